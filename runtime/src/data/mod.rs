//! Datasets: MNIST in IDX format and the MindSpore LeNet preprocessing.

pub mod mnist;

pub use mnist::{lenet_transform, read_idx, Idx, Mnist};

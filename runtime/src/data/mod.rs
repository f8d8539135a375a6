//! Datasets: MNIST in IDX format and the MindSpore LeNet preprocessing.

pub mod dataset;
pub mod mnist;

pub use dataset::{create_dataset, create_eval_dataset, Batch, ImageOp, MnistDataset};
pub use mnist::{lenet_transform, read_idx, Idx, Mnist};

//! Datasets: MNIST in IDX format with the MindSpore LeNet preprocessing, CIFAR-10's binary
//! version with torchvision's augmentation, and character-level text (Shakespeare).

pub mod cifar;
pub mod dataset;
pub mod mnist;
pub mod text;

pub use cifar::{Cifar10, Cifar10Dataset};
pub use dataset::{create_dataset, create_eval_dataset, Batch, ImageOp, MnistDataset, Sampling};
pub use mnist::{lenet_transform, read_idx, Idx, Mnist};
pub use text::{CharDataset, Corpus, Items, IGNORE_INDEX};

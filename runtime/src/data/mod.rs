//! Datasets: the [`Dataset`] trait `Model::train` draws batches from, MNIST in IDX format with
//! the MindSpore LeNet preprocessing, CIFAR-10's binary version with torchvision's
//! augmentation, character-level text (Shakespeare), and in-memory columns ([`TensorDataset`]).

pub mod cifar;
pub mod dataset;
pub mod mnist;
pub mod text;

pub use cifar::{Cifar10, Cifar10Dataset};
pub use dataset::{create_dataset, create_eval_dataset, lenet_transform, Batch, ImageOp, MnistDataset, Sampling};
pub use mnist::{read_idx, Idx, Mnist};
pub use text::{read_gzip_or_plain, CharDataset, Corpus, Items, TokenDataset, IGNORE_INDEX};

use cellgraph_compiler::HostTensor;

/// A source of batches, epoch by epoch. `Model::train` draws an epoch's batches on a thread of
/// their own, a few ahead of training (MindSpore's dataset pipeline and PyTorch's `DataLoader`
/// workers do the same), so a dataset is `Sync` and its batches come from a `Send` iterator.
pub trait Dataset: Sync {
    /// Batches per epoch.
    fn dataset_size(&self) -> usize;
    /// The batches of epoch `epoch` (0-based), from batch `skip` on; each batch is the
    /// network's inputs in order (`[data, label]`).
    fn batches(&self, epoch: usize, skip: usize) -> Box<dyn Iterator<Item = Vec<HostTensor>> + Send + '_>;
    /// Names of the inputs (for graph dumps).
    fn column_names(&self) -> Vec<&'static str> {
        vec!["data", "label"]
    }
    /// Items in each batch of an epoch, in order (by default: read off the batches).
    fn batch_sizes(&self) -> Vec<usize> {
        self.batches(0, 0).map(|b| b.first().and_then(|t| t.shape.first().copied()).unwrap_or(0)).collect()
    }
    /// The batch size asked for (the size of every batch but a short last one).
    fn batch_size(&self) -> usize {
        self.batch_sizes().first().copied().unwrap_or(0)
    }
    /// What the data is, for error messages (`MNIST train, shard 3 of 8: 1000 items`).
    fn describe(&self) -> String {
        "the dataset".into()
    }
}

/// In-memory columns batched in order (PyTorch's `TensorDataset` + `DataLoader`).
#[derive(Clone, Debug)]
pub struct TensorDataset {
    pub columns: Vec<HostTensor>,
    pub batch_size: usize,
}

impl Dataset for TensorDataset {
    fn dataset_size(&self) -> usize {
        self.columns.first().map_or(0, |c| c.shape[0].div_ceil(self.batch_size.max(1)))
    }
    fn batch_sizes(&self) -> Vec<usize> {
        let n = self.columns.first().map_or(0, |c| c.shape[0]);
        (0..self.dataset_size()).map(|k| ((k + 1) * self.batch_size).min(n) - k * self.batch_size).collect()
    }
    fn batch_size(&self) -> usize {
        self.batch_size
    }
    fn describe(&self) -> String {
        format!("a TensorDataset of {} items", self.columns.first().map_or(0, |c| c.shape[0]))
    }
    fn batches(&self, _epoch: usize, skip: usize) -> Box<dyn Iterator<Item = Vec<HostTensor>> + Send + '_> {
        let n = self.columns.first().map_or(0, |c| c.shape[0]);
        Box::new((skip..self.dataset_size()).map(move |k| {
            let (a, b) = (k * self.batch_size, ((k + 1) * self.batch_size).min(n));
            self.columns.iter().map(|c| crate::accumulate::slice_rows(c, a, b)).collect()
        }))
    }
}

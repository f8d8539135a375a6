//! A MindSpore-style dataset pipeline over MNIST: `map` image ops, seeded `shuffle`,
//! `batch(n, drop_remainder)`, `repeat`, and `shard(num_shards, shard_id)`.
//!
//! Order of operations, whatever order the builder calls come in: shard the item indices
//! (every shard gets `ceil(N / num_shards)` items, wrapping around to pad, so every rank takes
//! the same number of steps), shuffle within the epoch (seeded by the seed and the epoch, the
//! same on every rank), apply the image ops, batch, and repeat the epoch `repeat` times.
//! Labels are cast to int32 (MindSpore's `TypeCast(int32)`).

use std::path::Path;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use cellgraph_compiler::HostTensor;

use crate::data::mnist::{resize_linear_u8, Mnist, Resize};
use crate::error::{Result, RuntimeError};

/// The builder methods of a dataset whose field `sampling` is a [`Sampling`]: `shuffle`,
/// `batch` and `shard`, written once for every dataset.
macro_rules! sampling_builders {
    () => {
        /// Shuffles each epoch with a seeded permutation (the same on every rank).
        pub fn shuffle(mut self, seed: u64) -> Self {
            self.sampling.shuffle(seed);
            self
        }
        /// Groups items into batches of `n`; the last short batch is dropped when asked.
        pub fn batch(mut self, n: usize, drop_remainder: bool) -> crate::error::Result<Self> {
            self.sampling.batch(n, drop_remainder)?;
            Ok(self)
        }
        /// Keeps shard `shard_id` of `num_shards` (for data-parallel ranks).
        pub fn shard(mut self, num_shards: usize, shard_id: usize) -> crate::error::Result<Self> {
            self.sampling.shard(num_shards, shard_id)?;
            Ok(self)
        }
    };
}
pub(crate) use sampling_builders;

/// One image operation (MindSpore `dataset.vision` names).
#[derive(Clone, Debug, PartialEq)]
pub enum ImageOp {
    /// Bilinear resize to `(height, width)` on the uint8 image, exactly as MindSpore's
    /// `Resize(..., Inter.LINEAR)` (OpenCV's fixed-point path); only valid before the ops that
    /// make floats.
    Resize(usize, usize),
    /// `x * rescale + shift` as one fused multiply-add in f32 (OpenCV's `convertTo`, which
    /// MindSpore's `Rescale` calls). Give the constants as MindSpore computes them: in f64,
    /// then rounded to f32 (`ImageOp::rescale`).
    Rescale { rescale: f32, shift: f32 },
    /// `(x - mean) / std`.
    Normalize { mean: f32, std: f32 },
    /// Layout change to channels-first; MNIST has one channel, so only the shape changes.
    Hwc2Chw,
}

/// A batch: images `[n, 1, h, w]` (f32) and labels `[n]` (i32).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub data: HostTensor,
    pub label: HostTensor,
}

impl Batch {
    /// `[data, label]`, the order networks take them in.
    pub fn inputs(&self) -> [HostTensor; 2] {
        [self.data.clone(), self.label.clone()]
    }
}

/// MNIST with a pipeline.
#[derive(Clone, Debug)]
pub struct MnistDataset {
    source: Arc<Mnist>,
    /// Where the items came from, for error messages.
    name: String,
    ops: Vec<ImageOp>,
    sampling: Sampling,
}

/// How a dataset's items become an epoch's batches, shared by [`MnistDataset`] and
/// [`Cifar10Dataset`](crate::data::Cifar10Dataset): shard the item indices (every shard gets
/// `ceil(N / num_shards)` items, wrapping around), shuffle within the epoch (seeded by the seed
/// and the epoch, the same on every rank), batch, repeat.
#[derive(Clone, Debug)]
pub struct Sampling {
    shuffle: Option<u64>,
    batch_size: usize,
    drop_remainder: bool,
    repeat: usize,
    shard: (usize, usize),
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { shuffle: None, batch_size: 1, drop_remainder: false, repeat: 1, shard: (1, 0) }
    }
}

impl Sampling {
    /// Shuffles each epoch with a seeded permutation.
    pub fn shuffle(&mut self, seed: u64) {
        self.shuffle = Some(seed);
    }
    /// Batches of `n`; the last short batch is dropped when asked.
    pub fn batch(&mut self, n: usize, drop_remainder: bool) -> Result<()> {
        if n == 0 {
            return Err(RuntimeError::Mismatch { what: "batch size".into(), expected: "at least 1".into(), got: "0".into() });
        }
        (self.batch_size, self.drop_remainder) = (n, drop_remainder);
        Ok(())
    }
    /// Each epoch `n` times over.
    pub fn repeat(&mut self, n: usize) {
        self.repeat = n.max(1);
    }
    /// Shard `shard_id` of `num_shards`.
    pub fn shard(&mut self, num_shards: usize, shard_id: usize) -> Result<()> {
        if num_shards == 0 || shard_id >= num_shards {
            return Err(RuntimeError::Mismatch {
                what: "shard".into(),
                expected: format!("shard_id in 0..{num_shards}"),
                got: format!("shard_id {shard_id} of {num_shards} shards"),
            });
        }
        self.shard = (num_shards, shard_id);
        Ok(())
    }
    /// Items one shard sees per pass over `n` items.
    pub fn items_per_pass(&self, n: usize) -> usize {
        n.div_ceil(self.shard.0)
    }
    /// Items in each batch of an epoch over `n` items, in order.
    pub fn batch_lengths(&self, n: usize) -> Vec<usize> {
        let n = self.items_per_pass(n) * self.repeat;
        let mut v = vec![self.batch_size; n / self.batch_size];
        if !self.drop_remainder && !n.is_multiple_of(self.batch_size) {
            v.push(n % self.batch_size);
        }
        v
    }
    /// Batches per epoch over `n` items.
    pub fn dataset_size(&self, n: usize) -> usize {
        let n = self.items_per_pass(n) * self.repeat;
        if self.drop_remainder {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }
    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }
    /// The item indices of epoch `epoch` over `n` items, in order.
    pub fn order(&self, n: usize, epoch: usize) -> Vec<usize> {
        let (num, id) = self.shard;
        if n == 0 {
            return Vec::new();
        }
        let mut all: Vec<usize> = (0..n).collect();
        if let Some(seed) = self.shuffle {
            all.shuffle(&mut StdRng::seed_from_u64(seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        }
        let mine: Vec<usize> = (0..self.items_per_pass(n)).map(|k| all[(id + k * num) % n]).collect();
        (0..self.repeat).flat_map(|_| mine.iter().copied()).collect()
    }
    /// `source` (what it is, with `n` items) with this sampling, for messages.
    pub fn describe(&self, source: &str, n: usize) -> String {
        let (num, id) = self.shard;
        let shard = if num > 1 { format!(", shard {id} of {num}") } else { String::new() };
        let drop = if self.drop_remainder { ", drop_remainder" } else { "" };
        format!("{source}{shard}: {} items per epoch ({n} in the files), batch size {}{drop}", self.items_per_pass(n) * self.repeat, self.batch_size)
    }
    /// An error naming `what` unless an epoch over `n` items has at least one batch.
    pub fn check_batches(&self, n: usize, what: impl FnOnce() -> String) -> Result<()> {
        if self.dataset_size(n) == 0 {
            return Err(RuntimeError::Invalid {
                what: what(),
                detail: "gives no batch per epoch: it has fewer items than one batch; use a smaller batch size or more data".into(),
            });
        }
        Ok(())
    }
}

impl MnistDataset {
    /// Reads `{dir}/{split}-{images,labels}-idx*-ubyte[.gz]` (`split`: `train` or `t10k`).
    pub fn new(dir: &Path, split: &str) -> Result<Self> {
        let mut d = Self::from_mnist(Mnist::load(dir, split)?);
        d.name = format!("MNIST {split} ({})", dir.display());
        Ok(d)
    }
    /// A pipeline over already loaded data.
    pub fn from_mnist(m: Mnist) -> Self {
        MnistDataset { source: Arc::new(m), name: "MNIST".into(), ops: Vec::new(), sampling: Sampling::default() }
    }
    /// Appends image operations.
    pub fn map(mut self, ops: impl IntoIterator<Item = ImageOp>) -> Self {
        self.ops.extend(ops);
        self
    }
    sampling_builders!();
    /// Repeats the data `n` times per epoch.
    pub fn repeat(mut self, n: usize) -> Self {
        self.sampling.repeat(n);
        self
    }

    /// Items one shard sees per pass over the data.
    pub fn items_per_pass(&self) -> usize {
        self.sampling.items_per_pass(self.source.len())
    }

    /// Batches per epoch (MindSpore's `get_dataset_size`).
    pub fn get_dataset_size(&self) -> usize {
        self.sampling.dataset_size(self.source.len())
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.sampling.batch_size()
    }

    /// Items in each batch of an epoch: `batch_size` but for a short last one (kept unless
    /// `drop_remainder`).
    pub fn batch_lengths(&self) -> Vec<usize> {
        self.sampling.batch_lengths(self.source.len())
    }

    /// An error naming the dataset unless an epoch has at least one batch.
    pub fn check_batches(&self) -> Result<()> {
        self.sampling.check_batches(self.source.len(), || self.describe())
    }

    /// What this is, for error messages: source, shard, items per epoch and batching.
    pub fn describe(&self) -> String {
        self.sampling.describe(&self.name, self.source.len())
    }

    /// The output shape `[channels, height, width]` of one image after the ops.
    pub fn image_shape(&self) -> [usize; 3] {
        let mut hw = [self.source.rows, self.source.cols];
        for op in &self.ops {
            if let ImageOp::Resize(h, w) = op {
                hw = [*h, *w];
            }
        }
        [1, hw[0], hw[1]]
    }

    /// The batches of epoch `epoch` (0-based), starting at batch `skip`.
    pub fn epoch(&self, epoch: usize, skip: usize) -> impl Iterator<Item = Batch> + '_ {
        let order = self.sampling.order(self.source.len(), epoch);
        let b = self.sampling.batch_size();
        let batches = self.get_dataset_size();
        let shape = self.image_shape();
        let len = shape.iter().product::<usize>();
        let ops = Pipeline::new(&self.ops, self.source.rows, self.source.cols);
        let (mut rows, mut bytes) = (Vec::new(), Vec::new());
        (skip..batches).map(move |k| {
            let idx = &order[k * b..((k + 1) * b).min(order.len())];
            let n = idx.len();
            let mut data = vec![0.0f32; n * len];
            for (&i, out) in idx.iter().zip(data.chunks_exact_mut(len)) {
                ops.run(self.source.image(i), &mut rows, &mut bytes, out);
            }
            let label: Vec<i32> = idx.iter().map(|&i| self.source.labels[i] as i32).collect();
            Batch {
                data: HostTensor::f32(vec![n, shape[0], shape[1], shape[2]], data).expect("consistent sizes"),
                label: HostTensor::i32(vec![n], label).expect("consistent sizes"),
            }
        })
    }
}

/// Image ops made ready once for many images of one size: in MindSpore's order (at most a
/// resize on the bytes, then ops that map each byte value on its own), the resize's taps and
/// one table of the 256 values; in any other order, [`apply_ops`] per image.
enum Pipeline<'a> {
    Table { resize: Option<Resize>, table: Vec<f32> },
    General { ops: &'a [ImageOp], h: usize, w: usize },
}

impl<'a> Pipeline<'a> {
    fn new(ops: &'a [ImageOp], h: usize, w: usize) -> Self {
        let (first, rest) = match ops.first() {
            Some(ImageOp::Resize(oh, ow)) => (Some(Resize::new(h, w, *oh, *ow)), &ops[1..]),
            _ => (None, ops),
        };
        if rest.iter().any(|op| matches!(op, ImageOp::Resize(..))) {
            return Pipeline::General { ops, h, w };
        }
        Pipeline::Table { resize: first, table: float_ops(rest, (0..=255u8).map(f32::from).collect()) }
    }

    /// One image's pixels through the ops into `out` (`rows`, `bytes`: scratch).
    fn run(&self, pixels: &[u8], rows: &mut Vec<i32>, bytes: &mut Vec<u8>, out: &mut [f32]) {
        match self {
            Pipeline::Table { resize, table } => {
                let src = match resize {
                    Some(r) => {
                        bytes.resize(out.len(), 0);
                        r.run(pixels, rows, bytes);
                        &bytes[..]
                    }
                    None => pixels,
                };
                for (o, &p) in out.iter_mut().zip(src) {
                    *o = table[p as usize];
                }
            }
            Pipeline::General { ops, h, w } => out.copy_from_slice(&apply_ops(ops, pixels, *h, *w)),
        }
    }
}

/// MindSpore's LeNet `create_dataset(data_path, batch_size, repeat_size)`: `Resize(32, 32)`,
/// `Rescale(1/255)`, `Rescale(1/0.3081, -0.1307/0.3081)`, `HWC2CHW`, shuffle, batch with
/// `drop_remainder=True`, repeat.
pub fn create_dataset(dir: &Path, split: &str, batch_size: usize, repeat: usize, shuffle_seed: u64) -> Result<MnistDataset> {
    MnistDataset::new(dir, split)?.map(lenet_ops()).shuffle(shuffle_seed).batch(batch_size, true).map(|d| d.repeat(repeat))
}

/// The LeNet pipeline for scoring a split: the same image ops, in file order, keeping the last
/// partial batch so that every image counts (all 2,000 vendored test digits, where
/// `create_dataset`'s `drop_remainder` would score 1,984).
pub fn create_eval_dataset(dir: &Path, split: &str, batch_size: usize) -> Result<MnistDataset> {
    MnistDataset::new(dir, split)?.map(lenet_ops()).batch(batch_size, false)
}

/// MindSpore's LeNet image ops: `Resize((32, 32))`, `Rescale(1/255, 0)`,
/// `Rescale(1/0.3081, -0.1307/0.3081)`, `HWC2CHW()`.
pub fn lenet_ops() -> [ImageOp; 4] {
    [ImageOp::Resize(32, 32), ImageOp::rescale(1.0 / 255.0, 0.0), ImageOp::rescale(1.0 / 0.3081, -0.1307 / 0.3081), ImageOp::Hwc2Chw]
}

impl ImageOp {
    /// `Rescale(rescale, shift)` with Python's (f64) constants rounded once to f32, as
    /// MindSpore passes them to OpenCV (`1.0 / 0.3081` divided in f32 would differ).
    pub fn rescale(rescale: f64, shift: f64) -> Self {
        ImageOp::Rescale { rescale: rescale as f32, shift: shift as f32 }
    }
}

/// Runs image ops on one `[h, w]` uint8 image: resizes on the bytes, then the float ops,
/// which map each uint8 value on its own, through a table of the 256 values.
pub fn apply_ops(ops: &[ImageOp], pixels: &[u8], h: usize, w: usize) -> Vec<f32> {
    let (mut bytes, mut h, mut w) = (std::borrow::Cow::Borrowed(pixels), h, w);
    for (i, op) in ops.iter().enumerate() {
        match *op {
            ImageOp::Resize(oh, ow) => {
                bytes = std::borrow::Cow::Owned(resize_linear_u8(&bytes, h, w, oh, ow));
                (h, w) = (oh, ow);
            }
            ImageOp::Hwc2Chw => {}
            ImageOp::Rescale { .. } | ImageOp::Normalize { .. } => {
                let rest = &ops[i..];
                let Some(k) = rest.iter().position(|op| matches!(op, ImageOp::Resize(..))) else {
                    let table = float_ops(rest, (0..=255u8).map(f32::from).collect());
                    return bytes.iter().map(|&b| table[b as usize]).collect();
                };
                // A Resize after float ops (not MindSpore's order): back to uint8 first.
                let v = float_ops(&rest[..k], bytes.iter().map(|&b| f32::from(b)).collect());
                let back: Vec<u8> = v.iter().map(|p| p.round_ties_even().clamp(0.0, 255.0) as u8).collect();
                return apply_ops(&rest[k..], &back, h, w);
            }
        }
    }
    bytes.iter().map(|&p| f32::from(p)).collect()
}

/// The elementwise ops, in order, on `x`.
fn float_ops(ops: &[ImageOp], mut x: Vec<f32>) -> Vec<f32> {
    for op in ops {
        match *op {
            ImageOp::Rescale { rescale, shift } => x.iter_mut().for_each(|p| *p = p.mul_add(rescale, shift)),
            ImageOp::Normalize { mean, std } => x.iter_mut().for_each(|p| *p = (*p - mean) / std),
            ImageOp::Resize(..) | ImageOp::Hwc2Chw => {}
        }
    }
    x
}

/// MindSpore's LeNet pipeline for one image, bit for bit: `Resize(32, 32)` on the uint8
/// image, `Rescale(1/255, 0)`, `Rescale(1/0.3081, -0.1307/0.3081)` (each a fused
/// multiply-add in f32, as OpenCV's `convertTo`), HWC2CHW (one channel: `[1, 32, 32]`).
pub fn lenet_transform(pixels: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    apply_ops(&lenet_ops(), pixels, rows, cols)
}

impl super::Dataset for MnistDataset {
    fn dataset_size(&self) -> usize {
        self.get_dataset_size()
    }
    fn batches(&self, epoch: usize, skip: usize) -> Box<dyn Iterator<Item = Vec<HostTensor>> + Send + '_> {
        Box::new(self.epoch(epoch, skip).map(|b| b.inputs().to_vec()))
    }
    fn batch_sizes(&self) -> Vec<usize> {
        self.batch_lengths()
    }
    fn batch_size(&self) -> usize {
        MnistDataset::batch_size(self)
    }
    fn describe(&self) -> String {
        MnistDataset::describe(self)
    }
}

//! CIFAR-10, binary version (`cifar-10-batches-bin`), with torchvision's training
//! augmentation, seeded per image.
//!
//! Each file is 10,000 records of 3,073 bytes: a label byte (0..=9), then the 32 x 32 image as
//! three planes (R, G, B), row-major: already channels-first, so `HWC2CHW` is the identity on
//! these bytes. `train` reads `data_batch_1.bin` .. `data_batch_5.bin`, `test` reads
//! `test_batch.bin`.
//!
//! The pipeline is the seeds' (`RandomCrop(32, padding=4)`, `RandomHorizontalFlip()`,
//! `ToTensor()`, `Normalize(mean, std)`): an image's crop offset and flip are drawn from
//! (seed, epoch, the image's index in the files) only, so sharding over ranks, the shuffle
//! and slicing batches into micro-batches never change what an image sees.

use std::path::Path;
use std::sync::Arc;

use cellgraph_compiler::HostTensor;

use crate::data::dataset::Sampling;
use crate::data::mnist::{resize_linear_u8, Mnist};
use crate::error::{Result, RuntimeError};

/// Bytes per record: the label, then 3 x 32 x 32 pixels.
pub const RECORD: usize = 1 + PIXELS;
/// Pixels per image (3 planes of 32 x 32).
pub const PIXELS: usize = 3 * SIDE * SIDE;
const SIDE: usize = 32;

/// torchvision's CIFAR-10 normalisation (the seeds' `Normalize(mean, std)`).
pub const MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
pub const STD: [f32; 3] = [0.2023, 0.1994, 0.2010];

/// CIFAR-10 images (`[N, 3, 32, 32]` bytes) and labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cifar10 {
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
    /// Where the images came from, for messages.
    pub source: String,
}

fn data_err(path: &Path, offset: usize, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Data { path: path.display().to_string(), offset: offset as u64, detail: detail.into() }
}

impl Cifar10 {
    /// Reads split `train` (`data_batch_{1..5}.bin`) or `test` (`test_batch.bin`) from `dir`.
    pub fn load(dir: &Path, split: &str) -> Result<Self> {
        let files: Vec<String> = match split {
            "train" => (1..=5).map(|i| format!("data_batch_{i}.bin")).collect(),
            "test" => vec!["test_batch.bin".into()],
            other => {
                return Err(RuntimeError::Invalid { what: format!("CIFAR-10 split `{other}`"), detail: "expected `train` or `test`".into() });
            }
        };
        let mut all = Cifar10 { images: Vec::new(), labels: Vec::new(), source: format!("CIFAR-10 {split} ({})", dir.display()) };
        for f in files {
            let path = dir.join(&f);
            let bytes = std::fs::read(&path).map_err(|source| RuntimeError::Io {
                path: path.display().to_string(),
                source: std::io::Error::new(
                    source.kind(),
                    format!("{source} (pass --data-path the directory of the binary version, `cifar-10-batches-bin`)"),
                ),
            })?;
            let part = Self::parse(&path, &bytes)?;
            all.images.extend(part.images);
            all.labels.extend(part.labels);
        }
        Ok(all)
    }

    /// Parses one file's records; `path` names it in errors.
    pub fn parse(path: &Path, b: &[u8]) -> Result<Self> {
        if b.is_empty() {
            return Err(data_err(path, 0, "empty file: a CIFAR-10 batch file holds 3,073-byte records (a label byte, then 3,072 pixel bytes)"));
        }
        if !b.len().is_multiple_of(RECORD) {
            let whole = b.len() / RECORD;
            return Err(data_err(
                path,
                whole * RECORD,
                format!(
                    "truncated or not CIFAR-10's binary version: {} bytes is {whole} whole 3,073-byte records and {} bytes of record {whole}",
                    b.len(),
                    b.len() % RECORD
                ),
            ));
        }
        let n = b.len() / RECORD;
        let mut out = Cifar10 { images: Vec::with_capacity(n * PIXELS), labels: Vec::with_capacity(n), source: path.display().to_string() };
        for (i, r) in b.chunks_exact(RECORD).enumerate() {
            if r[0] > 9 {
                return Err(data_err(
                    path,
                    i * RECORD,
                    format!("record {i} has label {}: CIFAR-10 labels are 0..=9 (is this the CIFAR-100 binary version?)", r[0]),
                ));
            }
            out.labels.push(r[0]);
            out.images.extend_from_slice(&r[1..]);
        }
        Ok(out)
    }

    /// The MNIST digits as CIFAR-shaped images: resized to 32 x 32 (bilinear, as the LeNet
    /// pipeline does) and replicated to three planes. The stand-in when CIFAR-10 is absent.
    pub fn from_mnist(m: &Mnist) -> Self {
        let mut images = Vec::with_capacity(m.len() * PIXELS);
        for i in 0..m.len() {
            let plane = resize_linear_u8(m.image(i), m.rows, m.cols, SIDE, SIDE);
            for _ in 0..3 {
                images.extend_from_slice(&plane);
            }
        }
        Cifar10 { images, labels: m.labels.clone(), source: "MNIST digits replicated to 3 x 32 x 32".into() }
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True without images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Image `i`'s `3 x 32 x 32` bytes.
    pub fn image(&self, i: usize) -> &[u8] {
        &self.images[i * PIXELS..(i + 1) * PIXELS]
    }
}

/// The random part of one image's augmentation: a crop offset into the padded image
/// (`0..=2 * padding` each way) and a horizontal flip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Augment {
    pub dy: usize,
    pub dx: usize,
    pub flip: bool,
}

impl Augment {
    /// The draw for image `index` in epoch `epoch` of a run seeded `seed` (SplitMix64 of the
    /// three, so it is independent of where the image lands in a batch or on which rank).
    pub fn draw(seed: u64, epoch: usize, index: usize, padding: usize) -> Self {
        let mut z = seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (index as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        let span = 2 * padding as u64 + 1;
        Augment { dy: (next() % span) as usize, dx: (next() % span) as usize, flip: next() & 1 == 1 }
    }
}

/// `RandomCrop(32, padding)` (zero padding) and an optional flip of one `3 x 32 x 32` image,
/// then `ToTensor()` and `Normalize(MEAN, STD)` in torchvision's f32 order (`(p / 255 - mean) / std`),
/// into `out` (CHW).
pub fn augment_normalize(pixels: &[u8], a: Augment, padding: usize, out: &mut [f32]) {
    for c in 0..3 {
        let plane = &pixels[c * SIDE * SIDE..(c + 1) * SIDE * SIDE];
        for y in 0..SIDE {
            let sy = (y + a.dy).wrapping_sub(padding);
            for x in 0..SIDE {
                let ox = if a.flip { SIDE - 1 - x } else { x };
                let sx = (ox + a.dx).wrapping_sub(padding);
                let p = if sy < SIDE && sx < SIDE { plane[sy * SIDE + sx] } else { 0 };
                out[(c * SIDE + y) * SIDE + x] = (p as f32 / 255.0 - MEAN[c]) / STD[c];
            }
        }
    }
}

/// CIFAR-10 (or its MNIST stand-in) with a pipeline: optional augmentation, normalisation,
/// and [`MnistDataset`]'s seeded shuffle, `shard` and `batch` ([`Sampling`]).
///
/// [`MnistDataset`]: crate::data::MnistDataset
#[derive(Clone, Debug)]
pub struct Cifar10Dataset {
    source: Arc<Cifar10>,
    augment: Option<u64>,
    sampling: Sampling,
}

/// `RandomCrop(32, padding=4)`'s padding.
pub const PADDING: usize = 4;

impl Cifar10Dataset {
    /// Normalised images in file order, one per batch.
    pub fn new(source: Cifar10) -> Self {
        Cifar10Dataset { source: Arc::new(source), augment: None, sampling: Sampling::default() }
    }
    /// `RandomCrop(32, padding=4)` and `RandomHorizontalFlip()`, drawn from (seed, epoch,
    /// image index).
    pub fn augment(mut self, seed: u64) -> Self {
        self.augment = Some(seed);
        self
    }
    crate::data::dataset::sampling_builders!();
    /// Items one shard sees per epoch.
    pub fn items_per_pass(&self) -> usize {
        self.sampling.items_per_pass(self.source.len())
    }
    /// Batches per epoch.
    pub fn get_dataset_size(&self) -> usize {
        self.sampling.dataset_size(self.source.len())
    }
    /// An error naming the dataset unless an epoch has at least one batch.
    pub fn check_batches(&self) -> Result<()> {
        self.sampling.check_batches(self.source.len(), || self.describe())
    }
    /// What this is, for messages.
    pub fn describe(&self) -> String {
        self.sampling.describe(&self.source.source, self.source.len())
    }

    /// The file indices of this shard's items in epoch `epoch`, in order.
    pub fn order(&self, epoch: usize) -> Vec<usize> {
        self.sampling.order(self.source.len(), epoch)
    }

    /// One normalised (and, when asked, augmented) image in epoch `epoch`, by file index.
    pub fn item(&self, epoch: usize, index: usize, out: &mut [f32]) {
        let a = match self.augment {
            Some(seed) => Augment::draw(seed, epoch, index, PADDING),
            None => Augment { dy: PADDING, dx: PADDING, flip: false },
        };
        augment_normalize(self.source.image(index), a, PADDING, out);
    }

    /// The batches of epoch `epoch`, from batch `skip` on.
    pub fn epoch(&self, epoch: usize, skip: usize) -> impl Iterator<Item = Vec<HostTensor>> + Send + '_ {
        let order = self.order(epoch);
        let b = self.sampling.batch_size();
        (skip..self.get_dataset_size()).map(move |k| {
            let idx = &order[k * b..((k + 1) * b).min(order.len())];
            let mut data = vec![0.0f32; idx.len() * PIXELS];
            for (&i, out) in idx.iter().zip(data.chunks_exact_mut(PIXELS)) {
                self.item(epoch, i, out);
            }
            let label = idx.iter().map(|&i| self.source.labels[i] as i32).collect();
            vec![
                HostTensor::f32(vec![idx.len(), 3, SIDE, SIDE], data).expect("consistent sizes"),
                HostTensor::i32(vec![idx.len()], label).expect("consistent sizes"),
            ]
        })
    }
}

impl super::Dataset for Cifar10Dataset {
    fn dataset_size(&self) -> usize {
        self.get_dataset_size()
    }
    fn batches(&self, epoch: usize, skip: usize) -> Box<dyn Iterator<Item = Vec<HostTensor>> + Send + '_> {
        Box::new(self.epoch(epoch, skip))
    }
    fn batch_sizes(&self) -> Vec<usize> {
        self.sampling.batch_lengths(self.source.len())
    }
    fn batch_size(&self) -> usize {
        self.sampling.batch_size()
    }
    fn describe(&self) -> String {
        Cifar10Dataset::describe(self)
    }
}

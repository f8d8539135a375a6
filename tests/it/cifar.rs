//! The CIFAR-10 binary reader: record layout, malformed files (file and offset), the MNIST
//! stand-in, and augmentation that depends only on (seed, epoch, image index).

use std::collections::BTreeMap;
use std::path::Path;

use cellgraph::prelude::*;
use cellgraph::runtime::data::cifar::{augment_normalize, Augment, MEAN, PIXELS, RECORD, STD};
use cellgraph::runtime::data::{Cifar10, Cifar10Dataset};
use cellgraph::runtime::Dataset;

use crate::common::*;

/// `n` records: label `i % 10`, pixel bytes `(i * 7 + p) % 256`.
fn records(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| std::iter::once((i % 10) as u8).chain((0..PIXELS).map(move |p| ((i * 7 + p) % 256) as u8))).collect()
}

fn write_split(dir: &Path, per_file: usize) {
    for i in 1..=5 {
        std::fs::write(dir.join(format!("data_batch_{i}.bin")), records(per_file)).unwrap();
    }
    std::fs::write(dir.join("test_batch.bin"), records(per_file)).unwrap();
}

#[test]
fn cifar_records_are_a_label_then_three_planes() {
    let dir = TmpDir::created("cifar-layout");
    write_split(&dir, 3);
    let train = Cifar10::load(&dir, "train").unwrap();
    assert_eq!((train.len(), Cifar10::load(&dir, "test").unwrap().len()), (15, 3));
    assert_eq!(train.labels[..4], [0, 1, 2, 0]);
    assert_eq!(train.image(1)[..3], [7, 8, 9]);
    // Without augmentation an image is ToTensor + Normalize of its bytes, channel by channel.
    let ds = Cifar10Dataset::new(train).batch(4, false).unwrap();
    let batch: Vec<Vec<HostTensor>> = ds.batches(0, 0).collect();
    assert_eq!(batch.len(), 4);
    assert_eq!(batch[0][0].shape, [4, 3, 32, 32]);
    assert_eq!(batch[3][1].to_f64(), [0.0, 1.0, 2.0], "items 12..15: data_batch_5.bin's three records");
    let x = batch[0][0].to_f32();
    let green = PIXELS / 3 + 5;
    let want = (((green) % 256) as f32 / 255.0 - MEAN[1]) / STD[1];
    assert_eq!(x[green], want, "channel 1 (green) normalised with its own mean and std");
}

#[test]
fn malformed_cifar_files_name_the_file_and_offset() {
    let dir = TmpDir::created("cifar-bad");
    let err = |name: &str, bytes: Vec<u8>| {
        let p = dir.join(name);
        std::fs::write(&p, &bytes).unwrap();
        Cifar10::parse(&p, &bytes).unwrap_err().to_string()
    };
    let mut short = records(2);
    short.truncate(RECORD + 100);
    let e = err("short.bin", short);
    assert!(e.contains("short.bin") && e.contains("byte offset 3073") && e.contains("truncated"), "{e}");
    let mut bad = records(3);
    bad[2 * RECORD] = 57;
    let e = err("label.bin", bad);
    assert!(e.contains("label.bin") && e.contains("byte offset 6146") && e.contains("record 2 has label 57"), "{e}");
    let e = err("empty.bin", Vec::new());
    assert!(e.contains("empty.bin") && e.contains("empty file"), "{e}");
    // A missing split names the file and the flag.
    let e = Cifar10::load(&dir, "train").unwrap_err().to_string();
    assert!(e.contains("data_batch_1.bin") && e.contains("--data-path"), "{e}");
    assert!(Cifar10::load(&dir, "valid").unwrap_err().to_string().contains("`train` or `test`"));
}

#[test]
fn random_crop_pads_with_zeros_and_flip_mirrors() {
    let pixels: Vec<u8> = (0..PIXELS).map(|p| (p % 251) as u8).collect();
    let mut out = vec![0.0f32; PIXELS];
    let at = |out: &[f32], c: usize, y: usize, x: usize| out[(c * 32 + y) * 32 + x];
    let norm = |c: usize, b: u8| (b as f32 / 255.0 - MEAN[c]) / STD[c];
    // Offset (0, 0): the top four rows and left four columns are padding.
    augment_normalize(&pixels, Augment { dy: 0, dx: 0, flip: false }, 4, &mut out);
    assert_eq!(at(&out, 2, 3, 10), norm(2, 0));
    assert_eq!(at(&out, 0, 4, 4), norm(0, pixels[0]));
    assert_eq!(at(&out, 1, 10, 31), norm(1, pixels[1024 + 6 * 32 + 27]));
    // The centre crop is the image; flipped, its rows reversed.
    augment_normalize(&pixels, Augment { dy: 4, dx: 4, flip: true }, 4, &mut out);
    assert_eq!(at(&out, 0, 0, 0), norm(0, pixels[31]));
    assert_eq!(at(&out, 0, 5, 31), norm(0, pixels[5 * 32]));
    // Draws cover every offset and both flips, and depend on the epoch.
    let draws: Vec<Augment> = (0..2000).map(|i| Augment::draw(7, 0, i, 4)).collect();
    assert!((0..=8).all(|d| draws.iter().any(|a| a.dy == d) && draws.iter().any(|a| a.dx == d)));
    let flips = draws.iter().filter(|a| a.flip).count();
    assert!((900..1100).contains(&flips), "{flips} flips of 2000");
    assert_ne!(draws[..50], (0..50).map(|i| Augment::draw(7, 1, i, 4)).collect::<Vec<_>>()[..]);
}

/// What an image sees depends on (seed, epoch, image), not on the rank that reads it or the
/// batch it lands in: 4 shards of batches of 3 give each image the tensor one process gives it.
#[test]
fn augmentation_is_the_same_whatever_the_sharding_and_batching() {
    let dir = TmpDir::created("cifar-shards");
    std::fs::write(dir.join("test_batch.bin"), records(20)).unwrap();
    let source = Cifar10::load(&dir, "test").unwrap();
    // Identify an image by its label and first unaugmented byte pattern: every image is
    // distinct, so key the tensors by the image's index in the files.
    let by_index = |ds: &Cifar10Dataset, epoch: usize| -> BTreeMap<usize, Vec<u32>> {
        let order = ds.order(epoch);
        let rows: Vec<Vec<u32>> = ds
            .epoch(epoch, 0)
            .flat_map(|b| b[0].to_f32().chunks(PIXELS).map(|c| c.iter().map(|x| x.to_bits()).collect()).collect::<Vec<_>>())
            .collect();
        order.into_iter().zip(rows).collect()
    };
    let one = Cifar10Dataset::new(source.clone()).augment(3).shuffle(11).batch(8, false).unwrap();
    for epoch in 0..2 {
        let whole = by_index(&one, epoch);
        assert_eq!(whole.len(), 20);
        for rank in 0..4 {
            let shard = Cifar10Dataset::new(source.clone()).augment(3).shuffle(11).batch(3, false).unwrap().shard(4, rank).unwrap();
            for (i, x) in by_index(&shard, epoch) {
                assert!(whole[&i] == x, "image {i} differs on rank {rank} in epoch {epoch}");
            }
        }
    }
    assert_ne!(by_index(&one, 0)[&0], by_index(&one, 1)[&0], "epochs draw anew");
}

/// Without CIFAR-10 the programs train on the MNIST digits, resized to 32 x 32 and copied to
/// three planes.
#[test]
fn mnist_digits_stand_in_for_cifar() {
    let m = Mnist::load(&mnist_dir(), "t10k").unwrap();
    let c = Cifar10::from_mnist(&m);
    assert_eq!((c.len(), c.images.len()), (2000, 2000 * PIXELS));
    let img = c.image(0);
    assert_eq!(img[..1024], img[1024..2048]);
    assert_eq!(img[..1024], img[2048..]);
    assert_eq!(img[..1024], cellgraph::runtime::data::mnist::resize_linear_u8(m.image(0), 28, 28, 32, 32)[..]);
    assert!(c.source.contains("MNIST"));
}

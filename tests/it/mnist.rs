//! MNIST IDX reading: the vendored files, the LeNet transform, and malformed files.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::common::*;
use cellgraph::prelude::*;
use cellgraph::runtime::data::mnist::{parse_idx, read_idx, resize_linear_u8};
use cellgraph::runtime::data::{create_eval_dataset, ImageOp, MnistDataset};

#[test]
fn vendored_files_load_with_expected_sizes() {
    let train = Mnist::load(&mnist_dir(), "train").unwrap();
    let test = Mnist::load(&mnist_dir(), "t10k").unwrap();
    assert_eq!((train.len(), test.len(), train.rows, train.cols), (8000, 2000, 28, 28));
    let mut counts = [0; 10];
    train.labels.iter().for_each(|&l| counts[l as usize] += 1);
    assert!(counts.iter().all(|&c| c > 600), "{counts:?}");
}

#[test]
fn lenet_transform_resizes_and_normalises() {
    let m = Mnist::load(&mnist_dir(), "train").unwrap();
    let x = lenet_transform(m.image(0), 28, 28);
    assert_eq!(x.len(), 32 * 32);
    let lo = -0.1307 / 0.3081;
    let hi = (1.0 - 0.1307) / 0.3081;
    assert!(x.iter().all(|&v| v >= lo - 1e-5 && v <= hi + 1e-5));
    assert!((x[0] - lo).abs() < 1e-6, "corner pixel is background");
    // Bilinear resize keeps constants and interpolates ramps (half-pixel centres).
    assert_eq!(resize_linear_u8(&[3; 4], 2, 2, 3, 3), vec![3; 9]);
    assert_eq!(resize_linear_u8(&[0, 4, 0, 4], 2, 2, 2, 4), vec![0, 1, 3, 4, 0, 1, 3, 4]);
}

/// FNV-1a, 64 bits.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

#[test]
fn the_lenet_pipeline_gives_mindspores_exact_pixels() {
    // Checksums of MindSpore 2.10's own output (`Resize((32, 32), Inter.LINEAR)`,
    // `Rescale(1/255, 0)`, `Rescale(1/0.3081, -0.1307/0.3081)`, `HWC2CHW()`, file order) on all
    // 10,000 vendored images: FNV-1a 64 of the uint8 bytes after Resize, and of the final f32
    // little-endian bytes.
    let f32_bits = |x: f64| (x as f32).to_bits();
    assert_eq!([f32_bits(1.0 / 255.0), f32_bits(1.0 / 0.3081), f32_bits(-0.1307 / 0.3081)], [0x3b80_8081, 0x404f_b98a, 0xbed9_3270]);
    for (split, resized, fin) in
        [("train", 0xba69_e34e_d10a_db32u64, 0x489f_a62b_b6ce_2f50u64), ("t10k", 0x0087_36bf_af88_1ed4, 0xb076_69e0_12fb_f533)]
    {
        let m = Mnist::load(&mnist_dir(), split).unwrap();
        let bytes = (0..m.len()).flat_map(|i| resize_linear_u8(m.image(i), 28, 28, 32, 32));
        assert_eq!(fnv1a(bytes), resized, "{split}: Resize differs from MindSpore's");
        let ds = create_eval_dataset(&mnist_dir(), split, 500).unwrap();
        let floats = ds.epoch(0, 0).flat_map(|b| b.data.to_f32()).flat_map(f32::to_le_bytes);
        assert_eq!(fnv1a(floats), fin, "{split}: the pipeline's floats differ from MindSpore's");
    }
    // Train image 0, value by value (f32 bits from MindSpore).
    let m = Mnist::load(&mnist_dir(), "train").unwrap();
    let x = lenet_transform(m.image(0), 28, 28);
    for (i, bits) in [(0, 0xbed9_3270u32), (141, 0xbec5_a57e), (300, 0x4031_5115), (507, 0x3fa0_c1c9), (882, 0xbeb8_9cdd), (1023, 0xbed9_3270)] {
        assert_eq!(x[i].to_bits(), bits, "pixel {i}: {}", x[i]);
    }
    // The same ops through a dataset built by hand.
    let by_hand = MnistDataset::new(&mnist_dir(), "train").unwrap().map([
        ImageOp::Resize(32, 32),
        ImageOp::rescale(1.0 / 255.0, 0.0),
        ImageOp::rescale(1.0 / 0.3081, -0.1307 / 0.3081),
        ImageOp::Hwc2Chw,
    ]);
    assert_eq!(by_hand.batch(1, false).unwrap().epoch(0, 0).next().unwrap().data.to_f32(), x);
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
    p
}

fn idx(magic3: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 8, magic3];
    for d in dims {
        v.extend(d.to_be_bytes());
    }
    v.extend(data);
    v
}

#[test]
fn malformed_files_name_the_file_and_offset() {
    let dir = TmpDir::created("mnist");
    let p = Path::new("x.idx");
    let e = parse_idx(p, &[0, 0, 9, 1, 0, 0, 0, 1, 5]).unwrap_err().to_string();
    assert_eq!(e, "x.idx: at byte offset 0: bad IDX magic 00 00 09 01: expected 00 00 08 NDIM (unsigned bytes)");
    let e = parse_idx(p, &idx(1, &[5], &[1, 2])).unwrap_err().to_string();
    assert_eq!(e, "x.idx: at byte offset 10: truncated: header says [5] = 5 bytes of data, file holds 2");
    let e = parse_idx(p, &idx(1, &[1], &[1, 2])).unwrap_err().to_string();
    assert!(e.contains("has trailing bytes"), "{e}");
    let e = parse_idx(p, &[0, 0, 8]).unwrap_err().to_string();
    assert!(e.contains("offset 3") && e.contains("magic"), "{e}");
    let e = parse_idx(p, &[0, 0, 8, 3, 0, 0]).unwrap_err().to_string();
    assert!(e.contains("inside the header"), "{e}");

    // Zero-sized and overflowing headers are errors at the dimension's offset, not panics.
    let e = parse_idx(p, &idx(3, &[4, 0, 28], &[])).unwrap_err().to_string();
    assert!(e.starts_with("x.idx: at byte offset 8: IDX dimension 1 is 0"), "{e}");
    let e = parse_idx(p, &idx(1, &[0], &[])).unwrap_err().to_string();
    assert!(e.contains("offset 4") && e.contains("holds no items"), "{e}");
    let e = parse_idx(p, &idx(4, &[u32::MAX; 4], &[1])).unwrap_err().to_string();
    assert!(e.contains("multiply past the addressable size"), "{e}");
    write(&dir, "train-images-idx3-ubyte", &idx(3, &[1, 0, 0], &[]));
    write(&dir, "train-labels-idx1-ubyte", &idx(1, &[1], &[1]));
    let e = Mnist::load(&dir, "train").unwrap_err().to_string();
    assert!(e.contains("train-images-idx3-ubyte: at byte offset 8: IDX dimension 1 is 0"), "{e}");

    // Count mismatch and bad labels through the loader.
    write(&dir, "train-images-idx3-ubyte", &idx(3, &[2, 2, 2], &[0; 8]));
    write(&dir, "train-labels-idx1-ubyte", &idx(1, &[3], &[1, 2, 3]));
    let e = Mnist::load(&dir, "train").unwrap_err().to_string();
    assert!(e.contains("train-labels-idx1-ubyte: at byte offset 4: 3 labels for 2 images"), "{e}");
    write(&dir, "train-labels-idx1-ubyte", &idx(1, &[2], &[1, 12]));
    let e = Mnist::load(&dir, "train").unwrap_err().to_string();
    assert!(e.contains("at byte offset 9: label 12 of item 1 is not a digit 0..9"), "{e}");
    let e = Mnist::load(&dir, "t10k").unwrap_err().to_string();
    assert!(e.contains("t10k-images-idx3-ubyte (or .gz) is not in that directory") && e.contains("--data-path"), "{e}");
    let e = Mnist::load(&dir.join("nowhere"), "train").unwrap_err().to_string();
    assert!(e.contains("the directory does not exist") && e.contains("--data-path DIR"), "{e}");
    // Corrupt gzip.
    let gz = write(&dir, "bad.gz", &[0x1f, 0x8b, 8, 0, 1, 2, 3]);
    assert!(read_idx(&gz).unwrap_err().to_string().contains("corrupt gzip stream"));
    std::fs::remove_dir_all(&dir).unwrap();
}

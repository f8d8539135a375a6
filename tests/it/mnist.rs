//! MNIST IDX reading: the vendored files, the LeNet transform, and malformed files.

use std::io::Write;
use std::path::{Path, PathBuf};

use cellgraph::prelude::*;
use cellgraph::runtime::data::mnist::{parse_idx, read_idx, resize_bilinear};
use crate::common::*;

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
    // Bilinear resize keeps constants and interpolates ramps.
    assert_eq!(resize_bilinear(&[3.0; 4], 2, 2, 3, 3), vec![3.0; 9]);
    let up = resize_bilinear(&[0.0, 4.0], 1, 2, 1, 4);
    assert_eq!(up, vec![0.0, 1.0, 3.0, 4.0]);
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
    let dir = std::env::temp_dir().join(format!("cellgraph-mnist-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
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

    // Count mismatch and bad labels through the loader.
    write(&dir, "train-images-idx3-ubyte", &idx(3, &[2, 2, 2], &[0; 8]));
    write(&dir, "train-labels-idx1-ubyte", &idx(1, &[3], &[1, 2, 3]));
    let e = Mnist::load(&dir, "train").unwrap_err().to_string();
    assert!(e.contains("train-labels-idx1-ubyte: at byte offset 4: 3 labels for 2 images"), "{e}");
    write(&dir, "train-labels-idx1-ubyte", &idx(1, &[2], &[1, 12]));
    let e = Mnist::load(&dir, "train").unwrap_err().to_string();
    assert!(e.contains("at byte offset 9: label 12 of item 1 is not a digit 0..9"), "{e}");
    let e = Mnist::load(&dir, "t10k").unwrap_err().to_string();
    assert!(e.contains("t10k-images-idx3-ubyte") && e.contains("No such file"), "{e}");
    // Corrupt gzip.
    let gz = write(&dir, "bad.gz", &[0x1f, 0x8b, 8, 0, 1, 2, 3]);
    assert!(read_idx(&gz).unwrap_err().to_string().contains("corrupt gzip stream"));
    std::fs::remove_dir_all(&dir).unwrap();
}

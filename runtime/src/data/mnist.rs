//! MNIST from IDX files (raw or gzip), with errors that name the file and byte offset.
//!
//! IDX layout: a 4-byte magic `00 00 08 NDIM` (unsigned bytes), `NDIM` big-endian u32
//! extents, then the elements. Images are `[N, 28, 28]` (`NDIM = 3`), labels `[N]` (`NDIM = 1`).

use std::io::Read;
use std::path::Path;

use crate::error::{Result, RuntimeError};

/// A decoded IDX file of unsigned bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Idx {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

fn data_err(path: &Path, offset: u64, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Data { path: path.display().to_string(), offset, detail: detail.into() }
}

/// Reads an IDX file of unsigned bytes; gzip is detected by its magic bytes, not the name.
pub fn read_idx(path: &Path) -> Result<Idx> {
    let raw = std::fs::read(path).map_err(|source| RuntimeError::Io { path: path.display().to_string(), source })?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| data_err(path, 0, format!("corrupt gzip stream ({e}); re-download the file")))?;
        out
    } else {
        raw
    };
    parse_idx(path, &bytes)
}

/// Parses IDX bytes; `path` names the file in errors.
pub fn parse_idx(path: &Path, b: &[u8]) -> Result<Idx> {
    if b.len() < 4 {
        return Err(data_err(path, b.len() as u64, "file ends inside the 4-byte IDX magic number"));
    }
    if b[0] != 0 || b[1] != 0 || b[2] != 0x08 {
        return Err(data_err(
            path,
            0,
            format!("bad IDX magic {:02x} {:02x} {:02x} {:02x}: expected 00 00 08 NDIM (unsigned bytes)", b[0], b[1], b[2], b[3]),
        ));
    }
    let ndim = b[3] as usize;
    if ndim == 0 || ndim > 4 {
        return Err(data_err(path, 3, format!("IDX rank {ndim} is not 1..4")));
    }
    let header = 4 + 4 * ndim;
    if b.len() < header {
        return Err(data_err(path, b.len() as u64, format!("file ends inside the header ({header} bytes expected)")));
    }
    let dims: Vec<usize> =
        (0..ndim).map(|i| u32::from_be_bytes(b[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize).collect();
    let n: usize = dims.iter().product();
    let have = b.len() - header;
    if have != n {
        let what = if have < n { "truncated" } else { "has trailing bytes" };
        return Err(data_err(
            path,
            (header + have.min(n)) as u64,
            format!("{what}: header says {dims:?} = {n} bytes of data, file holds {have}"),
        ));
    }
    Ok(Idx { dims, data: b[header..].to_vec() })
}

/// MNIST images and labels, checked for consistency.
#[derive(Clone, Debug)]
pub struct Mnist {
    /// `[N, 28, 28]` pixels, row-major.
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
    pub rows: usize,
    pub cols: usize,
}

impl Mnist {
    /// Loads `{dir}/{split}-images-idx3-ubyte[.gz]` and `{dir}/{split}-labels-idx1-ubyte[.gz]`,
    /// where `split` is `train` or `t10k`.
    pub fn load(dir: &Path, split: &str) -> Result<Mnist> {
        let find = |stem: String| {
            let gz = dir.join(format!("{stem}.gz"));
            if gz.exists() {
                gz
            } else {
                dir.join(stem)
            }
        };
        let ip = find(format!("{split}-images-idx3-ubyte"));
        let lp = find(format!("{split}-labels-idx1-ubyte"));
        let images = read_idx(&ip)?;
        let labels = read_idx(&lp)?;
        if images.dims.len() != 3 {
            return Err(data_err(&ip, 3, format!("images must have rank 3 [N, rows, cols], header says {:?}", images.dims)));
        }
        if labels.dims.len() != 1 {
            return Err(data_err(&lp, 3, format!("labels must have rank 1 [N], header says {:?}", labels.dims)));
        }
        if images.dims[0] != labels.dims[0] {
            return Err(data_err(
                &lp,
                4,
                format!("{} labels for {} images in {}", labels.dims[0], images.dims[0], ip.display()),
            ));
        }
        if let Some(i) = labels.data.iter().position(|&l| l > 9) {
            return Err(data_err(&lp, 8 + i as u64, format!("label {} of item {i} is not a digit 0..9", labels.data[i])));
        }
        Ok(Mnist { rows: images.dims[1], cols: images.dims[2], images: images.data, labels: labels.data })
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True without items.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The pixels of item `i`.
    pub fn image(&self, i: usize) -> &[u8] {
        let n = self.rows * self.cols;
        &self.images[i * n..(i + 1) * n]
    }
}

/// Bilinear resize of one channel (OpenCV `INTER_LINEAR`, half-pixel centres, as MindSpore's
/// `Resize`), from `[h, w]` to `[oh, ow]`.
pub fn resize_bilinear(src: &[f32], h: usize, w: usize, oh: usize, ow: usize) -> Vec<f32> {
    let (sy, sx) = (h as f32 / oh as f32, w as f32 / ow as f32);
    let coord = |o: usize, s: f32, n: usize| {
        let f = ((o as f32 + 0.5) * s - 0.5).max(0.0);
        let i0 = (f.floor() as usize).min(n - 1);
        let i1 = (i0 + 1).min(n - 1);
        (i0, i1, f - i0 as f32)
    };
    let mut out = Vec::with_capacity(oh * ow);
    for y in 0..oh {
        let (y0, y1, fy) = coord(y, sy, h);
        for x in 0..ow {
            let (x0, x1, fx) = coord(x, sx, w);
            let top = src[y0 * w + x0] * (1.0 - fx) + src[y0 * w + x1] * fx;
            let bot = src[y1 * w + x0] * (1.0 - fx) + src[y1 * w + x1] * fx;
            out.push(top * (1.0 - fy) + bot * fy);
        }
    }
    out
}

/// MindSpore's LeNet pipeline for one image: `Resize(32, 32)` bilinear on the uint8 image
/// (so the result is rounded back to uint8, as there), `Rescale(1/255)`,
/// `Rescale(1/0.3081, -0.1307/0.3081)`, HWC2CHW (one channel: `[1, 32, 32]`).
pub fn lenet_transform(pixels: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let src: Vec<f32> = pixels.iter().map(|&p| p as f32).collect();
    let resized = resize_bilinear(&src, rows, cols, 32, 32);
    let (scale, shift) = (1.0 / 0.3081, -0.1307 / 0.3081);
    resized.into_iter().map(|v| (v.round().clamp(0.0, 255.0) / 255.0) * scale + shift).collect()
}

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
    let dims: Vec<usize> = (0..ndim).map(|i| u32::from_be_bytes(b[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize).collect();
    if let Some(i) = dims.iter().position(|&d| d == 0) {
        return Err(data_err(
            path,
            4 + 4 * i as u64,
            format!("IDX dimension {i} is 0 (header says {dims:?}): {}", if i == 0 { "the file holds no items" } else { "its items are empty" }),
        ));
    }
    let n = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| data_err(path, 4, format!("IDX dimensions {dims:?} multiply past the addressable size: the header is corrupt")))?;
    let have = b.len() - header;
    if have != n {
        let what = if have < n { "truncated" } else { "has trailing bytes" };
        return Err(data_err(path, (header + have.min(n)) as u64, format!("{what}: header says {dims:?} = {n} bytes of data, file holds {have}")));
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
        for p in [&ip, &lp] {
            if !p.exists() {
                let hint = if dir.is_dir() {
                    "is not in that directory"
                } else if dir.exists() {
                    "cannot be read: that is a file, not a directory"
                } else {
                    "cannot be read: the directory does not exist"
                };
                return Err(RuntimeError::Invalid {
                    what: format!("MNIST {split} files in {}", dir.display()),
                    detail: format!(
                        "{} (or .gz) {hint}; pass the directory that holds the IDX files (--data-path DIR; the repository vendors them in data/mnist)",
                        p.file_name().unwrap_or_default().to_string_lossy().trim_end_matches(".gz")
                    ),
                });
            }
        }
        let images = read_idx(&ip)?;
        let labels = read_idx(&lp)?;
        if images.dims.len() != 3 {
            return Err(data_err(&ip, 3, format!("images must have rank 3 [N, rows, cols], header says {:?}", images.dims)));
        }
        if labels.dims.len() != 1 {
            return Err(data_err(&lp, 3, format!("labels must have rank 1 [N], header says {:?}", labels.dims)));
        }
        if images.dims[0] != labels.dims[0] {
            return Err(data_err(&lp, 4, format!("{} labels for {} images in {}", labels.dims[0], images.dims[0], ip.display())));
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

/// One axis of OpenCV's `INTER_LINEAR` on 8-bit images: for each output index, the two source
/// indices and their 11-bit fixed-point weights (`1 << 11` in all). `clamp_weights` is the
/// column rule (an edge source index takes weight 0 beyond the edge); rows keep the weights
/// of the unclamped coordinate and clip the indices.
fn linear_taps(n: usize, m: usize, clamp_weights: bool) -> Vec<(usize, usize, i32, i32)> {
    let scale = n as f64 / m as f64;
    let last = n as i64 - 1;
    (0..m)
        .map(|d| {
            let f = ((d as f64 + 0.5) * scale - 0.5) as f32;
            let mut s = f.floor() as i64;
            let mut f = f - s as f32;
            if clamp_weights {
                if s < 0 {
                    (s, f) = (0, 0.0);
                }
                if s >= last {
                    (s, f) = (last, 0.0);
                }
            }
            let w0 = ((1.0 - f) * 2048.0).round_ties_even() as i32;
            let w1 = (f * 2048.0).round_ties_even() as i32;
            (s.clamp(0, last) as usize, (s + 1).clamp(0, last) as usize, w0, w1)
        })
        .collect()
}

/// MindSpore's `Resize((oh, ow), Inter.LINEAR)` on a one-channel uint8 image, bit for bit:
/// OpenCV's `cv::resize(INTER_LINEAR)` 8-bit fixed-point path. Half-pixel source
/// coordinates `(d + 0.5) * n / m - 0.5` in f32; 11-bit weights rounded half to even; the
/// horizontal pass in i32 (`S[x0] * w0 + S[x1] * w1`); the vertical pass as OpenCV's SIMD
/// kernel computes it, `(((R0 >> 4) * b0 >> 16) + ((R1 >> 4) * b1 >> 16) + 2) >> 2`. (The
/// textbook `(b0 * R0 + b1 * R1 + 2^21) >> 22` differs by one level in 2% of MNIST's pixels.)
pub fn resize_linear_u8(src: &[u8], h: usize, w: usize, oh: usize, ow: usize) -> Vec<u8> {
    let mut out = vec![0; oh * ow];
    Resize::new(h, w, oh, ow).run(src, &mut Vec::new(), &mut out);
    out
}

/// [`resize_linear_u8`] from `h x w` to `oh x ow`, its taps worked out once for many images.
#[derive(Clone, Debug)]
pub struct Resize {
    w: usize,
    ow: usize,
    cols: Vec<(usize, usize, i32, i32)>,
    rows: Vec<(usize, usize, i32, i32)>,
}

impl Resize {
    pub fn new(h: usize, w: usize, oh: usize, ow: usize) -> Self {
        Resize { w, ow, cols: linear_taps(w, ow, true), rows: linear_taps(h, oh, false) }
    }

    /// Resizes `src` into `out` (`oh * ow`); `rows` is scratch (each source row's horizontal
    /// pass, made once).
    pub fn run(&self, src: &[u8], rows: &mut Vec<i32>, out: &mut [u8]) {
        let (w, ow) = (self.w, self.ow);
        rows.clear();
        for r in src.chunks_exact(w) {
            rows.extend(self.cols.iter().map(|&(x0, x1, w0, w1)| r[x0] as i32 * w0 + r[x1] as i32 * w1));
        }
        for (&(y0, y1, b0, b1), out) in self.rows.iter().zip(out.chunks_exact_mut(ow)) {
            let (r0, r1) = (&rows[y0 * ow..][..ow], &rows[y1 * ow..][..ow]);
            for ((o, &a), &b) in out.iter_mut().zip(r0).zip(r1) {
                *o = (((((a >> 4) * b0) >> 16) + (((b >> 4) * b1) >> 16) + 2) >> 2).clamp(0, 255) as u8;
            }
        }
    }
}

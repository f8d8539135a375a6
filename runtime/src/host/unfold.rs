//! A convolution's input unfolded into column matrices and folded back, for the im2col
//! kernels of [`super::conv`]: one image's planes into the rows of a column matrix (dense,
//! strided, dilated or through a zero-padded plane), a chunk's images into one batch-wide
//! matrix, the column matrix's gradient added back into the input (col2im), and a group's
//! output channels gathered into and scattered from a batch-wide matrix.

use super::float::{copy_row, vectorized, HostFloat};
use crate::kernel::Geometry;

/// Unfolds `channels` input planes (`x`, each `h*w`) into rows of `col`: row
/// `c*kh*kw + ky*kw + kx` holds the `oh*ow` inputs that kernel offset `(ky, kx)` of channel `c`
/// reads, at `col[row * ld..][..oh*ow]` (`ld` >= `oh*ow`: one image's block of a batch-wide
/// column matrix).
pub(super) fn im2col<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F], ld: usize) {
    if g.is_dense() {
        return im2col_dense(g, x, channels, col, ld);
    }
    let (h, w) = (g.x[2], g.x[3]);
    let (ow, sp) = (g.out[1], g.spatial());
    let spans = ColSpans::new(g);
    let mut row = 0;
    for c in 0..channels {
        let plane = &x[c * h * w..(c + 1) * h * w];
        for ky in 0..g.kernel[0] {
            for kx in 0..g.kernel[1] {
                let dst = &mut col[row * ld..row * ld + sp];
                let (lo, hi) = spans.get(g, kx);
                let base = kx * g.dilation[1];
                for oy in 0..g.out[0] {
                    let d = &mut dst[oy * ow..(oy + 1) * ow];
                    let Some(iy) = g.at(0, oy, ky) else {
                        d.fill(F::ZERO);
                        continue;
                    };
                    d[..lo].fill(F::ZERO);
                    d[hi..].fill(F::ZERO);
                    let src = &plane[iy * w..(iy + 1) * w];
                    if g.stride[1] == 1 {
                        d[lo..hi].copy_from_slice(&src[lo + base - g.pad[1]..hi + base - g.pad[1]]);
                    } else {
                        for ox in lo..hi {
                            d[ox] = src[ox * g.stride[1] + base - g.pad[1]];
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// [`Geometry::valid_cols`] of the first 16 kernel columns, worked out once per call rather
/// than once per channel and kernel row (ResNet's small maps have rows of 1 to 8 elements, where
/// the divisions cost as much as the copies).
struct ColSpans([(usize, usize); 16]);

impl ColSpans {
    fn new(g: &Geometry) -> Self {
        let mut v = [(0, 0); 16];
        for (kx, s) in v.iter_mut().enumerate().take(g.kernel[1]) {
            *s = g.valid_cols(kx);
        }
        ColSpans(v)
    }
    #[inline(always)]
    fn get(&self, g: &Geometry, kx: usize) -> (usize, usize) {
        match self.0.get(kx) {
            Some(&s) => s,
            None => g.valid_cols(kx),
        }
    }
}

/// The adjoint of [`im2col`]: adds the rows of `col` (row stride `ld`) back into `channels`
/// planes of `x`; `padded` is scratch of at least [`padded_extents`].
pub(super) fn col2im<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F], padded: &mut [F]) {
    vectorized(Col2Im { g, col, ld, channels, x, padded })
}

/// [`col2im`] as a [`vectorized`] op (too large for a closure: see there).
struct Col2Im<'a, F> {
    g: &'a Geometry,
    col: &'a [F],
    ld: usize,
    channels: usize,
    x: &'a mut [F],
    padded: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for Col2Im<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Col2Im { g, col, ld, channels, x, padded } = self;
        if g.is_dense() {
            col2im_dense(g, col, ld, channels, x)
        } else if g.stride[1] == 1 {
            col2im_padded(g, col, ld, channels, x, padded)
        } else {
            col2im_strided(g, col, ld, channels, x)
        }
    }
}

/// [`col2im`] for any geometry (ResNet's stride-2 convolutions), clipping each row of `col`
/// to the inputs it reaches.
#[inline(always)]
pub(super) fn col2im_strided<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F]) {
    let (h, w) = (g.x[2], g.x[3]);
    let (ow, sp) = (g.out[1], g.spatial());
    let spans = ColSpans::new(g);
    let mut row = 0;
    for c in 0..channels {
        let plane = &mut x[c * h * w..(c + 1) * h * w];
        for ky in 0..g.kernel[0] {
            for kx in 0..g.kernel[1] {
                let src = &col[row * ld..row * ld + sp];
                let (lo, hi) = spans.get(g, kx);
                let base = kx * g.dilation[1];
                for oy in 0..g.out[0] {
                    let Some(iy) = g.at(0, oy, ky) else { continue };
                    let d = &mut plane[iy * w..(iy + 1) * w];
                    let s = &src[oy * ow..(oy + 1) * ow];
                    if g.stride[1] == 1 {
                        let d = &mut d[lo + base - g.pad[1]..hi + base - g.pad[1]];
                        for (d, &v) in d.iter_mut().zip(&s[lo..hi]) {
                            *d += v;
                        }
                    } else {
                        for ox in lo..hi {
                            d[ox * g.stride[1] + base - g.pad[1]] += s[ox];
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// [`im2col`] for stride 1, dilation 1 and no padding (LeNet's and most 'valid'
/// convolutions): every row of `col` is `oh` input row segments, copied inline.
pub(super) fn im2col_dense<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F], ld: usize) {
    let [_, _, h, w] = g.x;
    let [oh, ow] = g.out;
    let [kh, kw] = g.kernel;
    for c in 0..channels {
        for ky in 0..kh {
            for kx in 0..kw {
                let dst = &mut col[((c * kh + ky) * kw + kx) * ld..][..oh * ow];
                let src = &x[c * h * w + ky * w + kx..];
                for (oy, d) in dst.chunks_exact_mut(ow).enumerate() {
                    copy_row(d, &src[oy * w..oy * w + ow]);
                }
            }
        }
    }
}

/// [`col2im`] for the geometries [`im2col_dense`] takes.
#[inline(always)]
pub(super) fn col2im_dense<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F]) {
    let [_, _, h, w] = g.x;
    let [oh, ow] = g.out;
    let [kh, kw] = g.kernel;
    for c in 0..channels {
        for ky in 0..kh {
            for kx in 0..kw {
                let src = &col[((c * kh + ky) * kw + kx) * ld..][..oh * ow];
                let dst = &mut x[c * h * w + ky * w + kx..];
                for (oy, s) in src.chunks_exact(ow).enumerate() {
                    add_row(&mut dst[oy * w..oy * w + ow], s);
                }
            }
        }
    }
}

/// [`col2im`] at stride 1 along rows, padded or dilated (ResNet's 3x3 convolutions padded by
/// 1): each channel's plane is copied into the interior of `padded` (a plane of
/// [`padded_extents`]), every row of `col` is added into it without bounds, and the interior
/// is copied back. Each input gets the same additions in the same order as in
/// [`col2im_strided`]; what lands in the border is padding's, and is dropped (on ResNet-18's
/// 8x8 and 4x4 maps, clipping rows of 8 and 4 cost more than adding them).
#[inline(always)]
pub(super) fn col2im_padded<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F], padded: &mut [F]) {
    let [_, _, h, w] = g.x;
    let ([oh, ow], [kh, kw]) = (g.out, g.kernel);
    let (sy, [dy, dx]) = (g.stride[0], g.dilation);
    let [ph, pw] = padded_extents(g);
    let padded = &mut padded[..ph * pw];
    let [rows, cols] = interior(g, ph, pw);
    let inside = g.pad[0] * pw + g.pad[1];
    for c in 0..channels {
        let plane = &mut x[c * h * w..][..h * w];
        for iy in 0..rows {
            copy_row(&mut padded[inside + iy * pw..][..cols], &plane[iy * w..][..cols]);
        }
        for ky in 0..kh {
            for kx in 0..kw {
                let src = &col[((c * kh + ky) * kw + kx) * ld..][..oh * ow];
                for (oy, s) in src.chunks_exact(ow).enumerate() {
                    add_row(&mut padded[(oy * sy + ky * dy) * pw + kx * dx..][..ow], s);
                }
            }
        }
        for iy in 0..rows {
            copy_row(&mut plane[iy * w..][..cols], &padded[inside + iy * pw..][..cols]);
        }
    }
}

/// `d += s`, element by element, for short rows: eight at a time, then four, then one.
#[inline(always)]
pub(super) fn add_row<F: HostFloat>(d: &mut [F], s: &[F]) {
    let n = d.len();
    let s = &s[..n];
    let mut i = 0;
    while i + 8 <= n {
        let (mut a, b): ([F; 8], [F; 8]) = (d[i..i + 8].try_into().expect("eight"), s[i..i + 8].try_into().expect("eight"));
        for k in 0..8 {
            a[k] += b[k];
        }
        d[i..i + 8].copy_from_slice(&a);
        i += 8;
    }
    if i + 4 <= n {
        let (mut a, b): ([F; 4], [F; 4]) = (d[i..i + 4].try_into().expect("four"), s[i..i + 4].try_into().expect("four"));
        for k in 0..4 {
            a[k] += b[k];
        }
        d[i..i + 4].copy_from_slice(&a);
        i += 4;
    }
    for (d, &v) in d[i..].iter_mut().zip(&s[i..]) {
        *d += v;
    }
}

/// The extents a convolution's GEMMs use: channels and output channels per group, output
/// pixels per image, the contraction `c/groups * kh * kw`, and `n * oh * ow` columns (for the
/// `n` images of one chunk).
pub(super) struct ConvDims {
    pub(super) cg: usize,
    pub(super) og: usize,
    pub(super) sp: usize,
    pub(super) kk: usize,
    pub(super) cols: usize,
}

pub(super) fn conv_dims(g: &Geometry, groups: usize, o: usize) -> ConvDims {
    let sp = g.spatial();
    let cg = g.x[1] / groups;
    ConvDims { cg, og: o / groups, sp, kk: cg * g.kernel[0] * g.kernel[1], cols: g.x[0] * sp }
}

/// Unfolds group `gi` of every image into the batch-wide column matrix `col`
/// (`[kk, n * oh * ow]`, image `i` in columns `i*sp..(i+1)*sp`). Padded convolutions go
/// through a zero-padded copy of each plane ([`im2col_padded`]).
pub(super) fn im2col_batch<F: HostFloat>(g: &Geometry, d: &ConvDims, gi: usize, x: &[F], col: &mut [F]) {
    let [n, c, h, w] = g.x;
    if g.pad == [0, 0] || d.sp == 0 {
        for i in 0..n {
            im2col(g, &x[(i * c + gi * d.cg) * h * w..], d.cg, &mut col[i * d.sp..], d.cols);
        }
        return;
    }
    let [ph, pw] = padded_extents(g);
    F::scratch(ph * pw, |plane| {
        // Only the interior is ever written: the border stays zero for every plane.
        plane.fill(F::ZERO);
        for i in 0..n {
            im2col_padded(g, &x[(i * c + gi * d.cg) * h * w..], d.cg, &mut col[i * d.sp..], d.cols, plane, pw);
        }
    })
}

/// The extents of the padded plane every output's window lies in: `(out - 1) * stride +
/// (kernel - 1) * dilation + 1` per axis (input beyond it is never read).
pub(super) fn padded_extents(g: &Geometry) -> [usize; 2] {
    [0, 1].map(|a| (g.out[a] - 1) * g.stride[a] + (g.kernel[a] - 1) * g.dilation[a] + 1)
}

/// The input planes a padded plane (`pw` wide, zero outside the interior) holds: rows and
/// columns of each plane that land inside it, at offset `pad`.
pub(super) fn interior(g: &Geometry, ph: usize, pw: usize) -> [usize; 2] {
    [g.x[2].min(ph.saturating_sub(g.pad[0])), g.x[3].min(pw.saturating_sub(g.pad[1]))]
}

/// [`im2col`] through `padded`, a plane of [`padded_extents`] whose border is zero: each
/// channel's plane is copied into its interior, then every row of `col` is `oh` reads of it
/// without bounds (on ResNet's 8x8 and 4x4 maps, the per-row `memset`s and `memcpy`s of the
/// clipped rows cost more than the copying).
pub(super) fn im2col_padded<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F], ld: usize, padded: &mut [F], pw: usize) {
    let [_, _, h, w] = g.x;
    let ([oh, ow], [kh, kw]) = (g.out, g.kernel);
    let ([sy, sx], [dy, dx]) = (g.stride, g.dilation);
    let [rows, cols] = interior(g, padded.len() / pw, pw);
    for ci in 0..channels {
        let plane = &x[ci * h * w..][..h * w];
        for iy in 0..rows {
            copy_row(&mut padded[(iy + g.pad[0]) * pw + g.pad[1]..][..cols], &plane[iy * w..][..cols]);
        }
        for ky in 0..kh {
            for kx in 0..kw {
                let dst = &mut col[((ci * kh + ky) * kw + kx) * ld..][..oh * ow];
                for (oy, d) in dst.chunks_exact_mut(ow).enumerate() {
                    let s = &padded[(oy * sy + ky * dy) * pw + kx * dx..];
                    if sx == 1 {
                        copy_row(d, &s[..ow]);
                    } else {
                        d.iter_mut().enumerate().for_each(|(ox, v)| *v = s[ox * sx]);
                    }
                }
            }
        }
    }
}

/// Group `gi` of an `[n, o, sp]` tensor as the rows `[og, n * sp]` of a batch-wide matrix.
pub(super) fn gather_rows<F: HostFloat>(d: &ConvDims, o: usize, gi: usize, nchw: &[F], rows: &mut [F]) {
    for (i, image) in nchw.chunks_exact(o * d.sp).enumerate() {
        for oo in 0..d.og {
            rows[oo * d.cols + i * d.sp..][..d.sp].copy_from_slice(&image[(gi * d.og + oo) * d.sp..][..d.sp]);
        }
    }
}

/// The inverse of [`gather_rows`]: writes the rows back into group `gi` of `[n, o, sp]`.
pub(super) fn scatter_rows<F: HostFloat>(d: &ConvDims, o: usize, gi: usize, rows: &[F], nchw: &mut [F]) {
    for (i, image) in nchw.chunks_exact_mut(o * d.sp).enumerate() {
        for oo in 0..d.og {
            image[(gi * d.og + oo) * d.sp..][..d.sp].copy_from_slice(&rows[oo * d.cols + i * d.sp..][..d.sp]);
        }
    }
}

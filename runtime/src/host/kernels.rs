//! Kernels on host slices (NCHW, row-major), generic over f32 and f64.
//!
//! Matrix products go to the `gemm` crate (candle's GEMM: packed AVX2/AVX-512 FMA kernels chosen
//! at run time, with small-matrix kernels), which takes arbitrary strides, so transposed
//! operands cost nothing. Convolutions are one GEMM per group over the whole batch: im2col
//! of every image into one column matrix `[c/g*kh*kw, n*oh*ow]` (stride-1 rows are slice
//! copies), the forward `w @ col`, the filter gradient `dy @ col^T` contracting over the
//! batch, the input gradient `w^T @ dy` then col2im. `benches/kernels.rs` times them on
//! LeNet5's shapes (against `matrixmultiply` and per-image GEMMs, which this replaced: see
//! BENCHMARKS.md). Max pooling is direct, branch-free where every window lies inside the
//! input. Every kernel handles stride, dilation, asymmetric padding and groups, so the
//! lowering needs no fallbacks on host backends.

/// A float element the host kernels compute in.
pub trait HostFloat: Copy + PartialOrd + std::ops::Add<Output = Self> + std::ops::AddAssign + 'static {
    const ZERO: Self;
    const NEG_INF: Self;
    fn is_nan(self) -> bool;
    /// `C = A B + beta * C` with element strides (`beta` is 0 or 1; with 0, `C` is not read).
    ///
    /// # Safety
    /// The pointers and strides must describe matrices inside their allocations.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(m: usize, k: usize, n: usize, a: *const Self, rsa: isize, csa: isize, b: *const Self, rsb: isize, csb: isize, beta: Self, c: *mut Self, rsc: isize, csc: isize);
}

impl HostFloat for f32 {
    const ZERO: f32 = 0.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    unsafe fn gemm(m: usize, k: usize, n: usize, a: *const f32, rsa: isize, csa: isize, b: *const f32, rsb: isize, csb: isize, beta: f32, c: *mut f32, rsc: isize, csc: isize) {
        gemm::gemm(m, n, k, c, csc, rsc, beta != 0.0, a, csa, rsa, b, csb, rsb, beta, 1.0, false, false, false, gemm::Parallelism::None)
    }
}

impl HostFloat for f64 {
    const ZERO: f64 = 0.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    unsafe fn gemm(m: usize, k: usize, n: usize, a: *const f64, rsa: isize, csa: isize, b: *const f64, rsb: isize, csb: isize, beta: f64, c: *mut f64, rsc: isize, csc: isize) {
        gemm::gemm(m, n, k, c, csc, rsc, beta != 0.0, a, csa, rsa, b, csb, rsb, beta, 1.0, false, false, false, gemm::Parallelism::None)
    }
}

/// A row-major `[rows, cols]` matrix view, possibly read transposed.
#[derive(Clone, Copy)]
pub struct Mat<'a, F> {
    pub data: &'a [F],
    pub rows: usize,
    pub cols: usize,
    pub transposed: bool,
}

impl<F> Mat<'_, F> {
    /// Extents as read: `[rows, cols]`, swapped when transposed.
    fn logical(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
    /// Row and column strides as read.
    fn strides(&self) -> (isize, isize) {
        if self.transposed {
            (1, self.cols as isize)
        } else {
            (self.cols as isize, 1)
        }
    }
}

/// `op(a) @ op(b)` as a new row-major matrix.
pub fn matmul<F: HostFloat>(a: Mat<F>, b: Mat<F>) -> Vec<F> {
    let ((m, k), (k2, n)) = (a.logical(), b.logical());
    assert_eq!(k, k2, "contracting extents checked by shape inference");
    assert!(a.data.len() >= a.rows * a.cols && b.data.len() >= b.rows * b.cols);
    let mut c = vec![F::ZERO; m * n];
    let ((rsa, csa), (rsb, csb)) = (a.strides(), b.strides());
    // SAFETY: both views were checked to lie inside their slices; `c` is m x n.
    unsafe { F::gemm(m, k, n, a.data.as_ptr(), rsa, csa, b.data.as_ptr(), rsb, csb, F::ZERO, c.as_mut_ptr(), n as isize, 1) };
    c
}

/// The geometry of one 2-D convolution (or pooling window) over NCHW input.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// `[n, c, h, w]` of the input.
    pub x: [usize; 4],
    /// `[kh, kw]`.
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    /// `[top, left]` padding (bottom and right follow from `out`).
    pub pad: [usize; 2],
    /// `[oh, ow]`.
    pub out: [usize; 2],
}

impl Geometry {
    fn spatial(&self) -> usize {
        self.out[0] * self.out[1]
    }
    /// The input coordinate read by output `o` at kernel offset `k` along axis `a`, if inside.
    #[inline]
    fn at(&self, a: usize, o: usize, k: usize) -> Option<usize> {
        let i = (o * self.stride[a] + k * self.dilation[a]).checked_sub(self.pad[a])?;
        (i < self.x[2 + a]).then_some(i)
    }
    /// Output columns `[lo, hi)` whose input column at kernel offset `kx` lies inside.
    fn valid_cols(&self, kx: usize) -> (usize, usize) {
        let (s, off, w) = (self.stride[1], kx * self.dilation[1], self.x[3]);
        let lo = self.pad[1].saturating_sub(off).div_ceil(s).min(self.out[1]);
        let hi = if w + self.pad[1] > off { (w + self.pad[1] - off).div_ceil(s).min(self.out[1]) } else { 0 };
        (lo, hi.max(lo))
    }
}

/// Unfolds `channels` input planes (`x`, each `h*w`) into rows of `col`: row
/// `c*kh*kw + ky*kw + kx` holds the `oh*ow` inputs that kernel offset `(ky, kx)` of channel `c`
/// reads, at `col[row * ld..][..oh*ow]` (`ld` >= `oh*ow`: one image's block of a batch-wide
/// column matrix).
fn im2col<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F], ld: usize) {
    let (h, w) = (g.x[2], g.x[3]);
    let (ow, sp) = (g.out[1], g.spatial());
    let mut row = 0;
    for c in 0..channels {
        let plane = &x[c * h * w..(c + 1) * h * w];
        for ky in 0..g.kernel[0] {
            for kx in 0..g.kernel[1] {
                let dst = &mut col[row * ld..row * ld + sp];
                let (lo, hi) = g.valid_cols(kx);
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

/// The adjoint of [`im2col`]: adds the rows of `col` (row stride `ld`) back into `channels`
/// planes of `x`.
fn col2im<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F]) {
    let (h, w) = (g.x[2], g.x[3]);
    let (ow, sp) = (g.out[1], g.spatial());
    let mut row = 0;
    for c in 0..channels {
        let plane = &mut x[c * h * w..(c + 1) * h * w];
        for ky in 0..g.kernel[0] {
            for kx in 0..g.kernel[1] {
                let src = &col[row * ld..row * ld + sp];
                let (lo, hi) = g.valid_cols(kx);
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

/// The extents a convolution's batch-wide GEMMs use: channels and output channels per group,
/// output pixels per image, the contraction `c/groups * kh * kw`, and `n * oh * ow` columns.
struct ConvDims {
    cg: usize,
    og: usize,
    sp: usize,
    kk: usize,
    cols: usize,
}

fn conv_dims(g: &Geometry, groups: usize, o: usize) -> ConvDims {
    let sp = g.spatial();
    let cg = g.x[1] / groups;
    ConvDims { cg, og: o / groups, sp, kk: cg * g.kernel[0] * g.kernel[1], cols: g.x[0] * sp }
}

/// Unfolds group `gi` of every image into the batch-wide column matrix `col`
/// (`[kk, n * oh * ow]`, image `i` in columns `i*sp..(i+1)*sp`).
fn im2col_batch<F: HostFloat>(g: &Geometry, d: &ConvDims, gi: usize, x: &[F], col: &mut [F]) {
    let [n, c, h, w] = g.x;
    for i in 0..n {
        im2col(g, &x[(i * c + gi * d.cg) * h * w..], d.cg, &mut col[i * d.sp..], d.cols);
    }
}

/// Group `gi` of an `[n, o, sp]` tensor as the rows `[og, n * sp]` of a batch-wide matrix.
fn gather_rows<F: HostFloat>(d: &ConvDims, o: usize, gi: usize, nchw: &[F], rows: &mut [F]) {
    for (i, image) in nchw.chunks_exact(o * d.sp).enumerate() {
        for oo in 0..d.og {
            rows[oo * d.cols + i * d.sp..][..d.sp].copy_from_slice(&image[(gi * d.og + oo) * d.sp..][..d.sp]);
        }
    }
}

/// The inverse of [`gather_rows`]: writes the rows back into group `gi` of `[n, o, sp]`.
fn scatter_rows<F: HostFloat>(d: &ConvDims, o: usize, gi: usize, rows: &[F], nchw: &mut [F]) {
    for (i, image) in nchw.chunks_exact_mut(o * d.sp).enumerate() {
        for oo in 0..d.og {
            image[(gi * d.og + oo) * d.sp..][..d.sp].copy_from_slice(&rows[oo * d.cols + i * d.sp..][..d.sp]);
        }
    }
}

/// Convolution: `x` `[n, c, h, w]`, `w` `[o, c/groups, kh, kw]` -> `[n, o, oh, ow]`. Per group,
/// one GEMM over the whole batch: `w_g [og, kk] @ col [kk, n*oh*ow]`.
pub fn conv2d<F: HostFloat>(g: &Geometry, groups: usize, x: &[F], w: &[F], o: usize) -> Vec<F> {
    let d = conv_dims(g, groups, o);
    let n = g.x[0];
    let mut y = vec![F::ZERO; n * o * d.sp];
    let mut col = vec![F::ZERO; d.kk * d.cols];
    let mut rows = vec![F::ZERO; d.og * d.cols];
    for gi in 0..groups {
        im2col_batch(g, &d, gi, x, &mut col);
        let wg = &w[gi * d.og * d.kk..(gi + 1) * d.og * d.kk];
        // SAFETY: wg is og x kk, col is kk x cols, rows is og x cols, all row-major.
        unsafe { F::gemm(d.og, d.kk, d.cols, wg.as_ptr(), d.kk as isize, 1, col.as_ptr(), d.cols as isize, 1, F::ZERO, rows.as_mut_ptr(), d.cols as isize, 1) };
        scatter_rows(&d, o, gi, &rows, &mut y);
    }
    y
}

/// Gradient of [`conv2d`] w.r.t. its input: `dy` `[n, o, oh, ow]` -> `[n, c, h, w]`. Per group,
/// `w_g^T [kk, og] @ dy_g [og, n*oh*ow]`, then col2im image by image.
pub fn conv2d_input_grad<F: HostFloat>(g: &Geometry, groups: usize, dy: &[F], w: &[F], o: usize) -> Vec<F> {
    let d = conv_dims(g, groups, o);
    let [n, c, h, wi] = g.x;
    let mut dx = vec![F::ZERO; n * c * h * wi];
    let mut col = vec![F::ZERO; d.kk * d.cols];
    let mut rows = vec![F::ZERO; d.og * d.cols];
    for gi in 0..groups {
        gather_rows(&d, o, gi, dy, &mut rows);
        let wg = &w[gi * d.og * d.kk..(gi + 1) * d.og * d.kk];
        // SAFETY: wg^T is kk x og (read with swapped strides), rows is og x cols, col kk x cols.
        unsafe { F::gemm(d.kk, d.og, d.cols, wg.as_ptr(), 1, d.kk as isize, rows.as_ptr(), d.cols as isize, 1, F::ZERO, col.as_mut_ptr(), d.cols as isize, 1) };
        for i in 0..n {
            col2im(g, &col[i * d.sp..], d.cols, d.cg, &mut dx[(i * c + gi * d.cg) * h * wi..(i * c + (gi + 1) * d.cg) * h * wi]);
        }
    }
    dx
}

/// Gradient of [`conv2d`] w.r.t. its filter: `[o, c/groups, kh, kw]`. Per group, one GEMM
/// contracting over the whole batch: `dy_g [og, n*oh*ow] @ col^T [n*oh*ow, kk]`.
pub fn conv2d_filter_grad<F: HostFloat>(g: &Geometry, groups: usize, dy: &[F], x: &[F], o: usize) -> Vec<F> {
    let d = conv_dims(g, groups, o);
    let mut dw = vec![F::ZERO; o * d.kk];
    let mut col = vec![F::ZERO; d.kk * d.cols];
    let mut rows = vec![F::ZERO; d.og * d.cols];
    for gi in 0..groups {
        im2col_batch(g, &d, gi, x, &mut col);
        gather_rows(&d, o, gi, dy, &mut rows);
        let dwg = &mut dw[gi * d.og * d.kk..(gi + 1) * d.og * d.kk];
        // SAFETY: rows is og x cols, col^T is cols x kk (swapped strides), dwg is og x kk.
        unsafe { F::gemm(d.og, d.cols, d.kk, rows.as_ptr(), d.cols as isize, 1, col.as_ptr(), 1, d.cols as isize, F::ZERO, dwg.as_mut_ptr(), d.kk as isize, 1) };
    }
    dw
}

/// For each output of a max pool, the flat index (within its plane) of the first largest
/// input in the window; `usize::MAX` for a window entirely in padding.
fn argmax_windows<F: HostFloat>(g: &Geometry, plane: &[F], out: &mut [usize]) {
    let inside = |a: usize| g.out[a] > 0 && (g.out[a] - 1) * g.stride[a] + (g.kernel[a] - 1) * g.dilation[a] < g.x[2 + a];
    if g.pad == [0, 0] && inside(0) && inside(1) {
        return argmax_inside(g, plane, out);
    }
    argmax_general(g, plane, out)
}

/// [`argmax_windows`] for any window, padded or not.
fn argmax_general<F: HostFloat>(g: &Geometry, plane: &[F], out: &mut [usize]) {
    // Input rows (or columns) `[lo, hi)` that output `o` reads along axis `a`.
    let span = |a: usize, o: usize| {
        let start = (o * g.stride[a]) as isize - g.pad[a] as isize;
        let step = g.dilation[a] as isize;
        let k = (0..g.kernel[a] as isize).filter(|&k| (0..g.x[2 + a] as isize).contains(&(start + k * step)));
        let (lo, hi) = (k.clone().min(), k.max());
        (start, step, lo.unwrap_or(0), hi.map_or(0, |h| h + 1))
    };
    let w = g.x[3];
    let cols: Vec<_> = (0..g.out[1]).map(|ox| span(1, ox)).collect();
    for oy in 0..g.out[0] {
        let (ys, ysd, ky0, ky1) = span(0, oy);
        for (ox, &(xs, xsd, kx0, kx1)) in cols.iter().enumerate() {
            let (mut best, mut at) = (F::NEG_INF, usize::MAX);
            for ky in ky0..ky1 {
                let row = (ys + ky * ysd) as usize * w;
                for kx in kx0..kx1 {
                    let i = row + (xs + kx * xsd) as usize;
                    let v = plane[i];
                    if at == usize::MAX || v > best || v.is_nan() {
                        (best, at) = (v, i);
                    }
                }
            }
            out[oy * g.out[1] + ox] = at;
        }
    }
}

/// [`argmax_windows`] where every window lies inside the plane (no padding): the same
/// comparisons in the same order, a row of outputs at a time (one kernel offset across the
/// row), without branches on the data.
fn argmax_inside<F: HostFloat>(g: &Geometry, plane: &[F], out: &mut [usize]) {
    let w = g.x[3];
    let [sy, sx] = g.stride;
    let [dy, dx] = g.dilation;
    let ow = g.out[1];
    let mut best = vec![F::ZERO; ow];
    for (oy, at) in out.chunks_exact_mut(ow).enumerate() {
        let top = oy * sy * w;
        for (ox, (b, a)) in best.iter_mut().zip(at.iter_mut()).enumerate() {
            *a = top + ox * sx;
            *b = plane[*a];
        }
        for ky in 0..g.kernel[0] {
            for kx in 0..g.kernel[1] {
                let first = top + ky * dy * w + kx * dx;
                for (ox, (b, a)) in best.iter_mut().zip(at.iter_mut()).enumerate() {
                    let i = first + ox * sx;
                    let v = plane[i];
                    let take = v > *b || v.is_nan();
                    *b = if take { v } else { *b };
                    *a = if take { i } else { *a };
                }
            }
        }
    }
}

/// Max pooling over NCHW `x`; padding never wins.
pub fn max_pool2d<F: HostFloat>(g: &Geometry, x: &[F]) -> Vec<F> {
    let [n, c, h, w] = g.x;
    let sp = g.spatial();
    let mut y = vec![F::NEG_INF; n * c * sp];
    let mut at = vec![0usize; sp];
    for p in 0..n * c {
        let plane = &x[p * h * w..(p + 1) * h * w];
        argmax_windows(g, plane, &mut at);
        for (yv, &i) in y[p * sp..(p + 1) * sp].iter_mut().zip(&at) {
            if i != usize::MAX {
                *yv = plane[i];
            }
        }
    }
    y
}

/// Gradient of [`max_pool2d`]: each output's gradient goes to its window's first maximum.
pub fn max_pool2d_grad<F: HostFloat>(g: &Geometry, x: &[F], dy: &[F]) -> Vec<F> {
    let [n, c, h, w] = g.x;
    let sp = g.spatial();
    let mut dx = vec![F::ZERO; n * c * h * w];
    let mut at = vec![0usize; sp];
    for p in 0..n * c {
        argmax_windows(g, &x[p * h * w..(p + 1) * h * w], &mut at);
        let d = &mut dx[p * h * w..(p + 1) * h * w];
        for (&i, &g) in at.iter().zip(&dy[p * sp..(p + 1) * sp]) {
            if i != usize::MAX {
                d[i] += g;
            }
        }
    }
    dx
}

/// `dy` where `x > 0`, else zero.
pub fn relu_grad<F: HostFloat>(dy: &[F], x: &[F]) -> Vec<F> {
    dy.iter().zip(x).map(|(&d, &v)| if v > F::ZERO { d } else { F::ZERO }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free pooling path picks the same input as the general one, ties (the first
    /// maximum wins) and NaNs (a NaN wins) included, for every unpadded window shape.
    #[test]
    fn unpadded_pooling_picks_what_the_general_path_picks() {
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let (h, w) = (9, 11);
        let plane: Vec<f32> = (0..h * w)
            .map(|_| match next() % 10 {
                0 => f32::NAN,
                1..=4 => 1.0, // ties
                r => r as f32 - 7.0,
            })
            .collect();
        for (kernel, stride, dilation) in [([2, 2], [2, 2], [1, 1]), ([3, 3], [1, 1], [1, 1]), ([2, 3], [3, 2], [1, 1]), ([2, 2], [1, 2], [2, 3])] {
            let out = [0, 1].map(|a| ([h, w][a] - dilation[a] * (kernel[a] - 1) - 1) / stride[a] + 1);
            let g = Geometry { x: [1, 1, h, w], kernel, stride, dilation, pad: [0, 0], out };
            let (mut fast, mut general) = (vec![0; out[0] * out[1]], vec![0; out[0] * out[1]]);
            argmax_inside(&g, &plane, &mut fast);
            argmax_general(&g, &plane, &mut general);
            assert_eq!(fast, general, "kernel {kernel:?} stride {stride:?} dilation {dilation:?}");
        }
    }
}

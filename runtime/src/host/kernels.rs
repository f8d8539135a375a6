//! Kernels on host slices (NCHW, row-major), generic over f32 and f64.
//!
//! Matrix products go to `matrixmultiply`'s packed GEMM, which takes arbitrary strides, so
//! transposed operands cost nothing. Convolutions are im2col + GEMM per image and group (the
//! column buffer is one image's, reused), their gradients GEMM + col2im and im2col + GEMM
//! accumulated over the batch. Pooling is direct. Every kernel handles stride, dilation,
//! asymmetric padding and groups, so the lowering needs no fallbacks on host backends.

/// A float element the host kernels compute in.
pub trait HostFloat: Copy + PartialOrd + std::ops::Add<Output = Self> + std::ops::AddAssign + 'static {
    const ZERO: Self;
    const ONE: Self;
    const NEG_INF: Self;
    fn is_nan(self) -> bool;
    /// `C = alpha * A B + beta * C` with element strides (matrixmultiply's contract).
    ///
    /// # Safety
    /// The pointers and strides must describe matrices inside their allocations.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(m: usize, k: usize, n: usize, a: *const Self, rsa: isize, csa: isize, b: *const Self, rsb: isize, csb: isize, beta: Self, c: *mut Self, rsc: isize, csc: isize);
}

impl HostFloat for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    unsafe fn gemm(m: usize, k: usize, n: usize, a: *const f32, rsa: isize, csa: isize, b: *const f32, rsb: isize, csb: isize, beta: f32, c: *mut f32, rsc: isize, csc: isize) {
        matrixmultiply::sgemm(m, k, n, 1.0, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
    }
}

impl HostFloat for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    unsafe fn gemm(m: usize, k: usize, n: usize, a: *const f64, rsa: isize, csa: isize, b: *const f64, rsb: isize, csb: isize, beta: f64, c: *mut f64, rsc: isize, csc: isize) {
        matrixmultiply::dgemm(m, k, n, 1.0, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
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

/// Unfolds `channels` input planes (`x`, each `h*w`) into `col` (`[channels*kh*kw, oh*ow]`).
fn im2col<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F]) {
    let (h, w) = (g.x[2], g.x[3]);
    let (ow, sp) = (g.out[1], g.spatial());
    let mut row = 0;
    for c in 0..channels {
        let plane = &x[c * h * w..(c + 1) * h * w];
        for ky in 0..g.kernel[0] {
            for kx in 0..g.kernel[1] {
                let dst = &mut col[row * sp..(row + 1) * sp];
                let (lo, hi) = g.valid_cols(kx);
                for oy in 0..g.out[0] {
                    let d = &mut dst[oy * ow..(oy + 1) * ow];
                    let Some(iy) = g.at(0, oy, ky) else {
                        d.fill(F::ZERO);
                        continue;
                    };
                    d[..lo].fill(F::ZERO);
                    d[hi..].fill(F::ZERO);
                    let src = &plane[iy * w..(iy + 1) * w];
                    let base = kx * g.dilation[1];
                    for ox in lo..hi {
                        d[ox] = src[ox * g.stride[1] + base - g.pad[1]];
                    }
                }
                row += 1;
            }
        }
    }
}

/// The adjoint of [`im2col`]: adds `col` back into `channels` planes of `x`.
fn col2im<F: HostFloat>(g: &Geometry, col: &[F], channels: usize, x: &mut [F]) {
    let (h, w) = (g.x[2], g.x[3]);
    let (ow, sp) = (g.out[1], g.spatial());
    let mut row = 0;
    for c in 0..channels {
        let plane = &mut x[c * h * w..(c + 1) * h * w];
        for ky in 0..g.kernel[0] {
            for kx in 0..g.kernel[1] {
                let src = &col[row * sp..(row + 1) * sp];
                let (lo, hi) = g.valid_cols(kx);
                for oy in 0..g.out[0] {
                    let Some(iy) = g.at(0, oy, ky) else { continue };
                    let d = &mut plane[iy * w..(iy + 1) * w];
                    let base = kx * g.dilation[1];
                    for ox in lo..hi {
                        d[ox * g.stride[1] + base - g.pad[1]] += src[oy * ow + ox];
                    }
                }
                row += 1;
            }
        }
    }
}

/// Convolution: `x` `[n, c, h, w]`, `w` `[o, c/groups, kh, kw]` -> `[n, o, oh, ow]`.
pub fn conv2d<F: HostFloat>(g: &Geometry, groups: usize, x: &[F], w: &[F], o: usize) -> Vec<F> {
    let [n, c, h, wi] = g.x;
    let (cg, og, sp) = (c / groups, o / groups, g.spatial());
    let kk = cg * g.kernel[0] * g.kernel[1];
    let mut y = vec![F::ZERO; n * o * sp];
    let mut col = vec![F::ZERO; kk * sp];
    for i in 0..n {
        for gi in 0..groups {
            let xs = &x[(i * c + gi * cg) * h * wi..];
            im2col(g, xs, cg, &mut col);
            let wg = &w[gi * og * kk..(gi + 1) * og * kk];
            let yg = &mut y[(i * o + gi * og) * sp..(i * o + (gi + 1) * og) * sp];
            // SAFETY: wg is og x kk, col is kk x sp, yg is og x sp, all row-major.
            unsafe { F::gemm(og, kk, sp, wg.as_ptr(), kk as isize, 1, col.as_ptr(), sp as isize, 1, F::ZERO, yg.as_mut_ptr(), sp as isize, 1) };
        }
    }
    y
}

/// Gradient of [`conv2d`] w.r.t. its input: `dy` `[n, o, oh, ow]` -> `[n, c, h, w]`.
pub fn conv2d_input_grad<F: HostFloat>(g: &Geometry, groups: usize, dy: &[F], w: &[F], o: usize) -> Vec<F> {
    let [n, c, h, wi] = g.x;
    let (cg, og, sp) = (c / groups, o / groups, g.spatial());
    let kk = cg * g.kernel[0] * g.kernel[1];
    let mut dx = vec![F::ZERO; n * c * h * wi];
    let mut col = vec![F::ZERO; kk * sp];
    for i in 0..n {
        for gi in 0..groups {
            let wg = &w[gi * og * kk..(gi + 1) * og * kk];
            let dyg = &dy[(i * o + gi * og) * sp..(i * o + (gi + 1) * og) * sp];
            // SAFETY: wg^T is kk x og (read with swapped strides), dyg is og x sp, col kk x sp.
            unsafe { F::gemm(kk, og, sp, wg.as_ptr(), 1, kk as isize, dyg.as_ptr(), sp as isize, 1, F::ZERO, col.as_mut_ptr(), sp as isize, 1) };
            col2im(g, &col, cg, &mut dx[(i * c + gi * cg) * h * wi..(i * c + (gi + 1) * cg) * h * wi]);
        }
    }
    dx
}

/// Gradient of [`conv2d`] w.r.t. its filter: `[o, c/groups, kh, kw]`.
pub fn conv2d_filter_grad<F: HostFloat>(g: &Geometry, groups: usize, dy: &[F], x: &[F], o: usize) -> Vec<F> {
    let [n, c, h, wi] = g.x;
    let (cg, og, sp) = (c / groups, o / groups, g.spatial());
    let kk = cg * g.kernel[0] * g.kernel[1];
    let mut dw = vec![F::ZERO; o * kk];
    let mut col = vec![F::ZERO; kk * sp];
    for i in 0..n {
        for gi in 0..groups {
            im2col(g, &x[(i * c + gi * cg) * h * wi..], cg, &mut col);
            let dyg = &dy[(i * o + gi * og) * sp..(i * o + (gi + 1) * og) * sp];
            let dwg = &mut dw[gi * og * kk..(gi + 1) * og * kk];
            let beta = if i == 0 { F::ZERO } else { F::ONE };
            // SAFETY: dyg is og x sp, col^T is sp x kk (swapped strides), dwg is og x kk.
            unsafe { F::gemm(og, sp, kk, dyg.as_ptr(), sp as isize, 1, col.as_ptr(), 1, sp as isize, beta, dwg.as_mut_ptr(), kk as isize, 1) };
        }
    }
    dw
}

/// For each output of a max pool, the flat index (within its plane) of the first largest
/// input in the window; `usize::MAX` for a window entirely in padding.
fn argmax_windows<F: HostFloat>(g: &Geometry, plane: &[F], out: &mut [usize]) {
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

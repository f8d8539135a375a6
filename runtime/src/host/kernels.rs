//! Kernels on host slices (NCHW, row-major), generic over f32 and f64.
//!
//! Matrix products go to the `gemm` crate (candle's GEMM: packed AVX2/AVX-512 FMA kernels chosen
//! at run time, with small-matrix kernels), which takes arbitrary strides, so transposed
//! operands cost nothing. Convolutions cut the batch into chunks of images whose column
//! matrices fit in L2 (in thread-local scratch, reused), and run one GEMM per chunk and group:
//! im2col of the chunk's images into one column matrix `[c/g*kh*kw, m*oh*ow]` (stride-1 rows
//! are slice copies), the forward `w @ col`, the filter gradient `dy @ col^T` contracting over
//! the chunk (chunk sums added in order), the input gradient `w^T @ dy` then col2im. Chunks
//! (and pooling planes) run on the rayon pool's threads; the cut never depends on the thread
//! count, so results are the same on any number of threads. `benches/kernels.rs` times them
//! on LeNet5's shapes (see BENCHMARKS.md). Max pooling is direct and branch-free on the data
//! (windows of -inf aside), and returns its argmax for the gradient. Every kernel handles
//! stride, dilation, asymmetric padding and groups, so the lowering needs no fallbacks on host
//! backends.

use std::cell::Cell;

thread_local! {
    static SCRATCH_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static SCRATCH_F64: Cell<Vec<f64>> = const { Cell::new(Vec::new()) };
    static PARTIALS_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static PARTIALS_F64: Cell<Vec<f64>> = const { Cell::new(Vec::new()) };
}

use super::toeplitz;
pub use crate::kernel::Geometry;
use crate::kernel::{Elementwise, KStep, KVal, Products, Read, UpdateKernel};
use cellgraph_compiler::expr::{Binary, Term, Unary};
use cellgraph_compiler::update::Target;
use cellgraph_compiler::Reduction;

/// A float element the host kernels compute in.
pub trait HostFloat:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::AddAssign
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + Send
    + Sync
    + 'static
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn is_nan(self) -> bool;
    /// `v` rounded to this type (as a `constant` node is).
    fn from_f64(v: f64) -> Self;
    fn exp(self) -> Self;
    /// `exp`, `erf` and `tanh` as elementwise programs (and those ops alone) compute them: on
    /// f32 [`super::math`]'s, which vectorise (within 1, 2 and 1.5 ulp); on f64, the
    /// reference backend, std's and libm's, as burn's ops.
    fn program_exp(self) -> Self;
    fn erf(self) -> Self;
    fn tanh(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    /// The nearest bf16 value (ties to even; half's conversion, as `round_to` everywhere).
    fn round_bf16(self) -> Self;
    /// The nearest f16 value (ties to even, subnormals kept, past 65504 to infinity).
    fn round_f16(self) -> Self;
    /// `self * a + b` with one rounding (an FMA instruction where the CPU has one).
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// The sum of `xs` by ndarray's own `sum` (eight running sums, paired): the order, and so
    /// the bits, of burn-ndarray's reductions, which the host loss kernels must reproduce.
    fn ndarray_sum(xs: &[Self]) -> Self;
    /// Runs `f` on `len` elements of this thread's scratch memory (grown, never shrunk: a
    /// steady state allocates nothing; the contents are whatever the last kernel left).
    fn scratch<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R;
    /// As [`Self::scratch`], in a second buffer for what a kernel's calling thread holds while
    /// the chunks it hands out use their own scratch (the filter gradient's partial sums).
    fn partials<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R;
    /// `C = A B + beta * C` with element strides (`beta` is 0 or 1; with 0, `C` is not read),
    /// on up to `threads` of rayon's threads (gemm splits the output, never the contraction,
    /// so the bits do not depend on it).
    ///
    /// # Safety
    /// The pointers and strides must describe matrices inside their allocations.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
        threads: usize,
    );
}

/// One implementation for both element types (`$scratch`: the type's thread-local scratch).
macro_rules! host_float {
    ($t:ident, $scratch:ident, $partials:ident, $exp:path, $erf:path, $tanh:path) => {
        impl HostFloat for $t {
            const ZERO: $t = 0.0;
            const NEG_INF: $t = $t::NEG_INFINITY;
            fn is_nan(self) -> bool {
                $t::is_nan(self)
            }
            fn from_f64(v: f64) -> $t {
                v as $t
            }
            fn exp(self) -> $t {
                $t::exp(self)
            }
            #[inline(always)]
            fn program_exp(self) -> $t {
                $exp(self)
            }
            #[inline(always)]
            fn erf(self) -> $t {
                $erf(self)
            }
            #[inline(always)]
            fn tanh(self) -> $t {
                $tanh(self)
            }
            fn ln(self) -> $t {
                $t::ln(self)
            }
            fn sqrt(self) -> $t {
                $t::sqrt(self)
            }
            // From f32 (f64 values, on the f64 reference backend, are rounded to f32 first:
            // the op rounds f32 values).
            fn round_bf16(self) -> $t {
                super::math::round_bf16(self as f32) as $t
            }
            fn round_f16(self) -> $t {
                half::f16::from_f32(self as f32).to_f32() as $t
            }
            #[inline(always)]
            fn mul_add(self, a: $t, b: $t) -> $t {
                $t::mul_add(self, a, b)
            }
            fn ndarray_sum(xs: &[$t]) -> $t {
                ndarray::aview1(xs).sum()
            }
            fn scratch<R>(len: usize, f: impl FnOnce(&mut [$t]) -> R) -> R {
                grown(&$scratch, len, f)
            }
            fn partials<R>(len: usize, f: impl FnOnce(&mut [$t]) -> R) -> R {
                grown(&$partials, len, f)
            }
            unsafe fn gemm(
                m: usize,
                k: usize,
                n: usize,
                a: *const $t,
                rsa: isize,
                csa: isize,
                b: *const $t,
                rsb: isize,
                csb: isize,
                beta: $t,
                c: *mut $t,
                rsc: isize,
                csc: isize,
                threads: usize,
            ) {
                let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
                gemm::gemm(m, n, k, c, csc, rsc, beta != 0.0, a, csa, rsa, b, csb, rsb, beta, 1.0, false, false, false, par)
            }
        }
    };
}

host_float!(f32, SCRATCH_F32, PARTIALS_F32, super::math::exp, super::math::erf, super::math::tanh);
host_float!(f64, SCRATCH_F64, PARTIALS_F64, f64::exp, libm::erf, f64::tanh);

/// Runs `f` on the first `len` elements of a thread-local buffer, grown (never shrunk) to fit.
/// The buffer is taken out of the thread-local for the call: a thread waiting inside a kernel
/// may run another plan's jobs (rayon steals work while it waits), and a kernel there then
/// grows a buffer of its own; the larger goes back.
fn grown<T: Copy + Default + 'static, R>(key: &'static std::thread::LocalKey<Cell<Vec<T>>>, len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let mut v = key.take();
    if v.len() < len {
        v.resize(len, T::default());
    }
    let r = f(&mut v[..len]);
    key.with(|k| {
        let other = k.take();
        k.set(if other.len() > v.len() { other } else { v });
    });
    r
}

/// Runs `op` compiled for the widest vector instructions this CPU has (pulp: AVX-512, else
/// AVX2 with FMA, else none), chosen per call. Only code inlined into it is compiled so: the
/// kernels' loops are `#[inline(always)]`. A small closure is an op (the compiler vectorises
/// its loops), but a large one is called, not inlined, whatever its attributes, and runs on
/// the baseline instruction set (SSE2): the fused elementwise programs ran so, at 4 lanes,
/// until they became a struct whose `with_simd` holds the loop ([`Program`]). Check the
/// disassembly of `pulp::x86::v4::V4::vectorize::imp*` for calls when adding one.
/// [`crate::host::direct`]'s kernels take the instruction set as a type.
#[inline(always)]
pub(crate) fn vectorized<Op: pulp::WithSimd>(op: Op) -> Op::Output {
    #[cfg(test)]
    if tests::SCALAR.with(std::cell::Cell::get) {
        return pulp::Arch::Scalar.dispatch(op);
    }
    pulp::Arch::new().dispatch(op)
}

/// `C = A B` (`beta` as in [`HostFloat::gemm`]) on `threads` threads: cut into as many
/// bands of rows of `C` (or of columns, when it has more columns than rows) as there are
/// threads, each band a product of its own on one thread. Each band still has more than 64
/// rows (columns), so the GEMM blocks its contraction as it does the whole product's, and every
/// element of `C` is the same dot product, summed in the same order, on any number of threads.
/// (The GEMM's own threading ran these products at 1.4x on two threads: its threads share
/// the packing of each block and meet between blocks.)
///
/// # Safety
/// As [`HostFloat::gemm`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_oriented<F: HostFloat>(
    m: usize,
    k: usize,
    n: usize,
    a: *const F,
    rsa: isize,
    csa: isize,
    b: *const F,
    rsb: isize,
    csb: isize,
    beta: F,
    c: *mut F,
    rsc: isize,
    csc: isize,
    threads: usize,
    pr: Products,
) {
    let along = m.max(n);
    let mut bands = threads.min(along / MIN_BAND);
    // The last band is the shortest.
    while bands >= 2 && along - along.div_ceil(bands) * (bands - 1) < MIN_BAND {
        bands -= 1;
    }
    if bands < 2 {
        return gemm_turned(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc, threads, pr);
    }
    /// The operands' addresses, shared by the bands (each writes its own part of `C`).
    struct Ptrs<F>(*const F, *const F, *mut F);
    // SAFETY: the bands read `A` and `B` and write disjoint parts of `C`.
    unsafe impl<F> Sync for Ptrs<F> {}
    let p = Ptrs(a, b, c);
    let p = &p;
    let per = along.div_ceil(bands);
    each((0..along).step_by(per).collect(), |lo| {
        let len = per.min(along - lo);
        // SAFETY: band `lo..lo + len` of `C`'s rows (columns) and of `A`'s rows (`B`'s
        // columns) lie inside the caller's views.
        unsafe {
            if m >= n {
                gemm_turned(len, k, n, p.0.offset(lo as isize * rsa), rsa, csa, p.1, rsb, csb, beta, p.2.offset(lo as isize * rsc), rsc, csc, 1, pr)
            } else {
                gemm_turned(m, k, len, p.0, rsa, csa, p.1.offset(lo as isize * csb), rsb, csb, beta, p.2.offset(lo as isize * csc), rsc, csc, 1, pr)
            }
        }
    });
}

/// The fewest rows (columns) in a band of [`gemm_oriented`]: the GEMM takes products with at
/// most 64 rows and 64 columns down another path, which blocks a contraction over more than
/// 512 differently; bands of 80 or more are cut finely enough.
const MIN_BAND: usize = 80;

/// `C = A B` as [`gemm_oriented`], computed as `C^T = B^T A^T` when that wastes less of the
/// micro-kernel's tiles: the f32 GEMM's register tile is 64 bytes of rows (16 f32) by 6
/// columns, so a product with few rows (a convolution's 6 output channels) runs faster turned
/// around; the bf16 kernel's is 8 rows by 32 columns. The arithmetic per element of `C` is the
/// same dot product either way. Products of bf16 values (`pr`) on f32 run on
/// [`super::bf16`], one thread per call (the bands of [`gemm_oriented`] share the work).
///
/// # Safety
/// As [`HostFloat::gemm`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_turned<F: HostFloat>(
    m: usize,
    k: usize,
    n: usize,
    a: *const F,
    rsa: isize,
    csa: isize,
    b: *const F,
    rsb: isize,
    csb: isize,
    beta: F,
    c: *mut F,
    rsc: isize,
    csc: isize,
    threads: usize,
    pr: Products,
) {
    let bf16 = pr == Products::Bf16 && std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>();
    // The micro-kernel's register tile: rows and columns of `C`.
    let (mr, nr) = if bf16 { super::bf16::TILE } else { (64 / std::mem::size_of::<F>(), 6) };
    let padded = |m: usize, n: usize| m.div_ceil(mr) * mr * n.div_ceil(nr) * nr;
    let product = |m, n, a: *const F, rsa, csa, b: *const F, rsb, csb, rsc, csc| {
        if bf16 {
            let (a, b, c) = (a as *const f32, b as *const f32, c as *mut f32);
            let beta = if beta == F::ZERO { 0.0 } else { 1.0 };
            // SAFETY: as the caller's; plans choose bf16 products only where `bf16::available()`.
            unsafe { super::bf16::gemm(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
        } else {
            // SAFETY: as the caller's.
            unsafe { F::gemm(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc, threads) }
        }
    };
    if 4 * padded(n, m) < 3 * padded(m, n) {
        product(n, m, b, csb, rsb, a, csa, rsa, csc, rsc)
    } else {
        product(m, n, a, rsa, csa, b, rsb, csb, rsc, csc)
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

/// `op(a) @ op(b)` into the row-major `c` (every element written).
pub fn matmul<F: HostFloat>(a: Mat<F>, b: Mat<F>, c: &mut [F], p: Products) {
    let ((m, k), (k2, n)) = (a.logical(), b.logical());
    assert_eq!(k, k2, "contracting extents checked by shape inference");
    assert!(a.data.len() >= a.rows * a.cols && b.data.len() >= b.rows * b.cols && c.len() == m * n);
    if k == 0 {
        return c.fill(F::ZERO);
    }
    let ((rsa, csa), (rsb, csb)) = (a.strides(), b.strides());
    // Products of 4 M multiply-adds or more use every thread of the pool (the GEMM splits
    // rows and columns, never the contraction: the same bits on any number of threads).
    let threads = if m * k * n >= 1 << 22 { rayon::current_num_threads() } else { 1 };
    // SAFETY: both views were checked to lie inside their slices; `c` is m x n.
    unsafe { gemm_oriented::<F>(m, k, n, a.data.as_ptr(), rsa, csa, b.data.as_ptr(), rsb, csb, F::ZERO, c.as_mut_ptr(), n as isize, 1, threads, p) };
}

/// `batch` products `op(a_i) @ op(b_i)` of `m x k` by `k x n`, each operand's matrices
/// consecutive, into the row-major `c`; the products are shared among the pool's threads.
#[allow(clippy::too_many_arguments)]
pub fn batch_matmul<F: HostFloat>(
    a: &[F],
    b: &[F],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
    c: &mut [F],
    p: Products,
) {
    let (sa, sb) = (m * k, k * n);
    let (ra, ca) = if transpose_a { (k, m) } else { (m, k) };
    let (rb, cb) = if transpose_b { (n, k) } else { (k, n) };
    let one = |(i, c): (usize, &mut [F])| {
        let lhs = Mat { data: &a[i * sa..(i + 1) * sa], rows: ra, cols: ca, transposed: transpose_a };
        let rhs = Mat { data: &b[i * sb..(i + 1) * sb], rows: rb, cols: cb, transposed: transpose_b };
        matmul(lhs, rhs, c, p);
    };
    if rayon::current_num_threads() > 1 && batch > 1 {
        use rayon::prelude::*;
        c.par_chunks_exact_mut(m * n).take(batch).enumerate().for_each(one);
    } else {
        c.chunks_exact_mut(m * n).take(batch).enumerate().for_each(one);
    }
}

/// Unfolds `channels` input planes (`x`, each `h*w`) into rows of `col`: row
/// `c*kh*kw + ky*kw + kx` holds the `oh*ow` inputs that kernel offset `(ky, kx)` of channel `c`
/// reads, at `col[row * ld..][..oh*ow]` (`ld` >= `oh*ow`: one image's block of a batch-wide
/// column matrix).
fn im2col<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F], ld: usize) {
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
fn col2im<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F], padded: &mut [F]) {
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
fn col2im_strided<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F]) {
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

/// Copies a short row (a convolution's output width) without a call to `memcpy`: eight
/// elements at a time, the tail as an overlapping last eight.
#[inline(always)]
pub(super) fn copy_row<F: Copy>(d: &mut [F], s: &[F]) {
    let n = d.len();
    if n < 8 {
        if n < 4 {
            return d.copy_from_slice(s);
        }
        // Four at a time, the tail as an overlapping last four (ResNet's 4x4 maps).
        let (a, b): ([F; 4], [F; 4]) = (s[..4].try_into().expect("four"), s[n - 4..n].try_into().expect("four"));
        d[..4].copy_from_slice(&a);
        d[n - 4..].copy_from_slice(&b);
        return;
    }
    let s = &s[..n];
    let mut i = 0;
    while i + 8 <= n {
        let c: [F; 8] = s[i..i + 8].try_into().expect("eight elements");
        d[i..i + 8].copy_from_slice(&c);
        i += 8;
    }
    if i < n {
        let c: [F; 8] = s[n - 8..].try_into().expect("eight elements");
        d[n - 8..].copy_from_slice(&c);
    }
}

/// [`im2col`] for stride 1, dilation 1 and no padding (LeNet's and most 'valid'
/// convolutions): every row of `col` is `oh` input row segments, copied inline.
fn im2col_dense<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F], ld: usize) {
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
fn col2im_dense<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F]) {
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
fn col2im_padded<F: HostFloat>(g: &Geometry, col: &[F], ld: usize, channels: usize, x: &mut [F], padded: &mut [F]) {
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
fn add_row<F: HostFloat>(d: &mut [F], s: &[F]) {
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

/// A chunk's column matrix stays within about this many bytes (a core's L2 cache; larger
/// chunks give the GEMMs of small maps more columns: ResNet-18's epoch 0.91x the time of
/// 256 KiB chunks on one thread).
const CHUNK_BYTES: usize = 1 << 20;

/// The kernel taps that read an input element for some output, `[rows, cols]` of taps, when
/// others never do (a 3x3 convolution padded by 1 on a 1x1 map reads its centre alone): the
/// geometry of the convolution by the cropped kernel, and the first tap kept on each axis.
/// The cropped convolution computes the same sums without the terms that are always zero.
fn cropped(g: &Geometry) -> Option<(Geometry, [usize; 2])> {
    let live = |a: usize| {
        let read = |k: usize| (0..g.out[a]).any(|o| g.at(a, o, k).is_some());
        let lo = (0..g.kernel[a]).find(|&k| read(k))?;
        let hi = (0..g.kernel[a]).rev().find(|&k| read(k))? + 1;
        Some((lo, hi))
    };
    let (r, c) = (live(0)?, live(1)?);
    if (r.1 - r.0, c.1 - c.0) == (g.kernel[0], g.kernel[1]) {
        return None;
    }
    let pad = [g.pad[0].checked_sub(r.0 * g.dilation[0])?, g.pad[1].checked_sub(c.0 * g.dilation[1])?];
    Some((Geometry { kernel: [r.1 - r.0, c.1 - c.0], pad, ..*g }, [r.0, c.0]))
}

/// `f` on the filter `w` (of `big`'s kernel) cropped to the taps `at..at + small.kernel` of
/// every `[kh, kw]` plane, held in the calling thread's partials buffer.
fn with_cropped_filter<F: HostFloat, R>(w: &[F], big: &Geometry, small: &Geometry, at: [usize; 2], f: impl FnOnce(&[F]) -> R) -> R {
    let ([bh, bw], [sh, sw]) = (big.kernel, small.kernel);
    F::partials(w.len() / (bh * bw) * sh * sw, |out| {
        for (plane, dst) in w.chunks_exact(bh * bw).zip(out.chunks_exact_mut(sh * sw)) {
            for (r, row) in dst.chunks_exact_mut(sw).enumerate() {
                row.copy_from_slice(&plane[(at[0] + r) * bw + at[1]..][..sw]);
            }
        }
        f(out)
    })
}

/// Images per chunk of a convolution: the batch is cut into chunks whose column matrices
/// fit in L2; chunks run on the rayon pool's threads. The cut depends on the shapes only,
/// never on the thread count, so neither do the results.
fn chunk_images<F>(d: &ConvDims, n: usize) -> usize {
    let per_image = d.kk * d.sp * std::mem::size_of::<F>();
    let n = n.max(1);
    let most = (CHUNK_BYTES / per_image.max(1)).clamp(1, n);
    // As many chunks as that needs, rounded up to a power of two so that two or four threads
    // share them evenly (five chunks on two threads left one idle for a fifth of the time),
    // of sizes as equal as they can be.
    n.div_ceil(n.div_ceil(most).next_power_of_two().min(n))
}

/// The threads one chunk's GEMM may use: all of rayon's when the batch is one chunk (else
/// the chunks are the threads' work).
fn gemm_threads(chunks: usize) -> usize {
    if chunks == 1 {
        rayon::current_num_threads()
    } else {
        1
    }
}

/// The geometry of images `[i0, i0 + m)` of `g`'s batch.
fn sub_batch(g: &Geometry, m: usize) -> Geometry {
    Geometry { x: [m, g.x[1], g.x[2], g.x[3]], ..*g }
}

/// Runs `f` on every item, across `rayon::current_num_threads()` threads when that is more
/// than one (one thread per rank under `mpirun`: see [`crate::comm`]).
///
/// On a pool thread (a plan runs on one: see [`crate::Session::run`]) each item is a job: this
/// thread works through them from its end of its queue while the other threads steal from the
/// front, and whatever no thread has taken it runs itself, so it never waits for a thread that
/// has not woken up. From outside the pool the items are cut into that many contiguous shares;
/// the calling thread works through one share itself while the pool's threads take the others.
pub(super) fn each<T: Send>(items: Vec<T>, f: impl Fn(T) + Send + Sync) {
    let threads = rayon::current_num_threads().min(items.len());
    if threads <= 1 {
        return items.into_iter().for_each(f);
    }
    let f = &f;
    if rayon::current_thread_index().is_some() {
        return rayon::in_place_scope(|s| {
            for item in items {
                s.spawn(move |_| f(item));
            }
        });
    }
    let per = items.len().div_ceil(threads);
    let mut shares: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut rest = items.into_iter();
    loop {
        let share: Vec<T> = rest.by_ref().take(per).collect();
        if share.is_empty() {
            break;
        }
        shares.push(share);
    }
    let mine = shares.remove(0);
    rayon::in_place_scope(|s| {
        for share in shares {
            s.spawn(move |_| share.into_iter().for_each(f));
        }
        mine.into_iter().for_each(f);
    });
}

/// Unfolds group `gi` of every image into the batch-wide column matrix `col`
/// (`[kk, n * oh * ow]`, image `i` in columns `i*sp..(i+1)*sp`). Padded convolutions go
/// through a zero-padded copy of each plane ([`im2col_padded`]).
fn im2col_batch<F: HostFloat>(g: &Geometry, d: &ConvDims, gi: usize, x: &[F], col: &mut [F]) {
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
fn padded_extents(g: &Geometry) -> [usize; 2] {
    [0, 1].map(|a| (g.out[a] - 1) * g.stride[a] + (g.kernel[a] - 1) * g.dilation[a] + 1)
}

/// The input planes a padded plane (`pw` wide, zero outside the interior) holds: rows and
/// columns of each plane that land inside it, at offset `pad`.
fn interior(g: &Geometry, ph: usize, pw: usize) -> [usize; 2] {
    [g.x[2].min(ph.saturating_sub(g.pad[0])), g.x[3].min(pw.saturating_sub(g.pad[1]))]
}

/// [`im2col`] through `padded`, a plane of [`padded_extents`] whose border is zero: each
/// channel's plane is copied into its interior, then every row of `col` is `oh` reads of it
/// without bounds (on ResNet's 8x8 and 4x4 maps, the per-row `memset`s and `memcpy`s of the
/// clipped rows cost more than the copying).
fn im2col_padded<F: HostFloat>(g: &Geometry, x: &[F], channels: usize, col: &mut [F], ld: usize, padded: &mut [F], pw: usize) {
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

/// Convolution: `x` `[n, c, h, w]`, `w` `[o, c/groups, kh, kw]` -> `[n, o, oh, ow]`. Per chunk
/// of images and group, one GEMM: `w_g [og, kk] @ col [kk, m*oh*ow]`; `post` runs on each
/// chunk's output.
#[allow(clippy::too_many_arguments)]
pub fn conv2d<F: HostFloat>(g: &Geometry, groups: usize, x: &[F], w: &[F], o: usize, y: &mut [F], post: Post<F>, p: Products) {
    if let Some(taps) = toeplitz::taps(g, groups, o) {
        return toeplitz::forward(g, &taps, x, w, o, y, post, p);
    }
    if let Some((small, at)) = cropped(g) {
        return with_cropped_filter(w, g, &small, at, |wc| conv2d(&small, groups, x, wc, o, y, post, p));
    }
    let d = conv_dims(g, groups, o);
    let [n, c, h, wd] = g.x;
    assert_eq!(y.len(), n * o * d.sp, "output extents");
    if y.is_empty() {
        return;
    }
    let per = chunk_images::<F>(&d, n);
    let par = gemm_threads(n.div_ceil(per));
    let chunks: Vec<_> = y.chunks_mut(per * o * d.sp).enumerate().collect();
    each(chunks, |(k, yc)| {
        let sub = sub_batch(g, yc.len() / (o * d.sp));
        let dc = conv_dims(&sub, groups, o);
        let xc = &x[k * per * c * h * wd..][..sub.x[0] * c * h * wd];
        F::scratch(dc.kk * dc.cols + dc.og * dc.cols, |s| {
            let (col, rows) = s.split_at_mut(dc.kk * dc.cols);
            for gi in 0..groups {
                im2col_batch(&sub, &dc, gi, xc, col);
                let wg = &w[gi * dc.og * dc.kk..(gi + 1) * dc.og * dc.kk];
                // SAFETY: wg is og x kk, col is kk x cols, rows is og x cols, all row-major.
                unsafe {
                    gemm_oriented::<F>(
                        dc.og,
                        dc.kk,
                        dc.cols,
                        wg.as_ptr(),
                        dc.kk as isize,
                        1,
                        col.as_ptr(),
                        dc.cols as isize,
                        1,
                        F::ZERO,
                        rows.as_mut_ptr(),
                        dc.cols as isize,
                        1,
                        par,
                        p,
                    )
                };
                scatter_rows(&dc, o, gi, rows, yc);
            }
        });
        if let Some(post) = post {
            post(k * per * o * d.sp, yc);
        }
    });
}

/// Gradient of [`conv2d`] w.r.t. its input: `dy` `[n, o, oh, ow]` -> `[n, c, h, w]`. Per chunk
/// and group, `w_g^T [kk, og] @ dy_g [og, m*oh*ow]`, then col2im image by image.
pub fn conv2d_input_grad<F: HostFloat>(g: &Geometry, groups: usize, dy: &[F], w: &[F], o: usize, dx: &mut [F], p: Products) {
    if let Some(taps) = toeplitz::taps(g, groups, o) {
        return toeplitz::input_grad(g, &taps, dy, w, o, dx, p);
    }
    if let Some((small, at)) = cropped(g) {
        return with_cropped_filter(w, g, &small, at, |wc| conv2d_input_grad(&small, groups, dy, wc, o, dx, p));
    }
    let d = conv_dims(g, groups, o);
    let [n, c, h, wi] = g.x;
    assert_eq!(dx.len(), n * c * h * wi, "output extents");
    dx.fill(F::ZERO);
    if dx.is_empty() || d.sp == 0 {
        return;
    }
    let per = chunk_images::<F>(&d, n);
    let par = gemm_threads(n.div_ceil(per));
    let chunks: Vec<_> = dx.chunks_mut(per * c * h * wi).enumerate().collect();
    each(chunks, |(k, dxc)| {
        let sub = sub_batch(g, dxc.len() / (c * h * wi));
        let dc = conv_dims(&sub, groups, o);
        let dyc = &dy[k * per * o * dc.sp..][..sub.x[0] * o * dc.sp];
        let [ph, pw] = padded_extents(g);
        F::scratch(dc.kk * dc.cols + dc.og * dc.cols + ph * pw, |s| {
            let (col, rest) = s.split_at_mut(dc.kk * dc.cols);
            let (rows, padded) = rest.split_at_mut(dc.og * dc.cols);
            for gi in 0..groups {
                gather_rows(&dc, o, gi, dyc, rows);
                let wg = &w[gi * dc.og * dc.kk..(gi + 1) * dc.og * dc.kk];
                // SAFETY: wg^T is kk x og (read with swapped strides), rows is og x cols, col kk x cols.
                unsafe {
                    gemm_oriented::<F>(
                        dc.kk,
                        dc.og,
                        dc.cols,
                        wg.as_ptr(),
                        1,
                        dc.kk as isize,
                        rows.as_ptr(),
                        dc.cols as isize,
                        1,
                        F::ZERO,
                        col.as_mut_ptr(),
                        dc.cols as isize,
                        1,
                        par,
                        p,
                    )
                };
                for i in 0..sub.x[0] {
                    col2im(
                        &sub,
                        &col[i * dc.sp..],
                        dc.cols,
                        dc.cg,
                        &mut dxc[(i * c + gi * dc.cg) * h * wi..(i * c + (gi + 1) * dc.cg) * h * wi],
                        padded,
                    );
                }
            }
        })
    });
}

/// Gradient of [`conv2d`] w.r.t. its filter: `[o, c/groups, kh, kw]`. Per chunk and group, one
/// GEMM contracting over the chunk's pixels, `dy_g [og, m*oh*ow] @ col^T [m*oh*ow, kk]`; the
/// chunks' partial sums are then added in chunk order (so the thread count changes nothing).
///
/// With few output channels the product is made transposed, as `[kk, og]`, and turned back
/// while the chunks are added. The GEMM computes a row-major product as its transpose, packing
/// its left operand and streaming its right one: `dw`'s own layout makes the column matrix the
/// packed one, a strided gather of `kk * m*oh*ow` elements per chunk, as costly as the
/// arithmetic when `og` is 64 (ResNet-18's stem and layer1: 0.71x and 0.78x the time, by
/// `cargo bench --bench kernels`); `[kk, og]` packs the chunk's `dy` instead. With 128 output
/// channels the arithmetic hides the packing and `dw`'s layout is faster (layer2: 1.19x the
/// time transposed). `post` runs on the output in parts, as each is finished.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_filter_grad<F: HostFloat>(g: &Geometry, groups: usize, dy: &[F], x: &[F], o: usize, dw: &mut [F], post: Post<F>, p: Products) {
    if let Some(taps) = toeplitz::taps(g, groups, o) {
        return toeplitz::filter_grad(g, &taps, dy, x, o, dw, post, p);
    }
    if let Some((small, at)) = cropped(g) {
        // The cropped gradient, then written into its taps' places; the others are zero.
        let (big, little) = (g.kernel[0] * g.kernel[1], small.kernel[0] * small.kernel[1]);
        let planes = dw.len() / big;
        return F::partials(planes * little, |part| {
            conv2d_filter_grad(&small, groups, dy, x, o, part, None, p);
            dw.fill(F::ZERO);
            for r in 0..small.kernel[0] {
                for c in 0..small.kernel[1] {
                    let (from, to) = (r * small.kernel[1] + c, (at[0] + r) * g.kernel[1] + at[1] + c);
                    for (d, s) in dw.chunks_exact_mut(big).zip(part.chunks_exact(little)) {
                        d[to] = s[from];
                    }
                }
            }
            post_all(post, dw);
        });
    }
    let d = conv_dims(g, groups, o);
    let n = g.x[0];
    let size = o * d.kk;
    assert_eq!(dw.len(), size, "output extents");
    let per = chunk_images::<F>(&d, n);
    let chunks = n.div_ceil(per);
    if chunks == 0 || size == 0 {
        return dw.fill(F::ZERO);
    }
    if d.og > 64 || d.kk < d.og {
        // In dw's layout: the first chunk's sum is made in dw itself, the others in
        // thread-local memory.
        return F::partials((chunks - 1) * size, |rest| {
            let parts: Vec<_> = std::iter::once(&mut *dw).chain(rest.chunks_mut(size)).enumerate().collect();
            filter_grad_chunks(g, groups, dy, x, o, per, false, parts, p);
            for part in rest.chunks_exact(size) {
                add_assign(dw, part);
            }
            post_all(post, dw);
        });
    }
    F::partials(chunks * size, |parts| {
        filter_grad_chunks(g, groups, dy, x, o, per, true, parts.chunks_mut(size).enumerate().collect(), p);
        let parts = &*parts;
        // Per group, dw_g [og, kk] = the sum of the chunks' [kk, og], in tiles that keep both
        // sides' lines in L1.
        const TILE: usize = 16;
        for gi in 0..groups {
            let at = gi * d.og * d.kk;
            for o0 in (0..d.og).step_by(TILE) {
                for t0 in (0..d.kk).step_by(TILE) {
                    for oc in o0..(o0 + TILE).min(d.og) {
                        for t in t0..(t0 + TILE).min(d.kk) {
                            let i = at + t * d.og + oc;
                            let mut sum = parts[i];
                            for part in parts.chunks_exact(size).skip(1) {
                                sum += part[i];
                            }
                            dw[at + oc * d.kk + t] = sum;
                        }
                    }
                }
                // These output channels' rows are done: `post` while they are in cache.
                if let Some(post) = post {
                    let rows = at + o0 * d.kk..at + (o0 + TILE).min(d.og) * d.kk;
                    post(rows.start, &mut dw[rows]);
                }
            }
        }
    })
}

/// Chunk `k`'s filter gradient (images `k*per..`) into each `(k, part)`, per group `[og, kk]`,
/// or `[kk, og]` if `transposed`.
#[allow(clippy::too_many_arguments)]
fn filter_grad_chunks<F: HostFloat>(
    g: &Geometry,
    groups: usize,
    dy: &[F],
    x: &[F],
    o: usize,
    per: usize,
    transposed: bool,
    parts: Vec<(usize, &mut [F])>,
    p: Products,
) {
    let [n, c, h, wd] = g.x;
    let par = gemm_threads(parts.len());
    let chunks = parts;
    each(chunks, |(k, part)| {
        let sub = sub_batch(g, per.min(n - k * per));
        let dc = conv_dims(&sub, groups, o);
        let xc = &x[k * per * c * h * wd..][..sub.x[0] * c * h * wd];
        let dyc = &dy[k * per * o * dc.sp..][..sub.x[0] * o * dc.sp];
        let (rsc, csc) = if transposed { (1, dc.og as isize) } else { (dc.kk as isize, 1) };
        F::scratch(dc.kk * dc.cols + dc.og * dc.cols, |s| {
            let (col, rows) = s.split_at_mut(dc.kk * dc.cols);
            for gi in 0..groups {
                im2col_batch(&sub, &dc, gi, xc, col);
                gather_rows(&dc, o, gi, dyc, rows);
                let dwg = &mut part[gi * dc.og * dc.kk..(gi + 1) * dc.og * dc.kk];
                // SAFETY: rows is og x cols, col^T is cols x kk (swapped strides), dwg is og x kk
                // (row-major, or column-major as the row-major [kk, og]).
                unsafe {
                    gemm_oriented::<F>(
                        dc.og,
                        dc.cols,
                        dc.kk,
                        rows.as_ptr(),
                        dc.cols as isize,
                        1,
                        col.as_ptr(),
                        1,
                        dc.cols as isize,
                        F::ZERO,
                        dwg.as_mut_ptr(),
                        rsc,
                        csc,
                        par,
                        p,
                    )
                };
            }
        })
    });
}

/// Marks a max-pooling window that lies entirely in padding (its output is -inf and it
/// passes no gradient).
pub const NO_ARGMAX: u32 = u32::MAX;

/// For each output of a max pool over one plane, the flat index (within the plane) of the
/// window's first largest input (its last NaN, if it has one), or [`NO_ARGMAX`], into `at`,
/// and its value into `y` (-inf where none): [`argmax_one`]'s winner, always.
#[inline(always)]
fn argmax_windows<F: HostFloat>(g: &Geometry, plane: &[F], at: &mut [u32], y: &mut [F], s: &mut PoolScratch<F>) {
    if is_2x2(g) {
        pool_2x2(g, plane, at, y)
    } else {
        pool_separable(g, plane, at, y, s)
    }
}

/// Scratch of [`pool_separable`]: a padded input row, and each input row's pooled values and
/// their indices.
struct PoolScratch<F> {
    row: Vec<F>,
    hv: Vec<F>,
    hi: Vec<u32>,
}

impl<F: HostFloat> PoolScratch<F> {
    fn new(g: &Geometry) -> Self {
        if is_2x2(g) {
            // [`pool_2x2`] needs none.
            return PoolScratch { row: Vec::new(), hv: Vec::new(), hi: Vec::new() };
        }
        // The padded row reaches the last window's last column; each phase as long as the
        // longest.
        let len = (g.out[1].max(1) - 1) * g.stride[1] + (g.kernel[1].max(1) - 1) * g.dilation[1] + 1;
        let rows = g.x[2] * g.out[1];
        PoolScratch { row: vec![F::NEG_INF; len.div_ceil(g.stride[1]) * g.stride[1]], hv: vec![F::ZERO; rows], hi: vec![0; rows] }
    }
}

/// Any max pool over one plane, in two passes: along each input row, the best of each
/// output column's window taps (padding is -inf and never taken); then down the window's
/// rows, the best of those. Taking `v` over the best so far `b` when `v > b` or `v` is NaN,
/// in window order, the row pass keeps a row's last NaN, else its first largest; the column
/// pass then keeps the last row's with a NaN, else the first row's with the largest: the
/// window's last NaN, else its first largest, which is what [`argmax_one`] keeps. Both passes
/// run along a row of outputs without branches on the data. An output still at -inf (every
/// input it reads is -inf, or it reads none) goes through [`argmax_one`], which picks the
/// first input, or none.
#[inline(always)]
fn pool_separable<F: HostFloat>(g: &Geometry, plane: &[F], at: &mut [u32], y: &mut [F], s: &mut PoolScratch<F>) {
    let [_, _, h, w] = g.x;
    let ([kh, kw], [sy, sx], [dy, dx], [py, px]) = (g.kernel, g.stride, g.dilation, g.pad);
    let ow = g.out[1];
    // The padded row, dealt into `sx` phases (phase `j % sx` holds padded column `j` at
    // `j / sx`), so that each tap reads its outputs' inputs contiguously.
    let plen = s.row.len() / sx;
    for r in 0..h {
        let src = &plane[r * w..][..w];
        for (ph, dst) in s.row.chunks_exact_mut(plen).enumerate() {
            for (i, d) in dst.iter_mut().enumerate() {
                if let Some(&v) = (i * sx + ph).checked_sub(px).and_then(|c| src.get(c)) {
                    *d = v;
                }
            }
        }
        let (hv, hi) = (&mut s.hv[r * ow..][..ow], &mut s.hi[r * ow..][..ow]);
        hv.fill(F::NEG_INF);
        for kx in 0..kw {
            let j = kx * dx;
            let taps = &s.row[(j % sx) * plen + j / sx..][..ow];
            // The index of padded column `j` is `r * w + j - px` (wrapping: padding is
            // never taken).
            let first = ((r * w + j) as u32).wrapping_sub(px as u32);
            for (ox, ((b, a), &v)) in hv.iter_mut().zip(hi.iter_mut()).zip(taps).enumerate() {
                let t = takes(v, *b);
                *b = if t { v } else { *b };
                *a = if t { first.wrapping_add((ox * sx) as u32) } else { *a };
            }
        }
    }
    for (oy, (at, y)) in at.chunks_exact_mut(ow).zip(y.chunks_exact_mut(ow)).enumerate() {
        y.fill(F::NEG_INF);
        at.fill(NO_ARGMAX);
        for ky in 0..kh {
            let Some(r) = (oy * sy + ky * dy).checked_sub(py).filter(|&r| r < h) else { continue };
            for ((b, a), (&v, &i)) in y.iter_mut().zip(at.iter_mut()).zip(s.hv[r * ow..][..ow].iter().zip(&s.hi[r * ow..][..ow])) {
                let t = takes(v, *b);
                *b = if t { v } else { *b };
                *a = if t { i } else { *a };
            }
        }
        for (ox, (b, a)) in y.iter().zip(at.iter_mut()).enumerate() {
            if *b == F::NEG_INF {
                *a = argmax_one(g, plane, oy, ox);
            }
        }
    }
}

/// No padding, and every window inside the plane.
fn windows_inside(g: &Geometry) -> bool {
    let inside = |a: usize| g.out[a] > 0 && (g.out[a] - 1) * g.stride[a] + (g.kernel[a] - 1) * g.dilation[a] < g.x[2 + a];
    g.pad == [0, 0] && inside(0) && inside(1)
}

/// 2x2 windows at stride 2, all inside the plane: [`pool_2x2`]'s case.
fn is_2x2(g: &Geometry) -> bool {
    g.kernel == [2, 2] && g.stride == [2, 2] && g.dilation == [1, 1] && windows_inside(g)
}

/// Whether a fast pooling path takes `v` over the best so far `b`: when greater, or NaN (so a
/// window's last NaN wins, else its first largest input), as [`argmax_one`] does. That one
/// keeps its own comparison: it is the reference the paths are tested against.
#[inline(always)]
fn takes<F: HostFloat>(v: F, b: F) -> bool {
    v > b || v.is_nan()
}

/// The argmax of output `(oy, ox)`'s window, padded or not: its inputs in window order, the
/// first largest kept (the last NaN, if any), padding skipped; [`NO_ARGMAX`] if it reads none.
fn argmax_one<F: HostFloat>(g: &Geometry, plane: &[F], oy: usize, ox: usize) -> u32 {
    // The first input row (or column) of output `o`'s window along axis `a`, the step, and
    // the kernel offsets `[lo, hi)` that land inside the input (`lo == hi`: none).
    let span = |a: usize, o: usize| {
        let start = (o * g.stride[a]) as isize - g.pad[a] as isize;
        let (d, x) = (g.dilation[a] as isize, g.x[2 + a] as isize);
        let lo = if start < 0 { (-start + d - 1) / d } else { 0 };
        let hi = if x > start { ((x - start + d - 1) / d).min(g.kernel[a] as isize) } else { 0 };
        (start, d, lo, hi.max(lo))
    };
    let w = g.x[3];
    let (ys, ysd, ky0, ky1) = span(0, oy);
    let (xs, xsd, kx0, kx1) = span(1, ox);
    let (mut best, mut at) = (F::NEG_INF, NO_ARGMAX);
    for ky in ky0..ky1 {
        let row = (ys + ky * ysd) as usize * w;
        for kx in kx0..kx1 {
            let i = row + (xs + kx * xsd) as usize;
            let v = plane[i];
            if at == NO_ARGMAX || v > best || v.is_nan() {
                (best, at) = (v, i as u32);
            }
        }
    }
    at
}

/// 2x2 max pooling at stride 2 over one plane: each window's maximum into `y` and its index
/// into `at`, the comparisons of [`argmax_one`] in one pass the compiler vectorises.
#[inline(always)]
fn pool_2x2<F: HostFloat>(g: &Geometry, plane: &[F], at: &mut [u32], y: &mut [F]) {
    let (w, ow) = (g.x[3], g.out[1]);
    for (oy, (at, y)) in at.chunks_exact_mut(ow).zip(y.chunks_exact_mut(ow)).enumerate() {
        let top = 2 * oy * w;
        let (r0, r1) = (&plane[top..top + 2 * ow], &plane[top + w..top + w + 2 * ow]);
        let (at, y) = (&mut at[..ow], &mut y[..ow]);
        for ox in 0..ow {
            let (a, b, c, d) = (r0[2 * ox], r0[2 * ox + 1], r1[2 * ox], r1[2 * ox + 1]);
            // Left to right along the top row, then the bottom row; `k` the winner's place.
            let t1 = takes(b, a);
            let m1 = if t1 { b } else { a };
            let k1 = t1 as u32;
            let t2 = takes(c, m1);
            let m2 = if t2 { c } else { m1 };
            let k2 = if t2 { w as u32 } else { k1 };
            let t3 = takes(d, m2);
            y[ox] = if t3 { d } else { m2 };
            at[ox] = (top + 2 * ox) as u32 + if t3 { w as u32 + 1 } else { k2 };
        }
    }
}

/// Planes per parallel task of a pooling kernel: one task per thread, as long as each holds
/// about 32 Ki inputs or more (planes are independent, so the cut never changes the bits).
fn planes_per_task(g: &Geometry) -> usize {
    let plane = (g.x[2] * g.x[3]).max(1);
    let planes = g.x[0] * g.x[1];
    let tasks = (planes * plane / (32 << 10)).clamp(1, most_shares());
    planes.div_ceil(tasks).max(1)
}

/// [`argmax_windows`] over planes as a [`vectorized`] op (too large for a closure: see there):
/// `planes` consecutive planes of `x` from plane `first`.
struct PoolPlanes<'a, F> {
    g: &'a Geometry,
    x: &'a [F],
    first: usize,
    at: &'a mut [u32],
    y: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for PoolPlanes<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let [_, _, h, w] = self.g.x;
        let sp = self.g.spatial();
        let mut s = PoolScratch::new(self.g);
        for (p, (at, y)) in self.at.chunks_exact_mut(sp).zip(self.y.chunks_exact_mut(sp)).enumerate() {
            let p = self.first + p;
            argmax_windows(self.g, &self.x[p * h * w..(p + 1) * h * w], at, y, &mut s);
        }
    }
}

/// The argmax of every max-pooling window over NCHW `x` into `at` (`[n, c, oh, ow]`; see
/// [`argmax_windows`]): what the forward returns and its gradient routes by.
pub fn max_pool2d_argmax<F: HostFloat>(g: &Geometry, x: &[F], at: &mut [u32]) {
    let sp = g.spatial();
    if sp == 0 || at.is_empty() {
        return;
    }
    let per = planes_per_task(g);
    let tasks: Vec<_> = at.chunks_mut(per * sp).enumerate().collect();
    each(tasks, |(k, at)| {
        let mut y = vec![F::ZERO; at.len()];
        vectorized(PoolPlanes { g, x, first: k * per, at, y: &mut y })
    });
}

/// Max pooling over NCHW `x`; padding never wins. Writes each window's argmax into `at`
/// (`[n, c, oh, ow]`), which [`max_pool2d_grad`] takes, so the gradient needs no second pass.
pub fn max_pool2d<F: HostFloat>(g: &Geometry, x: &[F], at: &mut [u32], y: &mut [F]) {
    let sp = g.spatial();
    assert_eq!(y.len(), at.len(), "output extents");
    if sp == 0 || y.is_empty() {
        return;
    }
    let per = planes_per_task(g);
    let tasks: Vec<_> = at.chunks_mut(per * sp).zip(y.chunks_mut(per * sp)).enumerate().collect();
    each(tasks, |(k, (at, y))| vectorized(PoolPlanes { g, x, first: k * per, at, y }));
}

/// Gradient of [`max_pool2d`] from its argmax `at`: each output's gradient goes to its
/// window's first maximum. `post` runs on each task's planes.
pub fn max_pool2d_grad<F: HostFloat>(g: &Geometry, at: &[u32], dy: &[F], dx: &mut [F], post: Post<F>) {
    let [n, c, h, w] = g.x;
    let sp = g.spatial();
    assert_eq!(dx.len(), n * c * h * w, "output extents");
    if sp == 0 || dx.is_empty() {
        dx.fill(F::ZERO);
        return post_all(post, dx);
    }
    let per = planes_per_task(g);
    let tasks: Vec<_> = dx.chunks_mut(per * h * w).enumerate().collect();
    each(tasks, |(k, dx)| {
        dx.fill(F::ZERO);
        let (at, dy) = (&at[k * per * sp..], &dy[k * per * sp..]);
        for ((d, at), dy) in dx.chunks_exact_mut(h * w).zip(at.chunks_exact(sp)).zip(dy.chunks_exact(sp)) {
            for (&i, &g) in at.iter().zip(dy) {
                if i != NO_ARGMAX {
                    d[i as usize] += g;
                }
            }
        }
        if let Some(post) = post {
            post(k * per * h * w, dx);
        }
    });
}

/// `dy` where `x > 0`, else zero.
/// ReLU with one answer for NaN and -0 (+0): burn-ndarray's SIMD max gives +0 while its
/// scalar path (short or strided tensors) keeps them, so the host plans run this instead.
#[inline(always)]
fn relu1<F: HostFloat>(v: F) -> F {
    if v > F::ZERO {
        v
    } else {
        F::ZERO
    }
}

pub fn relu<F: HostFloat>(x: &[F], y: &mut [F]) {
    vectorized(
        #[inline(always)]
        || y.iter_mut().zip(x).for_each(|(y, &v)| *y = relu1(v)),
    )
}

pub fn relu_grad<F: HostFloat>(dy: &[F], x: &[F], dx: &mut [F]) {
    vectorized(
        #[inline(always)]
        || dx.iter_mut().zip(dy.iter().zip(x)).for_each(|(o, (&d, &v))| *o = if v > F::ZERO { d } else { F::ZERO }),
    )
}

/// `acc += g`, elementwise (the bits of burn's `acc + g`).
pub fn add_assign<F: HostFloat>(acc: &mut [F], g: &[F]) {
    vectorized(
        #[inline(always)]
        || acc.iter_mut().zip(g).for_each(|(a, &b)| *a += b),
    )
}

/// The sum over the rows of a row-major `[rows, cols]` matrix into `out` (`cols`), added
/// row after row onto zeros: the order (and so the bits) of ndarray's `sum_axis(Axis(0))`,
/// which burn-ndarray's `sum_dim` runs, for a matrix with more than one column.
pub fn sum_rows<F: HostFloat>(x: &[F], out: &mut [F]) {
    let rows = x.len().checked_div(out.len()).unwrap_or(0);
    sum_planes(x, rows, 1, None, out)
}

/// The sum of `x` (`[outer, out.len(), inner]`) over its first and last axes, times `scale`:
/// each run of `inner` summed on its own (ndarray's unrolled sum; in order when short), then
/// the runs added into `out` in order of the first axis. Threads take shares of `out`, each
/// element summed in that order whatever the cut.
pub fn sum_planes<F: HostFloat>(x: &[F], outer: usize, inner: usize, scale: Option<F>, out: &mut [F]) {
    let kept = out.len();
    let x = &x[..outer * kept * inner];
    // Sums over rows (`inner == 1`, a bias's gradient) share out `out` by 4 KiB: a thread
    // adds every row into its part, and parts of 16 elements (8 shares of 128) made the
    // threads take cache lines from each other once per row (`[1024, 128] -> [128]` took
    // 3.3x as long on two threads as on one); shares of 256 still lost to one thread on the
    // GPT's `[1024, 512] -> [512]`.
    let unit = if inner == 1 { 4096 / std::mem::size_of::<F>() } else { 1 };
    shares_of(out, unit, x.len(), |first, part| {
        let (first, n) = (first * unit, part.len());
        part.fill(F::ZERO);
        for plane in x.chunks_exact(kept * inner) {
            let runs = &plane[first * inner..(first + n) * inner];
            if inner == 1 {
                add_assign(part, runs);
            } else {
                for (o, run) in part.iter_mut().zip(runs.chunks_exact(inner)) {
                    *o += if inner >= 16 { F::ndarray_sum(run) } else { run.iter().fold(F::ZERO, |s, &v| s + v) };
                }
            }
        }
        if let Some(s) = scale {
            part.iter_mut().for_each(|v| *v = *v * s);
        }
    });
}

/// One row's log-softmax in `z` (`[c]` logits in, `logit - max - ln(sum(exp(logit - max)))`
/// out), in the order of the reference lowering's burn ops.
fn log_softmax_row<F: HostFloat>(row: &[F], z: &mut [F], e: &mut [F]) {
    let m = row.iter().copied().fold(F::NEG_INF, |m, x| if x > m { x } else { m });
    for ((z, e), &x) in z.iter_mut().zip(e.iter_mut()).zip(row) {
        *z = x - m;
        *e = z.exp();
    }
    let lse = F::ndarray_sum(e).ln();
    z.iter_mut().for_each(|z| *z = *z - lse);
}

/// The class id at batch position `i`, if it is one of `c` classes.
fn class(labels: &[i64], i: usize, c: usize) -> Option<usize> {
    usize::try_from(labels[i]).ok().filter(|&l| l < c)
}

/// Softmax cross-entropy of `[n, c]` `logits` against class ids (`-log_softmax[label]` per
/// item, then summed or averaged as `reduction` says) into `out` (`[n]` or one element),
/// and each row's log-softmax into `keep` (`[n, c]`) when given, for the gradient.
/// `false` (nothing written) when a label is out of range: the reference lowering
/// then reports it. The same ops in the same order as the reference lowering on burn's ops,
/// so the same bits.
pub fn softmax_cross_entropy<F: HostFloat>(
    logits: &[F],
    labels: &[i64],
    c: usize,
    reduction: Reduction,
    out: &mut [F],
    mut keep: Option<&mut [F]>,
) -> bool {
    let n = labels.len();
    // Every label first: a bad one leaves nothing kept for a gradient.
    if (0..n).any(|i| class(labels, i, c).is_none()) {
        return false;
    }
    F::scratch(2 * c + n, |s| {
        let (z, rest) = s.split_at_mut(c);
        let (e, items) = rest.split_at_mut(c);
        for (i, row) in logits.chunks_exact(c).enumerate().take(n) {
            let Some(l) = class(labels, i, c) else { return false };
            let z = match keep.as_deref_mut() {
                Some(k) => &mut k[i * c..(i + 1) * c],
                None => &mut *z,
            };
            log_softmax_row(row, z, e);
            items[i] = z[l] * F::from_f64(-1.0);
        }
        match reduction {
            Reduction::None => out.copy_from_slice(items),
            Reduction::Sum => out[0] = F::ndarray_sum(items),
            Reduction::Mean => out[0] = F::ndarray_sum(items) * F::from_f64(1.0 / n as f64),
        }
        true
    })
}

/// The gradient of [`softmax_cross_entropy`] w.r.t. the logits: `(softmax - one_hot) * dl`,
/// `dl` per item (no reduction), as given (sum) or divided by `n` (mean). The log-softmax is
/// the forward's (`kept`, the same bits) when given, else computed again from `logits`.
/// `false` when a label is out of range.
pub fn softmax_cross_entropy_grad<F: HostFloat>(
    logits: &[F],
    kept: Option<&[F]>,
    labels: &[i64],
    dl: &[F],
    c: usize,
    reduction: Reduction,
    dx: &mut [F],
) -> bool {
    let n = labels.len();
    F::scratch(c, |e| {
        for (i, (row, d)) in logits.chunks_exact(c).zip(dx.chunks_exact_mut(c)).enumerate().take(n) {
            let Some(l) = class(labels, i, c) else { return false };
            let scale = match reduction {
                Reduction::None => dl[i],
                Reduction::Sum => dl[0],
                Reduction::Mean => dl[0] * F::from_f64(1.0 / n as f64),
            };
            match kept {
                Some(k) => d.copy_from_slice(&k[i * c..(i + 1) * c]),
                None => log_softmax_row(row, d, e),
            }
            for (j, d) in d.iter_mut().enumerate() {
                let target = if j == l { F::from_f64(1.0) } else { F::ZERO };
                *d = (d.exp() - target) * scale;
            }
        }
        true
    })
}

/// Output elements a fused program works at a time: each term runs over a whole block, so
/// its loop is a plain slice loop the compiler vectorises, and the stack stays in L1 (4 KiB a
/// slot: blocks of 256 switched between the operands' streams so often that a program over
/// operands out of L2 ran at a third of the speed).
const BLOCK: usize = 1024;

/// What a kernel does to each part of its output once the part is final: `(first, part)`,
/// `first` being the index of the part's first element in the whole output (an epilogue's
/// program, run while the part is still in cache).
pub type Post<'a, F> = Option<&'a (dyn Fn(usize, &mut [F]) + Sync)>;

/// Runs `post` over the whole of `y` (for kernels that do not hand their output over in
/// parts), cut into per-thread shares of whole blocks.
pub fn post_all<F: HostFloat>(post: Post<F>, y: &mut [F]) {
    let Some(post) = post else { return };
    row_shares(y, BLOCK, |first, part| post(first * BLOCK, part));
}

/// Where a program's operands are: all in slices, or (an epilogue) operand 0 in the output
/// itself and operand `i` > 0 in slice `i - 1`.
#[derive(Clone, Copy)]
enum Operands<'a, F> {
    All(&'a [&'a [F]]),
    Head(&'a [&'a [F]]),
}

/// A fused elementwise program ([`Elementwise`]) over its operands, block by block. Each op
/// rounds to `F` exactly as the unfused op does, in the same order, so the bits are the
/// unfused plan's. Large outputs are cut into per-thread shares of whole blocks.
///
/// An operand read in runs too short to read in place, repeating along a broadcast leading
/// axis (a per-channel statistic over 2 x 2 and 4 x 4 maps), is first written out for one
/// period of the output, then read as a cycle over that: the same values.
pub fn fused<F: HostFloat>(e: &Elementwise, args: &[&[F]], out: &mut [F]) {
    assert_eq!(out.len(), e.len, "output extents");
    let periods: Vec<Option<usize>> = e.reads.iter().map(|r| period(r, e.len)).collect();
    if periods.iter().all(Option::is_none) {
        return post_all(Some(&|first, part: &mut [F]| program(e, &e.reads, Operands::All(args), first, part)), out);
    }
    let expanded: Vec<Option<Vec<F>>> = periods
        .iter()
        .zip(&e.reads)
        .zip(args)
        .map(|((p, r), x)| {
            p.map(|p| {
                let mut v = vec![F::ZERO; p];
                gather(r, x, 0, &mut v);
                v
            })
        })
        .collect();
    let reads: Vec<Read> = periods.iter().zip(&e.reads).map(|(p, r)| p.map_or_else(|| r.clone(), Read::Cycle)).collect();
    let args: Vec<&[F]> = expanded.iter().zip(args).map(|(v, x)| v.as_deref().unwrap_or(x)).collect();
    post_all(Some(&|first, part: &mut [F]| program(e, &reads, Operands::All(&args), first, part)), out);
}

/// The most elements [`fused`] writes out for one period of an operand (64 KiB of f32).
const MAX_PERIOD: usize = 1 << 14;

/// The period of a strided read worth writing out ([`fused`]): it repeats along the output's
/// broadcast leading axis, every period of at most [`MAX_PERIOD`] elements (repeated at least
/// twice), and runs along its last axis are shorter than [`MIN_RUN`].
fn period(r: &Read, len: usize) -> Option<usize> {
    let Read::Strided { out, strides } = r else { return None };
    let p: usize = out[1..].iter().product();
    (strides[0] == 0 && *out.last()? < MIN_RUN && (MIN_RUN..=MAX_PERIOD).contains(&p) && 2 * p <= len).then_some(p)
}

/// An epilogue's program ([`crate::kernel::Native::Epilogue`]) over `part` of the output, in
/// place: operand 0 is the head's output (the part itself), operand `i` > 0 is `extras[i - 1]`;
/// `first` is the part's first element's index in the whole output.
pub fn epilogue<F: HostFloat>(e: &Elementwise, extras: &[&[F]], first: usize, part: &mut [F]) {
    if let ([Term::Arg(0), Term::Arg(1), Term::Binary(op)], [_, Read::Same]) = (&e.terms[..], &e.reads[..]) {
        // One op with an operand of the output's extents (an accumulator, say): in one pass.
        let x = &extras[0][first..first + part.len()];
        return vectorized(
            #[inline(always)]
            || binary(*op, part, x),
        );
    }
    program(e, &e.reads, Operands::Head(extras), first, part)
}

/// `$body` with `$f` bound to binary op `$op`'s element function `(a, b) -> a op b` (for
/// `relu_grad`, as the host kernel: `dy` where `y > 0`): one closure per op, so each loop in
/// `$body` is compiled (and vectorised) for its op alone.
macro_rules! with_binary {
    ($op:expr, |$f:ident| $body:expr) => {
        match $op {
            Binary::Add => {
                let $f = |x: F, y: F| x + y;
                $body
            }
            Binary::Sub => {
                let $f = |x: F, y: F| x - y;
                $body
            }
            Binary::Mul => {
                let $f = |x: F, y: F| x * y;
                $body
            }
            Binary::Div => {
                let $f = |x: F, y: F| x / y;
                $body
            }
            Binary::ReluGrad => {
                let $f = |x: F, y: F| if y > F::ZERO { x } else { F::ZERO };
                $body
            }
        }
    };
}

/// `a = a op b`, element by element.
#[inline(always)]
fn binary<F: HostFloat>(op: Binary, a: &mut [F], b: &[F]) {
    with_binary!(op, |f| a.iter_mut().zip(b).for_each(|(a, &b)| *a = f(*a, b)))
}

/// `x = op(x)`, element by element.
#[inline(always)]
fn unary<F: HostFloat>(op: Unary, x: &mut [F]) {
    // `for` loops, not `for_each`: a closure as large as erf's makes `for_each` a call that
    // is not inlined, and so compiled for the baseline instruction set, not the caller's.
    macro_rules! each {
        (|$v:ident| $e:expr) => {
            for $v in x.iter_mut() {
                *$v = $e;
            }
        };
    }
    match op {
        // burn's neg is a multiplication by -1 (a NaN keeps its sign).
        Unary::Neg => each!(|v| *v * F::from_f64(-1.0)),
        Unary::Exp => each!(|v| v.program_exp()),
        Unary::Erf => each!(|v| v.erf()),
        Unary::Tanh => each!(|v| v.tanh()),
        Unary::Log => each!(|v| v.ln()),
        Unary::Sqrt => each!(|v| v.sqrt()),
        // As the host kernel `relu`.
        Unary::Relu => each!(|v| relu1(*v)),
        Unary::RoundBf16 => each!(|v| v.round_bf16()),
        Unary::RoundF16 => each!(|v| v.round_f16()),
    }
}

/// A window's boundary for one parameter in one pass: its optimizer's update
/// ([`UpdateKernel`], the program its graph comes from) and the clearing of its accumulator,
/// block by block: `g = acc * scale`, the program's steps in order, `acc = 0`. Reads of the
/// parameter and of the states see their values before the update (the optimizer graph's
/// writes land when it finishes), and each op rounds to `F` as the graph's ops do, so the
/// results are the optimizer graph's bits. `consts`: the scalar inputs, then the literals.
pub fn update_clear<F: HostFloat>(prog: &UpdateKernel, p: &mut [F], acc: &mut [F], states: &mut [Vec<F>], consts: &[F], scale: F) {
    let n = p.len();
    assert!(acc.len() == n && states.iter().all(|s| s.len() == n), "one length for a parameter's buffers");
    // A value per step (`Let(i)` is step `i`'s; a write's is never read).
    let lets = prog.steps.len();
    // The buffers the program reads after writing them: those are read from copies.
    let mut kept = vec![false; 1 + states.len()];
    let slot = |v: KVal| match v {
        KVal::Param => Some(0),
        KVal::State(j) => Some(1 + j as usize),
        _ => None,
    };
    let mut written = vec![false; 1 + states.len()];
    for step in &prog.steps {
        let reads: &[KVal] = match step {
            KStep::Unary(_, x) | KStep::Write(_, x) => std::slice::from_ref(x),
            KStep::Binary(_, a, b) => &[*a, *b][..],
        };
        for i in reads.iter().filter_map(|&v| slot(v)) {
            kept[i] |= written[i];
        }
        if let KStep::Write(t, _) = step {
            written[match t {
                Target::Param => 0,
                Target::State(j) => 1 + j,
            }] = true;
        }
    }
    let threads = rayon::current_num_threads().min(n / (16 * BLOCK)).max(1);
    let per = n.div_ceil(threads).div_ceil(BLOCK).max(1) * BLOCK;
    // Each share: its part of the parameter, the accumulator and every state.
    let mut parts: Vec<Vec<&mut [F]>> = states.iter_mut().map(|s| s.chunks_mut(per).collect()).collect();
    let shares: Vec<_> =
        p.chunks_mut(per).zip(acc.chunks_mut(per)).map(|(p, a)| (p, a, parts.iter_mut().map(|v| v.remove(0)).collect::<Vec<_>>())).collect();
    each(shares, |(p, acc, mut st)| {
        // Scratch: the gradient, the parameter and the states as they were, the steps' values.
        F::scratch((2 + st.len() + lets) * BLOCK, |scratch| vectorized(Update { prog, kept: &kept, consts, scale, p, acc, states: &mut st, scratch }))
    });
}

/// `a = a op b`, element by element.
#[inline(always)]
fn binary_assign<F: HostFloat>(op: Binary, a: &mut [F], b: Src<F>) {
    match b {
        Src::Block(b) => binary(op, a, b),
        Src::Splat(y) => with_binary!(op, |f| a.iter_mut().for_each(|x| *x = f(*x, y))),
    }
}

/// An operand: a block's values, or one value for every element.
#[derive(Clone, Copy)]
enum Src<'a, F> {
    Block(&'a [F]),
    Splat(F),
}

impl<F: Copy> Src<'_, F> {
    /// Writes the values into `dst`.
    #[inline(always)]
    fn copy_to(self, dst: &mut [F]) {
        match self {
            Src::Block(x) => dst.copy_from_slice(x),
            Src::Splat(x) => dst.fill(x),
        }
    }
}

/// `dst = a op b`, element by element, in one pass.
#[inline(always)]
fn binary_into<F: HostFloat>(op: Binary, dst: &mut [F], a: Src<F>, b: Src<F>) {
    with_binary!(op, |f| match (a, b) {
        (Src::Block(a), Src::Block(b)) => dst.iter_mut().zip(a).zip(b).for_each(|((d, &x), &y)| *d = f(x, y)),
        (Src::Block(a), Src::Splat(y)) => dst.iter_mut().zip(a).for_each(|(d, &x)| *d = f(x, y)),
        (Src::Splat(x), Src::Block(b)) => dst.iter_mut().zip(b).for_each(|(d, &y)| *d = f(x, y)),
        (Src::Splat(x), Src::Splat(y)) => dst.fill(f(x, y)),
    })
}

/// [`update_clear`]'s loop over one share's blocks, as a [`vectorized`] op (too large for a
/// closure, which ran on SSE2: see there).
struct Update<'a, 'b, F> {
    prog: &'a UpdateKernel,
    kept: &'a [bool],
    consts: &'a [F],
    scale: F,
    p: &'a mut [F],
    acc: &'a mut [F],
    states: &'a mut [&'b mut [F]],
    scratch: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for Update<'_, '_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Update { prog, kept, consts, scale, p, acc, states, scratch } = self;
        for start in (0..p.len()).step_by(BLOCK) {
            let m = BLOCK.min(p.len() - start);
            update_block(prog, kept, consts, scale, &mut p[start..start + m], &mut acc[start..start + m], states, start, scratch);
        }
    }
}

/// One block of [`update_clear`]: `p` and `acc` the block's elements, `states` the share's
/// (the block's are `start..start + p.len()`). Every step writes its own slot of `lets`, in
/// one pass over its operands; the parameter and the states are read in place, or (`kept`:
/// where the program reads one after writing it) from copies taken first.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn update_block<F: HostFloat>(
    prog: &UpdateKernel,
    kept: &[bool],
    consts: &[F],
    scale: F,
    p: &mut [F],
    acc: &mut [F],
    states: &mut [&mut [F]],
    start: usize,
    scratch: &mut [F],
) {
    let m = p.len();
    let k = states.len();
    let (fixed, lets) = scratch.split_at_mut((2 + k) * BLOCK);
    let (g, rest) = fixed.split_at_mut(BLOCK);
    let (w, old) = rest.split_at_mut(BLOCK);
    g[..m].iter_mut().zip(&*acc).for_each(|(g, &a)| *g = a * scale);
    if kept[0] {
        w[..m].copy_from_slice(p);
    }
    for (j, s) in states.iter().enumerate().filter(|(j, _)| kept[1 + j]) {
        old[j * BLOCK..][..m].copy_from_slice(&s[start..start + m]);
    }
    for (next, step) in prog.steps.iter().enumerate() {
        let (done, rest) = lets.split_at_mut(next * BLOCK);
        let dst = &mut rest[..m];
        // A write of a step's value or a constant lands straight in its target.
        let direct = match *step {
            KStep::Write(t, KVal::Let(i)) => Some((t, Src::Block(&done[i as usize * BLOCK..][..m]))),
            KStep::Write(t, KVal::Const(i)) => Some((t, Src::Splat(consts[i as usize]))),
            _ => None,
        };
        if let Some((t, x)) = direct {
            let to: &mut [F] = match t {
                Target::Param => &mut *p,
                Target::State(j) => &mut states[j][start..start + m],
            };
            x.copy_to(to);
            continue;
        }
        let val = |v: KVal| match v {
            KVal::Param if kept[0] => Src::Block(&w[..m]),
            KVal::Param => Src::Block(&*p),
            KVal::Grad => Src::Block(&g[..m]),
            KVal::State(j) if kept[1 + j as usize] => Src::Block(&old[j as usize * BLOCK..][..m]),
            KVal::State(j) => Src::Block(&states[j as usize][start..start + m]),
            KVal::Const(i) => Src::Splat(consts[i as usize]),
            KVal::Let(i) => Src::Block(&done[i as usize * BLOCK..][..m]),
        };
        let write = match *step {
            KStep::Unary(op, x) => {
                val(x).copy_to(dst);
                unary(op, dst);
                None
            }
            KStep::Binary(op, a, b) => {
                binary_into(op, dst, val(a), val(b));
                None
            }
            // The parameter or a state written as it is: through this step's slot.
            KStep::Write(t, x) => {
                val(x).copy_to(dst);
                Some(t)
            }
        };
        if let Some(t) = write {
            let to: &mut [F] = match t {
                Target::Param => &mut *p,
                Target::State(j) => &mut states[j][start..start + m],
            };
            to.copy_from_slice(dst);
        }
    }
    acc.fill(F::ZERO);
}

/// `e` over `part` (output elements from `first` on), its operands read as `reads` say
/// (`e.reads`, or [`fused`]'s with written-out periods).
fn program<F: HostFloat>(e: &Elementwise, reads: &[Read], args: Operands<F>, first: usize, part: &mut [F]) {
    F::scratch(e.depth.max(1) * BLOCK, |stack| vectorized(Program { e, reads, args, first, stack, part }))
}

/// [`program`]'s loop over blocks, as a [`vectorized`] op (too large for a closure: see there).
struct Program<'a, F> {
    e: &'a Elementwise,
    reads: &'a [Read],
    args: Operands<'a, F>,
    first: usize,
    stack: &'a mut [F],
    part: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for Program<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for (b, dst) in self.part.chunks_mut(BLOCK).enumerate() {
            fused_block(self.e, self.reads, self.args, self.first + b * BLOCK, self.stack, dst);
        }
    }
}

/// One block of a program: output elements `[start, start + dst.len())`. The stack's bottom
/// slot is `dst` itself (the program's value ends there), the others are `stack`'s. An
/// operand followed by a binary op is applied to the top of the stack straight from its
/// memory, piece by piece ([`Runs`]), and the first operand with the op after it is computed
/// into `dst` in one pass; only operands read in short pieces are gathered into a slot first.
/// Every op is the same op on the same values as in the unfused plan, in the same order.
#[inline(always)]
fn fused_block<F: HostFloat>(e: &Elementwise, reads: &[Read], args: Operands<F>, start: usize, stack: &mut [F], dst: &mut [F]) {
    static SAME: Read = Read::Same;
    let n = dst.len();
    // An epilogue's operand 0 is `dst` as the head left it, overwritten by the program from
    // its first op on: any read of it after the first term is of a copy, taken now.
    let (saved, stack) = stack.split_at_mut(BLOCK);
    let head = matches!(args, Operands::Head(_));
    if head && e.terms.iter().enumerate().any(|(k, t)| k > 0 && *t == Term::Arg(0)) {
        saved[..n].copy_from_slice(dst);
    }
    let saved = &saved[..n];
    // Operand `i`: how the block reads it, its memory, and the index of the block's first
    // element in that memory's frame.
    let operand = |i: usize| -> (&Read, &[F], usize) {
        match args {
            Operands::All(a) => (&reads[i], a[i], start),
            Operands::Head(_) if i == 0 => (&SAME, saved, 0),
            Operands::Head(a) => (&reads[i], a[i - 1], start),
        }
    };
    let terms = &e.terms[..];
    let mut sp = 0;
    let mut k = 0;
    while k < terms.len() {
        let next = match terms.get(k + 1) {
            Some(&Term::Binary(op)) => Some(op),
            _ => None,
        };
        // An operand or a literal, then a binary op: applied to the top of the stack.
        if let (Some(op), true) = (next, sp >= 1) {
            let top = if sp == 1 { &mut *dst } else { &mut stack[(sp - 2) * BLOCK..][..n] };
            let done = match terms[k] {
                Term::Lit(v) => {
                    binary_assign(op, top, Src::Splat(F::from_f64(v)));
                    true
                }
                Term::Arg(i) => {
                    let (r, x, at) = operand(i);
                    // A `for` loop: a closure this large would be called, not inlined (see
                    // [`vectorized`]).
                    match Runs::new(r, x, at, n) {
                        Some(runs) => {
                            for (o, len, b) in runs {
                                binary_assign(op, &mut top[o..o + len], b);
                            }
                            true
                        }
                        None => false,
                    }
                }
                _ => false,
            };
            if done {
                k += 2;
                continue;
            }
        }
        // The first operand, an operand or a literal, and a binary op: into `dst` in one pass.
        if let (0, Term::Arg(i), Some(&Term::Binary(op))) = (sp, terms[k], terms.get(k + 2)) {
            let (r, x, at) = operand(i);
            let first = if head && i == 0 && k == 0 { None } else { Runs::new(r, x, at, n).and_then(Runs::whole) };
            let second = match terms[k + 1] {
                Term::Lit(v) => Some(Src::Splat(F::from_f64(v))),
                Term::Arg(j) => {
                    let (r, x, at) = operand(j);
                    Runs::new(r, x, at, n).and_then(Runs::whole)
                }
                _ => None,
            };
            if let (Some(a), Some(b)) = (first, second) {
                binary_into(op, dst, a, b);
                sp = 1;
                k += 3;
                continue;
            }
        }
        match terms[k] {
            Term::Arg(i) => {
                let slot = if sp == 0 { &mut *dst } else { &mut stack[(sp - 1) * BLOCK..][..n] };
                // An epilogue's output read first is already where it belongs.
                if !(head && i == 0 && k == 0) {
                    let (r, x, at) = operand(i);
                    gather(r, x, at, slot);
                }
                sp += 1;
            }
            Term::Lit(v) => {
                let slot = if sp == 0 { &mut *dst } else { &mut stack[(sp - 1) * BLOCK..][..n] };
                slot.fill(F::from_f64(v));
                sp += 1;
            }
            Term::Unary(u) => unary(u, if sp == 1 { &mut *dst } else { &mut stack[(sp - 2) * BLOCK..][..n] }),
            Term::Binary(op) => {
                if sp == 2 {
                    binary(op, dst, &stack[..n]);
                } else {
                    let (lo, hi) = stack.split_at_mut((sp - 2) * BLOCK);
                    binary(op, &mut lo[(sp - 3) * BLOCK..][..n], &hi[..n]);
                }
                sp -= 1;
            }
        }
        k += 1;
    }
    debug_assert_eq!(sp, 1, "a program leaves one value");
}

/// An operand's values for a block of output elements, piece by piece: `(offset in the
/// block, length, values)`, the values a slice of the operand's memory or one value for the
/// piece. Only reads whose pieces are long (a bias's rows, a per-row statistic broadcast
/// along rows of 16 or more) are read so; the others are gathered ([`gather`]).
struct Runs<'a, F> {
    x: &'a [F],
    kind: RunKind<'a>,
    /// The block's elements done, and its length.
    k: usize,
    n: usize,
    /// Where the next piece starts in `x` (`at`), and (strided reads) the multi-index of its
    /// element.
    od: Odometer,
}

enum RunKind<'a> {
    Same,
    Splat,
    Cycle(usize),
    Strided { out: &'a [usize], strides: &'a [usize] },
}

/// Pieces shorter than this are not worth a loop of their own.
const MIN_RUN: usize = 16;

impl<'a, F: Copy> Runs<'a, F> {
    /// The pieces of output elements `[start, start + n)` of operand `x` read as `r`, or `None`
    /// if they would be short.
    #[inline(always)]
    fn new(r: &'a Read, x: &'a [F], start: usize, n: usize) -> Option<Self> {
        let at = |at| Odometer { idx: [0; MAX_RANK], at };
        let (kind, od) = match r {
            Read::Same => (RunKind::Same, at(start)),
            Read::Splat => (RunKind::Splat, at(0)),
            Read::Cycle(m) if *m >= MIN_RUN => (RunKind::Cycle(*m), at(start % m)),
            Read::Strided { out, strides } if out.len() <= MAX_RANK && *out.last()? >= MIN_RUN && *strides.last()? <= 1 => {
                (RunKind::Strided { out, strides }, Odometer::new(out, strides, start))
            }
            _ => return None,
        };
        Some(Runs { x, kind, k: 0, n, od })
    }

    /// The block's values as one piece, when they are.
    #[inline(always)]
    fn whole(self) -> Option<Src<'a, F>> {
        match self.kind {
            RunKind::Same => Some(Src::Block(&self.x[self.od.at..self.od.at + self.n])),
            RunKind::Splat => Some(Src::Splat(self.x[0])),
            _ => None,
        }
    }
}

impl<'a, F: Copy> Iterator for Runs<'a, F> {
    type Item = (usize, usize, Src<'a, F>);
    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let (k, left) = (self.k, self.n - self.k);
        if left == 0 {
            return None;
        }
        let at = self.od.at;
        let (len, src) = match self.kind {
            RunKind::Same => (left, Src::Block(&self.x[at..at + left])),
            RunKind::Splat => (left, Src::Splat(self.x[0])),
            RunKind::Cycle(m) => {
                let len = (m - at).min(left);
                self.od.at = if at + len == m { 0 } else { at + len };
                (len, Src::Block(&self.x[at..at + len]))
            }
            RunKind::Strided { out, strides } => {
                let len = self.od.left(out).min(left);
                let src = if strides[out.len() - 1] == 0 { Src::Splat(self.x[at]) } else { Src::Block(&self.x[at..at + len]) };
                self.od.advance(out, strides, len);
                (len, src)
            }
        };
        self.k += len;
        Some((k, len, src))
    }
}

/// Reads output elements `[start, start + dst.len())`'s values of one operand.
#[inline(always)]
fn gather<F: HostFloat>(r: &Read, x: &[F], start: usize, dst: &mut [F]) {
    match r {
        Read::Same => dst.copy_from_slice(&x[start..start + dst.len()]),
        Read::Splat => dst.fill(x[0]),
        Read::Cycle(m) => {
            let mut j = start % m;
            for d in dst {
                *d = x[j];
                j += 1;
                if j == *m {
                    j = 0;
                }
            }
        }
        Read::Strided { out, strides } if out.len() <= MAX_RANK => strided_runs(out, strides, x, start, dst),
        Read::Strided { out, strides } => {
            for (k, d) in dst.iter_mut().enumerate() {
                let (mut i, mut at) = (start + k, 0);
                for a in (0..out.len()).rev() {
                    at += (i % out[a]) * strides[a];
                    i /= out[a];
                }
                *d = x[at];
            }
        }
    }
}

/// Ranks [`strided_runs`] keeps its index for.
const MAX_RANK: usize = 8;

/// [`Read::Strided`] by runs along the last axis: the multi-index of `start` is worked out
/// once, then advanced like an odometer (a per-channel operand of an NCHW output is a `fill`
/// per row instead of a division per axis per element).
#[inline(always)]
fn strided_runs<F: HostFloat>(out: &[usize], strides: &[usize], x: &[F], start: usize, dst: &mut [F]) {
    let mut od = Odometer::new(out, strides, start);
    let step = strides[out.len() - 1];
    let mut k = 0;
    while k < dst.len() {
        let run = od.left(out).min(dst.len() - k);
        let d = &mut dst[k..k + run];
        if step == 0 {
            d.fill(x[od.at]);
        } else {
            d.iter_mut().enumerate().for_each(|(j, v)| *v = x[od.at + j * step]);
        }
        k += run;
        od.advance(out, strides, run);
    }
}

/// A multi-index over output extents `out` and the element it reaches through `strides`
/// (`at`), moved along the last axis and carried into the axes before like an odometer.
#[derive(Clone, Copy)]
struct Odometer {
    idx: [usize; MAX_RANK],
    at: usize,
}

impl Odometer {
    /// At output element `start` (`out` has at most [`MAX_RANK`] axes).
    #[inline(always)]
    fn new(out: &[usize], strides: &[usize], start: usize) -> Self {
        let (mut idx, mut i, mut at) = ([0; MAX_RANK], start, 0);
        for a in (0..out.len()).rev() {
            idx[a] = i % out[a];
            at += idx[a] * strides[a];
            i /= out[a];
        }
        Odometer { idx, at }
    }
    /// Elements left along the last axis.
    #[inline(always)]
    fn left(&self, out: &[usize]) -> usize {
        let last = out.len() - 1;
        out[last] - self.idx[last]
    }
    /// `len` elements on along the last axis (at most [`Self::left`]).
    #[inline(always)]
    fn advance(&mut self, out: &[usize], strides: &[usize], len: usize) {
        let last = out.len() - 1;
        self.at += len * strides[last];
        self.idx[last] += len;
        let mut a = last;
        while a > 0 && self.idx[a] == out[a] {
            self.at -= out[a] * strides[a];
            self.idx[a] = 0;
            a -= 1;
            self.idx[a] += 1;
            self.at += strides[a];
        }
    }
}

/// Row-major strides of extents `dims`.
fn strides_of(dims: &[usize]) -> Vec<usize> {
    let mut st = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * dims[i + 1];
    }
    st
}

/// The offsets of the rows of a walk over extents `ext` in row-major order (an odometer), in
/// an array whose axes step by `st`, starting at `base`.
fn row_offsets<'a>(ext: &'a [usize], st: &'a [usize], base: usize) -> impl Iterator<Item = usize> + 'a {
    let mut idx = vec![0usize; ext.len()];
    let mut at = base;
    (0..ext.iter().product::<usize>()).map(move |_| {
        let here = at;
        for a in (0..ext.len()).rev() {
            idx[a] += 1;
            at += st[a];
            if idx[a] < ext[a] {
                break;
            }
            at -= st[a] * ext[a];
            idx[a] = 0;
        }
        here
    })
}

/// Runs `f(first, part)` on `y` cut into shares of whole rows of `row` elements (`first`:
/// the share's first row) when there is more than one thread and `y` is large enough to be
/// worth it: up to four shares per thread, of 8 blocks or more, taken by the threads as they
/// come (a thread woken for the call starts tens of microseconds late; with one share each, the
/// caller finished its own and waited for the other's, and outputs of 128 Ki elements ran at
/// half the speed of one thread). Each element is computed the same way whatever the cut.
fn row_shares<F: HostFloat>(y: &mut [F], row: usize, f: impl Fn(usize, &mut [F]) + Send + Sync) {
    let work = y.len();
    shares_of(y, row, work, f)
}

/// The most shares a kernel's work is cut into: up to four per thread, taken by the threads as
/// they come (see [`row_shares`]); one on one thread.
pub(super) fn most_shares() -> usize {
    match rayon::current_num_threads() {
        1 => 1,
        t => 4 * t,
    }
}

/// [`row_shares`] for a kernel whose work is `work` elements rather than its output's (a
/// reduction reads more than it writes).
fn shares_of<F: HostFloat>(y: &mut [F], row: usize, work: usize, f: impl Fn(usize, &mut [F]) + Send + Sync) {
    if y.is_empty() {
        return;
    }
    let rows = y.len().checked_div(row).unwrap_or(0);
    let shares = most_shares().min(work / (8 * BLOCK)).min(rows);
    if shares <= 1 {
        return f(0, y);
    }
    let per = rows.div_ceil(shares);
    let shares: Vec<(usize, &mut [F])> = y.chunks_mut(per * row).enumerate().map(|(i, c)| (i * per, c)).collect();
    each(shares, |(first, part)| f(first, part));
}

/// `y` = the row-major `x` of extents `dims` with its axes permuted (`y`'s axis `i` is `x`'s
/// axis `perm[i]`), written row-major; runs along a kept last axis are copied whole.
pub fn permute<F: HostFloat>(x: &[F], dims: &[usize], perm: &[usize], y: &mut [F]) {
    let r = dims.len();
    if r == 0 || y.is_empty() {
        return y.copy_from_slice(&x[..y.len()]);
    }
    let strides = strides_of(dims);
    let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let st: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let (inner, step) = (out[r - 1], st[r - 1]);
    row_shares(y, inner, |first, part| {
        for (row, base) in part.chunks_exact_mut(inner).zip(row_offsets(&out[..r - 1], &st[..r - 1], 0).skip(first)) {
            if step == 1 {
                row.copy_from_slice(&x[base..base + inner]);
            } else {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = x[base + j * step];
                }
            }
        }
    });
}

/// `y` = `x[begin..end]` on every axis of the row-major `x` of extents `dims`, row-major.
pub fn slice<F: HostFloat>(x: &[F], dims: &[usize], begin: &[usize], end: &[usize], y: &mut [F]) {
    let r = dims.len();
    if r == 0 || y.is_empty() {
        return y.copy_from_slice(&x[..y.len()]);
    }
    let st = strides_of(dims);
    let out: Vec<usize> = (0..r).map(|i| end[i] - begin[i]).collect();
    let base = (0..r).map(|i| begin[i] * st[i]).sum();
    row_shares(y, out[r - 1], |first, part| {
        for (row, at) in part.chunks_exact_mut(out[r - 1]).zip(row_offsets(&out[..r - 1], &st[..r - 1], base).skip(first)) {
            row.copy_from_slice(&x[at..at + row.len()]);
        }
    });
}

/// `y` = the row-major `x` of extents `dims` padded with zeros, `lo[i]` before and `hi[i]`
/// after axis `i`, row-major: each output row is zeros, or zeros around a row of `x`.
pub fn pad<F: HostFloat>(x: &[F], dims: &[usize], lo: &[usize], hi: &[usize], y: &mut [F]) {
    let r = dims.len();
    if r == 0 || x.is_empty() || y.is_empty() {
        y.fill(F::ZERO);
        return y[..x.len()].copy_from_slice(x);
    }
    let out: Vec<usize> = (0..r).map(|i| lo[i] + dims[i] + hi[i]).collect();
    let xst = strides_of(dims);
    let (w, (l, xw)) = (out[r - 1], (lo[r - 1], dims[r - 1]));
    row_shares(y, w, |first, part| {
        // The multi-index of the share's first row over the outer axes.
        let mut idx = vec![0; r - 1];
        let mut rest = first;
        for a in (0..r - 1).rev() {
            (idx[a], rest) = (rest % out[a], rest / out[a]);
        }
        for row in part.chunks_exact_mut(w) {
            if (0..r - 1).all(|a| idx[a] >= lo[a] && idx[a] < lo[a] + dims[a]) {
                let at: usize = (0..r - 1).map(|a| (idx[a] - lo[a]) * xst[a]).sum();
                row[..l].fill(F::ZERO);
                row[l..l + xw].copy_from_slice(&x[at..at + xw]);
                row[l + xw..].fill(F::ZERO);
            } else {
                row.fill(F::ZERO);
            }
            for a in (0..r - 1).rev() {
                idx[a] += 1;
                if idx[a] < out[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
    });
}

/// Causal masking of `[..., t, s]` scores: element `(i, j)` of each `t x s` matrix is `fill`
/// where `j > i + s - t`, else `x`'s.
pub fn causal_mask<F: HostFloat>(x: &[F], t: usize, s: usize, fill: F, y: &mut [F]) {
    if s == 0 || t == 0 {
        return;
    }
    row_shares(y, s, |first, part| {
        for (k, yr) in part.chunks_exact_mut(s).enumerate() {
            let (g, i) = (first + k, (first + k) % t);
            // Keys 0..=i + s - t are visible.
            let seen = (i + s).saturating_sub(t).saturating_add(1).min(s);
            let xr = &x[g * s..(g + 1) * s];
            yr[..seen].copy_from_slice(&xr[..seen]);
            yr[seen..].fill(fill);
        }
    });
}

/// The maximum of each row of the row-major `[rows, cols]` `x` (a NaN in a row makes it NaN:
/// the last one's bits, as the sequential fold `if b > a || b != b { b } else { a }`).
pub fn max_rows<F: HostFloat>(x: &[F], cols: usize, y: &mut [F]) {
    if cols == 0 {
        return;
    }
    let threads = rayon::current_num_threads().min(x.len() / (16 * BLOCK)).min(y.len()).max(1);
    let per = y.len().div_ceil(threads);
    let shares: Vec<(&[F], &mut [F])> = x.chunks(per * cols).zip(y.chunks_mut(per)).collect();
    each(shares, |(x, y)| vectorized(MaxRows { x, cols, y }));
}

/// [`max_rows`] over one share, as a struct so that its loop is compiled for the dispatched
/// instruction set ([`vectorized`]).
struct MaxRows<'a, F> {
    x: &'a [F],
    cols: usize,
    y: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for MaxRows<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        const LANES: usize = 16;
        // `b != b`: `b` is NaN (`HostFloat` has no `is_nan`).
        #[allow(clippy::eq_op)]
        let fold = |row: &[F]| row[1..].iter().fold(row[0], |a, &b| if b > a || b != b { b } else { a });
        for (row, m) in self.x.chunks_exact(self.cols).zip(self.y.iter_mut()) {
            // Lane by lane, then across the lanes: the same maximum as the fold unless the row
            // holds a NaN (which one is kept) or the maximum is zero (which sign is kept),
            // where the fold itself decides.
            let mut acc = [row[0]; LANES];
            let mut nan = [false; LANES];
            let chunks = row.chunks_exact(LANES);
            let rest = chunks.remainder();
            for c in chunks {
                for j in 0..LANES {
                    acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
                    nan[j] |= c[j].is_nan();
                }
            }
            let mut v = acc[0];
            for &b in acc[1..].iter().chain(rest) {
                v = if b > v { b } else { v };
            }
            let odd = nan.iter().any(|&n| n) || rest.iter().any(|b| b.is_nan()) || v == F::ZERO;
            *m = if odd { fold(row) } else { v };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Makes [`vectorized`] run kernels without vector instructions, on this thread.
        pub(crate) static SCALAR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A kernel's output as a new vector of `len` elements (filled with NaN first: every
    /// element must be written).
    fn new(len: usize, kernel: impl FnOnce(&mut [f32])) -> Vec<f32> {
        let mut v = vec![f32::NAN; len];
        kernel(&mut v);
        v
    }

    fn data(n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 - 1001.0) / 1001.0).collect()
    }

    /// [`conv2d_filter_grad`] with an epilogue gives `dw` (its result without one) with the
    /// epilogue applied to every element once, at its own offset.
    pub(crate) fn assert_filter_grad_epilogue(g: &Geometry, groups: usize, dy: &[f32], x: &[f32], o: usize, dw: &[f32]) {
        let post = |first: usize, part: &mut [f32]| part.iter_mut().enumerate().for_each(|(i, v)| *v = *v * 2.0 + (first + i) as f32);
        let twice = new(dw.len(), |out| conv2d_filter_grad(g, groups, dy, x, o, out, Some(&post), Products::F32));
        assert!(twice.iter().zip(dw).enumerate().all(|(i, (t, d))| t.to_bits() == (d * 2.0 + i as f32).to_bits()), "{g:?}: the epilogue");
    }

    /// Direct-loop convolution in f64: the reference for the chunked GEMM kernels.
    pub(crate) fn conv_reference(g: &Geometry, groups: usize, x: &[f32], w: &[f32], o: usize) -> Vec<f64> {
        let [n, c, h, wd] = g.x;
        let (cg, og) = (c / groups, o / groups);
        let mut y = vec![0.0; n * o * g.spatial()];
        for i in 0..n {
            for oc in 0..o {
                for oy in 0..g.out[0] {
                    for ox in 0..g.out[1] {
                        let mut acc = 0.0f64;
                        for ci in 0..cg {
                            for ky in 0..g.kernel[0] {
                                for kx in 0..g.kernel[1] {
                                    let (Some(iy), Some(ix)) = (g.at(0, oy, ky), g.at(1, ox, kx)) else { continue };
                                    let xc = (oc / og) * cg + ci;
                                    acc += x[((i * c + xc) * h + iy) * wd + ix] as f64
                                        * w[((oc * cg + ci) * g.kernel[0] + ky) * g.kernel[1] + kx] as f64;
                                }
                            }
                        }
                        y[((i * o + oc) * g.out[0] + oy) * g.out[1] + ox] = acc;
                    }
                }
            }
        }
        y
    }

    /// The chunked convolution matches direct loops on dense and on strided, padded, dilated,
    /// grouped geometries, and its gradients are its adjoints: <conv(x), dy> equals both
    /// <x, input_grad(dy)> and <w, filter_grad(dy)>.
    #[test]
    fn chunked_convolutions_match_direct_loops_and_their_adjoints() {
        let cases = [
            // LeNet's conv1 and conv2 (dense path, several chunks).
            (Geometry { x: [32, 1, 32, 32], kernel: [5, 5], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [28, 28] }, 1, 6),
            (Geometry { x: [9, 6, 14, 14], kernel: [5, 5], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [10, 10] }, 1, 16),
            // Stride 2, padding 1, dilation 2, two groups.
            (Geometry { x: [5, 4, 11, 9], kernel: [3, 2], stride: [2, 2], dilation: [2, 1], pad: [1, 1], out: [5, 5] }, 2, 6),
            // 3x3 padded by 1 at stride 1 (through a padded plane): ResNet's 8x8 and 4x4 maps,
            // and rows of 6 (copied as two overlapping fours).
            (Geometry { x: [3, 5, 8, 8], kernel: [3, 3], stride: [1, 1], dilation: [1, 1], pad: [1, 1], out: [8, 8] }, 1, 7),
            (Geometry { x: [3, 5, 4, 4], kernel: [3, 3], stride: [1, 1], dilation: [1, 1], pad: [1, 1], out: [4, 4] }, 1, 7),
            (Geometry { x: [2, 3, 6, 6], kernel: [3, 3], stride: [1, 1], dilation: [1, 1], pad: [1, 1], out: [6, 6] }, 1, 4),
            // Stride 2 down the rows and 1 along them, dilated along them, padded unevenly.
            (Geometry { x: [2, 3, 7, 9], kernel: [2, 3], stride: [2, 1], dilation: [1, 2], pad: [1, 2], out: [4, 9] }, 1, 5),
            // Stride 2 padded by 1 whose last input column no window reads (the padded plane
            // holds only the part that is read).
            (Geometry { x: [2, 3, 8, 7], kernel: [3, 3], stride: [2, 2], dilation: [1, 1], pad: [1, 1], out: [4, 3] }, 1, 5),
            // More than 64 output channels, and more output channels than taps: the filter
            // gradient made in its own layout (the cases above make it transposed).
            (Geometry { x: [3, 4, 6, 6], kernel: [3, 3], stride: [1, 1], dilation: [1, 1], pad: [1, 1], out: [6, 6] }, 1, 72),
            (Geometry { x: [4, 2, 5, 5], kernel: [1, 1], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [5, 5] }, 1, 8),
        ];
        for (g, groups, o) in cases {
            let [n, c, h, wd] = g.x;
            let (x, w, dy) = (data(n * c * h * wd, 1), data(o * c / groups * g.kernel[0] * g.kernel[1], 2), data(n * o * g.spatial(), 3));
            let y = new(n * o * g.spatial(), |y| conv2d(&g, groups, &x, &w, o, y, None, Products::F32));
            for (a, b) in y.iter().zip(conv_reference(&g, groups, &x, &w, o)) {
                assert!((*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()), "{g:?}: {a} vs {b}");
            }
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>();
            let dx = new(x.len(), |dx| conv2d_input_grad(&g, groups, &dy, &w, o, dx, Products::F32));
            let dw = new(w.len(), |dw| conv2d_filter_grad(&g, groups, &dy, &x, o, dw, None, Products::F32));
            assert_filter_grad_epilogue(&g, groups, &dy, &x, o, &dw);
            let lhs = dot(&y, &dy);
            for rhs in [dot(&x, &dx), dot(&w, &dw)] {
                assert!((lhs - rhs).abs() <= 1e-4 * (1.0 + lhs.abs()), "{g:?}: {lhs} vs {rhs}");
            }
        }
    }

    /// The copies (permute, slice, pad, causal mask) and the row maxima, cut into shares of
    /// rows on one, two and three threads, against the same results written out element by
    /// element; the maxima keep the sequential fold's NaN and zero.
    #[test]
    fn row_kernels_on_several_threads_equal_the_elementwise_reference() {
        let dims = [4, 64, 6, 32];
        let n: usize = dims.iter().product();
        let x = data(n, 9);
        let at = |i: [usize; 4]| ((i[0] * dims[1] + i[1]) * dims[2] + i[2]) * dims[3] + i[3];
        let mut want_perm = Vec::new();
        for a in 0..4 {
            for c in 0..6 {
                for b in 0..64 {
                    for d in 0..32 {
                        want_perm.push(x[at([a, b, c, d])]);
                    }
                }
            }
        }
        let (begin, end) = ([1, 3, 0, 5], [4, 60, 6, 29]);
        let mut want_slice = Vec::new();
        for a in begin[0]..end[0] {
            for b in begin[1]..end[1] {
                for c in begin[2]..end[2] {
                    for d in begin[3]..end[3] {
                        want_slice.push(x[at([a, b, c, d])]);
                    }
                }
            }
        }
        let (lo, hi) = ([0, 2, 1, 3], [1, 0, 2, 4]);
        let out: Vec<usize> = (0..4).map(|i| lo[i] + dims[i] + hi[i]).collect();
        let mut want_pad = Vec::new();
        for a in 0..out[0] {
            for b in 0..out[1] {
                for c in 0..out[2] {
                    for d in 0..out[3] {
                        let i = [a, b, c, d];
                        let inside = (0..4).all(|k| i[k] >= lo[k] && i[k] < lo[k] + dims[k]);
                        want_pad.push(if inside { x[at([a - lo[0], b - lo[1], c - lo[2], d - lo[3]])] } else { 0.0 });
                    }
                }
            }
        }
        // Scores [4, 6, 64, 32]: 64 queries over 32 keys (the last 32 queries see all).
        let (t, s) = (64, 32);
        let want_mask: Vec<f32> = (0..n).map(|k| if k % s > (k / s % t + s).saturating_sub(t) { -7.0 } else { x[k] }).collect();
        // Rows of 100 (a remainder past the lanes); one with a NaN, one with both zeros and
        // negatives, one with a NaN then another NaN (the fold keeps the last).
        let cols = 100;
        let mut m = data(n / cols * cols, 3);
        m[5 * cols + 77] = f32::NAN;
        // The fold keeps the +0 it meets first; lane by lane, lane 1's -0 would come first.
        m[9 * cols..10 * cols].iter_mut().enumerate().for_each(|(j, v)| {
            *v = if j == 17 {
                -0.0
            } else if j == 2 {
                0.0
            } else {
                -1.0 - j as f32
            }
        });
        (m[11 * cols + 2], m[11 * cols + 90]) = (f32::NAN, f32::from_bits(0x7fc0_0001));
        let fold = |row: &[f32]| row[1..].iter().fold(row[0], |a, &b| if b > a || b != b { b } else { a });
        let want_max: Vec<u32> = m.chunks_exact(cols).map(|r| fold(r).to_bits()).collect();
        assert!(f32::from_bits(want_max[5]).is_nan() && want_max[9] == 0 && want_max[11] == 0x7fc0_0001);
        // Sums over the first and last axes, written out: each run of `inner` on its own
        // (ndarray's unrolled sum from 16 on), then the runs in order.
        let mut want_sums = std::collections::BTreeMap::new();
        for (outer, kept, inner) in [(4usize, 64usize, 192usize), (4 * 64, 192, 1), (1, 4 * 64, 192), (48, 32, 6)] {
            let sums: Vec<u32> = (0..kept)
                .map(|o| {
                    let run = |p: usize| &x[(p * kept + o) * inner..][..inner];
                    let total = (0..outer)
                        .fold(0.0f32, |s, p| s + if inner >= 16 { f32::ndarray_sum(run(p)) } else { run(p).iter().fold(0.0, |a, &v| a + v) });
                    (total * 0.5).to_bits()
                })
                .collect();
            want_sums.insert((outer, inner), sums);
        }
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| {
                assert_eq!(new(n, |y| permute(&x, &dims, &[0, 2, 1, 3], y)), want_perm, "permute on {threads}");
                assert_eq!(new(want_slice.len(), |y| slice(&x, &dims, &begin, &end, y)), want_slice, "slice on {threads}");
                assert_eq!(new(want_pad.len(), |y| pad(&x, &dims, &lo, &hi, y)), want_pad, "pad on {threads}");
                assert_eq!(new(n, |y| causal_mask(&x, t, s, -7.0, y)), want_mask, "causal mask on {threads}");
                let got: Vec<u32> = new(m.len() / cols, |y| max_rows(&m, cols, y)).into_iter().map(f32::to_bits).collect();
                assert_eq!(got, want_max, "row maxima on {threads}");
                for (outer, kept, inner) in [(4, 64, 192), (4 * 64, 192, 1), (1, 4 * 64, 192), (48, 32, 6)] {
                    let got: Vec<u32> = new(kept, |y| sum_planes(&x, outer, inner, Some(0.5), y)).into_iter().map(f32::to_bits).collect();
                    assert_eq!(got, want_sums[&(outer, inner)], "sums over [{outer}, {kept}, {inner}] on {threads}");
                }
            });
        }
    }

    /// Products cut into bands of rows or of columns, one per thread, have the bits of the
    /// whole product on one thread: tall and wide ones, contractions over more than 512 (which
    /// the GEMM blocks differently in products of at most 64 x 64), operands read transposed,
    /// on one to four threads.
    #[test]
    fn banded_products_have_the_bits_of_the_whole_product() {
        // (m, k, n): bands of rows; of columns; 160 rows over 40 columns in two bands of 80;
        // 150 and 170 not cut into bands of 64 or fewer (by 40, they would block their
        // contraction of 700 in pieces of 512).
        for (m, k, n) in [(1024, 128, 512), (128, 1024, 512), (160, 700, 40), (150, 700, 40), (40, 700, 170)] {
            for (ta, tb) in [(false, false), (true, false), (false, true)] {
                let (a, b) = (data(m * k, m), data(k * n, n));
                let ma =
                    if ta { Mat { data: &a, rows: k, cols: m, transposed: true } } else { Mat { data: &a, rows: m, cols: k, transposed: false } };
                let mb =
                    if tb { Mat { data: &b, rows: n, cols: k, transposed: true } } else { Mat { data: &b, rows: k, cols: n, transposed: false } };
                let one: Vec<u32> = new(m * n, |c| matmul(ma, mb, c, Products::F32)).into_iter().map(f32::to_bits).collect();
                for threads in [2, 3, 4] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
                    let got: Vec<u32> = pool.install(|| new(m * n, |c| matmul(ma, mb, c, Products::F32))).into_iter().map(f32::to_bits).collect();
                    assert!(got == one, "{m}x{k}x{n} (transposed {ta}, {tb}) on {threads} threads");
                }
            }
        }
    }

    /// A convolution's batch is cut into a power of two of equal chunks: ResNet-18's 3 x 3
    /// convolutions on 8 x 8 maps (147 KiB of columns per image, 7 to the MiB) take 8 chunks
    /// of 4 of a micro-batch of 32, not 5 of 7 (which left one of two threads idle a fifth of
    /// the time); LeNet5's first layer on 32 images, 4 chunks of 8, not 3 of 11.
    #[test]
    fn convolution_chunks_come_in_powers_of_two() {
        let g = |c: usize, hw: usize, k: usize, out: usize| Geometry {
            x: [32, c, hw, hw],
            kernel: [k, k],
            stride: [1, 1],
            dilation: [1, 1],
            pad: [k / 2, k / 2],
            out: [out, out],
        };
        let per = |g: Geometry, o: usize| chunk_images::<f32>(&conv_dims(&g, 1, o), 32);
        assert_eq!(per(g(64, 8, 3, 8), 64), 4);
        assert_eq!(per(g(128, 4, 3, 4), 128), 8);
        let lenet = Geometry { x: [32, 1, 32, 32], kernel: [5, 5], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [28, 28] };
        assert_eq!(per(lenet, 6), 8);
        // An image over the MiB on a batch of 3: 3 chunks of one (4 would leave one empty).
        assert_eq!(chunk_images::<f32>(&conv_dims(&Geometry { x: [3, 512, 16, 16], ..g(512, 16, 3, 16) }, 1, 512), 3), 1);
    }

    /// Chunks, pooling planes and sums run on rayon's threads, but the cut depends on the
    /// shapes only: one thread and three give the same bits.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let g = Geometry { x: [32, 6, 14, 14], kernel: [5, 5], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [10, 10] };
        let (x, w, dy) = (data(32 * 6 * 196, 4), data(16 * 6 * 25, 5), data(32 * 16 * 100, 6));
        let p = Geometry { x: [32, 6, 14, 14], kernel: [2, 2], stride: [2, 2], dilation: [1, 1], pad: [0, 0], out: [7, 7] };
        let sums = data(300 * 1000, 7);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| {
                let mut at = vec![0; 32 * 6 * 49];
                let y = new(at.len(), |y| max_pool2d(&p, &x, &mut at, y));
                let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                [
                    bits(new(dy.len(), |y| conv2d(&g, 1, &x, &w, 16, y, None, Products::F32))),
                    bits(new(x.len(), |dx| conv2d_input_grad(&g, 1, &dy, &w, 16, dx, Products::F32))),
                    bits(new(w.len(), |dw| conv2d_filter_grad(&g, 1, &dy, &x, 16, dw, None, Products::F32))),
                    bits(y),
                    bits(new(x.len(), |dx| max_pool2d_grad(&p, &at, &x[..at.len()], dx, None))),
                    // Sums over rows (shared out by 4 KiB of the output) and over planes.
                    bits(new(3000, |out| sum_planes(&sums, 100, 1, None, out))),
                    bits(new(128, |out| sum_planes(&sums[..64 * 128 * 20], 64, 20, Some(0.5), out))),
                ]
            })
        };
        let (one, three) = (run(1), run(3));
        assert_eq!(one, three);
        // Row by row onto zeros, column by column.
        let want: Vec<u32> = (0..3000).map(|j| (0..100).fold(0.0f32, |s, i| s + sums[i * 3000 + j]).to_bits()).collect();
        assert_eq!(one[5], want);
    }

    /// The pooling paths (2x2 at stride 2, and the two-pass one for any window) pick the same
    /// input as the general one, output by output, ties (the first maximum wins), NaNs (the
    /// last NaN wins) and -inf (the first input wins) included, and write its value, with
    /// vector instructions and without.
    #[test]
    fn pooling_picks_what_the_general_path_picks() {
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let (h, w) = (9, 11);
        let plane: Vec<f32> = (0..h * w)
            .map(|i| match next() % 10 {
                // A corner of -inf: some windows read nothing else.
                _ if i % w < 3 && i / w < 3 => f32::NEG_INFINITY,
                0 => f32::NAN,
                1..=4 => 1.0, // ties
                5 => f32::NEG_INFINITY,
                r => r as f32 - 7.0,
            })
            .collect();
        let cases = [
            ([2, 2], [2, 2], [1, 1], [0, 0], 0),
            ([3, 3], [1, 1], [1, 1], [0, 0], 0),
            ([2, 3], [3, 2], [1, 1], [0, 0], 0),
            ([2, 2], [1, 2], [2, 3], [0, 0], 0),
            // ResNet's 3x3 at stride 2 padded by 1, one-sided and dilated padding, windows
            // entirely in padding (no input: NO_ARGMAX), and a last window past the padding
            // (as ceil mode makes).
            ([3, 3], [2, 2], [1, 1], [1, 1], 0),
            ([3, 2], [1, 2], [1, 1], [1, 0], 0),
            ([2, 2], [1, 1], [2, 1], [2, 1], 0),
            ([3, 3], [2, 3], [1, 1], [4, 4], 0),
            ([3, 3], [2, 2], [1, 1], [1, 1], 1),
        ];
        for (kernel, stride, dilation, pad, extra) in cases {
            let out = [0, 1].map(|a| ([h, w][a] + 2 * pad[a] - dilation[a] * (kernel[a] - 1) - 1) / stride[a] + 1 + extra);
            let g = Geometry { x: [1, 1, h, w], kernel, stride, dilation, pad, out };
            let general: Vec<u32> = (0..out[0] * out[1]).map(|i| argmax_one(&g, &plane, i / out[1], i % out[1])).collect();
            if pad == [4, 4] || extra > 0 {
                assert!(general.contains(&NO_ARGMAX) && general.iter().any(|&i| i != NO_ARGMAX), "some windows read no input, some do");
            }
            let want: Vec<u32> = general.iter().map(|&i| if i == NO_ARGMAX { f32::NEG_INFINITY } else { plane[i as usize] }.to_bits()).collect();
            for scalar in [false, true] {
                SCALAR.with(|s| s.set(scalar));
                let mut at = vec![0; general.len()];
                let y = new(general.len(), |y| max_pool2d(&g, &plane, &mut at, y));
                let mut only = vec![0; general.len()];
                max_pool2d_argmax(&g, &plane, &mut only);
                SCALAR.with(|s| s.set(false));
                let case = format!("kernel {kernel:?} stride {stride:?} dilation {dilation:?} pad {pad:?} extra {extra} scalar {scalar}");
                assert_eq!((&at, y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()), (&general, want.clone()), "{case}");
                assert_eq!(only, general, "{case}");
            }
        }
    }

    /// A fused program reading one operand of each kind (the output's extents, one element, a
    /// trailing bias, and two broadcasts that need strides), over several blocks and thread
    /// shares, against the same ops written out per element.
    #[test]
    fn fused_programs_read_every_broadcast_and_round_as_the_ops_do() {
        use cellgraph_compiler::{Op, TensorType};
        let expr: cellgraph_compiler::expr::Expr =
            "$0 $1 mul $2 add $3 sub relu $4 div $0 relu_grad 0.5 add exp log sqrt neg tanh erf".parse().unwrap();
        let dims: [&[usize]; 5] = [&[4, 100, 100], &[], &[100], &[100, 1], &[4, 1, 100]];
        let tys: Vec<TensorType> = dims.iter().map(|d| TensorType::f32(d.to_vec())).collect();
        let Some(crate::kernel::Native::Fused(e)) = crate::kernel::bind(&Op::Fused { expr }, &tys.iter().collect::<Vec<_>>()) else {
            panic!("fused binds")
        };
        assert_eq!(e.reads[..3], [Read::Same, Read::Splat, Read::Cycle(100)]);
        assert!(matches!(e.reads[3], Read::Strided { .. }) && matches!(e.reads[4], Read::Strided { .. }));
        let mut xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i)).collect();
        xs[4].iter_mut().for_each(|v| *v = v.abs() + 0.5);
        let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
        let got = new(e.len, |out| fused(&e, &args, out));
        assert_eq!(got.len(), 40_000);
        for (i, &g) in got.iter().enumerate() {
            let (a, b, c) = (i / 10_000, i / 100 % 100, i % 100);
            let x0 = xs[0][i];
            let v = x0 * xs[1][0] + xs[2][c] - xs[3][b];
            let v = if v > 0.0 { v } else { 0.0 } / xs[4][a * 100 + c];
            let v = if x0 > 0.0 { v } else { 0.0 };
            use crate::host::math::{erf, exp, tanh};
            let want = erf(tanh(-(exp(v + 0.5f32).ln().sqrt())));
            assert_eq!(g.to_bits(), want.to_bits(), "element {i}: {g} vs {want}");
        }
    }

    /// Per-channel operands over 2 x 2 maps (runs of 4, repeating every image) are written
    /// out for one image and read as a cycle, with the values of the strided reads.
    #[test]
    fn short_periodic_reads_are_written_out_once_with_the_same_values() {
        use cellgraph_compiler::{Op, TensorType};
        let expr: cellgraph_compiler::expr::Expr = "$0 $1 sub $2 div $0 mul".parse().unwrap();
        let dims: [&[usize]; 3] = [&[40, 64, 2, 2], &[1, 64, 1, 1], &[64, 1, 1]];
        let tys: Vec<TensorType> = dims.iter().map(|d| TensorType::f32(d.to_vec())).collect();
        let Some(crate::kernel::Native::Fused(e)) = crate::kernel::bind(&Op::Fused { expr }, &tys.iter().collect::<Vec<_>>()) else {
            panic!("fused binds")
        };
        assert_eq!(e.reads[1..].iter().map(|r| period(r, e.len)).collect::<Vec<_>>(), [Some(256), Some(256)]);
        let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i)).collect();
        let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            let got = pool.install(|| new(e.len, |out| fused(&e, &args, out)));
            for (i, &g) in got.iter().enumerate() {
                let ch = i / 4 % 64;
                let x0 = xs[0][i];
                let want = (x0 - xs[1][ch]) / xs[2][ch] * x0;
                assert_eq!(g.to_bits(), want.to_bits(), "element {i} on {threads}: {g} vs {want}");
            }
        }
    }

    /// An epilogue's program runs in the output's own memory: its operand 0 (the head's
    /// output) read again after the program has started overwriting it, broadcasts read piece
    /// by piece across rows and blocks, and parts starting anywhere, against the ops written
    /// out per element.
    #[test]
    fn epilogue_programs_read_the_heads_output_as_it_was() {
        use cellgraph_compiler::{Op, TensorType};
        let expr: cellgraph_compiler::expr::Expr = "$0 $1 add $0 mul $2 sub 2.0 $0 mul $3 mul add".parse().unwrap();
        let dims: [&[usize]; 4] = [&[4, 100, 100], &[100], &[4, 100, 1], &[4, 1, 100]];
        let tys: Vec<TensorType> = dims.iter().map(|d| TensorType::f32(d.to_vec())).collect();
        let Some(crate::kernel::Native::Fused(e)) = crate::kernel::bind(&Op::Fused { expr }, &tys.iter().collect::<Vec<_>>()) else {
            panic!("fused binds")
        };
        let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i)).collect();
        let extras: Vec<&[f32]> = xs[1..].iter().map(|v| &v[..]).collect();
        let mut got = xs[0].clone();
        let (a, rest) = got.split_at_mut(5_003);
        let (b, c) = rest.split_at_mut(17_120);
        for (first, part) in [(0, a), (5_003, b), (22_123, c)] {
            epilogue(&e, &extras, first, part);
        }
        for (i, &g) in got.iter().enumerate() {
            let (n, r, col) = (i / 10_000, i / 100 % 100, i % 100);
            let x0 = xs[0][i];
            let want = (x0 + xs[1][col]) * x0 - xs[2][n * 100 + r] + 2.0 * x0 * xs[3][n * 100 + col];
            assert_eq!(g.to_bits(), want.to_bits(), "element {i}: {g} vs {want}");
        }
    }
}

//! Direct convolutions for dense geometries (stride 1, dilation 1, no padding, one group:
//! LeNet's and any 'valid' convolution with a small contraction), bound instead of im2col +
//! GEMM when the plan is compiled ([`crate::kernel::bind`], which says where they apply): their column matrix would be
//! `kh * kw` times the input, and writing it cost as much as the product.
//!
//! On the input's grid, output `(oy, ox)` sits at `q = oy * w + ox`, and kernel offset
//! `(ky, kx)` reads the input at `q + ky * w + kx`: a convolution is a one-dimensional
//! correlation over `q`. The `w - ow` positions past each output row are computed and dropped
//! (forward) or carry zeros (gradients). Each kernel holds a tile of vectors of grid positions
//! in registers (channels by two vectors for the forward and the input gradient, filters by
//! input rows for the filter gradient, sized to the register file) and does one fused
//! multiply-add per tap and element, on the CPU's widest vectors, chosen when it runs (pulp:
//! AVX-512, AVX2 with FMA, or none). The multiply-adds are exactly rounded everywhere and each
//! output's sum runs in a fixed order, so the forward and the input gradient give the same
//! bits on any CPU and any thread count; the filter gradient's sums are split by vector lane,
//! so its bits depend on the vector width (as a GEMM's do on its kernel), not on the threads:
//!
//! - forward: `y[o, q] = sum over (c, ky, kx) of w[o, c, ky, kx] * x[c, q + ky * w + kx]`,
//!   gathered a block of `q` at a time;
//! - filter gradient: `dw[o, c, ky, kx] = sum over images and q of dy[o, q] * x[c, q + ...]`,
//!   lane by lane within a chunk of images (a fixed cut of the batch), the lanes then added
//!   pairwise, the chunks' sums added in chunk order;
//! - input gradient: for each tap in order, `dx[c, q + ky * w + kx] += sum over o of
//!   w[o, c, ky, kx] * dy[o, q]`, the sum over `o` made in registers.
//!
//! A non-finite input at a position no output reads (past an output row) meets a zero there
//! in the filter gradient, as it does not in the im2col kernels: 0 * inf gives NaN where
//! those give the sum of the other terms.

use pulp::{Simd, WithSimd};

use super::float::{copy_row, each, vectorized as dispatch, HostFloat, Post};
use crate::kernel::{Geometry, DIRECT_BLOCK as L};

/// A float type's vectors on each instruction set `S`.
pub trait Lanes: HostFloat {
    type V<S: Simd>: Copy;
    /// Elements per vector.
    fn lanes<S: Simd>() -> usize;
    fn splat<S: Simd>(s: S, v: Self) -> Self::V<S>;
    /// `a * b + c`, rounded once.
    fn fma<S: Simd>(s: S, a: Self::V<S>, b: Self::V<S>, c: Self::V<S>) -> Self::V<S>;
    fn add<S: Simd>(s: S, a: Self::V<S>, b: Self::V<S>) -> Self::V<S>;
}

macro_rules! lanes {
    ($t:ident, $v:ident, $n:ident, $splat:ident, $fma:ident, $add:ident) => {
        impl Lanes for $t {
            type V<S: Simd> = S::$v;
            #[inline(always)]
            fn lanes<S: Simd>() -> usize {
                S::$n
            }
            #[inline(always)]
            fn splat<S: Simd>(s: S, v: $t) -> S::$v {
                s.$splat(v)
            }
            #[inline(always)]
            fn fma<S: Simd>(s: S, a: S::$v, b: S::$v, c: S::$v) -> S::$v {
                s.$fma(a, b, c)
            }
            #[inline(always)]
            fn add<S: Simd>(s: S, a: S::$v, b: S::$v) -> S::$v {
                s.$add(a, b)
            }
        }
    };
}

lanes!(f32, f32s, F32_LANES, splat_f32s, mul_add_f32s, add_f32s);
lanes!(f64, f64s, F64_LANES, splat_f64s, mul_add_f64s, add_f64s);

/// One vector of grid positions: a block.
pub(super) type Block<F, S> = <F as Lanes>::V<S>;

#[inline(always)]
pub(super) fn zeros<F: Lanes, S: Simd>(s: S) -> Block<F, S> {
    F::splat(s, F::ZERO)
}

/// `acc[k][j] += w[k] * v[j]`: one rank-1 update of a register tile (a filter tap's weights
/// against a row of input or gradient vectors).
#[inline(always)]
pub(super) fn rank1<F: Lanes, S: Simd, const T: usize, const Q: usize>(s: S, acc: &mut [[Block<F, S>; Q]; T], w: &[F], v: &[Block<F, S>; Q]) {
    for (a, &wk) in acc.iter_mut().zip(w) {
        let wk = F::splat(s, wk);
        for (a, &v) in a.iter_mut().zip(v) {
            *a = F::fma(s, wk, v, *a);
        }
    }
}

/// The vector at `p`.
///
/// # Safety
/// `p..p + lanes` must be inside one allocation.
#[inline(always)]
pub(super) unsafe fn load<F: Lanes, S: Simd>(p: *const F) -> Block<F, S> {
    // SAFETY: the caller vouches for the extent; vectors are plain data.
    unsafe { (p as *const F::V<S>).read_unaligned() }
}

/// Writes a vector at `p`.
///
/// # Safety
/// As [`load`].
#[inline(always)]
pub(super) unsafe fn store<F: Lanes, S: Simd>(p: *mut F, b: Block<F, S>) {
    // SAFETY: as in `load`.
    unsafe { (p as *mut F::V<S>).write_unaligned(b) };
}

/// The sum of a vector's lanes, added pairwise (lane `j` with `j + lanes/2`, and so on).
#[inline(always)]
fn lanes_sum<F: Lanes, S: Simd>(b: Block<F, S>) -> F {
    let mut p = [F::ZERO; L];
    let mut n = F::lanes::<S>();
    // SAFETY: `p` holds L >= lanes elements.
    unsafe { store::<F, S>(p.as_mut_ptr(), b) };
    while n > 1 {
        n /= 2;
        for j in 0..n {
            p[j] += p[j + n];
        }
    }
    p[0]
}

/// Vectors a tile's accumulators may take: half the vector registers (AVX-512's 32, AVX2's
/// 16), the rest for the tile's row of the other operand's vectors, the broadcast element and
/// addresses. (The attention's tiles with 12 accumulators on AVX2, 4 rows by 3 vectors, spilled
/// some to the stack inside their loop: the backward 1.26x and the forward 1.23x the time of 4
/// rows by 2 vectors on a Zen 3 core.)
pub(super) fn budget<S: Simd>() -> usize {
    if S::F32_LANES >= 16 {
        16
    } else {
        8
    }
}

/// The largest power of two at most `n` (and at least 1).
fn floor_pow2(n: usize) -> usize {
    1 << n.max(1).ilog2()
}

/// Tiles covering `0..n`, each the largest power of two that fits what is left and `cap`:
/// `(first, count)`.
fn tiles(n: usize, cap: usize) -> impl Iterator<Item = (usize, usize)> {
    let cap = floor_pow2(cap).min(8);
    let mut first = 0;
    std::iter::from_fn(move || {
        (first < n).then(|| {
            let t = floor_pow2(n - first).min(cap);
            first += t;
            (first - t, t)
        })
    })
}

/// Calls `$f::<F, S, T, ...>(args)` for a run-time tile size `T` in 1, 2, 4, 8 (`; U` passes
/// a further literal generic; `@2 $t, $u` chooses two, the second in 1, 2, 4).
macro_rules! tiled {
    (@2 $t:expr, $u:expr, $f:ident::<$F:ty, $S:ty>($($arg:expr),*)) => {
        match $u {
            1 => tiled!($t, $f::<$F, $S; 1>($($arg),*)),
            2 => tiled!($t, $f::<$F, $S; 2>($($arg),*)),
            _ => tiled!($t, $f::<$F, $S; 4>($($arg),*)),
        }
    };
    ($t:expr, $f:ident::<$F:ty, $S:ty $(; $u:literal)?>($($arg:expr),*)) => {
        match $t {
            1 => $f::<$F, $S, 1 $(, $u)?>($($arg),*),
            2 => $f::<$F, $S, 2 $(, $u)?>($($arg),*),
            4 => $f::<$F, $S, 4 $(, $u)?>($($arg),*),
            _ => $f::<$F, $S, 8 $(, $u)?>($($arg),*),
        }
    };
}

/// A dense convolution's extents on the input grid.
#[derive(Clone, Copy, Debug)]
struct Grid {
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    oh: usize,
    ow: usize,
    kh: usize,
    kw: usize,
    /// Grid positions from the first output to the last: `(oh - 1) * w + ow`.
    span: usize,
    /// `span` rounded up to whole blocks.
    padded: usize,
}

impl Grid {
    fn new(g: &Geometry, o: usize) -> Grid {
        let [_, c, h, w] = g.x;
        let [oh, ow] = g.out;
        let span = (oh - 1) * w + ow;
        Grid { c, h, w, o, oh, ow, kh: g.kernel[0], kw: g.kernel[1], span, padded: span.div_ceil(L) * L }
    }
    fn plane(&self) -> usize {
        self.h * self.w
    }
    fn taps(&self) -> usize {
        self.kh * self.kw
    }
    /// Elements of one input image and of one output image.
    fn images(&self) -> (usize, usize) {
        (self.c * self.plane(), self.o * self.oh * self.ow)
    }
    /// The grid offset of every kernel tap, in order (`ky * w + kx`).
    fn offsets(&self) -> Vec<usize> {
        (0..self.kh).flat_map(|ky| (0..self.kw).map(move |kx| ky * self.w + kx)).collect()
    }
}

/// `w` `[o, c, kh, kw]` as the tiles of `tiles(across, cap)` read it, tile after tile: the
/// forward's output-channel tiles, `[c, taps, tile]`, or (`by_input`) the input gradient's
/// input-channel tiles, `[o, taps, tile]`. A tap reads its tile's weights side by side.
fn pack<F: HostFloat>(w: &[F], o: usize, c: usize, kk: usize, by_input: bool, cap: usize, out: &mut [F]) {
    let (across, along) = if by_input { (c, o) } else { (o, c) };
    let mut at = 0;
    for (first, t) in tiles(across, cap) {
        for a in 0..along {
            for tap in 0..kk {
                for k in 0..t {
                    let (oc, ic) = if by_input { (a, first + k) } else { (first + k, a) };
                    out[at] = w[(oc * c + ic) * kk + tap];
                    at += 1;
                }
            }
        }
    }
}

/// Vectors a forward or input-gradient tile spans (each weight broadcast feeds this many
/// multiply-adds).
const SPAN: usize = 2;

/// Channels in a forward or input-gradient tile on `S`.
fn channel_cap<S: Simd>() -> usize {
    budget::<S>() / SPAN
}

/// The channel cap the packed weights were laid out for (the instruction set the call will
/// use).
fn cap_here<F: Lanes>() -> usize {
    struct Cap<F>(std::marker::PhantomData<F>);
    impl<F: Lanes> WithSimd for Cap<F> {
        type Output = usize;
        #[inline(always)]
        fn with_simd<S: Simd>(self, _: S) -> usize {
            channel_cap::<S>()
        }
    }
    dispatch(Cap::<F>(std::marker::PhantomData))
}

/// Forward: `x` `[n, c, h, w]`, `w` `[o, c, kh, kw]` -> `y` `[n, o, oh, ow]`, image by image
/// across the threads; `post` runs on each image's output.
pub fn forward<F: Lanes>(g: &Geometry, x: &[F], w: &[F], o: usize, y: &mut [F], post: Post<F>) {
    let gr = Grid::new(g, o);
    let (xin, yout) = gr.images();
    assert_eq!(y.len(), g.x[0] * yout, "output extents");
    let offsets = gr.offsets();
    let cap = cap_here::<F>();
    F::partials(w.len(), |packed| {
        pack(w, o, gr.c, gr.taps(), false, cap, packed);
        let images: Vec<_> = y.chunks_mut(yout.max(1)).enumerate().collect();
        each(images, |(i, y)| {
            F::scratch(o * gr.span, |rows| {
                dispatch(Forward { gr: &gr, x: &x[i * xin..][..xin], w: packed, offsets: &offsets, cap, rows, y: &mut *y })
            });
            if let Some(post) = post {
                post(i * yout, y);
            }
        });
    })
}

struct Forward<'a, F> {
    gr: &'a Grid,
    x: &'a [F],
    w: &'a [F],
    offsets: &'a [usize],
    cap: usize,
    /// `[o, span]`: the outputs on the grid.
    rows: &'a mut [F],
    y: &'a mut [F],
}

impl<F: Lanes> WithSimd for Forward<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        let Forward { gr, x, w, offsets, cap, rows, y } = self;
        assert!(gr.span >= L && x.len() >= gr.c * gr.plane() && rows.len() >= gr.o * gr.span);
        assert!(offsets.iter().all(|&off| gr.span - 1 + off < gr.plane()));
        // Vector starts; the last overlaps the one before it (its positions are computed
        // twice, to the same bits).
        let n = F::lanes::<S>();
        let starts: Vec<usize> = (0..gr.span / n).map(|b| b * n).chain((gr.span % n != 0).then_some(gr.span - n)).collect();
        let kk = offsets.len();
        for (o0, t) in tiles(gr.o, cap) {
            let w = &w[o0 * gr.c * kk..][..t * gr.c * kk];
            for q in starts.chunks(SPAN) {
                match *q {
                    [a, b] => tiled!(t, forward_tile::<F, S; 2>(s, gr, x, w, offsets, [a, b], o0, rows)),
                    [a] => tiled!(t, forward_tile::<F, S; 1>(s, gr, x, w, offsets, [a], o0, rows)),
                    _ => unreachable!("tiles span one or two vectors"),
                }
            }
        }
        // The grid's rows, without the positions past each output row.
        for (yo, ro) in y.chunks_exact_mut(gr.oh * gr.ow).zip(rows.chunks_exact(gr.span)) {
            for oy in 0..gr.oh {
                copy_row(&mut yo[oy * gr.ow..][..gr.ow], &ro[oy * gr.w..][..gr.ow]);
            }
        }
    }
}

/// Output channels `o0..o0 + T` at the vectors starting at `q` (`w`: the tile's packed
/// weights, `[c, taps, T]`). The caller has checked that every vector read lies in `x` and
/// every vector written in `rows`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn forward_tile<F: Lanes, S: Simd, const T: usize, const Q: usize>(
    s: S,
    gr: &Grid,
    x: &[F],
    w: &[F],
    offsets: &[usize],
    q: [usize; Q],
    o0: usize,
    rows: &mut [F],
) {
    let kk = offsets.len();
    let mut acc = [[zeros::<F, S>(s); Q]; T];
    for (c, wc) in w.chunks_exact(kk * T).enumerate().take(gr.c) {
        let xc = x[c * gr.plane()..].as_ptr();
        for (&off, wt) in offsets.iter().zip(wc.chunks_exact(T)) {
            let mut xv = [zeros::<F, S>(s); Q];
            for (xv, &q0) in xv.iter_mut().zip(&q) {
                // SAFETY: q0 + off + lanes <= span + off <= plane (checked by the caller).
                *xv = unsafe { load::<F, S>(xc.add(q0 + off)) };
            }
            rank1(s, &mut acc, wt, &xv);
        }
    }
    for (k, a) in acc.iter().enumerate() {
        for (&a, &q0) in a.iter().zip(&q) {
            // SAFETY: q0 + lanes <= span, inside row o0 + k (checked by the caller).
            unsafe { store::<F, S>(rows[(o0 + k) * gr.span + q0..].as_mut_ptr(), a) };
        }
    }
}

/// `dy` (images `[o, oh, ow]`) onto the grid: `[image, o, padded]`, zero past each output row
/// and past the last output.
fn spread<F: HostFloat>(gr: &Grid, dy: &[F], dyq: &mut [F]) {
    dyq.fill(F::ZERO);
    for (src, dst) in dy.chunks_exact(gr.oh * gr.ow).zip(dyq.chunks_exact_mut(gr.padded)) {
        for oy in 0..gr.oh {
            copy_row(&mut dst[oy * gr.w..][..gr.ow], &src[oy * gr.ow..][..gr.ow]);
        }
    }
}

/// Images per chunk of a filter gradient: about eight chunks whatever the thread count (the
/// chunks' partial sums are added in chunk order, so the cut fixes the bits).
fn chunk_images(n: usize) -> usize {
    n.div_ceil(8).max(1)
}

/// Gradient w.r.t. the filter: `dy` `[n, o, oh, ow]`, `x` `[n, c, h, w]` -> `dw`
/// `[o, c, kh, kw]`, as a product contracting over positions: `dy` on the grid (`[o, q]`)
/// times the input rows each (channel, tap) reads (`x[c, q + offset]`). The first chunk's sum
/// is made in `dw` itself, the others in thread-local memory, then added to it in chunk order.
pub fn filter_grad<F: Lanes>(g: &Geometry, dy: &[F], x: &[F], o: usize, dw: &mut [F]) {
    let gr = Grid::new(g, o);
    let n = g.x[0];
    let size = o * gr.c * gr.taps();
    assert_eq!(dw.len(), size, "output extents");
    let per = chunk_images(n);
    let chunks = n.div_ceil(per);
    if chunks == 0 || size == 0 {
        return dw.fill(F::ZERO);
    }
    let (xin, yout) = gr.images();
    // Where each (channel, tap) row starts in an image.
    let rows: Vec<usize> = (0..gr.c).flat_map(|c| gr.offsets().into_iter().map(move |off| c * gr.plane() + off)).collect();
    F::partials((chunks - 1) * size, |rest| {
        let parts: Vec<_> = std::iter::once(&mut *dw).chain(rest.chunks_mut(size)).enumerate().collect();
        each(parts, |(k, dw)| {
            let m = per.min(n - k * per);
            F::scratch(m * o * gr.padded + m * xin + L, |s| {
                let (dyq, xs) = s.split_at_mut(m * o * gr.padded);
                spread(&gr, &dy[k * per * yout..][..m * yout], dyq);
                // The chunk's input, and a block of zeros after it for the last block's reads.
                xs[..m * xin].copy_from_slice(&x[k * per * xin..][..m * xin]);
                xs[m * xin..].fill(F::ZERO);
                dispatch(Filter { gr: &gr, xs, dyq, m, rows: &rows, dw })
            })
        });
        for part in rest.chunks_exact(size) {
            for (a, &b) in dw.iter_mut().zip(part) {
                *a += b;
            }
        }
    })
}

struct Filter<'a, F> {
    gr: &'a Grid,
    /// The chunk's `m` images, then a block of zeros.
    xs: &'a [F],
    /// `[m, o, padded]`: `dy` on the grid ([`spread`]).
    dyq: &'a [F],
    m: usize,
    rows: &'a [usize],
    dw: &'a mut [F],
}

impl<F: Lanes> WithSimd for Filter<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        let Filter { gr, xs, dyq, m, rows, dw } = self;
        let xin = gr.images().0;
        assert!(dyq.len() >= m * gr.o * gr.padded && xs.len() >= m * xin + L);
        // The furthest read: the last image's last row, at the last block.
        assert!(rows.iter().all(|&r| (m - 1) * xin + r + gr.padded <= xs.len()));
        let cap = if budget::<S>() >= 16 { 4 } else { 2 };
        for (o0, mr) in tiles(gr.o, cap) {
            for (j0, nr) in tiles(rows.len(), cap) {
                tiled!(@2 mr, nr, filter_tile::<F, S>(s, gr, xs, dyq, m, &rows[j0..j0 + nr], o0, j0, dw));
            }
        }
    }
}

/// Filters `o0..o0 + R` against the input rows `j0..j0 + C` (`rows`: where they start in an
/// image), over the chunk's images. The caller has checked that every block read lies in
/// `dyq` and `xs`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn filter_tile<F: Lanes, S: Simd, const R: usize, const C: usize>(
    s: S,
    gr: &Grid,
    xs: &[F],
    dyq: &[F],
    m: usize,
    rows: &[usize],
    o0: usize,
    j0: usize,
    dw: &mut [F],
) {
    let xin = gr.images().0;
    let rows: [usize; C] = rows.try_into().expect("a tile's rows");
    let mut acc = [[zeros::<F, S>(s); C]; R];
    for i in 0..m {
        let dyi = dyq[(i * gr.o + o0) * gr.padded..].as_ptr();
        let xi = xs[i * xin..].as_ptr();
        for q0 in (0..gr.padded).step_by(F::lanes::<S>()) {
            let mut d = [zeros::<F, S>(s); R];
            for (r, d) in d.iter_mut().enumerate() {
                // SAFETY: filters o0 + r < o of image i < m, q0 + lanes <= padded (checked by the caller).
                *d = unsafe { load::<F, S>(dyi.add(r * gr.padded + q0)) };
            }
            for (c, &row) in rows.iter().enumerate() {
                // SAFETY: i * xin + row + q0 + lanes <= (m - 1) * xin + row + padded <= xs.len().
                let xv = unsafe { load::<F, S>(xi.add(row + q0)) };
                for (a, &d) in acc.iter_mut().zip(&d) {
                    a[c] = F::fma(s, d, xv, a[c]);
                }
            }
        }
    }
    let cols = gr.c * gr.taps();
    for (r, a) in acc.iter().enumerate() {
        for (c, &a) in a.iter().enumerate() {
            dw[(o0 + r) * cols + j0 + c] = lanes_sum::<F, S>(a);
        }
    }
}

/// Gradient w.r.t. the input: `dy` `[n, o, oh, ow]`, `w` `[o, c, kh, kw]` -> `dx`
/// `[n, c, h, w]`, image by image across the threads.
pub fn input_grad<F: Lanes>(g: &Geometry, dy: &[F], w: &[F], o: usize, dx: &mut [F]) {
    let gr = Grid::new(g, o);
    let (xin, yout) = gr.images();
    assert_eq!(dx.len(), g.x[0] * xin, "output extents");
    // Each input channel's sums on the grid, with room for the last block's furthest tap.
    let row = gr.padded + (gr.kh - 1) * gr.w + gr.kw - 1;
    let offsets = gr.offsets();
    let cap = cap_here::<F>();
    F::partials(w.len(), |packed| {
        pack(w, o, gr.c, gr.taps(), true, cap, packed);
        let images: Vec<_> = dx.chunks_mut(xin.max(1)).enumerate().collect();
        each(images, |(i, dx)| {
            F::scratch(o * gr.padded + gr.c * row, |s| {
                let (dyq, sums) = s.split_at_mut(o * gr.padded);
                spread(&gr, &dy[i * yout..][..yout], dyq);
                sums.fill(F::ZERO);
                dispatch(Input { gr: &gr, dyq, w: packed, offsets: &offsets, cap, sums, row });
                for (d, s) in dx.chunks_exact_mut(gr.plane()).zip(sums.chunks_exact(row)) {
                    d.copy_from_slice(&s[..gr.plane()]);
                }
            })
        });
    })
}

struct Input<'a, F> {
    gr: &'a Grid,
    dyq: &'a [F],
    w: &'a [F],
    offsets: &'a [usize],
    cap: usize,
    /// `[c, row]`: each input channel's sums on the grid.
    sums: &'a mut [F],
    row: usize,
}

impl<F: Lanes> WithSimd for Input<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        let Input { gr, dyq, w, offsets, cap, sums, row } = self;
        assert!(dyq.len() >= gr.o * gr.padded && sums.len() >= gr.c * row);
        assert!(offsets.iter().all(|&off| gr.padded + off <= row));
        let kk = offsets.len();
        let starts: Vec<usize> = (0..gr.padded).step_by(F::lanes::<S>()).collect();
        for (c0, t) in tiles(gr.c, cap) {
            let w = &w[c0 * gr.o * kk..][..t * gr.o * kk];
            for (tap, &off) in offsets.iter().enumerate() {
                for q in starts.chunks(SPAN) {
                    match *q {
                        [a, b] => tiled!(t, input_tile::<F, S; 2>(s, gr, dyq, w, kk, tap, off, [a, b], c0, sums, row)),
                        [a] => tiled!(t, input_tile::<F, S; 1>(s, gr, dyq, w, kk, tap, off, [a], c0, sums, row)),
                        _ => unreachable!("tiles span one or two vectors"),
                    }
                }
            }
        }
    }
}

/// Input channels `c0..c0 + T`, kernel tap `tap` (at grid offset `off`), the vectors starting
/// at `q` (`w`: the tile's packed weights, `[o, taps, T]`). The caller has checked that every
/// vector read lies in `dyq` and every vector written in `sums`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn input_tile<F: Lanes, S: Simd, const T: usize, const Q: usize>(
    s: S,
    gr: &Grid,
    dyq: &[F],
    w: &[F],
    kk: usize,
    tap: usize,
    off: usize,
    q: [usize; Q],
    c0: usize,
    sums: &mut [F],
    row: usize,
) {
    let dy = dyq.as_ptr();
    let mut acc = [[zeros::<F, S>(s); Q]; T];
    for oo in 0..gr.o {
        let wt = &w[(oo * kk + tap) * T..][..T];
        let mut d = [zeros::<F, S>(s); Q];
        for (d, &q0) in d.iter_mut().zip(&q) {
            // SAFETY: q0 + lanes <= padded, inside filter oo < o (checked by the caller).
            *d = unsafe { load::<F, S>(dy.add(oo * gr.padded + q0)) };
        }
        rank1(s, &mut acc, wt, &d);
    }
    for (k, a) in acc.iter().enumerate() {
        for (&a, &q0) in a.iter().zip(&q) {
            let at = sums[(c0 + k) * row + q0 + off..].as_mut_ptr();
            // SAFETY: q0 + off + lanes <= padded + off <= row, inside channel c0 + k (checked by the caller).
            unsafe { store::<F, S>(at, <F as Lanes>::add(s, load::<F, S>(at), a)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::conv;
    use crate::host::float::tests::SCALAR;
    use crate::kernel::{direct_conv, ConvAlgo, Products};

    fn data(n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 - 1001.0) / 1001.0).collect()
    }

    /// Output of `kernel` into a NaN-filled vector (every element must be written).
    fn new(len: usize, kernel: impl FnOnce(&mut [f32])) -> Vec<f32> {
        let mut v = vec![f32::NAN; len];
        kernel(&mut v);
        v
    }

    fn dense(n: usize, c: usize, h: usize, w: usize, kh: usize, kw: usize) -> Geometry {
        Geometry { x: [n, c, h, w], kernel: [kh, kw], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [h - kh + 1, w - kw + 1] }
    }

    /// LeNet's conv1 and conv2, and shapes whose grid span, channel counts and batch leave
    /// partial blocks, tiles and chunks.
    fn cases() -> Vec<(Geometry, usize)> {
        vec![(dense(32, 1, 32, 32, 5, 5), 6), (dense(9, 6, 14, 14, 5, 5), 16), (dense(3, 3, 7, 9, 3, 2), 11), (dense(5, 10, 6, 6, 2, 3), 9)]
    }

    struct Run {
        y: Vec<f32>,
        dx: Vec<f32>,
        dw: Vec<f32>,
    }

    fn run(g: &Geometry, o: usize, salt: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Run) {
        let [n, c, h, w] = g.x;
        let (x, wt, dy) = (data(n * c * h * w, salt), data(o * c * g.kernel[0] * g.kernel[1], salt + 1), data(n * o * g.spatial(), salt + 2));
        let r = Run {
            y: new(n * o * g.spatial(), |y| forward(g, &x, &wt, o, y, None)),
            dx: new(x.len(), |dx| input_grad(g, &dy, &wt, o, dx)),
            dw: new(wt.len(), |dw| filter_grad(g, &dy, &x, o, dw)),
        };
        (x, wt, dy, r)
    }

    /// The forward matches direct loops in f64; both gradients are its adjoints
    /// (<conv(x), dy> = <x, input_grad(dy)> = <w, filter_grad(dy)>) and agree with the
    /// im2col + GEMM kernels element by element.
    #[test]
    fn direct_convolutions_match_direct_loops_their_adjoints_and_the_gemm_kernels() {
        for (g, o) in cases() {
            assert!(direct_conv(&g, 1), "{g:?} takes the direct kernels");
            let (x, w, dy, r) = run(&g, o, 1);
            let [n, c, h, wd] = g.x;
            let [kh, kw] = g.kernel;
            for i in 0..n {
                for oc in 0..o {
                    for oy in 0..g.out[0] {
                        for ox in 0..g.out[1] {
                            let mut acc = 0.0f64;
                            for ci in 0..c {
                                for ky in 0..kh {
                                    for kx in 0..kw {
                                        acc += x[((i * c + ci) * h + oy + ky) * wd + ox + kx] as f64 * w[((oc * c + ci) * kh + ky) * kw + kx] as f64;
                                    }
                                }
                            }
                            let got = r.y[((i * o + oc) * g.out[0] + oy) * g.out[1] + ox] as f64;
                            assert!((got - acc).abs() <= 1e-5 * (1.0 + acc.abs()), "{g:?}: {got} vs {acc}");
                        }
                    }
                }
            }
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>();
            let lhs = dot(&r.y, &dy);
            for rhs in [dot(&x, &r.dx), dot(&w, &r.dw)] {
                assert!((lhs - rhs).abs() <= 1e-4 * (1.0 + lhs.abs()), "{g:?}: {lhs} vs {rhs}");
            }
            let gemm_dx = new(x.len(), |dx| conv::conv2d_input_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &w, o, dx, Products::F32));
            let gemm_dw = new(w.len(), |dw| conv::conv2d_filter_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &x, o, dw, None, Products::F32));
            for (a, b) in r.dx.iter().zip(&gemm_dx).chain(r.dw.iter().zip(&gemm_dw)) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{g:?}: {a} vs {b}");
            }
        }
    }

    /// The same bits on one thread and on three; without vector instructions the same bits for
    /// the forward and the input gradient, and the filter gradient within rounding.
    #[test]
    fn direct_convolution_bits_do_not_depend_on_threads_nor_forward_ones_on_vector_width() {
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (g, o) in cases() {
            let on = |threads: usize| rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            let one = on(1).install(|| run(&g, o, 7).3);
            let three = on(3).install(|| run(&g, o, 7).3);
            assert_eq!((bits(&one.y), bits(&one.dx), bits(&one.dw)), (bits(&three.y), bits(&three.dx), bits(&three.dw)), "{g:?}: threads");
            let scalar = on(1).install(|| {
                SCALAR.with(|s| s.set(true));
                let r = run(&g, o, 7).3;
                SCALAR.with(|s| s.set(false));
                r
            });
            assert_eq!((bits(&one.y), bits(&one.dx)), (bits(&scalar.y), bits(&scalar.dx)), "{g:?}: vector width");
            for (a, b) in one.dw.iter().zip(&scalar.dw) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{g:?}: {a} vs {b}");
            }
        }
    }

    /// Convolutions the direct kernels leave to im2col + GEMM.
    #[test]
    fn only_dense_single_group_small_contractions_go_direct() {
        let strided = Geometry { stride: [2, 2], out: [14, 14], ..dense(2, 1, 32, 32, 5, 5) };
        let padded = Geometry { pad: [1, 1], out: [30, 30], ..dense(2, 1, 32, 32, 5, 5) };
        assert!(!direct_conv(&strided, 1) && !direct_conv(&padded, 1));
        assert!(!direct_conv(&dense(2, 6, 14, 14, 5, 5), 2), "grouped");
        assert!(!direct_conv(&dense(2, 64, 14, 14, 3, 3), 1), "a contraction of 576");
        assert!(!direct_conv(&dense(2, 6, 14, 14, 1, 1), 1), "a 1x1 kernel is already a GEMM");
        assert!(!direct_conv(&dense(2, 6, 4, 4, 3, 3), 1), "fewer grid positions than a block");
    }
}

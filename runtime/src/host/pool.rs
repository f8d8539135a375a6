//! Max pooling on host slices: direct and branch-free on the data (windows of -inf aside), by
//! planes on the rayon pool's threads; the forward keeps its argmax for the gradient. On a CPU
//! with AVX-512, f32 planes pool on the kernels of `pool/x86.rs` (2x2 windows, and any window
//! at a column stride of 1 or 2), sixteen outputs a vector, with the same comparisons in the
//! same order: the same outputs and argmax as the portable loops here, which stay for f64,
//! other strides and other CPUs.

use super::float::{as_f32, as_f32_mut, each, most_shares, post_all, vectorized, HostFloat, Post};
use crate::kernel::Geometry;

mod x86;

/// Marks a max-pooling window that lies entirely in padding (its output is -inf and it
/// passes no gradient).
pub const NO_ARGMAX: u32 = u32::MAX;

/// For each output of a max pool over one plane, the flat index (within the plane) of the
/// window's first largest input (its last NaN, if it has one), or [`NO_ARGMAX`], into `at`,
/// and its value into `y` (-inf where none): [`argmax_one`]'s winner, always.
#[inline(always)]
fn argmax_windows<F: HostFloat>(g: &Geometry, plane: &[F], at: &mut [u32], y: &mut [F], s: &mut PoolScratch<F>) {
    if is_2x2(g) {
        #[cfg(target_arch = "x86_64")]
        if let (true, Some(plane), Some(y)) = (avx512(), as_f32(plane), as_f32_mut(y)) {
            // SAFETY: the CPU has AVX-512 F; the windows lie inside the plane.
            return unsafe { x86::pool_2x2(g.x[3], g.out[1], plane, at, y) };
        }
        pool_2x2(g, plane, at, y)
    } else {
        #[cfg(target_arch = "x86_64")]
        if let (true, 1..=2, Some(x), Some(y), Some(hv)) = (avx512(), g.stride[1], as_f32(plane), as_f32_mut(y), as_f32_mut(&mut s.hv)) {
            s.left.clear();
            // SAFETY: the CPU has AVX-512 F, the column stride is 1 or 2; the slices are the
            // plane's, its outputs' and the scratch's.
            unsafe { x86::separable(g, x, at, y, hv, &mut s.hi, &mut s.left) };
            let ow = g.out[1];
            for &o in &s.left {
                at[o] = argmax_one(g, plane, o / ow, o % ow);
            }
            return;
        }
        pool_separable(g, plane, at, y, s)
    }
}

/// Whether f32 planes pool on [`x86`]'s AVX-512 kernels: where the CPU has
/// AVX-512 F, except in a test that asks for the portable paths.
#[inline(always)]
fn avx512() -> bool {
    #[cfg(test)]
    if super::float::tests::SCALAR.with(std::cell::Cell::get) {
        return false;
    }
    cfg!(target_arch = "x86_64") && x86::available()
}

/// Scratch of [`pool_separable`]: a padded input row, and each input row's pooled values and
/// their indices.
struct PoolScratch<F> {
    row: Vec<F>,
    hv: Vec<F>,
    hi: Vec<u32>,
    /// The outputs [`x86::separable`] left at -inf.
    left: Vec<usize>,
}

impl<F: HostFloat> PoolScratch<F> {
    fn new(g: &Geometry) -> Self {
        if is_2x2(g) {
            // [`pool_2x2`] needs none.
            return PoolScratch { row: Vec::new(), hv: Vec::new(), hi: Vec::new(), left: Vec::new() };
        }
        // The padded row reaches the last window's last column; each phase as long as the
        // longest.
        let len = (g.out[1].max(1) - 1) * g.stride[1] + (g.kernel[1].max(1) - 1) * g.dilation[1] + 1;
        let rows = g.x[2] * g.out[1];
        PoolScratch { row: vec![F::NEG_INF; len.div_ceil(g.stride[1]) * g.stride[1]], hv: vec![F::ZERO; rows], hi: vec![0; rows], left: Vec::new() }
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
        let (at, dy) = (&at[k * per * sp..], &dy[k * per * sp..]);
        if !grad_2x2_x86(g, at, dy, dx) {
            dx.fill(F::ZERO);
            scatter(h * w, sp, at, dy, dx);
        }
        if let Some(post) = post {
            post(k * per * h * w, dx);
        }
    });
}

/// The gradient of 2x2 pools over `dx`'s planes on [`x86`]'s AVX-512 kernel, for
/// rows of 8 outputs or more: whether it did. (On rows of 5, LeNet's second pool, the
/// scatter is faster: 13 us a call against 16.6.)
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn grad_2x2_x86<F: HostFloat>(g: &Geometry, at: &[u32], dy: &[F], dx: &mut [F]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let (true, true, true, Some(dy), Some(dx)) = (is_2x2(g), g.out[1] >= 8, avx512(), as_f32(dy), as_f32_mut(dx)) {
        let ([_, _, h, w], sp) = (g.x, g.spatial());
        for ((d, at), dy) in dx.chunks_exact_mut(h * w).zip(at.chunks_exact(sp)).zip(dy.chunks_exact(sp)) {
            // SAFETY: the CPU has AVX-512 F; `at` is the forward's argmax over the plane.
            unsafe { x86::grad_2x2(h, w, g.out[1], at, dy, d) };
        }
        return true;
    }
    false
}

/// Each output's gradient `dy` added into its argmax's place of the zeroed planes `dx`.
fn scatter<F: HostFloat>(plane: usize, sp: usize, at: &[u32], dy: &[F], dx: &mut [F]) {
    for ((d, at), dy) in dx.chunks_exact_mut(plane).zip(at.chunks_exact(sp)).zip(dy.chunks_exact(sp)) {
        for (&i, &g) in at.iter().zip(dy) {
            if i != NO_ARGMAX {
                d[i as usize] += g;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::float::tests::{new, SCALAR};

    /// The pooling paths (2x2 at stride 2, and the two-pass one for any window) pick the same
    /// input as the general one, output by output, ties (the first maximum wins), NaNs (the
    /// last NaN wins) and -inf (the first input wins) included, and write its value, with
    /// vector instructions and without.
    #[test]
    fn pooling_picks_what_the_general_path_picks() {
        let mut next = numbers(12345);
        // Planes of 5 and 20 outputs a row at 2x2 (a vector's tail, and one and a tail), and
        // of 32 (two whole vectors, every input in a window).
        for (h, w) in [(9, 11), (7, 41), (8, 64)] {
            let plane = plane(h, w, &mut next);
            check_paths(h, w, &plane);
        }
    }

    /// A seeded stream of pseudo-random numbers (a linear congruential generator's high bits).
    fn numbers(mut seed: u64) -> impl FnMut() -> u32 {
        move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        }
    }

    /// A plane of `h x w` with ties, NaNs and -inf, and a corner of -inf.
    fn plane(h: usize, w: usize, next: &mut impl FnMut() -> u32) -> Vec<f32> {
        (0..h * w)
            .map(|i| match next() % 10 {
                // A corner of -inf: some windows read nothing else.
                _ if i % w < 3 && i / w < 3 => f32::NEG_INFINITY,
                0 => f32::NAN,
                1..=4 => 1.0, // ties
                5 => f32::NEG_INFINITY,
                r => r as f32 - 7.0,
            })
            .collect()
    }

    /// [`pooling_picks_what_the_general_path_picks`] over one plane.
    fn check_paths(h: usize, w: usize, plane: &[f32]) {
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
            let general: Vec<u32> = (0..out[0] * out[1]).map(|i| argmax_one(&g, plane, i / out[1], i % out[1])).collect();
            if (pad == [4, 4] || extra > 0) && (h, w) == (9, 11) {
                assert!(general.contains(&NO_ARGMAX) && general.iter().any(|&i| i != NO_ARGMAX), "some windows read no input, some do");
            }
            let want: Vec<u32> = general.iter().map(|&i| if i == NO_ARGMAX { f32::NEG_INFINITY } else { plane[i as usize] }.to_bits()).collect();
            for scalar in [false, true] {
                SCALAR.with(|s| s.set(scalar));
                let mut at = vec![0; general.len()];
                let y = new(general.len(), |y| max_pool2d(&g, plane, &mut at, y));
                let mut only = vec![0; general.len()];
                max_pool2d_argmax(&g, plane, &mut only);
                SCALAR.with(|s| s.set(false));
                let case = format!("{h}x{w}: kernel {kernel:?} stride {stride:?} dilation {dilation:?} pad {pad:?} extra {extra} scalar {scalar}");
                assert_eq!((&at, y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()), (&general, want.clone()), "{case}");
                assert_eq!(only, general, "{case}");
            }
        }
    }

    /// The gradient of a pool from its kept argmax, on the 2x2 kernels and the portable
    /// scatter, gives the same bits: each window's gradient (NaN and -0 among them: the
    /// scatter's `0 += -0` is +0) in its argmax's place, zeros elsewhere, inputs in no window
    /// (an odd last row and column) included, over several planes.
    #[test]
    fn pooling_gradients_match_the_scatter() {
        let mut next = numbers(99);
        for (h, w) in [(9, 11), (7, 41), (8, 64)] {
            let planes = 3;
            let x: Vec<f32> = (0..planes).flat_map(|_| plane(h, w, &mut next)).collect();
            let out = [h / 2, w / 2];
            let g = Geometry { x: [1, planes, h, w], kernel: [2, 2], stride: [2, 2], dilation: [1, 1], pad: [0, 0], out };
            let mut at = vec![0; planes * out[0] * out[1]];
            new(at.len(), |y| max_pool2d(&g, &x, &mut at, y));
            let dy: Vec<f32> = (0..at.len())
                .map(|i| match next() % 8 {
                    0 => f32::NAN,
                    1 => -0.0,
                    _ => i as f32 - 40.0,
                })
                .collect();
            let grads = [false, true].map(|scalar| {
                SCALAR.with(|s| s.set(scalar));
                let dx = new(x.len(), |dx| max_pool2d_grad(&g, &at, &dy, dx, None));
                SCALAR.with(|s| s.set(false));
                dx.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            });
            assert!(grads[1].iter().any(|&b| b == f32::NAN.to_bits()) && !grads[1].contains(&(-0.0f32).to_bits()), "{h}x{w}: NaN passed, -0 made +0");
            assert_eq!(grads[0], grads[1], "{h}x{w}: the 2x2 kernel against the scatter");
        }
    }
}

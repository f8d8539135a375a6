//! Convolutions on maps so small that the kernel reaches (nearly) every input pixel from every
//! output position (ResNet-18's 2 x 2 and 1 x 1 maps on 32 x 32 images) are dense layers:
//! with `p` an output position and `q` an input pixel,
//!
//! `y[n, (o, p)] = sum over (c, q) of x[n, (c, q)] * t[(o, p), (c, q)]`,
//!
//! where `t[(o, p), (c, q)]` is `w[o, c, tap]` for the tap through which position `p` reads
//! pixel `q` (zero where none does). Each direction is then one GEMM over the NCHW tensors as
//! they lie: no column matrix, and none of im2col's products with padding (a 3 x 3 kernel
//! padded by 1 on a 2 x 2 map reads padding in 20 of its 36 taps). `t` is built from the
//! filter in the thread's partials buffer on each call, except where the filter is a
//! parameter read as it is: then it is built once per value of the parameter and kept in the
//! session ([`super::Kept`]). The filter gradient is made tap by tap, each a GEMM over its
//! (position, pixel) entries and the batch ([`filter_grad`]).

use super::bf16::Packed;
use super::float::{each, most_shares, post_all, HostFloat, Post};
use super::gemm::gemm_oriented;
use crate::kernel::{Geometry, Products, Tap};

/// The dense filter of `w` for `g` (with `taps`), in new memory.
pub(super) fn dense<F: HostFloat>(g: &Geometry, taps: &[Tap], o: usize, w: &[F]) -> Vec<F> {
    let [_, c, h, wd] = g.x;
    let mut t = vec![F::ZERO; o * g.spatial() * c * h * wd];
    dense_filter(g, taps, w, o, &mut t, true);
    t
}

/// The dense filter `t` of an earlier value, for the same `g`, `taps` and `o`, rewritten for
/// `w`: only the taps' elements (the rest are the zeros of its first build).
pub(super) fn refill<F: HostFloat>(g: &Geometry, taps: &[Tap], o: usize, w: &[F], t: &mut [F]) {
    dense_filter(g, taps, w, o, t, true);
}

/// A small map's dense filter as a product reads it: as built (`[o * sp, c * hw]`), or
/// packed once for the bf16 pairs while its parameter keeps its value ([`Packed`]: the
/// forward's left operand, the input gradient's right one), which only an f32 session's bf16
/// products read ([`super::Kept`]). The two give the same bits.
pub(super) enum Filter<'a, F> {
    Dense(&'a [F]),
    Packed(&'a Packed),
}

/// Runs `f` on bands of `0..m` (rows of a product with a packed operand) on `threads`
/// threads, each band's start a multiple of the pairs' tile rows (as [`super::bf16::gemm_a_packed`]
/// takes them); an element's sum does not depend on the cut.
fn row_bands(m: usize, threads: usize, f: impl Fn(std::ops::Range<usize>) + Send + Sync) {
    let tile = super::bf16::TILE.0;
    let per = m.div_ceil(threads.max(1)).div_ceil(tile) * tile;
    each((0..m).step_by(per.max(tile)).map(|r| r..(r + per).min(m)).collect(), f)
}

/// `x` as f32 values: a packed filter is only ever made for an f32 session.
fn f32s<F: HostFloat>(x: *const F) -> *const f32 {
    assert_eq!(std::any::TypeId::of::<F>(), std::any::TypeId::of::<f32>(), "a packed filter in an f32 session");
    x as *const f32
}

/// Addresses shared by [`row_bands`]' bands: each writes its own rows.
#[derive(Clone, Copy)]
struct Ptrs(usize, usize);

/// Threads for a GEMM of `m * k * n` multiply-adds (as [`super::gemm::matmul`] chooses).
fn threads(work: usize) -> usize {
    if work >= 1 << 22 {
        rayon::current_num_threads()
    } else {
        1
    }
}

/// `f(oc, part)` for each output channel's part of `buf` (`o` equal parts), the channels
/// cut into contiguous shares.
fn per_channel<F: HostFloat>(buf: &mut [F], o: usize, f: impl Fn(usize, &mut [F]) + Send + Sync) {
    let len = buf.len() / o;
    channel_shares(buf, o, most_shares(), |first, share| {
        for (i, part) in share.chunks_exact_mut(len).enumerate() {
            f(first + i, part);
        }
    });
}

/// `f(first, share)` for `buf` (`o` equal parts, one per output channel) cut into up to
/// `shares` contiguous shares of whole channels, `first` a share's first channel.
fn channel_shares<F: HostFloat>(buf: &mut [F], o: usize, shares: usize, f: impl Fn(usize, &mut [F]) + Send + Sync) {
    let len = buf.len() / o;
    let per = o.div_ceil(shares).max(1);
    let parts: Vec<(usize, &mut [F])> = buf.chunks_mut(per * len).enumerate().map(|(s, share)| (s * per, share)).collect();
    each(parts, |(first, share)| f(first, share));
}

/// Writes the dense filter `t` (`[o * sp, c * hw]`, row-major) of filter `w` (`[o, c, kh, kw]`);
/// `zeroed`: `t`'s elements off the taps are zeros already (else they are written).
fn dense_filter<F: HostFloat>(g: &Geometry, taps: &[Tap], w: &[F], o: usize, t: &mut [F], zeroed: bool) {
    let [_, c, h, wd] = g.x;
    let (sp, hw, kk) = (g.spatial(), h * wd, g.kernel[0] * g.kernel[1]);
    let row = c * hw;
    let full = taps.len() == sp * hw;
    per_channel(t, o, |oc, rows| {
        if !full && !zeroed {
            rows.fill(F::ZERO);
        }
        for ci in 0..c {
            let taps_w = &w[(oc * c + ci) * kk..][..kk];
            for tap in taps {
                rows[tap.p as usize * row + ci * hw + tap.q as usize] = taps_w[tap.t as usize];
            }
        }
    });
}

/// `out [cols, rows]` = the transpose of `a [rows, cols]` (both row-major).
fn transpose<F: Copy>(a: &[F], rows: usize, cols: usize, out: &mut [F]) {
    for (r, row) in a.chunks_exact(cols).take(rows).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            out[c * rows + r] = v;
        }
    }
}

/// [`super::conv::conv2d`] on a small map: `y [n, o * sp] = x [n, c * hw] @ t^T`; `post` runs
/// over the whole output after.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward<F: HostFloat>(g: &Geometry, taps: &[Tap], x: &[F], w: &[F], o: usize, y: &mut [F], post: Post<F>, p: Products) {
    let [_, c, h, wd] = g.x;
    F::partials(o * g.spatial() * c * h * wd, |t| {
        dense_filter(g, taps, w, o, t, false);
        forward_dense(g, x, Filter::Dense(t), o, y, post, p)
    });
}

/// [`forward`] with the dense filter `t` already built.
pub(super) fn forward_dense<F: HostFloat>(g: &Geometry, x: &[F], t: Filter<F>, o: usize, y: &mut [F], post: Post<F>, p: Products) {
    let [n, c, h, wd] = g.x;
    let (k, m) = (c * h * wd, o * g.spatial());
    assert!(y.len() == n * m, "output extents");
    // y^T [m, n] = t [m, k] @ x^T [k, n], with x^T and y^T laid out row-major (the GEMM
    // reading both operands along their contraction took twice as long).
    F::scratch(k * n + m * n, |s| {
        let (xt, yt) = s.split_at_mut(k * n);
        transpose(x, n, k, xt);
        match t {
            Filter::Packed(t) => {
                let at = Ptrs(f32s(xt.as_ptr()) as usize, f32s(yt.as_ptr()) as usize);
                // SAFETY: t is m x k packed, xt is k x n, yt is m x n (row-major, the band's
                // rows from its first); the session is f32 (`f32s`).
                row_bands(m, threads(n * k * m), |rows| unsafe {
                    let (xt, yt) = (at.0 as *const f32, at.1 as *mut f32);
                    super::bf16::gemm_a_packed(t, rows.clone(), n, xt, n as isize, 1, 0.0, yt.add(rows.start * n), n as isize, 1)
                })
            }
            Filter::Dense(t) => {
                assert_eq!(t.len(), m * k, "dense filter extents");
                // SAFETY: t is m x k, xt is k x n, yt is m x n, all row-major.
                unsafe {
                    gemm_oriented::<F>(
                        m,
                        k,
                        n,
                        t.as_ptr(),
                        k as isize,
                        1,
                        xt.as_ptr(),
                        n as isize,
                        1,
                        F::ZERO,
                        yt.as_mut_ptr(),
                        n as isize,
                        1,
                        threads(n * k * m),
                        p,
                    )
                }
            }
        }
        transpose(yt, m, n, y);
    });
    post_all(post, y);
}

/// [`super::conv::conv2d_input_grad`] on a small map: `dx [n, c * hw] = dy [n, o * sp] @ t`.
pub(super) fn input_grad<F: HostFloat>(g: &Geometry, taps: &[Tap], dy: &[F], w: &[F], o: usize, dx: &mut [F], p: Products) {
    let [_, c, h, wd] = g.x;
    F::partials(o * g.spatial() * c * h * wd, |t| {
        dense_filter(g, taps, w, o, t, false);
        input_grad_dense(g, dy, Filter::Dense(t), o, dx, p)
    });
}

/// [`input_grad`] with the dense filter `t` already built.
pub(super) fn input_grad_dense<F: HostFloat>(g: &Geometry, dy: &[F], t: Filter<F>, o: usize, dx: &mut [F], p: Products) {
    let [n, c, h, wd] = g.x;
    let (k, m) = (c * h * wd, o * g.spatial());
    assert!(dy.len() == n * m && dx.len() == n * k, "gradient extents");
    let t = match t {
        Filter::Dense(t) => t,
        Filter::Packed(t) => {
            let at = Ptrs(f32s(dy.as_ptr()) as usize, f32s(dx.as_ptr()) as usize);
            // SAFETY: dy is n x m, t is m x k packed, dx is n x k (row-major, the band's rows
            // from its first); the session is f32 (`f32s`).
            return row_bands(n, threads(n * k * m), |rows| unsafe {
                let (dy, dx) = (at.0 as *const f32, at.1 as *mut f32);
                super::bf16::gemm_b_packed(rows.len(), dy.add(rows.start * m), m as isize, 1, t, 0.0, dx.add(rows.start * k), k as isize, 1)
            });
        }
    };
    assert_eq!(t.len(), m * k, "dense filter extents");
    // SAFETY: dy is n x m, t is m x k, dx is n x k, all row-major.
    unsafe {
        gemm_oriented::<F>(
            n,
            m,
            k,
            dy.as_ptr(),
            m as isize,
            1,
            t.as_ptr(),
            k as isize,
            1,
            F::ZERO,
            dx.as_mut_ptr(),
            k as isize,
            1,
            threads(n * k * m),
            p,
        )
    };
}

/// A kernel tap of [`filter_grad`] that some entry goes through: its index, its (position,
/// pixel) entries, and where its operands start in the scratch.
struct Used<'a> {
    t: usize,
    entries: &'a [(usize, usize)],
    at: usize,
}

/// [`super::conv::conv2d_filter_grad`] on a small map, one GEMM per kernel tap: tap `t`'s
/// gradient `[o, c]` is `sum over its (position p, pixel q) entries and the batch of
/// dy[:, :, p]^T x[:, :, q]`, one product whose contraction runs over the entries and the
/// images together (`dy`'s and `x`'s columns for them copied side by side: a few hundred KiB on
/// ResNet-18's maps). Each share of output channels makes its rows of every used tap's product
/// (a tap some entry goes through) into a `[taps, rows, c]` buffer, then writes its channels out
/// as `dw [o, c, kk]`, running `post` on each channel's filter while it is in cache. A tap no
/// entry goes through (on a 1 x 1 map, all but the centre) is zero. (The folding this replaced
/// summed each entry over the batch, then added the entries: other sums' order, other bits.)
///
/// The products and sums are those of the dense layer's `dy^T @ x` folded onto the taps (no
/// padding's zeros), without its `[o * sp, c * hw]` product in memory: on a 2 x 2 map that was
/// 16 entries per (output, input) channel pair, 4 MiB for 256 channels, written by the GEMM
/// and read back to be added onto 9 taps.
#[allow(clippy::too_many_arguments)]
pub(super) fn filter_grad<F: HostFloat>(g: &Geometry, taps: &[Tap], dy: &[F], x: &[F], o: usize, dw: &mut [F], post: Post<F>, p: Products) {
    let [n, c, h, wd] = g.x;
    let (sp, hw, kk) = (g.spatial(), h * wd, g.kernel[0] * g.kernel[1]);
    assert_eq!(dw.len(), o * c * kk, "output extents");
    // Each tap's entries, in (position, pixel) order.
    let mut entries: Vec<Vec<(usize, usize)>> = vec![Vec::new(); kk];
    for tap in taps {
        entries[tap.t as usize].push((tap.p as usize, tap.q as usize));
    }
    // The taps some entry goes through (on a 1 x 1 map, only the centre), in order, with the
    // offset of their operands in the scratch below.
    let mut used: Vec<Used> = Vec::new();
    let mut at = 0;
    for (t, e) in entries.iter().enumerate().filter(|(_, e)| !e.is_empty()) {
        used.push(Used { t, entries: e, at });
        at += e.len() * n * (o + c);
    }
    F::scratch(at, |s| {
        // Tap t's operands side by side: a [o, k] (column e*n + i is dy[i, :, p_e]), then
        // b [k, c] (row e*n + i is x[i, :, q_e]), k = n times its entries.
        for &Used { entries: tap, at, .. } in &used {
            let k = tap.len() * n;
            let (a, b) = s[at..at + k * (o + c)].split_at_mut(k * o);
            for (e, &(pos, pix)) in tap.iter().enumerate() {
                for i in 0..n {
                    let (dyi, xi) = (&dy[i * o * sp..][..o * sp], &x[i * c * hw..][..c * hw]);
                    for (oc, v) in dyi.iter().skip(pos).step_by(sp).enumerate() {
                        a[oc * k + e * n + i] = *v;
                    }
                    for (dst, v) in b[(e * n + i) * c..][..c].iter_mut().zip(xi.iter().skip(pix).step_by(hw)) {
                        *dst = *v;
                    }
                }
            }
        }
        let (s, used) = (&*s, &used);
        // Shares of output channels (one on one thread, or for little work), each its rows of
        // every tap's product into its partials `[taps, rows, c]`, then its channels' filters
        // written out and `post` run on each while it is in cache (on ResNet-18's
        // 512 x 512 x 3 x 3 gradients, a separate pass over the 9 MiB filter cost about 2.6x
        // the product). A product's rows are its own sums whatever the cut.
        let shares = if threads(n * o * c * taps.len()) > 1 { most_shares() } else { 1 };
        channel_shares(dw, o, shares, |oc0, filters| {
            let rows = filters.len() / (c * kk);
            F::partials(used.len() * rows * c, |dt| {
                for (u, &Used { entries: tap, at, .. }) in used.iter().enumerate() {
                    let k = tap.len() * n;
                    // SAFETY: rows oc0.. of a (o x k) and b (k x c) are inside the scratch, and
                    // tap u's block of dt (rows x c) inside dt, all row-major.
                    unsafe {
                        gemm_oriented::<F>(
                            rows,
                            k,
                            c,
                            s.as_ptr().add(at + oc0 * k),
                            k as isize,
                            1,
                            s.as_ptr().add(at + k * o),
                            c as isize,
                            1,
                            F::ZERO,
                            dt.as_mut_ptr().add(u * rows * c),
                            c as isize,
                            1,
                            1,
                            p,
                        )
                    };
                }
                for (i, planes) in filters.chunks_exact_mut(c * kk).enumerate() {
                    if used.len() < kk {
                        planes.fill(F::ZERO);
                    }
                    for (u, &Used { t, .. }) in used.iter().enumerate() {
                        for (taps_w, &v) in planes.chunks_exact_mut(kk).zip(&dt[(u * rows + i) * c..][..c]) {
                            taps_w[t] = v;
                        }
                    }
                    if let Some(post) = post {
                        post((oc0 + i) * c * kk, planes);
                    }
                }
            })
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::conv::tests::{assert_filter_grad_epilogue, conv_reference};
    use crate::host::conv::{conv2d, conv2d_filter_grad, conv2d_input_grad};
    use crate::kernel::{dense_taps as taps, ConvAlgo};

    fn data(n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 - 1001.0) / 1001.0).collect()
    }

    fn geometry(n: usize, c: usize, hw: [usize; 2], k: usize, s: usize, p: usize) -> Geometry {
        let out = hw.map(|d| (d + 2 * p - k) / s + 1);
        Geometry { x: [n, c, hw[0], hw[1]], kernel: [k, k], stride: [s, s], dilation: [1, 1], pad: [p, p], out }
    }

    /// ResNet-18's small maps (3x3 padded by 1 on 2x2 and 1x1, stride 2 from 2x2 to 1x1), a
    /// 1x2 map, and a 1x10 kernel padded by 1 on a 1x10 map (28 of its 30 pairs are taps: the
    /// dense filter has zeros), with output channels that split unevenly over threads.
    fn cases() -> Vec<(Geometry, usize)> {
        let wide = Geometry { x: [2, 3, 1, 10], kernel: [1, 10], stride: [1, 1], dilation: [1, 1], pad: [0, 1], out: [1, 3] };
        vec![
            (geometry(5, 7, [2, 2], 3, 1, 1), 9),
            (geometry(4, 6, [2, 2], 3, 2, 1), 11),
            (geometry(3, 8, [1, 1], 3, 1, 1), 5),
            (geometry(2, 3, [1, 2], 3, 1, 1), 4),
            (wide, 6),
        ]
    }

    /// Which convolutions go dense: the small maps above; not a 4x4 map (a 3x3 kernel padded by
    /// 1 reads 100 of its 256 pairs), nor LeNet's, nor a 1x1 stride-2 kernel on 2x2, nor groups,
    /// nor empty tensors.
    #[test]
    fn small_maps_go_dense_and_others_do_not() {
        for (g, o) in cases() {
            assert!(taps(&g, 1, o).is_some(), "{g:?}");
        }
        assert!(taps(&geometry(2, 4, [4, 4], 3, 1, 1), 1, 4).is_none());
        assert!(taps(&geometry(2, 1, [32, 32], 5, 1, 0), 1, 6).is_none());
        assert!(taps(&geometry(2, 4, [2, 2], 1, 2, 0), 1, 4).is_none());
        assert!(taps(&geometry(2, 4, [2, 2], 3, 1, 1), 2, 4).is_none());
        assert!(taps(&geometry(0, 4, [2, 2], 3, 1, 1), 1, 4).is_none() && taps(&geometry(2, 0, [2, 2], 3, 1, 1), 1, 4).is_none());
        assert!(taps(&geometry(2, 4, [2, 2], 3, 1, 1), 1, 0).is_none());
    }

    /// The forward matches direct loops in f64, and both gradients match theirs (every tap
    /// summed over the batch, the positions and the channels), through the public kernels.
    #[test]
    fn dense_convolutions_match_direct_loops() {
        for (g, o) in cases() {
            let [n, c, h, wd] = g.x;
            let kk = g.kernel[0] * g.kernel[1];
            let (x, w, dy) = (data(n * c * h * wd, 1), data(o * c * kk, 2), data(n * o * g.spatial(), 3));
            let mut y = vec![f32::NAN; dy.len()];
            conv2d(&ConvAlgo::gemm(&g, 1, o), &g, 1, &x, &w, o, &mut y, None, Products::F32);
            for (a, b) in y.iter().zip(conv_reference(&g, 1, &x, &w, o)) {
                assert!((*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()), "{g:?}: {a} vs {b}");
            }
            let (mut dx_ref, mut dw_ref) = (vec![0.0f64; x.len()], vec![0.0f64; w.len()]);
            for i in 0..n {
                for oc in 0..o {
                    for oy in 0..g.out[0] {
                        for ox in 0..g.out[1] {
                            let d = dy[((i * o + oc) * g.out[0] + oy) * g.out[1] + ox] as f64;
                            for ci in 0..c {
                                for ky in 0..g.kernel[0] {
                                    for kx in 0..g.kernel[1] {
                                        let (Some(iy), Some(ix)) = (g.at(0, oy, ky), g.at(1, ox, kx)) else { continue };
                                        let (xi, wi) = (((i * c + ci) * h + iy) * wd + ix, (oc * c + ci) * kk + ky * g.kernel[1] + kx);
                                        dx_ref[xi] += d * w[wi] as f64;
                                        dw_ref[wi] += d * x[xi] as f64;
                                    }
                                }
                            }
                        }
                    }
                }
            }
            let (mut dx, mut dw) = (vec![f32::NAN; x.len()], vec![f32::NAN; w.len()]);
            conv2d_input_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &w, o, &mut dx, Products::F32);
            conv2d_filter_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &x, o, &mut dw, None, Products::F32);
            assert_filter_grad_epilogue(&g, 1, &dy, &x, o, &dw);
            for (a, b) in dx.iter().zip(&dx_ref).chain(dw.iter().zip(&dw_ref)) {
                assert!((*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()), "{g:?}: {a} vs {b}");
            }
        }
    }

    /// On the bf16 pairs, a dense filter packed once ([`Filter::Packed`], as the session keeps
    /// it) gives the bits of the filter packed at every call: the forward and the input
    /// gradient, on one thread and three, with a contraction past one block of `k` and output
    /// rows in partial tiles.
    #[test]
    fn a_packed_filter_gives_the_dense_filters_bits() {
        if !crate::host::bf16::available() || crate::host::bf16_on_amx() {
            eprintln!("skipped: bf16 products here are not on the AVX-512 BF16 pairs");
            return;
        }
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        for (g, o) in [(geometry(32, 64, [2, 2], 3, 1, 1), 64), (geometry(5, 160, [2, 2], 3, 1, 1), 13), (geometry(3, 8, [2, 2], 3, 2, 1), 13)] {
            let [n, c, h, wd] = g.x;
            let (k, m) = (c * h * wd, o * g.spatial());
            let kk = g.kernel[0] * g.kernel[1];
            let (x, w, dy) = (data(n * k, 7), data(o * c * kk, 8), data(n * m, 9));
            let t = dense(&g, &taps(&g, 1, o).expect("a small map"), o, &w);
            let (pa, pb) = unsafe { (Packed::a(m, k, t.as_ptr(), k as isize, 1), Packed::b(m, k, t.as_ptr(), k as isize, 1)) };
            let run = |threads: usize| {
                rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool").install(|| {
                    let forward = |f: Filter<f32>| {
                        let mut y = vec![0.0; n * m];
                        forward_dense(&g, &x, f, o, &mut y, None, Products::Bf16);
                        bits(y)
                    };
                    let input_grad = |f: Filter<f32>| {
                        let mut dx = vec![0.0; n * k];
                        input_grad_dense(&g, &dy, f, o, &mut dx, Products::Bf16);
                        bits(dx)
                    };
                    [forward(Filter::Dense(&t)), forward(Filter::Packed(&pa)), input_grad(Filter::Dense(&t)), input_grad(Filter::Packed(&pb))]
                })
            };
            for threads in [1, 3] {
                let [y, y_packed, dx, dx_packed] = run(threads);
                assert_eq!(y, y_packed, "{g:?}, {threads} threads: the forward");
                assert_eq!(dx, dx_packed, "{g:?}, {threads} threads: the input gradient");
            }
        }
    }

    /// One thread and three give the same bits (the GEMM splits outputs, never sums; the
    /// dense filter and the tap sums are split by output channel).
    #[test]
    fn dense_bits_do_not_depend_on_threads() {
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        // The third is work enough for the filter gradient's shares of output channels.
        for (g, o) in [(geometry(32, 64, [2, 2], 3, 1, 1), 64), (geometry(3, 8, [2, 2], 3, 2, 1), 13), (geometry(32, 64, [2, 2], 3, 1, 1), 160)] {
            let [n, c, h, wd] = g.x;
            let kk = g.kernel[0] * g.kernel[1];
            let (x, w, dy) = (data(n * c * h * wd, 4), data(o * c * kk, 5), data(n * o * g.spatial(), 6));
            let run = |threads: usize| {
                rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool").install(|| {
                    let (mut y, mut dx, mut dw) = (vec![0.0; dy.len()], vec![0.0; x.len()], vec![0.0; w.len()]);
                    conv2d(&ConvAlgo::gemm(&g, 1, o), &g, 1, &x, &w, o, &mut y, None, Products::F32);
                    conv2d_input_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &w, o, &mut dx, Products::F32);
                    conv2d_filter_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &x, o, &mut dw, None, Products::F32);
                    // And on the bf16 products, where this CPU has them.
                    let mut dw16 = vec![0.0; w.len()];
                    let pr = if crate::host::bf16::available() { Products::Bf16 } else { Products::F32 };
                    conv2d_filter_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &x, o, &mut dw16, None, pr);
                    [bits(y), bits(dx), bits(dw), bits(dw16)]
                })
            };
            assert_eq!(run(1), run(3), "{g:?}");
        }
    }
}

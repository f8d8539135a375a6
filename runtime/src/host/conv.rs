//! Convolutions on host slices (NCHW, row-major) through im2col and GEMM. The batch is cut
//! into chunks of images whose column matrices fit in L2 (in thread-local scratch, reused),
//! and each chunk and group runs one GEMM: im2col of the chunk's images into one column matrix
//! `[c/g*kh*kw, m*oh*ow]` (stride-1 rows are slice copies), the forward `w @ col`, the filter
//! gradient `dy @ col^T` contracting over the chunk (chunk sums added in order), the input
//! gradient `w^T @ dy` then col2im (the unfolding and folding back: [`super::unfold`]). Chunks
//! run on the rayon pool's threads; the cut never depends on the thread count. Which algorithm
//! runs (this, the direct kernels or a dense filter) is decided once, when the plan is built
//! ([`ConvAlgo::choose`]).
//! Every kernel handles stride, dilation, asymmetric padding and groups, so the lowering needs
//! no fallbacks on host backends. `benches/kernels.rs` times them on LeNet5's and ResNet-18's
//! shapes.

use super::direct::{self, Lanes};
use super::float::{each, post_all, HostFloat, Post};
use super::gemm::gemm_oriented;
use super::rows::add_assign;
use super::toeplitz;
use super::unfold::{col2im, conv_dims, gather_rows, im2col_batch, padded_extents, scatter_rows};
use crate::kernel::{ConvAlgo, Geometry, Im2col, Products};

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

/// Convolution by `algo` (see [`ConvAlgo::choose`]): `x` `[n, c, h, w]`, `w`
/// `[o, c/groups, kh, kw]` -> `[n, o, oh, ow]`; `post` runs on the output as it is finished.
#[allow(clippy::too_many_arguments)]
pub fn conv2d<F: Lanes>(algo: &ConvAlgo, g: &Geometry, groups: usize, x: &[F], w: &[F], o: usize, y: &mut [F], post: Post<F>, p: Products) {
    match algo {
        ConvAlgo::Direct => direct::forward(g, x, w, o, y, post),
        ConvAlgo::Dense { taps, .. } => toeplitz::forward(g, taps, x, w, o, y, post, p),
        ConvAlgo::Im2col(c) => match c.crop {
            Some(at) => with_cropped_filter(w, g, &c.g, at, |wc| forward(c, groups, x, wc, o, y, post, p)),
            None => forward(c, groups, x, w, o, y, post, p),
        },
    }
}

/// Gradient of [`conv2d`] w.r.t. its input: `dy` `[n, o, oh, ow]` -> `[n, c, h, w]`.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_input_grad<F: Lanes>(algo: &ConvAlgo, g: &Geometry, groups: usize, dy: &[F], w: &[F], o: usize, dx: &mut [F], p: Products) {
    match algo {
        ConvAlgo::Direct => direct::input_grad(g, dy, w, o, dx),
        ConvAlgo::Dense { taps, .. } => toeplitz::input_grad(g, taps, dy, w, o, dx, p),
        ConvAlgo::Im2col(c) => match c.crop {
            Some(at) => with_cropped_filter(w, g, &c.g, at, |wc| input_grad(c, groups, dy, wc, o, dx, p)),
            None => input_grad(c, groups, dy, w, o, dx, p),
        },
    }
}

/// Gradient of [`conv2d`] w.r.t. its filter: `[o, c/groups, kh, kw]`; `post` runs on the
/// output as it is finished.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_filter_grad<F: Lanes>(
    algo: &ConvAlgo,
    g: &Geometry,
    groups: usize,
    dy: &[F],
    x: &[F],
    o: usize,
    dw: &mut [F],
    post: Post<F>,
    p: Products,
) {
    let c = match algo {
        ConvAlgo::Direct => {
            direct::filter_grad(g, dy, x, o, dw);
            return post_all(post, dw);
        }
        ConvAlgo::Dense { taps, .. } => return toeplitz::filter_grad(g, taps, dy, x, o, dw, post, p),
        ConvAlgo::Im2col(c) => c,
    };
    let Some(at) = c.crop else { return filter_grad(c, groups, dy, x, o, dw, post, p) };
    // The cropped gradient, then written into its taps' places; the others are zero.
    let (big, small) = (g.kernel, c.g.kernel);
    let (big, little, kw) = (big[0] * big[1], small[0] * small[1], big[1]);
    let planes = dw.len() / big;
    F::partials(planes * little, |part| {
        filter_grad(c, groups, dy, x, o, part, None, p);
        dw.fill(F::ZERO);
        for r in 0..small[0] {
            for col in 0..small[1] {
                let (from, to) = (r * small[1] + col, (at[0] + r) * kw + at[1] + col);
                for (d, s) in dw.chunks_exact_mut(big).zip(part.chunks_exact(little)) {
                    d[to] = s[from];
                }
            }
        }
        post_all(post, dw);
    })
}

/// The im2col forward on `c.g`: per chunk of images and group, one GEMM:
/// `w_g [og, kk] @ col [kk, m*oh*ow]`; `post` runs on each chunk's output.
#[allow(clippy::too_many_arguments)]
fn forward<F: HostFloat>(c: &Im2col, groups: usize, x: &[F], w: &[F], o: usize, y: &mut [F], post: Post<F>, p: Products) {
    let g = &c.g;
    let d = conv_dims(g, groups, o);
    let [n, ch, h, wd] = g.x;
    assert_eq!(y.len(), n * o * d.sp, "output extents");
    if y.is_empty() {
        return;
    }
    let per = c.chunk;
    let par = gemm_threads(n.div_ceil(per));
    let chunks: Vec<_> = y.chunks_mut(per * o * d.sp).enumerate().collect();
    each(chunks, |(k, yc)| {
        let sub = sub_batch(g, yc.len() / (o * d.sp));
        let dc = conv_dims(&sub, groups, o);
        let xc = &x[k * per * ch * h * wd..][..sub.x[0] * ch * h * wd];
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

/// The im2col input gradient on `c.g`: per chunk and group,
/// `w_g^T [kk, og] @ dy_g [og, m*oh*ow]`, then col2im image by image.
fn input_grad<F: HostFloat>(algo: &Im2col, groups: usize, dy: &[F], w: &[F], o: usize, dx: &mut [F], p: Products) {
    let g = &algo.g;
    let d = conv_dims(g, groups, o);
    let [n, c, h, wi] = g.x;
    assert_eq!(dx.len(), n * c * h * wi, "output extents");
    dx.fill(F::ZERO);
    if dx.is_empty() || d.sp == 0 {
        return;
    }
    let per = algo.chunk;
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

/// The im2col filter gradient on `c.g`. Per chunk and group, one GEMM contracting over the
/// chunk's pixels, `dy_g [og, m*oh*ow] @ col^T [m*oh*ow, kk]`; the chunks' partial sums are
/// then added in chunk order (so the thread count changes nothing).
///
/// With few output channels ([`Im2col::transposed`]) the product is made transposed, as
/// `[kk, og]`, and turned back while the chunks are added. The GEMM computes a row-major
/// product as its transpose, packing its left operand and streaming its right one: `dw`'s own
/// layout makes the column matrix the packed one, a strided gather of `kk * m*oh*ow` elements
/// per chunk, as costly as the arithmetic when `og` is 64 (ResNet-18's stem and layer1);
/// `[kk, og]` packs the chunk's `dy` instead. With 128 output channels the arithmetic hides
/// the packing and `dw`'s layout is faster. `post` runs on the output in parts, as each is
/// finished.
#[allow(clippy::too_many_arguments)]
fn filter_grad<F: HostFloat>(c: &Im2col, groups: usize, dy: &[F], x: &[F], o: usize, dw: &mut [F], post: Post<F>, p: Products) {
    let g = &c.g;
    let d = conv_dims(g, groups, o);
    let n = g.x[0];
    let size = o * d.kk;
    assert_eq!(dw.len(), size, "output extents");
    let per = c.chunk;
    let chunks = n.div_ceil(per);
    if chunks == 0 || size == 0 {
        return dw.fill(F::ZERO);
    }
    if !c.transposed {
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::host::float::tests::{data, new};
    use crate::host::pool::{max_pool2d, max_pool2d_grad};
    use crate::host::rows::sum_planes;

    /// [`conv2d_filter_grad`] with an epilogue gives `dw` (its result without one) with the
    /// epilogue applied to every element once, at its own offset.
    pub(crate) fn assert_filter_grad_epilogue(g: &Geometry, groups: usize, dy: &[f32], x: &[f32], o: usize, dw: &[f32]) {
        let post = |first: usize, part: &mut [f32]| part.iter_mut().enumerate().for_each(|(i, v)| *v = *v * 2.0 + (first + i) as f32);
        let twice = new(dw.len(), |out| conv2d_filter_grad(&ConvAlgo::gemm(g, groups, o), g, groups, dy, x, o, out, Some(&post), Products::F32));
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
            let y = new(n * o * g.spatial(), |y| conv2d(&ConvAlgo::gemm(&g, groups, o), &g, groups, &x, &w, o, y, None, Products::F32));
            for (a, b) in y.iter().zip(conv_reference(&g, groups, &x, &w, o)) {
                assert!((*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()), "{g:?}: {a} vs {b}");
            }
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>();
            let dx = new(x.len(), |dx| conv2d_input_grad(&ConvAlgo::gemm(&g, groups, o), &g, groups, &dy, &w, o, dx, Products::F32));
            let dw = new(w.len(), |dw| conv2d_filter_grad(&ConvAlgo::gemm(&g, groups, o), &g, groups, &dy, &x, o, dw, None, Products::F32));
            assert_filter_grad_epilogue(&g, groups, &dy, &x, o, &dw);
            let lhs = dot(&y, &dy);
            for rhs in [dot(&x, &dx), dot(&w, &dw)] {
                assert!((lhs - rhs).abs() <= 1e-4 * (1.0 + lhs.abs()), "{g:?}: {lhs} vs {rhs}");
            }
        }
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
                    bits(new(dy.len(), |y| conv2d(&ConvAlgo::gemm(&g, 1, 16), &g, 1, &x, &w, 16, y, None, Products::F32))),
                    bits(new(x.len(), |dx| conv2d_input_grad(&ConvAlgo::gemm(&g, 1, 16), &g, 1, &dy, &w, 16, dx, Products::F32))),
                    bits(new(w.len(), |dw| conv2d_filter_grad(&ConvAlgo::gemm(&g, 1, 16), &g, 1, &dy, &x, 16, dw, None, Products::F32))),
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
}

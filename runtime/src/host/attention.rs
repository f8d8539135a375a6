//! Multi-head self-attention (`Op::Attention`) on host slices, one (sequence, head) pair at a
//! time, its `[T, T]` scores in the thread's scratch (64 KiB of f32 at T = 128, in L2), never
//! written out. Queries, keys and values are read where they lie in `qkv [B, T, 3C]` (row
//! stride `3C`), and the heads' outputs written into `[B, T, C]` (the gradient into
//! `[B, T, 3C]`): no transposes, slices or pads around the op.
//!
//! The scores are made in bands of `BAND` (64) query rows. Under a causal mask band `r0..r1`
//! needs keys `0..r1` only, so every product (two forward, five backward: the scores again,
//! then `dP = dY V^T`, `dV = P^T dY`, `dQ = dS K`, `dK = dS^T Q`) skips the bands of keys
//! that no query of the band sees: 3/4 of the dense work at T = 128, where a causal
//! `matmul`, `causal_mask` and softmax did all of it. Within a band, the entries past a row's
//! last key are zeros in `P` and `dS`, so the products over whole bands add nothing for them.
//! (Bands of 32 skip more, 5/8, but each band is a GEMM call of its own, and calls of 32 rows
//! by 32 cost more than the work they skip: `attention` and `attention_grad` took 1,365 ms
//! over the GPT's 20 updates with bands of 32, 1,289 with 64, 1,487 with one band of 128.)
//!
//! Per row the softmax is `p = exp(s - max) / sum` over the keys the row sees (`s` the scaled
//! score), as the unfused ops compute it with the masked entries taking no part. When the
//! plan pairs the forward with its gradient (a training step: [`crate::host::Kept`]), the
//! forward makes `P` in the kept `[B, H, T, T]` buffer instead of scratch (2 MiB a layer for
//! the GPT's micro-batch) and the gradient reads it there; a gradient without its forward
//! recomputes `P` from `Q` and `K` (as flash attention does), with the same code and so the
//! same bits.

use super::float::{each, vectorized, HostFloat};
use super::gemm::gemm_oriented;
use crate::kernel::Products;

/// Query rows per band of scores: the products' rows, and the causal mask's granularity
/// (see the module's doc for why 64).
const BAND: usize = 64;

/// Extents `[b, t, heads, d]` of an attention over `qkv [b, t, 3 * heads * d]`.
type Extents = [usize; 4];

/// The output's address, shared by the (sequence, head) items: each writes its own columns.
struct Out<F>(*mut F);
// SAFETY: items write disjoint elements (their head's columns of their sequence's rows).
unsafe impl<F> Sync for Out<F> {}
unsafe impl<F> Send for Out<F> {}

/// A rounding of the result's values (bf16, f16: the plan's `round_to` after the attention),
/// done by each (sequence, head) item over its own rows as it finishes them, still in cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    Bf16,
    F16,
}

/// Rounds `rows` rows of `d` values at row stride `ld` from `x`.
///
/// # Safety
/// `x` must address `rows` rows of `d` elements at row stride `ld`, written by no one else.
#[inline(always)]
unsafe fn round_rows<F: HostFloat>(x: *mut F, rows: usize, ld: usize, d: usize, r: Round) {
    for i in 0..rows {
        let row = std::slice::from_raw_parts_mut(x.add(i * ld), d);
        match r {
            Round::Bf16 => row.iter_mut().for_each(|v| *v = v.round_bf16()),
            Round::F16 => row.iter_mut().for_each(|v| *v = v.round_f16()),
        }
    }
}

/// The keys row `i` sees: `0..i + 1` under a causal mask, else all `t`.
#[inline(always)]
fn seen(i: usize, t: usize, causal: bool) -> usize {
    if causal {
        i + 1
    } else {
        t
    }
}

/// The keys a band of rows ending at `r1` reads (its products' extent).
fn band_keys(r1: usize, t: usize, causal: bool) -> usize {
    if causal {
        r1
    } else {
        t
    }
}

/// Lanes of [`masked_fold`] and [`masked_zip`]: the loops over a row keep this many
/// independent running values.
const LANES: usize = 8;

/// Replaces each element of `xs` by `map` of it and folds the first `n` new values by `f` from
/// `init` in [`LANES`] interleaved lanes (element `i` into lane `i % LANES`), then the lanes by
/// `join` in order: one pass that vectorises, where one running value would wait on each
/// step's latency. The elements from `n` on are mapped but take no part (`f` is not applied
/// to them): the loop runs over the whole of `xs` (a band's keys, a multiple of the vectors'
/// width) without a remainder per row, and its value is that of the fold over `xs[..n]`. The
/// order depends on the length only.
#[inline(always)]
fn masked_fold<F: HostFloat>(xs: &mut [F], n: usize, map: impl Fn(F) -> F, init: F, f: impl Fn(F, F) -> F, join: impl Fn(F, F) -> F) -> F {
    let mut acc = [init; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    let mut at = 0;
    for ch in &mut chunks {
        for (l, (a, v)) in acc.iter_mut().zip(ch).enumerate() {
            *v = map(*v);
            let y = f(*a, *v);
            *a = if at + l < n { y } else { *a };
        }
        at += LANES;
    }
    for (l, (a, v)) in acc.iter_mut().zip(chunks.into_remainder()).enumerate() {
        *v = map(*v);
        let y = f(*a, *v);
        *a = if at + l < n { y } else { *a };
    }
    acc.into_iter().reduce(join).unwrap_or(init)
}

/// [`masked_fold`]'s lanes over pairs of the first `n` of `xs` and `ys` (of equal length),
/// summing the lanes.
#[inline(always)]
fn masked_zip<F: HostFloat>(xs: &[F], ys: &[F], n: usize, f: impl Fn(F, F, F) -> F) -> F {
    let mut acc = [F::ZERO; LANES];
    let (mut cx, mut cy) = (xs.chunks_exact(LANES), ys.chunks_exact(LANES));
    let mut at = 0;
    for (a8, b8) in (&mut cx).zip(&mut cy) {
        for (l, ((acc, &a), &b)) in acc.iter_mut().zip(a8).zip(b8).enumerate() {
            let y = f(*acc, a, b);
            *acc = if at + l < n { y } else { *acc };
        }
        at += LANES;
    }
    for (l, ((acc, &a), &b)) in acc.iter_mut().zip(cx.remainder()).zip(cy.remainder()).enumerate() {
        let y = f(*acc, a, b);
        *acc = if at + l < n { y } else { *acc };
    }
    acc.into_iter().fold(F::ZERO, |a, b| a + b)
}

/// `P` of one (sequence, head) into `p` (`[t, t]`, row-major; entries a row does not see and
/// its band reads are zeros, the rest of the row is not written): `q` and `k` at row stride
/// `ld`.
///
/// # Safety
/// `q` and `k` must address `t` rows of `d` elements at row stride `ld`.
#[inline(always)]
unsafe fn probs<F: HostFloat>(q: *const F, k: *const F, ld: usize, [_, t, _, d]: Extents, causal: bool, p: &mut [F]) {
    let scale = F::from_f64(1.0 / (d as f64).sqrt());
    for r0 in (0..t).step_by(BAND) {
        let (r1, ldi) = ((r0 + BAND).min(t), ld as isize);
        let keys = band_keys(r1, t, causal);
        // S[r0..r1, ..keys] = Q[r0..r1] K[..keys]^T.
        gemm_oriented::<F>(r1 - r0, d, keys, q.add(r0 * ld), ldi, 1, k, 1, ldi, F::ZERO, p.as_mut_ptr().add(r0 * t), t as isize, 1, 1, Products::F32);
        for i in r0..r1 {
            // Each pass runs over the band's keys, the entries past the row's last key (`n`
            // on) zeros or taking no part: whole vectors, where passes over the row's `n`
            // entries ended in a remainder of up to 15 (its own loop, on 4 lanes or one) in
            // every row. The values, and the order of each sum, are the same.
            let (row, n) = (&mut p[i * t..][..keys], seen(i, t, causal));
            // A NaN score need not be the maximum: its exp, and so the sum, is NaN anyway.
            let larger = |m: F, v: F| if v > m { v } else { m };
            let max = masked_fold(row, n, |v| v * scale, F::NEG_INF, larger, larger);
            // The exponentials in a pass of their own, then summed in the lanes: one pass that
            // also summed ran `exp` on 4 or fewer lanes at a time (a third of the GPT's
            // attention time in bf16); the values and the order of the sum are the same.
            for (j, v) in row.iter_mut().enumerate() {
                let e = (*v - max).program_exp();
                *v = if j < n { e } else { F::ZERO };
            }
            // The zeros past `n` add nothing: the sum over the row is the sum over its keys.
            let sum = masked_fold(row, keys, |v| v, F::ZERO, |a, v| a + v, |a, b| a + b);
            for (j, v) in row.iter_mut().enumerate() {
                let y = *v / sum;
                *v = if j < n { y } else { F::ZERO };
            }
        }
    }
}

/// The forward of one (sequence, head) under pulp's dispatch (the row loops vectorise).
struct Forward<'a, F> {
    qkv: &'a [F],
    y: &'a Out<F>,
    e: Extents,
    causal: bool,
    item: usize,
    /// `[t, t]` for `P`: scratch, or the item's part of the kept probabilities.
    p: &'a mut [F],
    round: Option<Round>,
}

impl<F: HostFloat> pulp::WithSimd for Forward<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Forward { qkv, y, e, causal, item, p, round } = self;
        let [_, t, heads, d] = e;
        let (c, (bi, h)) = (heads * d, (item / heads, item % heads));
        let ld = 3 * c;
        // SAFETY: the sequence's rows of `qkv` and `y` hold head `h`'s `d` columns at offsets
        // `h*d` (queries), `c + h*d` (keys), `2c + h*d` (values) and `h*d`.
        unsafe {
            let x = qkv.as_ptr().add(bi * t * ld + h * d);
            let (q, k, v) = (x, x.add(c), x.add(2 * c));
            probs(q, k, ld, e, causal, p);
            let y = y.0.add(bi * t * c + h * d);
            for r0 in (0..t).step_by(BAND) {
                let r1 = (r0 + BAND).min(t);
                let keys = band_keys(r1, t, causal);
                // Y[r0..r1] = P[r0..r1, ..keys] V[..keys].
                gemm_oriented::<F>(
                    r1 - r0,
                    keys,
                    d,
                    p.as_ptr().add(r0 * t),
                    t as isize,
                    1,
                    v,
                    ld as isize,
                    1,
                    F::ZERO,
                    y.add(r0 * c),
                    c as isize,
                    1,
                    1,
                    Products::F32,
                );
            }
            if let Some(r) = round {
                round_rows(y, t, c, d, r);
            }
        }
    }
}

/// The gradient of one (sequence, head) w.r.t. its queries, keys and values.
struct Backward<'a, F> {
    qkv: &'a [F],
    dy: &'a [F],
    dx: &'a Out<F>,
    e: Extents,
    causal: bool,
    item: usize,
    /// `[2, t, t]` of scratch for `P` and `dS`.
    s: &'a mut [F],
    /// The item's `P` as the forward kept it, if it did.
    kept: Option<&'a [F]>,
    round: Option<Round>,
}

impl<F: HostFloat> pulp::WithSimd for Backward<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Backward { qkv, dy, dx, e, causal, item, s, kept, round } = self;
        let [_, t, heads, d] = e;
        let (c, (bi, h)) = (heads * d, (item / heads, item % heads));
        let (ld, ldi, ti, ci) = (3 * c, 3 * c as isize, t as isize, c as isize);
        let scale = F::from_f64(1.0 / (d as f64).sqrt());
        // `[t, t]` for `dS` at the end; before it, when nothing was kept, `[t, t]` for `P`.
        let (own, ds) = s.split_at_mut(s.len() - t * t);
        // SAFETY: as the forward's; `dy` holds the sequence's `t` rows of `c` and `dx` is laid
        // out as `qkv`.
        unsafe {
            let x = qkv.as_ptr().add(bi * t * ld + h * d);
            let (q, k, v) = (x, x.add(c), x.add(2 * c));
            let g = dy.as_ptr().add(bi * t * c + h * d);
            let dx = dx.0.add(bi * t * ld + h * d);
            let (dq, dk, dv) = (dx, dx.add(c), dx.add(2 * c));
            let p: &[F] = match kept {
                Some(p) => p,
                None => {
                    probs(q, k, ld, e, causal, own);
                    own
                }
            };
            for r0 in (0..t).step_by(BAND) {
                let r1 = (r0 + BAND).min(t);
                let keys = band_keys(r1, t, causal);
                // dP[r0..r1, ..keys] = dY[r0..r1] V[..keys]^T, then dS in its place.
                gemm_oriented::<F>(r1 - r0, d, keys, g.add(r0 * c), ci, 1, v, 1, ldi, F::ZERO, ds.as_mut_ptr().add(r0 * t), ti, 1, 1, Products::F32);
                for i in r0..r1 {
                    // Over the band's keys, as in [`probs`].
                    let n = seen(i, t, causal);
                    let (pr, dr) = (&p[i * t..][..keys], &mut ds[i * t..][..keys]);
                    let dot = masked_zip(pr, dr, n, |acc, a, b| a.mul_add(b, acc));
                    for (j, (v, &a)) in dr.iter_mut().zip(pr).enumerate() {
                        let y = a * (*v - dot) * scale;
                        *v = if j < n { y } else { F::ZERO };
                    }
                }
                // dQ[r0..r1] = dS[r0..r1, ..keys] K[..keys].
                gemm_oriented::<F>(r1 - r0, keys, d, ds.as_ptr().add(r0 * t), ti, 1, k, ldi, 1, F::ZERO, dq.add(r0 * ld), ldi, 1, 1, Products::F32);
            }
            for c0 in (0..t).step_by(BAND) {
                let c1 = (c0 + BAND).min(t);
                // The queries that see keys c0..c1: from c0 on under the mask.
                let lo = if causal { c0 } else { 0 };
                let rows = t - lo;
                // dK[c0..c1] = dS[lo.., c0..c1]^T Q[lo..]; dV[c0..c1] = P[lo.., c0..c1]^T dY[lo..].
                gemm_oriented::<F>(
                    c1 - c0,
                    rows,
                    d,
                    ds.as_ptr().add(lo * t + c0),
                    1,
                    ti,
                    q.add(lo * ld),
                    ldi,
                    1,
                    F::ZERO,
                    dk.add(c0 * ld),
                    ldi,
                    1,
                    1,
                    Products::F32,
                );
                gemm_oriented::<F>(
                    c1 - c0,
                    rows,
                    d,
                    p.as_ptr().add(lo * t + c0),
                    1,
                    ti,
                    g.add(lo * c),
                    ci,
                    1,
                    F::ZERO,
                    dv.add(c0 * ld),
                    ldi,
                    1,
                    1,
                    Products::F32,
                );
            }
            if let Some(r) = round {
                for part in [dq, dk, dv] {
                    round_rows(part, t, ld, d, r);
                }
            }
        }
    }
}

/// `Op::Attention` over `qkv [b, t, 3 * heads * d]` into `y [b, t, heads * d]`, the
/// (sequence, head) pairs spread over the threads; `keep` (`[b, heads, t, t]`), when given,
/// receives the probabilities for [`backward`]; `round`: each item rounds its rows.
pub fn forward<F: HostFloat>(qkv: &[F], e: Extents, causal: bool, keep: Option<&mut [F]>, y: &mut [F], round: Option<Round>) {
    let [b, t, heads, d] = e;
    assert!(qkv.len() == b * t * 3 * heads * d && y.len() == b * t * heads * d, "attention extents");
    assert!(keep.as_ref().is_none_or(|p| p.len() == b * heads * t * t), "kept probabilities' extents");
    let out = Out(y.as_mut_ptr());
    let out = &out;
    let keep = keep.map(|p| Out(p.as_mut_ptr()));
    let keep = &keep;
    each((0..b * heads).collect(), |item| match keep {
        // SAFETY: item `item` writes its own `[t, t]` of the kept buffer (checked above).
        Some(p) => {
            vectorized(Forward { qkv, y: out, e, causal, item, p: unsafe { std::slice::from_raw_parts_mut(p.0.add(item * t * t), t * t) }, round })
        }
        // The scratch is taken here, outside pulp's dispatch: a closure handed to `scratch`
        // from inside it would be compiled without the dispatch's target features (its row
        // loops then called `fmaf` per element and did not vectorise).
        None => F::scratch(t * t, |p| vectorized(Forward { qkv, y: out, e, causal, item, p, round })),
    });
}

/// `Op::AttentionGrad`: the gradient w.r.t. `qkv` of [`forward`] given `dy [b, t, heads * d]`,
/// into `dx` (laid out as `qkv`); `kept`, the probabilities [`forward`] kept for this `qkv`,
/// or `None` to make them again; `round`: each item rounds its rows.
pub fn backward<F: HostFloat>(qkv: &[F], dy: &[F], e: Extents, causal: bool, kept: Option<&[F]>, dx: &mut [F], round: Option<Round>) {
    let [b, t, heads, d] = e;
    assert!(qkv.len() == b * t * 3 * heads * d && dx.len() == qkv.len() && dy.len() == b * t * heads * d, "attention gradient extents");
    assert!(kept.is_none_or(|p| p.len() == b * heads * t * t), "kept probabilities' extents");
    let out = Out(dx.as_mut_ptr());
    let out = &out;
    let s = if kept.is_some() { t * t } else { 2 * t * t };
    each((0..b * heads).collect(), |item| {
        let kept = kept.map(|p| &p[item * t * t..][..t * t]);
        F::scratch(s, |s| vectorized(Backward { qkv, dy, dx: out, e, causal, item, s, kept, round }))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 - 1001.0) / 500.0).collect()
    }

    /// The attention in f64 by its definition: scores, softmax over the keys each query sees,
    /// mixing; and its gradient w.r.t. `qkv` by the chain rule, element by element.
    fn reference(qkv: &[f32], dy: &[f32], [b, t, heads, d]: Extents, causal: bool) -> (Vec<f64>, Vec<f64>) {
        let c = heads * d;
        let at = |bi: usize, i: usize, part: usize, h: usize, j: usize| ((bi * t + i) * 3 + part) * c + h * d + j;
        let (mut y, mut dx) = (vec![0.0; b * t * c], vec![0.0; qkv.len()]);
        let scale = 1.0 / (d as f64).sqrt();
        for bi in 0..b {
            for h in 0..heads {
                for i in 0..t {
                    let n = seen(i, t, causal);
                    let s: Vec<f64> = (0..n)
                        .map(|j| (0..d).map(|x| qkv[at(bi, i, 0, h, x)] as f64 * qkv[at(bi, j, 1, h, x)] as f64).sum::<f64>() * scale)
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    let p: Vec<f64> = e.iter().map(|v| v / sum).collect();
                    let g = |x: usize| dy[(bi * t + i) * c + h * d + x] as f64;
                    for x in 0..d {
                        y[(bi * t + i) * c + h * d + x] = (0..n).map(|j| p[j] * qkv[at(bi, j, 2, h, x)] as f64).sum();
                    }
                    let dp: Vec<f64> = (0..n).map(|j| (0..d).map(|x| g(x) * qkv[at(bi, j, 2, h, x)] as f64).sum()).collect();
                    let dot: f64 = (0..n).map(|j| dp[j] * p[j]).sum();
                    for j in 0..n {
                        let ds = p[j] * (dp[j] - dot) * scale;
                        for x in 0..d {
                            dx[at(bi, i, 0, h, x)] += ds * qkv[at(bi, j, 1, h, x)] as f64;
                            dx[at(bi, j, 1, h, x)] += ds * qkv[at(bi, i, 0, h, x)] as f64;
                            dx[at(bi, j, 2, h, x)] += p[j] * g(x);
                        }
                    }
                }
            }
        }
        (y, dx)
    }

    /// The masked folds over a whole row give the bits of the same lanes over its first `n`
    /// entries alone (what the passes over a row's live keys computed), for every `n` and
    /// length, whatever the entries past `n` hold (infinities and NaN included).
    #[test]
    fn masked_folds_are_the_folds_over_the_first_n() {
        let lanes_over = |xs: &[f32], f: &dyn Fn(f32, f32) -> f32, init: f32, join: &dyn Fn(f32, f32) -> f32| {
            let mut acc = [init; LANES];
            for (i, &v) in xs.iter().enumerate() {
                acc[i % LANES] = f(acc[i % LANES], v);
            }
            acc.into_iter().reduce(join).unwrap()
        };
        let larger = |m: f32, v: f32| if v > m { v } else { m };
        let add = |a: f32, b: f32| a + b;
        for len in [1, 7, 8, 13, 64, 70] {
            let row: Vec<f32> = data(len, len).into_iter().enumerate().map(|(i, v)| if i % 11 == 5 { -0.0 } else { v }).collect();
            let other = data(len, len + 1);
            for n in 0..=len {
                let mut tail = row.clone();
                for (i, v) in tail.iter_mut().enumerate().skip(n) {
                    *v = [f32::INFINITY, f32::NAN, 1e30, -0.0][i % 4];
                }
                let mut xs = tail.clone();
                let max = masked_fold(&mut xs, n, |v| v * 0.5, f32::NEG_INFINITY, larger, larger);
                let halves: Vec<f32> = row[..n].iter().map(|v| v * 0.5).collect();
                assert_eq!(max.to_bits(), lanes_over(&halves, &larger, f32::NEG_INFINITY, &larger).to_bits(), "max, {len} {n}");
                assert!(xs.iter().zip(&tail).all(|(a, b)| a.to_bits() == (b * 0.5).to_bits()), "every entry mapped, {len} {n}");
                let sum = masked_fold(&mut tail.clone(), n, |v| v, 0.0, add, add);
                assert_eq!(sum.to_bits(), lanes_over(&row[..n], &add, 0.0, &add).to_bits(), "sum, {len} {n}");
                let dot = masked_zip(&tail, &other, n, |acc, a, b| a.mul_add(b, acc));
                let mut acc = [0f32; LANES];
                for i in 0..n {
                    acc[i % LANES] = row[i].mul_add(other[i], acc[i % LANES]);
                }
                assert_eq!(dot.to_bits(), acc.into_iter().fold(0.0, |a, b| a + b).to_bits(), "dot, {len} {n}");
            }
        }
    }

    /// Forward and gradient match the definition, causal or not, on sequences shorter than a
    /// band, of several bands and of a band and a part (the mask's edges inside and between
    /// bands), and give the same bits on one thread and on three, and with the gradient reading
    /// the probabilities the forward kept (the kept buffer starts as NaN: an entry the forward
    /// did not write and the gradient read would show).
    #[test]
    fn attention_matches_its_definition_on_any_number_of_threads() {
        for (e, causal) in [([2, 5, 2, 3], true), ([2, 5, 2, 3], false), ([1, 70, 3, 4], true), ([3, 64, 2, 8], true), ([1, 70, 1, 5], false)] {
            let [b, t, heads, d] = e;
            let (qkv, dy) = (data(b * t * 3 * heads * d, 1), data(b * t * heads * d, 2));
            let run = |threads: usize| {
                rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool").install(|| {
                    let (mut y, mut dx) = (vec![f32::NAN; dy.len()], vec![f32::NAN; qkv.len()]);
                    forward(&qkv, e, causal, None, &mut y, None);
                    backward(&qkv, &dy, e, causal, None, &mut dx, None);
                    (y, dx)
                })
            };
            let (y, dx) = run(1);
            let kept = |threads: usize| {
                rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool").install(|| {
                    let (mut y, mut dx, mut p) = (vec![f32::NAN; dy.len()], vec![f32::NAN; qkv.len()], vec![f32::NAN; b * heads * t * t]);
                    forward(&qkv, e, causal, Some(&mut p), &mut y, None);
                    backward(&qkv, &dy, e, causal, Some(&p), &mut dx, None);
                    (y, dx)
                })
            };
            let (y_ref, dx_ref) = reference(&qkv, &dy, e, causal);
            for (what, got, want) in [("y", &y, &y_ref), ("dqkv", &dx, &dx_ref)] {
                for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                    assert!((*a as f64 - b).abs() <= 2e-5 * (1.0 + b.abs()), "{e:?} causal {causal}: {what}[{i}] {a} vs {b}");
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (y3, dx3) = run(3);
            assert_eq!((bits(&y), bits(&dx)), (bits(&y3), bits(&dx3)), "{e:?} causal {causal}: threads");
            for threads in [1, 3] {
                let (yk, dxk) = kept(threads);
                assert_eq!((bits(&y), bits(&dx)), (bits(&yk), bits(&dxk)), "{e:?} causal {causal}: kept probabilities, {threads} threads");
            }
            // Rounded by the items as they finish: every value of the result rounded, once.
            for (round, r) in
                [(Round::Bf16, (|v| half::bf16::from_f32(v).to_f32()) as fn(f32) -> f32), (Round::F16, |v| half::f16::from_f32(v).to_f32())]
            {
                let (mut yr, mut dxr) = (vec![f32::NAN; dy.len()], vec![f32::NAN; qkv.len()]);
                forward(&qkv, e, causal, None, &mut yr, Some(round));
                backward(&qkv, &dy, e, causal, None, &mut dxr, Some(round));
                let rounded = |v: &[f32]| bits(&v.iter().map(|&x| r(x)).collect::<Vec<_>>());
                assert_eq!((bits(&yr), bits(&dxr)), (rounded(&y), rounded(&dx)), "{e:?} causal {causal}: rounded {round:?}");
            }
        }
    }
}

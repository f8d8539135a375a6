//! Multi-head self-attention over one projection's `qkv [b, t, 3c]` (`c = heads * d`; see
//! `Op::Attention`) and its gradient, without materialising the `[b, heads, t, t]` scores.
//! The burn-ops lowering (`crate::lower`, still the reference) took about 47 launches a layer
//! forward and backward (copies splitting and merging the heads, the products, the mask, a
//! softmax in five): the small GPT's micro-step went from 552 launches to 376 with these three.
//!
//! One unit per query row `(sequence, head, i)`, its `d` query values and accumulators in
//! registers, the keys and values read from `qkv` in place (consecutive units are consecutive
//! rows of one (sequence, head), so a plane's units read the same key at the same time). The
//! forward takes each row's maximum score, then sums `exp(s - max) v` and divides by the sum
//! of the exponentials. The gradient is two launches, as flash attention's: [`attention_grad_rows`] (a unit per query
//! row: the row's maximum and sum, `rowdot = sum_j p_ij dp_ij` and `dq_i`, the three statistics
//! kept for the second launch) then [`attention_grad_cols`] (a unit per key row: `dk_j` and
//! `dv_j`, each probability recomputed from its row's statistics). Under the causal mask a row
//! sees keys `0..=i`, and a key the queries `j..t`: masked pairs are never computed.

use cubecl::prelude::*;

/// An attention kernel's compile-time extents: `t` positions, `heads` heads of width `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnDims {
    pub t: u32,
    pub heads: u32,
    pub d: u32,
    pub causal: bool,
}

impl AttnDims {
    pub fn new(t: usize, heads: usize, d: usize, causal: bool) -> Option<AttnDims> {
        Some(AttnDims { t: u32::try_from(t).ok()?, heads: u32::try_from(heads).ok()?, d: u32::try_from(d).ok()?, causal })
    }
}

/// `(s * t + i) * 3c + h * d`: where row `i`'s query of head `h` in sequence `s` starts in
/// `qkv` (its key at `+ c`, its value at `+ 2c`).
#[cube]
fn qkv_row(s: usize, h: usize, i: usize, #[comptime] g: AttnDims) -> usize {
    let (t, c, d) = comptime!((g.t as usize, (g.heads * g.d) as usize, g.d as usize));
    (s * t + i) * 3 * c + h * d
}

/// `x · qkv[at..at + d]`.
#[cube]
fn dot<F: Float>(x: &Array<F>, qkv: &Array<F>, at: usize, #[comptime] d: u32) -> F {
    let mut acc = F::new(0.0);
    #[unroll]
    for e in 0..d as usize {
        acc += x[e] * qkv[at + e];
    }
    acc
}

/// The unit's `(sequence, head, row)` from its position (rows fastest).
#[cube]
fn unit(idx: usize, #[comptime] g: AttnDims) -> (usize, usize, usize) {
    let (t, heads) = comptime!((g.t as usize, g.heads as usize));
    (idx / (t * heads), (idx / t) % heads, idx % t)
}

/// Row `i`'s query (or any `d` values at `at`) into registers.
#[cube]
fn load<F: Float>(qkv: &Array<F>, at: usize, #[comptime] d: u32) -> Array<F> {
    let mut x = Array::<F>::new(d as usize);
    #[unroll]
    for e in 0..d as usize {
        x[e] = qkv[at + e];
    }
    x
}

/// The keys row `i` sees: `i + 1` under the causal mask, else all `t`.
#[cube]
fn keys(i: usize, #[comptime] g: AttnDims) -> usize {
    let t = comptime!(g.t as usize);
    let mut n = i + 1;
    if comptime!(!g.causal) {
        n = t;
    }
    n
}

/// Row `q`'s maximum score over keys `0..n` of `(s, h)`.
#[cube]
fn row_max<F: Float>(q: &Array<F>, qkv: &Array<F>, s: usize, h: usize, n: usize, scale: F, #[comptime] g: AttnDims) -> F {
    let c = comptime!((g.heads * g.d) as usize);
    let mut m = dot(q, qkv, qkv_row(s, h, 0, g) + c, g.d) * scale;
    for j in 1..n {
        m = F::max(m, dot(q, qkv, qkv_row(s, h, j, g) + c, g.d) * scale);
    }
    m
}

/// `y[s, i, h * d..]` = `softmax(q_i K^T * scale) V` over the keys row `i` sees.
#[cube(launch_unchecked)]
pub fn attention_forward<F: Float>(qkv: &Array<F>, y: &mut Array<F>, scale: f32, #[comptime] g: AttnDims) {
    let idx = ABSOLUTE_POS;
    let (t, c, d) = comptime!((g.t as usize, (g.heads * g.d) as usize, g.d as usize));
    if idx * d < y.len() {
        let (s, h, i) = unit(idx, g);
        let scale = F::cast_from(scale);
        let q = load(qkv, qkv_row(s, h, i, g), g.d);
        let n = keys(i, g);
        let m = row_max(&q, qkv, s, h, n, scale, g);
        let mut o = Array::<F>::new(d);
        #[unroll]
        for e in 0..d {
            o[e] = F::new(0.0);
        }
        let mut l = F::new(0.0);
        for j in 0..n {
            let at = qkv_row(s, h, j, g);
            let p = F::exp(dot(&q, qkv, at + c, g.d) * scale - m);
            l += p;
            #[unroll]
            for e in 0..d {
                o[e] += p * qkv[at + 2 * c + e];
            }
        }
        let out = (s * t + i) * c + h * d;
        #[unroll]
        for e in 0..d {
            y[out + e] = o[e] / l;
        }
    }
}

/// The gradient's first launch, a unit per query row `i`: its maximum score `m`, the sum `l`
/// of `exp(s - m)`, `rowdot = sum_j p_ij (dy_i · v_j)` into `stats[3 * unit..]`, and
/// `dq_i = scale * sum_j p_ij (dy_i · v_j - rowdot) k_j` into `dx` (laid out as `qkv`).
#[cube(launch_unchecked)]
pub fn attention_grad_rows<F: Float>(qkv: &Array<F>, dy: &Array<F>, dx: &mut Array<F>, stats: &mut Array<F>, scale: f32, #[comptime] g: AttnDims) {
    let idx = ABSOLUTE_POS;
    let (t, c, d) = comptime!((g.t as usize, (g.heads * g.d) as usize, g.d as usize));
    if idx * 3 < stats.len() {
        let (s, h, i) = unit(idx, g);
        let scale = F::cast_from(scale);
        let q = load(qkv, qkv_row(s, h, i, g), g.d);
        let gy = load(dy, (s * t + i) * c + h * d, g.d);
        let n = keys(i, g);
        let m = row_max(&q, qkv, s, h, n, scale, g);
        let mut l = F::new(0.0);
        for j in 0..n {
            l += F::exp(dot(&q, qkv, qkv_row(s, h, j, g) + c, g.d) * scale - m);
        }
        let mut rowdot = F::new(0.0);
        for j in 0..n {
            let at = qkv_row(s, h, j, g);
            let p = F::exp(dot(&q, qkv, at + c, g.d) * scale - m) / l;
            rowdot += p * dot(&gy, qkv, at + 2 * c, g.d);
        }
        let mut dq = Array::<F>::new(d);
        #[unroll]
        for e in 0..d {
            dq[e] = F::new(0.0);
        }
        for j in 0..n {
            let at = qkv_row(s, h, j, g);
            let p = F::exp(dot(&q, qkv, at + c, g.d) * scale - m) / l;
            let ds = p * (dot(&gy, qkv, at + 2 * c, g.d) - rowdot) * scale;
            #[unroll]
            for e in 0..d {
                dq[e] += ds * qkv[at + c + e];
            }
        }
        let out = qkv_row(s, h, i, g);
        #[unroll]
        for e in 0..d {
            dx[out + e] = dq[e];
        }
        stats[3 * idx] = m;
        stats[3 * idx + 1] = l;
        stats[3 * idx + 2] = rowdot;
    }
}

/// The gradient's second launch, a unit per key row `j`: `dv_j = sum_i p_ij dy_i` and
/// `dk_j = scale * sum_i p_ij (dy_i · v_j - rowdot_i) q_i` over the queries that see key `j`,
/// into `dx` (laid out as `qkv`), each `p_ij` from row `i`'s statistics.
#[cube(launch_unchecked)]
pub fn attention_grad_cols<F: Float>(qkv: &Array<F>, dy: &Array<F>, stats: &Array<F>, dx: &mut Array<F>, scale: f32, #[comptime] g: AttnDims) {
    let idx = ABSOLUTE_POS;
    let (t, c, d) = comptime!((g.t as usize, (g.heads * g.d) as usize, g.d as usize));
    if idx * 3 < stats.len() {
        let (s, h, j) = unit(idx, g);
        let scale = F::cast_from(scale);
        let at = qkv_row(s, h, j, g);
        let k = load(qkv, at + c, g.d);
        let v = load(qkv, at + 2 * c, g.d);
        let mut first = 0;
        if comptime!(g.causal) {
            first = j;
        }
        let mut dk = Array::<F>::new(d);
        let mut dv = Array::<F>::new(d);
        #[unroll]
        for e in 0..d {
            dk[e] = F::new(0.0);
            dv[e] = F::new(0.0);
        }
        // The statistics of row `i` of this (sequence, head) sit at `3 * (row0 + i)`.
        let row0 = idx - j;
        for i in first..t {
            let qi = qkv_row(s, h, i, g);
            let gi = (s * t + i) * c + h * d;
            let st = 3 * (row0 + i);
            let p = F::exp(dot(&k, qkv, qi, g.d) * scale - stats[st]) / stats[st + 1];
            let ds = p * (dot(&v, dy, gi, g.d) - stats[st + 2]) * scale;
            #[unroll]
            for e in 0..d {
                dv[e] += p * dy[gi + e];
                dk[e] += ds * qkv[qi + e];
            }
        }
        #[unroll]
        for e in 0..d {
            dx[at + c + e] = dk[e];
            dx[at + 2 * c + e] = dv[e];
        }
    }
}

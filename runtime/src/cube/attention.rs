//! Multi-head self-attention over one projection's `qkv [b, t, 3c]` (`c = heads * d`; see
//! `Op::Attention`) and its gradient, without materialising the `[b, heads, t, t]` scores.
//! The burn-ops lowering (`crate::lower`, still the reference) took about 47 launches a layer
//! forward and backward (copies splitting and merging the heads, the products, the mask, a
//! softmax in five): the small GPT's micro-step went from 552 launches to 376 with these three.
//!
//! A cube holds [`ROWS`] consecutive rows (a warp's lanes) times [`PARTS`] parts: unit `(x, p)`
//! takes row `x`'s keys `p, p + PARTS, ...`, with the row's `d` query values and its own
//! accumulators in registers, the keys and values read from `qkv` in place. A warp's lanes are
//! consecutive rows of one (sequence, head), so they read the same key at the same time (one
//! cache line per load); the parts' maxima, sums and vectors then meet in shared memory, added
//! in part order (the same bits on every run). Two layouts came first: a unit per row (a few
//! thousand units each walking all its keys: the gradient took 1.3 ms a layer on an H200
//! whatever the batch), then a cube of 32 lanes per row, lanes over the keys (fast on small
//! batches, but each lane of a warp read a different key row, 32 cache lines per load, and
//! on large batches it lost to the first). The forward takes the row's maximum score, then
//! sums `exp(s - max) v` and divides by the sum of the exponentials. The gradient is two
//! launches, as flash attention's: [`attention_grad_rows`] (per query row: the row's maximum
//! and sum, `rowdot = sum_j p_ij dp_ij` and `dq_i`, the three statistics kept for the second
//! launch) then [`attention_grad_cols`] (per key row, parts over the queries: `dk_j` and
//! `dv_j`, each probability recomputed from its row's statistics). Under the causal mask a row
//! sees keys `0..=i`, and a key the queries `j..t`: masked pairs are never computed.

use cubecl::prelude::*;

/// Rows per cube: a warp's lanes.
pub const ROWS: usize = 32;
/// Units per row, each taking every `PARTS`-th key (or query): the cube's warps.
pub const PARTS: usize = 8;
/// The widest head the kernels take: a cube keeps `ROWS * (d + 1)` floats of vectors and
/// `PARTS * ROWS` of statistics in shared memory (17.1 KiB of f32 at 128; see
/// [`shared_bytes`]).
pub const MAX_D: usize = 128;

/// Shared memory a cube of these kernels takes for heads of width `d`, in elements of `elem`
/// bytes: the rows' vectors and the parts' statistics. A device whose cubes have less runs
/// attention on the burn-ops lowering (WebGPU's default limit is 16 KiB; adapters usually
/// allow 32 or more, CUDA 48).
pub fn shared_bytes(d: usize, elem: usize) -> usize {
    (ROWS * (d + 1) + PARTS * ROWS) * elem
}

/// An attention kernel's compile-time extents: `t` positions, `heads` heads of width `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnDims {
    pub t: u32,
    pub heads: u32,
    pub d: u32,
    pub causal: bool,
}

impl AttnDims {
    /// `None` where the extents do not fit the kernels (`u32`, empty heads, or heads wider
    /// than [`MAX_D`]: the rows' vectors must fit shared memory).
    pub fn new(t: usize, heads: usize, d: usize, causal: bool) -> Option<AttnDims> {
        if d == 0 || d > MAX_D {
            return None;
        }
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
fn dot<F: Float, T: Float>(x: &Array<F>, qkv: &[T], at: usize, #[comptime] d: u32) -> F {
    let mut acc = F::new(0.0);
    #[unroll]
    for e in 0..d as usize {
        acc += x[e] * F::cast_from(qkv[at + e]);
    }
    acc
}

/// The unit's row: `(valid, row, sequence, head, i)` (rows fastest). A unit past the last row
/// (the grid rounds up) computes the last row again and writes nothing, so every unit of a
/// cube reaches the same barriers.
#[cube]
fn unit(rows: usize, #[comptime] g: AttnDims) -> (bool, usize, usize, usize, usize) {
    let (t, heads) = comptime!((g.t as usize, g.heads as usize));
    let r = CUBE_POS * ROWS + UNIT_POS_X as usize;
    let valid = r < rows;
    let idx = select(valid, r, rows - 1);
    (valid, idx, idx / (t * heads), (idx / t) % heads, idx % t)
}

/// `d` values at `at` into registers.
#[cube]
fn load<F: Float, T: Float>(qkv: &[T], at: usize, #[comptime] d: u32) -> Array<F> {
    let mut x = Array::<F>::new(d as usize);
    #[unroll]
    for e in 0..d as usize {
        x[e] = F::cast_from(qkv[at + e]);
    }
    x
}

/// `d` zeros in registers.
#[cube]
fn zeros<F: Float>(#[comptime] d: u32) -> Array<F> {
    let mut x = Array::<F>::new(d as usize);
    #[unroll]
    for e in 0..d as usize {
        x[e] = F::new(0.0);
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

/// The maximum of the row's parts' `x` (every part of the row gets it).
#[cube]
fn parts_max<F: Float>(x: F, sh: &mut Shared<[F]>) -> F {
    let (r, p) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    sh[p * ROWS + r] = x;
    sync_cube();
    let mut m = sh[r];
    for q in 1..PARTS {
        m = F::max(m, sh[q * ROWS + r]);
    }
    sync_cube();
    m
}

/// The sum of the row's parts' `x` in part order (every part of the row gets it).
#[cube]
fn parts_sum<F: Float>(x: F, sh: &mut Shared<[F]>) -> F {
    let (r, p) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    sh[p * ROWS + r] = x;
    sync_cube();
    let mut sum = F::new(0.0);
    for q in 0..PARTS {
        sum += sh[q * ROWS + r];
    }
    sync_cube();
    sum
}

/// The sum of the row's parts' `d` values `x`, in part order, into row `x` of `sh` (`[ROWS, d
/// + 1]`: a row's stride one more than `d`, so the rows' same element lies in distinct
/// banks); readable after the call, until the next barrier's writers.
#[cube]
fn parts_vec<F: Float>(x: &Array<F>, sh: &mut Shared<[F]>, #[comptime] d: u32) {
    let (r, p) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let base = r * comptime!(d as usize + 1);
    if p == 0 {
        #[unroll]
        for e in 0..d as usize {
            sh[base + e] = x[e];
        }
    }
    sync_cube();
    for q in 1..PARTS {
        if p == q {
            #[unroll]
            for e in 0..d as usize {
                sh[base + e] += x[e];
            }
        }
        sync_cube();
    }
}

/// Row `x`'s vector in `sh` (after [`parts_vec`]) divided by `div`, into `out[at..at + d]`,
/// the row's parts taking every `PARTS`-th element (a division by 1 keeps the bits).
#[cube]
fn write_row<F: Float>(out: &mut [F], at: usize, sh: &mut Shared<[F]>, div: F, #[comptime] d: u32) {
    let base = UNIT_POS_X as usize * comptime!(d as usize + 1);
    let mut e = UNIT_POS_Y as usize;
    while e < comptime!(d as usize) {
        out[at + e] = sh[base + e] / div;
        e += PARTS;
    }
}

/// Row `q`'s maximum score over keys `0..n` of `(s, h)`: each part's keys, then the parts'.
#[cube]
#[allow(clippy::too_many_arguments)]
fn row_max<F: Float, T: Float>(q: &Array<F>, qkv: &[T], s: usize, h: usize, n: usize, scale: F, sh: &mut Shared<[F]>, #[comptime] g: AttnDims) -> F {
    let c = comptime!((g.heads * g.d) as usize);
    let mut m = F::min_value();
    let mut j = UNIT_POS_Y as usize;
    while j < n {
        m = F::max(m, dot::<F, T>(q, qkv, qkv_row(s, h, j, g) + c, g.d) * scale);
        j += PARTS;
    }
    parts_max(m, sh)
}

/// `y[s, i, h * d..]` = `softmax(q_i K^T * scale) V` over the keys row `i` sees.
/// `qkv` is f32, or the bf16 / f16 a session stores it in (`_qkv_type`, given at the launch:
/// widened as it is read); the kernels compute in f32.
#[cube(launch_unchecked)]
pub fn attention_forward<F: Float, Q: Float>(qkv: &[Q], y: &mut [F], scale: f32, #[comptime] g: AttnDims, #[define(Q)] _qkv_type: ElemType) {
    let (t, c, d) = comptime!((g.t as usize, (g.heads * g.d) as usize, g.d as usize));
    let mut stat = Shared::<[F]>::new_slice(comptime!(PARTS * ROWS));
    let mut vecs = Shared::<[F]>::new_slice(comptime!(ROWS * (d + 1)));
    let (valid, _, s, h, i) = unit(y.len() / d, g);
    let scale = F::cast_from(scale);
    let q = load::<F, Q>(qkv, qkv_row(s, h, i, g), g.d);
    let n = keys(i, g);
    let m = row_max::<F, Q>(&q, qkv, s, h, n, scale, &mut stat, g);
    let mut o = zeros::<F>(g.d);
    let mut l = F::new(0.0);
    let mut j = UNIT_POS_Y as usize;
    while j < n {
        let at = qkv_row(s, h, j, g);
        let p = F::exp(dot::<F, Q>(&q, qkv, at + c, g.d) * scale - m);
        l += p;
        #[unroll]
        for e in 0..d {
            o[e] += p * F::cast_from(qkv[at + 2 * c + e]);
        }
        j += PARTS;
    }
    let l = parts_sum(l, &mut stat);
    parts_vec(&o, &mut vecs, g.d);
    if valid {
        write_row(y, (s * t + i) * c + h * d, &mut vecs, l, g.d);
    }
}

/// The gradient's first launch, per query row `i`: its maximum score `m`, the sum `l` of
/// `exp(s - m)`, `rowdot = sum_j p_ij (dy_i · v_j)` into `stats[3 * row..]`, and
/// `dq_i = scale * sum_j p_ij (dy_i · v_j - rowdot) k_j` into `dx` (laid out as `qkv`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn attention_grad_rows<F: Float, Q: Float, G: Float>(
    qkv: &[Q],
    dy: &[G],
    dx: &mut [F],
    stats: &mut [F],
    scale: f32,
    #[comptime] g: AttnDims,
    #[define(Q)] _qkv_type: ElemType,
    #[define(G)] _dy_type: ElemType,
) {
    let (t, c, d) = comptime!((g.t as usize, (g.heads * g.d) as usize, g.d as usize));
    let mut stat = Shared::<[F]>::new_slice(comptime!(PARTS * ROWS));
    let mut vecs = Shared::<[F]>::new_slice(comptime!(ROWS * (d + 1)));
    let (valid, idx, s, h, i) = unit(stats.len() / 3, g);
    let scale = F::cast_from(scale);
    let q = load::<F, Q>(qkv, qkv_row(s, h, i, g), g.d);
    let gy = load::<F, G>(dy, (s * t + i) * c + h * d, g.d);
    let n = keys(i, g);
    let m = row_max::<F, Q>(&q, qkv, s, h, n, scale, &mut stat, g);
    let mut l = F::new(0.0);
    let mut r = F::new(0.0);
    let mut j = UNIT_POS_Y as usize;
    while j < n {
        let at = qkv_row(s, h, j, g);
        let p = F::exp(dot::<F, Q>(&q, qkv, at + c, g.d) * scale - m);
        l += p;
        r += p * dot::<F, Q>(&gy, qkv, at + 2 * c, g.d);
        j += PARTS;
    }
    let l = parts_sum(l, &mut stat);
    let rowdot = parts_sum(r, &mut stat) / l;
    let mut dq = zeros::<F>(g.d);
    let mut j = UNIT_POS_Y as usize;
    while j < n {
        let at = qkv_row(s, h, j, g);
        let p = F::exp(dot::<F, Q>(&q, qkv, at + c, g.d) * scale - m) / l;
        let ds = p * (dot::<F, Q>(&gy, qkv, at + 2 * c, g.d) - rowdot) * scale;
        #[unroll]
        for e in 0..d {
            dq[e] += ds * F::cast_from(qkv[at + c + e]);
        }
        j += PARTS;
    }
    parts_vec(&dq, &mut vecs, g.d);
    if valid {
        write_row(dx, qkv_row(s, h, i, g), &mut vecs, F::new(1.0), g.d);
        if UNIT_POS_Y == 0 {
            stats[3 * idx] = m;
            stats[3 * idx + 1] = l;
            stats[3 * idx + 2] = rowdot;
        }
    }
}

/// The gradient's second launch, per key row `j`, parts over the queries that see it:
/// `dv_j = sum_i p_ij dy_i` and `dk_j = scale * sum_i p_ij (dy_i · v_j - rowdot_i) q_i`, into
/// `dx` (laid out as `qkv`), each `p_ij` from row `i`'s statistics. The lanes of a warp walk
/// the same queries (from their first row's), each skipping those before its own key.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn attention_grad_cols<F: Float, Q: Float, G: Float>(
    qkv: &[Q],
    dy: &[G],
    stats: &[F],
    dx: &mut [F],
    scale: f32,
    #[comptime] g: AttnDims,
    #[define(Q)] _qkv_type: ElemType,
    #[define(G)] _dy_type: ElemType,
) {
    let (t, c, d) = comptime!((g.t as usize, (g.heads * g.d) as usize, g.d as usize));
    let mut vecs = Shared::<[F]>::new_slice(comptime!(ROWS * (d + 1)));
    let (valid, idx, s, h, j) = unit(stats.len() / 3, g);
    let scale = F::cast_from(scale);
    let at = qkv_row(s, h, j, g);
    let k = load::<F, Q>(qkv, at + c, g.d);
    let v = load::<F, Q>(qkv, at + 2 * c, g.d);
    // Under the mask, from the key of the cube's first row in this (sequence, head).
    let lane = UNIT_POS_X as usize;
    let mut first = 0;
    let mut lo = 0;
    if comptime!(g.causal) {
        first = select(j >= lane, j - lane, 0);
        lo = j;
    }
    let mut dk = zeros::<F>(g.d);
    let mut dv = zeros::<F>(g.d);
    // The statistics of row `i` of this (sequence, head) sit at `3 * (row0 + i)`.
    let row0 = idx - j;
    let mut i = first + UNIT_POS_Y as usize;
    while i < t {
        if i >= lo {
            let qi = qkv_row(s, h, i, g);
            let gi = (s * t + i) * c + h * d;
            let st = 3 * (row0 + i);
            let p = F::exp(dot::<F, Q>(&k, qkv, qi, g.d) * scale - stats[st]) / stats[st + 1];
            let ds = p * (dot::<F, G>(&v, dy, gi, g.d) - stats[st + 2]) * scale;
            #[unroll]
            for e in 0..d {
                dv[e] += p * F::cast_from(dy[gi + e]);
                dk[e] += ds * F::cast_from(qkv[qi + e]);
            }
        }
        i += PARTS;
    }
    parts_vec(&dk, &mut vecs, g.d);
    if valid {
        write_row(dx, at + c, &mut vecs, F::new(1.0), g.d);
    }
    sync_cube();
    parts_vec(&dv, &mut vecs, g.d);
    if valid {
        write_row(dx, at + 2 * c, &mut vecs, F::new(1.0), g.d);
    }
}

//! Multi-head self-attention (`Op::Attention`) on host slices, one (sequence, head) pair at a
//! time, its `[T, T]` scores in the thread's scratch (64 KiB of f32 at T = 128, in L2), never
//! written out. Queries, keys and values are read where they lie in `qkv [B, T, 3C]` (row
//! stride `3C`), and the heads' outputs written into `[B, T, C]` (the gradient into
//! `[B, T, 3C]`): no transposes, slices or pads around the op.
//!
//! Every product (two forward, four backward from the kept probabilities: `S = Q K^T`,
//! `Y = P V`; `dP = dY V^T`, `dQ = dS K`, `dK = dS^T Q`, `dV = P^T dY`) is one register-tile
//! kernel ([`tile`]): a tile of 4 or 8 rows by up to 4 vectors of columns (at most half the
//! vector registers in all: [`budget`]), each step a
//! broadcast element of one operand times a row of vectors of the other, on the CPU's widest
//! vectors (pulp: AVX-512, AVX2 with FMA, or none). Its operands need no packing except `K^T`
//! (forward) and `V^T` (backward), made once per item with the keys along the vectors; rows of
//! `Q`, `K`, `V` and `dY` are read in place when a head's width is a whole number of vectors
//! (the GPT's 32), else copied once, zero-padded. Under a causal mask each tile stops at the
//! keys (queries) its rows see, to a vector's width: about 1.1x the masked work at T = 128,
//! where GEMM calls on bands of 64 queries did 1.5x of it, and packed both operands on every
//! call (their packing and the softmax's masked passes were half of the forward's time).
//!
//! Per row the softmax is `p = exp(s - max) / sum` over the keys the row sees (`s` the scaled
//! score), as the unfused ops compute it with the masked entries taking no part: the passes run
//! over whole chunks of [`LANES`] scores, the last one's entries past the row's last key masked
//! out ([`row_max`], [`exps`], [`dot`]), the lanes then joined in halves, and `P` and `dS` are
//! exact zeros past the row's last key, as far as the products read. When the
//! plan pairs the forward with its gradient (a training step: [`crate::host::Kept`]), the
//! forward makes `P` in the kept `[B, H, T, T]` buffer instead of scratch (2 MiB a layer for
//! the GPT's micro-batch) and the gradient reads it there; a gradient without its forward
//! recomputes `P` from `Q` and `K` (as flash attention does), with the same code and so the
//! same bits. Each output element is one sum in a fixed order, whatever the threads and the
//! vector width: the tiles' sums are chains over the contraction in order, and the softmax's
//! lanes are [`LANES`] on every instruction set.

use std::ops::Range;

use pulp::Simd;

use super::direct::{budget, load, rank1, store, zeros, Block, Lanes};
use super::float::{each, vectorized, HostFloat};

/// Extents `[b, t, heads, d]` of an attention over `qkv [b, t, 3 * heads * d]`.
type Extents = [usize; 4];

/// The widest vector of any instruction set pulp dispatches to, in elements (f32 on
/// AVX-512); every width divides it. Scratch is sized with it, before the dispatch.
const WIDEST: usize = 16;

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

/// The keys some row before `r1` (at least 1) sees: the contraction of `P V` and `dS K` for
/// rows up to `r1`.
#[inline(always)]
fn keys_before(r1: usize, t: usize, causal: bool) -> usize {
    seen(r1 - 1, t, causal)
}

/// The queries that see key `j0` or a later one: the contraction of `dS^T Q` and `P^T dY`.
#[inline(always)]
fn queries_from(j0: usize, t: usize, causal: bool) -> Range<usize> {
    if causal {
        j0..t
    } else {
        0..t
    }
}

/// An item's extents on one instruction set: `t` and `d`, `t` rounded up to [`WIDEST`] and
/// `d` to whole vectors.
#[derive(Clone, Copy)]
struct Geo {
    t: usize,
    d: usize,
    tp: usize,
    dp: usize,
    lanes: usize,
}

impl Geo {
    #[inline(always)]
    fn new(t: usize, d: usize, lanes: usize) -> Geo {
        // The scores' rows hold whole chunks of the softmax's lanes (a multiple of every width).
        Geo { t, d, tp: t.next_multiple_of(WIDEST), dp: d.next_multiple_of(lanes), lanes }
    }
    /// The score columns a row seeing `n` keys computes: `n` rounded up to whole vectors.
    #[inline(always)]
    fn width(&self, n: usize) -> usize {
        n.next_multiple_of(self.lanes).min(self.tp)
    }
}

/// An operand read one element at a time and broadcast: element `(r, k)` at `at + r * ra + k * ka`.
#[derive(Clone, Copy)]
struct Scalars<F> {
    at: *const F,
    ra: usize,
    ka: usize,
}

/// `out[r][..cols] = sum over k in ks of A[r][k] * B[k][..]` for the tile's first `rows` rows
/// (at most `R`; the rest repeat the last row's operand and are not written), `B`'s row `k`
/// `C` vectors at `b + k * rk`, `out`'s row `r` at `out + r * ro`, `cols` at most `C` vectors.
/// Each element is one fused multiply-add chain over `ks` in order.
///
/// # Safety
/// `A`'s rows `0..rows` and `B`'s rows in `ks` (`C` whole vectors each) must be readable, and
/// `out`'s rows writable for `cols` elements.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<F: Lanes, S: Simd, const R: usize, const C: usize>(
    s: S,
    a: Scalars<F>,
    rows: usize,
    b: *const F,
    rk: usize,
    ks: Range<usize>,
    out: *mut F,
    ro: usize,
    cols: usize,
) {
    let l = F::lanes::<S>();
    let ar: [*const F; R] = std::array::from_fn(|r| a.at.add(r.min(rows - 1) * a.ra));
    let mut acc = [[zeros::<F, S>(s); C]; R];
    for k in ks {
        let bk = b.add(k * rk);
        let bv: [Block<F, S>; C] = std::array::from_fn(|c| load::<F, S>(bk.add(c * l)));
        let av: [F; R] = std::array::from_fn(|r| *ar[r].add(k * a.ka));
        rank1(s, &mut acc, &av, &bv);
    }
    for (r, acc) in acc.iter().enumerate().take(rows) {
        let o = out.add(r * ro);
        for (c, &v) in acc.iter().enumerate() {
            let n = cols.saturating_sub(c * l).min(l);
            if n == l {
                store::<F, S>(o.add(c * l), v);
            } else if n > 0 {
                let mut part = [F::ZERO; WIDEST];
                store::<F, S>(part.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(part.as_ptr(), o.add(c * l), n);
            }
        }
    }
}

/// `out = A B` over rows `0..m`, a tile of rows at a time: `span(r0, r1)` gives rows
/// `r0..r1`'s contraction and their columns (at most `n`; `B`'s rows hold `n` rounded up to
/// whole vectors). Tiles of 8 rows when `n` is at most two vectors and the registers hold
/// them, else of 4 rows by up to 4 vectors (as many as fit).
///
/// # Safety
/// As [`tile`], for every tile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn product<F: Lanes, S: Simd>(
    s: S,
    m: usize,
    n: usize,
    a: Scalars<F>,
    b: *const F,
    rk: usize,
    out: *mut F,
    ro: usize,
    span: impl Fn(usize, usize) -> (Range<usize>, usize),
) {
    let (l, budget) = (F::lanes::<S>(), budget::<S>());
    let tall = 8 * n.div_ceil(l) <= budget && n.div_ceil(l) <= 2;
    let rows = if tall { 8 } else { 4 };
    let most = (budget / rows).clamp(1, 4);
    for r0 in (0..m).step_by(rows) {
        let r1 = (r0 + rows).min(m);
        let (ks, cols) = span(r0, r1);
        let at = Scalars { at: a.at.add(r0 * a.ra), ..a };
        let o = out.add(r0 * ro);
        let mut c0 = 0;
        while c0 < cols {
            let c = (cols - c0).div_ceil(l).min(most);
            let (b, o, w, ks) = (b.add(c0), o.add(c0), (cols - c0).min(c * l), ks.clone());
            match (rows, c) {
                (8, 1) => tile::<F, S, 8, 1>(s, at, r1 - r0, b, rk, ks, o, ro, w),
                (8, _) => tile::<F, S, 8, 2>(s, at, r1 - r0, b, rk, ks, o, ro, w),
                (_, 1) => tile::<F, S, 4, 1>(s, at, r1 - r0, b, rk, ks, o, ro, w),
                (_, 2) => tile::<F, S, 4, 2>(s, at, r1 - r0, b, rk, ks, o, ro, w),
                (_, 3) => tile::<F, S, 4, 3>(s, at, r1 - r0, b, rk, ks, o, ro, w),
                _ => tile::<F, S, 4, 4>(s, at, r1 - r0, b, rk, ks, o, ro, w),
            }
            c0 += c * l;
        }
    }
}

/// `x`'s `t` rows of `d` (row stride `ld`) transposed into `out` (`[dp, tp]`), zeros past `d`
/// rows and `t` columns: an operand whose rows are then read in vectors along `t`.
///
/// # Safety
/// `x` must address `t` rows of `d` elements at row stride `ld`.
#[inline(always)]
unsafe fn transposed<F: HostFloat>(x: *const F, ld: usize, g: Geo, out: &mut [F]) {
    const B: usize = WIDEST;
    let out = &mut out[..g.dp * g.tp];
    out.fill(F::ZERO);
    for j0 in (0..g.t).step_by(B) {
        for x0 in (0..g.d).step_by(B) {
            if j0 + B <= g.t && x0 + B <= g.d {
                // A whole block through a fixed-size array: rows read and columns written as
                // vectors (a column at a time, one element a row, was 13% of the forward).
                let mut blk = [[F::ZERO; B]; B];
                for (l, r) in blk.iter_mut().enumerate() {
                    r.copy_from_slice(std::slice::from_raw_parts(x.add((j0 + l) * ld + x0), B));
                }
                for xi in 0..B {
                    let o: &mut [F; B] = (&mut out[(x0 + xi) * g.tp + j0..][..B]).try_into().expect("a block's column");
                    for (l, o) in o.iter_mut().enumerate() {
                        *o = blk[l][xi];
                    }
                }
            } else {
                for j in j0..(j0 + B).min(g.t) {
                    for xi in x0..(x0 + B).min(g.d) {
                        out[xi * g.tp + j] = *x.add(j * ld + xi);
                    }
                }
            }
        }
    }
}

/// `x`'s `t` rows of `d` (row stride `ld`) as rows of whole vectors: in place when `d` is
/// whole vectors, else copied into `buf` (`[t, dp]`) with zeros past `d`. Returns the rows
/// and their stride.
///
/// # Safety
/// As [`transposed`].
#[inline(always)]
unsafe fn rows_of<F: HostFloat>(x: *const F, ld: usize, g: Geo, buf: &mut [F]) -> (*const F, usize) {
    if g.d == g.dp {
        return (x, ld);
    }
    for (j, row) in buf.chunks_exact_mut(g.dp).take(g.t).enumerate() {
        row[..g.d].copy_from_slice(std::slice::from_raw_parts(x.add(j * ld), g.d));
        row[g.d..].fill(F::ZERO);
    }
    (buf.as_ptr(), g.dp)
}

/// Lanes of the softmax's passes over a row ([`row_max`], [`exps`], [`dot`]): they keep this
/// many independent running values.
const LANES: usize = 16;

/// [`LANES`] running values joined by `join` in halves (lane `j` with `j + 8`, then `j + 4`,
/// and so on): four steps that vectorise, where joining them in order waited on fifteen.
#[inline(always)]
fn join_lanes<F: HostFloat>(mut acc: [F; LANES], join: impl Fn(F, F) -> F) -> F {
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for j in 0..n {
            acc[j] = join(acc[j], acc[j + n]);
        }
    }
    acc[0]
}

/// `row[..n]`'s largest value (a NaN need not be it): [`LANES`]-element chunks of it, the last
/// one's entries past `n` taking no part. `row` holds `n` rounded up to whole chunks.
#[inline(always)]
fn row_max<F: HostFloat>(row: &[F], n: usize) -> F {
    let larger = |m: F, v: F| if v > m { v } else { m };
    let full = n / LANES * LANES;
    let mut acc = [F::NEG_INF; LANES];
    for ch in row[..full].chunks_exact(LANES) {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a = larger(*a, v);
        }
    }
    if full < n {
        for (l, (a, &v)) in acc.iter_mut().zip(&row[full..full + LANES]).enumerate() {
            *a = if full + l < n { larger(*a, v) } else { *a };
        }
    }
    join_lanes(acc, larger)
}

/// A row's exponentials `e^(x * scale - max)` in place of its first `n` scores and zeros past
/// them to the end of their chunk, and their sum in [`LANES`] lanes, in one pass. The last
/// chunk's entries past `n` are taken as `top` (`max` unscaled, an exponential of 1, where one
/// that underflowed to 0 stalled an Intel core on a microcode assist), then as zeros.
#[inline(always)]
fn exps<F: HostFloat>(row: &mut [F], n: usize, scale: F, max: F, top: F) -> F {
    let mut acc = [F::ZERO; LANES];
    let full = n / LANES * LANES;
    for ch in row[..full].chunks_exact_mut(LANES) {
        for (a, v) in acc.iter_mut().zip(ch) {
            *v = (*v * scale - max).program_exp();
            *a += *v;
        }
    }
    if full < n {
        for (l, (a, v)) in acc.iter_mut().zip(&mut row[full..full + LANES]).enumerate() {
            let live = full + l < n;
            let e = ((if live { *v } else { top }) * scale - max).program_exp();
            *v = if live { e } else { F::ZERO };
            *a += *v;
        }
    }
    join_lanes(acc, |a, b| a + b)
}

/// `sum of xs[i] * ys[i]` over the first `n` of `xs` and `ys` (of equal lengths, at least
/// `n`, at most `n` rounded up to whole [`LANES`]-element chunks; the entries past `n` take no
/// part) in lanes, each a fused multiply-add chain.
#[inline(always)]
fn dot<F: HostFloat>(xs: &[F], ys: &[F], n: usize) -> F {
    let mut acc = [F::ZERO; LANES];
    let full = n / LANES * LANES;
    for (a, b) in xs[..full].chunks_exact(LANES).zip(ys[..full].chunks_exact(LANES)) {
        for ((acc, &a), &b) in acc.iter_mut().zip(a).zip(b) {
            *acc = a.mul_add(b, *acc);
        }
    }
    let (xs, ys) = (&xs[full..], &ys[full..]);
    let masked = |l: usize, acc: &mut F, a: F, b: F| {
        let y = a.mul_add(b, *acc);
        *acc = if full + l < n { y } else { *acc };
    };
    if xs.len() == LANES {
        // A whole chunk: one pass over fixed extents, which vectorises.
        for (l, ((acc, &a), &b)) in acc.iter_mut().zip(&xs[..LANES]).zip(&ys[..LANES]).enumerate() {
            masked(l, acc, a, b);
        }
    } else {
        for (l, ((acc, &a), &b)) in acc.iter_mut().zip(xs).zip(ys).enumerate() {
            masked(l, acc, a, b);
        }
    }
    join_lanes(acc, |a, b| a + b)
}

/// How far past a row's last key (`n` keys, of `t`) `P` and `dS` are written as zeros: to the
/// end of the softmax's chunk and one more chunk, as far as the products read (a tile of at
/// most 8 rows reads the keys its last row sees, rounded up to whole vectors).
#[inline(always)]
fn zeros_to(n: usize, t: usize) -> usize {
    (n.next_multiple_of(LANES) + LANES).min(t)
}

/// `P` of one (sequence, head) into `p` (`[t, t]`, row-major, zeros past each row's last
/// key): the scores `Q K^T` into `sc` (`[t, tp]`) from `q` (row stride `ld`) and `kt` (`K^T`,
/// [`transposed`]), each row's to the keys it sees rounded up to whole vectors, then its softmax.
///
/// # Safety
/// `q` must address `t` rows of `d` elements at row stride `ld`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn probs<F: Lanes, S: Simd>(s: S, q: *const F, ld: usize, g: Geo, causal: bool, kt: &[F], sc: &mut [F], p: &mut [F]) {
    let t = g.t;
    let scale = F::from_f64(1.0 / (g.d as f64).sqrt());
    let a = Scalars { at: q, ra: ld, ka: 1 };
    product(s, t, g.tp, a, kt.as_ptr(), g.tp, sc.as_mut_ptr(), g.tp, |_, r1| (0..g.d, g.width(keys_before(r1, t, causal))));
    for i in 0..t {
        let n = seen(i, t, causal);
        let row = &mut sc[i * g.tp..][..n.next_multiple_of(LANES)];
        // The scale is positive, so the largest scaled score is the largest score scaled.
        let top = row_max(row, n);
        let sum = exps(row, n, scale, top * scale, top);
        // Divided by the sum, as the unfused softmax does (times its reciprocal, as PyTorch's
        // CPU softmax does, was 1 ulp off at times: ranks against one process moved apart by
        // more than the f32 tests allow).
        let (pr, w) = (&mut p[i * t..][..t], row.len().min(t));
        for (o, &e) in pr[..w].iter_mut().zip(&row[..w]) {
            *o = e / sum;
        }
        pr[w..zeros_to(n, t)].fill(F::ZERO);
    }
}

/// The forward of one (sequence, head) under pulp's dispatch.
struct Forward<'a, F> {
    qkv: &'a [F],
    y: &'a Out<F>,
    e: Extents,
    causal: bool,
    item: usize,
    /// The item's part of the kept probabilities, if the plan keeps them.
    kept: Option<&'a mut [F]>,
    /// The thread's scratch, [`forward_scratch`] long.
    buf: &'a mut [F],
    round: Option<Round>,
}

/// Scratch a forward item takes: `K^T`, the scores, copied values and (unless kept) `P`.
fn forward_scratch(t: usize, d: usize, kept: bool) -> usize {
    let g = Geo::new(t, d, WIDEST);
    g.dp * g.tp + t * g.tp + t * g.dp + if kept { 0 } else { t * t }
}

impl<F: Lanes> pulp::WithSimd for Forward<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        let Forward { qkv, y, e, causal, item, kept, buf, round } = self;
        let [_, t, heads, d] = e;
        let (c, (bi, h)) = (heads * d, (item / heads, item % heads));
        let (ld, g) = (3 * c, Geo::new(t, d, F::lanes::<S>()));
        let (kt, rest) = buf.split_at_mut(g.dp * g.tp);
        let (sc, rest) = rest.split_at_mut(t * g.tp);
        let (vb, rest) = rest.split_at_mut(t * g.dp);
        let p = match kept {
            Some(p) => p,
            None => &mut rest[..t * t],
        };
        // SAFETY: the sequence's rows of `qkv` and `y` hold head `h`'s `d` columns at offsets
        // `h*d` (queries), `c + h*d` (keys), `2c + h*d` (values) and `h*d`; the scratch's
        // parts are the extents the products read and write.
        unsafe {
            let x = qkv.as_ptr().add(bi * t * ld + h * d);
            let (q, k, v) = (x, x.add(c), x.add(2 * c));
            transposed(k, ld, g, kt);
            probs(s, q, ld, g, causal, kt, sc, p);
            let (vr, rv) = rows_of(v, ld, g, vb);
            let y = y.0.add(bi * t * c + h * d);
            // Y = P V, each tile over the keys its rows see.
            let a = Scalars { at: p.as_ptr(), ra: t, ka: 1 };
            product(s, t, d, a, vr, rv, y, c, |_, r1| (0..keys_before(r1, t, causal), d));
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
    /// The thread's scratch, [`backward_scratch`] long.
    buf: &'a mut [F],
    /// The item's `P` as the forward kept it, if it did.
    kept: Option<&'a [F]>,
    round: Option<Round>,
}

/// Scratch a gradient item takes: `V^T`, `dP` (then `dS`), copied queries, keys and output
/// gradients, and (unless kept) `P` and `K^T`.
fn backward_scratch(t: usize, d: usize, kept: bool) -> usize {
    let g = Geo::new(t, d, WIDEST);
    g.dp * g.tp + t * g.tp + 3 * t * g.dp + if kept { 0 } else { t * t + g.dp * g.tp }
}

impl<F: Lanes> pulp::WithSimd for Backward<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        let Backward { qkv, dy, dx, e, causal, item, buf, kept, round } = self;
        let [_, t, heads, d] = e;
        let (c, (bi, h)) = (heads * d, (item / heads, item % heads));
        let (ld, g) = (3 * c, Geo::new(t, d, F::lanes::<S>()));
        let scale = F::from_f64(1.0 / (d as f64).sqrt());
        let (vt, rest) = buf.split_at_mut(g.dp * g.tp);
        let (ds, rest) = rest.split_at_mut(t * g.tp);
        let (qb, rest) = rest.split_at_mut(t * g.dp);
        let (kb, rest) = rest.split_at_mut(t * g.dp);
        let (gb, rest) = rest.split_at_mut(t * g.dp);
        // SAFETY: as the forward's; `dy` holds the sequence's `t` rows of `c` and `dx` is laid
        // out as `qkv`.
        unsafe {
            let x = qkv.as_ptr().add(bi * t * ld + h * d);
            let (q, k, v) = (x, x.add(c), x.add(2 * c));
            let gy = dy.as_ptr().add(bi * t * c + h * d);
            let dx = dx.0.add(bi * t * ld + h * d);
            let (dq, dk, dv) = (dx, dx.add(c), dx.add(2 * c));
            let p: &[F] = match kept {
                Some(p) => p,
                None => {
                    let (p, kt) = rest.split_at_mut(t * t);
                    transposed(k, ld, g, kt);
                    // The scores go where dP will.
                    probs(s, q, ld, g, causal, kt, ds, p);
                    p
                }
            };
            transposed(v, ld, g, vt);
            // dP = dY V^T, each row to the keys it sees rounded up to whole vectors.
            let a = Scalars { at: gy, ra: c, ka: 1 };
            product(s, t, g.tp, a, vt.as_ptr(), g.tp, ds.as_mut_ptr(), g.tp, |_, r1| (0..d, g.width(keys_before(r1, t, causal))));
            // dS = P * (dP - sum over the row of P * dP) * scale, exact zeros past the row's
            // last key as far as the products below read ([`zeros_to`]).
            for i in 0..t {
                let n = seen(i, t, causal);
                let (row, w) = (&mut ds[i * g.tp..][..g.tp], n.next_multiple_of(LANES).min(t));
                let pr = &p[i * t..][..w];
                // P is zero past the row's last key: those dP take no part.
                let dt = dot(pr, &row[..w], n);
                for (v, &a) in row[..w].iter_mut().zip(pr) {
                    *v = a * (*v - dt) * scale;
                }
                row[n..zeros_to(n, t)].fill(F::ZERO);
            }
            let (kr, rk) = rows_of(k, ld, g, kb);
            let (qr, rq) = rows_of(q, ld, g, qb);
            let (gr, rg) = rows_of(gy, c, g, gb);
            // dQ = dS K, each tile over the keys its rows see.
            let a = Scalars { at: ds.as_ptr(), ra: g.tp, ka: 1 };
            product(s, t, d, a, kr, rk, dq, ld, |_, r1| (0..keys_before(r1, t, causal), d));
            // dK = dS^T Q and dV = P^T dY, each tile of keys over the queries that see them.
            let a = Scalars { at: ds.as_ptr(), ra: 1, ka: g.tp };
            product(s, t, d, a, qr, rq, dk, ld, |j0, _| (queries_from(j0, t, causal), d));
            let a = Scalars { at: p.as_ptr(), ra: 1, ka: t };
            product(s, t, d, a, gr, rg, dv, ld, |j0, _| (queries_from(j0, t, causal), d));
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
pub fn forward<F: Lanes>(qkv: &[F], e: Extents, causal: bool, keep: Option<&mut [F]>, y: &mut [F], round: Option<Round>) {
    let [b, t, heads, d] = e;
    assert!(qkv.len() == b * t * 3 * heads * d && y.len() == b * t * heads * d, "attention extents");
    assert!(keep.as_ref().is_none_or(|p| p.len() == b * heads * t * t), "kept probabilities' extents");
    let out = Out(y.as_mut_ptr());
    let out = &out;
    let len = forward_scratch(t, d, keep.is_some());
    let keep = keep.map(|p| Out(p.as_mut_ptr()));
    let keep = &keep;
    each((0..b * heads).collect(), |item| {
        // SAFETY: item `item` writes its own `[t, t]` of the kept buffer (checked above).
        let kept = keep.as_ref().map(|p| unsafe { std::slice::from_raw_parts_mut(p.0.add(item * t * t), t * t) });
        // The scratch is taken here, outside pulp's dispatch: a closure handed to `scratch`
        // from inside it would be compiled without the dispatch's target features (its row
        // loops then called `fmaf` per element and did not vectorise).
        F::scratch(len, |buf| vectorized(Forward { qkv, y: out, e, causal, item, kept, buf, round }))
    });
}

/// `Op::AttentionGrad`: the gradient w.r.t. `qkv` of [`forward`] given `dy [b, t, heads * d]`,
/// into `dx` (laid out as `qkv`); `kept`, the probabilities [`forward`] kept for this `qkv`,
/// or `None` to make them again; `round`: each item rounds its rows.
pub fn backward<F: Lanes>(qkv: &[F], dy: &[F], e: Extents, causal: bool, kept: Option<&[F]>, dx: &mut [F], round: Option<Round>) {
    let [b, t, heads, d] = e;
    assert!(qkv.len() == b * t * 3 * heads * d && dx.len() == qkv.len() && dy.len() == b * t * heads * d, "attention gradient extents");
    assert!(kept.is_none_or(|p| p.len() == b * heads * t * t), "kept probabilities' extents");
    let out = Out(dx.as_mut_ptr());
    let out = &out;
    let len = backward_scratch(t, d, kept.is_some());
    each((0..b * heads).collect(), |item| {
        let kept = kept.map(|p| &p[item * t * t..][..t * t]);
        F::scratch(len, |buf| vectorized(Backward { qkv, dy, dx: out, e, causal, item, buf, kept, round }))
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

    /// Under the causal mask a row's output does not depend on the rows after it, to the bit:
    /// a sequence padded at its end (transformers' padding to a multiple) gives its own rows'
    /// values, and the gradient w.r.t. them, whatever the padding's length and values.
    #[test]
    fn causal_rows_do_not_see_padding() {
        let all = (1..=40).map(|t| (2, t, 48, 4, 16));
        for (b, t, pad, heads, d) in [(1, 13, 32, 4, 16), (2, 13, 19, 2, 32), (1, 40, 64, 1, 8), (3, 5, 16, 2, 3)].into_iter().chain(all) {
            let c = heads * d;
            let (own, g_own) = (data(b * t * 3 * c, 3), data(b * t * c, 5));
            // Each sequence's rows first, then the padding's.
            let (mut padded, mut g_pad) = (data(b * pad * 3 * c, 4), vec![0.0; b * pad * c]);
            for bi in 0..b {
                padded[bi * pad * 3 * c..][..t * 3 * c].copy_from_slice(&own[bi * t * 3 * c..][..t * 3 * c]);
                g_pad[bi * pad * c..][..t * c].copy_from_slice(&g_own[bi * t * c..][..t * c]);
            }
            let run = |x: &[f32], g: &[f32], t: usize| {
                let (mut y, mut dx, mut p) = (vec![f32::NAN; b * t * c], vec![f32::NAN; x.len()], vec![f32::NAN; b * heads * t * t]);
                forward(x, [b, t, heads, d], true, Some(&mut p), &mut y, None);
                backward(x, g, [b, t, heads, d], true, Some(&p), &mut dx, None);
                (y, dx)
            };
            let ((y, dx), (yp, dxp)) = (run(&own, &g_own, t), run(&padded, &g_pad, pad));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for bi in 0..b {
                assert_eq!(bits(&y[bi * t * c..][..t * c]), bits(&yp[bi * pad * c..][..t * c]), "t {t} padded to {pad}: sequence {bi}'s output");
                assert_eq!(
                    bits(&dx[bi * t * 3 * c..][..t * 3 * c]),
                    bits(&dxp[bi * pad * 3 * c..][..t * 3 * c]),
                    "t {t} padded to {pad}: sequence {bi}'s gradient"
                );
            }
        }
    }

    /// Forward and gradient match the definition, causal or not, on sequences shorter than a
    /// vector, of whole vectors and of vectors and a part (the mask's edges inside and between
    /// tiles of rows and vectors of keys), with heads narrower than a vector (copied, padded),
    /// of whole vectors (read in place) and of vectors and a part, and give the same bits on
    /// one thread and on three, and with the gradient reading the probabilities the forward
    /// kept (the kept buffer starts as NaN: an entry the forward did not write and the
    /// gradient read would show). The same on scalar code (no vectors: every width whole).
    #[test]
    fn attention_matches_its_definition_on_any_number_of_threads() {
        let cases = [
            ([2, 5, 2, 3], true),
            ([2, 5, 2, 3], false),
            ([1, 70, 3, 4], true),
            ([3, 64, 2, 8], true),
            ([1, 70, 1, 5], false),
            ([2, 40, 2, 32], true),
            ([1, 37, 2, 16], false),
            ([1, 128, 1, 32], true),
            ([1, 33, 1, 20], true),
        ];
        for (e, causal) in cases {
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
            // Scalar code (one element a vector) and AVX2 (8 lanes: other tiles, paddings and
            // widths of scores) where the CPU has it give the same bits: every sum runs in the
            // same order, the zeros past a row's keys adding nothing. f64 on the widest vectors
            // (half as many lanes as f32): the same values.
            use crate::host::float::tests::{AVX2, SCALAR};
            // On a pool of one thread: its items run on the thread whose flag is set.
            let with = |flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>| {
                rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a thread pool").install(|| {
                    flag.with(|s| s.set(true));
                    let (mut y, mut dx) = (vec![f32::NAN; dy.len()], vec![f32::NAN; qkv.len()]);
                    forward(&qkv, e, causal, None, &mut y, None);
                    backward(&qkv, &dy, e, causal, None, &mut dx, None);
                    flag.with(|s| s.set(false));
                    (y, dx)
                })
            };
            for (flag, name) in [(&SCALAR, "scalar code"), (&AVX2, "AVX2")] {
                let (yw, dxw) = with(flag);
                assert_eq!((bits(&y), bits(&dx)), (bits(&yw), bits(&dxw)), "{e:?} causal {causal}: the same bits on {name}");
            }
            let (q64, dy64): (Vec<f64>, Vec<f64>) = (qkv.iter().map(|&v| v as f64).collect(), dy.iter().map(|&v| v as f64).collect());
            let (mut y64, mut dx64) = (vec![f64::NAN; dy.len()], vec![f64::NAN; qkv.len()]);
            forward(&q64, e, causal, None, &mut y64, None);
            backward(&q64, &dy64, e, causal, None, &mut dx64, None);
            for (what, got, want) in [("y f64", &y64, &y_ref), ("dqkv f64", &dx64, &dx_ref)] {
                for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                    assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{e:?} causal {causal}: {what}[{i}] {a} vs {b}");
                }
            }
        }
    }
}

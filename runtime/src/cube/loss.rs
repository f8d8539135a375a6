//! Softmax cross-entropy over `[n, c]` logits with class-id labels on the device: the loss in
//! one launch and its gradient in one launch, or both in one launch when the gradient's `dloss`
//! is a constant of the plan (a training step's seed); burn's ops took about 23 kernels for
//! the two and computed the log-softmax twice. The arithmetic is the host kernels' in the same
//! order, so the fused kernel gives the two kernels' bits.

use cellgraph_compiler::Reduction;
use cubecl::prelude::*;

/// Units of the one cube that reduces the loss over the rows.
pub const REDUCE_UNITS: u32 = 256;

/// Most rows a reduced loss computes its gradient with, in its one cube (16 rows a unit).
pub const FUSED_ROWS: usize = 4096;

/// A loss kernel's compile-time extents: `n` rows of `c` classes, the reduction as `0` none,
/// `1` sum, `2` mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LossDims {
    pub n: u32,
    pub c: u32,
    pub reduction: u8,
}

impl LossDims {
    pub fn new(n: usize, c: usize, reduction: Reduction) -> Option<LossDims> {
        let reduction = match reduction {
            Reduction::None => 0,
            Reduction::Sum => 1,
            Reduction::Mean => 2,
        };
        Some(LossDims { n: u32::try_from(n).ok()?, c: u32::try_from(c).ok()?, reduction })
    }
}

/// Row `i`'s maximum logit and `ln(sum(exp(logit - max)))`.
#[cube]
fn row_stats<F: Float, L: Float>(logits: &[L], i: usize, #[comptime] c: u32) -> (F, F) {
    let c = comptime!(c as usize);
    let base = i * c;
    let mut m = F::cast_from(logits[base]);
    for j in 1..c {
        let x = F::cast_from(logits[base + j]);
        if x > m {
            m = x;
        }
    }
    let mut s = F::new(0.0);
    for j in 0..c {
        s += F::exp(F::cast_from(logits[base + j]) - m);
    }
    (m, F::ln(s))
}

/// `-log_softmax(logits[i])[label[i]]`.
#[cube]
fn row_loss<F: Float, L: Float, I: Int>(logits: &[L], labels: &[I], i: usize, #[comptime] c: u32) -> F {
    let (m, lse) = row_stats::<F, L>(logits, i, c);
    let l = usize::cast_from(labels[i]);
    -((F::cast_from(logits[i * comptime!(c as usize) + l]) - m) - lse)
}

/// Writes row `i`'s gradient `(softmax - one_hot) * scale` into `dx` and returns its loss.
#[cube]
fn row_loss_grad<F: Float, L: Float, I: Int>(logits: &[L], labels: &[I], dx: &mut [F], i: usize, scale: F, #[comptime] c: u32) -> F {
    let (m, lse) = row_stats::<F, L>(logits, i, c);
    let cc = comptime!(c as usize);
    let base = i * cc;
    let l = usize::cast_from(labels[i]);
    for j in 0..cc {
        let z = (F::cast_from(logits[base + j]) - m) - lse;
        let target = select(j == l, F::new(1.0), F::new(0.0));
        dx[base + j] = (F::exp(z) - target) * scale;
    }
    -((F::cast_from(logits[base + l]) - m) - lse)
}

/// The gradient's factor for `dloss = seed`: the seed (no reduction: every row's; sum), or the
/// seed times `1 / n` (mean), rounded as [`softmax_cross_entropy_grad`] rounds it.
#[cube]
fn seed_scale<F: Float>(#[comptime] d: LossDims, #[comptime] seed: u32) -> F {
    let s = F::new(comptime!(f32::from_bits(seed)));
    if comptime!(d.reduction == 2) {
        s * F::new(comptime!((1.0 / d.n as f64) as f32))
    } else {
        s
    }
}

/// Sums the cube's per-unit parts in a fixed tree order into `out[0]` (times `1 / n` for a
/// mean).
#[cube]
fn reduce_store<F: Float>(part: F, out: &mut [F], #[comptime] d: LossDims) {
    let u = UNIT_POS as usize;
    let mut shared = Shared::<[F]>::new_slice(comptime!(REDUCE_UNITS as usize));
    shared[u] = part;
    sync_cube();
    #[unroll]
    for r in 0..comptime!(REDUCE_UNITS.trailing_zeros() as usize) {
        let half = comptime!((REDUCE_UNITS as usize) >> (r + 1));
        if u < half {
            shared[u] = shared[u] + shared[u + half];
        }
        sync_cube();
    }
    if u == 0 {
        if comptime!(d.reduction == 2) {
            out[0] = shared[0] * F::new(comptime!((1.0 / d.n as f64) as f32));
        } else {
            out[0] = shared[0];
        }
    }
}

/// Row `i`'s loss, and with `grad` its gradient written into `dx` (see [`row_loss_grad`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn row<F: Float, L: Float, I: Int>(logits: &[L], labels: &[I], dx: &mut [F], i: usize, scale: F, #[comptime] c: u32, #[comptime] grad: bool) -> F {
    if comptime!(grad) {
        row_loss_grad::<F, L, I>(logits, labels, dx, i, scale, c)
    } else {
        row_loss::<F, L, I>(logits, labels, i, c)
    }
}

/// The loss: one unit per row without a reduction; else one cube of [`REDUCE_UNITS`] units,
/// each summing rows `u, u + 256, ...`, then a tree sum in shared memory (a fixed order: the
/// same bits on every run), the mean scaled by `1 / n`. With `seed` (the f32 bits of a constant
/// `dloss`) each unit also writes its rows' gradient into `dx`, with the arithmetic of
/// [`softmax_cross_entropy_grad`]: the loss and its gradient in one launch, the two kernels'
/// bits. Without, `dx` is not touched. `_label_type`: the labels' element type (burn's int
/// type on the device), given at launch; `_logit_type` the logits' (f32, or the bf16 / f16 a
/// session stores them in: widened as they are read).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn softmax_cross_entropy<F: Float, L: Float, I: Int>(
    logits: &[L],
    labels: &[I],
    out: &mut [F],
    dx: &mut [F],
    #[comptime] d: LossDims,
    #[comptime] seed: Option<u32>,
    #[define(L)] _logit_type: ElemType,
    #[define(I)] _label_type: ElemType,
) {
    let n = comptime!(d.n as usize);
    let grad = comptime!(seed.is_some());
    let scale = seed_scale::<F>(d, comptime!(seed.unwrap_or(0)));
    if comptime!(d.reduction == 0) {
        let i = ABSOLUTE_POS;
        if i < n {
            out[i] = row::<F, L, I>(logits, labels, dx, i, scale, d.c, grad);
        }
    } else {
        let u = UNIT_POS as usize;
        let units = comptime!(REDUCE_UNITS as usize);
        let mut part = F::new(0.0);
        let mut i = u;
        while i < n {
            part += row::<F, L, I>(logits, labels, dx, i, scale, d.c, grad);
            i += units;
        }
        reduce_store(part, out, d);
    }
}

/// The gradient w.r.t. the logits, one unit per element: `(softmax - one_hot) * dl`, `dl`
/// per row (no reduction), as given (sum) or divided by `n` (mean). `_logit_type` and
/// `_label_type` as in [`softmax_cross_entropy`].
#[cube(launch_unchecked)]
pub fn softmax_cross_entropy_grad<F: Float, L: Float, I: Int>(
    logits: &[L],
    labels: &[I],
    dl: &[F],
    dx: &mut [F],
    #[comptime] d: LossDims,
    #[define(L)] _logit_type: ElemType,
    #[define(I)] _label_type: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx < dx.len() {
        let c = comptime!(d.c as usize);
        let i = idx / c;
        let j = idx % c;
        let (m, lse) = row_stats::<F, L>(logits, i, d.c);
        let z = (F::cast_from(logits[idx]) - m) - lse;
        let l = usize::cast_from(labels[i]);
        let target = select(j == l, F::new(1.0), F::new(0.0));
        let mut scale = dl[0];
        if comptime!(d.reduction == 0) {
            scale = dl[i];
        } else if comptime!(d.reduction == 2) {
            scale = dl[0] * F::new(comptime!((1.0 / d.n as f64) as f32));
        }
        dx[idx] = (F::exp(z) - target) * scale;
    }
}

//! Softmax cross-entropy over `[n, c]` logits with class-id labels on the device: the loss in
//! one launch and its gradient in one launch (burn's ops took about 23 kernels for the two and
//! computed the log-softmax twice). The arithmetic is the host kernels' in the same order.

use cellgraph_compiler::Reduction;
use cubecl::prelude::*;

/// Units of the one cube that reduces the loss over the rows.
pub const REDUCE_UNITS: u32 = 256;

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
fn row_stats<F: Float>(logits: &Array<F>, i: usize, #[comptime] c: u32) -> (F, F) {
    let c = comptime!(c as usize);
    let base = i * c;
    let mut m = logits[base];
    for j in 1..c {
        let x = logits[base + j];
        if x > m {
            m = x;
        }
    }
    let mut s = F::new(0.0);
    for j in 0..c {
        s += F::exp(logits[base + j] - m);
    }
    (m, F::ln(s))
}

/// `-log_softmax(logits[i])[label[i]]`.
#[cube]
fn row_loss<F: Float, I: Int>(logits: &Array<F>, labels: &Array<I>, i: usize, #[comptime] c: u32) -> F {
    let (m, lse) = row_stats(logits, i, c);
    let l = usize::cast_from(labels[i]);
    -((logits[i * comptime!(c as usize) + l] - m) - lse)
}

/// The loss: one unit per row without a reduction; else one cube of [`REDUCE_UNITS`] units,
/// each summing rows `u, u + 256, ...`, then a tree sum in shared memory (a fixed order: the
/// same bits on every run), the mean scaled by `1 / n`.
#[cube(launch_unchecked)]
pub fn softmax_cross_entropy<F: Float, I: Int>(logits: &Array<F>, labels: &Array<I>, out: &mut Array<F>, #[comptime] d: LossDims) {
    let n = comptime!(d.n as usize);
    if comptime!(d.reduction == 0) {
        let i = ABSOLUTE_POS;
        if i < n {
            out[i] = row_loss(logits, labels, i, d.c);
        }
    } else {
        let u = UNIT_POS as usize;
        let units = comptime!(REDUCE_UNITS as usize);
        let mut part = F::new(0.0);
        let mut i = u;
        while i < n {
            part += row_loss(logits, labels, i, d.c);
            i += units;
        }
        let mut shared = SharedMemory::<F>::new(comptime!(REDUCE_UNITS as usize));
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
}

/// The gradient w.r.t. the logits, one unit per element: `(softmax - one_hot) * dl`, `dl`
/// per row (no reduction), as given (sum) or divided by `n` (mean).
#[cube(launch_unchecked)]
pub fn softmax_cross_entropy_grad<F: Float, I: Int>(logits: &Array<F>, labels: &Array<I>, dl: &Array<F>, dx: &mut Array<F>, #[comptime] d: LossDims) {
    let idx = ABSOLUTE_POS;
    if idx < dx.len() {
        let c = comptime!(d.c as usize);
        let i = idx / c;
        let j = idx % c;
        let (m, lse) = row_stats(logits, i, d.c);
        let z = (logits[idx] - m) - lse;
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

//! Softmax cross-entropy and its gradient on host slices, row by row, in the order of the
//! reference lowering's burn ops.

use super::float::HostFloat;
use cellgraph_compiler::Reduction;

/// One row's log-softmax in `z` (`[c]` logits in, `logit - max - ln(sum(exp(logit - max)))`
/// out), in the order of the reference lowering's burn ops.
fn log_softmax_row<F: HostFloat>(row: &[F], z: &mut [F], e: &mut [F]) {
    let m = row.iter().copied().fold(F::NEG_INF, |m, x| if x > m { x } else { m });
    for ((z, e), &x) in z.iter_mut().zip(e.iter_mut()).zip(row) {
        *z = x - m;
        *e = z.exp();
    }
    let lse = F::ndarray_sum(e).ln();
    z.iter_mut().for_each(|z| *z = *z - lse);
}

/// The class id at batch position `i`, if it is one of `c` classes.
fn class(labels: &[i64], i: usize, c: usize) -> Option<usize> {
    usize::try_from(labels[i]).ok().filter(|&l| l < c)
}

/// Softmax cross-entropy of `[n, c]` `logits` against class ids (`-log_softmax[label]` per
/// item, then summed or averaged as `reduction` says) into `out` (`[n]` or one element),
/// and each row's log-softmax into `keep` (`[n, c]`) when given, for the gradient.
/// `false` (nothing written) when a label is out of range: the reference lowering
/// then reports it. The same ops in the same order as the reference lowering on burn's ops,
/// so the same bits.
pub fn softmax_cross_entropy<F: HostFloat>(
    logits: &[F],
    labels: &[i64],
    c: usize,
    reduction: Reduction,
    out: &mut [F],
    mut keep: Option<&mut [F]>,
) -> bool {
    let n = labels.len();
    // Every label first: a bad one leaves nothing kept for a gradient.
    if (0..n).any(|i| class(labels, i, c).is_none()) {
        return false;
    }
    F::scratch(2 * c + n, |s| {
        let (z, rest) = s.split_at_mut(c);
        let (e, items) = rest.split_at_mut(c);
        for (i, row) in logits.chunks_exact(c).enumerate().take(n) {
            let Some(l) = class(labels, i, c) else { return false };
            let z = match keep.as_deref_mut() {
                Some(k) => &mut k[i * c..(i + 1) * c],
                None => &mut *z,
            };
            log_softmax_row(row, z, e);
            items[i] = z[l] * F::from_f64(-1.0);
        }
        match reduction {
            Reduction::None => out.copy_from_slice(items),
            Reduction::Sum => out[0] = F::ndarray_sum(items),
            Reduction::Mean => out[0] = F::ndarray_sum(items) * F::from_f64(1.0 / n as f64),
        }
        true
    })
}

/// The gradient of [`softmax_cross_entropy`] w.r.t. the logits: `(softmax - one_hot) * dl`,
/// `dl` per item (no reduction), as given (sum) or divided by `n` (mean). The log-softmax is
/// the forward's (`kept`, the same bits) when given, else computed again from `logits`.
/// `false` when a label is out of range.
pub fn softmax_cross_entropy_grad<F: HostFloat>(
    logits: &[F],
    kept: Option<&[F]>,
    labels: &[i64],
    dl: &[F],
    c: usize,
    reduction: Reduction,
    dx: &mut [F],
) -> bool {
    let n = labels.len();
    F::scratch(c, |e| {
        for (i, (row, d)) in logits.chunks_exact(c).zip(dx.chunks_exact_mut(c)).enumerate().take(n) {
            let Some(l) = class(labels, i, c) else { return false };
            let scale = match reduction {
                Reduction::None => dl[i],
                Reduction::Sum => dl[0],
                Reduction::Mean => dl[0] * F::from_f64(1.0 / n as f64),
            };
            match kept {
                Some(k) => d.copy_from_slice(&k[i * c..(i + 1) * c]),
                None => log_softmax_row(row, d, e),
            }
            for (j, d) in d.iter_mut().enumerate() {
                let target = if j == l { F::from_f64(1.0) } else { F::ZERO };
                *d = (d.exp() - target) * scale;
            }
        }
        true
    })
}

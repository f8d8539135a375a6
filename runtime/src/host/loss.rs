//! Softmax cross-entropy and its gradient on host slices, row by row, in the order of the
//! reference lowering's burn ops.

use super::float::{row_shares, HostFloat};
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
    keep: Option<&mut [F]>,
) -> bool {
    let n = labels.len();
    // Every label first: a bad one leaves nothing kept for a gradient.
    if (0..n).any(|i| class(labels, i, c).is_none()) {
        return false;
    }
    let reduce = |items: &[F], out: &mut [F]| match reduction {
        Reduction::None => out.copy_from_slice(items),
        Reduction::Sum => out[0] = F::ndarray_sum(items),
        Reduction::Mean => out[0] = F::ndarray_sum(items) * F::from_f64(1.0 / n as f64),
    };
    if let Some(keep) = keep {
        // The rows' log-softmax across the threads (each row the same whatever the cut), then
        // the items from it.
        row_shares(&mut keep[..n * c], c, |first, part| {
            F::scratch(c, |e| {
                for (i, z) in part.chunks_exact_mut(c).enumerate() {
                    let at = (first + i) * c;
                    log_softmax_row(&logits[at..at + c], z, e);
                }
            })
        });
        let items: Vec<F> = (0..n).map(|i| keep[i * c + class(labels, i, c).expect("checked")] * F::from_f64(-1.0)).collect();
        reduce(&items, out);
        return true;
    }
    F::scratch(2 * c + n, |s| {
        let (z, rest) = s.split_at_mut(c);
        let (e, items) = rest.split_at_mut(c);
        for (i, row) in logits.chunks_exact(c).enumerate().take(n) {
            let l = class(labels, i, c).expect("checked");
            log_softmax_row(row, z, e);
            items[i] = z[l] * F::from_f64(-1.0);
        }
        reduce(items, out);
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
    if (0..n).any(|i| class(labels, i, c).is_none()) {
        return false;
    }
    // Rows across the threads; each row is computed the same whatever the cut.
    row_shares(&mut dx[..n * c], c, |first, part| {
        F::scratch(c, |e| {
            for (r, d) in part.chunks_exact_mut(c).enumerate() {
                let i = first + r;
                let l = class(labels, i, c).expect("checked");
                let scale = match reduction {
                    Reduction::None => dl[i],
                    Reduction::Sum => dl[0],
                    Reduction::Mean => dl[0] * F::from_f64(1.0 / n as f64),
                };
                match kept {
                    Some(k) => d.copy_from_slice(&k[i * c..(i + 1) * c]),
                    None => log_softmax_row(&logits[i * c..(i + 1) * c], d, e),
                }
                for (j, d) in d.iter_mut().enumerate() {
                    let target = if j == l { F::from_f64(1.0) } else { F::ZERO };
                    *d = (d.exp() - target) * scale;
                }
            }
        })
    });
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::float::tests::data;

    /// The rows spread over the threads give the bits of one thread, kept or recomputed.
    #[test]
    fn the_loss_and_its_gradient_are_the_same_on_any_number_of_threads() {
        let (n, c) = (64, 1000);
        let logits: Vec<f32> = data(n * c, 3).iter().map(|x| 8.0 * x).collect();
        let labels: Vec<i64> = (0..n as i64).map(|i| (i * 37) % c as i64).collect();
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool").install(|| {
                let (mut loss, mut keep) = ([0f32], vec![0f32; n * c]);
                assert!(softmax_cross_entropy(&logits, &labels, c, Reduction::Sum, &mut loss, Some(&mut keep)));
                let mut alone = [0f32];
                assert!(softmax_cross_entropy(&logits, &labels, c, Reduction::Sum, &mut alone, None));
                assert_eq!(loss[0].to_bits(), alone[0].to_bits(), "kept or not, the same loss");
                let (mut dx, mut dx_again) = (vec![0f32; n * c], vec![0f32; n * c]);
                assert!(softmax_cross_entropy_grad(&logits, Some(&keep), &labels, &[0.5], c, Reduction::Mean, &mut dx));
                assert!(softmax_cross_entropy_grad(&logits, None, &labels, &[0.5], c, Reduction::Mean, &mut dx_again));
                assert_eq!(dx, dx_again, "kept or recomputed, the same gradient");
                (loss[0].to_bits(), keep.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dx.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            })
        };
        let one = run(1);
        assert_eq!(one, run(3));
        // A label out of range writes nothing and says so.
        let mut bad = labels.clone();
        bad[5] = c as i64;
        assert!(!softmax_cross_entropy(&logits, &bad, c, Reduction::Sum, &mut [0f32], None));
        assert!(!softmax_cross_entropy_grad(&logits, None, &bad, &[1.0], c, Reduction::Sum, &mut vec![0f32; n * c]));
    }
}

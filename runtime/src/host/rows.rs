//! Elementwise and row kernels on host slices: ReLU and its gradient, `acc += g`, sums over
//! rows and over planes, row maxima and the causal mask, shared out by whole rows.

use super::float::{each, row_shares, shares_of, vectorized, HostFloat, BLOCK};

/// ReLU with one answer for NaN and -0 (+0): burn-ndarray's SIMD max gives +0 while its
/// scalar path (short or strided tensors) keeps them, so the host plans run this instead.
#[inline(always)]
pub(super) fn relu1<F: HostFloat>(v: F) -> F {
    if v > F::ZERO {
        v
    } else {
        F::ZERO
    }
}

pub fn relu<F: HostFloat>(x: &[F], y: &mut [F]) {
    vectorized(
        #[inline(always)]
        || y.iter_mut().zip(x).for_each(|(y, &v)| *y = relu1(v)),
    )
}

/// `dy` where `x > 0`, else zero.
pub fn relu_grad<F: HostFloat>(dy: &[F], x: &[F], dx: &mut [F]) {
    vectorized(
        #[inline(always)]
        || dx.iter_mut().zip(dy.iter().zip(x)).for_each(|(o, (&d, &v))| *o = if v > F::ZERO { d } else { F::ZERO }),
    )
}

/// `acc += g`, elementwise (the bits of burn's `acc + g`).
pub fn add_assign<F: HostFloat>(acc: &mut [F], g: &[F]) {
    vectorized(
        #[inline(always)]
        || acc.iter_mut().zip(g).for_each(|(a, &b)| *a += b),
    )
}

/// The sum over the rows of a row-major `[rows, cols]` matrix into `out` (`cols`), added
/// row after row onto zeros: the order (and so the bits) of ndarray's `sum_axis(Axis(0))`,
/// which burn-ndarray's `sum_dim` runs, for a matrix with more than one column.
pub fn sum_rows<F: HostFloat>(x: &[F], out: &mut [F]) {
    let rows = x.len().checked_div(out.len()).unwrap_or(0);
    sum_planes(x, rows, 1, None, out)
}

/// The sum of `x` (`[outer, out.len(), inner]`) over its first and last axes, times `scale`:
/// each run of `inner` summed on its own (ndarray's unrolled sum; in order when short), then
/// the runs added into `out` in order of the first axis. Threads take shares of `out`, each
/// element summed in that order whatever the cut.
pub fn sum_planes<F: HostFloat>(x: &[F], outer: usize, inner: usize, scale: Option<F>, out: &mut [F]) {
    let kept = out.len();
    let x = &x[..outer * kept * inner];
    // Sums over rows (`inner == 1`, a bias's gradient) share out `out` by 4 KiB: a thread
    // adds every row into its part, and parts of 16 elements (8 shares of 128) made the
    // threads take cache lines from each other once per row (`[1024, 128] -> [128]` took
    // 3.3x as long on two threads as on one); shares of 256 still lost to one thread on the
    // GPT's `[1024, 512] -> [512]`.
    let unit = if inner == 1 { 4096 / std::mem::size_of::<F>() } else { 1 };
    shares_of(out, unit, x.len(), |first, part| {
        let (first, n) = (first * unit, part.len());
        part.fill(F::ZERO);
        for plane in x.chunks_exact(kept * inner) {
            add_runs(&plane[first * inner..(first + n) * inner], inner, part);
        }
        if let Some(s) = scale {
            part.iter_mut().for_each(|v| *v = *v * s);
        }
    });
}

/// `out[i] +=` the sum of run `i` of `runs` (`out.len()` runs of `inner` values), in
/// [`sum_planes`]'s order (also the order of the sums [`super::program::sum_of`] makes).
pub(super) fn add_runs<F: HostFloat>(runs: &[F], inner: usize, out: &mut [F]) {
    if inner == 1 {
        add_assign(out, runs);
    } else if inner >= 16 {
        add_run_sums(runs, inner, out);
    } else {
        for (o, run) in out.iter_mut().zip(runs.chunks_exact(inner)) {
            *o += run.iter().fold(F::ZERO, |s, &v| s + v);
        }
    }
}

/// `out[i] += ` the sum of run `i` of `x` (`out.len()` runs of `inner` values), each summed in
/// the order of ndarray's `sum` ([`HostFloat::ndarray_sum`]: eight running sums over the
/// run's whole eights, paired (0, 4), (1, 5), (2, 6), (3, 7) and added in that order onto
/// zero, then the rest in order), so with its bits; four runs at a time, their running sums
/// in registers (one `ndarray::aview1(run).sum()` a run took 2% of the bf16 GPT's step in
/// layer norm's row sums).
fn add_run_sums<F: HostFloat>(x: &[F], inner: usize, out: &mut [F]) {
    debug_assert_eq!(x.len(), out.len() * inner);
    /// `out[r] +=` the sums of the `R` runs `x` holds, side by side.
    #[inline(always)]
    fn side_by_side<const R: usize, F: HostFloat>(x: &[F], inner: usize, out: &mut [F]) {
        let whole = inner / 8 * 8;
        let mut p = [[F::ZERO; 8]; R];
        for c in (0..whole).step_by(8) {
            for (r, p) in p.iter_mut().enumerate() {
                let v = &x[r * inner + c..][..8];
                for l in 0..8 {
                    p[l] += v[l];
                }
            }
        }
        for (r, (o, p)) in out.iter_mut().zip(&p).enumerate() {
            let mut acc = F::ZERO;
            for l in 0..4 {
                acc += p[l] + p[l + 4];
            }
            *o += x[r * inner + whole..(r + 1) * inner].iter().fold(acc, |acc, &v| acc + v);
        }
    }
    vectorized(
        #[inline(always)]
        || {
            let mut runs = x.chunks_exact(4 * inner);
            let mut outs = out.chunks_exact_mut(4);
            for (four, o) in (&mut runs).zip(&mut outs) {
                side_by_side::<4, F>(four, inner, o);
            }
            for (o, run) in outs.into_remainder().iter_mut().zip(runs.remainder().chunks_exact(inner)) {
                side_by_side::<1, F>(run, inner, std::slice::from_mut(o));
            }
        },
    )
}

/// Causal masking of `[..., t, s]` scores: element `(i, j)` of each `t x s` matrix is `fill`
/// where `j > i + s - t`, else `x`'s.
pub fn causal_mask<F: HostFloat>(x: &[F], t: usize, s: usize, fill: F, y: &mut [F]) {
    if s == 0 || t == 0 {
        return;
    }
    row_shares(y, s, |first, part| {
        for (k, yr) in part.chunks_exact_mut(s).enumerate() {
            let (g, i) = (first + k, (first + k) % t);
            // Keys 0..=i + s - t are visible.
            let seen = (i + s).saturating_sub(t).saturating_add(1).min(s);
            let xr = &x[g * s..(g + 1) * s];
            yr[..seen].copy_from_slice(&xr[..seen]);
            yr[seen..].fill(fill);
        }
    });
}

/// The maximum of each row of the row-major `[rows, cols]` `x` (a NaN in a row makes it NaN:
/// the last one's bits, as the sequential fold `if b > a || b != b { b } else { a }`).
pub fn max_rows<F: HostFloat>(x: &[F], cols: usize, y: &mut [F]) {
    if cols == 0 {
        return;
    }
    let threads = rayon::current_num_threads().min(x.len() / (16 * BLOCK)).min(y.len()).max(1);
    let per = y.len().div_ceil(threads);
    let shares: Vec<(&[F], &mut [F])> = x.chunks(per * cols).zip(y.chunks_mut(per)).collect();
    each(shares, |(x, y)| vectorized(MaxRows { x, cols, y }));
}

/// [`max_rows`] over one share, as a struct so that its loop is compiled for the dispatched
/// instruction set ([`vectorized`]).
struct MaxRows<'a, F> {
    x: &'a [F],
    cols: usize,
    y: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for MaxRows<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        const LANES: usize = 16;
        // `b != b`: `b` is NaN (`HostFloat` has no `is_nan`).
        #[allow(clippy::eq_op)]
        let fold = |row: &[F]| row[1..].iter().fold(row[0], |a, &b| if b > a || b != b { b } else { a });
        for (row, m) in self.x.chunks_exact(self.cols).zip(self.y.iter_mut()) {
            // Lane by lane, then across the lanes: the same maximum as the fold unless the row
            // holds a NaN (which one is kept) or the maximum is zero (which sign is kept),
            // where the fold itself decides.
            let mut acc = [row[0]; LANES];
            let mut nan = [false; LANES];
            let chunks = row.chunks_exact(LANES);
            let rest = chunks.remainder();
            for c in chunks {
                for j in 0..LANES {
                    acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
                    nan[j] |= c[j].is_nan();
                }
            }
            let mut v = acc[0];
            for &b in acc[1..].iter().chain(rest) {
                v = if b > v { b } else { v };
            }
            let odd = nan.iter().any(|&n| n) || rest.iter().any(|b| b.is_nan()) || v == F::ZERO;
            *m = if odd { fold(row) } else { v };
        }
    }
}

#[cfg(test)]
mod tests {
    /// The run sums have ndarray's `sum`'s bits, run by run: lengths around its eights,
    /// counts of runs around the four taken at a time, values of mixed magnitude (so the order
    /// shows), -0 (which its zero start makes +0), infinities and NaN.
    #[test]
    fn run_sums_have_the_bits_of_ndarrays_sum() {
        use crate::host::float::HostFloat;
        for inner in [16, 17, 23, 24, 31, 128, 131] {
            for runs in [1, 3, 4, 5, 9] {
                let mut x: Vec<f32> = (0..runs * inner).map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 10f32.powi((i % 7) as i32 - 3)).collect();
                x[inner / 2] = -0.0;
                if runs > 2 {
                    x[inner..2 * inner].fill(-0.0);
                    x[2 * inner + 3] = f32::INFINITY;
                }
                if runs > 4 {
                    x[4 * inner + inner - 1] = f32::NAN;
                }
                let want: Vec<u32> = x.chunks_exact(inner).map(|r| (0.0 + f32::ndarray_sum(r)).to_bits()).collect();
                let mut got = vec![0.0f32; runs];
                super::add_run_sums(&x, inner, &mut got);
                assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{runs} runs of {inner}");
            }
        }
    }
}

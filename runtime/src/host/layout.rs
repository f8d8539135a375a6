//! Copies that move values: permutes, slices, pads, broadcasts and concatenations of row-major
//! tensors, by whole rows where the last axis is kept, shared out by rows.

use super::float::{row_shares, HostFloat};

/// Row-major strides of extents `dims` (also the device's copies', `crate::cube::layout`).
pub(crate) fn strides_of(dims: &[usize]) -> Vec<usize> {
    let mut st = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * dims[i + 1];
    }
    st
}

/// The steps, along each axis of `out`, through a row-major operand of extents `dims` aligned
/// to the right of `out`'s and broadcast to them: 0 on a new or repeated axis.
pub(crate) fn broadcast_strides(dims: &[usize], out: &[usize]) -> Vec<usize> {
    let mut padded = vec![1; out.len() - dims.len()];
    padded.extend_from_slice(dims);
    strides_of(&padded).iter().zip(&padded).map(|(&s, &d)| if d == 1 { 0 } else { s }).collect()
}

/// The offsets of the rows of a walk over extents `ext` in row-major order (an odometer), in
/// an array whose axes step by `st`, starting at `base`.
fn row_offsets<'a>(ext: &'a [usize], st: &'a [usize], base: usize) -> impl Iterator<Item = usize> + 'a {
    let mut idx = vec![0usize; ext.len()];
    let mut at = base;
    (0..ext.iter().product::<usize>()).map(move |_| {
        let here = at;
        for a in (0..ext.len()).rev() {
            idx[a] += 1;
            at += st[a];
            if idx[a] < ext[a] {
                break;
            }
            at -= st[a] * ext[a];
            idx[a] = 0;
        }
        here
    })
}

/// `y` = the row-major `x` of extents `dims` with its axes permuted (`y`'s axis `i` is `x`'s
/// axis `perm[i]`), written row-major; runs along a kept last axis are copied whole.
pub fn permute<F: HostFloat>(x: &[F], dims: &[usize], perm: &[usize], y: &mut [F]) {
    let r = dims.len();
    if r == 0 || y.is_empty() {
        return y.copy_from_slice(&x[..y.len()]);
    }
    let strides = strides_of(dims);
    let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let st: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let (inner, step) = (out[r - 1], st[r - 1]);
    row_shares(y, inner, |first, part| {
        for (row, base) in part.chunks_exact_mut(inner).zip(row_offsets(&out[..r - 1], &st[..r - 1], 0).skip(first)) {
            if step == 1 {
                row.copy_from_slice(&x[base..base + inner]);
            } else {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = x[base + j * step];
                }
            }
        }
    });
}

/// `y` = `x[begin..end]` on every axis of the row-major `x` of extents `dims`, row-major.
pub fn slice<F: HostFloat>(x: &[F], dims: &[usize], begin: &[usize], end: &[usize], y: &mut [F]) {
    let r = dims.len();
    if r == 0 || y.is_empty() {
        return y.copy_from_slice(&x[..y.len()]);
    }
    let st = strides_of(dims);
    let out: Vec<usize> = (0..r).map(|i| end[i] - begin[i]).collect();
    let base = (0..r).map(|i| begin[i] * st[i]).sum();
    row_shares(y, out[r - 1], |first, part| {
        for (row, at) in part.chunks_exact_mut(out[r - 1]).zip(row_offsets(&out[..r - 1], &st[..r - 1], base).skip(first)) {
            row.copy_from_slice(&x[at..at + row.len()]);
        }
    });
}

/// `y` = the row-major `x` of extents `dims` padded with zeros, `lo[i]` before and `hi[i]`
/// after axis `i`, row-major: each output row is zeros, or zeros around a row of `x`.
pub fn pad<F: HostFloat>(x: &[F], dims: &[usize], lo: &[usize], hi: &[usize], y: &mut [F]) {
    let r = dims.len();
    if r == 0 || x.is_empty() || y.is_empty() {
        y.fill(F::ZERO);
        return y[..x.len()].copy_from_slice(x);
    }
    let out: Vec<usize> = (0..r).map(|i| lo[i] + dims[i] + hi[i]).collect();
    let xst = strides_of(dims);
    let (w, (l, xw)) = (out[r - 1], (lo[r - 1], dims[r - 1]));
    row_shares(y, w, |first, part| {
        // The multi-index of the share's first row over the outer axes.
        let mut idx = vec![0; r - 1];
        let mut rest = first;
        for a in (0..r - 1).rev() {
            (idx[a], rest) = (rest % out[a], rest / out[a]);
        }
        for row in part.chunks_exact_mut(w) {
            if (0..r - 1).all(|a| idx[a] >= lo[a] && idx[a] < lo[a] + dims[a]) {
                let at: usize = (0..r - 1).map(|a| (idx[a] - lo[a]) * xst[a]).sum();
                row[..l].fill(F::ZERO);
                row[l..l + xw].copy_from_slice(&x[at..at + xw]);
                row[l + xw..].fill(F::ZERO);
            } else {
                row.fill(F::ZERO);
            }
            for a in (0..r - 1).rev() {
                idx[a] += 1;
                if idx[a] < out[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
    });
}

/// `y` = the row-major `x` of extents `dims` (aligned to the right of `out`'s, each 1 or
/// `out`'s) repeated to extents `out`, row-major: each output row is a row of `x`, or one of
/// its values repeated.
pub fn broadcast<F: HostFloat>(x: &[F], dims: &[usize], out: &[usize], y: &mut [F]) {
    let r = out.len();
    if r == 0 || y.is_empty() || x.is_empty() {
        return y.fill(x.first().copied().unwrap_or(F::ZERO));
    }
    let st = broadcast_strides(dims, out);
    let (inner, step) = (out[r - 1], st[r - 1]);
    row_shares(y, inner, |first, part| {
        for (row, at) in part.chunks_exact_mut(inner).zip(row_offsets(&out[..r - 1], &st[..r - 1], 0).skip(first)) {
            if step == 0 {
                row.fill(x[at]);
            } else {
                row.copy_from_slice(&x[at..at + inner]);
            }
        }
    });
}

/// `y` = the row-major operands `xs` (operand `k` of extents `dims[k]`) joined along `axis`,
/// row-major: for each index over the axes before `axis`, each operand's block in turn.
pub fn concat<F: HostFloat>(xs: &[&[F]], dims: &[Vec<usize>], axis: usize, y: &mut [F]) {
    let blocks: Vec<usize> = dims.iter().map(|d| d[axis..].iter().product()).collect();
    let row: usize = blocks.iter().sum();
    if row == 0 {
        return;
    }
    row_shares(y, row, |first, part| {
        for (o, out) in part.chunks_exact_mut(row).enumerate() {
            let mut at = 0;
            for (x, &b) in xs.iter().zip(&blocks) {
                out[at..at + b].copy_from_slice(&x[(first + o) * b..(first + o + 1) * b]);
                at += b;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::float::tests::{data, new};
    use crate::host::rows::{causal_mask, max_rows, sum_planes};

    /// The copies (permute, slice, pad, broadcast, concatenation, causal mask) and the row
    /// maxima, cut into shares of rows on one, two and three threads, against the same results
    /// written out element by element; the maxima keep the sequential fold's NaN and zero.
    #[test]
    fn row_kernels_on_several_threads_equal_the_elementwise_reference() {
        let dims = [4, 64, 6, 32];
        let n: usize = dims.iter().product();
        let x = data(n, 9);
        let at = |i: [usize; 4]| ((i[0] * dims[1] + i[1]) * dims[2] + i[2]) * dims[3] + i[3];
        let mut want_perm = Vec::new();
        for a in 0..4 {
            for c in 0..6 {
                for b in 0..64 {
                    for d in 0..32 {
                        want_perm.push(x[at([a, b, c, d])]);
                    }
                }
            }
        }
        let (begin, end) = ([1, 3, 0, 5], [4, 60, 6, 29]);
        let mut want_slice = Vec::new();
        for a in begin[0]..end[0] {
            for b in begin[1]..end[1] {
                for c in begin[2]..end[2] {
                    for d in begin[3]..end[3] {
                        want_slice.push(x[at([a, b, c, d])]);
                    }
                }
            }
        }
        let (lo, hi) = ([0, 2, 1, 3], [1, 0, 2, 4]);
        let out: Vec<usize> = (0..4).map(|i| lo[i] + dims[i] + hi[i]).collect();
        let mut want_pad = Vec::new();
        for a in 0..out[0] {
            for b in 0..out[1] {
                for c in 0..out[2] {
                    for d in 0..out[3] {
                        let i = [a, b, c, d];
                        let inside = (0..4).all(|k| i[k] >= lo[k] && i[k] < lo[k] + dims[k]);
                        want_pad.push(if inside { x[at([a - lo[0], b - lo[1], c - lo[2], d - lo[3]])] } else { 0.0 });
                    }
                }
            }
        }
        // A [64, 1, 32] operand broadcast to `dims`, and `x` joined with a [4, 64, 3, 32] one
        // along axis 2.
        let small = data(64 * 32, 5);
        let want_broadcast: Vec<f32> = (0..n).map(|k| small[(k / (6 * 32) % 64) * 32 + k % 32]).collect();
        let extra = data(4 * 64 * 3 * 32, 7);
        let mut want_concat = Vec::new();
        for ab in 0..4 * 64 {
            want_concat.extend_from_slice(&x[ab * 6 * 32..(ab + 1) * 6 * 32]);
            want_concat.extend_from_slice(&extra[ab * 3 * 32..(ab + 1) * 3 * 32]);
        }
        // Scores [4, 6, 64, 32]: 64 queries over 32 keys (the last 32 queries see all).
        let (t, s) = (64, 32);
        let want_mask: Vec<f32> = (0..n).map(|k| if k % s > (k / s % t + s).saturating_sub(t) { -7.0 } else { x[k] }).collect();
        // Rows of 100 (a remainder past the lanes); one with a NaN, one with both zeros and
        // negatives, one with a NaN then another NaN (the fold keeps the last).
        let cols = 100;
        let mut m = data(n / cols * cols, 3);
        m[5 * cols + 77] = f32::NAN;
        // The fold keeps the +0 it meets first; lane by lane, lane 1's -0 would come first.
        m[9 * cols..10 * cols].iter_mut().enumerate().for_each(|(j, v)| {
            *v = if j == 17 {
                -0.0
            } else if j == 2 {
                0.0
            } else {
                -1.0 - j as f32
            }
        });
        (m[11 * cols + 2], m[11 * cols + 90]) = (f32::NAN, f32::from_bits(0x7fc0_0001));
        let fold = |row: &[f32]| row[1..].iter().fold(row[0], |a, &b| if b > a || b != b { b } else { a });
        let want_max: Vec<u32> = m.chunks_exact(cols).map(|r| fold(r).to_bits()).collect();
        assert!(f32::from_bits(want_max[5]).is_nan() && want_max[9] == 0 && want_max[11] == 0x7fc0_0001);
        // Sums over the first and last axes, written out: each run of `inner` on its own
        // (ndarray's unrolled sum from 16 on), then the runs in order.
        let mut want_sums = std::collections::BTreeMap::new();
        for (outer, kept, inner) in [(4usize, 64usize, 192usize), (4 * 64, 192, 1), (1, 4 * 64, 192), (48, 32, 6)] {
            let sums: Vec<u32> = (0..kept)
                .map(|o| {
                    let run = |p: usize| &x[(p * kept + o) * inner..][..inner];
                    let total = (0..outer)
                        .fold(0.0f32, |s, p| s + if inner >= 16 { f32::ndarray_sum(run(p)) } else { run(p).iter().fold(0.0, |a, &v| a + v) });
                    (total * 0.5).to_bits()
                })
                .collect();
            want_sums.insert((outer, inner), sums);
        }
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| {
                assert_eq!(new(n, |y| permute(&x, &dims, &[0, 2, 1, 3], y)), want_perm, "permute on {threads}");
                assert_eq!(new(want_slice.len(), |y| slice(&x, &dims, &begin, &end, y)), want_slice, "slice on {threads}");
                assert_eq!(new(want_pad.len(), |y| pad(&x, &dims, &lo, &hi, y)), want_pad, "pad on {threads}");
                assert_eq!(new(n, |y| broadcast(&small, &[64, 1, 32], &dims, y)), want_broadcast, "broadcast on {threads}");
                let parts = [dims.to_vec(), vec![4, 64, 3, 32]];
                assert_eq!(new(want_concat.len(), |y| concat(&[&x, &extra], &parts, 2, y)), want_concat, "concat on {threads}");
                assert_eq!(new(n, |y| causal_mask(&x, t, s, -7.0, y)), want_mask, "causal mask on {threads}");
                let got: Vec<u32> = new(m.len() / cols, |y| max_rows(&m, cols, y)).into_iter().map(f32::to_bits).collect();
                assert_eq!(got, want_max, "row maxima on {threads}");
                for (outer, kept, inner) in [(4, 64, 192), (4 * 64, 192, 1), (1, 4 * 64, 192), (48, 32, 6)] {
                    let got: Vec<u32> = new(kept, |y| sum_planes(&x, outer, inner, Some(0.5), y)).into_iter().map(f32::to_bits).collect();
                    assert_eq!(got, want_sums[&(outer, inner)], "sums over [{outer}, {kept}, {inner}] on {threads}");
                }
            });
        }
    }
}

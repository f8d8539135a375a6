//! How the host's programs read an operand for a block of output elements: whole, one
//! element, periodic (a bias), or strided (a broadcast), piece by piece where the pieces are
//! long ([`Runs`]) and gathered where they are short ([`gather`]).

use super::float::HostFloat;
use crate::kernel::Read;

/// An operand: a block's values, or one value for every element.
#[derive(Clone, Copy)]
pub(super) enum Src<'a, F> {
    Block(&'a [F]),
    Splat(F),
}

impl<'a, F: Copy> Src<'a, F> {
    /// Elements `[o, o + len)` of the values.
    #[inline(always)]
    pub(super) fn piece(self, o: usize, len: usize) -> Src<'a, F> {
        match self {
            Src::Block(x) => Src::Block(&x[o..o + len]),
            s => s,
        }
    }
}

/// An operand's values for a block of output elements, piece by piece: `(offset in the
/// block, length, values)`, the values a slice of the operand's memory or one value for the
/// piece. Only reads whose pieces are long (a bias's rows, a per-row statistic broadcast
/// along rows of 16 or more) are read so; the others are gathered ([`gather`]).
pub(super) struct Runs<'a, F> {
    x: &'a [F],
    kind: RunKind<'a>,
    /// The block's elements done, and its length.
    k: usize,
    n: usize,
    /// Where the next piece starts in `x` (`at`), and (strided reads) the multi-index of its
    /// element.
    od: Odometer,
}

enum RunKind<'a> {
    Same,
    Splat,
    Cycle(usize),
    Strided { out: &'a [usize], strides: &'a [usize] },
}

/// Pieces shorter than this are not worth a loop of their own.
pub(super) const MIN_RUN: usize = 16;

impl<'a, F: Copy> Runs<'a, F> {
    /// The pieces of output elements `[start, start + n)` of operand `x` read as `r`, or `None`
    /// if they would be short.
    #[inline(always)]
    pub(super) fn new(r: &'a Read, x: &'a [F], start: usize, n: usize) -> Option<Self> {
        let at = |at| Odometer { idx: [0; MAX_RANK], at };
        let (kind, od) = match r {
            Read::Same => (RunKind::Same, at(start)),
            Read::Splat => (RunKind::Splat, at(0)),
            Read::Cycle(m) if *m >= MIN_RUN => (RunKind::Cycle(*m), at(start % m)),
            Read::Strided { out, strides } if out.len() <= MAX_RANK && *out.last()? >= MIN_RUN && *strides.last()? <= 1 => {
                (RunKind::Strided { out, strides }, Odometer::new(out, strides, start))
            }
            _ => return None,
        };
        Some(Runs { x, kind, k: 0, n, od })
    }
}

impl<'a, F: Copy> Iterator for Runs<'a, F> {
    type Item = (usize, usize, Src<'a, F>);
    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let (k, left) = (self.k, self.n - self.k);
        if left == 0 {
            return None;
        }
        let at = self.od.at;
        let (len, src) = match self.kind {
            RunKind::Same => (left, Src::Block(&self.x[at..at + left])),
            RunKind::Splat => (left, Src::Splat(self.x[0])),
            RunKind::Cycle(m) => {
                let len = (m - at).min(left);
                self.od.at = if at + len == m { 0 } else { at + len };
                (len, Src::Block(&self.x[at..at + len]))
            }
            RunKind::Strided { out, strides } => {
                let len = self.od.left(out).min(left);
                let src = if strides[out.len() - 1] == 0 { Src::Splat(self.x[at]) } else { Src::Block(&self.x[at..at + len]) };
                self.od.advance(out, strides, len);
                (len, src)
            }
        };
        self.k += len;
        Some((k, len, src))
    }
}

/// Reads output elements `[start, start + dst.len())`'s values of one operand.
#[inline(always)]
pub(super) fn gather<F: HostFloat>(r: &Read, x: &[F], start: usize, dst: &mut [F]) {
    match r {
        Read::Same => dst.copy_from_slice(&x[start..start + dst.len()]),
        Read::Splat => dst.fill(x[0]),
        Read::Cycle(m) => {
            let mut j = start % m;
            for d in dst {
                *d = x[j];
                j += 1;
                if j == *m {
                    j = 0;
                }
            }
        }
        Read::Strided { out, strides } if out.len() <= MAX_RANK => strided_runs(out, strides, x, start, dst),
        Read::Strided { out, strides } => {
            for (k, d) in dst.iter_mut().enumerate() {
                let (mut i, mut at) = (start + k, 0);
                for a in (0..out.len()).rev() {
                    at += (i % out[a]) * strides[a];
                    i /= out[a];
                }
                *d = x[at];
            }
        }
    }
}

/// Ranks [`strided_runs`] keeps its index for.
const MAX_RANK: usize = 8;

/// [`Read::Strided`] by runs along the last axis: the multi-index of `start` is worked out
/// once, then advanced like an odometer (a per-channel operand of an NCHW output is a `fill`
/// per row instead of a division per axis per element).
#[inline(always)]
fn strided_runs<F: HostFloat>(out: &[usize], strides: &[usize], x: &[F], start: usize, dst: &mut [F]) {
    let mut od = Odometer::new(out, strides, start);
    let step = strides[out.len() - 1];
    let mut k = 0;
    while k < dst.len() {
        let run = od.left(out).min(dst.len() - k);
        let d = &mut dst[k..k + run];
        if step == 0 {
            d.fill(x[od.at]);
        } else {
            d.iter_mut().enumerate().for_each(|(j, v)| *v = x[od.at + j * step]);
        }
        k += run;
        od.advance(out, strides, run);
    }
}

/// A multi-index over output extents `out` and the element it reaches through `strides`
/// (`at`), moved along the last axis and carried into the axes before like an odometer.
#[derive(Clone, Copy)]
struct Odometer {
    idx: [usize; MAX_RANK],
    at: usize,
}

impl Odometer {
    /// At output element `start` (`out` has at most [`MAX_RANK`] axes).
    #[inline(always)]
    fn new(out: &[usize], strides: &[usize], start: usize) -> Self {
        let (mut idx, mut i, mut at) = ([0; MAX_RANK], start, 0);
        for a in (0..out.len()).rev() {
            idx[a] = i % out[a];
            at += idx[a] * strides[a];
            i /= out[a];
        }
        Odometer { idx, at }
    }
    /// Elements left along the last axis.
    #[inline(always)]
    fn left(&self, out: &[usize]) -> usize {
        let last = out.len() - 1;
        out[last] - self.idx[last]
    }
    /// `len` elements on along the last axis (at most [`Self::left`]).
    #[inline(always)]
    fn advance(&mut self, out: &[usize], strides: &[usize], len: usize) {
        let last = out.len() - 1;
        self.at += len * strides[last];
        self.idx[last] += len;
        let mut a = last;
        while a > 0 && self.idx[a] == out[a] {
            self.at -= out[a] * strides[a];
            self.idx[a] = 0;
            a -= 1;
            self.idx[a] += 1;
            self.at += strides[a];
        }
    }
}

//! Layout copies on a device: permutes, slices, zero pads, broadcasts and concatenations
//! written out row-major into a buffer of the plan's arena by one strided-copy kernel
//! ([`walk_copy`], a concatenation one launch per operand). On burn's ops a permute, slice or
//! broadcast is a view that the next kernel copies into a new buffer, and a pad or a
//! concatenation a new buffer: a window with them (a Llama's rotary embeddings) did not reach
//! a steady arena, so was never captured.
//!
//! A copy moves stored values: it reads its operand as stored (f32, bf16, f16) and writes the
//! type the session stores its result in.
//!
//! An embedding's rows move here too: [`gather_rows`] (its table read as stored, so a bf16
//! plan's tied output layer multiplies the table's bf16 copy) and its gradient
//! [`scatter_add_rows`], a unit per output element summing its rows in the ids' order (the
//! host kernel's order: the same bits, no atomics). Their ids are a plan input the session
//! checks on the host before the step runs.

use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::{arr, grid};
use crate::host::layout::{broadcast_strides, strides_of};
use crate::kernel::Native;

/// Output axes a walk spans (axes of extent 1 left out); more are declined.
pub const MAX_AXES: usize = 6;

/// One output axis of a walk: `(div, extent, lo, len, stride)`. Output element `i`'s coordinate
/// on it is `c = i / div % extent`; the operand holds it where `lo <= c < lo + len`, at
/// `(c - lo) * stride` (0 on a broadcast axis).
type Axis = (u32, u32, u32, u32, u32);

/// How [`walk_copy`] finds each output element in its operand, as compile-time constants (one
/// kernel per shape: nothing uploaded, so a plan with copies can be captured).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Walk {
    axes: [Axis; MAX_AXES],
    rank: u8,
    /// The operand's offset of the output's first element (a slice's).
    base: u32,
    /// Elements outside the operand are left as they are (one operand of a concatenation)
    /// rather than zeroed (a pad).
    only_inside: bool,
}

impl Walk {
    /// The walk of output extents `out` whose axis `a` is `(lo, len, stride)` (the operand's
    /// span and step on it); `None` past [`MAX_AXES`] moving axes or `u32`'s range.
    fn new(out: &[usize], spans: &[(usize, usize, usize)], base: usize, only_inside: bool) -> Option<Walk> {
        let u = |v: usize| u32::try_from(v).ok();
        u(out.iter().product())?;
        let mut axes = [(1, 1, 0, 1, 0); MAX_AXES];
        let mut rank = 0;
        for (a, &(lo, len, stride)) in spans.iter().enumerate() {
            // An axis of extent 1 the operand covers adds nothing to the index.
            if out[a] == 1 && lo == 0 && len == 1 {
                continue;
            }
            let div: usize = out[a + 1..].iter().product();
            *axes.get_mut(rank)? = (u(div)?, u(out[a])?, u(lo)?, u(len)?, u(stride)?);
            rank += 1;
        }
        Some(Walk { axes, rank: rank as u8, base: u(base)?, only_inside })
    }
}

/// The walks of a layout copy, one per operand (a concatenation's several); `None` for other
/// kernels and for copies past the kernel's indexing (see [`Walk::new`]).
pub fn walks(op: &Native) -> Option<Vec<Walk>> {
    let whole = |st: &[usize], out: &[usize]| -> Vec<(usize, usize, usize)> { out.iter().zip(st).map(|(&e, &s)| (0, e, s)).collect() };
    Some(match op {
        Native::Permute { dims, perm } => {
            let st = strides_of(dims);
            let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
            let st: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
            vec![Walk::new(&out, &whole(&st, &out), 0, false)?]
        }
        Native::Slice { dims, begin, end } => {
            let st = strides_of(dims);
            let out: Vec<usize> = begin.iter().zip(end).map(|(b, e)| e - b).collect();
            let base = begin.iter().zip(&st).map(|(b, s)| b * s).sum();
            vec![Walk::new(&out, &whole(&st, &out), base, false)?]
        }
        Native::Pad { dims, lo, hi } => {
            let st = strides_of(dims);
            let out: Vec<usize> = (0..dims.len()).map(|a| lo[a] + dims[a] + hi[a]).collect();
            let spans: Vec<_> = (0..dims.len()).map(|a| (lo[a], dims[a], st[a])).collect();
            vec![Walk::new(&out, &spans, 0, false)?]
        }
        Native::Broadcast { dims, out } if dims.len() <= out.len() => {
            vec![Walk::new(out, &whole(&broadcast_strides(dims, out), out), 0, false)?]
        }
        Native::Concat { dims, axis } => {
            let mut out = dims.first()?.clone();
            *out.get_mut(*axis)? = dims.iter().map(|d| d[*axis]).sum();
            let mut at = 0;
            let mut v = Vec::with_capacity(dims.len());
            for d in dims {
                let st = strides_of(d);
                let spans: Vec<_> = (0..out.len()).map(|a| if a == *axis { (at, d[a], st[a]) } else { (0, out[a], st[a]) }).collect();
                at += d[*axis];
                v.push(Walk::new(&out, &spans, 0, true)?);
            }
            v
        }
        _ => return None,
    })
}

/// `y[i]` = the operand's element that walk `w` finds for output element `i`, converted to
/// `y`'s type; zero (or, `only_inside`, left as it is) where the operand has none.
#[cube(launch_unchecked)]
pub fn walk_copy<X: Float, Y: Float>(x: &[X], y: &mut [Y], #[comptime] w: Walk, #[define(X)] _x_type: ElemType, #[define(Y)] _y_type: ElemType) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        // (A runtime variable starts from a literal, not from a `comptime!` value.)
        let mut j = 0usize;
        j += comptime!(w.base as usize);
        let mut inside = true;
        #[unroll]
        for a in 0..comptime!(w.rank as usize) {
            let (div, ext, lo, len, stride) = comptime!(w.axes[a]);
            let c = (i / comptime!(div as usize)) % comptime!(ext as usize);
            if comptime!(lo == 0 && len == ext) {
                j += c * comptime!(stride as usize);
            } else if c >= comptime!(lo as usize) && c < comptime!((lo + len) as usize) {
                j += (c - comptime!(lo as usize)) * comptime!(stride as usize);
            } else {
                inside = false;
            }
        }
        if inside {
            y[i] = Y::cast_from(x[j]);
        } else if comptime!(!w.only_inside) {
            y[i] = Y::new(0.0);
        }
    }
}

/// The most `ids x rows` a [`scatter_add_rows`] launch scans (each output element reads every
/// id): a GPT's 65-character vocabulary over 64 x 256 tokens is 2^20; a Llama's 32,000 rows
/// over as many tokens are declined, to burn's ops.
pub const SCATTER_SCAN: usize = 1 << 24;

/// `y[r, c] = table[ids[r], c]` (rows of `width`), converted to `y`'s type; the ids were
/// checked against the table's rows on the host.
#[cube(launch_unchecked)]
pub fn gather_rows<X: Float, Y: Float, I: Int>(
    table: &[X],
    ids: &[I],
    y: &mut [Y],
    #[comptime] width: u32,
    #[define(X)] _x_type: ElemType,
    #[define(Y)] _y_type: ElemType,
    #[define(I)] _id_type: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        let w = comptime!(width as usize);
        let id = usize::cast_from(ids[i / w]);
        y[i] = Y::cast_from(table[id * w + i % w]);
    }
}

/// `y[r, c]` = the sum from +0, in the ids' order, of `x[k, c]` over the `k` with `ids[k] == r`
/// (rows of `width`): an embedding's gradient, as the host kernel adds it.
#[cube(launch_unchecked)]
pub fn scatter_add_rows<X: Float, I: Int>(
    ids: &[I],
    x: &[X],
    y: &mut [f32],
    #[comptime] width: u32,
    #[define(X)] _x_type: ElemType,
    #[define(I)] _id_type: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        let w = comptime!(width as usize);
        let (r, c) = (i / w, i % w);
        let mut acc = 0.0f32;
        for k in 0..ids.len() {
            if usize::cast_from(ids[k]) == r {
                acc += f32::cast_from(x[k * w + c]);
            }
        }
        y[i] = acc;
    }
}

/// An embedding's rows (`Gather`, from `[table]` and `[ids]`) or their gradient (`ScatterAdd`,
/// from `[x]` and `[ids]`) into `y` (contiguous; f32 for a gradient). `false` for other
/// kernels, widths past `u32` and scatter-adds past [`SCATTER_SCAN`].
pub(super) fn rows<R: CubeRuntime>(op: &Native, floats: &[CubeTensor<R>], ids: &CubeTensor<R>, y: &CubeTensor<R>) -> bool {
    let ([x], client) = (floats, &y.client) else { return false };
    let (count, dim) = grid(client, y.meta.num_elements());
    let ty = |t: &CubeTensor<R>| dtype_to_storage_type(t.dtype);
    match *op {
        Native::Gather { width, .. } => {
            let Ok(w) = u32::try_from(width.max(1)) else { return false };
            // SAFETY: one unit per element of `y` (`ids`' count of rows of `width`), reading the
            // table's row `ids[r]`, below its rows (checked on the host).
            unsafe { gather_rows::launch_unchecked::<R>(client, count, dim, arr(x), arr(ids), arr(y), w, ty(x), ty(y), ty(ids)) };
            true
        }
        Native::ScatterAdd { rows, width } => {
            let Ok(w) = u32::try_from(width.max(1)) else { return false };
            if !scatter_fits(rows, ids.meta.num_elements()) || y.dtype != burn_backend::DType::F32 {
                return false;
            }
            // SAFETY: one unit per element of `y` (`rows` of `width`), reading row `k` of `x`
            // for each of the `ids` (`x` holds a row per id).
            unsafe { scatter_add_rows::launch_unchecked::<R>(client, count, dim, arr(ids), arr(x), arr(y), w, ty(x), ty(ids)) };
            true
        }
        _ => false,
    }
}

/// Whether a scatter-add of `ids` ids into `rows` rows is within [`SCATTER_SCAN`].
pub fn scatter_fits(rows: usize, ids: usize) -> bool {
    rows.checked_mul(ids).is_some_and(|n| n <= SCATTER_SCAN)
}

/// `y` = `x` (contiguous, one element count) converted to `y`'s type, one launch: a staging
/// copy in another float type.
pub(super) fn convert<R: CubeRuntime>(x: &CubeTensor<R>, y: &CubeTensor<R>) -> bool {
    let n = y.meta.num_elements();
    let Some(w) = Walk::new(&[n], &[(0, n, 1)], 0, false) else { return false };
    if x.meta.num_elements() != n {
        return false;
    }
    let (count, dim) = grid(&y.client, n);
    // SAFETY: one unit per element of `y`, reading `x` at the same index (one length).
    unsafe {
        walk_copy::launch_unchecked::<R>(&y.client, count, dim, arr(x), arr(y), w, dtype_to_storage_type(x.dtype), dtype_to_storage_type(y.dtype))
    };
    true
}

/// Runs the layout copy `op` (its walks from [`walks`]) of the contiguous operands `xs` into
/// `y` (contiguous, the copy's output extents): one launch per operand. `false` for another
/// kernel, a copy the kernel does not index, or a wrong count of operands.
pub(super) fn copy<R: CubeRuntime>(op: &Native, xs: &[CubeTensor<R>], y: &CubeTensor<R>) -> bool {
    let Some(walks) = walks(op) else { return false };
    if walks.len() != xs.len() {
        return false;
    }
    let client = &y.client;
    let (count, dim) = grid(client, y.meta.num_elements());
    for (x, w) in xs.iter().zip(walks) {
        // SAFETY: one unit per element of `y`, reading the operand only at indices its walk
        // keeps inside the operand's extents (the bound op's, which the plan's types fix).
        unsafe {
            walk_copy::launch_unchecked::<R>(
                client,
                count.clone(),
                dim,
                arr(x),
                arr(y),
                w,
                dtype_to_storage_type(x.dtype),
                dtype_to_storage_type(y.dtype),
            )
        };
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_leave_out_unit_axes_and_decline_deep_ones() {
        let w = walks(&Native::Broadcast { dims: vec![3, 1, 4], out: vec![2, 3, 5, 4] }).unwrap();
        assert_eq!(w[0].rank, 4, "{w:?}");
        assert_eq!(w[0].axes[0], (60, 2, 0, 2, 0), "a new leading axis steps by 0");
        assert_eq!(w[0].axes[2], (4, 5, 0, 5, 0), "a broadcast axis steps by 0");
        let w = walks(&Native::Concat { dims: vec![vec![2, 1, 3], vec![2, 2, 3]], axis: 1 }).unwrap();
        assert_eq!((w[1].axes[1], w[1].only_inside), ((3, 3, 1, 2, 3), true));
        assert!(walks(&Native::Permute { dims: vec![2; 7], perm: (0..7).collect() }).is_none(), "seven moving axes do not fit");
        assert!(walks(&Native::Permute { dims: vec![1, 2, 1, 2, 1, 2, 1, 2], perm: (0..8).collect() }).is_some(), "unit axes are left out");
    }
}

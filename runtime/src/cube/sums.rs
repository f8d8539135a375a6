//! Column sums on the device: bias gradients, batch-norm sums and the sums of split products'
//! slices, in a fixed order (the same bits on every run).

use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{arr, empty, grid};
use crate::arena::Arena;

/// `y[j]` = the sum over the rows of a row-major `[rows, cols]` matrix of column `j`, added row
/// after row onto zero (the host kernel's order): a bias gradient, or the slices of a split
/// filter gradient (in slice order: the same bits on every run). `accumulate`: `y[j] += sum`
/// instead (an accumulator's view, in `assign_add`'s order). `scale` (f32 bits): the sum times
/// it (a `reduce_mean`).
#[cube(launch_unchecked)]
pub fn sum_rows<F: Float, T: Float>(
    x: &[T],
    y: &mut [F],
    #[comptime] rows: u32,
    #[comptime] accumulate: bool,
    #[comptime] scale: Option<u32>,
    #[define(F)] _f: ElemType,
    #[define(T)] _t: ElemType,
) {
    let j = ABSOLUTE_POS;
    let cols = y.len();
    if j < cols {
        let mut acc = F::new(0.0);
        for r in 0..comptime!(rows as usize) {
            acc += F::cast_from(x[r * cols + j]);
        }
        if comptime!(scale.is_some()) {
            acc *= F::new(comptime!(f32::from_bits(scale.unwrap_or(0))));
        }
        if comptime!(accumulate) {
            y[j] += acc;
        } else {
            y[j] = acc;
        }
    }
}

/// Rows per part of [`sum_row_parts`], loaded [`PART_LANES`] at a time.
const PART_ROWS: usize = 64;
const PART_LANES: usize = 8;

/// The column sums of consecutive parts of [`PART_ROWS`] rows of a row-major `[rows, cols]`
/// matrix, part `s` into row `s` of `y` (`[parts, cols]`): a unit per `(part, column)`, its
/// rows' loads issued [`PART_LANES`] at a time (a unit summing thousands of rows one load
/// after another waits on each: a bias gradient over 8,192 rows took 230 us on an H200).
#[cube(launch_unchecked)]
pub fn sum_row_parts<F: Float, T: Float>(
    x: &[T],
    y: &mut [F],
    #[comptime] rows: u32,
    #[comptime] cols: u32,
    #[define(F)] _f: ElemType,
    #[define(T)] _t: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx < y.len() {
        let (rows, cols) = comptime!((rows as usize, cols as usize));
        let (s, j) = (idx / cols, idx % cols);
        let mut lanes = Array::<F>::new(PART_LANES);
        #[unroll]
        for l in 0..PART_LANES {
            lanes[l] = F::new(0.0);
        }
        let first = s * PART_ROWS;
        for b in 0..comptime!(PART_ROWS / PART_LANES) {
            #[unroll]
            for l in 0..PART_LANES {
                let r = first + b * PART_LANES + l;
                if r < rows {
                    lanes[l] += F::cast_from(x[r * cols + j]);
                }
            }
        }
        let mut acc = F::new(0.0);
        #[unroll]
        for l in 0..PART_LANES {
            acc += lanes[l];
        }
        y[idx] = acc;
    }
}

/// `y = scale * column sums of x [rows, cols]` (or `y +=` with `accumulate`): one launch of
/// [`sum_rows`] over a few rows; over many, their parts' sums ([`sum_row_parts`]) then the
/// parts' sum, so that no unit walks thousands of rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn column_sums<R: CubeRuntime>(
    x: &CubeTensor<R>,
    y: &CubeTensor<R>,
    rows: usize,
    cols: usize,
    scale: Option<f32>,
    accumulate: bool,
    arena: &mut Arena,
) -> Option<()> {
    let client = &y.client;
    let (count, dim) = grid(client, cols);
    let scale = scale.map(f32::to_bits);
    let (rows32, cols32) = (u32::try_from(rows).ok()?, u32::try_from(cols).ok()?);
    let f32s = dtype_to_storage_type(burn_backend::DType::F32);
    // SAFETY: a unit per element of its output (`cols`, or `parts * cols` of `part`), reading
    // rows below `rows` (or `parts`) of `cols` elements.
    unsafe {
        if rows <= 4 * PART_ROWS {
            sum_rows::launch_unchecked::<R>(client, count, dim, arr(x), arr(y), rows32, accumulate, scale, f32s, dtype_to_storage_type(x.dtype));
        } else {
            let parts = rows.div_ceil(PART_ROWS);
            let len = parts * cols;
            let part = arena.take_scratch::<CubeTensor<R>>(len).unwrap_or_else(|| empty::<R>(client, &y.device, &[parts, cols]));
            let (pc, pd) = grid(client, len);
            sum_row_parts::launch_unchecked::<R>(client, pc, pd, arr(x), arr(&part), rows32, cols32, f32s, dtype_to_storage_type(x.dtype));
            sum_rows::launch_unchecked::<R>(client, count, dim, arr(&part), arr(y), parts as u32, accumulate, scale, f32s, f32s);
            arena.give_scratch(len, part);
        }
    }
    Some(())
}

/// Units of a cube of [`sum_planes`].
const PLANE_UNITS: u32 = 256;

/// `y[c]` = the sum of the elements of kept index `c` of `x`, whose extents are `[outer, kept,
/// inner]` (`kept = y.len()`; batch norm's statistics over N, H and W, a layer norm's over its
/// last axis), times `scale` (f32 bits) when given (a `reduce_mean`): a cube per `c`, its unit
/// `u` adding elements `u, u + 256, ...` of the channel's `outer * inner` in order, then a tree
/// sum in shared memory: a fixed order, the same bits on every run. Elements past `x`'s end
/// are skipped (the last, shorter part of [`sum_in_order`]). `accumulate`: `y[c] +=`
/// the value (a batch norm's or layer norm's parameter gradient into its accumulator: the
/// bits of the sum, then `assign_add`). Cubes past `kept` (a count spread over two
/// dimensions) write nothing.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn sum_planes<F: Float, T: Float>(
    x: &[T],
    y: &mut [F],
    #[comptime] outer: u32,
    #[comptime] inner: u32,
    #[comptime] scale: Option<u32>,
    #[comptime] accumulate: bool,
    #[define(F)] _f: ElemType,
    #[define(T)] _t: ElemType,
) {
    let c = CUBE_POS;
    let u = UNIT_POS as usize;
    let kept = y.len();
    let units = comptime!(PLANE_UNITS as usize);
    let inner = comptime!(inner as usize);
    let total = comptime!(outer as usize * inner);
    let mut acc = F::new(0.0);
    if c < kept {
        for j in 0..comptime!(total.div_ceil(units)) {
            let k = j * units + u;
            if k < total {
                let (n, i) = (k / inner, k % inner);
                let at = (n * kept + c) * inner + i;
                if at < x.len() {
                    acc += F::cast_from(x[at]);
                }
            }
        }
    }
    let mut shared = Shared::<[F]>::new_slice(units);
    shared[u] = acc;
    sync_cube();
    #[unroll]
    for r in 0..comptime!(PLANE_UNITS.trailing_zeros() as usize) {
        let half = comptime!(units >> (r + 1));
        if u < half {
            shared[u] = shared[u] + shared[u + half];
        }
        sync_cube();
    }
    if u == 0 && c < kept {
        let mut s = shared[0];
        if comptime!(scale.is_some()) {
            s *= F::new(comptime!(f32::from_bits(scale.unwrap_or(0))));
        }
        if comptime!(accumulate) {
            y[c] += s;
        } else {
            y[c] = s;
        }
    }
}

/// Whether [`plane_sums`] takes a reduction over `outer` leading and `inner` trailing elements
/// into `kept` values: the extents its kernel compiles in fit 32 bits.
pub(super) fn plane_sums_fit(outer: usize, kept: usize, inner: usize) -> bool {
    let fits = |n: Option<usize>| n.is_some_and(|n| u32::try_from(n).is_ok());
    fits(outer.checked_mul(inner)) && fits(kept.checked_mul(PLANE_UNITS as usize))
}

/// `y [kept] = scale * sums of x [outer, kept, inner]` over its first and last axes (or `y +=`
/// with `accumulate`) in one launch of [`sum_planes`] (the extents must fit:
/// [`plane_sums_fit`], checked at binding).
fn plane_sums<R: CubeRuntime>(x: &CubeTensor<R>, y: &CubeTensor<R>, outer: usize, inner: usize, scale: Option<f32>, accumulate: bool) {
    let client = &y.client;
    let kept = y.meta.num_elements();
    let dim = CubeDim::new_1d(PLANE_UNITS);
    let count = calculate_cube_count_elemwise(client, kept * PLANE_UNITS as usize, dim);
    // SAFETY: a cube per element of `y` (those past it write nothing), reading `x` within
    // `outer * kept * inner` elements, which the bound op's extents give it.
    unsafe {
        sum_planes::launch_unchecked::<R>(
            client,
            count,
            dim,
            arr(x),
            arr(y),
            outer as u32,
            inner as u32,
            scale.map(f32::to_bits),
            accumulate,
            dtype_to_storage_type(burn_backend::DType::F32),
            dtype_to_storage_type(x.dtype),
        );
    }
}

/// `y [kept] = scale * sums of x [outer, kept, inner]` over its first and last axes (or `y +=`
/// with `accumulate`), on the kernel a `SumPlanes` step is bound to: column sums when only
/// leading axes are summed (`inner == 1`, a layer norm's parameter gradients), else plane sums
/// (a batch norm's statistics and gradients). The sum and its accumulating form take the same
/// kernel, so they give the same bits. `None` where the extents do not fit (declined at
/// binding).
pub(super) fn sums_of_planes<R: CubeRuntime>(
    x: &CubeTensor<R>,
    y: &CubeTensor<R>,
    outer: usize,
    inner: usize,
    scale: Option<f32>,
    accumulate: bool,
    arena: &mut Arena,
) -> Option<()> {
    let kept = y.meta.num_elements();
    if inner == 1 {
        return column_sums::<R>(x, y, outer, kept, scale, accumulate, arena);
    }
    plane_sums_fit(outer, kept, inner).then(|| plane_sums::<R>(x, y, outer, inner, scale, accumulate))
}

/// Parts of [`sum_in_order`]'s first launch: at most this many.
const ORDER_PARTS: usize = 1024;

/// The parts of [`sum_in_order`] over `n` elements: `(parts, m)`, `parts` consecutive runs of
/// `m` elements (at most [`ORDER_PARTS`] runs, the last one shorter when `m` does not divide
/// `n`); `None` for no elements.
fn order_parts(n: usize) -> Option<(usize, usize)> {
    let m = n.div_ceil(ORDER_PARTS);
    (n > 0).then(|| (n.div_ceil(m), m))
}

/// The sum of every element of `x` (a one-element tensor of its type) in an order its length
/// `n` alone fixes: two launches of [`sum_planes`], the first summing the [`order_parts`] of
/// `x`, the second those parts in order; each a cube whose unit `u` adds elements `u, u + 256,
/// ...` onto zero, then a tree sum in shared memory. No atomics: the same bits on every run
/// (burn's `float_sum` adds its cubes' parts with atomics where the device has them). Other
/// than f32, or past 32-bit extents: burn's reductions along one axis, in a fixed order too.
pub(super) fn sum_in_order<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    use burn_backend::ops::FloatTensorOps;
    let n = x.meta.num_elements();
    let x = burn_cubecl::kernel::into_contiguous(x);
    let parts = order_parts(n).filter(|&(parts, m)| x.dtype == burn_backend::DType::F32 && plane_sums_fit(1, parts, m));
    let Some((parts, m)) = parts else {
        let flat = CubeBackend::<R>::float_reshape(x, burn_backend::Shape::from(vec![n]));
        return CubeBackend::<R>::float_sum_dim(flat, 0);
    };
    let (client, device) = (x.client.clone(), x.device.clone());
    let part = empty::<R>(&client, &device, &[parts]);
    plane_sums::<R>(&x, &part, 1, m, None, false);
    let y = empty::<R>(&client, &device, &[1]);
    plane_sums::<R>(&part, &y, 1, parts, None, false);
    y
}

/// The maximum of each row of the row-major `[rows, cols]` `x` (f32), a unit per row folding
/// it in order as the host's `rows::max_rows` does (`b` replaces `a` when greater or NaN: a NaN
/// in a row makes it NaN, the last one's bits), so the bits are the host's. NaN is found on
/// the bits: a shader compiler may fold `b != b` to false.
#[cube(launch_unchecked)]
pub fn max_rows<F: Float>(x: &[F], y: &mut [F], #[comptime] cols: u32) {
    let r = ABSOLUTE_POS;
    if r < y.len() {
        let cols = comptime!(cols as usize);
        let mut a = x[r * cols];
        for j in 1..cols {
            let b = x[r * cols + j];
            let nan = (u32::reinterpret(b) & 0x7fff_ffffu32) > 0x7f80_0000u32;
            if b > a || nan {
                a = b;
            }
        }
        y[r] = a;
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::backend::{Backend, HostVec};
    use crate::cube::Wgpu;
    use crate::value::Value;

    /// [`sum_planes`] of one part on the host: unit `u` adds elements `u, u + 256, ...` onto
    /// zero, then the halving tree over the units' values.
    fn plane_sum(x: &[f32]) -> f32 {
        let units = PLANE_UNITS as usize;
        let mut shared: Vec<f32> = (0..units).map(|u| x.iter().skip(u).step_by(units).fold(0.0, |a, &v| a + v)).collect();
        let mut half = units / 2;
        while half > 0 {
            for u in 0..half {
                shared[u] += shared[u + half];
            }
            half /= 2;
        }
        shared[0]
    }

    /// The sum of every element on the device is [`sum_in_order`]'s order, bit for bit, on
    /// lengths that split into 1 to 1,024 parts, whole or with a shorter last one (a run of
    /// atomic adds in the device's scheduling order would differ in the last bit now and then:
    /// the llama test's CI failure).
    #[test]
    fn a_sum_in_order_gives_the_bits_of_its_order() {
        let device = Default::default();
        for n in [1usize, 63, 64 * 37, 3 * 65_536 + 64, 1 << 20, 1_000_003] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 1e-3 / (1.0 + (i % 17) as f32)).collect();
            let (parts, m) = order_parts(n).unwrap();
            let part: Vec<f32> = x.chunks(m).map(plane_sum).collect();
            assert_eq!(part.len(), parts);
            let want = plane_sum(&part);
            let t = <Wgpu as Backend>::from_host_vec(HostVec::F32(x), &[n], &device);
            let got = Value::<Wgpu>::Float(sum_in_order(t)).to_host().scalar() as f32;
            assert_eq!(got.to_bits(), want.to_bits(), "n {n}: device {got}, host emulation {want}");
        }
    }
}

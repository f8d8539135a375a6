//! Device backends on cubecl: burn's cubecl backend drives the executor, and the runtime's own
//! `#[cube]` kernels do what burn's ops cannot do in one launch.
//!
//! - [`assign_add`]: `acc += g` in place, into an accumulator that is a view of one flat
//!   accumulator buffer (burn's `add` would allocate a new tensor and break the aliasing).
//! - [`update`]: the whole boundary of a window, the optimizer update of every parameter
//!   and the clearing of every accumulator, as one launch over flat parameter / accumulator /
//!   state buffers; the optimizer's update `Program` (the one its graph comes from) is
//!   unrolled into the kernel when it is compiled.
//! - [`gemm`]: matmuls on cubek's exact-f32 tiled kernels (the strategy bound per shape, TF32
//!   only when the session allows it or the operands hold bf16 values).
//! - [`conv`]: convolutions on [`conv2d_forward`], [`conv2d_input_grad`] and the split
//!   [`conv2d_filter_grad`] + [`sum_rows`], their geometry compile-time constants; where
//!   tensor cores are asked for (TF32, or bf16 values' products), on cubek's implicit GEMM.
//! - [`ew`]: elementwise programs (fused nodes, epilogues over a head's output in place, ReLU
//!   and its gradient) unrolled into one kernel each.
//! - [`loss`]: softmax cross-entropy and its gradient, one launch each.
//! - [`dropout`]: dropout's factors drawn in the kernel from the host's hash, and causal
//!   masking (nothing read back or uploaded: a plan with them can be captured).
//! - [`attention`]: multi-head self-attention over one projection's `qkv` and its gradient, a
//!   unit per row and the scores never in memory (one launch forward, two backward).
//! - [`pool`]: max pooling and its gradient on NCHW, without copies or a second forward.
//! - [`sums`]: a bias gradient (or a split filter gradient's slices), one unit per column.
//! - [`layout`]: permutes, slices, pads, broadcasts and concatenations written out into the
//!   plan's arena by one strided-copy kernel.
//!
//! `device_kernel` matches the bound op; the launches that take more than a line to set up
//! (an epilogue, the loss, attention, dropout, the causal mask, max pooling) are in `launch`.
//!
//! The kernels are generic over cubecl runtimes: CUDA on an NVIDIA GPU (feature `cuda`), and
//! wgpu (feature `wgpu`), which runs on Mesa's lavapipe CPU Vulkan driver in CI, where the
//! tests check them against the CPU reference (the optimizer graphs run on burn-ndarray).

pub mod attention;
pub mod conv;
pub mod dropout;
pub mod ew;
pub mod flash;
pub mod gemm;
mod head;
mod launch;
pub mod layout;
pub mod loss;
pub mod pool;
pub mod sums;
pub mod update;

use conv::filter_grad;
pub use conv::{conv2d_filter_grad, conv2d_forward, conv2d_input_grad, conv_tf32_fallbacks, ConvDims};
use gemm::{cubek_matmul, split_matmul};
pub use gemm::{matmul, naive_matmuls, tf32_fallbacks};
use head::{conv_on_tensor_cores, head_kernel};
use sums::column_sums;
pub use sums::{sum_row_parts, sum_rows};
pub use update::{launch_update, update_clear};

use burn_backend::cubecl::dtype_to_storage_type;
use burn_backend::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cellgraph_compiler::program::Program;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use ew::EwKernel;

use crate::arena::Arena;
use crate::backend::Backend;
use crate::kernel::{ConvKind, Native, Tiling};
use cellgraph_compiler::TensorType;

/// burn's CUDA backend (no fusion): the executor's tensors are cubecl buffers.
#[cfg(feature = "cuda")]
pub type Cuda = CubeBackend<cubecl::cuda::CudaRuntime>;
/// A CUDA device (`cuda:N`).
#[cfg(feature = "cuda")]
pub use cubecl::cuda::CudaDevice;

/// burn's cubecl backend on wgpu (Vulkan, Metal, DX12; lavapipe on a CPU).
#[cfg(feature = "wgpu")]
pub type Wgpu = CubeBackend<cubecl::wgpu::WgpuRuntime>;
/// A wgpu device.
#[cfg(feature = "wgpu")]
pub use cubecl::wgpu::WgpuDevice;

use crate::backend::FLAT_ALIGN as ALIGN;

/// The first reason cubek gave, per routine (`"matmul"`, `"convolution"`, `"attention"`), for
/// not setting up a tensor-core kernel in this process: what a fallback count alone does not
/// say (on an H200, 2026-12-04, cubek's CMMA kernel found no tile size for the GPT's bf16
/// products with its 65-character vocabulary, `[8192, 128, 65]`).
static REFUSALS: std::sync::Mutex<std::collections::BTreeMap<&'static str, String>> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Keeps `why` as `routine`'s refusal unless one is kept already.
pub(crate) fn note_refusal(routine: &'static str, why: impl std::fmt::Debug) {
    REFUSALS.lock().unwrap_or_else(|e| e.into_inner()).entry(routine).or_insert_with(|| {
        let s = format!("{why:?}");
        // A setup error's Debug may carry a whole blueprint: its first line, at most 300
        // characters, says what was refused.
        s.lines().next().unwrap_or_default().chars().take(300).collect()
    });
}

/// The first refusal of each cubek routine in this process (see `note_refusal`), as
/// `routine: reason` lines, routines in name order; empty when none refused.
pub fn cubek_refusals() -> Vec<String> {
    REFUSALS.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| format!("{k}: {v}")).collect()
}

/// `acc[i] += g[i]`.
#[cube(launch)]
pub fn assign_add<F: Float>(acc: &mut [F], g: &[F]) {
    if ABSOLUTE_POS < acc.len() {
        acc[ABSOLUTE_POS] += g[ABSOLUTE_POS];
    }
}

/// Launch geometry for `n` elements.
fn grid<R: CubeRuntime>(client: &ComputeClient<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, n);
    (calculate_cube_count_elemwise(client, n, dim), dim)
}

/// A new contiguous f32 tensor of IR extents `dims` (rank 0 as `[1]`).
fn empty<R: CubeRuntime>(client: &ComputeClient<R>, device: &R::Device, dims: &[usize]) -> CubeTensor<R> {
    empty_of(client, device, dims, DType::F32)
}

/// A new contiguous tensor of `dtype` and IR extents `dims` (rank 0 as `[1]`).
fn empty_of<R: CubeRuntime>(client: &ComputeClient<R>, device: &R::Device, dims: &[usize], dtype: DType) -> CubeTensor<R> {
    let numel = dims.iter().product::<usize>().max(1);
    let handle = client.empty(numel * dtype.size());
    let dims = if dims.is_empty() { vec![1] } else { dims.to_vec() };
    CubeTensor::new_contiguous(client.clone(), device.clone(), Shape::from(dims), handle, dtype)
}

/// An f32 output of IR extents `dims` in a free buffer of the session's arena (a new one when
/// none of its length is free).
fn output<R: CubeRuntime>(arena: &mut Arena, client: &ComputeClient<R>, device: &R::Device, dims: &[usize]) -> CubeTensor<R> {
    output_of(arena, client, device, dims, DType::F32)
}

/// [`output`] of `dtype` (f32, or the bf16 / f16 a session stores a value in).
fn output_of<R: CubeRuntime>(arena: &mut Arena, client: &ComputeClient<R>, device: &R::Device, dims: &[usize], dtype: DType) -> CubeTensor<R> {
    match arena.take_device::<CubeTensor<R>>(dims.iter().product::<usize>().max(1), dtype.size()) {
        Some(t) => CubeTensor::new_contiguous(client.clone(), device.clone(), crate::backend::bshape(dims), t.handle, dtype),
        None => empty_of(client, device, dims, dtype),
    }
}

/// The burn type of an IR float type the device's kernels store (f32, bf16, f16).
fn storage_dtype(d: cellgraph_compiler::DType) -> DType {
    match d {
        cellgraph_compiler::DType::BF16 => DType::BF16,
        cellgraph_compiler::DType::F16 => DType::F16,
        _ => DType::F32,
    }
}

/// A low-precision float type (bf16, f16): the types a session may store values in.
fn is_low(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16)
}

/// The launch of a loss over `n` rows: a unit per row without a reduction, else one cube.
fn loss_grid<R: CubeRuntime>(client: &ComputeClient<R>, n: usize, reduction: cellgraph_compiler::Reduction) -> (CubeCount, CubeDim) {
    match reduction {
        cellgraph_compiler::Reduction::None => grid(client, n),
        _ => (CubeCount::new_single(), CubeDim::new_1d(loss::REDUCE_UNITS)),
    }
}

/// The tensor's buffer as a kernel array (the tensor must be contiguous).
fn arr<R: CubeRuntime>(t: &CubeTensor<R>) -> BufferArg<R> {
    // SAFETY: `len` is the tensor's element count, which its handle holds.
    unsafe { BufferArg::from_raw_parts(t.handle.clone(), t.meta.num_elements()) }
}

/// `y[i] = x[i]` over 32-bit words (f32 or i32 alike, bit for bit): a replayed plan's input
/// buffer refreshed from a new upload, its output copied out of the graph's buffer, or state
/// written into a new buffer copied back into the one its graph reads.
#[cube(launch)]
pub fn copy_words(x: &[u32], y: &mut [u32]) {
    if ABSOLUTE_POS < y.len() {
        y[ABSOLUTE_POS] = x[ABSOLUTE_POS];
    }
}

/// A contiguous buffer of its own holding `data` (32-bit elements), written whole later by
/// [`write`].
fn upload_contiguous<R: CubeRuntime>(data: burn_backend::TensorData, device: &R::Device) -> Option<CubeTensor<R>> {
    let src = uploaded::<R>(data, device);
    if src.dtype.size() != 4 {
        return None;
    }
    let dims = src.meta.shape().to_vec();
    let mut y = empty::<R>(&src.client, device, &dims);
    y.dtype = src.dtype;
    launch_copy_words(&src, &y);
    Some(y)
}

/// `data` (host bytes, float or integer) in a buffer of their own length, row-major: every
/// upload of the session's. (burn's upload asks cubecl for its "optimized" layout, which on
/// CUDA pads rows to up to 512 bytes and rounds the buffer up.)
fn uploaded<R: CubeRuntime>(data: burn_backend::TensorData, device: &R::Device) -> CubeTensor<R> {
    let client = R::client(device);
    let (shape, dtype) = (data.shape.clone(), data.dtype);
    let handle = client.create(data.bytes);
    CubeTensor::new_contiguous(client, device.clone(), shape, handle, dtype)
}

/// `t` copied into a contiguous buffer when the runtime laid its rows out padded ("pitched":
/// cubecl's CUDA allocator pads a row to up to 512 bytes, so `[64, 28]` f32 rows lie 32 floats
/// apart), which the kernels here would read flat as other values; any other `t` as it is (a
/// broadcast or permuted view stays a view for burn's ops, which read strides). wgpu never
/// pitches.
fn unpitched<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if is_pitched(&t) {
        burn_cubecl::kernel::into_contiguous(t)
    } else {
        t
    }
}

/// Whether `t`'s rows are padded: not row-major, yet laid out as the runtime lays a tensor
/// out (a broadcast or permuted view is not).
fn is_pitched<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    !t.is_contiguous() && R::can_read_tensor(t.meta.shape(), t.meta.strides())
}

/// A tensor of extents `shape` sharing `buffer`'s memory from element `offset` (a multiple of
/// [`ALIGN`]): a flat buffer's parameter, a window's micro-batch.
fn view<R: CubeRuntime>(buffer: &CubeTensor<R>, offset: usize, shape: &[usize]) -> Option<CubeTensor<R>> {
    let n: usize = shape.iter().product();
    let total = buffer.meta.num_elements();
    if !offset.is_multiple_of(ALIGN) || offset + n > total || !buffer.is_contiguous() {
        return None;
    }
    let size = buffer.dtype.size() as u64;
    // Trimmed to the view's own bytes from the memory's end, not from `total`: a buffer may hold
    // more than its elements (cubecl's CUDA allocator rounds a buffer up to its row alignment,
    // 512 bytes), and a view trimmed by `total` reached into the next view's elements.
    let handle = buffer.handle.clone().offset_start(offset as u64 * size);
    let past = handle.size_in_used() - n as u64 * size;
    let handle = handle.offset_end(past);
    let shape = if shape.is_empty() { vec![1] } else { shape.to_vec() };
    Some(CubeTensor::new_contiguous(buffer.client.clone(), buffer.device.clone(), Shape::from(shape), handle, buffer.dtype))
}

/// Launches [`copy_words`] from `x` into `y` (contiguous, 32-bit elements, one length).
fn launch_copy_words<R: CubeRuntime>(x: &CubeTensor<R>, y: &CubeTensor<R>) {
    let (count, dim) = grid(&y.client, y.meta.num_elements());
    copy_words::launch::<R>(&y.client, count, dim, arr(x), arr(y));
}

/// Writes `data` (`t`'s type and length) into `t`'s memory: uploaded, then copied
/// by a kernel on this thread's stream (after the work already queued, which may still read
/// `t`). A whole-buffer host write (`client.write`) is not used: on CUDA it gave wrong
/// results for buffers whose rows burn pitched (measured, 2026-11-27).
fn write<R: CubeRuntime>(t: &CubeTensor<R>, data: burn_backend::TensorData) -> Result<(), burn_backend::TensorData> {
    if data.dtype != t.dtype || !t.is_contiguous() || t.dtype.size() != 4 || data.shape.num_elements() != t.meta.num_elements() {
        return Err(data);
    }
    let src = uploaded::<R>(data, &t.device);
    launch_copy_words(&src, t);
    Ok(())
}

/// Launches the elementwise program `p` writing `y`: operand `k` is `xs[k]`, or with `p` in
/// place, operand 0 is `y` and operand `k` is `xs[k - 1]`. Slots the program does not read get
/// another operand (or a one-element buffer): never `y`, which the kernel writes.
fn launch_elementwise<R: CubeRuntime>(p: &EwKernel, y: &CubeTensor<R>, xs: &[CubeTensor<R>]) {
    let client = &y.client;
    let (count, dim) = grid(client, y.meta.num_elements());
    let spare = xs.first().cloned().unwrap_or_else(|| empty::<R>(client, &y.device, &[1]));
    let skip = usize::from(p.in_place);
    let slot = |k: usize| arr(k.checked_sub(skip).and_then(|k| xs.get(k)).unwrap_or(&spare));
    // SAFETY: each unit checks its position against `y`'s length, and reads each operand at
    // an index its bound read keeps below the operand's extents.
    let ty = |k: usize| dtype_to_storage_type(k.checked_sub(skip).and_then(|k| xs.get(k)).unwrap_or(&spare).dtype);
    let f32s = dtype_to_storage_type(DType::F32);
    unsafe {
        ew::elementwise::launch_unchecked::<R>(
            client,
            count,
            dim,
            arr(y),
            slot(0),
            slot(1),
            slot(2),
            slot(3),
            slot(4),
            slot(5),
            p.clone(),
            f32s,
            dtype_to_storage_type(y.dtype),
            ty(0),
            ty(1),
            ty(2),
            ty(3),
            ty(4),
            ty(5),
        )
    }
}

/// burn's default integer type on `device`: the type it makes class labels in, the only one
/// the loss kernels are given.
fn int_dtype<R: CubeRuntime>(device: &R::Device) -> DType {
    burn_backend::get_device_settings::<CubeBackend<R>>(device).int_dtype.into()
}

impl<R: CubeRuntime> Backend for CubeBackend<R> {
    fn float_upload(data: burn_backend::TensorData, device: &R::Device) -> CubeTensor<R> {
        uploaded(data, device)
    }

    fn int_upload(data: burn_backend::TensorData, device: &R::Device) -> CubeTensor<R> {
        uploaded(data, device)
    }

    fn float_unpitched(t: CubeTensor<R>, arena: &mut Arena) -> CubeTensor<R> {
        if !is_pitched(&t) {
            return t;
        }
        let y = output_of(arena, &t.client, &t.device, t.meta.shape(), t.dtype);
        let dtype = burn_backend::cubecl::dtype_to_storage_type(t.dtype);
        cubecl::std::tensor::copy_into(&y.client, t.binding(), y.clone().binding(), dtype);
        y
    }

    fn int_unpitched(t: CubeTensor<R>) -> CubeTensor<R> {
        unpitched(t)
    }

    fn bool_unpitched(t: CubeTensor<R>) -> CubeTensor<R> {
        unpitched(t)
    }

    /// The flat buffers come from [`Backend::from_host_vec`], in f32 (the kernels' type).
    fn flat_buffers() -> bool {
        true
    }

    fn write_float(t: &CubeTensor<R>, data: burn_backend::TensorData) -> Result<(), burn_backend::TensorData> {
        write(t, data)
    }

    fn write_int(t: &CubeTensor<R>, data: burn_backend::TensorData) -> Result<(), burn_backend::TensorData> {
        write(t, data)
    }

    fn contiguous_float(data: burn_backend::TensorData, device: &R::Device) -> Option<CubeTensor<R>> {
        upload_contiguous::<R>(data, device)
    }

    fn contiguous_int(data: burn_backend::TensorData, device: &R::Device) -> Option<CubeTensor<R>> {
        upload_contiguous::<R>(data, device)
    }

    fn device_copy(t: &CubeTensor<R>) -> Option<CubeTensor<R>> {
        if t.dtype != DType::F32 || !t.is_contiguous() {
            return None;
        }
        let y = empty::<R>(&t.client, &t.device, &t.meta.shape().to_vec());
        launch_copy_words(t, &y);
        Some(y)
    }

    fn copy_into(dst: &CubeTensor<R>, src: &CubeTensor<R>) -> bool {
        let fits = dst.meta.num_elements() == src.meta.num_elements() && dst.dtype == DType::F32 && src.dtype == DType::F32;
        if !fits || !dst.is_contiguous() {
            return false;
        }
        launch_copy_words(&burn_cubecl::kernel::into_contiguous(src.clone()), dst);
        true
    }

    fn same_buffer(a: &CubeTensor<R>, b: &CubeTensor<R>) -> bool {
        // cubecl keeps a memory's identity private; its handle's debug form shows it (id,
        // location, offsets, size).
        format!("{:?}", a.handle) == format!("{:?}", b.handle)
    }

    fn flat_view(buffer: &CubeTensor<R>, offset: usize, shape: &[usize]) -> Option<CubeTensor<R>> {
        view(buffer, offset, shape)
    }

    fn flat_view_int(buffer: &CubeTensor<R>, offset: usize, shape: &[usize]) -> Option<CubeTensor<R>> {
        view(buffer, offset, shape)
    }
    fn device_reusable(t: CubeTensor<R>) -> Option<(usize, usize, CubeTensor<R>)> {
        let n = t.meta.num_elements();
        let h = &t.handle;
        // Exactly its elements (cubecl may pad a buffer at its end); a memory nothing else
        // holds, so never a view of a flat buffer that is still alive. A permuted view of its
        // whole buffer (burn's transposes) gives the buffer back too, as a plain one: what it
        // holds is written again before it is read.
        let size = t.dtype.size();
        let exact = h.size_in_used() == (n * size) as u64;
        if !(t.dtype == DType::F32 || is_low(t.dtype)) || !exact || !h.can_mut() {
            return None;
        }
        if t.is_contiguous() {
            return Some((n, size, t));
        }
        let permuted = {
            let mut dims: Vec<(usize, usize)> = t.meta.strides().iter().copied().zip(t.meta.shape().iter().copied()).collect();
            dims.sort_unstable();
            // Sorted by stride, each stride the product of the extents below it: a permutation.
            let mut want = 1;
            dims.iter().all(|&(stride, extent)| {
                let ok = stride == want || extent == 1;
                want *= extent;
                ok
            })
        };
        permuted.then(|| (n, size, CubeTensor::new_contiguous(t.client.clone(), t.device.clone(), Shape::from(vec![n]), t.handle.clone(), t.dtype)))
    }

    fn stores_low(dtype: cellgraph_compiler::DType, device: &R::Device) -> bool {
        let d = storage_dtype(dtype);
        is_low(d) && R::client(device).properties().supports_type(dtype_to_storage_type(d))
    }

    fn device_pin(t: &CubeTensor<R>) -> Option<Box<dyn std::any::Any + Send>> {
        // A binding holds the memory's descriptor, as a launch not yet run does: the pool does
        // not hand the memory out again, and the handle count `can_mut` reads is unchanged.
        Some(Box::new(t.handle.clone().binding()))
    }

    fn assign_add_in_place(acc: &CubeTensor<R>, g: CubeTensor<R>) -> bool {
        if !acc.is_contiguous() || acc.meta.num_elements() != g.meta.num_elements() || acc.dtype != DType::F32 || g.dtype != DType::F32 {
            return false;
        }
        let g = burn_cubecl::kernel::into_contiguous(g);
        let n = acc.meta.num_elements();
        let (count, dim) = grid(&acc.client, n);
        assign_add::launch::<f32, R>(&acc.client, count, dim, arr(acc), arr(&g));
        true
    }

    fn device_declines_program(post: &crate::kernel::Elementwise) -> Option<String> {
        EwKernel::new(post, true).is_none().then(|| {
            let n = post.reads.len();
            format!("a program reading {n} operands (the elementwise kernel reads up to {}) or along more axes than it indexes", ew::MAX_OPERANDS)
        })
    }

    fn device_declines(op: &Native, args: &[TensorType], out: &TensorType, ids_checked: bool, device: &R::Device) -> Option<String> {
        let rows_fit = |rows: usize, cols: usize| u32::try_from(rows).is_ok() && u32::try_from(cols).is_ok();
        match op {
            // The head's kernel decides (its program: `device_declines_program`).
            Native::Epilogue { head, head_args, .. } => Self::device_declines(head, args.get(..*head_args)?, out, ids_checked, device),
            &Native::SumRows { cols } if !rows_fit(args.first()?.numel() / cols.max(1), cols) => {
                Some("more rows or columns than the column-sum kernel indexes".into())
            }
            &Native::SumPlanes { outer, inner: 1, .. } if !rows_fit(outer, out.numel()) => {
                Some("more rows or columns than the column-sum kernel indexes".into())
            }
            Native::Fused(e) => EwKernel::new(e, false).is_none().then(|| "a program the elementwise kernel does not take".into()),
            Native::Fill(_) => Some("a fill (burn's `full`: one launch either way)".into()),
            Native::MaxPool { g, .. } if g.has_empty_window() => Some("a pooling window that reads no input".into()),
            &Native::SumPlanes { outer, inner, .. } if inner != 1 && !sums::plane_sums_fit(outer, out.numel(), inner) => {
                Some("a reduction whose extents the plane-sum kernel cannot index in 32 bits".into())
            }
            &Native::Dropout { p, seed, row } if dropout::DropoutKey::new(p, seed, row).is_none() => {
                Some("rows longer than the dropout kernel indexes".into())
            }
            &Native::CausalMask { t, s, .. } if u32::try_from(t).is_err() || u32::try_from(s).is_err() => {
                Some("a mask wider than the causal-mask kernel indexes".into())
            }
            &Native::MaxRows { cols } if u32::try_from(cols).is_err() => Some("rows longer than the row-maximum kernel indexes".into()),
            Native::SumOf { .. } => Some("a program summed as it is computed (host plans only)".into()),
            Native::Gather { .. } | Native::ScatterAdd { .. } if !ids_checked => {
                Some("ids computed in the plan (the lowering reads and checks them)".into())
            }
            &Native::Gather { width, .. } if u32::try_from(width).is_err() => Some("rows wider than the gather kernel indexes".into()),
            &Native::ScatterAdd { rows, width } => {
                let ids = args.iter().find(|t| !t.dtype.is_float()).map_or(0, |t| t.numel());
                if u32::try_from(width).is_err() {
                    Some("rows wider than the scatter-add kernel indexes".into())
                } else if !layout::scatter_fits(rows, ids) {
                    Some(format!(
                        "{rows} rows over {ids} ids: the scatter-add kernel reads every id for each row (at most {} ids x rows)",
                        layout::SCATTER_SCAN
                    ))
                } else {
                    None
                }
            }
            Native::Permute { .. } | Native::Slice { .. } | Native::Pad { .. } | Native::Broadcast { .. } | Native::Concat { .. }
                if layout::walks(op).is_none() =>
            {
                Some(format!("a copy along more than {} axes, or past 32-bit indices", layout::MAX_AXES))
            }
            Native::SoftmaxCrossEntropy { .. } if !ids_checked => Some("class ids computed in the plan (the lowering reads and checks them)".into()),
            Native::SoftmaxCrossEntropy { c, reduction, .. } => {
                let n = args.iter().find(|t| !t.dtype.is_float()).map_or(0, |t| t.numel());
                loss::LossDims::new(n, *c, *reduction).is_none().then(|| "more rows or classes than the loss kernel indexes".into())
            }
            &Native::Attention { b, t, heads, d, causal, .. } => {
                let max_shared = R::client(device).properties().hardware.max_shared_memory_size;
                if attention::AttnDims::new(t, heads, d, causal).is_none() || b * heads * t == 0 {
                    Some(format!("attention extents the kernel does not take (head size {d})"))
                } else if attention::shared_bytes(d, core::mem::size_of::<f32>()) > max_shared {
                    Some(format!("head size {d} needs more shared memory than the device's {max_shared} bytes"))
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    fn device_kernel(
        op: &Native,
        args: &[&CubeTensor<R>],
        ints: &[&CubeTensor<R>],
        out: &TensorType,
        tf32: bool,
        arena: &mut Arena,
    ) -> Option<CubeTensor<R>> {
        let first = args.first()?;
        let (client, device) = (first.client.clone(), first.device.clone());
        let int = int_dtype::<R>(&device);
        // Operands a session stores in bf16 / f16 are read so by the kernels that take them
        // (`Native::stored_operands`); the others read f32.
        let stored = |k: usize, t: &CubeTensor<R>| t.dtype == DType::F32 || (is_low(t.dtype) && k < op.stored_operands());
        if !args.iter().enumerate().all(|(k, t)| stored(k, t)) || ints.iter().any(|t| t.dtype != int) {
            return None;
        }
        // The type the result is stored in: f32, or the bf16 / f16 the session binds a fused
        // program's or a product's epilogue's result to (`exec::bind::low_stores`).
        let store = storage_dtype(out.dtype);
        let contiguous = |t: &CubeTensor<R>| burn_cubecl::kernel::into_contiguous(t.clone());
        let numel = out.numel().max(1);
        let (count, dim) = grid(&client, numel);
        // SAFETY (every launch below): the kernels index only below their arrays' lengths
        // (each unit checks its position against its output's length; the operands' extents
        // are the bound op's, which the plan's types fix; class ids were checked on the host,
        // see `run_bound`).
        let y = match op {
            Native::MatMul { .. } | Native::Conv { .. } => {
                let (a, b) = (contiguous(args[0]), contiguous(args[1]));
                if let Some(y) = conv_on_tensor_cores::<R>(op, &a, &b, tf32) {
                    return Some(y);
                }
                let y = output::<R>(arena, &client, &device, out.dims());
                head_kernel::<R>(op, &a, &b, &y, numel, tf32, &EwKernel::identity(), &[], arena);
                y
            }
            Native::Epilogue { head, head_args, post } => {
                return launch::epilogue::<R>(head, *head_args, post, args, out, store, tf32, arena);
            }
            Native::Fused(e) => {
                let prog = EwKernel::new(e, false)?;
                let xs: Vec<_> = args.iter().map(|t| contiguous(t)).collect();
                let y = output_of::<R>(arena, &client, &device, out.dims(), store);
                launch_elementwise::<R>(&prog, &y, &xs);
                y
            }
            Native::Relu | Native::ReluGrad => {
                let prog = match op {
                    Native::Relu => EwKernel::same(1, Program::of_op(&cellgraph_compiler::Op::Relu, 1)?),
                    _ => EwKernel::same(2, Program::of_op(&cellgraph_compiler::Op::ReluGrad, 2)?),
                };
                let xs: Vec<_> = args.iter().map(|t| contiguous(t)).collect();
                let y = output::<R>(arena, &client, &device, out.dims());
                launch_elementwise::<R>(&prog, &y, &xs);
                y
            }
            Native::SumRows { cols } => {
                let x = contiguous(args[0]);
                let y = output::<R>(arena, &client, &device, out.dims());
                column_sums::<R>(&x, &y, x.meta.num_elements() / cols, *cols, None, false, arena)?;
                y
            }
            // Over the leading axes (a layer norm's parameter gradients): column sums; over
            // leading and trailing ones (batch norm's statistics, a layer norm's): a cube per
            // kept value.
            &Native::SumPlanes { outer, inner, scale } => {
                let x = contiguous(args[0]);
                let y = output::<R>(arena, &client, &device, out.dims());
                sums::sums_of_planes::<R>(&x, &y, outer, inner, scale.map(|s| s as f32), false, arena)?;
                y
            }
            Native::MaxPool { g, .. } if !g.has_empty_window() => launch::max_pool::<R>(&contiguous(args[0]), g, out, store, arena),
            Native::MaxPoolGrad { .. } => {
                let (x, dy) = (contiguous(args[0]), contiguous(args[1]));
                let y = output::<R>(arena, &client, &device, out.dims());
                head_kernel::<R>(op, &x, &dy, &y, numel, tf32, &EwKernel::identity(), &[], arena);
                y
            }
            Native::SoftmaxCrossEntropy { c, reduction, grad, .. } => {
                let dl = if *grad { Some(contiguous(args.get(1)?)) } else { None };
                launch::loss::<R>(&contiguous(args[0]), &contiguous(ints.first()?), dl.as_ref(), *c, *reduction, out, arena)?
            }
            // burn's `full`: one launch either way.
            Native::Fill(_) | Native::MaxPool { .. } => return None,
            // The factors drawn in the kernel from the host's hash: nothing read back.
            &Native::Dropout { p, seed, row } => {
                let [items, update] = ints else { return None };
                launch::dropout::<R>(
                    &contiguous(args[0]),
                    &contiguous(items),
                    &contiguous(update),
                    dropout::DropoutKey::new(p, seed, row)?,
                    out,
                    arena,
                )
            }
            // Moved values, read as stored and written in the type the session stores the
            // result in: the layout copies and an embedding's rows; and the rows' gradient (f32).
            Native::Gather { .. }
            | Native::ScatterAdd { .. }
            | Native::Permute { .. }
            | Native::Slice { .. }
            | Native::Pad { .. }
            | Native::Broadcast { .. }
            | Native::Concat { .. } => {
                let xs: Vec<_> = args.iter().map(|t| contiguous(t)).collect();
                let store = if matches!(op, Native::ScatterAdd { .. }) { DType::F32 } else { store };
                let y = output_of::<R>(arena, &client, &device, out.dims(), store);
                let ran = match ints.first() {
                    Some(ids) => layout::rows::<R>(op, &xs, &contiguous(ids), &y),
                    None => layout::copy::<R>(op, &xs, &y),
                };
                if !ran {
                    arena.give_device(numel, store.size(), y);
                    return None;
                }
                y
            }
            // cubek's exact kernels over the batch (burn's matmul would take TF32 tensor cores).
            Native::BatchMatMul { batch, m, k, n, transpose_a, transpose_b, .. } => {
                let (a, b) = (contiguous(args[0]), contiguous(args[1]));
                let y = output::<R>(arena, &client, &device, out.dims());
                if !cubek_matmul(&a, &b, &y, *batch, [*m, *k, *n], *transpose_a, *transpose_b, Tiling::for_extents(*m, *k, *n), tf32) {
                    return None;
                }
                y
            }
            &Native::Attention { b, t, heads, d, causal, grad, .. } => {
                let dy = if grad { Some(contiguous(args.get(1)?)) } else { None };
                launch::attention::<R>(&contiguous(args[0]), dy.as_ref(), [b, t, heads, d], causal, out, tf32, arena)?
            }
            &Native::CausalMask { t, s, fill } => launch::causal_mask::<R>(&contiguous(args[0]), t, s, fill, out, arena),
            // Merged by host plans only (see `device_declines`).
            Native::SumOf { .. } => return None,
            &Native::MaxRows { cols } => {
                let x = contiguous(args[0]);
                let y = output::<R>(arena, &client, &device, out.dims());
                // SAFETY: one unit per row of `x` (`y`'s elements), reading its `cols` values.
                unsafe { sums::max_rows::launch_unchecked::<f32, R>(&client, count, dim, arr(&x), arr(&y), cols as u32) };
                y
            }
        };
        Some(y)
    }

    fn device_loss_with_grad(
        op: &Native,
        args: &[&CubeTensor<R>],
        ints: &[&CubeTensor<R>],
        out: &TensorType,
        seed: f64,
        arena: &mut Arena,
    ) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
        let Native::SoftmaxCrossEntropy { c, reduction, grad: false, .. } = *op else { return None };
        let ([logits], [labels]) = (args, ints) else { return None };
        launch::loss_with_grad::<R>(logits, labels, c, reduction, out, seed, arena)
    }

    fn device_accumulate(op: &Native, args: &[&CubeTensor<R>], acc: &CubeTensor<R>, tf32: bool, arena: &mut Arena) -> bool {
        // Operands stored in bf16 / f16 are read as they are where the kernel takes them.
        let stored = |k: usize, t: &CubeTensor<R>| t.dtype == DType::F32 || (is_low(t.dtype) && k < op.stored_operands());
        let f32s = acc.dtype == DType::F32 && args.iter().enumerate().all(|(k, t)| stored(k, t));
        if !f32s || !acc.is_contiguous() {
            return false;
        }
        let contiguous = |t: &CubeTensor<R>| burn_cubecl::kernel::into_contiguous(t.clone());
        match *op {
            // A filter gradient: its slices summed straight into the accumulator (one launch
            // fewer than the gradient and an `assign_add`). The op's operands are (dy, x).
            Native::Conv { kind: ConvKind::FilterGrad, g, groups, out_channels, .. } => {
                // On tensor cores the gradient is made apart, then added.
                if conv::on_tensor_cores::<R>(ConvKind::FilterGrad, &g, groups, out_channels, tf32) {
                    return false;
                }
                let dims = ConvDims::of(&g, groups, out_channels);
                if args.len() != 2 || acc.meta.num_elements() != dims.filter_len() {
                    return false;
                }
                filter_grad::<R>(&dims, &contiguous(args[0]), &contiguous(args[1]), acc, true, arena);
                true
            }
            // A weight gradient over many rows: its parts' products summed straight into
            // the accumulator (see `split_matmul`), on TF32 tensor cores with `tf32`.
            Native::MatMul { m, k, n, transpose_a, transpose_b, .. } => {
                let [a, b] = args else { return false };
                acc.meta.num_elements() == m * n
                    && split_matmul::<R>([m, k, n], transpose_a, transpose_b, &contiguous(a), &contiguous(b), acc, true, tf32, arena)
            }
            // A bias gradient: the column sums added into the accumulator.
            Native::SumRows { cols } => {
                let [x] = args else { return false };
                let x = contiguous(x);
                acc.meta.num_elements() == cols && column_sums::<R>(&x, acc, x.meta.num_elements() / cols, cols, None, true, arena).is_some()
            }
            // A layer norm's or batch norm's parameter gradient: its sums, on the kernel the
            // sum alone runs on (column sums over leading axes, else plane sums), added into
            // the accumulator (one launch fewer than the sums and an `assign_add`).
            Native::SumPlanes { outer, inner, scale } => {
                let [x] = args else { return false };
                x.meta.num_elements() == outer * acc.meta.num_elements() * inner
                    && sums::sums_of_planes::<R>(&contiguous(x), acc, outer, inner, scale.map(|s| s as f32), true, arena).is_some()
            }
            _ => false,
        }
    }

    fn sum_in_order(x: CubeTensor<R>) -> CubeTensor<R> {
        sums::sum_in_order::<R>(x)
    }

    fn fused_update(prog: &Program, p: &CubeTensor<R>, acc: &CubeTensor<R>, state: &[CubeTensor<R>], scale: f32, scalars: &[f32]) -> Option<usize> {
        let f32s = [p, acc].into_iter().chain(state).all(|t| t.dtype == DType::F32);
        f32s.then(|| launch_update::<R>(prog, p, acc, state, scale, scalars))
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;

    /// A view holds its own elements' bytes only, also of a buffer whose memory is longer than
    /// its elements (cubecl's CUDA allocator rounds buffers up to 512 bytes): trimmed by the
    /// buffer's element count, the view below reached 64 elements into the next one, and on
    /// CUDA's layout (scripts/pitched_wgpu.sh) the convolution test and the dropout GPT went wrong.
    #[test]
    fn a_view_of_a_longer_memory_holds_only_its_elements() {
        let device = cubecl::wgpu::WgpuDevice::DefaultDevice;
        let client = <cubecl::wgpu::WgpuRuntime as cubecl::Runtime>::client(&device);
        let memory = client.empty(256 * 4);
        let buffer = CubeTensor::new_contiguous(client, device, Shape::from(vec![192]), memory, DType::F32);
        let v = view(&buffer, 64, &[4, 16]).expect("an aligned view inside the buffer");
        assert_eq!(v.handle.size_in_used(), 64 * 4);
        assert_eq!(view(&buffer, 128, &[64]).expect("the last view").handle.size_in_used(), 64 * 4);
        assert!(view(&buffer, 128, &[65]).is_none(), "past the buffer's elements");
    }
}

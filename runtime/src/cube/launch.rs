//! The launches of the device's kernels that take more than a line to set up: an epilogue
//! (its program inside the head's kernel, or after it), softmax cross-entropy (the loss, its
//! gradient, or the two in one launch), attention (its forward on cubek's flash attention where
//! tensor cores are asked for; its gradient's two launches), dropout, the causal mask and max
//! pooling. `Backend::device_kernel` (in [`super`]) matches the bound op and calls these; each
//! returns `None` where its kernel does not take the operands, and burn's ops run the step.
//!
//! SAFETY (every launch below): the kernels index only below their arrays' lengths (each unit
//! checks its position against its output's length; the operands' extents are the bound op's,
//! which the plan's types fix; class ids were checked on the host, see `exec::run`).

use burn_backend::cubecl::dtype_to_storage_type;
use burn_backend::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cellgraph_compiler::{Reduction, TensorType};
use cubecl::{calculate_cube_count_elemwise, CubeDim};

use super::ew::{self, EwKernel};
use super::{
    arr, attention, conv, dropout, empty, flash, gemm, grid, head_kernel, int_dtype, is_low, launch_elementwise, loss, loss_grid, output, output_of,
    pool, ConvDims,
};
use crate::arena::Arena;
use crate::backend::Backend;
use crate::kernel::{ConvKind, Elementwise, Geometry, Native};

fn contiguous<R: CubeRuntime>(t: &CubeTensor<R>) -> CubeTensor<R> {
    burn_cubecl::kernel::into_contiguous(t.clone())
}

/// An epilogue: the head (`args[..head_args]`) with the program `post` over its result
/// (operands after the head's in `args[head_args..]`), stored in `store`: inside the head's
/// kernel where it runs there (a convolution forward or a pooling gradient off tensor cores),
/// else the head's f32 sums and the program writing the low type, else the program over the
/// head's output in place.
#[allow(clippy::too_many_arguments)]
pub(super) fn epilogue<R: CubeRuntime>(
    head: &Native,
    head_args: usize,
    post: &Elementwise,
    args: &[&CubeTensor<R>],
    out: &TensorType,
    store: DType,
    tf32: bool,
    arena: &mut Arena,
) -> Option<CubeTensor<R>> {
    let first = args.first()?;
    let (client, device) = (&first.client, &first.device);
    let numel = out.numel().max(1);
    let prog = EwKernel::new(post, true)?;
    let rest: Vec<_> = args.get(head_args..)?.iter().map(|t| contiguous(t)).collect();
    let tensor_cores = match *head {
        Native::Conv { kind, g, groups, out_channels, .. } => conv::on_tensor_cores::<R>(kind, &g, groups, out_channels, tf32),
        _ => false,
    };
    let inside = matches!(*head, Native::Conv { kind: ConvKind::Forward, .. } | Native::MaxPoolGrad { .. }) && head_args == 2 && !tensor_cores;
    let kernel = <CubeBackend<R> as Backend>::device_kernel;
    Some(if inside && prog.reads.len() <= ew::HEAD_OPERANDS {
        // The program inside the head's kernel, on its result before it is stored (in the
        // type the session stores it in).
        let (a, b) = (contiguous(args[0]), contiguous(args[1]));
        let y = output_of::<R>(arena, client, device, out.dims(), store);
        head_kernel::<R>(head, &a, &b, &y, numel, tf32, &prog, &rest, arena);
        y
    } else if is_low(store) {
        // The head's f32 sums, then the program over them, its result stored low.
        let sums = TensorType::f32(out.dims().to_vec());
        let h = kernel(head, args.get(..head_args)?, &[], &sums, tf32, arena)?;
        let y = output_of::<R>(arena, client, device, out.dims(), store);
        let prog = EwKernel::new(post, false)?;
        launch_elementwise::<R>(&prog, &y, &[std::iter::once(h.clone()).chain(rest).collect::<Vec<_>>()].concat());
        // Later launches run after this one: its buffer may be written again.
        arena.give_device(numel, DType::F32.size(), h);
        y
    } else {
        // The head, then the program over the head's output in place.
        let y = kernel(head, args.get(..head_args)?, &[], out, tf32, arena)?;
        launch_elementwise::<R>(&prog, &y, &rest);
        y
    })
}

/// Softmax cross-entropy of `logits` against class ids `labels` (`c` classes), or with `dl`
/// (the loss's gradient) its gradient with respect to the logits.
pub(super) fn loss<R: CubeRuntime>(
    logits: &CubeTensor<R>,
    labels: &CubeTensor<R>,
    dl: Option<&CubeTensor<R>>,
    c: usize,
    reduction: Reduction,
    out: &TensorType,
    arena: &mut Arena,
) -> Option<CubeTensor<R>> {
    let (client, device) = (&logits.client, &logits.device);
    let dims = loss::LossDims::new(labels.meta.num_elements(), c, reduction)?;
    let y = output::<R>(arena, client, device, out.dims());
    if let Some(dl) = dl {
        let (count, dim) = grid(client, out.numel().max(1));
        unsafe {
            loss::softmax_cross_entropy_grad::launch_unchecked::<f32, R>(
                client,
                count,
                dim,
                arr(logits),
                arr(labels),
                arr(dl),
                arr(&y),
                dims,
                dtype_to_storage_type(logits.dtype),
                dtype_to_storage_type(labels.dtype),
            )
        };
    } else {
        // No gradient: `dx` is never touched (a one-element buffer of its own).
        let dx = arena.take_scratch::<CubeTensor<R>>(1).unwrap_or_else(|| empty::<R>(client, device, &[1]));
        launch_loss(logits, labels, &y, &dx, dims, reduction, None);
        arena.give_scratch(1, dx);
    }
    Some(y)
}

/// The loss and its gradient for the constant seed `seed` in one launch: `(loss, dlogits)`.
/// `None` where the two kernels apart do better (a reduced loss over more than
/// [`loss::FUSED_ROWS`] rows) or the operands are not the kernel's types.
pub(super) fn loss_with_grad<R: CubeRuntime>(
    logits: &CubeTensor<R>,
    labels: &CubeTensor<R>,
    c: usize,
    reduction: Reduction,
    out: &TensorType,
    seed: f64,
    arena: &mut Arena,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    if !(logits.dtype == DType::F32 || is_low(logits.dtype)) || labels.dtype != int_dtype::<R>(&logits.device) {
        return None;
    }
    let (logits, labels) = (contiguous(logits), contiguous(labels));
    let n = labels.meta.num_elements();
    let dims = loss::LossDims::new(n, c, reduction)?;
    // One cube sums a reduced loss: beyond a few thousand rows the two kernels apart (a unit
    // per logit for the gradient) spread the work better.
    if reduction != Reduction::None && n > loss::FUSED_ROWS {
        return None;
    }
    let (client, device) = (&logits.client, &logits.device);
    let (y, dx) = (output::<R>(arena, client, device, out.dims()), output::<R>(arena, client, device, &[n, c]));
    launch_loss(&logits, &labels, &y, &dx, dims, reduction, Some((seed as f32).to_bits()));
    Some((y, dx))
}

/// The loss kernel over `labels`' rows into `y`, with the gradient for the constant seed
/// `seed` (f32 bits) into `dx` (`dx` untouched without it): each unit writes rows below the
/// labels' count of `dx` and `y`, reading those rows of the logits and labels (whose type is
/// the device's class-id type, checked by the callers).
fn launch_loss<R: CubeRuntime>(
    logits: &CubeTensor<R>,
    labels: &CubeTensor<R>,
    y: &CubeTensor<R>,
    dx: &CubeTensor<R>,
    dims: loss::LossDims,
    reduction: Reduction,
    seed: Option<u32>,
) {
    let client = &logits.client;
    let (count, dim) = loss_grid(client, labels.meta.num_elements(), reduction);
    unsafe {
        loss::softmax_cross_entropy::launch_unchecked::<f32, R>(
            client,
            count,
            dim,
            arr(logits),
            arr(labels),
            arr(y),
            arr(dx),
            dims,
            seed,
            dtype_to_storage_type(logits.dtype),
            dtype_to_storage_type(labels.dtype),
        )
    };
}

/// Attention over `qkv` (`[b, t, heads, d]` as `bthd`), or with `dy` its gradient: the forward
/// on cubek's flash attention where tensor cores are asked for (`tf32`) and it sets up, else
/// (counted) on the runtime's kernel; the gradient's two launches.
pub(super) fn attention<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    dy: Option<&CubeTensor<R>>,
    bthd: [usize; 4],
    causal: bool,
    out: &TensorType,
    tf32: bool,
    arena: &mut Arena,
) -> Option<CubeTensor<R>> {
    let [b, t, heads, d] = bthd;
    let (client, device) = (&qkv.client, &qkv.device);
    let g = attention::AttnDims::new(t, heads, d, causal)?;
    let rows = b * heads * t;
    if rows == 0 || attention::shared_bytes(d, core::mem::size_of::<f32>()) > client.properties().hardware.max_shared_memory_size {
        return None;
    }
    let y = output::<R>(arena, client, device, out.dims());
    let scale = 1.0 / (d as f32).sqrt();
    // A cube per `ROWS` query (or key) rows, `PARTS` units each.
    let dim = CubeDim::new_2d(attention::ROWS as u32, attention::PARTS as u32);
    let count = calculate_cube_count_elemwise(client, rows.div_ceil(attention::ROWS) * attention::ROWS * attention::PARTS, dim);
    // Units per query (or key) row below `rows` (those past it write nothing), reading `qkv`
    // (and `dy`) and writing `y` (and the statistics) within the extents `g` and `b` give them.
    unsafe {
        if let Some(dy) = dy {
            let stats = arena.take_scratch::<CubeTensor<R>>(3 * rows).unwrap_or_else(|| empty::<R>(client, device, &[3 * rows]));
            let (qt, gt) = (dtype_to_storage_type(qkv.dtype), dtype_to_storage_type(dy.dtype));
            attention::attention_grad_rows::launch_unchecked::<f32, R>(
                client,
                count.clone(),
                dim,
                arr(qkv),
                arr(dy),
                arr(&y),
                arr(&stats),
                scale,
                g,
                qt,
                gt,
            );
            attention::attention_grad_cols::launch_unchecked::<f32, R>(client, count, dim, arr(qkv), arr(dy), arr(&stats), arr(&y), scale, g, qt, gt);
            arena.give_scratch(3 * rows, stats);
        } else {
            // Tensor cores asked for: cubek's flash attention, where it sets up.
            let unit = flash::unit_routine_for_tests();
            if !((tf32 || unit) && flash::forward(qkv, &y, b, t, heads, d, causal, unit, arena)) {
                if tf32 {
                    gemm::count_tf32_fallback();
                }
                let qt = dtype_to_storage_type(qkv.dtype);
                attention::attention_forward::launch_unchecked::<f32, R>(client, count, dim, arr(qkv), arr(&y), scale, g, qt);
            }
        }
    }
    Some(y)
}

/// Dropout of `x` with the factors drawn in the kernel from the host's hash of `k`'s seed,
/// the update (`update[0]`) and each row's item (`items`): nothing read back.
pub(super) fn dropout<R: CubeRuntime>(
    x: &CubeTensor<R>,
    items: &CubeTensor<R>,
    update: &CubeTensor<R>,
    k: dropout::DropoutKey,
    out: &TensorType,
    arena: &mut Arena,
) -> CubeTensor<R> {
    let client = &x.client;
    let y = output::<R>(arena, client, &x.device, out.dims());
    let (count, dim) = grid(client, out.numel().max(1));
    // One unit per element of `y` (`x`'s extents), reading item `i / row` of `items` (a row per
    // item, as the bound op's types fix) and `update[0]`.
    unsafe {
        dropout::dropout::launch_unchecked::<f32, R>(
            client,
            count,
            dim,
            arr(x),
            arr(items),
            arr(update),
            arr(&y),
            k,
            dtype_to_storage_type(items.dtype),
        )
    };
    y
}

/// `x` with the scores past the causal diagonal (`t` queries over `s` keys) set to `fill`.
pub(super) fn causal_mask<R: CubeRuntime>(x: &CubeTensor<R>, t: usize, s: usize, fill: f64, out: &TensorType, arena: &mut Arena) -> CubeTensor<R> {
    let client = &x.client;
    let y = output::<R>(arena, client, &x.device, out.dims());
    let (count, dim) = grid(client, out.numel().max(1));
    // One unit per element of `y` (`x`'s extents).
    unsafe { dropout::causal_mask::launch_unchecked::<f32, R>(client, count, dim, arr(x), arr(&y), t as u32, s as u32, (fill as f32).to_bits()) };
    y
}

/// Max pooling of `x` over `g`'s windows (none of them empty), stored in `store`.
pub(super) fn max_pool<R: CubeRuntime>(x: &CubeTensor<R>, g: &Geometry, out: &TensorType, store: DType, arena: &mut Arena) -> CubeTensor<R> {
    let client = &x.client;
    let y = output_of::<R>(arena, client, &x.device, out.dims(), store);
    let (count, dim) = grid(client, out.numel().max(1));
    let ty = |t: &CubeTensor<R>| dtype_to_storage_type(t.dtype);
    // One unit per element of `y`, reading its window of `x` within `g`'s extents.
    unsafe { pool::max_pool2d::launch_unchecked::<f32, R>(client, count, dim, arr(x), arr(&y), ConvDims::of(g, 1, g.x[1]), ty(x), ty(&y)) };
    y
}

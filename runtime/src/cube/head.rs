//! A two-operand head's kernel (a matmul, a convolution, max pooling's gradient) with the
//! epilogue a convolution forward or a pooling gradient runs inside it, a convolution on
//! cubek's tensor-core routine, and a low-precision operand widened for a kernel that reads f32.

use burn_backend::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cellgraph_compiler::program::Program;

use super::conv::{self, filter_grad};
use super::ew::EwKernel;
use super::gemm::{cubek_matmul, split_matmul, NAIVE_MATMULS};
use super::{arr, conv2d_forward, conv2d_input_grad, empty, grid, launch_elementwise, matmul, pool, ConvDims};
use crate::arena::Arena;
use crate::kernel::{ConvKind, Native};

/// A two-operand head `(a, b)` (matmul, convolution, max pooling's gradient) into `y`
/// (`numel` elements) on the kernel bound for it. A convolution forward or a pooling gradient
/// stores its result through the in-place epilogue `post` (operands after the first in
/// `rest`); the others take [`EwKernel::identity`] only.
#[allow(clippy::too_many_arguments)]
pub(super) fn head_kernel<R: CubeRuntime>(
    op: &Native,
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    y: &CubeTensor<R>,
    numel: usize,
    tf32: bool,
    post: &EwKernel,
    rest: &[CubeTensor<R>],
    arena: &mut Arena,
) {
    let client = &y.client;
    let (count, dim) = grid(client, numel);
    // The epilogue's operands 1.. (slots it does not read get another operand, never `y`).
    let x = |k: usize| arr(rest.get(k).unwrap_or(a));
    // Each operand's stored type (f32, or a session's bf16 / f16).
    let ty = |t: &CubeTensor<R>| burn_backend::cubecl::dtype_to_storage_type(t.dtype);
    // SAFETY (every launch below): the kernels index only below their arrays' lengths (each
    // unit checks its position against its output's length; the operands' extents are the
    // bound op's, which the plan's types fix).
    match *op {
        Native::MatMul { m, k, n, transpose_a, transpose_b, tiling, .. } => {
            if split_matmul::<R>([m, k, n], transpose_a, transpose_b, a, b, y, false, tf32, arena) {
                return;
            }
            if !cubek_matmul(a, b, y, 1, [m, k, n], transpose_a, transpose_b, tiling, tf32) {
                NAIVE_MATMULS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mkn = [m as u32, k as u32, n as u32];
                let (a, b) = (widened(a), widened(b));
                unsafe { matmul::launch_unchecked::<f32, R>(client, count, dim, arr(&a), arr(&b), arr(y), mkn, transpose_a, transpose_b) }
            }
        }
        Native::Conv { kind, g, groups, out_channels, .. } => {
            let dims = ConvDims::of(&g, groups, out_channels);
            match kind {
                ConvKind::Forward => unsafe {
                    conv2d_forward::launch_unchecked::<f32, R>(
                        client,
                        count,
                        dim,
                        arr(a),
                        arr(b),
                        arr(y),
                        x(0),
                        x(1),
                        x(2),
                        dims,
                        post.clone(),
                        ty(a),
                        ty(b),
                        ty(y),
                    )
                },
                ConvKind::InputGrad => unsafe {
                    conv2d_input_grad::launch_unchecked::<f32, R>(client, count, dim, arr(a), arr(b), arr(y), dims, ty(a), ty(b))
                },
                // The op's operands are (dy, x).
                ConvKind::FilterGrad => filter_grad::<R>(&dims, a, b, y, false, arena),
            }
        }
        Native::MaxPoolGrad { g, .. } => unsafe {
            pool::max_pool2d_grad::launch_unchecked::<f32, R>(
                client,
                count,
                dim,
                arr(a),
                arr(b),
                arr(y),
                x(0),
                x(1),
                x(2),
                ConvDims::of(&g, 1, g.x[1]),
                post.clone(),
                ty(a),
                ty(b),
                ty(y),
            )
        },
        _ => unreachable!("a head kernel runs matmuls, convolutions and pooling gradients"),
    }
}

/// `t` (contiguous) as f32: itself, or a bf16 / f16 value widened into a new buffer (one
/// launch of the elementwise kernel; exact).
pub(super) fn widened<R: CubeRuntime>(t: &CubeTensor<R>) -> CubeTensor<R> {
    if t.dtype == DType::F32 {
        return t.clone();
    }
    let y = empty::<R>(&t.client, &t.device, &t.meta.shape().to_vec());
    let mut copy = Program::new();
    copy.write(0, cellgraph_compiler::program::Val::Arg(0));
    launch_elementwise::<R>(&EwKernel::same(1, copy), &y, std::slice::from_ref(t));
    y
}

/// A convolution `op` on cubek's tensor-core routine ([`conv::tensor_core_conv`]) where `tf32`
/// asks for tensor cores and the routine takes its geometry; `None` otherwise (and where the
/// routine does not set up, counted): the exact kernels run it.
pub(super) fn conv_on_tensor_cores<R: CubeRuntime>(op: &Native, a: &CubeTensor<R>, b: &CubeTensor<R>, tf32: bool) -> Option<CubeTensor<R>> {
    let Native::Conv { kind, g, groups, out_channels, .. } = *op else { return None };
    // A session stores a convolution's operands low only where it runs on the exact kernels.
    if a.dtype != DType::F32 || b.dtype != DType::F32 {
        return None;
    }
    conv::on_tensor_cores::<R>(kind, &g, groups, out_channels, tf32).then(|| conv::tensor_core_conv::<R>(kind, &g, out_channels, a, b)).flatten()
}

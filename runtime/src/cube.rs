//! Device backends on cubecl: burn's cubecl backend drives the executor, and the runtime's own
//! `#[cube]` kernels do what burn's ops cannot do in one launch.
//!
//! - [`assign_add`]: `acc += g` in place, into an accumulator that is a view of one flat
//!   accumulator buffer (burn's `add` would allocate a new tensor and break the aliasing).
//! - [`momentum_clear`], [`sgd_clear`], [`adam_clear`]: the whole boundary of a window, the
//!   optimizer update of every parameter and the clearing of every accumulator, as one launch
//!   over flat parameter / accumulator / state buffers.
//!
//! The kernels are generic over cubecl runtimes: CUDA on an NVIDIA GPU (feature `cuda`), and
//! wgpu (feature `wgpu`), which runs on Mesa's lavapipe CPU Vulkan driver in CI, where the
//! tests check them against the CPU reference (the optimizer graphs run on burn-ndarray).

use burn_backend::Shape;
use burn_cubecl::element::{BoolElement, FloatElement, IntElement};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cellgraph_compiler::update::FusedRule;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

use crate::host::Backend;

/// burn's CUDA backend (no fusion): the executor's tensors are cubecl buffers.
#[cfg(feature = "cuda")]
pub type Cuda = CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
/// A CUDA device (`cuda:N`).
#[cfg(feature = "cuda")]
pub use cubecl::cuda::CudaDevice;

/// burn's cubecl backend on wgpu (Vulkan, Metal, DX12; lavapipe on a CPU).
#[cfg(feature = "wgpu")]
pub type Wgpu = CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
/// A wgpu device.
#[cfg(feature = "wgpu")]
pub use cubecl::wgpu::WgpuDevice;

use crate::host::FLAT_ALIGN as ALIGN;

/// `acc[i] += g[i]`.
#[cube(launch)]
pub fn assign_add<F: Float>(acc: &mut Array<F>, g: &Array<F>) {
    if ABSOLUTE_POS < acc.len() {
        acc[ABSOLUTE_POS] += g[ABSOLUTE_POS];
    }
}

/// MindSpore's Momentum on flat buffers, then `acc = 0`:
/// `g = acc * scale + wd * p; v = v * momentum + g; p -= lr * (nesterov ? g + momentum * v : v)`.
#[cube(launch)]
pub fn momentum_clear<F: Float>(
    p: &mut Array<F>,
    acc: &mut Array<F>,
    v: &mut Array<F>,
    scale: f32,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    #[comptime] nesterov: bool,
) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let w = p[i];
        let g = acc[i] * F::cast_from(scale) + F::cast_from(weight_decay) * w;
        let vn = v[i] * F::cast_from(momentum) + g;
        v[i] = vn;
        let mut step = vn;
        if nesterov {
            step = g + vn * F::cast_from(momentum);
        }
        p[i] = w - step * F::cast_from(lr);
        acc[i] = F::new(0.0);
    }
}

/// PyTorch's SGD (MindSpore `nn.SGD`) on flat buffers, then `acc = 0`. `stat` is 1 until the
/// first update, which sets `v = g`. (`1 - dampening` and Adam's `1 - beta` come computed in
/// f64, as the graphs' constants do: `1 - 0.999f32` is off by 1e-5 relative.)
#[cube(launch)]
pub fn sgd_clear<F: Float>(
    p: &mut Array<F>,
    acc: &mut Array<F>,
    v: &mut Array<F>,
    stat: &mut Array<F>,
    scale: f32,
    lr: f32,
    momentum: f32,
    one_minus_dampening: f32,
    weight_decay: f32,
    #[comptime] has_momentum: bool,
    #[comptime] nesterov: bool,
) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let w = p[i];
        let g = acc[i] * F::cast_from(scale) + F::cast_from(weight_decay) * w;
        let mut step = g;
        if has_momentum {
            let s = stat[i];
            let later = v[i] * F::cast_from(momentum) + g * F::cast_from(one_minus_dampening);
            let vn = s * g + (later - s * later);
            v[i] = vn;
            stat[i] = F::new(0.0);
            step = vn;
            if nesterov {
                step = g + vn * F::cast_from(momentum);
            }
        }
        p[i] = w - step * F::cast_from(lr);
        acc[i] = F::new(0.0);
    }
}

/// Adam / AdamW (MindSpore's formula: `eps` added to `sqrt(v)` before the bias correction) on
/// flat buffers, then `acc = 0`. `bc1`, `bc2` are `1 - beta^t`.
#[cube(launch)]
pub fn adam_clear<F: Float>(
    p: &mut Array<F>,
    acc: &mut Array<F>,
    m: &mut Array<F>,
    v: &mut Array<F>,
    scale: f32,
    lr: f32,
    bc1: f32,
    bc2: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    eps: f32,
    weight_decay: f32,
    #[comptime] decoupled: bool,
) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let w = p[i];
        let mut g = acc[i] * F::cast_from(scale);
        if !decoupled {
            g += F::cast_from(weight_decay) * w;
        }
        let mn = m[i] * F::cast_from(beta1) + g * F::cast_from(one_minus_beta1);
        let vn = v[i] * F::cast_from(beta2) + g * g * F::cast_from(one_minus_beta2);
        m[i] = mn;
        v[i] = vn;
        let corr = F::sqrt(F::cast_from(bc2)) / F::cast_from(bc1);
        let mut step = mn / (F::sqrt(vn) + F::cast_from(eps)) * corr;
        if decoupled {
            step += F::cast_from(weight_decay) * w;
        }
        p[i] = w - step * F::cast_from(lr);
        acc[i] = F::new(0.0);
    }
}

/// Launch geometry for `n` elements.
fn grid<R: CubeRuntime>(client: &ComputeClient<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, n);
    (calculate_cube_count_elemwise(client, n, dim), dim)
}

/// The tensor's buffer as a kernel array (the tensor must be contiguous).
fn arr<R: CubeRuntime>(t: &CubeTensor<R>) -> ArrayArg<R> {
    // SAFETY: `len` is the tensor's element count, which its handle holds.
    unsafe { ArrayArg::from_raw_parts(t.handle.clone(), t.meta.num_elements()) }
}

/// Launches one fused optimizer-and-clear kernel over flat buffers of equal length: `p`
/// parameters, `acc` accumulators, `state` the rule's state buffers in its order, `scalars`
/// the rule's scalar inputs (learning rate first). Returns the kernels launched (1).
pub fn launch_fused<R: CubeRuntime, F: FloatElement + Float>(
    rule: &FusedRule,
    p: &CubeTensor<R>,
    acc: &CubeTensor<R>,
    state: &[CubeTensor<R>],
    scale: f32,
    scalars: &[f32],
) -> usize {
    let n = p.meta.num_elements();
    let client = &p.client;
    let (count, dim) = grid(client, n);
    let lr = scalars[0];
    match *rule {
        FusedRule::Momentum { momentum, weight_decay, nesterov } => momentum_clear::launch::<F, R>(
            client,
            count,
            dim,
            arr(p),
            arr(acc),
            arr(&state[0]),
            scale,
            lr,
            momentum as f32,
            weight_decay as f32,
            nesterov,
        ),
        FusedRule::Sgd { momentum, dampening, weight_decay, nesterov } => sgd_clear::launch::<F, R>(
            client,
            count,
            dim,
            arr(p),
            arr(acc),
            arr(&state[0]),
            arr(&state[1]),
            scale,
            lr,
            momentum as f32,
            (1.0 - dampening) as f32,
            weight_decay as f32,
            momentum != 0.0,
            nesterov,
        ),
        FusedRule::Adam { beta1, beta2, eps, weight_decay, decoupled } => adam_clear::launch::<F, R>(
            client,
            count,
            dim,
            arr(p),
            arr(acc),
            arr(&state[0]),
            arr(&state[1]),
            scale,
            lr,
            scalars[1],
            scalars[2],
            beta1 as f32,
            beta2 as f32,
            (1.0 - beta1) as f32,
            (1.0 - beta2) as f32,
            eps as f32,
            weight_decay as f32,
            decoupled,
        ),
    }
    1
}

impl<R, F, I, BT> Backend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement + Float,
    I: IntElement,
    BT: BoolElement,
{
    fn flat_buffers() -> bool {
        F::dtype() == burn_backend::DType::F32
    }

    fn flat_view(buffer: &CubeTensor<R>, offset: usize, shape: &[usize]) -> Option<CubeTensor<R>> {
        let n: usize = shape.iter().product();
        let total = buffer.meta.num_elements();
        if offset % ALIGN != 0 || offset + n > total || !buffer.is_contiguous() {
            return None;
        }
        let size = buffer.dtype.size() as u64;
        let handle = buffer.handle.clone().offset_start(offset as u64 * size).offset_end((total - offset - n) as u64 * size);
        let shape = if shape.is_empty() { vec![1] } else { shape.to_vec() };
        Some(CubeTensor::new_contiguous(buffer.client.clone(), buffer.device.clone(), Shape::from(shape), handle, buffer.dtype))
    }

    fn assign_add_in_place(acc: &CubeTensor<R>, g: CubeTensor<R>) -> bool {
        if !acc.is_contiguous() || acc.meta.num_elements() != g.meta.num_elements() || acc.dtype != g.dtype {
            return false;
        }
        let g = burn_cubecl::kernel::into_contiguous(g);
        let n = acc.meta.num_elements();
        let (count, dim) = grid(&acc.client, n);
        assign_add::launch::<F, R>(&acc.client, count, dim, arr(acc), arr(&g));
        true
    }

    fn fused_update(rule: &FusedRule, p: &CubeTensor<R>, acc: &CubeTensor<R>, state: &[CubeTensor<R>], scale: f32, scalars: &[f32]) -> Option<usize> {
        Some(launch_fused::<R, F>(rule, p, acc, state, scale, scalars))
    }
}

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

use crate::backend::Backend;
use crate::kernel::{ConvKind, Native};
use cellgraph_compiler::TensorType;

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

use crate::backend::FLAT_ALIGN as ALIGN;

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


/// `c = op(a) @ op(b)` in exact f32 (one unit per output element; burn's f32 matmul on
/// tensor cores rounds its operands to TF32). `a` is `m x k` (`k x m` when `ta`), `b` is
/// `k x n` (`n x k` when `tb`), all row-major.
#[cube(launch)]
pub fn matmul<F: Float>(a: &Array<F>, b: &Array<F>, c: &mut Array<F>, m: u32, k: u32, n: u32, #[comptime] ta: bool, #[comptime] tb: bool) {
    let idx = ABSOLUTE_POS;
    if idx < c.len() {
        let (mm, kk, nn) = (m as usize, k as usize, n as usize);
        let i = idx / nn;
        let j = idx % nn;
        let mut acc = F::new(0.0);
        for p in 0..kk {
            let mut ai = i * kk + p;
            if ta {
                ai = p * mm + i;
            }
            let mut bi = p * nn + j;
            if tb {
                bi = j * kk + p;
            }
            acc += a[ai] * b[bi];
        }
        c[idx] = acc;
    }
}

/// Convolution geometry as kernel scalars: `[n, c, h, w, o, oh, ow, kh, kw, sh, sw, dh, dw,
/// pad_top, pad_left, groups]`.
#[derive(CubeLaunch, CubeType)]
pub struct ConvGeom {
    dims: Array<u32>,
}

/// Direct convolution: one unit per output element `y[n, o, oh, ow]`.
#[cube(launch)]
pub fn conv2d_forward<F: Float>(x: &Array<F>, w: &Array<F>, y: &mut Array<F>, g: &ConvGeom) {
    let idx = ABSOLUTE_POS;
    if idx < y.len() {
        let d = &g.dims;
        let (c, h, wi, o, oh, ow, kh, kw) = (d[1] as usize, d[2] as usize, d[3] as usize, d[4] as usize, d[5] as usize, d[6] as usize, d[7] as usize, d[8] as usize);
        let (sh, sw, dh, dw, pt, pl, groups) = (d[9] as i32, d[10] as i32, d[11] as i32, d[12] as i32, d[13] as i32, d[14] as i32, d[15] as usize);
        let ox = idx % ow;
        let oy = (idx / ow) % oh;
        let co = (idx / (ow * oh)) % o;
        let b = idx / (ow * oh * o);
        let cg = c / groups;
        let gi = co / (o / groups);
        let mut acc = F::new(0.0);
        for ci in 0..cg {
            for ky in 0..kh {
                let iy = oy as i32 * sh + ky as i32 * dh - pt;
                if iy >= 0 && iy < h as i32 {
                    for kx in 0..kw {
                        let ix = ox as i32 * sw + kx as i32 * dw - pl;
                        if ix >= 0 && ix < wi as i32 {
                            let xv = x[((b * c + gi * cg + ci) * h + iy as usize) * wi + ix as usize];
                            let wv = w[((co * cg + ci) * kh + ky) * kw + kx];
                            acc += xv * wv;
                        }
                    }
                }
            }
        }
        y[idx] = acc;
    }
}

/// Gradient w.r.t. the input: one unit per `dx[n, c, h, w]`.
#[cube(launch)]
pub fn conv2d_input_grad<F: Float>(dy: &Array<F>, w: &Array<F>, dx: &mut Array<F>, g: &ConvGeom) {
    let idx = ABSOLUTE_POS;
    if idx < dx.len() {
        let d = &g.dims;
        let (c, h, wi, o, oh, ow, kh, kw) = (d[1] as usize, d[2] as usize, d[3] as usize, d[4] as usize, d[5] as usize, d[6] as usize, d[7] as usize, d[8] as usize);
        let (sh, sw, dh, dw, pt, pl, groups) = (d[9] as i32, d[10] as i32, d[11] as i32, d[12] as i32, d[13] as i32, d[14] as i32, d[15] as usize);
        let ix = idx % wi;
        let iy = (idx / wi) % h;
        let ci = (idx / (wi * h)) % c;
        let b = idx / (wi * h * c);
        let cg = c / groups;
        let og = o / groups;
        let gi = ci / cg;
        let cl = ci % cg;
        let mut acc = F::new(0.0);
        for q in 0..og {
            let co = gi * og + q;
            for ky in 0..kh {
                let ty = iy as i32 + pt - ky as i32 * dh;
                if ty >= 0 && ty % sh == 0 && ty / sh < oh as i32 {
                    let oy = (ty / sh) as usize;
                    for kx in 0..kw {
                        let tx = ix as i32 + pl - kx as i32 * dw;
                        if tx >= 0 && tx % sw == 0 && tx / sw < ow as i32 {
                            let ox = (tx / sw) as usize;
                            let gv = dy[((b * o + co) * oh + oy) * ow + ox];
                            let wv = w[((co * cg + cl) * kh + ky) * kw + kx];
                            acc += gv * wv;
                        }
                    }
                }
            }
        }
        dx[idx] = acc;
    }
}

/// Gradient w.r.t. the filter: one unit per `dw[o, c / groups, kh, kw]`.
#[cube(launch)]
pub fn conv2d_filter_grad<F: Float>(x: &Array<F>, dy: &Array<F>, dw: &mut Array<F>, g: &ConvGeom) {
    let idx = ABSOLUTE_POS;
    if idx < dw.len() {
        let d = &g.dims;
        let (n, c, h, wi, o, oh, ow, kh, kw) = (d[0] as usize, d[1] as usize, d[2] as usize, d[3] as usize, d[4] as usize, d[5] as usize, d[6] as usize, d[7] as usize, d[8] as usize);
        let (sh, sw, dh, dwl, pt, pl, groups) = (d[9] as i32, d[10] as i32, d[11] as i32, d[12] as i32, d[13] as i32, d[14] as i32, d[15] as usize);
        let kx = idx % kw;
        let ky = (idx / kw) % kh;
        let cg = c / groups;
        let cl = (idx / (kw * kh)) % cg;
        let co = idx / (kw * kh * cg);
        let gi = co / (o / groups);
        let ci = gi * cg + cl;
        let mut acc = F::new(0.0);
        for b in 0..n {
            for oy in 0..oh {
                let iy = oy as i32 * sh + ky as i32 * dh - pt;
                if iy >= 0 && iy < h as i32 {
                    for ox in 0..ow {
                        let ix = ox as i32 * sw + kx as i32 * dwl - pl;
                        if ix >= 0 && ix < wi as i32 {
                            acc += x[((b * c + ci) * h + iy as usize) * wi + ix as usize] * dy[((b * o + co) * oh + oy) * ow + ox];
                        }
                    }
                }
            }
        }
        dw[idx] = acc;
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

    fn device_kernel(op: &Native, args: &[&CubeTensor<R>], out: &TensorType) -> Option<CubeTensor<R>> {
        if !matches!(op, Native::MatMul { .. } | Native::Conv { .. }) {
            return None;
        }
        if F::dtype() != burn_backend::DType::F32 || args.iter().any(|t| t.dtype != burn_backend::DType::F32) {
            return None;
        }
        let client = args[0].client.clone();
        let device = args[0].device.clone();
        let a = burn_cubecl::kernel::into_contiguous(args[0].clone());
        let b = burn_cubecl::kernel::into_contiguous(args[1].clone());
        let numel = out.numel().max(1);
        let handle = client.empty(numel * core::mem::size_of::<f32>());
        let dims = if out.dims().is_empty() { vec![1] } else { out.dims().to_vec() };
        let y = CubeTensor::new_contiguous(client.clone(), device, Shape::from(dims), handle, burn_backend::DType::F32);
        let (count, dim) = grid(&client, numel);
        match *op {
            Native::MatMul { m, k, n, transpose_a, transpose_b } => {
                matmul::launch::<F, R>(&client, count, dim, arr(&a), arr(&b), arr(&y), m as u32, k as u32, n as u32, transpose_a, transpose_b)
            }
            Native::Conv { kind, g, groups, out_channels, .. } => {
                let v: Vec<u32> = [
                    g.x[0], g.x[1], g.x[2], g.x[3], out_channels, g.out[0], g.out[1], g.kernel[0], g.kernel[1],
                    g.stride[0], g.stride[1], g.dilation[0], g.dilation[1], g.pad[0], g.pad[1], groups,
                ]
                .iter()
                .map(|&d| d as u32)
                .collect();
                let gh = client.create_from_slice(u32::as_bytes(&v));
                // SAFETY: 16 u32 in the handle.
                let geom = ConvGeomLaunch::new(unsafe { ArrayArg::from_raw_parts(gh, v.len()) });
                match kind {
                    ConvKind::Forward => conv2d_forward::launch::<F, R>(&client, count, dim, arr(&a), arr(&b), arr(&y), geom),
                    ConvKind::InputGrad => conv2d_input_grad::launch::<F, R>(&client, count, dim, arr(&a), arr(&b), arr(&y), geom),
                    // The op's operands are (dy, x).
                    ConvKind::FilterGrad => conv2d_filter_grad::launch::<F, R>(&client, count, dim, arr(&b), arr(&a), arr(&y), geom),
                }
            }
            Native::MaxPool { .. } | Native::MaxPoolGrad { .. } | Native::Relu | Native::ReluGrad | Native::Fused(_) | Native::SumRows { .. } => unreachable!("checked above"),
        }
        Some(y)
    }

    fn fused_update(rule: &FusedRule, p: &CubeTensor<R>, acc: &CubeTensor<R>, state: &[CubeTensor<R>], scale: f32, scalars: &[f32]) -> Option<usize> {
        Some(launch_fused::<R, F>(rule, p, acc, state, scale, scalars))
    }
}

//! Device backends on cubecl: burn's cubecl backend drives the executor, and the runtime's own
//! `#[cube]` kernels do what burn's ops cannot do in one launch.
//!
//! - [`assign_add`]: `acc += g` in place, into an accumulator that is a view of one flat
//!   accumulator buffer (burn's `add` would allocate a new tensor and break the aliasing).
//! - [`update_clear`]: the whole boundary of a window, the optimizer update of every parameter
//!   and the clearing of every accumulator, as one launch over flat parameter / accumulator /
//!   state buffers; the optimizer's `Update` program (the one its graph comes from) is
//!   unrolled into the kernel when it is compiled.
//!
//! The kernels are generic over cubecl runtimes: CUDA on an NVIDIA GPU (feature `cuda`), and
//! wgpu (feature `wgpu`), which runs on Mesa's lavapipe CPU Vulkan driver in CI, where the
//! tests check them against the CPU reference (the optimizer graphs run on burn-ndarray).

use burn_backend::Shape;
use burn_cubecl::element::{BoolElement, FloatElement, IntElement};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use cellgraph_compiler::expr::{Binary, Unary};
use cellgraph_compiler::update::Target;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

use crate::backend::Backend;
use crate::kernel::{ConvKind, KStep, KVal, Native, UpdateKernel};
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

/// The value `v` at element `i`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn kval<F: Float>(w: F, g: F, s0: &Array<F>, s1: &Array<F>, consts: &Array<F>, lets: &Sequence<F>, i: usize, #[comptime] v: KVal) -> F {
    match comptime!(v) {
        KVal::Param => w,
        KVal::Grad => g,
        KVal::State(k) => {
            if comptime!(k == 0) {
                s0[i]
            } else {
                s1[i]
            }
        }
        KVal::Const(k) => consts[k as usize],
        KVal::Let(k) => *lets.index(k as usize),
    }
}

/// One optimizer's `Update` over flat buffers, interpreted when the kernel is compiled
/// (every step becomes straight-line code), then `acc = 0`: `g = acc * scale` and the
/// program's steps in order. `s0`, `s1` are the state buffers the program uses (any buffer
/// where it keeps fewer); `consts` the scalar inputs, then the literals.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn update_clear<F: Float>(
    p: &mut Array<F>,
    acc: &mut Array<F>,
    s0: &mut Array<F>,
    s1: &mut Array<F>,
    consts: &Array<F>,
    scale: f32,
    #[comptime] prog: UpdateKernel,
) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let w = p[i];
        let g = acc[i] * F::cast_from(scale);
        let mut lets = Sequence::<F>::new();
        let n = comptime!(prog.steps.len());
        #[unroll]
        for k in 0..n {
            let step = comptime!(prog.steps[k]);
            match comptime!(step) {
                KStep::Unary(op, x) => {
                    let x = kval(w, g, s0, s1, consts, &lets, i, x);
                    let y = match comptime!(op) {
                        Unary::Neg => -x,
                        Unary::Exp => F::exp(x),
                        Unary::Log => F::ln(x),
                        Unary::Relu => select(x > F::new(0.0), x, F::new(0.0)),
                        Unary::Sqrt => F::sqrt(x),
                    };
                    lets.push(y);
                }
                KStep::Binary(op, a, b) => {
                    let a = kval(w, g, s0, s1, consts, &lets, i, a);
                    let b = kval(w, g, s0, s1, consts, &lets, i, b);
                    let y = match comptime!(op) {
                        Binary::Add => a + b,
                        Binary::Sub => a - b,
                        Binary::Mul => a * b,
                        Binary::Div => a / b,
                        Binary::ReluGrad => select(b > F::new(0.0), a, F::new(0.0)),
                    };
                    lets.push(y);
                }
                KStep::Write(t, x) => {
                    let x = kval(w, g, s0, s1, consts, &lets, i, x);
                    match comptime!(t) {
                        Target::Param => p[i] = x,
                        Target::State(k) => {
                            if comptime!(k == 0) {
                                s0[i] = x;
                            } else {
                                s1[i] = x;
                            }
                        }
                    }
                    lets.push(F::new(0.0));
                }
            }
        }
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

/// Launches one optimizer-and-clear kernel ([`update_clear`]) over flat buffers of equal
/// length: `p` parameters, `acc` accumulators, `state` the rule's state buffers in its order,
/// `consts` its scalar inputs (learning rate first) then its program's literals. Returns the
/// kernels launched (1).
pub fn launch_update<R: CubeRuntime, F: FloatElement + Float>(
    prog: &UpdateKernel,
    p: &CubeTensor<R>,
    acc: &CubeTensor<R>,
    state: &[CubeTensor<R>],
    scale: f32,
    consts: &[f32],
) -> usize {
    let n = p.meta.num_elements();
    let client = &p.client;
    let (count, dim) = grid(client, n);
    // Unused state slots get a one-element buffer the program never touches.
    let spare = || CubeTensor::new_contiguous(client.clone(), p.device.clone(), Shape::from(vec![1]), client.empty(4), p.dtype);
    let s0 = state.first().cloned().unwrap_or_else(spare);
    let s1 = state.get(1).cloned().unwrap_or_else(spare);
    let c = client.create_from_slice(f32::as_bytes(consts));
    // SAFETY: `consts.len()` f32 in the handle.
    let c = unsafe { ArrayArg::from_raw_parts(c, consts.len().max(1)) };
    update_clear::launch::<F, R>(client, count, dim, arr(p), arr(acc), arr(&s0), arr(&s1), c, scale, prog.clone());
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
            Native::MaxPool { .. } | Native::MaxPoolGrad { .. } | Native::Fill(_) | Native::Relu | Native::ReluGrad | Native::Fused(_) | Native::SumRows { .. } | Native::SoftmaxCrossEntropy { .. } | Native::Epilogue { .. } => unreachable!("checked above"),
        }
        Some(y)
    }

    fn fused_update(prog: &UpdateKernel, p: &CubeTensor<R>, acc: &CubeTensor<R>, state: &[CubeTensor<R>], scale: f32, consts: &[f32]) -> Option<usize> {
        Some(launch_update::<R, F>(prog, p, acc, state, scale, consts))
    }
}

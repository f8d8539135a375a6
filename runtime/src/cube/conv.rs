//! Convolutions on the device: the direct forward with its epilogue, the input gradient, and
//! the filter gradient split over its output positions, each with the geometry as
//! compile-time constants ([`ConvDims`]).

use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::ew::{self, EwKernel};
use super::sums::sum_rows;
use super::{arr, empty, grid};
use crate::arena::Arena;
use crate::kernel::{ConvKind, Geometry};

/// A convolution's geometry as its kernels' compile-time constants: one kernel per shape, so
/// nothing is uploaded per call and the index arithmetic folds. `[pt, pl]`: top and left
/// padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvDims {
    pub n: u32,
    pub c: u32,
    pub h: u32,
    pub w: u32,
    pub o: u32,
    pub oh: u32,
    pub ow: u32,
    pub kh: u32,
    pub kw: u32,
    pub sh: u32,
    pub sw: u32,
    pub dh: u32,
    pub dw: u32,
    pub pt: u32,
    pub pl: u32,
    pub groups: u32,
}

impl ConvDims {
    pub(super) fn of(g: &crate::kernel::Geometry, groups: usize, out_channels: usize) -> ConvDims {
        let u = |v: usize| v as u32;
        ConvDims {
            n: u(g.x[0]),
            c: u(g.x[1]),
            h: u(g.x[2]),
            w: u(g.x[3]),
            o: u(out_channels),
            oh: u(g.out[0]),
            ow: u(g.out[1]),
            kh: u(g.kernel[0]),
            kw: u(g.kernel[1]),
            sh: u(g.stride[0]),
            sw: u(g.stride[1]),
            dh: u(g.dilation[0]),
            dw: u(g.dilation[1]),
            pt: u(g.pad[0]),
            pl: u(g.pad[1]),
            groups: u(groups),
        }
    }
    /// `(kh, kw, sh, sw, dh, dw, pt, pl)`: the window's extents as indices, its stride,
    /// dilation and top-left padding as signed offsets (what every window loop reads).
    #[allow(clippy::type_complexity)]
    pub(crate) fn window(&self) -> (usize, usize, i32, i32, i32, i32, i32, i32) {
        let i = |v: u32| v as i32;
        (self.kh as usize, self.kw as usize, i(self.sh), i(self.sw), i(self.dh), i(self.dw), i(self.pt), i(self.pl))
    }
    /// Elements of the filter (and of its gradient).
    pub(super) fn filter_len(&self) -> usize {
        (self.o * (self.c / self.groups) * self.kh * self.kw) as usize
    }
    /// Output positions `n * oh * ow`: the filter gradient's inner extent.
    fn positions(&self) -> usize {
        (self.n * self.oh * self.ow) as usize
    }
}

/// Direct convolution: one unit per output element `y[n, o, oh, ow]`, stored through the
/// epilogue `post` (its operands after the first in `x1`..; [`EwKernel::identity`] for none).
/// `x` and `w` are f32 or the bf16 / f16 a session stores them in (`_x_type`, `_w_type`,
/// given at the launch: widened as they are read), as are the gradients' operands below; `y`
/// is f32, or bf16 / f16 when the epilogue rounds to it (`_out_type`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn conv2d_forward<F: Float, X: Float, W: Float, Y: Float>(
    x: &[X],
    w: &[W],
    y: &mut [Y],
    x1: &[F],
    x2: &[F],
    x3: &[F],
    #[comptime] g: ConvDims,
    #[comptime] post: EwKernel,
    #[define(X)] _x_type: ElemType,
    #[define(W)] _w_type: ElemType,
    #[define(Y)] _out_type: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx < y.len() {
        let (c, h, wi, o, oh, ow) = comptime!((g.c as usize, g.h as i32, g.w as i32, g.o as usize, g.oh as usize, g.ow as usize));
        let (kh, kw, sh, sw, dh, dw, pt, pl) = comptime!(g.window());
        let (cg, og) = comptime!(((g.c / g.groups) as usize, (g.o / g.groups) as usize));
        let ox = idx % ow;
        let oy = (idx / ow) % oh;
        let co = (idx / (ow * oh)) % o;
        let b = idx / (ow * oh * o);
        let gi = co / og;
        let mut acc = F::new(0.0);
        for ci in 0..cg {
            for ky in 0..kh {
                let iy = oy as i32 * sh + ky as i32 * dh - pt;
                if iy >= 0 && iy < h {
                    for kx in 0..kw {
                        let ix = ox as i32 * sw + kx as i32 * dw - pl;
                        if ix >= 0 && ix < wi {
                            let xv = F::cast_from(x[((b * c + gi * cg + ci) * (h as usize) + iy as usize) * (wi as usize) + ix as usize]);
                            let wv = F::cast_from(w[((co * cg + ci) * kh + ky) * kw + kx]);
                            acc += xv * wv;
                        }
                    }
                }
            }
        }
        y[idx] = Y::cast_from(ew::apply::<F>(acc, x1, x2, x3, idx, post));
    }
}

/// Gradient w.r.t. the input: one unit per `dx[n, c, h, w]`.
#[cube(launch_unchecked)]
pub fn conv2d_input_grad<F: Float, G: Float, W: Float>(
    dy: &[G],
    w: &[W],
    dx: &mut [F],
    #[comptime] g: ConvDims,
    #[define(G)] _dy_type: ElemType,
    #[define(W)] _w_type: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx < dx.len() {
        let (c, h, wi, o, oh, ow) = comptime!((g.c as usize, g.h as usize, g.w as usize, g.o as usize, g.oh as i32, g.ow as i32));
        let (kh, kw, sh, sw, dh, dw, pt, pl) = comptime!(g.window());
        let (cg, og) = comptime!(((g.c / g.groups) as usize, (g.o / g.groups) as usize));
        let ix = idx % wi;
        let iy = (idx / wi) % h;
        let ci = (idx / (wi * h)) % c;
        let b = idx / (wi * h * c);
        let gi = ci / cg;
        let cl = ci % cg;
        let mut acc = F::new(0.0);
        for q in 0..og {
            let co = gi * og + q;
            for ky in 0..kh {
                let ty = iy as i32 + pt - ky as i32 * dh;
                if ty >= 0 && ty % sh == 0 && ty / sh < oh {
                    let oy = (ty / sh) as usize;
                    for kx in 0..kw {
                        let tx = ix as i32 + pl - kx as i32 * dw;
                        if tx >= 0 && tx % sw == 0 && tx / sw < ow {
                            let ox = (tx / sw) as usize;
                            let gv = F::cast_from(dy[((b * o + co) * (oh as usize) + oy) * (ow as usize) + ox]);
                            let wv = F::cast_from(w[((co * cg + cl) * kh + ky) * kw + kx]);
                            acc += gv * wv;
                        }
                    }
                }
            }
        }
        dx[idx] = acc;
    }
}

/// Gradient w.r.t. the filter, split over its inner extent (the `n * oh * ow` output
/// positions): `part[s, e]` is filter element `e`'s sum over positions `s * per ..
/// (s + 1) * per`. With one slice `part` is the gradient; otherwise [`sum_rows`] adds the
/// slices in order (a fixed order: the same bits on every run).
#[cube(launch_unchecked)]
pub fn conv2d_filter_grad<F: Float, X: Float, G: Float>(
    x: &[X],
    dy: &[G],
    part: &mut [F],
    #[comptime] g: ConvDims,
    #[comptime] per: u32,
    #[define(X)] _x_type: ElemType,
    #[define(G)] _dy_type: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx < part.len() {
        let (c, h, wi, o, oh, ow) = comptime!((g.c as usize, g.h as i32, g.w as i32, g.o as usize, g.oh as usize, g.ow as usize));
        let (kh, kw, sh, sw, dh, dw, pt, pl) = comptime!(g.window());
        let (cg, og, len, total, per) =
            comptime!(((g.c / g.groups) as usize, (g.o / g.groups) as usize, g.filter_len(), g.positions(), per as usize));
        let e = idx % len;
        let s = idx / len;
        let kx = e % kw;
        let ky = (e / kw) % kh;
        let cl = (e / (kw * kh)) % cg;
        let co = e / (kw * kh * cg);
        let ci = (co / og) * cg + cl;
        let start = s * per;
        let mut end = start + per;
        if end > total {
            end = total;
        }
        let mut acc = F::new(0.0);
        for p in start..end {
            let ox = p % ow;
            let oy = (p / ow) % oh;
            let b = p / (ow * oh);
            let iy = oy as i32 * sh + ky as i32 * dh - pt;
            let ix = ox as i32 * sw + kx as i32 * dw - pl;
            if iy >= 0 && iy < h && ix >= 0 && ix < wi {
                acc += F::cast_from(x[((b * c + ci) * (h as usize) + iy as usize) * (wi as usize) + ix as usize])
                    * F::cast_from(dy[((b * o + co) * oh + oy) * ow + ox]);
            }
        }
        part[idx] = acc;
    }
}

/// Slices of the filter gradient's inner extent and positions per slice: about 64K units in
/// all, each summing at least 32 positions.
fn filter_grad_split(g: &ConvDims) -> (usize, usize) {
    let (len, total) = (g.filter_len().max(1), g.positions().max(1));
    let slices = (65_536usize.div_ceil(len)).min(total.div_ceil(32)).max(1);
    let per = total.div_ceil(slices);
    (total.div_ceil(per), per)
}

/// The filter gradient of `(dy, x)` into `y` (added into it with `accumulate`, in
/// `assign_add`'s order): split over its output positions ([`filter_grad_split`]), the slices
/// summed in order by [`sum_rows`]; one slice without accumulation is written straight to `y`.
pub(super) fn filter_grad<R: CubeRuntime>(
    dims: &ConvDims,
    dy: &CubeTensor<R>,
    x: &CubeTensor<R>,
    y: &CubeTensor<R>,
    accumulate: bool,
    arena: &mut Arena,
) {
    let client = &y.client;
    let numel = dims.filter_len();
    let (slices, per) = filter_grad_split(dims);
    let (count, dim) = grid(client, numel);
    let ty = |t: &CubeTensor<R>| burn_backend::cubecl::dtype_to_storage_type(t.dtype);
    // SAFETY: as in `head_kernel`; `y` holds exactly the filter's elements.
    unsafe {
        if slices == 1 && !accumulate {
            conv2d_filter_grad::launch_unchecked::<f32, R>(client, count, dim, arr(x), arr(dy), arr(y), *dims, per as u32, ty(x), ty(dy));
        } else {
            // The slices in the arena's scratch buffer of their length (launches run in order,
            // so the next user of the buffer writes it after the sum has read it).
            let part = arena.take_scratch::<CubeTensor<R>>(slices * numel).unwrap_or_else(|| empty::<R>(client, &y.device, &[slices, numel]));
            let (pc, pd) = grid(client, slices * numel);
            conv2d_filter_grad::launch_unchecked::<f32, R>(client, pc, pd, arr(x), arr(dy), arr(&part), *dims, per as u32, ty(x), ty(dy));
            let f32s = burn_backend::cubecl::dtype_to_storage_type(burn_backend::DType::F32);
            sum_rows::launch_unchecked::<R>(client, count, dim, arr(&part), arr(y), slices as u32, accumulate, None, f32s, f32s);
            arena.give_scratch(slices * numel, part);
        }
    }
}

/// The convolutions (per runtime, direction, geometry and output channels) whose tensor-core
/// routine did not set up: the exact kernels run them without trying again (as `gemm`'s
/// `TENSOR_CORES` does for matmuls).
type TcKey = (std::any::TypeId, ConvKind, Geometry, usize);
static NO_TENSOR_CORES: std::sync::Mutex<std::collections::BTreeSet<TcKey>> = std::sync::Mutex::new(std::collections::BTreeSet::new());

fn key<R: CubeRuntime>(kind: ConvKind, g: &Geometry, out_channels: usize) -> TcKey {
    (std::any::TypeId::of::<R>(), kind, *g, out_channels)
}

/// Convolutions asked for tensor cores that ran on the exact kernels (see [`conv_tf32_fallbacks`]).
static CONV_FALLBACKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many convolutions asked for tensor cores ([`crate::Session::set_tf32`], or bf16
/// values' products) whose geometry cubek's implicit GEMM takes ran on the exact kernels in
/// this process, because its routine does not set up on the device (part of
/// [`super::tf32_fallbacks`]).
pub fn conv_tf32_fallbacks() -> u64 {
    CONV_FALLBACKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// True when a convolution asked for tensor cores (`tf32`) runs on [`tensor_core_conv`]: cubek's
/// implicit GEMM takes its geometry ([`Geometry::implicit_gemm_declines`]) and its routine has
/// not failed to set up for it on this runtime (such a refusal is counted here: the caller
/// runs the exact kernels).
pub(super) fn on_tensor_cores<R: CubeRuntime>(kind: ConvKind, g: &Geometry, groups: usize, out_channels: usize, tf32: bool) -> bool {
    if !tf32 || g.implicit_gemm_declines(kind, groups).is_some() {
        return false;
    }
    let refused = NO_TENSOR_CORES.lock().unwrap_or_else(|e| e.into_inner()).contains(&key::<R>(kind, g, out_channels));
    if refused {
        CONV_FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    !refused
}

/// A convolution in direction `kind` on cubek's implicit-GEMM routine (through burn-cubecl:
/// NHWC views of the NCHW operands, the routine's CMMA tiles on TF32 operands with f32 sums),
/// its result contiguous NCHW: the forward of `(x, w)`, the input gradient of `(dy, w)` (at
/// stride > 1 as [`input_grad_by_upsampling`]), the filter gradient of `(dy, x)`. A bf16
/// value is a TF32 value, so for operands the precision pass rounded to bf16 these are bf16
/// tensor cores' products. `None` where the routine does not set up on this device (lavapipe
/// has no tensor cores): counted in [`conv_tf32_fallbacks`], and not tried again (the exact
/// kernels run it). The caller checked [`on_tensor_cores`].
pub(super) fn tensor_core_conv<R: CubeRuntime>(
    kind: ConvKind,
    g: &Geometry,
    out_channels: usize,
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    let done = match kind {
        ConvKind::InputGrad if g.stride != [1, 1] => input_grad_by_upsampling::<R>(g, out_channels, a, b, true),
        _ => implicit_gemm::<R>(kind, g, out_channels, a, b),
    };
    if done.is_none() {
        NO_TENSOR_CORES.lock().unwrap_or_else(|e| e.into_inner()).insert(key::<R>(kind, g, out_channels));
        CONV_FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    done
}

/// [`tensor_core_conv`] on burn-cubecl's implicit-GEMM entry points, neither counting nor
/// remembering a routine that does not set up (`None`, having launched nothing).
fn implicit_gemm<R: CubeRuntime>(kind: ConvKind, g: &Geometry, out_channels: usize, a: &CubeTensor<R>, b: &CubeTensor<R>) -> Option<CubeTensor<R>> {
    use burn_backend::ops::ConvOptions;
    use burn_backend::{DType, Shape};
    use burn_cubecl::kernel::conv::{conv_data_backward, conv_forward, conv_weight_backward, ConvStrategy};
    let options = ConvOptions::new(g.stride, g.pad, g.dilation, 1);
    let [n, c, h, w] = g.x;
    let [oh, ow] = g.out;
    let filter = [out_channels, c, g.kernel[0], g.kernel[1]];
    let as4 = |t: &CubeTensor<R>, dims: [usize; 4]| {
        CubeTensor::new_contiguous(t.client.clone(), t.device.clone(), Shape::from(dims.to_vec()), t.handle.clone(), DType::F32)
    };
    let dy = [n, out_channels, oh, ow];
    let done = match kind {
        ConvKind::Forward => conv_forward::<R, 2>(as4(a, g.x), as4(b, filter), None, options, ConvStrategy::ImplicitGemm),
        ConvKind::InputGrad => {
            conv_data_backward::<R, 2>(as4(a, dy), as4(b, filter), Shape::from(vec![n, c, h, w]), options, ConvStrategy::ImplicitGemm)
        }
        ConvKind::FilterGrad => {
            conv_weight_backward::<R, 2>(as4(b, g.x), as4(a, dy), Shape::from(filter.to_vec()), options, ConvStrategy::ImplicitGemm)
        }
    };
    match done {
        Ok(t) => Some(burn_cubecl::kernel::into_contiguous(t)),
        Err(e) => {
            super::note_refusal("convolution", format_args!("{kind:?} of {:?} by {filter:?}: {e:?}", g.x));
            None
        }
    }
}

/// `u[n, o, a, b]`: `dy[n, o, a / sh, b / sw]` where both divide, else 0 (`u` of
/// [`Geometry::upsampled`]'s input extents).
#[cube(launch_unchecked)]
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` has no kernel expansion
pub fn spread_by_stride<F: Float>(dy: &[F], u: &mut [F], #[comptime] g: ConvDims, #[comptime] spread: [u32; 2]) {
    let idx = ABSOLUTE_POS;
    if idx < u.len() {
        let (oh, ow, sh, sw, uh, uw) =
            comptime!((g.oh as usize, g.ow as usize, g.sh as usize, g.sw as usize, spread[0] as usize, spread[1] as usize));
        let b = idx % uw;
        let a = (idx / uw) % uh;
        let plane = idx / (uw * uh);
        let mut v = F::new(0.0);
        if a % sh == 0 && b % sw == 0 && a / sh < oh && b / sw < ow {
            v = dy[(plane * oh + a / sh) * ow + b / sw];
        }
        u[idx] = v;
    }
}

/// `w2[c, o, ky, kx] = w[o, c, kh - 1 - ky, kw - 1 - kx]`: a filter of one group flipped, its
/// channel axes swapped.
#[cube(launch_unchecked)]
pub fn flip_filter<F: Float>(w: &[F], w2: &mut [F], #[comptime] g: ConvDims) {
    let idx = ABSOLUTE_POS;
    if idx < w2.len() {
        let (c, o, kh, kw) = comptime!((g.c as usize, g.o as usize, g.kh as usize, g.kw as usize));
        let kx = idx % kw;
        let ky = (idx / kw) % kh;
        let oi = (idx / (kw * kh)) % o;
        let ci = idx / (kw * kh * o);
        w2[idx] = w[((oi * c + ci) * kh + (kh - 1 - ky)) * kw + (kw - 1 - kx)];
    }
}

/// The input gradient of a convolution of one group and geometry `g` (stride > 1: cubek's
/// input-gradient routine takes stride 1 only) from `(dy, w)`, as the stride-1 forward
/// convolution of [`Geometry::upsampled`] (a launch spreading `dy`, one flipping the filter,
/// then the forward): on cubek's implicit GEMM with `tensor_cores` (three quarters of its
/// products are of zeros at stride 2, on units many times the exact kernels' rate), else on
/// [`conv2d_forward`] (what the tests check the construction with). `None` when the
/// geometry has no such form (having launched nothing) or, with `tensor_cores`, the routine
/// does not set up.
pub fn input_grad_by_upsampling<R: CubeRuntime>(
    g: &Geometry,
    out_channels: usize,
    dy: &CubeTensor<R>,
    w: &CubeTensor<R>,
    tensor_cores: bool,
) -> Option<CubeTensor<R>> {
    let up = g.upsampled(out_channels)?;
    let (client, device) = (&dy.client, &dy.device);
    let dims = ConvDims::of(g, 1, out_channels);
    let u = empty::<R>(client, device, &up.x);
    let w2 = empty::<R>(client, device, &[g.x[1], out_channels, g.kernel[0], g.kernel[1]]);
    let spread = [up.x[2] as u32, up.x[3] as u32];
    // SAFETY: one unit per element of `u` and of `w2`, reading `dy` and `w` inside their
    // extents (`a / sh < oh`, `b / sw < ow`; the filter's own indices).
    unsafe {
        let (count, dim) = grid(client, u.meta.num_elements());
        spread_by_stride::launch_unchecked::<f32, R>(client, count, dim, arr(dy), arr(&u), dims, spread);
        let (count, dim) = grid(client, w2.meta.num_elements());
        flip_filter::launch_unchecked::<f32, R>(client, count, dim, arr(w), arr(&w2), dims);
    }
    if tensor_cores {
        return implicit_gemm::<R>(ConvKind::Forward, &up, g.x[1], &u, &w2);
    }
    let dx = empty::<R>(client, device, &g.x);
    let (count, dim) = grid(client, dx.meta.num_elements());
    let id = EwKernel::identity();
    // SAFETY: as in `head_kernel`: one unit per element of `dx`, the forward's geometry `up`.
    unsafe {
        conv2d_forward::launch_unchecked::<f32, R>(
            client,
            count,
            dim,
            arr(&u),
            arr(&w2),
            arr(&dx),
            arr(&u),
            arr(&u),
            arr(&u),
            ConvDims::of(&up, 1, g.x[1]),
            id,
            burn_backend::cubecl::dtype_to_storage_type(u.dtype),
            burn_backend::cubecl::dtype_to_storage_type(w2.dtype),
            burn_backend::cubecl::dtype_to_storage_type(dx.dtype),
        )
    };
    Some(dx)
}

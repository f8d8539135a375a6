//! The runtime's backend interface, and native kernels for backends that keep tensors in
//! host memory.
//!
//! [`Backend`] extends burn's backend trait with a view of a float tensor's host memory (when
//! it has any), building a tensor from host data, flat buffers and device kernels. When a plan
//! is compiled, [`bind`] chooses each hot op's kernel (matrix products, convolutions and their
//! gradients, max pooling and its gradient, ReLU's gradient) with every extent resolved; a
//! max pool whose gradient is in the same plan keeps its argmax for it ([`Kept`]). On a host
//! backend (burn-ndarray) the bound kernels run on the slice kernels in [`kernels`]; on a
//! device backend matrix products and convolutions run on its own kernels and the rest on
//! burn's ops.

pub mod kernels;

use std::borrow::Cow;

use burn_backend::tensor::{Device, FloatTensor};
use burn_backend::TensorData;
use burn_ndarray::{FloatNdArrayElement, NdArray, NdArrayTensor};
use cellgraph_compiler::update::FusedRule;
use cellgraph_compiler::{window, Op, TensorType};

use kernels::{Geometry, HostFloat, Mat};

/// A float tensor's contents on the host, in row-major order.
pub enum HostSlice<'a> {
    F32(Cow<'a, [f32]>),
    F64(Cow<'a, [f64]>),
}

/// Host data for a new float tensor.
pub enum HostVec {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Offsets of per-parameter views into flat device buffers are multiples of this many
/// elements (256 bytes of f32: wgpu's storage-buffer offset alignment, aligned vector loads).
pub const FLAT_ALIGN: usize = 64;

/// A burn backend as the runtime drives it.
pub trait Backend: burn_backend::Backend {
    /// True when tensors live in host memory ([`Self::host_slice`] always answers): plans then
    /// run their bound kernels on [`kernels`]; otherwise on [`Self::device_kernel`].
    const HOST: bool = false;

    /// The tensor's contents when the backend keeps them in host memory (no copy when the
    /// layout is already row-major); `None` for device backends.
    fn host_slice(_t: &FloatTensor<Self>) -> Option<HostSlice<'_>> {
        None
    }

    /// True when the backend keeps parameters, accumulators and optimizer state in flat
    /// device buffers with per-parameter views ([`Self::flat_view`]), accumulates in place
    /// ([`Self::assign_add_in_place`]) and runs a boundary as one fused kernel
    /// ([`Self::fused_update`]). Host backends run the graphs instead.
    fn flat_buffers() -> bool {
        false
    }

    /// A tensor of extents `shape` sharing `buffer`'s memory from element `offset` (a
    /// multiple of the backend's alignment); `None` when the backend has no such views.
    fn flat_view(_buffer: &FloatTensor<Self>, _offset: usize, _shape: &[usize]) -> Option<FloatTensor<Self>> {
        None
    }

    /// `acc += g`, written into `acc`'s memory; false when the backend cannot (the caller
    /// then adds out of place).
    fn assign_add_in_place(_acc: &FloatTensor<Self>, _g: FloatTensor<Self>) -> bool {
        false
    }

    /// One kernel over flat buffers: the optimizer update of every parameter from
    /// `acc * scale`, then `acc = 0`. Returns the kernels launched, or `None` when the backend
    /// has no fused kernels.
    fn fused_update(
        _rule: &FusedRule,
        _params: &FloatTensor<Self>,
        _acc: &FloatTensor<Self>,
        _state: &[FloatTensor<Self>],
        _scale: f32,
        _scalars: &[f32],
    ) -> Option<usize> {
        None
    }

    /// Runs a matmul or convolution (see [`bind`]) on the backend's own kernels, when
    /// it has them (device backends: exact f32, where burn's would use TF32 tensor cores).
    fn device_kernel(_op: &Native, _args: &[&FloatTensor<Self>], _out: &TensorType) -> Option<FloatTensor<Self>> {
        None
    }

    /// A float tensor of extents `shape` holding `data`.
    fn from_host_vec(data: HostVec, shape: &[usize], device: &Device<Self>) -> FloatTensor<Self> {
        let shape = crate::lower::bshape(shape);
        let data = match data {
            HostVec::F32(v) => TensorData::new(v, shape),
            HostVec::F64(v) => TensorData::new(v, shape),
        };
        Self::float_from_data(data.convert::<Self::FloatElem>(), device)
    }
}

impl<E: FloatNdArrayElement> Backend for NdArray<E>
where
    NdArrayTensor: From<ndarray::ArcArray<E, ndarray::IxDyn>>,
{
    const HOST: bool = true;

    fn host_slice(t: &NdArrayTensor) -> Option<HostSlice<'_>> {
        fn cow<T: Clone>(v: ndarray::ArrayViewD<'_, T>) -> Cow<'_, [T]> {
            match v.to_slice() {
                Some(s) => Cow::Borrowed(s),
                None => Cow::Owned(v.iter().cloned().collect()),
            }
        }
        match t {
            NdArrayTensor::F32(s) => Some(HostSlice::F32(cow(s.view()))),
            NdArrayTensor::F64(s) => Some(HostSlice::F64(cow(s.view()))),
            _ => None,
        }
    }

    fn from_host_vec(data: HostVec, shape: &[usize], _device: &Device<Self>) -> NdArrayTensor {
        let dims = ndarray::IxDyn(if shape.is_empty() { &[1] } else { shape });
        match data {
            HostVec::F32(v) => ndarray::ArcArray::from_shape_vec(dims, v).expect("extents match the data").into(),
            HostVec::F64(v) => ndarray::ArcArray::from_shape_vec(dims, v).expect("extents match the data").into(),
        }
    }
}

/// The element types the kernels run in, tied to their [`HostSlice`]/[`HostVec`] variants.
trait Elem: HostFloat {
    fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [Self]>;
    fn wrap(v: Vec<Self>) -> HostVec;
}

impl Elem for f32 {
    fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [f32]> {
        match s {
            HostSlice::F32(v) => Some(v),
            HostSlice::F64(_) => None,
        }
    }
    fn wrap(v: Vec<f32>) -> HostVec {
        HostVec::F32(v)
    }
}

impl Elem for f64 {
    fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [f64]> {
        match s {
            HostSlice::F64(v) => Some(v),
            HostSlice::F32(_) => None,
        }
    }
    fn wrap(v: Vec<f64>) -> HostVec {
        HostVec::F64(v)
    }
}

fn geometry(x: &[usize], kernel: [usize; 2], stride: [usize; 2], dilation: [usize; 2], w: &window::Window) -> Geometry {
    Geometry { x: [x[0], x[1], x[2], x[3]], kernel, stride, dilation, pad: [w.pad[0], w.pad[2]], out: w.out }
}

/// Per-session host state the kernels keep between steps of a run: the argmax of each max
/// pool whose gradient is later in the same plan ([`Native::MaxPool`]'s `keep`), stamped with
/// the run that wrote it (a gradient only trusts its own run's argmax).
#[derive(Default)]
pub struct Kept {
    run: u64,
    argmax: Vec<(u64, Vec<u32>)>,
}

impl Kept {
    /// Starts a run: what earlier runs kept is stale from now on.
    pub fn begin_run(&mut self) {
        self.run += 1;
    }
    fn slot(&mut self, k: usize, len: usize) -> &mut Vec<u32> {
        if self.argmax.len() <= k {
            self.argmax.resize_with(k + 1, Default::default);
        }
        let (stamp, v) = &mut self.argmax[k];
        *stamp = self.run;
        v.resize(len, 0);
        v
    }
    fn get(&self, k: usize, len: usize) -> Option<&[u32]> {
        self.argmax.get(k).filter(|(stamp, v)| *stamp == self.run && v.len() == len).map(|(_, v)| &v[..])
    }
}

/// Runs a bound kernel in element type `F`, or `None` if an operand is not `F`.
fn run<F: Elem>(k: &Native, args: &[HostSlice], tys: &[&TensorType], out: &TensorType, kept: &mut Kept) -> Option<Vec<F>> {
    let a: Vec<&[F]> = args.iter().map(F::slice).collect::<Option<_>>()?;
    let d = |i: usize| tys[i].dims();
    Some(match k {
        Native::MatMul { transpose_a, transpose_b, .. } => {
            let m = |i: usize, t: bool| Mat { data: a[i], rows: d(i)[0], cols: d(i)[1], transposed: t };
            kernels::matmul(m(0, *transpose_a), m(1, *transpose_b))
        }
        Native::Conv { kind: ConvKind::Forward, g, groups, out_channels } => kernels::conv2d(g, *groups, a[0], a[1], *out_channels),
        Native::Conv { kind: ConvKind::InputGrad, g, groups, out_channels } => kernels::conv2d_input_grad(g, *groups, a[0], a[1], *out_channels),
        Native::Conv { kind: ConvKind::FilterGrad, g, groups, out_channels } => kernels::conv2d_filter_grad(g, *groups, a[0], a[1], *out_channels),
        Native::MaxPool { g, keep } => match keep {
            Some(s) => kernels::max_pool2d(g, a[0], kept.slot(*s, out.numel())),
            None => kernels::max_pool2d(g, a[0], &mut vec![0; out.numel()]),
        },
        Native::MaxPoolGrad { g, kept: slot } => {
            let len = tys[1].numel();
            match slot.and_then(|s| kept.get(s, len)) {
                Some(at) => kernels::max_pool2d_grad(g, at, a[1]),
                None => {
                    let mut at = vec![0; len];
                    kernels::max_pool2d_argmax(g, a[0], &mut at);
                    kernels::max_pool2d_grad(g, &at, a[1])
                }
            }
        }
        Native::ReluGrad => kernels::relu_grad(a[0], a[1]),
    })
    .filter(|v| v.len() == out.numel().max(1))
}

/// A step's kernel, chosen when the plan is compiled ([`bind`]): every extent and window is
/// resolved then, so running it is a call. Host backends run all of them on [`kernels`];
/// device backends run matmuls and convolutions on their own kernels
/// ([`Backend::device_kernel`]) and the rest on burn's ops.
#[derive(Clone, Debug)]
pub enum Native {
    MatMul { m: usize, k: usize, n: usize, transpose_a: bool, transpose_b: bool },
    /// Forward, input gradient, filter gradient; `out_channels` is the filter's first extent.
    Conv { kind: ConvKind, g: Geometry, groups: usize, out_channels: usize },
    /// Max pooling; `keep`: the [`Kept`] slot its argmax goes to, when its gradient is later in
    /// the same plan.
    MaxPool { g: Geometry, keep: Option<usize> },
    /// Max pooling's gradient `(x, dy)`; `kept`: the slot its forward fills (without one, or
    /// when the forward did not run on the host kernels, the argmax is recomputed from `x`).
    MaxPoolGrad { g: Geometry, kept: Option<usize> },
    /// ReLU's gradient `(dy, x)` of equal extents.
    ReluGrad,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvKind {
    Forward,
    InputGrad,
    FilterGrad,
}

/// The kernel for `op` on operands of types `tys`, resolved once (padding modes included);
/// `None` for ops that run on burn's ops (or windows that do not resolve: the lowering then
/// reports the error).
pub fn bind(op: &Op, tys: &[&TensorType]) -> Option<Native> {
    let d = |i: usize| tys[i].dims();
    let resolve = |x: &[usize], k: [usize; 2], s, dil, mode, pad| window::resolve([x[2], x[3]], k, s, dil, mode, pad).ok();
    let conv = |kind, c: &cellgraph_compiler::op::Conv2dAttrs, x: &[usize], w: &[usize]| {
        let win = resolve(x, [w[2], w[3]], c.stride, c.dilation, c.pad_mode, c.pad)?;
        Some(Native::Conv { kind, g: geometry(x, [w[2], w[3]], c.stride, c.dilation, &win), groups: c.groups, out_channels: w[0] })
    };
    let pool = |p: &cellgraph_compiler::Pool2dAttrs| {
        let x = d(0);
        let win = resolve(x, p.kernel, p.stride, [1, 1], p.pad_mode, p.pad)?;
        Some(geometry(x, p.kernel, p.stride, [1, 1], &win))
    };
    match op {
        Op::MatMul { transpose_a, transpose_b } => {
            let (a, b) = (d(0), d(1));
            let (m, k) = if *transpose_a { (a[1], a[0]) } else { (a[0], a[1]) };
            let n = if *transpose_b { b[0] } else { b[1] };
            Some(Native::MatMul { m, k, n, transpose_a: *transpose_a, transpose_b: *transpose_b })
        }
        Op::Conv2d(c) => conv(ConvKind::Forward, c, d(0), d(1)),
        Op::Conv2dBackpropInput { conv: c, input_shape } => conv(ConvKind::InputGrad, c, &input_shape.0, d(1)),
        Op::Conv2dBackpropFilter { conv: c, filter_shape } => conv(ConvKind::FilterGrad, c, d(1), &filter_shape.0),
        Op::MaxPool2d(p) => Some(Native::MaxPool { g: pool(p)?, keep: None }),
        Op::MaxPool2dGrad(p) => Some(Native::MaxPoolGrad { g: pool(p)?, kept: None }),
        Op::ReluGrad if d(0) == d(1) => Some(Native::ReluGrad),
        _ => None,
    }
}

/// Runs a bound kernel on the host kernels when every operand is host-visible in one float
/// type; `None` sends the step to burn's generic lowering.
pub fn run_host<B: Backend>(k: &Native, args: &[&FloatTensor<B>], tys: &[&TensorType], out: &TensorType, device: &Device<B>, kept: &mut Kept) -> Option<FloatTensor<B>> {
    let slices: Vec<HostSlice> = args.iter().map(|t| B::host_slice(t)).collect::<Option<_>>()?;
    let data = match slices.first()? {
        HostSlice::F32(_) => run::<f32>(k, &slices, tys, out, kept).map(f32::wrap),
        HostSlice::F64(_) => run::<f64>(k, &slices, tys, out, kept).map(f64::wrap),
    }?;
    Some(B::from_host_vec(data, out.dims(), device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellgraph_compiler::{PadMode, Pool2dAttrs};

    /// A max pool's gradient routes by the argmax its forward kept in the same run, with the
    /// same bits as recomputing it; an argmax from an earlier run is never used.
    #[test]
    fn a_pool_gradient_routes_by_its_own_runs_argmax_only() {
        let p = Pool2dAttrs { kernel: [2, 2], stride: [2, 2], pad_mode: PadMode::Valid, pad: [0; 4] };
        let (xt, yt) = (TensorType::f32(vec![2, 3, 6, 6]), TensorType::f32(vec![2, 3, 3, 3]));
        let bound = |op: &Op, tys: &[&TensorType]| bind(op, tys).expect("pooling binds");
        let (fwd, grad) = (bound(&Op::MaxPool2d(p.clone()), &[&xt]), bound(&Op::MaxPool2dGrad(p.clone()), &[&xt, &yt]));
        let (Native::MaxPool { g, .. }, Native::MaxPoolGrad { .. }) = (&fwd, &grad) else { panic!("pooling kernels") };
        let (keep, kept) = (Native::MaxPool { g: *g, keep: Some(0) }, Native::MaxPoolGrad { g: *g, kept: Some(0) });
        let x1: Vec<f32> = (0..216).map(|i| ((i * 37) % 23) as f32).collect();
        let x2: Vec<f32> = x1.iter().rev().copied().collect();
        let dy: Vec<f32> = (0..54).map(|i| i as f32 + 0.5).collect();
        let s = |v: &[f32]| HostSlice::F32(Cow::Owned(v.to_vec()));
        let mut state = Kept::default();
        state.begin_run();
        run::<f32>(&keep, &[s(&x1)], &[&xt], &yt, &mut state).expect("forward");
        let routed = run::<f32>(&kept, &[s(&x1), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient");
        let searched = run::<f32>(&grad, &[s(&x1), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient");
        assert_eq!(routed.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), searched.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // The next run's gradient, on other input, before its forward ran: it must search.
        state.begin_run();
        let fresh = run::<f32>(&kept, &[s(&x2), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient");
        assert_eq!(fresh, run::<f32>(&grad, &[s(&x2), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient"));
        assert_ne!(fresh, routed);
    }
}

//! The runtime's backend interface, and native kernels for backends that keep tensors in
//! host memory.
//!
//! [`Backend`] extends burn's backend trait with two methods: a view of a float tensor's
//! host memory (when it has any) and building a tensor from host data. The lowering calls
//! [`try_native`] first for the hot ops (matrix products, convolutions and their gradients,
//! max pooling, ReLU's gradient); where every operand is host-visible in one float type, the
//! op runs on the slice kernels in [`kernels`], otherwise it falls through to burn's generic
//! ops. burn-ndarray is host-visible; a device backend (CUDA) is not, and uses burn's path.

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

    /// Runs a matmul or convolution (see [`native_shape`]) on the backend's own kernels, when
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

/// Runs `op` on the host kernels in element type `F`, or `None` if an operand is not `F`.
fn run<F: Elem>(op: &Op, args: &[HostSlice], tys: &[&TensorType], out: &TensorType) -> Option<Vec<F>> {
    let a: Vec<&[F]> = args.iter().map(F::slice).collect::<Option<_>>()?;
    let d = |i: usize| tys[i].dims();
    let resolve = |x: &[usize], k: [usize; 2], s, dil, mode, pad| window::resolve([x[2], x[3]], k, s, dil, mode, pad).ok();
    Some(match op {
        Op::MatMul { transpose_a, transpose_b } => {
            let m = |i: usize, t: bool| Mat { data: a[i], rows: d(i)[0], cols: d(i)[1], transposed: t };
            kernels::matmul(m(0, *transpose_a), m(1, *transpose_b))
        }
        Op::Conv2d(c) => {
            let (x, w) = (d(0), d(1));
            let win = resolve(x, [w[2], w[3]], c.stride, c.dilation, c.pad_mode, c.pad)?;
            kernels::conv2d(&geometry(x, [w[2], w[3]], c.stride, c.dilation, &win), c.groups, a[0], a[1], w[0])
        }
        Op::Conv2dBackpropInput { conv: c, input_shape } => {
            let (x, w) = (&input_shape.0, d(1));
            let win = resolve(x, [w[2], w[3]], c.stride, c.dilation, c.pad_mode, c.pad)?;
            kernels::conv2d_input_grad(&geometry(x, [w[2], w[3]], c.stride, c.dilation, &win), c.groups, a[0], a[1], w[0])
        }
        Op::Conv2dBackpropFilter { conv: c, filter_shape } => {
            let (x, w) = (d(1), &filter_shape.0);
            let win = resolve(x, [w[2], w[3]], c.stride, c.dilation, c.pad_mode, c.pad)?;
            kernels::conv2d_filter_grad(&geometry(x, [w[2], w[3]], c.stride, c.dilation, &win), c.groups, a[0], a[1], w[0])
        }
        Op::MaxPool2d(p) | Op::MaxPool2dGrad(p) => {
            let x = d(0);
            let win = resolve(x, p.kernel, p.stride, [1, 1], p.pad_mode, p.pad)?;
            let g = geometry(x, p.kernel, p.stride, [1, 1], &win);
            match op {
                Op::MaxPool2d(_) => kernels::max_pool2d(&g, a[0]),
                _ => kernels::max_pool2d_grad(&g, a[0], a[1]),
            }
        }
        Op::ReluGrad if d(0) == d(1) => kernels::relu_grad(a[0], a[1]),
        _ => return None,
    })
    .filter(|v| v.len() == out.numel().max(1))
}

/// What a device kernel needs to run one of the [`has_native`] ops.
pub enum Native {
    MatMul { m: usize, k: usize, n: usize, transpose_a: bool, transpose_b: bool },
    /// Forward, input gradient, filter gradient; `out_channels` is the filter's first extent.
    Conv { kind: ConvKind, g: Geometry, groups: usize, out_channels: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvKind {
    Forward,
    InputGrad,
    FilterGrad,
}

/// The matmul and convolution ops' extents, resolved (padding modes included) from the
/// operand types, for device kernels; `None` for other ops.
pub fn native_shape(op: &Op, tys: &[&TensorType]) -> Option<Native> {
    let d = |i: usize| tys[i].dims();
    let resolve = |x: &[usize], k: [usize; 2], s, dil, mode, pad| window::resolve([x[2], x[3]], k, s, dil, mode, pad).ok();
    let conv = |kind, c: &cellgraph_compiler::op::Conv2dAttrs, x: &[usize], w: &[usize]| {
        let win = resolve(x, [w[2], w[3]], c.stride, c.dilation, c.pad_mode, c.pad)?;
        Some(Native::Conv { kind, g: geometry(x, [w[2], w[3]], c.stride, c.dilation, &win), groups: c.groups, out_channels: w[0] })
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
        _ => None,
    }
}

/// True for the ops [`try_native`] may run.
pub fn has_native(op: &Op) -> bool {
    matches!(
        op,
        Op::MatMul { .. } | Op::Conv2d(_) | Op::Conv2dBackpropInput { .. } | Op::Conv2dBackpropFilter { .. } | Op::MaxPool2d(_) | Op::MaxPool2dGrad(_) | Op::ReluGrad
    )
}

/// Runs `op` on the host kernels when every operand is host-visible in one float type;
/// `None` sends it to burn's generic lowering.
pub fn try_native<B: Backend>(op: &Op, args: &[&FloatTensor<B>], tys: &[&TensorType], out: &TensorType, device: &Device<B>) -> Option<FloatTensor<B>> {
    let slices: Vec<HostSlice> = args.iter().map(|t| B::host_slice(t)).collect::<Option<_>>()?;
    let data = match slices.first()? {
        HostSlice::F32(_) => run::<f32>(op, &slices, tys, out).map(f32::wrap),
        HostSlice::F64(_) => run::<f64>(op, &slices, tys, out).map(f64::wrap),
    }?;
    Some(B::from_host_vec(data, out.dims(), device))
}

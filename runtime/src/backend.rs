//! The runtime's backend interface: burn's backend trait extended with what plans need
//! (host views of tensors, flat buffers, device kernels), and its host implementation on
//! burn-ndarray.
//!
//! burn 0.22 marks burn-ndarray deprecated (burn-flex is to replace it); the host kernels read
//! its arrays in place, so it stays the CPU backend until a move to burn-flex.
#![allow(deprecated)]

use std::borrow::Cow;

use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor};
use burn_backend::{Shape as BShape, TensorData};
use burn_ndarray::{NdArray, NdArrayTensor};
use cellgraph_compiler::TensorType;

use crate::arena::Arena;
use crate::kernel::Native;
use cellgraph_compiler::program::Program;

/// A burn shape for IR extents (`[]` becomes `[1]`: burn has no rank-0 tensors).
pub fn bshape(dims: &[usize]) -> BShape {
    if dims.is_empty() {
        BShape::from(vec![1usize])
    } else {
        BShape::from(dims.to_vec())
    }
}

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
    /// run their bound kernels on the host kernels ([`crate::host`]); otherwise on [`Self::device_kernel`].
    const HOST: bool = false;

    /// The tensor's contents when the backend keeps them in host memory (no copy when the
    /// layout is already row-major); `None` for device backends.
    fn host_slice(_t: &FloatTensor<Self>) -> Option<HostSlice<'_>> {
        None
    }

    /// An integer tensor's contents when the backend keeps them in host memory (class labels
    /// for the host loss kernels); `None` for device backends.
    fn host_ints(_t: &IntTensor<Self>) -> Option<Cow<'_, [i64]>> {
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

    /// [`Self::flat_view`] of an integer buffer (a window's labels, say).
    fn flat_view_int(_buffer: &IntTensor<Self>, _offset: usize, _shape: &[usize]) -> Option<IntTensor<Self>> {
        None
    }

    /// `acc += g`, written into `acc`'s memory; false when the backend cannot (the caller
    /// then adds out of place).
    fn assign_add_in_place(_acc: &FloatTensor<Self>, _g: FloatTensor<Self>) -> bool {
        false
    }

    /// The sum of every element of `x`, as a one-element tensor, added in an order that its
    /// length alone fixes: the same bits on every run (a loss's total, the squared gradients
    /// whose root clipping compares with its norm). burn's `float_sum` on a device adds its
    /// cubes' parts with atomics in the order the device happens to run them: under load the
    /// clipping scale's last bit, and so the trained weights', changed from run to run.
    fn sum_in_order(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_sum(x)
    }

    /// One kernel over flat buffers: the optimizer update `prog` of every parameter from
    /// `acc * scale`, then `acc = 0`; `scalars` holds the rule's scalar inputs. Returns the
    /// kernels launched, or `None` when the backend has no such kernel.
    fn fused_update(
        _prog: &Program,
        _params: &FloatTensor<Self>,
        _acc: &FloatTensor<Self>,
        _state: &[FloatTensor<Self>],
        _scale: f32,
        _scalars: &[f32],
    ) -> Option<usize> {
        None
    }

    /// Why the backend's own kernels will not run the bound kernel `op` on operands of types
    /// `args` into `out`, decided once when a session binds a plan (the step then runs on
    /// burn's ops, counted in [`crate::Session::burn_op_steps`]): a kernel family it has no
    /// kernel for, extents its kernels do not take, class ids computed in the plan
    /// (`!ids_checked`: the lowering reads and checks them). `None`: [`Self::device_kernel`]
    /// runs it. Host backends run every bound kernel.
    fn device_declines(_op: &Native, _args: &[TensorType], _out: &TensorType, _ids_checked: bool, _device: &Device<Self>) -> Option<String> {
        None
    }

    /// Why the backend's own kernels will not run an epilogue's program `post` after its
    /// head's kernel, decided once when a session binds a plan: the head then runs on its
    /// kernel and the program on burn's ops, counted (`epilogue` in
    /// [`crate::Session::burn_op_steps`]). `None`: the program runs on the device too. Host
    /// backends run every program.
    fn device_declines_program(_post: &crate::kernel::Elementwise) -> Option<String> {
        None
    }

    /// Runs a bound kernel (see [`crate::kernel::bind`]) on the backend's own kernels, when it
    /// has them: `args` the float operands in order, `ints` the integer ones (class labels,
    /// already checked on the host). Device backends: matmuls in exact f32, where burn's would
    /// use TF32 tensor cores (`tf32`: they may, [`crate::Session::set_tf32`]), and one launch
    /// for what burn's ops take several for (elementwise programs, epilogues, the loss and
    /// its gradient, pooling).
    /// Outputs come from `arena` ([`Arena::take_device`]).
    fn device_kernel(
        _op: &Native,
        _args: &[&FloatTensor<Self>],
        _ints: &[&IntTensor<Self>],
        _out: &TensorType,
        _tf32: bool,
        _arena: &mut Arena,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// A softmax cross-entropy forward (`op`, class-id labels) and its gradient for the constant
    /// `dloss` `seed`, in one kernel: `(loss, gradient)`, or `None` where the backend has no
    /// such kernel (the two steps then run apart).
    fn device_loss_with_grad(
        _op: &Native,
        _args: &[&FloatTensor<Self>],
        _ints: &[&IntTensor<Self>],
        _out: &TensorType,
        _seed: f64,
        _arena: &mut Arena,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        None
    }

    /// Runs a bound head (an accumulating epilogue's, see [`crate::kernel::bind`]) adding its
    /// result into `acc`'s memory (`acc += head(args)`, the sum in `assign_add`'s order); false
    /// when the backend has no such kernel for it (the caller then runs the head and an
    /// `assign_add`). `tf32`: a product may run on TF32 tensor cores.
    fn device_accumulate(_op: &Native, _args: &[&FloatTensor<Self>], _acc: &FloatTensor<Self>, _tf32: bool, _arena: &mut Arena) -> bool {
        false
    }

    /// Writes `data` (the tensor's element type and length) into `t`'s own memory, enqueued
    /// after the work already given to the device (no wait); gives `data` back where the
    /// backend cannot (host backends: replay is for device backends; a tensor that is not
    /// contiguous, or of another type or length).
    fn write_float(_t: &FloatTensor<Self>, data: TensorData) -> std::result::Result<(), TensorData> {
        Err(data)
    }

    /// [`Self::write_float`] for an integer tensor.
    fn write_int(_t: &IntTensor<Self>, data: TensorData) -> std::result::Result<(), TensorData> {
        Err(data)
    }

    /// A contiguous float tensor holding `data` (in its own type), a buffer that
    /// [`Self::write_float`] can write whole later; `None` where the backend has no such
    /// buffers.
    fn contiguous_float(_data: TensorData, _device: &Device<Self>) -> Option<FloatTensor<Self>> {
        None
    }

    /// [`Self::contiguous_float`] for an integer tensor.
    fn contiguous_int(_data: TensorData, _device: &Device<Self>) -> Option<IntTensor<Self>> {
        None
    }

    /// A new buffer holding `t`'s elements (one launch), or `None` where the backend has no
    /// such kernel.
    fn device_copy(_t: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        None
    }

    /// `dst = src` elementwise, into `dst`'s memory (one launch); false where the backend
    /// cannot.
    fn copy_into(_dst: &FloatTensor<Self>, _src: &FloatTensor<Self>) -> bool {
        false
    }

    /// True when `a` and `b` are the same memory (same buffer, same offset and length).
    fn same_buffer(_a: &FloatTensor<Self>, _b: &FloatTensor<Self>) -> bool {
        false
    }

    /// The tensor's memory as a vector (row-major, exactly its elements), when the backend
    /// keeps it in host memory and nothing else holds it; the tensor back otherwise.
    fn reclaim(t: FloatTensor<Self>) -> Result<HostVec, FloatTensor<Self>> {
        Err(t)
    }

    /// A device tensor whose memory may be written again, with its length and element size in
    /// bytes: contiguous, its memory exactly its elements, and held by nothing else (so never
    /// a view of a live flat buffer); `None` otherwise, and always on host backends (see
    /// [`Self::reclaim`]).
    fn device_reusable(_t: FloatTensor<Self>) -> Option<(usize, usize, FloatTensor<Self>)> {
        None
    }

    /// Whether the device's own kernels store values of `dtype` (bf16 or f16: the
    /// elementwise kernel reads and writes it, cubek's matmuls read it) on `device`, so a
    /// session can keep a low-precision plan's values in it (see
    /// [`crate::Session::set_low_precision_storage`]). False on host backends.
    fn stores_low(_dtype: cellgraph_compiler::DType, _device: &Device<Self>) -> bool {
        false
    }

    /// Keeps the tensor's memory from going back to the device's pool while the returned pin
    /// lives, without holding the tensor (so whether it may be written in place, and whether
    /// it goes back to an arena, is unchanged); `None` on host backends. A captured graph pins
    /// the buffers its arena held when it was recorded (see [`crate::replay`]).
    fn device_pin(_t: &FloatTensor<Self>) -> Option<Box<dyn std::any::Any + Send>> {
        None
    }

    /// `t` laid out row-major without gaps where the device padded its rows, copied into a
    /// buffer of `arena`'s. The runtime's kernels, views and flat buffers index a device
    /// tensor's buffer as row-major; burn may hand out a tensor whose rows are padded (cubecl's
    /// CUDA allocator pitches a row to up to 512 bytes, so `[64, 28]` rows lie 32 floats apart),
    /// which read flat gives other values. Every value a step computes on burn's ops passes
    /// here; identity on host backends, on a tensor already row-major, and on views burn's ops
    /// read by their strides (broadcast, permuted). The copy goes into the arena's memory, not
    /// a new buffer: a captured plan may take no buffer its arena does not hold (on an H200 on
    /// 2026-12-04, with the copy in new buffers, captures of convolution and GPT plans failed
    /// on an allocation inside the capture window: likely this copy's).
    fn float_unpitched(t: FloatTensor<Self>, _arena: &mut Arena) -> FloatTensor<Self> {
        t
    }

    /// `data` (the session's float type) on the device, row-major without gaps: burn's upload,
    /// which on a device may pad the rows ([`Self::float_unpitched`]); a device writes the
    /// bytes into a buffer of their own length instead, with no copy after.
    fn float_upload(data: TensorData, device: &Device<Self>) -> FloatTensor<Self> {
        Self::float_from_data(data, device)
    }

    /// [`Self::float_upload`] for integers (the session's integer type).
    fn int_upload(data: TensorData, device: &Device<Self>) -> IntTensor<Self> {
        Self::int_from_data(data, device)
    }

    /// [`Self::float_unpitched`] for integers, into a new buffer (integers do not go back to
    /// an arena).
    fn int_unpitched(t: IntTensor<Self>) -> IntTensor<Self> {
        t
    }

    /// [`Self::int_unpitched`] for booleans.
    fn bool_unpitched(t: BoolTensor<Self>) -> BoolTensor<Self> {
        t
    }

    /// A float tensor of extents `shape` holding `data`: of `data`'s own type on host
    /// backends, f32 on device backends (their plans compute in f32).
    fn from_host_vec(data: HostVec, shape: &[usize], device: &Device<Self>) -> FloatTensor<Self> {
        let shape = bshape(shape);
        let data = match data {
            HostVec::F32(v) => TensorData::new(v, shape),
            HostVec::F64(v) => TensorData::new(v, shape),
        };
        Self::float_from_data(data.convert::<f32>(), device)
    }
}

/// An array's elements in row-major order: its own memory when that is how it lies, else a copy.
fn cow<T: Clone>(v: ndarray::ArrayViewD<'_, T>) -> Cow<'_, [T]> {
    match v.to_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(v.iter().cloned().collect()),
    }
}

impl Backend for NdArray {
    const HOST: bool = true;

    fn host_slice(t: &NdArrayTensor) -> Option<HostSlice<'_>> {
        match t {
            NdArrayTensor::F32(s) => Some(HostSlice::F32(cow(s.view()))),
            NdArrayTensor::F64(s) => Some(HostSlice::F64(cow(s.view()))),
            _ => None,
        }
    }

    fn host_ints(t: &NdArrayTensor) -> Option<Cow<'_, [i64]>> {
        fn wide<T: Copy + Into<i64>>(v: ndarray::ArrayViewD<'_, T>) -> Cow<'static, [i64]> {
            Cow::Owned(v.iter().map(|&x| x.into()).collect())
        }
        match t {
            NdArrayTensor::I64(s) => Some(cow(s.view())),
            NdArrayTensor::I32(s) => Some(wide(s.view())),
            NdArrayTensor::I16(s) => Some(wide(s.view())),
            NdArrayTensor::I8(s) => Some(wide(s.view())),
            NdArrayTensor::U32(s) => Some(wide(s.view())),
            NdArrayTensor::U16(s) => Some(wide(s.view())),
            NdArrayTensor::U8(s) => Some(wide(s.view())),
            _ => None,
        }
    }

    fn reclaim(t: NdArrayTensor) -> Result<HostVec, NdArrayTensor> {
        /// A unique standard-layout array's elements, in its own vector.
        fn exact<T: Clone>(a: ndarray::ArcArray<T, ndarray::IxDyn>) -> Vec<T> {
            let n = a.len();
            let (mut v, offset) = a.into_owned().into_raw_vec_and_offset();
            let offset = offset.unwrap_or(0);
            if offset != 0 || v.len() != n {
                // A view into part of a larger vector: keep its elements only.
                v.drain(..offset);
                v.truncate(n);
            }
            v
        }
        match t {
            NdArrayTensor::F32(s) if s.is_unique() && s.view().is_standard_layout() => Ok(HostVec::F32(exact(s.into_shared()))),
            NdArrayTensor::F64(s) if s.is_unique() && s.view().is_standard_layout() => Ok(HostVec::F64(exact(s.into_shared()))),
            t => Err(t),
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

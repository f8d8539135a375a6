//! Device values: a backend tensor primitive tagged with its kind, and host transfers.
//!
//! The executor works on burn's rank-erased primitives (`FloatTensor<B>` ...) through the
//! `Backend` trait, so one executor serves every burn backend (CPU ndarray now, CUDA later).

use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor};
use burn_backend::{get_device_settings, Backend, DType, FloatDType, TensorData, TensorMetadata};
use cellgraph_compiler::{HostData, HostTensor};

use crate::arena::Arena;

/// A tensor on a backend device.
#[derive(Debug)]
pub enum Value<B: Backend> {
    Float(FloatTensor<B>),
    Int(IntTensor<B>),
    Bool(BoolTensor<B>),
}

impl<B: Backend> Clone for Value<B> {
    fn clone(&self) -> Self {
        match self {
            Value::Float(t) => Value::Float(t.clone()),
            Value::Int(t) => Value::Int(t.clone()),
            Value::Bool(t) => Value::Bool(t.clone()),
        }
    }
}

thread_local! {
    static DEVICE_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static DEVICE_UPLOADS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many host-to-device copies this thread has made through the runtime (a batch's inputs,
/// a parameter set from the host, the boundary kernel's constants); host backends make none.
pub fn device_uploads() -> u64 {
    DEVICE_UPLOADS.with(std::cell::Cell::get)
}

/// Counts one host-to-device copy in [`device_uploads`].
pub(crate) fn count_upload() {
    DEVICE_UPLOADS.with(|n| n.set(n.get() + 1));
}

/// Blocks on a backend future that reads device memory back to the host (ready at once on
/// CPU backends), counting it in [`device_reads`].
pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    DEVICE_READS.with(|n| n.set(n.get() + 1));
    burn_backend::read_sync(f)
}

/// How many device-to-host reads this thread has made through the runtime (each one waits for
/// the device to finish what it was given: a sync). Host backends' values are read without one.
pub fn device_reads() -> u64 {
    DEVICE_READS.with(std::cell::Cell::get)
}

/// A host tensor's data in the dtypes a session makes its values in: floats as `settings`'
/// float type, integers as its integer type, booleans as they are.
pub(crate) fn device_data(t: HostTensor, settings: &burn_backend::DeviceSettings) -> TensorData {
    let shape = crate::backend::bshape(&t.shape);
    let (float, int): (DType, DType) = (settings.float_dtype.into(), settings.int_dtype.into());
    match t.data {
        HostData::F32(v) => TensorData::new(v, shape).convert_dtype(float),
        HostData::F64(v) => TensorData::new(v, shape).convert_dtype(float),
        HostData::I32(v) => TensorData::new(v, shape).convert_dtype(int),
        HostData::I64(v) => TensorData::new(v, shape).convert_dtype(int),
        HostData::Bool(v) => TensorData::new(v, shape),
    }
}

impl<B: crate::Backend> Value<B> {
    /// Copies a host tensor to the device: floats as `settings`' float type (the session's),
    /// integers as its integer type.
    pub fn from_host(t: &HostTensor, device: &Device<B>, settings: &burn_backend::DeviceSettings) -> Self {
        Self::from_host_owned(t.clone(), device, settings)
    }

    /// [`Self::from_host`], taking the host memory instead of copying it.
    pub fn from_host_owned(t: HostTensor, device: &Device<B>, settings: &burn_backend::DeviceSettings) -> Self {
        if !B::HOST {
            count_upload();
        }
        let dtype = t.dtype();
        let data = device_data(t, settings);
        // Float and integer uploads are row-major already (written into buffers of their own
        // length); burn's upload of bools may pad their rows.
        if dtype.is_float() {
            Value::Float(B::float_upload(data, device))
        } else if dtype.is_int() {
            Value::Int(B::int_upload(data, device))
        } else {
            Value::Bool(B::bool_unpitched(B::bool_from_data(data, device)))
        }
    }

    /// The value with any rows the device padded laid out row-major, a float's copy in a buffer
    /// of `arena`'s ([`crate::Backend::float_unpitched`]).
    pub fn unpitched(self, arena: &mut Arena) -> Self {
        match self {
            Value::Float(t) => Value::Float(B::float_unpitched(t, arena)),
            Value::Int(t) => Value::Int(B::int_unpitched(t)),
            Value::Bool(t) => Value::Bool(B::bool_unpitched(t)),
        }
    }

    /// Copies the value back to the host. Floats come back as f64 when the backend computes in f64.
    pub fn to_host(&self) -> HostTensor {
        let (data, shape) = match self {
            Value::Float(t) => match B::host_slice(t) {
                // Host backends: a copy of the memory (burn's `into_data` walks a shared array
                // element by element through dynamic indices, 20x slower on a parameter).
                Some(crate::backend::HostSlice::F32(v)) => (HostData::F32(v.into_owned()), t.shape().to_vec()),
                Some(crate::backend::HostSlice::F64(v)) => (HostData::F64(v.into_owned()), t.shape().to_vec()),
                None => {
                    let d = block_on(B::float_into_data(t.clone())).expect("device read");
                    let shape = d.shape.to_vec();
                    let data = if t.dtype() == DType::F64 {
                        HostData::F64(d.convert::<f64>().try_to_vec::<f64>().expect("f64 data"))
                    } else {
                        HostData::F32(d.convert::<f32>().try_to_vec::<f32>().expect("f32 data"))
                    };
                    (data, shape)
                }
            },
            Value::Int(t) => {
                let d = block_on(B::int_into_data(t.clone())).expect("device read");
                let shape = d.shape.to_vec();
                (HostData::I64(d.convert::<i64>().try_to_vec::<i64>().expect("int data")), shape)
            }
            Value::Bool(t) => {
                let d = block_on(B::bool_into_data(t.clone())).expect("device read");
                let shape = d.shape.to_vec();
                (HostData::Bool(d.try_to_vec::<bool>().expect("bool data")), shape)
            }
        };
        HostTensor { shape, data }
    }

    /// The value's extents.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Value::Float(t) => t.shape().to_vec(),
            Value::Int(t) => t.shape().to_vec(),
            Value::Bool(t) => t.shape().to_vec(),
        }
    }
}

/// The dtypes ops on `B` produce: floats of `float` (a session's: f32, or f64 for reference
/// runs), integers and bools as the device makes them. (burn keys its device settings by
/// device alone, and the CPU has one device, so an f32 and an f64 session in one process
/// cannot take their float type from there.)
pub fn settings<B: Backend>(device: &Device<B>, float: FloatDType) -> burn_backend::DeviceSettings {
    let mut s = get_device_settings::<B>(device);
    s.float_dtype = float;
    s
}

impl<B: crate::Backend> Value<B> {
    /// Gives the value's memory back to `arena` when nothing else holds it (the value is dropped
    /// otherwise).
    pub fn give_back(self, arena: &mut Arena) {
        if let Value::Float(t) = self {
            match <B as crate::Backend>::reclaim(t) {
                Ok(crate::backend::HostVec::F32(v)) => arena.give(v),
                Ok(crate::backend::HostVec::F64(v)) => arena.give(v),
                Err(t) => {
                    if let Some((len, size, t)) = <B as crate::Backend>::device_reusable(t) {
                        arena.give_device(len, size, t);
                    }
                }
            }
        }
    }
}

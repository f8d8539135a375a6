//! Concrete host tensors: parameter values, batches, results. The IR's element types map to
//! [`HostData`] variants; `F64` exists for f64 reference runs (gradient checks).

use std::fmt;

use crate::types::{DType, TensorType};

/// The elements of a host tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

/// A tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: HostData,
}

/// A host tensor whose element count does not match its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeMismatch {
    pub shape: Vec<usize>,
    pub len: usize,
}

impl fmt::Display for ShapeMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n: usize = self.shape.iter().product();
        write!(f, "shape {:?} needs {n} elements, data has {}", self.shape, self.len)
    }
}

impl std::error::Error for ShapeMismatch {}

impl HostData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F64(v) => v.len(),
            HostData::I32(v) => v.len(),
            HostData::I64(v) => v.len(),
            HostData::Bool(v) => v.len(),
        }
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl HostTensor {
    /// A tensor from a shape and elements; errors when the counts differ.
    pub fn new(shape: Vec<usize>, data: HostData) -> Result<Self, ShapeMismatch> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(ShapeMismatch { len: data.len(), shape });
        }
        Ok(HostTensor { shape, data })
    }
    /// An f32 tensor.
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, ShapeMismatch> {
        Self::new(shape, HostData::F32(data))
    }
    /// An f32 scalar.
    pub fn scalar_f32(v: f64) -> Self {
        HostTensor { shape: vec![], data: HostData::F32(vec![v as f32]) }
    }
    /// An i32 tensor.
    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Result<Self, ShapeMismatch> {
        Self::new(shape, HostData::I32(data))
    }
    /// A tensor of `ty` with every element `value`.
    pub fn full(ty: &TensorType, value: f64) -> Self {
        let n = ty.numel();
        let data = match ty.dtype {
            DType::F32 | DType::F16 | DType::BF16 => HostData::F32(vec![value as f32; n]),
            DType::I32 => HostData::I32(vec![value as i32; n]),
            DType::I64 => HostData::I64(vec![value as i64; n]),
            DType::Bool => HostData::Bool(vec![value != 0.0; n]),
        };
        HostTensor { shape: ty.dims().to_vec(), data }
    }
    /// The IR element type (F64 host data is an f32 value computed in double precision).
    pub fn dtype(&self) -> DType {
        match self.data {
            HostData::F32(_) | HostData::F64(_) => DType::F32,
            HostData::I32(_) => DType::I32,
            HostData::I64(_) => DType::I64,
            HostData::Bool(_) => DType::Bool,
        }
    }
    /// The IR type.
    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.clone())
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// The elements widened to f64.
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            HostData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::F64(v) => v.clone(),
            HostData::I32(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::I64(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
        }
    }
    /// The elements as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            HostData::F32(v) => v.clone(),
            _ => self.to_f64().into_iter().map(|x| x as f32).collect(),
        }
    }
    /// The first element as f64 (the value of a scalar).
    pub fn scalar(&self) -> f64 {
        self.to_f64().first().copied().unwrap_or(f64::NAN)
    }
    /// The tensor with f64 elements (for double-precision reference runs).
    pub fn to_f64_tensor(&self) -> HostTensor {
        match &self.data {
            HostData::F32(_) | HostData::F64(_) => HostTensor { shape: self.shape.clone(), data: HostData::F64(self.to_f64()) },
            _ => self.clone(),
        }
    }
}

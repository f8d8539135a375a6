//! Tensor types: an element type ([`DType`]) and a static [`Shape`].
//!
//! Every node of a graph has exactly one `TensorType`; it prints as `f32[32,1,32,32]`
//! (a scalar is `f32[]`).

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    I64,
    Bool,
}

impl DType {
    /// All element types, in print order.
    pub const ALL: [DType; 6] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64, DType::Bool];

    /// The name used by the text format (`f32`, `i32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }

    /// Parses a name written by [`DType::name`].
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    /// True for f32, f16 and bf16: the types gradients flow through.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// True for i32 and i64.
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A static shape: one extent per axis.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// The shape of a scalar (rank 0).
    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }
    /// Number of axes.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// The extents.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of a node's value: element type and static shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    /// Builds a type from an element type and extents.
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> Self {
        TensorType { dtype, shape: shape.into() }
    }
    /// An f32 tensor of the given extents.
    pub fn f32(shape: impl Into<Shape>) -> Self {
        TensorType::new(DType::F32, shape)
    }
    /// An i32 tensor of the given extents.
    pub fn i32(shape: impl Into<Shape>) -> Self {
        TensorType::new(DType::I32, shape)
    }
    /// The extents.
    pub fn dims(&self) -> &[usize] {
        &self.shape.0
    }
    /// Number of axes.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
    /// Bytes needed to hold one value of this type.
    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }
    /// Same shape, another element type.
    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType::new(dtype, self.shape.clone())
    }
    /// Same element type, another shape.
    pub fn with_shape(&self, shape: impl Into<Shape>) -> Self {
        TensorType::new(self.dtype, shape)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

//! A small builder that adds nodes to a graph under one scope: the vocabulary that gradient
//! rules and rewrites are written in.

use crate::error::Result;
use crate::graph::{Graph, NodeId};
use crate::op::{Op, ReduceAttrs};
use crate::types::{Shape, TensorType};

/// Adds nodes to `g`, all tagged with `scope`.
pub struct Emit<'g> {
    pub g: &'g mut Graph,
    pub scope: String,
}

impl<'g> Emit<'g> {
    /// A builder over `g` with the given scope.
    pub fn new(g: &'g mut Graph, scope: impl Into<String>) -> Self {
        Emit { g, scope: scope.into() }
    }
    /// Adds an op with inferred type.
    pub fn op(&mut self, op: Op, xs: &[NodeId]) -> Result<NodeId> {
        self.g.add(op, xs, &self.scope)
    }
    /// The type of a node.
    pub fn ty(&self, x: NodeId) -> TensorType {
        self.g.ty(x).clone()
    }
    /// A tensor of type `ty` filled with `value`.
    pub fn constant(&mut self, value: f64, ty: TensorType) -> Result<NodeId> {
        self.g.add_leaf(Op::Constant { value }, ty, &self.scope)
    }
    /// A scalar of `like`'s dtype.
    pub fn scalar_like(&mut self, value: f64, like: NodeId) -> Result<NodeId> {
        let t = self.ty(like).with_shape(Shape::scalar());
        self.constant(value, t)
    }
    pub fn add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.op(Op::Add, &[a, b])
    }
    pub fn sub(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.op(Op::Sub, &[a, b])
    }
    pub fn mul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.op(Op::Mul, &[a, b])
    }
    pub fn div(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.op(Op::Div, &[a, b])
    }
    pub fn neg(&mut self, a: NodeId) -> Result<NodeId> {
        self.op(Op::Neg, &[a])
    }
    /// `x * value` with a scalar constant.
    pub fn scale(&mut self, x: NodeId, value: f64) -> Result<NodeId> {
        let c = self.scalar_like(value, x)?;
        self.mul(x, c)
    }
    pub fn reshape(&mut self, x: NodeId, shape: impl Into<Shape>) -> Result<NodeId> {
        let shape = shape.into();
        if self.g.ty(x).shape == shape {
            return Ok(x);
        }
        self.op(Op::Reshape { shape }, &[x])
    }
    pub fn broadcast(&mut self, x: NodeId, shape: impl Into<Shape>) -> Result<NodeId> {
        let shape = shape.into();
        if self.g.ty(x).shape == shape {
            return Ok(x);
        }
        self.op(Op::Broadcast { shape }, &[x])
    }
    pub fn reduce_sum(&mut self, x: NodeId, axes: Vec<usize>, keep_dims: bool) -> Result<NodeId> {
        self.op(Op::ReduceSum(ReduceAttrs { axes, keep_dims }), &[x])
    }
    pub fn matmul(&mut self, a: NodeId, b: NodeId, transpose_a: bool, transpose_b: bool) -> Result<NodeId> {
        self.op(Op::MatMul { transpose_a, transpose_b }, &[a, b])
    }
    /// Sums `x` down to `shape`, undoing a numpy-style broadcast.
    pub fn unbroadcast(&mut self, x: NodeId, shape: &Shape) -> Result<NodeId> {
        let xs = self.ty(x).shape;
        if &xs == shape {
            return Ok(x);
        }
        let lead = xs.rank() - shape.rank();
        let axes: Vec<usize> = (0..xs.rank()).filter(|&i| i < lead || (shape.0[i - lead] == 1 && xs.0[i] != 1)).collect();
        // Summing away the leading axes alone (a bias's gradient) drops them: no reshape.
        let keep_dims = axes != (0..lead).collect::<Vec<_>>();
        let s = if axes.is_empty() { x } else { self.reduce_sum(x, axes, keep_dims)? };
        self.reshape(s, shape.clone())
    }
}

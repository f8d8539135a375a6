//! Graph-mode reverse-mode differentiation (MindSpore's `GradOperation`).
//!
//! [`grad`] appends the backward graph of `loss` with respect to chosen nodes to the same
//! graph, in the same IR. The driver walks nodes on a path from a differentiated node to the
//! loss in reverse topological order, asks the rule table ([`vjp`]) for each operand's
//! cotangent, and sums cotangents that meet. A rule answers `None` for "no gradient": zeros
//! are symbolic and never built, except for a requested gradient that nothing reaches.

use std::collections::{HashMap, HashSet};

use crate::emit::Emit;
use crate::error::{IrError, Result};
use crate::graph::{Graph, NodeId};
use crate::op::{Op, ReduceAttrs};
use crate::types::Shape;

/// The name of the seed's graph input under [`Sens::Input`].
pub const SENS: &str = "sens";

/// Where the initial cotangent of the loss comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sens {
    /// A constant 1 of the loss's type.
    One,
    /// A new graph input named `sens` (MindSpore's `sens_param=True`).
    Input,
}

/// What [`grad`] added.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// Gradient of each requested node, in request order.
    pub grads: Vec<NodeId>,
    /// The sensitivity node (constant 1 or the `sens` input).
    pub sens: NodeId,
}

/// Scope given to backward nodes: MindSpore's `Gradients/` prefix on the forward scope.
pub fn grad_scope(scope: &str) -> String {
    format!("Gradients/{scope}")
}

/// Appends d`loss`/d`wrt` to `g`. `loss` must be a float node.
pub fn grad(g: &mut Graph, loss: NodeId, wrt: &[NodeId], sens: Sens) -> Result<Gradients> {
    let lt = g.try_node(loss)?.ty.clone();
    if !lt.dtype.is_float() {
        return Err(IrError::Autodiff(format!("loss {loss} has type {lt}; only float values can be differentiated")));
    }
    for &w in wrt {
        let t = &g.try_node(w)?.ty;
        if !t.dtype.is_float() {
            return Err(IrError::Autodiff(format!("cannot differentiate with respect to {w} of type {t}")));
        }
    }
    let order = g.topo_order().map_err(|n| IrError::Autodiff(format!("graph has a cycle through {n}")))?;
    let active = active_nodes(g, &order, loss, wrt);
    let scope = grad_scope(&g.node(loss).scope);
    let sens = match sens {
        Sens::One => Emit::new(g, scope).constant(1.0, lt)?,
        Sens::Input => {
            let index = g.inputs().len();
            g.add_leaf(Op::Input { index, name: SENS.into() }, lt, &scope)?
        }
    };
    let mut ct: HashMap<NodeId, NodeId> = HashMap::from([(loss, sens)]);
    for &n in order.iter().rev() {
        let Some(&dy) = ct.get(&n) else { continue };
        let xs = g.operands(n);
        if !xs.iter().any(|x| active.contains(x)) {
            continue;
        }
        let node = g.node(n).clone();
        let mut e = Emit::new(g, grad_scope(&node.scope));
        let dxs = vjp(&mut e, &node.op, &xs, n, dy)?.ok_or_else(|| IrError::NoGradient { scope: node.scope.clone(), op: node.op.name(), node: n })?;
        for (x, dx) in xs.into_iter().zip(dxs) {
            let Some(dx) = dx.filter(|_| active.contains(&x)) else { continue };
            let sum = match ct.get(&x) {
                Some(&prev) => e.add(prev, dx)?,
                None => dx,
            };
            ct.insert(x, sum);
        }
    }
    let mut grads = Vec::with_capacity(wrt.len());
    for &w in wrt {
        let d = match ct.get(&w) {
            Some(&d) => d,
            None => {
                let t = g.ty(w).clone();
                let s = grad_scope(&g.node(w).scope);
                Emit::new(g, s).constant(0.0, t)?
            }
        };
        grads.push(d);
    }
    Ok(Gradients { grads, sens })
}

/// Nodes that depend on some `wrt` node and that `loss` depends on.
fn active_nodes(g: &Graph, order: &[NodeId], loss: NodeId, wrt: &[NodeId]) -> HashSet<NodeId> {
    let mut fwd: HashSet<NodeId> = wrt.iter().copied().collect();
    for &n in order {
        if g.operands(n).iter().any(|o| fwd.contains(o)) {
            fwd.insert(n);
        }
    }
    let mut back: HashSet<NodeId> = HashSet::from([loss]);
    for &n in order.iter().rev() {
        if back.contains(&n) {
            back.extend(g.operands(n));
        }
    }
    fwd.intersection(&back).copied().collect()
}

/// The keep-dims shape of a reduction of `x` over `axes`.
fn kept_shape(x: &Shape, axes: &[usize]) -> Shape {
    Shape(x.0.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect())
}

/// The gradient table: given node `y = op(xs)` and its cotangent `g`, the cotangent of each
/// operand (`None`: no gradient flows to it). Each rule is a few lines. `Ok(None)` means the
/// op has no gradient rule at all.
pub fn vjp(e: &mut Emit, op: &Op, xs: &[NodeId], y: NodeId, g: NodeId) -> Result<Option<Vec<Option<NodeId>>>> {
    let s = |e: &Emit, i: usize| e.g.ty(xs[i]).shape.clone();
    Ok(Some(match op {
        Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => vec![],
        Op::Add => vec![Some(e.unbroadcast(g, &s(e, 0))?), Some(e.unbroadcast(g, &s(e, 1))?)],
        Op::Sub => {
            let nb = e.neg(g)?;
            vec![Some(e.unbroadcast(g, &s(e, 0))?), Some(e.unbroadcast(nb, &s(e, 1))?)]
        }
        Op::Mul => {
            let (ga, gb) = (e.mul(g, xs[1])?, e.mul(g, xs[0])?);
            vec![Some(e.unbroadcast(ga, &s(e, 0))?), Some(e.unbroadcast(gb, &s(e, 1))?)]
        }
        Op::Div => {
            let ga = e.div(g, xs[1])?;
            let gy = e.mul(ga, y)?;
            let gb = e.neg(gy)?;
            vec![Some(e.unbroadcast(ga, &s(e, 0))?), Some(e.unbroadcast(gb, &s(e, 1))?)]
        }
        Op::Neg => vec![Some(e.neg(g)?)],
        // y = sum over ranks of x_r: every rank's loss reads y, so x_r's cotangent is the
        // sum over ranks of theirs.
        Op::AllReduce => vec![Some(e.op(Op::AllReduce, &[g])?)],
        Op::Exp => vec![Some(e.mul(g, y)?)],
        Op::Log => vec![Some(e.div(g, xs[0])?)],
        Op::Relu => vec![Some(e.op(Op::ReluGrad, &[g, y])?)],
        Op::Sqrt => {
            let two_y = e.scale(y, 2.0)?;
            vec![Some(e.div(g, two_y)?)]
        }
        Op::GreaterEqual | Op::Equal => vec![None, None],
        Op::Tanh => {
            // 1 - y^2
            let yy = e.mul(y, y)?;
            let one = e.scalar_like(1.0, yy)?;
            let d = e.sub(one, yy)?;
            vec![Some(e.mul(g, d)?)]
        }
        Op::Erf => {
            // 2/sqrt(pi) exp(-x^2)
            let xx = e.mul(xs[0], xs[0])?;
            let nxx = e.neg(xx)?;
            let ex = e.op(Op::Exp, &[nxx])?;
            let d = e.scale(ex, std::f64::consts::FRAC_2_SQRT_PI)?;
            vec![Some(e.mul(g, d)?)]
        }
        Op::CausalMask { .. } => vec![Some(e.op(Op::CausalMask { fill: 0.0 }, &[g])?)],
        Op::Attention { heads, causal } => vec![Some(e.op(Op::AttentionGrad { heads: *heads, causal: *causal }, &[xs[0], g])?)],
        // y = x * m: the same mask on the cotangent.
        Op::Dropout { .. } => vec![Some(e.op(op.clone(), &[g, xs[1], xs[2]])?), None, None],
        Op::Gather => {
            let rows = s(e, 0).0[0];
            vec![Some(e.op(Op::ScatterAdd { rows }, &[xs[1], g])?), None]
        }
        Op::Select => {
            let z = e.op(Op::ZerosLike, &[g])?;
            let (ga, gb) = (e.op(Op::Select, &[xs[0], g, z])?, e.op(Op::Select, &[xs[0], z, g])?);
            vec![None, Some(e.unbroadcast(ga, &s(e, 1))?), Some(e.unbroadcast(gb, &s(e, 2))?)]
        }
        Op::ReluGrad => vec![Some(e.op(Op::ReluGrad, &[g, xs[1]])?), None],
        Op::Cast { .. } => {
            let dtype = e.g.ty(xs[0]).dtype;
            vec![Some(e.op(Op::Cast { dtype }, &[g])?)]
        }
        Op::ZerosLike | Op::StopGradient => vec![None],
        // Straight through: the rounding error is not differentiated.
        Op::RoundTo { .. } => vec![Some(g)],
        Op::Broadcast { .. } => vec![Some(e.unbroadcast(g, &s(e, 0))?)],
        Op::Reshape { .. } | Op::Flatten => vec![Some(e.reshape(g, s(e, 0))?)],
        Op::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(e.op(Op::Transpose { perm: inv }, &[g])?)]
        }
        Op::Slice { begin, end } => {
            let hi = s(e, 0).0.iter().zip(end).map(|(d, e)| d - e).collect();
            vec![Some(e.op(Op::Pad { lo: begin.clone(), hi }, &[g])?)]
        }
        Op::Pad { lo, .. } => {
            let end = s(e, 0).0.iter().zip(lo).map(|(d, l)| d + l).collect();
            vec![Some(e.op(Op::Slice { begin: lo.clone(), end }, &[g])?)]
        }
        Op::Concat { axis } => {
            let mut out = Vec::new();
            let mut off = 0;
            let full = e.ty(g).shape;
            for i in 0..xs.len() {
                let xi = s(e, i);
                let mut begin = vec![0; full.rank()];
                let mut end = full.0.clone();
                begin[*axis] = off;
                end[*axis] = off + xi.0[*axis];
                off = end[*axis];
                out.push(Some(e.op(Op::Slice { begin, end }, &[g])?));
            }
            out
        }
        Op::ReduceSum(r) => {
            let k = e.reshape(g, kept_shape(&s(e, 0), &r.axes))?;
            vec![Some(e.broadcast(k, s(e, 0))?)]
        }
        Op::ReduceMean(r) => {
            let x = s(e, 0);
            let count: usize = r.axes.iter().map(|&a| x.0[a]).product();
            let k = e.reshape(g, kept_shape(&x, &r.axes))?;
            let b = e.broadcast(k, x)?;
            vec![Some(e.scale(b, 1.0 / count as f64)?)]
        }
        Op::ReduceMax(r) => vec![Some(e.op(Op::ReduceMaxGrad(r.clone()), &[xs[0], y, g])?)],
        Op::MatMul { transpose_a: ta, transpose_b: tb } => {
            let (a, b) = (xs[0], xs[1]);
            let (da, db) = match (ta, tb) {
                (false, false) => (e.matmul(g, b, false, true)?, e.matmul(a, g, true, false)?),
                (false, true) => (e.matmul(g, b, false, false)?, e.matmul(g, a, true, false)?),
                (true, false) => (e.matmul(b, g, false, true)?, e.matmul(a, g, false, false)?),
                (true, true) => (e.matmul(b, g, true, true)?, e.matmul(g, a, true, true)?),
            };
            vec![Some(da), Some(db)]
        }
        Op::SoftmaxCrossEntropy { sparse, reduction } => {
            let grad_op = Op::SoftmaxCrossEntropyGrad { sparse: *sparse, reduction: *reduction };
            vec![Some(e.op(grad_op, &[xs[0], xs[1], g])?), None]
        }
        Op::Conv2d(c) => {
            let dx = Op::Conv2dBackpropInput { conv: c.clone(), input_shape: s(e, 0) };
            let dw = Op::Conv2dBackpropFilter { conv: c.clone(), filter_shape: s(e, 1) };
            vec![Some(e.op(dx, &[g, xs[1]])?), Some(e.op(dw, &[g, xs[0]])?)]
        }
        Op::MaxPool2d(p) => vec![Some(e.op(Op::MaxPool2dGrad(p.clone()), &[xs[0], g])?)],
        Op::AvgPool2d(p) => vec![Some(e.op(Op::AvgPool2dGrad(p.clone()), &[xs[0], g])?)],
        Op::ReduceMaxGrad(_)
        | Op::ScatterAdd { .. }
        | Op::AttentionGrad { .. }
        | Op::SoftmaxCrossEntropyGrad { .. }
        | Op::Conv2dBackpropInput { .. }
        | Op::Conv2dBackpropFilter { .. }
        | Op::MaxPool2dGrad(_)
        | Op::AvgPool2dGrad(_)
        | Op::Assign
        | Op::AssignAdd
        | Op::Fused { .. }
        | Op::Epilogue { .. } => return Ok(None),
    }))
}

/// Reduce attributes for summing every axis of a rank-`r` tensor.
pub fn all_axes(r: usize, keep_dims: bool) -> ReduceAttrs {
    ReduceAttrs { axes: (0..r).collect(), keep_dims }
}

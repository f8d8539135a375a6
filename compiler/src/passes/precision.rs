//! Mixed precision by emulation: every value a micro-step computes is rounded to the compute
//! format (bf16 or f16) where it is stored, while the arithmetic inside each op stays f32, as
//! tensor cores and autocast do (products and sums accumulate in f32, results are stored in
//! low precision). The graph keeps its f32 types; `round_to` nodes mark the stores.
//!
//! What is rounded: the parameters as the network reads them (the low-precision copy of each
//! f32 master weight), the float inputs, and the result of every op that makes new values and
//! is read by anything but elementwise arithmetic. A value that only elementwise arithmetic
//! reads stays f32: a chain of elementwise ops (GELU, a normalisation, their gradients) is
//! computed in f32 and rounded where a product, a reduction, a move, a loss or an update
//! reads it, as a fused kernel keeps its intermediates in registers and rounds what it stores,
//! and as one PyTorch op under autocast (`gelu`, `gelu_backward`) rounds once. The rule reads
//! the graph, not the fuser's choices, so a fused plan and an unfused one give the same bits.
//! What is not: the graph's outputs (the loss and the token count stay f32, as autocast keeps
//! losses), the loss-scale seed (`sens`), state and what only state is made from (a parameter
//! the graph writes, read for its update, and the terms of its new value: BatchNorm's moving
//! statistics are read, updated and stored in f32, as master weights are), and results of ops that only move, select or
//! mask values already rounded (reshapes, transposes, slices, max pooling, ReLU...), which
//! rounding would leave unchanged. Constants are rounded in place.

use std::collections::{HashMap, HashSet};

use crate::autodiff::SENS;
use crate::graph::{Graph, NodeId};
use crate::op::Op;
use crate::program::ElementOp;
use crate::types::DType;

/// Whether `op`'s result is made of its operands' values (or zeros, or a fill), so that it
/// holds only low-precision values when its float operands do.
pub fn moves_values(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. }
            | Op::Flatten
            | Op::Transpose { .. }
            | Op::Broadcast { .. }
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::Select
            | Op::StopGradient
            | Op::ZerosLike
            | Op::Relu
            | Op::ReluGrad
            | Op::Neg
            | Op::MaxPool2d(_)
            | Op::ReduceMax(_)
            | Op::Gather
            | Op::CausalMask { .. }
            | Op::RoundTo { .. }
    )
}

/// Rounds the values `g` computes to `dtype` (F16 or BF16), leaving the graph's outputs in
/// f32. Returns each rounded node's `round_to` node.
pub fn round_values(g: &mut Graph, dtype: DType) -> HashMap<NodeId, NodeId> {
    debug_assert!(matches!(dtype, DType::F16 | DType::BF16));
    let outputs: Vec<NodeId> = g.outputs().to_vec();
    let state = state_values(g);
    let mut rounded = HashMap::new();
    for id in g.ids() {
        let node = g.node(id);
        // Values only state is computed from stay f32, and so do reads of state.
        if node.ty.dtype != DType::F32 || outputs.contains(&id) || node.op.is_effect() || moves_values(&node.op) || state.contains(&id) {
            continue;
        }
        match &node.op {
            Op::Constant { value } => {
                let value = round_f64(*value, dtype);
                g.node_mut(id).op = Op::Constant { value };
                continue;
            }
            Op::Input { name, .. } if name == SENS => continue,
            _ => {}
        }
        // A value only elementwise arithmetic reads stays f32, as in the registers of a fused
        // kernel (see the module's doc); a leaf (a parameter or an input) is rounded as read.
        if g.users(id).is_empty() || (!g.node(id).op.is_leaf() && read_by_arithmetic(g, id, 0)) {
            continue;
        }
        let scope = g.node(id).scope.clone();
        let ty = g.node(id).ty.clone();
        let r = g.add_unchecked(Op::RoundTo { dtype }, &[id], ty, &scope);
        g.replace_uses_except(id, r, r);
        rounded.insert(id, r);
    }
    rounded
}

/// Whether every reader of `id` is elementwise arithmetic: an op that makes new values from
/// it (an add, an exp...), or a negation, ReLU or ReLU's gradient (which move values and so
/// are not rounded themselves) whose own readers all are.
fn read_by_arithmetic(g: &Graph, id: NodeId, depth: usize) -> bool {
    g.users(id).iter().all(|&u| {
        let op = &g.node(u).op;
        match ElementOp::of(op) {
            Some(_) if !moves_values(op) => true,
            Some(_) => depth < 8 && !g.outputs().contains(&u) && !g.users(u).is_empty() && read_by_arithmetic(g, u, depth + 1),
            None => false,
        }
    })
}

/// State and what only state is made from: the parameters the graph writes (BatchNorm's moving
/// statistics; their reads), and the values whose every use is a write of state or another such
/// value (the statistics' new values and their terms). Kept f32, as autocast keeps them.
fn state_values(g: &Graph) -> HashSet<NodeId> {
    let mut state = HashSet::new();
    let order = g.topo_order().unwrap_or_default();
    for &id in order.iter().rev() {
        let users = g.users(id);
        let writes = |u: NodeId| g.node(u).op.is_effect() && g.operands(u).first() == Some(&id);
        let feeds = |u: NodeId| (g.node(u).op.is_effect() && !writes(u)) || state.contains(&u);
        if users.iter().any(|&u| writes(u)) || (!users.is_empty() && users.iter().all(|&u| feeds(u))) {
            state.insert(id);
        }
    }
    state
}

/// `x` as f32, rounded to the nearest value of `dtype` (F16 or BF16; ties to even; past the
/// largest finite value, infinity), as the runtime rounds.
pub fn round_f64(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_f32(x as f32).to_f64(),
        DType::BF16 => half::bf16::from_f32(x as f32).to_f64(),
        _ => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::ReduceAttrs;
    use crate::passes::testing::leaf;
    use crate::types::TensorType;

    /// State (a moving statistic) is read, updated and written in f32: neither its read nor the
    /// terms of its new value are rounded, and its `assign` still writes the parameter; the
    /// batch value it shares with the network is rounded for the network.
    #[test]
    fn state_and_its_update_stay_f32() {
        let mut g = Graph::new("g");
        let x = leaf(&mut g, "x", vec![3]);
        let m = g.add_leaf(Op::Parameter { name: "moving".into() }, TensorType::f32(vec![3]), "bn").unwrap();
        let c = g.add_leaf(Op::Constant { value: 0.9 }, TensorType::f32(vec![3]), "bn").unwrap();
        let e = g.add(Op::Exp, &[x], "t").unwrap();
        let d = g.add(Op::Mul, &[m, c], "bn").unwrap();
        let n = g.add(Op::Add, &[d, e], "bn").unwrap();
        g.add(Op::Assign, &[m, n], "bn").unwrap();
        let y = g.add(Op::Mul, &[e, e], "t").unwrap();
        g.set_outputs(vec![y]);
        let rounded = round_values(&mut g, DType::BF16);
        let mut keys: Vec<NodeId> = rounded.keys().copied().collect();
        keys.sort();
        // `e` is read by elementwise ops only (the state's `add` and the output's `mul`).
        assert_eq!(keys, vec![x]);
        assert_eq!(g.operands(d), vec![m, c]);
        assert_eq!(g.node(c).op, Op::Constant { value: 0.9 }, "the momentum of a state update is not rounded");
        crate::verify(&g).unwrap();
    }

    /// An input read and products read by a reshape or a reduction are rounded; an exp only a
    /// product reads stays f32 (elementwise arithmetic reads it, as in a fused kernel's
    /// registers), and so does one read by a negation that a product reads; an exp a ReLU
    /// reads and a reshape reads the ReLU is rounded (the ReLU only moves values, and does not
    /// round); a reshape of a rounded value and the output are not rounded; a constant is
    /// rounded in place.
    #[test]
    fn stores_are_rounded_and_moves_are_not() {
        let mut g = Graph::new("g");
        let x = leaf(&mut g, "x", vec![2, 3]);
        let c = g.add_leaf(Op::Constant { value: 0.1 }, TensorType::f32(vec![2, 3]), "t").unwrap();
        let e = g.add(Op::Exp, &[x], "t").unwrap();
        let m = g.add(Op::Mul, &[e, c], "t").unwrap();
        let r = g.add(Op::Reshape { shape: vec![6].into() }, &[m], "t").unwrap();
        let s = g.add(Op::ReduceSum(ReduceAttrs { axes: vec![0], keep_dims: false }), &[r], "t").unwrap();
        let e2 = g.add(Op::Exp, &[x], "t").unwrap();
        let relu = g.add(Op::Relu, &[e2], "t").unwrap();
        let r2 = g.add(Op::Reshape { shape: vec![6].into() }, &[relu], "t").unwrap();
        let s2 = g.add(Op::ReduceSum(ReduceAttrs { axes: vec![0], keep_dims: false }), &[r2], "t").unwrap();
        let e3 = g.add(Op::Exp, &[x], "t").unwrap();
        let n3 = g.add(Op::Neg, &[e3], "t").unwrap();
        let m3 = g.add(Op::Mul, &[n3, c], "t").unwrap();
        let s3 = g.add(Op::ReduceSum(ReduceAttrs { axes: vec![0, 1], keep_dims: false }), &[m3], "t").unwrap();
        g.set_outputs(vec![s, s2, s3]);
        let rounded = round_values(&mut g, DType::BF16);
        let mut keys: Vec<NodeId> = rounded.keys().copied().collect();
        keys.sort();
        // `e3` is read by a negation that arithmetic reads: f32 through both.
        assert_eq!(keys, vec![x, m, e2, m3]);
        assert_eq!(g.node(c).op, Op::Constant { value: 0.10009765625 });
        // Each user reads the rounded node, and `mul` reads `e` as it is.
        assert_eq!(g.operands(e), vec![rounded[&x]]);
        assert_eq!(g.operands(m)[0], e);
        assert_eq!(g.operands(r), vec![rounded[&m]]);
        assert_eq!(g.operands(relu), vec![rounded[&e2]]);
        assert_eq!(g.outputs(), &[s, s2, s3]);
        assert_eq!(g.operands(n3), vec![e3]);
        assert_eq!(round_f64(65520.0, DType::F16), f64::INFINITY);
        assert_eq!(round_f64(65519.0, DType::F16), 65504.0);
    }
}

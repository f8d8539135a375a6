//! Cost estimates per node: floating-point operations (a multiply-add counts 2) and the
//! bytes of parameters a graph reads. `cellgraph inspect` reports them.

use crate::graph::{Graph, NodeId};
use crate::op::Op;
use crate::program::{ElementOp, Program, Unary};
use crate::types::TensorType;

/// Estimated floating-point operations of one node.
pub fn node_flops(g: &Graph, id: NodeId) -> u64 {
    let args: Vec<&TensorType> = g.operands(id).into_iter().map(|o| g.ty(o)).collect();
    op_flops(&g.node(id).op, &g.node(id).ty, &args)
}

/// Estimated floating-point operations of `op` producing `out` from operands of types `args`.
fn op_flops(op: &Op, out_ty: &TensorType, args: &[&TensorType]) -> u64 {
    let out = out_ty.numel() as u64;
    let arg = |i: usize| args[i];
    // Multiply-adds of a convolution producing `y` from `x`-shaped input with `w`'s window.
    let conv = |y: &[usize], w: &[usize]| 2 * y.iter().product::<usize>() as u64 * (w[1] * w[2] * w[3]) as u64;
    let program = |expr: &Program| {
        let weight = |op: ElementOp| match op {
            ElementOp::Unary(Unary::Exp | Unary::Log) => 4,
            ElementOp::Unary(Unary::Tanh | Unary::Erf) => 8,
            ElementOp::Unary(_) | ElementOp::Binary(_) => 1,
        };
        out * expr.steps().iter().filter_map(|s| s.op()).map(weight).sum::<u64>()
    };
    match op {
        Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => 0,
        Op::Broadcast { .. } | Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Pad { .. } => 0,
        Op::Concat { .. } | Op::Flatten | Op::Cast { .. } | Op::ZerosLike | Op::Assign | Op::StopGradient => 0,
        Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Neg | Op::Relu | Op::ReluGrad | Op::Sqrt => out,
        Op::GreaterEqual | Op::Select | Op::AssignAdd | Op::AllReduce => out,
        Op::Equal | Op::CausalMask { .. } | Op::Gather | Op::RoundTo { .. } => out,
        Op::Dropout { .. } => 4 * out,
        Op::ScatterAdd { .. } => arg(1).numel() as u64,
        Op::Tanh | Op::Erf => 8 * out,
        Op::Exp | Op::Log => 4 * out,
        Op::ReduceSum(_) | Op::ReduceMean(_) | Op::ReduceMax(_) => arg(0).numel() as u64,
        Op::ReduceMaxGrad(_) => 3 * out,
        Op::MatMul { transpose_a, .. } => {
            let a = arg(0);
            let r = a.rank();
            let k = if *transpose_a { a.dims()[r - 2] } else { a.dims()[r - 1] };
            2 * out * k as u64
        }
        Op::SoftmaxCrossEntropy { .. } | Op::SoftmaxCrossEntropyGrad { .. } => 6 * arg(0).numel() as u64,
        Op::Conv2d(_) => conv(out_ty.dims(), arg(1).dims()),
        Op::Conv2dBackpropInput { .. } => conv(arg(0).dims(), arg(1).dims()),
        Op::Conv2dBackpropFilter { filter_shape, .. } => conv(arg(0).dims(), &filter_shape.0),
        Op::MaxPool2d(p) | Op::AvgPool2d(p) => out * (p.kernel[0] * p.kernel[1]) as u64,
        Op::MaxPool2dGrad(p) | Op::AvgPool2dGrad(p) => arg(1).numel() as u64 * (p.kernel[0] * p.kernel[1]) as u64,
        // Two products of T x T scores by D per head (the forward; four more and the scores
        // again for the gradient), half of them under a causal mask, and the softmax (8 per
        // score of each head).
        Op::Attention { heads, causal } | Op::AttentionGrad { heads, causal } => {
            let [b, t, c3] = [0, 1, 2].map(|i| arg(0).dims()[i] as u64);
            let pairs = if *causal { t * (t + 1) / 2 } else { t * t };
            let products = if matches!(op, Op::Attention { .. }) { 2 } else { 5 };
            b * pairs * (products * 2 * c3 / 3 + 8 * *heads as u64)
        }
        Op::Fused { expr } => program(expr),
        Op::Epilogue { head, expr } => op_flops(head, out_ty, &args[..head.arity().min()]) + program(expr),
    }
}

/// Estimated floating-point operations of the whole graph.
pub fn flops(g: &Graph) -> u64 {
    g.ids().into_iter().map(|id| node_flops(g, id)).sum()
}

/// Bytes of the parameters (trainable, accumulators, optimizer state) the graph reads.
pub fn parameter_bytes(g: &Graph) -> usize {
    g.parameters().into_iter().map(|(id, _)| g.ty(id).size_bytes()).sum()
}

//! Elementwise fusion: chains of elementwise ops become one `fused` node.
//!
//! Producer into consumer, in topological order. An elementwise node (add, sub, mul, div,
//! neg, exp, log, tanh, erf, relu, relu_grad, sqrt, or a node already fused) takes in:
//! - an elementwise operand that nothing else reads, that is not an output, and that has the
//!   consumer's extents (so no element is computed twice);
//! - a cheap one (one add, sub, mul, neg, relu or relu_grad over at most one operand of its
//!   extents) that other elementwise nodes of its type read, each of which then computes it
//!   again (see `duplicable`): the tensor is never written out; so is a large one with one
//!   `erf`, `exp` or `tanh` among at most three ops that two nodes read (GELU's
//!   `erf(x * 0.7071) + 1`), the second computing the function again;
//! - a float `constant` of one element, as a literal;
//! - the operand of a `broadcast` it reads, in the broadcast's place, when the program's
//!   implicit (right-aligned) broadcasting gives the same type: the program reads the small
//!   tensor strided instead of a materialised copy (batch norm's gradients broadcast
//!   per-channel values over N, H, W). This alone makes a one-op node `fused`.
//!
//! A node that ends up holding two or more ops becomes one `fused` node with the consumer's
//! scope, and the producers it took in are removed. The ops and their order are unchanged, so
//! the fused plan computes the same bits as the unfused one (`compile` can run either).

use crate::graph::{Graph, NodeId};
use crate::op::Op;
use crate::program::{Binary, ElementOp, Program, Unary, Val};

/// A node as a program over its own operands: its body when fused, one step when elementwise.
pub(super) fn body(g: &Graph, id: NodeId) -> Option<(Program, Vec<NodeId>)> {
    let n = g.node(id);
    if !n.ty.dtype.is_float() {
        return None;
    }
    let xs = g.operands(id);
    match &n.op {
        Op::Fused { expr } => Some((expr.clone(), xs)),
        op => Some((Program::of_op(op, xs.len())?, xs)),
    }
}

/// A float constant of one element, as a literal.
fn literal(g: &Graph, id: NodeId) -> Option<f64> {
    match g.node(id).op {
        Op::Constant { value } if g.ty(id).dtype.is_float() && g.ty(id).numel() == 1 => Some(value),
        _ => None,
    }
}

/// True when `consumer` (with operands `xs`) may take in its operand `x`, an elementwise
/// node: read once, by `consumer` alone, not an output, of the consumer's type.
pub(super) fn absorbable(g: &Graph, x: NodeId, consumer: NodeId, xs: &[NodeId]) -> bool {
    g.ty(x) == g.ty(consumer) && !g.outputs().contains(&x) && g.users(x).iter().all(|&u| u == consumer) && xs.iter().filter(|&&o| o == x).count() == 1
}

/// The longest program (in postfix terms) that computing cheap operands again may make.
const MAX_COPYING_TERMS: usize = 48;

/// The fewest elements of a node with a dear op ([`duplicable`]) that a second reader computes
/// again: 512 KiB of f32, past a core's share of L2 on the machines we run on, so the tensor
/// would stream from memory.
const MIN_DEAR_COPIED: usize = 1 << 17;

/// True when each reader of `x`, a cheap elementwise node several read (or one reads twice),
/// may compute it in its own program: `x` is one add, sub, mul, neg, relu or
/// relu_grad whose operands other than literals include at most one of its own extents, it
/// is not an output, and every node reading it is elementwise of its type, so each takes it
/// in and `x` is never written out (batch norm's `x - mean`, squared for the variance and
/// divided by the deviation). Each reader then reads `x`'s one large operand instead of
/// `x`, and the pass over memory that wrote `x` is gone (GELU's `x * 0.7071` and `x * 0.5`,
/// which its gradient reads too). The readers compute the same op on the same values: the
/// bits do not change.
///
/// Under bf16 or f16 compute the op's value is rounded as it is stored (`passes::precision`):
/// the op and its `round_to`, one `fused` node by then, are computed again as well (GELU's
/// `x * 0.7071` and `x * 0.5` in bf16 were two programs of their own, four passes over the
/// MLP's widest activation: 3% of the GPT's step on a CPU whose elementwise programs wait on
/// memory).
///
/// A dearer node is computed again too, by a second reader only, when it is large enough to
/// stream from memory ([`MIN_DEAR_COPIED`] elements): one `erf`, `exp` or `tanh` among at most
/// three ops, the others cheap, unrounded (GELU's `erf(x * 0.7071) + 1`, which its forward's
/// product and its gradient both read). The second reader computes the function again, and
/// the tensor is neither written nor read twice: on one core of an AMX Xeon the bf16 GPT's
/// elementwise programs took 1,274 ms of a 20-update run instead of 1,398 and its step 3.8%
/// less (medians of 8 alternated pairs), though alone, with its operands hot, the gradient's
/// program was 190 us dearer and the two of the forward 157 us cheaper.
fn duplicable(g: &Graph, x: NodeId) -> bool {
    let Some((prog, ys)) = body(g, x) else { return false };
    let cheap = |op: ElementOp| {
        matches!(op, ElementOp::Unary(Unary::Neg | Unary::Relu) | ElementOp::Binary(Binary::Add | Binary::Sub | Binary::Mul | Binary::ReluGrad))
    };
    let rounding = |op: ElementOp| matches!(op, ElementOp::Unary(Unary::RoundBf16 | Unary::RoundF16));
    let dear = |op: ElementOp| matches!(op, ElementOp::Unary(Unary::Erf | Unary::Exp | Unary::Tanh));
    // One cheap op, or one and the rounding of its value (a program is one tree: an op, then
    // a unary op, is that op of the first's value); or one dear op among cheap ones, large,
    // read by two nodes.
    let ops: Vec<ElementOp> = prog.steps().iter().filter_map(|s| s.op()).collect();
    let readers = g.users(x);
    let one_dear = ops.len() <= 3
        && ops.iter().filter(|&&op| dear(op)).count() == 1
        && ops.iter().all(|&op| cheap(op) || dear(op))
        && readers.len() <= 2
        && g.ty(x).numel() >= MIN_DEAR_COPIED;
    let one = one_dear
        || match (&g.node(x).op, &ops[..]) {
            (Op::Fused { .. }, &[op, r]) => cheap(op) && rounding(r),
            (Op::Fused { .. }, _) => false,
            (_, ops) => ops.iter().all(|&op| cheap(op)),
        };
    let ty = g.ty(x);
    let large = ys.iter().filter(|&&y| literal(g, y).is_none() && g.ty(y).numel() >= ty.numel()).count();
    one && large <= 1 && !g.outputs().contains(&x) && g.users(x).iter().all(|&u| g.ty(u) == ty && body(g, u).is_some())
}

/// Builds programs over a growing operand list, one slot per distinct operand.
struct Builder {
    prog: Program,
    operands: Vec<NodeId>,
    /// Read a broadcast's operand in its place.
    through: bool,
    /// The broadcasts read through.
    broadcasts: Vec<NodeId>,
}

impl Builder {
    /// The value reading node `x`: a literal, or an operand.
    fn read(&mut self, g: &Graph, x: NodeId) -> Val {
        if let Some(v) = literal(g, x) {
            return Val::lit(v);
        }
        let x = match (self.through, &g.node(x).op) {
            (true, Op::Broadcast { .. }) => {
                self.broadcasts.push(x);
                g.operands(x)[0]
            }
            _ => x,
        };
        let i = self.operands.iter().position(|&o| o == x).unwrap_or_else(|| {
            self.operands.push(x);
            self.operands.len() - 1
        });
        Val::Arg(u8::try_from(i).expect("a fused node of at most 256 operands"))
    }
}

/// Fuses the graph's elementwise chains; returns how many `fused` nodes it made (or grew).
///
/// A round takes each node's producers in one level deep, so it runs rounds until one
/// changes nothing: an operand that two producers read (a per-channel factor that both
/// terms of a sum scale by) becomes absorbable only once they are one node.
pub fn fuse_elementwise(g: &mut Graph) -> usize {
    let mut made = 0;
    loop {
        match fuse_round(g) {
            0 => return made,
            n => made += n,
        }
    }
}

fn fuse_round(g: &mut Graph) -> usize {
    let order = g.topo_order().expect("the pipeline verifies before every pass");
    let mut made = 0;
    for id in order {
        let Some((prog, xs)) = body(g, id) else { continue };
        let scope = g.node(id).scope.clone();
        let ty = g.ty(id).clone();
        // With broadcasts read through first; without, when that changes the type. Cheap
        // operands computed again only while the program stays short (a chain of squares
        // would double it at every link).
        let attempts = [(true, true), (false, true), (true, false), (false, false)];
        let built = attempts.into_iter().find_map(|(through, copy)| {
            let (b, taken) = splice(g, id, &prog, &xs, through, copy);
            if copy && !taken.1.is_empty() && b.prog.terms() > MAX_COPYING_TERMS {
                return None;
            }
            let expr = b.prog.clone();
            let changed = expr.ops() >= 2 || !b.broadcasts.is_empty();
            if !changed || b.operands.is_empty() || matches!(&g.node(id).op, Op::Fused { expr: e } if *e == expr) {
                return None;
            }
            // Literals drop their constants' extents: keep the rewrite only when the type holds.
            let fits = expr.infer(&b.operands.iter().map(|&o| g.ty(o)).collect::<Vec<_>>()).is_ok_and(|t| t == ty);
            fits.then_some((b, taken, expr))
        });
        let Some((b, (taken, copied), expr)) = built else { continue };
        let fused = g.add_unchecked(Op::Fused { expr }, &b.operands, ty, &scope);
        let mut constants = xs.clone();
        for &x in taken.iter().chain(&copied) {
            constants.extend(g.operands(x));
        }
        constants.retain(|&c| literal(g, c).is_some());
        g.replace_uses(id, fused);
        g.remove(id);
        for x in taken {
            g.remove(x);
        }
        // A copied node goes when its last reader has taken it in.
        for x in copied {
            if g.users(x).is_empty() {
                g.remove(x);
            }
        }
        for c in constants.into_iter().chain(b.broadcasts) {
            if g.contains(c) && g.users(c).is_empty() && !g.outputs().contains(&c) {
                g.remove(c);
            }
        }
        made += 1;
    }
    made
}

/// `id`'s program with its absorbable elementwise operands spliced in, and those operands:
/// the ones it alone reads, and the cheap ones it computes again ([`duplicable`]).
fn splice(g: &Graph, id: NodeId, prog: &Program, xs: &[NodeId], through: bool, copy: bool) -> (Builder, (Vec<NodeId>, Vec<NodeId>)) {
    let mut b = Builder { prog: Program::new(), operands: Vec::new(), through, broadcasts: Vec::new() };
    let (mut taken, mut copied) = (Vec::new(), Vec::new());
    let mut out = Program::new();
    let v = prog.rebuild(prog.result(), &mut out, &mut |i, out| {
        let x = xs[i as usize];
        let alone = absorbable(g, x, id, xs);
        match body(g, x).filter(|_| alone || (copy && duplicable(g, x))) {
            Some((inner, ys)) => {
                if alone {
                    taken.push(x);
                } else if !copied.contains(&x) {
                    copied.push(x);
                }
                inner.rebuild(inner.result(), out, &mut |j, _| b.read(g, ys[j as usize]))
            }
            None => b.read(g, x),
        }
    });
    out.write(0, v);
    b.prog = out;
    (b, (taken, copied))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testing::leaf;
    use crate::types::{Shape, TensorType};

    #[test]
    fn a_broadcast_operand_is_read_in_place_when_the_type_holds() {
        let mut g = Graph::new("g");
        let (x, a) = (leaf(&mut g, "x", vec![2, 4, 3, 3]), leaf(&mut g, "a", vec![1, 4, 1, 1]));
        let wide = g.add(Op::Broadcast { shape: Shape(vec![2, 4, 3, 3]) }, &[a], "t").unwrap();
        let y = g.add(Op::Mul, &[wide, x], "net.bn").unwrap();
        // Needed for its type: [3] + [1] would be [3], not [2, 3].
        let (c, d) = (leaf(&mut g, "c", vec![3]), leaf(&mut g, "d", vec![1]));
        let cw = g.add(Op::Broadcast { shape: Shape(vec![2, 3]) }, &[c], "t").unwrap();
        let z = g.add(Op::Add, &[cw, d], "t").unwrap();
        g.set_outputs(vec![y, z]);
        assert_eq!(fuse_elementwise(&mut g), 1);
        let out = g.outputs()[0];
        assert_eq!(g.node(out).op, Op::Fused { expr: "$0 $1 mul".parse().unwrap() });
        assert_eq!(g.operands(out), vec![a, x]);
        assert!(!g.contains(wide), "the unused broadcast is removed");
        assert_eq!((g.outputs()[1], g.operands(z)), (z, vec![cw, d]));
    }

    /// GELU's `x * 0.5`, read by the forward's product and by the gradient, and batch norm's
    /// `x - mean`, squared and divided: each reader computes them again and they are never
    /// written out. A node a reduction also reads, or one with two operands of its extents,
    /// stays.
    #[test]
    fn a_cheap_shared_operand_is_computed_again_by_each_reader() {
        let mut g = Graph::new("g");
        let (x, y) = (leaf(&mut g, "x", vec![2, 3]), leaf(&mut g, "y", vec![2, 3]));
        let half = g.add_leaf(Op::Constant { value: 0.5 }, TensorType::f32(Shape::scalar()), "t").unwrap();
        let h = g.add(Op::Mul, &[x, half], "t").unwrap();
        let e = g.add(Op::Exp, &[h], "t").unwrap();
        let f = g.add(Op::Add, &[h, y], "t").unwrap();
        // Stays: a reduction reads it.
        let k = g.add(Op::Neg, &[y], "t").unwrap();
        let ke = g.add(Op::Exp, &[k], "t").unwrap();
        let ks = g.add(Op::ReduceSum(crate::op::ReduceAttrs { axes: vec![1], keep_dims: false }), &[k], "t").unwrap();
        // Stays: two operands of its extents.
        let xy = g.add(Op::Mul, &[x, y], "t").unwrap();
        let xy1 = g.add(Op::Exp, &[xy], "t").unwrap();
        let xy2 = g.add(Op::Sqrt, &[xy], "t").unwrap();
        // Batch norm's `x - mean`, squared (read twice) for the variance, and divided.
        let mean = leaf(&mut g, "mean", vec![3]);
        let xc = g.add(Op::Sub, &[x, mean], "t").unwrap();
        let sq = g.add(Op::Mul, &[xc, xc], "t").unwrap();
        let var = g.add(Op::ReduceSum(crate::op::ReduceAttrs { axes: vec![0], keep_dims: false }), &[sq], "t").unwrap();
        let xn = g.add(Op::Div, &[xc, y], "t").unwrap();
        g.set_outputs(vec![e, f, ke, ks, xy1, xy2, var, xn]);
        fuse_elementwise(&mut g);
        crate::verify::verify(&g).unwrap();
        let outs = g.outputs();
        let program = |id: NodeId| match &g.node(id).op {
            Op::Fused { expr } => (expr.to_string(), g.operands(id)),
            op => (op.name().to_string(), g.operands(id)),
        };
        assert_eq!(program(outs[0]), ("$0 0.5 mul exp".to_string(), vec![x]));
        assert_eq!(program(outs[1]), ("$0 0.5 mul $1 add".to_string(), vec![x, y]));
        // (Node ids are reused: look for the ops, not the ids.)
        let ops = |f: fn(&Op) -> bool| g.ids().into_iter().filter(|&id| f(&g.node(id).op)).count();
        assert_eq!(
            ops(|op| matches!(op, Op::Constant { .. } | Op::Sub)),
            0,
            "the shared product's constant and `x - mean` are gone: {}",
            crate::print::print(&g)
        );
        assert_eq!(ops(|op| matches!(op, Op::Mul)), 1, "only x * y, with two operands of its extents, stays");
        assert!(g.contains(k) && program(outs[2]) == ("exp".to_string(), vec![k]), "{:?}", program(outs[2]));
        assert!(g.contains(xy) && program(outs[4]).1 == vec![xy] && program(outs[5]).1 == vec![xy]);
        assert_eq!(program(g.operands(outs[6])[0]), ("$0 $1 sub $0 $1 sub mul".to_string(), vec![x, mean]));
        assert_eq!(program(outs[7]), ("$0 $1 sub $2 div".to_string(), vec![x, mean, y]));
    }

    /// In bf16, GELU's `x * 0.5` and `x * 0.7071` are each a product and its rounding: each
    /// reader (the forward's terms and the gradient) computes both again, and neither is
    /// written out. A rounded `erf`, not cheap, and a product with two roundings, stay.
    #[test]
    fn a_cheap_op_and_its_rounding_are_computed_again_by_each_reader() {
        let mut g = Graph::new("g");
        let (x, dy) = (leaf(&mut g, "x", vec![4, 6]), leaf(&mut g, "dy", vec![4, 6]));
        let scalar = |g: &mut Graph, v: f64| g.add_leaf(Op::Constant { value: v }, TensorType::f32(Shape::scalar()), "t").unwrap();
        let round = |g: &mut Graph, v: NodeId| g.add(Op::RoundTo { dtype: crate::types::DType::BF16 }, &[v], "t").unwrap();
        let (half, s2, one) = (scalar(&mut g, 0.5), scalar(&mut g, 0.70703125), scalar(&mut g, 1.0));
        let hx = g.add(Op::Mul, &[x, half], "t").unwrap();
        let hx = round(&mut g, hx);
        let u = g.add(Op::Mul, &[x, s2], "t").unwrap();
        let u = round(&mut g, u);
        let e = g.add(Op::Erf, &[u], "t").unwrap();
        let e = round(&mut g, e);
        let e = g.add(Op::Add, &[e, one], "t").unwrap();
        let e = round(&mut g, e);
        let y = g.add(Op::Mul, &[hx, e], "t").unwrap();
        let y = round(&mut g, y);
        // The gradient's terms read all three.
        let a = g.add(Op::Mul, &[dy, e], "t").unwrap();
        let b = g.add(Op::Mul, &[dy, hx], "t").unwrap();
        let b = g.add(Op::Mul, &[b, u], "t").unwrap();
        let dx = g.add(Op::Add, &[a, b], "t").unwrap();
        // Rounded twice: not one op and its rounding.
        let w = g.add(Op::Mul, &[x, half], "t").unwrap();
        let w = round(&mut g, w);
        let w = round(&mut g, w);
        let w1 = g.add(Op::Exp, &[w], "t").unwrap();
        let w2 = g.add(Op::Neg, &[w], "t").unwrap();
        g.set_outputs(vec![y, dx, w1, w2]);
        fuse_elementwise(&mut g);
        crate::verify::verify(&g).unwrap();
        let program = |id: NodeId| match &g.node(id).op {
            Op::Fused { expr } => expr.to_string(),
            op => op.name().to_string(),
        };
        let outs = g.outputs();
        // `e` stays, made from `x`; `y` and `dx` read `x` and `e`, not `x * 0.5` or `u`.
        let e = g.operands(outs[0])[1];
        assert_eq!(program(e), "$0 0.70703125 mul round_bf16 erf round_bf16 1.0 add round_bf16");
        assert_eq!((g.operands(e), g.operands(outs[0])), (vec![x], vec![x, e]));
        assert_eq!(program(outs[0]), "$0 0.5 mul round_bf16 $1 mul round_bf16");
        assert_eq!(g.operands(outs[1]), vec![dy, e, x], "{}", program(outs[1]));
        let w = g.operands(outs[2])[0];
        assert_eq!((program(w), g.operands(outs[3])), ("$0 0.5 mul round_bf16 round_bf16".to_string(), vec![w]));
    }

    /// GELU's `erf(x * 0.7071) + 1`, read by the forward's product and by the gradient: at
    /// 128 Ki elements each reader computes it and it is never written out; smaller, or read
    /// by three nodes, it stays (its function computed once).
    #[test]
    fn a_large_erf_read_twice_is_computed_again_by_its_second_reader() {
        for (rows, readers, copied) in [(256, 2, true), (255, 2, false), (256, 3, false)] {
            let mut g = Graph::new("g");
            let (x, dy) = (leaf(&mut g, "x", vec![rows, 512]), leaf(&mut g, "dy", vec![rows, 512]));
            let scalar = |g: &mut Graph, v: f64| g.add_leaf(Op::Constant { value: v }, TensorType::f32(Shape::scalar()), "t").unwrap();
            let (half, s2, one) = (scalar(&mut g, 0.5), scalar(&mut g, 0.70703125), scalar(&mut g, 1.0));
            let u = g.add(Op::Mul, &[x, s2], "t").unwrap();
            let e = g.add(Op::Erf, &[u], "t").unwrap();
            let e = g.add(Op::Add, &[e, one], "t").unwrap();
            let hx = g.add(Op::Mul, &[x, half], "t").unwrap();
            let y = g.add(Op::Mul, &[hx, e], "t").unwrap();
            let dx = g.add(Op::Mul, &[dy, e], "t").unwrap();
            let mut outs = vec![y, dx];
            if readers == 3 {
                outs.push(g.add(Op::Neg, &[e], "t").unwrap());
            }
            g.set_outputs(outs);
            fuse_elementwise(&mut g);
            crate::verify::verify(&g).unwrap();
            let program = |id: NodeId| match &g.node(id).op {
                Op::Fused { expr } => (expr.to_string(), g.operands(id)),
                op => (op.name().to_string(), g.operands(id)),
            };
            let outs = g.outputs();
            let erfs = g.ids().into_iter().filter(|&id| program(id).0.contains("erf")).count();
            if copied {
                assert_eq!(program(outs[0]), ("$0 0.5 mul $0 0.70703125 mul erf 1.0 add mul".to_string(), vec![x]));
                assert_eq!(program(outs[1]), ("$0 $1 0.70703125 mul erf 1.0 add mul".to_string(), vec![dy, x]));
                assert_eq!(erfs, 2, "no node computes it for the others: {}", crate::print::print(&g));
            } else {
                let e = g.operands(outs[1])[1];
                assert_eq!(program(e), ("$0 0.70703125 mul erf 1.0 add".to_string(), vec![x]), "{rows} rows, {readers} readers");
                assert_eq!((program(outs[0]).1, erfs), (vec![x, e], 1));
            }
        }
    }

    #[test]
    fn bias_add_and_relu_become_one_node() {
        let mut g = Graph::new("g");
        let (x, b) = (leaf(&mut g, "x", vec![8, 120]), leaf(&mut g, "b", vec![120]));
        let y = g.add(Op::Add, &[x, b], "net.fc1").unwrap();
        let r = g.add(Op::Relu, &[y], "net.relu").unwrap();
        g.set_outputs(vec![r]);
        assert_eq!(fuse_elementwise(&mut g), 1);
        let out = g.outputs()[0];
        assert_eq!(g.node(out).op, Op::Fused { expr: "$0 $1 add relu".parse().unwrap() });
        assert_eq!(g.operands(out), vec![x, b]);
        assert_eq!(g.node(out).scope, "net.relu");
        assert_eq!(g.len(), 3);
    }

    #[test]
    fn shared_values_and_outputs_stay_materialized() {
        // Momentum: v' = v * 0.9 + g * s is read twice (assigned, and used for p), so it stays.
        let mut g = Graph::new("g");
        let (p, v, d) = (leaf(&mut g, "p", vec![4]), leaf(&mut g, "v", vec![4]), leaf(&mut g, "d", vec![4]));
        let s = g.add_leaf(Op::Input { index: 0, name: "s".into() }, TensorType::f32(Shape::scalar()), "t").unwrap();
        let lr = g.add_leaf(Op::Input { index: 1, name: "lr".into() }, TensorType::f32(Shape::scalar()), "t").unwrap();
        let m = g.add_leaf(Op::Constant { value: 0.9 }, TensorType::f32(Shape::scalar()), "t").unwrap();
        let gs = g.add(Op::Mul, &[d, s], "t").unwrap();
        let vm = g.add(Op::Mul, &[v, m], "t").unwrap();
        let v2 = g.add(Op::Add, &[vm, gs], "t").unwrap();
        g.add(Op::Assign, &[v, v2], "t").unwrap();
        let step = g.add(Op::Mul, &[v2, lr], "t").unwrap();
        let p2 = g.add(Op::Sub, &[p, step], "t").unwrap();
        g.add(Op::Assign, &[p, p2], "t").unwrap();
        assert_eq!(fuse_elementwise(&mut g), 2);
        let mut bodies: Vec<String> = g
            .ids()
            .into_iter()
            .filter_map(|id| match &g.node(id).op {
                Op::Fused { expr } => Some(expr.to_string()),
                _ => None,
            })
            .collect();
        bodies.sort();
        assert_eq!(bodies, ["$0 $1 $2 mul sub", "$0 0.9 mul $1 $2 mul add"]);
        assert!(g.ids().into_iter().all(|id| !matches!(g.node(id).op, Op::Constant { .. })), "the literal's constant is gone");
        crate::verify::verify(&g).unwrap();
    }

    #[test]
    fn a_lone_op_and_a_broadcast_producer_are_left_alone() {
        let mut g = Graph::new("g");
        let (a, b) = (leaf(&mut g, "a", vec![3]), leaf(&mut g, "b", vec![2, 3]));
        let e = g.add(Op::Exp, &[a], "t").unwrap();
        let y = g.add(Op::Mul, &[e, b], "t").unwrap();
        g.set_outputs(vec![y]);
        assert_eq!(fuse_elementwise(&mut g), 0, "exp has fewer elements than the product: fusing would recompute it");
        assert_eq!(g.len(), 4);
    }
}

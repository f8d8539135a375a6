//! Epilogue fusion: an elementwise node (or a `fused` one) that reads the result of a matrix
//! product, a convolution or max pooling's gradient becomes an `epilogue` of that op.
//!
//! Runs after [`super::fuse`]. The consumer takes in its producer (the head) when the head
//! [takes epilogues](Op::takes_epilogue) and is [absorbable](super::fuse::absorbable): read
//! once, by the consumer alone, not an output, of the consumer's type (so the program runs
//! over the head's output, element for element). `relu(conv2d(x, w))` becomes
//! `epilogue(x, w) {head=conv2d, expr="$0 relu"}`; `relu_grad(max_pool2d_grad(x, dy), x)`
//! becomes `epilogue(x, dy, x) {head=max_pool2d_grad, expr="$0 $1 relu_grad"}`. The ops and
//! their order are unchanged, so the plan computes the same bits; kernels apply the program
//! to each part of the output as the head finishes it, while it is still in cache.
//!
//! [`fuse_accumulation`] (the next pass) does the same for gradient accumulation: a weight's
//! gradient `assign_add`-ed into its accumulator, `assign_add(acc, matmul(dy, x))`, becomes
//! `assign(acc, epilogue(dy, x, acc) {head=matmul, expr="$0 $1 add"})`: the head's result is
//! added to the accumulator while it is in cache, and the sum is written back. `g + acc` and
//! `acc + g` are the same bits. A plan whose accumulators are views of one flat device buffer
//! runs [such an epilogue](accumulator) as the head and then `assign_add` into the view.

use crate::graph::{Graph, NodeId};
use crate::op::Op;
use crate::program::{Program, Val};

use super::fuse::{absorbable, body};

/// Fuses elementwise consumers onto their heads; returns how many `epilogue` nodes it made.
pub fn fuse_epilogues(g: &mut Graph) -> usize {
    let order = g.topo_order().expect("the pipeline verifies before every pass");
    let mut made = 0;
    for id in order {
        let Some((prog, xs)) = body(g, id) else { continue };
        let Some(&head) = xs.iter().find(|&&x| g.node(x).op.takes_epilogue() && absorbable(g, x, id, &xs)) else { continue };
        // `$0` is the head's result; the other operands follow the head's, once each.
        // (Numbered in postfix order, the order the operands are first read in.)
        let mut extras = Vec::new();
        let mut out = Program::new();
        let v = prog.rebuild(prog.result(), &mut out, &mut |i, _| {
            let x = xs[i as usize];
            if x == head {
                return Val::Arg(0);
            }
            let k = extras.iter().position(|&o| o == x).unwrap_or_else(|| {
                extras.push(x);
                extras.len() - 1
            });
            Val::Arg(1 + k as u8)
        });
        out.write(0, v);
        let expr = out;
        let mut operands = g.operands(head);
        operands.extend(extras);
        let (op, ty, scope) = (Op::Epilogue { head: Box::new(g.node(head).op.clone()), expr }, g.ty(id).clone(), g.node(head).scope.clone());
        let fused = g.add_unchecked(op, &operands, ty, &scope);
        g.replace_uses(id, fused);
        g.remove(id);
        g.remove(head);
        made += 1;
    }
    made
}

/// The program of an accumulating epilogue: the head's result plus the accumulator.
fn accumulating() -> Program {
    "$0 $1 add".parse().expect("a well-formed program")
}

/// Moves each `assign_add(acc, head(...))` whose value is a head's result, read by it alone,
/// and whose accumulator nothing else reads, into an epilogue of that head (see the module's
/// documentation); returns how many. Every epilogue it makes is an [`accumulator`]'s.
pub fn fuse_accumulation(g: &mut Graph) -> usize {
    let order = g.topo_order().expect("the pipeline verifies before every pass");
    let mut made = 0;
    for id in order {
        if !matches!(g.node(id).op, Op::AssignAdd) {
            continue;
        }
        let [acc, head] = g.operands(id)[..] else { continue };
        let head = drop_kept_axes(g, head);
        if acc == head || !g.node(head).op.takes_epilogue() || !absorbable(g, head, id, &[head]) {
            continue;
        }
        // Only where the sum may be made in the accumulator's own memory (see
        // [`accumulator`]): nothing else reads the accumulator, nor is it an output.
        if g.users(acc) != [id] || g.outputs().contains(&acc) || g.operands(head).contains(&acc) {
            continue;
        }
        let mut operands = g.operands(head);
        operands.push(acc);
        let op = Op::Epilogue { head: Box::new(g.node(head).op.clone()), expr: accumulating() };
        let sum = g.add_unchecked(op, &operands, g.ty(id).clone(), &g.node(head).scope.clone());
        let scope = g.node(id).scope.clone();
        let write = g.add_unchecked(Op::Assign, &[acc, sum], g.ty(id).clone(), &scope);
        g.replace_uses(id, write);
        g.remove(id);
        g.remove(head);
        made += 1;
    }
    made
}

/// `reshape(reduce_sum(x) {keep_dims=true})` that only drops the kept axes of one (a batch
/// norm's scale and shift gradients, summed over N, H and W to `[1, C, 1, 1]`, then `[C]`),
/// each read by the next alone: replaced by the sum dropping its axes, which heads an
/// accumulating epilogue (a reshape moves no values: the same bits). Returns the node that
/// now gives `x`'s value.
fn drop_kept_axes(g: &mut Graph, x: NodeId) -> NodeId {
    let Op::Reshape { .. } = g.node(x).op else { return x };
    let [s] = g.operands(x)[..] else { return x };
    let Op::ReduceSum(r) = &g.node(s).op else { return x };
    if !r.keep_dims || g.users(s) != [x] || g.outputs().contains(&s) || g.outputs().contains(&x) {
        return x;
    }
    let op = Op::ReduceSum(crate::op::ReduceAttrs { axes: r.axes.clone(), keep_dims: false });
    let operands = g.operands(s);
    let tys: Vec<&crate::types::TensorType> = operands.iter().map(|&o| g.ty(o)).collect();
    if crate::infer::infer(&op, &tys).as_ref() != Ok(g.ty(x)) {
        return x;
    }
    let (ty, scope) = (g.ty(x).clone(), g.node(s).scope.clone());
    let sum = g.add_unchecked(op, &operands, ty, &scope);
    g.replace_uses(x, sum);
    g.remove(x);
    g.remove(s);
    sum
}

/// For an epilogue [`fuse_accumulation`] made, whose sum only its `assign` reads and whose
/// accumulator (a parameter) only it and that `assign` read: the accumulator's operand index.
/// Such a step may add its head's result into the accumulator's own memory.
pub fn accumulator(g: &Graph, id: NodeId) -> Option<usize> {
    let Op::Epilogue { head, expr } = &g.node(id).op else { return None };
    let n = head.arity().min();
    let xs = g.operands(id);
    if xs.len() != n + 1 || *expr != accumulating() || g.outputs().contains(&id) {
        return None;
    }
    let acc = xs[n];
    let [write] = g.users(id)[..] else { return None };
    let ok = matches!(g.node(acc).op, Op::Parameter { .. })
        && !g.outputs().contains(&acc)
        && !xs[..n].contains(&acc)
        && matches!(g.node(write).op, Op::Assign)
        && g.operands(write) == [acc, id]
        && g.users(acc) == [id.min(write), id.max(write)];
    ok.then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Conv2dAttrs, PadMode, Pool2dAttrs};
    use crate::passes::testing::leaf;
    use crate::NodeId;

    fn epilogue(g: &Graph, id: NodeId) -> (String, String) {
        match &g.node(id).op {
            Op::Epilogue { head, expr } => (head.name().to_string(), expr.to_string()),
            other => panic!("expected an epilogue, got {}", other.name()),
        }
    }

    #[test]
    fn relu_joins_its_convolution_and_relu_grad_its_pooling_gradient() {
        let mut g = Graph::new("g");
        let (x, w) = (leaf(&mut g, "x", vec![2, 1, 8, 8]), leaf(&mut g, "w", vec![3, 1, 3, 3]));
        let conv = Conv2dAttrs { stride: [1, 1], pad_mode: PadMode::Valid, pad: [0; 4], dilation: [1, 1], groups: 1 };
        let y = g.add(Op::Conv2d(conv), &[x, w], "net.conv").unwrap();
        let r = g.add(Op::Relu, &[y], "net.relu").unwrap();
        let pool = Pool2dAttrs { kernel: [2, 2], stride: [2, 2], pad_mode: PadMode::Valid, pad: [0; 4] };
        let p = g.add(Op::MaxPool2d(pool.clone()), &[r], "net.pool").unwrap();
        let dy = leaf(&mut g, "dy", vec![2, 3, 3, 3]);
        let dp = g.add(Op::MaxPool2dGrad(pool), &[r, dy], "grad.pool").unwrap();
        let dr = g.add(Op::ReluGrad, &[dp, r], "grad.relu").unwrap();
        g.set_outputs(vec![p, dr]);
        assert_eq!(fuse_epilogues(&mut g), 2);
        crate::verify::verify(&g).unwrap();
        let conv_relu = g.operands(p)[0];
        assert_eq!(epilogue(&g, conv_relu), ("conv2d".into(), "$0 relu".into()));
        assert_eq!(g.operands(conv_relu), vec![x, w]);
        assert_eq!(g.node(conv_relu).scope, "net.conv", "the head's scope");
        let grad = g.outputs()[1];
        assert_eq!(epilogue(&g, grad), ("max_pool2d_grad".into(), "$0 $1 relu_grad".into()));
        assert_eq!(g.operands(grad), vec![conv_relu, dy, conv_relu]);
        let text = crate::print::print(&g);
        assert_eq!(crate::parse::parse(&text).map(|h| crate::print::print(&h)).unwrap(), text, "prints and parses");
    }

    #[test]
    fn a_head_read_twice_or_a_broadcast_head_stays() {
        let mut g = Graph::new("g");
        let (a, b, c) = (leaf(&mut g, "a", vec![4, 3]), leaf(&mut g, "b", vec![3, 5]), leaf(&mut g, "c", vec![4, 5]));
        let m = g.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[a, b], "t").unwrap();
        let r = g.add(Op::Relu, &[m], "t").unwrap();
        let s = g.add(Op::Add, &[m, c], "t").unwrap();
        let v = leaf(&mut g, "v", vec![4]);
        let n = g.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[a, b], "t").unwrap();
        // A product summed over its rows is no head of the sum (which is the head of `* v`).
        let n1 = g.add(Op::ReduceSum(crate::op::ReduceAttrs { axes: vec![1], keep_dims: false }), &[n], "t").unwrap();
        let e = g.add(Op::Mul, &[n1, v], "t").unwrap();
        g.set_outputs(vec![r, s, e]);
        assert_eq!(fuse_epilogues(&mut g), 1, "m has two users; n feeds a reduction over its rows");
        let e = g.outputs()[2];
        assert_eq!(epilogue(&g, e), ("reduce_sum".into(), "$0 $1 mul".into()));
        assert_eq!(g.operands(e), vec![n, v]);
        let mut g = Graph::new("g");
        let (a, b, c) = (leaf(&mut g, "a", vec![1, 3]), leaf(&mut g, "b", vec![3, 5]), leaf(&mut g, "c", vec![4, 5]));
        let m = g.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[a, b], "t").unwrap();
        let s = g.add(Op::Add, &[m, c], "t").unwrap();
        g.set_outputs(vec![s]);
        assert_eq!(fuse_epilogues(&mut g), 0, "the sum is larger than the product: the head's type differs");
    }

    #[test]
    fn a_weight_gradient_is_added_into_its_accumulator_by_its_head() {
        let mut g = Graph::new("g");
        let (dy, x, w) = (leaf(&mut g, "dy", vec![8, 4]), leaf(&mut g, "x", vec![8, 3]), leaf(&mut g, "w", vec![4, 3]));
        let y = g.add(Op::MatMul { transpose_a: false, transpose_b: true }, &[x, w], "net.fc").unwrap();
        // `acc += a^T b`, accumulated into a new `[a, b]`-shaped accumulator `name`.
        let accumulate = |g: &mut Graph, name: &str, a: NodeId, b: NodeId, dims: Vec<usize>| {
            let acc = leaf(g, &format!("accu_grads.{name}"), dims);
            let (a, b) = (if a == b { acc } else { a }, if a == b { acc } else { b });
            let d = g.add(Op::MatMul { transpose_a: a != acc, transpose_b: false }, &[a, b], "grad").unwrap();
            g.add(Op::AssignAdd, &[acc, d], "accumulate").unwrap();
            (acc, d)
        };
        let (acc, _) = accumulate(&mut g, "w", dy, x, vec![4, 3]);
        // A gradient someone else reads too stays where it is; so does one whose accumulator
        // is an output, or read by its own head (`acc^T acc` when `a == b`).
        let (_, dv) = accumulate(&mut g, "v", dy, x, vec![4, 3]);
        let (acc3, _) = accumulate(&mut g, "u", dy, x, vec![4, 3]);
        accumulate(&mut g, "t", x, x, vec![3, 3]);
        g.set_outputs(vec![y, dv, acc3]);
        assert_eq!(fuse_accumulation(&mut g), 1);
        crate::verify::verify(&g).unwrap();
        let writes = g.effects();
        let (fused, kept): (Vec<NodeId>, Vec<NodeId>) = writes.iter().partition(|&&e| matches!(g.node(e).op, Op::Assign));
        assert_eq!((fused.len(), kept.len()), (1, 3));
        let [target, sum] = g.operands(fused[0])[..] else { panic!("assign has two operands") };
        assert_eq!(target, acc);
        assert_eq!(epilogue(&g, sum), ("matmul".into(), "$0 $1 add".into()));
        assert_eq!(g.operands(sum), vec![dy, x, acc]);
        assert_eq!(accumulator(&g, sum), Some(2));
        assert_eq!(g.node(sum).scope, "grad", "the head's scope");
        assert_eq!(g.node(fused[0]).scope, "accumulate", "the write's scope");
        assert_eq!(accumulator(&g, g.operands(y)[0]), None, "not an epilogue");
        let text = crate::print::print(&g);
        assert_eq!(crate::parse::parse(&text).map(|h| crate::print::print(&h)).unwrap(), text, "prints and parses");
    }

    #[test]
    fn a_filter_gradient_takes_its_accumulation_and_an_epilogue_read_elsewhere_is_not_an_accumulator() {
        let mut g = Graph::new("g");
        let (x, dy) = (leaf(&mut g, "x", vec![2, 1, 8, 8]), leaf(&mut g, "dy", vec![2, 3, 6, 6]));
        let conv = Conv2dAttrs { stride: [1, 1], pad_mode: PadMode::Valid, pad: [0; 4], dilation: [1, 1], groups: 1 };
        let filter_shape = crate::Shape(vec![3, 1, 3, 3]);
        let dw = g.add(Op::Conv2dBackpropFilter { conv, filter_shape }, &[dy, x], "grad.conv").unwrap();
        let acc = leaf(&mut g, "accu_grads.conv", vec![3, 1, 3, 3]);
        g.add(Op::AssignAdd, &[acc, dw], "accumulate.conv").unwrap();
        g.set_outputs(vec![dy]);
        assert_eq!(fuse_accumulation(&mut g), 1);
        crate::verify::verify(&g).unwrap();
        let write = g.effects()[0];
        let sum = g.operands(write)[1];
        assert_eq!(epilogue(&g, sum), ("conv2d_backprop_filter".into(), "$0 $1 add".into()));
        assert_eq!(g.node(sum).op.label(), "conv2d_backprop_filter+epilogue");
        assert_eq!(accumulator(&g, sum), Some(2));
        // Read by anything but its write, the accumulator may not be added into in place.
        g.set_outputs(vec![dy, acc]);
        assert_eq!(accumulator(&g, sum), None);
    }

    /// A batch norm's scale gradient, summed keeping its axes and reshaped to `[C]`, becomes
    /// the sum dropping them, which takes its accumulation; one whose sum something else reads
    /// stays as it is.
    #[test]
    fn a_reshaped_sum_over_kept_axes_takes_its_accumulation() {
        let mut g = Graph::new("g");
        let x = leaf(&mut g, "x", vec![2, 3, 4, 4]);
        let kept = crate::op::ReduceAttrs { axes: vec![0, 2, 3], keep_dims: true };
        let bn = |g: &mut Graph, name: &str| {
            let s = g.add(Op::ReduceSum(kept.clone()), &[x], "Gradients/net.bn").unwrap();
            let r = g.add(Op::Reshape { shape: crate::types::Shape(vec![3]) }, &[s], "Gradients/net.bn").unwrap();
            let acc = leaf(g, name, vec![3]);
            g.add(Op::AssignAdd, &[acc, r], "accumulate").unwrap();
            (s, acc)
        };
        let (_, acc) = bn(&mut g, "accu_grads.bn.gamma");
        let (s2, _) = bn(&mut g, "accu_grads.bn.beta");
        let other = g.add(Op::Neg, &[s2], "t").unwrap();
        g.set_outputs(vec![other]);
        assert_eq!(fuse_accumulation(&mut g), 1);
        crate::verify::verify(&g).unwrap();
        let write = g.effects().into_iter().find(|&e| matches!(g.node(e).op, Op::Assign)).unwrap();
        let made = g.operands(write)[1];
        assert_eq!(epilogue(&g, made), ("reduce_sum".into(), "$0 $1 add".into()));
        assert!(
            matches!(&g.node(made).op, Op::Epilogue { head, .. } if **head == Op::ReduceSum(crate::op::ReduceAttrs { axes: vec![0, 2, 3], keep_dims: false }))
        );
        assert_eq!((g.operands(made), accumulator(&g, made)), (vec![x, acc], Some(1)));
        assert!(g.contains(s2) && matches!(g.node(s2).op, Op::ReduceSum(ref r) if r.keep_dims), "a sum read twice keeps its axes");
    }

    /// A bias's gradient (a sum over the batch) and a sum over other axes that drops them (a
    /// batch norm's or layer norm's scale gradient) take their accumulation; a sum that keeps
    /// its axes does not.
    #[test]
    fn a_bias_gradient_summed_over_the_batch_takes_its_accumulation() {
        let mut g = Graph::new("g");
        let dy = leaf(&mut g, "dy", vec![8, 4]);
        let sum = |axes, keep_dims| Op::ReduceSum(crate::op::ReduceAttrs { axes, keep_dims });
        let db = g.add(sum(vec![0], false), &[dy], "grad.fc").unwrap();
        let acc = leaf(&mut g, "accu_grads.fc.bias", vec![4]);
        g.add(Op::AssignAdd, &[acc, db], "accumulate.fc.bias").unwrap();
        // Kept dims (a `[1, 4]` accumulator): no head; a sum over another axis: a head.
        let kept = g.add(sum(vec![0], true), &[dy], "grad.other").unwrap();
        let acc2 = leaf(&mut g, "accu_grads.other", vec![1, 4]);
        g.add(Op::AssignAdd, &[acc2, kept], "accumulate.other").unwrap();
        let rows = g.add(sum(vec![1], false), &[dy], "grad.rows").unwrap();
        let acc3 = leaf(&mut g, "accu_grads.rows", vec![8]);
        g.add(Op::AssignAdd, &[acc3, rows], "accumulate.rows").unwrap();
        g.set_outputs(vec![dy]);
        assert_eq!(fuse_accumulation(&mut g), 2);
        crate::verify::verify(&g).unwrap();
        let writes: Vec<NodeId> = g.effects().into_iter().filter(|&e| matches!(g.node(e).op, Op::Assign)).collect();
        let made: Vec<NodeId> = writes.iter().map(|&w| g.operands(w)[1]).collect();
        for &m in &made {
            assert_eq!(epilogue(&g, m), ("reduce_sum".into(), "$0 $1 add".into()));
            assert_eq!(g.node(m).op.label(), "reduce_sum+epilogue");
        }
        let by_acc: Vec<(Vec<NodeId>, Option<usize>)> = made.iter().map(|&m| (g.operands(m), accumulator(&g, m))).collect();
        assert!(by_acc.contains(&(vec![dy, acc], Some(1))) && by_acc.contains(&(vec![dy, acc3], Some(1))), "{by_acc:?}");
        assert!(g.effects().into_iter().any(|e| matches!(g.node(e).op, Op::AssignAdd) && g.operands(e) == [acc2, kept]));
    }
}

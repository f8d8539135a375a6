//! Numeric gradient checks: every differentiable op, and whole networks, against f64 central
//! differences, executed on the f64 CPU backend. Every backward plan also runs unfused (no
//! elementwise fusion), on the host kernels and on burn's ops, with the same bits.

use cellgraph::compiler::autodiff::{grad, Sens};
use cellgraph::compiler::emit::Emit;
use cellgraph::compiler::{Conv2dAttrs, Pool2dAttrs, ReduceAttrs};
use cellgraph::prelude::*;
use cellgraph::runtime::compile_unfused;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One check: differentiable float parameters `x0..`, fixed inputs, and a body.
struct Case {
    name: &'static str,
    params: Vec<Vec<usize>>,
    /// Values for each param: `None` draws N(0,1); `Some(f)` maps a uniform draw.
    positive: bool,
    inputs: Vec<HostTensor>,
    body: fn(&mut Emit, &[NodeId], &[NodeId]) -> NodeId,
}

fn randn(rng: &mut StdRng, n: usize, positive: bool) -> Vec<f64> {
    (0..n).map(|_| if positive { rng.random_range(0.5..2.0) } else { rng.random_range(-1.0..1.0) }).collect()
}

/// Builds `loss = sum(body(params, inputs) * w)` for a random weight `w`, so every output
/// element gets a different cotangent.
fn build(case: &Case) -> (Graph, Vec<NodeId>, NodeId) {
    let mut g = Graph::new(case.name);
    let ps: Vec<NodeId> = case
        .params
        .iter()
        .enumerate()
        .map(|(i, s)| g.add_leaf(Op::Parameter { name: format!("x{i}") }, TensorType::f32(s.clone()), "t").unwrap())
        .collect();
    let xs: Vec<NodeId> =
        case.inputs.iter().enumerate().map(|(i, h)| g.add_leaf(Op::Input { index: i, name: format!("in{i}") }, h.ty(), "t").unwrap()).collect();
    let mut e = Emit::new(&mut g, "t");
    let y = (case.body)(&mut e, &ps, &xs);
    let yt = e.ty(y);
    let w = e.g.add_leaf(Op::Parameter { name: "w".into() }, yt.clone(), "t").unwrap();
    let yw = e.mul(y, w).unwrap();
    let loss = e.reduce_sum(yw, (0..yt.rank()).collect(), false).unwrap();
    (g, ps, loss)
}

fn run_loss(exe: &Executable, params: &[(String, HostTensor)], inputs: &[HostTensor]) -> Vec<HostTensor> {
    run_on(exe, params, inputs, true)
}

/// Runs on the f64 CPU backend, with the host kernels or with burn's generic ops only.
fn run_on(exe: &Executable, params: &[(String, HostTensor)], inputs: &[HostTensor], native: bool) -> Vec<HostTensor> {
    let mut s = Session::<Cpu>::new_f64(cpu());
    s.set_native_kernels(native);
    for (n, v) in params {
        s.set_param(n, v);
    }
    s.run(exe, inputs).unwrap()
}

fn bits(t: &HostTensor) -> Vec<u64> {
    t.to_f64().iter().map(|v| v.to_bits()).collect()
}

/// Runs `g`'s fused plan and its unfused reference on the same values, on the host kernels and
/// on burn's ops: the same bits. Returns how many `fused` and `epilogue` nodes the fused plan has.
fn fused_equals_unfused(g: &Graph, params: &[(String, HostTensor)], inputs: &[HostTensor]) -> usize {
    let (fused, plain) = (compile(g.clone()).unwrap(), compile_unfused(g.clone()).unwrap());
    let count =
        |e: &Executable| e.graph().ids().into_iter().filter(|&id| matches!(e.graph().node(id).op, Op::Fused { .. } | Op::Epilogue { .. })).count();
    assert_eq!(count(&plain), 0, "{}: the unfused plan has fused nodes", g.name);
    for native in [true, false] {
        let (a, b) = (run_on(&fused, params, inputs, native), run_on(&plain, params, inputs, native));
        for (k, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(bits(x) == bits(y), "{}: output {k} fused {:?} vs unfused {:?} (host kernels: {native})", g.name, x.to_f64(), y.to_f64());
        }
    }
    count(&fused)
}

/// Central difference of the loss w.r.t. element `k` of parameter `pi`, in f64.
fn numeric_grad(fwd: &Executable, params: &[(String, HostTensor)], inputs: &[HostTensor], pi: usize, k: usize) -> f64 {
    let eps = 1e-6;
    let at = |delta: f64| {
        let mut p = params.to_vec();
        if let HostData::F64(v) = &mut p[pi].1.data {
            v[k] += delta;
        }
        run_loss(fwd, &p, inputs)[0].scalar()
    };
    (at(eps) - at(-eps)) / (2.0 * eps)
}

/// Checks one case; returns how many `fused` nodes its backward plan has.
fn check(case: &Case) -> usize {
    let mut rng = StdRng::seed_from_u64(7);
    let (mut g, ps, loss) = build(case);
    let fwd = {
        let mut f = g.clone();
        f.set_outputs(vec![loss]);
        compile(f).unwrap()
    };
    let grads = grad(&mut g, loss, &ps, Sens::One).unwrap();
    g.set_outputs(grads.grads.clone());
    let bwd = compile(g.clone()).unwrap();
    let mut params: Vec<(String, HostTensor)> = case
        .params
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.iter().product();
            (format!("x{i}"), HostTensor::new(s.clone(), HostData::F64(randn(&mut rng, n, case.positive))).unwrap())
        })
        .collect();
    let wty = fwd.graph().ty(fwd.graph().find_parameter("w").unwrap()).clone();
    params.push(("w".into(), HostTensor::new(wty.dims().to_vec(), HostData::F64(randn(&mut rng, wty.numel(), false))).unwrap()));
    let inputs: Vec<HostTensor> = case.inputs.iter().map(|h| h.to_f64_tensor()).collect();
    let fused = fused_equals_unfused(&g, &params, &inputs);
    let analytic = run_loss(&bwd, &params, &inputs);
    // burn's generic ops (the path device backends take) agree with the host kernels.
    let generic = run_on(&bwd, &params, &inputs, false);
    for (pi, (a, b)) in analytic.iter().zip(&generic).enumerate() {
        for (k, (x, y)) in a.to_f64().iter().zip(b.to_f64()).enumerate() {
            assert!((x - y).abs() <= 1e-12 * (1.0 + x.abs()), "{}: d/dx{pi}[{k}] host kernels {x} vs burn's ops {y}", case.name);
        }
    }
    for (pi, a) in analytic.iter().enumerate() {
        let a = a.to_f64();
        let n = a.len();
        let picks: Vec<usize> = if n <= 40 { (0..n).collect() } else { (0..40).map(|_| rng.random_range(0..n)).collect() };
        for k in picks {
            let numeric = numeric_grad(&fwd, &params, &inputs, pi, k);
            let tol = 1e-6 + 1e-5 * numeric.abs().max(a[k].abs());
            assert!((numeric - a[k]).abs() <= tol, "{}: d/dx{pi}[{k}] analytic {} vs numeric {numeric}", case.name, a[k]);
        }
    }
    fused
}

fn conv(stride: usize, pad_mode: PadMode, pad: [usize; 4], dilation: usize, groups: usize) -> Conv2dAttrs {
    Conv2dAttrs { stride: [stride; 2], pad_mode, pad, dilation: [dilation; 2], groups }
}

fn pool(kernel: usize, stride: usize, pad_mode: PadMode) -> Pool2dAttrs {
    Pool2dAttrs { kernel: [kernel; 2], stride: [stride; 2], pad_mode, pad: [0; 4] }
}

fn r(axes: &[usize], keep: bool) -> ReduceAttrs {
    ReduceAttrs { axes: axes.to_vec(), keep_dims: keep }
}

fn labels() -> HostTensor {
    HostTensor::i32(vec![4], vec![2, 0, 4, 1]).unwrap()
}

macro_rules! case {
    ($name:literal, [$($s:expr),*], |$e:ident, $p:ident, $x:ident| $body:expr) => {
        Case { name: $name, params: vec![$($s.to_vec()),*], positive: false, inputs: vec![], body: |$e, $p, $x| { let _ = $x; $body } }
    };
}

fn cases() -> Vec<Case> {
    let mut v = vec![
        case!("add_broadcast", [[3, 4], [4]], |e, p, x| e.add(p[0], p[1]).unwrap()),
        case!("sub_broadcast", [[3, 1], [1, 4]], |e, p, x| e.sub(p[0], p[1]).unwrap()),
        case!("mul_broadcast", [[2, 3, 4], [3, 1]], |e, p, x| e.mul(p[0], p[1]).unwrap()),
        case!("neg", [[5]], |e, p, x| e.neg(p[0]).unwrap()),
        // A world of one: the plumbing of the rule (ranks are checked in batchnorm.rs).
        case!("all_reduce", [[2, 3]], |e, p, x| {
            let y = e.op(Op::AllReduce, &[p[0]]).unwrap();
            e.mul(y, p[0]).unwrap()
        }),
        case!("exp", [[2, 3]], |e, p, x| e.op(Op::Exp, &[p[0]]).unwrap()),
        case!("relu", [[3, 5]], |e, p, x| e.op(Op::Relu, &[p[0]]).unwrap()),
        case!("relu_grad_wrt_dy", [[3, 5], [3, 5]], |e, p, x| {
            let y = e.op(Op::Relu, &[p[1]]).unwrap();
            e.op(Op::ReluGrad, &[p[0], y]).unwrap()
        }),
        case!("cast_f32", [[4]], |e, p, x| e.op(Op::Cast { dtype: DType::F32 }, &[p[0]]).unwrap()),
        case!("zeros_like_plus_x", [[4]], |e, p, x| {
            let z = e.op(Op::ZerosLike, &[p[0]]).unwrap();
            e.add(z, p[0]).unwrap()
        }),
        case!("broadcast", [[3, 1]], |e, p, x| e.broadcast(p[0], [2, 3, 4]).unwrap()),
        case!("reshape", [[2, 6]], |e, p, x| e.reshape(p[0], [3, 4]).unwrap()),
        case!("flatten", [[2, 3, 2]], |e, p, x| e.op(Op::Flatten, &[p[0]]).unwrap()),
        case!("transpose", [[2, 3, 4]], |e, p, x| e.op(Op::Transpose { perm: vec![2, 0, 1] }, &[p[0]]).unwrap()),
        case!("slice", [[4, 5]], |e, p, x| e.op(Op::Slice { begin: vec![1, 0], end: vec![3, 4] }, &[p[0]]).unwrap()),
        case!("pad", [[2, 3]], |e, p, x| e.op(Op::Pad { lo: vec![1, 0], hi: vec![0, 2] }, &[p[0]]).unwrap()),
        case!("concat", [[2, 3], [2, 2]], |e, p, x| e.op(Op::Concat { axis: 1 }, &[p[0], p[1]]).unwrap()),
        case!("reduce_sum_keep", [[3, 4, 2]], |e, p, x| e.op(Op::ReduceSum(r(&[0, 2], true)), &[p[0]]).unwrap()),
        case!("reduce_sum_all", [[3, 4]], |e, p, x| e.op(Op::ReduceSum(r(&[0, 1], false)), &[p[0]]).unwrap()),
        case!("reduce_mean", [[3, 4]], |e, p, x| e.op(Op::ReduceMean(r(&[1], false)), &[p[0]]).unwrap()),
        case!("reduce_max", [[3, 5]], |e, p, x| e.op(Op::ReduceMax(r(&[1], false)), &[p[0]]).unwrap()),
        case!("matmul", [[3, 4], [4, 2]], |e, p, x| e.matmul(p[0], p[1], false, false).unwrap()),
        case!("matmul_tb", [[3, 4], [2, 4]], |e, p, x| e.matmul(p[0], p[1], false, true).unwrap()),
        case!("matmul_ta", [[4, 3], [4, 2]], |e, p, x| e.matmul(p[0], p[1], true, false).unwrap()),
        case!("matmul_ta_tb", [[4, 3], [2, 4]], |e, p, x| e.matmul(p[0], p[1], true, true).unwrap()),
        // Batched products (attention's scores and mixing): equal leading axes.
        case!("matmul_batched", [[2, 3, 4], [2, 4, 5]], |e, p, x| e.matmul(p[0], p[1], false, false).unwrap()),
        case!("matmul_batched_tb", [[2, 2, 3, 4], [2, 2, 5, 4]], |e, p, x| e.matmul(p[0], p[1], false, true).unwrap()),
        case!("matmul_batched_ta", [[3, 4, 3], [3, 4, 2]], |e, p, x| e.matmul(p[0], p[1], true, false).unwrap()),
        case!("tanh", [[2, 3]], |e, p, x| e.op(Op::Tanh, &[p[0]]).unwrap()),
        case!("erf", [[2, 3]], |e, p, x| e.op(Op::Erf, &[p[0]]).unwrap()),
        // Scores [batch, T = 3, S = 4]: a query sees keys up to its own position + 1.
        case!("causal_mask", [[2, 3, 4]], |e, p, x| e.op(Op::CausalMask { fill: -5.0 }, &[p[0]]).unwrap()),
        case!("conv2d_valid", [[2, 3, 6, 6], [4, 3, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Valid, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_same_stride2_asym", [[1, 2, 6, 6], [3, 2, 2, 2]], |e, p, x| e
            .op(Op::Conv2d(conv(2, PadMode::Same, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_same_odd", [[1, 2, 5, 5], [2, 2, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Same, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_pad_dilation", [[1, 2, 7, 7], [2, 2, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Pad, [1, 1, 2, 2], 2, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_stride3", [[1, 1, 8, 8], [2, 1, 2, 2]], |e, p, x| e
            .op(Op::Conv2d(conv(3, PadMode::Valid, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_1x1_wide_pad_fallback", [[1, 2, 4, 4], [3, 2, 1, 1]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Pad, [1, 2, 2, 1], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        // Taps that only ever read padding are cropped off: ResNet's layer4 (3x3 padded by 1
        // on a 1x1 map reads its centre alone; stride 2 on a 2x2 map reads a 2x2 corner).
        case!("conv2d_3x3_pad1_on_1x1", [[2, 3, 1, 1], [4, 3, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Pad, [1; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_3x3_stride2_pad1_on_2x2", [[2, 3, 2, 2], [4, 3, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(2, PadMode::Pad, [1; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_groups", [[1, 4, 5, 5], [6, 2, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Valid, [0; 4], 1, 2)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_groups_stride2_same", [[2, 4, 7, 7], [4, 2, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(2, PadMode::Same, [0; 4], 1, 2)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_groups_dilation_pad", [[1, 6, 6, 6], [3, 2, 2, 2]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Pad, [0, 1, 2, 0], 2, 3)), &[p[0], p[1]])
            .unwrap()),
        case!("max_pool2d", [[2, 2, 4, 4]], |e, p, x| e.op(Op::MaxPool2d(pool(2, 2, PadMode::Valid)), &[p[0]]).unwrap()),
        case!("max_pool2d_same", [[1, 2, 5, 5]], |e, p, x| e.op(Op::MaxPool2d(pool(2, 2, PadMode::Same)), &[p[0]]).unwrap()),
        case!("max_pool2d_overlap", [[1, 1, 5, 5]], |e, p, x| e.op(Op::MaxPool2d(pool(3, 1, PadMode::Valid)), &[p[0]]).unwrap()),
        case!("avg_pool2d", [[2, 2, 4, 4]], |e, p, x| e.op(Op::AvgPool2d(pool(2, 2, PadMode::Valid)), &[p[0]]).unwrap()),
        case!("avg_pool2d_stride1", [[1, 2, 4, 4]], |e, p, x| e.op(Op::AvgPool2d(pool(3, 1, PadMode::Valid)), &[p[0]]).unwrap()),
    ];
    // qkv [B = 2, T = 5, 3C = 12]: two heads of width 2, causal and not.
    v.push(case!("attention_causal", [[2, 5, 12]], |e, p, x| e.op(Op::Attention { heads: 2, causal: true }, &[p[0]]).unwrap()));
    v.push(case!("attention", [[2, 5, 12]], |e, p, x| e.op(Op::Attention { heads: 2, causal: false }, &[p[0]]).unwrap()));
    let positive = [
        case!("div", [[3, 4], [4]], |e, p, x| e.div(p[0], p[1]).unwrap()),
        case!("log", [[2, 3]], |e, p, x| e.op(Op::Log, &[p[0]]).unwrap()),
        case!("sqrt", [[2, 3]], |e, p, x| e.op(Op::Sqrt, &[p[0]]).unwrap()),
    ];
    v.extend(positive.into_iter().map(|c| Case { positive: true, ..c }));
    v.push(Case {
        name: "select_broadcast",
        params: vec![vec![2, 3], vec![3]],
        positive: false,
        inputs: vec![HostTensor::new(vec![2, 1], HostData::Bool(vec![true, false])).unwrap()],
        body: |e, p, x| e.op(Op::Select, &[x[0], p[0], p[1]]).unwrap(),
    });
    // Dropout's mask is fixed by its keys (items 5 and 9, update 3): y = x * mask.
    v.push(Case {
        name: "dropout",
        params: vec![vec![2, 3, 4]],
        positive: false,
        inputs: vec![HostTensor::new(vec![2], HostData::I64(vec![5, 9])).unwrap(), HostTensor::new(vec![], HostData::I64(vec![3])).unwrap()],
        body: |e, p, x| e.op(Op::Dropout { p: 0.4, seed: 1 }, &[p[0], x[0], x[1]]).unwrap(),
    });
    // Repeated ids: their gradients add up in the table.
    v.push(Case {
        name: "gather_repeated_ids",
        params: vec![vec![5, 3]],
        positive: false,
        inputs: vec![HostTensor::i32(vec![2, 3], vec![4, 0, 4, 2, 2, 4]).unwrap()],
        body: |e, p, x| e.op(Op::Gather, &[p[0], x[0]]).unwrap(),
    });
    let probs: Vec<f32> = (0..20).map(|i| ((i * 7) % 5) as f32 * 0.1 + 0.05).collect();
    v.push(Case {
        name: "softmax_ce_dense_mean",
        params: vec![vec![4, 5]],
        positive: false,
        inputs: vec![HostTensor::f32(vec![4, 5], probs).unwrap()],
        body: |e, p, x| e.op(Op::SoftmaxCrossEntropy { sparse: false, reduction: Reduction::Mean }, &[p[0], x[0]]).unwrap(),
    });
    for (name, reduction) in
        [("softmax_ce_sparse_mean", Reduction::Mean), ("softmax_ce_sparse_sum", Reduction::Sum), ("softmax_ce_sparse_none", Reduction::None)]
    {
        v.push(Case {
            name,
            params: vec![vec![4, 5]],
            positive: false,
            inputs: vec![labels()],
            body: match reduction {
                Reduction::Mean => |e, p, x| e.op(Op::SoftmaxCrossEntropy { sparse: true, reduction: Reduction::Mean }, &[p[0], x[0]]).unwrap(),
                Reduction::Sum => |e, p, x| e.op(Op::SoftmaxCrossEntropy { sparse: true, reduction: Reduction::Sum }, &[p[0], x[0]]).unwrap(),
                Reduction::None => |e, p, x| e.op(Op::SoftmaxCrossEntropy { sparse: true, reduction: Reduction::None }, &[p[0], x[0]]).unwrap(),
            },
        });
    }
    v
}

/// Every op must be decided here: checked numerically by a case above (by its name), or not
/// differentiable (a leaf, a backward op, or an effect). The match has no `_` arm, so adding
/// an op to the IR fails to compile until this table decides it.
fn must_be_checked(op: &Op) -> bool {
    match op {
        Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => false,
        Op::ReduceMaxGrad(_) | Op::SoftmaxCrossEntropyGrad { .. } | Op::Conv2dBackpropInput { .. } => false,
        Op::Conv2dBackpropFilter { .. } | Op::MaxPool2dGrad(_) | Op::AvgPool2dGrad(_) => false,
        Op::Assign | Op::AssignAdd => false,
        Op::GreaterEqual | Op::Equal => false, // comparisons: zero gradient almost everywhere
        Op::ScatterAdd { .. } | Op::AttentionGrad { .. } => false,
        Op::StopGradient => false, // no gradient by definition (checked in `stop_gradient_blocks`)
        // Straight through by definition (checked in `round_to_passes_the_gradient_through`).
        Op::RoundTo { .. } => false,
        Op::Tanh | Op::Erf | Op::CausalMask { .. } | Op::Gather | Op::Dropout { .. } | Op::Attention { .. } => true,
        Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Neg | Op::Exp | Op::Log | Op::Relu | Op::ReluGrad => true,
        Op::Sqrt | Op::Select | Op::AllReduce => true,
        Op::Cast { .. } | Op::ZerosLike | Op::Broadcast { .. } | Op::Reshape { .. } | Op::Transpose { .. } => true,
        Op::Slice { .. } | Op::Pad { .. } | Op::Concat { .. } | Op::Flatten => true,
        Op::ReduceSum(_) | Op::ReduceMean(_) | Op::ReduceMax(_) | Op::MatMul { .. } => true,
        Op::SoftmaxCrossEntropy { .. } | Op::Conv2d(_) | Op::MaxPool2d(_) | Op::AvgPool2d(_) => true,
        // Formed after differentiation; their plans are checked against unfused ones.
        Op::Fused { .. } | Op::Epilogue { .. } => false,
    }
}

#[test]
fn stop_gradient_blocks_the_gradient_and_is_the_identity() {
    let mut g = Graph::new("g");
    let x = g.add_leaf(Op::Parameter { name: "x".into() }, TensorType::f32([3]), "t").unwrap();
    let s = g.add(Op::StopGradient, &[x], "t").unwrap();
    let y = g.add(Op::Mul, &[s, x], "t").unwrap();
    let l = g.add(Op::ReduceSum(r(&[0], false)), &[y], "t").unwrap();
    let gr = grad(&mut g, l, &[x], Sens::One).unwrap();
    g.set_outputs(vec![l, gr.grads[0]]);
    let out = run_loss(&compile(g).unwrap(), &[("x".into(), HostTensor::new(vec![3], HostData::F64(vec![1.0, -2.0, 3.0])).unwrap())], &[]);
    assert_eq!(out[0].scalar(), 14.0, "sum(x * x)");
    assert_eq!(out[1].to_f64(), vec![1.0, -2.0, 3.0], "d/dx sum(sg(x) * x) = sg(x), not 2x");
}

#[test]
fn round_to_passes_the_gradient_through() {
    let mut g = Graph::new("g");
    let x = g.add_leaf(Op::Parameter { name: "x".into() }, TensorType::f32([3]), "t").unwrap();
    let q = g.add(Op::RoundTo { dtype: DType::BF16 }, &[x], "t").unwrap();
    let y = g.add(Op::Mul, &[q, q], "t").unwrap();
    let l = g.add(Op::ReduceSum(r(&[0], false)), &[y], "t").unwrap();
    let gr = grad(&mut g, l, &[x], Sens::One).unwrap();
    g.set_outputs(vec![l, gr.grads[0]]);
    let xs = vec![1.0 + 1.0 / 1024.0, -3.0, 0.1];
    let out = run_loss(&compile(g).unwrap(), &[("x".into(), HostTensor::new(vec![3], HostData::F64(xs)).unwrap())], &[]);
    let rounded = [1.0, -3.0, 0.10009765625];
    assert_eq!(out[0].scalar(), rounded.iter().map(|v| v * v).sum::<f64>(), "sum(bf16(x)^2)");
    assert_eq!(
        out[1].to_f64(),
        rounded.iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
        "d/dx sum(r(x)^2) = 2 r(x): the rounding passes the cotangent through"
    );
}

#[test]
fn every_differentiable_op_matches_finite_differences() {
    let cases = cases();
    let mut covered = std::collections::BTreeSet::new();
    let mut fused = 0;
    for c in &cases {
        fused += usize::from(check(c) > 0);
        let (g, _, _) = build(c);
        for id in g.ids() {
            covered.insert(g.node(id).op.name());
        }
    }
    let all_ops = cellgraph::compiler::op::Op::examples();
    let missing: Vec<_> = all_ops.iter().filter(|op| must_be_checked(op) && !covered.contains(op.name())).map(|op| op.name()).collect();
    assert!(missing.is_empty(), "differentiable ops without a numeric check: {missing:?}");
    assert!(fused >= 5, "only {fused} of {} backward plans fused anything: the fused/unfused comparison checks little", cases.len());
}

#[test]
fn backward_ops_have_no_second_order_rule() {
    let mut g = Graph::new("g");
    let x = g.add_leaf(Op::Parameter { name: "x".into() }, TensorType::f32([1, 1, 4, 4]), "net.pool").unwrap();
    let y = g.add(Op::MaxPool2d(pool(2, 2, PadMode::Valid)), &[x], "net.pool").unwrap();
    let dx = g.add(Op::MaxPool2dGrad(pool(2, 2, PadMode::Valid)), &[x, y], "net.pool").unwrap();
    let l = g.add(Op::ReduceSum(ReduceAttrs { axes: vec![0, 1, 2, 3], keep_dims: false }), &[dx], "net").unwrap();
    let err = grad(&mut g, l, &[x], Sens::One).unwrap_err().to_string();
    assert!(err.contains("no gradient rule for op `max_pool2d_grad`") && err.contains("net.pool"), "{err}");
}

fn lenet_or_mlp_check(net: &dyn Cell, x_shape: [usize; 4], seed: u64) {
    network_check(net, x_shape, seed, Tracer::new("net"))
}

/// Every trainable parameter's gradient of `net` (traced by `t`) against central differences
/// at 6 random coordinates. Moving statistics, if any, are set away from their initial zeros
/// and ones so that an inference trace's normalisation is not the identity.
fn network_check(net: &dyn Cell, x_shape: [usize; 4], seed: u64, t: Tracer) {
    let n = x_shape[0];
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let numel: usize = x_shape.iter().product();
    let x = HostTensor::new(x_shape.to_vec(), HostData::F64(randn(&mut rng, numel, false))).unwrap();
    let y = HostTensor::i32(vec![n], (0..n as i32).map(|i| i % 10).collect()).unwrap();
    network_check_on(net, &[("data", x), ("label", y)], seed, t, true)
}

/// [`network_check`] on given inputs; `fuses`: the backward plan must fuse something.
fn network_check_on(net: &dyn Cell, named: &[(&str, HostTensor)], seed: u64, t: Tracer, fuses: bool) {
    let types: Vec<(&str, TensorType)> = named.iter().map(|(n, h)| (*n, h.ty())).collect();
    let gg = cellgraph::cells::train::grad_graph_in(t, net, &types, Sens::One).unwrap();
    let mut fwd_g = gg.graph.clone();
    fwd_g.set_outputs(vec![gg.loss]);
    let fwd = compile(fwd_g).unwrap();
    let bwd = compile(gg.graph.clone()).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let params: Vec<(String, HostTensor)> = materialize(&net.parameters(), seed)
        .into_iter()
        .map(|(n, t)| {
            let t = t.to_f64_tensor();
            let mut moving = |positive| HostTensor::new(t.shape.clone(), HostData::F64(randn(&mut rng, t.shape.iter().product(), positive))).unwrap();
            let t = if n.ends_with("moving_mean") {
                moving(false)
            } else if n.ends_with("moving_variance") {
                moving(true)
            } else {
                t
            };
            (n, t)
        })
        .collect();
    let inputs: Vec<HostTensor> = named.iter().map(|(_, h)| h.clone()).collect();
    let fused = fused_equals_unfused(&gg.graph, &params, &inputs);
    assert!(!fuses || fused > 0, "bias-add and relu fuse");
    let out = run_loss(&bwd, &params, &inputs);
    for (k, (p, _, _)) in gg.grads.iter().enumerate() {
        let a = out[k + 1].to_f64();
        let pi = params.iter().position(|(n, _)| *n == p.name).unwrap();
        for _ in 0..6 {
            let j = rng.random_range(0..a.len());
            let numeric = numeric_grad(&fwd, &params, &inputs, pi, j);
            let tol = 1e-7 + 1e-4 * numeric.abs().max(a[j].abs());
            assert!((numeric - a[j]).abs() <= tol, "{}[{j}]: analytic {} vs numeric {numeric}", p.name, a[j]);
        }
    }
}

/// A two-block GPT (embeddings, LayerNorm, causal attention over two heads with batched
/// matmuls and softmax, the exact GELU, the tied head) under token-summed cross-entropy with
/// ignored (padding) labels, and the tanh GELU alone.
#[test]
fn gpt_gradients_match_finite_differences() {
    let cfg = GptConfig { vocab_size: 7, context: 5, layers: 2, heads: 2, width: 8, layer_norm_eps: 1e-5, dropout: 0.0, gelu_approximate: false };
    let net = WithLossCell::new(GPT::new(&Scope::root(), cfg).unwrap(), CrossEntropyLoss::new().ignore_index(-100).tokens());
    let ids = HostTensor::i32(vec![2, 4], vec![1, 5, 5, 0, 6, 2, 3, 3]).unwrap();
    let labels = HostTensor::i32(vec![2, 4], vec![5, 5, 0, -100, 2, 3, 3, 4]).unwrap();
    network_check_on(&net, &[("data", ids), ("label", labels)], 21, Tracer::new("net"), true);
    let gelu =
        WithLossCell::new(SequentialCell::new(&Scope::root()).add(|s| Dense::new(&s.child("0"), 3, 4)).add(|_| GELU::new(true)), MSELoss::new());
    let x = HostTensor::new(vec![3, 3], HostData::F64((0..9).map(|i| i as f64 * 0.3 - 1.2).collect())).unwrap();
    let y = HostTensor::new(vec![3, 4], HostData::F64((0..12).map(|i| (i as f64).sin()).collect())).unwrap();
    network_check_on(&gelu, &[("data", x), ("label", y)], 22, Tracer::new("net"), false);
}

/// A two-layer Llama (RMSNorm, the rotary embedding, four query heads over two key/value
/// heads, the gated SiLU MLP), untied and tied, under token-summed cross-entropy with an
/// ignored label; and SiLU alone, far into both tails (its tanh form keeps the gradient finite
/// where `exp(-x)` overflows).
#[test]
fn llama_gradients_match_finite_differences() {
    let small =
        LlamaConfig { vocab_size: 7, context: 5, layers: 2, heads: 4, kv_heads: 2, width: 8, head_dim: 4, intermediate: 12, ..LlamaConfig::small(7) };
    for (cfg, seed) in [(small, 23), (LlamaConfig { tie_embeddings: true, ..small }, 24)] {
        let net = WithLossCell::new(Llama::new(&Scope::root(), cfg).unwrap(), CrossEntropyLoss::new().ignore_index(-100).tokens());
        let ids = HostTensor::i32(vec![2, 4], vec![1, 5, 5, 0, 6, 2, 3, 3]).unwrap();
        let labels = HostTensor::i32(vec![2, 4], vec![5, 5, 0, -100, 2, 3, 3, 4]).unwrap();
        network_check_on(&net, &[("data", ids), ("label", labels)], seed, Tracer::new("net"), true);
    }
    let silu = WithLossCell::new(SequentialCell::new(&Scope::root()).add(|s| Dense::new(&s.child("0"), 3, 4)).add(|_| SiLU), MSELoss::new());
    let x = HostTensor::new(vec![3, 3], HostData::F64((0..9).map(|i| i as f64 * 0.3 - 1.2).collect())).unwrap();
    let y = HostTensor::new(vec![3, 4], HostData::F64((0..12).map(|i| (i as f64).sin()).collect())).unwrap();
    network_check_on(&silu, &[("data", x), ("label", y)], 25, Tracer::new("net"), false);
}

#[test]
fn lenet5_gradients_match_finite_differences() {
    let net = WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean));
    lenet_or_mlp_check(&net, [3, 1, 32, 32], 11);
}

/// Batch norm in training (batch statistics: the gradient flows through the mean and the
/// variance) and in inference (moving statistics), inside a residual block with a strided 1x1
/// downsample, global average pooling and a dense head.
#[test]
fn batch_norm_and_residual_gradients_match_finite_differences() {
    let net = WithLossCell::new(crate::batchnorm::BlockNet::new(), CrossEntropyLoss::new());
    network_check(&net, [4, 3, 6, 6], 13, Tracer::new("net"));
    network_check(&net, [2, 3, 6, 6], 14, Tracer::inference("net"));
    // SyncBatchNorm's graph (its collectives over a world of one).
    let synced = WithLossCell::new(crate::batchnorm::BlockNet::with_norm(&|bn| bn.sync()), CrossEntropyLoss::new());
    network_check(&synced, [4, 3, 6, 6], 15, Tracer::new("net"));
}

#[test]
fn seed002_mlp_gradients_match_finite_differences() {
    let net = WithLossCell::new(Network::new(&Scope::root()), CrossEntropyLoss::new());
    lenet_or_mlp_check(&net, [4, 1, 28, 28], 12);
}

/// Cases for the device's own kernels: big enough for cubek's double-buffered matmul (its
/// gradients are the NT and TN products), convolutions whose filter gradient is split over the
/// output positions (LeNet5's two layers, a strided padded one with a short last slice, a
/// grouped one), ResNet's stem, a dilated one and a strided 1 x 1, epilogues, padded
/// overlapping pooling, strided reads, a loss over many rows.
#[cfg(feature = "wgpu")]
fn device_cases() -> Vec<Case> {
    vec![
        case!("matmul_double", [[96, 200], [200, 80]], |e, p, x| e.matmul(p[0], p[1], false, false).unwrap()),
        case!("matmul_double_ta_tb", [[200, 96], [80, 200]], |e, p, x| e.matmul(p[0], p[1], true, true).unwrap()),
        case!("matmul_odd", [[37, 300], [300, 7]], |e, p, x| e.matmul(p[0], p[1], false, false).unwrap()),
        case!("conv2d_lenet_c1", [[8, 1, 32, 32], [6, 1, 5, 5]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Valid, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_lenet_c2", [[8, 6, 14, 14], [16, 6, 5, 5]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Valid, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_split_stride2_same", [[4, 3, 17, 17], [8, 3, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(2, PadMode::Same, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_split_groups", [[4, 4, 12, 12], [6, 2, 3, 3]], |e, p, x| e
            .op(Op::Conv2d(conv(1, PadMode::Valid, [0; 4], 1, 2)), &[p[0], p[1]])
            .unwrap()),
        // ResNet-18's stem (7 x 7, stride 2, padding 3) on an odd map, a dilated padded 3 x 3
        // with a bias and ReLU after it (an epilogue inside the convolution's kernel), a
        // strided 1 x 1 downsample.
        case!("conv2d_stem", [[2, 3, 13, 13], [64, 3, 7, 7]], |e, p, x| e
            .op(Op::Conv2d(conv(2, PadMode::Pad, [3; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        case!("conv2d_dilated_bias_relu", [[2, 16, 9, 9], [64, 16, 3, 3], [1, 64, 1, 1]], |e, p, x| {
            let y = e.op(Op::Conv2d(conv(1, PadMode::Pad, [1, 1, 2, 2], 2, 1)), &[p[0], p[1]]).unwrap();
            let y = e.add(y, p[2]).unwrap();
            e.op(Op::Relu, &[y]).unwrap()
        }),
        case!("conv2d_1x1_stride2", [[2, 64, 7, 7], [128, 64, 1, 1]], |e, p, x| e
            .op(Op::Conv2d(conv(2, PadMode::Valid, [0; 4], 1, 1)), &[p[0], p[1]])
            .unwrap()),
        // Epilogues: bias + ReLU after a matmul (its gradients: ReLU's gradient after the
        // input-gradient matmul, the bias gradient a sum over rows), ReLU after a convolution
        // and its gradient after pooling's.
        case!("dense_bias_relu", [[8, 20], [12, 20], [12]], |e, p, x| {
            let y = e.matmul(p[0], p[1], false, true).unwrap();
            let y = e.add(y, p[2]).unwrap();
            e.op(Op::Relu, &[y]).unwrap()
        }),
        case!("conv2d_relu_max_pool2d", [[2, 3, 12, 12], [4, 3, 3, 3]], |e, p, x| {
            let y = e.op(Op::Conv2d(conv(1, PadMode::Valid, [0; 4], 1, 1)), &[p[0], p[1]]).unwrap();
            let y = e.op(Op::Relu, &[y]).unwrap();
            e.op(Op::MaxPool2d(pool(2, 2, PadMode::Valid)), &[y]).unwrap()
        }),
        // ResNet's stem pool: overlapping windows, padding.
        case!("max_pool2d_3x3_s2_pad1", [[2, 3, 9, 9]], |e, p, x| {
            e.op(Op::MaxPool2d(Pool2dAttrs { kernel: [3; 2], stride: [2; 2], pad_mode: PadMode::Pad, pad: [1; 4] }), &[p[0]]).unwrap()
        }),
        // A per-channel operand: a strided read.
        case!("mul_per_channel", [[2, 3, 4, 5], [1, 3, 1, 1]], |e, p, x| e.mul(p[0], p[1]).unwrap()),
        Case {
            // More rows than the loss kernel's units: each unit sums several.
            name: "softmax_ce_sparse_mean_300",
            params: vec![vec![300, 7]],
            positive: false,
            inputs: vec![HostTensor::i32(vec![300], (0..300).map(|i| (i * 3) % 7).collect()).unwrap()],
            body: |e, p, x| e.op(Op::SoftmaxCrossEntropy { sparse: true, reduction: Reduction::Mean }, &[p[0], x[0]]).unwrap(),
        },
    ]
}

/// Device cases over many rows (run after the others, whose values they leave as they were).
#[cfg(feature = "wgpu")]
fn long_cases() -> Vec<Case> {
    vec![
        // A dense layer over 2,048 rows: its weight gradient cut into parts along the rows
        // (a batched product, then the parts' sum), its bias gradient summed by row parts.
        case!("dense_long_batch", [[2048, 24], [16, 24], [16]], |e, p, x| {
            let y = e.matmul(p[0], p[1], false, true).unwrap();
            e.add(y, p[2]).unwrap()
        }),
        // A mean over the two leading axes of 2,080 x 8 (a layer norm's parameter gradients):
        // column sums by row parts, scaled.
        case!("reduce_mean_leading_axes", [[16, 130, 8]], |e, p, x| e
            .op(Op::ReduceMean(ReduceAttrs { axes: vec![0, 1], keep_dims: false }), &[p[0]])
            .unwrap()),
        // Attention over 70 positions (cubes of 32 rows spanning two heads; each of a row's
        // parts taking several keys), with and without the mask.
        case!("attention_causal_long", [[2, 70, 48]], |e, p, x| e.op(Op::Attention { heads: 2, causal: true }, &[p[0]]).unwrap()),
        case!("attention_long", [[2, 70, 48]], |e, p, x| e.op(Op::Attention { heads: 2, causal: false }, &[p[0]]).unwrap()),
        // Batch norm's statistics: a mean over N, H and W (1,615 values a channel, more than
        // a plane-sum cube's 256 units, not a multiple of them); a sum over a long last axis
        // (a layer norm's).
        case!("reduce_mean_batch_norm_axes", [[5, 3, 17, 19]], |e, p, x| e
            .op(Op::ReduceMean(ReduceAttrs { axes: vec![0, 2, 3], keep_dims: true }), &[p[0]])
            .unwrap()),
        case!("reduce_sum_last_axis_700", [[3, 2, 700]], |e, p, x| e
            .op(Op::ReduceSum(ReduceAttrs { axes: vec![2], keep_dims: false }), &[p[0]])
            .unwrap()),
    ]
}

/// The device kernels (wgpu here; the same `#[cube]` and cubek code runs on CUDA) for every
/// case, forward and gradients, compiled with the fusion passes, against the CPU's host
/// kernels in f32: matmuls and convolutions, the elementwise programs and epilogues, pooling,
/// the loss and its gradient, bias gradients, sums and means keeping any axes (none of them
/// on burn's ops); matmuls again with TF32 allowed (on lavapipe,
/// without tensor cores, cubek's default runs a unit kernel). No matmul falls back from
/// cubek's kernels to the one-unit-per-output one.
#[cfg(feature = "wgpu")]
#[test]
fn device_kernels_match_the_host_kernels() {
    use cellgraph::runtime::cube::{Wgpu, WgpuDevice};
    let mut rng = StdRng::seed_from_u64(11);
    let mut checked = 0;
    // burn-cubecl 0.21 cannot upload host bools (`bool_from_data` on `Bool(Native)`): the
    // select case stays on the CPU.
    let uploadable = |c: &Case| !c.inputs.iter().any(|t| matches!(t.data, HostData::Bool(_)));
    // The cases draw their values from one generator in turn, and some losses cancel to
    // within a few 1e-5 of the tolerance on other values (conv2d_valid, conv2d_1x1_stride2):
    // cases added later (attention) run last, leaving the others' values as they were.
    let (late, early): (Vec<Case>, Vec<Case>) = cases().into_iter().partition(|c| c.name.starts_with("attention"));
    for case in early.into_iter().chain(device_cases()).chain(late).chain(long_cases()).filter(uploadable) {
        let (mut g, ps, loss) = build(&case);
        let grads = grad(&mut g, loss, &ps, Sens::One).unwrap();
        let mut outs = vec![loss];
        outs.extend(grads.grads.clone());
        g.set_outputs(outs);
        let exe = compile(g).unwrap();
        let tf32_too = case.name.starts_with("matmul");
        let mut cpu_s = Session::<Cpu>::new(cpu());
        let mut devs: Vec<(bool, Session<Wgpu>)> = [false, true]
            .into_iter()
            .filter(|&t| !t || tf32_too)
            .map(|t| {
                let mut s = Session::<Wgpu>::new(WgpuDevice::DefaultDevice);
                s.set_tf32(t);
                (t, s)
            })
            .collect();
        for (p, name) in exe.graph().parameters() {
            let ty = exe.graph().ty(p).clone();
            let lo = if case.positive { 0.1 } else { -1.0 };
            let v: Vec<f32> = (0..ty.numel()).map(|_| rng.random_range(lo..1.0)).collect();
            let t = HostTensor::f32(ty.dims().to_vec(), v).unwrap();
            cpu_s.set_param(name, &t);
            for (_, s) in &mut devs {
                s.set_param(name, &t);
            }
        }
        let inputs: Vec<HostTensor> = case.inputs.clone();
        let a = cpu_s.run(&exe, &inputs).unwrap();
        for (tf32, s) in &mut devs {
            let b = s.run(&exe, &inputs).unwrap();
            // Every sum and mean that keeps an axis runs on the device's own kernels (column or
            // plane sums); one over every axis (the case's loss) stays on burn's (one launch).
            let burn = s.burn_op_steps();
            let full = 1 + u64::from(case.name == "reduce_sum_all");
            let on_burn = (burn.get("reduce_sum").copied().unwrap_or(0), burn.get("reduce_mean").copied().unwrap_or(0));
            assert!(on_burn.0 <= full && on_burn.1 == 0, "{}: reductions on burn's ops: {burn:?}", case.name);
            // TF32 keeps 10 mantissa bits: PyTorch's allow_tf32 tolerance.
            let tol = if *tf32 { 1e-3 } else { 1e-5 };
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                let (x, y) = (x.to_f32(), y.to_f32());
                assert!(x.iter().chain(&y).all(|v| v.is_finite()), "{}: output {i} is not finite: {x:?} {y:?}", case.name);
                let scale = x.iter().map(|v| v.abs()).fold(1e-6f32, f32::max);
                let d = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max) / scale;
                assert!(d < tol, "{} (tf32 {tf32}): output {i} differs between host and device kernels by {d:e} relative", case.name);
            }
        }
        checked += 1;
    }
    assert!(checked >= 50, "only {checked} cases");
    assert_eq!(cellgraph::runtime::cube::naive_matmuls(), 0, "a matmul fell back from cubek's kernels");
}

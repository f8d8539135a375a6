//! The CPU runtime: training on real digits, parameters by name, and errors on bad input.

use crate::common::*;
use cellgraph::prelude::*;

fn session_for(net: &dyn Cell, seed: u64) -> Session<Cpu> {
    let mut s = Session::<Cpu>::new(cpu());
    s.init_params(&net.parameters(), seed);
    s
}

fn lr(v: f64) -> HostTensor {
    HostTensor::scalar_f32(v)
}

fn mnist_batch(m: &Mnist, start: usize, n: usize) -> [HostTensor; 2] {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for i in start..start + n {
        x.extend(lenet_transform(m.image(i), m.rows, m.cols));
        y.push(m.labels[i] as i32);
    }
    [HostTensor::f32(vec![n, 1, 32, 32], x).unwrap(), HostTensor::i32(vec![n], y).unwrap()]
}

#[test]
fn lenet5_sgd_loss_decreases_on_real_mnist() {
    let mnist = Mnist::load(&mnist_dir(), "train").unwrap();
    assert_eq!(mnist.len(), 8000);
    let net = lenet_with_loss();
    let exe = compile(train_one_step(&net, &image_inputs(32, 32), &SGD::new(0.1)).unwrap().graph).unwrap();
    let mut s = session_for(&net, 1);
    let losses: Vec<f64> = (0..150)
        .map(|i| {
            let [x, y] = mnist_batch(&mnist, i * 32, 32);
            s.run(&exe, &[x, y, lr(0.1)]).unwrap()[0].scalar()
        })
        .collect();
    let first: f64 = losses[..10].iter().sum::<f64>() / 10.0;
    let last: f64 = losses[140..].iter().sum::<f64>() / 10.0;
    assert!(first > 2.2 && last < first - 0.4, "loss went from {first:.3} to {last:.3}");
}

#[test]
fn repeated_steps_on_one_batch_overfit_it() {
    let mnist = Mnist::load(&mnist_dir(), "train").unwrap();
    let net = WithLossCell::new(Network::new(&Scope::root()), CrossEntropyLoss::new());
    let inputs = [("data", TensorType::f32([16, 1, 28, 28])), ("label", TensorType::i32([16]))];
    let exe = compile(train_one_step(&net, &inputs, &SGD::new(0.5)).unwrap().graph).unwrap();
    let mut s = session_for(&net, 2);
    let x: Vec<f32> = (0..16).flat_map(|i| mnist.image(i).iter().map(|&p| p as f32 / 255.0)).collect();
    let y: Vec<i32> = mnist.labels[..16].iter().map(|&l| l as i32).collect();
    let batch = [HostTensor::f32(vec![16, 1, 28, 28], x).unwrap(), HostTensor::i32(vec![16], y).unwrap(), lr(0.5)];
    let l0 = s.run(&exe, &batch).unwrap()[0].scalar();
    let mut l = l0;
    for _ in 0..60 {
        l = s.run(&exe, &batch).unwrap()[0].scalar();
    }
    assert!(l < 0.2 * l0, "{l0} -> {l}");
}

#[test]
fn sgd_step_updates_parameters_by_name_exactly() {
    // One Dense(2 -> 1) without bias, MSE on one point: w' = w - lr * 2 (w.x - y) x.
    let net = WithLossCell::new(Dense::new(&Scope::root().child("fc"), 2, 1).without_bias(), MSELoss::new());
    let inputs = [("x", TensorType::f32([1, 2])), ("y", TensorType::f32([1, 1]))];
    let exe = compile(train_one_step(&net, &inputs, &SGD::new(0.1)).unwrap().graph).unwrap();
    let mut s = Session::<Cpu>::new(cpu());
    s.set_param("fc.weight", &HostTensor::f32(vec![1, 2], vec![0.5, -1.0]).unwrap());
    let x = HostTensor::f32(vec![1, 2], vec![1.0, 2.0]).unwrap();
    let y = HostTensor::f32(vec![1, 1], vec![1.0]).unwrap();
    let loss = s.run(&exe, &[x, y, lr(0.1)]).unwrap()[0].scalar();
    // w.x - y = 0.5 - 2 - 1 = -2.5; loss = 6.25; grad = 2 * -2.5 * [1, 2] = [-5, -10].
    assert_eq!(loss, 6.25);
    assert_eq!(s.param("fc.weight").unwrap().to_f32(), vec![1.0, 0.0]);
    assert_eq!(s.param_names(), ["fc.weight"]);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let net = lenet_with_loss();
    let exe = compile(train_one_step(&net, &image_inputs(4, 32), &SGD::new(0.1)).unwrap().graph).unwrap();
    let x = HostTensor::f32(vec![4, 1, 32, 32], vec![0.0; 4096]).unwrap();

    let mut empty = Session::<Cpu>::new(cpu());
    let e = empty.run(&exe, &[x.clone(), HostTensor::i32(vec![4], vec![0; 4]).unwrap(), lr(0.1)]).unwrap_err().to_string();
    assert!(e.starts_with("parameter `") && e.contains("has no value"), "{e}");

    let mut s = session_for(&net, 1);
    let e = s.run(&exe, std::slice::from_ref(&x)).unwrap_err().to_string();
    assert_eq!(e, "inputs of graph `train_one_step`: expected 3 inputs, got 1");
    let e = s.run(&exe, &[x.clone(), HostTensor::i32(vec![5], vec![0; 5]).unwrap(), lr(0.1)]).unwrap_err().to_string();
    assert_eq!(e, "input 1 (`label`): expected i32[4], got i32[5]");
    let before = s.params_host();
    let e = s.run(&exe, &[x.clone(), HostTensor::i32(vec![4], vec![0, 3, 10, 1]).unwrap(), lr(0.1)]).unwrap_err().to_string();
    assert_eq!(e, "net.loss_fn: softmax_cross_entropy: label 10 at batch position 2 is out of range for 10 classes (valid: 0..9)");
    assert_eq!(s.params_host(), before, "a failed step leaves parameters untouched");

    s.set_param("fc1.weight", &HostTensor::f32(vec![2, 2], vec![0.0; 4]).unwrap());
    let e = s.run(&exe, &[x, HostTensor::i32(vec![4], vec![0; 4]).unwrap(), lr(0.1)]).unwrap_err().to_string();
    assert!(e.starts_with("parameter `fc1.weight`: expected f32[120,400]"), "{e}");
    assert!(HostTensor::f32(vec![2, 2], vec![0.0; 3]).unwrap_err().to_string().contains("needs 4 elements, data has 3"));
}

#[test]
fn intermediates_are_freed_at_their_last_use() {
    // x -> exp -> exp -> ... (10 times): at most the input, one live value and the next.
    let mut g = Graph::new("chain");
    let x = g.add_leaf(Op::Input { index: 0, name: "x".into() }, TensorType::f32([256]), "").unwrap();
    let mut y = x;
    for _ in 0..10 {
        y = g.add(Op::Mul, &[y, y], "").unwrap(); // an operand used twice by its last user
    }
    g.set_outputs(vec![y]);
    let exe = compile(g).unwrap();
    assert_eq!(exe.peak_bytes(), 2 * 256 * 4, "two buffers of 1 KiB live at once, not eleven");
    let mut s = Session::<Cpu>::new(cpu());
    let out = s.run(&exe, &[HostTensor::f32(vec![256], vec![1.0001; 256]).unwrap()]).unwrap();
    assert!((out[0].to_f32()[0] - 1.0001f32.powi(1024)).abs() < 1e-3);
}

#[test]
fn f32_and_f64_backends_coexist_in_one_process() {
    // burn keys device settings by device only; the lowering must take dtypes from the backend.
    let (g, _) = trace(&lenet_with_loss(), "g", &image_inputs(2, 32)).unwrap();
    let exe = compile(g).unwrap();
    let net = lenet_with_loss();
    let x = HostTensor::f32(vec![2, 1, 32, 32], (0..2048).map(|i| (i % 13) as f32 * 0.1).collect()).unwrap();
    let y = HostTensor::i32(vec![2], vec![3, 7]).unwrap();
    let mut f32s = session_for(&net, 4);
    let mut f64s = Session::<Cpu>::new_f64(cpu());
    f64s.init_params(&net.parameters(), 4);
    let a = f32s.run(&exe, &[x.clone(), y.clone()]).unwrap()[0].scalar();
    let b = f64s.run(&exe, &[x.to_f64_tensor(), y.clone()]).unwrap()[0].scalar();
    let c = f32s.run(&exe, &[x, y]).unwrap()[0].scalar();
    assert_eq!(a, c);
    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
}

/// A golden dump's graph (`tests/golden/dumps/{stem}.ir`), with random values drawn from `seed`
/// for its parameters (by name) and its inputs (in input-index order): class ids in `0..10`,
/// floats in `[-1, 1)`.
pub(crate) fn golden_with_values(stem: &str, seed: u64) -> (Graph, Vec<(String, HostTensor)>, Vec<HostTensor>) {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/dumps");
    let g = parse(&std::fs::read_to_string(dir.join(format!("{stem}.ir"))).unwrap()).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut draw = |ty: &TensorType| match ty.dtype {
        DType::I32 => HostTensor::i32(ty.dims().to_vec(), (0..ty.numel()).map(|_| rng.random_range(0..10)).collect()).unwrap(),
        _ => HostTensor::f32(ty.dims().to_vec(), (0..ty.numel()).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap(),
    };
    let params: Vec<(String, HostTensor)> = g.parameters().into_iter().map(|(id, name)| (name.to_string(), draw(g.ty(id)))).collect();
    let mut inputs = g.inputs();
    inputs.sort_by_key(|&(_, index, _)| index);
    let inputs: Vec<HostTensor> = inputs.into_iter().map(|(id, _, _)| draw(g.ty(id))).collect();
    (g, params, inputs)
}

/// A CPU session holding `params`, on the host kernels (`native`) or on burn's ops.
fn session_with(params: &[(String, HostTensor)], native: bool) -> Session<Cpu> {
    let mut s = Session::<Cpu>::new(cpu());
    s.set_native_kernels(native);
    for (n, v) in params {
        s.set_param(n, v);
    }
    s
}

/// Plans run from several threads at once on one multi-thread pool (a thread waiting inside
/// a kernel runs other plans' jobs meanwhile, whole plans included) give each session the
/// bits it gets alone: the kernels' thread-local scratch is not shared between them.
#[test]
fn plans_running_at_once_on_one_pool_keep_their_bits() {
    let (g, params, inputs) = golden_with_values("02_dce_micro_step", 11);
    let exe = compile(g).unwrap();
    let alone = {
        let mut s = session_with(&params, true);
        s.run(&exe, &inputs).unwrap();
        s.params_host()
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let results: Vec<_> = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    (0..10)
                        .map(|_| {
                            let mut s = session_with(&params, true);
                            pool.install(|| s.run(&exe, &inputs).unwrap());
                            s.params_host()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        runs.into_iter().flat_map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(results.len(), 80);
    for r in results {
        assert_eq!(r, alone);
    }
}

/// LeNet5's GradAccumulation graphs as the compiler sees them before fusion (the golden
/// dumps), compiled fused and unfused and run in f32 on the same random values: the loss,
/// every accumulator and every updated parameter and moment are the same bits.
#[test]
fn fused_lenet_accumulation_plans_equal_the_unfused_ones() {
    use cellgraph::runtime::compile_unfused;
    // The micro-step's bias + ReLU chains join their matmuls as epilogues, with the other
    // ReLUs (onto the convolutions), ReLU gradients (onto matmuls and pooling gradients) and
    // fc3's bias (9), and the eight gradients are added into their accumulators by the
    // matmuls, filter gradients and bias sums producing them (8).
    for (stem, want) in [("02_dce_micro_step", (0, 17)), ("02_dce_optimizer", (16, 0))] {
        let (g, params, inputs) = golden_with_values(stem, 5);
        let (fused, plain) = (compile(g.clone()).unwrap(), compile_unfused(g.clone()).unwrap());
        let count = |f: fn(&Op) -> bool| fused.graph().ids().into_iter().filter(|&id| f(&fused.graph().node(id).op)).count();
        let nodes = (count(|op| matches!(op, Op::Fused { .. })), count(|op| matches!(op, Op::Epilogue { .. })));
        assert_eq!(nodes, want, "{stem}: (fused, epilogue) nodes");
        assert!(fused.len() < plain.len(), "{stem}: {} steps fused, {} unfused", fused.len(), plain.len());
        let run = |exe: &Executable, native: bool| {
            let mut s = session_with(&params, native);
            let out = s.run(exe, &inputs).unwrap();
            (out, s.params_host())
        };
        let bits = |t: &HostTensor| t.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for native in [true, false] {
            let ((fo, fp), (po, pp)) = (run(&fused, native), run(&plain, native));
            for (a, b) in fo.iter().zip(&po) {
                assert_eq!(bits(a), bits(b), "{stem}: output (host kernels: {native})");
            }
            for (name, a) in &fp {
                assert_eq!(bits(a), bits(&pp[name]), "{stem}: {name} (host kernels: {native})");
            }
        }
    }
}

/// LeNet5's accumulation micro-step (batch 8) on the host kernels, in steady state: its values
/// come from the session's arena, sized by the plan at compile time, so after the first runs
/// it allocates no new buffer and nothing of 4 KiB or more (the labels widened for the loss
/// kernels remain, and the GEMM's packing scratch, counted apart); the accumulators it adds
/// into hold what burn's ops give; and the clear at a window's end takes its zeros from the
/// arena too.
#[test]
fn a_steady_state_micro_step_allocates_no_tensor_memory() {
    let (g, params, inputs) = golden_with_values("02_dce_micro_step", 9);
    let exe = compile(g).unwrap();
    let conv1 = 8 * 6 * 28 * 28;
    assert!(exe.arena().iter().any(|&(len, n)| len == conv1 && n >= 1), "conv1's output is planned: {:?}", exe.arena());
    let planned: u64 = exe.arena().iter().map(|&(_, n)| n as u64).sum();
    let (mut host, mut burn) = (session_with(&params, true), session_with(&params, false));
    // One thread: every kernel runs on the thread whose allocations are counted.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let (warm, (steady, seen)) = pool.install(|| {
        for _ in 0..2 {
            host.run(&exe, &inputs).unwrap();
        }
        let warm = host.fresh_buffers();
        let ((), seen) = counting::allocations(|| {
            for _ in 0..3 {
                host.run(&exe, &inputs).unwrap();
            }
        });
        (warm, (host.fresh_buffers(), seen))
    });
    let counting::Seen { count, bytes, largest, simd_bytes } = seen;
    eprintln!("3 steady micro-steps: {count} allocations, {bytes} bytes, largest {largest} (and {simd_bytes} bytes of SIMD scratch); arena: {warm} buffers for {planned} planned");
    assert!(warm > 0 && warm <= planned, "the arena holds at most what the plan said: {warm} of {planned}");
    assert_eq!(steady, warm, "a steady-state run takes every buffer from the arena");
    assert!(largest < 4096, "no tensor memory is allocated in steady state: largest allocation {largest} bytes ({count} allocations, {bytes} bytes)");
    // The same five runs, each in a new session (nothing in its arena yet), carrying the
    // accumulators over: the bits of the steady state's.
    let mut cold = params.clone();
    for _ in 0..5 {
        let mut s = session_with(&cold, true);
        s.run(&exe, &inputs).unwrap();
        cold = cold.iter().map(|(n, _)| (n.clone(), s.param(n).unwrap())).collect();
        burn.run(&exe, &inputs).unwrap();
    }
    for (name, cold) in cold.iter().filter(|(n, _)| n.starts_with("accu_grads.")) {
        let bits = |t: &HostTensor| t.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (a, b) = (host.param(name).unwrap(), burn.param(name).unwrap().to_f32());
        assert_eq!(bits(&a), bits(cold), "{name}: the steady state against new sessions");
        // burn's ops round the convolutions differently; a lost or doubled add is far off.
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (x, y) in a.to_f32().iter().zip(&b) {
            assert!((x - y).abs() <= 1e-3 * scale, "{name}: {x} (host kernels, arena) vs {y} (burn's ops)");
        }
    }
    let clear = compile(golden_with_values("02_dce_clear", 9).0).unwrap();
    let (fresh, seen) = pool.install(|| {
        host.run(&clear, &[]).unwrap();
        host.run(&exe, &inputs).unwrap();
        let before = host.fresh_buffers();
        let ((), seen) = counting::allocations(|| {
            host.run(&clear, &[]).unwrap();
        });
        (host.fresh_buffers() - before, seen)
    });
    assert_eq!(fresh, 0, "a steady-state clear takes every buffer from the arena");
    assert!(seen.largest < 4096, "a steady-state clear allocates no tensor memory: largest allocation {} bytes", seen.largest);
    for name in host.param_names().iter().filter(|n| n.starts_with("accu_grads.")) {
        assert!(host.param(name).unwrap().to_f32().iter().all(|v| v.to_bits() == 0), "{name} is +0 everywhere after the clear");
    }
}

/// ReLU and neg keep the unfused plan's bits for NaN and -0 on short and long rows on the host
/// kernels, and its values on burn's ops; a `fused` node reading an operand it does not have is an
/// error from `compile` in every build, not a panic in the fusion pass.
#[test]
fn fused_relu_and_neg_keep_the_unfused_bits_for_nan_and_negative_zero() {
    use cellgraph::runtime::compile_unfused;
    for n in [3usize, 40] {
        for op in [Op::Relu, Op::Neg] {
            let mut g = Graph::new("g");
            let x = g.add_leaf(Op::Parameter { name: "x".into() }, TensorType::f32([2, n]), "t").unwrap();
            let b = g.add_leaf(Op::Parameter { name: "b".into() }, TensorType::f32([n]), "t").unwrap();
            let y = g.add(Op::Add, &[x, b], "t").unwrap();
            let r = g.add(op.clone(), &[y], "t").unwrap();
            g.set_outputs(vec![r]);
            let xs: Vec<f32> = (0..2 * n).map(|i| [f32::NAN, -0.0, -1.5, 2.5, 0.0][i % 5]).collect();
            let x = HostTensor::f32(vec![2, n], xs).unwrap();
            let b = HostTensor::f32(vec![n], vec![-0.0; n]).unwrap();
            let (fused, plain) = (compile(g.clone()).unwrap(), compile_unfused(g).unwrap());
            assert!(fused.len() < plain.len(), "add + {} fuse", op.name());
            for native in [true, false] {
                let run = |exe: &Executable| {
                    let mut s = Session::<Cpu>::new(cpu());
                    s.set_native_kernels(native);
                    s.set_param("x", &x);
                    s.set_param("b", &b);
                    s.run(exe, &[]).unwrap()[0].to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                let (f, p) = (run(&fused), run(&plain));
                if native {
                    assert_eq!(f, p, "{} over {n} (host kernels)", op.name());
                } else {
                    // burn-ndarray's own relu gives -0 or +0 for -0 depending on the buffer's
                    // alignment (SIMD body, scalar head and tail), so burn's ops agree on values.
                    let same = |a: u32, b: u32| f32::from_bits(a) == f32::from_bits(b) || (f32::from_bits(a).is_nan() && f32::from_bits(b).is_nan());
                    assert!(f.iter().zip(&p).all(|(&a, &b)| same(a, b)), "{} over {n} (burn's ops): {f:?} vs {p:?}", op.name());
                }
            }
        }
    }
    let mut g = Graph::new("g");
    let a = g.add_leaf(Op::Parameter { name: "a".into() }, TensorType::f32([2]), "t").unwrap();
    let bad = g.add_unchecked(Op::Fused { expr: "$0 $1 add".parse().unwrap() }, &[a], TensorType::f32([2]), "net.fused");
    g.set_outputs(vec![bad]);
    let err = compile(g).unwrap_err().to_string();
    assert!(err.contains("`$1` names no operand") && err.contains("net.fused"), "{err}");
}

/// The host kernels of softmax cross-entropy (class-id labels) and its gradient give the
/// bits of the reference lowering on burn's ops, for every reduction, on rows shorter and
/// longer than ndarray's eight running sums, in f32 and in f64 (the CPU backend in double
/// precision); an out-of-range label is still
/// the reference lowering's clear error.
#[test]
fn host_loss_kernels_give_the_reference_bits() {
    fn session<B: cellgraph::runtime::Backend>(wide: bool) -> Session<B> {
        if wide {
            Session::<B>::new_f64(Default::default())
        } else {
            Session::<B>::new(Default::default())
        }
    }
    fn case<B: cellgraph::runtime::Backend>(n: usize, c: usize, reduction: Reduction, wide: bool) {
        let dt = TensorType::f32;
        let mut g = Graph::new("loss");
        let l = g.add_leaf(Op::Input { index: 0, name: "logits".into() }, dt(vec![n, c]), "t").unwrap();
        let y = g.add_leaf(Op::Input { index: 1, name: "labels".into() }, TensorType::i32([n]), "t").unwrap();
        let loss = g.add(Op::SoftmaxCrossEntropy { sparse: true, reduction }, &[l, y], "net.loss").unwrap();
        let dl = g.add_leaf(Op::Input { index: 2, name: "dl".into() }, g.ty(loss).clone(), "t").unwrap();
        let grad = g.add(Op::SoftmaxCrossEntropyGrad { sparse: true, reduction }, &[l, y, dl], "net.loss").unwrap();
        g.set_outputs(vec![loss, grad]);
        let exe = compile(g.clone()).unwrap();
        let logits: Vec<f64> = (0..n * c).map(|i| ((i * 7919) % 113) as f64 / 9.0 - 6.0).collect();
        let host = |d: Vec<usize>, v: Vec<f64>| {
            if wide {
                HostTensor::new(d, HostData::F64(v)).unwrap()
            } else {
                HostTensor::f32(d, v.iter().map(|&x| x as f32).collect()).unwrap()
            }
        };
        let dls: Vec<f64> = (0..g.ty(loss).numel()).map(|i| 0.75 + i as f64).collect();
        let labels =
            |bad: bool| HostTensor::i32(vec![n], (0..n).map(|i| if bad && i == n - 1 { c as i32 } else { ((i * 5) % c) as i32 }).collect()).unwrap();
        let inputs = |bad| [host(vec![n, c], logits.clone()), labels(bad), host(g.ty(loss).dims().to_vec(), dls.clone())];
        let run = |native: bool, bad: bool| {
            let mut s = session::<B>(wide);
            s.set_native_kernels(native);
            s.run(&exe, &inputs(bad))
        };
        let bits = |ts: Vec<HostTensor>| ts.iter().map(|t| t.to_f64().iter().map(|v| v.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
        let (fast, reference) = (run(true, false).unwrap(), run(false, false).unwrap());
        // In this plan the gradient exponentiates the log-softmax its forward kept; alone, it
        // computes it again.
        let (fast, reference) = (bits(fast), bits(reference));
        assert_eq!(fast, reference, "n {n}, c {c}, {reduction:?}, f64 {wide}");
        let mut alone = g.clone();
        alone.set_outputs(vec![grad]);
        let alone = compile(alone).unwrap();
        let mut s = session::<B>(wide);
        assert_eq!(bits(s.run(&alone, &inputs(false)).unwrap())[0], reference[1], "the gradient alone: n {n}, c {c}, {reduction:?}");
        let err = run(true, true).unwrap_err().to_string();
        assert!(err.contains(&format!("label {c} at batch position {}", n - 1)) && err.contains("net.loss"), "{err}");
    }
    for (n, c) in [(32, 10), (5, 3), (3, 17), (1, 8)] {
        for r in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            case::<Cpu>(n, c, r, false);
            case::<Cpu>(n, c, r, true);
        }
    }
}

/// A convolution whose batch is one im2col chunk runs its GEMMs on every thread of the pool;
/// gemm splits the output, never the contraction, so forward, input gradient and filter
/// gradient give the same bits on 1, 2 and 3 threads.
#[test]
fn one_chunk_convolutions_give_the_same_bits_on_any_number_of_threads() {
    use cellgraph::compiler::autodiff::{grad, Sens};
    use cellgraph::compiler::{Conv2dAttrs, ReduceAttrs};
    let mut g = Graph::new("g");
    let x = g.add_leaf(Op::Parameter { name: "x".into() }, TensorType::f32([8, 256, 2, 2]), "net").unwrap();
    let w = g.add_leaf(Op::Parameter { name: "w".into() }, TensorType::f32([256, 256, 3, 3]), "net").unwrap();
    let attrs = Conv2dAttrs { stride: [1, 1], pad_mode: PadMode::Pad, pad: [1; 4], dilation: [1, 1], groups: 1 };
    let y = g.add(Op::Conv2d(attrs), &[x, w], "net").unwrap();
    let sq = g.add(Op::Mul, &[y, y], "net").unwrap();
    let l = g.add(Op::ReduceSum(ReduceAttrs { axes: vec![0, 1, 2, 3], keep_dims: false }), &[sq], "net").unwrap();
    let d = grad(&mut g, l, &[x, w], Sens::One).unwrap();
    g.set_outputs([vec![y], d.grads.clone()].concat());
    let exe = compile(g).unwrap();
    let wave = |n: usize, f: f64| HostTensor::f32(vec![n], (0..n).map(|i| ((i as f64 * f).sin() * 0.5) as f32).collect()).unwrap();
    let run = |threads: usize| {
        let mut s = Session::<Cpu>::new(cpu());
        s.set_param("x", &HostTensor { shape: vec![8, 256, 2, 2], ..wave(8 * 256 * 4, 0.37) });
        s.set_param("w", &HostTensor { shape: vec![256, 256, 3, 3], ..wave(256 * 256 * 9, 0.011) });
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| s.run(&exe, &[]).unwrap()).into_iter().map(|t| t.to_f32()).collect::<Vec<_>>()
    };
    let one = run(1);
    for threads in [2, 3] {
        let other = run(threads);
        for (k, (a, b)) in one.iter().zip(&other).enumerate() {
            assert!(a.iter().map(|v| v.to_bits()).eq(b.iter().map(|v| v.to_bits())), "output {k} differs on {threads} threads");
        }
    }
}

/// Convolutions on maps small enough to run as dense layers (3x3 padded by 1 on 2x2 maps) keep
/// their dense filter between runs while the parameter keeps its value; every write of the
/// parameter drops it: an optimizer step's write, and `set_param`. After each write, the
/// forward and a training step (whose second convolution's input gradient reads the same
/// dense filter as its forward) give what a fresh session with the same parameters gives.
#[test]
fn dense_filters_follow_their_parameters_writes() {
    let net = || SequentialCell::new(&Scope::root().child("net")).add(|s| Conv2d::new(s, 3, 4, 3)).add(|s| Conv2d::new(s, 4, 5, 3));
    let (g, _) = trace(&net(), "forward", &[("x", TensorType::f32([2, 3, 2, 2]))]).unwrap();
    let fwd = compile(g).unwrap();
    let with_loss = WithLossCell::new(net(), MSELoss::new());
    let inputs = [("x", TensorType::f32([2, 3, 2, 2])), ("y", TensorType::f32([2, 5, 2, 2]))];
    let step = compile(train_one_step(&with_loss, &inputs, &SGD::new(0.5)).unwrap().graph).unwrap();
    let x = HostTensor::f32(vec![2, 3, 2, 2], (0..24).map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5).collect()).unwrap();
    let y = HostTensor::f32(vec![2, 5, 2, 2], (0..40).map(|i| ((i * 5) % 13) as f32 / 13.0).collect()).unwrap();
    let fresh = |s: &Session<Cpu>, exe: &Executable, args: &[HostTensor]| {
        let mut f = Session::<Cpu>::new(cpu());
        for (name, v) in s.params_host() {
            f.set_param(&name, &v);
        }
        f.run(exe, args).unwrap()
    };
    let mut s = session_for(&with_loss, 3);
    let y0 = s.run(&fwd, std::slice::from_ref(&x)).unwrap();
    assert_eq!(y0, fresh(&s, &fwd, std::slice::from_ref(&x)));
    for _ in 0..2 {
        let expected = fresh(&s, &step, &[x.clone(), y.clone(), lr(0.5)]);
        assert_eq!(s.run(&step, &[x.clone(), y.clone(), lr(0.5)]).unwrap(), expected, "a step after a write");
    }
    let y1 = s.run(&fwd, std::slice::from_ref(&x)).unwrap();
    assert_ne!(y1, y0, "the steps changed the filters");
    assert_eq!(y1, fresh(&s, &fwd, std::slice::from_ref(&x)), "the forward after the optimizer's writes");
    let w = s.param("net.1.weight").unwrap();
    s.set_param("net.1.weight", &HostTensor::f32(w.shape.clone(), w.to_f32().iter().map(|v| -v).collect()).unwrap());
    let y2 = s.run(&fwd, std::slice::from_ref(&x)).unwrap();
    assert_ne!(y2, y1);
    assert_eq!(y2, fresh(&s, &fwd, std::slice::from_ref(&x)), "the forward after set_param");
}

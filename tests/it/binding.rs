//! What each plan step runs: every step of LeNet5, the seed-002 MLP, ResNet-18 and the GPT is
//! bound when the plan is compiled, and on the CPU to a host kernel (or is a source, a
//! reshape, an accumulation in place); a step that computes on burn's ops is listed with its
//! reason ([`Executable::host_steps`], `cellgraph inspect plan`) and counted when it runs
//! ([`Session::burn_op_steps`]).

use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

use cellgraph::compiler::{Graph, HostData, Op, TensorType};
use cellgraph::prelude::*;
use cellgraph::runtime::burn_backend::tensor::Device;
use cellgraph::runtime::Place;
use cellgraph::runtime::{compile, Session};
use cellgraph::runtime::{Accumulator, Backend, HostRun};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A network and two micro-batches for it.
pub(crate) type Case = (&'static str, fn() -> WithLossCell, Vec<Vec<HostTensor>>);

fn images(rng: &mut StdRng, n: usize, shape: [usize; 3]) -> Vec<HostTensor> {
    let x: Vec<f32> = (0..n * shape.iter().product::<usize>()).map(|_| rng.random_range(-1.0..1.0)).collect();
    let y: Vec<i32> = (0..n).map(|_| rng.random_range(0..10)).collect();
    vec![HostTensor::f32(vec![n, shape[0], shape[1], shape[2]], x).unwrap(), HostTensor::i32(vec![n], y).unwrap()]
}

/// LeNet5, the seed-002 MLP, ResNet-18 and the GPT (with dropout), two micro-batches each.
pub(crate) fn cases() -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(5);
    let resnet18 = || WithLossCell::new(ResNet18::new(&Scope::root(), 10), CrossEntropyLoss::new());
    vec![
        ("lenet5", crate::common::lenet_with_loss as fn() -> WithLossCell, (0..2).map(|_| images(&mut rng, 4, [1, 32, 32])).collect()),
        ("mlp", crate::common::mlp_with_loss, (0..2).map(|_| images(&mut rng, 4, [1, 28, 28])).collect()),
        ("resnet18", resnet18, (0..2).map(|_| images(&mut rng, 2, [3, 32, 32])).collect()),
        ("gpt", crate::gpt::dropped, (0..2).map(|_| crate::gpt::sequences(&mut rng, 3)).collect()),
    ]
}

/// What [`window`] found: every plan's listed steps that run on burn's ops (`op: reason`),
/// the steps the session ran on them (by op), and the micro-step plans' kernels counted by
/// name (what `cellgraph inspect plan` lists).
pub(crate) struct Window {
    listed: Vec<String>,
    ran: BTreeMap<&'static str, u64>,
    /// The micro-steps' steps the session bound to burn's ops because the device's kernels
    /// decline them.
    declined: Vec<(&'static str, String)>,
    kernels: BTreeMap<String, usize>,
}

/// One window of `net` on `batches` on `device` (Momentum), and what its plans ran.
pub(crate) fn window<B: Backend>(net: WithLossCell, batches: &[Vec<HostTensor>], device: Device<B>) -> Window {
    let net = GradAccumulation::across_steps(net, batches.len());
    let mut acc = Accumulator::<B>::new(Rc::new(net), Rc::new(Momentum::new(0.01, 0.9)), device, 3).unwrap();
    for b in batches {
        acc.step(b, Place::Regular).unwrap();
    }
    acc.finish().unwrap();
    assert_eq!(acc.updates(), 1);
    let mut kernels: BTreeMap<String, usize> = BTreeMap::new();
    for s in acc.micro_plans().flat_map(|e| e.host_steps()) {
        if let HostRun::Kernel(k) = s.run {
            *kernels.entry(k).or_default() += 1;
        }
    }
    let (optimizer, clear) = acc.boundary_plans();
    let listed = acc
        .micro_plans()
        .chain([optimizer, clear])
        .flat_map(|e| e.host_steps())
        .filter_map(|s| match s.run {
            HostRun::BurnOps(why) => Some(format!("{}: {why}", s.op)),
            _ => None,
        })
        .collect();
    // The micro-steps' (on a device the boundary runs the fused update, not its plans).
    let declined = acc
        .micro_plans()
        .flat_map(|e| acc.session().steps(e))
        .filter_map(|s| match s.run {
            HostRun::BurnOps(why) if why.starts_with("the device's kernels decline it") => Some((s.op, why)),
            _ => None,
        })
        .collect();
    Window { listed, ran: acc.session().burn_op_steps().clone(), kernels, declined }
}

/// On the CPU every step of LeNet5's, the MLP's and ResNet-18's micro-steps and boundaries is
/// bound to a host kernel (or is a source, a reshape, a store or an accumulation in place),
/// and a window runs no step on burn's ops. The GPT's run on burn's ops only the steps on its
/// labels' integers and masks and on scalars (its token-weighted loss's
/// `select(equal(labels, ignored), ...)`, the token count, the loss's seed): every other step,
/// the embedding's `gather`/`scatter_add` and dropout included, is bound. The steps the
/// session counts on burn's ops are the ones the listing names. A new op without a host
/// kernel, or a kernel that stops binding, fails here.
#[test]
fn every_step_binds_to_a_host_kernel_on_the_cpu() {
    for (name, net, batches) in cases() {
        let Window { listed, ran, kernels, declined } = window::<Cpu>(net(), &batches, cpu());
        assert!(declined.is_empty(), "{name}: the CPU runs every bound kernel: {declined:?}");
        eprintln!("{name}: {}", kernels.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", "));
        let listed_ops: BTreeSet<&str> = listed.iter().map(|l| l.split(':').next().unwrap_or_default()).collect();
        let want: BTreeSet<&str> = match name {
            "gpt" => ["constant", "equal", "reduce_sum", "select"].into(),
            _ => BTreeSet::new(),
        };
        let unique: BTreeSet<&String> = listed.iter().collect();
        assert_eq!(listed_ops, want, "{name}: steps without a host kernel: {unique:#?}");
        let ran_ops: BTreeSet<&str> = ran.keys().copied().collect();
        assert_eq!(ran_ops, want, "{name}: steps that ran on burn's ops: {ran:?}");
    }
}

/// The host kernels that read integer operands (`gather`, `scatter_add`, `dropout`) give the
/// bits of burn's ops in f32, ids repeated and in any order (`scatter_add` sums rows in the
/// ids' order); an id out of range leaves the step to the lowering, which names it.
#[test]
fn the_kernels_with_ids_give_burns_bits() {
    let i64s = HostTensor::new(vec![2], HostData::I64(vec![11, 3])).unwrap();
    let step = HostTensor::new(vec![], HostData::I64(vec![4])).unwrap();
    let mut g = Graph::new("ids");
    let table = g.add_leaf(Op::Parameter { name: "table".into() }, TensorType::f32([7, 5]), "t").unwrap();
    let ids = g.add_leaf(Op::Input { index: 0, name: "ids".into() }, TensorType::i32([2, 4]), "t").unwrap();
    let items = g.add_leaf(Op::Input { index: 1, name: "items".into() }, i64s.ty(), "t").unwrap();
    let update = g.add_leaf(Op::Input { index: 2, name: "update".into() }, step.ty(), "t").unwrap();
    let rows = g.add(Op::Gather, &[table, ids], "t").unwrap();
    let dropped = g.add(Op::Dropout { p: 0.3, seed: 9 }, &[rows, items, update], "t").unwrap();
    let back = g.add(Op::ScatterAdd { rows: 7 }, &[ids, dropped], "t").unwrap();
    g.set_outputs(vec![rows, dropped, back]);
    let exe = compile(g).unwrap();
    let kernels: Vec<String> = exe
        .host_steps()
        .into_iter()
        .filter_map(|s| match s.run {
            HostRun::Kernel(k) => Some(k),
            _ => None,
        })
        .collect();
    assert_eq!(kernels, ["Gather", "Dropout", "ScatterAdd"]);
    let mut rng = StdRng::seed_from_u64(2);
    let t = HostTensor::f32(vec![7, 5], (0..35).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap();
    let run = |native: bool, ids: Vec<i32>| {
        let mut s = Session::<Cpu>::new(cpu());
        s.set_native_kernels(native);
        s.set_param("table", &t);
        let inputs = [HostTensor::i32(vec![2, 4], ids).unwrap(), i64s.clone(), step.clone()];
        let out = s.run(&exe, &inputs);
        (out.map(|o| o.iter().map(|t| t.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>()), s.burn_op_steps().clone())
    };
    let ids = vec![3, 0, 6, 3, 3, 1, 0, 5];
    let ((host, host_burn), (burn, _)) = (run(true, ids.clone()), run(false, ids));
    assert_eq!(host.unwrap(), burn.unwrap());
    assert!(host_burn.is_empty(), "{host_burn:?}");
    let (bad, _) = run(true, vec![3, 0, 7, 3, 3, 1, 0, 5]);
    let err = bad.unwrap_err().to_string();
    assert!(err.contains("7") && err.contains("gather"), "{err}");
}

/// A plan of `op` over inputs of `inputs`' types.
#[cfg(feature = "wgpu")]
fn one_op(op: Op, inputs: &[HostTensor]) -> cellgraph::runtime::Executable {
    let mut g = Graph::new("one op");
    let xs: Vec<_> =
        inputs.iter().enumerate().map(|(i, t)| g.add_leaf(Op::Input { index: i, name: format!("x{i}") }, t.ty(), "t").unwrap()).collect();
    let y = g.add(op, &xs, "t").unwrap();
    g.set_outputs(vec![y]);
    compile(g).unwrap()
}
/// The plan's output bits on the CPU and on wgpu, and the device reads the wgpu run made;
/// the wgpu run must put no step on burn's ops.
#[cfg(feature = "wgpu")]
fn host_and_wgpu(exe: &cellgraph::runtime::Executable, inputs: &[HostTensor], what: &str) -> (Vec<u32>, Vec<u32>, u64) {
    let bits = |t: &HostTensor| t.to_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let host = bits(&Session::<Cpu>::new(cpu()).run(exe, inputs).unwrap()[0]);
    let mut s = Session::<cellgraph::runtime::cube::Wgpu>::new(cellgraph::runtime::cube::WgpuDevice::DefaultDevice);
    let reads = cellgraph::runtime::value::device_reads();
    let dev = bits(&s.run(exe, inputs).unwrap()[0]);
    let reads = cellgraph::runtime::value::device_reads() - reads;
    assert!(s.burn_op_steps().is_empty(), "{what}: {:?}", s.burn_op_steps());
    (host, dev, reads)
}

/// With graphs on, the plan is captured at its second run on wgpu and replayed at its third,
/// each run giving the bits `want`.
#[cfg(feature = "wgpu")]
fn captured_and_replayed(exe: &cellgraph::runtime::Executable, inputs: &[HostTensor], want: &[u32], what: &str) {
    let mut s = Session::<cellgraph::runtime::cube::Wgpu>::new(cellgraph::runtime::cube::WgpuDevice::DefaultDevice);
    s.set_graphs(true).unwrap();
    for run in 0..3 {
        let out: Vec<u32> = s.run_replayed(exe, inputs).unwrap()[0].to_host().to_f32().iter().map(|x| x.to_bits()).collect();
        assert_eq!(out, want, "{what}, run {run} with graphs on");
    }
    let r = s.replay_counts();
    assert_eq!((r.captures, r.replays), (1, 1), "{what}: {r:?} {:?}", s.replay_blockers());
}

/// Dropout on the device draws its factors in the kernel from the host's hash: over 128 rows
/// of 48 (items near the top of `i32`; p = 0.3, and p = 0.5 with a seed past `i64`) it gives
/// the host kernel's bits (and so do the device's causal mask and row maxima),
/// runs on its own kernel (not burn's ops) and reads nothing back, so a plan with dropout can
/// be captured.
#[cfg(feature = "wgpu")]
#[test]
fn dropout_and_causal_masks_on_wgpu_give_the_hosts_bits() {
    let mut rng = StdRng::seed_from_u64(4);
    let x = HostTensor::f32(vec![128, 48], (0..128 * 48).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap();
    let items = HostTensor::new(vec![128], HostData::I64((0..128).map(|i| 2_000_000_000 + 7 * i).collect())).unwrap();
    let step = HostTensor::new(vec![], HostData::I64(vec![4])).unwrap();
    for (p, seed) in [(0.3, 9), (0.5, 0xf00d_cafe_dead_beef)] {
        let inputs = [x.clone(), items.clone(), step.clone()];
        let exe = one_op(Op::Dropout { p, seed }, &inputs);
        let (host, dev, reads) = host_and_wgpu(&exe, &inputs, &format!("dropout {p}"));
        // The output's own read back is the one read.
        assert_eq!(reads, 1, "p {p}: dropout read the device back");
        assert_eq!(dev, host, "p {p}: the device's factors differ from the host's");
        let dropped = host.iter().filter(|v| f32::from_bits(**v) == 0.0).count() as f64 / host.len() as f64;
        assert!((dropped - p).abs() < 0.03, "p {p}: dropped {dropped}");
        captured_and_replayed(&exe, &inputs, &host, &format!("dropout {p}"));
    }
    // Causal masking, made on the device too: queries 5 over keys 7 (the last 5 keys align
    // with the queries), filled with -inf.
    let scores = [HostTensor::f32(vec![2, 3, 5, 7], (0..210).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap()];
    let (host, dev, _) = host_and_wgpu(&one_op(Op::CausalMask { fill: f64::NEG_INFINITY }, &scores), &scores, "causal mask");
    assert_eq!(dev, host, "the device's causal mask differs from the host's");
    assert_eq!(host.iter().filter(|v| f32::from_bits(**v).is_infinite()).count(), 6 * (4 + 3 + 2 + 1), "masked entries");
    // Row maxima (softmax's, op by op) too, a row with a NaN and one with -0 and +0 among them.
    let mut v: Vec<f32> = (0..6 * 35).map(|_| rng.random_range(-1.0..1.0)).collect();
    v[40] = f32::NAN;
    v[70..105].fill(0.0);
    v[80] = -0.0;
    let rows = [HostTensor::f32(vec![6, 35], v).unwrap()];
    let max = Op::ReduceMax(cellgraph::compiler::ReduceAttrs { axes: vec![1], keep_dims: true });
    let (host, dev, _) = host_and_wgpu(&one_op(max, &rows), &rows, "row maxima");
    assert_eq!(dev, host, "the device's row maxima differ from the host's");
    assert!(f32::from_bits(host[1]).is_nan(), "{host:?}");
}

/// The layout copies (a permute, a slice, a zero pad, a broadcast, a concatenation along a
/// middle axis) and an embedding's gather and scatter-add (ids a plan input, repeated) on wgpu
/// give the bits of the host's kernels and of burn's ops, run on the device's own kernels (no
/// step on burn's ops), and a plan of each is captured at its
/// second run and replayed at its third with the same bits: burn's views and new buffers kept
/// a Llama window from being captured.
#[cfg(feature = "wgpu")]
#[test]
fn layout_copies_on_wgpu_give_the_hosts_bits_and_are_captured() {
    let mut rng = StdRng::seed_from_u64(6);
    let mut t = |dims: Vec<usize>| {
        let n = dims.iter().product();
        HostTensor::f32(dims, (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap()
    };
    let x = t(vec![2, 3, 5, 4]);
    let ids = HostTensor::i32(vec![2, 4], vec![3, 0, 6, 3, 3, 1, 0, 5]).unwrap();
    let cases: Vec<(&str, Op, Vec<HostTensor>)> = vec![
        ("permute", Op::Transpose { perm: vec![2, 0, 3, 1] }, vec![x.clone()]),
        ("slice", Op::Slice { begin: vec![1, 0, 2, 1], end: vec![2, 3, 5, 3] }, vec![x.clone()]),
        ("pad", Op::Pad { lo: vec![0, 1, 2, 0], hi: vec![1, 0, 1, 3] }, vec![x.clone()]),
        ("broadcast", Op::Broadcast { shape: vec![2, 3, 5, 4].into() }, vec![t(vec![3, 1, 4])]),
        ("concat", Op::Concat { axis: 2 }, vec![x.clone(), t(vec![2, 3, 1, 4]), t(vec![2, 3, 2, 4])]),
        // An embedding's rows and their gradient, ids repeated and out of order.
        ("gather", Op::Gather, vec![t(vec![7, 5]), ids.clone()]),
        ("scatter_add", Op::ScatterAdd { rows: 7 }, vec![ids.clone(), t(vec![2, 4, 5])]),
    ];
    for (what, op, inputs) in cases {
        let exe = one_op(op, &inputs);
        let kernels: Vec<String> = exe.host_steps().into_iter().filter_map(|s| if let HostRun::Kernel(k) = s.run { Some(k) } else { None }).collect();
        assert_eq!(kernels.len(), 1, "{what}: {kernels:?}");
        let (host, dev, _) = host_and_wgpu(&exe, &inputs, what);
        assert_eq!(dev, host, "{what}: the device's copy differs from the host's");
        let mut burn = Session::<Cpu>::new(cpu());
        burn.set_native_kernels(false);
        let want: Vec<u32> = burn.run(&exe, &inputs).unwrap()[0].to_f32().iter().map(|v| v.to_bits()).collect();
        assert_eq!(host, want, "{what}: the host's copy differs from burn's ops");
        captured_and_replayed(&exe, &inputs, &host, what);
    }
}

/// On wgpu (lavapipe in CI) the steps that run on burn's ops rather than the device's own
/// kernels, by network and op: named here, so a new one, or a device kernel that stops
/// running, fails.
#[cfg(feature = "wgpu")]
#[test]
fn the_steps_wgpu_runs_on_burns_ops_are_named() {
    use cellgraph::runtime::cube::{Wgpu, WgpuDevice};
    let mut seen = Vec::new();
    for (name, net, batches) in cases() {
        let Window { ran, declined, .. } = window::<Wgpu>(net(), &batches, WgpuDevice::DefaultDevice);
        let ran: BTreeSet<&str> = ran.keys().copied().collect();
        // What the session declined when it bound the plans runs on burn's ops, each with its
        // reason; the rest of `ran` had no kernel bound (or, counted, declined at launch).
        let declined_ops: BTreeSet<&str> = declined.iter().map(|d| d.0).collect();
        assert!(declined_ops.is_subset(&ran), "{name}: declined at bind but not run on burn's ops: {declined:?}");
        let want_declined: BTreeSet<&str> = match name {
            // Batch norm's statistics run on the device's plane sums, and its residual joins
            // (six operands) on its elementwise kernel.
            "resnet18" => BTreeSet::new(),
            "gpt" => ["zeros_like"].into(),
            _ => BTreeSet::new(),
        };
        assert_eq!(declined_ops, want_declined, "{name}: declined at bind: {declined:?}");
        assert!(declined.iter().all(|d| !d.1.is_empty()), "{name}: each with its reason: {declined:?}");
        // ResNet-18's batch-norm scale and shift gradients added into their accumulators, and
        // the GPT's padding masks (its embedding's rows and layout moves run on the device's
        // row and strided-copy kernels).
        let want: BTreeSet<&str> = match name {
            "resnet18" => ["assign_add"].into(),
            // `reduce_sum` over every axis (no kernel is bound for a sum that keeps none).
            "gpt" => ["assign_add", "equal", "reduce_sum", "select", "zeros_like"].into(),
            _ => BTreeSet::new(),
        };
        eprintln!("{name}: {ran:?}");
        seen.push((name, ran, want));
    }
    for (name, ran, want) in seen {
        assert_eq!(ran, want, "{name}: the steps wgpu ran on burn's ops");
    }
}

/// An epilogue whose program reads more operands than the device's elementwise kernel takes
/// (a product plus six more tensors: seven) runs its head on the device's matmul and its
/// program on burn's ops: the result is the CPU's, and the program is counted (`epilogue`),
/// not silent; decided when the session binds the plan, which `Session::steps` lists. With five
/// more (six, a residual join's count) the whole step runs on the device's kernels. An f64
/// session on the device binds every step to burn's ops (the device's kernels are f32).
#[cfg(feature = "wgpu")]
#[test]
fn an_epilogue_program_the_device_cannot_take_is_counted() {
    use cellgraph::runtime::cube::{Wgpu, WgpuDevice};
    for extra in [5, 6] {
        let mut text = String::from("graph g {\n  %0: f32[4,3] = input {index=0, name=\"x\"}\n  %1: f32[2,3] = input {index=1, name=\"w\"}\n");
        text += "  %2: f32[4,2] = matmul(%0, %1) {transpose_a=false, transpose_b=true}\n";
        for k in 0..extra {
            text += &format!("  %{}: f32[4,2] = input {{index={}, name=\"e{k}\"}}\n", 3 + 2 * k, 2 + k);
            text += &format!("  %{}: f32[4,2] = add(%{}, %{})\n", 4 + 2 * k, 2 + 2 * k, 3 + 2 * k);
        }
        text += &format!("  return %{}\n}}\n", 2 + 2 * extra);
        let exe = compile(cellgraph::compiler::parse(&text).unwrap()).unwrap();
        assert!(exe.host_steps().iter().any(|s| s.op == "matmul+epilogue"), "the adds fuse into the product's epilogue");
        let mut rng = StdRng::seed_from_u64(4);
        let mut inputs = vec![HostTensor::f32(vec![4, 3], (0..12).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap()];
        inputs.push(HostTensor::f32(vec![2, 3], (0..6).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap());
        for _ in 0..extra {
            inputs.push(HostTensor::f32(vec![4, 2], (0..8).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap());
        }
        let want = Session::<Cpu>::new(cpu()).run(&exe, &inputs).unwrap()[0].to_f32();
        let mut dev = Session::<Wgpu>::new(WgpuDevice::DefaultDevice);
        let listed: Vec<String> = dev.steps(&exe).into_iter().filter(|s| s.op == "matmul+epilogue").map(|s| format!("{:?}", s.run)).collect();
        match extra {
            5 => assert_eq!(listed, ["Kernel(\"epilogue(matmul)\")"]),
            _ => assert!(
                listed.len() == 1 && listed[0].contains("matmul, then its program on burn's ops") && listed[0].contains("7 operands"),
                "{listed:?}"
            ),
        }
        let f64s = Session::<Wgpu>::new_f64(WgpuDevice::DefaultDevice).steps(&exe);
        let f64_why = |r: &HostRun| matches!(r, HostRun::BurnOps(why) if why.contains("an f64 session"));
        assert!(f64s.iter().any(|s| f64_why(&s.run)) && !f64s.iter().any(|s| matches!(s.run, HostRun::Kernel(_))), "{f64s:?}");
        let got = dev.run(&exe, &inputs).unwrap()[0].to_f32();
        assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "{extra} more: {got:?} vs {want:?}");
        let burn = dev.burn_op_steps();
        match extra {
            5 => assert!(burn.is_empty(), "six operands run on the device's kernels: {burn:?}"),
            _ => {
                assert_eq!(burn.get("epilogue"), Some(&1), "{burn:?}");
                assert!(!burn.contains_key("matmul+epilogue"), "the head ran on its kernel: {burn:?}");
            }
        }
    }
}

/// Under bf16 compute the host's bf16 products round their factors as they pack them, so a
/// parameter's bf16 copy that only such products read (a matmul's weight, a dense small-map
/// convolution's filter) is not made: the session lists it as `rounded when packed` and the
/// products give the bits they give when the copy is made (here because the copy has a second
/// reader, a sum). With f32 products (the emulation) the copy is made again, and the dense
/// filter the bf16 products built from the unrounded parameter is not reused.
#[test]
fn a_weights_bf16_copy_that_only_bf16_products_read_is_made_as_they_pack() {
    use cellgraph::compiler::{Conv2dAttrs, DType, PadMode, ReduceAttrs};
    /// `x @ round(w)` and `conv(round(img), round(f))` (3 x 3, padded by 1, on a 2 x 2 map),
    /// with `sums` the bf16 copies' sums as more outputs.
    fn graph(sums: bool) -> Graph {
        let mut g = Graph::new("bf16 weights");
        let round = |g: &mut Graph, x| g.add(Op::RoundTo { dtype: DType::BF16 }, &[x], "t").unwrap();
        let x = g.add_leaf(Op::Input { index: 0, name: "x".into() }, TensorType::f32([32, 64]), "t").unwrap();
        let img = g.add_leaf(Op::Input { index: 1, name: "img".into() }, TensorType::f32([2, 8, 2, 2]), "t").unwrap();
        let w = g.add_leaf(Op::Parameter { name: "w".into() }, TensorType::f32([64, 48]), "t").unwrap();
        let f = g.add_leaf(Op::Parameter { name: "f".into() }, TensorType::f32([16, 8, 3, 3]), "t").unwrap();
        let (rx, ri, rw, rf) = (round(&mut g, x), round(&mut g, img), round(&mut g, w), round(&mut g, f));
        let y = g.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[rx, rw], "t").unwrap();
        let conv = Conv2dAttrs { stride: [1, 1], pad_mode: PadMode::Pad, pad: [1; 4], dilation: [1, 1], groups: 1 };
        let c = g.add(Op::Conv2d(conv), &[ri, rf], "t").unwrap();
        let mut outputs = vec![y, c];
        if sums {
            for r in [rw, rf] {
                let axes = (0..g.ty(r).rank()).collect();
                outputs.push(g.add(Op::ReduceSum(ReduceAttrs { axes, keep_dims: false }), &[r], "t").unwrap());
            }
        }
        g.set_outputs(outputs);
        g
    }
    let mut rng = StdRng::seed_from_u64(8);
    let mut random = |dims: Vec<usize>| {
        let n = dims.iter().product();
        HostTensor::f32(dims, (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()).unwrap()
    };
    let inputs = [random(vec![32, 64]), random(vec![2, 8, 2, 2])];
    let (w, f) = (random(vec![64, 48]), random(vec![16, 8, 3, 3]));
    let (alone, shared) = (compile(graph(false)).unwrap(), compile(graph(true)).unwrap());
    let mut s = Session::<Cpu>::new(cpu());
    s.set_param("w", &w);
    s.set_param("f", &f);
    let bits = |out: Vec<HostTensor>| out[..2].iter().map(|t| t.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
    let elided = |s: &Session<Cpu>, exe| s.steps(exe).iter().filter(|st| st.run == HostRun::RoundedWhenPacked).count();
    let pairs = cellgraph::runtime::host::bf16_products_pay();
    assert_eq!(elided(&s, &alone), if pairs { 2 } else { 0 }, "{:#?}", s.steps(&alone));
    assert_eq!(elided(&s, &shared), 0);
    let (packed, copied) = (bits(s.run(&alone, &inputs).unwrap()), bits(s.run(&shared, &inputs).unwrap()));
    assert_eq!(packed, copied, "the products' own rounding and the bf16 copy differ");
    // On the pairs the dense filter is also kept packed: a write of the parameter drops it
    // with the dense one, and the next run packs the new values.
    s.set_param("f", &HostTensor::f32(f.shape.clone(), f.to_f32().iter().map(|v| -v).collect()).unwrap());
    let (packed_again, copied_again) = (bits(s.run(&alone, &inputs).unwrap()), bits(s.run(&shared, &inputs).unwrap()));
    assert_ne!(packed_again[1], packed[1], "the filter's write changed nothing");
    assert_eq!(packed_again, copied_again, "a filter kept (or packed) outlived its parameter's write");
    s.set_param("f", &f);
    s.set_bf16_products(false);
    assert_eq!(elided(&s, &alone), 0);
    let (f32_alone, f32_shared) = (bits(s.run(&alone, &inputs).unwrap()), bits(s.run(&shared, &inputs).unwrap()));
    assert_eq!(f32_alone, f32_shared, "with f32 products, the copy");
    let mut fresh = Session::<Cpu>::new(cpu());
    fresh.set_bf16_products(false);
    fresh.set_param("w", &w);
    fresh.set_param("f", &f);
    assert_eq!(f32_alone, bits(fresh.run(&alone, &inputs).unwrap()), "a dense filter of the unrounded filter was reused");
    let dense = |st: &cellgraph::runtime::HostStep| matches!(&st.run, HostRun::Kernel(k) if k.contains("dense"));
    assert!(s.steps(&alone).iter().any(dense), "the convolution is not a dense one: {:#?}", s.steps(&alone));
    if pairs {
        assert!(f32_alone[0] != packed[0] && f32_alone[1] != packed[1], "the bf16 products did not run");
    }
}

//! Mixed precision, emulated: micro-steps whose stored values are rounded to bf16 or f16
//! (`round_to`, rounded as `half` converts), f32 accumulators and optimizer state, and f16's
//! dynamic loss scaling decided once per window: an overflow anywhere in the window, on any
//! rank, skips the update on every rank and leaves everything but the accumulators and the
//! scale exactly as it was.

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

use cellgraph::cells::accumulate::{GradAccumulation, LossScale, Normalization, Precision};
use cellgraph::cells::Optimizer;
use cellgraph::compiler::{DType, HostData};
use cellgraph::prelude::*;
use cellgraph::runtime::comm::Communicator;
use cellgraph::runtime::{Accumulator, Bf16Unit};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::accumulation::{data, net};
use crate::parallel::run_ranks;
use cellgraph::runtime::Place;

/// Values around every case of the two conversions: ties to even, the largest finite values
/// and past them, f16's subnormals and what underflows to zero, negative zero, infinities.
pub(crate) fn awkward_values() -> Vec<f32> {
    let mut v =
        vec![0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e5, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, f32::NEG_INFINITY];
    for base in [1.0f32, 3.0, 1.0 / 3.0, 6.1035156e-5, 5.9604645e-8, 2.9802322e-8, 1e-7, 1e-5, 0.1, 1000.0, 3.4e38] {
        let b = base.to_bits();
        // The base and its neighbours: halfway points of both formats fall among them.
        for d in [0u32, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001, 0x10000, 0x18000] {
            for x in [f32::from_bits(b.wrapping_add(d)), f32::from_bits(b.wrapping_sub(d))] {
                if x.is_finite() {
                    v.extend([x, -x]);
                }
            }
        }
    }
    let mut rng = StdRng::seed_from_u64(3);
    v.extend((0..2000).map(|_| f32::from_bits(rng.random::<u32>() & 0xBFFF_FFFF)));
    v
}

/// `round_to` on the host (alone and inside a fused program) gives `half`'s bits.
#[test]
fn round_to_rounds_as_half_converts() {
    let xs = awkward_values();
    for dtype in [DType::BF16, DType::F16] {
        let want: Vec<u32> = xs
            .iter()
            .map(|&x| match dtype {
                DType::BF16 => half::bf16::from_f32(x).to_f32(),
                _ => half::f16::from_f32(x).to_f32(),
            })
            .map(f32::to_bits)
            .collect();
        for fused in [false, true] {
            let got = round_on::<Cpu>(&xs, dtype, fused, cpu());
            let bad: Vec<_> = xs
                .iter()
                .zip(&got)
                .zip(&want)
                .filter(|((_, g), w)| g.to_bits() != **w && !(g.is_nan() && f32::from_bits(**w).is_nan()))
                .take(3)
                .collect();
            assert!(bad.is_empty(), "{dtype:?} (fused: {fused}): x, got, want: {bad:?}");
        }
    }
}

/// Runs `round_to` over `xs` on `device`, alone or in a fused program (`x * 1` rounded).
pub(crate) fn round_on<B: cellgraph::runtime::Backend>(
    xs: &[f32],
    dtype: DType,
    fused: bool,
    device: cellgraph::runtime::burn_backend::tensor::Device<B>,
) -> Vec<f32> {
    use cellgraph::compiler::{Graph, Op};
    use cellgraph::runtime::Session;
    let mut g = Graph::new("round");
    let ty = TensorType::f32([xs.len()]);
    let x = g.add_leaf(Op::Input { index: 0, name: "x".into() }, ty.clone(), "t").unwrap();
    let y = if fused {
        g.add(Op::Fused { expr: format!("$0 1.0 mul round_{}", dtype.name()).parse().unwrap() }, &[x], "t").unwrap()
    } else {
        g.add(Op::RoundTo { dtype }, &[x], "t").unwrap()
    };
    g.set_outputs(vec![y]);
    let exe = cellgraph::runtime::compile(g).unwrap();
    let mut s = Session::<B>::new(device);
    s.run(&exe, &[HostTensor::f32(vec![xs.len()], xs.to_vec()).unwrap()]).unwrap()[0].to_f32()
}

/// The micro-step under bf16: parameters, inputs and computed values rounded, the loss not;
/// the gradients added into f32 accumulators, or (asked for) rounded accumulators.
#[test]
fn the_micro_step_rounds_what_it_stores_and_accumulates_in_f32() {
    let types = [("data", TensorType::f32([4, crate::accumulation::FEATURES])), ("label", TensorType::i32([4]))];
    let text = |p: Option<Precision>| {
        let mut n = GradAccumulation::across_steps(net(), 2);
        n.precision = p;
        cellgraph::compiler::print(&n.micro_step_graph(&types.iter().map(|(n, t)| (n.to_string(), t.clone())).collect::<Vec<_>>()).unwrap())
    };
    let plain = text(None);
    assert!(!plain.contains("round_to"));
    let bf16 = text(Some(Precision::bf16()));
    // The two weights and biases as read, the input, the dense layers' outputs after their
    // bias (a product only the bias's add reads is not rounded: it rounds once, as a GEMM's
    // epilogue stores), the loss's gradient and the hidden layer's.
    assert_eq!(bf16.matches("{dtype=bf16}").count(), 9, "{bf16}");
    assert!(bf16.contains("= add(%3, %23)") && bf16.contains("= round_to(%5) {dtype=bf16}"), "{bf16}");
    assert_eq!(bf16.matches("= assign_add(").count(), 4, "{bf16}");
    let low = text(Some(Precision::bf16().accumulate_in(DType::BF16)));
    assert_eq!(low.matches("= assign_add(").count(), 0, "{low}");
    assert_eq!(low.matches("= assign(").count(), 4, "{low}");
    // f16 with loss scaling seeds the backward pass with the `sens` input.
    let f16 = text(Some(Precision::f16()));
    assert!(f16.contains("{dtype=f16}") && f16.contains("name=\"sens\""), "{f16}");
}

/// The trained parameters of the test network ([`net`]).
fn params(acc: &Accumulator<Cpu>) -> BTreeMap<String, Vec<f32>> {
    net().trainable_params().iter().map(|p| (p.name.clone(), acc.session().param(&p.name).unwrap().to_f32())).collect()
}

/// Trains `net` over `batches` (one micro-batch each) and returns the trained parameters.
fn trained(net: GradAccumulation, opt: Rc<dyn Optimizer>, batches: &[Vec<HostTensor>]) -> BTreeMap<String, Vec<f32>> {
    let mut acc = Accumulator::<Cpu>::new(Rc::new(net), opt, cpu(), 1).unwrap();
    for b in batches {
        acc.step(b, Place::Regular).unwrap();
    }
    params(&acc)
}

/// L2 distance between two parameter sets, relative to the f32 run's change from the start.
pub(crate) fn distance(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>, init: &BTreeMap<String, Vec<f32>>) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (k, va) in a {
        for ((x, y), i) in va.iter().zip(&b[k]).zip(&init[k]) {
            d += (*x as f64 - *y as f64).powi(2);
            n += (*y as f64 - *i as f64).powi(2);
        }
    }
    (d / n).sqrt()
}

/// `n` inputs labelled by a fixed linear teacher (the class of the largest of 10 fixed
/// projections): a task the network learns, so the micro-batches' gradients agree.
fn taught(rng: &mut StdRng, n: usize) -> Vec<HostTensor> {
    use crate::accumulation::FEATURES;
    let mut teacher = StdRng::seed_from_u64(99);
    let w: Vec<f32> = (0..10 * FEATURES).map(|_| teacher.random_range(-1.0..1.0)).collect();
    let x: Vec<f32> = (0..n * FEATURES).map(|_| rng.random_range(-1.0..1.0)).collect();
    let y: Vec<i32> = (0..n)
        .map(|i| {
            let score = |c: usize| (0..FEATURES).map(|j| w[c * FEATURES + j] * x[i * FEATURES + j]).sum::<f32>();
            (0..10).max_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap() as i32
        })
        .collect();
    vec![HostTensor::f32(vec![n, FEATURES], x).unwrap(), HostTensor::i32(vec![n], y).unwrap()]
}

/// The accumulators after `batches` micro-steps of one window (no boundary).
fn accumulated(p: Precision, batches: &[Vec<HostTensor>]) -> BTreeMap<String, Vec<f64>> {
    let net = GradAccumulation::across_steps(net(), batches.len() + 1).precision(p);
    let mut acc = Accumulator::<Cpu>::new(Rc::new(net), Rc::new(Momentum::new(0.1, 0.9)), cpu(), 1).unwrap();
    for b in batches {
        acc.step(b, Place::Regular).unwrap();
    }
    acc.snapshot().into_iter().filter(|(n, _)| n.starts_with("accu_grads.")).map(|(n, t)| (n, t.to_f64())).collect()
}

/// L2 distance of `a` from `exact`, relative to `exact`'s norm.
fn off(a: &BTreeMap<String, Vec<f64>>, exact: &BTreeMap<String, Vec<f64>>) -> f64 {
    let (mut d, mut n) = (0.0, 0.0);
    for (k, e) in exact {
        for (x, y) in a[k].iter().zip(e) {
            d += (x - y).powi(2);
            n += y * y;
        }
    }
    (d / n).sqrt()
}

/// Over a window of K = 16 micro-batches under bf16 compute, f32 accumulators hold the exact
/// sum of the micro-steps' bf16 gradients to f32's rounding, while bf16 accumulators (each add
/// rounded: accumulating in the compute format) miss it by far more.
#[test]
fn f32_accumulators_sum_bf16_gradients_to_f32_rounding_and_bf16_ones_do_not() {
    const K: usize = 16;
    let mut rng = StdRng::seed_from_u64(21);
    let batches: Vec<_> = (0..K).map(|_| taught(&mut rng, 4)).collect();
    // Each micro-step's bf16 gradient alone (an accumulator that starts at 0 holds exactly it;
    // the parameters do not change inside the window), summed exactly.
    let mut exact: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for b in &batches {
        for (n, g) in accumulated(Precision::bf16(), std::slice::from_ref(b)) {
            let e = exact.entry(n).or_insert_with(|| vec![0.0; g.len()]);
            e.iter_mut().zip(&g).for_each(|(e, g)| *e += g);
        }
    }
    let f32_off = off(&accumulated(Precision::bf16(), &batches), &exact);
    let bf16_off = off(&accumulated(Precision::bf16().accumulate_in(DType::BF16), &batches), &exact);
    eprintln!("16 bf16 micro-gradients summed: f32 accumulators {f32_off:e}, bf16 accumulators {bf16_off:e} off the exact sum");
    assert!(f32_off < 1e-6, "f32 accumulators are {f32_off:e} off the exact sum");
    assert!(bf16_off > 1e-4 && bf16_off > 5.0 * f32_off, "bf16 accumulators are only {bf16_off:e} off (f32: {f32_off:e})");
}

/// A measurement, not a check (run by hand: `cargo test -- --ignored bf16_runs`): how far
/// bf16 compute with f32 and with bf16 accumulators end from the f32 run after 20 updates of
/// K micro-batches (`MPK`, default 16; `MPB` items each, default 4).
#[test]
#[ignore]
fn bf16_runs_after_20_updates_against_f32() {
    let k: usize = std::env::var("MPK").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    let b: usize = std::env::var("MPB").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let mut rng = StdRng::seed_from_u64(21);
    let batches: Vec<_> = (0..20 * k).map(|_| taught(&mut rng, b)).collect();
    let opt: Rc<dyn Optimizer> = Rc::new(Momentum::new(0.05, 0.9));
    let mk = |p: Option<Precision>| {
        let mut n = GradAccumulation::across_steps(net(), k).normalization(Normalization::Mean);
        n.precision = p;
        n
    };
    let init: BTreeMap<String, Vec<f32>> = cellgraph::cells::materialize(&net().parameters(), 1).into_iter().map(|(n, t)| (n, t.to_f32())).collect();
    let f32_run = trained(mk(None), opt.clone(), &batches);
    let f32_acc = trained(mk(Some(Precision::bf16())), opt.clone(), &batches);
    let bf16_acc = trained(mk(Some(Precision::bf16().accumulate_in(DType::BF16))), opt, &batches);
    let (good, bad) = (distance(&f32_acc, &f32_run, &init), distance(&bf16_acc, &f32_run, &init));
    println!("K = {k}, {b} items per micro-batch, 20 updates: bf16 compute with f32 accumulators {good:e}, with bf16 accumulators {bad:e} from the f32 run (relative to its change); ratio {:.2}", bad / good);
}

/// A loss scale that is a power of two changes no bit under bf16 (bf16 has f32's exponent
/// range, so rounding commutes with it): the optimizer and clipping see the gradients with
/// the scale divided out.
#[test]
fn the_optimizer_and_clipping_see_unscaled_gradients() {
    let mut rng = StdRng::seed_from_u64(22);
    let batches: Vec<_> = (0..12).map(|_| data(&mut rng, 4)).collect();
    let mk = |scale: Option<LossScale>| {
        GradAccumulation::across_steps(net(), 3)
            .normalization(Normalization::Mean)
            .clip_global_norm(0.05)
            .precision(Precision::bf16().loss_scale(scale))
    };
    let opt: Rc<dyn Optimizer> = Rc::new(Adam::new(0.01));
    let plain = trained(mk(None), opt.clone(), &batches);
    let scaled = trained(mk(Some(LossScale { init: 1024.0, growth_interval: 1000 })), opt, &batches);
    assert_eq!(plain, scaled);
}

/// What a rank's accumulator holds besides the accumulators and the run counters: the
/// parameters, the optimizer state and the update count (the learning rate's position).
fn state(acc: &Accumulator<Cpu>) -> BTreeMap<String, HostTensor> {
    acc.snapshot().into_iter().filter(|(n, _)| !n.starts_with("accu_grads.") && (!n.starts_with("cellgraph.") || n == "cellgraph.updates")).collect()
}

const K: usize = 4;
const INIT_SCALE: f64 = 1024.0;

fn f16_net() -> GradAccumulation {
    GradAccumulation::across_steps(net(), K)
        .normalization(Normalization::Mean)
        .precision(Precision::f16().loss_scale(Some(LossScale { init: INIT_SCALE, growth_interval: 100 })))
}

/// Four ranks, f16 with loss scaling: an inf in micro-step 3 of window 5 on rank 2 makes every
/// rank skip that update, with parameters, optimizer state and update count (so the learning
/// rate's position) bit-identical to before the window, the accumulators cleared and the
/// scale halved once; the next window applies. Replicated and sharded (hsdp: the flag travels
/// with the reduce-scatter).
#[test]
fn an_overflow_on_one_rank_skips_the_window_on_every_rank() {
    for hsdp in [false, true] {
        let out = run_ranks(4, move |rank, comm: Arc<dyn Communicator>| {
            let mut rng = StdRng::seed_from_u64(30 + rank as u64);
            let mut acc = Accumulator::<Cpu>::new(Rc::new(f16_net()), Rc::new(Adam::new(0.01)), cpu(), 5).unwrap();
            acc.set_parallel(comm, true, hsdp).unwrap();
            let mut before = BTreeMap::new();
            let mut after = BTreeMap::new();
            let mut scales = Vec::new();
            for window in 1..=6 {
                if window == 5 {
                    before = state(&acc);
                }
                for micro in 1..=K {
                    let mut b = data(&mut rng, 4);
                    if window == 5 && micro == 3 && rank == 2 {
                        let HostData::F32(x) = &mut b[0].data else { unreachable!() };
                        x[5] = f32::INFINITY;
                    }
                    acc.step(&b, Place::Regular).unwrap();
                }
                if window == 5 {
                    after = state(&acc);
                }
                scales.push(acc.loss_scale().unwrap());
            }
            let accu_zero = acc.snapshot().iter().filter(|(n, _)| n.starts_with("accu_grads.")).all(|(_, t)| t.to_f32().iter().all(|&v| v == 0.0));
            (before, after, scales, acc.counters().skipped_updates, acc.updates(), accu_zero)
        });
        for (rank, (before, after, scales, skipped, updates, accu_zero)) in out.iter().enumerate() {
            assert!(*before == *after, "hsdp {hsdp}, rank {rank}: the skipped window changed the parameters, optimizer state or update count");
            assert_eq!(*skipped, 1, "hsdp {hsdp}, rank {rank}");
            assert_eq!(*updates, 5, "hsdp {hsdp}, rank {rank}: 6 windows, one skipped");
            assert_eq!(
                scales,
                &[INIT_SCALE, INIT_SCALE, INIT_SCALE, INIT_SCALE, INIT_SCALE / 2.0, INIT_SCALE / 2.0],
                "hsdp {hsdp}, rank {rank}: halved once"
            );
            assert!(accu_zero, "hsdp {hsdp}, rank {rank}: accumulators cleared");
        }
        // The ranks agree after the skip and the update that follows it.
        assert!(out.iter().all(|o| o.1 == out[0].1), "hsdp {hsdp}: ranks differ after the skipped window");
    }
}

/// Without loss scaling the same inf reaches the parameters (the skip above is the scaler's).
#[test]
fn without_loss_scaling_an_inf_reaches_the_parameters() {
    let mut rng = StdRng::seed_from_u64(31);
    let net = GradAccumulation::across_steps(crate::accumulation::net(), K).precision(Precision::f16().loss_scale(None));
    let mut acc = Accumulator::<Cpu>::new(Rc::new(net), Rc::new(Adam::new(0.01)), cpu(), 5).unwrap();
    for micro in 0..K {
        let mut b = data(&mut rng, 4);
        if micro == 2 {
            let HostData::F32(x) = &mut b[0].data else { unreachable!() };
            x[5] = f32::INFINITY;
        }
        acc.step(&b, Place::Regular).unwrap();
    }
    assert_eq!(acc.counters().skipped_updates, 0);
    assert!(params(&acc).values().flatten().any(|v| !v.is_finite()));
}

/// The scale doubles after `growth_interval` clean windows, and a checkpoint taken mid-window
/// (after an overflow halved the scale) resumes bit-identically: parameters, optimizer state,
/// the scale and its clean-window count.
#[test]
fn the_scale_grows_and_resumes_mid_window_bit_identically() {
    let mk = || GradAccumulation::across_steps(net(), 2).precision(Precision::f16().loss_scale(Some(LossScale { init: 256.0, growth_interval: 2 })));
    let mut rng = StdRng::seed_from_u64(32);
    let mut batches: Vec<_> = (0..14).map(|_| data(&mut rng, 4)).collect();
    let HostData::F32(x) = &mut batches[1][0].data else { unreachable!() };
    x[0] = f32::INFINITY;
    let opt = || Rc::new(Adam::new(0.01)) as Rc<dyn Optimizer>;
    let mut whole = Accumulator::<Cpu>::new(Rc::new(mk()), opt(), cpu(), 7).unwrap();
    let mut scales = Vec::new();
    for b in &batches {
        if whole.step(b, Place::Regular).unwrap() {
            scales.push(whole.loss_scale().unwrap());
        }
    }
    // Window 1 overflows: 128; every two clean windows double it.
    assert_eq!(scales, [128.0, 128.0, 256.0, 256.0, 512.0, 512.0, 1024.0]);
    assert_eq!((whole.counters().skipped_updates, whole.counters().overflows), (1, 1));

    let mut first = Accumulator::<Cpu>::new(Rc::new(mk()), opt(), cpu(), 7).unwrap();
    for b in &batches[..7] {
        first.step(b, Place::Regular).unwrap();
    }
    let snap = first.snapshot();
    assert_eq!(snap["cellgraph.loss_scale"].scalar(), 256.0);
    let mut resumed = Accumulator::<Cpu>::new(Rc::new(mk()), opt(), cpu(), 99).unwrap();
    resumed.restore(&snap).unwrap();
    for b in &batches[7..] {
        resumed.step(b, Place::Regular).unwrap();
    }
    assert_eq!(resumed.loss_scale(), whole.loss_scale());
    assert!(resumed.snapshot() == whole.snapshot(), "resumed mid-window, the run differs from the uninterrupted one");
}

/// Bad policies are refused before training, naming the setting.
#[test]
fn bad_precision_settings_are_refused() {
    let err = |p: Precision| GradAccumulation::across_steps(net(), 2).precision(p).check().unwrap_err().to_string();
    assert!(err(Precision::bf16().accumulate_in(DType::F16)).contains("accumulators must be f32 or the compute format (bf16)"));
    assert!(err(Precision { compute: DType::I32, ..Precision::bf16() }).contains("compute must be f16, bf16 or f32"));
    assert!(err(Precision::f16().loss_scale(Some(LossScale { init: 0.0, growth_interval: 10 }))).contains("init must be a finite number > 0"));
}

/// A model trained on `batches` in windows of 4 micro-batches (AdamW) on the CPU, in
/// `precision` (f32 when `None`) with the CPU's bf16 products on or off (the emulation): its
/// parameters, its losses and the micro-step plan's account of its products.
fn trained_adamw(net: WithLossCell, batches: &[Vec<HostTensor>], precision: Option<Precision>, pairs: bool) -> Trained {
    trained_adamw_on::<Cpu>(cpu(), net, batches, precision, pairs)
}

/// A trained model's parameters, its losses and its micro-step plan's account of its products.
pub(crate) type Trained = (BTreeMap<String, Vec<f32>>, Vec<f32>, Option<cellgraph::runtime::Bf16Products>);

/// [`trained_adamw`] on `device`, whose bf16 products (`fast`: on AMX tiles or AVX-512 BF16
/// pairs on the CPU, on tensor cores on a device) are on or off.
pub(crate) fn trained_adamw_on<B: cellgraph::runtime::Backend>(
    device: cellgraph::runtime::burn_backend::tensor::Device<B>,
    net: WithLossCell,
    batches: &[Vec<HostTensor>],
    precision: Option<Precision>,
    fast: bool,
) -> Trained {
    let names: Vec<String> = net.parameters().iter().map(|p| p.name.clone()).collect();
    let mut net = GradAccumulation::across_steps(net, 4);
    net.precision = precision;
    let mut acc = Accumulator::<B>::new(Rc::new(net), Rc::new(Adam::adamw(LearningRate::Constant(3e-3), 0.01)), device, 5).unwrap();
    acc.options().set_bf16_products(fast);
    let losses = batches
        .iter()
        .map(|b| {
            acc.step(b, Place::Regular).unwrap();
            acc.step_loss()
        } as f32)
        .collect();
    let params = names.iter().map(|n| (n.clone(), acc.session().param(n).unwrap().to_f32())).collect();
    let products = acc.micro_plans().find_map(|e| e.bf16_products::<B>());
    (params, losses, products)
}

/// In the bf16 GPT's micro-step on the CPU each layer's GELU reads its subtrees on bf16
/// activations from tables, as its plan says (the bits are those of computing them:
/// `host::tables`' test). At this width the fusion keeps `erf(x * 0.7071) + 1` a program of
/// its own, which the forward and the gradient read: that program and the gradient's `exp`
/// half, one table each, per layer (the gpt_accumulation sample's GELU is two programs with
/// three tables). An f32 plan has none (its activations are not bf16 values). Under
/// `CELLGRAPH_TABLES=0` the plan names none.
#[test]
fn the_bf16_gpts_gelu_reads_tables() {
    let mut rng = StdRng::seed_from_u64(31);
    let (gpt, text) = bf16_gpt_case(&mut rng);
    let tables = |precision: Option<Precision>| {
        let mut net = GradAccumulation::across_steps(gpt(), 4);
        net.precision = precision;
        let mut acc = Accumulator::<Cpu>::new(Rc::new(net), Rc::new(Adam::adamw(LearningRate::Constant(3e-3), 0.01)), cpu(), 5).unwrap();
        acc.step(&text[0], Place::Regular).unwrap();
        assert!(acc.step_loss().is_finite());
        let mut named: BTreeMap<String, usize> = BTreeMap::new();
        for s in acc.micro_plans().flat_map(|e| e.host_steps()) {
            if let cellgraph::runtime::HostRun::Kernel(k) = s.run {
                if k.contains("tables") {
                    *named.entry(k).or_default() += 1;
                }
            }
        }
        named
    };
    let want: BTreeMap<String, usize> =
        if cellgraph::runtime::host::tables::enabled() { [("Fused, 1 subtree from bf16 tables".to_string(), 4)].into() } else { BTreeMap::new() };
    assert_eq!(tables(Some(Precision::bf16())), want);
    assert_eq!(tables(None), BTreeMap::new());
}

/// A 2-layer GPT (vocabulary 40, context 24, width 48) and 20 micro-batches of 6 sequences
/// labelled by a fixed map of their tokens.
pub(crate) fn bf16_gpt_case(rng: &mut StdRng) -> (fn() -> WithLossCell, Vec<Vec<HostTensor>>) {
    let (vocab, t) = (40usize, 24);
    fn gpt() -> WithLossCell {
        let config =
            GptConfig { vocab_size: 40, context: 24, layers: 2, heads: 2, width: 48, layer_norm_eps: 1e-5, dropout: 0.0, gelu_approximate: false };
        WithLossCell::new(GPT::new(&Scope::root(), config).unwrap(), CrossEntropyLoss::new())
    }
    let text: Vec<Vec<HostTensor>> = (0..20)
        .map(|_| {
            let ids: Vec<i32> = (0..6 * t).map(|_| rng.random_range(0..vocab as i32)).collect();
            let labels: Vec<i32> = ids.iter().map(|&i| (i * 7 + 3) % vocab as i32).collect();
            vec![HostTensor::i32(vec![6, t], ids).unwrap(), HostTensor::i32(vec![6, t], labels).unwrap()]
        })
        .collect();
    (gpt, text)
}

/// The convolutional cases of the bf16 tests: LeNet5 on 20 micro-batches of 5 images 1 x 32 x
/// 32, and a 3 x 3 convolution then a ResNet basic block with batch norm (3 -> 4 channels,
/// stride 2, a 1 x 1 downsampling: strided input gradients) on 20 of 5 images 3 x 16 x 16,
/// labels at random.
#[allow(clippy::type_complexity)]
pub(crate) fn bf16_conv_cases(rng: &mut StdRng) -> [(&'static str, fn() -> WithLossCell, Vec<Vec<HostTensor>>); 2] {
    let mut images = |c: usize, side: usize| -> Vec<Vec<HostTensor>> {
        (0..20)
            .map(|_| {
                let x: Vec<f32> = (0..5 * c * side * side).map(|_| rng.random_range(-1.0..1.0)).collect();
                let y: Vec<i32> = (0..5).map(|_| rng.random_range(0..10)).collect();
                vec![HostTensor::f32(vec![5, c, side, side], x).unwrap(), HostTensor::i32(vec![5], y).unwrap()]
            })
            .collect()
    };
    fn block() -> WithLossCell {
        WithLossCell::new(crate::batchnorm::BlockNet::with_stem(), CrossEntropyLoss::new())
    }
    let lenet = images(1, 32);
    let colour = images(3, 16);
    [("lenet5", crate::common::lenet_with_loss, lenet), ("resnet block", block, colour)]
}

/// On a CPU with AVX-512 BF16, bf16 compute multiplies the GPT's and LeNet5's products of bf16
/// values as bf16 pairs, or on AMX tiles where the core has them (every matmul and every im2col/dense convolution; attention and the
/// direct convolutions stay f32, named), and after 5 AdamW updates of 4 micro-batches the
/// parameters and losses are those of the emulation (f32 GEMMs on the same bf16 values) within
/// bf16's rounding: the products are the same, summed in another order, so a stored value now
/// and then rounds to the neighbouring bf16. They are not bit-equal (the bf16 kernel ran), and
/// they are much closer to the emulation than the emulation is to f32. Without the
/// instructions, the plan says all of them run in f32.
#[test]
fn bf16_products_on_the_cpu_match_the_emulation() {
    let mut rng = StdRng::seed_from_u64(31);
    let (gpt, text) = bf16_gpt_case(&mut rng);
    let [(_, lenet, images), (_, block, colour)] = bf16_conv_cases(&mut rng);
    type Case<'a> = (&'a str, &'a dyn Fn() -> WithLossCell, &'a [Vec<HostTensor>]);
    let cases: [Case; 3] = [("gpt", &gpt, &text), ("lenet5", &lenet, &images), ("resnet block", &block, &colour)];
    for (name, net, batches) in cases {
        let (pairs, pair_losses, plan) = trained_adamw(net(), batches, Some(Precision::bf16()), true);
        let (emulated, emulated_losses, _) = trained_adamw(net(), batches, Some(Precision::bf16()), false);
        let plan = plan.expect("a bf16 plan has products of bf16 values");
        println!("{name}: {plan}");
        // Batch norm's moving statistics are state: updated and kept in f32.
        for (p, v) in pairs.iter().filter(|(p, _)| p.contains("moving")) {
            assert!(v.iter().any(|&x| half::bf16::from_f32(x).to_f32() != x), "{name}: {p} holds only bf16 values");
        }
        if !cellgraph::runtime::host::bf16_products_pay() {
            assert_eq!(plan.fast, 0, "{name}: {plan}");
            assert_eq!(pairs, emulated, "{name}: the plan chose the f32 emulation, yet its bits differ from it");
            let why = cellgraph::runtime::host::bf16::declined();
            eprintln!("{name}: {why:?}: the bf16 kernels' own tests run them; the CLI test runs the pairs with CELLGRAPH_BF16_PAIRS=1");
            continue;
        }
        let unit = if cellgraph::runtime::host::bf16_on_amx() { Bf16Unit::AmxTiles } else { Bf16Unit::Avx512Pairs };
        assert_eq!(plan.unit, unit, "{name}: {plan}");
        let f32_only: Vec<&str> = plan
            .in_f32
            .keys()
            .copied()
            .filter(|op| !matches!(*op, "attention" | "attention_grad" | "conv2d" | "conv2d_backprop_input" | "conv2d_backprop_filter"))
            .collect();
        assert!(f32_only.is_empty(), "{name}: products of bf16 values left in f32: {plan}");
        let want = if name == "gpt" { 2 * 2 * 4 + 3 } else { 0 };
        assert!(plan.fast >= want.max(3), "{name}: {plan}");
        assert!(pairs != emulated, "{name}: bf16 pairs and the emulation are bit-equal: the bf16 kernel did not run");
        let init: BTreeMap<String, Vec<f32>> =
            cellgraph::cells::materialize(&net().parameters(), 5).into_iter().map(|(n, t)| (n, t.to_f32())).collect();
        let (f32_run, _, _) = trained_adamw(net(), batches, None, true);
        let (near, far) = (distance(&pairs, &emulated, &init), distance(&emulated, &f32_run, &init));
        let loss_gap = pair_losses.iter().zip(&emulated_losses).map(|(a, b)| ((a - b) / b).abs()).fold(0f32, f32::max);
        println!("{name}: the bf16 kernel {near:.3e} from the emulation, the emulation {far:.3e} from f32 (relative to the change); losses within {loss_gap:.2e}");
        assert!(near < 0.5 * far && near < 0.05, "{name}: bf16 pairs {near:e} from the emulation, the emulation {far:e} from f32");
        assert!(loss_gap < 1e-2, "{name}: losses {pair_losses:?} against {emulated_losses:?}");
    }
}

/// On the host kernels, an attention's result (forward and gradient) that only its `round_to`
/// reads is rounded by the attention's kernel as it writes it, and that `round_to` is not run:
/// the values are those of the unrounded results rounded by `round_to` alone (they would not
/// be bf16 values if the rounding were lost), and the plan lists both decisions.
#[test]
fn the_hosts_attention_rounds_its_result_as_it_writes_it() {
    use cellgraph::compiler::{Graph, Op};
    use cellgraph::runtime::{HostRun, Session};
    let (qkv_ty, dy_ty) = (TensorType::f32([2, 9, 24]), TensorType::f32([2, 9, 8]));
    let plan = |round: bool| {
        let mut g = Graph::new("attention");
        let qkv = g.add_leaf(Op::Input { index: 0, name: "qkv".into() }, qkv_ty.clone(), "t").unwrap();
        let dy = g.add_leaf(Op::Input { index: 1, name: "dy".into() }, dy_ty.clone(), "t").unwrap();
        let y = g.add(Op::Attention { heads: 2, causal: true }, &[qkv], "t").unwrap();
        let dx = g.add(Op::AttentionGrad { heads: 2, causal: true }, &[qkv, dy], "t").unwrap();
        let outputs = match round {
            true => {
                vec![g.add(Op::RoundTo { dtype: DType::BF16 }, &[y], "t").unwrap(), g.add(Op::RoundTo { dtype: DType::BF16 }, &[dx], "t").unwrap()]
            }
            false => vec![y, dx],
        };
        g.set_outputs(outputs);
        cellgraph::runtime::compile(g).unwrap()
    };
    let mut rng = StdRng::seed_from_u64(17);
    let mut values = |n: usize| (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect::<Vec<f32>>();
    let inputs = [HostTensor::f32(vec![2, 9, 24], values(2 * 9 * 24)).unwrap(), HostTensor::f32(vec![2, 9, 8], values(2 * 9 * 8)).unwrap()];
    let mut s = Session::<Cpu>::new(cpu());
    let (rounded, plain) = (plan(true), plan(false));
    let got: Vec<Vec<f32>> = s.run(&rounded, &inputs).unwrap().iter().map(|t| t.to_f32()).collect();
    let unrounded: Vec<Vec<f32>> = s.run(&plain, &inputs).unwrap().iter().map(|t| t.to_f32()).collect();
    for (what, (got, unrounded)) in ["attention", "attention_grad"].iter().zip(got.iter().zip(&unrounded)) {
        let want = round_on::<Cpu>(unrounded, DType::BF16, false, cpu());
        assert!(unrounded.iter().zip(&want).any(|(u, w)| u != w), "{what}: some values are not bf16 values");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got), bits(&want), "{what}");
    }
    let runs: Vec<HostRun> = s.steps(&rounded).into_iter().map(|st| st.run).collect();
    assert_eq!(runs.iter().filter(|r| **r == HostRun::RoundedInProducer).count(), 2, "{runs:?}");
    assert_eq!(runs.iter().filter(|r| **r == HostRun::Kernel("epilogue(Attention)".into())).count(), 2, "{runs:?}");
}

/// On the host kernels, a program whose output only a sum over its last axis reads (a layer
/// norm's squared deviations, rounded to bf16) is summed as it is computed, never written out:
/// the sums are those of the same program written out (a second reader keeps it) and summed,
/// and the plans list the one decision and not the other. The bf16 GPT's layer norms have
/// such sums.
#[test]
fn the_hosts_programs_read_by_a_sum_alone_are_summed_as_they_are_computed() {
    use cellgraph::compiler::{Graph, Op, ReduceAttrs};
    use cellgraph::runtime::{HostRun, Session};
    let (rows, width) = (6 * 24, 48);
    let plan = |kept: bool| {
        let mut g = Graph::new("squares");
        let x = g.add_leaf(Op::Input { index: 0, name: "x".into() }, TensorType::f32([6, 24, width]), "t").unwrap();
        let axis = ReduceAttrs { axes: vec![2], keep_dims: true };
        let mean = g.add(Op::ReduceMean(axis.clone()), &[x], "t").unwrap();
        let d2 = g.add(Op::Fused { expr: "$0 $1 sub $0 $1 sub mul round_bf16".parse().unwrap() }, &[x, mean], "t").unwrap();
        let var = g.add(Op::ReduceMean(axis), &[d2], "t").unwrap();
        g.set_outputs(if kept { vec![var, d2] } else { vec![var] });
        cellgraph::runtime::compile(g).unwrap()
    };
    let mut rng = StdRng::seed_from_u64(23);
    let x = HostTensor::f32(vec![6, 24, width], (0..rows * width).map(|_| rng.random_range(-3.0f32..3.0)).collect()).unwrap();
    let mut s = Session::<Cpu>::new(cpu());
    let (summed, written) = (plan(false), plan(true));
    let got = s.run(&summed, std::slice::from_ref(&x)).unwrap()[0].to_f32();
    let want = s.run(&written, std::slice::from_ref(&x)).unwrap()[0].to_f32();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(got.len(), rows);
    assert_eq!(bits(&got), bits(&want));
    let merged = |exe| s.steps(exe).iter().filter(|st| st.run == HostRun::SummedInProducer).count();
    assert_eq!((merged(&summed), merged(&written)), (1, 0));

    let mut rng = StdRng::seed_from_u64(31);
    let (gpt, text) = bf16_gpt_case(&mut rng);
    let mut net = GradAccumulation::across_steps(gpt(), 4);
    net.precision = Some(Precision::bf16());
    let mut acc = Accumulator::<Cpu>::new(Rc::new(net), Rc::new(Adam::adamw(LearningRate::Constant(3e-3), 0.01)), cpu(), 5).unwrap();
    acc.step(&text[0], Place::Regular).unwrap();
    let sums = acc.micro_plans().flat_map(|e| acc.session().steps(e)).filter(|st| st.run == HostRun::SummedInProducer).count();
    // Each of the five layer norms: its squared deviations, and its gradient's two row terms.
    assert_eq!(sums, 15);
}

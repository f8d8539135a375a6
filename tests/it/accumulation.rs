//! GradAccumulation is exactly a large batch: K micro-batches of b equal one step on the
//! concatenated K*b batch, for both flavours and every normalisation; windows, counters,
//! the incomplete last window, clipping and the learning-rate schedule behave as specified.

use std::collections::BTreeMap;
use std::rc::Rc;

use cellgraph::cells::accumulate::{GradAccumulation, Normalization};
use cellgraph::cells::Optimizer;
use cellgraph::compiler::NodeId;
use cellgraph::prelude::*;
use cellgraph::runtime::accumulate::slice_rows;
use cellgraph::runtime::Place;
use cellgraph::runtime::{Accumulator, Counters};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub(crate) const FEATURES: usize = 16;

/// Dense(16 -> 24) -> ReLU -> Dense(24 -> 10).
pub(crate) struct Small {
    fc1: Dense,
    fc2: Dense,
}

impl Small {
    pub(crate) fn new() -> Self {
        let s = Scope::root();
        Small { fc1: Dense::new(&s.child("fc1"), FEATURES, 24), fc2: Dense::new(&s.child("fc2"), 24, 10) }
    }
}

impl Cell for Small {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> cellgraph::cells::Result<NodeId> {
        let h = t.call(&self.fc1, xs)?;
        let h = t.op(Op::Relu, &[h])?;
        t.call(&self.fc2, &[h])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [self.fc1.parameters(), self.fc2.parameters()].concat()
    }
    fn kind(&self) -> &'static str {
        "Small"
    }
}

/// `factor * inner(logits, labels)`.
pub(crate) struct Scaled<C: Cell>(pub(crate) C, pub(crate) f64);

impl<C: Cell> Cell for Scaled<C> {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> cellgraph::cells::Result<NodeId> {
        let l = t.call(&self.0, xs)?;
        let c = t.constant(self.1, TensorType::f32(Shape::scalar()))?;
        t.op(Op::Mul, &[l, c])
    }
    fn kind(&self) -> &'static str {
        "Scaled"
    }
}

pub(crate) fn net() -> WithLossCell {
    WithLossCell::new(Small::new(), CrossEntropyLoss::new())
}

pub(crate) fn data(rng: &mut StdRng, n: usize) -> Vec<HostTensor> {
    let x: Vec<f32> = (0..n * FEATURES).map(|_| rng.random_range(-1.0..1.0)).collect();
    let y: Vec<i32> = (0..n).map(|_| rng.random_range(0..10)).collect();
    vec![HostTensor::f32(vec![n, FEATURES], x).unwrap(), HostTensor::i32(vec![n], y).unwrap()]
}

pub(crate) fn concat(parts: &[Vec<HostTensor>]) -> Vec<HostTensor> {
    (0..2)
        .map(|i| {
            let mut shape = parts[0][i].shape.clone();
            shape[0] = parts.iter().map(|p| p[i].shape[0]).sum();
            match &parts[0][i].data {
                HostData::F32(_) => HostTensor::f32(shape, parts.iter().flat_map(|p| p[i].to_f32()).collect()).unwrap(),
                _ => HostTensor::i32(shape, parts.iter().flat_map(|p| p[i].to_f64()).map(|v| v as i32).collect()).unwrap(),
            }
        })
        .collect()
}

fn types(n: usize) -> [(&'static str, TensorType); 2] {
    [("x", TensorType::f32([n, FEATURES])), ("y", TensorType::i32([n]))]
}

/// A plain large-batch trainer: one `train_one_step` per window on the concatenated batch.
struct Reference {
    session: Session<Cpu>,
    exes: BTreeMap<usize, Executable>,
    loss_factor: f64,
    opt: Rc<dyn Optimizer>,
    updates: u64,
}

impl Reference {
    fn new(opt: Rc<dyn Optimizer>, loss_factor: f64) -> Self {
        let mut session = Session::<Cpu>::new(cpu());
        session.init_params(&net().parameters(), 1);
        Reference { session, exes: BTreeMap::new(), loss_factor, opt, updates: 0 }
    }
    fn step(&mut self, batch: &[HostTensor]) {
        let n = batch[0].shape[0];
        if !self.exes.contains_key(&n) {
            let cell = WithLossCell::new(Small::new(), Scaled(CrossEntropyLoss::new(), self.loss_factor));
            let step = train_one_step(&cell, &types(n), self.opt.as_ref()).unwrap();
            if self.exes.is_empty() {
                self.session.init_state(&step.state);
            }
            self.exes.insert(n, compile(step.graph).unwrap());
        }
        let mut inputs = batch.to_vec();
        inputs.extend(self.opt.scalar_values(self.updates).into_iter().map(HostTensor::scalar_f32));
        self.session.run(&self.exes[&n], &inputs).unwrap();
        self.updates += 1;
    }
}

pub(crate) fn params_of(s: &Session<Cpu>) -> BTreeMap<String, Vec<f32>> {
    net().parameters().iter().map(|p| (p.name.clone(), s.param(&p.name).unwrap().to_f32())).collect()
}

/// Largest relative difference over all parameters: max |a - b| / max |b|, per tensor.
pub(crate) fn rel_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f64 {
    // NaN wins (f64::max drops it: two runs that both went NaN compared as equal).
    let max = |m: f64, d: f64| if m.is_nan() || d.is_nan() { f64::NAN } else { m.max(d) };
    a.iter()
        .map(|(k, va)| {
            let vb = &b[k];
            let scale = vb.iter().map(|x| x.abs() as f64).fold(1e-12, max);
            va.iter().zip(vb).map(|(x, y)| (*x as f64 - *y as f64).abs()).fold(0.0, max) / scale
        })
        .fold(0.0, max)
}

fn momentum() -> Rc<dyn Optimizer> {
    Rc::new(Momentum::new(0.05, 0.9))
}

/// Trains `updates` windows of the given micro-batch sizes both ways and returns the
/// relative parameter difference.
fn compare(acc: GradAccumulation, sizes: &[usize], updates: usize, loss_factor: f64) -> f64 {
    let in_step = acc.slicing == cellgraph::cells::Slicing::InStep;
    let opt = momentum();
    let mut a = Accumulator::<Cpu>::new(Rc::new(acc), opt.clone(), cpu(), 1).unwrap();
    let mut r = Reference::new(opt, loss_factor);
    let mut rng = StdRng::seed_from_u64(9);
    for _ in 0..updates {
        let micro: Vec<Vec<HostTensor>> = sizes.iter().map(|&n| data(&mut rng, n)).collect();
        let big = concat(&micro);
        if in_step {
            assert!(a.step(&big, Place::Regular).unwrap());
        } else {
            for (i, m) in micro.iter().enumerate() {
                assert_eq!(a.step(m, Place::Regular).unwrap(), i + 1 == sizes.len());
            }
        }
        r.step(&big);
    }
    assert_eq!(a.updates(), updates as u64);
    rel_diff(&params_of(a.session()), &params_of(&r.session))
}

#[test]
fn micro_batches_equal_the_concatenated_batch_for_both_flavours_and_all_normalisations() {
    let (k, b) = (4, 8);
    let sizes = vec![b; k];
    for (name, norm, factor) in
        [("sum", Normalization::Sum, k as f64), ("mean", Normalization::Mean, 1.0), ("items", Normalization::ItemWeighted, 1.0)]
    {
        let d = compare(GradAccumulation::new(net(), k).normalization(norm), &sizes, 20, factor);
        assert!(d <= 1e-6, "in-step {name}: relative difference {d:e}");
        let d = compare(GradAccumulation::across_steps(net(), k).normalization(norm), &sizes, 20, factor);
        assert!(d <= 1e-6, "across-steps {name}: relative difference {d:e}");
    }
}

#[test]
fn item_weighted_equals_the_large_batch_with_unequal_micro_batches_and_mean_of_means_does_not() {
    let sizes = [3, 5, 2, 6];
    let d = compare(GradAccumulation::across_steps(net(), 4).normalization(Normalization::ItemWeighted), &sizes, 20, 1.0);
    assert!(d <= 1e-6, "item-weighted: relative difference {d:e}");
    // The 2024 transformers bug: averaging per-micro-batch means. The same check must fail.
    let wrong = compare(GradAccumulation::across_steps(net(), 4).normalization(Normalization::Mean), &sizes, 20, 1.0);
    assert!(wrong > 1e-3, "mean of means should differ from the large batch, got {wrong:e}");
}

#[test]
fn parameters_change_only_at_the_boundary_and_each_graph_runs_once_per_window() {
    let mut a = Accumulator::<Cpu>::new(Rc::new(GradAccumulation::across_steps(net(), 4)), momentum(), cpu(), 3).unwrap();
    let mut rng = StdRng::seed_from_u64(1);
    let acc_name = "accu_grads.fc1.weight";
    for window in 1..=3u64 {
        let before = params_of(a.session());
        for i in 1..=4 {
            let applied = a.step(&data(&mut rng, 8), Place::Regular).unwrap();
            let now = params_of(a.session());
            if i < 4 {
                assert!(!applied);
                assert_eq!(now, before, "window {window}: parameters changed at micro-step {i}");
                assert!(a.session().param(acc_name).unwrap().to_f32().iter().any(|&v| v != 0.0));
            } else {
                assert!(applied);
                assert_ne!(now, before, "window {window}: parameters did not change at the boundary");
                assert!(a.session().param(acc_name).unwrap().to_f32().iter().all(|&v| v == 0.0), "accumulators cleared");
            }
        }
        assert_eq!(
            a.counters(),
            Counters {
                micro_steps: 4 * window,
                optimizer_runs: window,
                clear_runs: window,
                grad_collectives: 0,
                step_collectives: 0,
                skipped_updates: 0,
                overflows: 0,
                fused_launches: 0,
                host_boundaries: window,
                uncaptured_steps: 0
            }
        );
    }
}

#[test]
fn in_step_loss_is_the_sum_of_micro_losses_and_bad_batch_sizes_are_refused() {
    let mut a = Accumulator::<Cpu>::new(Rc::new(GradAccumulation::new(net(), 4)), momentum(), cpu(), 3).unwrap();
    let mut rng = StdRng::seed_from_u64(2);
    let batch = data(&mut rng, 16);
    // Micro losses computed independently, before the update.
    let mut probe = Session::<Cpu>::new(cpu());
    probe.init_params(&net().parameters(), 3);
    let fwd = compile(trace(&net(), "fwd", &types(4)).unwrap().0).unwrap();
    let expected: f64 = (0..4)
        .map(|i| probe.run(&fwd, &[slice_rows(&batch[0], 4 * i, 4 * i + 4), slice_rows(&batch[1], 4 * i, 4 * i + 4)]).unwrap()[0].scalar())
        .sum();
    a.step(&batch, Place::Regular).unwrap();
    let loss = a.step_loss();
    assert!((loss - expected).abs() < 1e-5, "{loss} vs {expected}");
    assert_eq!(
        a.counters(),
        Counters {
            micro_steps: 4,
            optimizer_runs: 1,
            clear_runs: 1,
            grad_collectives: 0,
            step_collectives: 0,
            skipped_updates: 0,
            overflows: 0,
            fused_launches: 0,
            host_boundaries: 1,
            uncaptured_steps: 0
        }
    );

    let mut bad = Accumulator::<Cpu>::new(Rc::new(GradAccumulation::new(net(), 3)), momentum(), cpu(), 3).unwrap();
    let e = bad.step(&data(&mut rng, 16), Place::Regular).unwrap_err().to_string();
    assert!(e.contains("(16) must be divided by micro_size (3)"), "{e}");
    let e = a.step(&data(&mut rng, 10), Place::Regular).unwrap_err().to_string();
    assert!(e.contains("(10) must be divided by micro_size (4)"), "{e}");
}

#[test]
fn incomplete_last_window_steps_with_its_true_count_or_is_dropped() {
    let mut rng = StdRng::seed_from_u64(4);
    let micro: Vec<Vec<HostTensor>> = (0..6).map(|_| data(&mut rng, 8)).collect();

    let acc = GradAccumulation::across_steps(net(), 4).normalization(Normalization::Mean);
    let mut a = Accumulator::<Cpu>::new(Rc::new(acc), momentum(), cpu(), 1).unwrap();
    micro.iter().for_each(|m| {
        a.step(m, Place::Regular).unwrap();
    });
    assert_eq!((a.updates(), a.window_len()), (1, 2));
    assert!(a.finish().unwrap());
    let mut r = Reference::new(momentum(), 1.0);
    r.step(&concat(&micro[..4]));
    r.step(&concat(&micro[4..]));
    let d = rel_diff(&params_of(a.session()), &params_of(&r.session));
    assert!(d <= 1e-6, "true-count last window: {d:e}");
    assert_eq!(
        a.counters(),
        Counters {
            micro_steps: 6,
            optimizer_runs: 2,
            clear_runs: 2,
            grad_collectives: 0,
            step_collectives: 0,
            skipped_updates: 0,
            overflows: 0,
            fused_launches: 0,
            host_boundaries: 2,
            uncaptured_steps: 0
        }
    );

    let acc = GradAccumulation::across_steps(net(), 4).normalization(Normalization::Mean).drop_incomplete_window();
    let mut a = Accumulator::<Cpu>::new(Rc::new(acc), momentum(), cpu(), 1).unwrap();
    micro[..4].iter().for_each(|m| {
        a.step(m, Place::Regular).unwrap();
    });
    let after_first = params_of(a.session());
    micro[4..].iter().for_each(|m| {
        a.step(m, Place::Regular).unwrap();
    });
    assert!(!a.finish().unwrap());
    assert_eq!(params_of(a.session()), after_first);
    assert!(a.session().param("accu_grads.fc2.bias").unwrap().to_f32().iter().all(|&v| v == 0.0));
    assert_eq!(
        a.counters(),
        Counters {
            micro_steps: 6,
            optimizer_runs: 1,
            clear_runs: 2,
            grad_collectives: 0,
            step_collectives: 0,
            skipped_updates: 0,
            overflows: 0,
            fused_launches: 0,
            host_boundaries: 1,
            uncaptured_steps: 0
        }
    );
}

#[test]
fn clipping_happens_once_per_window_on_the_accumulated_gradient() {
    let max_norm = 1e-3;
    let acc = GradAccumulation::across_steps(net(), 3).normalization(Normalization::Mean).clip_global_norm(max_norm);
    let mut a = Accumulator::<Cpu>::new(Rc::new(acc), Rc::new(SGD::new(1.0)), cpu(), 1).unwrap();
    let before = params_of(a.session());
    let mut rng = StdRng::seed_from_u64(5);
    for _ in 0..3 {
        a.step(&data(&mut rng, 8), Place::Regular).unwrap();
    }
    let after = params_of(a.session());
    let norm: f64 = before.iter().flat_map(|(k, v)| v.iter().zip(&after[k]).map(|(x, y)| ((x - y) as f64).powi(2))).sum::<f64>().sqrt();
    assert!((norm - max_norm).abs() < 1e-3 * max_norm, "update norm {norm:e} should be the clip norm {max_norm:e}");
}

#[test]
fn the_learning_rate_schedule_advances_once_per_applied_update() {
    let schedule = LearningRate::Step { base: 0.2, step_size: 1, gamma: 0.5 };
    let opt: Rc<dyn Optimizer> = Rc::new(SGD::new(schedule));
    let acc = GradAccumulation::across_steps(net(), 2).normalization(Normalization::Mean);
    let mut a = Accumulator::<Cpu>::new(Rc::new(acc), opt.clone(), cpu(), 1).unwrap();
    let mut r = Reference::new(opt, 1.0);
    let mut rng = StdRng::seed_from_u64(6);
    for _ in 0..3 {
        let micro: Vec<Vec<HostTensor>> = (0..2).map(|_| data(&mut rng, 8)).collect();
        micro.iter().for_each(|m| {
            a.step(m, Place::Regular).unwrap();
        });
        r.step(&concat(&micro));
    }
    let d = rel_diff(&params_of(a.session()), &params_of(&r.session));
    assert!(d <= 1e-6, "schedule indexed by updates: {d:e}");
}

#[test]
fn a_loss_that_is_not_a_scalar_is_a_clear_error() {
    let per_item = WithLossCell::new(Small::new(), SoftmaxCrossEntropyWithLogits::new(true, Reduction::None));
    let mut m = Model::<Cpu>::new(GradAccumulation::new(per_item, 2), Momentum::new(0.1, 0.9), cpu(), 1).unwrap();
    let err = m.accumulator_mut().step(&data(&mut StdRng::seed_from_u64(1), 4), Place::Regular).unwrap_err().to_string();
    assert!(err.contains("GradAccumulation needs a scalar loss, got f32[2]"), "{err}");
}

/// On the CPU a window's boundary is one pass per parameter (the optimizer's update and the
/// accumulator's clearing, from the `Update` program the optimizer graph comes from; under
/// clipping by global norm, the factor from the clip graph first): for every built-in
/// optimizer, without clipping, with a clip that never bites (its factor exactly 1) and with
/// one that bites every window, 5 windows give the same bits as the optimizer and clear graphs
/// (`set_one_pass_boundary(false)`), and the accumulators are zero.
#[test]
fn the_one_pass_host_boundary_equals_the_optimizer_and_clear_graphs_bit_for_bit() {
    type Rule = (&'static str, fn() -> Rc<dyn Optimizer>);
    let rules: Vec<Rule> = vec![
        ("Momentum", || Rc::new(Momentum::new(0.1, 0.9))),
        ("Momentum nesterov + wd", || Rc::new(Momentum { weight_decay: 0.01, use_nesterov: true, ..Momentum::new(0.1, 0.9) })),
        ("SGD", || Rc::new(SGD::new(0.1))),
        ("SGD momentum dampening nesterov wd", || Rc::new(SGD { dampening: 0.1, weight_decay: 0.01, nesterov: true, ..SGD::new(0.1).momentum(0.9) })),
        ("Adam", || Rc::new(Adam { weight_decay: 0.01, ..Adam::new(0.01) })),
        ("AdamW", || Rc::new(Adam::adamw(0.01, 0.05))),
        ("AdamW, PyTorch's eps", || Rc::new(Adam::adamw(0.01, 0.05).pytorch_eps())),
    ];
    let mut rng = StdRng::seed_from_u64(31);
    let batches: Vec<Vec<HostTensor>> = (0..10).map(|_| data(&mut rng, 6)).collect();
    for (what, opt) in rules {
        for clip in [None, Some(1e30), Some(1e-3)] {
            let run = |one_pass: bool| {
                let net = GradAccumulation::across_steps(net(), 2).normalization(Normalization::Mean);
                let net = match clip {
                    Some(c) => net.clip_global_norm(c),
                    None => net,
                };
                let mut acc = Accumulator::<Cpu>::new(Rc::new(net), opt(), cpu(), 3).unwrap();
                acc.set_one_pass_boundary(one_pass);
                batches.iter().for_each(|b| {
                    acc.step(b, Place::Regular).unwrap();
                });
                assert_eq!(acc.counters().host_boundaries, if one_pass { 5 } else { 0 }, "{what}, clip {clip:?}: the boundary that ran");
                acc.session().params_host().into_iter().map(|(n, t)| (n, t.to_f32())).collect::<BTreeMap<_, _>>()
            };
            let (one_pass, graphs) = (run(true), run(false));
            assert_eq!(one_pass.keys().collect::<Vec<_>>(), graphs.keys().collect::<Vec<_>>());
            for (name, v) in &one_pass {
                assert!(
                    v.iter().map(|x| x.to_bits()).eq(graphs[name].iter().map(|x| x.to_bits())),
                    "{what}, clip {clip:?}: `{name}` differs from the graphs'"
                );
                if name.starts_with("accu_grads.") {
                    assert!(v.iter().all(|&x| x == 0.0), "{what}: {name} is cleared");
                }
            }
        }
    }
}

//! BatchNorm2d and ResNet-18: MindSpore's values, names and momentum; the declared semantics
//! under gradient accumulation (each micro-batch normalises with its own statistics: ghost
//! batch normalisation of the window, never the whole window's statistics); moving statistics
//! as state that training writes, checkpoints keep and the optimizer never touches.

use std::rc::Rc;

use cellgraph::cells::accumulate::{GradAccumulation, Normalization};
use cellgraph::cells::{AdaptiveAvgPool2d, BatchNorm2d, ResNet18};
use cellgraph::compiler::autodiff::{grad, Sens};
use cellgraph::compiler::NodeId;
use cellgraph::prelude::*;
use cellgraph::runtime::Accumulator;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::accumulation::rel_diff;
use cellgraph::runtime::Place;

fn wave(n: usize, f: impl Fn(f64) -> f64) -> Vec<f32> {
    (0..n).map(|i| f(i as f64) as f32).collect()
}

fn max_rel(a: &[f32], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max) / scale
}

/// The reference values printed by `benches/mindspore_batchnorm.py` (MindSpore 2.10,
/// `nn.BatchNorm2d(3)`, CPU): training outputs, moving statistics after two training calls,
/// inference outputs, and the gradients of `sum(bn(x) * w)`.
#[test]
fn batch_norm_matches_mindspore() {
    let n = 4 * 3 * 5 * 5;
    let x1 = wave(n, |i| (0.37 * i).sin() * 2.0 + 0.5);
    let x2 = wave(n, |i| (0.21 * i).cos() * 1.5 - 0.25);
    let w = wave(n, |i| (0.11 * i).sin());
    let bn = BatchNorm2d::new(&Scope::root().child("bn"), 3);
    let names: Vec<String> = bn.parameters().iter().map(|p| p.name.clone()).collect();
    assert_eq!(names, ["bn.moving_mean", "bn.moving_variance", "bn.gamma", "bn.beta"], "MindSpore's names and order");
    assert_eq!(bn.trainable_params().len(), 2, "the moving statistics are not trained");
    let x_ty = TensorType::f32([4, 3, 5, 5]);
    let x = |v: &[f32]| HostTensor::f32(vec![4, 3, 5, 5], v.to_vec()).unwrap();
    let mut s = Session::<Cpu>::new(cpu());
    s.init_params(&bn.parameters(), 0);
    s.set_param("bn.gamma", &HostTensor::f32(vec![3], vec![1.5, 0.5, -1.0]).unwrap());
    s.set_param("bn.beta", &HostTensor::f32(vec![3], vec![0.1, -0.2, 0.3]).unwrap());
    let weighted = |y: &[f32]| y.iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();

    let (train, _) = trace(&bn, "train", &[("x", x_ty.clone())]).unwrap();
    let train = compile(train).unwrap();
    let y1 = s.run(&train, &[x(&x1)]).unwrap()[0].to_f32();
    assert!(
        max_rel(&y1[..6], &[0.00976022332906723, 0.7799123525619507, 1.4458279609680176, 1.917378544807434, 2.130741834640503, 2.0570404529571533])
            < 1e-5,
        "{:?}",
        &y1[..6]
    );
    assert!((weighted(&y1) - 5.735347880214945).abs() < 1e-4, "{}", weighted(&y1));
    s.run(&train, &[x(&x2)]).unwrap();
    let mm = s.param("bn.moving_mean").unwrap().to_f32();
    let mv = s.param("bn.moving_variance").unwrap().to_f32();
    assert!(max_rel(&mm, &[0.027941426262259483, 0.01233786903321743, 0.028926463797688484]) < 1e-5, "moving mean {mm:?}");
    assert!(max_rel(&mv, &[1.0958423614501953, 1.1221365928649902, 1.0936405658721924]) < 1e-6, "moving variance {mv:?} (unbiased)");

    let (eval, _) = cellgraph::cells::cell::trace_inference(&bn, "eval", &[("x", x_ty.clone())]).unwrap();
    let eval = compile(eval).unwrap();
    assert!(eval.graph().effects().is_empty(), "inference writes nothing");
    let y3 = s.run(&eval, &[x(&x1)]).unwrap()[0].to_f32();
    assert!(max_rel(&y3[..4], &[0.7764117121696472, 1.8127275705337524, 2.708782911300659, 3.3433008193969727]) < 1e-5, "{:?}", &y3[..4]);
    assert!((weighted(&y3) - 12.279175604517407).abs() < 1e-4);
    assert_eq!(s.param("bn.moving_mean").unwrap().to_f32(), mm, "inference leaves the moving statistics");

    // Gradients of sum(bn(x) * w) in training, w.r.t. x, gamma and beta.
    let mut t = Tracer::new("grad");
    let xi = t.input("x", x_ty.clone()).unwrap();
    let y = t.call(&bn, &[xi]).unwrap();
    let wi = t.input("w", x_ty).unwrap();
    let yw = t.op(Op::Mul, &[y, wi]).unwrap();
    let loss = t.op(Op::ReduceSum(cellgraph::compiler::ReduceAttrs { axes: vec![0, 1, 2, 3], keep_dims: false }), &[yw]).unwrap();
    let gamma = t.param(&bn.parameters()[2]).unwrap();
    let beta = t.param(&bn.parameters()[3]).unwrap();
    let mut g = t.finish(vec![loss]);
    let d = grad(&mut g, loss, &[xi, gamma, beta], Sens::One).unwrap();
    g.set_outputs(d.grads.clone());
    let out = s.run(&compile(g).unwrap(), &[x(&x1), x(&w)]).unwrap();
    let gx = out[0].to_f32();
    assert!(
        max_rel(
            &gx[..6],
            &[-0.14654260873794556, -0.03229609504342079, 0.08089654892683029, 0.19194991886615753, 0.2997218668460846, 0.4030003547668457]
        ) < 1e-4,
        "{:?}",
        &gx[..6]
    );
    assert!((weighted(&gx) - 35.467239033455236).abs() < 1e-3, "{}", weighted(&gx));
    assert!(max_rel(&out[1].to_f32(), &[0.48539966344833374, 0.276387482881546, 0.11097285896539688]) < 1e-4, "dgamma {:?}", out[1].to_f32());
    assert!(max_rel(&out[2].to_f32(), &[13.790656089782715, -10.254898071289062, 5.166606903076172]) < 1e-5, "dbeta {:?}", out[2].to_f32());
}

#[test]
fn batch_norm_refuses_what_it_cannot_normalise() {
    let bn = BatchNorm2d::new(&Scope::root().child("layer4.1.bn2"), 8);
    let err = |ty: TensorType| trace(&bn, "t", &[("x", ty)]).unwrap_err().to_string();
    let e = err(TensorType::f32([1, 8, 1, 1]));
    assert!(e.contains("layer4.1.bn2") && e.contains("more than one value per channel") && e.contains("f32[1,8,1,1]"), "{e}");
    let e = err(TensorType::f32([4, 6, 2, 2]));
    assert!(e.contains("8 channels") && e.contains("f32[4,6,2,2]"), "{e}");
    assert!(cellgraph::cells::cell::trace_inference(&bn, "t", &[("x", TensorType::f32([1, 8, 1, 1]))]).is_ok(), "inference normalises one item");
    assert!(BatchNorm2d::new(&Scope::root(), 2).momentum(1.5).unwrap_err().to_string().contains("MindSpore's convention"));
    let ghost = BatchNorm2d::new(&Scope::root().child("bn"), 8).ghost_batch(3).unwrap();
    let e = trace(&ghost, "t", &[("x", TensorType::f32([4, 8, 2, 2]))]).unwrap_err().to_string();
    assert!(e.contains("ghost batches of 3 must divide the batch of 4"), "{e}");
}

/// torchvision's ResNet-18 for 10 classes: 11,181,642 trainable parameters, MindSpore's
/// batch-norm names, 10 logits for 32x32 images; in inference the graph writes nothing.
#[test]
fn resnet18_has_torchvisions_architecture() {
    let net = ResNet18::new(&Scope::root(), 10);
    let trainable: usize = net.trainable_params().iter().map(|p| p.ty.numel()).sum();
    assert_eq!(trainable, 11_181_642);
    let names: Vec<String> = net.parameters().iter().map(|p| p.name.clone()).collect();
    for n in [
        "conv1.weight",
        "bn1.gamma",
        "bn1.moving_variance",
        "layer1.0.conv1.weight",
        "layer1.1.bn2.beta",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.moving_mean",
        "layer4.1.conv2.weight",
        "fc.weight",
        "fc.bias",
    ] {
        assert!(names.iter().any(|m| m == n), "{n} missing from {names:?}");
    }
    assert!(!names.iter().any(|m| m.starts_with("layer1.0.downsample")), "layer1 keeps its width and stride");
    assert_eq!(names.iter().filter(|n| n.ends_with(".moving_mean")).count(), 20, "20 batch norms");
    let (g, y) = trace(&net, "t", &[("data", TensorType::f32([2, 3, 32, 32]))]).unwrap();
    assert_eq!(g.ty(y).dims(), [2, 10]);
    assert_eq!(g.effects().len(), 40, "each batch norm writes its two moving statistics");
    let (g, _) = cellgraph::cells::cell::trace_inference(&net, "t", &[("data", TensorType::f32([1, 3, 32, 32]))]).unwrap();
    assert!(g.effects().is_empty());
    // The stem halves, the max pool halves again, three stages halve: 32 -> 1 before the pool.
    assert!(g.ids().iter().any(|&id| matches!(g.node(id).op, Op::MaxPool2d(_)) && g.ty(id).dims() == [1, 64, 8, 8]));
}

/// Conv(3 -> 4, 3x3) -> BatchNorm -> ReLU -> global mean -> Dense(4 -> 10).
pub(crate) struct BnNet {
    conv: Conv2d,
    bn: BatchNorm2d,
    fc: Dense,
}

impl BnNet {
    pub(crate) fn new(ghost: Option<usize>) -> Self {
        let s = Scope::root();
        let bn = BatchNorm2d::new(&s.child("bn"), 4);
        BnNet {
            conv: Conv2d::new(&s.child("conv"), 3, 4, 3),
            bn: ghost.map_or(bn.clone(), |g| bn.ghost_batch(g).unwrap()),
            fc: Dense::new(&s.child("fc"), 4, 10),
        }
    }

    /// With the moving statistics updated once per window.
    pub(crate) fn windowed() -> Self {
        let net = BnNet::new(None);
        BnNet { bn: net.bn.clone().window_statistics().unwrap(), ..net }
    }

    /// With the statistics summed across ranks (SyncBatchNorm), once per window or not.
    pub(crate) fn synced(windowed: bool) -> Self {
        let net = if windowed { BnNet::windowed() } else { BnNet::new(None) };
        BnNet { bn: net.bn.clone().sync().unwrap(), ..net }
    }
}

impl Cell for BnNet {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> cellgraph::cells::Result<NodeId> {
        let x = t.call(&self.conv, xs)?;
        let x = t.call(&self.bn, &[x])?;
        let x = t.op(Op::Relu, &[x])?;
        let x = t.call(&AdaptiveAvgPool2d::new((1, 1)), &[x])?;
        let x = t.op(Op::Flatten, &[x])?;
        t.call(&self.fc, &[x])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [self.conv.parameters(), self.bn.parameters(), self.fc.parameters()].concat()
    }
    fn kind(&self) -> &'static str {
        "BnNet"
    }
}

/// A ResNet `BasicBlock` (3 -> 4 channels, stride 2, so with its 1x1 downsample) -> global
/// average pooling -> Dense(4 -> 10); [`BlockNet::with_stem`] puts a 3 x 3 convolution
/// (3 -> 3, padded by 1) before the block, so the block's stride-2 convolutions have input
/// gradients too.
pub(crate) struct BlockNet {
    stem: Option<cellgraph::cells::Conv2d>,
    block: cellgraph::cells::zoo::BasicBlock,
    fc: Dense,
}

impl BlockNet {
    pub(crate) fn new() -> Self {
        Self::with_norm(&Ok)
    }

    pub(crate) fn with_norm(norm: cellgraph::cells::zoo::NormOption) -> Self {
        let s = Scope::root();
        BlockNet {
            stem: None,
            block: cellgraph::cells::zoo::BasicBlock::with_norm(&s.child("block"), 3, 4, 2, norm).unwrap(),
            fc: Dense::new(&s.child("fc"), 4, 10),
        }
    }

    pub(crate) fn with_stem() -> Self {
        let stem = cellgraph::cells::Conv2d::new(&Scope::root().child("stem"), 3, 3, 3).padding([1; 4]);
        BlockNet { stem: Some(stem), ..Self::new() }
    }
}

impl Cell for BlockNet {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> cellgraph::cells::Result<NodeId> {
        let stemmed;
        let xs = match &self.stem {
            Some(stem) => {
                stemmed = [t.call(stem, xs)?];
                &stemmed[..]
            }
            None => xs,
        };
        let x = t.call(&self.block, xs)?;
        let x = t.call(&AdaptiveAvgPool2d::new((1, 1)), &[x])?;
        let x = t.op(Op::Flatten, &[x])?;
        t.call(&self.fc, &[x])
    }
    fn parameters(&self) -> Vec<Parameter> {
        let stem = self.stem.as_ref().map(|s| s.parameters()).unwrap_or_default();
        [stem, self.block.parameters(), self.fc.parameters()].concat()
    }
    fn kind(&self) -> &'static str {
        "BlockNet"
    }
}

pub(crate) fn images(rng: &mut StdRng, n: usize) -> Vec<HostTensor> {
    let x: Vec<f32> = (0..n * 3 * 6 * 6).map(|_| rng.random_range(-1.0..1.0)).collect();
    let y: Vec<i32> = (0..n).map(|_| rng.random_range(0..10)).collect();
    vec![HostTensor::f32(vec![n, 3, 6, 6], x).unwrap(), HostTensor::i32(vec![n], y).unwrap()]
}

fn params_of(acc: &Accumulator<Cpu>, net: &dyn Cell) -> std::collections::BTreeMap<String, Vec<f32>> {
    net.parameters().iter().map(|p| (p.name.clone(), acc.session().param(&p.name).unwrap().to_f32())).collect()
}

/// The default semantics, declared: K micro-batches of b equal ghost batch normalisation of
/// the K*b batch in groups of b (losses and parameters after 10 Momentum updates within 1e-6
/// relative), and do NOT equal batch normalisation of the whole K*b batch.
#[test]
fn micro_batches_normalise_as_ghost_batches_of_the_window() {
    let (k, b, updates) = (4, 3, 10);
    let mut rng = StdRng::seed_from_u64(5);
    let batches: Vec<Vec<HostTensor>> = (0..updates).map(|_| images(&mut rng, k * b)).collect();
    let opt = || -> Rc<dyn cellgraph::cells::Optimizer> { Rc::new(Momentum::new(0.05, 0.9)) };
    let run = |net: GradAccumulation| {
        let mut acc = Accumulator::<Cpu>::new(Rc::new(net), opt(), cpu(), 3).unwrap();
        let losses: Vec<f64> = batches
            .iter()
            .map(|batch| {
                acc.step(batch, Place::Regular).unwrap();
                acc.step_loss()
            })
            .collect();
        (acc, losses)
    };
    let with_loss = |ghost| WithLossCell::new(BnNet::new(ghost), CrossEntropyLoss::new());
    // In-step slicing into K micro-batches; the mean of their gradients (the loss of each is
    // its micro-batch's mean), against one micro-batch of K*b with ghost groups of b.
    let (micro, micro_losses) = run(GradAccumulation::new(with_loss(None), k).normalization(Normalization::Mean));
    let (ghost, ghost_losses) = run(GradAccumulation::new(with_loss(Some(b)), 1));
    let (whole, _) = run(GradAccumulation::new(with_loss(None), 1));
    let trainable: Vec<String> = BnNet::new(None).trainable_params().iter().map(|p| p.name.clone()).collect();
    let pick = |acc: &Accumulator<Cpu>| params_of(acc, &BnNet::new(None)).into_iter().filter(|(n, _)| trainable.contains(n)).collect();
    let (pm, pg, pw) = (pick(&micro), pick(&ghost), pick(&whole));
    let d = rel_diff(&pm, &pg);
    assert!(d < 1e-6, "K micro-batches vs ghost batch norm of the window: {d:e} relative");
    for (a, g) in micro_losses.iter().zip(&ghost_losses) {
        // In-step slicing sums the micro losses; the ghost run's loss is their mean.
        assert!((a / k as f64 - g).abs() <= 1e-6 * g.abs(), "loss {a} / {k} vs {g}");
    }
    let d = rel_diff(&pm, &pw);
    assert!(d > 1e-3, "whole-window batch statistics would be another network: {d:e}");
}

/// Moving statistics are state: every micro-step updates them with its own batch (K times per
/// window), the optimizer and the window's clear leave them, and a fresh session gets them
/// from the initializers (zeros and ones).
#[test]
fn moving_statistics_update_per_micro_step_and_never_by_the_optimizer() {
    let k = 3;
    let mut rng = StdRng::seed_from_u64(6);
    let micro: Vec<Vec<HostTensor>> = (0..k).map(|_| images(&mut rng, 4)).collect();
    let net = || WithLossCell::new(BnNet::new(None), CrossEntropyLoss::new());
    let mut acc = Accumulator::<Cpu>::new(Rc::new(GradAccumulation::across_steps(net(), k)), Rc::new(Momentum::new(0.1, 0.9)), cpu(), 1).unwrap();
    assert_eq!(acc.session().param("bn.moving_variance").unwrap().to_f32(), vec![1.0; 4]);
    // The expected moving mean: the conv's output channel means, batch by batch, with the
    // parameters fixed inside the window.
    let (conv_g, _) = trace(&Conv2d::new(&Scope::root().child("conv"), 3, 4, 3), "conv", &[("x", TensorType::f32([4, 3, 6, 6]))]).unwrap();
    let conv_exe = compile(conv_g).unwrap();
    let mut want = vec![0.0f64; 4];
    for (i, m) in micro.iter().enumerate() {
        let y = acc.run(&conv_exe, &m[..1]).unwrap()[0].to_f64();
        let per = y.len() / 4 / 4;
        for (c, w) in want.iter_mut().enumerate() {
            let mean = (0..4).flat_map(|n| y[(n * 4 + c) * per..(n * 4 + c + 1) * per].iter()).sum::<f64>() / (4 * per) as f64;
            *w = 0.9 * *w + 0.1 * mean;
        }
        let applied = acc.step(m, Place::Regular).unwrap();
        assert_eq!(applied, i == k - 1);
        let mm: Vec<f64> = acc.session().param("bn.moving_mean").unwrap().to_f64();
        assert!(mm.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5 * b.abs().max(1e-3)), "after micro-step {i}: {mm:?} vs {want:?}");
    }
    assert!(
        !acc.session().param_names().iter().any(|n| n.contains("moving_mean") && n != "bn.moving_mean"),
        "no accumulator or optimizer state for the statistics"
    );
}

/// A checkpoint taken mid-window keeps the moving statistics, and resumes bit-identically.
#[test]
fn a_mid_window_checkpoint_keeps_the_moving_statistics_and_resumes_bit_identically() {
    let k = 3;
    let mut rng = StdRng::seed_from_u64(8);
    let data: Vec<Vec<HostTensor>> = (0..8).map(|_| images(&mut rng, 4)).collect();
    let net = || Rc::new(GradAccumulation::across_steps(WithLossCell::new(BnNet::new(None), CrossEntropyLoss::new()), k));
    let opt = || -> Rc<dyn cellgraph::cells::Optimizer> { Rc::new(Momentum::new(0.1, 0.9)) };
    let mut straight = Accumulator::<Cpu>::new(net(), opt(), cpu(), 1).unwrap();
    for b in &data {
        straight.step(b, Place::Regular).unwrap();
    }
    let mut first = Accumulator::<Cpu>::new(net(), opt(), cpu(), 1).unwrap();
    for b in &data[..4] {
        first.step(b, Place::Regular).unwrap();
    }
    let snap = first.snapshot();
    assert!(snap.contains_key("bn.moving_mean") && snap.contains_key("bn.moving_variance"));
    let mut resumed = Accumulator::<Cpu>::new(net(), opt(), cpu(), 99).unwrap();
    resumed.restore(&snap).unwrap();
    for b in &data[4..] {
        resumed.step(b, Place::Regular).unwrap();
    }
    for name in straight.session().param_names() {
        let (a, b) = (straight.session().param(&name).unwrap().to_f32(), resumed.session().param(&name).unwrap().to_f32());
        assert!(a.iter().map(|x| x.to_bits()).eq(b.iter().map(|x| x.to_bits())), "{name} differs after resuming");
    }
    // A network checkpoint without its statistics is refused (strict), naming them.
    let mut partial = snap.clone();
    partial.remove("bn.moving_variance");
    let err = Accumulator::<Cpu>::new(net(), opt(), cpu(), 1).unwrap().restore(&partial).unwrap_err().to_string();
    assert!(err.contains("bn.moving_variance"), "{err}");
}

/// W ranks (threads of one process, `LocalGroup`) each train `Model::parallel` (gradients
/// averaged, Momentum(0.1, 0.9)) for one epoch on rows `r*k*b..(r+1)*k*b` of every global
/// batch, sliced into K micro-batches of b: each rank's parameters (all of `net()`'s, moving
/// statistics included) and run counters.
fn train_ranks(
    w: usize,
    k: usize,
    b: usize,
    global: &[Vec<HostTensor>],
    net: impl Fn() -> BnNet + Send + Copy + 'static,
) -> Vec<(std::collections::BTreeMap<String, Vec<f32>>, cellgraph::runtime::Counters)> {
    use cellgraph::runtime::comm::{Communicator, LocalGroup};
    use std::sync::Arc;
    let handles: Vec<_> = LocalGroup::new(w)
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let mine: Vec<Vec<HostTensor>> = global
                .iter()
                .map(|g| g.iter().map(|t| cellgraph::runtime::accumulate::slice_rows(t, r * k * b, (r + 1) * k * b)).collect())
                .collect();
            std::thread::spawn(move || {
                let comm: Arc<dyn Communicator> = Arc::new(c);
                let accumulate = GradAccumulation::new(WithLossCell::new(net(), CrossEntropyLoss::new()), k).normalization(Normalization::Mean);
                let mut m =
                    Model::<Cpu>::parallel(AutoParallel::new(accumulate).enable_gradients_mean(), Momentum::new(0.1, 0.9), cpu(), 1, comm).unwrap();
                m.train(1, &TensorDataset { columns: crate::accumulation::concat(&mine), batch_size: k * b }, &mut []).unwrap();
                (params_of(m.accumulator(), &net()), m.accumulator().counters())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Data parallel with batch norm: statistics stay per rank (as DDP's `BatchNorm2d`), so W ranks
/// of K micro-batches of b equal one process on the gathered batch sliced into K*W micro-batches
/// of b (each normalised with its own statistics), within 1e-6 relative after 6 updates; every
/// rank ends with the same trained parameters, and its own moving statistics.
#[test]
fn ranks_with_batch_norm_equal_one_process_on_the_gathered_batches() {
    let (k, b, updates) = (2, 3, 6);
    let with_loss = || WithLossCell::new(BnNet::new(None), CrossEntropyLoss::new());
    let trainable: Vec<String> = BnNet::new(None).trainable_params().iter().map(|p| p.name.clone()).collect();
    for w in [1usize, 2, 4] {
        let mut rng = StdRng::seed_from_u64(20 + w as u64);
        let global: Vec<Vec<HostTensor>> = (0..updates).map(|_| images(&mut rng, w * k * b)).collect();
        let single = {
            let net = GradAccumulation::new(with_loss(), k * w).normalization(Normalization::Mean);
            let mut m = Model::<Cpu>::new(net, Momentum::new(0.1, 0.9), cpu(), 1).unwrap();
            m.train(1, &TensorDataset { columns: crate::accumulation::concat(&global), batch_size: w * k * b }, &mut []).unwrap();
            BnNet::new(None)
                .parameters()
                .iter()
                .map(|p| (p.name.clone(), m.accumulator().session().param(&p.name).unwrap().to_f32()))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        let ranks: Vec<_> = train_ranks(w, k, b, &global, || BnNet::new(None)).into_iter().map(|(p, _)| p).collect();
        let pick = |m: &std::collections::BTreeMap<String, Vec<f32>>| {
            m.iter().filter(|(n, _)| trainable.contains(n)).map(|(n, v)| (n.clone(), v.clone())).collect::<std::collections::BTreeMap<_, _>>()
        };
        for (r, p) in ranks.iter().enumerate() {
            let d = rel_diff(&pick(p), &pick(&single));
            assert!(d < 1e-6, "W={w} rank {r}: {d:e} relative");
            assert_eq!(pick(p), pick(&ranks[0]), "W={w}: rank {r}'s trained parameters are rank 0's");
        }
        if w > 1 {
            assert_ne!(ranks[0]["bn.moving_mean"], ranks[1]["bn.moving_mean"], "moving statistics are per rank");
        }
    }
}

/// The once-per-window option: the moving statistics change once per window, at its boundary,
/// to `momentum * old + (1 - momentum) * stat` where the statistics are the mean and the
/// unbiased variance of every value the window's K micro-batches normalised (within 1e-6
/// relative); training itself is the default's, bit for bit; the window state is zero between
/// windows and travels in mid-window checkpoints.
#[test]
fn window_statistics_update_the_moving_statistics_once_per_window() {
    let (k, b) = (3, 4);
    let mut rng = StdRng::seed_from_u64(9);
    let data: Vec<Vec<HostTensor>> = (0..2 * k).map(|_| images(&mut rng, b)).collect();
    let accumulate = |net: BnNet| Rc::new(GradAccumulation::across_steps(WithLossCell::new(net, CrossEntropyLoss::new()), k));
    let opt = || -> Rc<dyn cellgraph::cells::Optimizer> { Rc::new(Momentum::new(0.1, 0.9)) };
    let mut acc = Accumulator::<Cpu>::new(accumulate(BnNet::windowed()), opt(), cpu(), 1).unwrap();
    let mut plain = Accumulator::<Cpu>::new(accumulate(BnNet::new(None)), opt(), cpu(), 1).unwrap();
    let names: Vec<String> = BnNet::windowed().parameters().iter().map(|p| p.name.clone()).collect();
    assert!(names.windows(4).any(|w| w == ["bn.beta", "bn.window_count", "bn.window_mean", "bn.window_m2"]), "after MindSpore's four: {names:?}");
    let (conv_g, _) = trace(&Conv2d::new(&Scope::root().child("conv"), 3, 4, 3), "conv", &[("x", TensorType::f32([b, 3, 6, 6]))]).unwrap();
    let conv_exe = compile(conv_g).unwrap();
    let stat = |acc: &Accumulator<Cpu>, n: &str| acc.session().param(n).unwrap().to_f64();
    for window in data.chunks(k) {
        let (old_mean, old_var) = (stat(&acc, "bn.moving_mean"), stat(&acc, "bn.moving_variance"));
        // The conv outputs of the whole window, with the window's (fixed) weights.
        let ys: Vec<Vec<f64>> = window.iter().map(|m| acc.run(&conv_exe, &m[..1]).unwrap()[0].to_f64()).collect();
        let per = ys[0].len() / b / 4;
        let channel = |c: usize| -> Vec<f64> {
            ys.iter().flat_map(|y| (0..b).flat_map(move |n| y[(n * 4 + c) * per..(n * 4 + c + 1) * per].iter().copied())).collect()
        };
        for (i, m) in window.iter().enumerate() {
            let applied = acc.step(m, Place::Regular).unwrap();
            plain.step(m, Place::Regular).unwrap();
            assert_eq!(applied, i == k - 1);
            if !applied {
                assert_eq!(stat(&acc, "bn.moving_mean"), old_mean, "micro-step {i} leaves the moving mean");
                assert_eq!(stat(&acc, "bn.window_count"), [((i + 1) * b * per) as f64]);
            }
        }
        for c in 0..4 {
            let v = channel(c);
            let n = v.len() as f64;
            let mean = v.iter().sum::<f64>() / n;
            let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
            let (want_mean, want_var) = (0.9 * old_mean[c] + 0.1 * mean, 0.9 * old_var[c] + 0.1 * var);
            let (got_mean, got_var) = (stat(&acc, "bn.moving_mean")[c], stat(&acc, "bn.moving_variance")[c]);
            assert!((got_mean - want_mean).abs() <= 1e-6 * want_mean.abs().max(1e-2), "channel {c}: moving mean {got_mean} vs {want_mean}");
            assert!((got_var - want_var).abs() <= 1e-6 * want_var.abs(), "channel {c}: moving variance {got_var} vs {want_var}");
        }
        for w in ["bn.window_count", "bn.window_mean", "bn.window_m2"] {
            assert!(stat(&acc, w).iter().all(|&x| x == 0.0), "{w} is zero after the boundary");
        }
    }
    for p in BnNet::new(None).trainable_params() {
        let (a, b) = (acc.session().param(&p.name).unwrap().to_f32(), plain.session().param(&p.name).unwrap().to_f32());
        assert!(a.iter().map(|x| x.to_bits()).eq(b.iter().map(|x| x.to_bits())), "{} trains as with per-micro statistics", p.name);
    }
    // Mid-window: the window state is in the checkpoint, and resuming gives the same bits.
    let mut first = Accumulator::<Cpu>::new(accumulate(BnNet::windowed()), opt(), cpu(), 1).unwrap();
    for m in &data[..k + 1] {
        first.step(m, Place::Regular).unwrap();
    }
    let snap = first.snapshot();
    assert!(snap.contains_key("bn.window_m2"));
    let mut resumed = Accumulator::<Cpu>::new(accumulate(BnNet::windowed()), opt(), cpu(), 7).unwrap();
    resumed.restore(&snap).unwrap();
    for m in &data[k + 1..] {
        resumed.step(m, Place::Regular).unwrap();
    }
    for n in ["bn.moving_mean", "bn.moving_variance", "conv.weight"] {
        assert_eq!(stat(&resumed, n), stat(&acc, n), "{n} after resuming mid-window");
    }
    assert!(BatchNorm2d::new(&Scope::root(), 2).window_statistics().unwrap().ghost_batch(2).unwrap_err().to_string().contains("choose one"));
}

/// SyncBatchNorm: W ranks of K micro-batches of b normalise as one process whose micro-batch j
/// joins every rank's j-th (W*b items, plain batch norm): trained parameters and moving
/// statistics within 1e-6 relative after 4 updates, alone and with once-per-window statistics;
/// the moving statistics are the same bits on every rank; each micro-step's four collectives
/// are counted. In a world of one it is the default batch norm.
#[test]
fn sync_batch_norm_on_w_ranks_equals_one_process_on_the_joined_micro_batches() {
    use std::collections::BTreeMap;
    let (k, b, updates) = (2, 3, 4);
    let opt = || Momentum::new(0.1, 0.9);
    let accumulate = |net: BnNet| GradAccumulation::new(WithLossCell::new(net, CrossEntropyLoss::new()), k).normalization(Normalization::Mean);
    let all = |acc: &Accumulator<Cpu>, windowed: bool| -> BTreeMap<String, Vec<f32>> { params_of(acc, &BnNet::synced(windowed)) };
    for (w, windowed) in [(2usize, false), (4, false), (2, true)] {
        let mut rng = StdRng::seed_from_u64(40 + w as u64);
        // Rank r's batches are rows r*k*b.. of each global batch; one process takes micro-batch
        // j as every rank's j-th micro-batch, joined in rank order.
        let global: Vec<Vec<HostTensor>> = (0..updates).map(|_| images(&mut rng, w * k * b)).collect();
        let joined: Vec<Vec<HostTensor>> = global
            .iter()
            .map(|g| {
                let parts: Vec<Vec<HostTensor>> = (0..k)
                    .flat_map(|j| (0..w).map(move |r| (r * k + j) * b))
                    .map(|at| g.iter().map(|t| cellgraph::runtime::accumulate::slice_rows(t, at, at + b)).collect())
                    .collect();
                crate::accumulation::concat(&parts)
            })
            .collect();
        let single = {
            let plain = if windowed { BnNet::windowed() } else { BnNet::new(None) };
            let mut acc = Accumulator::<Cpu>::new(Rc::new(accumulate(plain)), Rc::new(opt()), cpu(), 1).unwrap();
            joined.iter().for_each(|batch| assert!(acc.step(batch, Place::Regular).unwrap()));
            all(&acc, windowed)
        };
        let ranks = train_ranks(w, k, b, &global, move || BnNet::synced(windowed));
        for (r, (p, counters)) in ranks.iter().enumerate() {
            let d = rel_diff(p, &single);
            assert!(d < 1e-6, "W={w} windowed={windowed} rank {r}: {d:e} relative to one process on the joined micro-batches");
            assert_eq!(p, &ranks[0].0, "W={w}: rank {r} holds rank 0's parameters and moving statistics, bit for bit");
            assert_eq!(counters.step_collectives, (4 * k * updates) as u64, "four collectives per batch norm per micro-step");
            assert_eq!(counters.grad_collectives, updates as u64);
        }
    }
    // A world of one: the default batch norm, and no collective counted.
    let mut rng = StdRng::seed_from_u64(47);
    let data: Vec<Vec<HostTensor>> = (0..3).map(|_| images(&mut rng, k * b)).collect();
    let run = |net: BnNet| {
        let mut acc = Accumulator::<Cpu>::new(Rc::new(accumulate(net)), Rc::new(opt()), cpu(), 1).unwrap();
        data.iter().for_each(|batch| {
            acc.step(batch, Place::Regular).unwrap();
        });
        (all(&acc, false), acc.counters().step_collectives)
    };
    let ((synced, counted), (plain, _)) = (run(BnNet::synced(false)), run(BnNet::new(None)));
    assert!(rel_diff(&synced, &plain) < 1e-6, "{:e}", rel_diff(&synced, &plain));
    assert_eq!(counted, 0);
    let e = BatchNorm2d::new(&Scope::root().child("bn"), 2).ghost_batch(2).unwrap().sync().unwrap_err().to_string();
    assert!(e.contains("bn") && e.contains("choose one"), "{e}");
    assert!(BatchNorm2d::new(&Scope::root(), 2).sync().unwrap().ghost_batch(2).is_err());
}

/// On the host kernels, a per-channel sum over `N, H, W` (batch norm's) of a program that only
/// the sum reads is made as the program's values are computed, never written out: the same
/// bits as the program written out and summed (a second reader keeps it), for maps of 1 x 1
/// and larger, sums and means, and runs too long for the kernel's scratch left alone; and a
/// ResNet block's training micro-step has such sums in its batch norms.
#[test]
fn per_channel_sums_of_programs_are_summed_as_they_are_computed() {
    use cellgraph::compiler::{Graph, ReduceAttrs};
    use cellgraph::runtime::{HostRun, Session};
    let mut rng = StdRng::seed_from_u64(41);
    let mut s = Session::<Cpu>::new(cpu());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let cases = [
        (vec![4, 6, 5, 7], vec![0, 2, 3], 1),
        (vec![8, 12, 1, 1], vec![0], 1),
        (vec![3, 5, 40, 40], vec![0, 2, 3], 1),
        (vec![2, 3, 70, 70], vec![0, 2, 3], 0),
    ];
    for (dims, axes, merges) in cases {
        for mean in [false, true] {
            let plan = |kept: bool| {
                let mut g = Graph::new("channel sums");
                let ty = TensorType::f32(dims.clone());
                let x = g.add_leaf(Op::Input { index: 0, name: "x".into() }, ty.clone(), "t").unwrap();
                let y = g.add_leaf(Op::Input { index: 1, name: "y".into() }, ty, "t").unwrap();
                let m = g.add(Op::Mul, &[x, y], "t").unwrap();
                let attrs = ReduceAttrs { axes: axes.clone(), keep_dims: true };
                let sum = g.add(if mean { Op::ReduceMean(attrs) } else { Op::ReduceSum(attrs) }, &[m], "t").unwrap();
                g.set_outputs(if kept { vec![sum, m] } else { vec![sum] });
                cellgraph::runtime::compile(g).unwrap()
            };
            let n: usize = dims.iter().product();
            let inputs: Vec<HostTensor> =
                (0..2).map(|_| HostTensor::f32(dims.clone(), (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect()).unwrap()).collect();
            let (summed, written) = (plan(false), plan(true));
            let got = s.run(&summed, &inputs).unwrap()[0].to_f32();
            let want = s.run(&written, &inputs).unwrap()[0].to_f32();
            assert_eq!(got.len(), dims[1], "{dims:?}");
            assert_eq!(bits(&got), bits(&want), "{dims:?} over {axes:?}, mean {mean}");
            let merged = |exe| s.steps(exe).iter().filter(|st| st.run == HostRun::SummedInProducer).count();
            assert_eq!((merged(&summed), merged(&written)), (merges, 0), "{dims:?} over {axes:?}, mean {mean}");
        }
    }

    let net = GradAccumulation::new(WithLossCell::new(BlockNet::new(), CrossEntropyLoss::new()), 2);
    let mut acc = Accumulator::<Cpu>::new(Rc::new(net), Rc::new(Momentum::new(0.05, 0.9)), cpu(), 3).unwrap();
    acc.step(&images(&mut rng, 6), Place::Regular).unwrap();
    let sums = acc.micro_plans().flat_map(|e| acc.session().steps(e)).filter(|st| st.run == HostRun::SummedInProducer).count();
    assert_eq!(sums, 9, "three in each of the block's three batch norms");
}

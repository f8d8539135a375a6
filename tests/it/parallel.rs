//! Data parallelism on in-process ranks (`LocalGroup`): W ranks x K micro-batches equal one
//! process on the gathered global batch, with and without hsdp, summing or averaging across
//! ranks; one gradient collective per update; mismatched ranks fail with a clear error.

use std::sync::Arc;
use std::thread;

use cellgraph::cells::accumulate::{AutoParallel, GradAccumulation, Normalization};
use cellgraph::prelude::*;
use cellgraph::runtime::comm::{Communicator, LocalGroup};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::accumulation::{concat, data, net, params_of, rel_diff};

const UPDATES: usize = 7;
const K: usize = 2;
const B: usize = 4;

/// Rank `r`'s rows of every global batch of `w * B` rows.
fn rank_columns(global: &[Vec<HostTensor>], r: usize) -> Vec<HostTensor> {
    let mine: Vec<Vec<HostTensor>> =
        global.iter().map(|g| g.iter().map(|t| cellgraph::runtime::accumulate::slice_rows(t, r * B, (r + 1) * B)).collect()).collect();
    concat(&mine)
}

fn global_batches(w: usize) -> Vec<Vec<HostTensor>> {
    let mut rng = StdRng::seed_from_u64(11);
    (0..UPDATES).map(|_| data(&mut rng, w * B)).collect()
}

struct Setup {
    hsdp: bool,
    mean: bool,
    seed: u64,
}

/// Trains on `w` threads, one rank each; returns every rank's result.
pub(crate) fn run_ranks<T: Send + 'static>(w: usize, f: impl Fn(usize, Arc<dyn Communicator>) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = LocalGroup::new(w)
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let f = f.clone();
            thread::spawn(move || f(r, Arc::new(c)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

fn network(mean: bool) -> GradAccumulation {
    let n = GradAccumulation::new(net(), K);
    if mean {
        n.normalization(Normalization::Mean)
    } else {
        n
    }
}

fn parallel_model(comm: Arc<dyn Communicator>, s: &Setup) -> cellgraph::runtime::Result<Model<Cpu>> {
    let mut p = AutoParallel::new(network(s.mean));
    if s.hsdp {
        p = p.hsdp();
    }
    if s.mean {
        p = p.enable_gradients_mean();
    }
    Model::parallel(p, Momentum::new(0.1, 0.9), cpu(), s.seed, comm)
}

/// Parameters after training on `w` ranks, from every rank, plus the counters.
fn train_parallel(w: usize, hsdp: bool, mean: bool) -> Vec<(std::collections::BTreeMap<String, Vec<f32>>, cellgraph::runtime::Counters, u64)> {
    let global = global_batches(w);
    run_ranks(w, move |r, comm| {
        let s = Setup { hsdp, mean, seed: 1 };
        let mut m = parallel_model(comm, &s).unwrap();
        let ds = TensorDataset { columns: rank_columns(&global, r), batch_size: B };
        m.train(1, &ds, &mut []).unwrap();
        let a = m.accumulator();
        (params_of(a.session()), a.counters(), a.updates())
    })
}

/// One process on the gathered global batch: K*W micro-batches per update.
fn train_single(w: usize, mean: bool) -> std::collections::BTreeMap<String, Vec<f32>> {
    let global = global_batches(w);
    let n = GradAccumulation::new(net(), K * w);
    let n = if mean { n.normalization(Normalization::Mean) } else { n };
    let mut m = Model::<Cpu>::new(n, Momentum::new(0.1, 0.9), cpu(), 1).unwrap();
    let ds = TensorDataset { columns: concat(&global), batch_size: w * B };
    m.train(1, &ds, &mut []).unwrap();
    params_of(m.accumulator().session())
}

#[test]
fn ranks_times_micro_batches_equal_one_process_on_the_global_batch() {
    for w in [1, 2, 4, 8] {
        for hsdp in [false, true] {
            for mean in [false, true] {
                let reference = train_single(w, mean);
                let ranks = train_parallel(w, hsdp, mean);
                for (r, (params, counters, updates)) in ranks.iter().enumerate() {
                    let d = rel_diff(params, &reference);
                    assert!(d < 1e-6, "W={w} hsdp={hsdp} mean={mean} rank {r}: relative difference {d}");
                    assert_eq!(*updates, UPDATES as u64);
                    assert_eq!(counters.grad_collectives, *updates, "one gradient collective per update");
                    assert_eq!(counters.optimizer_runs, *updates);
                    assert_eq!(params, &ranks[0].0, "rank {r} holds the same parameters as rank 0");
                }
            }
        }
    }
}

#[test]
fn a_wrong_cross_rank_normalisation_fails_the_same_check() {
    // Summing across ranks where the single process averages: the check must catch it.
    let reference = train_single(4, true);
    let ranks = train_parallel(4, false, false);
    let d = rel_diff(&ranks[0].0, &reference);
    assert!(d > 1e-3, "summed ranks should differ from the averaged reference, got {d}");
}

#[test]
fn hsdp_shards_optimizer_state_and_checkpoints_like_the_unsharded_run() {
    let snapshots: Vec<Vec<_>> = [false, true]
        .into_iter()
        .map(|hsdp| {
            let global = global_batches(4);
            run_ranks(4, move |r, comm| {
                let mut m = parallel_model(comm, &Setup { hsdp, mean: false, seed: 1 }).unwrap();
                let ds = TensorDataset { columns: rank_columns(&global, r), batch_size: B };
                m.train(1, &ds, &mut []).unwrap();
                (m.accumulator().optimizer_state_elements(), m.snapshot())
            })
        })
        .collect();
    let (full, sharded) = (&snapshots[0], &snapshots[1]);
    let params: usize = net().parameters().iter().map(|p| p.ty.numel()).sum();
    assert_eq!(full[0].0, params, "Momentum keeps one moment per element");
    assert_eq!(sharded[0].0, params.div_ceil(4), "hsdp keeps a quarter on each rank");
    let (a, b) = (&full[0].1, &sharded[0].1);
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "same tensor names");
    for (k, t) in a {
        let (x, y) = (t.to_f64(), b[k].to_f64());
        let scale = x.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
        let d = x.iter().zip(&y).fold(0.0f64, |m, (p, q)| m.max((p - q).abs())) / scale;
        assert!(d < 1e-6, "{k}: sharded checkpoint differs by {d}");
    }
}

#[test]
fn hsdp_resumes_from_its_own_checkpoint() {
    let global = global_batches(2);
    let out = run_ranks(2, move |r, comm| {
        let s = Setup { hsdp: true, mean: false, seed: 1 };
        let mut m = parallel_model(comm.clone(), &s).unwrap();
        let ds = TensorDataset { columns: rank_columns(&global, r), batch_size: B };
        m.train(1, &ds, &mut []).unwrap();
        let snap = m.snapshot();
        m.train(2, &ds, &mut []).unwrap();
        let mut resumed = parallel_model(comm, &s).unwrap();
        resumed.restore(&snap).unwrap();
        resumed.train(2, &ds, &mut []).unwrap();
        (params_of(m.accumulator().session()), params_of(resumed.accumulator().session()))
    });
    for (a, b) in out {
        assert_eq!(a, b, "resumed hsdp run is bit-identical");
    }
}

#[test]
fn ranks_that_disagree_fail_with_a_clear_error() {
    // A different seed on rank 1: different initial parameters.
    let errs = run_ranks(2, |r, comm| parallel_model(comm, &Setup { hsdp: false, mean: false, seed: 1 + r as u64 }).err().map(|e| e.to_string()));
    for e in &errs {
        let e = e.as_ref().expect("every rank reports the mismatch");
        assert!(e.contains("ranks [1]") && e.contains("initial parameters"), "{e}");
    }
    // The same parameters but a different network on rank 1 (its loss scaled by 2).
    let errs = run_ranks(2, |r, comm| {
        let loss = crate::accumulation::Scaled(CrossEntropyLoss::new(), 1.0 + r as f64);
        let net = GradAccumulation::new(WithLossCell::new(crate::accumulation::Small::new(), loss), K);
        let mut m = Model::<Cpu>::parallel(AutoParallel::new(net), Momentum::new(0.1, 0.9), cpu(), 1, comm).unwrap();
        let ds = TensorDataset { columns: data(&mut StdRng::seed_from_u64(3), 2 * B), batch_size: B };
        m.train(1, &ds, &mut []).err().map(|e| e.to_string())
    });
    for e in &errs {
        let e = e.as_ref().expect("every rank reports the mismatch");
        assert!(e.contains("ranks [1] have a different network"), "{e}");
    }
    // A different number of batches per epoch on rank 1.
    let errs = run_ranks(2, |r, comm| {
        let mut m = parallel_model(comm, &Setup { hsdp: false, mean: false, seed: 1 }).unwrap();
        let mut rng = StdRng::seed_from_u64(r as u64);
        let ds = TensorDataset { columns: data(&mut rng, B * (3 + r)), batch_size: B };
        m.train(1, &ds, &mut []).err().map(|e| e.to_string())
    });
    for e in &errs {
        let e = e.as_ref().expect("every rank reports the mismatch");
        assert!(e.contains("number of batches per epoch") && e.contains("shard"), "{e}");
    }
}

#[test]
fn uneven_shards_take_the_same_steps_on_every_rank() {
    // 2,000 test images over 3 ranks: 667 each (the shard wraps around), 21 batches of up to
    // 32, windows of 4 across steps: 5 full windows and an incomplete one, applied on every rank.
    let out = run_ranks(3, |r, comm| {
        use cellgraph::runtime::data::{ImageOp, MnistDataset};
        let ops = [ImageOp::rescale(1.0 / 255.0, 0.0), ImageOp::Hwc2Chw];
        let ds = MnistDataset::new(&crate::common::mnist_dir(), "t10k").unwrap().map(ops).batch(32, false).unwrap().shard(3, r).unwrap();
        let net = GradAccumulation::across_steps(crate::common::mlp_with_loss(), 4);
        let mut m = Model::<Cpu>::parallel(AutoParallel::new(net).hsdp(), SGD::new(0.01), cpu(), 1, comm).unwrap();
        m.train(1, &ds, &mut []).unwrap();
        let a = m.accumulator();
        let names: Vec<String> = a.network().parameters().into_iter().map(|p| p.name).collect();
        (
            ds.get_dataset_size(),
            a.updates(),
            a.counters().grad_collectives,
            names.iter().map(|n| a.session().param(n).unwrap().to_f32()).collect::<Vec<_>>(),
        )
    });
    for (batches, updates, collectives, params) in &out {
        assert_eq!((*batches, *updates, *collectives), (21, 6, 6));
        assert_eq!(params, &out[0].3, "every rank holds the same parameters");
    }
}

#[test]
fn item_weighted_normalisation_counts_items_on_every_rank() {
    // Rank r brings batches of 4 * (r + 1) items: the global mean over 12 items per update
    // equals one process on the gathered 12-item batches.
    let mut rng = StdRng::seed_from_u64(5);
    let sizes = [4, 8];
    let steps: Vec<Vec<Vec<HostTensor>>> = (0..UPDATES).map(|_| sizes.iter().map(|&n| data(&mut rng, n)).collect()).collect();
    let per_rank: Vec<Vec<HostTensor>> = (0..2).map(|r| concat(&steps.iter().map(|s| s[r].clone()).collect::<Vec<_>>())).collect();
    let ranks = run_ranks(2, move |r, comm| {
        let net = GradAccumulation::new(net(), K).normalization(Normalization::ItemWeighted);
        let mut m = Model::<Cpu>::parallel(AutoParallel::new(net), Momentum::new(0.1, 0.9), cpu(), 1, comm).unwrap();
        m.train(1, &TensorDataset { columns: per_rank[r].clone(), batch_size: sizes[r] }, &mut []).unwrap();
        params_of(m.accumulator().session())
    });
    let gathered = concat(&steps.iter().map(|s| concat(s)).collect::<Vec<_>>());
    let single = GradAccumulation::new(net(), 4).normalization(Normalization::ItemWeighted);
    let mut m = Model::<Cpu>::new(single, Momentum::new(0.1, 0.9), cpu(), 1).unwrap();
    m.train(1, &TensorDataset { columns: gathered, batch_size: 12 }, &mut []).unwrap();
    let reference = params_of(m.accumulator().session());
    for (r, p) in ranks.iter().enumerate() {
        let d = rel_diff(p, &reference);
        assert!(d < 1e-6, "rank {r}: relative difference {d}");
    }
}

//! Language models: the character corpus and its datasets, token-weighted normalisation
//! (micro-batches and ranks with unequal token counts equal one large batch; the mean of
//! micro-batch means does not; a window without a token applies nothing), the validation loss.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use cellgraph::cells::accumulate::{AutoParallel, GradAccumulation, Normalization};
use cellgraph::prelude::Optimizer;
use cellgraph::prelude::*;
use cellgraph::runtime::data::{CharDataset, Corpus, Items, IGNORE_INDEX};
use cellgraph::runtime::{Dataset, Metric};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::accumulation::{concat, rel_diff};
use crate::parallel::run_ranks;
use cellgraph::runtime::Place;

const VOCAB: usize = 11;
const T: usize = 6;

fn gpt() -> GPT {
    GPT::new(
        &Scope::root(),
        GptConfig { vocab_size: VOCAB, context: T, layers: 1, heads: 2, width: 8, layer_norm_eps: 1e-5, dropout: 0.0, gelu_approximate: false },
    )
    .unwrap()
}

/// The GPT under token-summed cross-entropy.
pub(crate) fn counted() -> WithLossCell {
    WithLossCell::new(gpt(), CrossEntropyLoss::new().ignore_index(IGNORE_INDEX as i64).tokens())
}

/// `n` sequences of `T` tokens whose labels are padded after a random length in 1..=T (some
/// rows all padding when `empty_rows`): micro-batches carry different numbers of tokens.
pub(crate) fn sequences(rng: &mut StdRng, n: usize) -> Vec<HostTensor> {
    sequences_of(rng, n, T)
}

/// [`sequences`] of `t` tokens.
pub(crate) fn sequences_of(rng: &mut StdRng, n: usize, t: usize) -> Vec<HostTensor> {
    let mut ids = Vec::new();
    let mut labels = Vec::new();
    for _ in 0..n {
        let len = rng.random_range(1..=t);
        for j in 0..t {
            ids.push(rng.random_range(0..VOCAB as i32));
            labels.push(if j < len { rng.random_range(0..VOCAB as i32) } else { IGNORE_INDEX });
        }
    }
    vec![HostTensor::i32(vec![n, t], ids).unwrap(), HostTensor::i32(vec![n, t], labels).unwrap()]
}

fn tokens(batch: &[HostTensor]) -> usize {
    batch[1].to_f64().iter().filter(|&&l| l >= 0.0).count()
}

fn adamw() -> Adam {
    Adam::adamw(LearningRate::Warmup { warmup: 3, then: Box::new(LearningRate::Cosine { base: 1e-2, min: 1e-3, total: 20 }) }, 0.1)
}

// Token-weighting is checked in f64 (`Model::new_f64`): what it asserts is the normalisation, which
// f32's different summation orders (4 micro-batch sums against one) would blur at 1e-6 after
// 20 AdamW updates. (The gradients cross ranks in f32.)

fn params<B: cellgraph::runtime::Backend>(m: &Model<B>) -> BTreeMap<String, Vec<f32>> {
    gpt().parameters().iter().map(|p| (p.name.clone(), m.accumulator().session().param(&p.name).unwrap().to_f32())).collect()
}

fn trained(net: GradAccumulation, batches: &[Vec<HostTensor>]) -> Model<Cpu> {
    let mut m = Model::<Cpu>::new_f64(net, adamw(), cpu(), 3).unwrap();
    let n = batches[0][0].shape[0];
    m.train(1, &TensorDataset { columns: concat(batches), batch_size: n }, &mut []).unwrap();
    m
}

/// 20 AdamW updates (warmup + cosine) of 4 micro-batches of 2 sequences with unequal token
/// counts equal 20 steps on the 8-sequence batches; the mean of the micro-batches' mean losses
/// (what Hugging Face's Trainer did before `num_items_in_batch`) does not.
#[test]
fn token_weighted_micro_batches_equal_one_large_batch_and_the_mean_of_means_does_not() {
    let mut rng = StdRng::seed_from_u64(1);
    let batches: Vec<Vec<HostTensor>> = (0..20).map(|_| sequences(&mut rng, 8)).collect();
    let micro: Vec<usize> =
        (0..4).map(|k| tokens(&[batches[0][0].clone(), cellgraph::runtime::accumulate::slice_rows(&batches[0][1], 2 * k, 2 * k + 2)])).collect();
    assert!(micro.iter().any(|&c| c != micro[0]), "the micro-batches must differ in tokens: {micro:?}");
    let accumulated = trained(GradAccumulation::new(counted(), 4).normalization(Normalization::Tokens), &batches);
    let large = trained(GradAccumulation::new(counted(), 1).normalization(Normalization::Tokens), &batches);
    let (a, b) = (params(&accumulated), params(&large));
    assert_eq!(accumulated.accumulator().updates(), 20);
    let d = rel_diff(&a, &b);
    assert!(d < 1e-6, "token-weighted accumulation vs one large batch: relative difference {d}");
    let means = WithLossCell::new(gpt(), CrossEntropyLoss::new().ignore_index(IGNORE_INDEX as i64));
    let control = trained(GradAccumulation::new(means, 4).normalization(Normalization::Mean), &batches);
    let dc = rel_diff(&params(&control), &b);
    assert!(dc > 1e-3, "the mean of micro-batch means should miss the large batch, got {dc}");
}

/// W = 2 and 4 ranks, each with its own token counts, equal one process on the gathered
/// batches: the window's count crosses the ranks with the gradients (one collective). In f32
/// (data parallelism's type), with momentum SGD, whose steps do not amplify f32's rounding of
/// different summation orders as Adam's normalised steps do.
#[test]
fn token_weighted_ranks_equal_one_process() {
    for w in [2usize, 4] {
        let mut rng = StdRng::seed_from_u64(w as u64);
        // Per step: rank r's 4 sequences (2 micro-batches of 2).
        let steps: Vec<Vec<Vec<HostTensor>>> = (0..6).map(|_| (0..w).map(|_| sequences(&mut rng, 4)).collect()).collect();
        let per_rank: Vec<Vec<HostTensor>> = (0..w).map(|r| concat(&steps.iter().map(|s| s[r].clone()).collect::<Vec<_>>())).collect();
        let counts: Vec<usize> = (0..w).map(|r| tokens(&steps[0][r])).collect();
        assert!(counts.iter().any(|&c| c != counts[0]), "ranks must differ in tokens: {counts:?}");
        let ranks = run_ranks(w, move |r, comm| {
            let net = GradAccumulation::new(counted(), 2).normalization(Normalization::Tokens);
            let mut m = Model::<Cpu>::parallel(AutoParallel::new(net), Momentum::new(0.1, 0.9), cpu(), 3, comm).unwrap();
            m.train(1, &TensorDataset { columns: per_rank[r].clone(), batch_size: 4 }, &mut []).unwrap();
            (params(&m), m.accumulator().counters().grad_collectives)
        });
        let gathered: Vec<Vec<HostTensor>> = steps.iter().map(|s| concat(s)).collect();
        let mut single =
            Model::<Cpu>::new(GradAccumulation::new(counted(), 1).normalization(Normalization::Tokens), Momentum::new(0.1, 0.9), cpu(), 3).unwrap();
        single.train(1, &TensorDataset { columns: concat(&gathered), batch_size: 4 * w }, &mut []).unwrap();
        let reference = params(&single);
        for (r, (p, collectives)) in ranks.iter().enumerate() {
            let d = rel_diff(p, &reference);
            assert!(d < 1e-6, "{w} ranks, rank {r}: relative difference {d}");
            assert_eq!(*collectives, 6, "one gradient collective per update");
        }
    }
}

/// A window whose labels are all padding: its gradient would be 0/0. No update: parameters and
/// AdamW's moments stay bit-identical, the update count (and so the learning-rate position)
/// does not move, the accumulators are cleared, the skip is counted; the loss reads 0 (the
/// empty sum), and the next window trains normally.
#[test]
fn a_window_without_a_token_applies_no_update() {
    let mut rng = StdRng::seed_from_u64(9);
    let first = sequences(&mut rng, 4);
    let mut empty = sequences(&mut rng, 4);
    empty[1] = HostTensor::i32(vec![4, T], vec![IGNORE_INDEX; 4 * T]).unwrap();
    let net = GradAccumulation::new(counted(), 2).normalization(Normalization::Tokens);
    let mut acc = cellgraph::runtime::Accumulator::<Cpu>::new(std::rc::Rc::new(net), std::rc::Rc::new(adamw()), cpu(), 3).unwrap();
    acc.step(&first, Place::Regular).unwrap();
    let snapshot = |a: &cellgraph::runtime::Accumulator<Cpu>| -> BTreeMap<String, Vec<u32>> {
        a.session().param_names().iter().map(|n| (n.clone(), a.session().param(n).unwrap().to_f32().iter().map(|v| v.to_bits()).collect())).collect()
    };
    let before = snapshot(&acc);
    acc.step(&empty, Place::Regular).unwrap();
    assert_eq!(acc.step_loss(), 0.0, "the loss over no token");
    assert_eq!(snapshot(&acc), before, "parameters, moments and accumulators");
    // Skipped, and not an overflow.
    assert_eq!((acc.updates(), acc.counters().skipped_updates, acc.counters().overflows, acc.counters().optimizer_runs), (1, 1, 0, 1));
    let applied = acc.step(&first, Place::Regular).unwrap();
    assert!(acc.step_loss().is_finite() && applied && acc.updates() == 2);
    assert!(acc.session().param("wte.embedding_table").unwrap().to_f32().iter().all(|v| v.is_finite()));
}

#[test]
fn token_normalisation_needs_a_loss_that_counts() {
    let net = GradAccumulation::new(WithLossCell::new(gpt(), CrossEntropyLoss::new()), 2).normalization(Normalization::Tokens);
    let mut m = Model::<Cpu>::new(net, adamw(), cpu(), 3).unwrap();
    let mut rng = StdRng::seed_from_u64(2);
    let mut data = sequences(&mut rng, 4);
    data[1] = HostTensor::i32(vec![4, T], (0..4 * T as i32).map(|i| i % VOCAB as i32).collect()).unwrap();
    let err = m.train(1, &TensorDataset { columns: data, batch_size: 4 }, &mut []).unwrap_err().to_string();
    assert!(err.contains("Normalization::Tokens needs a loss that sums over tokens and counts them") && err.contains("tokens()"), "{err}");
    assert_eq!(m.accumulator().updates(), 0);
}

/// Labels outside the vocabulary are errors unless they are the index asked to be ignored.
#[test]
fn labels_out_of_range_are_errors_unless_ignored() {
    let mut rng = StdRng::seed_from_u64(4);
    let mut data = sequences(&mut rng, 2);
    data[1] = HostTensor::i32(vec![2, T], vec![-1; 2 * T]).unwrap();
    let net = GradAccumulation::new(counted(), 1).normalization(Normalization::Tokens);
    let mut m = Model::<Cpu>::new(net, adamw(), cpu(), 3).unwrap();
    let err = m.train(1, &TensorDataset { columns: data.clone(), batch_size: 2 }, &mut []).unwrap_err().to_string();
    assert!(err.contains("label -1") && err.contains("out of range"), "{err}");
    data[0] = HostTensor::i32(vec![2, T], vec![VOCAB as i32; 2 * T]).unwrap();
    data[1] = HostTensor::i32(vec![2, T], vec![0; 2 * T]).unwrap();
    let mut m = Model::<Cpu>::new(GradAccumulation::new(counted(), 1).normalization(Normalization::Tokens), adamw(), cpu(), 3).unwrap();
    let err = m.train(1, &TensorDataset { columns: data, batch_size: 2 }, &mut []).unwrap_err().to_string();
    assert!(err.contains("id 11") && err.contains("out of range for a table of 11 rows"), "{err}");
}

/// `Model::eval`'s loss is the mean over the held-out tokens: with a counting loss, the sum over
/// every batch's tokens divided by their number (not the mean of batch means).
#[test]
fn the_validation_loss_is_the_mean_over_tokens() {
    let mut rng = StdRng::seed_from_u64(6);
    let data = sequences(&mut rng, 6);
    let net = GradAccumulation::new(counted(), 1).normalization(Normalization::Tokens);
    let mut m = Model::<Cpu>::new(net, adamw(), cpu(), 3).unwrap().with_metrics(&[Metric::Loss, Metric::Accuracy]);
    let got = m.eval(&TensorDataset { columns: data.clone(), batch_size: 4 }).unwrap();
    // The reference: one plan on all six sequences, per-token losses summed in f64.
    let per_token = WithLossCell::new(gpt(), CrossEntropyLoss::new().reduction(Reduction::None));
    let (g, _) = cellgraph::cells::cell::trace_inference(
        &per_token,
        "ref",
        &[("ids", data[0].ty()), ("labels", HostTensor::i32(vec![6, T], vec![0; 6 * T]).unwrap().ty())],
    )
    .unwrap();
    let exe = compile(g).unwrap();
    let labels = data[1].to_f64();
    let safe = HostTensor::i32(vec![6, T], labels.iter().map(|&l| l.max(0.0) as i32).collect()).unwrap();
    let losses = m.accumulator_mut().run(&exe, &[data[0].clone(), safe]).unwrap().remove(0).to_f64();
    let (sum, n) = labels.iter().zip(&losses).filter(|(l, _)| **l >= 0.0).fold((0.0, 0.0), |(s, n), (_, x)| (s + x, n + 1.0));
    assert!((got["Loss"] - sum / n).abs() < 1e-5, "eval {} vs {}", got["Loss"], sum / n);
    assert!((0.0..=1.0).contains(&got["Accuracy"]));
}

fn corpus_of(text: &str) -> Arc<Corpus> {
    Arc::new(Corpus::parse(Path::new("t.txt"), text.as_bytes().to_vec()).unwrap())
}

#[test]
fn the_vendored_corpus_and_its_split() {
    let c = Corpus::load(Path::new("data/shakespeare/shakespeare.txt.gz")).unwrap();
    assert_eq!((c.text.len(), c.vocab_size()), (5_057_282, 84), "docs/data.md's size and character count");
    let (train, val) = c.split(0.1);
    assert_eq!(train.end, val.start);
    assert!(c.text[..val.start].ends_with(b"\n\n"), "the held-out part starts at a paragraph break");
    assert!((val.len() as f64 / c.text.len() as f64 - 0.1).abs() < 0.01);
    assert_eq!(c.decode(&c.encode(b"To be, or not to be").unwrap()), "To be, or not to be");
}

#[test]
fn windows_and_lines() {
    let c = corpus_of("abcdefghij\nxy\nz\nlonger line here\n");
    let w = CharDataset::new(c.clone(), 0..11, Items::Windows, 4, "w").unwrap().batch(2, false).unwrap();
    // 11 characters, windows of 5 every 4: starts 0 and 4 (8 would need 13).
    assert_eq!(w.len(), 2);
    let [ids, labels, items] = w.batch_of(&[0, 1]);
    assert_eq!(items.to_f64(), vec![0.0, 1.0]);
    assert_eq!(ids.shape, vec![2, 4]);
    assert_eq!(c.decode(&ids.to_f64().iter().map(|&v| v as i32).collect::<Vec<_>>()), "abcdefgh");
    assert_eq!(c.decode(&labels.to_f64().iter().map(|&v| v as i32).collect::<Vec<_>>()), "bcdefghi");
    // Lines of >= 3 characters with their newline, cut to context + 1, padded per batch.
    let l = CharDataset::new(c.clone(), 0..c.text.len(), Items::Lines, 8, "l").unwrap().batch(3, false).unwrap();
    assert_eq!(l.len(), 3, "`z\\n` is too short to predict anything but its newline... and is dropped");
    let [ids, labels, _] = l.batch_of(&[1, 2]);
    assert_eq!(ids.shape, vec![2, 8], "the longest item: 9 characters cut from `longer line here\\n`");
    let labels: Vec<i32> = labels.to_f64().iter().map(|&v| v as i32).collect();
    assert_eq!(&labels[..8], &[c.encode(b"y\n").unwrap(), vec![IGNORE_INDEX; 6]].concat()[..]);
    assert_eq!(c.decode(&labels[8..]), "onger li");
    // Sharding: each rank a different part; each epoch a different order, the same on every rank.
    let s0 = CharDataset::new(c.clone(), 0..c.text.len(), Items::Lines, 8, "l").unwrap().shuffle(1).batch(1, false).unwrap().shard(2, 0).unwrap();
    assert_eq!(s0.dataset_size(), 2);
}

#[test]
fn corrupt_text_is_an_error_at_its_offset() {
    let err = Corpus::parse(Path::new("bad.txt"), b"fine text\n\xe2\x80\x94 dash".to_vec()).unwrap_err().to_string();
    assert!(err.contains("bad.txt") && err.contains("offset 10") && err.contains("0xe2"), "{err}");
    let err = Corpus::parse(Path::new("short.txt"), b"a".to_vec()).unwrap_err().to_string();
    assert!(err.contains("short.txt") && err.contains("at least two characters"), "{err}");
    let c = corpus_of("abc\n");
    let err = c.encode(b"abz").unwrap_err().to_string();
    assert!(err.contains("'z'") && err.contains("position 2") && err.contains("vocabulary"), "{err}");
}

/// A GPT with dropout 0.3 everywhere nanoGPT puts it.
pub(crate) fn dropped() -> WithLossCell {
    let cfg = GptConfig { vocab_size: VOCAB, context: T, layers: 1, heads: 2, width: 8, layer_norm_eps: 1e-5, dropout: 0.3, gelu_approximate: false };
    WithLossCell::new(GPT::new(&Scope::root(), cfg).unwrap(), CrossEntropyLoss::new().ignore_index(IGNORE_INDEX as i64).tokens())
}

/// `batch` with each row's global item index as a third column.
fn with_items(batch: &[HostTensor], first: i64) -> Vec<HostTensor> {
    let n = batch[0].shape[0];
    let mut b = batch.to_vec();
    b.push(HostTensor::new(vec![n], HostData::I64((first..first + n as i64).collect())).unwrap());
    b
}

fn accumulator<B: cellgraph::runtime::Backend>(net: WithLossCell, k: usize, opt: impl Optimizer + 'static) -> cellgraph::runtime::Accumulator<B> {
    accumulator_in::<B>(net, k, opt, false)
}

/// [`accumulator`], computing in f64 when `wide`.
fn accumulator_in<B: cellgraph::runtime::Backend>(
    net: WithLossCell,
    k: usize,
    opt: impl Optimizer + 'static,
    wide: bool,
) -> cellgraph::runtime::Accumulator<B> {
    let net = GradAccumulation::new(net, k).normalization(Normalization::Tokens);
    let new = if wide { cellgraph::runtime::Accumulator::<B>::new_f64 } else { cellgraph::runtime::Accumulator::<B>::new };
    let mut a = new(std::rc::Rc::new(net), std::rc::Rc::new(opt), Default::default(), 3).unwrap();
    a.set_input_names(&["ids", "labels", "item_index"]);
    a
}

fn params_in<B: cellgraph::runtime::Backend>(a: &cellgraph::runtime::Accumulator<B>) -> BTreeMap<String, Vec<f32>> {
    gpt().parameters().iter().map(|p| (p.name.clone(), a.session().param(&p.name).unwrap().to_f32())).collect()
}

/// Dropout's masks follow the items, not where they land: 4 micro-batches equal one large
/// batch (10 AdamW updates, f64, within 1e-6) with dropout on, and the dropout does drop (the
/// same run without it ends elsewhere); 2 ranks, each with its half of every batch and the
/// items' global indices, equal one process (f32, momentum, 1e-6), while keying by each rank's
/// own count of items (no item column) does not.
#[test]
fn dropout_masks_follow_items_across_micro_batches_and_ranks() {
    let mut rng = StdRng::seed_from_u64(12);
    let batches: Vec<Vec<HostTensor>> = (0..10).map(|u| with_items(&sequences(&mut rng, 8), 8 * u)).collect();
    let run = |net: WithLossCell, k: usize| {
        let mut a = accumulator_in::<Cpu>(net, k, adamw(), true);
        for b in &batches {
            a.step(b, Place::Regular).unwrap();
        }
        params_in(&a)
    };
    let (micro, large) = (run(dropped(), 4), run(dropped(), 1));
    let d = rel_diff(&micro, &large);
    assert!(d < 1e-6, "dropout under 4 micro-batches vs one batch: {d}");
    let plain = run(counted(), 1);
    assert!(rel_diff(&plain, &large) > 1e-3, "dropout 0.3 changed nothing");

    // Two ranks: rank r takes rows 4r..4r+4 of every 8-row batch (with their item indices).
    let halves: Vec<Vec<Vec<HostTensor>>> = (0..2)
        .map(|r| batches.iter().map(|b| b.iter().map(|t| cellgraph::runtime::accumulate::slice_rows(t, 4 * r, 4 * r + 4)).collect()).collect())
        .collect();
    for keyed in [true, false] {
        let halves = halves.clone();
        let ranks = run_ranks(2, move |r, comm| {
            let mut a = accumulator::<Cpu>(dropped(), 2, Momentum::new(0.1, 0.9));
            if !keyed {
                a.set_input_names(&["ids", "labels"]);
            }
            a.set_parallel(comm, false, false).unwrap();
            for b in &halves[r] {
                let b = if keyed { b.clone() } else { b[..2].to_vec() };
                a.step(&b, Place::Regular).unwrap();
            }
            params_in(&a)
        });
        let mut one = accumulator::<Cpu>(dropped(), 1, Momentum::new(0.1, 0.9));
        for b in &batches {
            one.step(b, Place::Regular).unwrap();
        }
        let d = rel_diff(&ranks[0], &params_in(&one));
        if keyed {
            assert!(d < 1e-6, "2 ranks with item keys vs one process: {d}");
        } else {
            assert!(d > 1e-4, "per-rank item counts should give other masks, got {d}");
        }
    }
}

/// About `p` of the elements are dropped, the rest scaled by `1 / (1 - p)`; an inference trace
/// has no dropout at all.
#[test]
fn dropout_drops_p_and_is_the_identity_in_inference() {
    let mut g = Graph::new("d");
    let x = g.add_leaf(Op::Parameter { name: "x".into() }, TensorType::f32([100, 1000]), "t").unwrap();
    let items = g.add_leaf(Op::Input { index: 0, name: "item_index".into() }, TensorType::new(DType::I64, [100]), "t").unwrap();
    let upd = g.add_leaf(Op::Input { index: 1, name: "update".into() }, TensorType::new(DType::I64, Shape::scalar()), "t").unwrap();
    let y = g.add(Op::Dropout { p: 0.2, seed: 4 }, &[x, items, upd], "t").unwrap();
    g.set_outputs(vec![y]);
    let mut s = Session::<Cpu>::new(cpu());
    s.set_param("x", &HostTensor::f32(vec![100, 1000], vec![1.0; 100_000]).unwrap());
    let exe = compile(g).unwrap();
    let run = |s: &mut Session<Cpu>, first: i64, update: i64| {
        let items = HostTensor::new(vec![100], HostData::I64((first..first + 100).collect())).unwrap();
        s.run(&exe, &[items, HostTensor::new(vec![], HostData::I64(vec![update])).unwrap()]).unwrap().remove(0).to_f32()
    };
    let y = run(&mut s, 0, 0);
    let rate = y.iter().filter(|&&v| v == 0.0).count() as f64 / y.len() as f64;
    assert!((rate - 0.2).abs() < 0.01, "dropped {rate}");
    assert!(y.iter().all(|&v| v == 0.0 || v == 1.25));
    assert_ne!(y, run(&mut s, 0, 1), "another update, another mask");
    assert_ne!(y, run(&mut s, 100, 0), "other items, other masks");
    assert_eq!(y, run(&mut s, 0, 0), "the same keys, the same mask");
    let (g, _) =
        cellgraph::cells::cell::trace_inference(&dropped(), "eval", &[("ids", TensorType::i32([2, T])), ("labels", TensorType::i32([2, T]))])
            .unwrap();
    assert!(!print(&g).contains("dropout") && !print(&g).contains("item_index"));
}

/// Ranks whose padded sequences have different lengths (variable-length items: each batch is
/// padded to its own longest) train together: the start-up check compares the network traced
/// on the smallest extents of any rank, and every rank ends with the same parameters.
#[test]
fn ranks_with_different_sequence_lengths_train_together() {
    let mut rng = StdRng::seed_from_u64(21);
    let data: Vec<Vec<HostTensor>> = [T, T - 2]
        .iter()
        .map(|&t| {
            let full = sequences(&mut rng, 8);
            full.iter()
                .map(|c| HostTensor::i32(vec![8, t], c.to_f64().chunks(T).flat_map(|r| r[..t].to_vec()).map(|v| v as i32).collect()).unwrap())
                .collect()
        })
        .collect();
    let ranks = run_ranks(2, move |r, comm| {
        let net = GradAccumulation::new(counted(), 2).normalization(Normalization::Tokens);
        let mut m = Model::<Cpu>::parallel(AutoParallel::new(net), adamw(), cpu(), 3, comm).unwrap();
        m.train(1, &TensorDataset { columns: data[r].clone(), batch_size: 4 }, &mut []).map(|_| params(&m)).map_err(|e| e.to_string())
    });
    let (a, b) = (ranks[0].as_ref().unwrap(), ranks[1].as_ref().unwrap());
    assert_eq!(a, b, "every rank holds the same parameters");
}

/// Fine-tuning's boundary (token-weighted, AdamW, clipping by global norm, as `cellgraph
/// finetune` runs it): on the CPU one pass per parameter after the clip graph gives the bits
/// of the optimizer and clear graphs, in f32 and in bf16, with a clip that never bites and
/// one that bites every window: the embedding (tied to the head), the layer norms, the
/// attention's and the MLP's matrices and biases, 3 windows of 4 micro-batches.
#[test]
fn the_fine_tuning_boundary_in_one_pass_equals_the_graphs_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(12);
    let batches: Vec<Vec<HostTensor>> = (0..12).map(|_| sequences(&mut rng, 2)).collect();
    for precision in [None, Some(Precision::bf16())] {
        let mut ends = Vec::new();
        for clip in [1e30, 1e-2] {
            let run = |one_pass: bool| {
                let net = WithLossCell::new(gpt(), CrossEntropyLoss::new().ignore_index(IGNORE_INDEX as i64).tokens());
                let net = GradAccumulation::across_steps(net, 4).normalization(Normalization::Tokens).clip_global_norm(clip);
                let net = match precision {
                    Some(p) => net.precision(p),
                    None => net,
                };
                let mut a = cellgraph::runtime::Accumulator::<Cpu>::new(std::rc::Rc::new(net), std::rc::Rc::new(adamw()), cpu(), 3).unwrap();
                a.set_one_pass_boundary(one_pass);
                for b in &batches {
                    a.step(b, Place::Regular).unwrap();
                }
                assert_eq!((a.updates(), a.counters().host_boundaries), (3, if one_pass { 3 } else { 0 }));
                params_in(&a)
            };
            let (one_pass, graphs) = (run(true), run(false));
            for (name, v) in &one_pass {
                assert!(
                    v.iter().map(|x| x.to_bits()).eq(graphs[name].iter().map(|x| x.to_bits())),
                    "{precision:?}, clip {clip}: `{name}` differs from the graphs'"
                );
            }
            ends.push(one_pass);
        }
        assert_ne!(ends[0], ends[1], "{precision:?}: the clip at 1e-2 bites");
    }
}

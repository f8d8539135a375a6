//! `Model`: MindSpore's high-level training API over a GradAccumulation network.
//!
//! `Model::new(net, optimizer)` trains `net` with `train(epochs, dataset, callbacks)` and
//! evaluates its backbone with `eval(dataset)`. One train step is one batch from the dataset:
//! with in-step slicing (`GradAccumulation::new`) that is one optimizer update; with
//! accumulation across steps (`across_steps`, `boost`) it is one micro-step, as in MindSpore's
//! boost mode. At the end of each epoch an incomplete window is applied with its true count
//! (or dropped, if the network asks), as Accelerate's `sync_with_dataloader` does.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use crate::Backend;
use burn_backend::tensor::Device;
use cellgraph_cells::{AutoParallel, Cell, GradAccumulation, Optimizer};
use cellgraph_compiler::{HostTensor, TensorType};

use crate::accumulate::{Accumulator, Place};
use crate::callback::{snapshot_at, Callback, Position, RunContext};
use crate::checkpoint;
use crate::comm::Communicator;
use crate::data::Dataset;
use crate::error::{Result, RuntimeError};
use crate::exec::{compile_with, DumpAt, Executable};

/// Batches an epoch's data thread makes ahead of training.
const PREFETCH: usize = 4;

/// Metrics `eval` can compute (MindSpore's `metrics={"Accuracy": Accuracy()}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    /// Fraction of items whose largest logit is the label (items labelled below 0, ignored
    /// padding, do not count).
    Accuracy,
    /// The network's loss in inference mode, averaged over the items: over the tokens it
    /// counts, for a loss that counts them (`CrossEntropyLoss::tokens()`), else each batch's
    /// (mean) loss weighted by its size.
    Loss,
}

/// Trains and evaluates one network on one device.
pub struct Model<B: Backend> {
    acc: Accumulator<B>,
    metrics: Vec<Metric>,
    eval_plans: HashMap<(Metric, Vec<TensorType>), Executable>,
    position: Position,
}

impl<B: Backend> Model<B> {
    /// A model training `network` with `optimizer`; parameters are drawn from `seed`.
    pub fn new(network: GradAccumulation, optimizer: impl Optimizer + 'static, device: Device<B>, seed: u64) -> Result<Self> {
        let acc = Accumulator::new(Rc::new(network), Rc::new(optimizer), device, seed)?;
        Ok(Self::of(acc))
    }

    /// [`Self::new`] computing in f64 (host backends: reference runs).
    pub fn new_f64(network: GradAccumulation, optimizer: impl Optimizer + 'static, device: Device<B>, seed: u64) -> Result<Self> {
        Ok(Self::of(Accumulator::new_f64(Rc::new(network), Rc::new(optimizer), device, seed)?))
    }

    /// A model starting from `params`, a pretrained checkpoint (MindSpore's `Model` after
    /// `load_param_into_net(net, params, strict_load)`; Hugging Face's `from_pretrained`): the
    /// same values as [`Self::new`] followed by [`Self::restore_with`], without drawing the
    /// parameters `params` replaces first and without copying its tensors (see
    /// [`Accumulator::pretrained`]).
    pub fn pretrained(
        network: GradAccumulation,
        optimizer: impl Optimizer + 'static,
        device: Device<B>,
        seed: u64,
        params: checkpoint::Tensors,
        strict: bool,
    ) -> Result<(Self, crate::LoadReport)> {
        let position = saved_position(&params);
        let (acc, report) = Accumulator::pretrained(Rc::new(network), Rc::new(optimizer), device, seed, params, strict)?;
        let mut model = Self::of(acc);
        model.position = position.unwrap_or_default();
        Ok((model, report))
    }

    /// [`Self::parallel`] from a pretrained checkpoint (see [`Self::pretrained`]): every rank
    /// loads the same `params`, and the ranks check they agree on them.
    pub fn parallel_pretrained(
        network: AutoParallel,
        optimizer: impl Optimizer + 'static,
        device: Device<B>,
        seed: u64,
        comm: Arc<dyn Communicator>,
        (params, strict): (checkpoint::Tensors, bool),
    ) -> Result<(Self, crate::LoadReport)> {
        let AutoParallel { network, hsdp, gradients_mean } = network;
        let (mut model, report) = Self::pretrained(network, optimizer, device, seed, params, strict)?;
        model.acc.set_parallel(comm, gradients_mean, hsdp)?;
        Ok((model, report))
    }

    fn of(acc: Accumulator<B>) -> Self {
        Model { acc, metrics: vec![Metric::Accuracy], eval_plans: HashMap::new(), position: Position::default() }
    }

    /// A model training data-parallel over `comm` (MindSpore's `init()` + `AutoParallel(net)`):
    /// every rank runs this with its shard of the data. The ranks check at once that they
    /// agree on the configuration and the initial parameters.
    pub fn parallel(
        network: AutoParallel,
        optimizer: impl Optimizer + 'static,
        device: Device<B>,
        seed: u64,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let AutoParallel { network, hsdp, gradients_mean } = network;
        let mut model = Self::new(network, optimizer, device, seed)?;
        model.acc.set_parallel(comm, gradients_mean, hsdp)?;
        Ok(model)
    }

    /// MindSpore's `save_graphs`: writes every compiled graph after every pass (see
    /// [`cellgraph_compiler::dump`]); multi-rank runs write under `rank_<id>/`.
    pub fn save_graphs(&mut self, opts: cellgraph_compiler::dump::DumpOptions) -> Result<()> {
        self.eval_plans.clear();
        self.acc.save_graphs(opts)
    }

    /// A model without accumulation: one optimizer update per batch.
    pub fn plain(net_with_loss: impl Cell + 'static, optimizer: impl Optimizer + 'static, device: Device<B>, seed: u64) -> Result<Self> {
        Self::new(GradAccumulation::new(net_with_loss, 1), optimizer, device, seed)
    }

    /// Sets the metrics `eval` reports.
    pub fn with_metrics(mut self, metrics: &[Metric]) -> Self {
        self.metrics = metrics.to_vec();
        self
    }

    /// The accumulation driver (session, counters, compiled plans).
    pub fn accumulator(&self) -> &Accumulator<B> {
        &self.acc
    }

    /// Mutable access to the accumulation driver.
    pub fn accumulator_mut(&mut self) -> &mut Accumulator<B> {
        &mut self.acc
    }

    /// Where training stands.
    pub fn position(&self) -> Position {
        self.position
    }

    /// Trains until `epochs` epochs are complete (resuming from the current position).
    pub fn train(&mut self, epochs: usize, dataset: &dyn Dataset, callbacks: &mut [&mut dyn Callback<B>]) -> Result<()> {
        if epochs == 0 {
            return Err(RuntimeError::Invalid {
                what: "Model::train".into(),
                detail: "epoch must be at least 1, got 0 (MindSpore's check_positive_int)".into(),
            });
        }
        let steps_per_epoch = dataset.dataset_size();
        self.acc.set_input_names(&dataset.column_names());
        let sizes = self.check_batches(dataset)?;
        self.check_ranks_agree(dataset, steps_per_epoch)?;
        let mut stop = false;
        while self.position.epoch < epochs && !stop {
            let epoch = self.position.epoch;
            let t0 = Instant::now();
            let mut cx = RunContext::new(epoch + 1, epochs, steps_per_epoch, &self.acc);
            for cb in callbacks.iter_mut() {
                cb.epoch_begin(&mut cx)?;
            }
            // When the process has more than one thread for its kernels (rayon's pool), the
            // epoch's batches are made on a thread of their own, up to PREFETCH ahead; when
            // training stops or fails, the channel closes and that thread ends at its next batch.
            // Otherwise (one core, or one thread per rank under mpirun, where a data thread per
            // rank would only compete with the other ranks) they are made in turn with the steps.
            std::thread::scope(|s| -> Result<()> {
                let skip = self.position.step;
                let batches: Box<dyn Iterator<Item = Vec<HostTensor>>> = if rayon::current_num_threads() > 1 {
                    let (tx, rx) = std::sync::mpsc::sync_channel(PREFETCH);
                    s.spawn(move || {
                        for batch in dataset.batches(epoch, skip) {
                            if tx.send(batch).is_err() {
                                break;
                            }
                        }
                    });
                    Box::new(rx.into_iter())
                } else {
                    dataset.batches(epoch, skip)
                };
                for batch in batches {
                    // A short last batch may be sliced into unequal micro-batches.
                    let last = self.position.step + 1 == steps_per_epoch && sizes[self.position.step] < sizes[0];
                    // The loss stays on a device until a callback asks for it (`RunContext::loss`).
                    let applied = self.acc.step(&batch, if last { Place::LastOfEpoch } else { Place::Regular })?;
                    self.position.step += 1;
                    let mut cx = RunContext::new(epoch + 1, epochs, steps_per_epoch, &self.acc);
                    cx.step = self.position.step;
                    cx.applied = applied;
                    cx.position = self.position;
                    for cb in callbacks.iter_mut() {
                        cb.step_end(&mut cx)?;
                    }
                    if cx.stop_requested {
                        stop = true;
                        break;
                    }
                }
                Ok(())
            })?;
            if stop {
                break;
            }
            self.acc.finish()?;
            self.position = Position { epoch: epoch + 1, step: 0 };
            let mut cx = RunContext::new(epoch + 1, epochs, steps_per_epoch, &self.acc);
            cx.position = self.position;
            cx.step = steps_per_epoch;
            cx.epoch_seconds = t0.elapsed().as_secs_f64();
            for cb in callbacks.iter_mut() {
                cb.epoch_end(&mut cx)?;
            }
        }
        Ok(())
    }

    /// Everything about the data that could fail later, checked before the first step: at
    /// least one batch; the batch size not larger than the data; with in-step slicing, every
    /// batch but a short last one divisible by `micro_size`. Returns the batch sizes.
    fn check_batches(&self, dataset: &dyn Dataset) -> Result<Vec<usize>> {
        let rank = match self.acc.communicator() {
            Some(c) => format!("rank {} of {}: ", c.rank(), c.size()),
            None => String::new(),
        };
        let sizes = dataset.batch_sizes();
        let wanted = dataset.batch_size();
        let fail = |detail: String| Err(RuntimeError::Invalid { what: format!("{rank}{}", dataset.describe()), detail });
        if sizes.is_empty() || sizes.iter().all(|&b| b == 0) {
            return fail(format!(
                "gives no batch per epoch (batch size {wanted}): it has fewer items than one batch, or none; use a smaller batch size or more data"
            ));
        }
        if sizes.len() == 1 && sizes[0] < wanted {
            return fail(format!("holds {} items, fewer than one batch of {wanted}; use a batch size of at most {}", sizes[0], sizes[0]));
        }
        let net = self.acc.network();
        net.check()?;
        if net.slicing == cellgraph_cells::Slicing::InStep {
            let k = net.micro_size;
            let last = sizes.len() - 1;
            if let Some((i, &b)) = sizes.iter().enumerate().find(|&(i, &b)| b % k != 0 && !(i == last && b < sizes[0])) {
                let (lo, hi) = ((b / k).max(1) * k, (b / k + 1) * k);
                return fail(format!(
                    "batch {} of each epoch has {b} items, which GradAccumulation cannot slice into micro_size = {k} equal micro-batches; use a batch size that is a multiple of {k} (such as {lo} or {hi}) or another micro_size",
                    i + 1
                ));
            }
        }
        Ok(sizes)
    }

    /// Data parallel: every rank must take the same number of steps and run the same network.
    /// The micro-step graph is compared as traced on micro-batches of the smallest first
    /// micro-batch of any rank, so ranks may bring batches of different sizes (one item would
    /// not do: batch norm refuses a micro-batch with one value per channel), and on the
    /// smallest extents of any rank along the other axes (padded sequences of different
    /// lengths).
    fn check_ranks_agree(&self, dataset: &dyn Dataset, steps_per_epoch: usize) -> Result<()> {
        let Some(comm) = self.acc.communicator() else { return Ok(()) };
        let what = format!("number of batches per epoch (this rank has {steps_per_epoch}; shard the dataset with shard(size, rank))");
        crate::comm::agree(comm.as_ref(), &what, &(steps_per_epoch as u64).to_le_bytes())?;
        let Some(first) = dataset.batches(0, 0).next() else { return Ok(()) };
        let net = self.acc.network();
        let b = first.first().and_then(|t| t.shape.first().copied()).unwrap_or(1);
        let rows = match net.slicing {
            cellgraph_cells::Slicing::InStep => (b / net.micro_size).max(1),
            cellgraph_cells::Slicing::AcrossSteps => b,
        };
        // Every extent of every column, the first of each replaced by the micro-batch's rows;
        // the ranks' layouts (columns and ranks) must agree before their extents are compared.
        let layout: Vec<u8> = first.iter().flat_map(|t| [t.shape.len() as u8, t.ty().dtype as u8]).collect();
        crate::comm::agree(comm.as_ref(), "data layout (columns, their ranks and dtypes)", &layout)?;
        let mine: Vec<u64> = first.iter().flat_map(|t| t.shape.iter().enumerate().map(move |(i, &d)| if i == 0 { rows } else { d } as u64)).collect();
        let bytes: Vec<u8> = mine.iter().flat_map(|d| d.to_le_bytes()).collect();
        let mut all = vec![0u8; bytes.len() * comm.size()];
        comm.all_gather_bytes(&bytes, &mut all);
        let least: Vec<usize> = (0..mine.len())
            .map(|k| {
                all.chunks(bytes.len()).map(|r| u64::from_le_bytes(r[8 * k..8 * k + 8].try_into().expect("8 bytes"))).min().unwrap_or(1) as usize
            })
            .collect();
        let mut at = least.into_iter();
        let traced: Vec<TensorType> = first
            .iter()
            .map(|t| TensorType::new(t.ty().dtype, cellgraph_compiler::Shape(t.shape.iter().map(|_| at.next().unwrap_or(1)).collect())))
            .collect();
        let inputs = self.acc.named_inputs(&self.acc.network_inputs(&traced));
        let (_, micro) = self.acc.network().traced_micro_step(&inputs)?;
        crate::comm::agree(comm.as_ref(), "network (its micro-step graph)", cellgraph_compiler::print(&micro).as_bytes())
    }

    /// Evaluates on every batch: `{"Accuracy": ...}` from the backbone's logits, `{"Loss": ...}`
    /// from the network with its loss (see [`Metric`]), in inference mode.
    pub fn eval(&mut self, dataset: &dyn Dataset) -> Result<BTreeMap<String, f64>> {
        if dataset.dataset_size() == 0 {
            return Err(RuntimeError::Invalid {
                what: dataset.describe(),
                detail: "has no batch to evaluate (no items, or fewer than one batch with drop_remainder); an accuracy over nothing is not a number"
                    .into(),
            });
        }
        let (accuracy, loss) = (self.metrics.contains(&Metric::Accuracy), self.metrics.contains(&Metric::Loss));
        let items = crate::accumulate::item_column(&dataset.column_names());
        let (mut correct, mut total) = (0usize, 0usize);
        let (mut loss_sum, mut loss_items) = (0.0f64, 0.0f64);
        for batch in dataset.batches(0, 0) {
            let batch = crate::accumulate::without_column(&batch, items);
            if accuracy {
                let logits = self.run_eval(Metric::Accuracy, &batch)?.remove(0);
                let labels = batch[1].to_f64();
                let classes = *logits.shape.last().unwrap_or(&1);
                let l = logits.to_f32();
                for (i, &y) in labels.iter().enumerate().filter(|(_, &y)| y >= 0.0) {
                    let row = &l[i * classes..(i + 1) * classes];
                    let arg = row.iter().enumerate().fold(0, |best, (j, &v)| if v > row[best] { j } else { best });
                    correct += (arg as f64 == y) as usize;
                    total += 1;
                }
            }
            if loss {
                let out = self.run_eval(Metric::Loss, &batch)?;
                let items = match out.get(1) {
                    Some(count) => count.scalar(),
                    None => batch[0].shape.first().copied().unwrap_or(1) as f64,
                };
                loss_sum += if out.len() > 1 { out[0].scalar() } else { out[0].scalar() * items };
                loss_items += items;
            }
        }
        let mut out = BTreeMap::new();
        if accuracy {
            out.insert("Accuracy".to_string(), correct as f64 / total.max(1) as f64);
        }
        if loss {
            out.insert("Loss".to_string(), loss_sum / loss_items);
        }
        Ok(out)
    }

    /// Runs the inference plan of `metric` on a batch without its item column (traced and
    /// compiled on first use per input shape): the backbone on the data (accuracy), or the
    /// network with its loss on the whole batch, its outputs the loss and the count a counting
    /// loss reports (loss).
    fn run_eval(&mut self, metric: Metric, batch: &[HostTensor]) -> Result<Vec<HostTensor>> {
        let inputs = if metric == Metric::Loss { batch } else { &batch[..1] };
        let key: (Metric, Vec<TensorType>) = (metric, inputs.iter().map(|t| t.ty()).collect());
        if !self.eval_plans.contains_key(&key) {
            let g = match metric {
                Metric::Accuracy => {
                    let backbone = self.acc.network().backbone().ok_or_else(|| RuntimeError::Mismatch {
                        what: "Model::eval".into(),
                        expected: "a network wrapped with its loss (WithLossCell), whose backbone gives logits".into(),
                        got: format!("a {} without a backbone", self.acc.network().network.kind()),
                    })?;
                    cellgraph_cells::cell::trace_inference(backbone, "eval", &[("data", key.1[0].clone())])?.0
                }
                Metric::Loss => {
                    let mut t = cellgraph_cells::Tracer::inference("eval_loss");
                    let names = self.acc.named_inputs(&key.1);
                    let xs = names.iter().map(|(n, ty)| t.input(n, ty.clone())).collect::<cellgraph_cells::Result<Vec<_>>>()?;
                    let loss = t.call(self.acc.network().network.as_ref(), &xs)?;
                    let outputs = std::iter::once(loss).chain(t.count()).collect();
                    t.finish(outputs)
                }
            };
            let dump = self.acc.dump_options().map(|opts| DumpAt { opts, first: 0, input: "trace" });
            self.eval_plans.insert(key.clone(), compile_with(g, dump)?);
        }
        self.acc.run(&self.eval_plans[&key], inputs)
    }

    /// Everything needed to resume: the accumulator's snapshot and the position.
    pub fn snapshot(&self) -> checkpoint::Tensors {
        snapshot_at(&self.acc, self.position)
    }

    /// Saves a checkpoint (`.ckpt`: MindSpore's format; otherwise native safetensors).
    pub fn save_checkpoint(&self, path: &Path) -> Result<()> {
        checkpoint::save(path, &self.snapshot(), &BTreeMap::new())
    }

    /// Loads a checkpoint written by `save_checkpoint` (resuming where it was taken) or a
    /// MindSpore checkpoint of the network's parameters. Strict: every parameter of the
    /// network must be in it (see [`Accumulator::restore`]).
    pub fn load_checkpoint(&mut self, path: &Path) -> Result<()> {
        self.load_checkpoint_with(path, true).map(|_| ())
    }

    /// [`Self::load_checkpoint`]; `strict = false` is MindSpore's `strict_load=False`: what
    /// was skipped is in the report.
    pub fn load_checkpoint_with(&mut self, path: &Path, strict: bool) -> Result<crate::LoadReport> {
        let (tensors, _) = checkpoint::load(path)?;
        self.restore_with(&tensors, strict).map_err(|e| match e {
            RuntimeError::Invalid { what, detail } if what == "checkpoint" => {
                RuntimeError::Invalid { what: format!("checkpoint {}", path.display()), detail }
            }
            e => e,
        })
    }

    /// Restores from a snapshot (strictly).
    pub fn restore(&mut self, tensors: &checkpoint::Tensors) -> Result<()> {
        self.restore_with(tensors, true).map(|_| ())
    }

    /// Restores from a snapshot, strictly or not.
    pub fn restore_with(&mut self, tensors: &checkpoint::Tensors, strict: bool) -> Result<crate::LoadReport> {
        // The position's scalars are not the accumulator's counters: it passes them over.
        let report = self.acc.restore_with(tensors, strict)?;
        if let Some(p) = saved_position(tensors) {
            self.position = p;
        }
        Ok(report)
    }
}

/// The position a snapshot was taken at (`cellgraph.epoch`, `cellgraph.step`), if it has one.
fn saved_position(tensors: &checkpoint::Tensors) -> Option<Position> {
    let (e, s) = (tensors.get("cellgraph.epoch")?, tensors.get("cellgraph.step")?);
    Some(Position { epoch: e.scalar() as usize, step: s.scalar() as usize })
}

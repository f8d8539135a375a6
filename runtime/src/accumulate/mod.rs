//! Running a [`GradAccumulation`] network: micro-steps, window boundaries, counters.
//!
//! The [`Accumulator`] owns the compiled `micro_step` graphs (one per micro-batch shape, so a
//! short last batch just compiles another), the `optimizer` and `clear` graphs, and a
//! [`Session`] holding parameters, accumulators and optimizer state. A window ends after
//! `micro_size` micro-batches: the optimizer runs once with the window's normalisation scale
//! and its update number (for the learning-rate schedule), then clear runs once.
//!
//! Its parts, one job each:
//! - [`window`]: where accumulation stands (the open window, updates, run counters and the
//!   one table of those a checkpoint stores), the normalisation scale and clipping;
//! - [`store`]: the trained parameters' buffers by typed slot, flat host copies of them, and
//!   the flat device buffers behind them;
//! - [`sync`]: data parallelism across ranks, replicated or sharded (hsdp);
//! - [`snapshot`]: checkpoints, saved and restored.

mod snapshot;
mod store;
mod sync;
mod window;

use std::borrow::Cow;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use burn_backend::tensor::Device;
use cellgraph_cells::cell::{ITEM_INDEX, UPDATE};
use cellgraph_cells::{Cell, GradAccumulation, Normalization, Optimizer, Slicing};
use cellgraph_compiler::autodiff::SENS;
use cellgraph_compiler::dump::DumpOptions;
use cellgraph_compiler::passes::grad_accumulation::ACCUMULATOR_PREFIX;
use cellgraph_compiler::{HostData, HostTensor, TensorType};

use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::exec::{compile, compile_with, DumpAt, Executable, Session};
use crate::value::Value;
use crate::Backend;

use cellgraph_compiler::passes::grad_accumulation::accumulator_name;
pub use snapshot::LoadReport;
pub use sync::SHARD;
pub use window::Counters;
use window::{finite, Ended, Scaler};

use store::{Kind, Store};
use sync::Parallel;
use window::{scale, Progress};

/// What one call to [`Accumulator::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// The step's loss: the sum of its micro losses (in-step slicing) or the micro loss.
    pub loss: f64,
    /// True when this step ended a window and the optimizer ran.
    pub applied: bool,
}

/// The compiled graphs, and how they are named and dumped.
struct Plans {
    /// One `micro_step` per micro-batch shape.
    micro: HashMap<Vec<TensorType>, Executable>,
    optimizer: Executable,
    clear: Executable,
    /// The cells' once-per-window state updates (`window_stats`), traced with the first
    /// micro-step: `Some(None)` when there are none.
    window: Option<Option<Executable>>,
    /// Names of the micro-step graphs' inputs.
    names: Vec<String>,
    /// Graph dumps, when switched on.
    dump: Option<DumpOptions>,
}

/// Drives one GradAccumulation network on one device.
pub struct Accumulator<B: Backend> {
    net: Rc<GradAccumulation>,
    opt: Rc<dyn Optimizer>,
    plans: Plans,
    /// Parameters, accumulators and optimizer state.
    pub session: Session<B>,
    progress: Progress,
    store: Store<B>,
    parallel: Option<Parallel>,
    /// The last step's micro-batch losses, left on the device until read ([`Self::step_loss`]),
    /// and their sum once read.
    losses: Vec<Loss<B>>,
    loss: std::cell::Cell<Option<f64>>,
    /// Under token-weighted normalisation, the last step's token count (its loss is the mean
    /// over them), as far as it has been read ([`Self::counts`] holds the rest).
    tokens: f64,
    /// Token counts of micro-steps run on a device, not yet read back (each a sync): read
    /// together at the window's boundary, or with the step's loss. `true`: of the last step.
    counts: Vec<(Value<B>, bool)>,
    /// Items this process has trained on: dropout's item keys when the data gives none.
    items_seen: u64,
    /// Dynamic loss scaling, when the precision policy asks for it.
    scaler: Option<Scaler>,
}

/// A micro-batch's loss: read (host backends read it at once, at no cost), or on the device.
enum Loss<B: Backend> {
    Read(f64),
    Device(Value<B>),
}

/// The optimizer graph's inputs: the gradient scale, then the rule's host scalars.
fn optimizer_inputs(scale: f64, scalars: &[f64]) -> Vec<HostTensor> {
    std::iter::once(scale).chain(scalars.iter().copied()).map(HostTensor::scalar_f32).collect()
}

/// Device scalars (losses, token counts) as f64, in one read: gathered on the device first.
fn read_scalars<B: Backend>(vals: Vec<Value<B>>) -> Vec<f64> {
    match vals.len() {
        0 => Vec::new(),
        1 => vals[0].to_host().to_f64(),
        _ => {
            let floats: Option<Vec<_>> = vals.iter().map(|v| if let Value::Float(t) = v { Some(t.clone()) } else { None }).collect();
            match floats {
                Some(ts) => Value::<B>::Float(B::float_cat(ts, 0)).to_host().to_f64(),
                None => vals.iter().flat_map(|v| v.to_host().to_f64()).collect(),
            }
        }
    }
}

/// The position of the [`ITEM_INDEX`] column among a dataset's column `names`, if any.
pub fn item_column<S: AsRef<str>>(names: &[S]) -> Option<usize> {
    names.iter().position(|n| n.as_ref() == ITEM_INDEX)
}

/// `batch` without column `k` (all of it when `k` is `None`).
pub fn without_column<T: Clone>(batch: &[T], k: Option<usize>) -> Vec<T> {
    batch.iter().enumerate().filter(|&(i, _)| Some(i) != k).map(|(_, t)| t.clone()).collect()
}

/// `items` rows split into `min(k, items)` contiguous ranges whose sizes differ by at most one,
/// larger first: equal micro-batches when `k` divides `items`.
pub fn micro_ranges(items: usize, k: usize) -> Vec<(usize, usize)> {
    let n = k.min(items).max(1);
    let (q, r) = (items / n, items % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = q + usize::from(i < r);
            start += len;
            (start - len, start)
        })
        .collect()
}

/// Rows `start..end` (along dim 0) of a host tensor.
pub fn slice_rows(t: &HostTensor, start: usize, end: usize) -> HostTensor {
    let row: usize = t.shape[1..].iter().product();
    let (a, b) = (start * row, end * row);
    let data = match &t.data {
        HostData::F32(v) => HostData::F32(v[a..b].to_vec()),
        HostData::F64(v) => HostData::F64(v[a..b].to_vec()),
        HostData::I32(v) => HostData::I32(v[a..b].to_vec()),
        HostData::I64(v) => HostData::I64(v[a..b].to_vec()),
        HostData::Bool(v) => HostData::Bool(v[a..b].to_vec()),
    };
    let mut shape = t.shape.clone();
    shape[0] = end - start;
    HostTensor { shape, data }
}

impl<B: Backend> Accumulator<B> {
    /// Compiles the boundary graphs of `net` and fills a new session on `device`: parameters
    /// drawn from `seed`, zero accumulators, initial optimizer state. Micro-step graphs are
    /// compiled on first use, one per micro-batch shape.
    pub fn new(net: Rc<GradAccumulation>, opt: Rc<dyn Optimizer>, device: Device<B>, seed: u64) -> Result<Self> {
        Self::with_session(net, opt, Session::new(device), seed)
    }

    /// [`Self::new`] computing in f64 (host backends: the reference runs of the tests).
    pub fn new_f64(net: Rc<GradAccumulation>, opt: Rc<dyn Optimizer>, device: Device<B>, seed: u64) -> Result<Self> {
        Self::with_session(net, opt, Session::new_f64(device), seed)
    }

    fn with_session(net: Rc<GradAccumulation>, opt: Rc<dyn Optimizer>, mut session: Session<B>, seed: u64) -> Result<Self> {
        net.check()?;
        opt.check().map_err(|detail| cellgraph_cells::CellError::Config { cell: opt.name().into(), detail })?;
        let (optimizer, clear, accumulators, state) = net.boundary_graphs(opt.as_ref())?;
        session.init_params(&net.parameters(), seed);
        for (name, ty) in &accumulators {
            session.set_param(name, &HostTensor::full(ty, 0.0));
        }
        session.init_state(&state);
        let trained: Vec<(String, TensorType)> =
            accumulators.iter().map(|(n, t)| (n[ACCUMULATOR_PREFIX.len() + 1..].to_string(), t.clone())).collect();
        let store = Store::new(&trained, accumulator_name, opt.as_ref());
        let plans =
            Plans { micro: HashMap::new(), optimizer: compile(optimizer)?, clear: compile(clear)?, window: None, names: Vec::new(), dump: None };
        let mut acc = Accumulator {
            net,
            opt,
            plans,
            session,
            progress: Progress::default(),
            store,
            parallel: None,
            losses: Vec::new(),
            loss: std::cell::Cell::new(None),
            tokens: 0.0,
            counts: Vec::new(),
            items_seen: 0,
            scaler: None,
        };
        acc.scaler = acc.net.precision.and_then(|p| p.scaling()).map(Scaler::new);
        acc.store.enter_flat(&mut acc.session, acc.opt.as_ref())?;
        Ok(acc)
    }

    /// Names the inputs of micro-step graphs (default `input0`, `input1`, ...), as they appear
    /// in dumps.
    pub fn set_input_names(&mut self, names: &[&str]) {
        self.plans.names = names.iter().map(|n| n.to_string()).collect();
    }

    /// Names input types as micro-step graphs name their inputs (see [`Self::set_input_names`]).
    pub fn named_inputs(&self, types: &[TensorType]) -> Vec<(String, TensorType)> {
        types.iter().enumerate().map(|(i, t)| (self.plans.names.get(i).cloned().unwrap_or_else(|| format!("input{i}")), t.clone())).collect()
    }

    /// Writes every graph after every compiler pass to `opts.dir` (under `rank_<id>/` when
    /// data-parallel over several ranks): the optimizer and clear graphs at once, each
    /// micro-step graph (with the traced forward graph it came from) when it is compiled.
    pub fn save_graphs(&mut self, opts: DumpOptions) -> Result<()> {
        let opts = match &self.parallel {
            Some(p) if p.comm.size() > 1 => opts.for_rank(p.comm.rank()),
            _ => opts,
        };
        let at = DumpAt { opts: &opts, first: 1, input: "grad_accumulation" };
        self.plans.clear = compile_with(self.plans.clear.source().clone(), Some(at))?;
        // The optimizer graph that runs: this rank's shard under hsdp, else the whole one.
        match self.parallel.as_mut().and_then(|p| p.shard.as_mut()) {
            Some(sh) => sh.optimizer = compile_with(sh.optimizer.source().clone(), Some(at))?,
            None => self.plans.optimizer = compile_with(self.plans.optimizer.source().clone(), Some(at))?,
        }
        self.plans.micro.clear();
        self.plans.dump = Some(opts);
        Ok(())
    }

    /// The dump options in force (with the rank directory applied).
    pub fn dump_options(&self) -> Option<&DumpOptions> {
        self.plans.dump.as_ref()
    }

    /// The communicator, when training data-parallel.
    pub fn communicator(&self) -> Option<&Arc<dyn Communicator>> {
        self.parallel.as_ref().map(|p| &p.comm)
    }

    /// This process's rank (0 without data parallelism).
    pub fn rank(&self) -> usize {
        self.parallel.as_ref().map_or(0, |p| p.comm.rank())
    }

    /// Elements of the optimizer state this rank holds (all of it, unless hsdp).
    pub fn optimizer_state_elements(&self) -> usize {
        let state = |n: &str| n != SHARD && !n.starts_with(ACCUMULATOR_PREFIX) && !self.store.params().any(|t| t == n);
        self.session.param_names().iter().filter(|n| state(n)).map(|n| self.session.param_shape(n).map_or(0, |s| s.iter().product::<usize>())).sum()
    }

    /// The wrapped network.
    pub fn network(&self) -> &GradAccumulation {
        &self.net
    }

    /// The graphs' run counts.
    pub fn counters(&self) -> Counters {
        self.progress.counters
    }

    /// Optimizer updates applied so far.
    pub fn updates(&self) -> u64 {
        self.progress.updates
    }

    /// Micro-batches accumulated in the open window.
    pub fn window_len(&self) -> usize {
        self.progress.micro as usize
    }

    /// The compiled micro-step for a first micro-batch of the given shapes (for dumps).
    pub fn micro_plans(&self) -> impl Iterator<Item = &Executable> {
        self.plans.micro.values()
    }

    /// The compiled optimizer and clear plans.
    pub fn boundary_plans(&self) -> (&Executable, &Executable) {
        (&self.plans.optimizer, &self.plans.clear)
    }

    /// One training step. In-step slicing: the batch is split into `micro_size` equal
    /// micro-batches (a size `micro_size` does not divide is an error, as in MindSpore) and the
    /// window applied; the loss is their sum. Across steps: the batch is one micro-batch, and
    /// the window is applied when it is full.
    pub fn step(&mut self, batch: &[HostTensor]) -> Result<StepOutcome> {
        let applied = self.advance(batch)?;
        Ok(StepOutcome { loss: self.step_loss(), applied })
    }

    /// [`Self::step`] without reading the loss back: on a device backend nothing waits for the
    /// device, which runs the step while the host prepares the next one. The step's loss stays
    /// where it was computed until [`Self::step_loss`] asks for it. Returns whether the step
    /// ended a window.
    pub fn advance(&mut self, batch: &[HostTensor]) -> Result<bool> {
        let b = batch.first().and_then(|t| t.shape.first().copied()).unwrap_or(0);
        if self.net.slicing == Slicing::InStep {
            self.net.check_batch(b)?;
        }
        self.step_split(batch, b)
    }

    /// The last step's loss: the sum of its micro-batches' losses (each as the network computed
    /// it, added in f64), NaN before the first step; under token-weighted normalisation, that
    /// sum divided by the step's tokens (the mean loss per token; 0, the empty sum, without a
    /// token). On a device backend the first call after a
    /// step reads the losses back (one read: the device finishes the step's work first).
    pub fn step_loss(&self) -> f64 {
        if let Some(l) = self.loss.get() {
            return l;
        }
        let on_device: Vec<_> =
            self.losses.iter().filter_map(|l| if let Loss::Device(Value::Float(t)) = l { Some(t.clone()) } else { None }).collect();
        let losses = on_device.len();
        // One read for all of the step's device losses and unread token counts.
        let counts = self.counts.iter().filter(|c| c.1).map(|c| c.0.clone());
        let mut read = read_scalars::<B>(on_device.into_iter().map(Value::Float).chain(counts).collect()).into_iter();
        let tokens = self.tokens + read.clone().skip(losses).sum::<f64>();
        let l = if self.losses.is_empty() {
            f64::NAN
        } else {
            self.losses
                .iter()
                .map(|l| match l {
                    Loss::Read(v) => *v,
                    Loss::Device(Value::Float(_)) => read.next().unwrap_or(f64::NAN),
                    Loss::Device(v) => v.to_host().scalar(),
                })
                .sum()
        };
        let l = if self.net.normalization == Normalization::Tokens && tokens > 0.0 { l / tokens } else { l };
        self.loss.set(Some(l));
        l
    }

    /// The last batch of an epoch, which may be shorter than the others (a dataset without
    /// `drop_remainder`, or a wrapped shard). With in-step slicing a size that `micro_size`
    /// does not divide is split into `min(micro_size, items)` micro-batches whose sizes differ
    /// by at most one, larger first (11 items, `micro_size` 4: 3, 3, 3, 2); the normalisation
    /// counts the micro-batches and items the window really had. Otherwise as [`Self::step`].
    pub fn step_last(&mut self, batch: &[HostTensor]) -> Result<StepOutcome> {
        let applied = self.advance_last(batch)?;
        Ok(StepOutcome { loss: self.step_loss(), applied })
    }

    /// [`Self::step_last`] without reading the loss back (see [`Self::advance`]).
    pub fn advance_last(&mut self, batch: &[HostTensor]) -> Result<bool> {
        let b = batch.first().and_then(|t| t.shape.first().copied()).unwrap_or(0);
        self.step_split(batch, b)
    }

    fn step_split(&mut self, batch: &[HostTensor], b: usize) -> Result<bool> {
        let k = self.net.micro_size;
        if b == 0 {
            return Err(RuntimeError::Mismatch { what: "training batch".into(), expected: "at least one item".into(), got: "an empty batch".into() });
        }
        self.forget_losses();
        match self.net.slicing {
            Slicing::InStep => {
                for (start, end) in micro_ranges(b, k) {
                    let micro: Vec<HostTensor> = batch.iter().map(|t| slice_rows(t, start, end)).collect();
                    self.run_micro(&micro)?;
                }
                self.apply()?;
                Ok(true)
            }
            Slicing::AcrossSteps => {
                self.run_micro(batch)?;
                let applied = self.progress.micro == k as u64;
                if applied {
                    self.apply()?;
                }
                Ok(applied)
            }
        }
    }

    /// At the end of the data: an incomplete window is applied with its true counts, or
    /// dropped (accumulators cleared, no update) when the network asks for that. Returns
    /// whether an update was applied.
    pub fn finish(&mut self) -> Result<bool> {
        if self.progress.micro == 0 {
            return Ok(false);
        }
        if self.net.drop_incomplete_window {
            self.clear_window(false)?;
            return Ok(false);
        }
        self.apply()?;
        Ok(true)
    }

    /// Runs one micro-batch: forward, backward, gradients added into the accumulators.
    /// Returns its loss (read back: see [`Self::advance`] for steps that do not wait for it).
    pub fn micro_step(&mut self, inputs: &[HostTensor]) -> Result<f64> {
        self.forget_losses();
        self.run_micro(inputs)?;
        Ok(self.step_loss())
    }

    /// Drops the last step's losses; those on the device give their memory back to the
    /// session (the next step's losses are written there).
    fn forget_losses(&mut self) {
        for l in self.losses.drain(..) {
            if let Loss::Device(v) = l {
                self.session.give_back(v);
            }
        }
        self.loss.set(None);
        self.tokens = 0.0;
        for c in &mut self.counts {
            c.1 = false;
        }
    }

    /// Reads the micro-steps' unread token counts ([`Self::counts`]) in one read, adding them to
    /// the window's items (and the last step's tokens).
    fn settle_counts(&mut self) {
        let counts = std::mem::take(&mut self.counts);
        let read = read_scalars::<B>(counts.iter().map(|c| c.0.clone()).collect());
        for ((_, last), c) in counts.into_iter().zip(read) {
            self.progress.items += c as u64;
            if last {
                self.tokens += c;
            }
        }
    }

    /// The window's progress with its unread token counts read (a snapshot's copy).
    fn settled_progress(&self) -> window::Progress {
        let mut p = self.progress;
        p.items += read_scalars::<B>(self.counts.iter().map(|c| c.0.clone()).collect()).into_iter().map(|c| c as u64).sum::<u64>();
        p
    }

    /// The position of the data's [`ITEM_INDEX`] column among the inputs (named by
    /// [`Self::set_input_names`]), if it has one.
    pub fn item_column(&self) -> Option<usize> {
        item_column(&self.plans.names)
    }

    /// A batch without its [`ITEM_INDEX`] column: what the network reads.
    pub fn network_inputs<T: Clone>(&self, batch: &[T]) -> Vec<T> {
        without_column(batch, self.item_column())
    }

    /// Dropout's keys for a micro-batch of `rows` rows, for a plan whose inputs after the
    /// network's are [`ITEM_INDEX`] and [`UPDATE`]: the rows' global item indices (the data's
    /// column, else this process's running count of items) and the update number.
    fn keys(&self, exe: &Executable, given: usize, items: Option<&HostTensor>, rows: usize) -> Result<Vec<HostTensor>> {
        exe.graph()
            .inputs()
            .into_iter()
            .skip(given)
            .map(|(_, _, name)| match name {
                ITEM_INDEX => Ok(match items {
                    Some(t) => HostTensor::new(vec![rows], HostData::I64(t.to_f64().iter().map(|&v| v as i64).collect())).expect("rows"),
                    None => HostTensor::new(vec![rows], HostData::I64((0..rows as i64).map(|i| self.items_seen as i64 + i).collect())).expect("rows"),
                }),
                UPDATE => Ok(HostTensor::new(vec![], HostData::I64(vec![self.progress.updates as i64])).expect("scalar")),
                SENS => Ok(HostTensor::f32(vec![], vec![self.loss_scale().unwrap_or(1.0) as f32]).expect("scalar")),
                other => Err(RuntimeError::Mismatch {
                    what: "micro-step inputs".into(),
                    expected: format!("{given} inputs from the data"),
                    got: format!("an input `{other}` the runtime does not fill"),
                }),
            })
            .collect()
    }

    /// One micro-batch, its loss kept with the step's others.
    fn run_micro(&mut self, batch: &[HostTensor]) -> Result<()> {
        // The network reads the batch as it is, unless it carries its items' indices.
        let column = self.item_column();
        let items = column.and_then(|k| batch.get(k));
        let inputs: Cow<[HostTensor]> = match column {
            Some(k) => Cow::Owned(without_column(batch, Some(k))),
            None => Cow::Borrowed(batch),
        };
        let key: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
        if !self.plans.micro.contains_key(&key) {
            let named = self.named_inputs(&key);
            let (forward, mut g) = self.net.traced_micro_step(&named)?;
            if !self.plans.micro.is_empty() {
                // Another micro-batch shape (a short last batch): its own dump files.
                g.name = format!("micro_step_{}", self.plans.micro.len());
            }
            let exe = match &self.plans.dump {
                Some(d) => {
                    cellgraph_compiler::dump::write(d, 0, "trace", &forward)
                        .map_err(|source| RuntimeError::Io { path: d.dir.display().to_string(), source })?;
                    compile_with(g, Some(DumpAt { opts: d, first: 1, input: "grad_accumulation" }))?
                }
                None => compile(g)?,
            };
            self.plans.micro.insert(key.clone(), exe);
            if self.plans.window.is_none() {
                self.plans.window = Some(self.net.window_graph(&named)?.map(compile).transpose()?);
            }
        }
        let exe = &self.plans.micro[&key];
        let rows = inputs.first().and_then(|t| t.shape.first().copied()).unwrap_or(1);
        // Dropout's keys, when the plan reads them.
        let keys = self.keys(exe, inputs.len(), items, rows)?;
        let inputs: Cow<[HostTensor]> = if keys.is_empty() { inputs } else { Cow::Owned(inputs.iter().cloned().chain(keys).collect()) };
        let inputs = &inputs[..];
        // Collectives inside the step (SyncBatchNorm's statistics) sum over the ranks.
        let comm = self.parallel.as_ref().map(|p| p.comm.as_ref()).filter(|c| c.size() > 1);
        // Under token-weighted normalisation the step's second output is its token count: on
        // a device left there until the window's boundary (or the step's loss) needs it.
        let (loss, count) = if B::HOST {
            let out = self.session.run_over(exe, inputs, comm)?;
            (Loss::Read(out[0].scalar()), out.get(1).map(|c| c.scalar()))
        } else {
            // A plan without collectives replays its captured graph when the session's graphs
            // are on; one with them runs op by op (they read the device), counted.
            let mut out = if self.session.graphs() && exe.collectives() == 0 {
                self.session.run_replayed(exe, inputs)?
            } else {
                if self.session.graphs() {
                    self.progress.counters.uncaptured_steps += 1;
                }
                self.session.run_device_over(exe, inputs, comm)?
            };
            let count = out.get(1).cloned();
            let loss = Loss::Device(out.swap_remove(0));
            let counted = count.is_some();
            self.counts.extend(count.map(|c| (c, true)));
            // Counted as 0 tokens until `settle_counts` reads them and adds them.
            (loss, counted.then_some(0.0))
        };
        if comm.is_some() {
            self.progress.counters.step_collectives += exe.collectives() as u64;
        }
        self.losses.push(loss);
        let items = match count {
            Some(c) => {
                self.tokens += c;
                c as usize
            }
            None => rows,
        };
        self.items_seen += rows as u64;
        self.progress.micro_step(items);
        Ok(())
    }

    /// Ends the open window: the optimizer once (normalised by the window's true counts),
    /// then clear once. Does nothing on an empty window.
    pub fn apply(&mut self) -> Result<()> {
        self.settle_counts();
        if self.progress.micro == 0 {
            return Ok(());
        }
        let scalars = self.opt.scalar_values(self.progress.updates);
        let ended = match self.parallel.as_ref().map(|p| p.shard.is_some()) {
            None => {
                let items = self.progress.items as f64;
                let overflow = if self.scaler.is_some() { !finite(&self.store.gather(&self.session, Kind::Accu)?) } else { false };
                match self.skipped(items, overflow) {
                    Some(e) => e,
                    None => Ended::Applied(
                        self.run_optimizer(self.unscaled(scale(self.net.normalization, self.progress.micro, items, 1, false)), &scalars)?,
                    ),
                }
            }
            Some(false) => self.apply_replicated(&scalars)?,
            Some(true) => self.apply_sharded(&scalars)?,
        };
        if let Some(s) = &mut self.scaler {
            match ended {
                Ended::Applied(_) => s.window(false),
                Ended::Overflow => s.window(true),
                Ended::Empty => {}
            }
        }
        match ended {
            Ended::Applied(cleared) => {
                self.progress.counters.optimizer_runs += 1;
                self.progress.updates += 1;
                self.clear_window(cleared)
            }
            Ended::Empty | Ended::Overflow => {
                self.progress.counters.skipped_updates += 1;
                self.clear_window(false)
            }
        }
    }

    /// Whether a window of `items` items (over every rank), with or without a non-finite
    /// gradient on some rank, skips its update, and why: a token-weighted window without a
    /// token (whose gradient is 0/0) and, under loss scaling, an overflow. `None`: it applies.
    fn skipped(&self, items: f64, overflow: bool) -> Option<Ended> {
        if self.net.normalization == Normalization::Tokens && items <= 0.0 {
            Some(Ended::Empty)
        } else if overflow && self.scaler.is_some() {
            Some(Ended::Overflow)
        } else {
            None
        }
    }

    /// The optimizer's gradient factor with the loss scale divided out.
    fn unscaled(&self, scale: f64) -> f64 {
        scale / self.loss_scale().unwrap_or(1.0)
    }

    /// The scale the micro-steps seed the backward pass with, under dynamic loss scaling.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.map(|s| s.scale)
    }

    /// The optimizer over every parameter: one fused kernel on flat device buffers, one pass
    /// per parameter on a host backend (without clipping, whose norm the graph computes),
    /// else the graph. Returns whether the accumulators were zeroed with it.
    fn run_optimizer(&mut self, scale: f64, scalars: &[f64]) -> Result<bool> {
        if let Some(launches) = self.store.fused_update(scale, self.net.clip_global_norm, scalars) {
            self.progress.counters.fused_launches += launches? as u64;
            return Ok(true);
        }
        if self.net.clip_global_norm.is_none() && self.store.host_update(&mut self.session, scale, scalars) {
            return Ok(true);
        }
        self.session.run(&self.plans.optimizer, &optimizer_inputs(scale, scalars))?;
        Ok(false)
    }

    /// Zeroes the accumulators (unless the update already did: `cleared`), folds once-per-
    /// window statistics in, and closes the window.
    fn clear_window(&mut self, cleared: bool) -> Result<()> {
        match (cleared, self.store.is_flat()) {
            (true, _) => {}
            (false, true) => self.store.clear_flat(&mut self.session),
            (false, false) => {
                self.session.run(&self.plans.clear, &[])?;
            }
        }
        // Once-per-window statistics fold in every window, applied or dropped, as per-micro
        // statistics would have.
        if let Some(Some(window)) = &self.plans.window {
            self.session.run(window, &[])?;
        }
        self.progress.cleared();
        Ok(())
    }
}

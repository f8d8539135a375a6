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
//! - [`sync`]: how a window's gradients come together ([`sync::GradSync`]): this process alone,
//!   or across ranks, replicated or sharded (hsdp);
//! - [`readback`]: the step's losses and token counts, read back from a device when asked;
//! - [`snapshot`]: checkpoints, saved and restored.

mod readback;
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
use cellgraph_cells::{Cell, GradAccumulation, Optimizer, Slicing};
use cellgraph_compiler::autodiff::SENS;
use cellgraph_compiler::dump::DumpOptions;
use cellgraph_compiler::passes::grad_accumulation::ACCUMULATOR_PREFIX;
use cellgraph_compiler::{HostData, HostTensor, TensorType};

use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::exec::{compile, compile_with, DumpAt, Executable, Session};
use crate::Backend;

use cellgraph_compiler::passes::grad_accumulation::accumulator_name;
use readback::Readback;
pub use snapshot::LoadReport;
pub use sync::SHARD;
pub use window::Counters;
use window::{Ended, Scaler};

use store::Store;
use sync::{Boundary, GradSync, Local};
use window::Progress;

/// Where a training batch sits in its epoch ([`Accumulator::step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Any batch but an epoch's last: under in-step slicing its size must be a multiple of
    /// `micro_size` (an error otherwise, as in MindSpore).
    Regular,
    /// An epoch's last batch, which may be shorter than the others (a dataset without
    /// `drop_remainder`, or a wrapped shard): under in-step slicing a size that `micro_size`
    /// does not divide is split into `min(micro_size, items)` micro-batches whose sizes differ
    /// by at most one, larger first (11 items, `micro_size` 4: 3, 3, 3, 2).
    LastOfEpoch,
}

/// The compiled graphs, and how they are named and dumped.
struct Plans {
    /// One `micro_step` per micro-batch shape.
    micro: HashMap<Vec<TensorType>, Executable>,
    optimizer: Executable,
    clear: Executable,
    /// On a host backend under clipping by global norm: the optimizer graph's clipping alone,
    /// whose factor the one-pass boundary applies (see `Store::host_update`).
    clip: Option<Executable>,
    /// The cells' once-per-window state updates (`window_stats`), traced with the first
    /// micro-step: `Some(None)` when there are none.
    window: Option<Option<Executable>>,
    /// Names of the micro-step graphs' inputs.
    names: Vec<String>,
    /// Graph dumps, when switched on.
    dump: Option<DumpOptions>,
}

/// How an accumulator's session runs its plans ([`Accumulator::options`]); each setter is the
/// [`Session`]'s of the same name.
pub struct SessionOptions<'a, B: Backend>(&'a mut Session<B>);

impl<B: Backend> SessionOptions<'_, B> {
    /// Per-op wall-clock profiling ([`Session::set_profiling`]).
    pub fn set_profiling(&mut self, on: bool) {
        self.0.set_profiling(on);
    }

    /// Per-op profiling that waits for the device after each op ([`Session::set_device_profiling`]).
    pub fn set_device_profiling(&mut self, on: bool) {
        self.0.set_device_profiling(on);
    }

    /// TF32 tensor cores for device matmuls ([`Session::set_tf32`]).
    pub fn set_tf32(&mut self, on: bool) {
        self.0.set_tf32(on);
    }

    /// The CPU's bf16 products where the plan chose them ([`Session::set_bf16_products`]).
    pub fn set_bf16_products(&mut self, on: bool) {
        self.0.set_bf16_products(on);
    }

    /// A low-precision plan's values stored in bf16 / f16 on a device
    /// ([`Session::set_low_precision_storage`]).
    pub fn set_low_precision_storage(&mut self, on: bool) {
        self.0.set_low_precision_storage(on);
    }

    /// Captured graphs replayed on a device ([`Session::set_graphs`]); an error on the CPU.
    pub fn set_graphs(&mut self, on: bool) -> Result<()> {
        self.0.set_graphs(on)
    }
}

/// Drives one GradAccumulation network on one device.
pub struct Accumulator<B: Backend> {
    net: Rc<GradAccumulation>,
    opt: Rc<dyn Optimizer>,
    plans: Plans,
    /// Parameters, accumulators and optimizer state.
    session: Session<B>,
    progress: Progress,
    store: Store<B>,
    /// How the window's gradients come together (this process alone, or across ranks).
    sync: Box<dyn GradSync<B>>,
    /// The last step's losses and the window's token counts, read back when asked.
    readback: Readback<B>,
    /// Items this process has trained on: dropout's item keys when the data gives none.
    items_seen: u64,
    /// Dynamic loss scaling, when the precision policy asks for it.
    scaler: Option<Scaler>,
    /// With graphs on, whether an in-step window's micro-steps replay as one graph
    /// ([`Self::set_window_graphs`]).
    window_graphs: bool,
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
        Self::with_session(net, opt, Session::new(device), seed, None)
    }

    /// [`Self::new`] computing in f64 (host backends: the reference runs of the tests).
    pub fn new_f64(net: Rc<GradAccumulation>, opt: Rc<dyn Optimizer>, device: Device<B>, seed: u64) -> Result<Self> {
        Self::with_session(net, opt, Session::new_f64(device), seed, None)
    }

    /// [`Self::new`] then [`Self::restore_owned`] of `params` (a pretrained checkpoint), in
    /// one: a parameter `params` holds with the network's shape is not drawn from `seed` first
    /// (Hugging Face's `from_pretrained` skips those initialisations too), and the session
    /// keeps the tensors' memory as the values. The others are drawn from `seed`, as
    /// [`Self::new`] draws them. Strict or not as [`Self::restore_with`]; the same values as
    /// `new` followed by `restore_with`.
    pub fn pretrained(
        net: Rc<GradAccumulation>,
        opt: Rc<dyn Optimizer>,
        device: Device<B>,
        seed: u64,
        params: crate::checkpoint::Tensors,
        strict: bool,
    ) -> Result<(Self, LoadReport)> {
        let mut acc = Self::with_session(net, opt, Session::new(device), seed, Some(&params))?;
        let report = acc.restore_owned(params, strict)?;
        Ok((acc, report))
    }

    /// A new accumulator on `session`. `given`: a checkpoint about to be restored; its
    /// tensors of a parameter's name and shape are not drawn (zeros, whose pages are not even
    /// touched, hold their place until the restore).
    fn with_session(
        net: Rc<GradAccumulation>,
        opt: Rc<dyn Optimizer>,
        mut session: Session<B>,
        seed: u64,
        given: Option<&crate::checkpoint::Tensors>,
    ) -> Result<Self> {
        net.check()?;
        opt.check().map_err(|detail| cellgraph_cells::CellError::Config { cell: opt.name().into(), detail })?;
        let (optimizer, clear, accumulators, state) = net.boundary_graphs(opt.as_ref())?;
        let (drawn, placed): (Vec<_>, Vec<_>) =
            net.parameters().into_iter().partition(|p| given.and_then(|g| g.get(&p.name)).is_none_or(|t| t.shape != p.ty.dims()));
        session.init_params(&drawn, seed);
        for p in placed {
            session.set_param_owned(&p.name, HostTensor::full(&p.ty, 0.0));
        }
        for (name, ty) in &accumulators {
            session.set_param_owned(name, HostTensor::full(ty, 0.0));
        }
        session.init_state(&state);
        let trained: Vec<(String, TensorType)> =
            accumulators.iter().map(|(n, t)| (n[ACCUMULATOR_PREFIX.len() + 1..].to_string(), t.clone())).collect();
        let store = Store::new(&trained, accumulator_name, opt.as_ref());
        let clip = if B::HOST { net.clip_graph()?.map(compile).transpose()? } else { None };
        let plans = Plans {
            micro: HashMap::new(),
            optimizer: compile(optimizer)?,
            clear: compile(clear)?,
            clip,
            window: None,
            names: Vec::new(),
            dump: None,
        };
        let mut acc = Accumulator {
            net,
            opt,
            plans,
            session,
            progress: Progress::default(),
            store,
            sync: Box::new(Local),
            readback: Readback::new(),
            items_seen: 0,
            scaler: None,
            window_graphs: true,
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
        let opts = match self.sync.comm() {
            Some(c) if c.size() > 1 => opts.for_rank(c.rank()),
            _ => opts,
        };
        let at = DumpAt { opts: &opts, first: 1, input: "grad_accumulation" };
        self.plans.clear = compile_with(self.plans.clear.source().clone(), Some(at))?;
        if let Some(clip) = &mut self.plans.clip {
            *clip = compile_with(clip.source().clone(), Some(at))?;
        }
        // The optimizer graph that runs: this rank's shard under hsdp, else the whole one.
        match self.sync.shard_mut() {
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
        self.sync.comm()
    }

    /// This process's rank (0 without data parallelism).
    pub fn rank(&self) -> usize {
        self.sync.comm().map_or(0, |c| c.rank())
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

    /// What the session stores in bf16 / f16 of the micro-step compiled first
    /// ([`Session::low_precision_storage`]): `None` when it computes in f32.
    pub fn low_precision_storage(&mut self) -> Option<crate::LowStorage> {
        let exe = self.plans.micro.values().next()?;
        self.session.low_precision_storage(exe)
    }

    /// The compiled optimizer and clear plans.
    pub fn boundary_plans(&self) -> (&Executable, &Executable) {
        (&self.plans.optimizer, &self.plans.clear)
    }

    /// On a host backend, whether a window's boundary is one pass per parameter (the default:
    /// the optimizer and clear graphs' bits, each buffer read and written once) or those two
    /// graphs themselves (`false`, to compare with; each then counts in `clear_runs`).
    pub fn set_one_pass_boundary(&mut self, on: bool) {
        self.store.set_one_pass(self.opt.as_ref(), on);
    }

    /// With graphs on ([`SessionOptions::set_graphs`]) and in-step slicing, whether a window's
    /// micro-steps are captured and replayed as one graph (the default: one launch per window)
    /// or each as its own (one launch per micro-step, to compare with). Across steps, and for a
    /// last batch whose micro-batches differ in size, each micro-step replays its own graph.
    pub fn set_window_graphs(&mut self, on: bool) {
        self.window_graphs = on;
    }

    /// One training step, the one way to train: with in-step slicing the batch is split into
    /// `micro_size` micro-batches and the window applied; across steps the batch is one
    /// micro-batch and the window is applied when it is full. `place` says whether this is the
    /// epoch's last batch, which may be shorter ([`Place`]). Returns whether the step ended a
    /// window (the optimizer ran). Nothing waits for a device: the step's loss stays where it
    /// was computed until [`Self::step_loss`] asks for it, so the device runs the step while
    /// the host prepares the next one.
    pub fn step(&mut self, batch: &[HostTensor], place: Place) -> Result<bool> {
        let b = batch.first().and_then(|t| t.shape.first().copied()).unwrap_or(0);
        if self.net.slicing == Slicing::InStep && place == Place::Regular {
            self.net.check_batch(b)?;
        }
        let k = self.net.micro_size;
        if b == 0 {
            return Err(RuntimeError::Mismatch { what: "training batch".into(), expected: "at least one item".into(), got: "an empty batch".into() });
        }
        self.readback.forget(&mut self.session);
        match self.net.slicing {
            Slicing::InStep => {
                let ranges = micro_ranges(b, k);
                let micros = ranges.iter().map(|&(start, end)| batch.iter().map(|t| slice_rows(t, start, end)).collect::<Vec<_>>());
                let one_shape = ranges.iter().all(|r| r.1 - r.0 == ranges[0].1 - ranges[0].0);
                if self.window_graphs && self.session.graphs() && ranges.len() > 1 && one_shape {
                    self.run_window(micros.collect())?;
                } else {
                    for micro in micros {
                        self.run_micro(&micro)?;
                    }
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

    /// The last step's loss: the sum of its micro-batches' losses (each as the network computed
    /// it, added in f64), NaN before the first step; under token-weighted normalisation, that
    /// sum divided by the step's tokens (the mean loss per token; 0, the empty sum, without a
    /// token). On a device backend the first call after a step reads the losses back (one
    /// read: the device finishes the step's work first).
    pub fn step_loss(&self) -> f64 {
        self.readback.step_loss(self.net.normalization)
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

    /// The session holding the parameters, accumulators and optimizer state, to read (values,
    /// profiles, replay counts).
    pub fn session(&self) -> &Session<B> {
        &self.session
    }

    /// Runs another graph over the trained parameters (an evaluation, a sampling step): its
    /// parameter inputs read the session's values, `inputs` fill the rest.
    pub fn run(&mut self, exe: &Executable, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        self.session.run(exe, inputs)
    }

    /// Sets a trained parameter's value; an error naming the parameter when the network has
    /// none of that name or its shape differs.
    pub fn set_param(&mut self, name: &str, value: &HostTensor) -> Result<()> {
        match self.session.param_shape(name) {
            Some(shape) if shape == value.shape => {
                self.session.set_param(name, value);
                // Flat device buffers are packed again from the session's values.
                if self.store.is_flat() {
                    self.store.enter_flat(&mut self.session, self.opt.as_ref())?;
                }
                Ok(())
            }
            Some(shape) => Err(RuntimeError::Mismatch {
                what: format!("parameter `{name}`"),
                expected: format!("shape {shape:?}"),
                got: format!("shape {:?}", value.shape),
            }),
            None => Err(RuntimeError::Mismatch {
                what: "parameter name".into(),
                expected: format!("a parameter of the network ({})", self.store.params().collect::<Vec<_>>().join(", ")),
                got: format!("`{name}`"),
            }),
        }
    }

    /// How the session runs its plans: profiling, TF32, bf16 products, captured graphs.
    pub fn options(&mut self) -> SessionOptions<'_, B> {
        SessionOptions(&mut self.session)
    }

    /// The window's progress with its unread token counts read (a snapshot's copy).
    fn settled_progress(&self) -> window::Progress {
        let mut p = self.progress;
        p.items += self.readback.unread_items();
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

    /// A micro-batch's plan (compiled, and dumped, at its shape's first use) and the plan's
    /// inputs: the network's (the batch without its items' indices), then dropout's keys when
    /// the plan reads them. Returns the plan's key, the inputs and the micro-batch's rows.
    fn prepared<'a>(&mut self, batch: &'a [HostTensor]) -> Result<(Vec<TensorType>, Cow<'a, [HostTensor]>, usize)> {
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
        let inputs = if keys.is_empty() { inputs } else { Cow::Owned(inputs.iter().cloned().chain(keys).collect()) };
        Ok((key, inputs, rows))
    }

    /// An in-step window's micro-batches (one shape) as one captured graph, replayed in one
    /// launch ([`Session::run_window_replayed`]); a plan with collectives inside runs its
    /// micro-steps one by one.
    fn run_window(&mut self, micros: Vec<Vec<HostTensor>>) -> Result<()> {
        // Each micro-step's dropout keys count the items before it; the count stands only once
        // the window ran (a refused window, a bad label say, leaves it as it was).
        let seen = self.items_seen;
        let prepared = self.window_inputs(&micros);
        self.items_seen = seen;
        let (sets, plan) = prepared?;
        let exe = &self.plans.micro[&plan];
        if exe.collectives() > 0 {
            return micros.iter().try_for_each(|micro| self.run_micro(micro));
        }
        let inputs: Vec<&[HostTensor]> = sets.iter().map(|s| &s.0[..]).collect();
        let outs = self.session.run_window_replayed(exe, &inputs)?;
        self.items_seen += sets.iter().map(|s| s.1 as u64).sum::<u64>();
        for (mut out, (_, rows)) in outs.into_iter().zip(&sets) {
            let count = out.get(1).cloned();
            let counted = count.is_some();
            self.readback.push_device(out.swap_remove(0), count);
            // Counted as 0 tokens until the boundary reads them (`Readback::settle`).
            self.progress.micro_step(if counted { 0 } else { *rows });
        }
        Ok(())
    }

    /// The plan inputs of a window's micro-batches (see [`Self::prepared`]) with their rows, and
    /// the plan's key; advances `items_seen` past them (the caller restores it).
    #[allow(clippy::type_complexity)]
    fn window_inputs<'a>(&mut self, micros: &'a [Vec<HostTensor>]) -> Result<(Vec<(Cow<'a, [HostTensor]>, usize)>, Vec<TensorType>)> {
        let mut sets = Vec::with_capacity(micros.len());
        let mut plan = None;
        for micro in micros {
            let (key, inputs, rows) = self.prepared(micro)?;
            self.items_seen += rows as u64;
            sets.push((inputs, rows));
            plan = Some(key);
        }
        Ok((sets, plan.expect("a window has micro-steps")))
    }

    /// One micro-batch, its loss kept with the step's others.
    fn run_micro(&mut self, batch: &[HostTensor]) -> Result<()> {
        let (key, inputs, rows) = self.prepared(batch)?;
        let exe = &self.plans.micro[&key];
        let inputs = &inputs[..];
        // Collectives inside the step (SyncBatchNorm's statistics) sum over the ranks.
        let comm = self.sync.comm().map(|c| c.as_ref()).filter(|c| c.size() > 1);
        // Under token-weighted normalisation the step's second output is its token count: on
        // a device left there until the window's boundary (or the step's loss) needs it.
        let count = if B::HOST {
            let out = self.session.run_over(exe, inputs, comm)?;
            let count = out.get(1).map(|c| c.scalar());
            self.readback.push_read(out[0].scalar(), count);
            count
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
            let counted = count.is_some();
            self.readback.push_device(out.swap_remove(0), count);
            // Counted as 0 tokens until the boundary reads them (`Readback::settle`).
            counted.then_some(0.0)
        };
        if comm.is_some() {
            self.progress.counters.step_collectives += exe.collectives() as u64;
        }
        let items = count.map_or(rows, |c| c as usize);
        self.items_seen += rows as u64;
        self.progress.micro_step(items);
        Ok(())
    }

    /// Ends the open window: the optimizer once (normalised by the window's true counts),
    /// then clear once. Does nothing on an empty window.
    fn apply(&mut self) -> Result<()> {
        self.progress.items += self.readback.settle();
        if self.progress.micro == 0 {
            return Ok(());
        }
        let scalars = self.opt.scalar_values(self.progress.updates);
        let loss_scale = self.loss_scale();
        let mut boundary = Boundary {
            net: &self.net,
            session: &mut self.session,
            store: &mut self.store,
            progress: &mut self.progress,
            optimizer: &self.plans.optimizer,
            clip: self.plans.clip.as_ref(),
            loss_scale,
            scalars: &scalars,
        };
        let ended = self.sync.end_window(&mut boundary)?;
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
                self.progress.counters.overflows += u64::from(matches!(ended, Ended::Overflow));
                self.clear_window(false)
            }
        }
    }

    /// The scale the micro-steps seed the backward pass with, under dynamic loss scaling.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.map(|s| s.scale)
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

//! Running a [`GradAccumulation`] network: micro-steps, window boundaries, counters.
//!
//! The [`Accumulator`] owns the compiled `micro_step` graphs (one per micro-batch shape, so a
//! short last batch just compiles another), the `optimizer` and `clear` graphs, and a
//! [`Session`] holding parameters, accumulators and optimizer state. A window ends after
//! `micro_size` micro-batches: the optimizer runs once with the window's normalisation scale
//! and its update number (for the learning-rate schedule), then clear runs once.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use burn_backend::tensor::{Device, FloatTensor};
use crate::Backend;
use cellgraph_cells::{Cell, GradAccumulation, Normalization, Optimizer, Slicing};
use cellgraph_compiler::passes::grad_accumulation::{optimizer_graph, AccumulationOptions, ACCUMULATOR_PREFIX};
use cellgraph_compiler::dump::DumpOptions;
use cellgraph_compiler::update::{FusedRule, StateSpec};
use cellgraph_compiler::{HostData, HostTensor, TensorType};

use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::exec::{compile, compile_with, DumpAt, Executable, Session};
use crate::backend::HostVec;
use crate::value::Value;

/// How many times each graph ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub micro_steps: u64,
    pub optimizer_runs: u64,
    pub clear_runs: u64,
    /// Collectives that carried gradients across ranks (one per applied update).
    pub grad_collectives: u64,
    /// Fused optimizer-and-clear kernel launches (device backends with flat buffers: one per
    /// update, whatever the number of parameters).
    pub fused_launches: u64,
}

/// What a checkpoint load did (MindSpore's `load_param_into_net` returns the first two).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Parameters and state left as they were (`param_not_load`).
    pub missing: Vec<String>,
    /// Tensors of the checkpoint that were not loaded (`ckpt_not_load`).
    pub unused: Vec<String>,
    /// What was loaded.
    pub loaded: Vec<String>,
}

/// What one call to [`Accumulator::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// The step's loss: the sum of its micro losses (in-step slicing) or the micro loss.
    pub loss: f64,
    /// True when this step ended a window and the optimizer ran.
    pub applied: bool,
}

/// Drives one GradAccumulation network on one device.
pub struct Accumulator<B: Backend> {
    net: Rc<GradAccumulation>,
    opt: Rc<dyn Optimizer>,
    micro: HashMap<Vec<TensorType>, Executable>,
    optimizer: Executable,
    clear: Executable,
    /// Parameters, accumulators and optimizer state.
    pub session: Session<B>,
    window_micro: usize,
    window_items: usize,
    updates: u64,
    counters: Counters,
    names: Vec<String>,
    /// Trained parameters in flat-buffer order, with element counts.
    trained: Vec<(String, usize)>,
    parallel: Option<Parallel>,
    /// Graph dumps, when switched on.
    dump: Option<DumpOptions>,
    /// Device backends: flat buffers behind the parameters, accumulators and state.
    flat: Option<Flat<B>>,
}

/// Flat device buffers (see [`Backend::flat_buffers`]): every trained parameter, its
/// accumulator and each of its optimizer states is a view of one buffer per kind, at an
/// aligned offset, so a boundary is one fused kernel launch and a collective moves one buffer.
struct Flat<B: Backend> {
    rule: FusedRule,
    /// Each trained parameter's offset (in `trained` order) and extents.
    layout: Vec<(usize, Vec<usize>)>,
    len: usize,
    params: FloatTensor<B>,
    accu: FloatTensor<B>,
    /// One buffer per state kind, in the rule's order, with the kind's initial value.
    state: Vec<(FloatTensor<B>, f32)>,
}

/// Which of the flat buffers.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Params,
    Accu,
    State(usize),
}

/// Data parallelism: the communicator and how gradients cross it.
struct Parallel {
    comm: Arc<dyn Communicator>,
    gradients_mean: bool,
    /// With hsdp: this rank's slice of the flat parameters and its optimizer.
    shard: Option<Shard>,
}

/// ZeRO-1: this rank updates elements `rank*len..(rank+1)*len` of the flat parameters.
struct Shard {
    len: usize,
    optimizer: Executable,
    /// This rank's slice of the optimizer state (`moments.hsdp.shard`, ...).
    shard_state: Vec<StateSpec>,
}

/// The state kind of a shard state spec: `moments` for `moments.hsdp.shard`.
fn state_kind(spec: &StateSpec) -> &str {
    spec.name.strip_suffix(SHARD).and_then(|k| k.strip_suffix('.')).expect("shard state names end in the shard")
}

/// Rank `r`'s slice of `len` elements of a flat buffer, padded with `pad` past its end.
fn shard_of(v: &[f32], r: usize, len: usize, pad: f32) -> Vec<f32> {
    let start = (r * len).min(v.len());
    let mut s = v[start..(start + len).min(v.len())].to_vec();
    s.resize(len, pad);
    s
}

/// The optimizer graph's inputs: the gradient scale, then the rule's host scalars.
fn optimizer_inputs(scale: f64, scalars: &[f64]) -> Vec<HostTensor> {
    std::iter::once(scale).chain(scalars.iter().copied()).map(HostTensor::scalar_f32).collect()
}

/// The name the hsdp shard's parameter takes in the session.
pub const SHARD: &str = "hsdp.shard";

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
        net.check()?;
        opt.check().map_err(|detail| cellgraph_cells::CellError::Config { cell: opt.name().into(), detail })?;
        let (optimizer, clear, accumulators, state) = net.boundary_graphs(opt.as_ref())?;
        let mut session = Session::new(device);
        session.init_params(&net.parameters(), seed);
        for (name, ty) in &accumulators {
            session.set_param(name, &HostTensor::full(ty, 0.0));
        }
        session.init_state(&state);
        let trained = accumulators.iter().map(|(n, t)| (n[ACCUMULATOR_PREFIX.len() + 1..].to_string(), t.numel())).collect();
        Accumulator {
            net,
            opt,
            micro: HashMap::new(),
            optimizer: compile(optimizer)?,
            clear: compile(clear)?,
            session,
            window_micro: 0,
            window_items: 0,
            updates: 0,
            counters: Counters::default(),
            names: Vec::new(),
            trained,
            parallel: None,
            dump: None,
            flat: None,
        }
        .with_flat_buffers()
    }

    fn with_flat_buffers(mut self) -> Result<Self> {
        self.enter_flat()?;
        Ok(self)
    }

    /// The session name of parameter `name`'s buffer of `kind`.
    fn key(&self, kind: Kind, name: &str) -> String {
        match kind {
            Kind::Params => name.to_string(),
            Kind::Accu => format!("{ACCUMULATOR_PREFIX}.{name}"),
            Kind::State(i) => {
                let shape = self.session.param_shape(name).unwrap_or_default();
                self.opt.state(name, &TensorType::f32(shape)).swap_remove(i).name
            }
        }
    }

    /// Moves parameters, accumulators and optimizer state into flat device buffers, when the
    /// backend keeps them so and the optimizer has a fused kernel (re-packs them when already
    /// flat, after values were set from the host).
    fn enter_flat(&mut self) -> Result<()> {
        let hsdp = self.parallel.as_ref().is_some_and(|p| p.shard.is_some());
        let Some(rule) = self.opt.fused().filter(|_| B::flat_buffers() && !hsdp && !self.trained.is_empty()) else {
            return Ok(());
        };
        let mut layout = Vec::new();
        let mut len = 0;
        for (name, n) in &self.trained {
            let shape = self.session.param_shape(name).ok_or_else(|| RuntimeError::MissingParam(name.clone()))?;
            layout.push((len, shape));
            len += n.div_ceil(crate::backend::FLAT_ALIGN) * crate::backend::FLAT_ALIGN;
        }
        let first = &self.trained[0].0;
        let inits: Vec<f32> = self.opt.state(first, &TensorType::f32(layout[0].1.clone())).iter().map(|s| s.init as f32).collect();
        let pack = |kind: Kind, pad: f32| -> Result<FloatTensor<B>> {
            let mut v = vec![pad; len];
            for ((name, n), (at, _)) in self.trained.iter().zip(&layout) {
                let key = self.key(kind, name);
                let t = self.session.param(&key).ok_or_else(|| RuntimeError::MissingParam(key.clone()))?;
                v[*at..*at + n].copy_from_slice(&t.to_f32());
            }
            Ok(B::from_host_vec(HostVec::F32(v), &[len], self.session.device()))
        };
        let params = pack(Kind::Params, 0.0)?;
        let accu = pack(Kind::Accu, 0.0)?;
        let state = inits.iter().enumerate().map(|(i, &init)| Ok((pack(Kind::State(i), init)?, init))).collect::<Result<Vec<_>>>()?;
        self.flat = Some(Flat { rule, layout, len, params, accu, state });
        for kind in self.kinds() {
            self.bind_views(kind);
        }
        self.session.set_in_place_accumulation(true);
        Ok(())
    }

    /// Back to one tensor per name (hsdp updates slices on the host).
    fn leave_flat(&mut self) {
        if self.flat.is_none() {
            return;
        }
        for kind in self.kinds() {
            for (name, _) in self.trained.clone() {
                let key = self.key(kind, &name);
                if let Some(t) = self.session.param(&key) {
                    self.session.set_param(&key, &t);
                }
            }
        }
        self.flat = None;
        self.session.set_in_place_accumulation(false);
    }

    fn kinds(&self) -> Vec<Kind> {
        let states = self.flat.as_ref().map_or(0, |f| f.state.len());
        [Kind::Params, Kind::Accu].into_iter().chain((0..states).map(Kind::State)).collect()
    }

    fn buffer(&self, kind: Kind) -> Option<&FloatTensor<B>> {
        let f = self.flat.as_ref()?;
        Some(match kind {
            Kind::Params => &f.params,
            Kind::Accu => &f.accu,
            Kind::State(i) => &f.state[i].0,
        })
    }

    /// Points every parameter's session value of `kind` at its slice of the flat buffer.
    fn bind_views(&mut self, kind: Kind) {
        let Some(buf) = self.buffer(kind).cloned() else { return };
        let layout = self.flat.as_ref().map(|f| f.layout.clone()).unwrap_or_default();
        for ((name, _), (at, shape)) in self.trained.clone().iter().zip(layout) {
            let view = B::flat_view(&buf, at, &shape).expect("flat offsets are aligned and in bounds");
            let key = self.key(kind, name);
            self.session.set_value(&key, Value::Float(view));
        }
    }

    /// Replaces the flat buffer of `kind` by `data` (unpadded, in `trained` order).
    fn upload_flat(&mut self, kind: Kind, data: &[f32]) {
        let Some(f) = self.flat.as_mut() else { return };
        let pad = match kind {
            Kind::State(i) => f.state[i].1,
            _ => 0.0,
        };
        let mut v = vec![pad; f.len];
        let mut from = 0;
        for ((_, n), (at, _)) in self.trained.iter().zip(&f.layout) {
            v[*at..*at + n].copy_from_slice(&data[from..from + n]);
            from += n;
        }
        let t = B::from_host_vec(HostVec::F32(v), &[f.len], self.session.device());
        match kind {
            Kind::Params => f.params = t,
            Kind::Accu => f.accu = t,
            Kind::State(i) => f.state[i].0 = t,
        }
        self.bind_views(kind);
    }

    /// The flat buffer of `kind` on the host, without padding (one device read).
    fn download_flat(&self, kind: Kind) -> Option<Vec<f32>> {
        let f = self.flat.as_ref()?;
        let all = Value::<B>::Float(self.buffer(kind)?.clone()).to_host().to_f32();
        Some(self.trained.iter().zip(&f.layout).flat_map(|((_, n), (at, _))| all[*at..*at + n].iter().copied()).collect())
    }

    /// Trains data-parallel over `comm`: gradients are all-reduced (or, with `hsdp`,
    /// reduce-scattered) once per window, in one flat buffer. Checks that every rank has the
    /// same graphs and initial parameters.
    pub fn set_parallel(&mut self, comm: Arc<dyn Communicator>, gradients_mean: bool, hsdp: bool) -> Result<()> {
        let mut fingerprint = format!("{}\n{}\n", cellgraph_compiler::print(self.optimizer.graph()), cellgraph_compiler::print(self.clear.graph()));
        fingerprint += &format!("{:?} {:?} {} {:?} {} {gradients_mean} {hsdp}\n", self.net.slicing, self.net.normalization, self.net.micro_size, self.net.clip_global_norm, self.net.drop_incomplete_window);
        // The learning-rate schedule and other host scalars are inputs, not graph constants.
        fingerprint += &format!("{:?}\n", [0, 1, 10, 1000].map(|u| self.opt.scalar_values(u)));
        crate::comm::agree(comm.as_ref(), "configuration (network, optimizer, accumulation options)", fingerprint.as_bytes())?;
        let params: Vec<u8> = self.flat(None)?.iter().flat_map(|v| v.to_le_bytes()).collect();
        crate::comm::agree(comm.as_ref(), "initial parameters (seed)", &params)?;
        if hsdp {
            self.leave_flat();
        }
        let shard = if hsdp { Some(self.make_shard(comm.size())?) } else { None };
        if let Some(sh) = &shard {
            // The unsharded state (`moments.fc1.weight`, ...) gives way to this rank's slice.
            for spec in &sh.shard_state {
                for (name, _) in &self.trained {
                    self.session.remove_param(&format!("{}.{name}", state_kind(spec)));
                }
            }
            self.session.init_state(&sh.shard_state);
        }
        self.parallel = Some(Parallel { comm, gradients_mean, shard });
        Ok(())
    }

    /// The optimizer graph and state of one hsdp shard of `len` elements (clipping, which
    /// needs the global norm, is folded into the scale on the host).
    fn shard_graph(&self, len: usize) -> Result<(cellgraph_compiler::Graph, Vec<StateSpec>)> {
        let opts = AccumulationOptions { normalization: self.net.normalization, clip_global_norm: None };
        let (mut g, state) = optimizer_graph(&[(SHARD.to_string(), TensorType::f32(vec![len]))], self.opt.as_ref(), &opts)?;
        g.name = "optimizer_shard".into();
        Ok((g, state))
    }

    fn make_shard(&self, size: usize) -> Result<Shard> {
        let len = self.total().div_ceil(size);
        let (g, shard_state) = self.shard_graph(len)?;
        Ok(Shard { len, optimizer: compile(g)?, shard_state })
    }

    /// Elements of the flat parameter buffer.
    fn total(&self) -> usize {
        self.trained.iter().map(|(_, n)| n).sum()
    }

    /// Splits a flat buffer into one tensor per trained parameter, shaped like it.
    fn split_flat<'a>(&'a self, flat: &'a [f32]) -> impl Iterator<Item = (&'a str, HostTensor)> + 'a {
        self.trained.iter().scan(0, move |at, (name, n)| {
            let shape = self.session.param_shape(name).expect("trained parameters live in the session");
            let t = HostTensor::f32(shape, flat[*at..*at + n].to_vec()).expect("sizes match");
            *at += n;
            Some((name.as_str(), t))
        })
    }

    /// The trained parameters (or, with `prefix`, their accumulators) as one flat f32 buffer.
    fn flat(&self, prefix: Option<&str>) -> Result<Vec<f32>> {
        if let Some(v) = self.download_flat(if prefix.is_some() { Kind::Accu } else { Kind::Params }) {
            return Ok(v);
        }
        let mut out = Vec::with_capacity(self.total());
        for (name, _) in &self.trained {
            let key = prefix.map_or_else(|| name.clone(), |p| format!("{p}.{name}"));
            let t = self.session.param(&key).ok_or_else(|| RuntimeError::MissingParam(key.clone()))?;
            match &t.data {
                HostData::F32(v) => out.extend_from_slice(v),
                _ => return Err(RuntimeError::Comm(format!("data parallelism needs f32 values; `{key}` is {}", t.ty()))),
            }
        }
        Ok(out)
    }

    /// Writes a flat buffer back into the parameters (or their accumulators, with `prefix`).
    fn set_flat(&mut self, prefix: Option<&str>, flat: &[f32]) {
        if self.flat.is_some() {
            return self.upload_flat(if prefix.is_some() { Kind::Accu } else { Kind::Params }, flat);
        }
        let parts: Vec<(String, HostTensor)> = self.split_flat(flat).map(|(name, t)| (prefix.map_or_else(|| name.to_string(), |p| format!("{p}.{name}")), t)).collect();
        for (key, t) in parts {
            self.session.set_param(&key, &t);
        }
    }

    /// Names the inputs of micro-step graphs (default `input0`, `input1`, ...), as they appear
    /// in dumps.
    pub fn set_input_names(&mut self, names: &[&str]) {
        self.names = names.iter().map(|n| n.to_string()).collect();
    }

    /// Names input types as micro-step graphs name their inputs (see [`Self::set_input_names`]).
    pub fn named_inputs(&self, types: &[TensorType]) -> Vec<(String, TensorType)> {
        types.iter().enumerate().map(|(i, t)| (self.names.get(i).cloned().unwrap_or_else(|| format!("input{i}")), t.clone())).collect()
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
        self.clear = compile_with(self.clear.source().clone(), Some(at))?;
        // The optimizer graph that runs: this rank's shard under hsdp, else the whole one.
        match self.parallel.as_mut().and_then(|p| p.shard.as_mut()) {
            Some(sh) => sh.optimizer = compile_with(sh.optimizer.source().clone(), Some(at))?,
            None => self.optimizer = compile_with(self.optimizer.source().clone(), Some(at))?,
        }
        self.micro.clear();
        self.dump = Some(opts);
        Ok(())
    }

    /// The dump options in force (with the rank directory applied).
    pub fn dump_options(&self) -> Option<&DumpOptions> {
        self.dump.as_ref()
    }

    /// The communicator, when training data-parallel.
    pub fn communicator(&self) -> Option<&Arc<dyn Communicator>> {
        self.parallel.as_ref().map(|p| &p.comm)
    }

    /// This process's rank (0 without data parallelism).
    pub fn rank(&self) -> usize {
        self.parallel.as_ref().map_or(0, |p| p.comm.rank())
    }

    /// Elements of the flat optimizer state this rank holds (all of it, unless hsdp).
    pub fn optimizer_state_elements(&self) -> usize {
        let names = self.session.param_names();
        let is_state = |n: &str| !n.starts_with(&format!("{ACCUMULATOR_PREFIX}.")) && n != SHARD && !self.trained.iter().any(|(t, _)| t == n);
        names.iter().filter(|n| is_state(n)).map(|n| self.session.param_shape(n).map_or(0, |s| s.iter().product::<usize>())).sum()
    }

    /// The wrapped network.
    pub fn network(&self) -> &GradAccumulation {
        &self.net
    }

    /// The graphs' run counts.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Optimizer updates applied so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Micro-batches accumulated in the open window.
    pub fn window_len(&self) -> usize {
        self.window_micro
    }

    /// The compiled micro-step for a first micro-batch of the given shapes (for dumps).
    pub fn micro_plans(&self) -> impl Iterator<Item = &Executable> {
        self.micro.values()
    }

    /// The compiled optimizer and clear plans.
    pub fn boundary_plans(&self) -> (&Executable, &Executable) {
        (&self.optimizer, &self.clear)
    }

    /// Runs one micro-batch: forward, backward, gradients added into the accumulators.
    pub fn micro_step(&mut self, inputs: &[HostTensor]) -> Result<f64> {
        let key: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
        if !self.micro.contains_key(&key) {
            let named = self.named_inputs(&key);
            let (forward, mut g) = self.net.traced_micro_step(&named)?;
            if !self.micro.is_empty() {
                // Another micro-batch shape (a short last batch): its own dump files.
                g.name = format!("micro_step_{}", self.micro.len());
            }
            let exe = match &self.dump {
                Some(d) => {
                    cellgraph_compiler::dump::write(d, 0, "trace", &forward).map_err(|source| RuntimeError::Io { path: d.dir.display().to_string(), source })?;
                    compile_with(g, Some(DumpAt { opts: d, first: 1, input: "grad_accumulation" }))?
                }
                None => compile(g)?,
            };
            self.micro.insert(key.clone(), exe);
        }
        let loss = self.session.run(&self.micro[&key], inputs)?[0].scalar();
        self.counters.micro_steps += 1;
        self.window_micro += 1;
        self.window_items += inputs.first().and_then(|t| t.shape.first().copied()).unwrap_or(1);
        Ok(loss)
    }

    /// Ends the open window: the optimizer once (normalised by the window's true counts),
    /// then clear once. Does nothing on an empty window.
    pub fn apply(&mut self) -> Result<()> {
        if self.window_micro == 0 {
            return Ok(());
        }
        let scalars = self.opt.scalar_values(self.updates);
        match self.parallel.as_ref().map(|p| p.shard.is_some()) {
            None => {
                let scale = self.scale(self.window_items as f64, 1, false);
                self.run_optimizer(scale, &scalars)?;
            }
            Some(false) => self.apply_replicated(&scalars)?,
            Some(true) => self.apply_sharded(&scalars)?,
        }
        self.counters.optimizer_runs += 1;
        self.updates += 1;
        // The fused kernel has already zeroed the accumulators.
        let cleared = self.flat.is_some() && self.parallel.as_ref().is_none_or(|p| p.shard.is_none());
        self.clear_window(cleared)
    }

    /// The window's normalisation: `items` counted on every rank, gradients summed over
    /// `ranks` (averaged when `mean_over_ranks`).
    fn scale(&self, items: f64, ranks: usize, mean_over_ranks: bool) -> f64 {
        let per_rank = if mean_over_ranks { 1.0 / ranks as f64 } else { 1.0 };
        match self.net.normalization {
            Normalization::Sum => per_rank,
            Normalization::Mean => per_rank / self.window_micro as f64,
            Normalization::ItemWeighted => 1.0 / items,
        }
    }

    fn run_optimizer(&mut self, scale: f64, scalars: &[f64]) -> Result<()> {
        let Some(f) = &self.flat else {
            self.session.run(&self.optimizer, &optimizer_inputs(scale, scalars))?;
            return Ok(());
        };
        let mut scale = scale;
        if let Some(max) = self.net.clip_global_norm {
            // The optimizer graph's clip_by_global_norm, on the flat accumulators.
            let sq = B::float_sum(B::float_mul(f.accu.clone(), f.accu.clone()));
            let norm = scale * (Value::<B>::Float(sq).to_host().scalar()).sqrt();
            if norm >= max {
                scale *= max / norm;
            }
        }
        let scalars: Vec<f32> = scalars.iter().map(|&v| v as f32).collect();
        let state: Vec<FloatTensor<B>> = f.state.iter().map(|(t, _)| t.clone()).collect();
        let launches = B::fused_update(&f.rule, &f.params, &f.accu, &state, scale as f32, &scalars)
            .ok_or_else(|| RuntimeError::Device("the backend keeps flat buffers but has no fused update kernel".into()))?;
        self.counters.fused_launches += launches as u64;
        Ok(())
    }

    /// One all-reduce of the flat accumulators (with the window's item count appended), then
    /// the optimizer on every rank.
    fn apply_replicated(&mut self, scalars: &[f64]) -> Result<()> {
        let mut flat = self.flat(Some(ACCUMULATOR_PREFIX))?;
        flat.push(self.window_items as f32);
        let p = self.parallel.as_ref().expect("parallel");
        let (comm, mean) = (p.comm.clone(), p.gradients_mean);
        comm.all_reduce_sum(&mut flat);
        self.counters.grad_collectives += 1;
        let items = flat.pop().unwrap_or(0.0) as f64;
        self.set_flat(Some(ACCUMULATOR_PREFIX), &flat);
        let scale = self.scale(items, comm.size(), mean);
        self.run_optimizer(scale, scalars)
    }

    /// ZeRO-1: one reduce-scatter gives this rank the summed gradients of its slice (and the
    /// global item count); it updates that slice of the parameters and of the optimizer
    /// state; one all-gather brings every rank the whole updated parameters.
    fn apply_sharded(&mut self, scalars: &[f64]) -> Result<()> {
        let grads = self.flat(Some(ACCUMULATOR_PREFIX))?;
        let params = self.flat(None)?;
        let p = self.parallel.as_ref().expect("parallel");
        let (comm, mean) = (p.comm.clone(), p.gradients_mean);
        let len = p.shard.as_ref().expect("sharded").len;
        let (size, rank, total) = (comm.size(), comm.rank(), grads.len());
        let mut send = Vec::with_capacity(size * (len + 1));
        for r in 0..size {
            send.extend(shard_of(&grads, r, len, 0.0));
            send.push(self.window_items as f32);
        }
        let mut mine = vec![0.0f32; len + 1];
        comm.reduce_scatter_sum(&send, &mut mine);
        self.counters.grad_collectives += 1;
        let items = mine.pop().unwrap_or(0.0) as f64;
        let mut scale = self.scale(items, size, mean);
        if let Some(max) = self.net.clip_global_norm {
            let mut sq = [mine.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>() as f32];
            comm.all_reduce_sum(&mut sq);
            let norm = scale * (sq[0] as f64).sqrt();
            if norm >= max {
                scale *= max / norm;
            }
        }
        self.session.set_param(SHARD, &HostTensor::f32(vec![len], shard_of(&params, rank, len, 0.0)).expect("len"));
        self.session.set_param(&format!("{ACCUMULATOR_PREFIX}.{SHARD}"), &HostTensor::f32(vec![len], mine).expect("len"));
        let shard = self.parallel.as_ref().and_then(|p| p.shard.as_ref()).expect("sharded");
        self.session.run(&shard.optimizer, &optimizer_inputs(scale, scalars))?;
        let updated = self.session.param(SHARD).expect("written by the optimizer").to_f32();
        let mut all = vec![0.0f32; size * len];
        comm.all_gather(&updated, &mut all);
        all.truncate(total);
        self.set_flat(None, &all);
        Ok(())
    }

    /// Everything needed to resume bit-identically: parameters, accumulators, optimizer
    /// state, and the counters as `cellgraph.*` int64 scalars.
    ///
    /// With hsdp the optimizer state is gathered from every rank and stored under the
    /// unsharded names (`moments.fc1.weight`), so the checkpoint is the same as an unsharded
    /// run's; every rank must call this together.
    pub fn snapshot(&self) -> crate::checkpoint::Tensors {
        let mut t = self.session.params_host();
        if let Some((comm, shard)) = self.parallel.as_ref().and_then(|p| Some((&p.comm, p.shard.as_ref()?))) {
            t.remove(SHARD);
            t.remove(&format!("{ACCUMULATOR_PREFIX}.{SHARD}"));
            for spec in &shard.shard_state {
                let mine = t.remove(&spec.name).expect("shard state lives in the session").to_f32();
                let mut all = vec![0.0f32; comm.size() * shard.len];
                comm.all_gather(&mine, &mut all);
                for (name, part) in self.split_flat(&all) {
                    t.insert(format!("{}.{name}", state_kind(spec)), part);
                }
            }
        }
        let counters = [
            ("cellgraph.updates", self.updates as i64),
            ("cellgraph.window_micro", self.window_micro as i64),
            ("cellgraph.window_items", self.window_items as i64),
            ("cellgraph.micro_steps", self.counters.micro_steps as i64),
            ("cellgraph.optimizer_runs", self.counters.optimizer_runs as i64),
            ("cellgraph.clear_runs", self.counters.clear_runs as i64),
        ];
        for (k, v) in counters {
            t.insert(k.into(), HostTensor { shape: vec![], data: HostData::I64(vec![v]) });
        }
        t
    }

    /// Loads a snapshot, or a checkpoint of the network's parameters alone (MindSpore's
    /// `load_param_into_net(net, params, strict_load=True)`): every parameter of the network
    /// must be there with its shape, optimizer state and accumulators come all or none per kind
    /// (`moments.*`), and names the session does not know are an error. Nothing is changed
    /// unless everything checks.
    pub fn restore(&mut self, tensors: &crate::checkpoint::Tensors) -> Result<()> {
        self.restore_with(tensors, true).map(|_| ())
    }

    /// [`Self::restore`]; with `strict = false` (`strict_load=False`) missing parameters keep
    /// their values and unknown tensors are skipped, both reported.
    pub fn restore_with(&mut self, tensors: &crate::checkpoint::Tensors, strict: bool) -> Result<LoadReport> {
        use std::collections::{BTreeMap, BTreeSet};
        let tensors = &self.shard_state_from(tensors)?;
        let known: BTreeSet<String> = self.session.param_names().into_iter().collect();
        let network: BTreeSet<String> = self.net.parameters().into_iter().map(|p| p.name).collect();
        let mut report = LoadReport::default();
        let mut counters = Vec::new();
        let mut values = Vec::new();
        for (name, t) in tensors {
            if let Some(counter) = name.strip_prefix("cellgraph.") {
                counters.push((counter, t.scalar() as u64));
            } else if known.contains(name) {
                let have = self.session.param(name).expect("known").shape;
                if have != t.shape {
                    return Err(RuntimeError::Mismatch {
                        what: format!("checkpoint tensor `{name}`"),
                        expected: format!("shape {have:?}"),
                        got: format!("shape {:?}", t.shape),
                    });
                }
                values.push((name, t));
            } else if !matches!(name.as_str(), "global_step" | "learning_rate" | "epoch_num" | "step_num") {
                report.unused.push(name.clone());
            }
        }
        report.missing = network.iter().filter(|n| !tensors.contains_key(*n)).cloned().collect();
        // Optimizer state and accumulators: all or none of each kind.
        let mut kinds: BTreeMap<&str, (usize, Vec<&str>)> = BTreeMap::new();
        for n in known.iter().filter(|n| !network.contains(*n)) {
            let e = kinds.entry(n.split('.').next().unwrap_or(n)).or_default();
            match tensors.contains_key(n) {
                true => e.0 += 1,
                false => e.1.push(n),
            }
        }
        let partial: Vec<String> = kinds.iter().filter(|(_, (have, miss))| *have > 0 && !miss.is_empty()).flat_map(|(_, (_, m))| m.iter().map(|s| s.to_string())).collect();
        if strict {
            let list = |v: &[String]| {
                let shown: Vec<&str> = v.iter().take(8).map(String::as_str).collect();
                let more = if v.len() > 8 { format!(" and {} more", v.len() - 8) } else { String::new() };
                format!("{}{more}", shown.join(", "))
            };
            let mut problems = Vec::new();
            if !report.missing.is_empty() {
                problems.push(format!("it lacks {} of the network's {} parameters: {}", report.missing.len(), network.len(), list(&report.missing)));
            }
            if !partial.is_empty() {
                problems.push(format!("it has only part of the optimizer state; missing: {}", list(&partial)));
            }
            if !report.unused.is_empty() {
                problems.push(format!("it holds tensors this network does not have: {}", list(&report.unused)));
            }
            if !problems.is_empty() {
                return Err(RuntimeError::Invalid {
                    what: "checkpoint".into(),
                    detail: format!("{} (a checkpoint of another network? load it non-strictly to skip them: strict_load=False)", problems.join("; ")),
                });
            }
        }
        report.missing.extend(partial);
        for (counter, v) in counters {
            match counter {
                "updates" => self.updates = v,
                "window_micro" => self.window_micro = v as usize,
                "window_items" => self.window_items = v as usize,
                "micro_steps" => self.counters.micro_steps = v,
                "optimizer_runs" => self.counters.optimizer_runs = v,
                "clear_runs" => self.counters.clear_runs = v,
                _ => {}
            }
        }
        for (name, t) in values {
            self.session.set_param(name, t);
            report.loaded.push(name.clone());
        }
        if self.flat.is_some() {
            // The restored values replaced views: pack them into new flat buffers.
            self.enter_flat()?;
        }
        Ok(report)
    }

    /// With hsdp: replaces unsharded optimizer state (`moments.fc1.weight`, ...) by this
    /// rank's slice of it (`moments.hsdp.shard`); otherwise returns the tensors unchanged.
    fn shard_state_from(&self, tensors: &crate::checkpoint::Tensors) -> Result<crate::checkpoint::Tensors> {
        let mut out = tensors.clone();
        let Some((comm, shard)) = self.parallel.as_ref().and_then(|p| Some((&p.comm, p.shard.as_ref()?))) else {
            return Ok(out);
        };
        for spec in &shard.shard_state {
            let names: Vec<String> = self.trained.iter().map(|(n, _)| format!("{}.{n}", state_kind(spec))).collect();
            if !names.iter().any(|n| out.contains_key(n)) {
                continue;
            }
            let mut flat = Vec::new();
            for n in &names {
                let t = out.remove(n).ok_or_else(|| RuntimeError::Mismatch { what: "checkpoint".into(), expected: format!("optimizer state `{n}`"), got: "nothing".into() })?;
                flat.extend(t.to_f32());
            }
            let mine = shard_of(&flat, comm.rank(), shard.len, spec.init as f32);
            out.insert(spec.name.clone(), HostTensor::f32(vec![shard.len], mine).expect("len"));
        }
        Ok(out)
    }

    fn clear_window(&mut self, cleared: bool) -> Result<()> {
        if self.flat.is_some() {
            if !cleared {
                self.upload_flat(Kind::Accu, &vec![0.0; self.total()]);
            }
        } else {
            self.session.run(&self.clear, &[])?;
        }
        self.counters.clear_runs += 1;
        self.window_micro = 0;
        self.window_items = 0;
        Ok(())
    }

    /// One training step. In-step slicing: the batch is split into `micro_size` equal
    /// micro-batches (a size `micro_size` does not divide is an error, as in MindSpore) and the
    /// window applied; the loss is their sum. Across steps: the batch is one micro-batch, and
    /// the window is applied when it is full.
    pub fn step(&mut self, batch: &[HostTensor]) -> Result<StepOutcome> {
        let b = batch.first().and_then(|t| t.shape.first().copied()).unwrap_or(0);
        if self.net.slicing == Slicing::InStep {
            self.net.check_batch(b)?;
        }
        self.step_split(batch, b)
    }

    /// The last batch of an epoch, which may be shorter than the others (a dataset without
    /// `drop_remainder`, or a wrapped shard). With in-step slicing a size that `micro_size`
    /// does not divide is split into `min(micro_size, items)` micro-batches whose sizes differ
    /// by at most one, larger first (11 items, `micro_size` 4: 3, 3, 3, 2); the normalisation
    /// counts the micro-batches and items the window really had. Otherwise as [`Self::step`].
    pub fn step_last(&mut self, batch: &[HostTensor]) -> Result<StepOutcome> {
        let b = batch.first().and_then(|t| t.shape.first().copied()).unwrap_or(0);
        self.step_split(batch, b)
    }

    fn step_split(&mut self, batch: &[HostTensor], b: usize) -> Result<StepOutcome> {
        let k = self.net.micro_size;
        if b == 0 {
            return Err(RuntimeError::Mismatch { what: "training batch".into(), expected: "at least one item".into(), got: "an empty batch".into() });
        }
        match self.net.slicing {
            Slicing::InStep => {
                let mut loss = 0.0;
                for (start, end) in micro_ranges(b, k) {
                    let micro: Vec<HostTensor> = batch.iter().map(|t| slice_rows(t, start, end)).collect();
                    loss += self.micro_step(&micro)?;
                }
                self.apply()?;
                Ok(StepOutcome { loss, applied: true })
            }
            Slicing::AcrossSteps => {
                let loss = self.micro_step(batch)?;
                let applied = self.window_micro == k;
                if applied {
                    self.apply()?;
                }
                Ok(StepOutcome { loss, applied })
            }
        }
    }

    /// At the end of the data: an incomplete window is applied with its true counts, or
    /// dropped (accumulators cleared, no update) when the network asks for that. Returns
    /// whether an update was applied.
    pub fn finish(&mut self) -> Result<bool> {
        if self.window_micro == 0 {
            return Ok(false);
        }
        if self.net.drop_incomplete_window {
            self.clear_window(false)?;
            return Ok(false);
        }
        self.apply()?;
        Ok(true)
    }
}

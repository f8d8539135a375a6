//! Compiling a graph to an executable plan, and running it.
//!
//! [`compile`] runs the pass pipeline, verifies, and lowers the graph to a flat schedule of
//! steps in topological order. Each step knows, for every operand, whether this is the
//! operand's last use: then its slot is freed after the step (on device backends the value
//! is moved into the op, so the backend can reuse its buffer in place; on host backends the
//! op borrows it and its buffer goes back to the session's [`Arena`], which the next
//! value of its length is written into). Results and parameter writes are kept to the end.
//! The plan's memory is known when it is compiled: [`Executable::arena`] lists how many
//! buffers of each length its values hold at once, so a steady-state run on a host backend
//! allocates no tensor memory. A [`Session`] holds parameter values on one device and runs
//! plans; `assign`/`assign_add` writes land when the plan finishes (on host backends an
//! accumulator read only by its `assign_add` is added into in place).

use std::collections::BTreeMap;

use crate::Backend;
use burn_backend::tensor::Device;
use burn_backend::TensorData;
use cellgraph_compiler::{HostData, HostTensor, Op, TensorType};

mod bind;
mod capture;
mod listing;
mod plan;
mod run;

pub use bind::HostRun;
pub use bind::KeptF32;
use bind::{Binding, Declined, Exec};
pub use listing::{Bf16Products, Bf16Unit, HostStep, LowStorage};
use plan::Step;
pub use plan::{compile, compile_unfused, compile_with, compile_with_options, DumpAt, Executable};
use run::{record, since, Work};

use crate::arena::Arena;
use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::host::Kept;
use crate::kernel::Native;
use crate::lower::{eval, Ctx};
use crate::replay::Graphs;
use crate::value::{settings, Value};

/// What [`Session::run_here`] checks each step's transfers for.
#[derive(Debug, PartialEq, Eq)]
enum Watch {
    Off,
    /// A replayed plan's first run: the first step that reads or uploads (its message).
    Probe(Option<String>),
    /// A capture: the first step that reads, uploads or allocates (its message).
    Capture(Option<String>),
}

/// Parameter values on one device, and the plans that read and write them.
pub struct Session<B: Backend> {
    device: Device<B>,
    params: BTreeMap<String, Value<B>>,
    /// Per-op `(calls, seconds)` when profiling is on.
    profile: Option<BTreeMap<&'static str, (u64, f64)>>,
    /// The same per kind of step (op, output type and program): see [`Self::profile_steps`].
    step_profile: Option<BTreeMap<String, (u64, f64)>>,
    /// Profiling waits for the device after each op (see [`Self::set_device_profiling`]).
    profile_sync: bool,
    /// Run hot ops on the host kernels where the backend allows (see [`crate::host`]).
    native: bool,
    /// `assign_add` writes into the accumulator's memory (see [`Self::set_in_place_accumulation`]).
    in_place: bool,
    /// Device matmuls and convolutions may use TF32 tensor cores (see [`Self::set_tf32`]).
    tf32: bool,
    /// Host products the plan chose to run on bf16 pairs do (see [`Self::set_bf16_products`]).
    bf16: bool,
    /// What the host kernels keep between the steps of a run (max pools' argmax).
    kept: Kept,
    /// The memory host kernels write values into (see [`Executable::arena`]).
    arena: Arena,
    /// A run's value slots, kept for the next run.
    slots: Vec<Option<Value<B>>>,
    /// On device backends, the constants plans share (`(value bits, type)`): made once, so a
    /// step's constant (a loss's seed) is no launch after the first run. Held here, so burn's
    /// ops never write into them in place.
    constants: Vec<((u64, TensorType), Value<B>)>,
    /// The float type values are made in: f32, or f64 for reference runs ([`Self::new_f64`]).
    float: burn_backend::FloatDType,
    /// [`Self::run_replayed`] captures and replays (see [`crate::replay`]).
    replay: bool,
    /// The captured plans.
    graphs: Graphs<B>,
    /// What each step's transfers are checked for (see [`Watch`]).
    watch: Watch,
    /// Steps that computed on burn's ops (no bound kernel ran), by op: see
    /// [`Self::burn_op_steps`].
    burn_steps: BTreeMap<&'static str, u64>,
    /// How each step of a plan runs, by plan and by the settings it depends on (`native`,
    /// `in_place`): decided at a plan's first run (see [`bind`]).
    execs: BTreeMap<(u64, bool, bool, bool, bool), std::sync::Arc<Binding>>,
    /// A device stores a low-precision plan's values in bf16 / f16 where its kernels read and
    /// write them (see [`Self::set_low_precision_storage`]).
    low_storage: bool,
}

/// A capture's graph, the run's outputs, the pins on the buffers its arena held, and why it
/// cannot be replayed (if so).
type Captured<B> = (burn_backend::BackendGraph<B>, Vec<Value<B>>, Vec<Box<dyn std::any::Any + Send>>, Option<String>);

impl<B: Backend> Session<B> {
    /// An empty session on `device`.
    pub fn new(device: Device<B>) -> Self {
        Self::with_float(device, burn_backend::FloatDType::F32)
    }

    /// An empty session on `device` computing in f64 (host backends: reference runs and
    /// gradient checks; its inputs and parameters are widened to f64 when they are bound).
    pub fn new_f64(device: Device<B>) -> Self {
        Self::with_float(device, burn_backend::FloatDType::F64)
    }

    /// An empty session on `device` making its float values as `float`.
    pub fn with_float(device: Device<B>, float: burn_backend::FloatDType) -> Self {
        Session {
            device,
            params: BTreeMap::new(),
            profile: None,
            step_profile: None,
            profile_sync: false,
            native: true,
            in_place: false,
            tf32: false,
            bf16: true,
            kept: Kept::default(),
            arena: Arena::default(),
            slots: Vec::new(),
            constants: Vec::new(),
            float,
            replay: false,
            graphs: Graphs::default(),
            watch: Watch::Off,
            burn_steps: BTreeMap::new(),
            execs: BTreeMap::new(),
            low_storage: true,
        }
    }

    /// The float type the session computes in.
    pub fn float(&self) -> burn_backend::FloatDType {
        self.float
    }

    /// The dtypes the session's values are made in (see [`settings`]).
    pub fn settings(&self) -> burn_backend::DeviceSettings {
        settings::<B>(&self.device, self.float)
    }

    /// Buffers the session's arena has allocated because none of their length was free: after
    /// a plan's first runs, a steady state adds none.
    pub fn fresh_buffers(&self) -> u64 {
        self.arena.fresh()
    }

    /// Turns per-op wall-clock profiling on or off (off by default; on CPU backends the times
    /// are exact, on asynchronous backends they measure launch cost).
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(BTreeMap::new);
        self.step_profile = on.then(BTreeMap::new);
        self.profile_sync = false;
    }

    /// Per-op profiling that waits for the device after each op, so that on asynchronous
    /// backends an op's time is its launch and its kernels' run (plus one wait each): where a
    /// device step goes, at the cost of the overlap between host and device.
    pub fn set_device_profiling(&mut self, on: bool) {
        self.set_profiling(on);
        self.profile_sync = on;
    }

    /// Chooses between the host kernels (the default, where the backend keeps tensors in host
    /// memory) and burn's generic ops for every op; both give the same results to rounding.
    pub fn set_native_kernels(&mut self, on: bool) {
        self.native = on;
    }

    /// Lets device matmuls and convolutions round their operands to TF32 and run on tensor
    /// cores (off by default: every backend multiplies in exact f32). Like PyTorch's `allow_tf32`: about
    /// 1e-3 relative error on a product (10 mantissa bits), so results no longer equal the
    /// CPU's to 1e-5. Host backends ignore it.
    pub fn set_tf32(&mut self, on: bool) {
        self.tf32 = on;
    }

    /// Lets host products whose operands the precision pass rounded to bf16 multiply bf16
    /// pairs with f32 sums on the CPU's AVX-512 BF16 instructions, where the plan chose them
    /// ([`crate::kernel::Products::Bf16`]; on by default). Off, they run on the f32 GEMM: the
    /// emulation of bf16 compute, the same products summed in another order. Device backends
    /// and f32 plans ignore it.
    pub fn set_bf16_products(&mut self, on: bool) {
        if on != self.bf16 {
            // Dense filters built from a parameter the bf16 products rounded themselves
            // ([`Self::steps`]' `rounded when packed`) are not the f32 products' operands.
            self.kept.forget_all();
        }
        self.bf16 = on;
    }

    /// The steps this session computed on burn's ops because no bound kernel ran them, by op
    /// and count (reshapes, which move no values, are not counted): on host backends exactly
    /// the plans' [`HostRun::BurnOps`] steps; on devices also the ops they have no kernel for,
    /// and as `epilogue` an epilogue's program run on burn's ops after its head's kernel.
    pub fn burn_op_steps(&self) -> &BTreeMap<&'static str, u64> {
        &self.burn_steps
    }

    /// Makes `assign_add` write into the accumulator's own memory where the backend can (its
    /// accumulators are then views of one flat buffer; see [`Backend::flat_buffers`]).
    pub fn set_in_place_accumulation(&mut self, on: bool) {
        self.in_place = on;
    }

    /// Gives a value a plan returned (and the caller no longer needs) back to the session's
    /// memory, for later runs to write into; dropped if anything else still holds it.
    pub fn give_back(&mut self, v: Value<B>) {
        v.give_back(&mut self.arena);
    }

    /// Sets a parameter to a device value (a view of a flat buffer, say).
    pub fn set_value(&mut self, name: &str, value: Value<B>) {
        self.graphs.forget(name);
        self.put(name, value);
    }

    /// Sets parameter `name` from the host: while graphs are on, into its own buffer where the
    /// backend writes into one (a device's contiguous buffer of the value's type and length:
    /// [`Backend::write_float`]), so the captured graphs that read it stay; elsewhere as
    /// [`Self::set_param_owned`] (which forgets them). An hsdp boundary writes every rank's
    /// gathered parameters so each window: a new buffer made every micro-step graph forget
    /// itself (no replay with hsdp). Only with graphs on, where a parameter always has a buffer
    /// of its own (no plan output or other parameter shares it), is writing it in place safe.
    pub fn write_param(&mut self, name: &str, value: HostTensor) {
        let value = match (self.params.get(name), value) {
            (Some(held @ Value::Float(t)), HostTensor { shape, data: HostData::F32(v) }) if self.replay && held.dims() == shape => {
                match B::write_float(t, TensorData::new(v, shape.clone())) {
                    Ok(()) => {
                        crate::value::count_upload();
                        self.kept.forget(name);
                        return;
                    }
                    Err(d) => HostTensor { shape, data: HostData::F32(d.try_into_vec::<f32>().expect("written as f32")) },
                }
            }
            (_, value) => value,
        };
        self.set_param_owned(name, value);
    }

    /// Takes a parameter's value out of the session (put it back with [`Self::set_value`]).
    pub fn take_value(&mut self, name: &str) -> Option<Value<B>> {
        self.graphs.forget(name);
        self.pull(name)
    }

    /// Every write of a parameter goes through here or [`Self::pull`]: what the host kernels
    /// derived from its old value ([`Kept::forget`]) is dropped with it.
    fn put(&mut self, name: &str, value: Value<B>) -> Option<Value<B>> {
        self.kept.forget(name);
        self.params.insert(name.to_string(), value)
    }

    /// Takes a parameter out of the session (see [`Self::put`]).
    fn pull(&mut self, name: &str) -> Option<Value<B>> {
        self.kept.forget(name);
        self.params.remove(name)
    }

    /// A parameter's device value.
    pub fn value(&self, name: &str) -> Option<&Value<B>> {
        self.params.get(name)
    }

    /// `(op, calls, seconds)` collected since profiling was switched on, slowest first.
    pub fn profile(&self) -> Vec<(&'static str, u64, f64)> {
        let mut v: Vec<_> = self.profile.iter().flatten().map(|(k, &(n, t))| (*k, n, t)).collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    }

    /// [`Self::profile`] per kind of step: `("op type program", calls, seconds)`, slowest
    /// first, e.g. `fused f32[8,128,512] $0 0.5 mul $1 mul` (the program for fused ops and
    /// epilogues): which of the plan's steps the time goes to.
    pub fn profile_steps(&self) -> Vec<(String, u64, f64)> {
        let mut v: Vec<_> = self.step_profile.iter().flatten().map(|(k, &(n, t))| (k.clone(), n, t)).collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    }

    /// The `top` slowest ops ([`Self::profile`]), then under "slowest kinds of step (op, output,
    /// program):" the `top` slowest kinds of step ([`Self::profile_steps`]), one per line, as
    /// the programs print them; empty when profiling is off.
    pub fn profile_table(&self, top: usize) -> String {
        let mut s = String::new();
        for (op, calls, t) in self.profile().into_iter().take(top) {
            s += &format!("{op:>28} {calls:>8} calls {:>10.1} ms\n", t * 1e3);
        }
        for (i, (step, calls, t)) in self.profile_steps().into_iter().take(top).enumerate() {
            if i == 0 {
                s += "slowest kinds of step (op, output, program):\n";
            }
            s += &format!("{:>10.1} ms {calls:>8} calls  {step}\n", t * 1e3);
        }
        s
    }

    /// The device.
    pub fn device(&self) -> &Device<B> {
        &self.device
    }

    /// Sets (or replaces) a parameter's value.
    pub fn set_param(&mut self, name: &str, value: &HostTensor) {
        self.set_param_owned(name, value.clone());
    }

    /// [`Self::set_param`], keeping `value`'s memory (a host backend's) instead of a copy.
    pub fn set_param_owned(&mut self, name: &str, value: HostTensor) {
        let v = Value::from_host_owned(value, &self.device, &self.settings());
        self.graphs.forget(name);
        self.put(name, v);
    }

    /// Draws every parameter's first value from `seed` (see `cellgraph_cells::materialize`).
    pub fn init_params(&mut self, params: &[cellgraph_cells::Parameter], seed: u64) {
        for p in params {
            self.set_param_owned(&p.name, p.materialize(seed));
        }
    }

    /// Sets optimizer state (or accumulators) to their initial constants.
    pub fn init_state(&mut self, state: &[cellgraph_compiler::update::StateSpec]) {
        for s in state {
            self.set_param_owned(&s.name, HostTensor::full(&s.ty, s.init));
        }
    }

    /// Drops a parameter's value.
    pub fn remove_param(&mut self, name: &str) {
        self.graphs.forget(name);
        self.pull(name);
    }

    /// A parameter's extents (without copying it).
    pub fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.params.get(name).map(|v| v.dims())
    }

    /// A parameter's value, copied to the host.
    pub fn param(&self, name: &str) -> Option<HostTensor> {
        self.params.get(name).map(|v| v.to_host())
    }

    /// Names of every parameter held, sorted.
    pub fn param_names(&self) -> Vec<String> {
        self.params.keys().cloned().collect()
    }

    /// Every parameter copied to the host, by name.
    pub fn params_host(&self) -> BTreeMap<String, HostTensor> {
        self.params.iter().map(|(k, v)| (k.clone(), v.to_host())).collect()
    }

    fn bind_param(&self, name: &str, ty: &TensorType) -> Result<Value<B>> {
        let v = self.params.get(name).ok_or_else(|| RuntimeError::MissingParam(name.into()))?;
        let dims = v.dims();
        let want = crate::backend::bshape(ty.dims()).to_vec();
        if dims != want {
            return Err(RuntimeError::Mismatch {
                what: format!("parameter `{name}`"),
                expected: ty.to_string(),
                got: format!("a value of shape {dims:?}"),
            });
        }
        Ok(v.clone())
    }

    /// Runs a plan on host inputs (in input-index order) and returns its outputs on the host.
    ///
    /// On a host backend with several rayon threads the plan runs on one of rayon's threads:
    /// its kernels cut their work into jobs for the pool, and a pool thread works through its
    /// kernels' jobs itself while the others take what they can, where a thread outside the
    /// pool would hand each kernel's jobs over and sleep until they were done.
    pub fn run(&mut self, exe: &Executable, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        self.run_over(exe, inputs, None)
    }

    /// [`Self::run`], with the plan's collectives (`all_reduce`) summing over `comm`'s ranks;
    /// every rank must run the same plan together. Without a communicator ([`Self::run`]) a
    /// collective sums over a world of one: it passes its operand on.
    pub fn run_over(&mut self, exe: &Executable, inputs: &[HostTensor], comm: Option<&dyn Communicator>) -> Result<Vec<HostTensor>> {
        self.run_mapped(exe, inputs, comm, &|v, ty| {
            let mut h = v.to_host();
            h.shape = ty.dims().to_vec();
            h
        })
    }

    /// [`Self::run`], leaving the outputs on the device: the run itself reads nothing back
    /// (labels are checked on the host before they are uploaded; see
    /// [`crate::value::device_reads`]).
    pub fn run_device(&mut self, exe: &Executable, inputs: &[HostTensor]) -> Result<Vec<Value<B>>> {
        self.run_device_over(exe, inputs, None)
    }

    /// [`Self::run_device`] with the plan's collectives over `comm` (see [`Self::run_over`]).
    /// A collective reads its operand back to the host.
    pub fn run_device_over(&mut self, exe: &Executable, inputs: &[HostTensor], comm: Option<&dyn Communicator>) -> Result<Vec<Value<B>>> {
        self.run_mapped(exe, inputs, comm, &|v, _| v.clone())
    }

    fn run_mapped<T: Send>(
        &mut self,
        exe: &Executable,
        inputs: &[HostTensor],
        comm: Option<&dyn Communicator>,
        out: &(dyn Fn(&Value<B>, &TensorType) -> T + Sync),
    ) -> Result<Vec<T>> {
        // Collectives are called from the thread that runs the plan: MPI wants the thread
        // that initialised it, so a plan with collectives never moves to rayon's pool.
        let comm = comm.filter(|c| c.size() > 1 && exe.collectives > 0);
        if comm.is_none() && B::HOST && rayon::current_thread_index().is_none() && rayon::current_num_threads() > 1 {
            return rayon::scope(|_| self.run_here(exe, inputs, None, None, out));
        }
        self.run_here(exe, inputs, None, comm, out)
    }

    /// What the device's kernels will not run of `st`'s bound kernel, and why: the whole step
    /// ([`Backend::device_declines`]; every step of an f64 session, the device's kernels being
    /// f32), or an epilogue's program ([`Backend::device_declines_program`]). Nothing on host
    /// backends, for steps without a kernel, and where the device runs it all.
    fn declines(&self, st: &Step) -> Declined {
        let Some(k) = st.kernel.as_ref().filter(|_| !B::HOST) else {
            return Declined::Nothing;
        };
        if self.float != burn_backend::FloatDType::F32 {
            return Declined::Step("an f64 session: the device's kernels compute in f32".into());
        }
        if let Some(why) = B::device_declines(k, &st.arg_types, &st.ty, st.ids_checked, &self.device) {
            return Declined::Step(why);
        }
        match k {
            Native::Epilogue { post, .. } => B::device_declines_program(post).map_or(Declined::Nothing, Declined::Program),
            _ => Declined::Nothing,
        }
    }

    /// How each step of `exe` runs with the session's settings, and the type each value is
    /// stored in, decided at the plan's first run with them (a session holds the decisions of
    /// its last 256 plans).
    fn execs(&mut self, exe: &Executable) -> std::sync::Arc<Binding> {
        let key = (exe.id, self.native, self.in_place, self.low_storage, self.bf16);
        if let Some(b) = self.execs.get(&key) {
            return b.clone();
        }
        if self.execs.len() >= 256 {
            self.execs.clear();
        }
        let execs = self.decide(exe);
        let (stores, kept_f32) = self.low_stores(exe, &execs);
        let b = std::sync::Arc::new(Binding { execs, stores, kept_f32 });
        self.execs.insert(key, b.clone());
        b
    }

    /// How each step of `exe` runs with the session's settings ([`Self::execs`] keeps it).
    fn decide(&self, exe: &Executable) -> Vec<Exec> {
        let mut execs: Vec<Exec> = exe
            .steps
            .iter()
            .map(|st| match self.rounded_when_packed(st) {
                true => Exec::Pass(0),
                false => bind::exec_of(st, B::HOST, self.native, self.in_place, &self.declines(st)),
            })
            .collect();
        // A step whose work its operand's step does in the same kernel on the host
        // ([`plan::Step::merged`]).
        for (i, st) in exe.steps.iter().enumerate() {
            match st.merged_into {
                Some(j) if B::HOST && execs[j] == Exec::Kernel && execs[i] == Exec::Kernel => {
                    (execs[j], execs[i]) = (Exec::Merged, Exec::Pass(0));
                }
                _ => {}
            }
        }
        execs
    }

    /// Whether `st`, a parameter's bf16 copy that only bf16 products read
    /// ([`plan::Step::rounded_when_packed`]), is skipped in this session: on the host kernels in
    /// f32 with bf16 products on, the products get the parameter and round it as they pack it
    /// (the same bits; a window's micro-steps no longer each write a rounded copy of every
    /// weight). With f32 products (the emulation) or f64, the copy is made.
    fn rounded_when_packed(&self, st: &plan::Step) -> bool {
        st.rounded_when_packed && B::HOST && self.native && self.bf16 && self.float == burn_backend::FloatDType::F32
    }

    /// Which of `exe`'s values this session stores in bf16 / f16 (see [`bind::low_stores`]),
    /// and why the others of its low-precision values stay f32: none on host backends, with
    /// low-precision storage off, and on f32 plans.
    fn low_stores(&self, exe: &Executable, execs: &[Exec]) -> (Vec<Option<TensorType>>, KeptF32) {
        let none = |why: String| {
            let held = exe.steps.iter().filter(|st| st.holds.is_some() && !matches!(st.op, Op::Reshape { .. } | Op::Flatten)).count();
            (vec![None; exe.steps.len()], if held > 0 { KeptF32::from([(why, held)]) } else { KeptF32::new() })
        };
        if B::HOST {
            return none("host kernels store f32".into());
        }
        if !self.low_storage || self.float != burn_backend::FloatDType::F32 {
            return none("low-precision storage off".into());
        }
        match exe.steps.iter().find_map(|st| st.holds) {
            Some(d) if !B::stores_low(d, &self.device) => return none(format!("no {d} kernels on this device")),
            _ => {}
        }
        let pinned: Vec<usize> = exe.outputs.iter().copied().chain(exe.writes.iter().map(|w| w.1)).collect();
        bind::low_stores(&exe.steps, execs, &pinned, |d| B::stores_low(d, &self.device), |st| self.tf32 || (self.bf16 && st.bf16_operands))
    }

    /// Runs `exe` on this thread. `bound`: the inputs' device buffers (replay's), instead of
    /// uploading `inputs` (whose types are still checked).
    fn run_here<T>(
        &mut self,
        exe: &Executable,
        inputs: &[HostTensor],
        bound: Option<&[Value<B>]>,
        comm: Option<&dyn Communicator>,
        out: &dyn Fn(&Value<B>, &TensorType) -> T,
    ) -> Result<Vec<T>> {
        exe.check_inputs(inputs)?;
        let mut slots = std::mem::take(&mut self.slots);
        slots.clear();
        slots.resize(exe.slots, None);
        self.kept.begin_run();
        self.arena.size_for(&exe.arena);
        let s = self.settings();
        // With graphs on, a parameter stays in the buffer it is in (a captured graph reads and
        // writes that buffer): the buffers the plan's writes replace, held from the start.
        let stay: Vec<Option<Value<B>>> = match self.replay && !B::HOST {
            true => exe.writes.iter().map(|(n, _)| self.params.get(n).cloned()).collect(),
            false => Vec::new(),
        };
        let binding = self.execs(exe);
        for ((step, &exec), store) in exe.steps.iter().zip(binding.execs.iter()).zip(binding.stores.iter()) {
            let before = (self.watch != Watch::Off).then(|| (crate::value::device_reads(), crate::value::device_uploads(), self.arena.fresh()));
            let v = match (exec, &step.op) {
                (Exec::Deferred, _) => continue,
                (Exec::Param, Op::Parameter { name }) => self.bind_param(name, &step.ty)?,
                (Exec::Input, Op::Input { index, name }) => self.input(step, (*index, name), inputs, bound, s)?,
                (Exec::SharedConstant, Op::Constant { value }) => self.shared_constant(step, *value, s)?,
                (Exec::Collective, _) if comm.is_some() => {
                    let x = slots[step.args[0].0].as_ref().expect("operands are computed before use");
                    self.all_reduce(step, x, comm.expect("matched"), s)
                }
                (exec, _) => self.compute(step, exec, store.as_ref(), &mut slots, s)?,
            };
            if let Some(counts) = before {
                self.check_capturable(step, counts);
            }
            for slot in step.args.iter().filter(|(_, moved)| *moved).map(|(s, _)| *s).chain(step.frees.iter().copied()) {
                if let Some(v) = slots[slot].take() {
                    v.give_back(&mut self.arena);
                }
            }
            slots[step.slot] = Some(v);
        }
        self.write_back(exe, &slots, stay)?;
        let outputs = exe
            .outputs
            .iter()
            .map(|&o| out(slots[o].as_ref().expect("outputs are pinned"), exe.graph.ty(cellgraph_compiler::NodeId(o as u32))))
            .collect();
        for v in slots.iter_mut().filter_map(Option::take) {
            v.give_back(&mut self.arena);
        }
        self.slots = slots;
        Ok(outputs)
    }

    /// Input `index` (`name`) of a run, checked against the plan's type: copied into the arena
    /// (host), the replay's buffer (`bound`), or uploaded.
    fn input(
        &mut self,
        step: &Step,
        (index, name): (usize, &str),
        inputs: &[HostTensor],
        bound: Option<&[Value<B>]>,
        s: burn_backend::DeviceSettings,
    ) -> Result<Value<B>> {
        let given = &inputs[index];
        if given.ty() != step.ty {
            return Err(RuntimeError::Mismatch {
                what: format!("input {index} (`{name}`)"),
                expected: step.ty.to_string(),
                got: given.ty().to_string(),
            });
        }
        let copied = if B::HOST { crate::host::input::<B>(given, s.float_dtype, &mut self.arena, &self.device) } else { None };
        Ok(match (copied, bound) {
            (Some(t), _) => Value::Float(t),
            (None, Some(b)) => b[index].clone(),
            (None, None) => Value::from_host(given, &self.device, &s),
        })
    }

    /// A constant the device's plans share: made at its first use, then the same value.
    fn shared_constant(&mut self, step: &Step, value: f64, s: burn_backend::DeviceSettings) -> Result<Value<B>> {
        let key = (value.to_bits(), step.ty.clone());
        if let Some((_, v)) = self.constants.iter().find(|(k, _)| *k == key) {
            return Ok(v.clone());
        }
        let cx = Ctx {
            device: &self.device,
            settings: s,
            scope: &step.scope,
            op: step.op.label(),
            in_place: self.in_place,
            ids_checked: false,
            tf32: self.tf32,
            bf16: self.bf16,
        };
        let v = eval(&cx, &step.op, Vec::new(), &step.ty)?.unpitched(&mut self.arena);
        self.constants.push((key, v.clone()));
        Ok(v)
    }

    /// `all_reduce` of `x` over the run's communicator `c` (through the host).
    fn all_reduce(&mut self, step: &Step, x: &Value<B>, c: &dyn Communicator, s: burn_backend::DeviceSettings) -> Value<B> {
        let t0 = self.profile.is_some().then(std::time::Instant::now);
        let mut sum = x.to_host().to_f32();
        c.all_reduce_sum(&mut sum);
        let sum = HostTensor::f32(step.ty.dims().to_vec(), sum).expect("the operand's extents");
        record(&mut self.profile, || step.op.label(), since(t0));
        Value::from_host_owned(sum, &self.device, &s)
    }

    /// A computing step (`exec`) over its operands in `slots`: those at their last use taken,
    /// the others lent; timed into the profiles when profiling is on.
    fn compute(
        &mut self,
        step: &Step,
        exec: Exec,
        store: Option<&TensorType>,
        slots: &mut [Option<Value<B>>],
        s: burn_backend::DeviceSettings,
    ) -> Result<Value<B>> {
        if let Some(name) = &step.target {
            let target = step.args[0].0;
            if slots[target].is_none() {
                // A deferred read: check it, then take it out of the session.
                self.bind_param(name, &step.arg_types[0])?;
                slots[target] = self.pull(name);
            }
        }
        // On host backends a step done in its first operand's memory takes that operand at
        // its last use; the others are lent and their buffers taken back after the step (by
        // the caller). Device ops take operands at their last use.
        let takes_first = matches!(exec, Exec::ReshapeInPlace | Exec::AddInPlace);
        let args: Vec<_> = step
            .args
            .iter()
            .zip(&step.arg_types)
            .enumerate()
            .map(|(k, (&(slot, moved), ty))| {
                let take = moved && (!B::HOST || (takes_first && k == 0));
                let v = if take { slots[slot].take() } else { slots[slot].clone() };
                (v.expect("operands are computed before use"), ty)
            })
            .collect();
        // With graphs on, device operands at their last use that burn's ops may consume (a
        // burn op drops what it does not write into): held here and given back to the arena
        // after the step, so a run returns every buffer it took and the next run takes none
        // new (what a capture needs). Off, burn may write into them in place, as before.
        let held: Vec<Value<B>> = match self.replay && !B::HOST {
            true => step.args.iter().zip(&args).filter(|((_, moved), _)| *moved).map(|(_, (v, _))| v.clone()).collect(),
            false => Vec::new(),
        };
        let op = &step.op;
        let t0 = self.profile.is_some().then(std::time::Instant::now);
        let cx = Ctx {
            device: &self.device,
            settings: s,
            scope: &step.scope,
            op: op.label(),
            in_place: self.in_place,
            ids_checked: step.ids_checked,
            // A device product of bf16 values on tensor cores: TF32 holds them exactly.
            tf32: self.tf32 || (self.bf16 && step.bf16_operands),
            bf16: self.bf16,
        };
        let mut work = Work { native: self.native, kept: &mut self.kept, arena: &mut self.arena, burn_steps: &mut self.burn_steps };
        let v = run::compute(exec, &cx, step, args, store, &mut work)?;
        if t0.is_some() && self.profile_sync {
            B::sync(&self.device).map_err(|e| RuntimeError::Device(format!("{}: {}: waiting for the device: {e:?}", step.scope, op.label())))?;
        }
        // The step's time, taken before its kind's name is formatted.
        let secs = since(t0);
        let kind = || {
            let program = match op {
                Op::Fused { expr } | Op::Epilogue { expr, .. } => format!(" {expr}"),
                _ => String::new(),
            };
            format!("{} {}{program}", op.label(), step.ty)
        };
        record(&mut self.step_profile, kind, secs);
        record(&mut self.profile, || op.label(), secs);
        for h in held {
            h.give_back(&mut self.arena);
        }
        Ok(v)
    }

    /// The plan's parameter writes into the session: with graphs on, each copied into the
    /// buffer its parameter had (`stay`), which a captured graph reads and writes.
    fn write_back(&mut self, exe: &Executable, slots: &[Option<Value<B>>], stay: Vec<Option<Value<B>>>) -> Result<()> {
        let mut stay = stay.into_iter();
        for (name, slot) in &exe.writes {
            let v = slots[*slot].clone().expect("writes are pinned");
            let v = match (stay.next().flatten(), v) {
                // Copied into the buffer it had (a launch; captured into the graph during a
                // capture); the new buffer goes back to the arena with the slots.
                (Some(Value::Float(old)), Value::Float(new)) if !B::same_buffer(&old, &new) => {
                    if !B::copy_into(&old, &new) {
                        return Err(RuntimeError::Device(format!("`{name}` is written into a new buffer and this backend cannot copy it back into its own (graph replay); run without graphs")));
                    }
                    Value::Float(old)
                }
                (_, v) => v,
            };
            if let Some(old) = self.put(name, v) {
                old.give_back(&mut self.arena);
            }
        }
        Ok(())
    }
}

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
use std::sync::Arc;

use crate::Backend;
use burn_backend::tensor::Device;
use cellgraph_compiler::dump::DumpOptions;
use cellgraph_compiler::passes::pipeline::{self, PipelineOptions};
use cellgraph_compiler::{Graph, HostData, HostTensor, Op, TensorType};

use crate::arena::Arena;
use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::host::Kept;
use crate::kernel::{ConvAlgo, ConvKind, Native, Products};
use crate::lower::{eval, Ctx};
use crate::replay::{Graphs, ReplayCounts};
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

/// One scheduled node.
#[derive(Clone, Debug)]
struct Step {
    slot: usize,
    op: Op,
    ty: TensorType,
    scope: String,
    /// `(slot, moved)`: `moved` when this step is the operand's last use.
    args: Vec<(usize, bool)>,
    /// The operands' types, in order.
    arg_types: Vec<TensorType>,
    /// For an `assign`/`assign_add`: the written parameter's name.
    target: Option<String>,
    /// For a parameter read only as the target of its own write (an accumulator): the read
    /// is deferred to the write, which takes the value out of the session so that the update
    /// (`assign_add`) reuses its buffer in place.
    deferred: bool,
    /// Slots whose last use is this step but that were shared, not moved (an operand used
    /// twice by its last user): freed right after the step.
    frees: Vec<usize>,
    /// The step's kernel, bound when the plan is compiled; `None` runs burn's ops.
    kernel: Option<Native>,
    /// For an epilogue that adds its head's result to an accumulator only it and its write
    /// read ([`cellgraph_compiler::passes::epilogue::accumulator`]): the accumulator's operand.
    accumulator: Option<usize>,
    /// A loss, gather or scatter-add whose integer ids are a plan input, checked on the host
    /// before the run ([`IdCheck`]).
    ids_checked: bool,
    /// A constant that no `assign`/`assign_add` writes and that is not an output: on device
    /// backends made once per session and shared (see [`Session::run`]).
    shared_constant: bool,
    /// A product (matmul, convolution, attention) whose float operands all hold bf16 values:
    /// a candidate for bf16 products ([`choose_products`]).
    bf16_operands: bool,
}

/// The ops whose arithmetic is matrix products, with or without a bound GEMM.
fn is_product(op: &Op) -> bool {
    match op {
        Op::MatMul { .. }
        | Op::Conv2d(_)
        | Op::Conv2dBackpropInput { .. }
        | Op::Conv2dBackpropFilter { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. } => true,
        Op::Epilogue { head, .. } => is_product(head),
        _ => false,
    }
}

/// Whether node `id` holds only bf16 values: a `round_to bf16`, a program whose result is
/// (ends with a rounding, or moves a rounded value: ReLU, negation, ReLU's gradient of one), a
/// bf16 constant, or values moved from nodes that hold bf16 (a reshape, a transpose, a pad,
/// ReLU... see [`cellgraph_compiler::passes::precision::moves_values`]).
fn holds_bf16(g: &Graph, id: cellgraph_compiler::NodeId, depth: usize) -> bool {
    use cellgraph_compiler::types::DType;
    if depth > 32 {
        return false;
    }
    let xs = g.operands(id);
    let operand = |i: usize| xs.get(i).is_some_and(|&o| holds_bf16(g, o, depth + 1));
    match &g.node(id).op {
        Op::RoundTo { dtype: DType::BF16 } => true,
        Op::Fused { expr } => program_holds_bf16(expr, operand),
        // `$0` is the head's result (a product's sums: not bf16); `$1..` the operands after the head's.
        Op::Epilogue { head, expr } => {
            let skip = head.arity().min();
            program_holds_bf16(expr, |i| i > 0 && operand(skip + i - 1))
        }
        &Op::Constant { value } => cellgraph_compiler::passes::precision::round_f64(value, DType::BF16) == value,
        op if cellgraph_compiler::passes::precision::moves_values(op) => {
            xs.iter().filter(|&&o| g.ty(o).dtype.is_float()).all(|&o| holds_bf16(g, o, depth + 1))
        }
        _ => false,
    }
}

/// Whether a program's result holds only bf16 values, given which of its operands do.
fn program_holds_bf16(expr: &cellgraph_compiler::expr::Expr, arg: impl Fn(usize) -> bool) -> bool {
    use cellgraph_compiler::expr::{Binary, Term, Unary};
    use cellgraph_compiler::types::DType;
    let mut stack: Vec<bool> = Vec::new();
    for t in expr.terms() {
        let v = match *t {
            Term::Arg(i) => arg(i),
            Term::Lit(v) => cellgraph_compiler::passes::precision::round_f64(v, DType::BF16) == v,
            Term::Unary(Unary::RoundBf16) => {
                stack.pop();
                true
            }
            Term::Unary(Unary::Neg | Unary::Relu) => stack.pop().unwrap_or(false),
            Term::Unary(_) => {
                stack.pop();
                false
            }
            // `dy * (y > 0)`: `dy`'s values or zeros.
            Term::Binary(Binary::ReluGrad) => {
                stack.pop();
                stack.pop().unwrap_or(false)
            }
            Term::Binary(_) => {
                stack.pop();
                stack.pop();
                false
            }
        };
        stack.push(v);
    }
    stack.pop().unwrap_or(false)
}

/// `k` with bf16 products where it runs a GEMM (an epilogue's head included).
fn choose_products(k: Native) -> Native {
    match k {
        Native::MatMul { m, k, n, transpose_a, transpose_b, tiling, .. } => {
            Native::MatMul { m, k, n, transpose_a, transpose_b, tiling, products: Products::Bf16 }
        }
        Native::BatchMatMul { batch, m, k, n, transpose_a, transpose_b, .. } => {
            Native::BatchMatMul { batch, m, k, n, transpose_a, transpose_b, products: Products::Bf16 }
        }
        Native::Conv { kind, g, groups, out_channels, algo, .. } if algo != ConvAlgo::Direct => {
            Native::Conv { kind, g, groups, out_channels, algo, products: Products::Bf16 }
        }
        Native::Epilogue { head, head_args, post } => Native::Epilogue { head: Box::new(choose_products(*head)), head_args, post },
        k => k,
    }
}

/// Integer ids a plan takes as an input (directly or through reshapes): checked on the host
/// before they are uploaded, so no step reads them back from the device. Class-id labels of a
/// loss over `bound` classes (but `except`, a loss's ignored index, which the plan replaces
/// with a valid id), or row ids of a gather or scatter-add over `bound` rows.
#[derive(Clone, Debug)]
struct IdCheck {
    input: usize,
    bound: usize,
    labels: bool,
    except: Option<i64>,
    scope: String,
    op: &'static str,
}

impl IdCheck {
    /// What is wrong with the input's values `ids`, if anything.
    fn error(&self, ids: impl Iterator<Item = i64>) -> Option<String> {
        // An ignored label reads as a valid one (the plan's replacement), keeping positions.
        let ids = ids.map(|i| if Some(i) == self.except { 0 } else { i });
        if self.labels {
            crate::lower::label_error(ids, self.bound)
        } else {
            crate::lower::id_error(ids, self.bound)
        }
    }
}

/// A graph lowered to a schedule.
#[derive(Clone, Debug)]
pub struct Executable {
    /// The graph as given, before the pass pipeline (what a recompile starts from).
    source: Graph,
    graph: Graph,
    steps: Vec<Step>,
    outputs: Vec<usize>,
    /// `(parameter name, slot holding the new value)`.
    writes: Vec<(String, usize)>,
    slots: usize,
    peak_bytes: usize,
    /// `(elements, buffers)`: the most float values of each length alive at once.
    arena: Vec<(usize, usize)>,
    id_checks: Vec<IdCheck>,
    /// Steps that are collectives (`all_reduce`).
    collectives: usize,
    /// The plan's identity in a session's captured graphs (clones share it).
    id: u64,
}

/// How a plan multiplies the products whose operands hold bf16 values (see
/// [`Executable::bf16_products`]): chosen when the plan was compiled.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bf16Products {
    /// Where the fast ones run: AVX-512 BF16 pairs on host backends, tensor cores on devices.
    pub unit: Bf16Unit,
    /// Products on that unit with f32 sums: [`crate::kernel::Products::Bf16`] on the host; on
    /// a device, every matmul and batched matmul (and epilogue head) of bf16 values.
    pub fast: usize,
    /// Those that multiply in exact f32 (the emulation), by op: attention and direct
    /// convolutions have no bf16 kernel on the host, convolutions and attention none on
    /// devices; on a CPU without AVX-512 BF16, all of them.
    pub in_f32: BTreeMap<&'static str, usize>,
}

/// The unit that multiplies a plan's fast bf16 products ([`Bf16Products`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Unit {
    /// The CPU's `vdpbf16ps`: pairs of bf16 values multiplied, summed in f32.
    #[default]
    Avx512Pairs,
    /// cubek's tensor-core matmul on TF32 operands with f32 sums. A bf16 value is a TF32 value
    /// (8 significant bits of TF32's 11), so these are the products of bf16 tensor cores, not
    /// a rounding of them; where the device has no tensor-core kernel cubek's exact-f32 kernel
    /// runs them, counted ([`crate::cube::tf32_fallbacks`]).
    Tf32TensorCores,
}

impl std::fmt::Display for Bf16Products {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let f32s: usize = self.in_f32.values().sum();
        let unit = match self.unit {
            Bf16Unit::Avx512Pairs => "AVX-512 BF16 pairs",
            Bf16Unit::Tf32TensorCores => "tensor cores (TF32 operands, exact for bf16 values)",
        };
        write!(f, "bf16 products: {} on {unit}, {f32s} in f32", self.fast)?;
        if self.unit == Bf16Unit::Avx512Pairs && !crate::host::bf16::available() {
            write!(f, " (this CPU has no AVX-512 BF16: f32 emulation)")?;
        } else if f32s > 0 {
            let each: Vec<String> = self.in_f32.iter().map(|(op, n)| format!("{op} {n}")).collect();
            write!(f, " ({})", each.join(", "))?;
        }
        Ok(())
    }
}

/// How a plan step runs on a host backend (the CPU), decided when the plan was compiled: see
/// [`Executable::host_steps`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostRun {
    /// Reads a parameter, an input or a constant: no arithmetic.
    Source,
    /// A reshape: its operand's memory at the operand's last use, else a copy.
    Reshape,
    /// `assign_add`: the sum written into the accumulator's memory.
    AccumulateInPlace,
    /// A collective between ranks (`all_reduce`).
    Collective,
    /// `assign`: the parameter's new value, moved (no arithmetic).
    Store,
    /// `stop_gradient`: its operand, unchanged.
    Identity,
    /// A bound host kernel, by name (`matmul`, `epilogue(conv Forward direct)`).
    Kernel(String),
    /// burn's ops (the reference lowering), with the reason no host kernel binds.
    BurnOps(String),
}

/// One step of a plan as [`Executable::host_steps`] lists it.
#[derive(Clone, Debug)]
pub struct HostStep {
    /// The graph node the step computes.
    pub node: usize,
    /// The op's label (`matmul`, `fused`).
    pub op: &'static str,
    /// The op's scope (`net.fc1`, `Gradients/...`).
    pub scope: String,
    /// The step's result type.
    pub ty: TensorType,
    pub run: HostRun,
}

/// A bound kernel's name in plan listings: `matmul`, `matmul bf16`, `conv Forward im2col`,
/// `conv InputGrad dense taps`, `epilogue(matmul)`, `Fused`, ...
fn kernel_name(k: &Native) -> String {
    let bf16 = |p: &Products| if *p == Products::Bf16 { " bf16" } else { "" };
    match k {
        Native::MatMul { products, .. } => format!("matmul{}", bf16(products)),
        Native::BatchMatMul { products, .. } => format!("batch_matmul{}", bf16(products)),
        Native::Conv { kind, algo, products, .. } => format!("conv {kind:?} {}{}", algo.name(), bf16(products)),
        Native::Epilogue { head, .. } => format!("epilogue({})", kernel_name(head)),
        other => {
            let debug = format!("{other:?}");
            debug.split(|c: char| !c.is_ascii_alphanumeric()).next().unwrap_or_default().to_string()
        }
    }
}

impl std::fmt::Display for HostStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let run = match &self.run {
            HostRun::Source => "source".to_string(),
            HostRun::Reshape => "reshape (a view at the operand's last use)".to_string(),
            HostRun::AccumulateInPlace => "assign_add in place".to_string(),
            HostRun::Collective => "collective".to_string(),
            HostRun::Store => "store (the new value, moved)".to_string(),
            HostRun::Identity => "identity (its operand)".to_string(),
            HostRun::Kernel(k) => format!("kernel {k}"),
            HostRun::BurnOps(why) => format!("burn ops: {why}"),
        };
        write!(f, "%{} {} {} [{}]: {run}", self.node, self.op, self.ty, self.scope)
    }
}

impl Executable {
    /// What each step of the plan runs on a host backend, in order: a bound kernel, a source,
    /// a reshape, an accumulation in place, a collective, or burn's ops and why
    /// (`cellgraph inspect plan`). Device backends run the same bound kernels on their own
    /// kernels where they have them.
    pub fn host_steps(&self) -> Vec<HostStep> {
        self.steps
            .iter()
            .map(|st| {
                let run = match (&st.op, &st.kernel) {
                    (Op::Parameter { .. } | Op::Input { .. }, _) => HostRun::Source,
                    (Op::Reshape { .. } | Op::Flatten, _) => HostRun::Reshape,
                    (Op::AssignAdd, _) if st.args.first().is_some_and(|a| a.1) => HostRun::AccumulateInPlace,
                    (Op::AllReduce, _) => HostRun::Collective,
                    (Op::Assign, _) => HostRun::Store,
                    (Op::StopGradient, _) => HostRun::Identity,
                    (_, Some(_)) if !st.ty.dtype.is_float() => HostRun::BurnOps(format!("its result is {}: host kernels write floats", st.ty)),
                    (_, Some(_)) if st.arg_types.iter().any(|t| t.dtype == cellgraph_compiler::DType::Bool) => {
                        HostRun::BurnOps("a bool operand: host kernels read floats and ids".into())
                    }
                    (_, Some(k)) => HostRun::Kernel(kernel_name(k)),
                    (op, None) => HostRun::BurnOps(format!(
                        "no host kernel for `{}` on ({})",
                        op.label(),
                        st.arg_types.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
                    )),
                };
                HostStep { node: st.slot, op: st.op.label(), scope: st.scope.clone(), ty: st.ty.clone(), run }
            })
            .collect()
    }

    /// The plan's products whose operands hold bf16 values (a plan compiled from a graph the
    /// precision pass rounded to bf16), and what each runs on on backend `B`; `None` when it
    /// has none.
    pub fn bf16_products<B: Backend>(&self) -> Option<Bf16Products> {
        let unit = if B::HOST { Bf16Unit::Avx512Pairs } else { Bf16Unit::Tf32TensorCores };
        let mut out = Bf16Products { unit, ..Default::default() };
        for st in self.steps.iter().filter(|st| st.bf16_operands) {
            let head = match &st.kernel {
                Some(Native::Epilogue { head, .. }) => Some(&**head),
                k => k.as_ref(),
            };
            let fast = match head {
                Some(Native::MatMul { .. } | Native::BatchMatMul { .. }) if !B::HOST => true,
                Some(
                    Native::MatMul { products: Products::Bf16, .. }
                    | Native::BatchMatMul { products: Products::Bf16, .. }
                    | Native::Conv { products: Products::Bf16, .. },
                ) => B::HOST,
                _ => false,
            };
            if fast {
                out.fast += 1;
            } else {
                let op = match &st.op {
                    Op::Epilogue { head, .. } => head.label(),
                    op => op.label(),
                };
                *out.in_f32.entry(op).or_default() += 1;
            }
        }
        (out.fast + out.in_f32.values().sum::<usize>() > 0).then_some(out)
    }

    /// The host checks a run makes before anything reaches the device: the number of inputs,
    /// and the integer ids a step takes from them (see [`IdCheck`]).
    fn check_inputs(&self, inputs: &[HostTensor]) -> Result<()> {
        let graph_inputs = self.graph.inputs();
        if inputs.len() != graph_inputs.len() {
            return Err(RuntimeError::Mismatch {
                what: format!("inputs of graph `{}`", self.graph.name),
                expected: format!("{} inputs", graph_inputs.len()),
                got: format!("{}", inputs.len()),
            });
        }
        for l in &self.id_checks {
            let wrong = match &inputs[l.input].data {
                HostData::I32(v) => l.error(v.iter().map(|&x| i64::from(x))),
                HostData::I64(v) => l.error(v.iter().copied()),
                // Not class ids: the input's type check reports it.
                _ => None,
            };
            if let Some(detail) = wrong {
                return Err(RuntimeError::BadValue { scope: l.scope.clone(), op: l.op, detail });
            }
        }
        Ok(())
    }

    /// The optimised graph this plan runs.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
    /// The graph as it was given to [`compile`], before any pass.
    pub fn source(&self) -> &Graph {
        &self.source
    }
    /// Number of scheduled steps.
    pub fn len(&self) -> usize {
        self.steps.len()
    }
    /// True when nothing is scheduled.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
    /// The most bytes of node values alive at once under this schedule (parameters read by
    /// the plan included, since the plan holds a reference while they are live).
    pub fn peak_bytes(&self) -> usize {
        self.peak_bytes
    }
    /// The plan's memory: `(elements, buffers)`, the most float values of each length that its
    /// inputs and ops hold at once under this schedule. A session's [`Arena`] keeps that many
    /// buffers of each length for the values host kernels write.
    pub fn arena(&self) -> &[(usize, usize)] {
        &self.arena
    }
    /// How many collectives (`all_reduce`) one run calls.
    pub fn collectives(&self) -> usize {
        self.collectives
    }
}

/// True for a parameter node whose only use is as operand 0 of one `assign`/`assign_add`.
fn deferred_read(g: &Graph, id: cellgraph_compiler::NodeId) -> bool {
    if !matches!(g.node(id).op, Op::Parameter { .. }) || g.outputs().contains(&id) {
        return false;
    }
    match g.users(id).as_slice() {
        [w] => g.node(*w).op.is_effect() && matches!(g.operands(*w)[..], [target, value] if target == id && value != id),
        _ => false,
    }
}

/// The slots whose last use is `st`, once each.
fn released(st: &Step) -> Vec<usize> {
    let mut v: Vec<usize> = st.args.iter().filter(|(_, moved)| *moved).map(|(s, _)| *s).chain(st.frees.iter().copied()).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Simulates the schedule: a value is allocated at its step and released at its last use.
fn simulate_peak(graph: &Graph, steps: &[Step]) -> usize {
    let bytes = |slot: usize| graph.ty(cellgraph_compiler::NodeId(slot as u32)).size_bytes();
    let (mut live, mut peak) = (0usize, 0usize);
    for st in steps {
        live += bytes(st.slot);
        peak = peak.max(live);
        live -= released(st).into_iter().map(bytes).sum::<usize>();
    }
    peak
}

/// The same simulation, by length, for the float values a run writes into new memory (inputs
/// and ops; parameters are the session's): `(elements, most alive at once)`.
fn arena_sizes(graph: &Graph, steps: &[Step]) -> Vec<(usize, usize)> {
    let ty = |slot: usize| graph.ty(cellgraph_compiler::NodeId(slot as u32));
    let counted = |st: &Step| st.ty.dtype.is_float() && !matches!(st.op, Op::Parameter { .. });
    let (mut live, mut most) = (BTreeMap::<usize, usize>::new(), BTreeMap::<usize, usize>::new());
    let mut owned = vec![false; graph.id_bound()];
    for st in steps {
        if counted(st) {
            owned[st.slot] = true;
            let n = live.entry(ty(st.slot).numel()).or_default();
            *n += 1;
            let m = most.entry(ty(st.slot).numel()).or_default();
            *m = (*m).max(*n);
        }
        for s in released(st).into_iter().filter(|&s| owned[s]) {
            *live.get_mut(&ty(s).numel()).expect("counted when written") -= 1;
        }
    }
    most.into_iter().collect()
}

/// Pairs each forward whose gradient reuses what it computed with the gradients of it
/// scheduled after it, on the same operands: a max pool keeps its argmax (its gradients,
/// alone or heading an epilogue, route by it instead of searching the windows again), a
/// softmax cross-entropy its log-softmax (its gradients exponentiate it instead of computing
/// it again), an attention its probabilities (its gradients read them instead of making the
/// scores and the softmax again). Each pair gets a [`Kept`] slot.
fn keep_for_gradients(steps: &mut [Step]) {
    /// The pooling window of a max pool's gradient, alone or heading an epilogue.
    fn pool_grad(op: &Op) -> Option<&cellgraph_compiler::Pool2dAttrs> {
        match op {
            Op::MaxPool2dGrad(q) => Some(q),
            Op::Epilogue { head, .. } => pool_grad(head),
            _ => None,
        }
    }
    /// Where a bound gradient keeps the slot it reads.
    fn kept_slot(k: &mut Native) -> Option<&mut Option<usize>> {
        match k {
            Native::MaxPoolGrad { kept, .. } => Some(kept),
            Native::SoftmaxCrossEntropy { grad: true, kept, .. } => Some(kept),
            Native::Attention { grad: true, kept, .. } => Some(kept),
            Native::Epilogue { head, .. } => kept_slot(head),
            _ => None,
        }
    }
    /// When `op` is a gradient of `fwd` that can reuse what it keeps: how many leading
    /// operands they must share.
    fn reuses(fwd: &Op, op: &Op) -> Option<usize> {
        match (fwd, op) {
            (Op::MaxPool2d(p), op) if pool_grad(op) == Some(p) => Some(1),
            (Op::SoftmaxCrossEntropy { sparse: true, .. }, Op::SoftmaxCrossEntropyGrad { sparse: true, .. }) => Some(2),
            (Op::Attention { heads, causal }, Op::AttentionGrad { heads: h, causal: c }) if (heads, causal) == (h, c) => Some(1),
            _ => None,
        }
    }
    // Argmax slots and rows (log-softmax, probabilities) are counted apart (they are kept
    // apart).
    let (mut pools, mut rows) = (0, 0);
    for i in 0..steps.len() {
        let grads: Vec<usize> = (i + 1..steps.len())
            .filter(|&j| {
                reuses(&steps[i].op, &steps[j].op).is_some_and(|n| steps[j].args.iter().zip(&steps[i].args).take(n).all(|(a, b)| a.0 == b.0))
            })
            .collect();
        if grads.is_empty() {
            continue;
        }
        // A loss with one gradient whose `dloss` is a constant: the value, for a device to
        // compute that gradient with the loss.
        let seed = match grads[..] {
            [j] => steps[j].args.get(2).and_then(|&(dl, _)| steps[..j].iter().find(|st| st.slot == dl)).and_then(|st| match st.op {
                Op::Constant { value } => Some(value),
                _ => None,
            }),
            _ => None,
        };
        let slot = match &mut steps[i].kernel {
            Some(Native::MaxPool { keep, .. }) => {
                pools += 1;
                *keep.insert(pools - 1)
            }
            Some(Native::SoftmaxCrossEntropy { grad: false, kept, seed: s, .. }) => {
                rows += 1;
                *s = seed;
                *kept.insert(rows - 1)
            }
            Some(Native::Attention { grad: false, kept, .. }) => {
                rows += 1;
                *kept.insert(rows - 1)
            }
            _ => continue,
        };
        for j in grads {
            if let Some(kept) = steps[j].kernel.as_mut().and_then(kept_slot) {
                *kept = Some(slot);
            }
        }
    }
}

/// Names the parameter each dense small-map convolution (forward or input gradient, alone or
/// heading an epilogue) reads as its filter (operand 1), so that host backends build its dense
/// filter once per value of the parameter (see [`Native::Conv`]'s `filter`).
fn name_dense_filters(steps: &mut [Step]) {
    fn conv(k: &mut Native) -> Option<&mut Option<Arc<str>>> {
        match k {
            Native::Epilogue { head, .. } => conv(head),
            Native::Conv { kind: ConvKind::Forward | ConvKind::InputGrad, algo: ConvAlgo::Dense { filter, .. }, .. } => Some(filter),
            _ => None,
        }
    }
    let mut params: BTreeMap<usize, Arc<str>> = steps
        .iter()
        .filter_map(|st| match &st.op {
            Op::Parameter { name } if !st.deferred => Some((st.slot, Arc::from(name.as_str()))),
            _ => None,
        })
        .collect();
    // A parameter's bf16 copy (mixed precision): its own dense filter, under its own name
    // (see [`crate::host::Kept::forget`]).
    let rounded: Vec<(usize, Arc<str>)> = steps
        .iter()
        .filter_map(|st| match (&st.op, st.args.first()) {
            (Op::RoundTo { dtype: cellgraph_compiler::DType::BF16 }, Some((slot, _))) => {
                params.get(slot).map(|n| (st.slot, Arc::from(format!("{}{n}", crate::host::ROUNDED_BF16))))
            }
            _ => None,
        })
        .collect();
    params.extend(rounded);
    for st in steps.iter_mut() {
        let name = st.args.get(1).and_then(|(slot, _)| params.get(slot));
        if let (Some(name), Some(filter)) = (name, st.kernel.as_mut().and_then(conv)) {
            *filter = Some(name.clone());
        }
    }
}

/// Optimises, verifies and schedules a graph.
pub fn compile(graph: Graph) -> Result<Executable> {
    compile_with(graph, None)
}

/// Where [`compile_with`] dumps: the pipeline's input is written as pass `input` at position
/// `first`, each pass after it at the next position.
#[derive(Clone, Copy, Debug)]
pub struct DumpAt<'a> {
    pub opts: &'a DumpOptions,
    pub first: usize,
    pub input: &'a str,
}

/// [`compile`] without elementwise fusion: the reference plan a fused one is checked against.
pub fn compile_unfused(graph: Graph) -> Result<Executable> {
    compile_with_options(graph, None, &PipelineOptions { fuse: false, ..PipelineOptions::default() })
}

/// [`compile`], writing the graph after every pass when `dump` is given.
pub fn compile_with(graph: Graph, dump: Option<DumpAt>) -> Result<Executable> {
    compile_with_options(graph, dump, &PipelineOptions::default())
}

/// [`compile_with`] under the given pipeline options.
pub fn compile_with_options(mut graph: Graph, dump: Option<DumpAt>, opts: &PipelineOptions) -> Result<Executable> {
    let source = graph.clone();
    let mut failed = None;
    pipeline::run(&mut graph, &pipeline::passes(opts), opts, |i, name, g| {
        if let (Some(d), None) = (dump, &failed) {
            let pass = if i == 0 { d.input } else { name };
            failed = cellgraph_compiler::dump::write(d.opts, d.first + i, pass, g).err().map(|e| (d.opts.dir.clone(), e));
        }
    })?;
    if let Some((dir, source)) = failed {
        return Err(RuntimeError::Io { path: dir.display().to_string(), source });
    }
    cellgraph_compiler::verify(&graph).map_err(cellgraph_compiler::IrError::from)?;
    let order = graph.topo_order().expect("verified graphs are acyclic");
    let pos: BTreeMap<_, _> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut last_use = vec![None::<usize>; graph.id_bound()];
    for (i, &id) in order.iter().enumerate() {
        for o in graph.operands(id) {
            last_use[o.index()] = Some(i);
        }
    }
    let mut pinned = vec![false; graph.id_bound()];
    for o in graph.outputs() {
        pinned[o.index()] = true;
    }
    let mut writes = Vec::new();
    for e in graph.effects() {
        pinned[e.index()] = true;
        let target = graph.operands(e)[0];
        if let Op::Parameter { name } = &graph.node(target).op {
            writes.push((name.clone(), e.index()));
        }
    }
    let mut id_checks: Vec<IdCheck> = Vec::new();
    let mut steps: Vec<Step> = order
        .iter()
        .map(|&id| {
            let n = graph.node(id);
            let ops = graph.operands(id);
            let is_last = |o: &cellgraph_compiler::NodeId| last_use[o.index()] == Some(pos[&id]) && !pinned[o.index()];
            let args = ops.iter().enumerate().map(|(k, o)| (o.index(), is_last(o) && !ops[k + 1..].contains(o))).collect();
            let mut frees: Vec<usize> = ops.iter().filter(|o| is_last(o)).map(|o| o.index()).collect();
            frees.sort_unstable();
            frees.dedup();
            let deferred = deferred_read(&graph, id);
            let arg_types: Vec<TensorType> = ops.iter().map(|&o| graph.ty(o).clone()).collect();
            let target = match (&n.op, ops.first().map(|&o| &graph.node(o).op)) {
                (op, Some(Op::Parameter { name })) if op.is_effect() => Some(name.clone()),
                _ => None,
            };
            let mut kernel = crate::kernel::bind(&n.op, &arg_types.iter().collect::<Vec<_>>());
            // The product's own operands (an epilogue's head's: the program's extra operands,
            // an accumulator say, are not multiplied).
            let factors = match &n.op {
                Op::Epilogue { head, .. } => &ops[..head.arity().min().min(ops.len())],
                _ => &ops[..],
            };
            let bf16_operands = is_product(&n.op) && factors.iter().filter(|&&o| graph.ty(o).dtype.is_float()).all(|&o| holds_bf16(&graph, o, 0));
            if bf16_operands && crate::host::bf16::available() {
                kernel = kernel.map(choose_products);
            }
            let accumulator = cellgraph_compiler::passes::epilogue::accumulator(&graph, id);
            let check = id_input(&graph, id);
            let ids_checked = check.is_some();
            if let Some(c) =
                check.filter(|c| !id_checks.iter().any(|l| (l.input, l.bound, l.labels, l.except) == (c.input, c.bound, c.labels, c.except)))
            {
                id_checks.push(c);
            }
            let shared_constant = matches!(n.op, Op::Constant { .. })
                && !graph.outputs().contains(&id)
                && graph.users(id).iter().all(|&u| !graph.node(u).op.is_effect());
            Step {
                slot: id.index(),
                op: n.op.clone(),
                ty: n.ty.clone(),
                scope: n.scope.clone(),
                args,
                arg_types,
                target,
                frees,
                deferred,
                kernel,
                accumulator,
                ids_checked,
                shared_constant,
                bf16_operands,
            }
        })
        .collect();
    keep_for_gradients(&mut steps);
    name_dense_filters(&mut steps);
    let outputs = graph.outputs().iter().map(|o| o.index()).collect();
    let slots = graph.id_bound();
    let peak_bytes = simulate_peak(&graph, &steps);
    let arena = arena_sizes(&graph, &steps);
    let collectives = steps.iter().filter(|st| matches!(st.op, Op::AllReduce)).count();
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(Executable { source, graph, steps, outputs, writes, slots, peak_bytes, arena, id_checks, collectives, id })
}

/// For a softmax cross-entropy (or its gradient) with class-id labels, a gather or a
/// scatter-add whose ids are a plan input: the check they need. The ids may come through
/// reshapes, and a loss's labels through its ignored index's replacement
/// (`select(equal(labels, ignored), id, labels)` with constant `ignored` and a valid `id`).
fn id_input(g: &Graph, id: cellgraph_compiler::NodeId) -> Option<IdCheck> {
    let n = g.node(id);
    let xs = g.operands(id);
    let (ids, bound, labels) = match n.op {
        Op::SoftmaxCrossEntropy { sparse: true, .. } | Op::SoftmaxCrossEntropyGrad { sparse: true, .. } => {
            (*xs.get(1)?, *g.ty(xs[0]).dims().get(1)?, true)
        }
        Op::Gather => (*xs.get(1)?, *g.ty(xs[0]).dims().first()?, false),
        Op::ScatterAdd { rows } => (*xs.first()?, rows, false),
        _ => return None,
    };
    let constant = |x: cellgraph_compiler::NodeId| match g.node(x).op {
        Op::Constant { value } => Some(value),
        _ => None,
    };
    let through_reshapes = |mut x: cellgraph_compiler::NodeId| {
        while let Op::Reshape { .. } = g.node(x).op {
            x = g.operands(x)[0];
        }
        x
    };
    let (mut ids, mut except) = (through_reshapes(ids), None);
    if let (true, Op::Select) = (labels, &g.node(ids).op) {
        let [cond, with, kept] = g.operands(ids)[..] else { return None };
        let [x, ignored] = g.operands(cond)[..] else { return None };
        let valid = constant(with).is_some_and(|v| v >= 0.0 && v < bound as f64);
        if !(matches!(g.node(cond).op, Op::Equal) && x == kept && valid) {
            return None;
        }
        (ids, except) = (through_reshapes(x), Some(constant(ignored)? as i64));
    }
    let Op::Input { index, .. } = g.node(ids).op else { return None };
    Some(IdCheck { input: index, bound, labels, except, scope: n.scope.clone(), op: n.op.label() })
}

/// Runs a step's bound kernel: on the host kernels on a host backend, on the device's own
/// kernels otherwise; `None` when it does not apply (a non-float operand, a dtype the kernels
/// lack), and burn's ops run the step instead.
fn run_bound<B: Backend>(
    k: &Native,
    args: &[(Value<B>, &TensorType)],
    out: &TensorType,
    cx: &Ctx<B>,
    kept: &mut Kept,
    arena: &mut Arena,
) -> Option<burn_backend::tensor::FloatTensor<B>> {
    let (mut floats, mut ints) = (Vec::new(), Vec::new());
    for (v, _) in args {
        match v {
            Value::Float(t) => floats.push(t),
            Value::Int(t) => ints.push(t),
            Value::Bool(_) => return None,
        }
    }
    let tys: Vec<&TensorType> = args.iter().map(|(_, t)| *t).collect();
    if B::HOST {
        crate::host::run_host::<B>(k, &floats, &ints, &tys, out, (cx.device, cx.settings.float_dtype, cx.bf16), kept, arena)
    } else if matches!(k, Native::SoftmaxCrossEntropy { .. }) && !cx.ids_checked {
        // Class ids computed in the plan: the lowering reads and checks them.
        None
    } else {
        match *k {
            // The loss's gradient, made with the loss (below).
            Native::SoftmaxCrossEntropy { grad: true, kept: Some(s), .. } => {
                if let Some(g) = kept.take_device::<burn_backend::tensor::FloatTensor<B>>(s) {
                    return Some(g);
                }
            }
            Native::SoftmaxCrossEntropy { grad: false, kept: Some(s), seed: Some(seed), .. } => {
                if let Some((loss, g)) = B::device_loss_with_grad(k, &floats, &ints, out, seed, arena) {
                    kept.keep_device(s, g);
                    return Some(loss);
                }
            }
            _ => {}
        }
        B::device_kernel(k, &floats, &ints, out, cx.tf32, arena)
    }
}

/// An epilogue step's head (`args`: its operands) on the head's bound kernel where the backend
/// runs it (`native`), else on burn's ops.
fn run_head<B: Backend>(
    cx: &Ctx<B>,
    head: &Op,
    step: &Step,
    args: Vec<(Value<B>, &TensorType)>,
    native: bool,
    kept: &mut Kept,
    arena: &mut Arena,
) -> Result<(Value<B>, Ran)> {
    let bound = match &step.kernel {
        Some(Native::Epilogue { head, .. }) if native => run_bound(head, &args, &step.ty, cx, kept, arena),
        _ => None,
    };
    match bound {
        Some(t) => {
            for (v, _) in args {
                v.give_back(arena);
            }
            Ok((Value::Float(t), Ran::Kernel))
        }
        None => Ok((eval(cx, head, args, &step.ty)?, Ran::BurnOps)),
    }
}

/// Whether a step ran on its bound kernel or on burn's ops (counted in
/// [`Session::burn_op_steps`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ran {
    Kernel,
    BurnOps,
}

/// Counts one call of `secs` under `key()` in a profile, when profiling is on (`key` is only
/// made then).
fn record<K: Ord>(profile: &mut Option<BTreeMap<K, (u64, f64)>>, key: impl FnOnce() -> K, secs: Option<f64>) {
    if let (Some(p), Some(secs)) = (profile.as_mut(), secs) {
        let e = p.entry(key()).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += secs;
    }
}

/// Seconds since `t0` (profiling on).
fn since(t0: Option<std::time::Instant>) -> Option<f64> {
    t0.map(|t| t.elapsed().as_secs_f64())
}

/// A captured plan shape: the plan's id and its inputs' types.
type GraphKey = (u64, Vec<TensorType>);

/// An error of `exe`'s graph replay.
fn replay_error(exe: &Executable, detail: String) -> RuntimeError {
    RuntimeError::Device(format!("graph replay of `{}`: {detail}", exe.graph.name))
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
    /// Device matmuls may use TF32 tensor cores (see [`Self::set_tf32`]).
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
}

/// A capture's graph, the run's outputs, and why it cannot be replayed (if so).
type Captured<B> = (burn_backend::BackendGraph<B>, Vec<Value<B>>, Option<String>);

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

    /// Lets device matmuls round their operands to TF32 and run on tensor cores (off by
    /// default: every backend multiplies in exact f32). Like PyTorch's `allow_tf32`: about
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
        self.bf16 = on;
    }

    /// The steps this session computed on burn's ops because no bound kernel ran them, by op
    /// and count (reshapes, which move no values, are not counted): on host backends exactly
    /// the plans' [`HostRun::BurnOps`] steps; on devices also the ops they have no kernel for.
    pub fn burn_op_steps(&self) -> &BTreeMap<&'static str, u64> {
        &self.burn_steps
    }

    /// Makes `assign_add` write into the accumulator's own memory where the backend can (its
    /// accumulators are then views of one flat buffer; see [`Backend::flat_buffers`]).
    pub fn set_in_place_accumulation(&mut self, on: bool) {
        self.in_place = on;
    }

    /// Whether [`Self::run_replayed`] captures and replays graphs (off by default: an opt-in,
    /// `--graphs`, until replay is checked against the CPU on CUDA; see [`crate::replay`]).
    pub fn graphs(&self) -> bool {
        self.replay
    }

    /// Turns graph replay on or off (see [`crate::replay`]); turning it off forgets every
    /// captured graph. Host backends have no graphs: turning it on there is an error.
    pub fn set_graphs(&mut self, on: bool) -> Result<()> {
        if on && B::HOST {
            return Err(RuntimeError::Invalid { what: "graph replay".into(), detail: "the CPU backend runs its host kernels directly and has no graphs to capture; use a device (--device cuda or wgpu), or leave graphs off".into() });
        }
        if !on {
            self.graphs = Graphs::default();
        }
        self.replay = on;
        Ok(())
    }

    /// What replay has done in this session.
    pub fn replay_counts(&self) -> ReplayCounts {
        self.graphs.counts
    }

    /// Why plans run op by op although replay is on: for each plan shape that cannot be
    /// captured, the step that reads the device or uploads (`scope: op: what`).
    pub fn replay_blockers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.graphs.entries.values().filter_map(|e| e.blocker.clone()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// [`Self::run_device`] through a captured graph (see [`crate::replay`]): the first two
    /// runs of a plan shape run op by op, the second then captures the plan; every later run
    /// of that shape is one replay. The plan must not have collectives (they read the device);
    /// the outputs are new buffers each run.
    pub fn run_replayed(&mut self, exe: &Executable, inputs: &[HostTensor]) -> Result<Vec<Value<B>>> {
        if !self.replay || exe.collectives > 0 || B::HOST {
            return Err(replay_error(
                exe,
                "replay is off, the plan has collectives, or the backend has no graphs (the caller runs it op by op)".into(),
            ));
        }
        // A replay runs no step on the host: the ids are checked here, before any upload.
        exe.check_inputs(inputs)?;
        let key = (exe.id, inputs.iter().map(|t| t.ty()).collect::<Vec<_>>());
        let Some(entry) = self.graphs.entries.get_mut(&key) else {
            return self.first_run(exe, inputs, key);
        };
        let s = settings::<B>(&self.device, self.float);
        for (t, v) in inputs.iter().zip(&entry.inputs) {
            let written = match v {
                Value::Float(d) => B::write_float(d, crate::value::device_data(t.clone(), &s)),
                Value::Int(d) => B::write_int(d, crate::value::device_data(t.clone(), &s)),
                Value::Bool(_) => false,
            };
            if !written {
                return Err(replay_error(exe, format!("an input of type {} cannot be written in place on this backend", t.ty())));
            }
            crate::value::count_upload();
        }
        if entry.blocker.is_some() {
            // Known at the first run: op by op, counted (see `replay_blockers`).
            self.graphs.counts.uncaptured += 1;
            return self.in_own_arena(&key, |s, fixed| s.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone()));
        }
        if entry.graph.is_none() {
            return self.second_run(exe, inputs, &key);
        }
        let Some((graph, outs)) = &entry.graph else { unreachable!("checked above") };
        // SAFETY: every buffer the graph touches is held by this session (inputs, outputs,
        // parameters, which stay in their buffers while graphs are on and whose graphs are
        // forgotten when one is set from outside; the plan's own arena, which only this entry
        // holds) or pinned by the backend at capture; writes and replays go to the one stream
        // this thread uses.
        unsafe { B::graph_replay(&self.device, graph) }.map_err(|e| replay_error(exe, format!("replay: {e:?}")))?;
        let outs = outs.clone();
        self.graphs.counts.replays += 1;
        self.in_own_arena(&key, |s, _| s.copied_out(outs)).map_err(|e| replay_error(exe, e))
    }

    /// The first run of a plan shape: its inputs uploaded into the contiguous buffers kept for
    /// the plan's life, then the plan op by op in an arena of its own, probed for a step that
    /// reads the device or uploads (which would keep it from being captured).
    fn first_run(&mut self, exe: &Executable, inputs: &[HostTensor], key: GraphKey) -> Result<Vec<Value<B>>> {
        let s = self.settings();
        let fixed: Option<Vec<Value<B>>> = inputs
            .iter()
            .map(|t| match t.dtype().is_float() {
                true => B::contiguous_float(crate::value::device_data(t.clone(), &s), &self.device).map(Value::Float),
                false => B::contiguous_int(crate::value::device_data(t.clone(), &s), &self.device).map(Value::Int),
            })
            .collect();
        let fixed = fixed.ok_or_else(|| replay_error(exe, "this backend cannot keep an input in a fixed buffer".into()))?;
        inputs.iter().for_each(|_| crate::value::count_upload());
        let names = exe
            .steps
            .iter()
            .filter_map(|st| match &st.op {
                Op::Parameter { name } => Some(name.clone()),
                _ => None,
            })
            .chain(exe.writes.iter().map(|(n, _)| n.clone()))
            .collect();
        self.graphs
            .entries
            .insert(key.clone(), crate::replay::Entry { inputs: fixed, names, graph: None, blocker: None, tries: 0, arena: Arena::default() });
        self.graphs.counts.warmups += 1;
        self.watch = Watch::Probe(None);
        let outs = self.in_own_arena(&key, |s, fixed| s.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone()));
        let Watch::Probe(blocker) = std::mem::replace(&mut self.watch, Watch::Off) else { unreachable!("set above") };
        self.graphs.entries.get_mut(&key).expect("inserted above").blocker = blocker;
        let outs = outs?;
        self.in_own_arena(&key, |s, _| s.copied_out(outs)).map_err(|e| replay_error(exe, e))
    }

    /// The second run of a plan shape: op by op (this run's results), then, when the run took
    /// every buffer from the plan's arena, the capture, in one call (a stream holds one
    /// prepared capture at a time). When the run took a new buffer, or the capture found a
    /// step it cannot record, the graph is dropped (its launches were recorded, never run:
    /// this run's results stand) and the next run tries again; after three tries the plan
    /// stays op by op, named. (Whether a buffer is free again is cubecl's count of its handles,
    /// which a launch still queued for the device may hold a moment longer: a try can fail by
    /// timing alone.)
    fn second_run(&mut self, exe: &Executable, inputs: &[HostTensor], key: &GraphKey) -> Result<Vec<Value<B>>> {
        B::graph_prepare(&self.device).map_err(|e| replay_error(exe, format!("preparing the device for a capture: {e:?}")))?;
        self.graphs.counts.warmups += 1;
        let (outs, steady) = self.in_own_arena(key, |s, fixed| {
            let fresh = s.arena.fresh();
            let outs = s.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone()).and_then(|o| s.copied_out(o).map_err(|e| replay_error(exe, e)));
            (outs, s.arena.fresh() == fresh)
        });
        let failed = if steady {
            // A prepare must be followed by a capture on the stream, even after a failed run.
            match self.in_own_arena(key, |s, fixed| s.capture(exe, inputs, fixed)) {
                Ok((graph, outs, None)) => {
                    self.graphs.entries.get_mut(key).expect("made at the first run").graph = Some((graph, outs));
                    self.graphs.counts.captures += 1;
                    None
                }
                Ok((_, _, Some(why))) => Some(why),
                Err(RuntimeError::Device(d)) => return Err(replay_error(exe, d)),
                Err(e) => return Err(e),
            }
        } else {
            let closed = B::graph_start_capture(&self.device).and_then(|_| B::graph_stop_capture(&self.device).map(drop));
            closed.map_err(|e| replay_error(exe, format!("closing an empty capture: {e:?}")))?;
            Some("its runs still take new buffers (no steady set of buffers to capture)".to_string())
        };
        if let Some(why) = failed {
            let entry = self.graphs.entries.get_mut(key).expect("made at the first run");
            entry.tries += 1;
            if entry.tries >= 3 {
                entry.blocker = Some(format!("{why}, at each of {} tries", entry.tries));
            }
        }
        outs
    }

    /// Runs `f` with the plan shape's own arena as the session's (a graph's buffers are never
    /// lent to another plan, which could keep one past the next replay) and its input buffers.
    fn in_own_arena<T>(&mut self, key: &GraphKey, f: impl FnOnce(&mut Self, &[Value<B>]) -> T) -> T {
        let entry = self.graphs.entries.get_mut(key).expect("a plan shape's entry");
        let fixed = entry.inputs.clone();
        std::mem::swap(&mut self.arena, &mut entry.arena);
        let out = f(self, &fixed);
        let entry = self.graphs.entries.get_mut(key).expect("forgotten only from outside a run");
        std::mem::swap(&mut self.arena, &mut entry.arena);
        out
    }

    /// Records `exe`'s launches reading the input buffers `fixed`; returns the graph, the
    /// buffers its outputs land in, and the first step it could not record, if any (that
    /// graph must not be replayed). A parameter the plan writes into a new buffer is copied
    /// into its own inside the graph (see [`Self::run_here`]).
    fn capture(&mut self, exe: &Executable, inputs: &[HostTensor], fixed: &[Value<B>]) -> Result<Captured<B>> {
        B::graph_start_capture(&self.device).map_err(|e| RuntimeError::Device(format!("starting the capture: {e:?}")))?;
        self.watch = Watch::Capture(None);
        let outs = self.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone());
        let Watch::Capture(why) = std::mem::replace(&mut self.watch, Watch::Off) else { unreachable!("set above") };
        let graph = B::graph_stop_capture(&self.device);
        let outs = outs?;
        let graph = graph.map_err(|e| {
            RuntimeError::Device(format!("capture failed (an allocation or a host copy inside the plan, outside the runtime's checks): {e:?}"))
        })?;
        Ok((graph, outs, why))
    }

    /// Copies of a run's outputs (their buffers are written again by the next run), the
    /// outputs' own buffers back to the arena.
    fn copied_out(&mut self, outs: Vec<Value<B>>) -> std::result::Result<Vec<Value<B>>, String> {
        outs.into_iter()
            .map(|v| match &v {
                Value::Float(t) => {
                    let c = B::device_copy(t).ok_or("this backend cannot copy an output out of its graph buffer")?;
                    v.give_back(&mut self.arena);
                    Ok(Value::Float(c))
                }
                _ => Err("a replayed plan's outputs must be floats".to_string()),
            })
            .collect()
    }

    /// A step that read the device, uploaded or took a new buffer cannot be in a graph: found
    /// by the first run's probe (a read or an upload; a constant's first upload does not
    /// count, later runs share it) and by the capture (any of the three); the first such step
    /// is kept, named, for the plan.
    fn check_capturable(&mut self, step: &Step, (reads, uploads, fresh): (u64, u64, u64)) {
        let what = if crate::value::device_reads() != reads {
            "reads the device back to the host"
        } else if crate::value::device_uploads() != uploads && !matches!(step.op, Op::Constant { .. }) {
            "uploads from the host"
        } else if self.arena.fresh() != fresh && matches!(self.watch, Watch::Capture(_)) {
            "takes a buffer the plan's arena does not hold (a new allocation)"
        } else {
            return;
        };
        if let Watch::Probe(found) | Watch::Capture(found) = &mut self.watch {
            found.get_or_insert_with(|| format!("{}: {}: {what}, which a captured graph cannot do", step.scope, step.op.label()));
        }
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
        let v = Value::from_host(value, &self.device, &self.settings());
        self.graphs.forget(name);
        self.put(name, v);
    }

    /// Draws every parameter's first value from `seed` (see `cellgraph_cells::materialize`).
    pub fn init_params(&mut self, params: &[cellgraph_cells::Parameter], seed: u64) {
        for p in params {
            self.set_param(&p.name, &p.materialize(seed));
        }
    }

    /// Sets optimizer state (or accumulators) to their initial constants.
    pub fn init_state(&mut self, state: &[cellgraph_compiler::update::StateSpec]) {
        for s in state {
            self.set_param(&s.name, &HostTensor::full(&s.ty, s.init));
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
        for step in &exe.steps {
            let before = (self.watch != Watch::Off).then(|| (crate::value::device_reads(), crate::value::device_uploads(), self.arena.fresh()));
            let v = match &step.op {
                Op::Parameter { .. } if step.deferred => continue,
                Op::Parameter { name } => self.bind_param(name, &step.ty)?,
                Op::Input { index, name } => {
                    let given = &inputs[*index];
                    if given.ty() != step.ty {
                        return Err(RuntimeError::Mismatch {
                            what: format!("input {index} (`{name}`)"),
                            expected: step.ty.to_string(),
                            got: given.ty().to_string(),
                        });
                    }
                    let copied = if B::HOST { crate::host::input::<B>(given, s.float_dtype, &mut self.arena, &self.device) } else { None };
                    match (copied, bound) {
                        (Some(t), _) => Value::Float(t),
                        (None, Some(b)) => b[*index].clone(),
                        (None, None) => Value::from_host(given, &self.device, &s),
                    }
                }
                Op::Constant { value } if !B::HOST && step.shared_constant => {
                    let key = (value.to_bits(), step.ty.clone());
                    match self.constants.iter().find(|(k, _)| *k == key) {
                        Some((_, v)) => v.clone(),
                        None => {
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
                            let v = eval(&cx, &step.op, Vec::new(), &step.ty)?;
                            self.constants.push((key, v.clone()));
                            v
                        }
                    }
                }
                Op::AllReduce if comm.is_some() => {
                    let c = comm.expect("matched");
                    let t0 = self.profile.is_some().then(std::time::Instant::now);
                    let x = slots[step.args[0].0].as_ref().expect("operands are computed before use");
                    let mut sum = x.to_host().to_f32();
                    c.all_reduce_sum(&mut sum);
                    let sum = HostTensor::f32(step.ty.dims().to_vec(), sum).expect("the operand's extents");
                    record(&mut self.profile, || step.op.label(), since(t0));
                    Value::from_host_owned(sum, &self.device, &s)
                }
                op => {
                    if let Some(name) = &step.target {
                        let target = step.args[0].0;
                        if slots[target].is_none() {
                            // A deferred read: check it, then take it out of the session.
                            self.bind_param(name, &step.arg_types[0])?;
                            slots[target] = self.pull(name);
                        }
                    }
                    // On host backends an accumulator read only here is added into in place, and
                    // a reshape keeps its operand's memory at the operand's last use (else copies
                    // it into the arena).
                    let reshape = matches!(op, Op::Reshape { .. } | Op::Flatten);
                    let takes_first = B::HOST && self.native && (reshape || (matches!(op, Op::AssignAdd) && step.args[0].1));
                    let args: Vec<_> = step
                        .args
                        .iter()
                        .zip(&step.arg_types)
                        .enumerate()
                        .map(|(k, (&(slot, moved), ty))| {
                            // Host backends lend an operand at its last use too, and take its
                            // buffer back after the step (below).
                            let take = moved && (!B::HOST || (takes_first && k == 0));
                            let v = if take { slots[slot].take() } else { slots[slot].clone() };
                            (v.expect("operands are computed before use"), ty)
                        })
                        .collect();
                    // With graphs on, device operands at their last use that burn's ops may
                    // consume (a burn op drops what it does not write into): held here and
                    // given back to the arena after the step, so a run returns every buffer it
                    // took and the next run takes none new (what a capture needs). Off, burn
                    // may write into them in place, as before.
                    let held: Vec<Value<B>> = match self.replay && !B::HOST {
                        true => step.args.iter().zip(&args).filter(|((_, moved), _)| *moved).map(|(_, (v, _))| v.clone()).collect(),
                        false => Vec::new(),
                    };
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
                    let t0 = self.profile.is_some().then(std::time::Instant::now);
                    let v = if takes_first && reshape {
                        let Ok([(x, ty)]) = <[_; 1]>::try_from(args) else { unreachable!("a reshape's arity is checked by the verifier") };
                        match x {
                            Value::Float(x) => match crate::host::reshape::<B>(x, &step.ty, &self.device, &mut self.arena) {
                                Ok(t) => Value::Float(t),
                                Err(x) => eval(&cx, op, vec![(Value::Float(x), ty)], &step.ty)?,
                            },
                            x => eval(&cx, op, vec![(x, ty)], &step.ty)?,
                        }
                    } else if takes_first {
                        let Ok([(acc, _), (g, _)]) = <[_; 2]>::try_from(args) else { unreachable!("assign_add's arity is checked by the verifier") };
                        let tys = (&step.arg_types[0], &step.arg_types[1]);
                        match (acc, g) {
                            (Value::Float(acc), Value::Float(g)) => match crate::host::assign_add::<B>(acc, &g, &step.ty, &self.device) {
                                Ok(t) => Value::Float(t),
                                Err(acc) => eval(&cx, op, vec![(Value::Float(acc), tys.0), (Value::Float(g), tys.1)], &step.ty)?,
                            },
                            (acc, g) => eval(&cx, op, vec![(acc, tys.0), (g, tys.1)], &step.ty)?,
                        }
                    } else if let (Some(n), Op::Epilogue { head, .. }) = (step.accumulator.filter(|_| !B::HOST && self.in_place), op) {
                        // Accumulators that are views of one flat device buffer: the head adding
                        // into the view's own memory where the device has such a kernel, else the
                        // head, then `assign_add` into it.
                        let mut args = args;
                        let mut acc = args.split_off(n);
                        let into = match (&step.kernel, acc.as_slice()) {
                            (Some(Native::Epilogue { head: k, .. }), [(Value::Float(a), _)]) if self.native => {
                                let floats: Option<Vec<_>> = args.iter().map(|(v, _)| if let Value::Float(t) = v { Some(t) } else { None }).collect();
                                floats.is_some_and(|f| B::device_accumulate(k, &f, a, cx.tf32, &mut self.arena))
                            }
                            _ => false,
                        };
                        if into {
                            for (v, _) in args {
                                v.give_back(&mut self.arena);
                            }
                            acc.swap_remove(0).0
                        } else {
                            let (g, ran) = run_head(&cx, head, step, args, self.native, &mut self.kept, &mut self.arena)?;
                            if ran == Ran::BurnOps {
                                *self.burn_steps.entry(head.label()).or_default() += 1;
                            }
                            match (acc.as_slice(), g) {
                                ([(Value::Float(a), _)], Value::Float(g)) if B::assign_add_in_place(a, g.clone()) => {
                                    Value::<B>::Float(g).give_back(&mut self.arena);
                                    acc.swap_remove(0).0
                                }
                                (_, g) => eval(&cx, &Op::AssignAdd, acc.into_iter().chain([(g, &step.ty)]).collect(), &step.ty)?,
                            }
                        }
                    } else {
                        let kernel = step.kernel.as_ref().filter(|_| self.native);
                        match kernel.and_then(|k| run_bound(k, &args, &step.ty, &cx, &mut self.kept, &mut self.arena)) {
                            Some(t) => {
                                // Operands at their last use give their memory back (a
                                // device kernel only read them; later launches run after it).
                                for (v, _) in args {
                                    v.give_back(&mut self.arena);
                                }
                                Value::Float(t)
                            }
                            None => match (op, kernel) {
                                // On device backends: the head on its bound kernel, the program on burn's ops.
                                (Op::Epilogue { head, expr }, Some(Native::Epilogue { head_args, .. })) => {
                                    let mut args = args;
                                    let rest = args.split_off(*head_args);
                                    let (y, ran) = run_head(&cx, head, step, args, self.native, &mut self.kept, &mut self.arena)?;
                                    if ran == Ran::BurnOps {
                                        *self.burn_steps.entry(head.label()).or_default() += 1;
                                    }
                                    crate::lower::epilogue_program(&cx, y, expr, rest, &step.ty)?
                                }
                                // Its operand, unchanged.
                                (Op::StopGradient, _) => {
                                    let Ok([(v, _)]) = <[_; 1]>::try_from(args) else {
                                        unreachable!("stop_gradient's arity is checked by the verifier")
                                    };
                                    v
                                }
                                // A parameter's new value: the second operand, moved.
                                (Op::Assign, _) => {
                                    let Ok([_, (v, _)]) = <[_; 2]>::try_from(args) else { unreachable!("assign's arity is checked by the verifier") };
                                    v
                                }
                                _ => {
                                    // A reshape moves no values (on devices a view of the buffer).
                                    if !matches!(op, Op::Reshape { .. } | Op::Flatten) {
                                        *self.burn_steps.entry(op.label()).or_default() += 1;
                                    }
                                    eval(&cx, op, args, &step.ty)?
                                }
                            },
                        }
                    };
                    if t0.is_some() && self.profile_sync {
                        B::sync(&self.device)
                            .map_err(|e| RuntimeError::Device(format!("{}: {}: waiting for the device: {e:?}", step.scope, op.label())))?;
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
                    v
                }
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
        let mut stay = stay.into_iter();
        for (name, slot) in &exe.writes {
            let v = slots[*slot].clone().expect("writes are pinned");
            let v = match (stay.next().flatten(), v) {
                // Copied into the buffer it had (a launch; captured into the graph during a
                // capture); the new buffer goes back to the arena with the slots below.
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
}

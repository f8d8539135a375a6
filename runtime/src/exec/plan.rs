//! Compiling a graph to a plan: the pass pipeline, verification, and the flat schedule of
//! steps, each with its operands' last uses, its bound kernel and what it keeps for later
//! steps; the plan's memory ([`Executable::arena`]) is known here.

use std::collections::BTreeMap;
use std::sync::Arc;

use cellgraph_compiler::dump::DumpOptions;
use cellgraph_compiler::passes::pipeline::{self, PipelineOptions};
use cellgraph_compiler::{DType, Graph, HostData, HostTensor, Op, TensorType};

use crate::error::{Result, RuntimeError};
use crate::kernel::{ConvAlgo, ConvKind, Native, Products};

/// One scheduled node.
#[derive(Clone, Debug)]
pub(super) struct Step {
    pub(super) slot: usize,
    pub(super) op: Op,
    pub(super) ty: TensorType,
    pub(super) scope: String,
    /// `(slot, moved)`: `moved` when this step is the operand's last use.
    pub(super) args: Vec<(usize, bool)>,
    /// The operands' types, in order.
    pub(super) arg_types: Vec<TensorType>,
    /// For an `assign`/`assign_add`: the written parameter's name.
    pub(super) target: Option<String>,
    /// For a parameter read only as the target of its own write (an accumulator): the read
    /// is deferred to the write, which takes the value out of the session so that the update
    /// (`assign_add`) reuses its buffer in place.
    pub(super) deferred: bool,
    /// Slots whose last use is this step but that were shared, not moved (an operand used
    /// twice by its last user): freed right after the step.
    pub(super) frees: Vec<usize>,
    /// The step's kernel, bound when the plan is compiled; `None` runs burn's ops.
    pub(super) kernel: Option<Native>,
    /// For an epilogue that adds its head's result to an accumulator only it and its write
    /// read ([`cellgraph_compiler::passes::epilogue::accumulator`]): the accumulator's operand.
    pub(super) accumulator: Option<usize>,
    /// A loss, gather or scatter-add whose integer ids are a plan input, checked on the host
    /// before the run ([`IdCheck`]).
    pub(super) ids_checked: bool,
    /// A constant that no `assign`/`assign_add` writes and that is not an output: on device
    /// backends made once per session and shared (see [`super::Session::run`]).
    pub(super) shared_constant: bool,
    /// A product (matmul, convolution, attention) whose float operands all hold bf16 values:
    /// a candidate for bf16 products ([`choose_products`]).
    pub(super) bf16_operands: bool,
    /// The low-precision type (bf16, f16) the step's float result holds only values of, when
    /// the graph computes in one ([`holds_low`]): a device session may store it in that type
    /// (see [`super::bind::low_stores`]).
    pub(super) holds: Option<DType>,
    /// A `round_to` bf16 of a parameter that only bf16 products read, as factors
    /// ([`rounded_when_packed`]): they round each value as they pack it, so a session whose
    /// products run on bf16 hands them the parameter itself (see [`super::Session`]'s binding).
    pub(super) rounded_when_packed: bool,
    /// A step that alone reads its operand and whose work the operand's step does on host
    /// backends ([`merge_into_producers`]): that step (this index).
    pub(super) merged_into: Option<usize>,
    /// On that producing step: the kernel doing both steps' work.
    pub(super) merged: Option<Merged>,
}

/// Two steps, the second alone reading the first's result, run on host backends as one kernel
/// at the first ([`merge_into_producers`]); the second passes the value on.
#[derive(Clone, Debug)]
pub(super) struct Merged {
    pub(super) kind: Merge,
    /// The kernel doing both steps' work.
    pub(super) kernel: Native,
    /// The reader's op, kernel and result type (what the merged kernel writes).
    pub(super) reader: Op,
    pub(super) reader_kernel: Native,
    pub(super) ty: TensorType,
}

/// What a [`Merged`] kernel does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Merge {
    /// An attention (forward or gradient) rounding its result as its items finish it.
    Rounding,
    /// A fused program's values summed over its last axis as they are computed.
    Sum,
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

/// Whether node `id` holds only values of `low` (bf16 or f16): a `round_to` to it, a program
/// whose result does (ends with that rounding, or moves such a value: ReLU, negation, ReLU's
/// gradient of one), a constant of it, or values moved from nodes that hold it (a reshape, a
/// transpose, a pad, ReLU... see [`cellgraph_compiler::passes::precision::moves_values`]).
pub(super) fn holds_low(g: &Graph, id: cellgraph_compiler::NodeId, low: DType, depth: usize) -> bool {
    if depth > 32 {
        return false;
    }
    let xs = g.operands(id);
    let operand = |i: usize| xs.get(i).is_some_and(|&o| holds_low(g, o, low, depth + 1));
    match &g.node(id).op {
        Op::RoundTo { dtype } => *dtype == low,
        Op::Fused { expr } => program_holds(expr, low, operand),
        // `$0` is the head's result (a product's sums: not low); `$1..` the operands after the head's.
        Op::Epilogue { head, expr } => {
            let skip = head.arity().min();
            program_holds(expr, low, |i| i > 0 && operand(skip + i - 1))
        }
        &Op::Constant { value } => cellgraph_compiler::passes::precision::round_f64(value, low) == value,
        op if cellgraph_compiler::passes::precision::moves_values(op) => {
            xs.iter().filter(|&&o| g.ty(o).dtype.is_float()).all(|&o| holds_low(g, o, low, depth + 1))
        }
        _ => false,
    }
}

/// Whether a program's result holds only values of `low`, given which of its operands do.
fn program_holds(expr: &cellgraph_compiler::program::Program, low: DType, arg: impl Fn(usize) -> bool) -> bool {
    use cellgraph_compiler::program::{Binary, Step, Unary, Val};
    let rounds = if low == DType::BF16 { Unary::RoundBf16 } else { Unary::RoundF16 };
    let mut lets: Vec<bool> = Vec::with_capacity(expr.steps().len());
    let holds = |v: Val, lets: &[bool]| match v {
        Val::Arg(i) => arg(i as usize),
        Val::Lit(_) => {
            let c = v.literal().expect("a literal");
            cellgraph_compiler::passes::precision::round_f64(c, low) == c
        }
        Val::Let(k) => lets[k as usize],
        Val::Scalar(_) => false,
    };
    for s in expr.steps() {
        let v = match *s {
            Step::Unary(op, _) if op == rounds => true,
            Step::Unary(Unary::Neg | Unary::Relu, x) => holds(x, &lets),
            Step::Unary(..) => false,
            // `dy * (y > 0)`: `dy`'s values or zeros.
            Step::Binary(Binary::ReluGrad, dy, _) => holds(dy, &lets),
            Step::Binary(..) => false,
            Step::Write(_, x) => holds(x, &lets),
        };
        lets.push(v);
    }
    lets.last().copied().unwrap_or(false)
}

/// The low-precision type a graph's micro-steps compute in (the one its `round_to` nodes round
/// to), if any.
fn low_precision(g: &Graph) -> Option<DType> {
    g.ids().into_iter().find_map(|id| match g.node(id).op {
        Op::RoundTo { dtype } => Some(dtype),
        _ => None,
    })
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
    pub(super) source: Graph,
    pub(super) graph: Graph,
    pub(super) steps: Vec<Step>,
    pub(super) outputs: Vec<usize>,
    /// `(parameter name, slot holding the new value)`.
    pub(super) writes: Vec<(String, usize)>,
    pub(super) slots: usize,
    pub(super) peak_bytes: usize,
    /// `(elements, buffers)`: the most float values of each length alive at once.
    pub(super) arena: Vec<(usize, usize)>,
    id_checks: Vec<IdCheck>,
    /// Steps that are collectives (`all_reduce`).
    pub(super) collectives: usize,
    /// The plan's identity in a session's captured graphs (clones share it).
    pub(super) id: u64,
}

impl Executable {
    /// The host checks a run makes before anything reaches the device: the number of inputs,
    /// and the integer ids a step takes from them (see [`IdCheck`]).
    pub(super) fn check_inputs(&self, inputs: &[HostTensor]) -> Result<()> {
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
    simulate_peak_stored(graph, steps, &[])
}

/// [`simulate_peak`] with each step's value in the type `stores` gives it, where it gives one
/// (a device session's bf16 / f16 storage, [`super::bind::low_stores`]; by step, as `steps`).
pub(super) fn simulate_peak_stored(graph: &Graph, steps: &[Step], stores: &[Option<TensorType>]) -> usize {
    let mut stored: BTreeMap<usize, usize> = BTreeMap::new();
    for (st, t) in steps.iter().zip(stores) {
        if let Some(t) = t {
            stored.insert(st.slot, t.size_bytes());
        }
    }
    let bytes = |slot: usize| stored.get(&slot).copied().unwrap_or_else(|| graph.ty(cellgraph_compiler::NodeId(slot as u32)).size_bytes());
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

/// Whether operand `k` of `st` is a factor of a product bound to bf16 products (a matmul or a
/// convolution other than the direct one, alone or heading an epilogue): the kernels pack
/// such a factor as bf16 pairs or AMX tiles, rounding each value to the nearest bf16 (ties to
/// even) as `round_to` does.
fn bf16_factor(st: &Step, k: usize) -> bool {
    fn bf16(n: &Native) -> bool {
        matches!(
            n,
            Native::MatMul { products: Products::Bf16, .. }
                | Native::BatchMatMul { products: Products::Bf16, .. }
                | Native::Conv { products: Products::Bf16, .. }
        )
    }
    match &st.kernel {
        Some(Native::Epilogue { head, head_args, .. }) => k < *head_args && bf16(head),
        Some(n) => bf16(n),
        None => false,
    }
}

/// Marks each `round_to` bf16 of a parameter (the bf16 copy of a weight, made every
/// micro-step) that is not an output and whose every reader reads it only as a factor of bf16
/// products ([`bf16_factor`]): the products round the parameter's values themselves, to the
/// same bits, so the copy need not be made (see [`Step::rounded_when_packed`]).
fn rounded_when_packed(steps: &mut [Step], outputs: &[usize]) {
    let params: std::collections::BTreeSet<usize> =
        steps.iter().filter(|st| matches!(st.op, Op::Parameter { .. }) && !st.deferred).map(|st| st.slot).collect();
    let marks: Vec<usize> = (0..steps.len())
        .filter(|&i| {
            let st = &steps[i];
            let of_param = matches!(st.op, Op::RoundTo { dtype: DType::BF16 }) && st.args.first().is_some_and(|a| params.contains(&a.0));
            let mut reads = steps.iter().flat_map(|r| r.args.iter().enumerate().filter(|(_, a)| a.0 == st.slot).map(move |(k, _)| (r, k))).peekable();
            of_param && !outputs.contains(&st.slot) && reads.peek().is_some() && reads.all(|(r, k)| bf16_factor(r, k))
        })
        .collect();
    for i in marks {
        steps[i].rounded_when_packed = true;
    }
}

/// Marks each step whose one operand only it reads, where the operand's step can do both steps'
/// work in one kernel on host backends, and gives that step the kernel ([`Merged`]; see
/// [`super::Session`]'s binding): a `round_to` (bf16, f16) of an attention's result, forward or
/// gradient (each (sequence, head) item rounds its rows as it finishes them, still in cache),
/// and a sum of a fused program's whole output over its trailing axes, or its leading and
/// trailing ones (the values summed as they are computed, never written out: a layer norm's
/// squared deviations and its gradient's row terms, batch norm's per-channel sums over `N,
/// H, W`). The same bits, one pass over the operand fewer. Runs after
/// [`keep_for_gradients`], whose slots the kernels keep.
fn merge_into_producers(steps: &mut [Step], outputs: &[usize]) {
    for i in 0..steps.len() {
        let [(x, true)] = steps[i].args[..] else { continue };
        let Some(j) = steps[..i].iter().position(|st| st.slot == x) else { continue };
        let readers = steps.iter().filter(|st| st.args.iter().any(|a| a.0 == x)).count();
        if readers != 1 || outputs.contains(&x) {
            continue;
        }
        let (Some(k), Some(r)) = (steps[j].kernel.as_ref(), steps[i].kernel.as_ref()) else { continue };
        let merged = match (&steps[j].op, &steps[i].op, k) {
            (Op::Attention { .. } | Op::AttentionGrad { .. }, &Op::RoundTo { dtype }, Native::Attention { .. }) => {
                crate::kernel::rounding(k, steps[j].args.len(), &steps[j].ty, dtype).map(|k| (Merge::Rounding, k))
            }
            (_, Op::ReduceSum(_) | Op::ReduceMean(_), Native::Fused(_)) => crate::kernel::sum_of(k, r).map(|k| (Merge::Sum, k)),
            _ => None,
        };
        if let Some((kind, kernel)) = merged {
            let (reader, reader_kernel, ty) = (steps[i].op.clone(), r.clone(), steps[i].ty.clone());
            steps[j].merged = Some(Merged { kind, kernel, reader, reader_kernel, ty });
            steps[i].merged_into = Some(j);
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
    // The environment's choice of the CPU's bf16 units, which plans read below: a value that
    // means nothing is refused here, before anything runs.
    crate::host::units_checked()?;
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
    let low = low_precision(&graph);
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
            // A program's operands holding only bf16 values: the host tabulates its subtrees on them.
            if let (Some(DType::BF16), Some(Native::Fused(e))) = (low, &kernel) {
                let bf16: Vec<bool> = ops.iter().map(|&o| holds_low(&graph, o, DType::BF16, 0)).collect();
                if bf16.contains(&true) {
                    kernel = Some(Native::Fused(Arc::new(e.with_bf16_args(bf16))));
                }
            }
            // The product's own operands (an epilogue's head's: the program's extra operands,
            // an accumulator say, are not multiplied).
            let factors = match &n.op {
                Op::Epilogue { head, .. } => &ops[..head.arity().min().min(ops.len())],
                _ => &ops[..],
            };
            let bf16_operands =
                is_product(&n.op) && factors.iter().filter(|&&o| graph.ty(o).dtype.is_float()).all(|&o| holds_low(&graph, o, DType::BF16, 0));
            if bf16_operands && crate::host::bf16_products_pay() {
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
            let holds = low.filter(|&d| n.ty.dtype == DType::F32 && holds_low(&graph, id, d, 0));
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
                holds,
                rounded_when_packed: false,
                merged_into: None,
                merged: None,
            }
        })
        .collect();
    let outputs: Vec<usize> = graph.outputs().iter().map(|o| o.index()).collect();
    rounded_when_packed(&mut steps, &outputs);
    keep_for_gradients(&mut steps);
    name_dense_filters(&mut steps);
    merge_into_producers(&mut steps, &outputs);
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

//! How each step of a plan runs in a session, decided once per plan and per session settings
//! (host or device backend, bound kernels on or off, in-place accumulation) instead of at
//! every step of every run: [`Session::run_here`](super::Session) and `run::compute` match
//! on the step's [`Exec`], and the host's decision ([`host_run`]) is also what `cellgraph
//! inspect plan` lists ([`super::Executable::host_steps`]), so the listing and the run cannot
//! disagree.

use cellgraph_compiler::{DType, Op, TensorType};

use super::plan::Step;
use crate::kernel::{Native, Products};

/// How a plan step runs on a host backend (the CPU), decided when the plan was compiled: see
/// [`super::Executable::host_steps`].
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
    /// A parameter's bf16 copy that only bf16 products read: not made, the products round the
    /// parameter's values as they pack them (a session with bf16 products on the host).
    RoundedWhenPacked,
    /// A `round_to` of an attention's result that alone reads it: not run, the attention's
    /// kernel rounds its result as it writes it.
    RoundedInProducer,
    /// A sum over the last axis of a program's output that alone reads it: not run, the
    /// program's kernel sums its values as it computes them.
    SummedInProducer,
    /// A bound host kernel, by name (`matmul`, `epilogue(conv Forward direct)`).
    Kernel(String),
    /// burn's ops (the reference lowering), with the reason no host kernel binds.
    BurnOps(String),
}

/// A bound kernel's name in plan listings: `matmul`, `matmul bf16`, `conv Forward im2col`,
/// `conv InputGrad dense taps`, `epilogue(matmul)`, `Fused`, ...
pub(super) fn kernel_name(k: &Native) -> String {
    let bf16 = |p: &Products| if *p == Products::Bf16 { " bf16" } else { "" };
    match k {
        Native::MatMul { products, .. } => format!("matmul{}", bf16(products)),
        Native::BatchMatMul { products, .. } => format!("batch_matmul{}", bf16(products)),
        Native::Conv { kind, algo, products, .. } => format!("conv {kind:?} {}{}", algo.name(), bf16(products)),
        Native::Epilogue { head, .. } => format!("epilogue({})", kernel_name(head)),
        Native::SumOf { program, outer: 1, .. } => format!("{}, summed over its trailing axes", kernel_name(&Native::Fused(program.clone()))),
        Native::SumOf { program, .. } => format!("{}, summed over its leading and trailing axes", kernel_name(&Native::Fused(program.clone()))),
        Native::Fused(e) => match crate::host::tables::subtrees(&e.prog, &e.bf16_args).len() {
            n @ 1.. if crate::host::tables::enabled() => format!("Fused, {n} subtree{} from bf16 tables", if n == 1 { "" } else { "s" }),
            _ => "Fused".into(),
        },
        other => {
            let debug = format!("{other:?}");
            debug.split(|c: char| !c.is_ascii_alphanumeric()).next().unwrap_or_default().to_string()
        }
    }
}

/// How one step runs (see the module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Exec {
    /// A parameter read at its first use (its write's step reads it): nothing to run here.
    Deferred,
    /// A parameter's value from the session.
    Param,
    /// A plan input: copied into the arena (host), the replay's buffer, or uploaded.
    Input,
    /// A constant made once per session and shared by the device's plans.
    SharedConstant,
    /// `all_reduce` over the run's communicator (with none, its operand: see [`Exec::Burn`]).
    Collective,
    /// A reshape keeping its operand's memory at the operand's last use (host kernels).
    ReshapeInPlace,
    /// `assign_add` written into the accumulator's memory (host kernels).
    AddInPlace,
    /// An epilogue whose accumulator (operand `n` on) is a view of one flat device buffer:
    /// the head adds into it.
    AccumulateInto(usize),
    /// The step's bound kernel (the host's, or the device's own). Steps the device's kernels
    /// do not take are bound to [`Exec::Burn`] instead ([`crate::Backend::device_declines`]);
    /// what only a launch can tell (a cubek kernel that does not set up) still runs on burn's
    /// ops when it happens, counted ([`super::Session::burn_op_steps`]).
    Kernel,
    /// The kernel doing this step's work and that of the step that alone reads its result
    /// ([`super::plan::Step::merged`], host backends): that step is [`Exec::Pass`]`(0)`.
    Merged,
    /// An epilogue whose program the device's kernels decline
    /// ([`crate::Backend::device_declines_program`]): its head on the head's kernel, then the
    /// program on burn's ops, counted (`epilogue`).
    HeadKernel,
    /// Operand `i`, unchanged: `stop_gradient` (0), `assign`'s new value (1).
    Pass(usize),
    /// burn's ops (the reference lowering), counted unless it is a reshape.
    Burn,
}

/// How `st` runs on a host backend with bound kernels on (the CPU), and why not on a kernel
/// where it does not.
pub(super) fn host_run(st: &Step) -> HostRun {
    match (&st.op, &st.kernel) {
        (Op::Parameter { .. } | Op::Input { .. }, _) => HostRun::Source,
        (Op::Reshape { .. } | Op::Flatten, _) => HostRun::Reshape,
        (Op::AssignAdd, _) if st.args.first().is_some_and(|a| a.1) => HostRun::AccumulateInPlace,
        (Op::AllReduce, _) => HostRun::Collective,
        (Op::Assign, _) => HostRun::Store,
        (Op::StopGradient, _) => HostRun::Identity,
        (_, Some(_)) if !st.ty.dtype.is_float() => HostRun::BurnOps(format!("its result is {}: host kernels write floats", st.ty)),
        (_, Some(_)) if st.arg_types.iter().any(|t| t.dtype == DType::Bool) => {
            HostRun::BurnOps("a bool operand: host kernels read floats and ids".into())
        }
        (_, Some(k)) => HostRun::Kernel(kernel_name(k)),
        (op, None) => HostRun::BurnOps(format!(
            "no host kernel for `{}` on ({})",
            op.label(),
            st.arg_types.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// What a device's kernels decline of a step, and why ([`crate::Backend::device_declines`] and
/// [`crate::Backend::device_declines_program`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Declined {
    Nothing,
    /// The whole step: it runs on burn's ops.
    Step(String),
    /// An epilogue's program: its head runs on the head's kernel.
    Program(String),
}

impl Declined {
    /// Why, when something is declined.
    pub(super) fn why(&self) -> Option<&str> {
        match self {
            Declined::Nothing => None,
            Declined::Step(why) | Declined::Program(why) => Some(why),
        }
    }
}

/// How `st` runs on a host (`host`) or device backend, with bound kernels on (`native`) or
/// off, and device accumulators as views of one buffer (`in_place`) or not; `declined`: what
/// the device's kernels do not take of it.
pub(super) fn exec_of(st: &Step, host: bool, native: bool, in_place: bool, declined: &Declined) -> Exec {
    match &st.op {
        Op::Parameter { .. } if st.deferred => return Exec::Deferred,
        Op::Parameter { .. } => return Exec::Param,
        Op::Input { .. } => return Exec::Input,
        Op::Constant { .. } if !host && st.shared_constant => return Exec::SharedConstant,
        Op::AllReduce => return Exec::Collective,
        _ => {}
    }
    if host && native {
        match host_run(st) {
            HostRun::Reshape => return Exec::ReshapeInPlace,
            HostRun::AccumulateInPlace => return Exec::AddInPlace,
            _ => {}
        }
    }
    match (&st.op, st.accumulator) {
        (Op::StopGradient, _) => Exec::Pass(0),
        (Op::Assign, _) => Exec::Pass(1),
        (Op::Epilogue { .. }, Some(n)) if !host && in_place => Exec::AccumulateInto(n),
        _ if !native || st.kernel.is_none() || matches!(declined, Declined::Step(_)) => Exec::Burn,
        (Op::Epilogue { .. }, _) if matches!(declined, Declined::Program(_)) => Exec::HeadKernel,
        _ => Exec::Kernel,
    }
}

/// How a session runs a plan: each step's [`Exec`], the type each step's result is stored in
/// where it is not the plan's (bf16 / f16 instead of f32: [`low_stores`]), and why the plan's
/// other low-precision values stay f32.
pub(super) struct Binding {
    pub(super) execs: Vec<Exec>,
    pub(super) stores: Vec<Option<TensorType>>,
    pub(super) kept_f32: KeptF32,
}

/// Whether the device's kernel for step `st` (run as `exec`) reads its operand `k` as stored
/// in bf16 / f16 ([`Native::stored_operands`]): a bound kernel's, an accumulating epilogue's
/// head's (its accumulator, operand `n` on, is f32), the loss's logits only where the class
/// ids were checked on the host (its kernel runs), and a convolution only on the exact kernels
/// (`tensor_cores`: the session asks tensor cores of it, whose routine reads f32).
fn reads_low(st: &Step, exec: Exec, k: usize, tensor_cores: bool) -> bool {
    let conv = |n: &Native| matches!(n, Native::Conv { .. });
    let (kernel, head) = match (&st.kernel, exec) {
        (Some(n), Exec::Kernel) => (n, n),
        (Some(n @ Native::Epilogue { head, .. }), Exec::AccumulateInto(acc)) if k < acc => (n, &**head),
        _ => return false,
    };
    k < kernel.stored_operands() && (!kernel.indexes_by_ids() || st.ids_checked) && !(conv(head) && tensor_cores)
}

/// Whether the device's kernel for step `st` (run as `exec`) writes its result in bf16 / f16:
/// the elementwise kernel, alone (a fused program) or after a product's or a sum's f32 result
/// (its epilogue's program, which rounds it), a convolution's forward or a pooling gradient
/// with its epilogue inside (or after it), max pooling, the layout copies and a gather (which
/// move stored values).
fn writes_low(st: &Step, exec: Exec) -> bool {
    let head = |n: &Native| {
        matches!(
            n,
            Native::MatMul { .. }
                | Native::BatchMatMul { .. }
                | Native::SumRows { .. }
                | Native::SumPlanes { .. }
                | Native::Conv { kind: crate::kernel::ConvKind::Forward, .. }
                | Native::MaxPoolGrad { .. }
        )
    };
    match (exec, &st.kernel) {
        (Exec::Kernel, Some(k)) if k.is_layout_copy() || matches!(k, Native::Gather { .. }) => true,
        (Exec::Kernel, Some(Native::Fused(_) | Native::MaxPool { .. })) => true,
        (Exec::Kernel, Some(Native::Epilogue { head: h, .. })) => head(h),
        _ => false,
    }
}

/// Why values a plan holds in low precision stay in f32 storage, by reason, and how many.
pub type KeptF32 = std::collections::BTreeMap<String, usize>;

/// The values of a low-precision plan (steps whose results hold only bf16 / f16 values,
/// [`Step::holds`]) that a device session stores in that type, half the bytes: those the
/// elementwise kernel or a product's epilogue writes and that only kernels reading the type
/// read ([`reads_low`], through reshapes, which are views), and that are neither an output nor
/// a parameter's new value. `stores(d)`: the device stores type `d`; `tensor_cores(st)`: the
/// session asks tensor cores of step `st` (TF32, bf16 products). Returns each step's
/// storage type where it is low, and why the others stay f32 (the first reader that does not
/// read the type, by its op; `output`; `written by <op>`).
pub(super) fn low_stores(
    steps: &[Step],
    execs: &[Exec],
    pinned: &[usize],
    stores: impl Fn(DType) -> bool,
    tensor_cores: impl Fn(&Step) -> bool,
) -> (Vec<Option<TensorType>>, KeptF32) {
    let index: std::collections::HashMap<usize, usize> = steps.iter().enumerate().map(|(i, st)| (st.slot, i)).collect();
    // The step whose buffer each value is: a reshape (a view on a device) is its operand's.
    let mut root: Vec<usize> = (0..steps.len()).collect();
    for (i, st) in steps.iter().enumerate() {
        if matches!(st.op, Op::Reshape { .. } | Op::Flatten) && execs[i] == Exec::Burn {
            if let Some(&(a, _)) = st.args.first() {
                root[i] = root[index[&a]];
            }
        }
    }
    let mut kept = KeptF32::new();
    let mut low: Vec<Option<DType>> = steps.iter().map(|st| st.holds.filter(|&d| stores(d))).collect();
    for (i, st) in steps.iter().enumerate() {
        let view = matches!(st.op, Op::Reshape { .. } | Op::Flatten);
        if low[i].is_some() && !view && !writes_low(st, execs[i]) {
            low[i] = None;
            *kept.entry(format!("written by {}", bind_label(st))).or_default() += 1;
        }
    }
    let mut drop = |r: usize, why: String, low: &mut Vec<Option<DType>>| {
        if low[r].take().is_some() {
            *kept.entry(why).or_default() += 1;
        }
    };
    for slot in pinned {
        if let Some(&i) = index.get(slot) {
            drop(root[i], "an output or a parameter's new value".into(), &mut low);
        }
    }
    for (r, st) in steps.iter().enumerate() {
        for (k, &(a, _)) in st.args.iter().enumerate() {
            let Some(&i) = index.get(&a) else { continue };
            let is_view = root[r] == root[i] && r != root[i];
            if low[root[i]].is_some() && !is_view && !reads_low(st, execs[r], k, tensor_cores(st)) {
                drop(root[i], format!("read by {}", bind_label(st)), &mut low);
            }
        }
    }
    let stores = (0..steps.len()).map(|i| low[root[i]].map(|d| steps[i].ty.with_dtype(d))).collect();
    (stores, kept)
}

/// A step's name in [`low_stores`]' reasons: its kernel's, else its op's.
fn bind_label(st: &Step) -> String {
    st.kernel.as_ref().map_or_else(|| st.op.label().to_string(), kernel_name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::Tiling;

    fn step(op: Op, kernel: Option<Native>, args: &[(usize, bool)]) -> Step {
        Step {
            slot: 9,
            op,
            ty: TensorType::f32(vec![4, 2]),
            scope: "net".into(),
            args: args.to_vec(),
            arg_types: args.iter().map(|_| TensorType::f32(vec![4, 2])).collect(),
            target: None,
            deferred: false,
            frees: Vec::new(),
            kernel,
            accumulator: None,
            ids_checked: false,
            shared_constant: false,
            bf16_operands: false,
            holds: None,
            rounded_when_packed: false,
            merged_into: None,
            merged: None,
        }
    }

    /// The decision table: what runs where, for each kind of step, with bound kernels on and
    /// off and device accumulators in place or not; the host's kernels are those it lists.
    #[test]
    fn each_kind_of_step_is_bound_once_to_how_it_runs() {
        let matmul = || {
            let k = Native::MatMul { m: 4, k: 3, n: 2, transpose_a: false, transpose_b: false, tiling: Tiling::Simple, products: Products::F32 };
            step(Op::MatMul { transpose_a: false, transpose_b: false }, Some(k), &[(0, false), (1, true)])
        };
        let reshape = step(Op::Reshape { shape: vec![8].into() }, None, &[(0, true)]);
        let add_into = step(Op::AssignAdd, None, &[(0, true), (1, true)]);
        let add_shared = step(Op::AssignAdd, None, &[(0, false), (1, true)]);
        let stop = step(Op::StopGradient, None, &[(0, false)]);
        let assign = step(Op::Assign, None, &[(0, false), (1, true)]);
        let mut deferred = step(Op::Parameter { name: "acc".into() }, None, &[]);
        deferred.deferred = true;
        let mut constant = step(Op::Constant { value: 1.0 }, Some(Native::Fill(1.0)), &[]);
        constant.shared_constant = true;
        let expr = "$0 $1 add".parse().expect("a program");
        let mut accumulate = step(Op::Epilogue { head: Box::new(Op::MatMul { transpose_a: false, transpose_b: false }), expr }, None, &[]);
        accumulate.kernel = matmul().kernel;
        accumulate.accumulator = Some(2);

        // (host, native, in_place) -> Exec, for each step.
        let cases: [(&Step, [Exec; 4]); 9] = [
            (&matmul(), [Exec::Kernel, Exec::Burn, Exec::Kernel, Exec::Kernel]),
            (&reshape, [Exec::ReshapeInPlace, Exec::Burn, Exec::Burn, Exec::Burn]),
            (&add_into, [Exec::AddInPlace, Exec::Burn, Exec::Burn, Exec::Burn]),
            (&add_shared, [Exec::Burn, Exec::Burn, Exec::Burn, Exec::Burn]),
            (&stop, [Exec::Pass(0); 4]),
            (&assign, [Exec::Pass(1); 4]),
            (&deferred, [Exec::Deferred; 4]),
            (&constant, [Exec::Kernel, Exec::Burn, Exec::SharedConstant, Exec::SharedConstant]),
            (&accumulate, [Exec::Kernel, Exec::Burn, Exec::Kernel, Exec::AccumulateInto(2)]),
        ];
        for (st, want) in cases {
            let got = [
                exec_of(st, true, true, false, &Declined::Nothing),
                exec_of(st, true, false, false, &Declined::Nothing),
                exec_of(st, false, true, false, &Declined::Nothing),
                exec_of(st, false, true, true, &Declined::Nothing),
            ];
            assert_eq!(got, want, "{}", st.op.label());
        }
        // A kernel the device declines runs on burn's ops, bound so; an accumulating epilogue
        // keeps adding into its accumulator's memory (its head's fallback is its own).
        assert_eq!(exec_of(&matmul(), false, true, false, &Declined::Step(String::new())), Exec::Burn);
        assert_eq!(exec_of(&accumulate, false, true, true, &Declined::Step(String::new())), Exec::AccumulateInto(2));
        // An epilogue whose program the device declines runs its head on the head's kernel.
        assert_eq!(exec_of(&accumulate, false, true, false, &Declined::Program(String::new())), Exec::HeadKernel);
        assert_eq!(exec_of(&accumulate, false, false, false, &Declined::Program(String::new())), Exec::Burn);
        assert_eq!(host_run(&matmul()), HostRun::Kernel("matmul".into()));
        assert!(matches!(host_run(&add_shared), HostRun::BurnOps(why) if why.contains("assign_add")));
    }

    /// A value held in f16 is stored so where its writer is the elementwise kernel and every
    /// reader reads f16 (a matmul, through a reshape); one a row-maximum kernel reads, one the
    /// plan returns, and one a kernel that writes f32 makes stay f32, each with its reason.
    #[test]
    fn values_are_stored_low_where_writer_and_readers_take_the_type() {
        let fused = |slot: usize, args: &[(usize, bool)]| {
            let prog: cellgraph_compiler::program::Program = "$0 round_f16".parse().expect("a program");
            let e = crate::kernel::Elementwise::new(prog.clone(), vec![crate::kernel::Read::Same], 8);
            let mut st = step(Op::Fused { expr: prog }, Some(Native::Fused(std::sync::Arc::new(e))), args);
            (st.slot, st.holds) = (slot, Some(DType::F16));
            st
        };
        let mut reshape = step(Op::Reshape { shape: vec![8].into() }, None, &[(1, true)]);
        (reshape.slot, reshape.holds) = (2, Some(DType::F16));
        let mm = Native::MatMul { m: 4, k: 2, n: 2, transpose_a: false, transpose_b: false, tiling: Tiling::Simple, products: Products::F32 };
        let mut matmul = step(Op::MatMul { transpose_a: false, transpose_b: false }, Some(mm), &[(2, true), (2, false)]);
        matmul.slot = 3;
        let mut rows = step(
            Op::ReduceMax(cellgraph_compiler::op::ReduceAttrs { axes: vec![1], keep_dims: false }),
            Some(Native::MaxRows { cols: 2 }),
            &[(4, true)],
        );
        rows.slot = 5;
        let mut relu = step(Op::Relu, Some(Native::Relu), &[(0, false)]);
        (relu.slot, relu.holds) = (7, Some(DType::F16));
        let steps = [fused(1, &[(0, false)]), reshape, matmul, fused(4, &[(0, false)]), rows, fused(6, &[(0, false)]), relu];
        let execs: Vec<Exec> = steps.iter().map(|st| exec_of(st, false, true, false, &Declined::Nothing)).collect();
        let (stores, kept) = low_stores(&steps, &execs, &[6], |d| d == DType::F16, |_| false);
        let low: Vec<bool> = stores.iter().map(|t| t.as_ref().is_some_and(|t| t.dtype == DType::F16)).collect();
        assert_eq!(low, [true, true, false, false, false, false, false]);
        let want: KeptF32 =
            [("read by MaxRows".into(), 1), ("an output or a parameter's new value".into(), 1), ("written by Relu".into(), 1)].into_iter().collect();
        assert_eq!(kept, want);
        // A device without the type stores nothing low.
        assert!(low_stores(&steps, &execs, &[6], |_| false, |_| false).0.iter().all(Option::is_none));
    }
}

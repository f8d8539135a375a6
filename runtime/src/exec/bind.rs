//! How each step of a plan runs in a session, decided once per plan and per session settings
//! (host or device backend, bound kernels on or off, in-place accumulation) instead of at
//! every step of every run: [`Session::run_here`](super::Session) matches on the step's
//! [`Exec`], and the host's decision ([`host_run`]) is also what `cellgraph inspect plan`
//! lists ([`super::Executable::host_steps`]), so the listing and the run cannot disagree.

use cellgraph_compiler::{DType, Op};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::Tiling;
    use cellgraph_compiler::TensorType;

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
}

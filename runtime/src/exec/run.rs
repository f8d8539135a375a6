//! How a plan's step runs once its execution kind is fixed ([`super::Exec`]): on its bound
//! kernel (the host's, or the device's own), its head on a kernel and its program on burn's
//! ops, or on burn's ops (the reference lowering), counted by name; and the profile's
//! bookkeeping.

use std::collections::BTreeMap;

use cellgraph_compiler::{Op, TensorType};

use super::plan::Step;
use crate::arena::Arena;
use crate::error::Result;
use crate::host::Kept;
use crate::kernel::Native;
use crate::lower::{eval, Ctx};
use crate::value::Value;
use crate::Backend;

/// Runs a step's bound kernel: on the host kernels on a host backend, on the device's own
/// kernels otherwise; `None` when it does not apply (a non-float operand, a dtype the kernels
/// lack), and burn's ops run the step instead.
pub(super) fn run_bound<B: Backend>(
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
/// runs it (`native`), else on burn's ops, counted in `burn_steps` under the head's name.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_head<B: Backend>(
    cx: &Ctx<B>,
    head: &Op,
    step: &Step,
    args: Vec<(Value<B>, &TensorType)>,
    native: bool,
    kept: &mut Kept,
    arena: &mut Arena,
    burn_steps: &mut BTreeMap<&'static str, u64>,
) -> Result<Value<B>> {
    let bound = match &step.kernel {
        Some(Native::Epilogue { head, .. }) if native => run_bound(head, &args, &step.ty, cx, kept, arena),
        _ => None,
    };
    match bound {
        Some(t) => {
            for (v, _) in args {
                v.give_back(arena);
            }
            Ok(Value::Float(t))
        }
        None => {
            *burn_steps.entry(head.label()).or_default() += 1;
            eval(cx, head, args, &step.ty)
        }
    }
}

/// An epilogue step's head on its kernel where the backend runs it ([`run_head`]), then its
/// program on burn's ops, counted as `epilogue`: a program the device's kernels decline (at
/// binding, [`super::Exec::HeadKernel`], or at the launch).
#[allow(clippy::too_many_arguments)]
pub(super) fn head_then_program<B: Backend>(
    cx: &Ctx<B>,
    step: &Step,
    mut args: Vec<(Value<B>, &TensorType)>,
    native: bool,
    kept: &mut Kept,
    arena: &mut Arena,
    burn_steps: &mut BTreeMap<&'static str, u64>,
) -> Result<Value<B>> {
    let (Op::Epilogue { head, expr }, Some(Native::Epilogue { head_args, .. })) = (&step.op, &step.kernel) else {
        unreachable!("an epilogue step bound to an epilogue kernel")
    };
    let rest = args.split_off(*head_args);
    let y = run_head(cx, head, step, args, native, kept, arena, burn_steps)?;
    *burn_steps.entry("epilogue").or_default() += 1;
    crate::lower::epilogue_program(cx, y, expr, rest, &step.ty)
}

/// A step on burn's ops (the reference lowering), counted in [`super::Session::burn_op_steps`]
/// unless it is a reshape (which moves no values; on devices a view of the buffer).
pub(super) fn burn_op<B: Backend>(
    cx: &Ctx<B>,
    op: &Op,
    args: Vec<(Value<B>, &TensorType)>,
    ty: &TensorType,
    burn_steps: &mut BTreeMap<&'static str, u64>,
) -> Result<Value<B>> {
    if !matches!(op, Op::Reshape { .. } | Op::Flatten) {
        *burn_steps.entry(op.label()).or_default() += 1;
    }
    eval(cx, op, args, ty)
}

/// Counts one call of `secs` under `key()` in a profile, when profiling is on (`key` is only
/// made then).
pub(super) fn record<K: Ord>(profile: &mut Option<BTreeMap<K, (u64, f64)>>, key: impl FnOnce() -> K, secs: Option<f64>) {
    if let (Some(p), Some(secs)) = (profile.as_mut(), secs) {
        let e = p.entry(key()).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += secs;
    }
}

/// Seconds since `t0` (profiling on).
pub(super) fn since(t0: Option<std::time::Instant>) -> Option<f64> {
    t0.map(|t| t.elapsed().as_secs_f64())
}

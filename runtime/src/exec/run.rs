//! How a plan's step runs once its execution kind is fixed ([`super::Exec`]): on its bound
//! kernel (the host's, or the device's own), its head on a kernel and its program on burn's
//! ops, or on burn's ops (the reference lowering), counted by name; and the profile's
//! bookkeeping.

use std::collections::BTreeMap;

use cellgraph_compiler::{Op, TensorType};

use super::bind::Exec;
use super::plan::Step;
use crate::arena::Arena;
use crate::error::Result;
use crate::host::Kept;
use crate::kernel::Native;
use crate::lower::{eval, Ctx};
use crate::value::Value;
use crate::Backend;

/// What a computing step uses of its session besides its operands, borrowed apart from the
/// rest of it: whether bound kernels run, what the host kernels keep between steps, the
/// memory values are written into, and the count of steps that ran on burn's ops.
pub(super) struct Work<'a> {
    pub native: bool,
    pub kept: &'a mut Kept,
    pub arena: &'a mut Arena,
    pub burn_steps: &'a mut BTreeMap<&'static str, u64>,
}

/// Runs a computing step (`exec`, neither a source nor a collective over a communicator) on
/// its operands `args`, taken or lent by the caller: its result. `store`: the type its kernel
/// writes, where the plan stores it low.
pub(super) fn compute<B: Backend>(
    exec: Exec,
    cx: &Ctx<B>,
    step: &Step,
    args: Vec<(Value<B>, &TensorType)>,
    store: Option<&TensorType>,
    w: &mut Work,
) -> Result<Value<B>> {
    let op = &step.op;
    let v = match exec {
        Exec::ReshapeInPlace => {
            let Ok([(x, ty)]) = <[_; 1]>::try_from(args) else { unreachable!("a reshape's arity is checked by the verifier") };
            match x {
                Value::Float(x) => match crate::host::reshape::<B>(x, &step.ty, cx.device, w.arena) {
                    Ok(t) => Value::Float(t),
                    Err(x) => eval(cx, op, vec![(Value::Float(x), ty)], &step.ty)?,
                },
                x => eval(cx, op, vec![(x, ty)], &step.ty)?,
            }
        }
        Exec::AddInPlace => {
            let Ok([(acc, _), (g, _)]) = <[_; 2]>::try_from(args) else { unreachable!("assign_add's arity is checked by the verifier") };
            let tys = (&step.arg_types[0], &step.arg_types[1]);
            match (acc, g) {
                (Value::Float(acc), Value::Float(g)) => match crate::host::assign_add::<B>(acc, &g, &step.ty, cx.device) {
                    Ok(t) => Value::Float(t),
                    Err(acc) => eval(cx, op, vec![(Value::Float(acc), tys.0), (Value::Float(g), tys.1)], &step.ty)?,
                },
                (acc, g) => eval(cx, op, vec![(acc, tys.0), (g, tys.1)], &step.ty)?,
            }
        }
        Exec::AccumulateInto(n) => accumulate_into(cx, step, args, n, w)?,
        Exec::Kernel => {
            let k = step.kernel.as_ref().expect("bound to steps with a kernel");
            match on_kernel(k, args, store.unwrap_or(&step.ty), cx, w) {
                Ok(v) => v,
                // Declined at the launch (what only a launch can tell: a cubek kernel that
                // does not set up): an epilogue's head on its kernel and its program on burn's
                // ops, else the whole step on burn's ops, counted (the program as `epilogue`).
                Err(args) if matches!(k, Native::Epilogue { .. }) => head_then_program(cx, step, args, w)?,
                Err(args) => burn_op(cx, op, args, &step.ty, w.burn_steps)?,
            }
        }
        Exec::Merged => {
            let m = step.merged.as_ref().expect("bound to steps with a merged kernel");
            match on_kernel(&m.kernel, args, &m.ty, cx, w) {
                Ok(v) => v,
                // Declined at the launch: this step on burn's ops (counted), then the reader's
                // on its own kernel, as the two steps run apart.
                Err(args) => {
                    let y = vec![(burn_op(cx, op, args, &step.ty, w.burn_steps)?, &step.ty)];
                    match on_kernel(&m.reader_kernel, y, &m.ty, cx, w) {
                        Ok(v) => v,
                        Err(y) => burn_op(cx, &m.reader, y, &m.ty, w.burn_steps)?,
                    }
                }
            }
        }
        // The program the device declines, decided at binding.
        Exec::HeadKernel => head_then_program(cx, step, args, w)?,
        Exec::Pass(i) => args.into_iter().nth(i).expect("the verifier checks the arity").0,
        Exec::Collective | Exec::Burn => burn_op(cx, op, args, &step.ty, w.burn_steps)?,
        Exec::Deferred | Exec::Param | Exec::Input | Exec::SharedConstant => unreachable!("sources are not computed"),
    };
    // burn's ops may hand a device tensor out with padded rows: the session's kernels read flat.
    Ok(v.unpitched(w.arena))
}

/// An epilogue whose accumulator (operands `n` on) is a view of one flat device buffer: the
/// head adding into the view's own memory where the device has such a kernel, else the head,
/// then `assign_add` into it.
fn accumulate_into<B: Backend>(cx: &Ctx<B>, step: &Step, mut args: Vec<(Value<B>, &TensorType)>, n: usize, w: &mut Work) -> Result<Value<B>> {
    let Op::Epilogue { head, .. } = &step.op else { unreachable!("bound to epilogues only") };
    let mut acc = args.split_off(n);
    let into = match (&step.kernel, acc.as_slice()) {
        (Some(Native::Epilogue { head: k, .. }), [(Value::Float(a), _)]) if w.native => {
            let floats: Option<Vec<_>> = args.iter().map(|(v, _)| if let Value::Float(t) = v { Some(t) } else { None }).collect();
            floats.is_some_and(|f| B::device_accumulate(k, &f, a, cx.tf32, w.arena))
        }
        _ => false,
    };
    if into {
        for (v, _) in args {
            v.give_back(w.arena);
        }
        return Ok(acc.swap_remove(0).0);
    }
    let g = run_head(cx, head, step, args, w)?;
    match (acc.as_slice(), g) {
        ([(Value::Float(a), _)], Value::Float(g)) if B::assign_add_in_place(a, g.clone()) => {
            Value::<B>::Float(g).give_back(w.arena);
            Ok(acc.swap_remove(0).0)
        }
        (_, g) => eval(cx, &Op::AssignAdd, acc.into_iter().chain([(g, &step.ty)]).collect(), &step.ty),
    }
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
    } else if k.indexes_by_ids() && !cx.ids_checked {
        // Class ids or rows computed in the plan: the lowering reads and checks them.
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
fn run_head<B: Backend>(cx: &Ctx<B>, head: &Op, step: &Step, args: Vec<(Value<B>, &TensorType)>, w: &mut Work) -> Result<Value<B>> {
    let args = match &step.kernel {
        Some(Native::Epilogue { head, .. }) if w.native => match on_kernel(head, args, &step.ty, cx, w) {
            Ok(v) => return Ok(v),
            Err(args) => args,
        },
        _ => args,
    };
    *w.burn_steps.entry(head.label()).or_default() += 1;
    eval(cx, head, args, &step.ty)
}

/// `k` on `args` ([`run_bound`]), writing `out`; its operands, at their last use, then give
/// their memory back (a device kernel only read them; later launches run after it). `Err`
/// hands the operands back where the kernel does not apply.
#[allow(clippy::type_complexity)]
fn on_kernel<'t, B: Backend>(
    k: &Native,
    args: Vec<(Value<B>, &'t TensorType)>,
    out: &TensorType,
    cx: &Ctx<B>,
    w: &mut Work,
) -> std::result::Result<Value<B>, Vec<(Value<B>, &'t TensorType)>> {
    let Some(t) = run_bound(k, &args, out, cx, w.kept, w.arena) else { return Err(args) };
    for (v, _) in args {
        v.give_back(w.arena);
    }
    Ok(Value::Float(t))
}

/// An epilogue step's head on its kernel where the backend runs it ([`run_head`]), then its
/// program on burn's ops, counted as `epilogue`: a program the device's kernels decline (at
/// binding, [`super::Exec::HeadKernel`], or at the launch).
fn head_then_program<B: Backend>(cx: &Ctx<B>, step: &Step, mut args: Vec<(Value<B>, &TensorType)>, w: &mut Work) -> Result<Value<B>> {
    let (Op::Epilogue { head, expr }, Some(Native::Epilogue { head_args, .. })) = (&step.op, &step.kernel) else {
        unreachable!("an epilogue step bound to an epilogue kernel")
    };
    let rest = args.split_off(*head_args);
    let y = run_head(cx, head, step, args, w)?;
    *w.burn_steps.entry("epilogue").or_default() += 1;
    crate::lower::epilogue_program(cx, y, expr, rest, &step.ty)
}

/// A step on burn's ops (the reference lowering), counted in [`super::Session::burn_op_steps`]
/// unless it is a reshape (which moves no values; on devices a view of the buffer).
fn burn_op<B: Backend>(
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

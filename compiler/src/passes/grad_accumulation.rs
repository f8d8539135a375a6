//! The GradAccumulation rewrite: one traced loss graph becomes three named graphs.
//!
//! - `micro_step`: forward + backward of one micro-batch; each parameter's gradient is
//!   `assign_add`-ed into `accu_grads.<param>` (times the micro-batch's item count under
//!   item-weighted normalisation). Output: the micro-batch's loss (and, under token-weighted
//!   normalisation, its token count).
//! - `optimizer`: reads the accumulators, scales them by the `grad_scale` input (1 for sum,
//!   1/k for the mean over k micro-batches, 1/N for N items), clips by global norm when asked,
//!   and applies the update rule. Runs once per window.
//! - `clear`: zeroes the accumulators. Runs once per window, after the optimizer.
//!
//! Running `micro_step` once per micro-batch keeps one micro-batch's activations alive at a
//! time; the accumulation itself is an in-place add.

use crate::autodiff::{grad, Sens};
use crate::emit::Emit;
use crate::error::{IrError, Result};
use crate::graph::{Graph, NodeId};
use crate::op::Op;
use crate::passes::dce::dce;
use crate::types::{Shape, TensorType};
use crate::update::{emit_updates, StateSpec, UpdateRule};

/// How accumulated gradients are normalised at the window boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Normalization {
    /// MindSpore: the sum of the micro-batches' gradients, unscaled.
    Sum,
    /// PyTorch/Accelerate and MindSpore boost: the mean over the window's micro-batches.
    Mean,
    /// The mean over the window's items: each micro-batch's (mean-loss) gradient is weighted by
    /// its item count and the sum divided by the total count (correct with unequal sizes).
    ItemWeighted,
    /// The mean over the window's tokens: the loss sums over a micro-batch's non-ignored tokens
    /// and counts them (the forward graph's second output); the micro-steps accumulate the
    /// summed gradients, and the boundary divides once by the count of the whole window, over
    /// every micro-batch and rank (Hugging Face's `num_items_in_batch`). A window without a
    /// token applies no update.
    Tokens,
}

/// Options of the rewrite.
#[derive(Clone, Debug)]
pub struct AccumulationOptions {
    pub normalization: Normalization,
    /// Clip the normalised accumulated gradient to this global L2 norm, once per window.
    pub clip_global_norm: Option<f64>,
}

/// The prefix of accumulator parameters (MindSpore's `accu_grads`).
pub const ACCUMULATOR_PREFIX: &str = "accu_grads";

/// The accumulator name of a parameter.
pub fn accumulator_name(param: &str) -> String {
    format!("{ACCUMULATOR_PREFIX}.{param}")
}

/// The `micro_step` graph: `forward` differentiated w.r.t. `params`, each gradient
/// `assign_add`-ed into its accumulator. The loss must be a scalar.
pub fn micro_graph(forward: &Graph, loss: NodeId, params: &[String], opts: &AccumulationOptions) -> Result<Graph> {
    let lt = forward.try_node(loss)?.ty.clone();
    if lt.rank() != 0 {
        return Err(IrError::Autodiff(format!("GradAccumulation needs a scalar loss, got {lt}; use a reducing loss")));
    }
    let count = match (opts.normalization, forward.outputs().get(1)) {
        (Normalization::Tokens, Some(&c)) if forward.try_node(c)?.ty.rank() == 0 => Some(c),
        (Normalization::Tokens, _) => {
            return Err(IrError::Autodiff(
                "Normalization::Tokens needs a loss that sums over tokens and counts them (CrossEntropyLoss::new().ignore_index(-100).tokens())".into(),
            ))
        }
        _ => None,
    };
    let mut g = forward.clone();
    g.name = "micro_step".into();
    let nodes: Vec<NodeId> = params
        .iter()
        .map(|p| g.find_parameter(p).ok_or_else(|| IrError::Autodiff(format!("the network has no parameter `{p}`"))))
        .collect::<Result<_>>()?;
    let grads = grad(&mut g, loss, &nodes, Sens::One)?;
    let items = g.inputs().first().map(|&(id, _, _)| g.ty(id).dims().first().copied().unwrap_or(1)).unwrap_or(1);
    for (p, d) in params.iter().zip(grads.grads) {
        let mut e = Emit::new(&mut g, format!("accumulate.{p}"));
        let d = match opts.normalization {
            Normalization::ItemWeighted => e.scale(d, items as f64)?,
            Normalization::Sum | Normalization::Mean | Normalization::Tokens => d,
        };
        let t = e.ty(d);
        let acc = e.g.add_leaf(Op::Parameter { name: accumulator_name(p) }, t, &e.scope)?;
        e.op(Op::AssignAdd, &[acc, d])?;
    }
    g.set_outputs(std::iter::once(loss).chain(count).collect());
    dce(&mut g);
    Ok(g)
}

/// The `optimizer` graph (and the state it declares) for parameters of the given types.
pub fn optimizer_graph(params: &[(String, TensorType)], rule: &dyn UpdateRule, opts: &AccumulationOptions) -> Result<(Graph, Vec<StateSpec>)> {
    let mut g = Graph::new("optimizer");
    let scalar = TensorType::f32(Shape::scalar());
    let scale = g.add_leaf(Op::Input { index: 0, name: "grad_scale".into() }, scalar.clone(), "optimizer")?;
    let mut triples = Vec::new();
    for (name, ty) in params {
        let p = g.add_leaf(Op::Parameter { name: name.clone() }, ty.clone(), "optimizer")?;
        let acc = g.add_leaf(Op::Parameter { name: accumulator_name(name) }, ty.clone(), "optimizer")?;
        let d = g.add(Op::Mul, &[acc, scale], "optimizer")?;
        triples.push((name.clone(), p, d));
    }
    if let Some(max) = opts.clip_global_norm {
        let mut e = Emit::new(&mut g, "optimizer.clip_by_global_norm");
        let mut total = None;
        for (_, _, d) in &triples {
            let sq = e.mul(*d, *d)?;
            let s = e.reduce_sum(sq, (0..e.ty(sq).rank()).collect(), false)?;
            total = Some(match total {
                Some(t) => e.add(t, s)?,
                None => s,
            });
        }
        let total = total.ok_or_else(|| IrError::Autodiff("nothing to clip: no trainable parameters".into()))?;
        let norm = e.op(Op::Sqrt, &[total])?;
        let max_c = e.constant(max, scalar.clone())?;
        let over = e.op(Op::GreaterEqual, &[norm, max_c])?;
        let ratio = e.div(max_c, norm)?;
        let one = e.constant(1.0, scalar)?;
        let factor = e.op(Op::Select, &[over, ratio, one])?;
        for (_, _, d) in &mut triples {
            *d = e.mul(*d, factor)?;
        }
        e.g.push_output(norm);
    }
    let state = emit_updates(&mut g, rule, &triples)?;
    Ok((g, state))
}

/// The `clear` graph for parameters of the given types.
pub fn clear_graph(params: &[(String, TensorType)]) -> Result<Graph> {
    let mut g = Graph::new("clear");
    for (name, ty) in params {
        let acc = g.add_leaf(Op::Parameter { name: accumulator_name(name) }, ty.clone(), "clear")?;
        let zero = g.add_leaf(Op::Constant { value: 0.0 }, ty.clone(), "clear")?;
        g.add(Op::Assign, &[acc, zero], "clear")?;
    }
    Ok(g)
}

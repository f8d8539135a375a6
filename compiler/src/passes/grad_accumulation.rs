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
use crate::passes::precision::round_values;
use crate::types::{DType, Shape, TensorType};
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

/// Dynamic loss scaling, decided once per window: the micro-steps seed the backward pass with
/// the scale `S` (the gradients come out `S` times larger, clear of f16's underflow); at the
/// boundary a non-finite accumulator on any rank skips the update on every rank and halves
/// `S`, and `growth_interval` clean windows in a row double it (PyTorch's `GradScaler`,
/// MindSpore's `DynamicLossScaleManager` with `scale_factor` 2). The optimizer sees the
/// gradients divided by `S` again, clipping included.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScale {
    /// The first scale (PyTorch's `init_scale`, 2^16).
    pub init: f64,
    /// Clean windows in a row after which the scale doubles (PyTorch's 2000).
    pub growth_interval: u64,
}

impl Default for LossScale {
    fn default() -> Self {
        LossScale { init: 65536.0, growth_interval: 2000 }
    }
}

impl LossScale {
    /// This scaling for a loss that sums over about `n` items (tokens) a window, where `self`
    /// is meant for their mean, as PyTorch's `GradScaler` scales a mean loss and Hugging Face's
    /// Trainer a sum divided by the window's `num_items_in_batch`: `init` divided by the largest
    /// power of two at most `n` (a power of two stays one), at least 1. Under
    /// [`Normalization::Tokens`] the micro-steps' gradients are those of the sum, `n` times a
    /// mean's, and from the mean's `init` the first windows would overflow f16 until the scale
    /// had halved about `log2 n` times.
    pub fn for_sum_over(self, n: usize) -> LossScale {
        let step = if n == 0 { 1 } else { 1usize << n.ilog2() };
        LossScale { init: (self.init / step as f64).max(1.0), ..self }
    }
}

/// A precision policy for the micro-steps (emulated, see [`crate::passes::precision`]): every
/// value they compute is rounded to `compute` (F16 or BF16) while each op's arithmetic stays
/// f32; master weights, accumulators (unless `accumulators` says otherwise), optimizer state,
/// the loss and the token count stay f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Precision {
    /// F16 or BF16.
    pub compute: DType,
    /// F32 (the default: each micro-step's low-precision gradient is added into an f32
    /// accumulator), or the compute format (the accumulator rounded after every add, as
    /// DeepSpeed and FSDP do unless told otherwise: for comparison).
    pub accumulators: DType,
    /// Dynamic loss scaling (f16's default), or none.
    pub loss_scale: Option<LossScale>,
}

impl Precision {
    /// bf16 compute, f32 accumulators, no loss scaling (bf16 has f32's range).
    pub fn bf16() -> Self {
        Precision { compute: DType::BF16, accumulators: DType::F32, loss_scale: None }
    }
    /// f16 compute, f32 accumulators, dynamic loss scaling with PyTorch's defaults.
    pub fn f16() -> Self {
        Precision { compute: DType::F16, accumulators: DType::F32, loss_scale: Some(LossScale::default()) }
    }
    /// The accumulators in `dtype` (F32, or the compute format).
    pub fn accumulate_in(self, dtype: DType) -> Self {
        Precision { accumulators: dtype, ..self }
    }
    /// The loss scaling in effect (none when computing in f32).
    pub fn scaling(&self) -> Option<LossScale> {
        self.loss_scale.filter(|_| self.compute != DType::F32)
    }
    /// Loss scaling as given (`None`: off).
    pub fn loss_scale(self, loss_scale: Option<LossScale>) -> Self {
        Precision { loss_scale, ..self }
    }
}

/// Options of the rewrite.
#[derive(Clone, Debug)]
pub struct AccumulationOptions {
    pub normalization: Normalization,
    /// Clip the normalised accumulated gradient to this global L2 norm, once per window.
    pub clip_global_norm: Option<f64>,
    /// Mixed precision (emulated); `None`: f32 throughout.
    pub precision: Option<Precision>,
}

/// The prefix of accumulator parameters (MindSpore's `accu_grads`).
pub const ACCUMULATOR_PREFIX: &str = "accu_grads";

/// The accumulator name of a parameter.
pub fn accumulator_name(param: &str) -> String {
    format!("{ACCUMULATOR_PREFIX}.{param}")
}

/// The `micro_step` graph: `forward` differentiated w.r.t. `params`, each gradient
/// `assign_add`-ed into its accumulator. The loss must be a scalar. Under a precision policy
/// the values are rounded to the compute format (the loss and count excepted) and, with loss
/// scaling, the backward pass is seeded by the graph input `sens` (the scale).
pub fn micro_graph(forward: &Graph, loss: NodeId, params: &[String], opts: &AccumulationOptions) -> Result<Graph> {
    let lt = forward.try_node(loss)?.ty.clone();
    if lt.rank() != 0 {
        return Err(IrError::Autodiff(format!("GradAccumulation needs a scalar loss, got {lt}; use a reducing loss")));
    }
    let count = match (opts.normalization, forward.outputs().get(1)) {
        (Normalization::Tokens, Some(&c)) if forward.try_node(c)?.ty.rank() == 0 => Some(c),
        (Normalization::Tokens, _) => {
            return Err(IrError::Autodiff(
                "Normalization::Tokens needs a loss that sums over tokens and counts them (CrossEntropyLoss::new().ignore_index(-100).tokens())"
                    .into(),
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
    let precision = opts.precision.filter(|p| p.compute != DType::F32);
    let sens = if precision.and_then(|p| p.scaling()).is_some() { Sens::Input } else { Sens::One };
    let grads = grad(&mut g, loss, &nodes, sens)?;
    let rounded = match precision {
        Some(p) => round_values(&mut g, p.compute),
        None => Default::default(),
    };
    let items = g.inputs().first().map(|&(id, _, _)| g.ty(id).dims().first().copied().unwrap_or(1)).unwrap_or(1);
    for (p, d) in params.iter().zip(grads.grads) {
        let d = rounded.get(&d).copied().unwrap_or(d);
        let mut e = Emit::new(&mut g, format!("accumulate.{p}"));
        let d = match opts.normalization {
            Normalization::ItemWeighted => e.scale(d, items as f64)?,
            Normalization::Sum | Normalization::Mean | Normalization::Tokens => d,
        };
        let t = e.ty(d);
        let acc = e.g.add_leaf(Op::Parameter { name: accumulator_name(p) }, t, &e.scope)?;
        match precision.map(|p| p.accumulators).filter(|&a| a != DType::F32) {
            // A low-precision accumulator: the sum rounded after every add.
            Some(dtype) => {
                let sum = e.add(acc, d)?;
                let r = e.op(Op::RoundTo { dtype }, &[sum])?;
                e.op(Op::Assign, &[acc, r])?
            }
            None => e.op(Op::AssignAdd, &[acc, d])?,
        };
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
        let ds: Vec<NodeId> = triples.iter().map(|t| t.2).collect();
        let (norm, factor) = clip_by_global_norm(&mut g, &ds, max)?;
        for (_, _, d) in &mut triples {
            *d = g.add(Op::Mul, &[*d, factor], "optimizer.clip_by_global_norm")?;
        }
        g.push_output(norm);
    }
    let state = emit_updates(&mut g, rule, &triples)?;
    Ok((g, state))
}

/// The global norm of the gradients `ds` and the factor clipping multiplies them by: `max /
/// norm` where the norm reaches `max`, else exactly 1.
fn clip_by_global_norm(g: &mut Graph, ds: &[NodeId], max: f64) -> Result<(NodeId, NodeId)> {
    let scalar = TensorType::f32(Shape::scalar());
    let mut e = Emit::new(g, "optimizer.clip_by_global_norm");
    let mut total = None;
    for &d in ds {
        let sq = e.mul(d, d)?;
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
    Ok((norm, factor))
}

/// The `clip` graph: the optimizer graph's clipping alone, for a boundary that runs the update
/// itself (the host's one pass per parameter). Input 0 `grad_scale`; outputs the factor the
/// gradients `accu_grads.<param> * grad_scale` are multiplied by, then their global norm: the
/// same ops as in [`optimizer_graph`], so the same bits.
pub fn clip_graph(params: &[(String, TensorType)], max: f64) -> Result<Graph> {
    let mut g = Graph::new("clip");
    let scale = g.add_leaf(Op::Input { index: 0, name: "grad_scale".into() }, TensorType::f32(Shape::scalar()), "optimizer")?;
    let mut ds = Vec::new();
    for (name, ty) in params {
        let acc = g.add_leaf(Op::Parameter { name: accumulator_name(name) }, ty.clone(), "optimizer")?;
        ds.push(g.add(Op::Mul, &[acc, scale], "optimizer")?);
    }
    let (norm, factor) = clip_by_global_norm(&mut g, &ds, max)?;
    g.set_outputs(vec![factor, norm]);
    Ok(g)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scale_for_a_sum_starts_where_the_means_would() {
        let s = LossScale::default();
        // The GPT's window: 32 sequences of 128 tokens, 2^12.
        assert_eq!(s.for_sum_over(4096), LossScale { init: 16.0, growth_interval: 2000 });
        // Not a power of two: the largest one below it, so the start stays a power of two.
        assert_eq!(s.for_sum_over(6000).init, 16.0);
        assert_eq!(s.for_sum_over(8191).init, 16.0);
        // Never below 1; nothing to divide by for one item, or none.
        assert_eq!(s.for_sum_over(1 << 20).init, 1.0);
        assert_eq!(s.for_sum_over(1).init, 65536.0);
        assert_eq!(s.for_sum_over(0).init, 65536.0);
    }
}

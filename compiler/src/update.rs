//! Optimizer update rules as graph builders.
//!
//! An [`UpdateRule`] declares its state parameters (MindSpore names such as
//! `moments.fc1.weight`), the scalar inputs it reads (learning rate first; anything that
//! depends on the update count, such as Adam's bias corrections, is a scalar input computed
//! on the host), and emits, per parameter, `assign` nodes that write the new parameter and
//! state. The same rule serves a plain training step and the GradAccumulation optimizer graph.

use crate::emit::Emit;
use crate::error::Result;
use crate::graph::{Graph, NodeId};
use crate::op::Op;
use crate::types::{Shape, TensorType};

/// A state parameter an optimizer keeps per trained parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct StateSpec {
    pub name: String,
    pub ty: TensorType,
    /// Every element's initial value.
    pub init: f64,
}

/// A rule's update as one elementwise formula over (parameter, gradient, state), for backends
/// that run a whole boundary (update, then clearing the accumulators) as one kernel over flat
/// buffers. The state buffers are in [`UpdateRule::state`]'s order; the scalar inputs are
/// [`UpdateRule::scalar_values`]. Must compute what [`UpdateRule::emit`] emits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FusedRule {
    /// `g += wd * p; v = v * momentum + g; p -= lr * (nesterov ? g + momentum * v : v)`.
    Momentum { momentum: f64, weight_decay: f64, nesterov: bool },
    /// PyTorch's SGD with the `stat` first-update flag (see `SGD`); no state when
    /// `momentum` is 0.
    Sgd { momentum: f64, dampening: f64, weight_decay: f64, nesterov: bool },
    /// Adam/AdamW with the bias corrections as scalar inputs 1 and 2.
    Adam { beta1: f64, beta2: f64, eps: f64, weight_decay: f64, decoupled: bool },
}

/// An optimizer's per-parameter update.
pub trait UpdateRule {
    /// MindSpore's class name (`Momentum`, `SGD`, `Adam`).
    fn name(&self) -> &'static str;
    /// State kept for parameter `param` of type `ty`, in the order `emit` receives it.
    fn state(&self, param: &str, ty: &TensorType) -> Vec<StateSpec>;
    /// The learning rate of the `update`-th applied update, counting from 0.
    fn learning_rate(&self, update: u64) -> f64;
    /// Checks the hyperparameters before anything runs: `Err` says which one is wrong and why
    /// (a negative or non-finite learning rate, a momentum or beta out of range).
    fn check(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Names of the f32 scalar inputs the update reads, `learning_rate` first.
    fn scalar_inputs(&self) -> Vec<&'static str> {
        vec!["learning_rate"]
    }
    /// Their values for the `update`-th applied update, counting from 0.
    fn scalar_values(&self, update: u64) -> Vec<f64> {
        vec![self.learning_rate(update)]
    }
    /// The same update as one elementwise formula, when the rule has one (see [`FusedRule`]).
    fn fused(&self) -> Option<FusedRule> {
        None
    }
    /// Emits the update of one parameter: writes to `param` and `state` with `assign`.
    fn emit(&self, e: &mut Emit, param: NodeId, grad: NodeId, state: &[NodeId], scalars: &[NodeId]) -> Result<()>;
}

/// Adds `rule`'s update of every `(name, param node, grad node)` to `g`: its scalar inputs
/// (numbered after the graph's existing inputs), its state parameters, and the writes.
/// Returns the state it declared.
pub fn emit_updates(g: &mut Graph, rule: &dyn UpdateRule, params: &[(String, NodeId, NodeId)]) -> Result<Vec<StateSpec>> {
    let scope = format!("optimizer.{}", rule.name());
    let first = g.inputs().len();
    let scalars = rule
        .scalar_inputs()
        .iter()
        .enumerate()
        .map(|(i, n)| g.add_leaf(Op::Input { index: first + i, name: (*n).into() }, TensorType::f32(Shape::scalar()), &scope))
        .collect::<Result<Vec<_>>>()?;
    let mut all_state = Vec::new();
    for (name, p, d) in params {
        let specs = rule.state(name, g.ty(*p));
        let state = specs
            .iter()
            .map(|s| g.add_leaf(Op::Parameter { name: s.name.clone() }, s.ty.clone(), &scope))
            .collect::<Result<Vec<_>>>()?;
        rule.emit(&mut Emit::new(g, scope.clone()), *p, *d, &state, &scalars)?;
        all_state.extend(specs);
    }
    Ok(all_state)
}

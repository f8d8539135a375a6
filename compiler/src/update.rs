//! Optimizer update rules, each written once as an [`Update`] program.
//!
//! An [`UpdateRule`] declares its state parameters (MindSpore names such as
//! `moments.fc1.weight`), the scalar inputs it reads (learning rate first; anything that
//! depends on the update count, such as Adam's bias corrections, is a scalar input computed
//! on the host), and its per-element update as an [`Update`]: a straight-line program over
//! the parameter, its gradient, its state and the scalars. Everything that runs an update
//! comes from that one program:
//! - the graph ([`Update::emit`]): `assign` nodes that write the new parameter and state,
//!   for a plain training step and the GradAccumulation optimizer graph (which the fusion
//!   pass turns into the host's fused kernels);
//! - the device's boundary kernel, which interprets the same program at kernel-compile time
//!   over flat buffers (`runtime::cube::update_clear`).
//!
//! Both compute the same ops in the same order and precision, so they agree to the bit.

use crate::emit::Emit;
use crate::error::{IrError, Result};
use crate::expr::{Binary, Unary};
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

/// A value an [`Update`] reads. `Param` and `State` are the values before the update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Val {
    Param,
    Grad,
    State(usize),
    /// The `i`-th scalar input ([`UpdateRule::scalar_inputs`]).
    Scalar(usize),
    /// A literal, rounded to the parameter's dtype (as a `constant` node is).
    Lit(f64),
    /// The result of step `i`.
    Let(usize),
}

/// Where an [`Update`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Param,
    State(usize),
}

/// One step of an [`Update`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    Unary(Unary, Val),
    Binary(Binary, Val, Val),
    /// Writes a value; later steps may no longer read the target.
    Write(Target, Val),
}

/// An optimizer's per-element update as a straight-line program, built with its methods:
///
/// ```
/// use cellgraph_compiler::update::{Target, Update, Val};
/// // p -= lr * g
/// let mut u = Update::new();
/// let s = u.mul(Val::Grad, Val::Scalar(0));
/// let p = u.sub(Val::Param, s);
/// u.write(Target::Param, p);
/// assert_eq!(u.steps().len(), 3);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Update {
    steps: Vec<Step>,
}

impl Update {
    /// An empty program.
    pub fn new() -> Update {
        Update::default()
    }
    /// The steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }
    fn push(&mut self, s: Step) -> Val {
        self.steps.push(s);
        Val::Let(self.steps.len() - 1)
    }
    pub fn unary(&mut self, op: Unary, x: Val) -> Val {
        self.push(Step::Unary(op, x))
    }
    pub fn binary(&mut self, op: Binary, a: Val, b: Val) -> Val {
        self.push(Step::Binary(op, a, b))
    }
    pub fn add(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Add, a, b)
    }
    pub fn sub(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Sub, a, b)
    }
    pub fn mul(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Mul, a, b)
    }
    pub fn div(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Div, a, b)
    }
    pub fn sqrt(&mut self, x: Val) -> Val {
        self.unary(Unary::Sqrt, x)
    }
    /// `x * c`.
    pub fn scale(&mut self, x: Val, c: f64) -> Val {
        self.mul(x, Val::Lit(c))
    }
    /// Writes `v` to `t`.
    pub fn write(&mut self, t: Target, v: Val) {
        self.steps.push(Step::Write(t, v));
    }

    /// Every value step `s` reads, in order.
    fn reads(s: &Step) -> Vec<Val> {
        match *s {
            Step::Unary(_, x) | Step::Write(_, x) => vec![x],
            Step::Binary(_, a, b) => vec![a, b],
        }
    }

    /// Checks the program against a rule with `states` state buffers and `scalars` scalar
    /// inputs: every value exists and is read before its target is written, a step's result
    /// is a value (not a write), each target is written at most once, the parameter exactly
    /// once.
    pub fn check(&self, states: usize, scalars: usize) -> std::result::Result<(), String> {
        let mut written: Vec<Target> = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            for v in Update::reads(s) {
                let target = match v {
                    Val::Param => Some(Target::Param),
                    Val::State(k) if k >= states => return Err(format!("step {i} reads state {k}; the rule keeps {states}")),
                    Val::State(k) => Some(Target::State(k)),
                    Val::Scalar(k) if k >= scalars => return Err(format!("step {i} reads scalar input {k}; the rule has {scalars}")),
                    Val::Let(k) if k >= i || matches!(self.steps[k], Step::Write(..)) => {
                        return Err(format!("step {i} reads step {k}, which is not an earlier value"))
                    }
                    Val::Grad | Val::Scalar(_) | Val::Lit(_) | Val::Let(_) => None,
                };
                if let Some(t) = target.filter(|t| written.contains(t)) {
                    return Err(format!("step {i} reads {t:?} after it was written"));
                }
            }
            if let Step::Write(t, _) = *s {
                if let Target::State(k) = t {
                    if k >= states {
                        return Err(format!("step {i} writes state {k}; the rule keeps {states}"));
                    }
                }
                if written.contains(&t) {
                    return Err(format!("step {i} writes {t:?} a second time"));
                }
                written.push(t);
            }
        }
        if !written.contains(&Target::Param) {
            return Err("the update never writes the parameter".into());
        }
        Ok(())
    }

    /// Emits the update of one parameter into the graph: `assign` nodes that write `param`
    /// and `state` (literals become scalar constants of the parameter's dtype, made where
    /// they are read).
    pub fn emit(&self, e: &mut Emit, param: NodeId, grad: NodeId, state: &[NodeId], scalars: &[NodeId]) -> Result<()> {
        let mut lets: Vec<Option<NodeId>> = Vec::with_capacity(self.steps.len());
        for s in &self.steps {
            let node = |v: Val, e: &mut Emit| -> Result<NodeId> {
                Ok(match v {
                    Val::Param => param,
                    Val::Grad => grad,
                    Val::State(k) => state[k],
                    Val::Scalar(k) => scalars[k],
                    Val::Lit(c) => e.scalar_like(c, param)?,
                    Val::Let(k) => lets[k].expect("checked: a step reads earlier values"),
                })
            };
            let out = match *s {
                Step::Unary(op, x) => {
                    let x = node(x, e)?;
                    Some(e.op(op.op(), &[x])?)
                }
                Step::Binary(op, a, b) => {
                    let a = node(a, e)?;
                    let b = node(b, e)?;
                    Some(e.op(op.op(), &[a, b])?)
                }
                Step::Write(t, v) => {
                    let dst = match t {
                        Target::Param => param,
                        Target::State(k) => state[k],
                    };
                    let src = match v {
                        Val::Lit(c) => {
                            let zeros = e.op(Op::ZerosLike, &[dst])?;
                            if c == 0.0 {
                                zeros
                            } else {
                                let c = e.scalar_like(c, dst)?;
                                e.add(zeros, c)?
                            }
                        }
                        v => node(v, e)?,
                    };
                    e.op(Op::Assign, &[dst, src])?;
                    None
                }
            };
            lets.push(out);
        }
        Ok(())
    }
}

/// An optimizer's per-parameter update.
pub trait UpdateRule {
    /// MindSpore's class name (`Momentum`, `SGD`, `Adam`).
    fn name(&self) -> &'static str;
    /// State kept for parameter `param` of type `ty`, in the order the update reads it.
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
    /// The update of one element: the one definition the graph and the kernels come from.
    fn update(&self) -> Update;
}

/// Adds `rule`'s update of every `(name, param node, grad node)` to `g`: its scalar inputs
/// (numbered after the graph's existing inputs), its state parameters, and the writes.
/// Returns the state it declared.
pub fn emit_updates(g: &mut Graph, rule: &dyn UpdateRule, params: &[(String, NodeId, NodeId)]) -> Result<Vec<StateSpec>> {
    let scope = format!("optimizer.{}", rule.name());
    let first = g.inputs().len();
    let names = rule.scalar_inputs();
    let scalars = names
        .iter()
        .enumerate()
        .map(|(i, n)| g.add_leaf(Op::Input { index: first + i, name: (*n).into() }, TensorType::f32(Shape::scalar()), &scope))
        .collect::<Result<Vec<_>>>()?;
    let update = rule.update();
    let mut all_state = Vec::new();
    for (name, p, d) in params {
        let specs = rule.state(name, g.ty(*p));
        update.check(specs.len(), names.len()).map_err(|detail| IrError::Misuse { scope: scope.clone(), op: "update", detail })?;
        let state = specs.iter().map(|s| g.add_leaf(Op::Parameter { name: s.name.clone() }, s.ty.clone(), &scope)).collect::<Result<Vec<_>>>()?;
        update.emit(&mut Emit::new(g, scope.clone()), *p, *d, &state, &scalars)?;
        all_state.extend(specs);
    }
    Ok(all_state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sgd() -> Update {
        let mut u = Update::new();
        let s = u.mul(Val::Grad, Val::Scalar(0));
        let p = u.sub(Val::Param, s);
        u.write(Target::Param, p);
        u
    }

    #[test]
    fn check_refuses_programs_that_read_what_they_cannot() {
        assert_eq!(sgd().check(0, 1), Ok(()));
        assert!(sgd().check(0, 0).unwrap_err().contains("scalar input 0"));
        let mut u = sgd();
        u.add(Val::Param, Val::Grad);
        assert!(u.check(0, 1).unwrap_err().contains("after it was written"));
        let mut u = Update::new();
        u.write(Target::State(0), Val::Lit(0.0));
        assert!(u.check(1, 0).unwrap_err().contains("never writes the parameter"));
        assert!(u.check(0, 0).unwrap_err().contains("writes state 0"));
        let mut u = sgd();
        u.write(Target::Param, Val::Grad);
        assert!(u.check(0, 1).unwrap_err().contains("second time"));
        let mut u = Update::new();
        u.write(Target::Param, Val::Let(0));
        assert!(u.check(0, 0).unwrap_err().contains("not an earlier value"));
    }
}

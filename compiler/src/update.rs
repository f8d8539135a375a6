//! Optimizer update rules, each written once as a [`Program`].
//!
//! An [`UpdateRule`] declares its state parameters (MindSpore names such as
//! `moments.fc1.weight`), the scalar inputs it reads (learning rate first; anything that
//! depends on the update count, such as Adam's bias corrections, is a scalar input computed
//! on the host), and its per-element update as a [`Program`] over the parameter
//! ([`Val::PARAM`]), its gradient ([`Val::GRAD`]), its state ([`Val::state`]) and the scalars
//! ([`Val::Scalar`]), writing the parameter and the state ([`Target`]). Everything that runs
//! an update comes from that one program:
//! - the graph ([`emit`]): `assign` nodes that write the new parameter and state, for a plain
//!   training step and the GradAccumulation optimizer graph;
//! - the host's and the devices' boundary kernels (`runtime::host::update::update_clear`,
//!   `runtime::cube::update_clear`), which run the same program over flat buffers.
//!
//! All compute the same ops in the same order and precision, so they agree to the bit.

use crate::emit::Emit;
use crate::error::{IrError, Result};
use crate::graph::{Graph, NodeId};
use crate::op::Op;
pub use crate::program::{Program, Step, Val};
use crate::types::{Shape, TensorType};

/// A state parameter an optimizer keeps per trained parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct StateSpec {
    pub name: String,
    pub ty: TensorType,
    /// Every element's initial value.
    pub init: f64,
}

/// The operands of an update: the parameter and its gradient, then the state.
impl Val {
    /// The parameter, as it was before the update.
    pub const PARAM: Val = Val::Arg(0);
    /// The gradient.
    pub const GRAD: Val = Val::Arg(1);
    /// State `k`, as it was before the update.
    pub const fn state(k: u8) -> Val {
        Val::Arg(2 + k)
    }
}

/// Where an update writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Param,
    State(u8),
}

impl Target {
    /// The program's output it is.
    pub fn out(self) -> u8 {
        match self {
            Target::Param => 0,
            Target::State(k) => 1 + k,
        }
    }

    /// The target of output `o`.
    pub fn of(o: u8) -> Target {
        match o {
            0 => Target::Param,
            k => Target::State(k - 1),
        }
    }

    /// The operand that reads the target's value before the update.
    pub fn before(self) -> Val {
        match self {
            Target::Param => Val::PARAM,
            Target::State(k) => Val::state(k),
        }
    }
}

impl Program {
    /// Writes `v` to the update's target `t`.
    pub fn assign(&mut self, t: Target, v: Val) {
        self.write(t.out(), v)
    }
}

/// Checks an update against a rule with `states` state buffers and `scalars` scalar inputs:
/// the form of every program ([`Program::check_form`]: earlier values read, each output
/// written at most once), every operand exists and is read before its target is written,
/// and the parameter is written.
pub fn check(u: &Program, states: usize, scalars: usize) -> std::result::Result<(), String> {
    u.check_form()?;
    let mut written: Vec<Target> = Vec::new();
    for (i, s) in u.steps().iter().enumerate() {
        for v in s.reads() {
            let target = match v {
                Val::Arg(1) => None,
                Val::Arg(0) => Some(Target::Param),
                Val::Arg(a) if (a - 2) as usize >= states => return Err(format!("step {i} reads state {}; the rule keeps {states}", a - 2)),
                Val::Arg(a) => Some(Target::State(a - 2)),
                Val::Scalar(k) if k as usize >= scalars => return Err(format!("step {i} reads scalar input {k}; the rule has {scalars}")),
                Val::Scalar(_) | Val::Lit(_) | Val::Let(_) => None,
            };
            if let Some(t) = target.filter(|t| written.contains(t)) {
                return Err(format!("step {i} reads {t:?} after it was written"));
            }
        }
        if let Step::Write(o, _) = *s {
            let t = Target::of(o);
            if let Target::State(k) = t {
                if k as usize >= states {
                    return Err(format!("step {i} writes state {k}; the rule keeps {states}"));
                }
            }
            written.push(t);
        }
    }
    if !written.contains(&Target::Param) {
        return Err("the update never writes the parameter".into());
    }
    Ok(())
}

/// Emits the update `u` of one parameter into the graph: `assign` nodes that write `param`
/// and `state` (literals become scalar constants of the parameter's dtype, made where they
/// are read).
pub fn emit(u: &Program, e: &mut Emit, param: NodeId, grad: NodeId, state: &[NodeId], scalars: &[NodeId]) -> Result<()> {
    let mut lets: Vec<Option<NodeId>> = Vec::with_capacity(u.steps().len());
    let arg = |a: u8| match a {
        0 => param,
        1 => grad,
        k => state[k as usize - 2],
    };
    for s in u.steps() {
        let node = |v: Val, e: &mut Emit| -> Result<NodeId> {
            Ok(match v {
                Val::Arg(a) => arg(a),
                Val::Scalar(k) => scalars[k as usize],
                Val::Lit(_) => e.scalar_like(v.literal().expect("a literal"), param)?,
                Val::Let(k) => lets[k as usize].expect("checked: a step reads earlier values"),
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
            Step::Write(o, v) => {
                let dst = match Target::of(o) {
                    Target::Param => param,
                    Target::State(k) => state[k as usize],
                };
                let src = match v.literal() {
                    Some(c) => {
                        let zeros = e.op(Op::ZerosLike, &[dst])?;
                        if c == 0.0 {
                            zeros
                        } else {
                            let c = e.scalar_like(c, dst)?;
                            e.add(zeros, c)?
                        }
                    }
                    None => node(v, e)?,
                };
                e.op(Op::Assign, &[dst, src])?;
                None
            }
        };
        lets.push(out);
    }
    Ok(())
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
    fn update(&self) -> Program;
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
        check(&update, specs.len(), names.len()).map_err(|detail| IrError::Misuse { scope: scope.clone(), op: "update", detail })?;
        let state = specs.iter().map(|s| g.add_leaf(Op::Parameter { name: s.name.clone() }, s.ty.clone(), &scope)).collect::<Result<Vec<_>>>()?;
        emit(&update, &mut Emit::new(g, scope.clone()), *p, *d, &state, &scalars)?;
        all_state.extend(specs);
    }
    Ok(all_state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sgd() -> Program {
        let mut u = Program::new();
        let s = u.mul(Val::GRAD, Val::Scalar(0));
        let p = u.sub(Val::PARAM, s);
        u.assign(Target::Param, p);
        u
    }

    #[test]
    fn check_refuses_programs_that_read_what_they_cannot() {
        assert_eq!(check(&sgd(), 0, 1), Ok(()));
        assert!(check(&sgd(), 0, 0).unwrap_err().contains("scalar input 0"));
        let mut u = sgd();
        u.add(Val::PARAM, Val::GRAD);
        assert!(check(&u, 0, 1).unwrap_err().contains("after it was written"));
        let mut u = Program::new();
        u.assign(Target::State(0), Val::lit(0.0));
        assert!(check(&u, 1, 0).unwrap_err().contains("never writes the parameter"));
        assert!(check(&u, 0, 0).unwrap_err().contains("writes state 0"));
        let mut u = sgd();
        u.assign(Target::Param, Val::GRAD);
        assert!(check(&u, 0, 1).unwrap_err().contains("second time"));
        let mut u = Program::new();
        u.assign(Target::Param, Val::Let(0));
        assert!(check(&u, 0, 0).unwrap_err().contains("not an earlier value"));
        let mut u = Program::new();
        u.assign(Target::Param, Val::state(1));
        assert!(check(&u, 1, 0).unwrap_err().contains("reads state 1"));
    }
}

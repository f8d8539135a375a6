//! Optimizers with MindSpore's names, formulas and state names. Each is an [`UpdateRule`]:
//! the learning rate (and anything else that depends on the update count) is a scalar input
//! fed per update from the host, so a schedule advances exactly once per applied update.

use cellgraph_compiler::emit::Emit;
use cellgraph_compiler::update::{FusedRule, StateSpec, UpdateRule};
use cellgraph_compiler::{NodeId, Op, Result, TensorType};

use crate::schedule::{non_negative, LearningRate};

/// Any optimizer (MindSpore's `nn.Optimizer`).
pub use cellgraph_compiler::update::UpdateRule as Optimizer;

fn state(prefix: &str, param: &str, ty: &TensorType, init: f64) -> StateSpec {
    StateSpec { name: format!("{prefix}.{param}"), ty: ty.clone(), init }
}

/// `g + wd * p`, or `g` when `wd` is zero.
fn decayed(e: &mut Emit, g: NodeId, p: NodeId, wd: f64) -> Result<NodeId> {
    if wd == 0.0 {
        return Ok(g);
    }
    let d = e.scale(p, wd)?;
    e.add(g, d)
}

/// `p - lr * step`, written to `p`.
fn descend(e: &mut Emit, p: NodeId, step: NodeId, lr: NodeId) -> Result<()> {
    let s = e.mul(step, lr)?;
    let new = e.sub(p, s)?;
    e.op(Op::Assign, &[p, new])?;
    Ok(())
}

/// MindSpore's `nn.Momentum`: `v = v * momentum + g; p -= lr * v` (Nesterov:
/// `p -= lr * (g + momentum * v)`), state `moments.<param>`; weight decay adds `wd * p` to `g`.
#[derive(Clone, Debug)]
pub struct Momentum {
    pub learning_rate: LearningRate,
    pub momentum: f64,
    pub weight_decay: f64,
    pub use_nesterov: bool,
}

impl Momentum {
    /// Momentum with MindSpore's defaults (no weight decay, no Nesterov).
    pub fn new(learning_rate: impl Into<LearningRate>, momentum: f64) -> Self {
        Momentum { learning_rate: learning_rate.into(), momentum, weight_decay: 0.0, use_nesterov: false }
    }
}

impl UpdateRule for Momentum {
    fn name(&self) -> &'static str {
        "Momentum"
    }
    fn state(&self, param: &str, ty: &TensorType) -> Vec<StateSpec> {
        vec![state("moments", param, ty, 0.0)]
    }
    fn learning_rate(&self, update: u64) -> f64 {
        self.learning_rate.at(update)
    }
    fn check(&self) -> Result<(), String> {
        self.learning_rate.check()?;
        non_negative("momentum", self.momentum)?;
        non_negative("weight_decay", self.weight_decay)
    }
    fn fused(&self) -> Option<FusedRule> {
        Some(FusedRule::Momentum { momentum: self.momentum, weight_decay: self.weight_decay, nesterov: self.use_nesterov })
    }
    fn emit(&self, e: &mut Emit, p: NodeId, g: NodeId, st: &[NodeId], sc: &[NodeId]) -> Result<()> {
        let g = decayed(e, g, p, self.weight_decay)?;
        let vm = e.scale(st[0], self.momentum)?;
        let v = e.add(vm, g)?;
        e.op(Op::Assign, &[st[0], v])?;
        let step = if self.use_nesterov {
            let mv = e.scale(v, self.momentum)?;
            e.add(g, mv)?
        } else {
            v
        };
        descend(e, p, step, sc[0])
    }
}

/// MindSpore's `nn.SGD` (PyTorch semantics): weight decay, momentum with dampening (the first
/// update sets `v = g`), optional Nesterov. State `accum.<param>` and `stat.<param>` (1 until
/// the first update).
#[derive(Clone, Debug)]
pub struct SGD {
    pub learning_rate: LearningRate,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl SGD {
    /// Plain SGD: `p -= lr * g`.
    pub fn new(learning_rate: impl Into<LearningRate>) -> Self {
        SGD { learning_rate: learning_rate.into(), momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
    /// Sets the momentum.
    pub fn momentum(mut self, m: f64) -> Self {
        self.momentum = m;
        self
    }
}

impl UpdateRule for SGD {
    fn name(&self) -> &'static str {
        "SGD"
    }
    fn state(&self, param: &str, ty: &TensorType) -> Vec<StateSpec> {
        vec![state("accum", param, ty, 0.0), state("stat", param, ty, 1.0)]
    }
    fn learning_rate(&self, update: u64) -> f64 {
        self.learning_rate.at(update)
    }
    fn check(&self) -> Result<(), String> {
        self.learning_rate.check()?;
        non_negative("momentum", self.momentum)?;
        non_negative("dampening", self.dampening)?;
        non_negative("weight_decay", self.weight_decay)
    }
    fn fused(&self) -> Option<FusedRule> {
        Some(FusedRule::Sgd { momentum: self.momentum, dampening: self.dampening, weight_decay: self.weight_decay, nesterov: self.nesterov })
    }
    fn emit(&self, e: &mut Emit, p: NodeId, g: NodeId, st: &[NodeId], sc: &[NodeId]) -> Result<()> {
        let g = decayed(e, g, p, self.weight_decay)?;
        if self.momentum == 0.0 {
            return descend(e, p, g, sc[0]);
        }
        let (v, stat) = (st[0], st[1]);
        // v' = stat * g + (1 - stat) * (momentum * v + (1 - dampening) * g)
        let vm = e.scale(v, self.momentum)?;
        let gd = e.scale(g, 1.0 - self.dampening)?;
        let later = e.add(vm, gd)?;
        let first = e.mul(stat, g)?;
        let stat_later = e.mul(stat, later)?;
        let not_first = e.sub(later, stat_later)?;
        let v_new = e.add(first, not_first)?;
        e.op(Op::Assign, &[v, v_new])?;
        let zero = e.op(Op::ZerosLike, &[stat])?;
        e.op(Op::Assign, &[stat, zero])?;
        let step = if self.nesterov {
            let mv = e.scale(v_new, self.momentum)?;
            e.add(g, mv)?
        } else {
            v_new
        };
        descend(e, p, step, sc[0])
    }
}

/// Adam. `decoupled = false` is MindSpore's `nn.Adam`: L2 weight decay added to the gradient,
/// `p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`. `decoupled = true` is
/// AdamW (decoupled): `p -= lr * wd * p` besides the same step. `eps` is added to `sqrt(v)`
/// before the bias correction, as in MindSpore. State `moment1.<param>`,
/// `moment2.<param>`; the bias corrections are scalar inputs.
#[derive(Clone, Debug)]
pub struct Adam {
    pub learning_rate: LearningRate,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub decoupled: bool,
}

impl Adam {
    /// Adam with MindSpore's defaults (`beta1 0.9`, `beta2 0.999`, `eps 1e-8`).
    pub fn new(learning_rate: impl Into<LearningRate>) -> Self {
        Adam { learning_rate: learning_rate.into(), beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false }
    }
    /// AdamW with decoupled weight decay `wd`.
    pub fn adamw(learning_rate: impl Into<LearningRate>, wd: f64) -> Self {
        Adam { weight_decay: wd, decoupled: true, ..Adam::new(learning_rate) }
    }
}

impl UpdateRule for Adam {
    fn name(&self) -> &'static str {
        if self.decoupled {
            "AdamW"
        } else {
            "Adam"
        }
    }
    fn state(&self, param: &str, ty: &TensorType) -> Vec<StateSpec> {
        vec![state("moment1", param, ty, 0.0), state("moment2", param, ty, 0.0)]
    }
    fn learning_rate(&self, update: u64) -> f64 {
        self.learning_rate.at(update)
    }
    fn check(&self) -> Result<(), String> {
        self.learning_rate.check()?;
        for (what, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(format!("{what} must be in [0, 1), got {b}"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(format!("eps must be a finite number > 0, got {}", self.eps));
        }
        non_negative("weight_decay", self.weight_decay)
    }
    fn scalar_inputs(&self) -> Vec<&'static str> {
        vec!["learning_rate", "bias_correction1", "bias_correction2"]
    }
    fn scalar_values(&self, update: u64) -> Vec<f64> {
        let t = (update + 1) as i32;
        vec![self.learning_rate(update), 1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t)]
    }
    fn fused(&self) -> Option<FusedRule> {
        Some(FusedRule::Adam { beta1: self.beta1, beta2: self.beta2, eps: self.eps, weight_decay: self.weight_decay, decoupled: self.decoupled })
    }
    fn emit(&self, e: &mut Emit, p: NodeId, g: NodeId, st: &[NodeId], sc: &[NodeId]) -> Result<()> {
        let (lr, bc1, bc2) = (sc[0], sc[1], sc[2]);
        let g = if self.decoupled { g } else { decayed(e, g, p, self.weight_decay)? };
        let m_old = e.scale(st[0], self.beta1)?;
        let g1 = e.scale(g, 1.0 - self.beta1)?;
        let m = e.add(m_old, g1)?;
        let v_old = e.scale(st[1], self.beta2)?;
        let gg = e.mul(g, g)?;
        let g2 = e.scale(gg, 1.0 - self.beta2)?;
        let v = e.add(v_old, g2)?;
        e.op(Op::Assign, &[st[0], m])?;
        e.op(Op::Assign, &[st[1], v])?;
        let sv = e.op(Op::Sqrt, &[v])?;
        let eps = e.scalar_like(self.eps, sv)?;
        let denom = e.add(sv, eps)?;
        let ratio = e.div(m, denom)?;
        let sb2 = e.op(Op::Sqrt, &[bc2])?;
        let corr = e.div(sb2, bc1)?;
        let step = e.mul(ratio, corr)?;
        let step = if self.decoupled && self.weight_decay != 0.0 {
            let wd = e.scale(p, self.weight_decay)?;
            e.add(step, wd)?
        } else {
            step
        };
        descend(e, p, step, lr)
    }
}

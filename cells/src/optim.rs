//! Optimizers with MindSpore's names, formulas and state names. Each is an [`UpdateRule`]:
//! the learning rate (and anything else that depends on the update count) is a scalar input
//! fed per update from the host, so a schedule advances exactly once per applied update.

use cellgraph_compiler::update::{Program, StateSpec, Target, UpdateRule, Val};
use cellgraph_compiler::TensorType;

use crate::schedule::{non_negative, LearningRate};

/// Any optimizer (MindSpore's `nn.Optimizer`).
pub use cellgraph_compiler::update::UpdateRule as Optimizer;

fn state(prefix: &str, param: &str, ty: &TensorType, init: f64) -> StateSpec {
    StateSpec { name: format!("{prefix}.{param}"), ty: ty.clone(), init }
}

/// `g + p * wd`, or `g` when `wd` is zero.
fn decayed(u: &mut Program, g: Val, wd: f64) -> Val {
    if wd == 0.0 {
        return g;
    }
    let d = u.scale(Val::PARAM, wd);
    u.add(g, d)
}

/// `p - step * lr`, written to `p` (the learning rate is scalar input 0).
fn descend(u: &mut Program, step: Val) {
    let s = u.mul(step, Val::Scalar(0));
    let new = u.sub(Val::PARAM, s);
    u.assign(Target::Param, new);
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
    fn update(&self) -> Program {
        let mut u = Program::new();
        let g = decayed(&mut u, Val::GRAD, self.weight_decay);
        let vm = u.scale(Val::state(0), self.momentum);
        let v = u.add(vm, g);
        u.assign(Target::State(0), v);
        let step = if self.use_nesterov {
            let mv = u.scale(v, self.momentum);
            u.add(g, mv)
        } else {
            v
        };
        descend(&mut u, step);
        u
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
    fn update(&self) -> Program {
        let mut u = Program::new();
        let g = decayed(&mut u, Val::GRAD, self.weight_decay);
        if self.momentum == 0.0 {
            descend(&mut u, g);
            return u;
        }
        let (v, stat) = (Val::state(0), Val::state(1));
        // v' = stat * g + (1 - stat) * (momentum * v + (1 - dampening) * g)
        let vm = u.scale(v, self.momentum);
        let gd = u.scale(g, 1.0 - self.dampening);
        let later = u.add(vm, gd);
        let first = u.mul(stat, g);
        let stat_later = u.mul(stat, later);
        let not_first = u.sub(later, stat_later);
        let v_new = u.add(first, not_first);
        u.assign(Target::State(0), v_new);
        u.assign(Target::State(1), Val::lit(0.0));
        let step = if self.nesterov {
            let mv = u.scale(v_new, self.momentum);
            u.add(g, mv)
        } else {
            v_new
        };
        descend(&mut u, step);
        u
    }
}

/// Adam. `decoupled = false` is MindSpore's `nn.Adam`: L2 weight decay added to the gradient,
/// `p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`. `decoupled = true` is
/// AdamW (decoupled): `p -= lr * wd * p` besides the same step. `eps` is added to `sqrt(v)`
/// before the bias correction, as in MindSpore, unless `pytorch_eps` ([`Adam::pytorch_eps`]).
/// State `moment1.<param>`, `moment2.<param>`; the bias corrections are scalar inputs.
#[derive(Clone, Debug)]
pub struct Adam {
    pub learning_rate: LearningRate,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub decoupled: bool,
    /// `eps` added after the bias correction, as `torch.optim.Adam`/`AdamW` (and so
    /// transformers' Trainer) do: `p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`.
    /// The two forms differ where `sqrt(v)` is near `eps` (early updates, tiny gradients).
    pub pytorch_eps: bool,
}

impl Adam {
    /// Adam with MindSpore's defaults (`beta1 0.9`, `beta2 0.999`, `eps 1e-8`).
    pub fn new(learning_rate: impl Into<LearningRate>) -> Self {
        Adam { learning_rate: learning_rate.into(), beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, pytorch_eps: false }
    }
    /// AdamW with decoupled weight decay `wd`.
    pub fn adamw(learning_rate: impl Into<LearningRate>, wd: f64) -> Self {
        Adam { weight_decay: wd, decoupled: true, ..Adam::new(learning_rate) }
    }
    /// `eps` added after the bias correction, as PyTorch's Adam and AdamW do (see
    /// [`Adam::pytorch_eps`](struct.Adam.html#structfield.pytorch_eps)).
    pub fn pytorch_eps(mut self) -> Self {
        self.pytorch_eps = true;
        self
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
    fn update(&self) -> Program {
        let mut u = Program::new();
        let (bc1, bc2) = (Val::Scalar(1), Val::Scalar(2));
        let g = if self.decoupled { Val::GRAD } else { decayed(&mut u, Val::GRAD, self.weight_decay) };
        let m_old = u.scale(Val::state(0), self.beta1);
        let g1 = u.scale(g, 1.0 - self.beta1);
        let m = u.add(m_old, g1);
        let v_old = u.scale(Val::state(1), self.beta2);
        let gg = u.mul(g, g);
        let g2 = u.scale(gg, 1.0 - self.beta2);
        let v = u.add(v_old, g2);
        u.assign(Target::State(0), m);
        u.assign(Target::State(1), v);
        let sv = u.sqrt(v);
        let step = if self.pytorch_eps {
            // (m / bc1) / (sqrt(v) / sqrt(bc2) + eps), in PyTorch's order.
            let sb2 = u.sqrt(bc2);
            let vhat = u.div(sv, sb2);
            let denom = u.add(vhat, Val::lit(self.eps));
            let mhat = u.div(m, bc1);
            u.div(mhat, denom)
        } else {
            let denom = u.add(sv, Val::lit(self.eps));
            let ratio = u.div(m, denom);
            let sb2 = u.sqrt(bc2);
            let corr = u.div(sb2, bc1);
            u.mul(ratio, corr)
        };
        let step = if self.decoupled && self.weight_decay != 0.0 {
            let wd = u.scale(Val::PARAM, self.weight_decay);
            u.add(step, wd)
        } else {
            step
        };
        descend(&mut u, step);
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellgraph_compiler::program::{Binary, Unary};
    use cellgraph_compiler::update::Step;

    /// One element's update by `u` in f64: the new parameter; `state` is updated in place.
    fn run(u: &Program, p: f64, g: f64, state: &mut [f64], scalars: &[f64]) -> f64 {
        let old = state.to_vec();
        let (mut lets, mut new_p) = (Vec::new(), p);
        for step in u.steps() {
            let val = |v: Val, lets: &[f64]| match v {
                Val::Arg(0) => p,
                Val::Arg(1) => g,
                Val::Arg(k) => old[k as usize - 2],
                Val::Scalar(i) => scalars[i as usize],
                Val::Lit(_) => v.literal().expect("a literal"),
                Val::Let(i) => lets[i as usize],
            };
            let r = match *step {
                Step::Unary(Unary::Sqrt, a) => val(a, &lets).sqrt(),
                Step::Unary(op, _) => panic!("{op:?} in an optimizer"),
                Step::Binary(op, a, b) => {
                    let (a, b) = (val(a, &lets), val(b, &lets));
                    match op {
                        Binary::Add => a + b,
                        Binary::Sub => a - b,
                        Binary::Mul => a * b,
                        Binary::Div => a / b,
                        Binary::ReluGrad => panic!("relu_grad in an optimizer"),
                    }
                }
                Step::Write(o, v) => {
                    let v = val(v, &lets);
                    match Target::of(o) {
                        Target::Param => new_p = v,
                        Target::State(i) => state[i as usize] = v,
                    }
                    f64::NAN
                }
            };
            lets.push(r);
        }
        new_p
    }

    /// AdamW with `pytorch_eps` takes `torch.optim.AdamW`'s steps (written out from its
    /// documentation), and without it MindSpore's, on gradients near `eps` where the two differ.
    #[test]
    fn adamw_takes_pytorchs_or_mindspores_steps() {
        let (lr, wd, eps, b1, b2) = (1e-3, 0.01, 1e-8, 0.9, 0.999);
        for torch in [true, false] {
            let opt = if torch { Adam::adamw(lr, wd).pytorch_eps() } else { Adam::adamw(lr, wd) };
            let u = opt.update();
            let (mut p, mut state) = (0.5, [0.0, 0.0]);
            let (mut want_p, mut m, mut v) = (0.5f64, 0.0, 0.0);
            for (t, g) in [3e-8, -1e-7, 2e-9, 5e-3].into_iter().enumerate() {
                p = run(&u, p, g, &mut state, &opt.scalar_values(t as u64));
                let t = (t + 1) as i32;
                m = b1 * m + (1.0 - b1) * g;
                v = b2 * v + (1.0 - b2) * g * g;
                let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
                let step = if torch { (m / bc1) / ((v / bc2).sqrt() + eps) } else { m / (v.sqrt() + eps) * bc2.sqrt() / bc1 };
                want_p = want_p - lr * wd * want_p - lr * step;
                assert!((p - want_p).abs() <= 1e-15, "torch {torch}, update {t}: {p} vs {want_p}");
                assert!((state[0] - m).abs() <= 1e-15 * m.abs() && (state[1] - v).abs() <= 1e-15 * v, "{state:?} vs {m} {v}");
            }
        }
        // The forms differ on these gradients (the first steps' effective eps is 30x larger).
        let ms = Adam::adamw(lr, wd);
        let (mut a, mut b) = ([0.0; 2], [0.0; 2]);
        let (pa, pb) = (
            run(&ms.update(), 0.5, 3e-8, &mut a, &ms.scalar_values(0)),
            run(&ms.clone().pytorch_eps().update(), 0.5, 3e-8, &mut b, &ms.scalar_values(0)),
        );
        assert!((pa - pb).abs() > 1e-4, "{pa} vs {pb}");
    }
}

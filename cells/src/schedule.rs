//! Learning-rate schedules, indexed by the number of optimizer updates already applied
//! (never by micro-steps), as Accelerate, DeepSpeed and MindSpore's `global_step` do.

/// A learning rate as a function of the update count.
#[derive(Clone, Debug, PartialEq)]
pub enum LearningRate {
    /// The same rate for every update.
    Constant(f64),
    /// `base * gamma^(u / step_size)`.
    Step { base: f64, step_size: u64, gamma: f64 },
    /// Cosine decay from `base` to `min` over `total` updates, then `min`.
    Cosine { base: f64, min: f64, total: u64 },
    /// Linear warmup over `warmup` updates from `base/warmup` up to the inner schedule's rate,
    /// then the inner schedule shifted by `warmup`.
    Warmup { warmup: u64, then: Box<LearningRate> },
}

impl LearningRate {
    /// The rate for update number `u` (0 for the first update).
    pub fn at(&self, u: u64) -> f64 {
        match self {
            LearningRate::Constant(lr) => *lr,
            LearningRate::Step { base, step_size, gamma } => base * gamma.powi((u / (*step_size).max(1)) as i32),
            LearningRate::Cosine { base, min, total } => {
                let t = (u.min(*total) as f64) / (*total).max(1) as f64;
                min + 0.5 * (base - min) * (1.0 + (std::f64::consts::PI * t).cos())
            }
            LearningRate::Warmup { warmup, then } => {
                if u < *warmup {
                    then.at(0) * (u + 1) as f64 / *warmup as f64
                } else {
                    then.at(u - warmup)
                }
            }
        }
    }
}

/// `Err` naming `what` unless `x` is finite and at least 0.
pub(crate) fn non_negative(what: &str, x: f64) -> Result<(), String> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(format!("{what} must be a finite number >= 0, got {x}"))
    }
}

impl LearningRate {
    /// Checks that every rate the schedule can give is finite and not negative.
    pub fn check(&self) -> Result<(), String> {
        match self {
            LearningRate::Constant(lr) => non_negative("learning rate", *lr),
            LearningRate::Step { base, gamma, .. } => non_negative("learning rate", *base).and(non_negative("step schedule's gamma", *gamma)),
            LearningRate::Cosine { base, min, .. } => non_negative("learning rate", *base).and(non_negative("cosine schedule's minimum", *min)),
            LearningRate::Warmup { then, .. } => then.check(),
        }
    }
}

impl From<f64> for LearningRate {
    fn from(lr: f64) -> Self {
        LearningRate::Constant(lr)
    }
}

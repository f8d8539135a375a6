//! Parameter initializers by MindSpore name, deterministic from a seed.
//!
//! Each parameter draws from its own RNG stream, seeded from the global seed and the
//! parameter's name, so values do not depend on construction order or on which other
//! parameters exist (ranks and resumed runs agree by construction).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use cellgraph_compiler::{HostTensor, TensorType};

use crate::error::{CellError, Result};

/// How a parameter's first value is drawn (MindSpore's `mindspore.common.initializer`).
#[derive(Clone, Debug, PartialEq)]
pub enum Initializer {
    Zeros,
    Ones,
    Constant(f64),
    /// `N(mean, sigma^2)`; MindSpore's default sigma is 0.01.
    Normal {
        sigma: f64,
        mean: f64,
    },
    /// `N(0, sigma^2)` redrawn outside two sigmas.
    TruncatedNormal {
        sigma: f64,
    },
    /// `U(-scale, scale)`; MindSpore's default scale is 0.07.
    Uniform {
        scale: f64,
    },
    XavierUniform {
        gain: f64,
    },
    XavierNormal {
        gain: f64,
    },
    /// Kaiming uniform, fan-in mode, leaky-relu gain with `negative_slope`.
    HeUniform {
        negative_slope: f64,
    },
    /// Kaiming normal, fan-in mode, leaky-relu gain with `negative_slope`.
    HeNormal {
        negative_slope: f64,
    },
    /// Kaiming normal, fan-out mode (torchvision's ResNet convolutions:
    /// `kaiming_normal_(mode="fan_out", nonlinearity="relu")` is `negative_slope = 0`).
    HeNormalFanOut {
        negative_slope: f64,
    },
    /// Rotary position embedding's table (Hugging Face's `LlamaRotaryEmbedding`, default
    /// type) for `[positions, head_dim]`: row `p`, column `j` is `cos` (or `sin`) of
    /// `p * theta^(-2i / head_dim)` with `i = j mod head_dim / 2` (the two halves repeat), in
    /// f32 as transformers computes it. Not random: a buffer, not a weight.
    Rotary {
        theta: f64,
        sine: bool,
    },
}

impl Initializer {
    /// MindSpore's `Normal(sigma)`.
    pub fn normal(sigma: f64) -> Self {
        Initializer::Normal { sigma, mean: 0.0 }
    }

    /// An initializer from its MindSpore name with default arguments: `zeros`, `ones`,
    /// `normal`, `truncatednormal` (or `truncated_normal`), `uniform`, `xavier_uniform`,
    /// `xavier_normal`, `he_uniform`, `he_normal`.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "zeros" => Initializer::Zeros,
            "ones" => Initializer::Ones,
            "normal" => Initializer::normal(0.01),
            "truncatednormal" | "truncated_normal" => Initializer::TruncatedNormal { sigma: 0.01 },
            "uniform" => Initializer::Uniform { scale: 0.07 },
            "xavier_uniform" => Initializer::XavierUniform { gain: 1.0 },
            "xavier_normal" => Initializer::XavierNormal { gain: 1.0 },
            "he_uniform" => Initializer::HeUniform { negative_slope: 0.0 },
            "he_normal" => Initializer::HeNormal { negative_slope: 0.0 },
            other => {
                return Err(CellError::Config {
                    cell: "initializer".into(),
                    detail: format!(
                        "unknown initializer `{other}`; use one of zeros, ones, normal, truncatednormal, uniform, \
                         xavier_uniform, xavier_normal, he_uniform, he_normal"
                    ),
                })
            }
        })
    }

    /// Draws a value of type `ty` for the parameter called `name`.
    pub fn materialize(&self, ty: &TensorType, name: &str, seed: u64) -> HostTensor {
        let mut rng = StdRng::seed_from_u64(stream_seed(seed, name));
        let n = ty.numel();
        let (fan_in, fan_out) = fans(ty.dims());
        let gain = |a: f64| (2.0 / (1.0 + a * a)).sqrt();
        let data: Vec<f32> = match *self {
            Initializer::Zeros => vec![0.0; n],
            Initializer::Ones => vec![1.0; n],
            Initializer::Constant(v) => vec![v as f32; n],
            Initializer::Normal { sigma, mean } => (0..n).map(|_| (mean + sigma * std_normal(&mut rng)) as f32).collect(),
            Initializer::TruncatedNormal { sigma } => (0..n)
                .map(|_| loop {
                    let z = std_normal(&mut rng);
                    if z.abs() <= 2.0 {
                        break (sigma * z) as f32;
                    }
                })
                .collect(),
            Initializer::Uniform { scale } => uniform(&mut rng, n, scale),
            Initializer::XavierUniform { gain } => uniform(&mut rng, n, gain * (6.0 / (fan_in + fan_out)).sqrt()),
            Initializer::XavierNormal { gain } => {
                let std = gain * (2.0 / (fan_in + fan_out)).sqrt();
                (0..n).map(|_| (std * std_normal(&mut rng)) as f32).collect()
            }
            Initializer::HeUniform { negative_slope } => uniform(&mut rng, n, 3f64.sqrt() * gain(negative_slope) / fan_in.sqrt()),
            Initializer::HeNormal { negative_slope } => {
                let std = gain(negative_slope) / fan_in.sqrt();
                (0..n).map(|_| (std * std_normal(&mut rng)) as f32).collect()
            }
            Initializer::HeNormalFanOut { negative_slope } => {
                let std = gain(negative_slope) / fan_out.sqrt();
                (0..n).map(|_| (std * std_normal(&mut rng)) as f32).collect()
            }
            Initializer::Rotary { theta, sine } => rotary(ty.dims(), theta as f32, sine),
        };
        HostTensor::f32(ty.dims().to_vec(), data).expect("numel matches")
    }
}

/// [`Initializer::Rotary`]'s table for `dims` (`[positions, head_dim]`; a `head_dim` of the
/// last axis, every other axis positions).
fn rotary(dims: &[usize], theta: f32, sine: bool) -> Vec<f32> {
    let d = dims.last().copied().unwrap_or(1).max(1);
    let half = d.div_ceil(2);
    // transformers: `1.0 / (base ** (arange(0, dim, 2).float() / dim))`, in f32.
    let inv: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / d as f32)).collect();
    let rows = dims.iter().product::<usize>() / d;
    (0..rows * d)
        .map(|k| {
            let angle = (k / d) as f32 * inv[(k % d) % half];
            if sine {
                angle.sin()
            } else {
                angle.cos()
            }
        })
        .collect()
}

/// `(fan_in, fan_out)` as MindSpore computes them: `[out, in, k...]` layouts.
fn fans(dims: &[usize]) -> (f64, f64) {
    match dims {
        [] => (1.0, 1.0),
        [n] => (*n as f64, *n as f64),
        [out, inp, rest @ ..] => {
            let r: usize = rest.iter().product();
            ((inp * r) as f64, (out * r) as f64)
        }
    }
}

fn uniform(rng: &mut StdRng, n: usize, bound: f64) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-bound..=bound) as f32).collect()
}

/// A standard normal draw (Box-Muller).
fn std_normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// FNV-1a of the name, mixed with the seed: one independent stream per parameter (with seed
/// 0, plain FNV-1a: dropout's default seed from its path).
pub(crate) fn stream_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

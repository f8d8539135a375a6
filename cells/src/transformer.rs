//! The building blocks of Transformers, with MindSpore's names: [`Embedding`], [`LayerNorm`],
//! [`GELU`], [`Softmax`] (and `layers::Dropout`), and GPT's [`CausalSelfAttention`], [`Mlp`] and [`Block`]. Each is
//! written in the graph's own ops (gather, reductions, batched matmuls, elementwise
//! arithmetic), so its gradient is the autodiff of what runs.

use cellgraph_compiler::{NodeId, Op, ReduceAttrs, Shape, TensorType};

use crate::cell::{expect_inputs, Cell, Tracer};
use crate::error::{CellError, Result};
use crate::init::Initializer;
use crate::layers::{Dense, Dropout};
use crate::param::{Parameter, Scope};

/// A lookup table of `vocab_size` rows of `embedding_size` (MindSpore's `nn.Embedding`,
/// parameter `embedding_table`, default initializer `Normal(0.01)`): integer ids `[...]` give
/// `[..., embedding_size]`. An id outside `0..vocab_size` is an error naming it. The gradient
/// adds each position's cotangent into its id's row (repeated ids add up).
#[derive(Clone, Debug)]
pub struct Embedding {
    path: String,
    table: Parameter,
}

impl Embedding {
    /// A table of `vocab_size` rows of `embedding_size` features.
    pub fn new(s: &Scope, vocab_size: usize, embedding_size: usize) -> Self {
        Embedding {
            path: s.path().into(),
            table: s.param("embedding_table", TensorType::f32([vocab_size, embedding_size]), Initializer::normal(0.01)),
        }
    }
    /// Sets the table's initializer.
    pub fn embedding_init(mut self, init: Initializer) -> Self {
        self.table.init = init;
        self
    }
    /// The table parameter (a GPT's output head reads it: tied weights).
    pub fn table(&self) -> &Parameter {
        &self.table
    }
}

impl Cell for Embedding {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let table = t.param(&self.table)?;
        t.op(Op::Gather, &[table, xs[0]])
    }
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.table.clone()]
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "Embedding"
    }
}

fn last_axis(t: &Tracer, x: NodeId) -> ReduceAttrs {
    ReduceAttrs { axes: vec![t.ty(x).rank() - 1], keep_dims: true }
}

/// Layer normalisation over the last axis (MindSpore's `nn.LayerNorm((n,))` with
/// `begin_norm_axis = begin_params_axis = -1`): `(x - mean) / sqrt(var + epsilon) * gamma +
/// beta`, the biased variance, parameters `gamma` (ones) and `beta` (zeros). MindSpore's
/// default `epsilon` is 1e-7, PyTorch's `eps` 1e-5 ([`Self::epsilon`]).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    path: String,
    gamma: Parameter,
    beta: Parameter,
    pub epsilon: f64,
}

impl LayerNorm {
    /// Normalises the last axis, of extent `n`.
    pub fn new(s: &Scope, n: usize) -> Self {
        LayerNorm {
            path: s.path().into(),
            gamma: s.param("gamma", TensorType::f32([n]), Initializer::Ones),
            beta: s.param("beta", TensorType::f32([n]), Initializer::Zeros),
            epsilon: 1e-7,
        }
    }
    /// Sets epsilon.
    pub fn epsilon(mut self, eps: f64) -> Self {
        self.epsilon = eps;
        self
    }
}

impl Cell for LayerNorm {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = xs[0];
        let n = self.gamma.ty.dims()[0];
        let xt = t.ty(x).clone();
        if xt.dims().last() != Some(&n) {
            return Err(CellError::Config { cell: self.path.clone(), detail: format!("LayerNorm over {n} features got input {xt}") });
        }
        let axis = last_axis(t, x);
        let mean = t.op(Op::ReduceMean(axis.clone()), &[x])?;
        let d = t.op(Op::Sub, &[x, mean])?;
        let d2 = t.op(Op::Mul, &[d, d])?;
        let var = t.op(Op::ReduceMean(axis), &[d2])?;
        let eps = t.constant(self.epsilon, xt.with_shape(Shape::scalar()))?;
        let v = t.op(Op::Add, &[var, eps])?;
        let sd = t.op(Op::Sqrt, &[v])?;
        let y = t.op(Op::Div, &[d, sd])?;
        let (g, b) = (t.param(&self.gamma)?, t.param(&self.beta)?);
        let y = t.op(Op::Mul, &[y, g])?;
        t.op(Op::Add, &[y, b])
    }
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.gamma.clone(), self.beta.clone()]
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "LayerNorm"
    }
}

/// The Gaussian error linear unit (MindSpore's `nn.GELU(approximate)`): the tanh form
/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` when `approximate` (MindSpore's default),
/// else the exact `0.5 x (1 + erf(x / sqrt 2))` (PyTorch's default).
#[derive(Clone, Debug)]
pub struct GELU {
    pub approximate: bool,
}

impl GELU {
    /// The tanh form (MindSpore's default) or the erf form.
    pub fn new(approximate: bool) -> Self {
        GELU { approximate }
    }
}

impl Cell for GELU {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = xs[0];
        let scalar = t.ty(x).with_shape(Shape::scalar());
        let inner = if self.approximate {
            let x2 = t.op(Op::Mul, &[x, x])?;
            let x3 = t.op(Op::Mul, &[x2, x])?;
            let c = t.constant(0.044715, scalar.clone())?;
            let cx3 = t.op(Op::Mul, &[x3, c])?;
            let u = t.op(Op::Add, &[x, cx3])?;
            let k = t.constant((2.0 / std::f64::consts::PI).sqrt(), scalar.clone())?;
            let u = t.op(Op::Mul, &[u, k])?;
            t.op(Op::Tanh, &[u])?
        } else {
            let k = t.constant(std::f64::consts::FRAC_1_SQRT_2, scalar.clone())?;
            let u = t.op(Op::Mul, &[x, k])?;
            t.op(Op::Erf, &[u])?
        };
        let one = t.constant(1.0, scalar.clone())?;
        let s = t.op(Op::Add, &[inner, one])?;
        let half = t.constant(0.5, scalar)?;
        let hx = t.op(Op::Mul, &[x, half])?;
        t.op(Op::Mul, &[hx, s])
    }
    fn kind(&self) -> &'static str {
        "GELU"
    }
}

/// Softmax over `axis` (MindSpore's `nn.Softmax(axis=-1)`), numerically stable: the axis's
/// maximum is subtracted before `exp`, behind `stop_gradient` (softmax does not depend on it,
/// so its exact gradient is zero and the backward pass skips it).
#[derive(Clone, Debug)]
pub struct Softmax {
    /// The axis; `None` is the last.
    pub axis: Option<usize>,
}

impl Softmax {
    /// Softmax over the last axis.
    pub fn new() -> Self {
        Softmax { axis: None }
    }
}

impl Default for Softmax {
    fn default() -> Self {
        Self::new()
    }
}

impl Cell for Softmax {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = xs[0];
        let r = t.ty(x).rank();
        let axis = self.axis.unwrap_or(r.saturating_sub(1));
        if axis >= r {
            return Err(CellError::Config { cell: "Softmax".into(), detail: format!("axis {axis} out of range for {}", t.ty(x)) });
        }
        let at = ReduceAttrs { axes: vec![axis], keep_dims: true };
        let m = t.op(Op::ReduceMax(at.clone()), &[x])?;
        let m = t.op(Op::StopGradient, &[m])?;
        let z = t.op(Op::Sub, &[x, m])?;
        let e = t.op(Op::Exp, &[z])?;
        let s = t.op(Op::ReduceSum(at), &[e])?;
        t.op(Op::Div, &[e, s])
    }
    fn kind(&self) -> &'static str {
        "Softmax"
    }
}

/// GPT's causal multi-head self-attention over `[B, T, C]`: one projection to queries, keys
/// and values (`c_attn`, `C -> 3C`), `heads` heads of `C / heads`, scores scaled by
/// `1/sqrt(C / heads)`, causally masked, softmaxed, mixed, and projected back (`c_proj`).
/// Without dropout on the probabilities (`dropout` 0, or in evaluation) the middle is one
/// `attention` op on the projection's `[B, T, 3C]`; with it, the ops above one by one (a
/// `causal_mask` with fill -1e9, a softmax, the dropout), as nanoGPT's slow path.
pub struct CausalSelfAttention {
    path: String,
    c_attn: Dense,
    c_proj: Dense,
    heads: usize,
    attn_dropout: Dropout,
    resid_dropout: Dropout,
}

/// nanoGPT's initializer for a linear layer: weight `N(0, sigma^2)`, bias zeros.
fn gpt_dense(s: &Scope, i: usize, o: usize, sigma: f64) -> Dense {
    Dense::new(s, i, o).weight_init(Initializer::normal(sigma)).bias_init(Initializer::Zeros)
}

impl CausalSelfAttention {
    /// Attention of `width` features in `heads` heads; `proj_sigma` initialises `c_proj`;
    /// `dropout` on the attention probabilities and the output.
    pub fn new(s: &Scope, width: usize, heads: usize, proj_sigma: f64, dropout: f64) -> Result<Self> {
        if heads == 0 || !width.is_multiple_of(heads) {
            return Err(CellError::Config {
                cell: s.path().into(),
                detail: format!("width {width} must be a multiple of the number of heads {heads}"),
            });
        }
        Ok(CausalSelfAttention {
            path: s.path().into(),
            c_attn: gpt_dense(&s.child("c_attn"), width, 3 * width, 0.02),
            c_proj: gpt_dense(&s.child("c_proj"), width, width, proj_sigma),
            heads,
            attn_dropout: Dropout::new(&s.child("attn_dropout"), dropout),
            resid_dropout: Dropout::new(&s.child("resid_dropout"), dropout),
        })
    }
}

/// Causal attention between the projections op by op, `qkv [B, T, 3C] -> [B, T, C]` in
/// `heads` heads: scores scaled by `1/sqrt(C / heads)`, the causal mask (fill -1e9), softmax,
/// `dropout` on the probabilities, mixing. What the `attention` op computes, with the dropout
/// it has not got.
pub(crate) fn attention_op_by_op(t: &mut Tracer, qkv: NodeId, [b, tt, c]: [usize; 3], heads: usize, dropout: &Dropout) -> Result<NodeId> {
    let (h, d) = (heads, c / heads);
    // Queries, keys and values: [B, T, C] -> [B, H, T, D].
    let mut parts = Vec::new();
    for i in 0..3 {
        let part = t.op(Op::Slice { begin: vec![0, 0, i * c], end: vec![b, tt, (i + 1) * c] }, &[qkv])?;
        let part = t.op(Op::Reshape { shape: vec![b, tt, h, d].into() }, &[part])?;
        parts.push(t.op(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[part])?);
    }
    let att = t.op(Op::MatMul { transpose_a: false, transpose_b: true }, &[parts[0], parts[1]])?;
    let scale = t.constant(1.0 / (d as f64).sqrt(), t.ty(att).with_shape(Shape::scalar()))?;
    let att = t.op(Op::Mul, &[att, scale])?;
    let att = t.op(Op::CausalMask { fill: -1e9 }, &[att])?;
    let att = t.call(&Softmax::new(), &[att])?;
    let att = t.call(dropout, &[att])?;
    let y = t.op(Op::MatMul { transpose_a: false, transpose_b: false }, &[att, parts[2]])?;
    let y = t.op(Op::Transpose { perm: vec![0, 2, 1, 3] }, &[y])?;
    t.op(Op::Reshape { shape: vec![b, tt, c].into() }, &[y])
}

impl Cell for CausalSelfAttention {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let &[b, tt, c] = t.ty(xs[0]).dims() else {
            return Err(CellError::Config { cell: self.path.clone(), detail: format!("attention needs [B, T, C], got {}", t.ty(xs[0])) });
        };
        let qkv = t.call(&self.c_attn, xs)?;
        let y = if self.attn_dropout.is_identity(t) {
            // Without dropout on the probabilities: one op, whose kernels skip the masked
            // half of the scores and keep them out of memory (PyTorch's
            // `scaled_dot_product_attention(..., is_causal=True)`).
            t.op(Op::Attention { heads: self.heads, causal: true }, &[qkv])?
        } else {
            attention_op_by_op(t, qkv, [b, tt, c], self.heads, &self.attn_dropout)?
        };
        let y = t.call(&self.c_proj, &[y])?;
        t.call(&self.resid_dropout, &[y])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [self.c_attn.parameters(), self.c_proj.parameters()].concat()
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "CausalSelfAttention"
    }
}

/// GPT's feed-forward part: `c_fc` (`C -> 4C`), GELU (the exact form, as PyTorch's default;
/// GPT-2's tanh form through [`Block::gelu`]), `c_proj` (`4C -> C`).
pub struct Mlp {
    path: String,
    c_fc: Dense,
    c_proj: Dense,
    gelu: GELU,
    dropout: Dropout,
}

impl Mlp {
    /// The MLP of `width` features; `proj_sigma` initialises `c_proj`; `dropout` on its output.
    pub fn new(s: &Scope, width: usize, proj_sigma: f64, dropout: f64) -> Self {
        Mlp {
            path: s.path().into(),
            c_fc: gpt_dense(&s.child("c_fc"), width, 4 * width, 0.02),
            c_proj: gpt_dense(&s.child("c_proj"), 4 * width, width, proj_sigma),
            gelu: GELU::new(false),
            dropout: Dropout::new(&s.child("dropout"), dropout),
        }
    }
}

impl Cell for Mlp {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        let y = t.call(&self.c_fc, xs)?;
        let y = t.call(&self.gelu, &[y])?;
        let y = t.call(&self.c_proj, &[y])?;
        t.call(&self.dropout, &[y])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [self.c_fc.parameters(), self.c_proj.parameters()].concat()
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "Mlp"
    }
}

/// A pre-LayerNorm Transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
pub struct Block {
    path: String,
    ln_1: LayerNorm,
    attn: CausalSelfAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    /// A block of `width` features and `heads` heads in a GPT of `layers` blocks (GPT-2's
    /// residual projections start at `0.02 / sqrt(2 * layers)`); LayerNorm epsilon `eps`;
    /// `dropout` in the attention and the MLP.
    pub fn new(s: &Scope, width: usize, heads: usize, layers: usize, eps: f64, dropout: f64) -> Result<Self> {
        let proj = 0.02 / ((2 * layers.max(1)) as f64).sqrt();
        Ok(Block {
            path: s.path().into(),
            ln_1: LayerNorm::new(&s.child("ln_1"), width).epsilon(eps),
            attn: CausalSelfAttention::new(&s.child("attn"), width, heads, proj, dropout)?,
            ln_2: LayerNorm::new(&s.child("ln_2"), width).epsilon(eps),
            mlp: Mlp::new(&s.child("mlp"), width, proj, dropout),
        })
    }
}

impl Block {
    /// The MLP's GELU in its tanh form (`approximate`) or the exact erf form (the default).
    pub fn gelu(mut self, approximate: bool) -> Self {
        self.mlp.gelu = GELU::new(approximate);
        self
    }
}

impl Cell for Block {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let a = t.call(&self.ln_1, xs)?;
        let a = t.call(&self.attn, &[a])?;
        let x = t.op(Op::Add, &[xs[0], a])?;
        let m = t.call(&self.ln_2, &[x])?;
        let m = t.call(&self.mlp, &[m])?;
        t.op(Op::Add, &[x, m])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [self.ln_1.parameters(), self.attn.parameters(), self.ln_2.parameters(), self.mlp.parameters()].concat()
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "Block"
    }
}

//! Llama (Hugging Face's `LlamaForCausalLM`): [`RMSNorm`], [`SiLU`], rotary position embedding,
//! grouped-query causal attention ([`LlamaAttention`]), the gated MLP ([`LlamaMlp`]), the
//! decoder layer ([`LlamaBlock`]) and the model ([`Llama`]). Written in the graph's own ops
//! (slices, concatenation, broadcasts, batched matmuls, the `attention` op, elementwise
//! arithmetic), so each gradient is the autodiff of what runs. The parameters carry Hugging
//! Face's names without the `model.` prefix (`layers.0.self_attn.q_proj.weight`), an
//! embedding's `weight` being its `embedding_table`.

use cellgraph_compiler::{NodeId, Op, ReduceAttrs, Shape, TensorType};

use crate::cell::{expect_inputs, Cell, Tracer};
use crate::error::{CellError, Result};
use crate::init::Initializer;
use crate::layers::{Dense, Dropout};
use crate::param::{Parameter, Scope};
use crate::transformer::{attention_op_by_op, Embedding};

/// The shape of a [`Llama`] (Hugging Face's `LlamaConfig`, default rotary embedding).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    /// The longest sequence (`max_position_embeddings`: the rotary tables' rows).
    pub context: usize,
    pub layers: usize,
    /// Query heads (`num_attention_heads`).
    pub heads: usize,
    /// Key and value heads (`num_key_value_heads`): each serves `heads / kv_heads` query
    /// heads (grouped-query attention; `heads` for plain multi-head attention).
    pub kv_heads: usize,
    /// The residual stream's width (`hidden_size`).
    pub width: usize,
    /// Each head's width (`head_dim`; `width / heads` by default), even.
    pub head_dim: usize,
    /// The MLP's width (`intermediate_size`).
    pub intermediate: usize,
    pub rms_norm_eps: f64,
    /// The rotary embedding's base (`rope_theta`).
    pub rope_theta: f64,
    /// The output head is the embedding table (`tie_word_embeddings`) rather than `lm_head`.
    pub tie_embeddings: bool,
    /// Dropout on the attention probabilities (`attention_dropout`), Llama's only dropout.
    pub dropout: f64,
}

impl LlamaConfig {
    /// A small Llama: 4 layers, 4 heads over 2 key/value heads, width 128, MLP 344, context 128.
    pub fn small(vocab_size: usize) -> Self {
        LlamaConfig {
            vocab_size,
            context: 128,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            width: 128,
            head_dim: 32,
            intermediate: 344,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_embeddings: false,
            dropout: 0.0,
        }
    }
    /// The sentence saying what in `self` a [`Llama`] cannot be built from, if anything.
    pub fn check(&self) -> std::result::Result<(), String> {
        let c = self;
        if c.heads == 0 || c.kv_heads == 0 || !c.heads.is_multiple_of(c.kv_heads) {
            return Err(format!("{} query heads cannot be shared out among {} key/value heads", c.heads, c.kv_heads));
        }
        if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even: the rotary embedding turns pairs of features", c.head_dim));
        }
        if [c.vocab_size, c.context, c.width, c.intermediate].contains(&0) {
            return Err(format!(
                "vocab_size {}, context {}, width {} and intermediate {} must be positive",
                c.vocab_size, c.context, c.width, c.intermediate
            ));
        }
        Ok(())
    }
}

fn config_error(s: &Scope, detail: String) -> CellError {
    CellError::Config { cell: if s.path().is_empty() { "Llama".into() } else { s.path().into() }, detail }
}

/// Root-mean-square normalisation over the last axis (Hugging Face's `LlamaRMSNorm`, T5's
/// LayerNorm): `x / sqrt(mean(x^2) + epsilon) * weight`, parameter `weight` (ones), no
/// centring and no bias.
#[derive(Clone, Debug)]
pub struct RMSNorm {
    path: String,
    weight: Parameter,
    pub epsilon: f64,
}

impl RMSNorm {
    /// Normalises the last axis, of extent `n`, with `epsilon` added to the mean square.
    pub fn new(s: &Scope, n: usize, epsilon: f64) -> Self {
        RMSNorm { path: s.path().into(), weight: s.param("weight", TensorType::f32([n]), Initializer::Ones), epsilon }
    }
}

impl Cell for RMSNorm {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = xs[0];
        let n = self.weight.ty.dims()[0];
        let xt = t.ty(x).clone();
        if xt.dims().last() != Some(&n) {
            return Err(CellError::Config { cell: self.path.clone(), detail: format!("RMSNorm over {n} features got input {xt}") });
        }
        let x2 = t.op(Op::Mul, &[x, x])?;
        let ms = t.op(Op::ReduceMean(ReduceAttrs { axes: vec![xt.rank() - 1], keep_dims: true }), &[x2])?;
        let eps = t.constant(self.epsilon, xt.with_shape(Shape::scalar()))?;
        let v = t.op(Op::Add, &[ms, eps])?;
        let rms = t.op(Op::Sqrt, &[v])?;
        let y = t.op(Op::Div, &[x, rms])?;
        let w = t.param(&self.weight)?;
        t.op(Op::Mul, &[y, w])
    }
    fn parameters(&self) -> Vec<Parameter> {
        vec![self.weight.clone()]
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "RMSNorm"
    }
}

/// The sigmoid-weighted linear unit (PyTorch's `nn.SiLU`, Llama's `silu`): `x * sigmoid(x)`,
/// the sigmoid written `0.5 + 0.5 tanh(x / 2)`, whose gradient stays finite where `exp(-x)`
/// overflows.
#[derive(Clone, Debug, Default)]
pub struct SiLU;

impl Cell for SiLU {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = xs[0];
        let half = t.constant(0.5, t.ty(x).with_shape(Shape::scalar()))?;
        let hx = t.op(Op::Mul, &[x, half])?;
        let th = t.op(Op::Tanh, &[hx])?;
        let s = t.op(Op::Mul, &[th, half])?;
        let s = t.op(Op::Add, &[s, half])?;
        t.op(Op::Mul, &[x, s])
    }
    fn kind(&self) -> &'static str {
        "SiLU"
    }
}

/// `x [B, T, H * D]` with the rotary position embedding applied to each head (transformers'
/// `x * cos + rotate_half(x) * sin`, `rotate_half` being `[-x2, x1]` of the halves);
/// `cos` and `sin` are `[T, 1, D]`.
fn rotate(t: &mut Tracer, x: NodeId, [b, tt, h, d]: [usize; 4], cos: NodeId, sin: NodeId) -> Result<NodeId> {
    let x = t.op(Op::Reshape { shape: vec![b, tt, h, d].into() }, &[x])?;
    let x1 = t.op(Op::Slice { begin: vec![0, 0, 0, 0], end: vec![b, tt, h, d / 2] }, &[x])?;
    let x2 = t.op(Op::Slice { begin: vec![0, 0, 0, d / 2], end: vec![b, tt, h, d] }, &[x])?;
    let x2 = t.op(Op::Neg, &[x2])?;
    let rot = t.op(Op::Concat { axis: 3 }, &[x2, x1])?;
    let a = t.op(Op::Mul, &[x, cos])?;
    let r = t.op(Op::Mul, &[rot, sin])?;
    let y = t.op(Op::Add, &[a, r])?;
    t.op(Op::Reshape { shape: vec![b, tt, h * d].into() }, &[y])
}

/// `x [B, T, KV * D]` with each of the `kv` heads repeated `groups` times, in place
/// (transformers' `repeat_kv`): `[B, T, KV * groups * D]`.
fn repeat_heads(t: &mut Tracer, x: NodeId, [b, tt, kv, d]: [usize; 4], groups: usize) -> Result<NodeId> {
    if groups == 1 {
        return Ok(x);
    }
    let x = t.op(Op::Reshape { shape: vec![b, tt, kv, 1, d].into() }, &[x])?;
    let x = t.op(Op::Broadcast { shape: vec![b, tt, kv, groups, d].into() }, &[x])?;
    t.op(Op::Reshape { shape: vec![b, tt, kv * groups * d].into() }, &[x])
}

/// Llama's causal self-attention over `[B, T, C]`, with the rotary tables `cos` and `sin`
/// (`[T, 1, head_dim]`) as its second and third inputs: projections `q_proj`, `k_proj`,
/// `v_proj` (no biases), the rotary embedding on queries and keys, each key/value head shared
/// by `heads / kv_heads` query heads, scores scaled by `1/sqrt(head_dim)`, causally masked,
/// softmaxed and mixed, then `o_proj`. Without dropout, one `attention` op.
pub struct LlamaAttention {
    path: String,
    q_proj: Dense,
    k_proj: Dense,
    v_proj: Dense,
    o_proj: Dense,
    config: LlamaConfig,
    attn_dropout: Dropout,
}

fn linear(s: &Scope, i: usize, o: usize) -> Dense {
    Dense::new(s, i, o).weight_init(Initializer::normal(0.02)).without_bias()
}

impl LlamaAttention {
    /// The attention of a Llama of shape `c`.
    pub fn new(s: &Scope, c: &LlamaConfig) -> Result<Self> {
        c.check().map_err(|e| config_error(s, e))?;
        let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        Ok(LlamaAttention {
            path: s.path().into(),
            q_proj: linear(&s.child("q_proj"), c.width, q),
            k_proj: linear(&s.child("k_proj"), c.width, kv),
            v_proj: linear(&s.child("v_proj"), c.width, kv),
            o_proj: linear(&s.child("o_proj"), q, c.width),
            config: *c,
            attn_dropout: Dropout::new(&s.child("attn_dropout"), c.dropout),
        })
    }
}

impl Cell for LlamaAttention {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 3)?;
        let &[b, tt, _] = t.ty(xs[0]).dims() else {
            return Err(CellError::Config { cell: self.path.clone(), detail: format!("attention needs [B, T, C], got {}", t.ty(xs[0])) });
        };
        let c = &self.config;
        let (h, kv, d) = (c.heads, c.kv_heads, c.head_dim);
        let q = t.call(&self.q_proj, &xs[..1])?;
        let k = t.call(&self.k_proj, &xs[..1])?;
        let v = t.call(&self.v_proj, &xs[..1])?;
        let q = rotate(t, q, [b, tt, h, d], xs[1], xs[2])?;
        let k = rotate(t, k, [b, tt, kv, d], xs[1], xs[2])?;
        let k = repeat_heads(t, k, [b, tt, kv, d], h / kv)?;
        let v = repeat_heads(t, v, [b, tt, kv, d], h / kv)?;
        let qkv = t.op(Op::Concat { axis: 2 }, &[q, k, v])?;
        let y = if self.attn_dropout.is_identity(t) {
            t.op(Op::Attention { heads: h, causal: true }, &[qkv])?
        } else {
            attention_op_by_op(t, qkv, [b, tt, h * d], h, &self.attn_dropout)?
        };
        t.call(&self.o_proj, &[y])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj].into_iter().flat_map(|d| d.parameters()).collect()
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "LlamaAttention"
    }
}

/// Llama's gated MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases.
pub struct LlamaMlp {
    path: String,
    gate_proj: Dense,
    up_proj: Dense,
    down_proj: Dense,
}

impl LlamaMlp {
    /// The MLP of `width` features through `intermediate`.
    pub fn new(s: &Scope, width: usize, intermediate: usize) -> Self {
        LlamaMlp {
            path: s.path().into(),
            gate_proj: linear(&s.child("gate_proj"), width, intermediate),
            up_proj: linear(&s.child("up_proj"), width, intermediate),
            down_proj: linear(&s.child("down_proj"), intermediate, width),
        }
    }
}

impl Cell for LlamaMlp {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let g = t.call(&self.gate_proj, xs)?;
        let g = t.call(&SiLU, &[g])?;
        let u = t.call(&self.up_proj, xs)?;
        let y = t.op(Op::Mul, &[g, u])?;
        t.call(&self.down_proj, &[y])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [&self.gate_proj, &self.up_proj, &self.down_proj].into_iter().flat_map(|d| d.parameters()).collect()
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "LlamaMlp"
    }
}

/// A Llama decoder layer: `x + self_attn(input_layernorm(x))`, then
/// `x + mlp(post_attention_layernorm(x))`; inputs `x`, `cos`, `sin`.
pub struct LlamaBlock {
    path: String,
    input_layernorm: RMSNorm,
    self_attn: LlamaAttention,
    post_attention_layernorm: RMSNorm,
    mlp: LlamaMlp,
}

impl LlamaBlock {
    /// A layer of a Llama of shape `c`.
    pub fn new(s: &Scope, c: &LlamaConfig) -> Result<Self> {
        Ok(LlamaBlock {
            path: s.path().into(),
            input_layernorm: RMSNorm::new(&s.child("input_layernorm"), c.width, c.rms_norm_eps),
            self_attn: LlamaAttention::new(&s.child("self_attn"), c)?,
            post_attention_layernorm: RMSNorm::new(&s.child("post_attention_layernorm"), c.width, c.rms_norm_eps),
            mlp: LlamaMlp::new(&s.child("mlp"), c.width, c.intermediate),
        })
    }
}

impl Cell for LlamaBlock {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 3)?;
        let a = t.call(&self.input_layernorm, &xs[..1])?;
        let a = t.call(&self.self_attn, &[a, xs[1], xs[2]])?;
        let x = t.op(Op::Add, &[xs[0], a])?;
        let m = t.call(&self.post_attention_layernorm, &[x])?;
        let m = t.call(&self.mlp, &[m])?;
        t.op(Op::Add, &[x, m])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [self.input_layernorm.parameters(), self.self_attn.parameters(), self.post_attention_layernorm.parameters(), self.mlp.parameters()].concat()
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "LlamaBlock"
    }
}

/// A Llama (Hugging Face's `LlamaForCausalLM`): the token embedding (`embed_tokens`), `layers`
/// decoder layers (`layers.0`, ...), a final RMSNorm (`norm`) and the output head (`lm_head`,
/// or the embedding table when tied). The rotary tables are buffers, not trained
/// (`rotary_emb.cos`, `rotary_emb.sin`, `[context, head_dim]`, [`Initializer::Rotary`]).
/// Input: token ids `[B, T]` with `T <= context`; output: logits `[B, T, vocab_size]`.
/// Initialised as transformers does: weights `N(0, 0.02)`, norms ones.
pub struct Llama {
    embed_tokens: Embedding,
    layers: Vec<LlamaBlock>,
    norm: RMSNorm,
    lm_head: Option<Dense>,
    cos: Parameter,
    sin: Parameter,
    pub config: LlamaConfig,
}

impl Llama {
    /// A Llama of the given shape.
    pub fn new(s: &Scope, config: LlamaConfig) -> Result<Self> {
        let c = config;
        c.check().map_err(|e| config_error(s, e))?;
        let table = |sine| {
            let mut p = s.child("rotary_emb").param(
                if sine { "sin" } else { "cos" },
                TensorType::f32([c.context, c.head_dim]),
                Initializer::Rotary { theta: c.rope_theta, sine },
            );
            p.requires_grad = false;
            p
        };
        Ok(Llama {
            embed_tokens: Embedding::new(&s.child("embed_tokens"), c.vocab_size, c.width).embedding_init(Initializer::normal(0.02)),
            layers: (0..c.layers).map(|i| LlamaBlock::new(&s.child("layers").child(&i.to_string()), &c)).collect::<Result<_>>()?,
            norm: RMSNorm::new(&s.child("norm"), c.width, c.rms_norm_eps),
            lm_head: (!c.tie_embeddings).then(|| linear(&s.child("lm_head"), c.width, c.vocab_size)),
            cos: table(false),
            sin: table(true),
            config,
        })
    }
}

impl Cell for Llama {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let ids = t.ty(xs[0]).clone();
        let (&[b, tt], true) = (ids.dims(), ids.dtype.is_int()) else {
            return Err(CellError::Config { cell: "Llama".into(), detail: format!("input must be integer token ids [B, T], got {ids}") });
        };
        let c = &self.config;
        if tt > c.context {
            return Err(CellError::Config {
                cell: "Llama".into(),
                detail: format!("sequences of {tt} tokens exceed the context of {}; use windows of at most {0}", c.context),
            });
        }
        // The tables' first T rows, [T, 1, D]: broadcast over the batch and the heads.
        let mut tables = Vec::new();
        for p in [&self.cos, &self.sin] {
            let full = t.param(p)?;
            let rows = t.op(Op::Slice { begin: vec![0, 0], end: vec![tt, c.head_dim] }, &[full])?;
            tables.push(t.op(Op::Reshape { shape: vec![tt, 1, c.head_dim].into() }, &[rows])?);
        }
        let mut x = t.call(&self.embed_tokens, xs)?;
        for layer in &self.layers {
            x = t.call(layer, &[x, tables[0], tables[1]])?;
        }
        let x = t.call(&self.norm, &[x])?;
        let x = t.op(Op::Reshape { shape: vec![b * tt, c.width].into() }, &[x])?;
        let logits = match &self.lm_head {
            Some(head) => t.call(head, &[x])?,
            None => {
                let table = t.param(self.embed_tokens.table())?;
                t.op(Op::MatMul { transpose_a: false, transpose_b: true }, &[x, table])?
            }
        };
        t.op(Op::Reshape { shape: vec![b, tt, c.vocab_size].into() }, &[logits])
    }
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.embed_tokens.parameters();
        v.extend(self.layers.iter().flat_map(|l| l.parameters()));
        v.extend(self.norm.parameters());
        v.extend(self.lm_head.iter().flat_map(|h| h.parameters()));
        v.extend([self.cos.clone(), self.sin.clone()]);
        v
    }
    fn kind(&self) -> &'static str {
        "Llama"
    }
}

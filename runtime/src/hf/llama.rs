//! Llama (`LlamaForCausalLM`, and the checkpoints of its shape: TinyLlama, SmolLM, Llama 2 and
//! 3 without rope scaling): its `config.json` read into a [`LlamaConfig`], and its tensors'
//! names. The projections are `nn.Linear`s, stored `[out, in]` as cellgraph's `Dense` stores
//! them. The head is `lm_head.weight`, or the embedding table under `tie_word_embeddings`
//! (stored once, or twice and equal). The rotary embedding's buffers (`rotary_emb.inv_freq`
//! in older checkpoints) are not parameters: cellgraph's tables are computed from
//! `rope_theta`.

use cellgraph_cells::LlamaConfig;
use serde_json::{Map, Value as Json};

use super::{Keys, Name};
use crate::error::Result;

/// The rotary embedding's base and type: transformers 5's `rope_parameters`, or the older
/// `rope_theta` and `rope_scaling`. Only the default type is Llama's own; scaled types
/// (`llama3`, `linear`, `dynamic`, `yarn`) are errors naming the key.
fn rope(k: &Keys<'_>) -> Result<f64> {
    let (theta, kind, key) = match k.j.get("rope_parameters") {
        Some(Json::Object(p)) => (p.get("rope_theta").and_then(Json::as_f64), p.get("rope_type").and_then(Json::as_str), "rope_parameters"),
        _ => {
            let scaling = match k.j.get("rope_scaling") {
                Some(Json::Object(s)) => Some(s.get("rope_type").or_else(|| s.get("type")).and_then(Json::as_str).unwrap_or("?")),
                _ => None,
            };
            (Some(k.num("rope_theta", 10000.0)?), scaling, "rope_scaling")
        }
    };
    match kind {
        None | Some("default") => {}
        Some(other) => return Err(k.invalid(format!("`{key}` has rope type `{other}`: cellgraph's Llama has the default rotary embedding only"))),
    }
    theta.filter(|t| *t > 1.0).ok_or_else(|| k.invalid(format!("`{key}` has no rope_theta above 1")))
}

/// The model's shape from `config.json`: a Llama whose every setting cellgraph's Llama has;
/// anything else is an error naming the key.
pub(super) fn config(k: &Keys<'_>, dropout: Option<f64>) -> Result<LlamaConfig> {
    let (width, heads) = (k.int("hidden_size")?, k.int("num_attention_heads")?);
    if heads == 0 {
        return Err(k.invalid("num_attention_heads is 0"));
    }
    match k.j.get("hidden_act").and_then(Json::as_str).unwrap_or("silu") {
        "silu" | "swish" => {}
        other => return Err(k.invalid(format!("hidden_act `{other}`: cellgraph's Llama MLP has silu"))),
    }
    for (key, want) in [("attention_bias", false), ("mlp_bias", false)] {
        k.require(key, want, "cellgraph's Llama")?;
    }
    if let Some(tp) = k.j.get("pretraining_tp").and_then(Json::as_u64).filter(|&tp| tp != 1) {
        return Err(k.invalid(format!("pretraining_tp is {tp}: cellgraph's Llama computes its projections whole (pretraining_tp 1)")));
    }
    let dropout = match dropout {
        Some(p) => p,
        None => k.num("attention_dropout", 0.0)?,
    };
    k.dropout(dropout)?;
    let c = LlamaConfig {
        vocab_size: k.int("vocab_size")?,
        context: k.int("max_position_embeddings")?,
        layers: k.int("num_hidden_layers")?,
        heads,
        kv_heads: k.int_or("num_key_value_heads", heads)?,
        width,
        head_dim: k.int_or("head_dim", width / heads)?,
        intermediate: k.int("intermediate_size")?,
        rms_norm_eps: k.num("rms_norm_eps", 1e-6)?,
        rope_theta: rope(k)?,
        tie_embeddings: k.flag("tie_word_embeddings", false),
        dropout,
    };
    c.check().map_err(|e| k.invalid(e))?;
    Ok(c)
}

/// `j` with the shape of `c` written in.
pub(super) fn write_config(j: &mut Map<String, Json>, c: &LlamaConfig) {
    for (key, v) in [
        ("vocab_size", c.vocab_size),
        ("max_position_embeddings", c.context),
        ("num_hidden_layers", c.layers),
        ("num_attention_heads", c.heads),
        ("num_key_value_heads", c.kv_heads),
        ("hidden_size", c.width),
        ("head_dim", c.head_dim),
        ("intermediate_size", c.intermediate),
    ] {
        j.insert(key.into(), Json::from(v));
    }
    j.insert("model_type".into(), Json::from("llama"));
    j.insert("rms_norm_eps".into(), Json::from(c.rms_norm_eps));
    j.insert("tie_word_embeddings".into(), Json::from(c.tie_embeddings));
    j.insert("attention_dropout".into(), Json::from(c.dropout));
}

/// Every trained parameter of a Llama of shape `c`, in cellgraph's order.
pub(super) fn names(c: &LlamaConfig) -> Vec<Name> {
    let plain = |hf: String, ours: String| Name { hf, ours, transposed: false };
    let same = |n: String| plain(format!("model.{n}"), n);
    let mut v = vec![plain("model.embed_tokens.weight".into(), "embed_tokens.embedding_table".into())];
    for i in 0..c.layers {
        let l = format!("layers.{i}");
        v.push(same(format!("{l}.input_layernorm.weight")));
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            v.push(same(format!("{l}.self_attn.{p}.weight")));
        }
        v.push(same(format!("{l}.post_attention_layernorm.weight")));
        for p in ["gate_proj", "up_proj", "down_proj"] {
            v.push(same(format!("{l}.mlp.{p}.weight")));
        }
    }
    v.push(same("norm.weight".into()));
    if !c.tie_embeddings {
        v.push(plain("lm_head.weight".into(), "lm_head.weight".into()));
    }
    v
}

/// A tensor name of the file as [`names`] spells it, or `None` for a buffer that is no
/// parameter (`rotary_emb.inv_freq`).
pub(super) fn canonical(name: &str) -> Option<String> {
    (!name.ends_with("rotary_emb.inv_freq")).then(|| name.to_string())
}

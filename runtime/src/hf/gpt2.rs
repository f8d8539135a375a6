//! GPT-2 (`GPT2LMHeadModel`): its `config.json` read into a [`GptConfig`], and its tensors'
//! names. The projections (`c_attn`, `c_proj`, `c_fc`) are `Conv1D`s, stored `[in, out]`:
//! cellgraph's `Dense` stores `[out, in]`, so they are transposed both ways. The LM head is
//! tied to `wte` and stored once; the causal-mask buffers of older checkpoints (`attn.bias`,
//! `attn.masked_bias`) are not parameters.

use cellgraph_cells::GptConfig;
use serde_json::{Map, Value as Json};

use super::{Keys, Name};
use crate::error::Result;

/// The model's shape from `config.json`: a GPT-2 whose every setting cellgraph's GPT has;
/// anything else is an error naming the key.
pub(super) fn config(k: &Keys<'_>, dropout: Option<f64>) -> Result<GptConfig> {
    let (layers, heads, width) = (k.int("n_layer")?, k.int("n_head")?, k.int("n_embd")?);
    if heads == 0 || width % heads != 0 {
        return Err(k.invalid(format!("n_embd {width} is not a multiple of n_head {heads}")));
    }
    if let Some(inner) = k.j.get("n_inner").and_then(Json::as_u64) {
        if inner as usize != 4 * width {
            return Err(k.invalid(format!("n_inner is {inner}: cellgraph's GPT-2 MLP is 4 x n_embd = {} wide", 4 * width)));
        }
    }
    let gelu_approximate = match k.j.get("activation_function").and_then(Json::as_str).unwrap_or("gelu_new") {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => true,
        "gelu" => false,
        other => return Err(k.invalid(format!("activation_function `{other}`: cellgraph's GPT-2 has gelu_new (tanh) and gelu (erf)"))),
    };
    for (key, want) in
        [("scale_attn_weights", true), ("scale_attn_by_inverse_layer_idx", false), ("add_cross_attention", false), ("tie_word_embeddings", true)]
    {
        k.require(key, want, "cellgraph's GPT-2")?;
    }
    let dropout = match dropout {
        Some(p) => p,
        None => {
            let p = [k.num("embd_pdrop", 0.1)?, k.num("attn_pdrop", 0.1)?, k.num("resid_pdrop", 0.1)?];
            if p.iter().any(|&x| x != p[0]) {
                return Err(k.invalid(format!(
                    "embd_pdrop {}, attn_pdrop {} and resid_pdrop {} differ: cellgraph's GPT has one dropout rate; choose one (LoadOptions::dropout, --dropout)",
                    p[0], p[1], p[2]
                )));
            }
            p[0]
        }
    };
    k.dropout(dropout)?;
    Ok(GptConfig {
        vocab_size: k.int("vocab_size")?,
        context: k.int("n_positions")?,
        layers,
        heads,
        width,
        layer_norm_eps: k.num("layer_norm_epsilon", 1e-5)?,
        dropout,
        gelu_approximate,
    })
}

/// `j` with the shape of `c` written in.
pub(super) fn write_config(j: &mut Map<String, Json>, c: &GptConfig) {
    for (key, v) in [("n_layer", c.layers), ("n_head", c.heads), ("n_embd", c.width), ("n_positions", c.context), ("vocab_size", c.vocab_size)] {
        j.insert(key.into(), Json::from(v));
    }
    j.insert("model_type".into(), Json::from("gpt2"));
    j.insert("layer_norm_epsilon".into(), Json::from(c.layer_norm_eps));
    j.insert("activation_function".into(), Json::from(if c.gelu_approximate { "gelu_new" } else { "gelu" }));
    for key in ["embd_pdrop", "attn_pdrop", "resid_pdrop"] {
        j.insert(key.into(), Json::from(c.dropout));
    }
}

/// Every parameter of a GPT-2 of `layers` blocks, in cellgraph's order.
pub(super) fn names(layers: usize) -> Vec<Name> {
    let plain = |hf: String, ours: String| Name { hf: format!("transformer.{hf}"), ours, transposed: false };
    let mut v = vec![plain("wte.weight".into(), "wte.embedding_table".into()), plain("wpe.weight".into(), "wpe.embedding_table".into())];
    for i in 0..layers {
        let h = format!("h.{i}");
        for ln in ["ln_1", "ln_2"] {
            v.push(plain(format!("{h}.{ln}.weight"), format!("{h}.{ln}.gamma")));
            v.push(plain(format!("{h}.{ln}.bias"), format!("{h}.{ln}.beta")));
        }
        for proj in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
            v.push(Name { hf: format!("transformer.{h}.{proj}.weight"), ours: format!("{h}.{proj}.weight"), transposed: true });
            v.push(plain(format!("{h}.{proj}.bias"), format!("{h}.{proj}.bias")));
        }
    }
    v.push(plain("ln_f.weight".into(), "ln_f.gamma".into()));
    v.push(plain("ln_f.bias".into(), "ln_f.beta".into()));
    v
}

/// A tensor name of the file as [`names`] spells it (`transformer.` added where a
/// `GPT2Model` saved it without), or `None` for a buffer that is no parameter.
pub(super) fn canonical(name: &str) -> Option<String> {
    if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
        return None;
    }
    Some(if name.starts_with("transformer.") || name == "lm_head.weight" { name.to_string() } else { format!("transformer.{name}") })
}

//! Hugging Face GPT-2 model directories (`GPT2LMHeadModel.save_pretrained`'s): `config.json`,
//! `model.safetensors` and the tokenizer's files, read into a [`GPT`]'s shape and parameters
//! and written back in the same format, so `transformers` loads what cellgraph trained.
//!
//! The parameters map one to one, by name (Hugging Face's `transformer.h.0.attn.c_attn.weight`
//! is cellgraph's `h.0.attn.c_attn.weight`; LayerNorm's `weight`/`bias` are `gamma`/`beta`,
//! an embedding's `weight` its `embedding_table`). GPT-2's projections (`c_attn`, `c_proj`,
//! `c_fc`) are `Conv1D`s, stored `[in, out]`: cellgraph's `Dense` stores `[out, in]`, so they
//! are transposed both ways. The LM head is tied to `wte` and stored once, as Hugging Face
//! stores it; the causal-mask buffers of older checkpoints (`attn.bias`, `attn.masked_bias`)
//! are not parameters and are skipped.
//!
//! Loading is strict by default: a missing, unexpected or wrongly shaped tensor is an error
//! naming each; [`LoadOptions::strict`] off loads what matches and reports the rest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cellgraph_cells::GptConfig;
use cellgraph_compiler::HostTensor;
use serde_json::{Map, Value as Json};

use crate::checkpoint::{write_atomic, write_atomic_with, Tensors};
use crate::error::{listed, Result, RuntimeError};

/// The files of a model directory besides the weights that [`save`] copies from the directory
/// the model was loaded from (the tokenizer's, the generation defaults).
const COPIED: [&str; 6] =
    ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json"];

/// How [`load`] treats tensors that do not match the configuration.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Missing, unexpected or wrongly shaped tensors are errors (else reported in
    /// [`Loaded::report`] and the missing ones left to the model's initializers).
    pub strict: bool,
    /// Dropout for every place GPT-2 has it, instead of the configuration's (which must then
    /// agree: `embd_pdrop`, `attn_pdrop` and `resid_pdrop` equal).
    pub dropout: Option<f64>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { strict: true, dropout: None }
    }
}

/// What a non-strict [`load`] did not load.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Parameters the file lacks (cellgraph's names).
    pub missing: Vec<String>,
    /// Tensors of the file that are no parameter of the configuration (the file's names).
    pub unexpected: Vec<String>,
    /// `(file's name, expected shape, shape in the file)`.
    pub mismatched: Vec<(String, Vec<usize>, Vec<usize>)>,
}

impl LoadReport {
    /// True when everything matched.
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.mismatched.is_empty()
    }
}

impl std::fmt::Display for LoadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if !self.missing.is_empty() {
            parts.push(format!("missing {}", listed(&self.missing)));
        }
        if !self.unexpected.is_empty() {
            parts.push(format!("unexpected {}", listed(&self.unexpected)));
        }
        if !self.mismatched.is_empty() {
            let each: Vec<String> = self.mismatched.iter().map(|(n, want, got)| format!("{n} is {got:?}, the config gives {want:?}")).collect();
            parts.push(format!("wrongly shaped: {}", listed(&each)));
        }
        if parts.is_empty() {
            write!(f, "every tensor loaded")
        } else {
            write!(f, "{}", parts.join("; "))
        }
    }
}

/// A GPT-2 model directory read by [`load`].
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The model's shape (build it with [`cellgraph_cells::GPT::new`]).
    pub config: GptConfig,
    /// `config.json` as read: [`save`] writes it back with the shape's keys updated and every
    /// other key kept.
    pub hf_config: Map<String, Json>,
    /// The parameters, by cellgraph's names.
    pub params: Tensors,
    /// The directory it was read from (its tokenizer files are copied by [`save`]).
    pub dir: PathBuf,
    /// What was not loaded (empty after a strict load).
    pub report: LoadReport,
}

fn invalid(what: impl Into<String>, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Invalid { what: what.into(), detail: detail.into() }
}

fn io(path: &Path, source: std::io::Error) -> RuntimeError {
    RuntimeError::Io { path: path.display().to_string(), source }
}

/// One parameter of a GPT-2: Hugging Face's name (without `transformer.`), cellgraph's, and
/// whether the stored matrix is the transpose of cellgraph's (a `Conv1D`).
struct Name {
    hf: String,
    ours: String,
    transposed: bool,
}

/// Every parameter of a GPT-2 of `layers` blocks, in cellgraph's order.
fn names(layers: usize) -> Vec<Name> {
    let plain = |hf: String, ours: String| Name { hf, ours, transposed: false };
    let mut v = vec![plain("wte.weight".into(), "wte.embedding_table".into()), plain("wpe.weight".into(), "wpe.embedding_table".into())];
    for i in 0..layers {
        let h = format!("h.{i}");
        for ln in ["ln_1", "ln_2"] {
            v.push(plain(format!("{h}.{ln}.weight"), format!("{h}.{ln}.gamma")));
            v.push(plain(format!("{h}.{ln}.bias"), format!("{h}.{ln}.beta")));
        }
        for proj in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
            v.push(Name { hf: format!("{h}.{proj}.weight"), ours: format!("{h}.{proj}.weight"), transposed: true });
            v.push(plain(format!("{h}.{proj}.bias"), format!("{h}.{proj}.bias")));
        }
    }
    v.push(plain("ln_f.weight".into(), "ln_f.gamma".into()));
    v.push(plain("ln_f.bias".into(), "ln_f.beta".into()));
    v
}

/// The parameter shapes of `c`, by cellgraph's names (matrices as cellgraph stores them): the
/// GPT's own parameters, so the two cannot drift apart.
fn shapes(c: &GptConfig) -> Result<BTreeMap<String, Vec<usize>>> {
    let gpt = cellgraph_cells::GPT::new(&cellgraph_cells::Scope::root(), *c)?;
    Ok(cellgraph_cells::Cell::parameters(&gpt).into_iter().map(|p| (p.name, p.ty.dims().to_vec())).collect())
}

/// `v` (`[rows, cols]` row-major) transposed: `[cols, rows]`.
fn transposed(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; v.len()];
    crate::host::layout::permute(v, &[rows, cols], &[1, 0], &mut out);
    out
}

/// `[rows, cols]` row-major -> `[cols, rows]`.
fn transpose(t: HostTensor) -> HostTensor {
    let &[rows, cols] = t.shape.as_slice() else { return t };
    HostTensor::f32(vec![cols, rows], transposed(&values(&t), rows, cols)).expect("the transpose has the same elements")
}

/// A tensor's values as f32: its own memory when it holds f32.
fn values(t: &HostTensor) -> std::borrow::Cow<'_, [f32]> {
    match &t.data {
        cellgraph_compiler::HostData::F32(v) => std::borrow::Cow::Borrowed(v),
        _ => std::borrow::Cow::Owned(t.to_f32()),
    }
}

/// One tensor of a saved model, as safetensors writes it (f32, little-endian): `values`, or
/// their transpose (`transpose: [rows, cols]` of `values`; a `Conv1D` weight), made only when
/// the file is written, one tensor at a time.
struct Saved<'a> {
    values: std::borrow::Cow<'a, [f32]>,
    shape: Vec<usize>,
    transpose: Option<[usize; 2]>,
}

impl safetensors::View for &Saved<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let values = match self.transpose {
            Some([rows, cols]) => std::borrow::Cow::Owned(transposed(&self.values, rows, cols)),
            None => std::borrow::Cow::Borrowed(&*self.values),
        };
        #[cfg(target_endian = "little")]
        if let std::borrow::Cow::Borrowed(v) = values {
            // SAFETY: f32 has no padding and every bit pattern is a byte sequence; on a
            // little-endian target its memory is its little-endian bytes.
            return std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), 4 * v.len()) });
        }
        let mut bytes = Vec::with_capacity(4 * values.len());
        values.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
        std::borrow::Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        4 * self.values.len()
    }
}

/// The model's shape from `config.json` (`path` names it in errors): a GPT-2 whose every
/// setting cellgraph's GPT has; anything else is an error naming the key.
pub fn config_from_json(path: &Path, j: &Map<String, Json>, dropout: Option<f64>) -> Result<GptConfig> {
    let what = || format!("{}", path.display());
    let int = |key: &str| -> Result<usize> {
        j.get(key)
            .and_then(Json::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| invalid(what(), format!("`{key}` is missing or not a whole number; a GPT-2 config.json has it")))
    };
    let num = |key: &str, default: f64| -> Result<f64> {
        match j.get(key) {
            None | Some(Json::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| invalid(what(), format!("`{key}` is {v}, not a number"))),
        }
    };
    let flag = |key: &str, default: bool| match j.get(key) {
        Some(Json::Bool(b)) => *b,
        _ => default,
    };
    match j.get("model_type").and_then(Json::as_str) {
        Some("gpt2") => {}
        other => {
            return Err(invalid(
                what(),
                format!("model_type is {other:?}: cellgraph reads GPT-2 checkpoints (`\"model_type\": \"gpt2\"`, GPT2LMHeadModel)"),
            ));
        }
    }
    let (layers, heads, width) = (int("n_layer")?, int("n_head")?, int("n_embd")?);
    if heads == 0 || width % heads != 0 {
        return Err(invalid(what(), format!("n_embd {width} is not a multiple of n_head {heads}")));
    }
    if let Some(inner) = j.get("n_inner").and_then(Json::as_u64) {
        if inner as usize != 4 * width {
            return Err(invalid(what(), format!("n_inner is {inner}: cellgraph's GPT-2 MLP is 4 x n_embd = {} wide", 4 * width)));
        }
    }
    let gelu_approximate = match j.get("activation_function").and_then(Json::as_str).unwrap_or("gelu_new") {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => true,
        "gelu" => false,
        other => return Err(invalid(what(), format!("activation_function `{other}`: cellgraph's GPT-2 has gelu_new (tanh) and gelu (erf)"))),
    };
    for (key, want) in
        [("scale_attn_weights", true), ("scale_attn_by_inverse_layer_idx", false), ("add_cross_attention", false), ("tie_word_embeddings", true)]
    {
        if flag(key, want) != want {
            return Err(invalid(what(), format!("`{key}: {}`: cellgraph's GPT-2 has `{key}: {want}` only", !want)));
        }
    }
    let dropout = match dropout {
        Some(p) => p,
        None => {
            let p = [num("embd_pdrop", 0.1)?, num("attn_pdrop", 0.1)?, num("resid_pdrop", 0.1)?];
            if p.iter().any(|&x| x != p[0]) {
                return Err(invalid(
                    what(),
                    format!("embd_pdrop {}, attn_pdrop {} and resid_pdrop {} differ: cellgraph's GPT has one dropout rate; choose one (LoadOptions::dropout, --dropout)", p[0], p[1], p[2]),
                ));
            }
            p[0]
        }
    };
    if !(0.0..1.0).contains(&dropout) {
        return Err(invalid(what(), format!("dropout {dropout} is outside [0, 1)")));
    }
    Ok(GptConfig {
        vocab_size: int("vocab_size")?,
        context: int("n_positions")?,
        layers,
        heads,
        width,
        layer_norm_eps: num("layer_norm_epsilon", 1e-5)?,
        dropout,
        gelu_approximate,
    })
}

/// Reads a GPT-2 model directory: `config.json` and `model.safetensors` (F32, F16 or BF16,
/// read into f32). See the module's documentation for the names and [`LoadOptions`] for
/// tensors that do not match.
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Loaded> {
    if !dir.is_dir() {
        return Err(invalid(
            format!("model directory {}", dir.display()),
            "is not a directory; give the directory a Hugging Face model was saved to (config.json, model.safetensors)",
        ));
    }
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| io(&config_path, e))?;
    let hf_config = match serde_json::from_str::<Json>(&text) {
        Ok(Json::Object(m)) => m,
        Ok(_) => return Err(invalid(config_path.display().to_string(), "is not a JSON object")),
        Err(e) => return Err(invalid(config_path.display().to_string(), format!("is not valid JSON: {e}"))),
    };
    let config = config_from_json(&config_path, &hf_config, opts.dropout)?;
    let weights = dir.join("model.safetensors");
    if !weights.is_file() {
        let bin = dir.join("pytorch_model.bin").is_file();
        return Err(invalid(
            weights.display().to_string(),
            if bin {
                "is missing (the directory has pytorch_model.bin, a pickle cellgraph does not read): save the model with safetensors (`save_pretrained(dir)` in transformers >= 4.35)"
            } else {
                "is missing: a Hugging Face model directory has its weights in model.safetensors"
            },
        ));
    }
    let bytes = std::fs::read(&weights).map_err(|e| io(&weights, e))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| RuntimeError::Data {
        path: weights.display().to_string(),
        offset: 0,
        detail: format!("not a safetensors file or truncated ({e})"),
    })?;
    let mut stored: BTreeMap<String, HostTensor> = BTreeMap::new();
    let mut unexpected = Vec::new();
    let mut head = None;
    for (name, view) in file.tensors() {
        let short = name.strip_prefix("transformer.").unwrap_or(&name).to_string();
        // Older checkpoints carry the causal masks as buffers: not parameters.
        if short.ends_with(".attn.bias") || short.ends_with(".attn.masked_bias") {
            continue;
        }
        let data: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            safetensors::Dtype::F16 => view.data().chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            safetensors::Dtype::BF16 => view.data().chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => {
                return Err(RuntimeError::Data {
                    path: weights.display().to_string(),
                    offset: 0,
                    detail: format!("tensor `{name}` has dtype {other:?}; GPT-2 weights are F32, F16 or BF16"),
                })
            }
        };
        let t = HostTensor::f32(view.shape().to_vec(), data).map_err(|e| RuntimeError::Data {
            path: weights.display().to_string(),
            offset: 0,
            detail: format!("tensor `{name}`: {e}"),
        })?;
        if short == "lm_head.weight" {
            head = Some((name.clone(), t));
        } else {
            stored.insert(short, t);
        }
    }
    let shapes = shapes(&config)?;
    let mut report = LoadReport::default();
    let mut params = Tensors::new();
    let known: std::collections::BTreeSet<String> = names(config.layers).into_iter().map(|n| n.hf).collect();
    unexpected.extend(stored.keys().filter(|k| !known.contains(*k)).cloned());
    for n in names(config.layers) {
        let want = &shapes[&n.ours];
        match stored.remove(&n.hf) {
            None => report.missing.push(n.ours),
            Some(t) => {
                let t = if n.transposed { transpose(t) } else { t };
                if &t.shape == want {
                    params.insert(n.ours, t);
                } else {
                    let file_shape = if n.transposed { t.shape.iter().rev().copied().collect() } else { t.shape.clone() };
                    let hf_want = if n.transposed { want.iter().rev().copied().collect() } else { want.clone() };
                    report.mismatched.push((n.hf, hf_want, file_shape));
                }
            }
        }
    }
    // A separate LM head must be the tied one (GPT2LMHeadModel ties it to wte).
    if let (Some((name, h)), Some(wte)) = (&head, params.get("wte.embedding_table")) {
        if h.shape != wte.shape || values(h) != values(wte) {
            unexpected.push(format!("{name} (not tied to transformer.wte.weight, which GPT-2's head is)"));
        }
    }
    report.unexpected = unexpected;
    if opts.strict && !report.is_clean() {
        return Err(invalid(
            format!("model {}", weights.display()),
            format!("does not match its config.json: {report}; check that config.json belongs to these weights (or load non-strict)"),
        ));
    }
    Ok(Loaded { config, hf_config, params, dir: dir.to_path_buf(), report })
}

/// Writes a GPT-2 model directory at `dir` that `transformers` loads
/// (`GPT2LMHeadModel.from_pretrained(dir)`, `AutoTokenizer.from_pretrained(dir)`):
/// `config.json` (`hf_config` with the shape of `config` written in), `model.safetensors`
/// (every parameter of `params` under Hugging Face's name, the head tied and stored once) and
/// the tokenizer files of `tokenizer_from` (a model directory) copied. Each file is written
/// atomically; a missing parameter is an error before anything is written.
pub fn save(dir: &Path, config: &GptConfig, hf_config: &Map<String, Json>, params: &Tensors, tokenizer_from: Option<&Path>) -> Result<()> {
    let shapes = shapes(config)?;
    let mut tensors = Vec::new();
    for n in names(config.layers) {
        let t = params.get(&n.ours).ok_or_else(|| invalid(format!("saving {}", dir.display()), format!("parameter `{}` has no value", n.ours)))?;
        if t.shape != shapes[&n.ours] {
            return Err(invalid(
                format!("saving {}", dir.display()),
                format!("parameter `{}` is {:?}, the config gives {:?}", n.ours, t.shape, shapes[&n.ours]),
            ));
        }
        let transpose = match (n.transposed, t.shape.as_slice()) {
            (true, &[rows, cols]) => Some([rows, cols]),
            _ => None,
        };
        let shape = if transpose.is_some() { t.shape.iter().rev().copied().collect() } else { t.shape.clone() };
        tensors.push((format!("transformer.{}", n.hf), Saved { values: values(t), shape, transpose }));
    }
    let meta: std::collections::HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut j = hf_config.clone();
    for (key, v) in [
        ("n_layer", config.layers),
        ("n_head", config.heads),
        ("n_embd", config.width),
        ("n_positions", config.context),
        ("vocab_size", config.vocab_size),
    ] {
        j.insert(key.into(), Json::from(v));
    }
    j.insert("model_type".into(), Json::from("gpt2"));
    j.insert("layer_norm_epsilon".into(), Json::from(config.layer_norm_eps));
    j.insert("activation_function".into(), Json::from(if config.gelu_approximate { "gelu_new" } else { "gelu" }));
    for key in ["embd_pdrop", "attn_pdrop", "resid_pdrop"] {
        j.insert(key.into(), Json::from(config.dropout));
    }
    j.entry("architectures").or_insert_with(|| Json::from(vec!["GPT2LMHeadModel"]));
    let config_text = serde_json::to_string_pretty(&Json::Object(j)).expect("a JSON object prints") + "\n";
    let mut copies = Vec::new();
    if let Some(from) = tokenizer_from {
        for f in COPIED {
            let p = from.join(f);
            if p.is_file() && (from != dir) {
                copies.push((f, std::fs::read(&p).map_err(|e| io(&p, e))?));
            }
        }
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| invalid(format!("model directory {}", dir.display()), format!("cannot be made: {e}; choose a writable path")))?;
    // Streamed to the file a tensor at a time: no copy of the whole model in memory.
    let views = tensors.iter().map(|(name, t)| (name.as_str(), t));
    write_atomic_with(&dir.join("model.safetensors"), |tmp| {
        safetensors::tensor::serialize_to_file(views, Some(meta), tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => e,
            other => std::io::Error::other(other.to_string()),
        })
    })?;
    for (f, bytes) in copies {
        write_atomic(&dir.join(f), &bytes)?;
    }
    // The config last: a directory with a config.json has everything before it.
    write_atomic(&dir.join("config.json"), config_text.as_bytes())
}

/// A model's tokenizer (`tokenizer.json`, read with Hugging Face's `tokenizers`): GPT-2's
/// byte-level BPE gives the ids `transformers`' tokenizer gives, on any text.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// The tokenizer of model directory `dir` (its `tokenizer.json`).
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(invalid(
                path.display().to_string(),
                "is missing: save the tokenizer with the model (`tokenizer.save_pretrained(dir)`; a fast tokenizer writes tokenizer.json)",
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| invalid(path.display().to_string(), format!("is not a tokenizer file tokenizers reads: {e}")))?;
        Ok(Tokenizer { inner, path })
    }
    /// The ids of `text` (no special tokens added, as GPT-2's tokenizer adds none).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc =
            self.inner.encode_fast(text, false).map_err(|e| invalid(self.path.display().to_string(), format!("cannot encode the text: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }
    /// The text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| invalid(self.path.display().to_string(), format!("cannot decode ids: {e}")))
    }
    /// Ids in the vocabulary (special tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
    /// The id of a token (`<|endoftext|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names cover every parameter of cellgraph's GPT, once each.
    #[test]
    fn every_gpt_parameter_has_a_hugging_face_name() {
        let c = GptConfig { vocab_size: 11, context: 7, layers: 2, heads: 2, width: 8, layer_norm_eps: 1e-5, dropout: 0.0, gelu_approximate: true };
        let ours: Vec<String> = names(c.layers).into_iter().map(|n| n.ours).collect();
        let mut sorted = ours.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), ours.len(), "a name twice");
        assert_eq!(sorted, shapes(&c).unwrap().into_keys().collect::<Vec<_>>());
    }
}

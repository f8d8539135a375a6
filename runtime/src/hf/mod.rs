//! Hugging Face model directories (`save_pretrained`'s) of GPT-2 (`GPT2LMHeadModel`) and Llama
//! (`LlamaForCausalLM`): `config.json`, `model.safetensors` and the tokenizer's files, read
//! into a [`GPT`](cellgraph_cells::GPT)'s or a [`Llama`](cellgraph_cells::Llama)'s shape and
//! parameters and written back in the same format, so `transformers` loads what cellgraph
//! trained.
//!
//! The parameters map one to one, by name: Hugging Face's `transformer.h.0.attn.c_attn.weight`
//! is cellgraph's `h.0.attn.c_attn.weight`, `model.layers.0.mlp.up_proj.weight` is
//! `layers.0.mlp.up_proj.weight`; LayerNorm's `weight`/`bias` are `gamma`/`beta`, an
//! embedding's `weight` its `embedding_table` (each architecture's module says the rest).
//!
//! Loading is strict by default: a missing, unexpected or wrongly shaped tensor is an error
//! naming each; [`LoadOptions::strict`] off loads what matches and reports the rest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cellgraph_cells::{Cell, GptConfig, LlamaConfig, Scope};
use cellgraph_compiler::HostTensor;
use serde_json::{Map, Value as Json};

use crate::checkpoint::{write_atomic, write_atomic_with, Tensors};
use crate::error::{listed, Result, RuntimeError};

mod files;
mod gpt2;
mod llama;

use files::{read_safetensors, values, Saved};

/// The files of a model directory besides the weights that [`save`] copies from the directory
/// the model was loaded from (the tokenizer's, the generation defaults).
const COPIED: [&str; 7] =
    ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json"];

/// How [`load`] treats tensors that do not match the configuration.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Missing, unexpected or wrongly shaped tensors are errors (else reported in
    /// [`Loaded::report`] and the missing ones left to the model's initializers).
    pub strict: bool,
    /// Dropout for every place the model has it, instead of the configuration's (GPT-2's
    /// must then agree: `embd_pdrop`, `attn_pdrop` and `resid_pdrop` equal; Llama's is
    /// `attention_dropout`).
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

/// The architecture and shape of a model directory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ModelConfig {
    /// `"model_type": "gpt2"`: a [`cellgraph_cells::GPT`].
    Gpt2(GptConfig),
    /// `"model_type": "llama"`: a [`cellgraph_cells::Llama`].
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// The network of this shape, its parameters named as [`load`] names them.
    pub fn network(&self, s: &Scope) -> Result<Box<dyn Cell>> {
        Ok(match self {
            ModelConfig::Gpt2(c) => Box::new(cellgraph_cells::GPT::new(s, *c)?),
            ModelConfig::Llama(c) => Box::new(cellgraph_cells::Llama::new(s, *c)?),
        })
    }
    /// The longest sequence.
    pub fn context(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.context,
            ModelConfig::Llama(c) => c.context,
        }
    }
    /// The config.json key of [`Self::context`].
    pub fn context_key(&self) -> &'static str {
        match self {
            ModelConfig::Gpt2(_) => "n_positions",
            ModelConfig::Llama(_) => "max_position_embeddings",
        }
    }
    /// The vocabulary's size (the logits' width).
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }
    /// transformers' class for the directory (`GPT2LMHeadModel`, `LlamaForCausalLM`).
    pub fn class(&self) -> &'static str {
        match self {
            ModelConfig::Gpt2(_) => "GPT2LMHeadModel",
            ModelConfig::Llama(_) => "LlamaForCausalLM",
        }
    }
    /// Every trained parameter, by Hugging Face's name and cellgraph's.
    fn names(&self) -> Vec<Name> {
        match self {
            ModelConfig::Gpt2(c) => gpt2::names(c.layers),
            ModelConfig::Llama(c) => llama::names(c),
        }
    }
    /// A tensor name of the file as [`Self::names`] spells it; `None` for a buffer.
    fn canonical(&self, name: &str) -> Option<String> {
        match self {
            ModelConfig::Gpt2(_) => gpt2::canonical(name),
            ModelConfig::Llama(_) => llama::canonical(name),
        }
    }
    /// The head tied to the embedding table: the head's name and the table's, as stored.
    fn tied_head(&self) -> Option<(&'static str, &'static str)> {
        match self {
            ModelConfig::Gpt2(_) => Some(("lm_head.weight", "transformer.wte.weight")),
            ModelConfig::Llama(c) => c.tie_embeddings.then_some(("lm_head.weight", "model.embed_tokens.weight")),
        }
    }
}

/// A model directory read by [`load`].
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The model's architecture and shape (build it with [`ModelConfig::network`]).
    pub config: ModelConfig,
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

/// One parameter: Hugging Face's name as `save_pretrained` writes it, cellgraph's, and
/// whether the stored matrix is the transpose of cellgraph's (GPT-2's `Conv1D`).
struct Name {
    hf: String,
    ours: String,
    transposed: bool,
}

/// The keys of a `config.json` at `path`, read with errors that name the file and the key.
struct Keys<'a> {
    path: &'a Path,
    j: &'a Map<String, Json>,
}

impl Keys<'_> {
    fn invalid(&self, detail: impl Into<String>) -> RuntimeError {
        invalid(self.path.display().to_string(), detail)
    }
    /// A whole number the config must have.
    fn int(&self, key: &str) -> Result<usize> {
        self.j
            .get(key)
            .and_then(Json::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| self.invalid(format!("`{key}` is missing or not a whole number; the model's config.json has it")))
    }
    /// A whole number, `default` when absent or null.
    fn int_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.j.get(key) {
            None | Some(Json::Null) => Ok(default),
            Some(_) => self.int(key),
        }
    }
    /// A number, `default` when absent or null.
    fn num(&self, key: &str, default: f64) -> Result<f64> {
        match self.j.get(key) {
            None | Some(Json::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.invalid(format!("`{key}` is {v}, not a number"))),
        }
    }
    /// A flag, `default` when absent.
    fn flag(&self, key: &str, default: bool) -> bool {
        match self.j.get(key) {
            Some(Json::Bool(b)) => *b,
            _ => default,
        }
    }
    /// An error unless the flag `key` is `want` (absent counts as `want`): `who` has no other.
    fn require(&self, key: &str, want: bool, who: &str) -> Result<()> {
        if self.flag(key, want) != want {
            return Err(self.invalid(format!("`{key}: {}`: {who} has `{key}: {want}` only", !want)));
        }
        Ok(())
    }
    /// An error unless `p` is a dropout rate.
    fn dropout(&self, p: f64) -> Result<()> {
        if !(0.0..1.0).contains(&p) {
            return Err(self.invalid(format!("dropout {p} is outside [0, 1)")));
        }
        Ok(())
    }
}

/// The model's architecture and shape from `config.json` (`path` names it in errors): a GPT-2
/// or a Llama whose every setting cellgraph's model has; anything else is an error naming the
/// key.
pub fn config_from_json(path: &Path, j: &Map<String, Json>, dropout: Option<f64>) -> Result<ModelConfig> {
    let k = Keys { path, j };
    match j.get("model_type").and_then(Json::as_str) {
        Some("gpt2") => Ok(ModelConfig::Gpt2(gpt2::config(&k, dropout)?)),
        Some("llama") => Ok(ModelConfig::Llama(llama::config(&k, dropout)?)),
        other => Err(k.invalid(format!(
            "model_type is {other:?}: cellgraph reads GPT-2 (`\"model_type\": \"gpt2\"`, GPT2LMHeadModel) and Llama (`\"llama\"`, LlamaForCausalLM) checkpoints"
        ))),
    }
}

/// The trained parameters' shapes of `c`, by cellgraph's names (matrices as cellgraph stores
/// them), and its buffers' first values (a Llama's rotary tables): the network's own
/// parameters, so the two cannot drift apart.
fn shapes(c: &ModelConfig) -> Result<(BTreeMap<String, Vec<usize>>, Tensors)> {
    let (mut shapes, mut buffers) = (BTreeMap::new(), Tensors::new());
    for p in c.network(&Scope::root())?.parameters() {
        if p.requires_grad {
            shapes.insert(p.name, p.ty.dims().to_vec());
        } else {
            buffers.insert(p.name.clone(), p.materialize(0));
        }
    }
    Ok((shapes, buffers))
}

/// Reads a GPT-2 or Llama model directory: `config.json` and `model.safetensors` (F32, F16 or
/// BF16, read into f32). See the module's documentation for the names and [`LoadOptions`] for
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
    let transposed: std::collections::BTreeSet<String> = config.names().into_iter().filter(|n| n.transposed).map(|n| n.hf).collect();
    let read = read_safetensors(&weights, |name| config.canonical(name).map(|n| transposed.contains(&n)))?;
    let (params, report) = matched(&config, read)?;
    if opts.strict && !report.is_clean() {
        return Err(invalid(
            format!("model {}", weights.display()),
            format!("does not match its config.json: {report}; check that config.json belongs to these weights (or load non-strict)"),
        ));
    }
    Ok(Loaded { config, hf_config, params, dir: dir.to_path_buf(), report })
}

/// The parameters among the file's tensors `read` (each shaped as `config` gives it, by
/// cellgraph's names, with the model's buffers added), and what did not match.
fn matched(config: &ModelConfig, read: Vec<(String, HostTensor)>) -> Result<(Tensors, LoadReport)> {
    let mut stored: BTreeMap<String, (String, HostTensor)> = BTreeMap::new();
    for (name, t) in read {
        let canonical = config.canonical(&name).expect("only parameters are read");
        stored.insert(canonical, (name, t));
    }
    // A tied head stored apart (older GPT-2 files, a tied Llama's) must be the table.
    let head = config.tied_head().and_then(|(head, _)| stored.remove(head));
    let (shapes, buffers) = shapes(config)?;
    let mut report = LoadReport::default();
    let names = config.names();
    let known: std::collections::BTreeSet<&str> = names.iter().map(|n| n.hf.as_str()).collect();
    report.unexpected.extend(stored.iter().filter(|(k, _)| !known.contains(k.as_str())).map(|(_, (name, _))| name.clone()));
    let mut params = buffers;
    for n in names {
        let want = &shapes[&n.ours];
        match stored.remove(&n.hf) {
            None => report.missing.push(n.ours),
            Some((_, t)) if &t.shape == want => {
                params.insert(n.ours, t);
            }
            Some((_, t)) => {
                let file_shape = if n.transposed { t.shape.iter().rev().copied().collect() } else { t.shape.clone() };
                let hf_want = if n.transposed { want.iter().rev().copied().collect() } else { want.clone() };
                report.mismatched.push((n.hf, hf_want, file_shape));
            }
        }
    }
    if let (Some((name, h)), Some((_, table_hf))) = (&head, config.tied_head()) {
        let table = names_of(config, table_hf).and_then(|ours| params.get(&ours));
        if table.is_some_and(|t| h.shape != t.shape || values(h) != values(t)) {
            report.unexpected.push(format!("{name} (not tied to {table_hf}, which the config ties the head to)"));
        }
    }
    Ok((params, report))
}

/// cellgraph's name of the parameter Hugging Face names `hf`.
fn names_of(config: &ModelConfig, hf: &str) -> Option<String> {
    config.names().into_iter().find(|n| n.hf == hf).map(|n| n.ours)
}

/// Writes a model directory at `dir` that `transformers` loads (`GPT2LMHeadModel` or
/// `LlamaForCausalLM`'s `from_pretrained(dir)`, `AutoTokenizer.from_pretrained(dir)`):
/// `config.json` (`hf_config` with the shape of `config` written in), `model.safetensors`
/// (every trained parameter of `params` under Hugging Face's name, a tied head stored once,
/// no buffer) and
/// the tokenizer files of `tokenizer_from` (a model directory) copied. Each file is written
/// atomically; a missing parameter is an error before anything is written.
pub fn save(dir: &Path, config: &ModelConfig, hf_config: &Map<String, Json>, params: &Tensors, tokenizer_from: Option<&Path>) -> Result<()> {
    let views = params.iter().map(|(n, t)| (n.clone(), (t.shape.clone(), values(t)))).collect();
    save_values(dir, config, hf_config, &views, tokenizer_from)
}

/// A parameter's shape and its values, borrowed where they can be
/// ([`crate::Accumulator::parameter_values`]).
pub type ParamValues<'a> = BTreeMap<String, (Vec<usize>, std::borrow::Cow<'a, [f32]>)>;

/// [`save`] from parameters' values that need not be copied out of a session first
/// (`Accumulator::parameter_values`).
pub fn save_values(
    dir: &Path,
    config: &ModelConfig,
    hf_config: &Map<String, Json>,
    params: &ParamValues<'_>,
    tokenizer_from: Option<&Path>,
) -> Result<()> {
    let (shapes, _) = shapes(config)?;
    let mut tensors = Vec::new();
    for n in config.names() {
        let (shape, values) =
            params.get(&n.ours).ok_or_else(|| invalid(format!("saving {}", dir.display()), format!("parameter `{}` has no value", n.ours)))?;
        if shape != &shapes[&n.ours] {
            return Err(invalid(
                format!("saving {}", dir.display()),
                format!("parameter `{}` is {:?}, the config gives {:?}", n.ours, shape, shapes[&n.ours]),
            ));
        }
        let transpose = match (n.transposed, shape.as_slice()) {
            (true, &[rows, cols]) => Some([rows, cols]),
            _ => None,
        };
        let shape = if transpose.is_some() { shape.iter().rev().copied().collect() } else { shape.clone() };
        tensors.push((n.hf, Saved { values: std::borrow::Cow::Borrowed(&values[..]), shape, transpose }));
    }
    let meta: std::collections::HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut j = hf_config.clone();
    match config {
        ModelConfig::Gpt2(c) => gpt2::write_config(&mut j, c),
        ModelConfig::Llama(c) => llama::write_config(&mut j, c),
    }
    j.entry("architectures").or_insert_with(|| Json::from(vec![config.class()]));
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

/// A model's tokenizer (`tokenizer.json`, read with Hugging Face's `tokenizers`): it gives the
/// ids `transformers`' fast tokenizer gives, on any text (GPT-2's byte-level BPE, Llama's).
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
    /// The ids of `text`, with no special tokens added (GPT-2's tokenizer adds none; a Llama
    /// tokenizer's `<s>`, which `transformers` adds to each text it tokenizes, is not added).
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

    /// The names cover every trained parameter of cellgraph's GPT and Llama (tied or not),
    /// once each, and the buffers are the Llama's rotary tables.
    #[test]
    fn every_trained_parameter_has_a_hugging_face_name() {
        let gpt = GptConfig { vocab_size: 11, context: 7, layers: 2, heads: 2, width: 8, layer_norm_eps: 1e-5, dropout: 0.0, gelu_approximate: true };
        let llama = LlamaConfig { layers: 2, heads: 4, kv_heads: 2, width: 16, head_dim: 4, intermediate: 24, context: 7, ..LlamaConfig::small(11) };
        let tied = LlamaConfig { tie_embeddings: true, ..llama };
        for c in [ModelConfig::Gpt2(gpt), ModelConfig::Llama(llama), ModelConfig::Llama(tied)] {
            let ours: Vec<String> = c.names().into_iter().map(|n| n.ours).collect();
            let mut sorted = ours.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), ours.len(), "a name twice");
            let (shapes, buffers) = shapes(&c).unwrap();
            assert_eq!(sorted, shapes.into_keys().collect::<Vec<_>>());
            let want: Vec<&str> = if matches!(c, ModelConfig::Llama(_)) { vec!["rotary_emb.cos", "rotary_emb.sin"] } else { vec![] };
            assert_eq!(buffers.keys().map(String::as_str).collect::<Vec<_>>(), want);
        }
    }
}

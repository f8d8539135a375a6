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

/// A tensor's values as f32: its own memory when it holds f32.
fn values(t: &HostTensor) -> std::borrow::Cow<'_, [f32]> {
    match &t.data {
        cellgraph_compiler::HostData::F32(v) => std::borrow::Cow::Borrowed(v),
        _ => std::borrow::Cow::Owned(t.to_f32()),
    }
}

/// The tensors of the safetensors file at `path` that `keep` keeps (`Some(transpose)`), in
/// the file's order, each read from the file straight into its own f32 buffer (f16 and bf16
/// widened through a small buffer), with no copy of the file in memory; a rank-2 tensor kept
/// with `transpose` (a `Conv1D` weight) is read into one reused buffer, then transposed into
/// its own. The file is checked as `SafeTensors::deserialize` checks it, before any tensor is
/// read: a header that parses, offsets that tile the data exactly, the file's length.
fn read_safetensors(path: &Path, keep: impl Fn(&str) -> Option<bool>) -> Result<Vec<(String, HostTensor)>> {
    use safetensors::Dtype;
    use std::io::{Read, Seek, SeekFrom};
    let bad = |detail: String| RuntimeError::Data { path: path.display().to_string(), offset: 0, detail };
    let truncated = |why: String| bad(format!("not a safetensors file or truncated ({why})"));
    let mut f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let len = f.metadata().map_err(|e| io(path, e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| truncated(format!("{len} bytes: no header")))?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || n > len - 8 {
        return Err(truncated(format!("a header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| io(path, e))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&header).map_err(|e| truncated(format!("its header: {e}")))?;
    let mut tensors = Vec::new();
    let mut end = 0;
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("a name of the header");
        let numel = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let bytes = match info.dtype {
            Dtype::F32 => numel.and_then(|n| n.checked_mul(4)),
            Dtype::F16 | Dtype::BF16 => numel.and_then(|n| n.checked_mul(2)),
            other => return Err(bad(format!("tensor `{name}` has dtype {other:?}; GPT-2 weights are F32, F16 or BF16"))),
        };
        let (start, stop) = info.data_offsets;
        if start != end || Some(stop.wrapping_sub(start)) != bytes || stop < start {
            return Err(truncated(format!(
                "tensor `{name}`'s offsets {start}..{stop} do not follow {end} or fit its {:?} {:?}",
                info.dtype, info.shape
            )));
        }
        end = stop;
        tensors.push((name.clone(), info.dtype, info.shape.clone(), numel.unwrap_or(0), stop - start));
    }
    if 8 + n + end as u64 != len {
        return Err(truncated(format!("its header describes {end} bytes of data, the file holds {}", len - 8 - n)));
    }
    // Reads `out.len()` values of `dtype` from the file into `out`.
    let mut chunk = Vec::new();
    let mut read = |f: &mut std::fs::File, dtype: Dtype, out: &mut [f32]| -> std::io::Result<()> {
        if dtype == Dtype::F32 {
            // SAFETY: `out`'s memory as bytes, which any bit pattern of an f32 is.
            f.read_exact(unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(out)) })?;
            if cfg!(target_endian = "big") {
                out.iter_mut().for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
            }
            return Ok(());
        }
        for part in out.chunks_mut(1 << 16) {
            chunk.resize(2 * part.len(), 0u8);
            f.read_exact(&mut chunk)?;
            let halves = chunk.chunks_exact(2).map(|b| [b[0], b[1]]);
            match dtype {
                Dtype::F16 => part.iter_mut().zip(halves).for_each(|(x, b)| *x = half::f16::from_le_bytes(b).to_f32()),
                _ => part.iter_mut().zip(halves).for_each(|(x, b)| *x = half::bf16::from_le_bytes(b).to_f32()),
            }
        }
        Ok(())
    };
    let mut scratch = Vec::new();
    let mut out = Vec::new();
    for (name, dtype, shape, numel, bytes) in tensors {
        let Some(transpose) = keep(&name) else {
            f.seek(SeekFrom::Current(bytes as i64)).map_err(|e| io(path, e))?;
            continue;
        };
        let (shape, v) = match (transpose, shape.as_slice()) {
            (true, &[rows, cols]) => {
                scratch.resize(numel.max(scratch.len()), 0.0);
                read(&mut f, dtype, &mut scratch[..numel]).map_err(|e| io(path, e))?;
                (vec![cols, rows], transposed(&scratch[..numel], rows, cols))
            }
            _ => {
                let mut v = vec![0.0f32; numel];
                read(&mut f, dtype, &mut v).map_err(|e| io(path, e))?;
                (shape, v)
            }
        };
        out.push((name, HostTensor::f32(shape, v).expect("the header's shape, checked")));
    }
    Ok(out)
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
    let transposed: std::collections::BTreeSet<String> = names(config.layers).into_iter().filter(|n| n.transposed).map(|n| n.hf).collect();
    let short = |name: &str| name.strip_prefix("transformer.").unwrap_or(name).to_string();
    // Older checkpoints carry the causal masks as buffers: not parameters.
    let read = read_safetensors(&weights, |name| {
        let short = short(name);
        (!(short.ends_with(".attn.bias") || short.ends_with(".attn.masked_bias"))).then(|| transposed.contains(&short))
    })?;
    let mut stored: BTreeMap<String, HostTensor> = BTreeMap::new();
    let mut unexpected = Vec::new();
    let mut head = None;
    for (name, t) in read {
        let short = short(&name);
        if short == "lm_head.weight" {
            head = Some((name, t));
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
    config: &GptConfig,
    hf_config: &Map<String, Json>,
    params: &ParamValues<'_>,
    tokenizer_from: Option<&Path>,
) -> Result<()> {
    let shapes = shapes(config)?;
    let mut tensors = Vec::new();
    for n in names(config.layers) {
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
        tensors.push((format!("transformer.{}", n.hf), Saved { values: std::borrow::Cow::Borrowed(&values[..]), shape, transpose }));
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

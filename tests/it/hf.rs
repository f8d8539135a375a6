//! Hugging Face GPT-2 directories: the vendored tiny GPT-2 (`tests/assets/tiny-gpt2`, made by
//! `scripts/make_tiny_gpt2.py` with `transformers`) loads into cellgraph's GPT and gives
//! `transformers`' logits and loss (its `reference.json`), its tokenizer gives `tokenizers`'
//! ids, what cellgraph saves loads back unchanged, and bad directories are clear errors.

use std::path::{Path, PathBuf};

use cellgraph::prelude::*;
use cellgraph::runtime::checkpoint::Tensors;
use cellgraph::runtime::hf::{self, LoadOptions, Tokenizer};
use serde_json::Value as Json;

use crate::common::TmpDir;

const TINY: &str = "tests/assets/tiny-gpt2";

fn reference() -> Json {
    serde_json::from_str(&std::fs::read_to_string(Path::new(TINY).join("reference.json")).unwrap()).unwrap()
}

/// The GPT-2's shape of a loaded GPT-2 directory.
pub(crate) fn gpt(m: &hf::Loaded) -> GptConfig {
    match m.config {
        hf::ModelConfig::Gpt2(c) => c,
        other => panic!("{} is not a GPT-2: {other:?}", m.dir.display()),
    }
}

fn ids(j: &Json) -> Vec<i32> {
    j.as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect()
}

/// `cell` traced for inference on `inputs`, run on a session holding `params`.
pub(crate) fn run(cell: &dyn Cell, params: &cellgraph::runtime::checkpoint::Tensors, inputs: &[(&str, HostTensor)]) -> Vec<f64> {
    let types: Vec<(&str, TensorType)> = inputs.iter().map(|(n, t)| (*n, t.ty())).collect();
    let (g, _) = cellgraph::cells::cell::trace_inference(cell, "hf", &types).unwrap();
    let exe = compile(g).unwrap();
    let mut s = Session::<Cpu>::new(cpu());
    for (name, t) in params {
        s.set_param(name, t);
    }
    let values: Vec<HostTensor> = inputs.iter().map(|(_, t)| t.clone()).collect();
    s.run(&exe, &values).unwrap().remove(0).to_f64()
}

/// The mean loss of a loaded model over the reference sequence's 63 next-token predictions.
pub(crate) fn reference_loss(m: &hf::Loaded) -> f64 {
    let seq = ids(&reference()["sequence"]["ids"]);
    let with_loss = WithLossCell::new(GPT::new(&Scope::root(), gpt(m)).unwrap(), CrossEntropyLoss::new());
    let inputs =
        [("ids", HostTensor::i32(vec![1, 63], seq[..63].to_vec()).unwrap()), ("labels", HostTensor::i32(vec![1, 63], seq[1..].to_vec()).unwrap())];
    run(&with_loss, &m.params, &inputs)[0]
}

/// `logits` (`[T, vocab]`) against a `reference.json`'s `sequence` (transformers' logits at
/// `logits_positions`): within 1e-5 of the largest, at each position.
pub(crate) fn assert_logits_match(logits: &[f64], reference: &Json, vocab: usize) {
    let positions = reference["logits_positions"].as_array().unwrap();
    let mut worst = 0.0f64;
    for (row, p) in reference["logits"].as_array().unwrap().iter().zip(positions) {
        let p = p.as_u64().unwrap() as usize;
        let want: Vec<f64> = row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let scale = want.iter().fold(0.0f64, |a, x| a.max(x.abs()));
        for (got, want) in logits[p * vocab..(p + 1) * vocab].iter().zip(&want) {
            worst = worst.max((got - want).abs() / scale);
        }
    }
    eprintln!("logits: at most {worst:e} of the largest from transformers'");
    assert!(worst <= 1e-5, "logits differ from transformers' by {worst:e} of the largest");
}

/// Loaded into cellgraph, the tiny GPT-2's logits at three positions of a 64-token sequence and
/// its mean loss over the 63 next-token predictions equal `transformers`' (float32, eval
/// mode) within 1e-5, relative to the largest logit and to the loss.
#[test]
fn the_tiny_gpt2_gives_transformers_logits_and_loss() {
    let r = reference();
    let m = hf::load(Path::new(TINY), &LoadOptions { dropout: Some(0.0), ..Default::default() }).unwrap();
    let c = gpt(&m);
    assert!(m.report.is_clean() && c.gelu_approximate, "{c:?}");
    assert_eq!((c.layers, c.heads, c.width, c.context, c.vocab_size), (2, 4, 64, 128, 1000));
    let seq = ids(&r["sequence"]["ids"]);
    assert_eq!(seq.len(), 64);
    let gpt = GPT::new(&Scope::root(), gpt(&m)).unwrap();
    let logits = run(&gpt, &m.params, &[("ids", HostTensor::i32(vec![1, 64], seq.clone()).unwrap())]);
    assert_logits_match(&logits, &r["sequence"], c.vocab_size);
    let loss = reference_loss(&m);
    let want = r["sequence"]["loss"].as_f64().unwrap();
    eprintln!("loss {loss} against transformers' {want}");
    assert!((loss - want).abs() <= 1e-5 * want, "loss {loss} vs transformers' {want}");
}

/// The tokenizer gives `tokenizers`' ids on the reference text and on whitespace and
/// non-ASCII strings, and decodes them back to the text.
#[test]
fn the_tokenizer_gives_the_python_tokenizers_ids() {
    let r = reference();
    let tok = Tokenizer::from_dir(Path::new(TINY)).unwrap();
    assert_eq!(tok.vocab_size(), 1000);
    assert_eq!(tok.token_id("<|endoftext|>"), Some(0));
    let mut cases = vec![(r["text"].as_str().unwrap().to_string(), ids(&r["ids"]))];
    for s in r["strings"].as_array().unwrap() {
        cases.push((s["text"].as_str().unwrap().to_string(), ids(&s["ids"])));
    }
    assert!(cases.len() >= 3);
    for (text, want) in cases {
        let got = tok.encode(&text).unwrap();
        assert_eq!(got.iter().map(|&i| i as i32).collect::<Vec<_>>(), want, "{text:?}");
        assert_eq!(tok.decode(&got).unwrap(), text);
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cellgraph-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// What cellgraph saves is a model directory of the same format: loaded back, every parameter
/// has the same bits, the config the same shape and keys, and the tokenizer files are there.
#[test]
fn a_saved_model_loads_back_bit_for_bit() {
    let m = hf::load(Path::new(TINY), &LoadOptions::default()).unwrap();
    // Kept after the test (`target/tmp/hf-saved-tiny-gpt2`): `benches/hf_gpt2_check.py` loads
    // it with transformers.
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hf-saved-tiny-gpt2");
    let _ = std::fs::remove_dir_all(&out);
    hf::save(&out, &m.config, &m.hf_config, &m.params, Some(&m.dir)).unwrap();
    let back = hf::load(&out, &LoadOptions::default()).unwrap();
    assert_eq!(back.config, m.config);
    assert_eq!(back.params.keys().collect::<Vec<_>>(), m.params.keys().collect::<Vec<_>>());
    for (name, t) in &m.params {
        assert_eq!(
            back.params[name].to_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            t.to_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{name}"
        );
    }
    for key in m.hf_config.keys() {
        assert!(back.hf_config.contains_key(key), "config.json lost `{key}`");
    }
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"] {
        assert_eq!(std::fs::read(out.join(f)).unwrap(), std::fs::read(Path::new(TINY).join(f)).unwrap(), "{f}");
    }
    // The same tensor names as transformers wrote (the head tied, stored once).
    let names = |dir: &Path| {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let mut v: Vec<String> = safetensors::SafeTensors::deserialize(&bytes).unwrap().names().into_iter().map(String::from).collect();
        v.sort();
        v
    };
    assert_eq!(names(&out), names(Path::new(TINY)));
    // Every tensor's bytes as transformers wrote them (the Conv1D weights transposed back as
    // the file is streamed out).
    let (ours, theirs) = (std::fs::read(out.join("model.safetensors")).unwrap(), std::fs::read(Path::new(TINY).join("model.safetensors")).unwrap());
    let (ours, theirs) = (safetensors::SafeTensors::deserialize(&ours).unwrap(), safetensors::SafeTensors::deserialize(&theirs).unwrap());
    for name in names(&out) {
        let (a, b) = (ours.tensor(&name).unwrap(), theirs.tensor(&name).unwrap());
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
        assert!(a.data() == b.data(), "{name}: other bytes than transformers'");
    }
}

/// A save onto a full disk (a 64 KiB tmpfs; root only, as CI runs) fails naming the weights
/// file, and leaves no file behind: the streamed weights' temporary file is removed.
#[test]
fn a_save_onto_a_full_disk_leaves_no_file() {
    let m = hf::load(Path::new(TINY), &LoadOptions::default()).unwrap();
    let small = scratch("full-disk");
    std::fs::create_dir_all(&small).unwrap();
    let mounted =
        std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"]).arg(&small).status().is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("SKIPPED: mounting a tmpfs needs root");
        return;
    }
    let out = small.join("tuned");
    let e = hf::save(&out, &m.config, &m.hf_config, &m.params, Some(&m.dir)).map(|_| ()).unwrap_err().to_string();
    let left: Vec<_> = std::fs::read_dir(&out).map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect()).unwrap_or_default();
    let _ = std::process::Command::new("umount").arg(&small).status();
    let _ = std::fs::remove_dir_all(&small);
    assert!(e.starts_with(&format!("cannot write checkpoint {}", out.join("model.safetensors").display())), "{e}");
    assert!(left.is_empty(), "a failed save left {left:?}");
}

/// The tiny GPT-2 as `cellgraph finetune` trains it: AdamW, windows of 2.
fn tiny_net(m: &hf::Loaded) -> GradAccumulation {
    let loss = CrossEntropyLoss::new().tokens();
    GradAccumulation::new(WithLossCell::new(GPT::new(&Scope::root(), gpt(m)).unwrap(), loss), 2).normalization(Normalization::Tokens)
}

/// `Model::pretrained` is `Model::new` then `restore_with`, without drawing what the
/// checkpoint replaces: the same parameters, accumulators and optimizer state, bit for bit,
/// and the same report, strict and not (a parameter the checkpoint lacks is drawn from the
/// seed as `new` draws it); strict, a missing parameter is the same error. `parameters()` holds
/// the network's parameters alone, and `parameter_values()` the same values, borrowed.
#[test]
fn a_pretrained_model_equals_a_new_one_restored() {
    let m = hf::load(Path::new(TINY), &LoadOptions::default()).unwrap();
    let opt = || Adam::adamw(LearningRate::Constant(1e-3), 0.01);
    let bits = |t: &Tensors| t.iter().map(|(k, v)| (k.clone(), v.to_f64().iter().map(|x| x.to_bits()).collect::<Vec<_>>())).collect::<Vec<_>>();
    let mut lacking = m.params.clone();
    lacking.remove("ln_f.beta").unwrap();
    for (params, strict) in [(&m.params, true), (&m.params, false), (&lacking, false)] {
        let mut restored = Model::<Cpu>::new(tiny_net(&m), opt(), cpu(), 7).unwrap();
        let want = restored.restore_with(params, strict).unwrap();
        let (pretrained, got) = Model::<Cpu>::pretrained(tiny_net(&m), opt(), cpu(), 7, params.clone(), strict).unwrap();
        assert_eq!(got, want);
        assert_eq!(bits(&pretrained.snapshot()), bits(&restored.snapshot()), "strict {strict}, {} tensors", params.len());
        let own = pretrained.accumulator().parameters();
        // The same values borrowed from the session (no copy on the CPU).
        let views = pretrained.accumulator().parameter_values();
        assert_eq!(views.keys().collect::<Vec<_>>(), own.keys().collect::<Vec<_>>());
        for (k, (shape, v)) in &views {
            assert!(matches!(v, std::borrow::Cow::Borrowed(_)), "{k} is borrowed");
            assert_eq!((shape, &v[..]), (&own[k].shape, &own[k].to_f32()[..]), "{k}");
        }
        let names: Vec<String> = Cell::parameters(pretrained.accumulator().network()).into_iter().map(|p| p.name).collect();
        assert_eq!(own.keys().cloned().collect::<Vec<_>>(), {
            let mut n = names;
            n.sort();
            n
        });
        assert_eq!(bits(&own), bits(&restored.snapshot().into_iter().filter(|(k, _)| own.contains_key(k)).collect()));
    }
    assert_eq!(
        Model::<Cpu>::new(tiny_net(&m), opt(), cpu(), 7).unwrap().restore_with(&lacking, true).unwrap_err().to_string(),
        Model::<Cpu>::pretrained(tiny_net(&m), opt(), cpu(), 7, lacking.clone(), true).map(|_| ()).unwrap_err().to_string()
    );
}

/// Bad directories and configs that do not fit the weights are errors naming the file, the
/// key or each tensor, with what to do; non-strict loading reports instead.
#[test]
fn bad_model_directories_are_clear_errors() {
    let err = |dir: &Path, opts: &LoadOptions| hf::load(dir, opts).map(|_| ()).unwrap_err().to_string();
    let e = err(Path::new("tests/assets/no-such-model"), &LoadOptions::default());
    assert!(e.contains("no-such-model") && e.contains("is not a directory"), "{e}");
    let dir = scratch("bad");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(Path::new(TINY).join(f), dir.join(f)).unwrap();
    }
    let config: Json = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let write = |edit: &dyn Fn(&mut serde_json::Map<String, Json>)| {
        let mut c = config.as_object().unwrap().clone();
        edit(&mut c);
        std::fs::write(dir.join("config.json"), serde_json::to_string(&c).unwrap()).unwrap();
    };
    // A config of another width: every tensor of the wrong shape is named.
    write(&|c| {
        c.insert("n_embd".into(), Json::from(32));
    });
    let e = err(&dir, &LoadOptions::default());
    assert!(e.contains("does not match its config.json") && e.contains("wte.weight is [1000, 64], the config gives [1000, 32]"), "{e}");
    let loose = hf::load(&dir, &LoadOptions { strict: false, ..Default::default() }).unwrap();
    assert!(loose.report.missing.is_empty() && !loose.report.mismatched.is_empty() && loose.params.is_empty(), "{}", loose.report);
    // More layers than the file has: the missing ones are named.
    write(&|c| {
        c.insert("n_layer".into(), Json::from(3));
    });
    let e = err(&dir, &LoadOptions::default());
    assert!(e.contains("missing h.2.ln_1.gamma"), "{e}");
    // Settings cellgraph's GPT does not have, named by key.
    write(&|c| {
        c.insert("model_type".into(), Json::from("mistral"));
    });
    let e = err(&dir, &LoadOptions::default());
    assert!(e.contains("model_type is Some(\"mistral\")") && e.contains("GPT2LMHeadModel") && e.contains("LlamaForCausalLM"), "{e}");
    write(&|c| {
        c.insert("attn_pdrop".into(), Json::from(0.0));
    });
    let e = err(&dir, &LoadOptions::default());
    assert!(e.contains("attn_pdrop 0") && e.contains("--dropout"), "{e}");
    assert!(hf::load(&dir, &LoadOptions { dropout: Some(0.0), ..Default::default() }).is_ok());
    write(&|c| {
        c.insert("n_inner".into(), Json::from(100));
    });
    assert!(err(&dir, &LoadOptions::default()).contains("n_inner is 100"));
    // Weights missing, or not safetensors.
    write(&|_| {});
    std::fs::write(dir.join("model.safetensors"), b"not a safetensors file").unwrap();
    assert!(err(&dir, &LoadOptions::default()).contains("not a safetensors file"));
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(err(&dir, &LoadOptions::default()).contains("model.safetensors: is missing"));
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = Tokenizer::from_dir(&dir).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json: is missing"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Weights are read from the file straight into their tensors: a model saved in f16 or bf16
/// (as many Hugging Face checkpoints are) loads as those values widened to f32, the `Conv1D`
/// weights transposed as from f32; a file cut short, one byte too long, or whose header's
/// offsets do not tile its data is an error naming the file, before a tensor is read.
#[test]
fn half_precision_weights_load_and_damaged_files_are_errors() {
    let dir = scratch("halves");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(Path::new(TINY).join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(Path::new(TINY).join("model.safetensors")).unwrap();
    let f32s = hf::load(Path::new(TINY), &LoadOptions::default()).unwrap().params;
    type Half = (safetensors::Dtype, fn(f32) -> [u8; 2], fn(f32) -> f32);
    let halves: [Half; 2] = [
        (safetensors::Dtype::F16, |x| half::f16::from_f32(x).to_le_bytes(), |x| half::f16::from_f32(x).to_f32()),
        (safetensors::Dtype::BF16, |x| half::bf16::from_f32(x).to_le_bytes(), |x| half::bf16::from_f32(x).to_f32()),
    ];
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (dtype, to_bytes, rounded) in halves {
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = file
            .tensors()
            .into_iter()
            .map(|(name, v)| {
                let b = v.data().chunks_exact(4).flat_map(|b| to_bytes(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect();
                (name, v.shape().to_vec(), b)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> =
            data.iter().map(|(n, shape, b)| (n.clone(), safetensors::tensor::TensorView::new(dtype, shape.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let loaded = hf::load(&dir, &LoadOptions::default()).unwrap().params;
        assert_eq!(loaded.keys().collect::<Vec<_>>(), f32s.keys().collect::<Vec<_>>());
        for (name, t) in &loaded {
            let want: Vec<f32> = f32s[name].to_f32().into_iter().map(rounded).collect();
            assert_eq!((&t.shape, t.to_f32()), (&f32s[name].shape, want), "{dtype:?} {name}");
        }
    }
    let err = || hf::load(&dir, &LoadOptions::default()).map(|_| ()).unwrap_err().to_string();
    let path = dir.join("model.safetensors");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let first = header.find("\"data_offsets\":[").unwrap() + "\"data_offsets\":[".len();
    let shifted = format!("{}{}", &header[..first], header[first..].replacen('0', "4", 1));
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("cut short", bytes[..bytes.len() - 1].to_vec(), "the file holds"),
        ("one byte too long", [&bytes[..], &[0]].concat(), "the file holds"),
        ("offsets that leave a gap", [&bytes[..8], shifted.as_bytes(), &bytes[8 + n..]].concat(), "offset"),
        ("no header", bytes[..5].to_vec(), "no header"),
    ];
    for (what, b, says) in cases {
        std::fs::write(&path, b).unwrap();
        let e = err();
        assert!(e.contains(&path.display().to_string()) && e.contains("not a safetensors file or truncated") && e.contains(says), "{what}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

const CELLGRAPH: &str = env!("CARGO_BIN_EXE_cellgraph");

pub(crate) fn cellgraph(args: &[&str]) -> (Option<i32>, String, String) {
    let o = std::process::Command::new(CELLGRAPH).args(args).output().unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The first `chars` characters of the vendored Shakespeare as `dir/text.txt`: a text to
/// fine-tune on.
pub(crate) fn shakespeare_text(dir: &Path, chars: usize) -> PathBuf {
    let corpus = cellgraph::runtime::data::read_gzip_or_plain(Path::new("data/shakespeare/shakespeare.txt.gz")).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, &corpus[..chars]).unwrap();
    text
}

/// The value after `key` in a line like `epoch: 1 {'Loss': 5.1, 'Perplexity': 164.0}`.
pub(crate) fn field(line: &str, key: &str) -> f64 {
    let rest = &line[line.find(key).unwrap() + key.len()..];
    rest.trim_start_matches(['\'', ':', ' ']).split([',', '}']).next().unwrap().trim().parse().unwrap()
}

/// `cellgraph finetune` as a user runs it, on the tiny GPT-2 and 40,000 characters of
/// Shakespeare: LossMonitor lines, the held-out loss and perplexity before and after (lower
/// after), the loss log, a greedy sample, and a saved directory that loads back with the same
/// shape and trained values.
#[test]
fn finetune_trains_the_tiny_gpt2_and_saves_it_back() {
    let dir = TmpDir::created("hf-finetune");
    let text = shakespeare_text(&dir, 40_000);
    let (out, log) = (dir.join("tuned"), dir.join("ft.jsonl"));
    let args = [
        "finetune",
        "--model",
        TINY,
        "--data",
        text.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--steps",
        "8",
        "--block-size",
        "32",
        "--batch-size",
        "8",
        "--micro-size",
        "4",
        "--lr",
        "3e-3",
        "--print-every",
        "2",
        "--loss-log",
        log.to_str().unwrap(),
        "--sample-tokens",
        "5",
        "--device",
        "cpu",
        "--profile",
    ];
    let (code, stdout, stderr) = cellgraph(&args);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let line = |start: &str| stdout.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no `{start}` line in:\n{stdout}"));
    let (before, after) = (line("before:"), line("epoch: 1 {"));
    assert!(field(after, "'Loss'") < field(before, "'Loss'"), "{before} then {after}");
    assert!((field(after, "'Perplexity'") - field(after, "'Loss'").exp()).abs() < 1e-3 * field(after, "'Perplexity'"), "{after}");
    assert!(stdout.lines().filter(|l| l.contains("loss is")).count() >= 4, "{stdout}");
    assert!(line("trained 8 updates").contains("tokens/s") && line("saved").contains("tuned") && line("sample:").contains("->"), "{stdout}");
    assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 8 + 1, "a line per update and one for the epoch");
    // --profile: the time per op, the attention among them.
    assert!(stdout.lines().any(|l| l.trim_start().starts_with("attention ") && l.contains(" calls ")), "{stdout}");
    let (base, tuned) = (hf::load(Path::new(TINY), &LoadOptions::default()).unwrap(), hf::load(&out, &LoadOptions::default()).unwrap());
    assert_eq!(tuned.config, base.config);
    assert!(tuned.params.iter().all(|(n, t)| t.shape == base.params[n].shape && t.to_f32() != base.params[n].to_f32()), "every tensor trained");
    assert!(out.join("tokenizer.json").is_file());
}

/// Bad settings are refused with a sentence before anything trains.
#[test]
fn finetune_refuses_bad_settings() {
    let refused = |extra: &[&str], want: &str| {
        let mut args = vec![
            "finetune",
            "--model",
            TINY,
            "--data",
            "data/shakespeare/shakespeare.txt.gz",
            "--out",
            "/tmp/cellgraph-never-written",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = cellgraph(&args);
        assert!(code.is_some_and(|c| c != 0) && err.contains("error: ") && err.contains(want), "{args:?}:\n{out}\n{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!Path::new("/tmp/cellgraph-never-written").exists());
    };
    refused(&["--batch-size", "6", "--micro-size", "4"], "--batch-size 6 is not a multiple of --micro-size 4");
    refused(&["--block-size", "500"], "--block-size 500 exceeds the model's n_positions 128");
    refused(&["--model", "tests/assets/no-such-model"], "is not a directory");
    refused(&["--data", "no-such-text.txt"], "no-such-text.txt");
    refused(&["--data", "tests/assets"], "tests/assets: is a directory");
    refused(&["--graphs"], "has no graphs to capture");
    refused(&["--pad-to-multiple-of", "64"], "--pad-to-multiple-of pads the batches of --split lines");
}

/// `cellgraph finetune --graphs` on a device (lavapipe): each update's window of 4 micro-steps
/// replays as one graph, with the op-by-op run's loss lines, held-out losses and saved model,
/// byte for byte.
#[cfg(feature = "wgpu")]
#[test]
fn finetune_with_graphs_replays_windows_with_the_same_results() {
    let dir = TmpDir::created("hf-finetune-graphs");
    let text = shakespeare_text(&dir, 20_000);
    let run = |name: &str, graphs: bool| {
        let out = dir.join(name);
        let mut args = vec!["finetune", "--model", TINY, "--data", text.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(["--steps", "4", "--block-size", "32", "--batch-size", "8", "--micro-size", "4", "--lr", "3e-3"]);
        args.extend(["--print-every", "1", "--sample-tokens", "0", "--device", "wgpu", "--eval-items", "4"]);
        if graphs {
            args.push("--graphs");
        }
        let (code, stdout, stderr) = cellgraph(&args);
        assert_eq!(code, Some(0), "{stdout}\n{stderr}");
        let kept: Vec<String> = stdout.lines().filter(|l| l.contains("loss is") || l.contains("'Loss'")).map(str::to_string).collect();
        (kept, std::fs::read(out.join("model.safetensors")).unwrap(), stdout)
    };
    let (eager, replayed) = (run("eager", false), run("replayed", true));
    assert_eq!(eager.0.len(), 4 + 2, "{}", eager.2);
    assert_eq!(eager.0, replayed.0, "the loss lines");
    assert!(eager.1 == replayed.1, "the saved model.safetensors differs");
    assert!(!eager.2.contains("graph replay"), "{}", eager.2);
    let line = replayed.2.lines().find(|l| l.starts_with("graph replay: ")).unwrap_or_else(|| panic!("{}", replayed.2));
    assert!(
        line.starts_with("graph replay: 1 captured, ") && line.contains(" of them whole windows") && line.ends_with(", 0 op by op (not capturable)"),
        "{line}"
    );
    assert!(!line.contains(" 0 replayed"), "{line}");
}

/// `--split lines` batches padded to a multiple of the block (`--pad-to-multiple-of`, as
/// transformers' `DataCollatorWithPadding`): without dropout the first update's loss is the
/// unpadded run's within an f32 rounding or two and the later ones within rounding (the loss
/// ignores the padding, causal attention never reads it: every token's loss is the same bits,
/// `host::attention`'s `causal_rows_do_not_see_padding`; their sum over `[b, t]` runs in
/// lanes, whose order moves with `t`); on a device with graphs every window then has
/// one shape, captured once and replayed, where the batches' own lengths fill the session's
/// shapes and run op by op past them, named.
#[test]
fn lines_padded_to_a_multiple_keep_the_losses_and_one_graph() {
    let dir = TmpDir::created("hf-pad-lines");
    let text = shakespeare_text(&dir, 30_000);
    let run = |extra: &[&str]| {
        let out = dir.join("out");
        let mut args = vec!["finetune", "--model", TINY, "--data", text.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(["--split", "lines", "--block-size", "32", "--batch-size", "8", "--micro-size", "4", "--lr", "3e-3", "--dropout", "0"]);
        args.extend(["--print-every", "1", "--sample-tokens", "0", "--eval-items", "4"]);
        args.extend(extra);
        let (code, stdout, stderr) = cellgraph(&args);
        assert_eq!(code, Some(0), "{stdout}\n{stderr}");
        stdout
    };
    let losses = |out: &str| -> Vec<f64> { out.lines().filter_map(|l| l.split("loss is ").nth(1)).map(|v| v.parse().unwrap()).collect() };
    let (own, padded) = (run(&["--steps", "3", "--device", "cpu"]), run(&["--steps", "3", "--device", "cpu", "--pad-to-multiple-of", "32"]));
    let (a, b) = (losses(&own), losses(&padded));
    assert_eq!(a.len(), 3, "{own}");
    assert!((a[0] - b[0]).abs() <= 2.5e-7 * a[0].abs(), "the first update's loss: {a:?} against {b:?}");
    assert!(own.contains("trained 3 updates in ") && own.contains(" sequences/s)"), "lines are not counted as blocks of tokens: {own}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * x.abs(), "{a:?} against {b:?}");
    }
    #[cfg(feature = "wgpu")]
    {
        let line = |out: &str| out.lines().find(|l| l.starts_with("graph replay: ")).unwrap_or_else(|| panic!("{out}")).to_string();
        let padded = run(&["--steps", "12", "--device", "wgpu", "--graphs", "--pad-to-multiple-of", "32"]);
        let l = line(&padded);
        assert!(
            l.starts_with("graph replay: 1 captured, 10 replayed (10 of them whole windows") && l.ends_with(", 0 op by op (not capturable)"),
            "{l}"
        );
        let own = run(&["--steps", "20", "--device", "wgpu", "--graphs"]);
        assert!(own.contains("--graphs with --split lines: each batch length is its own plan"), "{own}");
        assert!(line(&own).contains("op by op while warming up") && own.contains("not captured: `micro_step"), "{own}");
        assert!(own.contains("past the 8 shapes a session captures"), "{own}");
    }
}

/// `cellgraph finetune --precision f16`: the loss sums over the window's tokens, so with
/// blocks the loss scale starts where a mean loss's 2^16 would (as Hugging Face's Trainer,
/// dividing by `num_items_in_batch`, has it): 2^16 over the window's 8 x 32 tokens. Lines,
/// fewer tokens than their padded length, start at 2^16. The summary says what overflowed.
#[test]
fn finetune_in_f16_starts_its_loss_scale_at_a_mean_losss() {
    let dir = TmpDir::created("hf-f16-scale");
    let text = shakespeare_text(&dir, 20_000);
    let run = |split: &str| {
        let out = dir.join("out");
        let mut args = vec!["finetune", "--model", TINY, "--data", text.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(["--split", split, "--steps", "2", "--block-size", "32", "--batch-size", "8", "--micro-size", "4"]);
        args.extend(["--precision", "f16", "--print-every", "0", "--sample-tokens", "0", "--eval-items", "4", "--device", "cpu"]);
        let (code, stdout, stderr) = cellgraph(&args);
        assert_eq!(code, Some(0), "{stdout}\n{stderr}");
        let line = stdout.lines().find(|l| l.starts_with("f16 loss scaling: ")).unwrap_or_else(|| panic!("{stdout}")).to_string();
        let skipped: u32 = line["f16 loss scaling: ".len()..].split(' ').next().unwrap().parse().unwrap();
        let now: f64 = line.rsplit("loss scale now ").next().unwrap().parse().unwrap();
        assert!(line.contains(" of 2 windows skipped"), "{line}");
        assert!(stdout.contains(&format!("trained {} updates in ", 2 - skipped)), "{stdout}");
        now * f64::from(1u32 << skipped)
    };
    assert_eq!(run("blocks"), 256.0, "the first scale with blocks");
    assert_eq!(run("lines"), 65536.0, "the first scale with lines");
}

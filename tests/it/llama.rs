//! Hugging Face Llama directories: the vendored tiny Llama (`tests/assets/tiny-llama`, made by
//! `scripts/make_tiny_llama.py` with `transformers`: grouped-query attention, an untied head)
//! loads into cellgraph's `Llama` and gives `transformers`' logits and loss, what cellgraph
//! saves loads back unchanged (tied heads stored once), `cellgraph finetune` trains it, and
//! settings cellgraph's Llama has not got are errors naming the key.

use std::path::Path;

use cellgraph::prelude::*;
use cellgraph::runtime::hf::{self, LoadOptions, ModelConfig};
use serde_json::Value as Json;

use crate::common::TmpDir;
use crate::hf::{assert_logits_match, cellgraph, field, run, shakespeare_text};

const TINY: &str = "tests/assets/tiny-llama";

fn llama(m: &hf::Loaded) -> LlamaConfig {
    match m.config {
        ModelConfig::Llama(c) => c,
        other => panic!("{} is not a Llama: {other:?}", m.dir.display()),
    }
}

fn reference() -> Json {
    serde_json::from_str(&std::fs::read_to_string(Path::new(TINY).join("reference.json")).unwrap()).unwrap()
}

/// The tiny Llama's logits at three positions of a 64-token sequence and its mean loss over
/// the 63 next-token predictions equal `transformers`' (float32, eval mode) within 1e-5,
/// relative to the largest logit and to the loss: RMSNorm, the rotary tables, grouped-query
/// attention, the gated SiLU MLP and the untied head as transformers computes them.
#[test]
fn the_tiny_llama_gives_transformers_logits_and_loss() {
    let r = reference();
    let m = hf::load(Path::new(TINY), &LoadOptions::default()).unwrap();
    let c = llama(&m);
    assert!(m.report.is_clean(), "{}", m.report);
    assert_eq!((c.layers, c.heads, c.kv_heads, c.head_dim, c.width, c.intermediate, c.context), (2, 4, 2, 16, 64, 160, 128));
    assert!(!c.tie_embeddings && c.rope_theta == 10000.0 && c.rms_norm_eps == 1e-6, "{c:?}");
    let seq: Vec<i32> = r["sequence"]["ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect();
    let net = Llama::new(&Scope::root(), c).unwrap();
    let logits = run(&net, &m.params, &[("ids", HostTensor::i32(vec![1, 64], seq.clone()).unwrap())]);
    assert_logits_match(&logits, &r["sequence"], c.vocab_size);
    let with_loss = WithLossCell::new(Llama::new(&Scope::root(), c).unwrap(), CrossEntropyLoss::new());
    let inputs =
        [("ids", HostTensor::i32(vec![1, 63], seq[..63].to_vec()).unwrap()), ("labels", HostTensor::i32(vec![1, 63], seq[1..].to_vec()).unwrap())];
    let loss = run(&with_loss, &m.params, &inputs)[0];
    let want = r["sequence"]["loss"].as_f64().unwrap();
    eprintln!("loss {loss} against transformers' {want}");
    assert!((loss - want).abs() <= 1e-5 * want, "loss {loss} vs transformers' {want}");
}

/// The tensor names of a safetensors file, sorted.
fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let mut names: Vec<String> = safetensors::SafeTensors::deserialize(&bytes).unwrap().names().into_iter().map(String::from).collect();
    names.sort();
    names
}

/// Saved, the tiny Llama is transformers' file again: the same tensor names (no rotary
/// buffer), each tensor's bytes equal, the config's keys kept; loaded back, every parameter has
/// the same bits. Tied (`tie_word_embeddings`), the head is stored once, as the table, and a
/// separate head that differs from the table is named.
#[test]
fn a_saved_llama_loads_back_bit_for_bit_tied_or_not() {
    let dir = TmpDir::created("llama-save");
    let m = hf::load(Path::new(TINY), &LoadOptions::default()).unwrap();
    let out = dir.join("saved");
    hf::save(&out, &m.config, &m.hf_config, &m.params, Some(&m.dir)).unwrap();
    assert_eq!(tensor_names(&out.join("model.safetensors")), tensor_names(&Path::new(TINY).join("model.safetensors")));
    let (theirs, ours) = (std::fs::read(Path::new(TINY).join("model.safetensors")).unwrap(), std::fs::read(out.join("model.safetensors")).unwrap());
    let (theirs, ours) = (safetensors::SafeTensors::deserialize(&theirs).unwrap(), safetensors::SafeTensors::deserialize(&ours).unwrap());
    for name in theirs.names() {
        assert_eq!(theirs.tensor(name).unwrap().data(), ours.tensor(name).unwrap().data(), "{name}");
    }
    let back = hf::load(&out, &LoadOptions::default()).unwrap();
    assert_eq!(back.config, m.config);
    assert_eq!(back.params, m.params);
    assert!(m.hf_config.keys().all(|k| back.hf_config.contains_key(k)) && out.join("tokenizer.json").is_file());

    // Tied: the table serves as the head, which is not stored.
    let tied = ModelConfig::Llama(LlamaConfig { tie_embeddings: true, ..llama(&m) });
    let mut params = m.params.clone();
    params.remove("lm_head.weight").unwrap();
    let out = dir.join("tied");
    hf::save(&out, &tied, &m.hf_config, &params, Some(&m.dir)).unwrap();
    let names = tensor_names(&out.join("model.safetensors"));
    assert!(!names.contains(&"lm_head.weight".to_string()) && names.contains(&"model.embed_tokens.weight".to_string()), "{names:?}");
    let back = hf::load(&out, &LoadOptions::default()).unwrap();
    assert!(matches!(back.config, ModelConfig::Llama(c) if c.tie_embeddings) && back.params == params);
    // The untied file read as tied: its own lm_head is not the table.
    let config: Json = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    std::fs::copy(Path::new(TINY).join("model.safetensors"), out.join("model.safetensors")).unwrap();
    std::fs::write(out.join("config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    let e = hf::load(&out, &LoadOptions::default()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("lm_head.weight (not tied to model.embed_tokens.weight"), "{e}");
}

/// Llama settings cellgraph's Llama has not got are errors naming the key; the older
/// `rope_theta` form of transformers 4 is read as transformers 5's `rope_parameters`.
#[test]
fn llama_settings_it_has_not_got_are_named() {
    let dir = TmpDir::created("llama-bad");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(Path::new(TINY).join(f), dir.join(f)).unwrap();
    }
    let config: Json = serde_json::from_str(&std::fs::read_to_string(Path::new(TINY).join("config.json")).unwrap()).unwrap();
    let load = |edit: &dyn Fn(&mut serde_json::Map<String, Json>)| {
        let mut c = config.as_object().unwrap().clone();
        edit(&mut c);
        std::fs::write(dir.join("config.json"), serde_json::to_string(&c).unwrap()).unwrap();
        hf::load(&dir, &LoadOptions::default())
    };
    let err = |edit: &dyn Fn(&mut serde_json::Map<String, Json>)| load(edit).map(|_| ()).unwrap_err().to_string();
    let e = err(&|c| {
        c.insert("rope_parameters".into(), serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}));
    });
    assert!(e.contains("rope type `llama3`") && e.contains("config.json"), "{e}");
    let e = err(&|c| {
        c.remove("rope_parameters");
        c.insert("rope_scaling".into(), serde_json::json!({"type": "linear", "factor": 2.0}));
    });
    assert!(e.contains("`rope_scaling` has rope type `linear`"), "{e}");
    assert!(err(&|c| {
        c.insert("hidden_act".into(), Json::from("gelu"));
    })
    .contains("hidden_act `gelu`"));
    assert!(err(&|c| {
        c.insert("attention_bias".into(), Json::from(true));
    })
    .contains("`attention_bias: true`"));
    assert!(err(&|c| {
        c.insert("num_key_value_heads".into(), Json::from(3));
    })
    .contains("4 query heads cannot be shared out among 3 key/value heads"));
    assert!(err(&|c| {
        c.insert("num_key_value_heads".into(), Json::from(4));
    })
    .contains("k_proj.weight is [32, 64], the config gives [64, 64]"));
    // transformers 4's keys: rope_theta at the top, no rope_parameters.
    let m = load(&|c| {
        c.remove("rope_parameters");
        c.insert("rope_theta".into(), Json::from(10000.0));
        c.insert("rope_scaling".into(), Json::Null);
    })
    .unwrap();
    assert_eq!(m.config, hf::load(Path::new(TINY), &LoadOptions::default()).unwrap().config);
}

/// `cellgraph finetune` on the tiny Llama as a user runs it: the held-out loss lower after 8
/// updates, every trained tensor changed, a saved directory that loads back with the same
/// shape, and the class transformers loads it with named.
#[test]
fn finetune_trains_the_tiny_llama_and_saves_it_back() {
    let dir = TmpDir::created("llama-finetune");
    let text = shakespeare_text(&dir, 40_000);
    let out = dir.join("tuned");
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
        "--lr",
        "1e-3",
        "--sample-tokens",
        "5",
        "--device",
        "cpu",
    ];
    let (code, stdout, stderr) = cellgraph(&args);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let line = |start: &str| stdout.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no `{start}` line in:\n{stdout}"));
    let (before, after) = (line("before:"), line("epoch: 1 {"));
    assert!(field(after, "'Loss'") < field(before, "'Loss'"), "{before} then {after}");
    assert!(line("saved").contains("LlamaForCausalLM.from_pretrained") && line("sample:").contains("->"), "{stdout}");
    let (base, tuned) = (hf::load(Path::new(TINY), &LoadOptions::default()).unwrap(), hf::load(&out, &LoadOptions::default()).unwrap());
    assert_eq!(tuned.config, base.config);
    for (n, t) in &tuned.params {
        let trained = !n.starts_with("rotary_emb.");
        assert_eq!(t.to_f32() != base.params[n].to_f32(), trained, "{n}: trained {trained}");
    }
}

/// `cellgraph finetune` on the tiny Llama on a device (lavapipe): the loss lines and held-out
/// losses of the CPU's run within 1e-5, and `--graphs` the op-by-op run's saved model byte for
/// byte with its window captured and replayed (its rotary slices and concatenations and its
/// grouped-query broadcast on the device's strided copies, in the plan's arena: on burn's ops
/// they kept the window from being captured).
#[cfg(feature = "wgpu")]
#[test]
fn finetune_on_a_device_gives_the_cpus_losses() {
    let dir = TmpDir::created("llama-device");
    let text = shakespeare_text(&dir, 20_000);
    let run = |name: &str, device: &str, graphs: bool| {
        let out = dir.join(name);
        let mut args = vec!["finetune", "--model", TINY, "--data", text.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(["--steps", "3", "--block-size", "32", "--lr", "1e-3", "--print-every", "1", "--sample-tokens", "0", "--eval-items", "4"]);
        args.extend(["--device", device]);
        if graphs {
            args.push("--graphs");
        }
        let (code, stdout, stderr) = cellgraph(&args);
        assert_eq!(code, Some(0), "{stdout}\n{stderr}");
        let losses: Vec<f64> = stdout
            .lines()
            .filter_map(|l| {
                l.split_once("loss is ").map(|(_, v)| v.trim().parse().unwrap()).or_else(|| l.contains("'Loss'").then(|| field(l, "'Loss'")))
            })
            .collect();
        (losses, std::fs::read(out.join("model.safetensors")).unwrap(), stdout)
    };
    let (cpu, device, replayed) = (run("cpu", "cpu", false), run("wgpu", "wgpu", false), run("graphs", "wgpu", true));
    assert_eq!(cpu.0.len(), 3 + 2, "{}", cpu.2);
    assert_eq!(cpu.0.len(), device.0.len(), "{}", device.2);
    for (c, d) in cpu.0.iter().zip(&device.0) {
        assert!((c - d).abs() <= 1e-5 * c.abs(), "cpu {c} vs wgpu {d}\n{}\n{}", cpu.2, device.2);
    }
    if device.1 != replayed.1 {
        let load = |name: &str| hf::load(&dir.join(name), &LoadOptions::default()).unwrap().params;
        let (launched, graphs) = (load("wgpu"), load("graphs"));
        let differ: Vec<String> = launched
            .iter()
            .filter_map(|(n, t)| {
                let (a, b) = (t.to_f32(), graphs[n].to_f32());
                let k = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                (k > 0).then(|| format!("{n} ({k} of {})", a.len()))
            })
            .collect();
        panic!("--graphs changed the saved model: {}\nop by op:\n{}\nreplayed:\n{}", differ.join(", "), device.2, replayed.2);
    }
    let line = replayed.2.lines().find(|l| l.starts_with("graph replay: ")).unwrap_or_else(|| panic!("{}", replayed.2));
    // `{captured} captured, {replayed} replayed ({windows} of them whole windows, ...), {warm-ups}
    // op by op while warming up, {uncaptured} op by op (not capturable)`.
    let n: Vec<usize> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|t| t.parse().ok()).collect();
    let [captured, replays, _, _, uncaptured] = n[..] else { panic!("{line}") };
    assert!(captured >= 1 && replays >= 1 && uncaptured == 0, "{}", replayed.2);
    assert!(!replayed.2.contains("not captured:"), "{}", replayed.2);
}

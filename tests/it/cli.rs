//! `cellgraph` as a user drives it: `train` with accumulation, checkpoints, resuming and a loss
//! log; `eval`; `plot`; and bad arguments refused with a sentence before anything trains.
//! Runs use a small MNIST directory (256 training and 64 test digits from `data/mnist`).

use std::path::Path;
use std::process::Command;

use cellgraph::prelude::*;

use crate::common::{mnist_dir, TmpDir};

const CELLGRAPH: &str = env!("CARGO_BIN_EXE_cellgraph");

fn tmp(name: &str) -> TmpDir {
    TmpDir::created(&format!("cli-{name}"))
}

/// Runs `cellgraph ARGS`: (exit code, stdout, stderr).
fn cellgraph(args: &[&str]) -> (Option<i32>, String, String) {
    let o = Command::new(CELLGRAPH).args(args).output().unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Runs `cellgraph ARGS` and fails unless it succeeded; returns stdout.
fn ok(args: &[&str]) -> String {
    let (code, out, err) = cellgraph(args);
    assert_eq!(code, Some(0), "cellgraph {args:?} failed:\n{out}\n{err}");
    out
}

/// Fails unless `cellgraph ARGS` exits non-zero with an `error: ...` sentence containing `want`
/// (no panic, no Debug output).
fn refused(args: &[&str], want: &str) {
    let (code, out, err) = cellgraph(args);
    assert!(code.is_some_and(|c| c != 0), "cellgraph {args:?} should fail:\n{out}\n{err}");
    assert!(err.contains("error: ") && err.contains(want), "cellgraph {args:?}: expected `{want}` in:\n{err}");
    assert!(
        !err.contains("panicked") && !err.contains("Error: ") && !err.contains(" { "),
        "cellgraph {args:?} printed a panic or Debug output:\n{err}"
    );
}

/// The first `n` digits of each split of `data/mnist`, as uncompressed IDX files in `dir`.
fn small_mnist(dir: &Path, train: usize, test: usize) {
    for (split, n) in [("train", train), ("t10k", test)] {
        let m = Mnist::load(&mnist_dir(), split).unwrap();
        let idx = |magic: u8, dims: &[usize], data: &[u8]| {
            let mut v = vec![0, 0, 8, magic];
            dims.iter().for_each(|&d| v.extend((d as u32).to_be_bytes()));
            v.extend(data);
            v
        };
        let px = m.rows * m.cols;
        std::fs::write(dir.join(format!("{split}-images-idx3-ubyte")), idx(3, &[n, m.rows, m.cols], &m.images[..n * px])).unwrap();
        std::fs::write(dir.join(format!("{split}-labels-idx1-ubyte")), idx(1, &[n], &m.labels[..n])).unwrap();
    }
}

/// The JSON lines of a log.
fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// `{'Accuracy': X}` -> X.
fn accuracy(out: &str) -> f64 {
    let line = out.lines().find(|l| l.contains("{'Accuracy': ")).unwrap_or_else(|| panic!("no accuracy in:\n{out}"));
    let x = line.split("{'Accuracy': ").nth(1).unwrap().trim_end_matches('}');
    x.parse().unwrap_or_else(|_| panic!("{line}"))
}

#[test]
fn train_accumulates_logs_checkpoints_resumes_and_evaluates() {
    let dir = tmp("train");
    small_mnist(&dir, 256, 64);
    let data = dir.to_str().unwrap();
    let (ckpt, log) = (dir.join("lenet.ckpt"), dir.join("loss.jsonl"));
    let (ckpt_s, log_s) = (ckpt.to_str().unwrap(), log.to_str().unwrap());
    let base = ["train", "--data-path", data, "--device", "cpu", "--print-every", "2"];
    // Epoch 1 of 8 batches of 32, each sliced into 4 micro-batches: 8 updates.
    let out = ok(&[&base[..], &["--micro-size", "4", "--ckpt", ckpt_s, "--loss-log", log_s, "--eval-each-epoch"]].concat());
    assert!(out.contains("epoch: 1 step: 2, loss is ") && out.contains("epoch: 1 step: 8, loss is "), "{out}");
    assert!(out.contains("Train epoch time: ") && out.contains("trained 8 steps, 8 optimizer updates"), "{out}");
    let acc = accuracy(&out);
    assert!((0.0..=1.0).contains(&acc), "{out}");
    let rows = lines(&log);
    assert_eq!(rows.len(), 9, "8 steps and one accuracy line");
    assert_eq!((&rows[7]["epoch"], &rows[7]["step"], &rows[7]["updates"]), (&1.into(), &8.into(), &8.into()));
    assert!(rows[7]["loss"].as_f64().unwrap() > 0.0 && rows[8]["accuracy"].as_f64() == Some(acc), "{rows:?}");
    assert!(ckpt.is_file());

    // Resume: epoch 2 continues from the checkpoint, the log continues where it was.
    let out = ok(&[&base[..], &["--resume", ckpt_s, "--epochs", "2", "--ckpt", ckpt_s, "--loss-log", log_s]].concat());
    assert!(out.contains(&format!("resumed from {ckpt_s} after epoch 1 (8 updates)")), "{out}");
    assert!(out.contains("epoch: 2 step: 7, loss is ") && !out.contains("epoch: 1 step"), "{out}");
    let rows = lines(&log);
    assert_eq!((rows.len(), &rows[16]["epoch"], &rows[16]["updates"]), (17, &2.into(), &16.into()));
    // Both epochs are done: asking for no more is refused.
    refused(&[&base[..], &["--resume", ckpt_s, "--epochs", "2"]].concat(), "--epochs 3 or more");

    // The checkpoint scores as the trained network; not as another one.
    let out = ok(&["eval", "--data-path", data, "--device", "cpu", "--ckpt", ckpt_s]);
    assert!(out.trim().starts_with("{'Accuracy': ") && (0.0..=1.0).contains(&accuracy(&out)), "{out}");
    refused(&["eval", "--data-path", data, "--net", "mlp", "--ckpt", ckpt_s], "not a checkpoint of --net mlp");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn steps_stop_mid_epoch_and_resume_continues_there() {
    let dir = tmp("steps");
    small_mnist(&dir, 256, 64);
    let data = dir.to_str().unwrap();
    let (ckpt, log) = (dir.join("mlp.safetensors"), dir.join("loss.jsonl"));
    let (ckpt_s, log_s) = (ckpt.to_str().unwrap(), log.to_str().unwrap());
    // Across steps: one update every 4 of the 8 batches.
    let base = [
        "train",
        "--net",
        "mlp",
        "--data-path",
        data,
        "--device",
        "cpu",
        "--accumulation",
        "across-steps",
        "--micro-size",
        "4",
        "--print-every",
        "1",
    ];
    let out = ok(&[&base[..], &["--steps", "3", "--ckpt", ckpt_s, "--loss-log", log_s]].concat());
    assert!(out.contains("epoch: 1 step: 3, loss is ") && !out.contains("step: 4,") && out.contains("trained 3 steps, 0 optimizer updates"), "{out}");
    let out = ok(&[&base[..], &["--resume", ckpt_s, "--loss-log", log_s]].concat());
    assert!(out.contains("at epoch 1 step 3 (0 updates)") && out.contains("epoch: 1 step: 4, loss is ") && !out.contains("step: 3,"), "{out}");
    let updates: Vec<u64> = lines(&log).iter().map(|r| r["updates"].as_u64().unwrap()).collect();
    assert_eq!(updates, [0, 0, 0, 1, 1, 1, 1, 2], "a window applies every 4 steps");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The contents of an SVG's `<text>` elements, trimmed.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text").skip(1).filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_string())).collect()
}

/// `--graphs` on a device: the same loss lines as without (LeNet5, 4 steps of 4 micro-batches
/// on lavapipe), and a closing line saying the window was captured and replayed, each window
/// in one replay; the CPU refuses it before anything trains.
#[cfg(feature = "wgpu")]
#[test]
fn graphs_replay_the_window_with_the_same_losses() {
    let dir = tmp("graphs");
    small_mnist(&dir, 256, 64);
    let data = dir.to_str().unwrap();
    let base = ["train", "--data-path", data, "--device", "wgpu", "--micro-size", "4", "--steps", "4", "--print-every", "1"];
    let losses = |out: &str| out.lines().filter(|l| l.contains("loss is")).map(str::to_string).collect::<Vec<_>>();
    let eager = ok(&base);
    let replayed = ok(&[&base[..], &["--graphs"]].concat());
    assert_eq!(losses(&eager).len(), 4, "{eager}");
    assert_eq!(losses(&eager), losses(&replayed), "{eager}\n{replayed}");
    assert!(!eager.contains("graph replay"), "{eager}");
    // 4 windows of 4 micro-steps (in-step, the default): two op by op, then each window one
    // replay (a capture retried by timing moves one over).
    let line = replayed.lines().find(|l| l.starts_with("graph replay: ")).unwrap_or_else(|| panic!("{replayed}"));
    let ok_line = ["graph replay: 1 captured, 2 replayed (2 of them whole windows", "graph replay: 1 captured, 1 replayed (1 of them whole windows"]
        .iter()
        .any(|p| line.starts_with(p));
    assert!(ok_line && line.ends_with(", 0 op by op (not capturable)"), "{line}");
    refused(&["train", "--data-path", data, "--device", "cpu", "--graphs"], "has no graphs to capture");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--precision bf16` on a device says where its products ran: every product of LeNet5's
/// micro-step (its convolutions included) on tensor cores, none in f32, and, on lavapipe,
/// which has no tensor-core kernel, how many ran in exact f32 instead.
#[cfg(feature = "wgpu")]
#[test]
fn bf16_on_a_device_says_where_its_products_run() {
    let dir = tmp("bf16_device");
    small_mnist(&dir, 256, 64);
    let data = dir.to_str().unwrap();
    let out = ok(&["train", "--data-path", data, "--device", "wgpu", "--precision", "bf16", "--micro-size", "2", "--steps", "2"]);
    let line = out.lines().find(|l| l.starts_with("bf16 products: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains(" on tensor cores (TF32 operands, exact for bf16 values), 0 in f32"), "{line}");
    let fallbacks = out.lines().find(|l| l.starts_with("tensor-core products run in exact f32")).unwrap_or_else(|| panic!("{out}"));
    assert!(fallbacks.contains("of them convolutions"), "{fallbacks}");
    // cubecl's wgpu compiler has no bf16: the values stay f32, and the line says why.
    let storage = out.lines().find(|l| l.starts_with("bf16 storage: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(storage.starts_with("bf16 storage: 0 values in bf16") && storage.contains("no bf16 kernels on this device"), "{storage}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--precision bf16` on the CPU says which unit multiplies its products of bf16 values: AMX
/// tiles where the core has AMX-BF16 (and Linux grants the tiles), else the AVX-512 BF16
/// pairs where they beat the f32 GEMM (not on Intel's cores), else the emulation, saying why;
/// `CELLGRAPH_AMX=0 CELLGRAPH_BF16_PAIRS=1` the pairs wherever the CPU has them, `=0` the
/// emulation. LeNet5's im2col convolutions and dense layers run there, its direct first
/// convolution in f32. The kernels' runs sum in another order, so their losses are close and
/// their checkpoints differ (the weight gradients are summed into f32 accumulators unrounded;
/// the losses, made from values rounded to bf16, can agree to the last bit over four steps);
/// a default run that chose the emulation has its bits.
#[test]
fn bf16_on_the_cpu_says_which_unit_multiplies() {
    let dir = tmp("bf16_cpu");
    small_mnist(&dir, 256, 64);
    let data = dir.to_str().unwrap();
    let run = |env: &[(&str, &str)], log: &Path| {
        let args = ["train", "--data-path", data, "--device", "cpu", "--precision", "bf16", "--micro-size", "2", "--steps", "4"];
        let ckpt = log.with_extension("safetensors");
        let o = Command::new(CELLGRAPH)
            .args(args)
            .args(["--loss-log", log.to_str().unwrap(), "--ckpt", ckpt.to_str().unwrap()])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(o.status.code(), Some(0), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
        out.lines().find(|l| l.starts_with("bf16 products: ")).unwrap_or_else(|| panic!("{out}")).to_string()
    };
    let (chosen, pairs, refused) = (dir.join("default.jsonl"), dir.join("pairs.jsonl"), dir.join("f32.jsonl"));
    let by_default = run(&[("CELLGRAPH_AMX", "1")], &chosen);
    let on_pairs = run(&[("CELLGRAPH_AMX", "0"), ("CELLGRAPH_BF16_PAIRS", "1")], &pairs);
    let in_f32 = run(&[("CELLGRAPH_AMX", "0"), ("CELLGRAPH_BF16_PAIRS", "0")], &refused);
    use cellgraph::runtime::host::{bf16, bf16_on_amx};
    let (has_pairs, has_amx, pays) = (bf16::available(), bf16_on_amx(), bf16::pays());
    if has_amx {
        assert!(by_default.contains(" on AMX tiles, "), "{by_default}");
    } else if pays {
        assert!(by_default.contains(" on AVX-512 BF16 pairs, ") && !by_default.starts_with("bf16 products: 0 "), "{by_default}");
    } else {
        let why = bf16::declined().expect("a CPU whose pairs do not pay says why");
        assert!(by_default.starts_with("bf16 products: 0 ") && by_default.ends_with(&format!("(f32 emulation: {why})")), "{by_default}");
    }
    if has_pairs {
        assert!(on_pairs.contains(" on AVX-512 BF16 pairs, ") && !on_pairs.starts_with("bf16 products: 0 "), "{on_pairs}");
    } else {
        assert!(on_pairs.ends_with("(f32 emulation: this CPU has no AVX-512 BF16)"), "{on_pairs}");
    }
    let refusal = if has_pairs { "CELLGRAPH_BF16_PAIRS=0 refuses the AVX-512 BF16 pairs" } else { "this CPU has no AVX-512 BF16" };
    assert!(in_f32.starts_with("bf16 products: 0 ") && in_f32.ends_with(&format!("(f32 emulation: {refusal})")), "{in_f32}");
    let losses = |p: &Path| -> Vec<f64> { lines(p).iter().filter_map(|l| l["loss"].as_f64()).collect() };
    let (a, b, c) = (losses(&chosen), losses(&pairs), losses(&refused));
    assert!(a.len() == 4 && b.len() == 4 && c.len() == 4, "{a:?} {b:?} {c:?}");
    for (x, y) in a.iter().chain(&b).zip(c.iter().chain(&c)) {
        assert!(((x - y) / y).abs() < 1e-2, "losses {a:?} (default unit) and {b:?} (pairs) against {c:?} (f32)");
    }
    let read = |p: &Path| std::fs::read(p.with_extension("safetensors")).unwrap();
    if has_pairs {
        assert!(read(&pairs) != read(&refused), "bf16 pairs and the f32 emulation trained the same parameters: the pairs did not run");
    }
    if has_amx {
        assert!(read(&chosen) != read(&pairs), "AMX tiles and bf16 pairs trained the same parameters: one kernel ran both");
    } else if !pays {
        assert!(read(&chosen) == read(&refused), "a default run that chose the f32 emulation trained other parameters than it");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--precision f16` on a device stores the MLP's values in f16 (its every low-precision value:
/// products, their epilogues, the loss's logits) and says so, with a smaller peak; with
/// `--f32-storage` nothing, saying why; the two runs log the same losses.
#[cfg(feature = "wgpu")]
#[test]
fn f16_on_a_device_says_what_it_stores_in_f16() {
    let dir = tmp("f16_device");
    small_mnist(&dir, 256, 64);
    let data = dir.to_str().unwrap();
    let args = ["train", "--data-path", data, "--net", "mlp", "--device", "wgpu", "--precision", "f16", "--micro-size", "2", "--steps", "4"];
    let (log_low, log_f32) = (dir.join("low.jsonl"), dir.join("f32.jsonl"));
    let low = ok(&[&args[..], &["--loss-log", log_low.to_str().unwrap()]].concat());
    let f32s = ok(&[&args[..], &["--f32-storage", "--loss-log", log_f32.to_str().unwrap()]].concat());
    let line = |out: &str| out.lines().find(|l| l.starts_with("f16 storage: ")).unwrap_or_else(|| panic!("{out}")).to_string();
    let (on, off) = (line(&low), line(&f32s));
    assert!(!on.starts_with("f16 storage: 0 values") && on.contains(", 0 in f32 (0.00 MiB)"), "{on}");
    let peak = |l: &str| -> (f64, f64) {
        let p = l.split("; peak ").nth(1).unwrap_or_else(|| panic!("{l}"));
        let mut n = p.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter(|t| !t.is_empty()).map(|t| t.parse::<f64>().unwrap());
        (n.next().unwrap(), n.next().unwrap())
    };
    let (with, without) = peak(&on);
    assert!(with < without, "{on}");
    assert!(off.starts_with("f16 storage: 0 values in f16") && off.contains("low-precision storage off"), "{off}");
    let (a, b) = (std::fs::read_to_string(&log_low).unwrap(), std::fs::read_to_string(&log_f32).unwrap());
    assert_eq!(a.lines().count(), 4, "{a}");
    assert_eq!(a, b, "the losses with f16 storage differ from f32 storage's");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plot_draws_the_loss_curve_and_accuracy_as_svg() {
    let dir = tmp("plot");
    let log = dir.join("run.jsonl");
    let mut text: String =
        (1..=20).map(|s| format!("{{\"epoch\": {}, \"step\": {s}, \"updates\": {s}, \"loss\": {}}}\n", 1 + s / 11, 2.3 / s as f64)).collect();
    text.push_str("{\"epoch\": 1, \"updates\": 10, \"accuracy\": 0.5}\n{\"epoch\": 2, \"updates\": 20, \"accuracy\": 0.75}\n");
    std::fs::write(&log, text).unwrap();
    let svg = dir.join("loss.svg");
    let out = ok(&["plot", log.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(out.contains("wrote") && out.contains("20 steps"), "{out}");
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"), "{}", &s[..200.min(s.len())]);
    assert!(s.contains("<polyline") || s.contains("<path"), "a curve");
    let texts = svg_texts(&s);
    for want in ["run.jsonl: training loss and test accuracy", "training step", "loss", "test accuracy"] {
        assert!(texts.iter().any(|t| t == want), "`{want}` is not among the texts: {texts:?}");
    }

    refused(&["plot", log.to_str().unwrap(), "-o", dir.join("loss.png").to_str().unwrap()], "writes SVG");
    std::fs::write(&log, "{\"loss\": 1.0}\nnot json\n").unwrap();
    refused(&["plot", log.to_str().unwrap(), "-o", svg.to_str().unwrap()], "run.jsonl:2: not a JSON line");
    std::fs::write(&log, "").unwrap();
    refused(&["plot", log.to_str().unwrap(), "-o", svg.to_str().unwrap()], "no loss in it");
    refused(&["plot", dir.join("missing.jsonl").to_str().unwrap(), "-o", svg.to_str().unwrap()], "missing.jsonl");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `cellgraph train` covers every workload with its sample's recipe: ResNet-18 on the MNIST
/// digits as 3 x 32 x 32 images (here in bf16), scored by accuracy; the GPT on a slice of the
/// vendored Shakespeare, token-weighted, scored by the held-out loss per character; each
/// checkpoint scores again with `eval`, and not as another network.
#[test]
fn train_covers_resnet18_and_the_gpt() {
    let dir = tmp("nets");
    small_mnist(&dir, 16, 8);
    let data = dir.to_str().unwrap();
    let ckpt = dir.join("resnet.ckpt");
    let out = ok(&[
        "train",
        "--net",
        "resnet18",
        "--data-path",
        data,
        "--device",
        "cpu",
        "--batch-size",
        "8",
        "--print-every",
        "1",
        "--precision",
        "bf16",
        "--eval-each-epoch",
        "--ckpt",
        ckpt.to_str().unwrap(),
    ]);
    assert!(out.contains("the MNIST digits in") && out.contains("epoch: 1 step: 2, loss is "), "{out}");
    assert!(out.contains("trained 2 steps, 2 optimizer updates") && out.contains(" images/s)"), "{out}");
    assert!(out.contains("bf16 products: "), "{out}");
    assert!((0.0..=1.0).contains(&accuracy(&out)), "{out}");
    // --tf32 on the CPU: said to change nothing, not taken silently.
    let (code, out, err) =
        cellgraph(&["train", "--net", "lenet", "--data-path", data, "--device", "cpu", "--batch-size", "8", "--steps", "1", "--tf32"]);
    assert!(code == Some(0) && err.contains("--tf32: the CPU has no TF32") && out.contains("trained 1 steps"), "{out}\n{err}");
    let out = ok(&["eval", "--net", "resnet18", "--data-path", data, "--device", "cpu", "--ckpt", ckpt.to_str().unwrap()]);
    assert!((0.0..=1.0).contains(&accuracy(&out)), "{out}");

    // 60,000 characters of the play: 418 windows of 129 to train on, 47 held out.
    let text = cellgraph::runtime::data::Corpus::load(Path::new("data/shakespeare/shakespeare.txt.gz")).unwrap().text;
    let corpus = dir.join("shakespeare.txt");
    std::fs::write(&corpus, &text[..60_000]).unwrap();
    let (corpus, gpt) = (corpus.to_str().unwrap(), dir.join("gpt.ckpt"));
    let base = ["train", "--net", "gpt", "--data-path", corpus, "--device", "cpu", "--batch-size", "8", "--print-every", "1"];
    let out = ok(&[&base[..], &["--steps", "3", "--ckpt", gpt.to_str().unwrap()]].concat());
    assert!(out.contains("epoch: 1 step: 3, loss is ") && out.contains("trained 3 steps, 3 optimizer updates"), "{out}");
    assert!(out.contains(" sequences/s, ") && out.contains(" tokens/s)"), "{out}");
    // f16: the token-summed loss's scale starts where a mean loss's 2^16 would, 2^16 over the
    // window's 1,024 tokens (from 2^16 itself the first windows overflow, each halving it);
    // the summary says what was skipped, the log has the scale after each step.
    let log = dir.join("f16.jsonl");
    let out = ok(&[&base[..], &["--steps", "2", "--precision", "f16", "--loss-log", log.to_str().unwrap()]].concat());
    let line = out.lines().find(|l| l.starts_with("f16 loss scaling: ")).unwrap_or_else(|| panic!("no loss scaling in:\n{out}"));
    let skipped: u64 = line["f16 loss scaling: ".len()..].split(' ').next().unwrap().parse().unwrap();
    let now: f64 = line.rsplit("loss scale now ").next().unwrap().parse().unwrap();
    assert!(line.contains(" of 2 windows skipped") && now == 64.0 / f64::from(1 << skipped), "{out}");
    assert!(out.contains(&format!("trained 2 steps, {} optimizer updates", 2 - skipped)), "{out}");
    let scales: Vec<f64> = lines(&log).iter().map(|l| l["loss_scale"].as_f64().unwrap()).collect();
    assert_eq!(scales.last(), Some(&now), "{scales:?}");
    // Across steps (and boost, across steps too) a window is --micro-size batches: 2 x 8 x 128
    // tokens, from 32; a normalization other than tokens still sums the GPT's loss over them.
    for extra in
        [&["--accumulation", "across-steps"][..], &["--accumulation", "boost"], &["--accumulation", "across-steps", "--normalization", "mean"]]
    {
        let out = ok(&[&base[..], &["--steps", "4", "--micro-size", "2", "--precision", "f16"], extra].concat());
        let line = out.lines().find(|l| l.starts_with("f16 loss scaling: ")).unwrap_or_else(|| panic!("{extra:?}: no loss scaling in:\n{out}"));
        let skipped: u32 = line["f16 loss scaling: ".len()..].split(' ').next().unwrap().parse().unwrap();
        let now: f64 = line.rsplit("loss scale now ").next().unwrap().parse().unwrap();
        assert!(line.contains(" of 2 windows skipped") && now * f64::from(1u32 << skipped) == 32.0, "{extra:?}: {out}");
    }
    let loss = |out: &str| -> f64 {
        let line = out.lines().find(|l| l.contains("{'Loss': ")).unwrap_or_else(|| panic!("no loss in:\n{out}"));
        line.split("{'Loss': ").nth(1).unwrap().trim_end_matches('}').parse().unwrap()
    };
    let out = ok(&["eval", "--net", "gpt", "--data-path", corpus, "--device", "cpu", "--ckpt", gpt.to_str().unwrap()]);
    // A loss per character, below a uniform guess over the full play's 84 characters (4.43 nats).
    let l = loss(&out);
    assert!(l > 0.0 && l < 4.43, "{out}");
    refused(
        &["eval", "--net", "resnet18", "--data-path", data, "--ckpt", gpt.to_str().unwrap()],
        "was it written with another --net (lenet, mlp, gpt)?",
    );
    refused(&["train", "--net", "lenet", "--normalization", "tokens", "--data-path", data], "it is for --net gpt");
    // The text's directory given for the text: the error names the file to give.
    refused(
        &["train", "--net", "gpt", "--data-path", "data/shakespeare", "--device", "cpu"],
        "data/shakespeare: is a directory: give the text file itself (data/shakespeare/shakespeare.txt.gz)",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_are_refused_before_anything_trains() {
    let dir = tmp("bad");
    small_mnist(&dir, 40, 8);
    let data = dir.to_str().unwrap();
    let ckpt = dir.join("never.ckpt");
    let train = |extra: &[&str], want: &str| {
        refused(&[&["train", "--data-path", data, "--device", "cpu", "--ckpt", ckpt.to_str().unwrap()][..], extra].concat(), want);
    };
    train(&["--batch-size", "0"], "must be at least 1");
    train(&["--batch", "0"], "must be at least 1");
    train(&["--micro-size", "0"], "must be at least 1");
    train(&["--epochs", "0"], "must be at least 1");
    train(&["--steps", "0"], "must be at least 1");
    train(&["--lr", "-0.5"], "must be a finite number >= 0");
    train(&["--lr", "nan"], "must be a finite number >= 0");
    train(&["--lr", "fast"], "expected a number");
    train(&["--net", "resnet"], "possible values: lenet, mlp");
    train(&["--optimizer", "rmsprop"], "possible values: momentum, sgd, adam, adamw");
    train(&["--accumulation", "sometimes"], "in-step");
    train(&["--batch-size", "30"], "--batch-size 30 is not a multiple of --micro-size 4");
    train(&["--resume", dir.join("none.ckpt").to_str().unwrap()], "no such checkpoint file");
    // 40 images give one batch of 32 with LeNet's drop_remainder; 64 would be needed for a batch of 64.
    train(&["--batch-size", "64"], "gives no batch per epoch");
    refused(&["train", "--data-path", dir.join("nowhere").to_str().unwrap()], "the directory does not exist");
    refused(&["train", "--data-path", "data/shakespeare/shakespeare.txt.gz"], "that is a file, not a directory; pass the directory");
    refused(&["train", "--data-path", data, "--device", "tpu"], "expected cpu, cuda, cuda:N, wgpu or auto");
    refused(&["eval", "--data-path", data, "--ckpt", ckpt.to_str().unwrap()], "never.ckpt");
    assert!(!ckpt.exists(), "nothing trained, nothing saved");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A value of `CELLGRAPH_AMX` or `CELLGRAPH_BF16_PAIRS` other than `0` or `1` stops a run
/// before it trains, naming the variable, its value and the values it takes (it was read as
/// unset, without a word); `0` and `1` train.
#[test]
fn bad_unit_settings_are_refused_before_anything_trains() {
    let dir = tmp("bad_units");
    small_mnist(&dir, 40, 8);
    let ckpt = dir.join("never.ckpt");
    let args =
        ["train", "--data-path", dir.to_str().unwrap(), "--device", "cpu", "--precision", "bf16", "--steps", "1", "--ckpt", ckpt.to_str().unwrap()];
    let run = |var: &str, value: &str| {
        let o = Command::new(CELLGRAPH).args(args).env(var, value).output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    for (var, bad) in [("CELLGRAPH_BF16_PAIRS", "yes"), ("CELLGRAPH_AMX", "on"), ("CELLGRAPH_BF16_PAIRS", "")] {
        let (code, out, err) = run(var, bad);
        assert!(code.is_some_and(|c| c != 0), "{var}={bad} should fail:\n{out}\n{err}");
        assert!(err.contains(&format!("error: {var}={bad}: expected 1 (")) && err.contains("or 0 (never)"), "{var}={bad}:\n{err}");
        assert!(!err.contains("panicked") && !out.contains("trained "), "{var}={bad}:\n{out}\n{err}");
        assert!(!ckpt.exists(), "{var}={bad}: nothing trained, nothing saved");
    }
    for (var, good) in [("CELLGRAPH_BF16_PAIRS", "0"), ("CELLGRAPH_AMX", "1")] {
        let (code, out, err) = run(var, good);
        assert_eq!(code, Some(0), "{var}={good}:\n{out}\n{err}");
        assert!(out.contains("trained 1 steps"), "{var}={good}:\n{out}");
        std::fs::remove_file(&ckpt).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn help_names_every_option_and_its_default() {
    let out = ok(&["train", "--help"]);
    for flag in [
        "--net",
        "--accumulation",
        "--micro-size",
        "--normalization",
        "--optimizer",
        "--lr",
        "--epochs",
        "--batch-size",
        "--device",
        "--ckpt",
        "--resume",
        "--loss-log",
        "--eval-each-epoch",
        "--profile",
    ] {
        assert!(out.contains(flag), "{flag} missing from train --help:\n{out}");
    }
    assert!(out.contains("[default: lenet]") && out.contains("[default: in-step]") && out.contains("Momentum(0.01, 0.9)"), "{out}");
}

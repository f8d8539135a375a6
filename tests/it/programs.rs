//! The sample programs as a user runs them: bad arguments and bad files are errors printed as
//! sentences (never `Error: Io { .. }`, never a panic), and nothing that did no work exits 0.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::TmpDir;

/// An example program built by `cargo test` (target/<profile>/examples/NAME).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let p = profile.join("examples").join(name);
    assert!(p.is_file(), "{} is not built (cargo test builds the examples)", p.display());
    p
}

fn run(name: &str, args: &[&str]) -> (Output, String) {
    let out = Command::new(example(name)).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out, text)
}

/// Fails unless the program exited 1 with `error: ...` containing `want`, as a sentence.
fn refused(name: &str, args: &[&str], want: &str) {
    let (out, s) = run(name, args);
    assert_eq!(out.status.code(), Some(1), "{name} {args:?} should fail: {s}");
    assert!(s.contains("error: ") && s.contains(want), "{name} {args:?}: {s}");
    assert!(!s.contains("panicked") && !s.contains("Error: ") && !s.contains(" { "), "{name} {args:?} printed a panic or Debug output: {s}");
}

fn tmp(name: &str) -> TmpDir {
    TmpDir::created(&format!("programs-{name}"))
}

/// A tiny MNIST directory of `n` training and `n` test images (IDX, uncompressed).
fn tiny_mnist(dir: &Path, n: u32) {
    let idx = |magic: u8, dims: &[u32], data: Vec<u8>| {
        let mut v = vec![0, 0, 8, magic];
        dims.iter().for_each(|d| v.extend(d.to_be_bytes()));
        v.extend(data);
        v
    };
    for split in ["train", "t10k"] {
        std::fs::write(dir.join(format!("{split}-images-idx3-ubyte")), idx(3, &[n, 28, 28], vec![7; n as usize * 784])).unwrap();
        std::fs::write(dir.join(format!("{split}-labels-idx1-ubyte")), idx(1, &[n], (0..n).map(|i| (i % 10) as u8).collect())).unwrap();
    }
}

#[test]
fn the_tutorial_programs_refuse_what_would_do_nothing() {
    let dir = tmp("tutorial");
    let ckpt = dir.join("out.ckpt");
    let ckpt = ckpt.to_str().unwrap();
    refused("gradient_accumulation_train", &["--mini-steps", "0", "--ckpt", ckpt], "at least 1, got 0");
    refused("gradient_accumulation_train", &["--epochs", "0", "--ckpt", ckpt], "--epochs must be at least 1");
    refused("gradient_accumulation_train", &["--data-path", "no/such/dir", "--ckpt", ckpt], "--data-path");
    let tiny = dir.join("tiny");
    std::fs::create_dir_all(&tiny).unwrap();
    tiny_mnist(&tiny, 5);
    refused("gradient_accumulation_train", &["--data-path", tiny.to_str().unwrap(), "--ckpt", ckpt], "gives no batch per epoch");
    refused("gradient_accumulation_train", &["--ckpt", dir.to_str().unwrap()], "is a directory");
    assert!(!Path::new(ckpt).exists(), "nothing was trained, nothing saved");
    refused("train_and_eval_boost", &["--data-path", tiny.to_str().unwrap()], "gives no batch per epoch");
    // An empty or truncated checkpoint does not score as a network.
    let empty = dir.join("z.ckpt");
    std::fs::write(&empty, b"").unwrap();
    refused("gradient_accumulation_eval", &["--ckpt-path", empty.to_str().unwrap()], "empty");
    std::fs::write(&empty, b"\x0a\x2c\x0a\x01a").unwrap();
    refused("gradient_accumulation_eval", &["--ckpt-path", empty.to_str().unwrap()], "truncated");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_seed_002_program_refuses_bad_settings_before_training_and_logs_why() {
    const BIN: &str = env!("CARGO_BIN_EXE_distributed_gradient_accumulation");
    let dir = tmp("seed002");
    for (args, want) in [
        (&["--lr", "-0.5"][..], "SGD: learning rate must be a finite number >= 0, got -0.5"),
        (&["--lr", "inf"], "got inf"),
        (&["--batch-size", "9000"], "holds 8000 items, fewer than one batch of 9000; use a batch size of at most 8000"),
        (&["--batch-size", "30"], "multiple of 4 (such as 28 or 32)"),
        (&["--ckpt", dir.to_str().unwrap()], "is a directory"),
        (&["--epochs", "0"], "--epochs must be at least 1"),
        (&["--sync-bn"], "--sync-bn synchronises batch norms: it needs --net resnet18 (`mlp` has none)"),
    ] {
        // Started without mpirun: a world of one.
        let out = Command::new(BIN).args(args).arg("--log-dir").arg(&dir).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
        let s = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success() && s.contains("rank 0: error: ") && s.contains(want), "{args:?}: {s}");
        let log = std::fs::read_to_string(dir.join("worker_0.log")).unwrap();
        assert!(log.contains(want) && !log.contains("loss is"), "{args:?}: the worker log holds the error and no training: {log}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Colossal-AI's ResNet-18 example (seeds 000/004), small batches: the seed's four lines and
/// its verdict, the MNIST stand-in announced; bad settings refused before any work.
#[test]
fn the_colossal_resnet18_example_prints_the_seeds_boundary_check() {
    let (out, s) = run("colossal_resnet18", &["--batch-size", "4"]);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("training on the MNIST digits"), "{s}");
    let params: Vec<&str> = (0..4)
        .map(|i| {
            let head = format!("iteration {i}, first 10 elements of param: [");
            let line = s.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("no `{head}` line in {s}"));
            &line[head.len()..]
        })
        .collect();
    assert!(params[1] == params[0] && params[2] == params[0] && params[3] != params[0], "{s}");
    assert_eq!(params[0].split(", ").count(), 10);
    assert!(s.trim_end().ends_with("The parameter is only updated in the last iteration"), "{s}");
    refused("colossal_resnet18", &["--data-path", "no/such/dir"], "--data-path");
    refused("colossal_resnet18", &["--epochs", "0"], "--epochs must be at least 1");
    refused("colossal_resnet18", &["--batch-size", "9000"], "gives no batch per epoch");
    let dir = tmp("resnet18");
    refused("colossal_resnet18", &["--train", "--ckpt", dir.to_str().unwrap()], "is a directory");
}

/// The GPT program learns: a one-block GPT after 120 token-weighted updates on Shakespeare has
/// a validation loss well under the unigram baseline (3.33 nats/char), then samples text and
/// writes its checkpoint. Padded lines (micro-batches of different token counts) run too;
/// impossible settings are refused before any work.
#[test]
fn the_gpt_program_learns_and_refuses_bad_settings() {
    let dir = tmp("gpt");
    let ckpt = dir.join("gpt.ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let small = [
        "--layers",
        "1",
        "--width",
        "64",
        "--heads",
        "2",
        "--context",
        "32",
        "--micro-size",
        "2",
        "--eval-items",
        "64",
        "--lr",
        "1e-2",
        "--print-every",
        "40",
        "--ckpt",
        ckpt,
    ];
    let (out, s) = run("gpt_accumulation", &[&small[..], &["--batch-size", "16", "--steps", "120", "--epochs", "1", "--sample", "60"]].concat());
    assert!(out.status.success(), "{s}");
    let val: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("epoch 1: validation loss "))
        .and_then(|l| l.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no validation loss: {s}"));
    assert!(val < 3.0, "validation loss {val} should be well under the unigram baseline 3.33: {s}");
    assert!(s.contains("unigram baseline 3.330") && s.contains("updates: 120") && s.contains("sample:\n") && s.contains("checkpoint: "), "{s}");
    assert!(std::fs::metadata(ckpt).unwrap().len() > 100_000);
    let (out, s) = run(
        "gpt_accumulation",
        &[&small[..], &["--items", "lines", "--batch-size", "8", "--steps", "3", "--epochs", "1", "--sample", "0", "--profile"]].concat(),
    );
    assert!(out.status.success() && s.contains("lines of up to 33 characters") && s.contains("updates: 3"), "{s}");
    // --profile: the ops, then the kinds of step with their programs.
    let steps = s.split("slowest kinds of step (op, output, program):\n").nth(1).unwrap_or_else(|| panic!("no kinds of step: {s}"));
    assert!(s.contains(" calls ") && steps.lines().any(|l| l.contains(" calls  fused f32[") && l.contains("$0")), "{s}");
    // f16 with loss scaling: windows whose gradients overflow are skipped, the rest applied.
    let (out, s) = run(
        "gpt_accumulation",
        &[&small[..], &["--precision", "f16", "--batch-size", "8", "--steps", "24", "--epochs", "1", "--sample", "0"]].concat(),
    );
    assert!(out.status.success(), "{s}");
    let count = |key: &str| -> u64 {
        s.split(key)
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no `{key}`: {s}"))
    };
    assert_eq!(count("updates: ") + count("skipped: "), 24, "{s}");
    assert!(count("updates: ") > 12 && s.contains("loss scale: "), "{s}");
    refused("gpt_accumulation", &["--batch-size", "6", "--micro-size", "4", "--ckpt", ckpt], "must be a multiple of --micro-size 4");
    refused("gpt_accumulation", &["--data-path", "no/such.txt.gz", "--ckpt", ckpt], "no/such.txt.gz");
    refused("gpt_accumulation", &["--context", "0", "--ckpt", ckpt], "context");
}

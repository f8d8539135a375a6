//! Graph dumps and `cellgraph inspect`: LeNet5 under GradAccumulation(4) dumps one file per
//! pass for every graph at each level (golden files, `BLESS=1` re-records them), every dump
//! parses back, and each `inspect` subcommand works on them and fails clearly on bad files.

use std::path::Path;
use std::process::Command;

use cellgraph::compiler::dump::DumpOptions;
use cellgraph::prelude::*;

use crate::common::{golden, lenet_with_loss, TmpDir};
use cellgraph::runtime::Place;

const CELLGRAPH: &str = env!("CARGO_BIN_EXE_cellgraph");

fn tmp(name: &str) -> TmpDir {
    TmpDir::fresh(&format!("dumps-{name}"))
}

/// Dumps LeNet5 + GradAccumulation(4), Momentum, after one training step at batch 32.
fn dump_lenet(level: u8, dir: &Path) -> Vec<String> {
    let net = GradAccumulation::new(lenet_with_loss(), 4);
    let mut model = Model::<Cpu>::new(net, Momentum::new(0.01, 0.9), cpu(), 1).unwrap();
    model.save_graphs(DumpOptions { level, dir: dir.to_path_buf() }).unwrap();
    let batch =
        [HostTensor::f32(vec![32, 1, 32, 32], vec![0.5; 32 * 1024]).unwrap(), HostTensor::i32(vec![32], (0..32).map(|i| i % 10).collect()).unwrap()];
    model.accumulator_mut().set_input_names(&["data", "label"]);
    model.accumulator_mut().step(&batch, Place::Regular).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

const STEMS: [&str; 16] = [
    "00_trace_forward",
    "01_grad_accumulation_clear",
    "01_grad_accumulation_micro_step",
    "01_grad_accumulation_optimizer",
    "02_dce_clear",
    "02_dce_micro_step",
    "02_dce_optimizer",
    "03_fuse_elementwise_clear",
    "03_fuse_elementwise_micro_step",
    "03_fuse_elementwise_optimizer",
    "04_fuse_epilogue_clear",
    "04_fuse_epilogue_micro_step",
    "04_fuse_epilogue_optimizer",
    "05_fuse_accumulation_clear",
    "05_fuse_accumulation_micro_step",
    "05_fuse_accumulation_optimizer",
];

#[test]
fn lenet_dumps_match_golden_files_at_every_level() {
    for level in 1..=3u8 {
        let dir = tmp(&format!("level{level}"));
        let files = dump_lenet(level, &dir);
        let exts: &[&str] = &["ir", "json", "dot"][..level as usize];
        let mut want: Vec<String> = STEMS.iter().flat_map(|s| exts.iter().map(move |e| format!("{s}.{e}"))).collect();
        want.sort();
        assert_eq!(files, want, "level {level}");
        for f in &files {
            golden(&format!("dumps/{f}"), &std::fs::read_to_string(dir.join(f)).unwrap());
        }
    }
}

#[test]
fn every_dump_parses_back_and_names_accumulators_and_state() {
    let dir = tmp("parse");
    dump_lenet(2, &dir);
    for stem in STEMS {
        let text = std::fs::read_to_string(dir.join(format!("{stem}.ir"))).unwrap();
        let g = parse(&text).unwrap_or_else(|e| panic!("{stem}.ir: {e}"));
        assert_eq!(print(&g), text, "{stem}.ir round-trips");
        verify(&g).unwrap();
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{stem}.json"))).unwrap()).unwrap();
        assert_eq!(json["schema"], "cellgraph.graph/1");
        assert_eq!(json["nodes"].as_array().unwrap().len(), g.len(), "{stem}.json has every node");
    }
    let micro = std::fs::read_to_string(dir.join("02_dce_micro_step.ir")).unwrap();
    assert!(micro.contains("assign_add(") && micro.contains("name=\"accu_grads.fc1.weight\"") && micro.contains("# net.conv1"), "{micro}");
    let opt = std::fs::read_to_string(dir.join("02_dce_optimizer.ir")).unwrap();
    assert!(opt.contains("name=\"moments.fc1.weight\"") && opt.contains("name=\"grad_scale\""), "{opt}");
    let fused = std::fs::read_to_string(dir.join("03_fuse_elementwise_micro_step.ir")).unwrap();
    assert!(fused.contains("f32[8,120] = fused(") && fused.contains("{expr=\"$0 $1 add relu\"}  # net.relu"), "{fused}");
    let fused = std::fs::read_to_string(dir.join("03_fuse_elementwise_optimizer.ir")).unwrap();
    assert!(fused.contains("expr=\"$0 0.9 mul $1 $2 mul add\"") && !fused.contains("constant"), "{fused}");
    let epilogues = std::fs::read_to_string(dir.join("04_fuse_epilogue_micro_step.ir")).unwrap();
    for (head, expr) in [("conv2d", "$0 relu"), ("matmul", "$0 $1 add relu"), ("matmul", "$0 $1 relu_grad"), ("max_pool2d_grad", "$0 $1 relu_grad")] {
        assert!(
            epilogues.lines().any(|l| l.contains("= epilogue(") && l.contains(&format!("expr=\"{expr}\"")) && l.contains(&format!("head={head}"))),
            "{head} + {expr}: {epilogues}"
        );
    }
    assert!(!epilogues.contains("= relu(") && !epilogues.contains("= relu_grad(") && !epilogues.contains("= fused("), "{epilogues}");
    // Every gradient is added into its accumulator by the op producing it: the weights' by
    // their filter gradients and matmuls, the biases' by their sums over the batch.
    let last = std::fs::read_to_string(dir.join("05_fuse_accumulation_micro_step.ir")).unwrap();
    let adds = |head: &str| {
        last.lines()
            .filter(|l| {
                l.contains("= epilogue(") && l.contains("expr=\"$0 $1 add\"") && l.contains(&format!("head={head},")) && l.contains("# Gradients/")
            })
            .count()
    };
    assert_eq!((adds("conv2d_backprop_filter"), adds("matmul"), adds("reduce_sum")), (2, 3, 3), "{last}");
    assert_eq!((last.matches("= assign(").count(), last.matches("= assign_add(").count()), (8, 0), "{last}");
}

fn inspect(args: &[&str]) -> (bool, String) {
    let o = Command::new(CELLGRAPH).arg("inspect").args(args).output().unwrap();
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

#[test]
fn inspect_lists_prints_filters_diffs_and_checks_dumps() {
    let dir = tmp("cli");
    dump_lenet(1, &dir);
    let d = dir.to_str().unwrap();
    let (ok, out) = inspect(&[d]);
    assert!(ok, "{out}");
    let row = out.lines().find(|l| l.starts_with("02_dce_micro_step.ir")).unwrap_or_else(|| panic!("{out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cols[1..4], &["micro_step", "dce", "63"], "{row}");
    let (ok, out) = inspect(&[d, "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(ok && rows.as_array().unwrap().len() == STEMS.len());
    let micro = rows.as_array().unwrap().iter().find(|r| r["file"] == "02_dce_micro_step.ir").unwrap();
    // conv1 + conv2 forward, conv2's input gradient and both filter gradients, at micro-batch 8.
    assert!(micro["flops"].as_u64().unwrap() > 5 * 2 * 8 * 117_600 && micro["peak_bytes"].as_u64().unwrap() > 0, "{micro}");

    let file = dir.join("02_dce_micro_step.ir");
    let f = file.to_str().unwrap();
    let (ok, out) = inspect(&[f, "--op", "assign_add"]);
    assert!(ok && out.starts_with("graph micro_step (8 of 63 nodes)"), "{out}");
    let (ok, out) = inspect(&[f, "--scope", "net.fc1"]);
    assert!(ok && out.lines().skip(1).all(|l| l.ends_with("# net.fc1")), "{out}");
    let (ok, out) = inspect(&[f, "--stats", "--json"]);
    let hist: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(ok && hist["conv2d_backprop_filter"] == 2 && hist["assign_add"] == 8, "{out}");

    let before = dir.join("00_trace_forward.ir");
    let (ok, out) = inspect(&["diff", before.to_str().unwrap(), f]);
    assert!(ok && out.starts_with("forward -> micro_step: 37 added, 0 removed, 0 rewritten"), "{out}");
    let (ok, out) = inspect(&["check", f]);
    assert!(ok && out.contains("is valid (63 nodes)"), "{out}");
}

/// `inspect plan` compiles a dump and says what each step runs on the CPU: LeNet5's micro-step
/// binds every step (its convolutions on the direct kernels, its 8 accumulators stored), and
/// `--json` says the same.
#[test]
fn inspect_plan_lists_each_steps_kernel() {
    let dir = tmp("plan");
    dump_lenet(1, &dir);
    let micro = dir.join("05_fuse_accumulation_micro_step.ir");
    let micro = micro.to_str().unwrap();
    let (ok, out) = inspect(&["plan", micro]);
    assert!(ok, "{out}");
    assert!(out.lines().any(|l| l.contains(" conv2d") && l.ends_with("kernel epilogue(conv Forward direct)")), "{out}");
    // The accumulation is fused into the gradients' epilogues: each accumulator's new value is stored.
    assert_eq!(out.lines().filter(|l| l.contains(" assign ") && l.ends_with("store (the new value, moved)")).count(), 8, "{out}");
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("micro_step: ") && last.ends_with(", 0 on burn's ops"), "{last}");
    let (ok, unbound) = inspect(&["plan", micro, "--unbound"]);
    assert!(ok && unbound.lines().count() == 1, "{unbound}");
    let (ok, out) = inspect(&["plan", micro, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(ok && v["burn_ops"] == 0 && v["kernels"].as_u64().unwrap() > 20, "{v}");
    assert!(v["list"].as_array().unwrap().iter().any(|r| r["runs"] == "kernel" && r["detail"] == "matmul"), "{v}");
    let (ok, out) = inspect(&["plan", dir.join("nothing.ir").to_str().unwrap()]);
    assert!(!ok && out.contains("nothing.ir"), "{out}");
    let (ok, out) = inspect(&["plan", micro, "--device", "tpu"]);
    assert!(!ok && out.contains("tpu"), "{out}");
}

/// `inspect plan --device wgpu` binds the plan as a wgpu session does: the GPT's micro-step
/// lists its `zeros_like` as declined by the device's kernels, with the reason, and not the
/// embedding's `gather` (the device's kernel, its ids a plan input), and LeNet5's binds every
/// step.
#[cfg(feature = "wgpu")]
#[test]
fn inspect_plan_on_wgpu_names_what_the_device_declines() {
    let dir = tmp("plan_wgpu");
    dump_lenet(1, &dir);
    let micro = dir.join("05_fuse_accumulation_micro_step.ir");
    let (ok, out) = inspect(&["plan", micro.to_str().unwrap(), "--device", "wgpu"]);
    let summary = out.lines().find(|l| l.starts_with("micro_step: ")).unwrap_or_default();
    assert!(ok && summary.ends_with("on the device's kernels, 0 on burn's ops") && out.contains("device: wgpu"), "{out}");
    use rand::SeedableRng;
    let gpt = tmp("plan_wgpu_gpt");
    let net = GradAccumulation::across_steps(crate::gpt::counted(), 2).normalization(Normalization::Tokens);
    let mut model = Model::<Cpu>::new(net, Momentum::new(0.1, 0.9), cpu(), 1).unwrap();
    model.save_graphs(DumpOptions { level: 1, dir: gpt.to_path_buf() }).unwrap();
    let batch = crate::gpt::sequences(&mut rand::rngs::StdRng::seed_from_u64(5), 3);
    model.accumulator_mut().step(&batch, Place::Regular).unwrap();
    let file = std::fs::read_dir(&gpt)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("micro_step.ir"))
        .max()
        .expect("a micro-step dump");
    let (ok, out) = inspect(&["plan", file.to_str().unwrap(), "--device", "wgpu", "--unbound"]);
    assert!(ok && out.lines().any(|l| l.contains(" zeros_like ") && l.contains("the device's kernels decline it: a fill")), "{out}");
    assert!(!out.lines().any(|l| l.contains(" gather ") || l.contains(" scatter_add ")), "{out}");
}

/// Under clipping by global norm on the CPU the `clip` graph runs before the one-pass
/// boundary: it is dumped after every pass like the others, parses back, and holds the
/// optimizer graph's clipping (the squared norm's sums, its square root, the factor).
#[test]
fn the_clip_graph_is_dumped_where_it_runs() {
    let dir = tmp("clip");
    let net = GradAccumulation::new(lenet_with_loss(), 4).clip_global_norm(1.0);
    let mut model = Model::<Cpu>::new(net, Momentum::new(0.01, 0.9), cpu(), 1).unwrap();
    model.save_graphs(DumpOptions { level: 1, dir: dir.to_path_buf() }).unwrap();
    let batch =
        [HostTensor::f32(vec![8, 1, 32, 32], vec![0.5; 8 * 1024]).unwrap(), HostTensor::i32(vec![8], (0..8).map(|i| i % 10).collect()).unwrap()];
    model.accumulator_mut().step(&batch, Place::Regular).unwrap();
    assert_eq!(model.accumulator().counters().host_boundaries, 1);
    for stem in ["01_grad_accumulation_clip", "02_dce_clip", "05_fuse_accumulation_clip"] {
        let text = std::fs::read_to_string(dir.join(format!("{stem}.ir"))).unwrap_or_else(|e| panic!("{stem}.ir: {e}"));
        let g = parse(&text).unwrap_or_else(|e| panic!("{stem}.ir: {e}"));
        verify(&g).unwrap();
        assert!(text.contains("name=\"accu_grads.conv1.weight\"") && text.contains("name=\"grad_scale\""), "{text}");
    }
    let clip = std::fs::read_to_string(dir.join("02_dce_clip.ir")).unwrap();
    assert!(clip.contains("= sqrt(") && clip.contains("= select(") && clip.contains("# optimizer.clip_by_global_norm"), "{clip}");
}

#[test]
fn inspect_rejects_bad_files_with_their_place() {
    let dir = tmp("bad");
    dump_lenet(1, &dir);
    let text = std::fs::read_to_string(dir.join("02_dce_clear.ir")).unwrap();
    let bad = dir.join("bad.ir");
    std::fs::write(&bad, text.replacen("f32[6,1,5,5]", "f32[6,1,5", 1)).unwrap();
    let (ok, out) = inspect(&["check", bad.to_str().unwrap()]);
    assert!(!ok && out.contains("bad.ir:2:17:") && out.contains("in the shape"), "{out}");
    // Well-formed text that breaks an invariant: a parameter assigned a value of another type.
    // The error names the equation's line and column, as parse errors do.
    let edited = text.replacen("f32[6,1,5,5] = assign", "f32[6,1,5,4] = assign", 1);
    let line = edited.lines().position(|l| l.contains("f32[6,1,5,4] = assign")).unwrap() + 1;
    std::fs::write(&bad, &edited).unwrap();
    let (ok, out) = inspect(&["check", bad.to_str().unwrap()]);
    assert!(!ok && out.contains(&format!("bad.ir:{line}:3: declared type f32[6,1,5,4]")), "{out}");
    assert!(out.contains("f32[6,1,5,4] = assign("), "the offending equation is shown: {out}");
    let (ok, out) = inspect(&["/nonexistent/dump.ir"]);
    assert!(!ok && out.contains("/nonexistent/dump.ir"), "{out}");
    let (ok, out) = inspect(&[std::env::temp_dir().join("cellgraph-no-such-dir.json").to_str().unwrap()]);
    assert!(!ok, "{out}");
}

#[test]
fn inspect_renders_svg_where_graphviz_is_installed() {
    let dir = tmp("svg");
    dump_lenet(1, &dir);
    let svg = dir.join("micro.svg");
    let (ok, out) = inspect(&["render", dir.join("02_dce_micro_step.ir").to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    if Command::new("dot").arg("-V").output().is_err() {
        assert!(!ok && out.contains("apt-get install graphviz"), "{out}");
        eprintln!("skipped the SVG check: Graphviz is not installed");
        return;
    }
    assert!(ok, "{out}");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg") && text.contains("cluster_backward") && text.contains("cluster_accumulate"), "{}", &text[..400.min(text.len())]);
}

#[test]
fn inspect_lists_the_ranks_of_a_multi_rank_dump_and_names_the_known_ops() {
    // The layout CELLGRAPH_SAVE_GRAPHS writes under mpirun: one rank_<id>/ per rank.
    let dir = tmp("ranks");
    dump_lenet(1, &dir.join("rank_0"));
    for r in [1, 10] {
        std::fs::create_dir_all(dir.join(format!("rank_{r}"))).unwrap();
        for stem in &STEMS[..3] {
            std::fs::copy(dir.join("rank_0").join(format!("{stem}.ir")), dir.join(format!("rank_{r}/{stem}.ir"))).unwrap();
        }
    }
    let (ok, out) = inspect(&[dir.to_str().unwrap()]);
    assert!(ok && out.contains("a multi-rank dump, 3 rank(s)"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.trim_start().starts_with("rank_")).collect();
    assert_eq!(rows.len(), 3, "{out}");
    assert!(rows[0].contains("rank_0/") && rows[0].contains(&format!("{} dumps", STEMS.len())), "{out}");
    assert!(rows[1].contains("rank_1/") && rows[1].contains("3 dumps") && rows[2].contains("rank_10/"), "ranks in numeric order: {out}");
    let (ok, out) = inspect(&[dir.to_str().unwrap(), "--json"]);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(ok && json[2]["rank"] == 10 && json[2]["dumps"] == 3, "{out}");

    let file = dir.join("rank_0/02_dce_micro_step.ir");
    let (ok, out) = inspect(&[file.to_str().unwrap(), "--op", "assign-add"]);
    assert!(
        !ok && out.contains("--op assign-add: no such op")
            && out.contains("assign_add, attention, attention_grad, avg_pool2d")
            && out.contains("conv2d_backprop_filter"),
        "{out}"
    );
    let (ok, out) = inspect(&[dir.to_str().unwrap(), "--op", "conv2d"]);
    assert!(!ok && out.contains("apply to one .ir dump"), "{out}");
    let empty = tmp("no-dumps");
    std::fs::create_dir_all(&empty).unwrap();
    let (ok, out) = inspect(&[empty.to_str().unwrap()]);
    assert!(!ok && out.contains("no .ir dumps here"), "{out}");
}

//! Accumulation throughput on a device: LeNet5, the seed-002 MLP, ResNet-18 on 3x32x32 images
//! or the small GPT (sequences of 128 characters, token-weighted), `K` micro-batches of `b` per
//! update, on `--device` (cpu, cuda:N, wgpu). Prints one markdown table row: items (images or
//! sequences) per second, ms per update, fused optimizer launches per update, FLOPs per item
//! and achieved TFLOP/s (and tokens/s for the GPT).
//! `scripts/gpu_check.sh` runs it beside PyTorch on the same GPU.
//!
//! `cargo build --release --features cuda --example device_bench`, then
//! `device_bench --device cuda:0 --net lenet --micro-batch 32 --micro-size 4`.

use std::rc::Rc;
use std::time::Instant;

use clap::Parser;

use cellgraph::cells::Optimizer;
use cellgraph::prelude::*;
use cellgraph::runtime::burn_backend::tensor::Device;
use cellgraph::runtime::device::{self, OnDevice};
use cellgraph::runtime::Place;
use cellgraph::runtime::{Accumulator, Backend};
use rand::{Rng, SeedableRng};

#[derive(Parser, Clone)]
struct Args {
    #[arg(long, default_value = "auto")]
    device: String,
    /// `lenet` (Momentum 0.01/0.9), `mlp` (SGD 0.01), `resnet18` (SGD 0.1, momentum 0.9,
    /// weight decay 5e-4) or `gpt` (AdamW 3e-3, clip 1.0, token-weighted).
    #[arg(long, default_value = "lenet")]
    net: String,
    #[arg(long, default_value_t = 32)]
    micro_batch: usize,
    #[arg(long, default_value_t = 4)]
    micro_size: usize,
    /// Timed updates (after `warmup`).
    #[arg(long, default_value_t = 100)]
    updates: usize,
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Print the table header first.
    #[arg(long)]
    header: bool,
    /// Let matmuls and convolutions use TF32 tensor cores (default: exact f32).
    #[arg(long)]
    tf32: bool,
    /// After timing, count the kernels one window launches (cubecl's execution log): per
    /// micro-step, at the boundary, and by kernel name. Device backends only.
    #[arg(long)]
    launches: bool,
    /// After timing, run one more window waiting for the device after each op, and print
    /// where its time went: the slowest ops and kinds of step (launch and kernels together).
    #[arg(long)]
    profile: bool,
    /// Replay each micro-step as its captured graph (see docs/devices.md, "CUDA graph replay");
    /// with `--in-step`, each window as one graph.
    #[arg(long)]
    graphs: bool,
    /// Each step is a whole window (`GradAccumulation::new`: its batch of micro-batch x K rows
    /// sliced into K micro-batches, MindSpore's GradAccumulationCell) instead of one
    /// micro-batch (`GradAccumulation::across_steps`, the default here).
    #[arg(long)]
    in_step: bool,
    /// Compute precision of the micro-steps: f32, or bf16 (`Precision::bf16()`: values stored
    /// as bf16, f32 accumulators; on the CPU, products of bf16 values on AVX-512 BF16 where it
    /// has them).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Under bf16 on the CPU, multiply on the f32 GEMM (the emulation) even where the CPU has
    /// AVX-512 BF16.
    #[arg(long)]
    f32_products: bool,
    /// Under bf16 or f16 on a device, keep every value in f32 storage (the emulation).
    #[arg(long)]
    f32_storage: bool,
}

/// The GPT's characters (the Shakespeare corpus has 65) and context.
const GPT_VOCAB: usize = 65;
const GPT_CONTEXT: usize = 128;

struct Bench(Args, String);

impl OnDevice for Bench {
    type Output = Result<(), Box<dyn std::error::Error>>;
    fn run<B: Backend>(self, device: Device<B>) -> Self::Output {
        bench::<B>(&self.0, &self.1, device)
    }
}

fn bench<B: Backend>(args: &Args, label: &str, device: Device<B>) -> Result<(), Box<dyn std::error::Error>> {
    let (b, k) = (args.micro_batch, args.micro_size);
    // Rows per step: a micro-batch, or with in-step slicing a whole window.
    let rows = if args.in_step { b * k } else { b };
    let accumulate = |net: WithLossCell| if args.in_step { GradAccumulation::new(net, k) } else { GradAccumulation::across_steps(net, k) };
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    // Host batches, as a data loader hands them over (each micro-step uploads its batch).
    let images = |rng: &mut rand::rngs::StdRng, c: usize, hw: usize| {
        let x: Vec<f32> = (0..rows * c * hw * hw).map(|_| rng.random_range(-1.0..1.0)).collect();
        let y: Vec<i32> = (0..rows).map(|_| rng.random_range(0..10)).collect();
        vec![HostTensor::f32(vec![rows, c, hw, hw], x).unwrap(), HostTensor::i32(vec![rows], y).unwrap()]
    };
    // Items per micro-batch row: an image, or a sequence of GPT_CONTEXT tokens.
    let mut tokens_per_item = 1;
    let (net, opt, batches): (GradAccumulation, Rc<dyn Optimizer>, Vec<Vec<HostTensor>>) = match args.net.as_str() {
        "lenet" => {
            let loss = SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean);
            let net = accumulate(WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), loss));
            (net, Rc::new(Momentum::new(0.01, 0.9)), (0..8).map(|_| images(&mut rng, 1, 32)).collect())
        }
        "mlp" => {
            let net = accumulate(WithLossCell::new(Network::new(&Scope::root()), CrossEntropyLoss::new()));
            (net, Rc::new(SGD::new(0.01)), (0..8).map(|_| images(&mut rng, 1, 28)).collect())
        }
        // Colossal-AI's seed: SGD(0.1, momentum 0.9, weight decay 5e-4), loss divided by K.
        "resnet18" => {
            let net = accumulate(WithLossCell::new(ResNet18::new(&Scope::root(), 10), CrossEntropyLoss::new())).normalization(Normalization::Mean);
            (net, Rc::new(SGD { momentum: 0.9, weight_decay: 5e-4, ..SGD::new(0.1) }), (0..8).map(|_| images(&mut rng, 3, 32)).collect())
        }
        // sample_code/gpt_accumulation's model and recipe at a constant learning rate: the
        // small GPT on 65 characters, token-weighted, AdamW (b2 0.99, wd 0.1), clip at 1.0.
        "gpt" => {
            let t = GPT_CONTEXT;
            tokens_per_item = t;
            let gpt = GPT::new(&Scope::root(), GptConfig::small(GPT_VOCAB))?;
            let loss = CrossEntropyLoss::new().ignore_index(-100).tokens();
            let net = accumulate(WithLossCell::new(gpt, loss)).normalization(Normalization::Tokens).clip_global_norm(1.0);
            let batches = (0..8)
                .map(|_| {
                    let ids: Vec<i32> = (0..rows * (t + 1)).map(|_| rng.random_range(0..GPT_VOCAB as i32)).collect();
                    let (x, y): (Vec<i32>, Vec<i32>) =
                        (0..rows * t).map(|i| (ids[i / t * (t + 1) + i % t], ids[i / t * (t + 1) + i % t + 1])).unzip();
                    vec![HostTensor::i32(vec![rows, t], x).unwrap(), HostTensor::i32(vec![rows, t], y).unwrap()]
                })
                .collect();
            (net, Rc::new(Adam { beta2: 0.99, ..Adam::adamw(3e-3, 0.1) }), batches)
        }
        other => return Err(format!("--net must be lenet, mlp, resnet18 or gpt, got `{other}`").into()),
    };
    let mut net = net;
    net.precision = match args.precision.as_str() {
        "f32" => None,
        "bf16" => Some(cellgraph::cells::Precision::bf16()),
        "f16" => Some(cellgraph::cells::Precision::f16()),
        other => return Err(format!("--precision must be f32, bf16 or f16, got `{other}`").into()),
    };
    // The micro-step's inputs: a micro-batch's rows.
    let micro_type = |t: &HostTensor| TensorType::new(t.dtype(), [b].into_iter().chain(t.shape[1..].iter().copied()).collect::<Vec<_>>());
    let types: Vec<(String, TensorType)> = batches[0].iter().enumerate().map(|(i, t)| (format!("input{i}"), micro_type(t))).collect();
    let micro_graph = net.micro_step_graph(&types)?;
    let flops_per_item = cellgraph::compiler::cost::flops(&micro_graph) as f64 / b as f64;
    let mut acc = Accumulator::<B>::new(Rc::new(net), opt, device, 1)?;
    acc.options().set_tf32(args.tf32);
    acc.options().set_bf16_products(!args.f32_products);
    acc.options().set_low_precision_storage(!args.f32_storage);
    let graphs = args.graphs;
    acc.options().set_graphs(graphs)?;
    let mut i = 0;
    // Steps per window: K micro-batches, or one window.
    let steps = if args.in_step { 1 } else { k };
    let mut run = |acc: &mut Accumulator<B>, updates: usize| -> Result<f64, Box<dyn std::error::Error>> {
        let mut loss = 0.0;
        for _ in 0..updates * steps {
            // The loss is read once per update (PyTorch's script does the same), so the
            // micro-steps of a window queue on the device without waiting for it.
            if acc.step(&batches[i % batches.len()], Place::Regular)? {
                loss = acc.step_loss();
            }
            i += 1;
        }
        Ok(loss)
    };
    run(&mut acc, args.warmup)?;
    let (fused0, updates0) = (acc.counters().fused_launches, acc.updates());
    let t = Instant::now();
    let loss = run(&mut acc, args.updates)?;
    // Reading the parameters back waits for every queued kernel.
    let _ = acc.session().params_host();
    let secs = t.elapsed().as_secs_f64();
    let updates = (acc.updates() - updates0) as f64;
    let images = updates * (b * k) as f64;
    let tokens = if tokens_per_item > 1 { format!(" <!-- {:.0} tokens/s -->", images * tokens_per_item as f64 / secs) } else { String::new() };
    let fused = (acc.counters().fused_launches - fused0) as f64 / updates;
    if args.header {
        println!("| framework | device | net | micro-batch x K | items/s | ms/update | optimizer launches/update | GFLOP/item | TFLOP/s |");
        println!("|---|---|---|---|---|---|---|---|---|");
    }
    let launches = if fused > 0.0 { format!("{fused:.0} (fused)") } else { "graph (per parameter)".into() };
    let label = if args.tf32 { format!("{label} tf32") } else { label.to_string() };
    let label = match (graphs, args.in_step) {
        (true, true) => format!("{label} graphs (window)"),
        (true, false) => format!("{label} graphs"),
        (false, true) => format!("{label} (in-step)"),
        (false, false) => label,
    };
    let label = match (args.precision.as_str(), args.f32_products) {
        ("bf16", false) => format!("{label} bf16"),
        ("bf16", true) => format!("{label} bf16 (f32 products)"),
        ("f16", _) => format!("{label} f16"),
        _ => label,
    };
    let label = if args.f32_storage && args.precision != "f32" { format!("{label} (f32 storage)") } else { label };
    println!(
        "| cellgraph | {label} | {} | {b} x {k} | {:.0} | {:.3} | {launches} | {:.5} | {:.3} |{tokens}",
        args.net,
        images / secs,
        secs * 1e3 / updates,
        flops_per_item / 1e9,
        flops_per_item * images / secs / 1e12
    );
    eprintln!("last loss {loss:.4}");
    if let Some(p) = acc.micro_plans().find_map(|e| e.bf16_products::<B>()) {
        eprintln!("{p}{}", if args.f32_products { " (--f32-products: all in f32)" } else { "" });
    }
    if let Some(s) = acc.low_precision_storage().filter(|_| !B::HOST) {
        eprintln!("{s}");
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if !B::HOST && cellgraph::runtime::cube::tf32_fallbacks() > 0 {
        let (all, convs) = (cellgraph::runtime::cube::tf32_fallbacks(), cellgraph::runtime::cube::conv_tf32_fallbacks());
        eprintln!("tensor-core products run in exact f32 (no tensor-core kernel here): {all} ({convs} of them convolutions)");
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if !B::HOST {
        for why in cellgraph::runtime::cube::cubek_refusals() {
            eprintln!("cubek did not set up a tensor-core routine, first refusal: {why}");
        }
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if !B::HOST && cellgraph::runtime::cube::flash::cubek_attentions() > 0 {
        eprintln!("attention forwards on cubek's flash attention: {}", cellgraph::runtime::cube::flash::cubek_attentions());
    }
    if graphs {
        let r = acc.session().replay_counts();
        eprintln!(
            "graph replay: {} warm-ups, {} captures, {} replays ({} of them whole windows), {} forgotten, {} op by op ({} with collectives)",
            r.warmups,
            r.captures,
            r.replays,
            r.windows,
            r.forgotten,
            r.uncaptured,
            acc.counters().uncaptured_steps
        );
        for why in acc.session().replay_blockers() {
            eprintln!("  not captured: {why}");
        }
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if args.launches && k >= 2 {
        use cellgraph::runtime::launches;
        // The timed run ended on a boundary; count a whole window: K - 1 micro-steps, then the
        // last with the boundary (each step reads its loss, so the device is idle at each count).
        let c0 = launches::settled();
        let before: std::collections::BTreeMap<String, u64> = launches::by_name().into_iter().collect();
        let replays = acc.session().replay_counts().replays;
        if args.in_step {
            // One step is the window.
            acc.step(&batches[0], Place::Regular)?;
            let _ = acc.session().params_host();
            let c1 = launches::settled();
            eprintln!("kernel launches: {} per window of {k} micro-steps, boundary included (in-step)", c1 - c0);
        } else {
            for _ in 0..k - 1 {
                acc.step(&batches[0], Place::Regular)?;
                acc.step_loss();
            }
            let c1 = launches::settled();
            acc.step(&batches[0], Place::Regular)?;
            let _ = acc.session().params_host();
            let c2 = launches::settled();
            let micro = (c1 - c0) as f64 / (k - 1) as f64;
            eprintln!("kernel launches: {micro:.1} per micro-step, {:.1} at the boundary, {} per window", (c2 - c1) as f64 - micro, c2 - c0);
        }
        if graphs {
            // A graph's kernels are not in cubecl's log: its replay is one launch.
            eprintln!("graph replays in that window: {}", acc.session().replay_counts().replays - replays);
        }
        let mut names: Vec<(u64, String)> =
            launches::by_name().into_iter().map(|(n, c)| (c - before.get(&n).copied().unwrap_or(0), n)).filter(|(c, _)| *c > 0).collect();
        names.sort_by_key(|n| std::cmp::Reverse(n.0));
        for (c, n) in names {
            eprintln!("  {c:>4}  {n}");
        }
        // Transfers of a window whose losses nobody reads (as PyTorch's script: no readback).
        use cellgraph::runtime::value::{device_reads, device_uploads};
        let (r0, u0) = (device_reads(), device_uploads());
        for _ in 0..steps {
            acc.step(&batches[0], Place::Regular)?;
        }
        let (reads, uploads) = (device_reads() - r0, device_uploads() - u0);
        eprintln!("transfers per window of {k} micro-steps, loss not read: {reads} device-to-host reads, {uploads} host-to-device copies");
    }
    if args.profile {
        // Per-op times need the ops run one by one.
        acc.options().set_graphs(false)?;
        acc.options().set_device_profiling(true);
        let t = Instant::now();
        for _ in 0..steps {
            acc.step(&batches[0], Place::Regular)?;
        }
        let _ = acc.session().params_host();
        let total: f64 = acc.session().profile().iter().map(|p| p.2).sum();
        eprintln!(
            "one window of {k} micro-steps, waiting for the device after each op: {:.1} ms, {:.1} ms of it in ops\n{}",
            t.elapsed().as_secs_f64() * 1e3,
            total * 1e3,
            acc.session().profile_table(25)
        );
        acc.options().set_device_profiling(false);
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if args.launches {
        if let Err(e) = cellgraph::runtime::launches::start() {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
    let result = device::choose(&args.device, 0).and_then(|(spec, msg)| {
        eprintln!("{msg}");
        device::dispatch(spec, Bench(args.clone(), spec.to_string()))
    });
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

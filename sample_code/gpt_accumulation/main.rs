//! A character-level GPT on Shakespeare, trained with gradient accumulation and token-weighted
//! normalisation: what a language-model user of accumulation needs.
//!
//! `GradAccumulation(WithLossCell(GPT, CrossEntropyLoss::new().ignore_index(-100).tokens()), K)`
//! with `Normalization::Tokens`: each micro-batch's loss is the sum over its tokens, the
//! window's gradient is divided once by the window's token count (over every micro-batch and,
//! under `mpirun`, every rank: the count travels with the gradients), so micro-batches of
//! different lengths (`--items lines`) weigh each token equally, as one large batch would.
//! AdamW, linear warmup then cosine decay counted in updates, gradient clipping at global norm
//! 1.0 (once per window).
//!
//! It prints LossMonitor lines (mean loss per token), the validation loss per epoch against
//! the unigram baseline, a few lines of sampled text, and writes a checkpoint.
//!
//! Run: `cargo run --release --example gpt_accumulation [-- --epochs 2 --steps 50]`;
//! `bash run.sh --net gpt` runs it on 8 ranks.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, ValueEnum};
use rand::{Rng, SeedableRng};

use cellgraph::prelude::*;
use cellgraph::runtime::comm::Communicator;
use cellgraph::runtime::data::{CharDataset, Corpus, Items, IGNORE_INDEX};
use cellgraph::runtime::Metric;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ItemKind {
    /// Fixed windows of context + 1 characters.
    Windows,
    /// One line per item, padded (micro-batches carry different numbers of tokens).
    Lines,
}

#[derive(Clone, Copy, ValueEnum)]
enum Compute {
    /// f32 throughout.
    F32,
    /// bf16 compute (emulated), f32 accumulators and optimizer state.
    Bf16,
    /// f16 compute (emulated), f32 accumulators, dynamic loss scaling once per window.
    F16,
}

#[derive(Parser)]
#[command(about = "A character-level GPT on Shakespeare with gradient accumulation and token-weighted normalisation")]
struct Args {
    /// The corpus (plain or gzip-compressed ASCII text).
    #[arg(long, default_value = "data/shakespeare/shakespeare.txt.gz")]
    data_path: PathBuf,
    /// What an item is.
    #[arg(long, value_enum, default_value = "windows")]
    items: ItemKind,
    /// Sequences per step on each rank (sliced into --micro-size micro-batches).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Micro-batches per update (GradAccumulation's micro_size).
    #[arg(long, default_value_t = 4)]
    micro_size: usize,
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Updates per epoch (each epoch reads the first this many batches of a fresh shuffle).
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Context length (positions).
    #[arg(long, default_value_t = 128)]
    context: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Warmup updates before the cosine decay.
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Dropout probability (nanoGPT's places; masks keyed by item and update, so the same on
    /// any number of ranks and micro-batches).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Compute precision of the micro-steps: values rounded to it where they are stored, f32
    /// arithmetic inside each op; under bf16, products of bf16 values multiply bf16 pairs on
    /// the CPU's AVX-512 BF16 where it has them (elsewhere, and on f16, emulated in f32).
    #[arg(long, value_enum, default_value = "f32")]
    precision: Compute,
    /// Under bf16, multiply on the f32 GEMM even where the CPU has AVX-512 BF16 (the
    /// emulation: the same products, summed in another order).
    #[arg(long)]
    f32_products: bool,
    /// Held-out sequences the validation loss reads.
    #[arg(long, default_value_t = 128)]
    eval_items: usize,
    /// Characters to sample at the end.
    #[arg(long, default_value_t = 240)]
    sample: usize,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 10)]
    print_every: usize,
    #[arg(long, default_value = "gpt.ckpt")]
    ckpt: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Time every op and print the slowest ops, and the slowest kinds of step (op, output type,
    /// fused program), rank 0
    #[arg(long)]
    profile: bool,
}

fn main() -> std::process::ExitCode {
    cellgraph::main_on_ranks(|comm| run(Args::parse(), comm))
}

/// The entropy (nats per character) of the training text's character frequencies: the loss
/// of the best model that ignores context.
fn unigram_nats(text: &[u8]) -> f64 {
    let mut count = [0u64; 256];
    for &b in text {
        count[b as usize] += 1;
    }
    let n = text.len() as f64;
    count.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
}

fn run(args: Args, comm: Arc<dyn Communicator>) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, size) = (comm.rank(), comm.size());
    if args.epochs == 0 || args.steps == 0 {
        return Err("--epochs and --steps must be at least 1".into());
    }
    if !args.batch_size.is_multiple_of(args.micro_size) {
        return Err(format!("--batch-size {} must be a multiple of --micro-size {}", args.batch_size, args.micro_size).into());
    }
    if rank == 0 {
        cellgraph::runtime::checkpoint::check_writable(&args.ckpt)?;
    }
    let corpus = Arc::new(Corpus::load(&args.data_path)?);
    let (train_part, val_part) = corpus.split(0.1);
    let kind = match args.items {
        ItemKind::Windows => Items::Windows,
        ItemKind::Lines => Items::Lines,
    };
    let train = CharDataset::new(corpus.clone(), train_part.clone(), kind, args.context, "Shakespeare train")?
        .shuffle(args.seed)
        .batch(args.batch_size, true)?
        .shard(size, rank)?
        .take_batches(args.steps);
    train.check_batches()?;
    // Validation: the same held-out windows (or lines) on every rank, in order.
    let val = CharDataset::new(corpus.clone(), val_part.clone(), kind, args.context, "Shakespeare held-out")?
        .batch(args.eval_items.clamp(1, 64), false)?
        .take_batches(args.eval_items.div_ceil(64));
    val.check_batches()?;

    let config = GptConfig {
        vocab_size: corpus.vocab_size(),
        context: args.context,
        layers: args.layers,
        heads: args.heads,
        width: args.width,
        layer_norm_eps: 1e-5,
        dropout: args.dropout,
        gelu_approximate: false,
    };
    let gpt = GPT::new(&Scope::root(), config)?;
    let loss = CrossEntropyLoss::new().ignore_index(IGNORE_INDEX as i64).tokens();
    let mut net = GradAccumulation::new(WithLossCell::new(gpt, loss), args.micro_size).normalization(Normalization::Tokens).clip_global_norm(1.0);
    net.precision = match args.precision {
        Compute::F32 => None,
        Compute::Bf16 => Some(Precision::bf16()),
        // The micro-steps' losses are sums over their tokens, so their gradients are the
        // window's token count times a mean loss's (PyTorch's per-micro-batch mean over the
        // micro-batches, Hugging Face's sum over `num_items_in_batch`): the scale starts that
        // much below PyTorch's 2^16 (at a power of two), sparing the first windows' overflows.
        Compute::F16 => Some(Precision::f16().loss_scale(Some(LossScale::default().for_sum_over(args.batch_size * args.context)))),
    };
    let total = (args.epochs * args.steps) as u64;
    let schedule = LearningRate::Warmup {
        warmup: args.warmup,
        then: Box::new(LearningRate::Cosine { base: args.lr, min: args.lr / 10.0, total: total.saturating_sub(args.warmup).max(1) }),
    };
    let optimizer = Adam { beta2: 0.99, ..Adam::adamw(schedule, args.weight_decay) };
    let mut model = if size > 1 {
        Model::<Cpu>::parallel(AutoParallel::new(net), optimizer, cpu(), args.seed, comm.clone())?
    } else {
        Model::<Cpu>::new(net, optimizer, cpu(), args.seed)?
    };
    model = model.with_metrics(&[Metric::Loss]);
    model.accumulator_mut().options().set_profiling(args.profile);
    model.accumulator_mut().options().set_bf16_products(!args.f32_products);
    // MindSpore's save_graphs: CELLGRAPH_SAVE_GRAPHS=1..3, CELLGRAPH_SAVE_GRAPHS_PATH=dir.
    if let Some(opts) = cellgraph::compiler::dump::DumpOptions::from_env()? {
        model.save_graphs(opts)?;
    }

    let out: Box<dyn std::io::Write> = if rank == 0 { Box::new(std::io::stdout()) } else { Box::new(std::io::sink()) };
    let mut loss_cb = LossMonitor::to_writer(args.print_every, out);
    let baseline = unigram_nats(&corpus.text[train_part.clone()]);
    let params: usize = model.accumulator().network().trainable_params().iter().map(|p| p.ty.numel()).sum();
    if rank == 0 {
        println!(
            "GPT: {} layers, {} heads, width {}, context {}, {} characters, {params} parameters",
            args.layers,
            args.heads,
            args.width,
            args.context,
            corpus.vocab_size()
        );
        println!("{}; {} updates per epoch of {} micro-batches", train.describe(), args.steps, args.micro_size);
        println!("{}; unigram baseline {baseline:.3} nats/char", val.describe());
    }
    let t0 = std::time::Instant::now();
    let mut secs = 0.0;
    for epoch in 0..args.epochs {
        let t = std::time::Instant::now();
        model.train(epoch + 1, &train, &mut [&mut loss_cb])?;
        secs += t.elapsed().as_secs_f64();
        let v = model.eval(&val)?["Loss"];
        if rank == 0 {
            println!("epoch {}: validation loss {v:.4} nats/char (unigram {baseline:.3}), {:.0} s", epoch + 1, t0.elapsed().as_secs_f64());
        }
    }
    let tokens = args.epochs * train.dataset_size() * args.batch_size * args.context * size;
    let snapshot = model.snapshot();
    if rank == 0 {
        let c = model.accumulator().counters();
        println!(
            "ranks: {size}, updates: {}, gradient collectives: {}, skipped: {}",
            model.accumulator().updates(),
            c.grad_collectives,
            c.skipped_updates
        );
        if let Some(s) = model.accumulator().loss_scale() {
            println!("loss scale: {s}");
        }
        if let Some(p) = model.accumulator().micro_plans().find_map(|e| e.bf16_products::<Cpu>()) {
            println!("{p}{}", if args.f32_products { " (--f32-products: all in f32)" } else { "" });
        }
        if matches!(args.items, ItemKind::Windows) {
            println!("training: {secs:.2} s, {:.1} tokens/s across ranks", tokens as f64 / secs);
        }
        print!("{}", model.accumulator().session().profile_table(20));
        if args.sample > 0 {
            println!("sample:\n{}", sample(&mut model, &corpus, args.context, args.sample, args.seed)?);
        }
        cellgraph::runtime::checkpoint::save(&args.ckpt, &snapshot, &Default::default())?;
        println!("checkpoint: {}", args.ckpt.display());
    }
    Ok(())
}

/// `n` characters drawn from the model after a newline, each from the softmax of its logits
/// (temperature 0.8) over the last `context` characters.
fn sample(model: &mut Model<Cpu>, corpus: &Corpus, context: usize, n: usize, seed: u64) -> Result<String, Box<dyn std::error::Error>> {
    let backbone = model.accumulator().network().backbone().ok_or("the network has no backbone")?;
    // One plan on a full context: causal attention makes position t read only tokens <= t,
    // so the tokens after the prompt do not matter.
    let (g, _) = cellgraph::cells::cell::trace_inference(backbone, "sample", &[("ids", TensorType::i32([1, context]))])?;
    let exe = compile(g)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = corpus.encode(b"\n")?;
    for _ in 0..n {
        let start = ids.len().saturating_sub(context);
        let window = &ids[start..];
        let mut input = window.to_vec();
        input.resize(context, 0);
        let logits = model.accumulator_mut().run(&exe, &[HostTensor::i32(vec![1, context], input)?])?.remove(0).to_f32();
        let v = corpus.vocab_size();
        let row = &logits[(window.len() - 1) * v..window.len() * v];
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let p: Vec<f64> = row.iter().map(|&l| (((l - m) / 0.8) as f64).exp()).collect();
        let mut r = rng.random_range(0.0..p.iter().sum::<f64>());
        let next = p.iter().position(|&q| {
            r -= q;
            r < 0.0
        });
        ids.push(next.unwrap_or(v - 1) as i32);
    }
    Ok(corpus.decode(&ids[1..]))
}

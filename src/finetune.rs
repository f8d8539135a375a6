//! `cellgraph finetune`: a Hugging Face GPT-2 or Llama checkpoint fine-tuned on a text under
//! gradient accumulation, token-weighted, and saved back as a model directory `transformers`
//! loads.
//!
//! The model directory (`config.json`, `model.safetensors`, `tokenizer.json`) is read with
//! `cellgraph::runtime::hf`; the text (plain or gzip, UTF-8) is split into a training part
//! and a held-out part (the last `--val-fraction`, from a paragraph break), tokenized with the
//! model's tokenizer, and cut into blocks of `--block-size` tokens (or taken line by line,
//! padded per batch). Each update is a window of `--micro-size` micro-batches whose
//! gradients are normalised by the window's tokens (`Normalization::Tokens`), clipped at
//! global norm `--max-grad-norm`, and applied by AdamW (PyTorch's form) with linear warmup and
//! cosine decay to zero. After each epoch the held-out loss and perplexity are printed; at the end the model
//! is saved (`--out`) and greedily continues `--prompt`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::{Args, ValueEnum};

use cellgraph::prelude::*;
use cellgraph::runtime::burn_backend::tensor::Device;
use cellgraph::runtime::callback::py_float;
use cellgraph::runtime::comm::{self, Communicator};
use cellgraph::runtime::data::{TokenDataset, IGNORE_INDEX};
use cellgraph::runtime::device::{self, OnDevice};
use cellgraph::runtime::hf::{self, LoadOptions, Tokenizer};
use cellgraph::runtime::{Backend, Dataset, Metric, ProgressBar};

use crate::train::{at_least_one, non_negative, Compute, RunLog, StopAfter};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// How the text becomes items.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Split {
    /// The whole text tokenized, cut into blocks of `--block-size + 1` tokens, one every
    /// `--block-size` (`run_clm.py`'s `group_texts`).
    Blocks,
    /// Each line tokenized on its own (at least two tokens), cut to `--block-size + 1` and
    /// padded to the batch's longest, padding labelled -100: micro-batches then differ in
    /// tokens, which token-weighted normalisation counts.
    Lines,
}

/// Arguments of `cellgraph finetune`.
#[derive(Args)]
#[command(after_help = FINETUNE_EXAMPLES, args_override_self = true)]
pub struct FinetuneArgs {
    /// A Hugging Face GPT-2 or Llama model directory: config.json, model.safetensors,
    /// tokenizer.json.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// The text to fine-tune on: a UTF-8 text file or its gzip.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Where to save the fine-tuned model (a model directory transformers loads).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// K: micro-batches per update (the batch is sliced into K).
    #[arg(long, value_name = "K", default_value_t = 4, value_parser = at_least_one)]
    micro_size: usize,
    /// Sequences per update on each rank (a multiple of --micro-size; under mpirun the
    /// update's window is the ranks' batches together).
    #[arg(long, visible_alias = "batch", value_name = "B", default_value_t = 8, value_parser = at_least_one)]
    batch_size: usize,
    /// Epochs over the training part.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one)]
    epochs: usize,
    /// Stop after N updates of this run.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    steps: Option<usize>,
    /// How the text becomes items.
    #[arg(long, value_enum, default_value_t = Split::Blocks)]
    split: Split,
    /// Under --split lines, pad each batch to a multiple of N tokens (at most --block-size), as
    /// transformers' `DataCollatorWithPadding(pad_to_multiple_of=N)`: the same loss, fewer
    /// batch shapes (each is a plan to compile and, with --graphs, a graph to capture)
    /// [default: to the batch's longest line].
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pad_to_multiple_of: Option<usize>,
    /// Tokens per item [default: the model's n_positions or max_position_embeddings].
    #[arg(long, value_name = "T", value_parser = at_least_one)]
    block_size: Option<usize>,
    /// Peak learning rate (AdamW; transformers' Trainer default).
    #[arg(long, value_name = "LR", default_value_t = 5e-5, value_parser = non_negative)]
    lr: f64,
    /// AdamW's decoupled weight decay.
    #[arg(long, value_name = "WD", default_value_t = 0.0, value_parser = non_negative)]
    weight_decay: f64,
    /// Updates of linear warmup before the cosine decay to zero.
    #[arg(long, value_name = "N", default_value_t = 0)]
    warmup: u64,
    /// Clip the window's gradient at this global norm (0: no clipping).
    #[arg(long, value_name = "NORM", default_value_t = 1.0, value_parser = non_negative)]
    max_grad_norm: f64,
    /// Dropout everywhere the model has it (GPT-2: embeddings, attention, residuals; Llama:
    /// attention) [default: the config's; GPT-2's three rates must then agree].
    #[arg(long, value_name = "P", value_parser = non_negative)]
    dropout: Option<f64>,
    /// The held-out part: the last fraction of the text, from a paragraph break.
    #[arg(long, value_name = "F", default_value_t = 0.1, value_parser = non_negative)]
    val_fraction: f64,
    /// At most N held-out items scored after each epoch.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = at_least_one)]
    eval_items: usize,
    /// Seed of the shuffling and of dropout.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Take the items in the text's order (else shuffled each epoch, as the Trainer does).
    #[arg(long)]
    no_shuffle: bool,
    /// Compute precision of the micro-steps (bf16 or f16: values rounded to it where they are
    /// stored, f32 accumulators, optimizer state and master weights; f16 with dynamic loss
    /// scaling, reported at the end: with blocks it starts at 2^16 over each rank's tokens an
    /// update, where the Trainer's 2^16 on the loss over `num_items_in_batch` starts; with lines
    /// at 2^16).
    #[arg(long, value_enum, default_value_t = Compute::F32)]
    precision: Compute,
    /// Load a model whose tensors do not all match its config.json: load what matches,
    /// report the rest, and keep the others' initial values.
    #[arg(long)]
    non_strict: bool,
    /// LossMonitor: print the loss every N steps (0: never).
    #[arg(long, value_name = "N", default_value_t = 10)]
    print_every: usize,
    /// Write one JSON line per step ({"epoch", "step", "updates", "loss"}) and one per epoch
    /// ({"epoch", "updates", "loss", "perplexity"}); `cellgraph plot FILE` draws it.
    #[arg(long, value_name = "FILE")]
    loss_log: Option<PathBuf>,
    /// Text the fine-tuned model continues at the end (greedy) [default: the held-out
    /// part's first line, else a newline].
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate after --prompt (0: none).
    #[arg(long, value_name = "N", default_value_t = 20)]
    sample_tokens: usize,
    /// `cpu`, `cuda`, `cuda:N`, `wgpu` or `auto`.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Print the time spent per op and per kind of step at the end (rank 0's, the held-out
    /// scoring included).
    #[arg(long)]
    profile: bool,
    /// Replay each update's window of --micro-size micro-steps as one captured device graph
    /// (CUDA and wgpu; see `cellgraph train --graphs`). `--profile` turns it off.
    #[arg(long)]
    graphs: bool,
}

const FINETUNE_EXAMPLES: &str = "\
Defaults: 8 sequences per update in 4 micro-batches of 2, blocks of the model's context, AdamW(5e-5, no weight decay) with cosine decay to zero, clipping at norm 1.0,
token-weighted windows, the last tenth of the text held out, 1 epoch, seed 42.

Examples:
  cellgraph finetune --model tests/assets/tiny-gpt2 --data data/shakespeare/shakespeare.txt.gz \\
      --out tuned --steps 20 --block-size 64
  cellgraph finetune --model tests/assets/tiny-llama --data data/shakespeare/shakespeare.txt.gz \\
      --out tuned-llama --steps 20 --block-size 64
  cellgraph finetune --model gpt2 --data notes.txt --out gpt2-notes --split lines --batch-size 16 \\
      --micro-size 8 --lr 1e-4 --warmup 10 --epochs 3 --loss-log ft.jsonl";

/// Runs `cellgraph finetune` on this process's rank of `comm` (a world of one without
/// `mpirun`): each rank trains on its shard of every batch, rank 0 prints and saves.
pub fn finetune(args: FinetuneArgs, comm: Arc<dyn Communicator>) -> Res<()> {
    if !args.batch_size.is_multiple_of(args.micro_size) {
        return Err(format!(
            "--batch-size {} is not a multiple of --micro-size {}: each update slices its batch into K equal micro-batches",
            args.batch_size, args.micro_size
        )
        .into());
    }
    if args.pad_to_multiple_of.is_some() && args.split == Split::Blocks {
        return Err("--pad-to-multiple-of pads the batches of --split lines; --split blocks items are all --block-size tokens".into());
    }
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(format!("--val-fraction {} must be in [0, 1)", args.val_fraction).into());
    }
    if args.out.exists() && !args.out.is_dir() {
        return Err(format!("--out {} is a file; give a directory for the model", args.out.display()).into());
    }
    let (spec, msg) = device::choose(&args.device, comm.rank())?;
    if comm.rank() == 0 {
        println!("{msg}");
    }
    device::dispatch(spec, Finetune(&args, comm))?
}

struct Finetune<'a>(&'a FinetuneArgs, Arc<dyn Communicator>);

impl OnDevice for Finetune<'_> {
    type Output = Res<()>;
    fn run<B: Backend>(self, device: Device<B>) -> Res<()> {
        finetune_on::<B>(self.0, device, self.1)
    }
}

/// A UTF-8 text file or its gzip.
fn read_text(path: &Path) -> Res<String> {
    let bytes = cellgraph::runtime::data::read_gzip_or_plain(path).map_err(|e| format!("--data: {e}"))?;
    String::from_utf8(bytes)
        .map_err(|e| format!("--data {}: not UTF-8 text (at byte {}); save it as UTF-8", path.display(), e.utf8_error().valid_up_to()).into())
}

/// The text's training and held-out parts: the held-out part is the last `fraction`, from the
/// paragraph break (a blank line) at or after that point.
fn split_text(text: &str, fraction: f64) -> (&str, &str) {
    if fraction == 0.0 {
        return (text, "");
    }
    let mut at = ((text.len() as f64) * (1.0 - fraction)) as usize;
    while !text.is_char_boundary(at) {
        at += 1;
    }
    let cut = text[at..].find("\n\n").map_or(text.len(), |p| at + p + 2);
    text.split_at(cut)
}

fn as_ids(v: Vec<u32>) -> Vec<i32> {
    v.into_iter().map(|i| i as i32).collect()
}

/// The token lists of `part` (one for `Split::Blocks`, one per line for `Split::Lines`),
/// tokenized by rank 0 and handed to the other ranks.
fn token_lists(tok: &Tokenizer, part: &str, split: Split, comm: &dyn Communicator) -> Res<Vec<Vec<i32>>> {
    let mine = (comm.rank() == 0)
        .then(|| match split {
            Split::Blocks => tok.encode(part).map(|ids| vec![ids]),
            Split::Lines => part.split_inclusive('\n').map(|l| tok.encode(l)).collect(),
        })
        .transpose()?;
    // [lists, each list's length..., the ids...] as little-endian u32s.
    let bytes = mine.map(|lists| {
        let heads: Vec<u32> = std::iter::once(lists.len() as u32).chain(lists.iter().map(|l| l.len() as u32)).collect();
        heads.into_iter().chain(lists.into_iter().flatten()).flat_map(u32::to_le_bytes).collect()
    });
    let words: Vec<u32> = comm::share(comm, 0, bytes, "token ids")?.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let n = words[0] as usize;
    let mut at = 1 + n;
    Ok(words[1..=n]
        .iter()
        .map(|&len| {
            at += len as usize;
            as_ids(words[at - len as usize..at].to_vec())
        })
        .collect())
}

/// The items of the token lists (`name` in messages) for blocks of `block` tokens.
fn items(lists: Vec<Vec<i32>>, args: &FinetuneArgs, block: usize, name: &str) -> Res<TokenDataset> {
    Ok(match args.split {
        Split::Blocks => TokenDataset::windows(lists.into_iter().flatten().collect(), block, name)?,
        Split::Lines => TokenDataset::lines(lists, block, name)?.pad_to_multiple_of(args.pad_to_multiple_of.unwrap_or(1)),
    })
}

fn finetune_on<B: Backend>(args: &FinetuneArgs, device: Device<B>, comm: Arc<dyn Communicator>) -> Res<()> {
    let (rank, size) = (comm.rank(), comm.size());
    // Rank 0 speaks for the job.
    macro_rules! say {
        ($($t:tt)*) => {
            if rank == 0 {
                println!($($t)*);
            }
        };
    }
    let loaded = hf::load(&args.model, &LoadOptions { strict: !args.non_strict, dropout: args.dropout }).map_err(|e| format!("--model: {e}"))?;
    if !loaded.report.is_clean() {
        say!("--non-strict: {}", loaded.report);
    }
    let tok = Tokenizer::from_dir(&args.model).map_err(|e| format!("--model: {e}"))?;
    let config = loaded.config;
    if tok.vocab_size() > config.vocab_size() {
        return Err(format!("--model: the tokenizer has {} tokens, the model's vocab_size is {}", tok.vocab_size(), config.vocab_size()).into());
    }
    let block = args.block_size.unwrap_or(config.context());
    if block > config.context() {
        return Err(format!("--block-size {block} exceeds the model's {} {}", config.context_key(), config.context()).into());
    }
    let text = read_text(&args.data)?;
    let (train_text, val_text) = split_text(&text, args.val_fraction);
    let t0 = Instant::now();
    let mut train = items(token_lists(&tok, train_text, args.split, &*comm)?, args, block, "train")?;
    if !args.no_shuffle {
        train = train.shuffle(args.seed);
    }
    let train = train.batch(args.batch_size, true)?.shard(size, rank)?;
    train.check_batches().map_err(|e| format!("--data {}: {e}", args.data.display()))?;
    let val = if val_text.is_empty() {
        None
    } else {
        let v = items(token_lists(&tok, val_text, args.split, &*comm)?, args, block, "held-out")?;
        let n = v.len().min(args.eval_items);
        match n {
            0 => {
                say!("the held-out text has no item of {block} tokens: no validation (lower --block-size or raise --val-fraction)");
                None
            }
            n => Some(v.batch(n.min(8), false)?.take_batches(n.div_ceil(8))),
        }
    };
    say!(
        "{}: {} training items, {} held out, tokenized in {:.2} s",
        args.data.display(),
        train.len(),
        val.as_ref().map_or(0, |v| v.len()),
        t0.elapsed().as_secs_f64()
    );
    let steps = (train.dataset_size() * args.epochs).min(args.steps.unwrap_or(usize::MAX)) as u64;
    let schedule = LearningRate::Warmup {
        warmup: args.warmup.min(steps),
        then: Box::new(LearningRate::Cosine { base: args.lr, min: 0.0, total: steps.saturating_sub(args.warmup).max(1) }),
    };
    let backbone = config.network(&Scope::root())?;
    let loss = CrossEntropyLoss::new().ignore_index(IGNORE_INDEX as i64).tokens();
    let with_loss = WithLossCell { backbone, loss_fn: Box::new(loss) };
    let mut net = GradAccumulation::new(with_loss, args.micro_size).normalization(Normalization::Tokens);
    if args.max_grad_norm > 0.0 {
        net = net.clip_global_norm(args.max_grad_norm);
    }
    net.precision = match args.precision {
        Compute::F32 => None,
        Compute::Bf16 => Some(Precision::bf16()),
        // The loss sums over the window's tokens: with blocks (every position a token) the
        // scale starts where a mean loss's 2^16 would (as in Hugging Face's Trainer, which
        // divides by `num_items_in_batch`). Lines hold fewer tokens than their padded length:
        // there it starts at 2^16 and comes down on overflows.
        Compute::F16 => Some(Precision::f16().loss_scale(Some(match args.split {
            Split::Blocks => LossScale::default().for_sum_over(args.batch_size * block),
            Split::Lines => LossScale::default(),
        }))),
    };
    // torch.optim.AdamW's step (eps after the bias correction), as the Trainer takes.
    let optimizer = Adam::adamw(schedule, args.weight_decay).pytorch_eps();
    // The checkpoint's tensors become the parameters as they are: none is drawn first, none
    // copied.
    let (params, strict) = (loaded.params, !args.non_strict);
    let (model, _) = match size {
        1 => Model::<B>::pretrained(net, optimizer, device, args.seed, params, strict)?,
        _ => Model::<B>::parallel_pretrained(AutoParallel::new(net), optimizer, device, args.seed, comm.clone(), (params, strict))?,
    };
    let mut model = model.with_metrics(&[Metric::Loss]);
    model.accumulator_mut().options().set_profiling(args.profile);
    if args.graphs && args.profile {
        eprintln!("--graphs: off under --profile (it times each op)");
    } else if args.graphs {
        model.accumulator_mut().options().set_graphs(true)?;
        if args.split == Split::Lines && args.pad_to_multiple_of.is_none() {
            say!("--graphs with --split lines: each batch length is its own plan and graph ({} at most are captured); --pad-to-multiple-of N makes them fewer", cellgraph::runtime::replay::MAX_SHAPES);
        }
    }
    let mut log = args.loss_log.as_deref().filter(|_| rank == 0).map(|p| RunLog::open(p, false)).transpose()?;
    let out: Box<dyn std::io::Write> = if rank == 0 { Box::new(std::io::stdout()) } else { Box::new(std::io::sink()) };
    let mut loss_monitor = LossMonitor::to_writer(args.print_every, out);
    let mut time = TimeMonitor::new();
    let mut bar = ProgressBar::new();
    let mut stop = StopAfter { steps: 0, limit: args.steps.unwrap_or(usize::MAX) };
    if let Some(val) = &val {
        let v = model.eval(val)?["Loss"];
        say!("before: {{'Loss': {}, 'Perplexity': {}}}", py_float(v), py_float(v.exp()));
    }
    let mut secs = 0.0;
    for epoch in 1..=args.epochs {
        let started = Instant::now();
        {
            let mut cbs: Vec<&mut dyn Callback<B>> = vec![&mut loss_monitor, &mut stop];
            if rank == 0 {
                cbs.extend([&mut time as &mut dyn Callback<B>, &mut bar]);
            }
            if let Some(l) = log.as_mut() {
                cbs.push(l);
            }
            model.train(epoch, &train, &mut cbs)?;
        }
        secs += started.elapsed().as_secs_f64();
        if let Some(val) = &val {
            let v = model.eval(val)?["Loss"];
            say!("epoch: {epoch} {{'Loss': {}, 'Perplexity': {}}}", py_float(v), py_float(v.exp()));
            if let Some(l) = log.as_mut() {
                l.write(&serde_json::json!({"epoch": epoch, "updates": model.accumulator().updates(), "loss": v, "perplexity": v.exp()}))?;
            }
        }
        if model.position().epoch < epoch {
            break; // stopped by --steps
        }
    }
    if stop.steps == 0 {
        return Err("no update was taken; nothing was trained".into());
    }
    let sequences = stop.steps * args.batch_size * size;
    let ranks = if size > 1 { format!(" on {size} ranks") } else { String::new() };
    // Lines hold fewer tokens than a block (the rest is padding): their rate is in sequences.
    let rate = match args.split {
        Split::Blocks => format!("{:.0} tokens/s", (sequences * block) as f64 / secs),
        Split::Lines => format!("{:.0} sequences/s", sequences as f64 / secs),
    };
    say!("trained {} updates{ranks} in {secs:.2} s ({rate})", model.accumulator().updates());
    if let Some(scale) = model.accumulator().loss_scale() {
        let c = model.accumulator().counters();
        say!("{}", crate::train::loss_scaling_line(c.overflows, model.accumulator().updates() + c.skipped_updates, scale));
    }
    if rank == 0 {
        print!("{}", model.accumulator().session().profile_table(20));
        if let Some(report) = model.accumulator().session().replay_report() {
            print!("{report}");
        }
    }
    if rank > 0 {
        return Ok(());
    }
    // The network's parameters alone (no optimizer state): what the model directory holds.
    hf::save_values(&args.out, &config, &loaded.hf_config, &model.accumulator().parameter_values(), Some(&args.model))?;
    println!("saved {} ({}.from_pretrained and AutoTokenizer.from_pretrained load it)", args.out.display(), config.class());
    if args.sample_tokens > 0 {
        let first_line = val_text.lines().map(str::trim).find(|l| !l.is_empty()).map(|l| l.chars().take(64).collect::<String>() + " ");
        let text = args.prompt.clone().or(first_line).unwrap_or_else(|| "\n".into());
        let prompt = as_ids(tok.encode(&text)?);
        let ids = greedy(&mut model, &prompt, config.context(), config.vocab_size(), args.sample_tokens)?;
        let ids: Vec<u32> = ids.into_iter().map(|i| i as u32).collect();
        println!("sample: {text:?} -> {:?}", tok.decode(&ids)?);
    }
    Ok(())
}

/// `prompt` continued by `n` tokens, each the argmax of the model's logits over the last
/// `context` tokens (one plan on a full context: causal attention makes position `t` read only
/// tokens up to `t`, so the padding after the prompt does not matter).
fn greedy<B: Backend>(model: &mut Model<B>, prompt: &[i32], context: usize, vocab: usize, n: usize) -> Res<Vec<i32>> {
    let backbone = model.accumulator().network().backbone().ok_or("the network has no backbone")?;
    let (g, _) = cellgraph::cells::cell::trace_inference(backbone, "sample", &[("ids", TensorType::i32([1, context]))])?;
    let exe = compile(g)?;
    let mut ids = if prompt.is_empty() { vec![0] } else { prompt.to_vec() };
    for _ in 0..n {
        let window = &ids[ids.len().saturating_sub(context)..];
        let mut input = window.to_vec();
        input.resize(context, 0);
        let logits = model.accumulator_mut().run(&exe, &[HostTensor::i32(vec![1, context], input)?])?.remove(0).to_f32();
        let row = &logits[(window.len() - 1) * vocab..window.len() * vocab];
        let next = row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &l)| if l > best.1 { (i, l) } else { best }).0;
        ids.push(next as i32);
    }
    Ok(ids[prompt.len().max(1).min(ids.len())..].to_vec())
}

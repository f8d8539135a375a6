//! `cellgraph train` and `cellgraph eval`: MindSpore's `Model.train` / `Model.eval` from the
//! command line, on MNIST (LeNet5, the MLP), MNIST or CIFAR-10 as 3 x 32 x 32 images
//! (ResNet-18) and the Shakespeare characters (the GPT), each with its sample program's recipe.
//!
//! - `train`: a network (`--net lenet|mlp|resnet18|gpt`) wrapped in `GradAccumulation` (`--accumulation
//!   in-step|across-steps|boost`, `--micro-size`, `--normalization`), an optimizer, LossMonitor
//!   and TimeMonitor lines, a progress bar on a terminal, a JSON-lines log (`--loss-log`, read
//!   by `cellgraph plot`), a checkpoint (`--ckpt`) and resuming from one (`--resume`).
//! - `eval`: the network's parameters from a checkpoint, scored on the test split:
//!   `{'Accuracy': 0.9645}` (the GPT: the held-out text's loss per character, `{'Loss': 1.62}`).
//!
//! Every setting is checked before anything trains; errors are sentences (`error: ...`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, ValueEnum};

use cellgraph::prelude::*;
use cellgraph::runtime::burn_backend::tensor::Device;
use cellgraph::runtime::callback::py_float;
use std::sync::Arc;

use cellgraph::runtime::data::{
    create_dataset, create_eval_dataset, CharDataset, Cifar10, Cifar10Dataset, Corpus, ImageOp, Items, Mnist, MnistDataset, IGNORE_INDEX,
};
use cellgraph::runtime::device::{self, OnDevice};
use cellgraph::runtime::{checkpoint, Backend, Dataset, Metric, Position, ProgressBar, RunContext};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The networks the command line trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Net {
    /// LeNet5 (MindSpore's model zoo) on 32x32 images, softmax cross-entropy (mean).
    Lenet,
    /// The seed-002 MLP (`Network`: 784-512-512-10) on 28x28 images, CrossEntropyLoss.
    Mlp,
    /// torchvision's ResNet-18 (batch norm in training mode) on 3 x 32 x 32 images with
    /// CIFAR-10's augmentation: CIFAR-10 when `--data-path` holds its binary files, else the
    /// MNIST digits; Colossal-AI's recipe (SGD(0.1, momentum 0.9, weight decay 5e-4), the
    /// window's mean).
    Resnet18,
    /// The character-level GPT (4 layers, 4 heads, width 128, context 128) on the Shakespeare
    /// text (`--data-path`, a text file or gzip; the last tenth held out): gpt_accumulation's
    /// recipe (AdamW(3e-3, betas 0.9/0.99, weight decay 0.1), 10 warmup updates then cosine to
    /// lr/10, clipping at global norm 1.0, token-weighted windows).
    Gpt,
}

/// The GPT's shape (gpt_accumulation's defaults).
const GPT_CONTEXT: usize = 128;

/// Where micro-batches come from (see `GradAccumulation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Accumulation {
    /// `parallel.GradAccumulation(net, K)`: each batch is sliced into K micro-batches and the
    /// optimizer steps once per batch.
    InStep,
    /// The r1.6 tutorial's `mini_steps`: the optimizer steps once every K batches.
    AcrossSteps,
    /// `boost.GradientAccumulation(K)`: across K batches, gradients averaged.
    Boost,
}

/// How the window's summed gradient is scaled before the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Norm {
    /// The sum of the micro-batches' gradients (MindSpore's GradAccumulation).
    Sum,
    /// The mean over the window's micro-batches (PyTorch/Accelerate's `loss / K`, boost).
    Mean,
    /// The mean over the window's items (right when micro-batches differ in size).
    Item,
    /// The mean over the window's tokens (labels other than the ignored index; the GPT's).
    Tokens,
}

/// The micro-steps' compute precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Compute {
    F32,
    Bf16,
    /// f16 with dynamic loss scaling (`Precision::f16()`).
    F16,
}

/// The optimizers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Opt {
    /// `nn.Momentum(lr, 0.9)`.
    Momentum,
    /// `nn.SGD(lr)`.
    Sgd,
    /// `nn.Adam(lr)` (betas 0.9, 0.999).
    Adam,
    /// Adam with decoupled weight decay (`--weight-decay`, default 0.01).
    Adamw,
}

impl Net {
    /// The name on the command line.
    fn name(self) -> &'static str {
        match self {
            Net::Lenet => "lenet",
            Net::Mlp => "mlp",
            Net::Resnet18 => "resnet18",
            Net::Gpt => "gpt",
        }
    }

    /// Where its data is unless `--data-path` says.
    fn default_data(self) -> &'static str {
        match self {
            Net::Gpt => "data/shakespeare/shakespeare.txt.gz",
            _ => "data/mnist",
        }
    }

    /// What `eval` and `--eval-each-epoch` report.
    fn metric(self) -> Metric {
        match self {
            Net::Gpt => Metric::Loss,
            _ => Metric::Accuracy,
        }
    }
}

/// What one item is, for the throughput line.
fn items(net: Net) -> &'static str {
    match net {
        Net::Gpt => "sequences",
        _ => "images",
    }
}

/// Where the data is and where it runs (both `train` and `eval`).
#[derive(Args)]
pub struct Place {
    /// The data: a directory with the MNIST IDX files (`train-images-idx3-ubyte[.gz]`,
    /// `t10k-...`; default data/mnist), for resnet18 also CIFAR-10's `cifar-10-batches-bin`,
    /// for gpt a text file or its gzip (default data/shakespeare/shakespeare.txt.gz).
    #[arg(long, visible_alias = "data", value_name = "PATH")]
    data_path: Option<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N`, `wgpu` or `auto` (a CUDA GPU when the binary has the `cuda`
    /// feature and the machine has one, else the CPU).
    #[arg(long, default_value = "auto")]
    device: String,
}

/// Arguments of `cellgraph train`.
#[derive(Args)]
#[command(after_help = TRAIN_EXAMPLES)]
pub struct TrainArgs {
    /// The network.
    #[arg(long, value_enum, default_value_t = Net::Lenet)]
    net: Net,
    /// Images per batch: one step.
    #[arg(long, visible_alias = "batch", value_name = "N", default_value_t = 32, value_parser = at_least_one)]
    batch_size: usize,
    /// Gradient accumulation flavour.
    #[arg(long, value_enum, default_value_t = Accumulation::InStep)]
    accumulation: Accumulation,
    /// K: micro-batches per batch (in-step; the batch size must be a multiple of K), or batches
    /// per optimizer update (across-steps, boost). 1 is plain training.
    #[arg(long, value_name = "K", default_value_t = 4, value_parser = at_least_one)]
    micro_size: usize,
    /// Gradient normalisation at each update [default: sum; mean with boost and for resnet18;
    /// tokens for gpt].
    #[arg(long, value_enum)]
    normalization: Option<Norm>,
    /// Compute precision of the micro-steps: f32, bf16 or f16 (values rounded to it where
    /// they are stored, f32 accumulators and optimizer state; f16 with dynamic loss scaling,
    /// starting at 2^16, for the GPT's token-summed loss at 2^16 over the window's tokens, and
    /// reported at the end). On a CPU with AVX-512 BF16 products of bf16 values multiply bf16
    /// pairs; on a device the values its kernels read and write are stored in the type (half
    /// the bytes; bf16 on CUDA, f16 on CUDA and wgpu); elsewhere it is emulated in f32.
    #[arg(long, value_enum, default_value_t = Compute::F32)]
    precision: Compute,
    /// Under --precision bf16 or f16 on a device, keep every value in f32 storage (the
    /// emulation, the same bits).
    #[arg(long)]
    f32_storage: bool,
    /// Optimizer [default: momentum for lenet and resnet18, sgd for mlp, adamw for gpt].
    #[arg(long, value_enum)]
    optimizer: Option<Opt>,
    /// Learning rate [default: 0.01; 0.1 for resnet18; 0.001 for adam and adamw, 0.003 for
    /// gpt (its peak: 10 warmup updates, then cosine to a tenth)].
    #[arg(long, value_name = "LR", allow_negative_numbers = true, value_parser = non_negative)]
    lr: Option<f64>,
    /// Weight decay [default: 0; 0.01 for adamw; 5e-4 for resnet18, 0.1 for gpt].
    #[arg(long, value_name = "WD", allow_negative_numbers = true, value_parser = non_negative)]
    weight_decay: Option<f64>,
    /// Epochs to train, counting those a resumed checkpoint has done.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one)]
    epochs: usize,
    /// Stop after N steps (batches) of this run; the checkpoint resumes from there.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    steps: Option<usize>,
    /// Seed of the parameters' initial values and of the shuffling.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    place: Place,
    /// LossMonitor: print the loss every N steps (0: never).
    #[arg(long, value_name = "N", default_value_t = 100)]
    print_every: usize,
    /// Save a checkpoint here at the end of every epoch and at the end (`.ckpt`: MindSpore's
    /// format; otherwise safetensors). It holds everything `--resume` needs.
    #[arg(long, value_name = "PATH")]
    ckpt: Option<PathBuf>,
    /// Continue from a checkpoint written by `--ckpt` (same --net, --optimizer and
    /// --accumulation), at the epoch and step where it was taken.
    #[arg(long, value_name = "PATH")]
    resume: Option<PathBuf>,
    /// Write one JSON line per step ({"epoch", "step", "updates", "loss"}) and, with
    /// --eval-each-epoch, one per epoch ({"epoch", "updates", "accuracy"}); appended to under
    /// --resume. `cellgraph plot FILE` draws it.
    #[arg(long, value_name = "FILE")]
    loss_log: Option<PathBuf>,
    /// Score the test split after every epoch and print `{'Accuracy': ...}`.
    #[arg(long)]
    eval_each_epoch: bool,
    /// Print the time spent per op at the end.
    #[arg(long)]
    profile: bool,
    /// Let device matmuls and convolutions round f32 operands to TF32 on tensor cores (faster on GPUs that have
    /// them; about 1e-3 relative error per product, like PyTorch's `allow_tf32`), and
    /// attention's forward run on cubek's flash attention in f16 fragments where its width is a
    /// multiple of 128. Off: every backend multiplies in exact f32. The CPU has none (it says so).
    #[arg(long)]
    tf32: bool,
    /// Replay device steps as the graphs captured from them (CUDA and wgpu): a window of
    /// in-step accumulation in one launch, a micro-step of across-steps accumulation in one.
    /// An opt-in until it is checked against the CPU on CUDA; `--profile` (per-op times) turns
    /// it off.
    #[arg(long)]
    graphs: bool,
}

const TRAIN_EXAMPLES: &str = "\
Defaults: LeNet5, in-step accumulation with K = 4 (each batch of 32 sliced into 4 micro-batches
of 8, summed), Momentum(0.01, 0.9), 1 epoch, seed 1 (the MLP: SGD(0.01); ResNet-18 and the GPT:
their sample programs' recipes, see --net). One step is one batch.

Examples:
  cellgraph train --epochs 10 --ckpt lenet.ckpt --loss-log loss.jsonl --eval-each-epoch
  cellgraph train --net mlp --accumulation across-steps --micro-size 8 --normalization mean
  cellgraph train --net resnet18 --steps 40 --eval-each-epoch
  cellgraph train --net gpt --steps 60 --precision bf16 --eval-each-epoch
  cellgraph train --epochs 10 --resume lenet.ckpt --ckpt lenet.ckpt --loss-log loss.jsonl
  cellgraph eval --ckpt lenet.ckpt
  cellgraph plot loss.jsonl -o loss.svg";

/// Arguments of `cellgraph eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// The network the checkpoint holds.
    #[arg(long, value_enum, default_value_t = Net::Lenet)]
    net: Net,
    /// Images per batch (scores do not depend on it).
    #[arg(long, visible_alias = "batch", value_name = "N", default_value_t = 32, value_parser = at_least_one)]
    batch_size: usize,
    /// A checkpoint of the network (written by `cellgraph train --ckpt`, or MindSpore's).
    #[arg(long, value_name = "PATH")]
    ckpt: PathBuf,
    #[command(flatten)]
    place: Place,
}

/// A clap value parser: a whole number >= 1.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("expected a whole number, got `{s}`")),
    }
}

pub fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        Ok(x) => Err(format!("must be a finite number >= 0 (such as 0.01), got {x}")),
        Err(_) => Err(format!("expected a number such as 0.01, got `{s}`")),
    }
}

/// The network with its loss (`vocab`: the GPT's characters).
fn with_loss(net: Net, vocab: usize) -> Res<WithLossCell> {
    Ok(match net {
        Net::Lenet => WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean)),
        Net::Mlp => WithLossCell::new(Network::new(&Scope::root()), CrossEntropyLoss::new()),
        Net::Resnet18 => WithLossCell::new(ResNet18::new(&Scope::root(), 10), CrossEntropyLoss::new()),
        Net::Gpt => {
            let config = GptConfig {
                vocab_size: vocab,
                context: GPT_CONTEXT,
                layers: 4,
                heads: 4,
                width: 128,
                layer_norm_eps: 1e-5,
                dropout: 0.0,
                gelu_approximate: false,
            };
            WithLossCell::new(GPT::new(&Scope::root(), config)?, CrossEntropyLoss::new().ignore_index(IGNORE_INDEX as i64).tokens())
        }
    })
}

/// Where a network's data is: each split is read when asked for (training reads the test split
/// only for `--eval-each-epoch`, `eval` never reads the training split).
struct Source<'a> {
    net: Net,
    path: &'a Path,
    batch: usize,
    /// ResNet-18: CIFAR-10's binary files are at `path` (else the MNIST digits stand in).
    cifar: bool,
    /// The GPT: the text, read once, and its training and held-out parts.
    corpus: Option<(Arc<Corpus>, std::ops::Range<usize>, std::ops::Range<usize>)>,
}

impl<'a> Source<'a> {
    /// `net`'s data at `path`, in batches of `batch` (the GPT's text is read here).
    fn open(net: Net, path: &'a Path, batch: usize) -> Res<Self> {
        let cifar = net == Net::Resnet18 && path.join("data_batch_1.bin").is_file();
        if net == Net::Resnet18 && !cifar {
            println!("--net resnet18: the MNIST digits in {} as 3 x 32 x 32 images (CIFAR-10's binary files are not there)", path.display());
        }
        let corpus = match net {
            Net::Gpt => {
                let corpus = Arc::new(Corpus::load(path)?);
                let (train, held_out) = corpus.split(0.1);
                Some((corpus, train, held_out))
            }
            _ => None,
        };
        Ok(Source { net, path, batch, cifar, corpus })
    }

    /// The GPT's characters (0 for the image networks).
    fn vocab(&self) -> usize {
        self.corpus.as_ref().map_or(0, |(c, _, _)| c.vocab_size())
    }

    /// ResNet-18's images of a split (`train` or `test`).
    fn images(&self, split: &str) -> Res<Cifar10> {
        Ok(match self.cifar {
            true => Cifar10::load(self.path, split)?,
            false => Cifar10::from_mnist(&Mnist::load(self.path, if split == "train" { "train" } else { "t10k" })?),
        })
    }

    /// The training split, shuffled each epoch: LeNet's `create_dataset`, the MLP's pipeline,
    /// CIFAR-10's augmentation, the GPT's windows of `GPT_CONTEXT + 1` characters.
    fn train(&self, seed: u64) -> Res<Box<dyn Dataset>> {
        let (path, batch) = (self.path, self.batch);
        Ok(match (self.net, &self.corpus) {
            (Net::Lenet, _) => Box::new(create_dataset(path, "train", batch, 1, seed)?),
            (Net::Mlp, _) => Box::new(MnistDataset::new(path, "train")?.map(mlp_ops()).shuffle(seed).batch(batch, false)?),
            (Net::Resnet18, _) => Box::new(Cifar10Dataset::new(self.images("train")?).augment(seed).shuffle(seed).batch(batch, true)?),
            (Net::Gpt, Some((corpus, train, _))) => Box::new(
                CharDataset::new(corpus.clone(), train.clone(), Items::Windows, GPT_CONTEXT, "Shakespeare train")?
                    .shuffle(seed)
                    .batch(batch, true)?,
            ),
            (Net::Gpt, None) => unreachable!("`open` reads the GPT's text"),
        })
    }

    /// The test split in order, every item scored.
    fn test(&self) -> Res<Box<dyn Dataset>> {
        let (path, batch) = (self.path, self.batch);
        Ok(match (self.net, &self.corpus) {
            (Net::Lenet, _) => Box::new(create_eval_dataset(path, "t10k", batch)?),
            (Net::Mlp, _) => Box::new(MnistDataset::new(path, "t10k")?.map(mlp_ops()).batch(batch, false)?),
            (Net::Resnet18, _) => Box::new(Cifar10Dataset::new(self.images("test")?).batch(batch, false)?),
            (Net::Gpt, Some((corpus, _, held_out))) => Box::new(
                CharDataset::new(corpus.clone(), held_out.clone(), Items::Windows, GPT_CONTEXT, "Shakespeare held-out")?.batch(batch, false)?,
            ),
            (Net::Gpt, None) => unreachable!("`open` reads the GPT's text"),
        })
    }
}

/// The seed-002 MLP's pipeline: 28x28, scaled to [0, 1] and standardised.
fn mlp_ops() -> [ImageOp; 3] {
    [ImageOp::Rescale { rescale: 1.0 / 255.0, shift: 0.0 }, ImageOp::Normalize { mean: 0.1307, std: 0.3081 }, ImageOp::Hwc2Chw]
}

impl TrainArgs {
    fn optimizer(&self) -> Opt {
        self.optimizer.unwrap_or(match self.net {
            Net::Lenet | Net::Resnet18 => Opt::Momentum,
            Net::Mlp => Opt::Sgd,
            Net::Gpt => Opt::Adamw,
        })
    }

    fn lr(&self) -> f64 {
        self.lr.unwrap_or(match (self.net, self.optimizer()) {
            (Net::Gpt, Opt::Adamw) => 3e-3,
            (_, Opt::Adam | Opt::Adamw) => 1e-3,
            (Net::Resnet18, _) => 0.1,
            _ => 1e-2,
        })
    }

    fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(match (self.net, self.optimizer()) {
            (Net::Gpt, Opt::Adamw) => 0.1,
            (_, Opt::Adamw) => 0.01,
            (Net::Resnet18, _) => 5e-4,
            _ => 0.0,
        })
    }

    fn network(&self, vocab: usize) -> Res<GradAccumulation> {
        let (net, k) = (with_loss(self.net, vocab)?, self.micro_size);
        let acc = match self.accumulation {
            Accumulation::InStep => GradAccumulation::new(net, k),
            Accumulation::AcrossSteps => GradAccumulation::across_steps(net, k),
            Accumulation::Boost => GradAccumulation::boost(net, k),
        };
        let norm = self.normalization.or(match self.net {
            Net::Resnet18 => Some(Norm::Mean),
            Net::Gpt => Some(Norm::Tokens),
            _ => None,
        });
        let mut acc = match norm {
            None => acc,
            Some(Norm::Sum) => acc.normalization(Normalization::Sum),
            Some(Norm::Mean) => acc.normalization(Normalization::Mean),
            Some(Norm::Item) => acc.normalization(Normalization::ItemWeighted),
            Some(Norm::Tokens) => acc.normalization(Normalization::Tokens),
        };
        if self.net == Net::Gpt {
            acc = acc.clip_global_norm(1.0);
        }
        match self.precision {
            Compute::F32 => {}
            Compute::Bf16 => acc = acc.precision(Precision::bf16()),
            // The GPT's loss sums over its tokens (whatever the normalization): the scale starts
            // where a mean loss's 2^16 would (as in Hugging Face's Trainer), not log2(tokens)
            // overflowing windows above it. A window is one batch in-step, else k (boost too).
            Compute::F16 if self.net == Net::Gpt => {
                let steps = if self.accumulation == Accumulation::InStep { 1 } else { k };
                let scale = LossScale::default().for_sum_over(self.batch_size * steps * GPT_CONTEXT);
                acc = acc.precision(Precision::f16().loss_scale(Some(scale)));
            }
            Compute::F16 => acc = acc.precision(Precision::f16()),
        }
        Ok(acc)
    }

    /// The model with the chosen optimizer; `updates`: how many the run makes in all (the
    /// GPT's cosine schedule ends there).
    fn model<B: Backend>(&self, device: Device<B>, vocab: usize, updates: u64) -> Res<Model<B>> {
        let (net, lr, wd, seed) = (self.network(vocab)?, self.lr(), self.weight_decay(), self.seed);
        let model = match self.optimizer() {
            Opt::Momentum => Model::new(net, Momentum { weight_decay: wd, ..Momentum::new(lr, 0.9) }, device, seed)?,
            Opt::Sgd => Model::new(net, SGD { weight_decay: wd, ..SGD::new(lr) }, device, seed)?,
            Opt::Adam => Model::new(net, Adam { weight_decay: wd, ..Adam::new(lr) }, device, seed)?,
            Opt::Adamw if self.net == Net::Gpt => {
                let warmup = 10;
                let then = LearningRate::Cosine { base: lr, min: lr / 10.0, total: updates.saturating_sub(warmup).max(1) };
                let schedule = LearningRate::Warmup { warmup, then: Box::new(then) };
                Model::new(net, Adam { beta2: 0.99, ..Adam::adamw(schedule, wd) }, device, seed)?
            }
            Opt::Adamw => Model::new(net, Adam::adamw(lr, wd), device, seed)?,
        };
        Ok(model.with_metrics(&[self.net.metric()]))
    }

    /// What can be checked from the flags alone.
    fn check(&self) -> Res<()> {
        let (b, k) = (self.batch_size, self.micro_size);
        if self.normalization == Some(Norm::Tokens) && self.net != Net::Gpt {
            return Err(format!("--normalization tokens weighs a window by its tokens: it is for --net gpt, not --net {}", self.net.name()).into());
        }
        if self.accumulation == Accumulation::InStep && b % k != 0 {
            let (lo, hi) = ((b / k).max(1) * k, (b / k + 1) * k);
            return Err(format!(
                "--batch-size {b} is not a multiple of --micro-size {k}: in-step accumulation slices each batch into {k} equal micro-batches; use --batch-size {lo} or {hi}, another --micro-size, or --accumulation across-steps"
            )
            .into());
        }
        if let Some(r) = self.resume.as_ref().filter(|r| !r.is_file()) {
            return Err(format!("--resume {}: no such checkpoint file (write one with --ckpt, or drop --resume to start afresh)", r.display()).into());
        }
        Ok(())
    }
}

/// Runs `cellgraph train`.
pub fn train(args: TrainArgs) -> Res<()> {
    args.check()?;
    let (spec, msg) = device::choose(&args.place.device, 0)?;
    println!("{msg}");
    device::dispatch(spec, Train(&args))?
}

/// Runs `cellgraph eval`.
pub fn eval(args: EvalArgs) -> Res<()> {
    let (spec, msg) = device::choose(&args.place.device, 0)?;
    eprintln!("{msg}");
    device::dispatch(spec, Eval(&args))?
}

struct Train<'a>(&'a TrainArgs);

impl OnDevice for Train<'_> {
    type Output = Res<()>;
    fn run<B: Backend>(self, device: Device<B>) -> Res<()> {
        train_on::<B>(self.0, device)
    }
}

struct Eval<'a>(&'a EvalArgs);

impl OnDevice for Eval<'_> {
    type Output = Res<()>;
    fn run<B: Backend>(self, device: Device<B>) -> Res<()> {
        eval_on::<B>(self.0, device)
    }
}

fn train_on<B: Backend>(args: &TrainArgs, device: Device<B>) -> Res<()> {
    let path = args.place.data_path.clone().unwrap_or_else(|| args.net.default_data().into());
    let source = Source::open(args.net, &path, args.batch_size)?;
    let train = source.train(args.seed)?;
    let test = if args.eval_each_epoch { Some(source.test()?) } else { None };
    let (ds, test) = (&*train, test.as_deref());
    let updates = {
        let steps = (ds.dataset_size() * args.epochs).min(args.steps.unwrap_or(usize::MAX)) as u64;
        if args.accumulation == Accumulation::InStep {
            steps
        } else {
            steps.div_ceil(args.micro_size as u64)
        }
    };
    let mut model = args.model::<B>(device, source.vocab(), updates)?;
    // MindSpore's save_graphs, read once here (see docs/ir-and-passes.md: graph dumps).
    if let Some(opts) = cellgraph::compiler::dump::DumpOptions::from_env()? {
        model.save_graphs(opts)?;
    }
    if let Some(path) = &args.resume {
        model.load_checkpoint(path).map_err(|e| format!("--resume: {e}; resume with the --net and --optimizer that wrote it"))?;
        let p = model.position();
        if p.epoch >= args.epochs {
            return Err(format!(
                "--resume {}: the checkpoint has already trained {} epoch(s); --epochs counts every epoch, those done included: ask for --epochs {} or more",
                path.display(),
                p.epoch,
                p.epoch + 1
            )
            .into());
        }
        println!("resumed from {} {} ({} updates)", path.display(), place(p), model.accumulator().updates());
    }
    if let Some(path) = &args.ckpt {
        checkpoint::check_writable(path)?;
    }
    let mut log = args.loss_log.as_deref().map(|p| RunLog::open(p, args.resume.is_some())).transpose()?;
    model.accumulator_mut().options().set_profiling(args.profile);
    model.accumulator_mut().options().set_tf32(args.tf32);
    if args.tf32 && B::HOST {
        eprintln!("--tf32: the CPU has no TF32 (a mode of GPU tensor cores): its products stay exact f32");
    }
    model.accumulator_mut().options().set_low_precision_storage(!args.f32_storage);
    if args.graphs && args.profile {
        eprintln!("--graphs: off under --profile (it times each op)");
    } else if args.graphs {
        model.accumulator_mut().options().set_graphs(true)?;
    }
    let before = (model.accumulator().updates(), model.accumulator().counters());
    let t0 = Instant::now();
    let steps = run_epochs(args, &mut model, ds, test, log.as_mut())?;
    let secs = t0.elapsed().as_secs_f64();
    let updates = model.accumulator().updates() - before.0;
    let p = model.position();
    let per_second = (steps * args.batch_size) as f64 / secs;
    let tokens = if args.net == Net::Gpt { format!(", {:.0} tokens/s", per_second * GPT_CONTEXT as f64) } else { String::new() };
    println!("trained {steps} steps, {updates} optimizer updates in {secs:.2} s ({per_second:.0} {}/s{tokens})", items(args.net));
    // f16's dynamic loss scaling: the windows whose gradients overflowed made no update.
    if let Some(scale) = model.accumulator().loss_scale() {
        let c = model.accumulator().counters();
        let windows = updates + c.skipped_updates - before.1.skipped_updates;
        println!("{}", loss_scaling_line(c.overflows - before.1.overflows, windows, scale));
    }
    if let Some(p) = model.accumulator().micro_plans().find_map(|e| e.bf16_products::<B>()) {
        println!("{p}");
    }
    // What a device stored in bf16 / f16 of the micro-step.
    if let Some(s) = model.accumulator_mut().low_precision_storage().filter(|_| !B::HOST) {
        println!("{s}");
    }
    // Products asked for tensor cores (`--tf32`, bf16 values') that ran in exact f32 here.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if !B::HOST && cellgraph::runtime::cube::tf32_fallbacks() > 0 {
        let (all, convs) = (cellgraph::runtime::cube::tf32_fallbacks(), cellgraph::runtime::cube::conv_tf32_fallbacks());
        println!("tensor-core products run in exact f32 (no tensor-core kernel on this device): {all} ({convs} of them convolutions)");
        for why in cellgraph::runtime::cube::cubek_refusals() {
            println!("  cubek's first refusal, {why}");
        }
    }
    if let Some(report) = model.accumulator().session().replay_report() {
        print!("{report}");
    }
    if let Some(path) = &args.ckpt {
        model.save_checkpoint(path)?;
        println!("saved {} {} ({} updates)", path.display(), place(p), model.accumulator().updates());
    }
    for (op, calls, t) in model.accumulator().session().profile() {
        println!("{op:>28} {calls:>8} calls {:>10.1} ms", t * 1e3);
    }
    Ok(())
}

/// Where training stands, in words: `after epoch 2`, `at epoch 1 step 3`.
fn place(p: Position) -> String {
    match p.step {
        0 => format!("after epoch {}", p.epoch),
        s => format!("at epoch {} step {s}", p.epoch + 1),
    }
}

/// Trains epoch by epoch up to `--epochs` (scoring after each with `--eval-each-epoch`);
/// returns the steps taken.
fn run_epochs<B: Backend>(
    args: &TrainArgs,
    model: &mut Model<B>,
    ds: &dyn Dataset,
    test: Option<&dyn Dataset>,
    mut log: Option<&mut RunLog>,
) -> Res<usize> {
    let mut loss = LossMonitor::new(args.print_every);
    let mut time = TimeMonitor::new();
    let mut bar = ProgressBar::new();
    let mut stop = StopAfter { steps: 0, limit: args.steps.unwrap_or(usize::MAX) };
    let mut save = SaveEachEpoch(args.ckpt.clone());
    while model.position().epoch < args.epochs {
        let epoch = model.position().epoch + 1;
        {
            let mut cbs: Vec<&mut dyn Callback<B>> = vec![&mut loss, &mut time, &mut bar, &mut stop, &mut save];
            if let Some(l) = log.as_deref_mut() {
                cbs.push(l);
            }
            model.train(epoch, ds, &mut cbs)?;
        }
        if model.position().epoch < epoch {
            break; // stopped by --steps
        }
        if let Some(test) = test {
            let (name, key) = match args.net.metric() {
                Metric::Loss => ("Loss", "loss"),
                _ => ("Accuracy", "accuracy"),
            };
            let v = model.eval(test)?[name];
            println!("epoch: {epoch} {{'{name}': {}}}", py_float(v));
            if let Some(l) = log.as_deref_mut() {
                l.write(&serde_json::json!({"epoch": epoch, "updates": model.accumulator().updates(), key: v}))?;
            }
        }
    }
    if stop.steps == 0 {
        return Err("no step was taken (the data gives no batch?); nothing was trained".into());
    }
    Ok(stop.steps)
}

fn eval_on<B: Backend>(args: &EvalArgs, device: Device<B>) -> Res<()> {
    let path = args.place.data_path.clone().unwrap_or_else(|| args.net.default_data().into());
    let source = Source::open(args.net, &path, args.batch_size)?;
    let test = source.test()?;
    let net = GradAccumulation::new(with_loss(args.net, source.vocab())?, 1);
    let names: Vec<String> = net.parameters().into_iter().map(|p| p.name).collect();
    let (tensors, _) = checkpoint::load(&args.ckpt)?;
    let missing: Vec<&str> = names.iter().filter(|n| !tensors.contains_key(*n)).map(String::as_str).collect();
    if !missing.is_empty() {
        let others: Vec<&str> = Net::value_variants().iter().filter(|n| **n != args.net).map(|n| n.name()).collect();
        let shown: Vec<&str> = missing.iter().take(4).copied().collect();
        return Err(format!(
            "{}: not a checkpoint of --net {}: it lacks {} of the network's {} parameters ({}{}); was it written with another --net ({})?",
            args.ckpt.display(),
            args.net.name(),
            missing.len(),
            names.len(),
            shown.join(", "),
            if missing.len() > shown.len() { ", ..." } else { "" },
            others.join(", ")
        )
        .into());
    }
    // Only the network's parameters: the optimizer state and counters do not score. They
    // become the model's as they are (none drawn from a seed first, none copied).
    let params = tensors.into_iter().filter(|(k, _)| names.contains(k)).collect();
    let (model, _) = Model::<B>::pretrained(net, SGD::new(0.0), device, 1, params, true)?;
    let mut model = model.with_metrics(&[args.net.metric()]);
    let name = if args.net.metric() == Metric::Loss { "Loss" } else { "Accuracy" };
    let v = model.eval(&*test)?[name];
    println!("{{'{name}': {}}}", py_float(v));
    Ok(())
}

/// Stops training after `limit` steps of this run (`--steps`).
pub(crate) struct StopAfter {
    pub(crate) steps: usize,
    pub(crate) limit: usize,
}

impl<B: Backend> Callback<B> for StopAfter {
    fn step_end(&mut self, cx: &mut RunContext<B>) -> cellgraph::runtime::Result<()> {
        self.steps += 1;
        if self.steps >= self.limit {
            cx.request_stop();
        }
        Ok(())
    }
}

/// Saves the checkpoint at the end of every epoch (`--ckpt`), so a crash loses one epoch.
struct SaveEachEpoch(Option<PathBuf>);

impl<B: Backend> Callback<B> for SaveEachEpoch {
    fn epoch_end(&mut self, cx: &mut RunContext<B>) -> cellgraph::runtime::Result<()> {
        match &self.0 {
            Some(path) => checkpoint::save(path, &cellgraph::runtime::callback::snapshot_at(cx.accumulator, cx.position), &Default::default()),
            None => Ok(()),
        }
    }
}

/// The summary of f16's dynamic loss scaling over a run: `overflowed` of `windows` windows
/// overflowed and made no update; `scale` is the scale now.
pub(crate) fn loss_scaling_line(overflowed: u64, windows: u64, scale: f64) -> String {
    let why = if overflowed == 0 {
        String::new()
    } else {
        // The scale halves on each overflow: a run's first windows find its level.
        " (their gradients overflowed f16 at the scale then: no update made, the scale halved, as PyTorch's GradScaler does)".into()
    };
    format!("f16 loss scaling: {overflowed} of {windows} windows skipped{why}; loss scale now {scale}")
}

/// The run's JSON-lines log: `LossLog`'s step lines (`{"epoch", "step", "updates", "loss"}`)
/// and, in the same file, the per-epoch accuracy lines; appended to when resuming.
pub(crate) struct RunLog {
    file: std::fs::File,
    path: PathBuf,
}

impl RunLog {
    pub(crate) fn open(path: &Path, append: bool) -> Res<RunLog> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("--loss-log {}: {e}", path.display()))?;
        }
        let file = std::fs::OpenOptions::new().create(true).write(true).append(append).truncate(!append).open(path);
        let file = file.map_err(|e| format!("--loss-log {}: {e}", path.display()))?;
        Ok(RunLog { file, path: path.into() })
    }

    pub(crate) fn write(&mut self, line: &serde_json::Value) -> cellgraph::runtime::Result<()> {
        writeln!(self.file, "{line}").map_err(|source| cellgraph::runtime::RuntimeError::Io { path: self.path.display().to_string(), source })
    }
}

impl<B: Backend> Callback<B> for RunLog {
    fn step_end(&mut self, cx: &mut RunContext<B>) -> cellgraph::runtime::Result<()> {
        let mut line = serde_json::json!({"epoch": cx.epoch, "step": cx.step, "updates": cx.accumulator.updates(), "loss": cx.loss()});
        // Under f16 the loss scale after the step (halved where its window overflowed).
        if let Some(scale) = cx.accumulator.loss_scale() {
            line["loss_scale"] = scale.into();
        }
        self.write(&line)
    }
}

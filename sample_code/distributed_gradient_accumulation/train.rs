//! MindSpore's distributed gradient accumulation sample (seed 002), for cellgraph.
//!
//! ```python
//! init()
//! net = GradAccumulation(nn.WithLossCell(net, loss_fn), 4)
//! net = AutoParallel(net); net.hsdp()
//! model = ms.Model(net, optimizer=optimizer)
//! model.train(10, data_set, callbacks=[loss_cb])
//! ```
//!
//! Launched by `run.sh` as `mpirun -n 8`; started alone it is a world of one. Each rank reads
//! its shard of the training images, writes its LossMonitor lines to
//! `<log-dir>/worker_<rank>.log` (rank 0 also prints them), and rank 0 reports throughput,
//! the bytes reduced per update and the test accuracy.
//!
//! `--net resnet18` runs Colossal-AI's ResNet-18 example (seeds 000/004) the same way:
//! `GradAccumulation::across_steps(.., 4)` with mean normalisation, SGD(0.1, momentum 0.9,
//! weight decay 5e-4), 128 images per rank and step, CIFAR-10's augmentation, and gradients
//! averaged across ranks once per window (TorchDDPPlugin + `no_sync`: replicated optimizer).
//! `--data-path` may hold CIFAR-10's binary files; otherwise the MNIST digits stand in.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use cellgraph::cells::AutoParallel;
use cellgraph::prelude::*;
use cellgraph::runtime::burn_backend::tensor::Device;
use cellgraph::runtime::comm::{self, Communicator};
use cellgraph::runtime::data::{create_dataset, Cifar10, Cifar10Dataset, ImageOp, MnistDataset};
use cellgraph::runtime::device::{self, OnDevice};
use cellgraph::runtime::Backend;

#[derive(Parser)]
#[command(about = "cellgraph distributed gradient accumulation (MindSpore seed 002): run under mpirun", allow_negative_numbers = true)]
struct Args {
    /// Directory with the MNIST IDX files (with `--net resnet18`: CIFAR-10's binary files, or
    /// MNIST's, which then stand in).
    #[arg(long, default_value = "data/mnist")]
    data_path: PathBuf,
    /// `mlp` (the seed's Network, SGD 1e-2), `lenet` (LeNet5, Momentum(0.01, 0.9)) or
    /// `resnet18` (Colossal-AI's example: SGD(0.1, 0.9, weight decay 5e-4), batch 128).
    #[arg(long, default_value = "mlp")]
    net: String,
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Per-rank batch size (sliced into `micro-size` micro-batches; with `--net resnet18` one
    /// micro-batch per step, 128 by default).
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long, default_value_t = 4)]
    micro_size: usize,
    /// Replicate the optimizer state instead of sharding it (hsdp).
    #[arg(long)]
    no_hsdp: bool,
    /// Average gradients across ranks (MindSpore's enable_gradients_mean) instead of summing.
    #[arg(long)]
    gradients_mean: bool,
    /// LossMonitor's per_print_times (100; with `--net resnet18`, whose epoch is a few steps
    /// per rank, once per epoch).
    #[arg(long)]
    print_every: Option<usize>,
    #[arg(long, default_value = "log_output")]
    log_dir: PathBuf,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Learning rate (0.01; 0.1 with `--net resnet18`).
    #[arg(long)]
    lr: Option<f64>,
    /// Rank 0 saves the trained model here at the end (`.ckpt` or `.safetensors`).
    #[arg(long)]
    ckpt: Option<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N`, `wgpu` or `auto` (a CUDA GPU when there is one, rank r taking
    /// GPU r % count; the CPU otherwise).
    #[arg(long, default_value = "auto")]
    device: String,
    /// With `--net resnet18`: SyncBatchNorm (each micro-step normalises with the statistics of
    /// every rank's micro-batch; four collectives per batch norm per micro-step).
    #[arg(long)]
    sync_bn: bool,
    /// Replay each device window (in-step: its micro-steps together) or micro-step (across
    /// steps) as the graph captured from it (an opt-in; see docs/devices.md, "CUDA graph
    /// replay").
    #[arg(long)]
    graphs: bool,
    /// Test hook: this rank panics at the given step (`RANK:STEP`).
    #[arg(long, hide = true)]
    panic_at: Option<String>,
}

/// Rank 0's log lines go to the terminal too.
struct Tee(std::fs::File, bool);

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.1 {
            std::io::stdout().write_all(buf)?;
        }
        self.0.write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stdout().flush()?;
        self.0.flush()
    }
}

/// Panics at a chosen step on a chosen rank (for the failure tests).
struct PanicAt(usize);

impl<B: Backend> Callback<B> for PanicAt {
    fn step_end(&mut self, cx: &mut cellgraph::runtime::RunContext<B>) -> cellgraph::runtime::Result<()> {
        if cx.step == self.0 {
            panic!("test hook: rank {} panics at step {}", cx.accumulator.rank(), cx.step);
        }
        Ok(())
    }
}

/// One rank's training, on the backend `--device` chose, logging to its worker log.
struct Train<'a>(&'a Args, Arc<dyn Communicator>, std::fs::File);

impl OnDevice for Train<'_> {
    type Output = Result<(), Box<dyn std::error::Error>>;
    fn run<B: Backend>(self, device: Device<B>) -> Self::Output {
        train::<B>(self.0, self.1, device, self.2)
    }
}

fn train<B: Backend>(args: &Args, comm: Arc<dyn Communicator>, device: Device<B>, log: std::fs::File) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, size) = (comm.rank(), comm.size());
    if args.epochs == 0 {
        return Err("--epochs must be at least 1".into());
    }
    if args.sync_bn && args.net != "resnet18" {
        return Err(format!("--sync-bn synchronises batch norms: it needs --net resnet18 (`{}` has none)", args.net).into());
    }
    // Found now, not after training: rank 0 writes the checkpoint at the end.
    if let (Some(path), 0) = (&args.ckpt, rank) {
        cellgraph::runtime::checkpoint::check_writable(path)?;
    }
    let batch = args.batch_size.unwrap_or(if args.net == "resnet18" { 128 } else { 32 });
    let lr = args.lr.unwrap_or(if args.net == "resnet18" { 0.1 } else { 0.01 });
    let (ds, test, model): (Box<dyn Dataset>, Box<dyn Dataset>, Model<B>) = match args.net.as_str() {
        "mlp" => {
            let ops = [ImageOp::rescale(1.0 / 255.0, 0.0), ImageOp::Normalize { mean: 0.1307, std: 0.3081 }, ImageOp::Hwc2Chw];
            let ds = MnistDataset::new(&args.data_path, "train")?.map(ops.clone()).batch(batch, false)?.shard(size, rank)?;
            let test = MnistDataset::new(&args.data_path, "t10k")?.map(ops).batch(batch, false)?;
            let net = GradAccumulation::new(WithLossCell::new(Network::new(&Scope::root()), CrossEntropyLoss::new()), args.micro_size);
            let model = Model::<B>::parallel(parallel(net, args), SGD::new(lr), device, args.seed, comm.clone())?;
            (Box::new(ds), Box::new(test), model)
        }
        "lenet" => {
            let ds = create_dataset(&args.data_path, "train", batch, 1, args.seed)?.shard(size, rank)?;
            let test = create_dataset(&args.data_path, "t10k", batch, 1, 0)?;
            let loss = SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean);
            let net = GradAccumulation::new(WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), loss), args.micro_size);
            let model = Model::<B>::parallel(parallel(net, args), Momentum::new(lr, 0.9), device, args.seed, comm.clone())?;
            (Box::new(ds), Box::new(test), model)
        }
        "resnet18" => {
            let (train, test) = if args.data_path.join("data_batch_1.bin").exists() {
                (Cifar10::load(&args.data_path, "train")?, Cifar10::load(&args.data_path, "test")?)
            } else {
                if rank == 0 {
                    println!("no CIFAR-10 in {}: training on its MNIST digits as 3 x 32 x 32 images", args.data_path.display());
                }
                (Cifar10::from_mnist(&Mnist::load(&args.data_path, "train")?), Cifar10::from_mnist(&Mnist::load(&args.data_path, "t10k")?))
            };
            let ds = Cifar10Dataset::new(train).augment(args.seed).shuffle(args.seed).batch(batch, true)?.shard(size, rank)?;
            let test = Cifar10Dataset::new(test).batch(batch, false)?;
            let sync = args.sync_bn;
            let resnet = ResNet18::with_norm(&Scope::root(), 10, &|bn| if sync { bn.sync() } else { Ok(bn) })?;
            let net = WithLossCell::new(resnet, CrossEntropyLoss::new());
            let net = GradAccumulation::across_steps(net, args.micro_size).normalization(Normalization::Mean);
            let opt = SGD { momentum: 0.9, weight_decay: 5e-4, ..SGD::new(lr) };
            // TorchDDPPlugin: replicated optimizer, gradients averaged across ranks.
            let model = Model::<B>::parallel(AutoParallel::new(net).enable_gradients_mean(), opt, device, args.seed, comm.clone())?;
            (Box::new(ds), Box::new(test), model)
        }
        other => return Err(format!("--net must be mlp, lenet or resnet18, got `{other}`").into()),
    };
    let mut model = model;
    if args.graphs {
        model.accumulator_mut().options().set_graphs(true)?;
    }
    // MindSpore's MS_DEV_SAVE_GRAPHS, read once here: CELLGRAPH_SAVE_GRAPHS=1..3 and
    // CELLGRAPH_SAVE_GRAPHS_PATH write every graph after every pass (under rank_<id>/).
    if let Some(opts) = cellgraph::compiler::dump::DumpOptions::from_env()? {
        model.save_graphs(opts)?;
    }
    let print_every = args.print_every.unwrap_or(if args.net == "resnet18" { ds.dataset_size() } else { 100 });
    let mut loss_cb = LossMonitor::to_writer(print_every, Box::new(Tee(log, rank == 0)));
    let mut panic_cb = PanicAt(usize::MAX);
    if let Some((r, s)) = args.panic_at.as_deref().and_then(|v| v.split_once(':')) {
        if r.parse() == Ok(rank) {
            panic_cb.0 = s.parse().map_err(|_| format!("--panic-at RANK:STEP, got `{s}`"))?;
        }
    }
    let t0 = Instant::now();
    model.train(args.epochs, ds.as_ref(), &mut [&mut loss_cb, &mut panic_cb])?;
    let secs = t0.elapsed().as_secs_f64();
    let acc = model.accumulator();
    // Trained parameters agree across ranks; batch norm's moving statistics are per rank (as DDP's
    // running statistics on each rank; rank 0's go into the checkpoint), unless synchronised.
    let trained = if args.sync_bn { acc.network().parameters() } else { acc.network().trainable_params() };
    let params: Vec<u8> =
        trained.iter().filter_map(|p| acc.session().param(&p.name)).flat_map(|t| t.to_f32()).flat_map(|v| v.to_le_bytes()).collect();
    comm::agree(comm.as_ref(), "final parameters", &params)?;
    // Every rank takes the snapshot (with hsdp it gathers the optimizer state); rank 0 saves.
    let snapshot = model.snapshot();
    if let (Some(path), 0) = (&args.ckpt, rank) {
        cellgraph::runtime::checkpoint::save(path, &snapshot, &Default::default())?;
    }
    if rank == 0 {
        // The images trained (a batch dropped by drop_remainder is not), on every rank.
        let images = ds.batch_sizes().iter().sum::<usize>() * args.epochs * size;
        let elements: usize = trained.iter().map(|p| p.ty.numel()).sum();
        let c = acc.counters();
        println!(
            "ranks: {size}, updates: {}, gradient collectives: {}, fused optimizer launches: {}",
            acc.updates(),
            c.grad_collectives,
            c.fused_launches
        );
        if c.step_collectives > 0 {
            println!("batch-norm collectives: {} (SyncBatchNorm)", c.step_collectives);
        }
        if let Some(report) = acc.session().replay_report() {
            print!("{report}");
        }
        println!("training: {secs:.2} s, {:.0} images/s across ranks", images as f64 / secs);
        println!("gradient bytes reduced per update: {} ({} f32 + the item count)", 4 * (elements + 1), elements);
        println!("optimizer state on this rank: {} elements", acc.optimizer_state_elements());
        println!("test accuracy: {:.4}", model.eval(test.as_ref())?["Accuracy"]);
    }
    Ok(())
}

fn parallel(net: GradAccumulation, args: &Args) -> AutoParallel {
    let mut p = AutoParallel::new(net);
    if !args.no_hsdp {
        p = p.hsdp();
    }
    if args.gradients_mean {
        p = p.enable_gradients_mean();
    }
    p
}

fn main() {
    let args = Args::parse();
    let comm = match comm::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    // The worker log exists before anything can fail, so every rank's error lands in it.
    let log_path = args.log_dir.join(format!("worker_{}.log", comm.rank()));
    let log = std::fs::create_dir_all(&args.log_dir).and_then(|_| std::fs::File::create(&log_path));
    // A panic lands in the worker log too, before the MPI hook takes the job down.
    let panic_log = log_path.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&panic_log) {
            let _ = writeln!(f, "{info}");
        }
        previous(info);
    }));
    let result: Result<(), Box<dyn std::error::Error>> = match log {
        Err(e) => Err(format!("cannot write the worker log {}: {e} (pass --log-dir a writable directory)", log_path.display()).into()),
        Ok(log) => device::choose(&args.device, device::local_rank()).map_err(Into::into).and_then(|(spec, msg)| {
            if comm.rank() == 0 {
                println!("{msg}");
            }
            let file = log.try_clone().map_err(|e| format!("{}: {e}", log_path.display()))?;
            device::dispatch(spec, Train(&args, comm.clone(), file)).map_err(Box::<dyn std::error::Error>::from)?
        }),
    };
    if let Err(e) = result {
        let line = format!("rank {}: error: {e}", comm.rank());
        eprintln!("{line}");
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&log_path) {
            let _ = writeln!(f, "{line}");
        }
        // The other ranks may be waiting in a collective: take the whole job down.
        comm.abort(1);
    }
}

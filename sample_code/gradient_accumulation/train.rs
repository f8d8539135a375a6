//! The r1.6 standalone gradient-accumulation tutorial (seed 003), in cellgraph.
//!
//! MindSpore splits training into three compiled graphs: `TrainForwardBackward` (loss,
//! gradients, `AssignAdd` into `grad_sum`), `TrainOptim` (the optimizer on `grad_sum`) and
//! `TrainClear` (zero `grad_sum`), driven by a host loop that runs optim + clear every
//! `mini_steps` batches. cellgraph's GradAccumulation rewrite produces exactly these graphs
//! (`micro_step`, `optimizer`, `clear`); the `Accumulator` is the host loop.
//!
//! Run: `cargo run --release --example gradient_accumulation_train -- --data-path data/mnist`
//! (`--reduction mean` for the PyTorch-style mean over the window).

use std::path::PathBuf;
use std::rc::Rc;

use clap::Parser;

use cellgraph::cells::accumulate::{GradAccumulation, Normalization};
use cellgraph::prelude::*;
use cellgraph::runtime::data::create_dataset;
use cellgraph::runtime::Accumulator;
use cellgraph::runtime::Place;

#[derive(Parser)]
#[command(about = "cellgraph Grad Cumulative Example (MindSpore r1.6 tutorial)")]
struct Args {
    /// Path where the dataset is saved.
    #[arg(long, default_value = "data/mnist")]
    data_path: PathBuf,
    /// Epochs.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Batches per update.
    #[arg(long, default_value_t = 4)]
    mini_steps: usize,
    /// `sum` (the tutorial: AssignAdd without division) or `mean`.
    #[arg(long, default_value = "sum")]
    reduction: String,
    /// Where to save the checkpoint.
    #[arg(long, default_value = "gradient_accumulation.ckpt")]
    ckpt: PathBuf,
    /// Drop the batches left over at the end of an epoch (250 % 4 = 2 here) instead of applying
    /// them as a short window.
    #[arg(long)]
    drop_incomplete_window: bool,
    /// Seed for parameters and shuffling.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> std::process::ExitCode {
    cellgraph::runtime::join_thread_pool();
    cellgraph::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let normalization = match args.reduction.as_str() {
        "sum" => Normalization::Sum,
        "mean" => Normalization::Mean,
        other => return Err(format!("--reduction must be sum or mean, got `{other}`").into()),
    };
    if args.epochs == 0 {
        return Err("--epochs must be at least 1 (0 would train nothing and save untrained weights)".into());
    }
    let ds_train = create_dataset(&args.data_path, "train", 32, 1, args.seed)?;
    ds_train.check_batches()?;
    cellgraph::runtime::checkpoint::check_writable(&args.ckpt)?;
    let net = LeNet5::new(&Scope::root(), 10, 1);
    let net_loss = SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean);
    let net_opt = Momentum::new(0.01, 0.9);
    // Windows span mini_steps batches. The batches left at the end of an epoch form a short
    // window applied with its true count (MindSpore's loop carries them into the next epoch's
    // first window instead; both use every image), or are dropped on request.
    let mut model = GradAccumulation::across_steps(WithLossCell::new(net, net_loss), args.mini_steps).normalization(normalization);
    if args.drop_incomplete_window {
        model = model.drop_incomplete_window();
    }
    let mut acc = Accumulator::<Cpu>::new(Rc::new(model), Rc::new(net_opt), cpu(), args.seed)?;
    acc.set_input_names(&["data", "label"]);
    println!("============== Starting Training ==============");
    let t0 = std::time::Instant::now();
    for i in 0..args.epochs {
        let mut step = 0;
        for batch in ds_train.epoch(i, 0) {
            if acc.step(&batch.inputs(), Place::Regular)? {
                step += 1;
                println!("epoch: {} step: {} loss is {}", i + 1, step, acc.step_loss() as f32);
            }
        }
        acc.finish()?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let images = acc.counters().micro_steps as f64 * 32.0;
    eprintln!("trained {} updates in {secs:.1} s ({:.0} images/s)", acc.updates(), images / secs);
    // The tutorial saves TrainForwardBackward's parameters: the network's and grad_sum's.
    let tensors: cellgraph::runtime::checkpoint::Tensors =
        acc.session().params_host().into_iter().filter(|(k, _)| !k.starts_with("moments.")).collect();
    cellgraph::runtime::checkpoint::save(&args.ckpt, &tensors, &Default::default())?;
    println!("saved {}", args.ckpt.display());
    Ok(())
}

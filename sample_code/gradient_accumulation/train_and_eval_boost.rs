//! The r1.6 tutorial's boost mode (seed 003): `GradientAccumulation(max_accumulation_step=5)`
//! inside a train-step cell, driven by `Model.train` with `TimeMonitor` and `LossMonitor`, then
//! `Model.eval` with an `Accuracy` metric.
//!
//! Run: `cargo run --release --example train_and_eval_boost -- --data-path data/mnist`

use std::path::PathBuf;

use clap::Parser;

use cellgraph::prelude::*;
use cellgraph::runtime::data::{create_dataset, create_eval_dataset};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "data/mnist")]
    data_path: PathBuf,
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Print the loss every this many steps (MindSpore's LossMonitor() default is 1).
    #[arg(long, default_value_t = 1)]
    per_print_times: usize,
}

fn main() -> std::process::ExitCode {
    cellgraph::runtime::join_thread_pool();
    cellgraph::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let ds_train = create_dataset(&args.data_path, "train", 32, 1, 1)?;
    let net = LeNet5::new(&Scope::root(), 10, 1);
    let net_loss = SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean);
    let net_opt = Momentum::new(0.01, 0.9);
    let mut time_cb = TimeMonitor::new();
    let mut loss_cb = LossMonitor::new(args.per_print_times);

    // TrainGradAccumulationStepsCell(WithLossCell(net, loss), opt, 1.0, 5): one step is one
    // micro-batch; every 5 steps the optimizer runs on the mean of the gradients.
    let train_net = GradAccumulation::boost(WithLossCell::new(net, net_loss), 5);
    let mut model = Model::<Cpu>::new(train_net, net_opt, cpu(), 1)?;
    // MindSpore's save_graphs: CELLGRAPH_SAVE_GRAPHS=1..3, CELLGRAPH_SAVE_GRAPHS_PATH=dir.
    if let Some(opts) = cellgraph::compiler::dump::DumpOptions::from_env()? {
        model.save_graphs(opts)?;
    }

    println!("============== Starting Training ==============");
    model.train(args.epochs, &ds_train, &mut [&mut time_cb, &mut loss_cb])?;

    println!("============== Starting Testing ==============");
    // Every test image counts (2,000; MindSpore's drop_remainder batches would score 1,984).
    let ds_eval = create_eval_dataset(&args.data_path, "t10k", 32)?;
    if ds_eval.get_dataset_size() == 0 {
        return Err("Please check dataset size > 0 and batch_size <= dataset size".into());
    }
    let acc = model.eval(&ds_eval)?;
    println!("============== {{'Accuracy': {}}} ==============", acc["Accuracy"]);
    Ok(())
}

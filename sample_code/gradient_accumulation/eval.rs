//! The tutorial's `eval.py`: loads `gradient_accumulation.ckpt` into LeNet5 and reports the
//! accuracy on the test split: all 2,000 vendored test digits (MindSpore's `eval.py` batches
//! with `drop_remainder` and scores 1,984 of them).
//!
//! Run: `cargo run --release --example gradient_accumulation_eval -- --data-path data/mnist
//! --ckpt-path gradient_accumulation.ckpt`

use std::path::PathBuf;

use clap::Parser;

use cellgraph::prelude::*;
use cellgraph::runtime::data::create_eval_dataset;
use cellgraph::runtime::{checkpoint, Model};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "data/mnist")]
    data_path: PathBuf,
    #[arg(long, default_value = "gradient_accumulation.ckpt")]
    ckpt_path: PathBuf,
}

fn main() -> std::process::ExitCode {
    cellgraph::runtime::join_thread_pool();
    cellgraph::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let net = LeNet5::new(&Scope::root(), 10, 1);
    let net_loss = SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean);
    let mut model = Model::<Cpu>::plain(WithLossCell::new(net, net_loss), Momentum::new(0.01, 0.9), cpu(), 0)?;
    let (params, _) = checkpoint::load(&args.ckpt_path)?;
    // load_param_into_net: the network's parameters; grad_sum buffers are not the network's.
    let net_params: checkpoint::Tensors = params.into_iter().filter(|(k, _)| !k.starts_with("accu_grads.")).collect();
    model.accumulator_mut().restore(&net_params)?;
    println!("============== Starting Testing ==============");
    let ds_eval = create_eval_dataset(&args.data_path, "t10k", 32)?;
    let acc = model.eval(&ds_eval)?;
    println!("============== {{'Accuracy': {}}} ==============", acc["Accuracy"]);
    Ok(())
}

//! The `cellgraph` command line: train, evaluate and plot without writing Rust, and look into
//! the compiled graphs.
//!
//! - `cellgraph train`: MNIST with LeNet5 or the seed-002 MLP under gradient accumulation
//!   (`train.rs`);
//! - `cellgraph finetune --model DIR --data FILE --out DIR`: a Hugging Face GPT-2 fine-tuned
//!   and saved back (`finetune.rs`);
//! - `cellgraph eval --ckpt PATH`: `{'Accuracy': ...}` on the test split;
//! - `cellgraph plot LOG -o loss.svg`: the loss curve (`plot.rs`);
//! - `cellgraph inspect`: graph dumps (`inspect.rs`);
//! - `cellgraph graph`: LeNet5's training-step graph in the text format.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use cellgraph::prelude::*;

mod finetune;
mod inspect;
mod plot;
mod train;

#[derive(Parser)]
#[command(name = "cellgraph", version, about = "Graph-mode training with gradient accumulation, in the style of MindSpore")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train LeNet5, the seed-002 MLP, ResNet-18 or the character GPT with gradient accumulation.
    Train(train::TrainArgs),
    /// Fine-tune a Hugging Face GPT-2 checkpoint on a text and save it back for transformers.
    Finetune(finetune::FinetuneArgs),
    /// Score a checkpoint on held-out data: prints {'Accuracy': ...} (the GPT: {'Loss': ...}).
    Eval(train::EvalArgs),
    /// Draw the loss curve (and test accuracy) of `train --loss-log` logs as SVG.
    Plot(plot::PlotArgs),
    /// Inspect graph dumps: list a dump directory, print, filter, diff, render or check dumps.
    Inspect(inspect::InspectArgs),
    /// Print the graph of LeNet5's training step in the text format.
    Graph {
        /// Batch size of the traced step.
        #[arg(long, default_value_t = 32, value_parser = train::at_least_one)]
        batch: usize,
    },
}

fn graph(batch: usize) -> Result<(), Box<dyn std::error::Error>> {
    let net = WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean));
    let inputs = [("data", TensorType::f32([batch, 1, 32, 32])), ("label", TensorType::i32([batch]))];
    print!("{}", print(&train_one_step(&net, &inputs, &SGD::new(0.01))?.graph));
    Ok(())
}

fn main() -> ExitCode {
    let cmd = Cli::parse().cmd;
    // Fine-tuning runs on `mpirun`'s ranks (a world of one without it).
    if let Cmd::Finetune(args) = cmd {
        return cellgraph::main_on_ranks(|comm| finetune::finetune(args, comm));
    }
    cellgraph::runtime::join_thread_pool();
    cellgraph::exit_with(match cmd {
        Cmd::Train(args) => train::train(args),
        Cmd::Finetune(_) => unreachable!("run on its ranks above"),
        Cmd::Eval(args) => train::eval(args),
        Cmd::Plot(args) => plot::run(args),
        Cmd::Inspect(args) => inspect::run(args),
        Cmd::Graph { batch } => graph(batch),
    })
}

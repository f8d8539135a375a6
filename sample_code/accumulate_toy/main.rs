//! Accelerate's self-contained gradient-accumulation example (seed 001): a 1x1 weight fitted
//! to y = 2x on 8 points with SGD(lr 0.02), once with 4 accumulated micro-batches of 2 and
//! once on the whole batch. Both print 2.04000.
//!
//! Run: `cargo run --release --example accumulate_toy`

use std::rc::Rc;

use cellgraph::prelude::*;
use cellgraph::runtime::Place;
use cellgraph::runtime::{Accumulator, TensorDataset};

fn model() -> WithLossCell {
    WithLossCell::new(Dense::new(&Scope::root(), 1, 1).without_bias().weight_init(Initializer::Zeros), MSELoss::new())
}

fn main() -> std::process::ExitCode {
    cellgraph::runtime::join_thread_pool();
    cellgraph::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let x: Vec<f32> = (1..=8).map(|v| v as f32).collect();
    let y: Vec<f32> = x.iter().map(|v| 2.0 * v).collect();
    let gradient_accumulation_steps = 4;
    let batch_size = x.len() / gradient_accumulation_steps;
    let columns = vec![HostTensor::f32(vec![8, 1], x.clone())?, HostTensor::f32(vec![8, 1], y)?];
    let dataloader = TensorDataset { columns: columns.clone(), batch_size };

    // Accelerator(gradient_accumulation_steps=4): the loss is averaged over the window.
    let acc = GradAccumulation::across_steps(model(), gradient_accumulation_steps).normalization(Normalization::Mean);
    let mut accumulated = Accumulator::<Cpu>::new(Rc::new(acc), Rc::new(SGD::new(0.02)), cpu(), 0)?;
    let mut clone = Model::<Cpu>::plain(model(), SGD::new(0.02), cpu(), 0)?;
    let weight = |s: &Session<Cpu>| s.param("weight").expect("the model has a weight").scalar();
    println!("initial model weight is {:.5}", weight(accumulated.session()));
    println!("initial model weight is {:.5}", weight(clone.accumulator().session()));
    for (i, batch) in dataloader.batches(0, 0).enumerate() {
        println!("{i} {:?}", batch[0].to_f32());
        accumulated.step(&batch, Place::Regular)?;
    }
    accumulated.finish()?;
    clone.train(1, &TensorDataset { columns, batch_size: 8 }, &mut [])?;
    println!("w/ accumulation, the final model weight is {:.5}", weight(accumulated.session()));
    println!("w/o accumulation, the final model weight is {:.5}", weight(clone.accumulator().session()));
    Ok(())
}

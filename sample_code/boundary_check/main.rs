//! Colossal-AI's gradient-accumulation check (seeds 000/004): with accumulation over 4
//! micro-batches, the first parameter must be unchanged for iterations 0..2 and change at
//! iteration 3. LeNet5 on MNIST stands in for ResNet-18 on CIFAR-10. Exits non-zero if the
//! check fails.
//!
//! Run: `cargo run --release --example boundary_check`

use std::path::PathBuf;
use std::rc::Rc;

use cellgraph::prelude::*;
use cellgraph::runtime::data::create_dataset;
use cellgraph::runtime::Accumulator;
use cellgraph::runtime::Place;

const GRADIENT_ACCUMULATION: usize = 4;
const BATCH_SIZE: usize = 32;

fn main() -> std::process::ExitCode {
    cellgraph::runtime::join_thread_pool();
    cellgraph::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let data = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("data/mnist"));
    let train_dataloader = create_dataset(&data, "train", BATCH_SIZE, 1, 0)?;
    let model = LeNet5::new(&Scope::root(), 10, 1);
    let criterion = CrossEntropyLoss::new();
    let optimizer = SGD { momentum: 0.9, weight_decay: 5e-4, ..SGD::new(0.1) };
    let net = GradAccumulation::across_steps(WithLossCell::new(model, criterion), GRADIENT_ACCUMULATION).normalization(Normalization::Mean);
    let mut booster = Accumulator::<Cpu>::new(Rc::new(net), Rc::new(optimizer), cpu(), 0)?;
    let mut param_by_iter = Vec::new();
    for (idx, batch) in train_dataloader.epoch(0, 0).take(GRADIENT_ACCUMULATION).enumerate() {
        booster.step(&batch.inputs(), Place::Regular)?;
        let param = booster.session().param("conv1.weight").expect("LeNet5 has conv1").to_f32();
        println!("iteration {idx}, first 10 elements of param: {:?}", &param[..10]);
        param_by_iter.push(param);
    }
    let unchanged_inside = param_by_iter[1..GRADIENT_ACCUMULATION - 1].iter().all(|p| *p == param_by_iter[0]);
    if unchanged_inside && param_by_iter[GRADIENT_ACCUMULATION - 1] != param_by_iter[0] {
        println!("The parameter is only updated in the last iteration");
        Ok(())
    } else {
        Err("gradient accumulation check failed: the parameter changed inside the window or not at its end".into())
    }
}

//! The `cellgraph` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};

use cellgraph::prelude::*;

mod inspect;

#[derive(Parser)]
#[command(name = "cellgraph", version, about = "Graph-mode training with gradient accumulation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train LeNet5 on MNIST (single process, CPU, one SGD step per batch).
    Train {
        /// Directory with train-images-idx3-ubyte[.gz] and friends.
        #[arg(long, default_value = "data/mnist")]
        data: PathBuf,
        /// Batch size.
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Number of steps.
        #[arg(long, default_value_t = 100)]
        steps: usize,
        /// Learning rate.
        #[arg(long, default_value_t = 0.1)]
        lr: f64,
        /// Seed for parameter initialisation.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print the loss every this many steps.
        #[arg(long, default_value_t = 10)]
        print_every: usize,
        /// Print time spent per op at the end.
        #[arg(long)]
        profile: bool,
    },
    /// Inspect graph dumps: list a dump directory, print, filter, diff, render or check dumps.
    Inspect(inspect::InspectArgs),
    /// Print the graph of LeNet5's training step in the text format.
    Graph {
        #[arg(long, default_value_t = 32)]
        batch: usize,
    },
}

fn lenet_with_loss() -> WithLossCell {
    WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean))
}

fn batch_of(m: &Mnist, start: usize, n: usize) -> (HostTensor, HostTensor) {
    let mut x = Vec::with_capacity(n * 1024);
    let mut y = Vec::with_capacity(n);
    for k in 0..n {
        let i = (start + k) % m.len();
        x.extend(lenet_transform(m.image(i), m.rows, m.cols));
        y.push(m.labels[i] as i32);
    }
    (HostTensor::f32(vec![n, 1, 32, 32], x).unwrap(), HostTensor::i32(vec![n], y).unwrap())
}

fn train(
    data: PathBuf,
    batch: usize,
    steps: usize,
    lr: f64,
    seed: u64,
    print_every: usize,
    profile: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let mnist = Mnist::load(&data, "train")?;
    let net = lenet_with_loss();
    let inputs = [("data", TensorType::f32([batch, 1, 32, 32])), ("label", TensorType::i32([batch]))];
    let t0 = Instant::now();
    let opt = SGD::new(lr);
    let exe = compile(train_one_step(&net, &inputs, &opt)?.graph)?;
    println!("compiled LeNet5 training step ({} steps in plan) in {:.1} ms", exe.len(), t0.elapsed().as_secs_f64() * 1e3);
    let mut sess = Session::<Cpu>::new(cpu());
    sess.set_profiling(profile);
    sess.init_params(&net.parameters(), seed);
    let lr = HostTensor::scalar_f32(opt.scalar_values(0)[0]);
    let t1 = Instant::now();
    for step in 1..=steps {
        let (x, y) = batch_of(&mnist, (step - 1) * batch, batch);
        let loss = sess.run(&exe, &[x, y, lr.clone()])?[0].scalar();
        if !loss.is_finite() {
            return Err(format!("step {step}: loss is {loss}; lower the learning rate").into());
        }
        if step % print_every == 0 || step == steps {
            println!("step: {step}, loss is {loss:.6}");
        }
    }
    let secs = t1.elapsed().as_secs_f64();
    println!("{steps} steps in {secs:.2} s: {:.0} images/s", (steps * batch) as f64 / secs);
    for (op, calls, t) in sess.profile() {
        println!("{op:>28} {calls:>8} calls {:>10.1} ms", t * 1e3);
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Train { data, batch, steps, lr, seed, print_every, profile } => {
            train(data, batch, steps, lr, seed, print_every.max(1), profile)
        }
        Cmd::Inspect(args) => inspect::run(args),
        Cmd::Graph { batch } => {
            let inputs = [("data", TensorType::f32([batch, 1, 32, 32])), ("label", TensorType::i32([batch]))];
            train_one_step(&lenet_with_loss(), &inputs, &SGD::new(0.01)).map(|s| print!("{}", print(&s.graph))).map_err(Into::into)
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

//! LeNet5 on the CPU: trace + differentiate + compile time, and forward+backward throughput
//! at batch 32. Prints a table. Run: `cargo bench --bench lenet` (set RAYON_NUM_THREADS=1
//! for a single thread).

use std::time::Instant;

use cellgraph::prelude::*;

fn lenet_with_loss() -> WithLossCell {
    WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let inputs = [("data", TensorType::f32([32, 1, 32, 32])), ("label", TensorType::i32([32]))];
    let compile_ms = median(
        (0..21)
            .map(|_| {
                let t = Instant::now();
                let net = lenet_with_loss();
                let g = grad_graph(&net, "lenet5", &inputs, Sens::One).unwrap();
                let exe = compile(g.graph).unwrap();
                std::hint::black_box(exe.len());
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    let net = lenet_with_loss();
    let exe = compile(grad_graph(&net, "lenet5", &inputs, Sens::One).unwrap().graph).unwrap();
    let mut s = Session::<Cpu>::new(cpu());
    for (n, v) in materialize(&net.parameters(), 1) {
        s.set_param(&n, &v);
    }
    let m = Mnist::load(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/data/mnist")), "train").unwrap();
    let x: Vec<f32> = (0..32).flat_map(|i| lenet_transform(m.image(i), 28, 28)).collect();
    let y: Vec<i32> = m.labels[..32].iter().map(|&l| l as i32).collect();
    let batch = [HostTensor::f32(vec![32, 1, 32, 32], x).unwrap(), HostTensor::i32(vec![32], y).unwrap()];
    for _ in 0..5 {
        s.run(&exe, &batch).unwrap();
    }
    let steps = 100;
    let t = Instant::now();
    for _ in 0..steps {
        std::hint::black_box(s.run(&exe, &batch).unwrap());
    }
    let secs = t.elapsed().as_secs_f64();
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
    println!("| benchmark | threads | result |");
    println!("|---|---|---|");
    println!("| LeNet5 trace + grad + compile (median of 21) | - | {compile_ms:.2} ms |");
    println!(
        "| LeNet5 forward+backward, batch 32 ({steps} steps) | {threads} | {:.0} images/s ({:.2} ms/step) |",
        (steps * 32) as f64 / secs,
        secs * 1e3 / steps as f64
    );
}

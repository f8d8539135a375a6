//! The host kernels on LeNet5's shapes, and ResNet-18's convolutions, at batch 32, the GPT's
//! products, attention and widest elementwise programs, one call at a time: median
//! microseconds per call and GFLOP/s. Run: `cargo bench --bench kernels` (one thread:
//! `MATMUL_NUM_THREADS=1 RAYON_NUM_THREADS=1 taskset -c 0 cargo bench --bench kernels`; only the
//! kernels whose name contains S: `KERNELS_ONLY=S`; ResNet-18's convolutions and the GPT's
//! products with bf16 products, on the kernel a bf16 plan picks on this CPU:
//! `KERNELS_PRODUCTS=bf16`).

use std::hint::black_box;
use std::time::Instant;

use cellgraph_runtime::host::gemm::{self, Mat};
use cellgraph_runtime::host::{attention, direct};
use cellgraph_runtime::host::{conv, pool, rows};
use cellgraph_runtime::kernel::Products;
use cellgraph_runtime::kernel::{ConvAlgo, Geometry};

fn median_us(mut f: impl FnMut()) -> f64 {
    for _ in 0..5 {
        f();
    }
    let mut v: Vec<f64> = (0..41)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn data(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0).collect()
}

/// Times `kernel` writing into one output buffer of `len` elements, reused across calls.
fn timed(len: usize, mut kernel: impl FnMut(&mut [f32])) -> f64 {
    let mut out = vec![0.0f32; len];
    median_us(|| kernel(black_box(&mut out)))
}

/// Times and prints one kernel, unless `KERNELS_ONLY` is set and not part of its name.
fn row(name: &str, us: impl FnOnce() -> f64, flops: f64) {
    if std::env::var("KERNELS_ONLY").is_ok_and(|only| !name.contains(&only)) {
        return;
    }
    let us = us();
    let gf = if flops > 0.0 { format!("{:8.1}", flops / us / 1e3) } else { "       -".into() };
    println!("{name:<46} {us:10.1} {gf}");
}

/// The products of the ResNet-18 and GPT rows: f32, or bf16 with `KERNELS_PRODUCTS=bf16`
/// (AMX tiles or AVX-512 BF16 pairs, whichever a plan picks here; refused where neither is).
fn products() -> Products {
    match std::env::var("KERNELS_PRODUCTS").as_deref() {
        Ok("bf16") if cellgraph_runtime::host::bf16::available() => Products::Bf16,
        Ok("f32") | Err(_) => Products::F32,
        Ok(v) => {
            let why = match v {
                "bf16" => "this CPU has no AVX-512 BF16 (nor AMX): no bf16 kernel to time; unset it or use f32".to_string(),
                other => format!("must be f32 or bf16, got {other:?}"),
            };
            eprintln!("kernels: KERNELS_PRODUCTS: {why}");
            std::process::exit(2)
        }
    }
}

fn main() {
    let pr = products();
    println!("{:<46} {:>10} {:>8}", "kernel (batch 32)", "us/call", "GFLOP/s");
    let n = 32;
    for (name, c, hw, o) in [("conv1 1->6 5x5 on 32x32", 1usize, 32usize, 6usize), ("conv2 6->16 5x5 on 14x14", 6, 14, 16)] {
        let oh = hw - 4;
        let g = Geometry { x: [n, c, hw, hw], kernel: [5, 5], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [oh, oh] };
        let (x, w, dy) = (data(n * c * hw * hw), data(o * c * 25), data(n * o * oh * oh));
        let flops = 2.0 * (n * o * oh * oh * c * 25) as f64;
        row(
            &format!("{name} forward, im2col+GEMM"),
            || timed(dy.len(), |y| conv::conv2d(&ConvAlgo::gemm(&g, 1, o), &g, 1, &x, &w, o, y, None, Products::F32)),
            flops,
        );
        row(&format!("{name} forward, direct"), || timed(dy.len(), |y| direct::forward(&g, &x, &w, o, y, None)), flops);
        row(
            &format!("{name} filter grad, im2col+GEMM"),
            || timed(w.len(), |dw| conv::conv2d_filter_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &x, o, dw, None, Products::F32)),
            flops,
        );
        row(&format!("{name} filter grad, direct"), || timed(w.len(), |dw| direct::filter_grad(&g, &dy, &x, o, dw)), flops);
        row(
            &format!("{name} input grad, im2col+GEMM"),
            || timed(x.len(), |dx| conv::conv2d_input_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &w, o, dx, Products::F32)),
            flops,
        );
        row(&format!("{name} input grad, direct"), || timed(x.len(), |dx| direct::input_grad(&g, &dy, &w, o, dx)), flops);
    }
    for (name, c, hw) in [("pool1 6x28x28", 6usize, 28usize), ("pool2 16x10x10", 16, 10)] {
        let g = Geometry { x: [n, c, hw, hw], kernel: [2, 2], stride: [2, 2], dilation: [1, 1], pad: [0, 0], out: [hw / 2, hw / 2] };
        let (x, dy) = (data(n * c * hw * hw), data(n * c * hw * hw / 4));
        let mut at = vec![0u32; dy.len()];
        row(&format!("{name} max pool"), || timed(dy.len(), |y| pool::max_pool2d(&g, &x, &mut at, y)), 0.0);
        row(&format!("{name} max pool grad (kept argmax)"), || timed(x.len(), |dx| pool::max_pool2d_grad(&g, &at, &dy, dx, None)), 0.0);
    }
    for (name, m, k, nn) in [("fc1 32x400 @ 400x120^T", 32usize, 400usize, 120usize), ("fc1 grad 120x32^T @ 32x400", 120, 32, 400)] {
        let (a, b) = (data(m * k), data(k * nn));
        let ma = Mat { data: &a, rows: m, cols: k, transposed: false };
        let mb = Mat { data: &b, rows: k, cols: nn, transposed: false };
        row(name, || timed(m * nn, |c| gemm::matmul(ma, mb, c, Products::F32, None)), 2.0 * (m * k * nn) as f64);
    }
    let (dy, x) = (data(n * 6 * 28 * 28), data(n * 6 * 28 * 28));
    row("relu grad 32x6x28x28", || timed(x.len(), |dx| rows::relu_grad(&dy, &x, dx)), 0.0);
    resnet18(n, pr);
    gpt(pr);
    boundary();
}

/// The window's boundary on ResNet-18's 11.2 M parameters as one tensor: Colossal-AI's
/// SGD(0.1, momentum 0.9, weight decay 5e-4) and the clearing of the accumulator in one pass
/// (`update_clear`), reading the parameter, its accumulator and SGD's two states and writing
/// all four: 32 bytes an element; then AdamW's. The last column is GB/s moved, not GFLOP/s.
fn boundary() {
    use cellgraph::cells::optim::{Adam, SGD};
    use cellgraph::cells::Optimizer;
    println!("\nboundary (11.2 M parameters)");
    let n = 11_173_962;
    let prog = SGD { momentum: 0.9, weight_decay: 5e-4, ..SGD::new(0.1) }.update();
    let (mut p, mut acc) = (data(n), data(n));
    let mut states = vec![data(n), vec![1.0f32; n]];
    row(
        "SGD momentum + weight decay, update and clear",
        || median_us(|| cellgraph_runtime::host::update::update_clear(&prog, &mut p, &mut acc, &mut states, &[0.1], 0.25, 1.0)),
        32.0 * n as f64,
    );
    // The GPT's and fine-tuning's optimizer: AdamW (two moments), at its first update's
    // bias corrections.
    let prog = Adam { beta2: 0.99, ..Adam::adamw(3e-3, 0.1) }.update();
    let mut states = vec![data(n), data(n).iter().map(|x| x * x).collect()];
    row(
        "AdamW, update and clear",
        || median_us(|| cellgraph_runtime::host::update::update_clear(&prog, &mut p, &mut acc, &mut states, &[3e-3, 0.1, 0.01], 0.25, 1.0)),
        32.0 * n as f64,
    );
}

/// The character GPT's products (width 128, 4 heads, context 128, micro-batch of 8 sequences:
/// 1,024 tokens): the linear layers forward and their two gradients, and one head's attention
/// scores. Row-major operands, read transposed where the graph reads them so.
fn gpt(pr: Products) {
    println!("\nGPT products (1,024 tokens, width 128)");
    let shapes = [
        ("qkv 1024x128 @ 128x384", 1024usize, 128usize, 384usize, false, false),
        ("fc1 1024x128 @ 128x512", 1024, 128, 512, false, false),
        ("fc2 1024x512 @ 512x128", 1024, 512, 128, false, false),
        ("fc1 input grad 1024x512 @ (128x512)^T", 1024, 512, 128, false, true),
        ("fc1 weight grad (1024x128)^T @ 1024x512", 128, 1024, 512, true, false),
        ("fc2 weight grad (1024x512)^T @ 1024x128", 512, 1024, 128, true, false),
        ("scores 128x32 @ (128x32)^T", 128, 32, 128, false, true),
        ("values 128x128 @ 128x32", 128, 128, 32, false, false),
    ];
    for (name, m, k, n, ta, tb) in shapes {
        let (a, b) = (data(m * k), data(k * n));
        let ma = if ta { Mat { data: &a, rows: k, cols: m, transposed: true } } else { Mat { data: &a, rows: m, cols: k, transposed: false } };
        let mb = if tb { Mat { data: &b, rows: n, cols: k, transposed: true } } else { Mat { data: &b, rows: k, cols: n, transposed: false } };
        row(name, || timed(m * n, |c| gemm::matmul(ma, mb, c, pr, None)), 2.0 * (m * k * n) as f64);
    }
    // fc1 with the epilogue a bf16 plan gives it (its bias, then the rounding to bf16), run by
    // the product (over each strip of rows as it finishes it, on AMX tiles) and after it.
    {
        use cellgraph_runtime::host::program;
        use cellgraph_runtime::kernel::{Elementwise, Read};
        let (m, k, n) = (1024, 128, 512);
        let (a, b, bias) = (data(m * k), data(k * n), data(n));
        let ma = Mat { data: &a, rows: m, cols: k, transposed: false };
        let mb = Mat { data: &b, rows: k, cols: n, transposed: false };
        let prog: cellgraph_compiler::program::Program = "$0 $1 add round_bf16".parse().expect("a program");
        let e = Elementwise::new(prog, vec![Read::Same, Read::Cycle(n)], m * n);
        let post = |first: usize, part: &mut [f32]| program::epilogue(&e, &[&bias], first, part);
        let flops = 2.0 * (m * k * n) as f64;
        row("fc1 + bias, round: epilogue in the product", || timed(m * n, |c| gemm::matmul(ma, mb, c, pr, Some(&post))), flops);
        row(
            "fc1 + bias, round: epilogue after it",
            || {
                timed(m * n, |c| {
                    gemm::matmul(ma, mb, c, pr, None);
                    post(0, c)
                })
            },
            flops,
        );
    }
    // The `attention` op on a micro-batch of the GPT (8 sequences of 128, 4 heads of 32),
    // causal; GFLOP/s counts the products' multiply-adds over the (query, key) pairs the
    // mask keeps (2 products forward, 5 backward: the scores again, dP, dV, dQ, dK).
    let e = [8usize, 128usize, 4usize, 32usize];
    let [b, t, h, d] = e;
    let (qkv, dy) = (data(b * t * 3 * h * d), data(b * t * h * d));
    let pairs = (b * h * t * (t + 1) / 2) as f64;
    row(
        "attention 8 x 4 heads of 128 x 32, causal",
        || timed(dy.len(), |y| attention::forward(&qkv, e, true, None, y, None)),
        2.0 * 2.0 * pairs * d as f64,
    );
    row("attention grad, causal", || timed(qkv.len(), |dx| attention::backward(&qkv, &dy, e, true, None, dx, None)), 5.0 * 2.0 * pairs * d as f64);
    // As a training plan runs them: the forward keeps `P`, the gradient reads it (4 products).
    let mut p = vec![0.0f32; b * h * t * t];
    row("attention, keeping P", || timed(dy.len(), |y| attention::forward(&qkv, e, true, Some(&mut p), y, None)), 2.0 * 2.0 * pairs * d as f64);
    row(
        "attention grad from the kept P",
        || timed(qkv.len(), |dx| attention::backward(&qkv, &dy, e, true, Some(&p), dx, None)),
        4.0 * 2.0 * pairs * d as f64,
    );
    // Elementwise programs over the GPT's widest activation (`[8, 128, 512]`, 2 MiB of f32 an
    // operand: past L2 on the machines we run on), the GELU's forward and gradient as the bf16
    // plan fuses them, against one hand-written pass over the same bytes as the first.
    use cellgraph_compiler::program::Val;
    use cellgraph_runtime::host::program;
    use cellgraph_runtime::kernel::{Elementwise, Read};
    let n = 8 * 128 * 512;
    let (x, y, z) = (data(n), data(n), data(n));
    let gelu_grad =
        "$0 $1 mul 0.5 mul $0 $2 0.5 mul mul round_bf16 $2 0.70703125 mul $2 0.70703125 mul mul neg exp 1.125 mul mul 0.70703125 mul add round_bf16";
    for (name, text) in [
        ("program x 0.5 mul y mul round_bf16", "$0 0.5 mul $1 mul round_bf16"),
        ("program x 0.7071 mul erf 1 add", "$0 0.70703125 mul erf 1.0 add"),
        ("program: GELU's gradient in bf16 (3 operands)", gelu_grad),
    ] {
        let prog: cellgraph_compiler::program::Program = text.parse().expect("a program");
        // Its operands: one past the highest it reads.
        let k = prog
            .steps()
            .iter()
            .flat_map(|s| s.reads())
            .filter_map(|v| if let Val::Arg(i) = v { Some(i as usize + 1) } else { None })
            .max()
            .unwrap_or(0);
        let args: Vec<&[f32]> = [&x[..], &y[..], &z[..]][..k].to_vec();
        let e = Elementwise::new(prog, vec![Read::Same; k], n);
        row(name, || timed(n, |o| program::fused(&e, &args, o)), 0.0);
    }
    // GELU's gradient as a bf16 plan runs it: x holds bf16 values, so erf's and exp's subtrees
    // on it are read from tables (`host/tables.rs`; made on the first call, before timing).
    {
        use cellgraph_runtime::host::float::HostFloat;
        let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|f| f.round_bf16()).collect() };
        let (x, y, z) = (round(&x), round(&y), round(&z));
        let e = Elementwise::new(gelu_grad.parse().expect("a program"), vec![Read::Same; 3], n).with_bf16_args(vec![true; 3]);
        let args: Vec<&[f32]> = vec![&x, &y, &z];
        row("program: GELU's gradient in bf16, tables", || timed(n, |o| program::fused(&e, &args, o)), 0.0);
    }
    row("one pass of x * 0.5 * y, by hand", || timed(n, |o| o.iter_mut().zip(&x).zip(&y).for_each(|((o, &a), &b)| *o = a * 0.5 * b)), 0.0);
}

/// ResNet-18's convolutions on 3 x 32 x 32 images (torchvision's layout: the 7x7/2 stem, then
/// 8x8, 4x4, 2x2 and 1x1 maps). GFLOP/s counts the multiply-adds that read an image pixel,
/// not padding: the work a kernel that skipped padding would do.
fn resnet18(n: usize, pr: Products) {
    println!("\nResNet-18 (batch {n})");
    // The stem's max pooling: 3x3 at stride 2 padded by 1, 64 x 16 x 16 -> 64 x 8 x 8.
    let g = Geometry { x: [n, 64, 16, 16], kernel: [3, 3], stride: [2, 2], dilation: [1, 1], pad: [1, 1], out: [8, 8] };
    // Its input comes out of a ReLU: half of it zeros, in no pattern a branch predictor learns.
    let x: Vec<f32> =
        (0..n * 64 * 16 * 16).map(|i| (((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 23) as f32 - 1.0).max(0.0)).collect();
    let dy = data(n * 64 * 8 * 8);
    let mut at = vec![0u32; dy.len()];
    row("max pool 3x3/2 padded by 1, 64x16x16", || timed(dy.len(), |y| pool::max_pool2d(&g, &x, &mut at, y)), 0.0);
    row("max pool 3x3/2 grad (kept argmax)", || timed(x.len(), |dx| pool::max_pool2d_grad(&g, &at, &dy, dx, None)), 0.0);
    // (name, in channels, in size, out channels, kernel, stride, padding)
    let convs = [
        ("stem 3->64 7x7/2 on 32x32", 3usize, 32usize, 64usize, 7usize, 2usize, 3usize),
        ("layer1 64->64 3x3 on 8x8", 64, 8, 64, 3, 1, 1),
        ("layer2.0 64->128 3x3/2 on 8x8", 64, 8, 128, 3, 2, 1),
        ("layer2 128->128 3x3 on 4x4", 128, 4, 128, 3, 1, 1),
        ("layer2 down 64->128 1x1/2 on 8x8", 64, 8, 128, 1, 2, 0),
        ("layer3.0 128->256 3x3/2 on 4x4", 128, 4, 256, 3, 2, 1),
        ("layer3 256->256 3x3 on 2x2", 256, 2, 256, 3, 1, 1),
        ("layer4.0 256->512 3x3/2 on 2x2", 256, 2, 512, 3, 2, 1),
        ("layer4 512->512 3x3 on 1x1", 512, 1, 512, 3, 1, 1),
        ("layer4 down 256->512 1x1/2 on 2x2", 256, 2, 512, 1, 2, 0),
    ];
    for (name, c, hw, o, k, s, p) in convs {
        let oh = (hw + 2 * p - k) / s + 1;
        let g = Geometry { x: [n, c, hw, hw], kernel: [k, k], stride: [s, s], dilation: [1, 1], pad: [p, p], out: [oh, oh] };
        // Taps that land on the image, per output position along one axis, squared.
        let along: usize = (0..oh).map(|o| (0..k).filter(|&t| (o * s + t).checked_sub(p).is_some_and(|i| i < hw)).count()).sum();
        let flops = 2.0 * (n * o * c * along * along) as f64;
        let (x, w, dy) = (data(n * c * hw * hw), data(o * c * k * k), data(n * o * oh * oh));
        row(&format!("{name} forward"), || timed(dy.len(), |y| conv::conv2d(&ConvAlgo::gemm(&g, 1, o), &g, 1, &x, &w, o, y, None, pr)), flops);
        row(
            &format!("{name} filter grad"),
            || timed(w.len(), |dw| conv::conv2d_filter_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &x, o, dw, None, pr)),
            flops,
        );
        row(
            &format!("{name} input grad"),
            || timed(x.len(), |dx| conv::conv2d_input_grad(&ConvAlgo::gemm(&g, 1, o), &g, 1, &dy, &w, o, dx, pr)),
            flops,
        );
    }
}

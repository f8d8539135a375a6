//! Which of cubek's matmul routines set up on a device, how fast each runs, and how far each
//! lands from the exact kernel, at the products the benchmark's nets make (the seed-002 MLP's
//! and the small GPT's, forward and backward). One line per shape, operand type and routine,
//! with cubek's refusal where it does not set up: the data behind the routines the runtime
//! picks (`runtime/src/cube/gemm.rs`). Run beside `benches/torch_mm.py` (cuBLAS at the same
//! shapes) in a GPU check.
//!
//! `cargo build --release --no-default-features --features cuda --example matmul_probe`, then
//! `matmul_probe --dtype f32`, `--dtype bf16` and `--dtype bf16xf32`.

use std::time::Instant;

use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Operand types: `f32` (exact and TF32 tensor-core routines), `bf16` (bf16 tensor cores,
    /// f32 sums; the exact routines widen bf16 operands to f32), or `bf16xf32`: a bf16 `a` and
    /// an f32 `b` holding bf16 values (a bf16 plan's product whose second operand is kept in f32
    /// storage, as the GPT's tied head), each tensor-core routine staged in f32 (TF32, the
    /// runtime's choice) and in bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Products as `MxKxN`, `BxMxKxN` for a batch, a suffix `:ta` / `:tb` / `:tab` for a
    /// transposed (stored `K x M` / `N x K`) operand; `;`-separated. Default: the MLP's and the
    /// GPT's.
    #[arg(long)]
    shapes: Option<String>,
    /// Routines by cubek's multi-level names (`SimpleUnit`, `DoubleCyclicMma`, ...; the exact
    /// ones with their smallest tile: `SimpleUnitMin`, `DoubleUnitMin`), comma-separated.
    /// Default: the exact ones and every tensor-core family.
    #[arg(long)]
    routines: Option<String>,
    /// Timed launches per routine (after 3 untimed).
    #[arg(long, default_value_t = 20)]
    reps: usize,
}

/// The seed-002 MLP (784-512-512-10, micro-batch 256) and the small GPT (64 x 128 tokens,
/// width 128, 4 heads, vocabulary 65): forward, input gradient and weight gradient shapes.
const DEFAULT_SHAPES: &str = "256x784x512;256x512x512;256x512x10;256x10x512:tb;256x512x512:tb;784x256x512:ta;512x256x512:ta;512x256x10:ta;\
8192x128x384;8192x128x512;8192x512x128;8192x128x65:tb;8192x384x128:tb;128x8192x384:ta;512x8192x128:ta;256x128x32x128:tb;256x128x128x32";

const DEFAULT_ROUTINES: &str = "SimpleUnit,DoubleUnit,SimpleUnitMin,DoubleUnitMin,SimpleCyclicCmma,SimpleCyclicMma,DoubleCyclicCmma,DoubleCyclicMma,\
SimpleStridedMma,DoubleHybridMma,OrderedDoubleCmma,OrderedDoubleMma,SimpleTmaCmma,SimpleTmaMma,DoubleTmaMma,SpecializedCyclicMma,SpecializedTmaMma";

fn main() {
    let args = Args::parse();
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        if let Err(e) = probe::run(&args) {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        let _ = (&args.dtype, &args.shapes, &args.routines, args.reps, DEFAULT_SHAPES, DEFAULT_ROUTINES, Instant::now);
        eprintln!("error: matmul_probe needs a device backend: build with --features cuda (or wgpu)");
        std::process::exit(2);
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod probe {
    use super::*;
    use burn_cubecl::tensor::CubeTensor;
    use cellgraph::runtime::burn_backend::cubecl::dtype_to_storage_type;
    use cellgraph::runtime::burn_backend::{DType, Shape};
    use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
    use cubek::matmul::multi_level::routines::batch::{double_unit::DoubleUnitSelectionArgs, simple_unit::SimpleUnitSelectionArgs};
    use cubek::matmul::multi_level::routines::TileSizeSelection;
    use cubek::matmul::multi_level::Strategy as Level;
    use cubek::matmul::routine::BlueprintStrategy;
    use cubek::matmul::strategy::Strategy;

    #[cfg(feature = "cuda")]
    type Runtime = cubecl::cuda::CudaRuntime;
    #[cfg(all(feature = "wgpu", not(feature = "cuda")))]
    type Runtime = cubecl::wgpu::WgpuRuntime;

    fn routine(name: &str) -> Result<Level, String> {
        Ok(match name {
            "SimpleUnit" => Level::SimpleUnit(Default::default()),
            "DoubleUnit" => Level::DoubleUnit(Default::default()),
            // The exact kernels with their smallest tile (the defaults take the largest): small
            // products (the MLP's, LeNet5's) fill more of the GPU with more, smaller tiles.
            "SimpleUnitMin" => Level::SimpleUnit(BlueprintStrategy::Inferred(SimpleUnitSelectionArgs { tile_size: TileSizeSelection::MinTileSize })),
            "DoubleUnitMin" => Level::DoubleUnit(BlueprintStrategy::Inferred(DoubleUnitSelectionArgs { tile_size: TileSizeSelection::MinTileSize })),
            "SimpleCyclicCmma" => Level::SimpleCyclicCmma(Default::default()),
            "SimpleCyclicMma" => Level::SimpleCyclicMma(Default::default()),
            "DoubleCyclicCmma" => Level::DoubleCyclicCmma(Default::default()),
            "DoubleCyclicMma" => Level::DoubleCyclicMma(Default::default()),
            "SimpleStridedMma" => Level::SimpleStridedMma(Default::default()),
            "DoubleHybridMma" => Level::DoubleHybridMma(Default::default()),
            "OrderedDoubleCmma" => Level::OrderedDoubleCmma(Default::default()),
            "OrderedDoubleMma" => Level::OrderedDoubleMma(Default::default()),
            "SimpleTmaCmma" => Level::SimpleTmaCmma(Default::default()),
            "SimpleTmaMma" => Level::SimpleTmaMma(Default::default()),
            "DoubleTmaMma" => Level::DoubleTmaMma(Default::default()),
            "SpecializedCyclicMma" => Level::SpecializedCyclicMma(Default::default()),
            "SpecializedTmaMma" => Level::SpecializedTmaMma(Default::default()),
            other => return Err(format!("unknown routine `{other}`")),
        })
    }

    /// `[batch, m, k, n]`, transposed a, transposed b.
    fn shape(s: &str) -> Result<([usize; 4], bool, bool), String> {
        let (dims, flags) = s.split_once(':').unwrap_or((s, ""));
        let d: Vec<usize> = dims.split('x').map(|v| v.trim().parse::<usize>().map_err(|e| format!("shape `{s}`: {e}"))).collect::<Result<_, _>>()?;
        let d = match d[..] {
            [m, k, n] => [1, m, k, n],
            [b, m, k, n] => [b, m, k, n],
            _ => return Err(format!("shape `{s}`: expected MxKxN or BxMxKxN")),
        };
        let (ta, tb) = match flags {
            "" => (false, false),
            "ta" => (true, false),
            "tb" => (false, true),
            "tab" => (true, true),
            other => return Err(format!("shape `{s}`: unknown suffix `{other}` (ta, tb or tab)")),
        };
        Ok((d, ta, tb))
    }

    /// Deterministic values in [-1, 1), as f32 bytes or as bf16 bytes (the f32's top half);
    /// `rounded`: f32 bytes of bf16 values (the f32's top half, its low half zero).
    fn values(n: usize, seed: u64, bf16: bool, rounded: bool) -> Vec<u8> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let f: Vec<f32> = (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        if bf16 {
            f.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
        } else if rounded {
            f.iter().flat_map(|v| (v.to_bits() & 0xffff_0000).to_le_bytes()).collect()
        } else {
            f.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
    }

    pub fn run(args: &Args) -> Result<(), String> {
        // The operands' types, and the stages each tensor-core routine is tried with.
        let (da, db, stages): (DType, DType, &[DType]) = match args.dtype.as_str() {
            "f32" => (DType::F32, DType::F32, &[DType::F32]),
            "bf16" => (DType::BF16, DType::BF16, &[DType::BF16]),
            "bf16xf32" => (DType::BF16, DType::F32, &[DType::F32, DType::BF16]),
            other => return Err(format!("--dtype must be f32, bf16 or bf16xf32, got `{other}`")),
        };
        let shapes: Vec<_> = args
            .shapes
            .as_deref()
            .unwrap_or(DEFAULT_SHAPES)
            .split(';')
            .filter(|s| !s.trim().is_empty())
            .map(|s| shape(s.trim()))
            .collect::<Result<_, _>>()?;
        let routines: Vec<(String, Level)> = args
            .routines
            .as_deref()
            .unwrap_or(DEFAULT_ROUTINES)
            .split(',')
            .map(|r| routine(r.trim()).map(|l| (r.trim().to_string(), l)))
            .collect::<Result<_, _>>()?;
        let device = Default::default();
        let client = <Runtime as cubecl::Runtime>::client(&device);
        println!("| shape (batch x m x k x n) | operands | routine | set up | us/product | TFLOP/s | max abs diff from the first routine |");
        println!("|---|---|---|---|---|---|---|");
        for (seed, ([batch, m, k, n], ta, tb)) in shapes.into_iter().enumerate() {
            let dims = |rows: usize, cols: usize| if batch > 1 { vec![batch, rows, cols] } else { vec![rows, cols] };
            let low = da != DType::F32;
            let a = client.create_from_slice(&values(batch * m * k, 2 * seed as u64, da == DType::BF16, low));
            let b = client.create_from_slice(&values(batch * k * n, 2 * seed as u64 + 1, db == DType::BF16, low));
            let operand = |h: &cubecl::server::Handle, rows: usize, cols: usize, t: bool, dtype: DType| {
                let stored = if t { dims(cols, rows) } else { dims(rows, cols) };
                let r = stored.len();
                let mut v = CubeTensor::<Runtime>::new_contiguous(client.clone(), device.clone(), Shape::from(stored), h.clone(), dtype);
                if t {
                    v.meta.swap(r - 2, r - 1);
                }
                cubek::std::InputBinding::new(v.binding(), dtype_to_storage_type(dtype))
            };
            let mut reference: Option<Vec<f32>> = None;
            let flops = 2.0 * (batch * m * k * n) as f64;
            let label = format!(
                "{}{m} x {k} x {n}{}{}",
                if batch > 1 { format!("{batch} x ") } else { String::new() },
                if ta { " (a^T)" } else { "" },
                if tb { " (b^T)" } else { "" }
            );
            for ((name, level), stage) in routines.iter().flat_map(|r| {
                // The exact routines stage in f32 whatever the operands.
                let stagings: &[DType] = if r.0.ends_with("Unit") { &[DType::F32] } else { stages };
                stagings.iter().map(move |&st| (r, st))
            }) {
                let name = match stages.len() > 1 && !name.ends_with("Unit") {
                    true => format!("{name}, {} stage", if stage == DType::F32 { "f32" } else { "bf16" }),
                    false => name.clone(),
                };
                let y = client.empty(batch * m * n * 4);
                let out = CubeTensor::<Runtime>::new_contiguous(client.clone(), device.clone(), Shape::from(dims(m, n)), y.clone(), DType::F32);
                let f32s = dtype_to_storage_type(DType::F32);
                let mut dt = MatmulElems::from_globals(&MatmulGlobalElems { lhs: f32s, rhs: f32s, out: f32s });
                dt.lhs_global = dtype_to_storage_type(da);
                dt.rhs_global = dtype_to_storage_type(db);
                if stage != DType::F32 {
                    let st = dtype_to_storage_type(stage);
                    (dt.lhs_stage, dt.rhs_stage, dt.lhs_register, dt.rhs_register) = (st, st, st, st);
                }
                let strategy = Strategy::MultiLevel(level.clone());
                let launch = |dt: &mut MatmulElems| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        cubek::matmul::launch::launch_ref(
                            &strategy,
                            &client,
                            operand(&a, m, k, ta, da),
                            operand(&b, k, n, tb, db),
                            out.clone().binding(),
                            dt,
                        )
                    }))
                    .map_err(|p| p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default())
                    .and_then(|r| r.map_err(|e| format!("{e:?}")))
                };
                let first = launch(&mut dt.clone());
                if let Err(why) = first {
                    let why: String = why.lines().next().unwrap_or("").chars().take(160).collect();
                    println!("| {label} | {} | {name} | no: {} | | | |", args.dtype, why.replace('|', "/"));
                    continue;
                }
                for _ in 0..2 {
                    let _ = launch(&mut dt.clone());
                }
                let _ = cellgraph::runtime::value::block_on(client.sync());
                let t = Instant::now();
                for _ in 0..args.reps {
                    let _ = launch(&mut dt.clone());
                }
                let _ = cellgraph::runtime::value::block_on(client.sync());
                let secs = t.elapsed().as_secs_f64() / args.reps as f64;
                let got: Vec<f32> = client
                    .read_one(y)
                    .map_err(|e| format!("read: {e:?}"))?
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let diff = match &reference {
                    Some(r) => format!(
                        "{:.2e}",
                        r.iter().zip(&got).map(|(x, y)| (x - y).abs()).fold(0f32, |m, d| if d.is_nan() || m.is_nan() { f32::NAN } else { m.max(d) })
                    ),
                    None => {
                        reference = Some(got);
                        "(reference)".into()
                    }
                };
                println!("| {label} | {} | {name} | yes | {:.1} | {:.2} | {diff} |", args.dtype, secs * 1e6, flops / secs / 1e12);
            }
        }
        Ok(())
    }
}

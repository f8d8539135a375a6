//! Matrix products on the device: cubek's exact-f32 tiled kernels (the strategy bound per
//! shape), its tensor-core kernel on TF32 operands where asked (counted where it does not set
//! up), products over a long inner extent cut into parts, and a one-unit-per-output kernel
//! where cubek sets nothing up.

use burn_backend::cubecl::dtype_to_storage_type;
use burn_backend::Shape;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubek::matmul::strategy::Strategy;

use super::sums::sum_rows;
use super::{arr, empty, grid};
use crate::arena::Arena;
use crate::kernel::Tiling;

/// cubek's exact-f32 kernel for a bound matmul's tiling.
fn exact_strategy(tiling: Tiling) -> Strategy {
    use cubek::matmul::multi_level::Strategy as Level;
    Strategy::MultiLevel(match tiling {
        Tiling::Simple => Level::SimpleUnit(Default::default()),
        Tiling::Double => Level::DoubleUnit(Default::default()),
    })
}

/// cubek's tensor-core kernels (f32 operands rounded to TF32: the `tf32` opt-in; bf16 / f16
/// operands as they are), in the order they are tried for a shape: the first that sets up runs
/// it from then on. The order is the H200's (`benches/matmul_probe.rs`, 2026-12-04, at the
/// MLP's and the GPT's products): the double-buffered `mma` kernel was the fastest of the
/// three at most shapes (bf16 `8192 x 128 x 384`: 38.5 us against 60.8 for CMMA), the single
/// `mma` kernel next; CMMA, the one tried alone before, last. The TMA kernels, faster still at
/// some shapes, need 16-byte-aligned strides, which views into flat buffers do not have.
const TENSOR_CORE_ROUTINES: [&str; 3] = ["DoubleCyclicMma", "SimpleCyclicMma", "SimpleCyclicCmma"];

/// The tensor-core kernel named in [`TENSOR_CORE_ROUTINES`].
fn tensor_core_strategy(name: &str) -> Strategy {
    use cubek::matmul::multi_level::Strategy as Level;
    Strategy::MultiLevel(match name {
        "DoubleCyclicMma" => Level::DoubleCyclicMma(Default::default()),
        "SimpleCyclicMma" => Level::SimpleCyclicMma(Default::default()),
        _ => Level::SimpleCyclicCmma(Default::default()),
    })
}

/// `y = op(a) @ op(b)` on cubek's kernel for `tiling` (with `tf32`, first its tensor-core
/// kernel, which rounds f32 operands to TF32, where the device has one); `a` and `b`
/// contiguous, row-major as stored (`k x m` when `ta`), `y` `m x n`; `batch` such products
/// one after another in each buffer (attention's). False when cubek cannot set a kernel up
/// on this device.
#[allow(clippy::too_many_arguments)]
pub(super) fn cubek_matmul<R: CubeRuntime>(
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    y: &CubeTensor<R>,
    batch: usize,
    [m, k, n]: [usize; 3],
    ta: bool,
    tb: bool,
    tiling: Tiling,
    tf32: bool,
) -> bool {
    use burn_backend::DType;
    use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
    let dims = |rows: usize, cols: usize| if batch > 1 { vec![batch, rows, cols] } else { vec![rows, cols] };
    // A transposed operand is its stored matrices with their strides swapped (no copy), in
    // the type it is stored in (f32, or a session's bf16 / f16).
    let operand = |t: &CubeTensor<R>, rows: usize, cols: usize, transposed: bool| {
        let stored = if transposed { dims(cols, rows) } else { dims(rows, cols) };
        let r = stored.len();
        let mut v = CubeTensor::new_contiguous(t.client.clone(), t.device.clone(), Shape::from(stored), t.handle.clone(), t.dtype);
        if transposed {
            v.meta.swap(r - 2, r - 1);
        }
        cubek::std::InputBinding::new(v.binding(), dtype_to_storage_type(t.dtype))
    };
    let out = CubeTensor::new_contiguous(y.client.clone(), y.device.clone(), Shape::from(dims(m, n)), y.handle.clone(), DType::F32);
    let f32s = dtype_to_storage_type(DType::F32);
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems { lhs: f32s, rhs: f32s, out: f32s });
    // Operands stored in bf16 / f16 are read as they are stored: widened to f32 in the stage
    // for the exact kernels (f32 products and sums of the same values, the same bits as from
    // f32 storage), kept in their type for the tensor-core kernel when both are (bf16 / f16
    // tensor cores, f32 sums).
    let (lt, rt) = (dtype_to_storage_type(a.dtype), dtype_to_storage_type(b.dtype));
    dtypes.lhs_global = lt;
    dtypes.rhs_global = rt;
    let half_cores = tf32 && a.dtype == b.dtype && a.dtype != DType::F32;
    let mut cores = dtypes.clone();
    if half_cores {
        (cores.lhs_stage, cores.rhs_stage, cores.lhs_register, cores.rhs_register) = (lt, rt, lt, rt);
    }
    let launch = |strategy: &Strategy, dtypes: &mut MatmulElems| {
        cubek::matmul::launch::launch_ref(strategy, &y.client, operand(a, m, k, ta), operand(b, k, n, tb), out.clone().binding(), dtypes)
    };
    if tf32 {
        // The routine that set up for this shape on this runtime, tried first; a shape none
        // set up for is not tried again.
        let key = (std::any::TypeId::of::<R>(), batch, [m, k, n], ta, tb, half_cores);
        let known = TENSOR_CORES.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
        let chosen = match known {
            Some(chosen) => chosen.and_then(|i| launch(&tensor_core_strategy(TENSOR_CORE_ROUTINES[i]), &mut cores).ok().map(|_| i)),
            None => {
                let mut refusals = Vec::new();
                let chosen = TENSOR_CORE_ROUTINES.iter().position(|name| match launch(&tensor_core_strategy(name), &mut cores.clone()) {
                    Ok(()) => true,
                    Err(e) => {
                        let e = format!("{e:?}");
                        refusals.push(format!("{name}: {}", e.lines().next().unwrap_or_default()));
                        false
                    }
                });
                if chosen.is_none() {
                    super::note_refusal(
                        "matmul",
                        format_args!(
                            "{batch} x [{m}, {k}, {n}] (transposed {ta}, {tb}), {:?} x {:?} operands: {}",
                            a.dtype,
                            b.dtype,
                            refusals.join("; ")
                        ),
                    );
                }
                chosen
            }
        };
        TENSOR_CORES.lock().unwrap_or_else(|e| e.into_inner()).insert(key, chosen);
        if chosen.is_some() {
            return true;
        }
        TF32_FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    launch(&exact_strategy(tiling), &mut dtypes).is_ok()
}

/// Per matmul shape (runtime, batch, `[m, k, n]`, transposes, bf16 / f16 operands), which of
/// [`TENSOR_CORE_ROUTINES`] set up for it, or none: the exact kernel then runs it without
/// trying again.
type Tf32Key = (std::any::TypeId, usize, [usize; 3], bool, bool, bool);
static TENSOR_CORES: std::sync::Mutex<std::collections::BTreeMap<Tf32Key, Option<usize>>> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Matmuls asked for tensor cores (TF32) that ran on cubek's exact-f32 kernel because its
/// tensor-core kernel did not set up on the device (in this process).
static TF32_FALLBACKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many matmuls and convolutions asked for TF32 tensor cores
/// ([`crate::Session::set_tf32`], or bf16 values' products,
/// [`crate::Bf16Unit::Tf32TensorCores`]) ran in exact f32 instead in this process, because
/// the device has no tensor-core kernel for them.
pub fn tf32_fallbacks() -> u64 {
    TF32_FALLBACKS.load(std::sync::atomic::Ordering::Relaxed) + super::conv::conv_tf32_fallbacks()
}

/// Counts a product asked for tensor cores that ran on an exact kernel (see [`tf32_fallbacks`]).
pub(super) fn count_tf32_fallback() {
    TF32_FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Matmuls that ran on [`matmul`] because cubek's kernel did not set up (in this process).
pub(super) static NAIVE_MATMULS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many matmuls fell back from cubek's tiled kernels to the one-unit-per-output kernel in
/// this process (0 on wgpu and CUDA for every shape the tests run).
pub fn naive_matmuls() -> u64 {
    NAIVE_MATMULS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `c = op(a) @ op(b)` in exact f32, one unit per output element: where cubek's kernels do
/// not set up on a device.
#[cube(launch_unchecked)]
pub fn matmul<F: Float>(a: &[F], b: &[F], c: &mut [F], #[comptime] mkn: [u32; 3], #[comptime] ta: bool, #[comptime] tb: bool) {
    let idx = ABSOLUTE_POS;
    if idx < c.len() {
        let (mm, kk, nn) = comptime!((mkn[0] as usize, mkn[1] as usize, mkn[2] as usize));
        let i = idx / nn;
        let j = idx % nn;
        let mut acc = F::new(0.0);
        for p in 0..kk {
            let mut ai = i * kk + p;
            if ta {
                ai = p * mm + i;
            }
            let mut bi = p * nn + j;
            if tb {
                bi = j * kk + p;
            }
            acc += a[ai] * b[bi];
        }
        c[idx] = acc;
    }
}

/// The parts a product `a^T b` of a long inner extent `k` is cut into (a weight gradient:
/// `k` the batch's rows), when cutting pays: cubek's kernels spread a product over its
/// outputs only, so a `128 x 128` output over `k = 8192` ran on a few hundred units, each
/// walking all of `k` (1.5 ms on an H200). Parts of `k / parts >= 256` rows, a power of two
/// dividing `k`, at most 64, and none when the output alone fills the device.
fn split_parts(m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Option<usize> {
    // Only `a` stored `[k, m]` and `b` stored `[k, n]` make each part's operands consecutive
    // rows (a batch of `[k / parts, m]` and `[k / parts, n]` matrices, no copy).
    if !ta || tb || m * n > 512 * 512 || k < 1024 {
        return None;
    }
    let parts = (k / 256).min(64);
    let parts = (0..=parts.ilog2()).rev().map(|e| 1usize << e).find(|p| k.is_multiple_of(*p))?;
    (parts > 1).then_some(parts)
}

/// `y = a^T b` (or `y += a^T b` with `accumulate`) for a long inner extent (see
/// [`split_parts`]): the parts' products as one batched product into scratch, then their sum
/// (in part order: the same bits on every run). False, having launched nothing, when the
/// product is not cut or cubek's batched kernel does not set up.
#[allow(clippy::too_many_arguments)]
pub(super) fn split_matmul<R: CubeRuntime>(
    [m, k, n]: [usize; 3],
    ta: bool,
    tb: bool,
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    y: &CubeTensor<R>,
    accumulate: bool,
    tf32: bool,
    arena: &mut Arena,
) -> bool {
    let Some(parts) = split_parts(m, k, n, ta, tb) else { return false };
    let client = &y.client;
    let len = parts * m * n;
    let part = arena.take_scratch::<CubeTensor<R>>(len).unwrap_or_else(|| empty::<R>(client, &y.device, &[parts, m, n]));
    let kc = k / parts;
    let done = cubek_matmul(a, b, &part, parts, [m, kc, n], ta, tb, Tiling::for_extents(m, kc, n), tf32);
    if done {
        let (count, dim) = grid(client, m * n);
        // SAFETY: one unit per element of `y` (`m * n`), reading `parts * m * n` of `part`.
        let f32s = dtype_to_storage_type(burn_backend::DType::F32);
        unsafe { sum_rows::launch_unchecked::<R>(client, count, dim, arr(&part), arr(y), parts as u32, accumulate, None, f32s, f32s) };
    }
    arena.give_scratch(len, part);
    done
}

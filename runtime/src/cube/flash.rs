//! The attention op's forward on cubek-attention (flash attention) where tensor cores are asked
//! for (bf16 values' products, `--tf32`), as matmuls and convolutions are put on cubek's
//! tensor-core kernels: its `BlackboxAccelerated` routine multiplies on tensor cores in f16
//! fragments (the queries, keys and values, then the probabilities: bf16 values are f16 values
//! where f16's range holds them; 10 significant bits, as TF32's, for f32 values) with f32 sums
//! and softmax statistics. The gradient stays on the runtime's own kernels
//! ([`super::attention`]), which recompute the probabilities from `qkv` (no statistics pass
//! between the two).
//!
//! The op's operand `qkv [b, t, 3c]` is read in place: queries, keys and values are three
//! strided views of it, `[b, heads, t, d]` with strides `[t * 3c, d, 3c, 1]` from element 0, `c`
//! and `2c`, and the output `[b, t, c]` is written through the same view of it. A view starts
//! at a binding offset, which devices align (256 bytes on WebGPU), so cubek takes a width
//! `c` that is a multiple of 128 ([`crate::kernel::flash_attention_takes`]); where it does not set up (no tensor cores with f16
//! fragments: lavapipe), the runtime's kernel runs the op, counted in
//! [`super::tf32_fallbacks`] as matmuls and convolutions are.
//!
//! The accelerated routine loads the queries straight into its f16 fragments, with no stage
//! to convert them in: it refuses bf16 or f32 queries ("Query global and tile types must be
//! the same", on an H200, 2026-12-04). So `qkv` in another type is first copied into an f16
//! buffer of the plan's arena (one launch; bf16 values are f16 values where f16's range holds
//! them, and f32 values are rounded to f16 as the routine's fragments would round them), and
//! the routine reads that. It is tried with 4, 2 and 1 planes per cube, the first that sets up
//! kept for the shape; a shape none sets up for is not staged again.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use burn_backend::cubecl::dtype_to_storage_type;
use burn_backend::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubek::attention::forward::definition::{AccumulatorPrecision, AttentionGlobalTypes, AttentionOptions};
use cubek::attention::forward::launch::{launch_ref, BlueprintStrategy, Strategy};
use cubek::attention::forward::routines::blackbox_accelerated::BlackboxAcceleratedStrategy;

use crate::arena::Arena;

static RAN: AtomicU64 = AtomicU64::new(0);

/// Planes per cube the accelerated routine is tried with, in order.
const PLANES: [u8; 3] = [4, 2, 1];

/// Per shape (`[b, t, heads, d]`, causal, the output's type), the planes the accelerated
/// routine set up with, or `None` where it set up with none.
type Shape = ([usize; 4], bool, String);
static CHOSEN: Mutex<BTreeMap<Shape, Option<u8>>> = Mutex::new(BTreeMap::new());

thread_local! {
    static UNIT: Cell<bool> = const { Cell::new(false) };
}

/// How many attention forwards ran on cubek-attention in this process.
pub fn cubek_attentions() -> u64 {
    RAN.load(Ordering::Relaxed)
}

/// For tests on devices without tensor cores (lavapipe): this thread's attention forwards run
/// on cubek's `Unit` routine (f32 on the units, no tensor cores), whatever the session asks,
/// so that the views and the launch are checked where the accelerated routine cannot run.
#[doc(hidden)]
pub fn set_unit_routine_for_tests(on: bool) {
    UNIT.set(on);
}

pub(super) fn unit_routine_for_tests() -> bool {
    UNIT.get()
}

/// `t`'s memory viewed from element `offset` with `shape` and `strides`.
fn strided<R: CubeRuntime>(t: &CubeTensor<R>, offset: usize, shape: [usize; 4], strides: [usize; 4]) -> CubeTensor<R> {
    let mut v = t.clone();
    v.handle = t.handle.clone().offset_start((offset * t.dtype.size()) as u64);
    v.meta.shape = shape.to_vec().into();
    v.meta.strides = strides.to_vec().into();
    v
}

/// The attention of `qkv [b, t, 3 * heads * d]` (contiguous) into `y [b, t, heads * d]`
/// (contiguous) on cubek-attention: the accelerated routine (`qkv` staged in f16 first unless
/// it is f16), or the unit one (tests, reading `qkv` as it is). Returns whether it ran (false:
/// it did not set up; at most the staging copy was launched, once per shape).
#[allow(clippy::too_many_arguments)]
pub(super) fn forward<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    y: &CubeTensor<R>,
    b: usize,
    t: usize,
    heads: usize,
    d: usize,
    causal: bool,
    unit: bool,
    arena: &mut Arena,
) -> bool {
    if !crate::kernel::flash_attention_takes(heads, d) {
        return false;
    }
    if !qkv.is_contiguous() || !y.is_contiguous() {
        super::note_refusal("attention", format_args!("qkv strides {:?}, output strides {:?}: not contiguous", qkv.meta.strides(), y.meta.strides()));
        return false;
    }
    if unit {
        let ran = launch(qkv, y, [b, t, heads, d], causal, Strategy::Unit(BlueprintStrategy::Inferred(()))).is_ok();
        if ran {
            RAN.fetch_add(1, Ordering::Relaxed);
        }
        return ran;
    }
    let shape: Shape = ([b, t, heads, d], causal, format!("{:?}", y.dtype));
    let chosen = CHOSEN.lock().unwrap_or_else(|e| e.into_inner()).get(&shape).copied();
    let planes = match chosen {
        Some(None) => return false,
        Some(Some(p)) => vec![p],
        None => PLANES.to_vec(),
    };
    if qkv.dtype != DType::F16 && !qkv.client.properties().supports_type(dtype_to_storage_type(DType::F16)) {
        super::note_refusal("attention", "the device has no f16 type to stage the queries in");
        CHOSEN.lock().unwrap_or_else(|e| e.into_inner()).insert(shape, None);
        return false;
    }
    let staged = (qkv.dtype != DType::F16).then(|| {
        let s = super::output_of::<R>(arena, &qkv.client, &qkv.device, &[b, t, 3 * heads * d], DType::F16);
        super::layout::convert::<R>(qkv, &s);
        s
    });
    let src = staged.as_ref().unwrap_or(qkv);
    let mut ran = None;
    for p in planes {
        let strategy = Strategy::BlackboxAccelerated(BlueprintStrategy::Inferred(BlackboxAcceleratedStrategy { num_planes: p, seq_q: 1, seq_kv: 1 }));
        match launch(src, y, [b, t, heads, d], causal, strategy) {
            Ok(()) => {
                ran = Some(p);
                break;
            }
            Err(e) => super::note_refusal(
                "attention",
                format_args!("{b} x {heads} heads x {t} x {d}, {:?} values staged as {:?}, {p} planes: {e}", qkv.dtype, src.dtype),
            ),
        }
    }
    CHOSEN.lock().unwrap_or_else(|e| e.into_inner()).insert(shape, ran);
    if let Some(s) = staged {
        // Later launches run after the routine's: the buffer may be written again.
        arena.give_device(qkv.meta.num_elements(), DType::F16.size(), s);
    }
    if ran.is_some() {
        RAN.fetch_add(1, Ordering::Relaxed);
    }
    ran.is_some()
}

/// One launch of `strategy` over the queries, keys and values viewed in `qkv`, writing `y`.
fn launch<R: CubeRuntime>(qkv: &CubeTensor<R>, y: &CubeTensor<R>, bthd: [usize; 4], causal: bool, strategy: Strategy) -> Result<(), String> {
    let [b, t, heads, d] = bthd;
    let c = heads * d;
    let view = [b, heads, t, d];
    let read = [t * 3 * c, d, 3 * c, 1];
    let (q, k, v) = (strided(qkv, 0, view, read), strided(qkv, c, view, read), strided(qkv, 2 * c, view, read));
    let out = strided(y, 0, view, [t * c, d, c, 1]);
    let client = qkv.client.clone();
    let (at, ot) = (dtype_to_storage_type(qkv.dtype), dtype_to_storage_type(y.dtype));
    let types = AttentionGlobalTypes { query: at, key: at, value: at, mask: AttentionGlobalTypes::mask_dtype(&client), out: ot };
    let options =
        AttentionOptions { causal, accumulator_precision: AccumulatorPrecision::Strict(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::F32)) };
    launch_ref::<R>(strategy, &client, q.binding(), k.binding(), v.binding(), None, out.binding(), &types, options).map_err(|e| format!("{e:?}"))
}

//! Lowering: one exhaustive `match` from IR ops to burn backend primitives.
//!
//! [`eval`] computes one node from its operand values. It is generic over `B: Backend`, so the
//! same code runs on the CPU (ndarray) and on CUDA (cubecl). Device tensors of IR rank 0 are
//! held as shape `[1]` (burn has no rank-0 tensors); the IR type decides the host shape.

use burn_backend::ops::{ConvOptions, ConvTransposeOptions};
use burn_backend::tensor::{Device, FloatTensor, IntTensor};
use burn_backend::{DeviceSettings, FloatDType, Scalar, Slice, TensorData};
use cellgraph_compiler::infer::infer;
use cellgraph_compiler::program::{Step, Val};
use cellgraph_compiler::window::{self, Window};
use cellgraph_compiler::{DType, HostData, Op, PadMode, Pool2dAttrs, ReduceAttrs, Reduction, TensorType};

use crate::arena::Arena;
use crate::backend::{bshape, Backend, HostVec};
use crate::error::{Result, RuntimeError};
use crate::kernel::{dropout_factor, Native};
use crate::value::Value;

/// What one evaluation needs besides its operands.
pub struct Ctx<'a, B: Backend> {
    pub device: &'a Device<B>,
    pub settings: DeviceSettings,
    pub scope: &'a str,
    pub op: &'static str,
    /// `assign_add` writes into its target's memory (flat device buffers).
    pub in_place: bool,
    /// The step's class-id labels or row ids are a plan input the executor checked on the
    /// host before uploading it ([`label_error`], [`id_error`]), so the lowering does not read
    /// them back.
    pub ids_checked: bool,
    /// Matmuls may round their operands to TF32 on tensor cores (the session's opt-in).
    pub tf32: bool,
    /// Host products of bf16 operands may run on bf16 pairs (the session's setting).
    pub bf16: bool,
}

impl<B: Backend> Ctx<'_, B> {
    fn unsupported<T>(&self, detail: impl Into<String>) -> Result<T> {
        Err(RuntimeError::Unsupported { scope: self.scope.into(), op: self.op, detail: detail.into() })
    }
    fn bad<T>(&self, detail: impl Into<String>) -> Result<T> {
        Err(RuntimeError::BadValue { scope: self.scope.into(), op: self.op, detail: detail.into() })
    }
    fn float(&self, v: Value<B>) -> Result<FloatTensor<B>> {
        match v {
            Value::Float(t) => Ok(t),
            _ => self.unsupported("expected a float operand"),
        }
    }
    fn int(&self, v: Value<B>) -> Result<IntTensor<B>> {
        match v {
            Value::Int(t) => Ok(t),
            _ => self.unsupported("expected an integer operand"),
        }
    }
    fn full(&self, dims: &[usize], value: f64) -> FloatTensor<B> {
        B::float_full(bshape(dims), Scalar::Float(value), self.device, self.settings.float_dtype)
    }
}

/// Broadcasts `t` (IR extents `from`) to IR extents `to`.
fn expand<B: Backend>(t: FloatTensor<B>, from: &[usize], to: &[usize]) -> FloatTensor<B> {
    if from == to {
        return t;
    }
    let mut padded = vec![1; to.len() - from.len()];
    padded.extend_from_slice(from);
    B::float_expand(B::float_reshape(t, bshape(&padded)), bshape(to))
}

/// Broadcasts a value of any kind (IR extents `from`) to IR extents `to`.
fn expand_value<B: Backend>(v: Value<B>, from: &[usize], to: &[usize]) -> Value<B> {
    if from == to {
        return v;
    }
    let mut padded = vec![1; to.len() - from.len()];
    padded.extend_from_slice(from);
    let (p, t) = (bshape(&padded), bshape(to));
    match v {
        Value::Float(x) => Value::Float(expand::<B>(x, from, to)),
        Value::Int(x) => Value::Int(B::int_expand(B::int_reshape(x, p), t)),
        Value::Bool(x) => Value::Bool(B::bool_expand(B::bool_reshape(x, p), t)),
    }
}

/// An integer tensor's values on the host (read back from a device).
fn host_ints<B: Backend>(t: IntTensor<B>) -> Vec<i64> {
    crate::value::block_on(B::int_into_data(t)).expect("device read").convert::<i64>().try_to_vec::<i64>().expect("int data")
}

/// What is wrong with row `ids` into a table of `rows` rows: the first one outside `0..rows`.
pub fn id_error(ids: impl IntoIterator<Item = i64>, rows: usize) -> Option<String> {
    let (k, bad) = ids.into_iter().enumerate().find(|&(_, i)| i < 0 || i >= rows as i64)?;
    Some(format!("id {bad} at position {k} is out of range for a table of {rows} rows (valid: 0..{})", rows.saturating_sub(1)))
}

/// Reads integer `ids` back and reports what `error` finds in them, unless the executor
/// checked them on the host before uploading them (then nothing is read).
fn checked_on_device<B: Backend>(cx: &Ctx<B>, ids: &IntTensor<B>, error: impl FnOnce(Vec<i64>) -> Option<String>) -> Result<()> {
    match (!cx.ids_checked).then(|| error(host_ints::<B>(ids.clone()))).flatten() {
        Some(e) => cx.bad(e),
        None => Ok(()),
    }
}

/// Checks that row `ids` lie in `0..rows`.
fn checked_ids<B: Backend>(cx: &Ctx<B>, ids: &IntTensor<B>, rows: usize) -> Result<()> {
    checked_on_device(cx, ids, |v| id_error(v, rows))
}

/// The mask of causal attention over scores of extents `dims` (`[..., T, S]`): true where
/// `j > i + S - T`. Built from index ranges on the device (burn-cubecl 0.21 cannot upload host
/// bools).
fn causal<B: Backend>(cx: &Ctx<B>, dims: &[usize]) -> burn_backend::tensor::BoolTensor<B> {
    let r = dims.len();
    let (t, s) = (dims[r - 2], dims[r - 1]);
    let it = cx.settings.int_dtype;
    let rows = B::int_add_scalar(B::int_arange(0..t as i64, cx.device, it), Scalar::Int(s as i64 - t as i64));
    let rows = B::int_expand(B::int_reshape(rows, bshape(&[t, 1])), bshape(&[t, s]));
    let cols = B::int_expand(B::int_reshape(B::int_arange(0..s as i64, cx.device, it), bshape(&[1, s])), bshape(&[t, s]));
    let m = B::int_greater(cols, rows, cx.settings.bool_dtype);
    let mut padded = vec![1; r - 2];
    padded.extend([t, s]);
    B::bool_expand(B::bool_reshape(m, bshape(&padded)), bshape(dims))
}

/// `[b, t, c, d]` of an attention of `heads` heads over `qkv [b, t, 3c]` (`d = c / heads`).
fn attention_extents(qkv: &TensorType, heads: usize) -> [usize; 4] {
    let dims = qkv.dims();
    [dims[0], dims[1], dims[2] / 3, dims[2] / 3 / heads]
}

/// Queries, keys and values `[b, heads, t, d]` of `qkv` (IR type `ty`).
fn split_heads<B: Backend>(qkv: FloatTensor<B>, ty: &TensorType, heads: usize) -> [FloatTensor<B>; 3] {
    let [b, t, c, d] = attention_extents(ty, heads);
    [0, 1, 2].map(|i| {
        let part = B::float_slice(qkv.clone(), &slices(&[0, 0, i * c], &[b, t, (i + 1) * c]));
        B::float_swap_dims(B::float_reshape(part, bshape(&[b, t, heads, d])), 1, 2)
    })
}

/// `op(a) @ op(b)` over `[b, heads, .., ..]` operands of an attention over `qkv`, `m x k` by
/// `k x n` (each `op` transposing its last two axes or not): on the backend's own batched
/// matmul where it has one (a device's cubek exact-f32 kernels, TF32 only under the session's
/// opt-in: burn's matmul would take TF32 tensor cores), else burn's.
#[allow(clippy::too_many_arguments)]
fn heads_matmul<B: Backend>(
    cx: &Ctx<B>,
    qkv: &TensorType,
    heads: usize,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    [ta, tb]: [bool; 2],
    [m, k, n]: [usize; 3],
) -> FloatTensor<B> {
    let native =
        Native::BatchMatMul { batch: qkv.dims()[0] * heads, m, k, n, transpose_a: ta, transpose_b: tb, products: crate::kernel::Products::F32 };
    let out = qkv.with_shape(vec![qkv.dims()[0], heads, m, n]);
    if let Some(y) = B::device_kernel(&native, &[&a, &b], &[], &out, cx.tf32, &mut Arena::default()) {
        return y;
    }
    let a = if ta { B::float_swap_dims(a, 2, 3) } else { a };
    let b = if tb { B::float_swap_dims(b, 2, 3) } else { b };
    B::float_matmul(a, b)
}

/// `[b, heads, t, d]` back to `[b, t, heads * d]` (`out`).
fn merge_heads<B: Backend>(x: FloatTensor<B>, out: &[usize]) -> FloatTensor<B> {
    B::float_reshape(B::float_swap_dims(x, 1, 2), bshape(out))
}

/// The attention probabilities `[b, heads, t, t]` of an attention over `qkv`:
/// `softmax(q k^T / sqrt(d))` over each row's keys (under `causal`, the later keys filled with
/// minus infinity first).
fn attention_probs<B: Backend>(cx: &Ctx<B>, q: FloatTensor<B>, k: FloatTensor<B>, qkv: &TensorType, heads: usize, causal: bool) -> FloatTensor<B> {
    let [b, t, _, d] = attention_extents(qkv, heads);
    let shape = [b, heads, t, t];
    let s = B::float_mul_scalar(heads_matmul(cx, qkv, heads, q, k, [false, true], [t, d, t]), Scalar::Float(1.0 / (d as f64).sqrt()));
    let s = if causal { B::float_mask_fill(s, self::causal(cx, &shape), Scalar::Float(f64::NEG_INFINITY)) } else { s };
    let m = B::float_expand(B::float_max_dim(s.clone(), 3), bshape(&shape));
    let e = B::float_exp(B::float_sub(s, m));
    let sum = B::float_expand(B::float_sum_dim(e.clone(), 3), bshape(&shape));
    B::float_div(e, sum)
}

fn slices(begin: &[usize], end: &[usize]) -> Vec<Slice> {
    begin.iter().zip(end).map(|(&b, &e)| Slice::new(b as isize, Some(e as isize), 1)).collect()
}

/// Pads `t` (IR extents `dims`) with `fill`, `lo[i]`/`hi[i]` elements around axis `i`.
fn pad_with<B: Backend>(cx: &Ctx<B>, t: FloatTensor<B>, dims: &[usize], lo: &[usize], hi: &[usize], fill: f64) -> FloatTensor<B> {
    let out: Vec<usize> = (0..dims.len()).map(|i| lo[i] + dims[i] + hi[i]).collect();
    let end: Vec<usize> = (0..dims.len()).map(|i| lo[i] + dims[i]).collect();
    B::float_slice_assign(cx.full(&out, fill), &slices(lo, &end), t)
}

/// Pads an NCHW tensor spatially by a resolved window's `[top, bottom, left, right]`.
fn pad_spatial<B: Backend>(cx: &Ctx<B>, t: FloatTensor<B>, dims: &[usize], w: &Window, fill: f64) -> (FloatTensor<B>, Vec<usize>) {
    let lo = [0, 0, w.pad[0], w.pad[2]];
    let hi = [0, 0, w.pad[1], w.pad[3]];
    let out: Vec<usize> = (0..4).map(|i| lo[i] + dims[i] + hi[i]).collect();
    (pad_with(cx, t, dims, &lo, &hi, fill), out)
}

/// Sums (or maxes) over `axes`, then reshapes to the IR result type.
fn reduce<B: Backend>(t: FloatTensor<B>, r: &ReduceAttrs, out: &TensorType, max: bool) -> FloatTensor<B> {
    let mut t = t;
    for &a in r.axes.iter().rev() {
        t = if max { B::float_max_dim(t, a) } else { B::float_sum_dim(t, a) };
    }
    B::float_reshape(t, bshape(out.dims()))
}

fn kept(dims: &[usize], axes: &[usize]) -> Vec<usize> {
    dims.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect()
}

fn pool_window<B: Backend>(cx: &Ctx<B>, x: &TensorType, p: &Pool2dAttrs) -> Result<Window> {
    let d = x.dims();
    window::resolve([d[2], d[3]], p.kernel, p.stride, [1, 1], p.pad_mode, p.pad).or_else(|e| cx.bad(e))
}

/// Log-softmax over axis 1 of `[N, C]` logits.
fn log_softmax<B: Backend>(l: FloatTensor<B>, n: usize, c: usize) -> FloatTensor<B> {
    let m = B::float_expand(B::float_max_dim(l.clone(), 1), bshape(&[n, c]));
    let z = B::float_sub(l, m);
    let lse = B::float_log(B::float_sum_dim(B::float_exp(z.clone()), 1));
    B::float_sub(z, B::float_expand(lse, bshape(&[n, c])))
}

/// What is wrong with class-id `labels` for `c` classes: the first one outside `0..c`.
pub fn label_error(labels: impl IntoIterator<Item = i64>, c: usize) -> Option<String> {
    let (i, bad) = labels.into_iter().enumerate().find(|&(_, l)| l < 0 || l >= c as i64)?;
    Some(format!("label {bad} at batch position {i} is out of range for {c} classes (valid: 0..{})", c.saturating_sub(1)))
}

/// Checks sparse labels are class ids in `0..c` (unless the executor did, on the host) and
/// returns them as `[N, 1]`.
fn checked_labels<B: Backend>(cx: &Ctx<B>, y: IntTensor<B>, n: usize, c: usize) -> Result<IntTensor<B>> {
    checked_on_device(cx, &y, |v| label_error(v, c))?;
    Ok(B::int_reshape(y, bshape(&[n, 1])))
}

/// One-hot `[N, C]` floats from `[N, 1]` class ids.
fn one_hot<B: Backend>(cx: &Ctx<B>, y: IntTensor<B>, n: usize, c: usize) -> FloatTensor<B> {
    let ids = B::int_arange(0..c as i64, cx.device, cx.settings.int_dtype);
    let ids = B::int_expand(B::int_reshape(ids, bshape(&[1, c])), bshape(&[n, c]));
    let eq = B::int_equal(B::int_expand(y, bshape(&[n, c])), ids, cx.settings.bool_dtype);
    B::bool_into_float(eq, cx.settings.float_dtype)
}

fn padding_out(k: usize, s: usize, p: usize, d: usize, size_in: usize, size_out: usize) -> usize {
    if s <= 1 {
        return 0;
    }
    let base = (size_out as i64 - 1) * s as i64 + (d * (k - 1) + 1) as i64 - 2 * p as i64;
    (size_in as i64 - base).max(0) as usize
}

/// Operands burn's ops widened from the bf16 / f16 a device session stored them in
/// ([`crate::Session::set_low_precision_storage`]) in this process: a session binds such
/// values to readers that read the type, so this counts only launch-time fallbacks.
static WIDENED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many operands stored in bf16 / f16 burn's ops widened to the session's float type
/// before computing (see [`WIDENED`]).
pub fn low_operands_widened() -> u64 {
    WIDENED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Evaluates one non-leaf op. `args` pairs each operand value with its IR type. On a device
/// the result may have padded rows, as burn's ops leave it: the executor lays it out row-major
/// in its arena ([`Value::unpitched`]) before a kernel of the session's reads it flat.
pub fn eval<B: Backend>(cx: &Ctx<B>, op: &Op, mut args: Vec<(Value<B>, &TensorType)>, out: &TensorType) -> Result<Value<B>> {
    // burn's ops compute in their operands' type: a value stored low is widened first (exact)
    // unless the op only views it.
    if !matches!(op, Op::Reshape { .. } | Op::Flatten) {
        let float: burn_backend::DType = cx.settings.float_dtype.into();
        for (v, _) in args.iter_mut() {
            if let Value::Float(t) = v {
                if burn_backend::TensorMetadata::dtype(t) != float
                    && matches!(burn_backend::TensorMetadata::dtype(t), burn_backend::DType::BF16 | burn_backend::DType::F16)
                {
                    WIDENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    *t = B::float_cast(t.clone(), cx.settings.float_dtype);
                }
            }
        }
    }
    let tys: Vec<&TensorType> = args.iter().map(|(_, t)| *t).collect();
    let mut vals = args.into_iter().map(|(v, _)| v);
    let mut next = || vals.next().expect("arity checked by the verifier");
    let od = out.dims();
    let binary = |cx: &Ctx<B>, a: Value<B>, b: Value<B>, f: fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>| {
        let a = expand::<B>(cx.float(a)?, tys[0].dims(), od);
        let b = expand::<B>(cx.float(b)?, tys[1].dims(), od);
        Ok::<_, RuntimeError>(Value::Float(f(a, b)))
    };
    Ok(match op {
        Op::Parameter { .. } | Op::Input { .. } => return cx.unsupported("leaves are bound by the executor"),
        Op::Constant { value } => match out.dtype {
            DType::F32 | DType::F16 | DType::BF16 => Value::Float(cx.full(od, *value)),
            DType::I32 | DType::I64 => Value::Int(B::int_from_data(
                TensorData::new(vec![*value as i64; out.numel()], bshape(od)).convert_dtype(cx.settings.int_dtype.into()),
                cx.device,
            )),
            DType::Bool => Value::Bool(B::bool_from_data(TensorData::new(vec![*value != 0.0; out.numel()], bshape(od)), cx.device)),
        },
        Op::Add => binary(cx, next(), next(), B::float_add)?,
        Op::Sub => binary(cx, next(), next(), B::float_sub)?,
        Op::Mul => binary(cx, next(), next(), B::float_mul)?,
        Op::Div => binary(cx, next(), next(), B::float_div)?,
        Op::Neg => Value::Float(B::float_neg(cx.float(next())?)),
        Op::Exp => Value::Float(B::float_exp(cx.float(next())?)),
        Op::Log => Value::Float(B::float_log(cx.float(next())?)),
        Op::Relu => Value::Float(B::relu(cx.float(next())?)),
        Op::Sqrt => Value::Float(B::float_sqrt(cx.float(next())?)),
        // A world of one: the sum over ranks is the operand (the executor runs it over a
        // communicator when it has one).
        Op::AllReduce | Op::StopGradient => next(),
        Op::GreaterEqual | Op::Equal => {
            let a = expand_value::<B>(next(), tys[0].dims(), od);
            let b = expand_value::<B>(next(), tys[1].dims(), od);
            let bd = cx.settings.bool_dtype;
            Value::Bool(match (a, b, op) {
                (Value::Float(a), Value::Float(b), Op::GreaterEqual) => B::float_greater_equal(a, b, bd),
                (Value::Float(a), Value::Float(b), _) => B::float_equal(a, b, bd),
                (Value::Int(a), Value::Int(b), Op::GreaterEqual) => B::int_greater_equal(a, b, bd),
                (Value::Int(a), Value::Int(b), _) => B::int_equal(a, b, bd),
                (Value::Bool(a), Value::Bool(b), Op::Equal) => B::bool_equal(a, b),
                _ => return cx.unsupported("comparison of these operand kinds"),
            })
        }
        Op::Tanh => Value::Float(B::float_tanh(cx.float(next())?)),
        Op::Erf => Value::Float(B::float_erf(cx.float(next())?)),
        // Off the host and cube kernels (an epilogue whose head runs on burn's ops, a program
        // the cube kernels do not take): on the host, the host's rounding on the values
        // (burn-ndarray has no f16 or bf16); on a device, through the format and back.
        Op::RoundTo { dtype } => {
            let x = cx.float(next())?;
            if B::HOST {
                let t = Value::<B>::Float(x).to_host();
                let round = |v: f64| cellgraph_compiler::passes::precision::round_f64(v, *dtype);
                let data = match &t.data {
                    HostData::F64(v) => HostVec::F64(v.iter().map(|&v| round(v)).collect()),
                    _ => HostVec::F32(t.to_f64().into_iter().map(|v| round(v) as f32).collect()),
                };
                Value::Float(B::from_host_vec(data, &t.shape, cx.device))
            } else {
                let low = B::float_cast(x, float_dtype(*dtype, cx.settings.float_dtype));
                Value::Float(B::float_cast(low, cx.settings.float_dtype))
            }
        }
        Op::CausalMask { fill } => Value::Float(B::float_mask_fill(cx.float(next())?, causal(cx, od), Scalar::Float(*fill))),
        Op::Attention { heads, causal } => {
            let [_, t, _, d] = attention_extents(tys[0], *heads);
            let [q, k, v] = split_heads::<B>(cx.float(next())?, tys[0], *heads);
            let p = attention_probs(cx, q, k, tys[0], *heads, *causal);
            Value::Float(merge_heads::<B>(heads_matmul(cx, tys[0], *heads, p, v, [false, false], [t, t, d]), od))
        }
        Op::AttentionGrad { heads, causal } => {
            let (qkv, dy) = (cx.float(next())?, cx.float(next())?);
            let [b, t, c, d] = attention_extents(tys[0], *heads);
            let [q, k, v] = split_heads::<B>(qkv, tys[0], *heads);
            let p = attention_probs(cx, q.clone(), k.clone(), tys[0], *heads, *causal);
            let g = B::float_swap_dims(B::float_reshape(dy, bshape(&[b, t, *heads, d])), 1, 2);
            let scores = bshape(&[b, *heads, t, t]);
            let mm = |a, b, tr, mkn| heads_matmul(cx, tys[0], *heads, a, b, tr, mkn);
            let dv = mm(p.clone(), g.clone(), [true, false], [t, t, d]);
            let dp = mm(g, v, [false, true], [t, d, t]);
            let dot = B::float_expand(B::float_sum_dim(B::float_mul(dp.clone(), p.clone()), 3), scores);
            let ds = B::float_mul_scalar(B::float_mul(p, B::float_sub(dp, dot)), Scalar::Float(1.0 / (d as f64).sqrt()));
            let dq = mm(ds.clone(), k, [false, false], [t, t, d]);
            let dk = mm(ds, q, [true, false], [t, t, d]);
            let part = [b, t, c];
            Value::Float(B::float_cat(vec![merge_heads::<B>(dq, &part), merge_heads::<B>(dk, &part), merge_heads::<B>(dv, &part)], 2))
        }
        Op::Dropout { p, seed } => {
            let x = cx.float(next())?;
            let (items, update) = (host_ints::<B>(cx.int(next())?), host_ints::<B>(cx.int(next())?));
            let row = out.numel() / od[0].max(1);
            let mask: Vec<f64> = items.iter().flat_map(|&item| (0..row).map(dropout_factor(*seed, update[0], item, *p))).collect();
            let mask = B::float_from_data(TensorData::new(mask, bshape(od)).convert_dtype(cx.settings.float_dtype.into()), cx.device);
            Value::Float(B::float_mul(x, mask))
        }
        Op::Gather => {
            let (table, ids) = (cx.float(next())?, cx.int(next())?);
            let (rows, n) = (tys[0].dims()[0], tys[1].numel());
            let width = tys[0].numel() / rows.max(1);
            let ids = B::int_reshape(ids, bshape(&[n]));
            checked_ids(cx, &ids, rows)?;
            let picked = B::float_select(B::float_reshape(table, bshape(&[rows, width])), 0, ids);
            Value::Float(B::float_reshape(picked, bshape(od)))
        }
        Op::ScatterAdd { rows } => {
            let (ids, upd) = (cx.int(next())?, cx.float(next())?);
            let n = tys[0].numel();
            let width = out.numel() / (*rows).max(1);
            let ids = B::int_reshape(ids, bshape(&[n]));
            checked_ids(cx, &ids, *rows)?;
            let upd = B::float_reshape(upd, bshape(&[n, width]));
            Value::Float(B::float_reshape(B::float_select_add(cx.full(&[*rows, width], 0.0), 0, ids, upd), bshape(od)))
        }
        Op::Select => {
            let c = match expand_value::<B>(next(), tys[0].dims(), od) {
                Value::Bool(c) => c,
                _ => return cx.unsupported("select needs a bool condition"),
            };
            match (expand_value::<B>(next(), tys[1].dims(), od), expand_value::<B>(next(), tys[2].dims(), od)) {
                (Value::Float(a), Value::Float(b)) => Value::Float(B::float_mask_where(b, c, a)),
                (Value::Int(a), Value::Int(b)) => Value::Int(B::int_mask_where(b, c, a)),
                _ => return cx.unsupported("select between these operand kinds"),
            }
        }
        Op::ReluGrad => {
            let dy = cx.float(next())?;
            Value::Float(B::relu_backward(cx.float(next())?, dy))
        }
        Op::Cast { dtype } => cast(cx, next(), *dtype)?,
        Op::ZerosLike => match next() {
            Value::Float(_) => Value::Float(cx.full(od, 0.0)),
            Value::Int(_) => Value::Int(B::int_zeros(bshape(od), cx.device, cx.settings.int_dtype)),
            Value::Bool(_) => Value::Bool(B::bool_zeros(bshape(od), cx.device, cx.settings.bool_dtype)),
        },
        Op::Broadcast { .. } => Value::Float(expand::<B>(cx.float(next())?, tys[0].dims(), od)),
        Op::Reshape { .. } | Op::Flatten => match next() {
            Value::Float(t) => Value::Float(B::float_reshape(t, bshape(od))),
            Value::Int(t) => Value::Int(B::int_reshape(t, bshape(od))),
            Value::Bool(t) => Value::Bool(B::bool_reshape(t, bshape(od))),
        },
        Op::Transpose { perm } => Value::Float(B::float_permute(cx.float(next())?, perm)),
        Op::Slice { begin, end } => Value::Float(B::float_slice(cx.float(next())?, &slices(begin, end))),
        Op::Pad { lo, hi } => Value::Float(pad_with(cx, cx.float(next())?, tys[0].dims(), lo, hi, 0.0)),
        Op::Concat { axis } => {
            let ts = (0..tys.len()).map(|_| cx.float(next())).collect::<Result<Vec<_>>>()?;
            Value::Float(B::float_cat(ts, *axis))
        }
        Op::ReduceSum(r) => Value::Float(reduce::<B>(cx.float(next())?, r, out, false)),
        Op::ReduceMean(r) => {
            let count: usize = r.axes.iter().map(|&a| tys[0].dims()[a]).product();
            let s = reduce::<B>(cx.float(next())?, r, out, false);
            Value::Float(B::float_mul_scalar(s, Scalar::Float(1.0 / count as f64)))
        }
        Op::ReduceMax(r) => Value::Float(reduce::<B>(cx.float(next())?, r, out, true)),
        Op::ReduceMaxGrad(r) => {
            let (x, y, dy) = (cx.float(next())?, cx.float(next())?, cx.float(next())?);
            let k = kept(od, &r.axes);
            let yb = B::float_expand(B::float_reshape(y, bshape(&k)), bshape(od));
            let mask = B::bool_into_float(B::float_equal(x, yb, cx.settings.bool_dtype), cx.settings.float_dtype);
            let mut count = mask.clone();
            for &a in r.axes.iter().rev() {
                count = B::float_sum_dim(count, a);
            }
            let share = B::float_div(B::float_reshape(dy, bshape(&k)), count);
            Value::Float(B::float_mul(mask, B::float_expand(share, bshape(od))))
        }
        Op::MatMul { transpose_a, transpose_b } => {
            let (mut a, mut b) = (cx.float(next())?, cx.float(next())?);
            let r = od.len();
            if *transpose_a {
                a = B::float_swap_dims(a, r - 2, r - 1);
            }
            if *transpose_b {
                b = B::float_swap_dims(b, r - 2, r - 1);
            }
            Value::Float(B::float_matmul(a, b))
        }
        Op::SoftmaxCrossEntropy { sparse, reduction } => {
            let (n, c) = (tys[0].dims()[0], tys[0].dims()[1]);
            let logp = log_softmax::<B>(cx.float(next())?, n, c);
            let picked = if *sparse {
                let y = checked_labels(cx, cx.int(next())?, n, c)?;
                B::float_gather(1, logp, y)
            } else {
                B::float_sum_dim(B::float_mul(cx.float(next())?, logp), 1)
            };
            let per_item = B::float_neg(B::float_reshape(picked, bshape(&[n])));
            Value::Float(match reduction {
                Reduction::None => per_item,
                Reduction::Sum => B::sum_in_order(per_item),
                Reduction::Mean => B::float_mul_scalar(B::sum_in_order(per_item), Scalar::Float(1.0 / n as f64)),
            })
        }
        Op::SoftmaxCrossEntropyGrad { sparse, reduction } => {
            let (n, c) = (tys[0].dims()[0], tys[0].dims()[1]);
            let p = B::float_exp(log_softmax::<B>(cx.float(next())?, n, c));
            // d/dlogits of -sum(y * log_softmax) is p * sum(y) - y (p - y for one-hot labels).
            let (p, target) = if *sparse {
                let y = checked_labels(cx, cx.int(next())?, n, c)?;
                (p, one_hot(cx, y, n, c))
            } else {
                let y = cx.float(next())?;
                let total = B::float_expand(B::float_sum_dim(y.clone(), 1), bshape(&[n, c]));
                (B::float_mul(p, total), y)
            };
            let dl = cx.float(next())?;
            let scale = match reduction {
                Reduction::None => B::float_reshape(dl, bshape(&[n, 1])),
                Reduction::Sum => dl,
                Reduction::Mean => B::float_mul_scalar(dl, Scalar::Float(1.0 / n as f64)),
            };
            let scale = expand::<B>(scale, &if matches!(reduction, Reduction::None) { vec![n, 1] } else { vec![] }, &[n, c]);
            Value::Float(B::float_mul(B::float_sub(p, target), scale))
        }
        Op::Conv2d(c) => {
            let (x, w) = (cx.float(next())?, cx.float(next())?);
            let (xd, wd) = (tys[0].dims(), tys[1].dims());
            let win = window::resolve([xd[2], xd[3]], [wd[2], wd[3]], c.stride, c.dilation, c.pad_mode, c.pad).or_else(|e| cx.bad(e))?;
            let (x, pad) = if win.is_symmetric() { (x, [win.pad[0], win.pad[2]]) } else { (pad_spatial(cx, x, xd, &win, 0.0).0, [0, 0]) };
            Value::Float(B::conv2d(x, w, None, ConvOptions::new(c.stride, pad, c.dilation, c.groups)))
        }
        Op::Conv2dBackpropInput { conv: c, input_shape } => {
            let (dy, w) = (cx.float(next())?, cx.float(next())?);
            conv_input_grad(cx, dy, w, tys[0].dims(), tys[1].dims(), &input_shape.0, c)?
        }
        Op::Conv2dBackpropFilter { conv: c, filter_shape } => {
            let (dy, x) = (cx.float(next())?, cx.float(next())?);
            let (xd, wd) = (tys[1].dims(), &filter_shape.0);
            let win = window::resolve([xd[2], xd[3]], [wd[2], wd[3]], c.stride, c.dilation, c.pad_mode, c.pad).or_else(|e| cx.bad(e))?;
            let (x, pad) = if win.is_symmetric() { (x, [win.pad[0], win.pad[2]]) } else { (pad_spatial(cx, x, xd, &win, 0.0).0, [0, 0]) };
            let w = cx.full(wd, 0.0);
            Value::Float(B::conv2d_weight_backward(x, w, dy, ConvOptions::new(c.stride, pad, c.dilation, c.groups)))
        }
        Op::MaxPool2d(p) => {
            let win = pool_window(cx, tys[0], p)?;
            let x = cx.float(next())?;
            let (x, pad) = if win.is_symmetric() {
                (x, [win.pad[0], win.pad[2]])
            } else {
                (pad_spatial(cx, x, tys[0].dims(), &win, f64::NEG_INFINITY).0, [0, 0])
            };
            Value::Float(B::max_pool2d(x, p.kernel, p.stride, pad, [1, 1], false))
        }
        Op::MaxPool2dGrad(p) => {
            let win = pool_window(cx, tys[0], p)?;
            let (x, dy) = (cx.float(next())?, cx.float(next())?);
            let xd = tys[0].dims();
            let sym = win.is_symmetric();
            let (x, pad) = if sym { (x, [win.pad[0], win.pad[2]]) } else { (pad_spatial(cx, x, xd, &win, f64::NEG_INFINITY).0, [0, 0]) };
            let idx = B::max_pool2d_with_indices(x.clone(), p.kernel, p.stride, pad, [1, 1], false, cx.settings.int_dtype).indices;
            let dx = B::max_pool2d_with_indices_backward(x, p.kernel, p.stride, pad, [1, 1], false, dy, idx).x_grad;
            if sym {
                Value::Float(dx)
            } else {
                let b = [0, 0, win.pad[0], win.pad[2]];
                let e = [xd[0], xd[1], win.pad[0] + xd[2], win.pad[2] + xd[3]];
                Value::Float(B::float_slice(dx, &slices(&b, &e)))
            }
        }
        Op::AvgPool2d(p) | Op::AvgPool2dGrad(p) => {
            let win = pool_window(cx, tys[0], p)?;
            if !win.is_symmetric() {
                return cx.unsupported("average pooling with asymmetric 'same' padding; use pad_mode=pad with explicit padding");
            }
            let pad = [win.pad[0], win.pad[2]];
            let include = p.pad_mode == PadMode::Pad;
            let x = cx.float(next())?;
            match op {
                Op::AvgPool2d(_) => Value::Float(B::avg_pool2d(x, p.kernel, p.stride, pad, include, false)),
                _ => Value::Float(B::avg_pool2d_backward(x, cx.float(next())?, p.kernel, p.stride, pad, include, false)),
            }
        }
        Op::Assign => {
            next();
            next()
        }
        Op::AssignAdd => {
            let (acc, g) = (cx.float(next())?, cx.float(next())?);
            // Accumulators that are views of one flat buffer must be written in place.
            if cx.in_place && B::assign_add_in_place(&acc, g.clone()) {
                Value::Float(acc)
            } else {
                Value::Float(B::float_add(acc, g))
            }
        }
        Op::Fused { expr } => {
            // The reference lowering: the unfused ops, one step at a time.
            let xs: Vec<(Value<B>, TensorType)> = tys.iter().map(|t| (next(), (*t).clone())).collect();
            let mut lets: Vec<(Value<B>, TensorType)> = Vec::with_capacity(expr.steps().len());
            let value = |v: Val, lets: &[(Value<B>, TensorType)]| -> Result<(Value<B>, TensorType)> {
                Ok(match v {
                    Val::Arg(i) => xs[i as usize].clone(),
                    Val::Let(k) => lets[k as usize].clone(),
                    _ => {
                        let Some(value) = v.literal() else { return cx.bad(format!("{v:?} in an elementwise program")) };
                        let ty = TensorType::new(out.dtype, cellgraph_compiler::Shape::scalar());
                        (eval(cx, &Op::Constant { value }, vec![], &ty)?, ty)
                    }
                })
            };
            for s in expr.steps() {
                let v = match (s.op(), *s) {
                    (Some(op), _) => {
                        let op = op.op();
                        let args = s.reads().map(|x| value(x, &lets)).collect::<Result<Vec<_>>>()?;
                        let ty = infer(&op, &args.iter().map(|(_, t)| t).collect::<Vec<_>>()).or_else(|e| cx.bad(e))?;
                        let v = eval(cx, &op, args.iter().map(|(v, t)| (v.clone(), t)).collect(), &ty)?;
                        (v, ty)
                    }
                    (None, Step::Write(_, x)) => value(x, &lets)?,
                    (None, _) => unreachable!("a step without an op is a write"),
                };
                lets.push(v);
            }
            lets.pop().expect("a program ends with its write").0
        }
        Op::Epilogue { head, expr } => {
            // The reference lowering: the head, then its program.
            let n = head.arity().min();
            let xs: Vec<Value<B>> = tys.iter().map(|_| next()).collect();
            let mut xs = xs.into_iter();
            let y = eval(cx, head, xs.by_ref().take(n).zip(tys[..n].iter().copied()).collect(), out)?;
            epilogue_program(cx, y, expr, xs.zip(tys[n..].iter().copied()).collect(), out)?
        }
    })
}

/// An epilogue's program on burn's ops, over the head's result `y` and the operands after the
/// head's (`rest`).
pub fn epilogue_program<B: Backend>(
    cx: &Ctx<B>,
    y: Value<B>,
    expr: &cellgraph_compiler::program::Program,
    rest: Vec<(Value<B>, &TensorType)>,
    out: &TensorType,
) -> Result<Value<B>> {
    let args = std::iter::once((y, out)).chain(rest).collect();
    eval(cx, &Op::Fused { expr: expr.clone() }, args, out)
}

/// Gradient of a convolution w.r.t. its input, as a forward convolution: `dy` dilated by the
/// stride and padded by `d(k-1) - pad`, correlated with the spatially flipped weight whose
/// in/out channels are swapped within each group. burn's ndarray `conv_transpose2d` is two
/// orders of magnitude slower than its `conv2d`, so this is the fast path; windows padded
/// beyond the kernel extent fall back to `conv_transpose2d`.
fn conv_input_grad<B: Backend>(
    cx: &Ctx<B>,
    dy: FloatTensor<B>,
    w: FloatTensor<B>,
    yd: &[usize],
    wd: &[usize],
    xd: &[usize],
    c: &cellgraph_compiler::Conv2dAttrs,
) -> Result<Value<B>> {
    let win = window::resolve([xd[2], xd[3]], [wd[2], wd[3]], c.stride, c.dilation, c.pad_mode, c.pad).or_else(|e| cx.bad(e))?;
    let dilated = [0, 1].map(|a| (yd[2 + a] - 1) * c.stride[a] + 1);
    let lo = [0, 1].map(|a| (c.dilation[a] * (wd[2 + a] - 1)) as i64 - win.pad[2 * a] as i64);
    let hi = [0, 1].map(|a| xd[2 + a] as i64 + win.pad[2 * a] as i64 - dilated[a] as i64);
    if lo.iter().chain(&hi).any(|&p| p < 0) {
        let sym = win.is_symmetric();
        let pad = if sym { [win.pad[0], win.pad[2]] } else { [0, 0] };
        let size_in = [0, 1].map(|a| xd[2 + a] + if sym { 0 } else { win.pad[2 * a] + win.pad[2 * a + 1] });
        let pout = [0, 1].map(|a| padding_out(wd[2 + a], c.stride[a], pad[a], c.dilation[a], size_in[a], yd[2 + a]));
        let dx = B::conv_transpose2d(dy, w, None, ConvTransposeOptions::new(c.stride, pad, pout, c.dilation, c.groups));
        if sym {
            return Ok(Value::Float(dx));
        }
        let b = [0, 0, win.pad[0], win.pad[2]];
        let e = [xd[0], xd[1], win.pad[0] + xd[2], win.pad[2] + xd[3]];
        return Ok(Value::Float(B::float_slice(dx, &slices(&b, &e))));
    }
    let (n, o) = (yd[0], yd[1]);
    let dyd = if c.stride == [1, 1] {
        dy
    } else {
        let steps = [
            Slice::new(0, Some(n as isize), 1),
            Slice::new(0, Some(o as isize), 1),
            Slice::new(0, Some(dilated[0] as isize), c.stride[0] as isize),
            Slice::new(0, Some(dilated[1] as isize), c.stride[1] as isize),
        ];
        B::float_slice_assign(cx.full(&[n, o, dilated[0], dilated[1]], 0.0), &steps, dy)
    };
    let g = c.groups;
    let (og, cg, kh, kw) = (wd[0] / g, wd[1], wd[2], wd[3]);
    let wf = B::float_flip(w, &[2, 3]);
    let wf = B::float_reshape(wf, bshape(&[g, og, cg, kh, kw]));
    let wf = B::float_reshape(B::float_swap_dims(wf, 1, 2), bshape(&[g * cg, og, kh, kw]));
    let (lo, hi) = (lo.map(|p| p as usize), hi.map(|p| p as usize));
    let (dyd, pad) = if lo == hi {
        (dyd, lo)
    } else {
        let dims = [n, o, dilated[0], dilated[1]];
        (pad_with(cx, dyd, &dims, &[0, 0, lo[0], lo[1]], &[0, 0, hi[0], hi[1]], 0.0), [0, 0])
    };
    Ok(Value::Float(B::conv2d(dyd, wf, None, ConvOptions::new([1, 1], pad, c.dilation, g))))
}

fn float_dtype(d: DType, default: FloatDType) -> FloatDType {
    match d {
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        _ => default,
    }
}

fn cast<B: Backend>(cx: &Ctx<B>, v: Value<B>, to: DType) -> Result<Value<B>> {
    let s = &cx.settings;
    Ok(match (v, to.is_float(), to.is_int()) {
        (Value::Float(t), true, _) => Value::Float(B::float_cast(t, float_dtype(to, s.float_dtype))),
        (Value::Float(t), _, true) => Value::Int(B::float_into_int(t, s.int_dtype)),
        (Value::Int(t), true, _) => Value::Float(B::int_into_float(t, float_dtype(to, s.float_dtype))),
        (Value::Int(t), _, true) => Value::Int(t),
        (Value::Bool(t), true, _) => Value::Float(B::bool_into_float(t, float_dtype(to, s.float_dtype))),
        (Value::Bool(t), _, true) => Value::Int(B::bool_into_int(t, s.int_dtype)),
        (Value::Float(t), _, _) => Value::Bool(B::float_not_equal_elem(t, Scalar::Float(0.0), s.bool_dtype)),
        (Value::Int(t), _, _) => Value::Bool(B::int_not_equal_elem(t, Scalar::Int(0), s.bool_dtype)),
        (v @ Value::Bool(_), _, _) => v,
    })
}

//! Bound kernels ([`crate::kernel::Native`]) on backends that keep tensors in host memory
//! (burn-ndarray): the slice kernels, one module per family (below), what they keep between
//! the steps of a run ([`Kept`]: a max pool's argmax for its gradient in the same plan), and
//! the memory their outputs are written into ([`Arena`]).

#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod attention;
pub mod bf16;
pub mod conv;
pub mod direct;
pub mod float;
pub mod gemm;
mod kept;
pub mod layout;
pub mod loss;
pub mod math;
pub mod pool;
pub mod program;
mod reads;
pub mod rows;
pub mod tables;
mod toeplitz;
mod unfold;
pub mod update;

use burn_backend::tensor::{Device, FloatTensor, IntTensor};
use burn_backend::FloatDType;
use cellgraph_compiler::{HostData, HostTensor, TensorType};

use crate::arena::{Arena, Shelved};
use crate::backend::{Backend, HostSlice, HostVec};
use crate::kernel::{ConvAlgo, ConvKind, Native, Products};
use cellgraph_compiler::program::Program;
use float::HostFloat;
use gemm::Mat;
pub use kept::Kept;
use kept::Typed;

/// Makes the calling thread thread 0 of rayon's global pool (sized by `RAYON_NUM_THREADS`, else
/// one thread per core), so the plans it runs split their kernels' work with the pool's other
/// threads directly, without handing each plan over to the pool and waiting (see
/// [`crate::Session::run`]). For a single-process program's main thread, first thing in
/// `main`; does nothing where the pool already exists (under `mpirun` each rank keeps one).
pub fn join_thread_pool() {
    let _ = rayon::ThreadPoolBuilder::new().use_current_thread().build_global();
}

/// The process's choice of the CPU's bf16 product units, read from the environment once, in
/// this one place: `CELLGRAPH_AMX`, `CELLGRAPH_BF16_PAIRS` and `CELLGRAPH_TABLES`, each `1` (use the unit wherever
/// the CPU has it), `0` (never) or unset (the default rule: [`amx::available`],
/// [`bf16::pays`]). Any other value is an error, which every compile reports
/// ([`units_checked`]) before a plan runs, rather than a setting silently read as unset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Units {
    /// `CELLGRAPH_AMX`: `Some(false)` refuses the AMX tiles.
    pub amx: Option<bool>,
    /// `CELLGRAPH_BF16_PAIRS`: `Some(true)` chooses the AVX-512 BF16 pairs on any core that
    /// has them, `Some(false)` on none.
    pub pairs: Option<bool>,
    /// `CELLGRAPH_TABLES`: `Some(false)` refuses the tables of programs' subtrees on bf16
    /// operands ([`tables`]).
    pub tables: Option<bool>,
}

impl Units {
    /// The settings `var` gives for each variable (`None` where unset), or, for the first one
    /// whose value is neither `0` nor `1`, `NAME=VALUE` and what it should be.
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Result<Units, (String, String)> {
        let one = |name: &str, what: &str| match var(name).as_deref() {
            None => Ok(None),
            Some("1") => Ok(Some(true)),
            Some("0") => Ok(Some(false)),
            Some(v) => Err((format!("{name}={v}"), format!("expected 1 ({what} wherever the CPU has them) or 0 (never), or leave it unset"))),
        };
        Ok(Units {
            amx: one("CELLGRAPH_AMX", "bf16 products on AMX tiles")?,
            pairs: one("CELLGRAPH_BF16_PAIRS", "bf16 products on AVX-512 BF16 pairs")?,
            tables: one("CELLGRAPH_TABLES", "tables of programs' subtrees on bf16 operands")?,
        })
    }
}

/// This process's [`Units`], read from its environment on the first call; a bad value reads as
/// unset here, and [`units_checked`] reports it.
pub fn units() -> Units {
    units_read().as_ref().copied().unwrap_or_default()
}

/// This process's [`Units`], or the error naming the variable whose value is neither `0` nor
/// `1` (every compile asks first: [`crate::compile`]).
pub fn units_checked() -> crate::Result<Units> {
    units_read().clone().map_err(|(what, detail)| crate::RuntimeError::Invalid { what, detail })
}

fn units_read() -> &'static Result<Units, (String, String)> {
    static UNITS: std::sync::OnceLock<Result<Units, (String, String)>> = std::sync::OnceLock::new();
    UNITS.get_or_init(|| Units::parse(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())))
}

/// Whether this process's products of bf16 values run on AMX tiles ([`amx`]) rather than on
/// AVX-512 BF16 pairs ([`bf16`]).
pub fn bf16_on_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether plans compiled in this process give their products of bf16 values to a bf16
/// kernel ([`crate::kernel::Products::Bf16`]): AMX tiles where the process has them
/// ([`amx::available`]), else AVX-512 BF16 pairs where they beat the f32 GEMM
/// ([`bf16::pays`]); elsewhere the f32 GEMM runs them (the emulation), and the plan's
/// [`crate::Bf16Products`] line says why.
pub fn bf16_products_pay() -> bool {
    bf16_on_amx() || bf16::pays()
}

/// What [`Kept`] names what it derives from a parameter's bf16 copy by: this, then the
/// parameter's name (no parameter name holds it).
pub const ROUNDED_BF16: &str = "round_to bf16 of ";

/// The element types the kernels run in, tied to their [`HostSlice`]/[`HostVec`] variants
/// (and, as [`Shelved`], to their shelf of the [`Arena`]).
trait Elem: HostFloat + direct::Lanes + Shelved {
    fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [Self]>;
    fn wrap(v: Vec<Self>) -> HostVec;
    fn kept(k: &mut Kept) -> &mut Typed<Self>;
    /// `x` as f32 values, in an f32 session.
    fn as_f32(x: &[Self]) -> Option<&[f32]> {
        float::as_f32(x)
    }
}

macro_rules! elem {
    ($t:ident, $variant:ident, $other:ident, $shelf:ident) => {
        impl Elem for $t {
            fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [$t]> {
                match s {
                    HostSlice::$variant(v) => Some(v),
                    HostSlice::$other(_) => None,
                }
            }
            fn wrap(v: Vec<$t>) -> HostVec {
                HostVec::$variant(v)
            }
            fn kept(k: &mut Kept) -> &mut Typed<$t> {
                &mut k.$shelf
            }
        }
    };
}

elem!(f32, F32, F64, f32);
elem!(f64, F64, F32, f64);

/// The kernels that read integer operands besides floats: `Some(y)` for them (`y` `None` when
/// an id is out of range or the operands do not fit: the reference lowering then runs the
/// step and reports it), `None` for every other kernel.
fn with_ids<F: Elem>(k: &Native, a: &[&[F]], ints: &[&[i64]], len: usize, arena: &mut Arena) -> Option<Option<Vec<F>>> {
    let in_range = |ids: &[i64], rows: usize| ids.iter().all(|&i| (0..rows as i64).contains(&i));
    let fits = match (k, a, ints) {
        (Native::Gather { rows, width }, [table], [ids]) => table.len() == rows * width && len == ids.len() * width && in_range(ids, *rows),
        (Native::ScatterAdd { rows, width }, [upd], [ids]) => upd.len() == ids.len() * width && len == rows * width && in_range(ids, *rows),
        (Native::Dropout { row, .. }, [x], [items, update]) => x.len() == len && len == items.len() * row && update.len() == 1,
        (Native::Gather { .. } | Native::ScatterAdd { .. } | Native::Dropout { .. }, ..) => false,
        _ => return None,
    };
    if !fits {
        return Some(None);
    }
    let mut y = arena.take::<F>(len);
    match (k, ints) {
        (Native::Gather { width, .. }, [ids]) => {
            for (out, &i) in y.chunks_exact_mut(*width).zip(ids.iter()) {
                out.copy_from_slice(&a[0][i as usize * width..][..*width]);
            }
        }
        // In the ids' order, as burn's `select_add` sums them.
        (Native::ScatterAdd { width, .. }, [ids]) => {
            y.fill(F::ZERO);
            for (upd, &i) in a[0].chunks_exact(*width).zip(ids.iter()) {
                rows::add_assign(&mut y[i as usize * width..][..*width], upd);
            }
        }
        // The lowering's mask, converted to the float type, times `x`.
        (Native::Dropout { p, seed, row }, [items, update]) => {
            for ((out, x), &item) in y.chunks_exact_mut(*row).zip(a[0].chunks_exact(*row)).zip(items.iter()) {
                let factor = crate::kernel::dropout_factor(*seed, update[0], item, *p);
                for (j, (o, &v)) in out.iter_mut().zip(x).enumerate() {
                    *o = v * F::from_f64(factor(j));
                }
            }
        }
        _ => unreachable!("matched above"),
    }
    Some(Some(y))
}

/// `v` copied into a buffer from the arena.
fn copied<F: Elem>(arena: &mut Arena, v: &[F]) -> HostVec {
    let mut b = arena.take::<F>(v.len());
    b.copy_from_slice(v);
    F::wrap(b)
}

/// A float input copied into an arena buffer, when the backend computes in its element type
/// (`None`: the caller copies it as any host tensor).
pub fn input<B: Backend>(t: &HostTensor, float: FloatDType, arena: &mut Arena, device: &Device<B>) -> Option<FloatTensor<B>> {
    let data = match (&t.data, float) {
        (HostData::F32(v), FloatDType::F32) => copied(arena, v),
        (HostData::F64(v), FloatDType::F64) => copied(arena, v),
        _ => return None,
    };
    Some(B::from_host_vec(data, &t.shape, device))
}

/// `t` with extents `ty`: its own memory when nothing else holds it, else a copy into an arena
/// buffer (burn-ndarray's reshape copies every time); `Err(t)` when `t` is not in host memory.
pub fn reshape<B: Backend>(t: FloatTensor<B>, ty: &TensorType, device: &Device<B>, arena: &mut Arena) -> Result<FloatTensor<B>, FloatTensor<B>> {
    let data = match B::reclaim(t) {
        Ok(data) => data,
        Err(t) => match B::host_slice(&t) {
            Some(HostSlice::F32(v)) => copied(arena, &v),
            Some(HostSlice::F64(v)) => copied(arena, &v),
            None => return Err(t),
        },
    };
    Ok(B::from_host_vec(data, ty.dims(), device))
}

/// `acc += g` in `acc`'s own memory when nothing else holds it (an accumulator read only by
/// its `assign_add`) and both are host floats of one type and length; `Err(acc)` otherwise.
pub fn assign_add<B: Backend>(
    acc: FloatTensor<B>,
    g: &FloatTensor<B>,
    ty: &TensorType,
    device: &Device<B>,
) -> Result<FloatTensor<B>, FloatTensor<B>> {
    let Some(gs) = B::host_slice(g) else { return Err(acc) };
    let data = match (B::reclaim(acc)?, gs) {
        (HostVec::F32(mut a), HostSlice::F32(g)) if a.len() == g.len() => {
            rows::add_assign(&mut a, &g);
            return Ok(B::from_host_vec(HostVec::F32(a), ty.dims(), device));
        }
        (HostVec::F64(mut a), HostSlice::F64(g)) if a.len() == g.len() => {
            rows::add_assign(&mut a, &g);
            return Ok(B::from_host_vec(HostVec::F64(a), ty.dims(), device));
        }
        (a, _) => a,
    };
    Err(B::from_host_vec(data, ty.dims(), device))
}

/// True when `t` is an f32 value of `len` elements in host memory ([`update_clear`] takes
/// only those).
pub fn is_host_f32<B: Backend>(t: &FloatTensor<B>, len: usize) -> bool {
    matches!(B::host_slice(t), Some(HostSlice::F32(v)) if v.len() == len)
}

/// A window's boundary for one parameter on a host backend, in one pass (see
/// [`update::update_clear`]): `bufs` are the parameter, its accumulator and its optimizer
/// states, in place where nothing else holds them (else copied), returned updated (the
/// accumulator zeroed); the gradient is the accumulator times `scale`, then times `factor`
/// (clipping's). `Err(bufs)` when they are not all f32 host values of one length.
#[allow(clippy::too_many_arguments)]
pub fn update_clear<B: Backend>(
    prog: &Program,
    bufs: Vec<FloatTensor<B>>,
    dims: &[usize],
    scalars: &[f32],
    scale: f32,
    factor: f32,
    device: &Device<B>,
) -> Result<Vec<FloatTensor<B>>, Vec<FloatTensor<B>>> {
    let n: usize = dims.iter().product();
    if bufs.len() < 2 || !bufs.iter().all(|t| is_host_f32::<B>(t, n)) {
        return Err(bufs);
    }
    let mut vecs: Vec<Vec<f32>> = bufs
        .into_iter()
        .map(|t| match B::reclaim(t) {
            Ok(HostVec::F32(v)) => v,
            Ok(HostVec::F64(_)) => unreachable!("checked f32"),
            Err(t) => match B::host_slice(&t) {
                Some(HostSlice::F32(v)) => v.into_owned(),
                _ => unreachable!("checked f32"),
            },
        })
        .collect();
    let (pa, states) = vecs.split_at_mut(2);
    let [p, acc] = pa else { unreachable!("two") };
    update::update_clear(prog, p, acc, states, scalars, scale, factor);
    Ok(vecs.into_iter().map(|v| B::from_host_vec(HostVec::F32(v), dims, device)).collect())
}

/// Runs a bound kernel in element type `F` into a buffer from the arena, or `None` if an
/// operand is not `F` or the output is empty.
/// `args` are the float operands and `ints` the integer ones, each in operand order; `tys` every
/// operand's type, in order.
#[allow(clippy::too_many_arguments)]
fn run<F: Elem>(
    k: &Native,
    args: &[HostSlice],
    ints: &[&[i64]],
    tys: &[&TensorType],
    out: &TensorType,
    kept: &mut Kept,
    arena: &mut Arena,
    bf16: bool,
) -> Option<Vec<F>> {
    let a: Vec<&[F]> = args.iter().map(F::slice).collect::<Option<_>>()?;
    let len = out.numel();
    if let Native::SoftmaxCrossEntropy { c, reduction, grad, kept: slot, .. } = *k {
        // A label out of range leaves the step to the reference lowering, which reports it.
        let mut y = arena.take::<F>(len);
        let ok = match (grad, ints) {
            (false, [labels]) => {
                let keep = slot.map(|s| kept.rows::<F>(s, labels.len() * c));
                loss::softmax_cross_entropy(a[0], labels, c, reduction, &mut y, keep)
            }
            (true, [labels]) => {
                let from = slot.and_then(|s| kept.rows_of::<F>(s, labels.len() * c));
                loss::softmax_cross_entropy_grad(a[0], from, labels, a[1], c, reduction, &mut y)
            }
            _ => false,
        };
        if ok {
            return Some(y);
        }
        arena.give(y);
        return None;
    }
    if let Some(y) = with_ids(k, &a, ints, len, arena) {
        return y;
    }
    if !ints.is_empty() {
        // The other kernels read float operands only.
        return None;
    }
    // The extents were fixed when the kernel was bound (`kernel::bind`) from the same types the
    // plan's verifier checked: a mismatch here is a binding bug, not a user's mistake.
    let fits = match k {
        Native::Fused(e) | Native::Epilogue { post: e, .. } => e.len == len,
        Native::SumOf { program, outer, inner, .. } => program.len == outer * len * inner,
        Native::SumRows { cols } => *cols == len && a[0].len().is_multiple_of(*cols),
        Native::SumPlanes { outer, inner, .. } => a[0].len() == outer * len * inner,
        Native::BatchMatMul { batch, m, k, n, .. } => len == batch * m * n && a[0].len() == batch * m * k && a[1].len() == batch * k * n,
        Native::Permute { dims, .. } | Native::Slice { dims, .. } | Native::Pad { dims, .. } | Native::Broadcast { dims, .. } => {
            a[0].len() == dims.iter().product::<usize>()
        }
        Native::Concat { dims, .. } => a.len() == dims.len() && a.iter().zip(dims).all(|(x, d)| x.len() == d.iter().product::<usize>()),
        Native::CausalMask { .. } => a[0].len() == len,
        Native::Attention { b, t, heads, d, grad, .. } => {
            let c = heads * d;
            a[0].len() == b * t * 3 * c && len == b * t * if *grad { 3 * c } else { c } && (!grad || a[1].len() == b * t * c)
        }
        Native::MaxRows { cols } => a[0].len() == len * cols,
        _ => true,
    };
    debug_assert!(fits, "{k:?} bound for other extents than its operands' ({:?} -> {len})", a.iter().map(|x| x.len()).collect::<Vec<_>>());
    if len == 0 {
        return None;
    }
    let mut y = arena.take::<F>(len);
    match k {
        Native::Epilogue { head, head_args: split, post } => match (&**head, lone_rounding(post)) {
            // A rounding alone, done by the attention's items as they finish their rows.
            (Native::Attention { .. }, round @ Some(_)) => attention_into(head, &a[..*split], kept, &mut y, round),
            _ => {
                // The head's operands come first; `post` reads the output and the rest.
                let split = *split;
                let extras = &a[split..];
                let part = |first: usize, part: &mut [F]| program::epilogue(post, extras, first, part);
                run_into(head, &a[..split], &tys[..split], kept, &mut y, Some(&part), bf16)
            }
        },
        k => run_into(k, &a, tys, kept, &mut y, None, bf16),
    }
    Some(y)
}

/// An attention (forward or gradient, `k`) into `y`, each (sequence, head) item rounding its
/// rows as it finishes them when `round` says.
fn attention_into<F: Elem>(k: &Native, a: &[&[F]], kept: &mut Kept, y: &mut [F], round: Option<attention::Round>) {
    let &Native::Attention { b, t, heads, d, causal, grad, kept: slot } = k else { unreachable!("an attention kernel") };
    let rows = b * heads * t * t;
    match grad {
        false => attention::forward(a[0], [b, t, heads, d], causal, slot.map(|s| kept.rows::<F>(s, rows)), y, round),
        true => attention::backward(a[0], a[1], [b, t, heads, d], causal, slot.and_then(|s| kept.rows_of::<F>(s, rows)), y, round),
    }
}

/// The rounding an epilogue's program is, alone (`$0 round_bf16`, `$0 round_f16`): an
/// attention does it inside its items.
fn lone_rounding(e: &crate::kernel::Elementwise) -> Option<attention::Round> {
    use cellgraph_compiler::program::{Step, Unary, Val};
    match e.prog.steps() {
        [Step::Unary(Unary::RoundBf16, Val::Arg(0)), Step::Write(0, Val::Let(0))] => Some(attention::Round::Bf16),
        [Step::Unary(Unary::RoundF16, Val::Arg(0)), Step::Write(0, Val::Let(0))] => Some(attention::Round::F16),
        _ => None,
    }
}

/// Runs a bound kernel (not an epilogue) into `y`, then `post` over each part of `y` as the
/// kernel finishes it (or over the whole of `y` after kernels that do not cut their output).
/// `bf16`: products the plan chose to run on bf16 pairs do (else in f32; see
/// [`crate::Session::set_bf16_products`]).
fn run_into<F: Elem>(k: &Native, a: &[&[F]], tys: &[&TensorType], kept: &mut Kept, y: &mut [F], post: float::Post<F>, bf16: bool) {
    let d = |i: usize| tys[i].dims();
    let products = |k: &Native| match k {
        Native::MatMul { products, .. } | Native::BatchMatMul { products, .. } | Native::Conv { products, .. } if bf16 => *products,
        _ => Products::F32,
    };
    match k {
        Native::Conv { kind, g, groups, out_channels: o, algo, .. } => {
            let (o, p) = (*o, products(k));
            return match (kind, algo) {
                // A dense filter kept since its parameter was last written.
                (ConvKind::Forward | ConvKind::InputGrad, ConvAlgo::Dense { taps, filter: Some(name) }) => {
                    let forward = *kind == ConvKind::Forward;
                    // On the pairs, the filter packed once since its parameter was written.
                    let packed = match F::as_f32(a[1]) {
                        Some(w) if p == Products::Bf16 && !bf16_on_amx() => Some(kept.packed_filter(name, g, taps, o, w, forward)),
                        _ => None,
                    };
                    let t = match packed {
                        Some(t) => toeplitz::Filter::Packed(t),
                        None => toeplitz::Filter::Dense(kept.dense_filter(name, g, taps, o, a[1])),
                    };
                    match kind {
                        ConvKind::Forward => toeplitz::forward_dense(g, a[0], t, o, y, post, p),
                        _ => {
                            toeplitz::input_grad_dense(g, a[0], t, o, y, p);
                            float::post_all(post, y)
                        }
                    }
                }
                (ConvKind::Forward, _) => conv::conv2d(algo, g, *groups, a[0], a[1], o, y, post, p),
                (ConvKind::InputGrad, _) => {
                    conv::conv2d_input_grad(algo, g, *groups, a[0], a[1], o, y, p);
                    float::post_all(post, y)
                }
                (ConvKind::FilterGrad, _) => conv::conv2d_filter_grad(algo, g, *groups, a[0], a[1], o, y, post, p),
            };
        }
        Native::MaxPoolGrad { g, kept: slot } => {
            let at_len = tys[1].numel();
            return match slot.and_then(|s| kept.argmax_of(s, at_len)) {
                Some(at) => pool::max_pool2d_grad(g, at, a[1], y, post),
                None => {
                    let mut at = vec![0; at_len];
                    pool::max_pool2d_argmax(g, a[0], &mut at);
                    pool::max_pool2d_grad(g, &at, a[1], y, post)
                }
            };
        }
        Native::MatMul { transpose_a, transpose_b, .. } => {
            let m = |i: usize, t: bool| Mat { data: a[i], rows: d(i)[0], cols: d(i)[1], transposed: t };
            // `post` runs inside the product (over strips still in cache, on AMX tiles).
            return gemm::matmul(m(0, *transpose_a), m(1, *transpose_b), y, products(k), post);
        }
        Native::MaxPool { g, keep } => match keep {
            Some(s) => pool::max_pool2d(g, a[0], kept.argmax(*s, y.len()), y),
            None => pool::max_pool2d(g, a[0], &mut vec![0; y.len()], y),
        },
        Native::Fill(v) => y.fill(F::from_f64(*v)),
        // Their integer operands never reach here (see `with_ids`).
        Native::Gather { .. } | Native::ScatterAdd { .. } | Native::Dropout { .. } => unreachable!("kernels with ids run in `with_ids`"),
        Native::Relu => rows::relu(a[0], y),
        Native::ReluGrad => rows::relu_grad(a[0], a[1], y),
        Native::Fused(e) => program::fused(e, a, y),
        Native::SumRows { .. } => rows::sum_rows(a[0], y),
        Native::SumPlanes { outer, inner, scale } => rows::sum_planes(a[0], *outer, *inner, scale.map(F::from_f64), y),
        Native::BatchMatMul { batch, m, k: kk, n, transpose_a, transpose_b, .. } => {
            gemm::batch_matmul(a[0], a[1], *batch, *m, *kk, *n, *transpose_a, *transpose_b, y, products(k))
        }
        Native::Permute { dims, perm } => layout::permute(a[0], dims, perm, y),
        Native::Slice { dims, begin, end } => layout::slice(a[0], dims, begin, end, y),
        Native::Pad { dims, lo, hi } => layout::pad(a[0], dims, lo, hi, y),
        Native::Broadcast { dims, out } => layout::broadcast(a[0], dims, out, y),
        Native::Concat { dims, axis } => layout::concat(a, dims, *axis, y),
        Native::CausalMask { t, s, fill } => rows::causal_mask(a[0], *t, *s, F::from_f64(*fill), y),
        Native::SumOf { program, outer, inner, scale } => program::sum_of(program, a, *outer, *inner, scale.map(F::from_f64), y),
        Native::MaxRows { cols } => rows::max_rows(a[0], *cols, y),
        Native::Attention { .. } => attention_into(k, a, kept, y, None),
        Native::Epilogue { .. } | Native::SoftmaxCrossEntropy { .. } => unreachable!("an epilogue's head is neither an epilogue nor a loss"),
    }
    float::post_all(post, y)
}

/// Runs a bound kernel on the host kernels when every operand is host-visible in one float
/// type, writing into a buffer from `arena`; `None` sends the step to burn's generic lowering.
/// `args` are the float operands and `ints` the integer ones, each in operand order.
#[allow(clippy::too_many_arguments)]
pub fn run_host<B: Backend>(
    k: &Native,
    args: &[&FloatTensor<B>],
    ints: &[&IntTensor<B>],
    tys: &[&TensorType],
    out: &TensorType,
    (device, float, bf16): (&Device<B>, FloatDType, bool),
    kept: &mut Kept,
    arena: &mut Arena,
) -> Option<FloatTensor<B>> {
    if !out.dtype.is_float() {
        return None;
    }
    let slices: Vec<HostSlice> = args.iter().map(|t| B::host_slice(t)).collect::<Option<_>>()?;
    let ints: Vec<_> = ints.iter().map(|t| B::host_ints(t)).collect::<Option<_>>()?;
    let ints: Vec<&[i64]> = ints.iter().map(|v| &v[..]).collect();
    // The operands' element type, or (a constant) the session's.
    let wide = match slices.first() {
        Some(s) => matches!(s, HostSlice::F64(_)),
        None => float == FloatDType::F64,
    };
    let data = if wide {
        run::<f64>(k, &slices, &ints, tys, out, kept, arena, bf16).map(f64::wrap)
    } else {
        run::<f32>(k, &slices, &ints, tys, out, kept, arena, bf16).map(f32::wrap)
    }?;
    Some(B::from_host_vec(data, out.dims(), device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::bind;
    use cellgraph_compiler::{Op, PadMode, Pool2dAttrs};
    use std::borrow::Cow;

    /// An epilogue that is a rounding alone is done inside an attention's items; any other
    /// program (a rounding after another op, of another operand, or followed by one) is not.
    #[test]
    fn only_a_rounding_alone_is_an_attentions_own() {
        let of = |p: &str| lone_rounding(&crate::kernel::Elementwise::new(p.parse().unwrap(), vec![crate::kernel::Read::Same], 4));
        assert_eq!(of("$0 round_bf16"), Some(attention::Round::Bf16));
        assert_eq!(of("$0 round_f16"), Some(attention::Round::F16));
        for other in ["$0 1.0 mul round_bf16", "$0 round_bf16 neg", "$0 round_bf16 round_f16", "$0 neg"] {
            assert_eq!(of(other), None, "{other}");
        }
    }

    /// `CELLGRAPH_AMX`, `CELLGRAPH_BF16_PAIRS` and `CELLGRAPH_TABLES` are each `1`, `0` or
    /// unset; any other value (a word, a space, an empty string) is refused with the variable,
    /// its value and the values it takes.
    #[test]
    fn unit_settings_take_one_zero_or_nothing() {
        let parse = |amx: Option<&str>, pairs: Option<&str>, tables: Option<&str>| {
            Units::parse(|name| match name {
                "CELLGRAPH_AMX" => amx.map(str::to_string),
                "CELLGRAPH_BF16_PAIRS" => pairs.map(str::to_string),
                "CELLGRAPH_TABLES" => tables.map(str::to_string),
                other => panic!("{other} read"),
            })
        };
        assert_eq!(parse(None, None, None), Ok(Units { amx: None, pairs: None, tables: None }));
        assert_eq!(parse(Some("0"), Some("1"), Some("0")), Ok(Units { amx: Some(false), pairs: Some(true), tables: Some(false) }));
        assert_eq!(parse(Some("1"), Some("0"), Some("1")), Ok(Units { amx: Some(true), pairs: Some(false), tables: Some(true) }));
        for bad in ["yes", "true", "", " 1", "01", "2"] {
            let (what, detail) = parse(Some(bad), None, None).unwrap_err();
            assert_eq!(what, format!("CELLGRAPH_AMX={bad}"));
            assert!(detail.starts_with("expected 1 (bf16 products on AMX tiles ") && detail.contains("or 0 (never)"), "{detail}");
            let (what, detail) = parse(Some("0"), Some(bad), None).unwrap_err();
            assert_eq!(what, format!("CELLGRAPH_BF16_PAIRS={bad}"));
            assert!(detail.starts_with("expected 1 (bf16 products on AVX-512 BF16 pairs "), "{detail}");
            let (what, detail) = parse(None, None, Some(bad)).unwrap_err();
            assert_eq!(what, format!("CELLGRAPH_TABLES={bad}"));
            assert!(detail.starts_with("expected 1 (tables of programs' subtrees on bf16 operands "), "{detail}");
        }
    }

    /// A max pool's gradient routes by the argmax its forward kept in the same run, with the
    /// same bits as recomputing it; an argmax from an earlier run is never used.
    #[test]
    fn a_pool_gradient_routes_by_its_own_runs_argmax_only() {
        let p = Pool2dAttrs { kernel: [2, 2], stride: [2, 2], pad_mode: PadMode::Valid, pad: [0; 4] };
        let (xt, yt) = (TensorType::f32(vec![2, 3, 6, 6]), TensorType::f32(vec![2, 3, 3, 3]));
        let bound = |op: &Op, tys: &[&TensorType]| bind(op, tys).expect("pooling binds");
        let (fwd, grad) = (bound(&Op::MaxPool2d(p.clone()), &[&xt]), bound(&Op::MaxPool2dGrad(p.clone()), &[&xt, &yt]));
        let (Native::MaxPool { g, .. }, Native::MaxPoolGrad { .. }) = (&fwd, &grad) else { panic!("pooling kernels") };
        let (keep, kept) = (Native::MaxPool { g: *g, keep: Some(0) }, Native::MaxPoolGrad { g: *g, kept: Some(0) });
        let x1: Vec<f32> = (0..216).map(|i| ((i * 37) % 23) as f32).collect();
        let x2: Vec<f32> = x1.iter().rev().copied().collect();
        let dy: Vec<f32> = (0..54).map(|i| i as f32 + 0.5).collect();
        let s = |v: &[f32]| HostSlice::F32(Cow::Owned(v.to_vec()));
        let (mut state, arena) = (Kept::default(), &mut Arena::default());
        state.begin_run();
        run::<f32>(&keep, &[s(&x1)], &[], &[&xt], &yt, &mut state, arena, true).expect("forward");
        let routed = run::<f32>(&kept, &[s(&x1), s(&dy)], &[], &[&xt, &yt], &xt, &mut state, arena, true).expect("gradient");
        let searched = run::<f32>(&grad, &[s(&x1), s(&dy)], &[], &[&xt, &yt], &xt, &mut state, arena, true).expect("gradient");
        assert_eq!(routed.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), searched.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // The next run's gradient, on other input, before its forward ran: it must search.
        state.begin_run();
        let fresh = run::<f32>(&kept, &[s(&x2), s(&dy)], &[], &[&xt, &yt], &xt, &mut state, arena, true).expect("gradient");
        assert_eq!(fresh, run::<f32>(&grad, &[s(&x2), s(&dy)], &[], &[&xt, &yt], &xt, &mut state, arena, true).expect("gradient"));
        assert_ne!(fresh, routed);
    }
}

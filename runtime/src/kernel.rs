//! Kernel binding: what a plan step runs, chosen when the plan is compiled.
//!
//! [`bind`] resolves a hot op (matrix products, convolutions and their gradients, max pooling
//! and its gradient, ReLU's gradient) on its operand types to a [`Native`] kernel with every
//! extent and window worked out, so running a step is a call. The backend decides where a
//! bound kernel runs: host backends on [`crate::host`]'s slice kernels, device backends on
//! their own kernels ([`crate::backend::Backend::device_kernel`]) or burn's ops.

use std::sync::Arc;

use cellgraph_compiler::infer::{broadcast_shapes, infer};
use cellgraph_compiler::program::{Program, Step, Val};
use cellgraph_compiler::{window, Op, Reduction, TensorType};

mod conv;
use conv::geometry;
pub use conv::{dense_taps, direct_conv, ConvAlgo, ConvKind, Geometry, Im2col, Tap, DIRECT_BLOCK};

/// A step's kernel, chosen when the plan is compiled ([`bind`]): every extent and window is
/// resolved then, so running it is a call. Host backends run all of them on [`crate::host::kernels`];
/// device backends run matmuls and convolutions on their own kernels
/// ([`crate::backend::Backend::device_kernel`]) and the rest on burn's ops.
#[derive(Clone, Debug)]
pub enum Native {
    /// `op(a) @ op(b)`, `m x k` by `k x n`; `tiling`: the kernel a device runs it on;
    /// `products`: how host backends multiply.
    MatMul { m: usize, k: usize, n: usize, transpose_a: bool, transpose_b: bool, tiling: Tiling, products: Products },
    /// Forward, input gradient, filter gradient; `out_channels` is the filter's first extent.
    /// `algo`: how host backends run it ([`ConvAlgo::choose`]). `products`: how the host's
    /// GEMMs multiply (the direct kernels always in f32).
    Conv { kind: ConvKind, g: Geometry, groups: usize, out_channels: usize, algo: ConvAlgo, products: Products },
    /// Max pooling; `keep`: the [`crate::host::Kept`] slot its argmax goes to, when its gradient is later in
    /// the same plan.
    MaxPool { g: Geometry, keep: Option<usize> },
    /// Max pooling's gradient `(x, dy)`; `kept`: the slot its forward fills (without one, or
    /// when the forward did not run on the host kernels, the argmax is recomputed from `x`).
    MaxPoolGrad { g: Geometry, kept: Option<usize> },
    /// ReLU: `x` where `x > 0`, else +0 (NaN and -0 included, on every length).
    Relu,
    /// ReLU's gradient `(dy, x)` of equal extents.
    ReluGrad,
    /// A `fused` node's program, with how each operand is read (also one arithmetic op alone:
    /// an add, sub, mul, div or neg, with its broadcasts).
    Fused(Arc<Elementwise>),
    /// The sum over the rows of a `[rows, cols]` matrix (`reduce_sum` over axis 0, `cols` > 1:
    /// a bias gradient).
    SumRows { cols: usize },
    /// The sum of `[outer, kept, inner]` over its first and last axes: a
    /// `reduce_sum` keeping contiguous axes, batch norm's per-channel sums over `N, H, W`;
    /// times `scale` for a `reduce_mean`.
    SumPlanes { outer: usize, inner: usize, scale: Option<f64> },
    /// Softmax cross-entropy over `[n, c]` logits with class-id labels, reduced by
    /// `reduction` `(logits, labels)`, or (`grad`) its gradient w.r.t. the logits
    /// `(logits, labels, dloss)`. `kept`: the [`crate::host::Kept`] slot the forward writes
    /// its log-softmax to and its gradient later in the same plan reads it from (without
    /// one, or when the forward did not run on the host kernels, the gradient recomputes it).
    /// `seed`: on a forward whose one gradient later in the plan has a constant `dloss`, that
    /// constant; a device then computes the gradient with the loss, in the same launch, and
    /// keeps it in the slot for the gradient step.
    SoftmaxCrossEntropy { c: usize, reduction: Reduction, grad: bool, kept: Option<usize>, seed: Option<f64> },
    /// Batched `op(a) @ op(b)`: `batch` products of `m x k` by `k x n`, each operand's
    /// matrices consecutive (rank > 2, equal leading axes). The host GEMM, or cubek's exact
    /// kernels over the batch on a device.
    BatchMatMul { batch: usize, m: usize, k: usize, n: usize, transpose_a: bool, transpose_b: bool, products: Products },
    /// A transpose written out row-major: input extents `dims`, output axis `i` is input axis
    /// `perm[i]`. The layout copies (this, `Slice`, `Pad`, `Broadcast`, `Concat`) run on the
    /// host's row copies and on a device's strided-copy kernel ([`crate::cube::layout`]), whose
    /// output is a buffer of the plan's arena (burn's ops made views, or new buffers, that
    /// kept a window from being captured).
    Permute { dims: Vec<usize>, perm: Vec<usize> },
    /// A slice written out row-major: input extents `dims`, `begin..end` on every axis.
    Slice { dims: Vec<usize>, begin: Vec<usize>, end: Vec<usize> },
    /// Zero padding written out row-major: input extents `dims`, `lo`/`hi` elements around each
    /// axis.
    Pad { dims: Vec<usize>, lo: Vec<usize>, hi: Vec<usize> },
    /// A broadcast written out row-major: input extents `dims` (aligned to the right of `out`'s,
    /// each 1 or `out`'s) repeated to extents `out`.
    Broadcast { dims: Vec<usize>, out: Vec<usize> },
    /// A concatenation written out row-major: operand `k` of extents `dims[k]`, along `axis`.
    Concat { dims: Vec<Vec<usize>>, axis: usize },
    /// Causal masking of `[..., t, s]` scores (see `Op::CausalMask`).
    CausalMask { t: usize, s: usize, fill: f64 },
    /// Multi-head self-attention over `qkv [b, t, 3 * heads * d]` (see `Op::Attention`), or
    /// (`grad`) its gradient w.r.t. `qkv` from `(qkv, dy)`. Host kernels and `#[cube]` ones.
    /// `kept`: the slot where, on host backends, the forward keeps its probabilities
    /// `[b, heads, t, t]` and its gradients later in the plan read them instead of computing
    /// them again (set by the executor).
    Attention { b: usize, t: usize, heads: usize, d: usize, causal: bool, grad: bool, kept: Option<usize> },
    /// The maximum of each row of `[rows, cols]` (a `reduce_max` over the last axis). Host
    /// backends only.
    MaxRows { cols: usize },
    /// A fused program's output `[outer, kept, inner]` summed over its first and last axes
    /// (times `scale`) as it is computed, never written out: a program only a `SumPlanes`
    /// reads (a layer norm's row sums, `outer == 1`; batch norm's per-channel sums over `N, H,
    /// W`), set by the plan for host backends ([`crate::exec`]'s merges).
    SumOf { program: Arc<Elementwise>, outer: usize, inner: usize, scale: Option<f64> },
    /// A float `constant`: every element `value` (on host backends in the plan's arena, so a
    /// clear of the accumulators allocates nothing).
    Fill(f64),
    /// `gather`: rows of a `[rows, width]` table picked by integer ids (an embedding). On a
    /// device where the ids are a plan input the session checks ([`crate::cube::layout`]).
    Gather { rows: usize, width: usize },
    /// `scatter_add`: rows of width `width` added into `rows` zero rows at their ids, in order
    /// (an embedding's gradient). On a device as `Gather`, within a scan's bound.
    ScatterAdd { rows: usize, width: usize },
    /// `dropout`: each row of `row` elements of item `items[i]` times its keyed factor (0 or
    /// `1 / (1 - p)`, [`dropout_factor`]), drawn in the kernel on devices too.
    Dropout { p: f64, seed: u64, row: usize },
    /// An `epilogue` node: `head` on the first `head_args` operands, then `post` over its
    /// output in place (`post`'s operand 0 is the head's output, the others the node's operands
    /// after the head's).
    Epilogue { head: Box<Native>, head_args: usize, post: Arc<Elementwise> },
}

impl Native {
    /// A permute, slice, pad, broadcast or concatenation: values moved, none computed.
    pub fn is_layout_copy(&self) -> bool {
        matches!(self, Native::Permute { .. } | Native::Slice { .. } | Native::Pad { .. } | Native::Broadcast { .. } | Native::Concat { .. })
    }

    /// A kernel that indexes by integer ids (a loss's class ids, a gather's or scatter-add's
    /// rows): a device runs it only where the session checked the ids on the host.
    pub fn indexes_by_ids(&self) -> bool {
        matches!(self, Native::SoftmaxCrossEntropy { .. } | Native::Gather { .. } | Native::ScatterAdd { .. })
    }

    /// How many of its leading operands the device's kernel for this op reads as they are
    /// stored, bf16 / f16 included (a session's low-precision storage,
    /// [`crate::Session::set_low_precision_storage`]); the others it reads as f32. The
    /// elementwise kernel and the layout copies read every operand so, a gather its table, a
    /// scatter-add its rows, cubek's matmuls, attention and convolutions
    /// their two, the sums, the loss (its logits) and max pooling their first; an epilogue
    /// after a product or a sum every operand (its program runs on the elementwise kernel),
    /// one with its program inside a convolution's or a pooling gradient's kernel the head's
    /// two. Convolutions on tensor cores read f32 whatever this says (the session binds only
    /// exact ones to read low).
    pub fn stored_operands(&self) -> usize {
        match self {
            Native::Fused(_) => usize::MAX,
            k if k.is_layout_copy() => usize::MAX,
            // The table; the rows (operand 1, after the ids).
            Native::Gather { .. } => 1,
            Native::ScatterAdd { .. } => 2,
            Native::MatMul { .. } | Native::BatchMatMul { .. } | Native::Attention { .. } | Native::Conv { .. } | Native::MaxPoolGrad { .. } => 2,
            Native::SumRows { .. } | Native::SumPlanes { .. } | Native::SoftmaxCrossEntropy { .. } | Native::MaxPool { .. } => 1,
            Native::Epilogue { head, .. } => match **head {
                Native::MatMul { .. } | Native::BatchMatMul { .. } | Native::SumRows { .. } | Native::SumPlanes { .. } => usize::MAX,
                Native::Conv { .. } | Native::MaxPoolGrad { .. } => 2,
                _ => 0,
            },
            _ => 0,
        }
    }
}

/// How a host backend multiplies a product's operands. Chosen when the plan is compiled
/// ([`crate::exec::compile`]): `Bf16` where the precision pass has rounded both operands to
/// bf16 and the CPU multiplies bf16 pairs ([`crate::host::bf16`]: AVX-512 BF16), `F32`
/// everywhere else. Device backends and the f64 reference backend multiply in their own
/// precision whatever it says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Products {
    /// f32 multiply-adds: exact f32 products, the emulation of bf16 when its operands are bf16.
    #[default]
    F32,
    /// Pairs of bf16 values multiplied and summed in f32 (`vdpbf16ps`), as autocast's products:
    /// the same products as `F32` on bf16 operands, summed in another order.
    Bf16,
}

/// Whether a device's attention forward with tensor cores asked for runs on cubek-attention
/// (`cube::flash`): its queries, keys and values are views of `qkv` starting at multiples of
/// the width `heads * d`, which must keep binding offsets 256-byte aligned in f32 and in 16-bit
/// storage alike.
pub fn flash_attention_takes(heads: usize, d: usize) -> bool {
    d > 0 && (heads * d).is_multiple_of(128)
}

/// Which of cubek's exact-f32 matmul kernels a device runs a matmul on, chosen from its
/// extents when the plan is bound. All of them multiply in f32 on the units' registers (no
/// tensor cores, so no rounding of the operands to TF32: that is the session's opt-in,
/// [`crate::Session::set_tf32`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiling {
    /// Few outputs or a short inner extent: one register tile per unit, one stage
    /// (`SimpleUnit`).
    Simple,
    /// Register tiles, double-buffered stages (`DoubleUnit`).
    Double,
}

impl Tiling {
    /// The kernel for an `m x k` by `k x n` product: the double-buffered one when the
    /// output fills at least a few dozen 8 x 8 tiles and the inner extent spans several stages.
    pub fn for_extents(m: usize, k: usize, n: usize) -> Tiling {
        if m * n >= 64 * 64 && k >= 64 {
            Tiling::Double
        } else {
            Tiling::Simple
        }
    }
}

/// An elementwise program (a `fused` node's, an epilogue's) bound to its operands' extents.
#[derive(Debug)]
pub struct Elementwise {
    pub prog: Program,
    /// Values the program holds at once, run as a stack machine ([`Program::depth`]).
    pub depth: usize,
    /// How output element `i` reads each operand.
    pub reads: Vec<Read>,
    /// Output elements.
    pub len: usize,
    /// The operands the plan knows hold only bf16 values (empty: none), set at plan build.
    pub bf16_args: Vec<bool>,
    /// The host's tables of the program's subtrees on those operands, made on its first run
    /// there ([`crate::host::tables`]).
    pub tables: std::sync::OnceLock<Tables>,
}

/// Entries of a table of a program's subtree ([`Tables`]): one per bf16 bit pattern.
pub const BF16_VALUES: usize = 1 << 16;

/// One tabulated subtree (`crate::host::tables`): steps `first..=last` of the program
/// (contiguous: it is postfix) read operand `arg` and literals, and `values[b]` is their
/// result for the f32 value whose bits are `b << 16`.
#[derive(Debug)]
pub struct Table {
    pub first: usize,
    pub last: usize,
    pub arg: u8,
    /// Shared by every program with the same subtree in the process (a model's layers).
    pub values: Arc<[f32; BF16_VALUES]>,
}

/// A program's tables, in step order (none overlap).
#[derive(Debug, Default)]
pub struct Tables {
    pub tables: Vec<Table>,
}

impl Tables {
    /// The table whose subtree begins at step `k`.
    #[inline(always)]
    pub fn at(&self, k: usize) -> Option<&Table> {
        self.tables.iter().find(|t| t.first == k)
    }
}

impl Elementwise {
    /// `prog` with operands read as `reads`, over `len` output elements.
    pub fn new(prog: Program, reads: Vec<Read>, len: usize) -> Elementwise {
        Elementwise { depth: prog.depth(), prog, reads, len, bf16_args: Vec::new(), tables: std::sync::OnceLock::new() }
    }

    /// The same, knowing which operands hold only bf16 values.
    pub fn with_bf16_args(&self, bf16_args: Vec<bool>) -> Elementwise {
        Elementwise { bf16_args, ..Elementwise::new(self.prog.clone(), self.reads.clone(), self.len) }
    }
}

/// Where output element `i` finds an operand's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Read {
    /// At `i`: the operand has the output's extents.
    Same,
    /// At 0: one element.
    Splat,
    /// At `i % n`: the operand's extents are the output's last ones (a bias).
    Cycle(usize),
    /// At the sum over output axes of `index * stride` (0 for a broadcast axis).
    Strided { out: Vec<usize>, strides: Vec<usize> },
}

impl Read {
    fn of(x: &[usize], out: &[usize]) -> Read {
        let n: usize = x.iter().product();
        let lead = x.iter().take_while(|&&d| d == 1).count();
        if x == out {
            Read::Same
        } else if n == 1 {
            Read::Splat
        } else if out.ends_with(&x[lead..]) {
            Read::Cycle(n)
        } else {
            let pad = out.len() - x.len();
            let mut strides = vec![0; out.len()];
            let mut s = 1;
            for a in (0..x.len()).rev() {
                strides[pad + a] = if x[a] == 1 { 0 } else { s };
                s *= x[a];
            }
            // Axes of one element dropped, and neighbours read as one axis merged (both
            // broadcast, or the outer's stride spanning the inner): the same addresses, in
            // runs as long as they can be (batch norm's per-channel operand of an NCHW
            // output reads `[n, c, h * w]` with strides `[0, 1, 0]`: one value per plane).
            let (mut merged, mut by): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
            for (&e, &st) in out.iter().zip(&strides).filter(|(&e, _)| e != 1) {
                match (merged.last_mut(), by.last_mut()) {
                    (Some(pe), Some(ps)) if *ps == st * e => {
                        *pe *= e;
                        *ps = st;
                    }
                    _ => {
                        merged.push(e);
                        by.push(st);
                    }
                }
            }
            Read::Strided { out: merged, strides: by }
        }
    }
}

fn elementwise(e: &Program, tys: &[&TensorType]) -> Option<Arc<Elementwise>> {
    e.check_elementwise().ok()?;
    let out = tys.iter().try_fold(Vec::new(), |s, t| broadcast_shapes(&s, t.dims()))?;
    let reads = tys.iter().map(|t| Read::of(t.dims(), &out)).collect();
    Some(Arc::new(Elementwise::new(e.clone(), reads, out.iter().product())))
}

/// A program (`Fused`) whose output only `sum` (a `SumPlanes` of the whole of it) reads, as
/// one kernel summing the program's values as it computes them.
pub(crate) fn sum_of(program: &Native, sum: &Native) -> Option<Native> {
    match (program, sum) {
        // Runs of at most 4 Ki values: a few rows at a time fit the kernel's scratch.
        (Native::Fused(e), &Native::SumPlanes { outer, inner, scale })
            if outer >= 1 && (1..=4096).contains(&inner) && e.len.is_multiple_of(outer * inner) =>
        {
            Some(Native::SumOf { program: e.clone(), outer, inner, scale })
        }
        _ => None,
    }
}

/// `head` (of `head_args` operands, result of type `ty`) with a `round_to` `dtype` of its
/// result as its epilogue: the rounding over each part of the result as the head writes it.
pub(crate) fn rounding(head: &Native, head_args: usize, ty: &TensorType, dtype: cellgraph_compiler::DType) -> Option<Native> {
    let post = elementwise(&Program::of_op(&Op::RoundTo { dtype }, 1)?, &[ty])?;
    Some(Native::Epilogue { head: Box::new(head.clone()), head_args, post })
}

/// The kernel for `op` on operands of types `tys`, resolved once (padding modes included);
/// `None` for ops that run on burn's ops (or windows that do not resolve: the lowering then
/// reports the error).
pub fn bind(op: &Op, tys: &[&TensorType]) -> Option<Native> {
    let d = |i: usize| tys[i].dims();
    let resolve = |x: &[usize], k: [usize; 2], s, dil, mode, pad| window::resolve([x[2], x[3]], k, s, dil, mode, pad).ok();
    let conv = |kind, c: &cellgraph_compiler::op::Conv2dAttrs, x: &[usize], w: &[usize]| {
        let win = resolve(x, [w[2], w[3]], c.stride, c.dilation, c.pad_mode, c.pad)?;
        let g = geometry(x, [w[2], w[3]], c.stride, c.dilation, &win);
        let algo = ConvAlgo::choose(&g, c.groups, w[0]);
        Some(Native::Conv { kind, g, groups: c.groups, out_channels: w[0], algo, products: Products::F32 })
    };
    let pool = |p: &cellgraph_compiler::Pool2dAttrs| {
        let x = d(0);
        let win = resolve(x, p.kernel, p.stride, [1, 1], p.pad_mode, p.pad)?;
        Some(geometry(x, p.kernel, p.stride, [1, 1], &win))
    };
    match op {
        Op::MatMul { transpose_a, transpose_b } if tys[0].rank() > 2 => {
            let (a, b, r) = (d(0), d(1), tys[0].rank());
            let (m, k) = if *transpose_a { (a[r - 1], a[r - 2]) } else { (a[r - 2], a[r - 1]) };
            let n = if *transpose_b { b[r - 2] } else { b[r - 1] };
            Some(Native::BatchMatMul {
                batch: a[..r - 2].iter().product(),
                m,
                k,
                n,
                transpose_a: *transpose_a,
                transpose_b: *transpose_b,
                products: Products::F32,
            })
        }
        Op::Transpose { perm } if tys[0].dtype.is_float() => Some(Native::Permute { dims: d(0).to_vec(), perm: perm.clone() }),
        Op::Pad { lo, hi } if tys[0].dtype.is_float() => Some(Native::Pad { dims: d(0).to_vec(), lo: lo.clone(), hi: hi.clone() }),
        Op::Attention { heads, causal } | Op::AttentionGrad { heads, causal } => {
            let &[b, t, c3] = d(0) else { return None };
            let grad = matches!(op, Op::AttentionGrad { .. });
            Some(Native::Attention { b, t, heads: *heads, d: c3 / (3 * heads), causal: *causal, grad, kept: None })
        }
        Op::CausalMask { fill } => {
            let r = tys[0].rank();
            Some(Native::CausalMask { t: d(0)[r - 2], s: d(0)[r - 1], fill: *fill })
        }
        // Over the last axis (a scalar has none: `rank - 1` must not be formed for it).
        Op::ReduceMax(r) if r.axes.len() == 1 && r.axes[0] + 1 == tys[0].rank() && d(0)[r.axes[0]] > 0 => {
            Some(Native::MaxRows { cols: d(0)[r.axes[0]] })
        }
        Op::Slice { begin, end } if tys[0].dtype.is_float() => Some(Native::Slice { dims: d(0).to_vec(), begin: begin.clone(), end: end.clone() }),
        Op::Broadcast { shape } if tys[0].dtype.is_float() && d(0) != &shape.0[..] => {
            Some(Native::Broadcast { dims: d(0).to_vec(), out: shape.0.clone() })
        }
        Op::Concat { axis } if tys.iter().all(|t| t.dtype.is_float()) && !tys.is_empty() => {
            Some(Native::Concat { dims: tys.iter().map(|t| t.dims().to_vec()).collect(), axis: *axis })
        }
        Op::MatMul { transpose_a, transpose_b } => {
            let (a, b) = (d(0), d(1));
            let (m, k) = if *transpose_a { (a[1], a[0]) } else { (a[0], a[1]) };
            let n = if *transpose_b { b[0] } else { b[1] };
            Some(Native::MatMul {
                m,
                k,
                n,
                transpose_a: *transpose_a,
                transpose_b: *transpose_b,
                tiling: Tiling::for_extents(m, k, n),
                products: Products::F32,
            })
        }
        Op::Conv2d(c) => conv(ConvKind::Forward, c, d(0), d(1)),
        Op::Conv2dBackpropInput { conv: c, input_shape } => conv(ConvKind::InputGrad, c, &input_shape.0, d(1)),
        Op::Conv2dBackpropFilter { conv: c, filter_shape } => conv(ConvKind::FilterGrad, c, d(1), &filter_shape.0),
        Op::MaxPool2d(p) => Some(Native::MaxPool { g: pool(p)?, keep: None }),
        Op::MaxPool2dGrad(p) => Some(Native::MaxPoolGrad { g: pool(p)?, kept: None }),
        Op::Constant { value } => Some(Native::Fill(*value)),
        Op::ZerosLike if tys[0].dtype.is_float() => Some(Native::Fill(0.0)),
        Op::Gather if tys[0].dtype.is_float() && tys[0].rank() >= 1 && d(0)[0] > 0 => {
            Some(Native::Gather { rows: d(0)[0], width: tys[0].numel() / d(0)[0] })
        }
        Op::ScatterAdd { rows } if tys[1].dtype.is_float() && tys[0].numel() > 0 => {
            Some(Native::ScatterAdd { rows: *rows, width: tys[1].numel() / tys[0].numel() })
        }
        Op::Dropout { p, seed } if tys[0].dtype.is_float() && tys[0].rank() >= 1 && d(0)[0] > 0 => {
            Some(Native::Dropout { p: *p, seed: *seed, row: tys[0].numel() / d(0)[0] })
        }
        Op::Relu => Some(Native::Relu),
        Op::ReluGrad if d(0) == d(1) => Some(Native::ReluGrad),
        Op::Fused { expr } => elementwise(expr, tys).map(Native::Fused),
        // One op as a one-step program: on host backends its output then comes from the
        // plan's arena, and exp, erf and tanh alone compute what they compute in a program
        // (log and sqrt alone stay on burn's ops, whose bits a program's are).
        Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Neg | Op::RoundTo { .. } | Op::Exp | Op::Erf | Op::Tanh => {
            elementwise(&Program::of_op(op, tys.len())?, tys).map(Native::Fused)
        }
        Op::ReduceSum(r) if r.axes == [0] && tys[0].rank() == 2 && d(0)[1] > 1 => Some(Native::SumRows { cols: d(0)[1] }),
        Op::ReduceSum(r) | Op::ReduceMean(r) => {
            let (outer, kept, inner) = planes(d(0), &r.axes)?;
            let scale = matches!(op, Op::ReduceMean(_)).then(|| 1.0 / (outer * inner) as f64);
            (kept > 0).then_some(Native::SumPlanes { outer, inner, scale })
        }
        Op::SoftmaxCrossEntropy { sparse: true, reduction } if d(0)[1] > 0 => {
            Some(Native::SoftmaxCrossEntropy { c: d(0)[1], reduction: *reduction, grad: false, kept: None, seed: None })
        }
        Op::SoftmaxCrossEntropyGrad { sparse: true, reduction } if d(0)[1] > 0 => {
            Some(Native::SoftmaxCrossEntropy { c: d(0)[1], reduction: *reduction, grad: true, kept: None, seed: None })
        }
        Op::Epilogue { head, expr } => {
            let (hs, rest) = tys.split_at(head.arity().min());
            let y = infer(head, hs).ok()?;
            let ys: Vec<&TensorType> = std::iter::once(&y).chain(rest.iter().copied()).collect();
            Some(Native::Epilogue { head: Box::new(bind(head, hs)?), head_args: hs.len(), post: elementwise(expr, &ys)? })
        }
        _ => None,
    }
}

/// A reduction of extents `dims` over `axes` as `[outer, kept, inner]` summed over its first
/// and last axes: when the axes kept lie together (at least one), their product, and the
/// products of the extents before and after them.
fn planes(dims: &[usize], axes: &[usize]) -> Option<(usize, usize, usize)> {
    let kept: Vec<usize> = (0..dims.len()).filter(|a| !axes.contains(a)).collect();
    let (&first, &last) = (kept.first()?, kept.last()?);
    if last - first + 1 != kept.len() {
        return None;
    }
    let prod = |r: std::ops::Range<usize>| dims[r].iter().product::<usize>();
    Some((prod(0..first), prod(first..last + 1), prod(last + 1..dims.len())))
}

/// State buffers the devices' boundary kernel binds (`cube::update_clear`).
pub const BOUNDARY_STATES: u8 = 2;

/// Whether the devices' boundary kernel runs the optimizer update `u`: it reads and writes at
/// most [`BOUNDARY_STATES`] state buffers (every built-in optimizer does).
pub fn boundary_kernel_takes(u: &Program) -> bool {
    u.steps().iter().all(|s| match *s {
        Step::Write(o, _) => o <= BOUNDARY_STATES,
        s => s.reads().all(|v| !matches!(v, Val::Arg(a) if a >= 2 + BOUNDARY_STATES)),
    })
}

/// SplitMix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Dropout's factor for element `j` of the row of global item `item` at update `update`: 0
/// when a uniform draw keyed by `(seed, update, item, j)` falls below `p`, else `1 / (1 - p)`.
pub fn dropout_factor(seed: u64, update: i64, item: i64, p: f64) -> impl Fn(usize) -> f64 {
    let row = mix(mix(mix(seed) ^ update as u64) ^ item as u64);
    let scale = 1.0 / (1.0 - p);
    move |j| {
        let u = (mix(row.wrapping_add(j as u64)) >> 11) as f64 / (1u64 << 53) as f64;
        if u < p {
            0.0
        } else {
            scale
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Broadcast reads merge the axes they read as one: a per-channel operand of NCHW reads
    /// one value per plane (with or without its leading axis of one), a row broadcast over a
    /// middle axis keeps its three axes, broadcast axes next to each other become one, and an
    /// operand matching the output's last axes is still a cycle.
    #[test]
    fn strided_reads_merge_axes_read_as_one() {
        let read = |x: &[usize], out: &[usize]| Read::of(x, out);
        assert_eq!(read(&[1, 3, 1, 1], &[2, 3, 4, 5]), Read::Strided { out: vec![2, 3, 20], strides: vec![0, 1, 0] });
        assert_eq!(read(&[3, 1, 1], &[2, 3, 4, 5]), Read::Strided { out: vec![2, 3, 20], strides: vec![0, 1, 0] });
        assert_eq!(read(&[2, 1, 4], &[2, 3, 4]), Read::Strided { out: vec![2, 3, 4], strides: vec![4, 0, 1] });
        assert_eq!(read(&[2, 1, 1, 5], &[2, 3, 4, 5]), Read::Strided { out: vec![2, 12, 5], strides: vec![5, 0, 1] });
        assert_eq!(read(&[1, 3, 4], &[2, 3, 4]), Read::Cycle(12));
    }
}

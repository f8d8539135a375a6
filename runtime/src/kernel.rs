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

/// The geometry of one 2-D convolution (or pooling window) over NCHW input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Geometry {
    /// `[n, c, h, w]` of the input.
    pub x: [usize; 4],
    /// `[kh, kw]`.
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    /// `[top, left]` padding (bottom and right follow from `out`).
    pub pad: [usize; 2],
    /// `[oh, ow]`.
    pub out: [usize; 2],
}

impl Geometry {
    pub(crate) fn spatial(&self) -> usize {
        self.out[0] * self.out[1]
    }
    /// Stride 1, dilation 1, no padding, and a window that fits: every output reads a
    /// contiguous run of each input row.
    pub(crate) fn is_dense(&self) -> bool {
        self.stride == [1, 1]
            && self.dilation == [1, 1]
            && self.pad == [0, 0]
            && self.out[0] > 0
            && self.out[1] > 0
            && self.out[0] + self.kernel[0] <= self.x[2] + 1
            && self.out[1] + self.kernel[1] <= self.x[3] + 1
    }
    /// True when some output's window lies wholly in the padding (no input element).
    pub fn has_empty_window(&self) -> bool {
        (0..2).any(|a| (0..self.out[a]).any(|o| (0..self.kernel[a]).all(|k| self.at(a, o, k).is_none())))
    }
    /// The input coordinate read by output `o` at kernel offset `k` along axis `a`, if inside.
    #[inline]
    pub(crate) fn at(&self, a: usize, o: usize, k: usize) -> Option<usize> {
        let i = (o * self.stride[a] + k * self.dilation[a]).checked_sub(self.pad[a])?;
        (i < self.x[2 + a]).then_some(i)
    }
    /// Why cubek's implicit-GEMM convolution (tensor cores, through burn-cubecl) does not
    /// take a convolution of this geometry in direction `kind` with `groups` groups; `None`
    /// when it does. Its routines take one group, pad both ends of an axis alike (so the
    /// windows must be the ones a symmetric padding of `pad` gives: the same outputs), and
    /// compute the input gradient at stride 1 only: at a larger stride it is the forward
    /// convolution of [`Self::upsampled`], where padding does not pass the dilated window.
    pub fn implicit_gemm_declines(&self, kind: ConvKind, groups: usize) -> Option<&'static str> {
        let symmetric = (0..2).all(|a| {
            let span = self.dilation[a] * self.kernel[a].saturating_sub(1) + 1;
            let padded = self.x[2 + a] + 2 * self.pad[a];
            padded >= span && (padded - span) / self.stride[a] + 1 == self.out[a]
        });
        if groups != 1 {
            Some("grouped")
        } else if !symmetric {
            Some("asymmetric padding")
        } else if kind == ConvKind::InputGrad && self.stride != [1, 1] && self.upsampled(1).is_none() {
            Some("strided input gradient padded past its window")
        } else {
            None
        }
    }
    /// The stride-1 forward convolution whose result is the input gradient of a strided
    /// convolution of this geometry (see `cube::conv::input_grad_by_upsampling`): over `dy`
    /// spread out by the stride (zeros between its elements and after the last, `[n, o, uh,
    /// uw]`), the filter flipped with its channel axes swapped, padding `(k - 1) * dilation -
    /// pad` on every side (its windows are symmetric), and the input's extents as output.
    /// `None` where the padding exceeds the dilated window (the gradient then has no such form).
    pub fn upsampled(&self, out_channels: usize) -> Option<Geometry> {
        let g = self;
        let mut spread = [0; 2];
        let mut pad = [0; 2];
        for a in 0..2 {
            let reach = g.dilation[a] * g.kernel[a].checked_sub(1)?;
            pad[a] = reach.checked_sub(g.pad[a])?;
            // `x + 2p - reach`: `dy`'s last element lands at `(out - 1) * stride` in it.
            spread[a] = (g.x[2 + a] + 2 * g.pad[a]).checked_sub(reach)?;
            if spread[a] < (g.out[a].checked_sub(1)?) * g.stride[a] + 1 {
                return None;
            }
        }
        Some(Geometry {
            x: [g.x[0], out_channels, spread[0], spread[1]],
            kernel: g.kernel,
            stride: [1, 1],
            dilation: g.dilation,
            pad,
            out: [g.x[2], g.x[3]],
        })
    }
    /// Output columns `[lo, hi)` whose input column at kernel offset `kx` lies inside.
    pub(crate) fn valid_cols(&self, kx: usize) -> (usize, usize) {
        let (s, off, w) = (self.stride[1], kx * self.dilation[1], self.x[3]);
        let lo = self.pad[1].saturating_sub(off).div_ceil(s).min(self.out[1]);
        let hi = if w + self.pad[1] > off { (w + self.pad[1] - off).div_ceil(s).min(self.out[1]) } else { 0 };
        (lo, hi.max(lo))
    }
}

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
    Some(Arc::new(Elementwise { prog: e.clone(), depth: e.depth(), reads, len: out.iter().product() }))
}

/// Grid positions a direct convolution kernel holds in registers at a time, per channel.
pub const DIRECT_BLOCK: usize = 16;

/// Whether a convolution of geometry `g` with `groups` groups runs on the direct kernels:
/// dense (stride 1, dilation 1, no padding), one group, a kernel larger than one pixel, a
/// contraction `c * kh * kw` of at most 512 (beyond it im2col's GEMM reuses its operands
/// better), and at least one block of grid positions. Otherwise im2col + GEMM.
pub fn direct_conv(g: &Geometry, groups: usize) -> bool {
    let kk = g.kernel[0] * g.kernel[1];
    g.is_dense() && groups == 1 && kk > 1 && g.x[1] * kk <= 512 && (g.out[0] - 1) * g.x[3] + g.out[1] >= DIRECT_BLOCK
}

/// How host backends run a convolution, in each of its three directions: chosen once, when
/// the plan is built ([`ConvAlgo::choose`]), and stored in the step, so no kernel re-derives
/// it per call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConvAlgo {
    /// The direct kernels ([`crate::host::direct`]; where they apply: [`direct_conv`]).
    Direct,
    /// A map so small that the convolution is a dense layer ([`crate::host::toeplitz`]): the
    /// dense filter's nonzeros. `filter`: for a forward or input gradient whose filter is a
    /// parameter read as it is, that parameter's name: its dense filter is then built once per
    /// value of the parameter and kept between runs ([`crate::host::Kept`]), rather than on
    /// every call.
    Dense { taps: Arc<[Tap]>, filter: Option<Arc<str>> },
    /// im2col + GEMM ([`crate::host::conv`]).
    Im2col(Im2col),
}

/// One nonzero of a dense small-map filter: output position `p` reads input pixel `q` through
/// kernel tap `t` (flat indices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tap {
    pub p: u32,
    pub q: u32,
    pub t: u32,
}

/// An im2col convolution's resolved cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Im2col {
    /// The geometry the GEMMs run on: the step's own, or, where some kernel taps never read an
    /// input element (a 3 x 3 kernel padded by 1 on a 1 x 1 map reads its centre alone), the
    /// convolution by the cropped kernel, which computes the same sums without the terms that
    /// are always zero.
    pub g: Geometry,
    /// With a cropped kernel, the first tap kept on each axis.
    pub crop: Option<[usize; 2]>,
    /// Images per column matrix (a chunk; chunks run on the rayon pool's threads). The cut
    /// depends on the shapes only, never on the thread count, so neither do the results; it is
    /// sized for 4-byte elements, and f64 backends (the gradient checks) keep it.
    pub chunk: usize,
    /// The filter gradient is made transposed, as `[kk, og]` per group, and turned back while
    /// the chunks are added (with few output channels packing the chunk's `dy` is cheaper than
    /// gathering its column matrix; see [`crate::host::conv::filter_grad`]).
    pub transposed: bool,
}

/// A chunk's column matrix stays within about this many bytes (a core's L2 cache; larger
/// chunks give the GEMMs of small maps more columns).
const CHUNK_BYTES: usize = 1 << 20;

/// The dense filter's largest size in elements (16 MiB of f32).
const MAX_DENSE: usize = 1 << 22;

impl ConvAlgo {
    /// The algorithm for a convolution of geometry `g`, `groups` groups and `o` output
    /// channels: the direct kernels where [`direct_conv`] says so, else a dense layer where
    /// [`dense_taps`] finds one, else im2col ([`ConvAlgo::im2col`]).
    pub fn choose(g: &Geometry, groups: usize, o: usize) -> ConvAlgo {
        if direct_conv(g, groups) {
            return ConvAlgo::Direct;
        }
        ConvAlgo::gemm(g, groups, o)
    }
    /// A dense layer where [`dense_taps`] finds one, else im2col: the algorithms that run on
    /// the GEMM, whether or not the direct kernels would apply.
    pub fn gemm(g: &Geometry, groups: usize, o: usize) -> ConvAlgo {
        match dense_taps(g, groups, o) {
            Some(taps) => ConvAlgo::Dense { taps: taps.into(), filter: None },
            None => ConvAlgo::im2col(g, groups, o),
        }
    }
    /// im2col + GEMM for `g`, whatever else would apply (the benchmarks and tests compare the
    /// algorithms on one shape).
    pub fn im2col(g: &Geometry, groups: usize, o: usize) -> ConvAlgo {
        let (run, crop) = match cropped(g) {
            Some((small, at)) => (small, Some(at)),
            None => (*g, None),
        };
        let (og, kk) = (o / groups.max(1), run.x[1] / groups.max(1) * run.kernel[0] * run.kernel[1]);
        let per_image = (kk * run.spatial() * 4).max(1);
        let n = g.x[0].max(1);
        let most = (CHUNK_BYTES / per_image).clamp(1, n);
        // As many chunks as that needs, rounded up to a power of two so that two or four threads
        // share them evenly (five chunks on two threads left one idle for a fifth of the time),
        // of sizes as equal as they can be.
        let chunk = n.div_ceil(n.div_ceil(most).next_power_of_two().min(n));
        // With 128 output channels the arithmetic hides the packing and `dw`'s layout wins.
        let transposed = og <= 64 && kk >= og;
        ConvAlgo::Im2col(Im2col { g: run, crop, chunk, transposed })
    }
    /// Its name in plan listings: `direct`, `dense taps`, `im2col`, `im2col cropped`.
    pub fn name(&self) -> &'static str {
        match self {
            ConvAlgo::Direct => "direct",
            ConvAlgo::Dense { .. } => "dense taps",
            ConvAlgo::Im2col(Im2col { crop: None, .. }) => "im2col",
            ConvAlgo::Im2col(Im2col { crop: Some(_), .. }) => "im2col cropped",
        }
    }
}

/// `g`'s taps when the convolution (one group, `o` output channels) is better done as a dense
/// layer: the taps fill at least 9 in 10 of the (position, pixel) pairs of a map of at most
/// 64 of each, and the dense filter stays within [`MAX_DENSE`] elements. `None` otherwise
/// (im2col then wastes less), and for empty tensors (which the im2col path handles).
pub fn dense_taps(g: &Geometry, groups: usize, o: usize) -> Option<Vec<Tap>> {
    let [n, c, h, w] = g.x;
    let (sp, hw) = (g.spatial(), h * w);
    if groups != 1 || n * c * o * sp * hw == 0 || sp * hw > 64 || o * sp * c * hw > MAX_DENSE {
        return None;
    }
    let live = |a: usize| -> usize { (0..g.out[a]).map(|o| (0..g.kernel[a]).filter(|&k| g.at(a, o, k).is_some()).count()).sum() };
    if 10 * live(0) * live(1) < 9 * sp * hw {
        return None;
    }
    let mut taps = Vec::with_capacity(sp * hw);
    for oy in 0..g.out[0] {
        for ox in 0..g.out[1] {
            for ky in 0..g.kernel[0] {
                for kx in 0..g.kernel[1] {
                    let (Some(iy), Some(ix)) = (g.at(0, oy, ky), g.at(1, ox, kx)) else { continue };
                    let (p, q, t) = (oy * g.out[1] + ox, iy * w + ix, ky * g.kernel[1] + kx);
                    taps.push(Tap { p: p as u32, q: q as u32, t: t as u32 });
                }
            }
        }
    }
    Some(taps)
}

/// The kernel taps that read an input element for some output, `[rows, cols]` of taps, when
/// others never do: the geometry of the convolution by the cropped kernel, and the first tap
/// kept on each axis.
fn cropped(g: &Geometry) -> Option<(Geometry, [usize; 2])> {
    let live = |a: usize| {
        let read = |k: usize| (0..g.out[a]).any(|o| g.at(a, o, k).is_some());
        let lo = (0..g.kernel[a]).find(|&k| read(k))?;
        let hi = (0..g.kernel[a]).rev().find(|&k| read(k))? + 1;
        Some((lo, hi))
    };
    let (r, c) = (live(0)?, live(1)?);
    if (r.1 - r.0, c.1 - c.0) == (g.kernel[0], g.kernel[1]) {
        return None;
    }
    let pad = [g.pad[0].checked_sub(r.0 * g.dilation[0])?, g.pad[1].checked_sub(c.0 * g.dilation[1])?];
    Some((Geometry { kernel: [r.1 - r.0, c.1 - c.0], pad, ..*g }, [r.0, c.0]))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConvKind {
    Forward,
    InputGrad,
    FilterGrad,
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

fn geometry(x: &[usize], kernel: [usize; 2], stride: [usize; 2], dilation: [usize; 2], w: &window::Window) -> Geometry {
    Geometry { x: [x[0], x[1], x[2], x[3]], kernel, stride, dilation, pad: [w.pad[0], w.pad[2]], out: w.out }
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

    /// A convolution's batch is cut into a power of two of equal chunks: ResNet-18's 3 x 3
    /// convolutions on 8 x 8 maps (147 KiB of columns per image, 7 to the MiB) take 8 chunks
    /// of 4 of a micro-batch of 32, not 5 of 7 (which left one of two threads idle a fifth of
    /// the time); LeNet5's first layer on 32 images, 4 chunks of 8, not 3 of 11.
    #[test]
    fn convolution_chunks_come_in_powers_of_two() {
        let g = |c: usize, hw: usize, k: usize, out: usize| Geometry {
            x: [32, c, hw, hw],
            kernel: [k, k],
            stride: [1, 1],
            dilation: [1, 1],
            pad: [k / 2, k / 2],
            out: [out, out],
        };
        let per = |g: Geometry, o: usize| match ConvAlgo::im2col(&g, 1, o) {
            ConvAlgo::Im2col(c) => c.chunk,
            other => panic!("{other:?}"),
        };
        assert_eq!(per(g(64, 8, 3, 8), 64), 4);
        assert_eq!(per(g(128, 4, 3, 4), 128), 8);
        let lenet = Geometry { x: [32, 1, 32, 32], kernel: [5, 5], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [28, 28] };
        assert_eq!(per(lenet, 6), 8);
        // An image over the MiB on a batch of 3: 3 chunks of one (4 would leave one empty).
        assert_eq!(per(Geometry { x: [3, 512, 16, 16], ..g(512, 16, 3, 16) }, 512), 1);
    }

    /// Each convolution's algorithm is settled by its shape when the plan is built: LeNet5's
    /// second layer runs direct, ResNet-18's 2 x 2 maps dense, a grouped 3 x 3 kernel padded by
    /// 1 on a 1 x 1 map on im2col with its centre tap alone, and im2col's filter gradient is
    /// made transposed up to 64 output channels.
    #[test]
    fn convolution_algorithms_are_chosen_by_shape() {
        let geo = |n: usize, c: usize, hw: usize, k: usize, pad: usize, stride: usize| {
            let out = (hw + 2 * pad - k) / stride + 1;
            Geometry { x: [n, c, hw, hw], kernel: [k, k], stride: [stride; 2], dilation: [1, 1], pad: [pad; 2], out: [out, out] }
        };
        assert_eq!(ConvAlgo::choose(&geo(32, 6, 14, 5, 0, 1), 1, 16).name(), "direct");
        assert!(matches!(ConvAlgo::choose(&geo(32, 256, 2, 3, 1, 1), 1, 256), ConvAlgo::Dense { ref taps, filter: None } if taps.len() == 16));
        let centre = ConvAlgo::choose(&geo(32, 64, 1, 3, 1, 1), 2, 64);
        let ConvAlgo::Im2col(c) = centre else { panic!("{centre:?}") };
        assert_eq!((c.crop, c.g.kernel, c.g.pad), (Some([1, 1]), [1, 1], [0, 0]));
        let transposed = |o: usize| match ConvAlgo::choose(&geo(32, 64, 8, 3, 1, 2), 1, o) {
            ConvAlgo::Im2col(c) => c.transposed,
            other => panic!("{other:?}"),
        };
        assert!(transposed(64) && !transposed(128));
        assert_eq!(ConvAlgo::gemm(&geo(32, 6, 14, 5, 0, 1), 1, 16).name(), "im2col");
    }

    /// cubek's implicit GEMM takes a convolution when symmetric padding gives its windows:
    /// ResNet's padded 3 x 3 and strided 1 x 1 layers, LeNet5's valid 5 x 5; not a `same`
    /// window padded more at the bottom than the top, not two groups, and an input gradient
    /// only at stride 1.
    #[test]
    fn implicit_gemm_takes_symmetric_ungrouped_convolutions() {
        use cellgraph_compiler::op::PadMode;
        let geo = |hw: usize, k: usize, stride: usize, mode: PadMode, pad: usize| {
            let w = window::resolve([hw, hw], [k, k], [stride; 2], [1, 1], mode, [pad; 4]).unwrap();
            geometry(&[8, 16, hw, hw], [k, k], [stride; 2], [1, 1], &w)
        };
        let (fwd, dx, dw) = (ConvKind::Forward, ConvKind::InputGrad, ConvKind::FilterGrad);
        let resnet = geo(16, 3, 2, PadMode::Pad, 1);
        assert_eq!(resnet.out, [8, 8]);
        assert_eq!((resnet.implicit_gemm_declines(fwd, 1), resnet.implicit_gemm_declines(dw, 1)), (None, None));
        assert_eq!(resnet.implicit_gemm_declines(dx, 1), None);
        // The gradient of a 1 x 1 window padded by 1 at stride 2 has no upsampled form.
        assert_eq!(geo(16, 1, 2, PadMode::Pad, 1).implicit_gemm_declines(dx, 1), Some("strided input gradient padded past its window"));
        let up = resnet.upsampled(32).unwrap();
        assert_eq!((up.x, up.stride, up.pad, up.out), ([8, 32, 16, 16], [1, 1], [1, 1], [16, 16]));
        assert_eq!(geo(16, 3, 1, PadMode::Pad, 1).implicit_gemm_declines(dx, 1), None);
        assert_eq!(geo(16, 1, 2, PadMode::Pad, 0).implicit_gemm_declines(fwd, 1), None);
        assert_eq!(geo(32, 5, 1, PadMode::Valid, 0).implicit_gemm_declines(fwd, 1), None);
        // `same` over 16 at stride 2 pads 0 at the top and 1 at the bottom.
        let same = geo(16, 3, 2, PadMode::Same, 0);
        assert_eq!((same.pad, same.out), ([0, 0], [8, 8]));
        assert_eq!(same.implicit_gemm_declines(fwd, 1), Some("asymmetric padding"));
        assert_eq!(geo(16, 3, 1, PadMode::Same, 0).implicit_gemm_declines(fwd, 1), None);
        assert_eq!(resnet.implicit_gemm_declines(fwd, 2), Some("grouped"));
    }
}

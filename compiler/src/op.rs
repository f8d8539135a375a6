//! The operations of the IR, declared once.
//!
//! Every op is a variant of [`Op`]; its attributes live inside the variant, operands are the
//! node's ordered edges. This file also holds the one table that maps ops to and from text
//! ([`Op::name`], [`Op::attrs`], [`Op::from_parts`]): no other place names an op by string.
//! Shape inference ([`crate::infer`]), gradients ([`crate::autodiff`]) and lowering (the
//! runtime) are exhaustive `match`es over this enum, so a new op must be decided everywhere.

use std::collections::BTreeMap;
use std::fmt;

use crate::program::Program;
use crate::types::{DType, Shape};

/// How a convolution or pooling window pads its input (MindSpore's `pad_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PadMode {
    /// No padding; the window must fit.
    Valid,
    /// Pad so that `out = ceil(in / stride)`; extra padding goes to the bottom/right.
    Same,
    /// Explicit padding from the `pad` attribute `[top, bottom, left, right]`.
    Pad,
}

/// How a loss reduces over the batch (MindSpore's `reduction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduction {
    None,
    Sum,
    Mean,
}

/// Attributes of a 2-D convolution over NCHW input and OIHW weight.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dAttrs {
    pub stride: [usize; 2],
    pub pad_mode: PadMode,
    /// `[top, bottom, left, right]`; only read when `pad_mode` is `Pad`.
    pub pad: [usize; 4],
    pub dilation: [usize; 2],
    pub groups: usize,
}

/// Attributes of a 2-D pooling window over NCHW input.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pool2dAttrs {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub pad_mode: PadMode,
    /// `[top, bottom, left, right]`; only read when `pad_mode` is `Pad`.
    pub pad: [usize; 4],
}

/// Attributes shared by the reductions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReduceAttrs {
    /// Axes to reduce, sorted, without repeats.
    pub axes: Vec<usize>,
    pub keep_dims: bool,
}

/// One operation. Operands are not stored here: they are the node's ordered edges.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    // ---- leaves (no operands)
    /// A trainable or state tensor, read by name from the parameter store.
    Parameter {
        name: String,
    },
    /// The `index`-th input of the graph.
    Input {
        index: usize,
        name: String,
    },
    /// A tensor of the node's type with every element equal to `value` (MindSpore's Fill).
    Constant {
        value: f64,
    },
    // ---- elementwise (binary ops broadcast numpy-style)
    Add,
    Sub,
    Mul,
    Div,
    Neg,
    Exp,
    Log,
    Relu,
    /// `dy * (y > 0)`, operands `(dy, y)`.
    ReluGrad,
    Sqrt,
    /// `a >= b` elementwise (bool result, no gradient).
    GreaterEqual,
    /// `a == b` elementwise on operands of one dtype (bool result, no gradient).
    Equal,
    /// The hyperbolic tangent.
    Tanh,
    /// The error function (GELU's exact form).
    Erf,
    /// Inverted dropout, operands `(x [N, ...], items [N] int, update [] int)`: element `j` of
    /// row `n` is kept (times `1 / (1 - p)`) unless a hash of `(seed, update, items[n], j)`
    /// falls below `p`, else 0. The mask depends on the item's global index and the update
    /// number only, so slicing into micro-batches, sharding over ranks or resuming never
    /// changes it. Its gradient is the same op on the cotangent.
    Dropout {
        p: f64,
        seed: u64,
    },
    /// Rounds f32 values to the nearest value of `dtype` (F16 or BF16: ties to even, past the
    /// largest finite value to infinity, f16's subnormals kept), storing them as f32: emulated
    /// low precision ([`crate::passes::precision`]). Its gradient passes the cotangent through
    /// unchanged (the rounding error is not differentiated, as a cast's is not).
    RoundTo {
        dtype: DType,
    },
    /// The identity, through which no gradient flows (JAX's and MindSpore's `stop_gradient`):
    /// softmax's subtracted maximum, whose exact gradient is zero.
    StopGradient,
    /// `cond ? a : b` elementwise, operands `(cond, a, b)`, broadcasting.
    Select,
    Cast {
        dtype: DType,
    },
    ZerosLike,
    // ---- shape
    Broadcast {
        shape: Shape,
    },
    Reshape {
        shape: Shape,
    },
    Transpose {
        perm: Vec<usize>,
    },
    /// `x[begin[i]..end[i]]` on every axis.
    Slice {
        begin: Vec<usize>,
        end: Vec<usize>,
    },
    /// Zero padding: `lo[i]` before and `hi[i]` after axis `i`.
    Pad {
        lo: Vec<usize>,
        hi: Vec<usize>,
    },
    Concat {
        axis: usize,
    },
    /// `[N, ...] -> [N, prod(...)]`.
    Flatten,
    // ---- reductions
    ReduceSum(ReduceAttrs),
    ReduceMean(ReduceAttrs),
    ReduceMax(ReduceAttrs),
    /// Gradient of `ReduceMax`, operands `(x, y, dy)`; ties share the gradient equally.
    ReduceMaxGrad(ReduceAttrs),
    // ---- linear algebra
    /// `op(a) @ op(b)`, `op` transposing the last two axes when the flag is set; operands of
    /// rank 2, or of one rank above 2 with equal leading (batch) axes.
    MatMul {
        transpose_a: bool,
        transpose_b: bool,
    },
    // ---- indexing
    /// Rows of a table by integer ids, operands `(table [V, ...], ids [...])`, giving
    /// `[...ids, ...rows]` (MindSpore's `Gather` on axis 0, an embedding lookup). Ids outside
    /// `0..V` are an error.
    Gather,
    /// The gradient of [`Op::Gather`]: `updates` added into a zero `[rows, ...]` table at their
    /// ids (repeated ids add up), operands `(ids [...], updates [...ids, ...])`.
    ScatterAdd {
        rows: usize,
    },
    /// Causal masking of attention scores `[..., T, S]`: element `(i, j)` becomes `fill` where
    /// `j > i + S - T` (a query never sees a later key); the rest pass through. Its gradient is
    /// the same mask with `fill` 0.
    CausalMask {
        fill: f64,
    },
    // ---- neural network
    /// Multi-head scaled dot-product self-attention (PyTorch's `scaled_dot_product_attention`
    /// on `heads` heads, scale `1/sqrt(D)`), operand `qkv [B, T, 3C]`: queries, keys and values
    /// side by side on the last axis (as one projection to `3C` makes them), head `h` in
    /// features `h*D..(h+1)*D` of each (`D = C / heads`). Gives `[B, T, C]`, the heads side by
    /// side. `causal`: position `i` attends to positions `0..=i` only, the others taking no
    /// part in its softmax (a fill of minus infinity). One op, so kernels skip what the mask
    /// removes and never write the scores out.
    Attention {
        heads: usize,
        causal: bool,
    },
    /// Gradient of [`Op::Attention`] w.r.t. `qkv`, operands `(qkv, dy)`, laid out as `qkv`.
    AttentionGrad {
        heads: usize,
        causal: bool,
    },
    /// Softmax cross-entropy of `(logits [N,C], labels)`: labels are class ids `[N]` when
    /// `sparse`, else probabilities `[N,C]`.
    SoftmaxCrossEntropy {
        sparse: bool,
        reduction: Reduction,
    },
    /// Gradient w.r.t. logits, operands `(logits, labels, dloss)`.
    SoftmaxCrossEntropyGrad {
        sparse: bool,
        reduction: Reduction,
    },
    /// Operands `(x [N,C,H,W], w [O,C/groups,KH,KW])`.
    Conv2d(Conv2dAttrs),
    /// Gradient w.r.t. the input, operands `(dy, w)`.
    Conv2dBackpropInput {
        conv: Conv2dAttrs,
        input_shape: Shape,
    },
    /// Gradient w.r.t. the weight, operands `(dy, x)`.
    Conv2dBackpropFilter {
        conv: Conv2dAttrs,
        filter_shape: Shape,
    },
    MaxPool2d(Pool2dAttrs),
    /// Operands `(x, dy)`.
    MaxPool2dGrad(Pool2dAttrs),
    AvgPool2d(Pool2dAttrs),
    /// Operands `(x, dy)`; `x` is read for its shape only.
    AvgPool2dGrad(Pool2dAttrs),
    // ---- collectives
    /// The element-wise sum of the operand over every rank of the data-parallel world
    /// (MindSpore's `AllReduce(ReduceOp.SUM)`); the identity in a world of one. Its gradient
    /// is the same sum of the cotangent. Every rank must run the same collectives in the same
    /// order: the executor calls them in schedule order, on the operand's values as f32.
    AllReduce,
    // ---- side effects
    /// `param := value` when the graph finishes; operands `(param, value)`.
    Assign,
    /// `param := param + value` when the graph finishes; operands `(param, value)`.
    AssignAdd,
    // ---- formed by the compiler
    /// Elementwise ops fused into one node by [`crate::passes::fuse`]: `expr` runs per output
    /// element over the operands (broadcast numpy-style). Formed after differentiation.
    Fused {
        expr: Program,
    },
    /// An op with elementwise ops fused onto its output, by [`crate::passes::epilogue`]: `head`
    /// runs on the first operands (as many as it takes), then `expr` per output element, `$0`
    /// reading the head's result and `$1, $2, ...` the operands after the head's. The result
    /// keeps the head's type. Kernels apply the program to each part of the output as the
    /// head finishes it, while it is still in cache. Formed after differentiation.
    Epilogue {
        head: Box<Op>,
        expr: Program,
    },
}

/// A printed attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    Str(String),
    /// A bare word: enum values (`valid`, `mean`) and dtypes (`f32`).
    Sym(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(v) => write!(f, "{v}"),
            Attr::Float(v) => write!(f, "{v:?}"),
            Attr::Bool(v) => write!(f, "{v}"),
            Attr::Ints(v) => {
                f.write_str("[")?;
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("]")
            }
            Attr::Str(s) => write!(f, "{s:?}"),
            Attr::Sym(s) => f.write_str(s),
        }
    }
}

/// How many operands an op takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    Exactly(usize),
    AtLeast(usize),
}

impl Arity {
    /// True when `n` operands are acceptable.
    pub fn accepts(self, n: usize) -> bool {
        match self {
            Arity::Exactly(k) => n == k,
            Arity::AtLeast(k) => n >= k,
        }
    }
    /// The fewest operands accepted.
    pub fn min(self) -> usize {
        match self {
            Arity::Exactly(k) | Arity::AtLeast(k) => k,
        }
    }
}

impl fmt::Display for Arity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arity::Exactly(k) => write!(f, "{k}"),
            Arity::AtLeast(k) => write!(f, "at least {k}"),
        }
    }
}

fn pad_mode_name(m: PadMode) -> &'static str {
    match m {
        PadMode::Valid => "valid",
        PadMode::Same => "same",
        PadMode::Pad => "pad",
    }
}

fn reduction_name(r: Reduction) -> &'static str {
    match r {
        Reduction::None => "none",
        Reduction::Sum => "sum",
        Reduction::Mean => "mean",
    }
}

fn ints(v: &[usize]) -> Attr {
    Attr::Ints(v.iter().map(|&x| x as i64).collect())
}

impl Op {
    /// The op's name in the text format.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Parameter { .. } => "parameter",
            Op::Input { .. } => "input",
            Op::Constant { .. } => "constant",
            Op::Add => "add",
            Op::Sub => "sub",
            Op::Mul => "mul",
            Op::Div => "div",
            Op::Neg => "neg",
            Op::Exp => "exp",
            Op::Log => "log",
            Op::Relu => "relu",
            Op::ReluGrad => "relu_grad",
            Op::Sqrt => "sqrt",
            Op::GreaterEqual => "greater_equal",
            Op::Equal => "equal",
            Op::Tanh => "tanh",
            Op::Erf => "erf",
            Op::Gather => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::CausalMask { .. } => "causal_mask",
            Op::Attention { .. } => "attention",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::StopGradient => "stop_gradient",
            Op::Dropout { .. } => "dropout",
            Op::RoundTo { .. } => "round_to",
            Op::Select => "select",
            Op::Cast { .. } => "cast",
            Op::ZerosLike => "zeros_like",
            Op::Broadcast { .. } => "broadcast",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::Pad { .. } => "pad",
            Op::Concat { .. } => "concat",
            Op::Flatten => "flatten",
            Op::ReduceSum(_) => "reduce_sum",
            Op::ReduceMean(_) => "reduce_mean",
            Op::ReduceMax(_) => "reduce_max",
            Op::ReduceMaxGrad(_) => "reduce_max_grad",
            Op::MatMul { .. } => "matmul",
            Op::SoftmaxCrossEntropy { .. } => "softmax_cross_entropy",
            Op::SoftmaxCrossEntropyGrad { .. } => "softmax_cross_entropy_grad",
            Op::Conv2d(_) => "conv2d",
            Op::Conv2dBackpropInput { .. } => "conv2d_backprop_input",
            Op::Conv2dBackpropFilter { .. } => "conv2d_backprop_filter",
            Op::MaxPool2d(_) => "max_pool2d",
            Op::MaxPool2dGrad(_) => "max_pool2d_grad",
            Op::AvgPool2d(_) => "avg_pool2d",
            Op::AvgPool2dGrad(_) => "avg_pool2d_grad",
            Op::Assign => "assign",
            Op::AssignAdd => "assign_add",
            Op::AllReduce => "all_reduce",
            Op::Fused { .. } => "fused",
            Op::Epilogue { .. } => "epilogue",
        }
    }

    /// The name profiles and error messages give a node: [`Self::name`], or for an epilogue
    /// its head's name and `+epilogue`.
    pub fn label(&self) -> &'static str {
        match self {
            Op::Epilogue { head, .. } => match **head {
                Op::MatMul { .. } => "matmul+epilogue",
                Op::Conv2d(_) => "conv2d+epilogue",
                Op::MaxPool2dGrad(_) => "max_pool2d_grad+epilogue",
                Op::Conv2dBackpropFilter { .. } => "conv2d_backprop_filter+epilogue",
                Op::ReduceSum(_) => "reduce_sum+epilogue",
                _ => "epilogue",
            },
            op => op.name(),
        }
    }

    /// Number of operands the op takes.
    pub fn arity(&self) -> Arity {
        use Arity::Exactly;
        match self {
            Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => Exactly(0),
            Op::Neg | Op::Exp | Op::Log | Op::Relu | Op::Sqrt | Op::Cast { .. } | Op::ZerosLike => Exactly(1),
            Op::AllReduce | Op::Tanh | Op::Erf | Op::CausalMask { .. } | Op::StopGradient | Op::RoundTo { .. } => Exactly(1),
            Op::Equal | Op::Gather | Op::ScatterAdd { .. } => Exactly(2),
            Op::Attention { .. } => Exactly(1),
            Op::AttentionGrad { .. } => Exactly(2),
            Op::Broadcast { .. } | Op::Reshape { .. } | Op::Transpose { .. } => Exactly(1),
            Op::Slice { .. } | Op::Pad { .. } | Op::Flatten => Exactly(1),
            Op::ReduceSum(_) | Op::ReduceMean(_) | Op::ReduceMax(_) => Exactly(1),
            Op::MaxPool2d(_) | Op::AvgPool2d(_) => Exactly(1),
            Op::Add | Op::Sub | Op::Mul | Op::Div | Op::ReluGrad | Op::MatMul { .. } => Exactly(2),
            Op::GreaterEqual => Exactly(2),
            Op::Select | Op::Dropout { .. } => Exactly(3),
            Op::SoftmaxCrossEntropy { .. } | Op::Conv2d(_) => Exactly(2),
            Op::Conv2dBackpropInput { .. } | Op::Conv2dBackpropFilter { .. } => Exactly(2),
            Op::MaxPool2dGrad(_) | Op::AvgPool2dGrad(_) | Op::Assign | Op::AssignAdd => Exactly(2),
            Op::ReduceMaxGrad(_) | Op::SoftmaxCrossEntropyGrad { .. } => Exactly(3),
            Op::Concat { .. } | Op::Fused { .. } => Arity::AtLeast(1),
            Op::Epilogue { head, .. } => Arity::AtLeast(head.arity().min()),
        }
    }

    /// True for the ops an [`Op::Epilogue`] may have as its head: ops of a fixed arity whose
    /// host kernels hand their output over in parts (matrix products, convolutions, max
    /// pooling's gradient), or produce a weight's gradient (a convolution's filter gradient,
    /// and sums that drop their axes: a bias's gradient over the batch, a batch norm's or
    /// layer norm's scale and shift gradients over the other axes), whose epilogues add them
    /// into their accumulators.
    pub fn takes_epilogue(&self) -> bool {
        match self {
            Op::MatMul { .. } | Op::Conv2d(_) | Op::MaxPool2dGrad(_) | Op::Conv2dBackpropFilter { .. } => true,
            Op::ReduceSum(r) => !r.keep_dims,
            _ => false,
        }
    }

    /// True for ops without operands whose type is given, not inferred.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. })
    }

    /// True for ops that write a parameter when the graph finishes.
    pub fn is_effect(&self) -> bool {
        matches!(self, Op::Assign | Op::AssignAdd)
    }

    /// The attributes, sorted by name, as printed by the text format.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut v: Vec<(&'static str, Attr)> = match self {
            Op::Parameter { name } => vec![("name", Attr::Str(name.clone()))],
            Op::Input { index, name } => {
                vec![("index", Attr::Int(*index as i64)), ("name", Attr::Str(name.clone()))]
            }
            Op::Constant { value } => vec![("value", Attr::Float(*value))],
            Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Neg | Op::Exp | Op::Log => vec![],
            Op::Relu | Op::ReluGrad | Op::ZerosLike | Op::Flatten | Op::Assign | Op::AssignAdd => vec![],
            Op::Sqrt | Op::GreaterEqual | Op::Select | Op::AllReduce => vec![],
            Op::Equal | Op::Tanh | Op::Erf | Op::Gather | Op::StopGradient => vec![],
            Op::ScatterAdd { rows } => vec![("rows", Attr::Int(*rows as i64))],
            Op::CausalMask { fill } => vec![("fill", Attr::Float(*fill))],
            Op::Attention { heads, causal } | Op::AttentionGrad { heads, causal } => {
                vec![("causal", Attr::Bool(*causal)), ("heads", Attr::Int(*heads as i64))]
            }
            Op::Dropout { p, seed } => vec![("p", Attr::Float(*p)), ("seed", Attr::Int(*seed as i64))],
            Op::Cast { dtype } | Op::RoundTo { dtype } => vec![("dtype", Attr::Sym(dtype.name().into()))],
            Op::Broadcast { shape } | Op::Reshape { shape } => vec![("shape", ints(&shape.0))],
            Op::Transpose { perm } => vec![("perm", ints(perm))],
            Op::Slice { begin, end } => vec![("begin", ints(begin)), ("end", ints(end))],
            Op::Pad { lo, hi } => vec![("hi", ints(hi)), ("lo", ints(lo))],
            Op::Concat { axis } => vec![("axis", Attr::Int(*axis as i64))],
            Op::Fused { expr } => vec![("expr", Attr::Str(expr.to_string()))],
            Op::Epilogue { head, expr } => {
                let mut v = head.attrs();
                v.push(("expr", Attr::Str(expr.to_string())));
                v.push(("head", Attr::Sym(head.name().into())));
                v
            }
            Op::ReduceSum(r) | Op::ReduceMean(r) | Op::ReduceMax(r) | Op::ReduceMaxGrad(r) => {
                vec![("axes", ints(&r.axes)), ("keep_dims", Attr::Bool(r.keep_dims))]
            }
            Op::MatMul { transpose_a, transpose_b } => vec![("transpose_a", Attr::Bool(*transpose_a)), ("transpose_b", Attr::Bool(*transpose_b))],
            Op::SoftmaxCrossEntropy { sparse, reduction } | Op::SoftmaxCrossEntropyGrad { sparse, reduction } => {
                vec![("reduction", Attr::Sym(reduction_name(*reduction).into())), ("sparse", Attr::Bool(*sparse))]
            }
            Op::Conv2d(c) => conv_attrs(c),
            Op::Conv2dBackpropInput { conv, input_shape } => {
                let mut v = conv_attrs(conv);
                v.push(("input_shape", ints(&input_shape.0)));
                v
            }
            Op::Conv2dBackpropFilter { conv, filter_shape } => {
                let mut v = conv_attrs(conv);
                v.push(("filter_shape", ints(&filter_shape.0)));
                v
            }
            Op::MaxPool2d(p) | Op::MaxPool2dGrad(p) | Op::AvgPool2d(p) | Op::AvgPool2dGrad(p) => vec![
                ("kernel", ints(&p.kernel)),
                ("pad", ints(&p.pad)),
                ("pad_mode", Attr::Sym(pad_mode_name(p.pad_mode).into())),
                ("stride", ints(&p.stride)),
            ],
        };
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Rebuilds an op from its printed name and attributes (the inverse of `name`/`attrs`).
    /// Every attribute must be used exactly once.
    pub fn from_parts(name: &str, attrs: BTreeMap<String, Attr>) -> Result<Op, String> {
        let mut a = AttrReader { attrs };
        let op = match name {
            "parameter" => Op::Parameter { name: a.str("name")? },
            "input" => Op::Input { index: a.usize("index")?, name: a.str("name")? },
            "constant" => Op::Constant { value: a.float("value")? },
            "add" => Op::Add,
            "sub" => Op::Sub,
            "mul" => Op::Mul,
            "div" => Op::Div,
            "neg" => Op::Neg,
            "exp" => Op::Exp,
            "log" => Op::Log,
            "relu" => Op::Relu,
            "relu_grad" => Op::ReluGrad,
            "sqrt" => Op::Sqrt,
            "greater_equal" => Op::GreaterEqual,
            "equal" => Op::Equal,
            "tanh" => Op::Tanh,
            "erf" => Op::Erf,
            "gather" => Op::Gather,
            "scatter_add" => Op::ScatterAdd { rows: a.usize("rows")? },
            "causal_mask" => Op::CausalMask { fill: a.float("fill")? },
            "attention" => Op::Attention { heads: a.usize("heads")?, causal: a.bool("causal")? },
            "attention_grad" => Op::AttentionGrad { heads: a.usize("heads")?, causal: a.bool("causal")? },
            "stop_gradient" => Op::StopGradient,
            "dropout" => Op::Dropout { p: a.float("p")?, seed: a.usize("seed")? as u64 },
            "select" => Op::Select,
            "cast" => {
                let s = a.sym("dtype")?;
                Op::Cast { dtype: DType::from_name(&s).ok_or(format!("unknown dtype `{s}`"))? }
            }
            "round_to" => {
                let s = a.sym("dtype")?;
                Op::RoundTo { dtype: DType::from_name(&s).ok_or(format!("unknown dtype `{s}`"))? }
            }
            "zeros_like" => Op::ZerosLike,
            "broadcast" => Op::Broadcast { shape: Shape(a.usizes("shape")?) },
            "reshape" => Op::Reshape { shape: Shape(a.usizes("shape")?) },
            "transpose" => Op::Transpose { perm: a.usizes("perm")? },
            "slice" => Op::Slice { begin: a.usizes("begin")?, end: a.usizes("end")? },
            "pad" => Op::Pad { lo: a.usizes("lo")?, hi: a.usizes("hi")? },
            "concat" => Op::Concat { axis: a.usize("axis")? },
            "flatten" => Op::Flatten,
            "reduce_sum" => Op::ReduceSum(a.reduce()?),
            "reduce_mean" => Op::ReduceMean(a.reduce()?),
            "reduce_max" => Op::ReduceMax(a.reduce()?),
            "reduce_max_grad" => Op::ReduceMaxGrad(a.reduce()?),
            "matmul" => Op::MatMul { transpose_a: a.bool("transpose_a")?, transpose_b: a.bool("transpose_b")? },
            "softmax_cross_entropy" => Op::SoftmaxCrossEntropy { sparse: a.bool("sparse")?, reduction: a.reduction()? },
            "softmax_cross_entropy_grad" => Op::SoftmaxCrossEntropyGrad { sparse: a.bool("sparse")?, reduction: a.reduction()? },
            "conv2d" => Op::Conv2d(a.conv()?),
            "conv2d_backprop_input" => Op::Conv2dBackpropInput { conv: a.conv()?, input_shape: Shape(a.usizes("input_shape")?) },
            "conv2d_backprop_filter" => Op::Conv2dBackpropFilter { conv: a.conv()?, filter_shape: Shape(a.usizes("filter_shape")?) },
            "max_pool2d" => Op::MaxPool2d(a.pool()?),
            "max_pool2d_grad" => Op::MaxPool2dGrad(a.pool()?),
            "avg_pool2d" => Op::AvgPool2d(a.pool()?),
            "avg_pool2d_grad" => Op::AvgPool2dGrad(a.pool()?),
            "assign" => Op::Assign,
            "assign_add" => Op::AssignAdd,
            "all_reduce" => Op::AllReduce,
            "fused" => Op::Fused { expr: a.str("expr")?.parse().map_err(|e| format!("attribute `expr`: {e}"))? },
            "epilogue" => {
                let expr = a.str("expr")?.parse().map_err(|e| format!("attribute `expr`: {e}"))?;
                let name = a.sym("head")?;
                let head = Op::from_parts(&name, std::mem::take(&mut a.attrs)).map_err(|e| format!("head `{name}`: {e}"))?;
                if !head.takes_epilogue() {
                    return Err(format!("`{name}` cannot head an epilogue (matmul, conv2d and max_pool2d_grad can)"));
                }
                Op::Epilogue { head: Box::new(head), expr }
            }
            other => return Err(format!("unknown op `{other}`")),
        };
        match a.attrs.keys().next() {
            Some(k) => Err(format!("op `{name}` has no attribute `{k}`")),
            None => Ok(op),
        }
    }
}

fn conv_attrs(c: &Conv2dAttrs) -> Vec<(&'static str, Attr)> {
    vec![
        ("dilation", ints(&c.dilation)),
        ("groups", Attr::Int(c.groups as i64)),
        ("pad", ints(&c.pad)),
        ("pad_mode", Attr::Sym(pad_mode_name(c.pad_mode).into())),
        ("stride", ints(&c.stride)),
    ]
}

/// Takes attributes out of a parsed map, one typed read each.
struct AttrReader {
    attrs: BTreeMap<String, Attr>,
}

impl AttrReader {
    fn take(&mut self, k: &str) -> Result<Attr, String> {
        self.attrs.remove(k).ok_or_else(|| format!("missing attribute `{k}`"))
    }
    fn str(&mut self, k: &str) -> Result<String, String> {
        match self.take(k)? {
            Attr::Str(s) => Ok(s),
            other => Err(format!("attribute `{k}` must be a string, got `{other}`")),
        }
    }
    fn sym(&mut self, k: &str) -> Result<String, String> {
        match self.take(k)? {
            Attr::Sym(s) => Ok(s),
            other => Err(format!("attribute `{k}` must be a word, got `{other}`")),
        }
    }
    fn bool(&mut self, k: &str) -> Result<bool, String> {
        match self.take(k)? {
            Attr::Bool(b) => Ok(b),
            other => Err(format!("attribute `{k}` must be true or false, got `{other}`")),
        }
    }
    fn float(&mut self, k: &str) -> Result<f64, String> {
        match self.take(k)? {
            Attr::Float(v) => Ok(v),
            Attr::Int(v) => Ok(v as f64),
            other => Err(format!("attribute `{k}` must be a number, got `{other}`")),
        }
    }
    fn usize(&mut self, k: &str) -> Result<usize, String> {
        match self.take(k)? {
            Attr::Int(v) if v >= 0 => Ok(v as usize),
            other => Err(format!("attribute `{k}` must be a non-negative integer, got `{other}`")),
        }
    }
    fn usizes(&mut self, k: &str) -> Result<Vec<usize>, String> {
        match self.take(k)? {
            Attr::Ints(v) if v.iter().all(|&x| x >= 0) => Ok(v.into_iter().map(|x| x as usize).collect()),
            other => Err(format!("attribute `{k}` must be a list of non-negative integers, got `{other}`")),
        }
    }
    fn array<const N: usize>(&mut self, k: &str) -> Result<[usize; N], String> {
        let v = self.usizes(k)?;
        v.try_into().map_err(|v: Vec<usize>| format!("attribute `{k}` needs {N} values, got {}", v.len()))
    }
    fn pad_mode(&mut self) -> Result<PadMode, String> {
        match self.sym("pad_mode")?.as_str() {
            "valid" => Ok(PadMode::Valid),
            "same" => Ok(PadMode::Same),
            "pad" => Ok(PadMode::Pad),
            s => Err(format!("pad_mode must be valid, same or pad, got `{s}`")),
        }
    }
    fn reduction(&mut self) -> Result<Reduction, String> {
        match self.sym("reduction")?.as_str() {
            "none" => Ok(Reduction::None),
            "sum" => Ok(Reduction::Sum),
            "mean" => Ok(Reduction::Mean),
            s => Err(format!("reduction must be none, sum or mean, got `{s}`")),
        }
    }
    fn reduce(&mut self) -> Result<ReduceAttrs, String> {
        Ok(ReduceAttrs { axes: self.usizes("axes")?, keep_dims: self.bool("keep_dims")? })
    }
    fn conv(&mut self) -> Result<Conv2dAttrs, String> {
        Ok(Conv2dAttrs {
            stride: self.array("stride")?,
            pad_mode: self.pad_mode()?,
            pad: self.array("pad")?,
            dilation: self.array("dilation")?,
            groups: self.usize("groups")?,
        })
    }
    fn pool(&mut self) -> Result<Pool2dAttrs, String> {
        Ok(Pool2dAttrs { kernel: self.array("kernel")?, stride: self.array("stride")?, pad_mode: self.pad_mode()?, pad: self.array("pad")? })
    }
}

impl Op {
    /// One instance of every op, for table-driven tests (print/parse, gradient coverage).
    /// [`Op::variant_index`] is exhaustive, and a test checks this list covers every index.
    pub fn examples() -> Vec<Op> {
        let conv = Conv2dAttrs { stride: [2, 1], pad_mode: PadMode::Pad, pad: [1, 0, 2, 1], dilation: [1, 2], groups: 1 };
        let pool = Pool2dAttrs { kernel: [2, 3], stride: [2, 2], pad_mode: PadMode::Same, pad: [0; 4] };
        let pool_e = pool.clone();
        let r = ReduceAttrs { axes: vec![0, 2], keep_dims: true };
        vec![
            Op::Parameter { name: "fc1.weight".into() },
            Op::Input { index: 1, name: "label".into() },
            Op::Constant { value: -0.125 },
            Op::Add,
            Op::Sub,
            Op::Mul,
            Op::Div,
            Op::Neg,
            Op::Exp,
            Op::Log,
            Op::Relu,
            Op::ReluGrad,
            Op::Cast { dtype: DType::BF16 },
            Op::ZerosLike,
            Op::Broadcast { shape: Shape(vec![2, 3]) },
            Op::Reshape { shape: Shape(vec![6]) },
            Op::Transpose { perm: vec![1, 0] },
            Op::Slice { begin: vec![0, 1], end: vec![2, 3] },
            Op::Pad { lo: vec![1, 0], hi: vec![0, 2] },
            Op::Concat { axis: 1 },
            Op::Flatten,
            Op::ReduceSum(r.clone()),
            Op::ReduceMean(r.clone()),
            Op::ReduceMax(r.clone()),
            Op::ReduceMaxGrad(r),
            Op::MatMul { transpose_a: false, transpose_b: true },
            Op::SoftmaxCrossEntropy { sparse: true, reduction: Reduction::Mean },
            Op::SoftmaxCrossEntropyGrad { sparse: false, reduction: Reduction::None },
            Op::Conv2d(conv.clone()),
            Op::Conv2dBackpropInput { conv: conv.clone(), input_shape: Shape(vec![1, 2, 5, 5]) },
            Op::Conv2dBackpropFilter { conv, filter_shape: Shape(vec![3, 2, 3, 3]) },
            Op::MaxPool2d(pool.clone()),
            Op::MaxPool2dGrad(pool.clone()),
            Op::AvgPool2d(pool.clone()),
            Op::AvgPool2dGrad(pool),
            Op::Assign,
            Op::AssignAdd,
            Op::Sqrt,
            Op::GreaterEqual,
            Op::Select,
            Op::Fused { expr: "$0 $1 add relu".parse().expect("a well-formed program") },
            Op::Epilogue { head: Box::new(Op::MaxPool2dGrad(pool_e)), expr: "$0 $1 relu_grad".parse().expect("a well-formed program") },
            Op::AllReduce,
            Op::Equal,
            Op::Tanh,
            Op::Erf,
            Op::Gather,
            Op::ScatterAdd { rows: 7 },
            Op::CausalMask { fill: -1e9 },
            Op::StopGradient,
            Op::Dropout { p: 0.25, seed: 7 },
            Op::RoundTo { dtype: DType::BF16 },
            Op::Attention { heads: 4, causal: true },
            Op::AttentionGrad { heads: 2, causal: false },
        ]
    }

    /// A dense index per variant (exhaustive: a new op must take the next index).
    pub fn variant_index(&self) -> usize {
        match self {
            Op::Parameter { .. } => 0,
            Op::Input { .. } => 1,
            Op::Constant { .. } => 2,
            Op::Add => 3,
            Op::Sub => 4,
            Op::Mul => 5,
            Op::Div => 6,
            Op::Neg => 7,
            Op::Exp => 8,
            Op::Log => 9,
            Op::Relu => 10,
            Op::ReluGrad => 11,
            Op::Cast { .. } => 12,
            Op::ZerosLike => 13,
            Op::Broadcast { .. } => 14,
            Op::Reshape { .. } => 15,
            Op::Transpose { .. } => 16,
            Op::Slice { .. } => 17,
            Op::Pad { .. } => 18,
            Op::Concat { .. } => 19,
            Op::Flatten => 20,
            Op::ReduceSum(_) => 21,
            Op::ReduceMean(_) => 22,
            Op::ReduceMax(_) => 23,
            Op::ReduceMaxGrad(_) => 24,
            Op::MatMul { .. } => 25,
            Op::SoftmaxCrossEntropy { .. } => 26,
            Op::SoftmaxCrossEntropyGrad { .. } => 27,
            Op::Conv2d(_) => 28,
            Op::Conv2dBackpropInput { .. } => 29,
            Op::Conv2dBackpropFilter { .. } => 30,
            Op::MaxPool2d(_) => 31,
            Op::MaxPool2dGrad(_) => 32,
            Op::AvgPool2d(_) => 33,
            Op::AvgPool2dGrad(_) => 34,
            Op::Assign => 35,
            Op::AssignAdd => 36,
            Op::Sqrt => 37,
            Op::GreaterEqual => 38,
            Op::Select => 39,
            Op::Fused { .. } => 40,
            Op::Epilogue { .. } => 41,
            Op::AllReduce => 42,
            Op::Equal => 43,
            Op::Tanh => 44,
            Op::Erf => 45,
            Op::Gather => 46,
            Op::ScatterAdd { .. } => 47,
            Op::CausalMask { .. } => 48,
            Op::StopGradient => 49,
            Op::Dropout { .. } => 50,
            Op::RoundTo { .. } => 51,
            Op::Attention { .. } => 52,
            Op::AttentionGrad { .. } => 53,
        }
    }

    /// Number of op variants.
    pub const COUNT: usize = 54;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_cover_every_variant_once() {
        let idx: Vec<usize> = Op::examples().iter().map(|o| o.variant_index()).collect();
        assert_eq!(idx, (0..Op::COUNT).collect::<Vec<_>>());
    }

    #[test]
    fn attrs_round_trip_through_the_table() {
        for op in Op::examples() {
            let attrs = op.attrs().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            assert_eq!(Op::from_parts(op.name(), attrs).unwrap(), op);
        }
    }

    #[test]
    fn unknown_and_extra_attributes_are_rejected() {
        assert!(Op::from_parts("frobnicate", BTreeMap::new()).unwrap_err().contains("unknown op"));
        let extra = BTreeMap::from([("axis".to_string(), Attr::Int(1))]);
        assert!(Op::from_parts("add", extra).unwrap_err().contains("has no attribute `axis`"));
        assert!(Op::from_parts("concat", BTreeMap::new()).unwrap_err().contains("missing attribute `axis`"));
        let head = |name: &str| BTreeMap::from([("head".to_string(), Attr::Sym(name.into())), ("expr".to_string(), Attr::Str("$0 relu".into()))]);
        assert!(Op::from_parts("epilogue", head("relu")).unwrap_err().contains("`relu` cannot head an epilogue"));
        assert!(Op::from_parts("epilogue", head("matmul")).unwrap_err().contains("head `matmul`: missing attribute"));
    }
}

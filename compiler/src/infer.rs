//! Shape and dtype inference: one exhaustive `match` over [`Op`].
//!
//! [`infer`] computes a node's output type from its op and its operands' types, or explains
//! in words why they do not fit. Leaves (parameter, input, constant) carry their type and
//! are not inferred. The graph builder wraps these messages with the Cell scope and op.

use crate::op::{Conv2dAttrs, Op, Pool2dAttrs, ReduceAttrs};
use crate::types::{DType, Shape, TensorType};
use crate::window;

/// Numpy-style broadcast of two shapes, or `None` when they are incompatible.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let x = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let y = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

fn same_dtype(ts: &[&TensorType]) -> Result<DType, String> {
    let d = ts[0].dtype;
    if ts.iter().any(|t| t.dtype != d) {
        let list: Vec<String> = ts.iter().map(|t| t.to_string()).collect();
        return Err(format!("operand dtypes differ: {}", list.join(", ")));
    }
    Ok(d)
}

fn float_operand(t: &TensorType) -> Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("needs a float operand, got {t}"))
    }
}

fn binary(a: &TensorType, b: &TensorType) -> Result<TensorType, String> {
    let dtype = same_dtype(&[a, b])?;
    let shape = broadcast_shapes(a.dims(), b.dims()).ok_or_else(|| format!("shapes {a} and {b} do not broadcast"))?;
    Ok(TensorType::new(dtype, shape))
}

fn reduce(x: &TensorType, r: &ReduceAttrs) -> Result<TensorType, String> {
    if r.axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("axes {:?} must be sorted and distinct", r.axes));
    }
    if let Some(&a) = r.axes.iter().find(|&&a| a >= x.rank()) {
        return Err(format!("axis {a} out of range for {x}"));
    }
    let mut dims = Vec::new();
    for (i, &d) in x.dims().iter().enumerate() {
        if !r.axes.contains(&i) {
            dims.push(d);
        } else if r.keep_dims {
            dims.push(1);
        }
    }
    Ok(x.with_shape(dims))
}

fn rank4(t: &TensorType, what: &str) -> Result<[usize; 4], String> {
    t.dims().try_into().map_err(|_| format!("{what} must be rank 4 (NCHW), got {t}"))
}

/// Output type of a convolution of `x` by `w`.
fn conv2d(x: &TensorType, w: &TensorType, c: &Conv2dAttrs) -> Result<TensorType, String> {
    same_dtype(&[x, w])?;
    float_operand(x)?;
    let [n, ci, h, wd] = rank4(x, "input")?;
    let [o, wc, kh, kw] = rank4(w, "weight")?;
    if c.groups == 0 || ci % c.groups != 0 || o % c.groups != 0 {
        return Err(format!("groups {} must divide input channels {ci} and output channels {o}", c.groups));
    }
    if wc * c.groups != ci {
        return Err(format!("input {x} has {ci} channels but weight {w} expects {} (= {wc} x groups {})", wc * c.groups, c.groups));
    }
    let win = window::resolve([h, wd], [kh, kw], c.stride, c.dilation, c.pad_mode, c.pad)?;
    Ok(x.with_shape([n, o, win.out[0], win.out[1]]))
}

fn pool2d(x: &TensorType, p: &Pool2dAttrs) -> Result<TensorType, String> {
    float_operand(x)?;
    let [n, c, h, w] = rank4(x, "input")?;
    let win = window::resolve([h, w], p.kernel, p.stride, [1, 1], p.pad_mode, p.pad)?;
    Ok(x.with_shape([n, c, win.out[0], win.out[1]]))
}

fn matmul(a: &TensorType, b: &TensorType, ta: bool, tb: bool) -> Result<TensorType, String> {
    let dtype = same_dtype(&[a, b])?;
    let r = a.rank();
    if r < 2 || b.rank() != r || a.dims()[..r - 2] != b.dims()[..r - 2] {
        return Err(format!("operands must be rank 2, or of one rank with equal leading (batch) axes, got {a} and {b}"));
    }
    let (batch, [ar, ac], [br, bc]) = (&a.dims()[..r - 2], [a.dims()[r - 2], a.dims()[r - 1]], [b.dims()[r - 2], b.dims()[r - 1]]);
    let (m, ka) = if ta { (ac, ar) } else { (ar, ac) };
    let (kb, n) = if tb { (bc, br) } else { (br, bc) };
    if ka != kb {
        return Err(format!("contracting dimensions differ: {a}{} has {ka}, {b}{} has {kb}", if ta { "^T" } else { "" }, if tb { "^T" } else { "" }));
    }
    Ok(TensorType::new(dtype, batch.iter().copied().chain([m, n]).collect::<Vec<_>>()))
}

fn softmax_ce(l: &TensorType, y: &TensorType, sparse: bool) -> Result<(usize, usize), String> {
    float_operand(l)?;
    let &[n, c] = l.dims() else {
        return Err(format!("logits must be [N, C], got {l}"));
    };
    if sparse {
        if !y.dtype.is_int() || y.dims() != [n] {
            return Err(format!("sparse labels must be an integer [{n}] tensor for logits {l}, got {y}"));
        }
    } else if y.dims() != l.dims() || y.dtype != l.dtype {
        return Err(format!("dense labels must match logits {l}, got {y}"));
    }
    Ok((n, c))
}

fn check_same(a: &TensorType, b: &TensorType, what: &str) -> Result<(), String> {
    if a == b {
        Ok(())
    } else {
        Err(format!("{what}: {a} and {b} must have the same type"))
    }
}

/// Infers the output type of `op` applied to operands of types `xs`.
///
/// The caller has checked the arity. Leaves return an error: their type is given.
pub fn infer(op: &Op, xs: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => Err("leaf ops carry their type; it is not inferred".into()),
        Op::Add | Op::Sub | Op::Mul | Op::Div => binary(xs[0], xs[1]),
        Op::GreaterEqual | Op::Equal => Ok(binary(xs[0], xs[1])?.with_dtype(DType::Bool)),
        Op::Select => {
            if xs[0].dtype != DType::Bool {
                return Err(format!("condition must be bool, got {}", xs[0]));
            }
            let ab = binary(xs[1], xs[2])?;
            let shape = broadcast_shapes(xs[0].dims(), ab.dims()).ok_or_else(|| format!("condition {} does not broadcast with {ab}", xs[0]))?;
            Ok(ab.with_shape(shape))
        }
        Op::Neg | Op::Exp | Op::Log | Op::Relu | Op::Sqrt | Op::AllReduce | Op::Tanh | Op::Erf => {
            float_operand(xs[0])?;
            Ok(xs[0].clone())
        }
        Op::RoundTo { dtype } => {
            if xs[0].dtype != DType::F32 || !matches!(dtype, DType::F16 | DType::BF16) {
                return Err(format!("round_to rounds f32 values to f16 or bf16, got {} to {}", xs[0], dtype.name()));
            }
            Ok(xs[0].clone())
        }
        Op::CausalMask { .. } => {
            float_operand(xs[0])?;
            if xs[0].rank() < 2 {
                return Err(format!("causal masking needs scores [..., T, S], got {}", xs[0]));
            }
            Ok(xs[0].clone())
        }
        Op::Attention { heads, .. } | Op::AttentionGrad { heads, .. } => {
            let qkv = xs[0];
            float_operand(qkv)?;
            let &[b, t, c3] = qkv.dims() else {
                return Err(format!("attention needs qkv [B, T, 3C], got {qkv}"));
            };
            if *heads == 0 || c3 % (3 * heads) != 0 {
                return Err(format!("attention needs qkv [B, T, 3C] with C a multiple of the {heads} heads, got {qkv}"));
            }
            if matches!(op, Op::AttentionGrad { .. }) {
                let want = qkv.with_shape(vec![b, t, c3 / 3]);
                check_same(xs[1], &want, "dy and the attention's output")?;
                return Ok(qkv.clone());
            }
            Ok(qkv.with_shape(vec![b, t, c3 / 3]))
        }
        Op::Dropout { p, .. } => {
            let (x, items, update) = (xs[0], xs[1], xs[2]);
            float_operand(x)?;
            if !(0.0..1.0).contains(p) {
                return Err(format!("dropout probability must be in [0, 1), got {p}"));
            }
            if x.rank() == 0 || !items.dtype.is_int() || items.dims() != [x.dims()[0]] || !update.dtype.is_int() || update.rank() != 0 {
                return Err(format!(
                    "dropout needs x [N, ...], integer item indices [N] and an integer update number [], got {x}, {items} and {update}"
                ));
            }
            Ok(x.clone())
        }
        Op::Gather => {
            let (table, ids) = (xs[0], xs[1]);
            if table.rank() == 0 || !ids.dtype.is_int() {
                return Err(format!("gather needs a table [V, ...] and integer ids, got {table} and {ids}"));
            }
            Ok(table.with_shape(ids.dims().iter().chain(&table.dims()[1..]).copied().collect::<Vec<_>>()))
        }
        Op::ScatterAdd { rows } => {
            let (ids, upd) = (xs[0], xs[1]);
            let k = ids.rank();
            if !ids.dtype.is_int() || upd.rank() < k || upd.dims()[..k] != *ids.dims() {
                return Err(format!("scatter_add needs integer ids and updates [...ids, ...], got {ids} and {upd}"));
            }
            float_operand(upd)?;
            Ok(upd.with_shape(std::iter::once(*rows).chain(upd.dims()[k..].iter().copied()).collect::<Vec<_>>()))
        }
        Op::ReluGrad => {
            check_same(xs[0], xs[1], "dy and y")?;
            Ok(xs[0].clone())
        }
        Op::Cast { dtype } => Ok(TensorType::new(*dtype, xs[0].shape.clone())),
        Op::ZerosLike | Op::StopGradient => Ok(xs[0].clone()),
        Op::Broadcast { shape } => match broadcast_shapes(xs[0].dims(), &shape.0) {
            Some(s) if s == shape.0 => Ok(xs[0].with_shape(s)),
            _ => Err(format!("{} does not broadcast to {shape}", xs[0])),
        },
        Op::Reshape { shape } => {
            if shape.numel() != xs[0].numel() {
                return Err(format!("cannot reshape {} ({} elements) to {shape}", xs[0], xs[0].numel()));
            }
            Ok(xs[0].with_shape(shape.clone()))
        }
        Op::Transpose { perm } => {
            let mut seen = perm.clone();
            seen.sort_unstable();
            if seen != (0..xs[0].rank()).collect::<Vec<_>>() {
                return Err(format!("perm {perm:?} is not a permutation of the axes of {}", xs[0]));
            }
            Ok(xs[0].with_shape(perm.iter().map(|&p| xs[0].dims()[p]).collect::<Vec<_>>()))
        }
        Op::Slice { begin, end } => {
            let d = xs[0].dims();
            if begin.len() != d.len() || end.len() != d.len() {
                return Err(format!("slice bounds {begin:?}..{end:?} need one entry per axis of {}", xs[0]));
            }
            if (0..d.len()).any(|i| begin[i] > end[i] || end[i] > d[i]) {
                return Err(format!("slice bounds {begin:?}..{end:?} out of range for {}", xs[0]));
            }
            Ok(xs[0].with_shape((0..d.len()).map(|i| end[i] - begin[i]).collect::<Vec<_>>()))
        }
        Op::Pad { lo, hi } => {
            let d = xs[0].dims();
            if lo.len() != d.len() || hi.len() != d.len() {
                return Err(format!("padding {lo:?}/{hi:?} needs one entry per axis of {}", xs[0]));
            }
            Ok(xs[0].with_shape((0..d.len()).map(|i| lo[i] + d[i] + hi[i]).collect::<Vec<_>>()))
        }
        Op::Concat { axis } => {
            let dtype = same_dtype(xs)?;
            let first = xs[0].dims();
            if *axis >= first.len() {
                return Err(format!("axis {axis} out of range for {}", xs[0]));
            }
            let mut out = first.to_vec();
            out[*axis] = 0;
            for x in xs {
                let ok = x.rank() == first.len() && (0..first.len()).all(|i| i == *axis || x.dims()[i] == first[i]);
                if !ok {
                    return Err(format!("{} and {x} differ outside axis {axis}", xs[0]));
                }
                out[*axis] += x.dims()[*axis];
            }
            Ok(TensorType::new(dtype, out))
        }
        Op::Flatten => match xs[0].dims() {
            [] => Err(format!("cannot flatten a scalar {}", xs[0])),
            [n, rest @ ..] => Ok(xs[0].with_shape([*n, rest.iter().product()])),
        },
        Op::ReduceSum(r) | Op::ReduceMean(r) | Op::ReduceMax(r) => reduce(xs[0], r),
        Op::ReduceMaxGrad(r) => {
            let y = reduce(xs[0], r)?;
            check_same(&y, xs[1], "reduced x and y")?;
            check_same(xs[1], xs[2], "y and dy")?;
            Ok(xs[0].clone())
        }
        Op::MatMul { transpose_a, transpose_b } => matmul(xs[0], xs[1], *transpose_a, *transpose_b),
        Op::SoftmaxCrossEntropy { sparse, reduction } => {
            let (n, _) = softmax_ce(xs[0], xs[1], *sparse)?;
            Ok(match reduction {
                crate::op::Reduction::None => xs[0].with_shape([n]),
                _ => xs[0].with_shape(Shape::scalar()),
            })
        }
        Op::SoftmaxCrossEntropyGrad { sparse, reduction } => {
            let (n, _) = softmax_ce(xs[0], xs[1], *sparse)?;
            let dl = match reduction {
                crate::op::Reduction::None => xs[0].with_shape([n]),
                _ => xs[0].with_shape(Shape::scalar()),
            };
            check_same(&dl, xs[2], "loss gradient")?;
            Ok(xs[0].clone())
        }
        Op::Conv2d(c) => conv2d(xs[0], xs[1], c),
        Op::Conv2dBackpropInput { conv, input_shape } => {
            let x = xs[0].with_shape(input_shape.clone());
            let y = conv2d(&x, xs[1], conv)?;
            check_same(&y, xs[0], "dy and the convolution output")?;
            Ok(x)
        }
        Op::Conv2dBackpropFilter { conv, filter_shape } => {
            let w = xs[1].with_shape(filter_shape.clone());
            let y = conv2d(xs[1], &w, conv)?;
            check_same(&y, xs[0], "dy and the convolution output")?;
            Ok(w)
        }
        Op::MaxPool2d(p) | Op::AvgPool2d(p) => pool2d(xs[0], p),
        Op::MaxPool2dGrad(p) | Op::AvgPool2dGrad(p) => {
            let y = pool2d(xs[0], p)?;
            check_same(&y, xs[1], "dy and the pooling output")?;
            Ok(xs[0].clone())
        }
        Op::Assign | Op::AssignAdd => {
            check_same(xs[0], xs[1], "parameter and value")?;
            Ok(xs[0].clone())
        }
        Op::Fused { expr } => expr.infer(xs),
        Op::Epilogue { head, expr } => {
            if !head.takes_epilogue() {
                return Err(format!("`{}` cannot head an epilogue", head.name()));
            }
            let (hs, rest) = xs.split_at(head.arity().min().min(xs.len()));
            let y = infer(head, hs).map_err(|e| format!("head `{}`: {e}", head.name()))?;
            let ys: Vec<&TensorType> = std::iter::once(&y).chain(rest.iter().copied()).collect();
            let t = expr.infer(&ys)?;
            if t != y {
                return Err(format!("the epilogue gives {t}, not its head's {y}"));
            }
            Ok(t)
        }
    }
}

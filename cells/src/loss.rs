//! Loss cells (MindSpore's `nn.SoftmaxCrossEntropyWithLogits`, `nn.CrossEntropyLoss`,
//! `nn.MSELoss`) and the `WithLossCell` wrapper. Each takes `(logits, labels)`.

use cellgraph_compiler::{NodeId, Op, ReduceAttrs, Reduction, Shape};

use crate::cell::{expect_inputs, Cell, Tracer};
use crate::error::Result;
use crate::param::Parameter;

/// Softmax cross-entropy on logits `[N, C]`; `sparse` labels are class ids `[N]` (int),
/// dense labels are probabilities `[N, C]`. MindSpore defaults: `sparse=false`, `reduction=none`.
#[derive(Clone, Debug)]
pub struct SoftmaxCrossEntropyWithLogits {
    pub sparse: bool,
    pub reduction: Reduction,
}

impl SoftmaxCrossEntropyWithLogits {
    /// The loss with the given label kind and reduction.
    pub fn new(sparse: bool, reduction: Reduction) -> Self {
        SoftmaxCrossEntropyWithLogits { sparse, reduction }
    }
}

impl Cell for SoftmaxCrossEntropyWithLogits {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 2)?;
        t.op(Op::SoftmaxCrossEntropy { sparse: self.sparse, reduction: self.reduction }, xs)
    }
    fn kind(&self) -> &'static str {
        "SoftmaxCrossEntropyWithLogits"
    }
}

/// Cross-entropy of logits and labels (MindSpore's `nn.CrossEntropyLoss`, reduction `mean` by
/// default): integer labels are class ids, float labels are class probabilities.
///
/// With class ids, [`Self::ignore_index`] names a label whose items the loss skips (PyTorch's
/// and MindSpore's `ignore_index`, padding in language models): `mean` is then the sum over
/// the other items divided by their number, `none` gives 0 at ignored items. Unlike MindSpore
/// and PyTorch, nothing is ignored by default: a label outside `0..C` is an error, not a
/// silently skipped item. [`Self::tokens`] makes the loss the sum over the counted items and
/// reports their number, for `Normalization::Tokens`. Logits `[..., C]` with labels `[...]`
/// are flattened to `[N, C]` and `[N]`.
#[derive(Clone, Debug)]
pub struct CrossEntropyLoss {
    pub reduction: Reduction,
    pub ignore_index: Option<i64>,
    /// Sum over the non-ignored items and report their count ([`Tracer::set_count`]).
    pub tokens: bool,
}

impl CrossEntropyLoss {
    /// Mean reduction, as MindSpore's default.
    pub fn new() -> Self {
        CrossEntropyLoss { reduction: Reduction::Mean, ignore_index: None, tokens: false }
    }
    /// Sets the reduction.
    pub fn reduction(mut self, r: Reduction) -> Self {
        self.reduction = r;
        self
    }
    /// Items labelled `index` do not count (PyTorch's default is -100).
    pub fn ignore_index(mut self, index: i64) -> Self {
        self.ignore_index = Some(index);
        self
    }
    /// The sum over the counted items, their count reported for token-weighted normalisation.
    pub fn tokens(mut self) -> Self {
        self.tokens = true;
        self.reduction = Reduction::Sum;
        self
    }
}

impl Default for CrossEntropyLoss {
    fn default() -> Self {
        Self::new()
    }
}

impl Cell for CrossEntropyLoss {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 2)?;
        let (mut logits, mut labels) = (xs[0], xs[1]);
        let sparse = t.ty(labels).dtype.is_int();
        let lt = t.ty(logits).clone();
        if sparse && lt.rank() > 2 {
            let c = lt.dims()[lt.rank() - 1];
            logits = t.op(Op::Reshape { shape: vec![lt.numel() / c.max(1), c].into() }, &[logits])?;
            labels = t.op(Op::Reshape { shape: vec![t.ty(labels).numel()].into() }, &[labels])?;
        }
        let counted = self.tokens || self.ignore_index.is_some();
        if !(sparse && counted) {
            if counted {
                return Err(crate::error::CellError::Config {
                    cell: "CrossEntropyLoss".into(),
                    detail: "ignore_index and tokens() need integer class-id labels".into(),
                });
            }
            return t.op(Op::SoftmaxCrossEntropy { sparse, reduction: self.reduction }, &[logits, labels]);
        }
        let n = t.ty(labels).numel();
        let int_scalar = t.ty(labels).with_shape(Shape::scalar());
        let f_scalar = t.ty(logits).with_shape(Shape::scalar());
        // Ignored items read class 0 (any valid id) and their losses are zeroed.
        let (ignored, safe) = match self.ignore_index {
            Some(ig) => {
                let ig = t.constant(ig as f64, int_scalar.clone())?;
                let ignored = t.op(Op::Equal, &[labels, ig])?;
                let zero = t.constant(0.0, int_scalar)?;
                (Some(ignored), t.op(Op::Select, &[ignored, zero, labels])?)
            }
            None => (None, labels),
        };
        let per_item = t.op(Op::SoftmaxCrossEntropy { sparse: true, reduction: Reduction::None }, &[logits, safe])?;
        let all = ReduceAttrs { axes: vec![0], keep_dims: false };
        let (per_item, count) = match ignored {
            Some(ignored) => {
                let zero = t.constant(0.0, f_scalar.clone())?;
                let kept = t.op(Op::Select, &[ignored, zero, per_item])?;
                let skipped = t.op(Op::Cast { dtype: f_scalar.dtype }, &[ignored])?;
                let skipped = t.op(Op::ReduceSum(all.clone()), &[skipped])?;
                let total = t.constant(n as f64, f_scalar)?;
                (kept, t.op(Op::Sub, &[total, skipped])?)
            }
            None => (per_item, t.constant(n as f64, f_scalar)?),
        };
        if self.tokens {
            t.set_count(count);
        }
        match self.reduction {
            Reduction::None => Ok(per_item),
            Reduction::Sum => t.op(Op::ReduceSum(all), &[per_item]),
            Reduction::Mean => {
                let sum = t.op(Op::ReduceSum(all), &[per_item])?;
                t.op(Op::Div, &[sum, count])
            }
        }
    }
    fn kind(&self) -> &'static str {
        "CrossEntropyLoss"
    }
}

/// Squared error `(x - y)^2`, reduced (MindSpore's `nn.MSELoss`, `mean` by default).
#[derive(Clone, Debug)]
pub struct MSELoss {
    pub reduction: Reduction,
}

impl MSELoss {
    /// Mean reduction, as MindSpore's default.
    pub fn new() -> Self {
        MSELoss { reduction: Reduction::Mean }
    }
}

impl Default for MSELoss {
    fn default() -> Self {
        Self::new()
    }
}

impl Cell for MSELoss {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 2)?;
        let d = t.op(Op::Sub, xs)?;
        let sq = t.op(Op::Mul, &[d, d])?;
        let all = ReduceAttrs { axes: (0..t.ty(sq).rank()).collect(), keep_dims: false };
        match self.reduction {
            Reduction::None => Ok(sq),
            Reduction::Sum => t.op(Op::ReduceSum(all), &[sq]),
            Reduction::Mean => t.op(Op::ReduceMean(all), &[sq]),
        }
    }
    fn kind(&self) -> &'static str {
        "MSELoss"
    }
}

/// `loss_fn(backbone(data), label)` (MindSpore's `nn.WithLossCell`); parameter names are
/// the backbone's, unchanged.
pub struct WithLossCell {
    pub backbone: Box<dyn Cell>,
    pub loss_fn: Box<dyn Cell>,
}

impl WithLossCell {
    /// Wraps a network and a loss.
    pub fn new(backbone: impl Cell + 'static, loss_fn: impl Cell + 'static) -> Self {
        WithLossCell { backbone: Box::new(backbone), loss_fn: Box::new(loss_fn) }
    }
}

impl Cell for WithLossCell {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 2)?;
        let y = t.call(self.backbone.as_ref(), &xs[..1])?;
        t.call_in("loss_fn", self.loss_fn.as_ref(), &[y, xs[1]])
    }
    fn parameters(&self) -> Vec<Parameter> {
        self.backbone.parameters()
    }
    fn kind(&self) -> &'static str {
        "WithLossCell"
    }
    fn backbone(&self) -> Option<&dyn Cell> {
        Some(self.backbone.as_ref())
    }
    fn set_train(&mut self, train: bool) {
        self.backbone.set_train(train);
    }
}

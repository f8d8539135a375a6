//! Loss cells (MindSpore's `nn.SoftmaxCrossEntropyWithLogits`, `nn.CrossEntropyLoss`,
//! `nn.MSELoss`) and the `WithLossCell` wrapper. Each takes `(logits, labels)`.

use cellgraph_compiler::{NodeId, Op, ReduceAttrs, Reduction};

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
#[derive(Clone, Debug)]
pub struct CrossEntropyLoss {
    pub reduction: Reduction,
}

impl CrossEntropyLoss {
    /// Mean reduction, as MindSpore's default.
    pub fn new() -> Self {
        CrossEntropyLoss { reduction: Reduction::Mean }
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
        let sparse = t.ty(xs[1]).dtype.is_int();
        t.op(Op::SoftmaxCrossEntropy { sparse, reduction: self.reduction }, xs)
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

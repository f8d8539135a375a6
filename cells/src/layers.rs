//! Layers with MindSpore's names, shapes and default initializers.

use cellgraph_compiler::{Conv2dAttrs, NodeId, Op, PadMode, Pool2dAttrs, TensorType};

use crate::cell::{expect_inputs, Cell, Tracer};
use crate::error::{CellError, Result};
use crate::init::Initializer;
use crate::param::{Parameter, Scope};

/// `y = x @ weight^T + bias`, weight `[out, in]` (MindSpore's `nn.Dense`).
/// Defaults: weight HeUniform(sqrt 5), bias Uniform(1/sqrt(in)), `has_bias = true`.
/// Input `[..., in]` of any rank from 2 gives `[..., out]`.
#[derive(Clone, Debug)]
pub struct Dense {
    path: String,
    weight: Parameter,
    bias: Option<Parameter>,
}

impl Dense {
    /// A dense layer from `in_channels` to `out_channels` features.
    pub fn new(s: &Scope, in_channels: usize, out_channels: usize) -> Self {
        let bound = 1.0 / (in_channels as f64).sqrt();
        Dense {
            path: s.path().to_string(),
            weight: s.param("weight", TensorType::f32([out_channels, in_channels]), Initializer::HeUniform { negative_slope: 5f64.sqrt() }),
            bias: Some(s.param("bias", TensorType::f32([out_channels]), Initializer::Uniform { scale: bound })),
        }
    }
    /// Sets the weight initializer.
    pub fn weight_init(mut self, init: Initializer) -> Self {
        self.weight.init = init;
        self
    }
    /// Sets the bias initializer.
    pub fn bias_init(mut self, init: Initializer) -> Self {
        if let Some(b) = &mut self.bias {
            b.init = init;
        }
        self
    }
    /// Removes the bias.
    pub fn without_bias(mut self) -> Self {
        self.bias = None;
        self
    }
}

impl Cell for Dense {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let w = t.param(&self.weight)?;
        let xt = t.ty(xs[0]).clone();
        if xt.rank() > 2 {
            // [..., in] -> [rows, in] -> [rows, out] -> [..., out]
            let (k, out) = (xt.dims()[xt.rank() - 1], self.weight.ty.dims()[0]);
            let x = t.op(Op::Reshape { shape: vec![xt.numel() / k.max(1), k].into() }, &[xs[0]])?;
            let y = t.op(Op::MatMul { transpose_a: false, transpose_b: true }, &[x, w])?;
            let y = add_bias(t, y, self.bias.as_ref(), 0)?;
            let mut dims = xt.dims().to_vec();
            *dims.last_mut().expect("rank > 2") = out;
            return t.op(Op::Reshape { shape: dims.into() }, &[y]);
        }
        let y = t.op(Op::MatMul { transpose_a: false, transpose_b: true }, &[xs[0], w])?;
        add_bias(t, y, self.bias.as_ref(), 0)
    }
    fn parameters(&self) -> Vec<Parameter> {
        weight_and_bias(&self.weight, &self.bias)
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "Dense"
    }
}

/// 2-D convolution over NCHW input (MindSpore's `nn.Conv2d`): weight
/// `[out, in/groups, k, k]`, `pad_mode` default `same`, no bias by default, weight
/// HeUniform(sqrt 5).
#[derive(Clone, Debug)]
pub struct Conv2d {
    path: String,
    attrs: Conv2dAttrs,
    weight: Parameter,
    bias: Option<Parameter>,
}

impl Conv2d {
    /// A convolution from `in_channels` to `out_channels` with a square `kernel`.
    pub fn new(s: &Scope, in_channels: usize, out_channels: usize, kernel: usize) -> Self {
        Conv2d {
            path: s.path().to_string(),
            attrs: Conv2dAttrs { stride: [1, 1], pad_mode: PadMode::Same, pad: [0; 4], dilation: [1, 1], groups: 1 },
            weight: s.param(
                "weight",
                TensorType::f32([out_channels, in_channels, kernel, kernel]),
                Initializer::HeUniform { negative_slope: 5f64.sqrt() },
            ),
            bias: None,
        }
    }
    /// Sets `pad_mode` (`valid`, `same`, `pad`).
    pub fn pad_mode(mut self, m: PadMode) -> Self {
        self.attrs.pad_mode = m;
        self
    }
    /// Explicit padding `[top, bottom, left, right]`; implies `pad_mode = pad`.
    pub fn padding(mut self, pad: [usize; 4]) -> Self {
        self.attrs.pad_mode = PadMode::Pad;
        self.attrs.pad = pad;
        self
    }
    /// Sets the stride on both axes.
    pub fn stride(mut self, s: usize) -> Self {
        self.attrs.stride = [s, s];
        self
    }
    /// Sets the dilation on both axes.
    pub fn dilation(mut self, d: usize) -> Self {
        self.attrs.dilation = [d, d];
        self
    }
    /// Sets the group count; the weight becomes `[out, in/groups, k, k]`.
    pub fn groups(mut self, g: usize) -> Result<Self> {
        let d = self.weight.ty.dims().to_vec();
        let in_channels = d[1] * self.attrs.groups;
        if g == 0 || !in_channels.is_multiple_of(g) || !d[0].is_multiple_of(g) {
            return Err(CellError::Config {
                cell: self.path.clone(),
                detail: format!("groups {g} must divide in_channels {in_channels} and out_channels {}", d[0]),
            });
        }
        self.attrs.groups = g;
        self.weight.ty = TensorType::f32([d[0], in_channels / g, d[2], d[3]]);
        Ok(self)
    }
    /// Adds a bias `[out]` initialised to zeros.
    pub fn with_bias(mut self) -> Self {
        let out = self.weight.ty.dims()[0];
        let s = Scope::root().child(&self.path);
        self.bias = Some(s.param("bias", TensorType::f32([out]), Initializer::Zeros));
        self
    }
    /// Sets the weight initializer.
    pub fn weight_init(mut self, init: Initializer) -> Self {
        self.weight.init = init;
        self
    }
}

impl Cell for Conv2d {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let w = t.param(&self.weight)?;
        let y = t.op(Op::Conv2d(self.attrs.clone()), &[xs[0], w])?;
        add_bias(t, y, self.bias.as_ref(), 2)
    }
    fn parameters(&self) -> Vec<Parameter> {
        weight_and_bias(&self.weight, &self.bias)
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "Conv2d"
    }
}

/// `y + bias`, the bias `[out]` viewed as `[out, 1, ...]` with `spatial` trailing ones so it
/// broadcasts over the channel axis; `y` unchanged without a bias.
fn add_bias(t: &mut Tracer, y: NodeId, bias: Option<&Parameter>, spatial: usize) -> Result<NodeId> {
    let Some(b) = bias else { return Ok(y) };
    let mut b = t.param(b)?;
    if spatial > 0 {
        let mut shape = t.ty(b).dims().to_vec();
        shape.extend(std::iter::repeat_n(1, spatial));
        b = t.op(Op::Reshape { shape: shape.into() }, &[b])?;
    }
    t.op(Op::Add, &[y, b])
}

fn weight_and_bias(weight: &Parameter, bias: &Option<Parameter>) -> Vec<Parameter> {
    std::iter::once(weight.clone()).chain(bias.clone()).collect()
}

macro_rules! stateless {
    ($(#[$doc:meta])* $name:ident, $kind:literal, |$t:ident, $x:ident| $body:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug, Default)]
        pub struct $name;
        impl $name {
            /// The layer.
            pub fn new() -> Self {
                $name
            }
        }
        impl Cell for $name {
            fn construct(&self, $t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
                expect_inputs(self, xs, 1)?;
                let $x = xs[0];
                $body
            }
            fn kind(&self) -> &'static str {
                $kind
            }
        }
    };
}

stateless!(
    /// `max(x, 0)` (MindSpore's `nn.ReLU`).
    ReLU, "ReLU", |t, x| t.op(Op::Relu, &[x])
);
stateless!(
    /// `[N, ...] -> [N, prod(...)]` (MindSpore's `nn.Flatten`).
    Flatten, "Flatten", |t, x| t.op(Op::Flatten, &[x])
);

/// A pooling layer's window (MindSpore's `nn.MaxPool2d` / `nn.AvgPool2d`, `pad_mode` valid by default).
#[derive(Clone, Debug)]
pub struct Pool2d {
    attrs: Pool2dAttrs,
    max: bool,
}

/// Max pooling.
pub type MaxPool2d = Pool2d;
/// Average pooling.
pub type AvgPool2d = Pool2d;

impl Pool2d {
    /// Max pooling with a square `kernel` and `stride`.
    pub fn max(kernel: usize, stride: usize) -> Self {
        Pool2d { attrs: Pool2dAttrs { kernel: [kernel; 2], stride: [stride; 2], pad_mode: PadMode::Valid, pad: [0; 4] }, max: true }
    }
    /// Average pooling with a square `kernel` and `stride`.
    pub fn avg(kernel: usize, stride: usize) -> Self {
        Pool2d { max: false, ..Pool2d::max(kernel, stride) }
    }
    /// Sets `pad_mode`.
    pub fn pad_mode(mut self, m: PadMode) -> Self {
        self.attrs.pad_mode = m;
        self
    }
    /// Explicit padding `p` on every side; implies `pad_mode = pad` (PyTorch's
    /// `MaxPool2d(3, 2, padding=1)` is `Pool2d::max(3, 2).padding(1)`; max pooling never picks
    /// the padding).
    pub fn padding(mut self, p: usize) -> Self {
        self.attrs.pad_mode = PadMode::Pad;
        self.attrs.pad = [p; 4];
        self
    }
}

impl Cell for Pool2d {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let op = if self.max { Op::MaxPool2d(self.attrs.clone()) } else { Op::AvgPool2d(self.attrs.clone()) };
        t.op(op, &[xs[0]])
    }
    fn kind(&self) -> &'static str {
        if self.max {
            "MaxPool2d"
        } else {
            "AvgPool2d"
        }
    }
}

/// Average pooling to a fixed output size (MindSpore's `nn.AdaptiveAvgPool2d`): `(1, 1)` is
/// the global mean over each channel's plane (ResNet's head), `[N, C, H, W] -> [N, C, 1, 1]`;
/// other sizes must divide the input's (the windows are then equal and do not overlap).
#[derive(Clone, Debug)]
pub struct AdaptiveAvgPool2d {
    output: [usize; 2],
}

impl AdaptiveAvgPool2d {
    /// Pooling to `(height, width)`.
    pub fn new(output: (usize, usize)) -> Self {
        AdaptiveAvgPool2d { output: [output.0, output.1] }
    }
}

impl Cell for AdaptiveAvgPool2d {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let ty = t.ty(xs[0]).clone();
        let [_, _, h, w] = ty.dims()[..] else {
            return Err(CellError::Config { cell: "AdaptiveAvgPool2d".into(), detail: format!("expects NCHW input, got {ty}") });
        };
        let [oh, ow] = self.output;
        if [oh, ow] == [1, 1] {
            return t.op(Op::ReduceMean(cellgraph_compiler::ReduceAttrs { axes: vec![2, 3], keep_dims: true }), &[xs[0]]);
        }
        if oh == 0 || ow == 0 || h % oh != 0 || w % ow != 0 {
            return Err(CellError::Config {
                cell: "AdaptiveAvgPool2d".into(),
                detail: format!("output size ({oh}, {ow}) must divide the input's ({h}, {w}) (input {ty})"),
            });
        }
        let (kh, kw) = (h / oh, w / ow);
        let attrs = Pool2dAttrs { kernel: [kh, kw], stride: [kh, kw], pad_mode: PadMode::Valid, pad: [0; 4] };
        t.op(Op::AvgPool2d(attrs), &[xs[0]])
    }
    fn kind(&self) -> &'static str {
        "AdaptiveAvgPool2d"
    }
}

/// Children applied in order, named `0.`, `1.`, ... (MindSpore's `nn.SequentialCell`).
pub struct SequentialCell {
    scope: Scope,
    cells: Vec<Box<dyn Cell>>,
}

impl SequentialCell {
    /// An empty sequence whose children are named under `s`.
    pub fn new(s: &Scope) -> Self {
        SequentialCell { scope: s.clone(), cells: Vec::new() }
    }
    /// Appends the child built by `f` under the next index (a builder, as `SequentialCell`'s
    /// list of cells is in MindSpore, not arithmetic).
    #[allow(clippy::should_implement_trait)]
    pub fn add<C: Cell + 'static>(mut self, f: impl FnOnce(&Scope) -> C) -> Self {
        let child = self.scope.child(&self.cells.len().to_string());
        self.cells.push(Box::new(f(&child)));
        self
    }
    /// Number of children.
    pub fn len(&self) -> usize {
        self.cells.len()
    }
    /// True without children.
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }
}

impl Cell for SequentialCell {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let mut x = xs[0];
        for (i, c) in self.cells.iter().enumerate() {
            x = match c.path() {
                Some(_) => t.call(c.as_ref(), &[x])?,
                None => t.call_in(self.scope.child(&i.to_string()).path(), c.as_ref(), &[x])?,
            };
        }
        Ok(x)
    }
    fn parameters(&self) -> Vec<Parameter> {
        self.cells.iter().flat_map(|c| c.parameters()).collect()
    }
    fn path(&self) -> Option<&str> {
        Some(self.scope.path())
    }
    fn kind(&self) -> &'static str {
        "SequentialCell"
    }
}

/// Inverted dropout (MindSpore's `nn.Dropout(p=0.5)`): in training, each element is zeroed
/// with probability `p` and the rest scaled by `1 / (1 - p)`; in inference, the identity. The
/// mask is keyed by `(seed, update, global item index, position in the item)` (`Op::Dropout`),
/// never by where an item lands: slicing a batch into micro-batches, sharding it over ranks or
/// resuming from a checkpoint gives every item the same mask. The seed defaults to a hash of
/// the cell's path, so two dropouts never share masks. Activations must be `[N, ...]` with one
/// row per item.
#[derive(Clone, Debug)]
pub struct Dropout {
    path: String,
    pub p: f64,
    pub seed: u64,
}

impl Dropout {
    /// Dropout with probability `p`, seeded by its path.
    pub fn new(s: &Scope, p: f64) -> Self {
        Dropout { path: s.path().into(), p, seed: crate::init::stream_seed(0, s.path()) }
    }
    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Whether tracing it now gives its input back unchanged: in inference, or with `p` 0.
    pub fn is_identity(&self, t: &Tracer) -> bool {
        !t.training() || self.p == 0.0
    }
}

impl Cell for Dropout {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        if !(0.0..1.0).contains(&self.p) {
            return Err(CellError::Config { cell: self.path.clone(), detail: format!("dropout probability must be in [0, 1), got {}", self.p) });
        }
        if self.is_identity(t) {
            return Ok(xs[0]);
        }
        let rows = t.ty(xs[0]).dims().first().copied().unwrap_or(1);
        let (items, update) = t.dropout_keys(rows)?;
        t.op(Op::Dropout { p: self.p, seed: self.seed }, &[xs[0], items, update])
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "Dropout"
    }
}

//! Reference networks: MindSpore's LeNet5, the seed-002 MLP, torchvision's ResNet-18, and a
//! character-level GPT (nanoGPT's).

use cellgraph_compiler::{NodeId, Op, PadMode};

use crate::cell::{expect_inputs, Cell, Tracer};
use crate::error::{CellError, Result};
use crate::init::Initializer;
use crate::layers::{AdaptiveAvgPool2d, Conv2d, Dense, Dropout, Flatten, MaxPool2d, Pool2d, ReLU, SequentialCell};
use crate::norm::BatchNorm2d;
use crate::param::{Parameter, Scope};
use crate::transformer::{Block, Embedding, LayerNorm};

/// LeNet5 exactly as MindSpore's model zoo: input `[N, 1, 32, 32]`, 61,684 parameters.
pub struct LeNet5 {
    conv1: Conv2d,
    conv2: Conv2d,
    fc1: Dense,
    fc2: Dense,
    fc3: Dense,
    relu: ReLU,
    max_pool2d: MaxPool2d,
    flatten: Flatten,
}

impl LeNet5 {
    /// LeNet5 for `num_class` classes over `num_channel` input channels.
    pub fn new(s: &Scope, num_class: usize, num_channel: usize) -> Self {
        let dense = |name: &str, i, o| Dense::new(&s.child(name), i, o).weight_init(Initializer::normal(0.02));
        LeNet5 {
            conv1: Conv2d::new(&s.child("conv1"), num_channel, 6, 5).pad_mode(PadMode::Valid),
            conv2: Conv2d::new(&s.child("conv2"), 6, 16, 5).pad_mode(PadMode::Valid),
            fc1: dense("fc1", 16 * 5 * 5, 120),
            fc2: dense("fc2", 120, 84),
            fc3: dense("fc3", 84, num_class),
            relu: ReLU::new(),
            max_pool2d: Pool2d::max(2, 2),
            flatten: Flatten::new(),
        }
    }
}

impl Cell for LeNet5 {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let mut x = xs[0];
        for conv in [&self.conv1, &self.conv2] {
            x = t.call(conv, &[x])?;
            x = t.call_in("relu", &self.relu, &[x])?;
            x = t.call_in("max_pool2d", &self.max_pool2d, &[x])?;
        }
        x = t.call_in("flatten", &self.flatten, &[x])?;
        for fc in [&self.fc1, &self.fc2] {
            x = t.call(fc, &[x])?;
            x = t.call_in("relu", &self.relu, &[x])?;
        }
        t.call(&self.fc3, &[x])
    }
    fn parameters(&self) -> Vec<Parameter> {
        [&self.conv1 as &dyn Cell, &self.conv2, &self.fc1, &self.fc2, &self.fc3].iter().flat_map(|c| c.parameters()).collect()
    }
    fn kind(&self) -> &'static str {
        "LeNet5"
    }
}

/// The seed-002 network: Flatten -> Dense(784,512) -> ReLU -> Dense(512,512) -> ReLU ->
/// Dense(512,10), weights `normal`, biases `zeros`. Input `[N, 1, 28, 28]`.
pub struct Network {
    flatten: Flatten,
    dense_relu_sequential: SequentialCell,
}

impl Network {
    /// The network with MindSpore's parameter names (`dense_relu_sequential.0.weight`, ...).
    pub fn new(s: &Scope) -> Self {
        let dense =
            |i, o| move |s: &Scope| Dense::new(s, i, o).weight_init(Initializer::from_name("normal").expect("known")).bias_init(Initializer::Zeros);
        Network {
            flatten: Flatten::new(),
            dense_relu_sequential: SequentialCell::new(&s.child("dense_relu_sequential"))
                .add(dense(28 * 28, 512))
                .add(|_| ReLU::new())
                .add(dense(512, 512))
                .add(|_| ReLU::new())
                .add(dense(512, 10)),
        }
    }
}

impl Cell for Network {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = t.call_in("flatten", &self.flatten, xs)?;
        t.call(&self.dense_relu_sequential, &[x])
    }
    fn parameters(&self) -> Vec<Parameter> {
        self.dense_relu_sequential.parameters()
    }
    fn kind(&self) -> &'static str {
        "Network"
    }
}

/// A `k x k` convolution without bias, padded by `k / 2`, with torchvision's ResNet initializer
/// (Kaiming normal, fan-out mode, ReLU gain).
fn resnet_conv(s: &Scope, in_channels: usize, out_channels: usize, k: usize, stride: usize) -> Conv2d {
    Conv2d::new(s, in_channels, out_channels, k).stride(stride).padding([k / 2; 4]).weight_init(Initializer::HeNormalFanOut { negative_slope: 0.0 })
}

/// torchvision's `BasicBlock`: `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`, the
/// shortcut a strided 1x1 convolution and batch norm (`downsample.0`, `downsample.1`) when the
/// block changes the stride or the width, else `x`.
pub struct BasicBlock {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    conv2: Conv2d,
    bn2: BatchNorm2d,
    relu: ReLU,
    downsample: Option<SequentialCell>,
    path: String,
}

/// How a network makes each of its batch norms from the default one: the identity, or an
/// option applied to every one (`|bn| bn.sync()`, `|bn| bn.window_statistics()`).
pub type NormOption<'a> = &'a dyn Fn(BatchNorm2d) -> Result<BatchNorm2d>;

impl BasicBlock {
    /// A block from `in_channels` to `channels` whose first convolution has `stride`.
    pub fn new(s: &Scope, in_channels: usize, channels: usize, stride: usize) -> Self {
        Self::with_norm(s, in_channels, channels, stride, &Ok).expect("the default batch norm")
    }

    /// [`Self::new`] with `norm` applied to each batch norm.
    pub fn with_norm(s: &Scope, in_channels: usize, channels: usize, stride: usize, norm: NormOption) -> Result<Self> {
        let bn = |s: &Scope| norm(BatchNorm2d::new(s, channels));
        let downsample = match stride != 1 || in_channels != channels {
            true => {
                let d = s.child("downsample");
                let norm = bn(&d.child("1"))?;
                Some(SequentialCell::new(&d).add(|s| resnet_conv(s, in_channels, channels, 1, stride)).add(|_| norm))
            }
            false => None,
        };
        Ok(BasicBlock {
            conv1: resnet_conv(&s.child("conv1"), in_channels, channels, 3, stride),
            bn1: bn(&s.child("bn1"))?,
            conv2: resnet_conv(&s.child("conv2"), channels, channels, 3, 1),
            bn2: bn(&s.child("bn2"))?,
            relu: ReLU::new(),
            downsample,
            path: s.path().to_string(),
        })
    }
}

impl Cell for BasicBlock {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = t.call(&self.conv1, xs)?;
        let x = t.call(&self.bn1, &[x])?;
        let x = t.call_in(&format!("{}.relu", self.path), &self.relu, &[x])?;
        let x = t.call(&self.conv2, &[x])?;
        let x = t.call(&self.bn2, &[x])?;
        let identity = match &self.downsample {
            Some(d) => t.call(d, xs)?,
            None => xs[0],
        };
        let x = t.op(Op::Add, &[x, identity])?;
        t.call_in(&format!("{}.relu", self.path), &self.relu, &[x])
    }
    fn parameters(&self) -> Vec<Parameter> {
        let mut v: Vec<Parameter> = [&self.conv1 as &dyn Cell, &self.bn1, &self.conv2, &self.bn2].iter().flat_map(|c| c.parameters()).collect();
        v.extend(self.downsample.iter().flat_map(|d| d.parameters()));
        v
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "BasicBlock"
    }
}

/// torchvision's `resnet18(num_classes)`, with MindSpore's batch-norm names: a 7x7 stride-2
/// stem (`conv1`, `bn1`), 3x3 stride-2 max pooling padded by 1, four stages of two
/// [`BasicBlock`]s (`layer1` .. `layer4`: 64, 128, 256, 512 channels, stride 2 from the
/// second), global average pooling and `fc`. Input `[N, 3, H, W]`; 11,181,642 trainable
/// parameters for 10 classes. Convolutions are drawn Kaiming normal (fan-out), batch norms
/// start at gamma 1, beta 0, and `fc` has `Dense`'s defaults (those of `torch.nn.Linear`).
pub struct ResNet18 {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    relu: ReLU,
    maxpool: MaxPool2d,
    layers: [SequentialCell; 4],
    avgpool: AdaptiveAvgPool2d,
    flatten: Flatten,
    fc: Dense,
}

impl ResNet18 {
    /// ResNet-18 for `num_classes` classes over 3 input channels.
    pub fn new(s: &Scope, num_classes: usize) -> Self {
        Self::with_norm(s, num_classes, &Ok).expect("the default batch norm")
    }

    /// [`Self::new`] with `norm` applied to each of its 20 batch norms:
    /// `ResNet18::with_norm(s, 10, &|bn| bn.sync())` is PyTorch's
    /// `SyncBatchNorm.convert_sync_batchnorm(resnet18(num_classes=10))`.
    pub fn with_norm(s: &Scope, num_classes: usize, norm: NormOption) -> Result<Self> {
        let stage = |name: &str, i: usize, o: usize, stride: usize| -> Result<SequentialCell> {
            let s = s.child(name);
            let (first, second) = (BasicBlock::with_norm(&s.child("0"), i, o, stride, norm)?, BasicBlock::with_norm(&s.child("1"), o, o, 1, norm)?);
            Ok(SequentialCell::new(&s).add(|_| first).add(|_| second))
        };
        Ok(ResNet18 {
            conv1: resnet_conv(&s.child("conv1"), 3, 64, 7, 2),
            bn1: norm(BatchNorm2d::new(&s.child("bn1"), 64))?,
            relu: ReLU::new(),
            maxpool: Pool2d::max(3, 2).padding(1),
            layers: [stage("layer1", 64, 64, 1)?, stage("layer2", 64, 128, 2)?, stage("layer3", 128, 256, 2)?, stage("layer4", 256, 512, 2)?],
            avgpool: AdaptiveAvgPool2d::new((1, 1)),
            flatten: Flatten::new(),
            fc: Dense::new(&s.child("fc"), 512, num_classes),
        })
    }
}

impl Cell for ResNet18 {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = t.call(&self.conv1, xs)?;
        let x = t.call(&self.bn1, &[x])?;
        let x = t.call_in("relu", &self.relu, &[x])?;
        let mut x = t.call_in("maxpool", &self.maxpool, &[x])?;
        for layer in &self.layers {
            x = t.call(layer, &[x])?;
        }
        let x = t.call_in("avgpool", &self.avgpool, &[x])?;
        let x = t.call_in("flatten", &self.flatten, &[x])?;
        t.call(&self.fc, &[x])
    }
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.conv1.parameters();
        v.extend(self.bn1.parameters());
        v.extend(self.layers.iter().flat_map(|l| l.parameters()));
        v.extend(self.fc.parameters());
        v
    }
    fn kind(&self) -> &'static str {
        "ResNet18"
    }
}

/// The shape of a [`GPT`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// The longest sequence (the position table's rows).
    pub context: usize,
    pub layers: usize,
    pub heads: usize,
    pub width: usize,
    /// LayerNorm's epsilon (1e-5, PyTorch's and GPT-2's).
    pub layer_norm_eps: f64,
    /// Dropout after the embeddings, on the attention probabilities and after each residual
    /// branch (nanoGPT's places); 0 for none.
    pub dropout: f64,
    /// The MLP's GELU in its tanh form (GPT-2's `gelu_new`, what Hugging Face checkpoints
    /// were trained with) rather than the exact erf form (nanoGPT's, PyTorch's default).
    pub gelu_approximate: bool,
}

impl GptConfig {
    /// The small character model: 4 layers, 4 heads, width 128, context 128.
    pub fn small(vocab_size: usize) -> Self {
        GptConfig { vocab_size, context: 128, layers: 4, heads: 4, width: 128, layer_norm_eps: 1e-5, dropout: 0.0, gelu_approximate: false }
    }
}

/// A GPT (nanoGPT's): token and position embeddings (`wte`, `wpe`), `layers`
/// pre-LayerNorm [`Block`]s (`h.0`, `h.1`, ...), a final LayerNorm (`ln_f`) and an output head
/// tied to the token embedding (logits = `x @ wte^T`). Input: token ids `[B, T]` with
/// `T <= context`; output: logits `[B, T, vocab_size]`. Initialised as GPT-2: weights
/// `N(0, 0.02)`, residual projections `N(0, 0.02 / sqrt(2 * layers))`, biases zero.
pub struct GPT {
    wte: Embedding,
    wpe: Embedding,
    drop: Dropout,
    h: Vec<Block>,
    ln_f: LayerNorm,
    pub config: GptConfig,
}

impl GPT {
    /// A GPT of the given shape.
    pub fn new(s: &Scope, config: GptConfig) -> Result<Self> {
        let c = config;
        Ok(GPT {
            wte: Embedding::new(&s.child("wte"), c.vocab_size, c.width).embedding_init(Initializer::normal(0.02)),
            wpe: Embedding::new(&s.child("wpe"), c.context, c.width).embedding_init(Initializer::normal(0.02)),
            drop: Dropout::new(&s.child("drop"), c.dropout),
            h: (0..c.layers)
                .map(|i| {
                    Block::new(&s.child("h").child(&i.to_string()), c.width, c.heads, c.layers, c.layer_norm_eps, c.dropout)
                        .map(|b| b.gelu(c.gelu_approximate))
                })
                .collect::<Result<_>>()?,
            ln_f: LayerNorm::new(&s.child("ln_f"), c.width).epsilon(c.layer_norm_eps),
            config,
        })
    }
}

impl Cell for GPT {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let ids = t.ty(xs[0]).clone();
        let (&[b, tt], true) = (ids.dims(), ids.dtype.is_int()) else {
            return Err(CellError::Config { cell: "GPT".into(), detail: format!("input must be integer token ids [B, T], got {ids}") });
        };
        let (c, v) = (self.config.width, self.config.vocab_size);
        if tt > self.config.context {
            return Err(CellError::Config {
                cell: "GPT".into(),
                detail: format!("sequences of {tt} tokens exceed the context of {}; use windows of at most {0}", self.config.context),
            });
        }
        let tok = t.call(&self.wte, xs)?;
        let wpe = t.param(self.wpe.table())?;
        let pos = t.op(Op::Slice { begin: vec![0, 0], end: vec![tt, c] }, &[wpe])?;
        let x = t.op(Op::Add, &[tok, pos])?;
        let mut x = t.call(&self.drop, &[x])?;
        for block in &self.h {
            x = t.call(block, &[x])?;
        }
        let x = t.call(&self.ln_f, &[x])?;
        let x = t.op(Op::Reshape { shape: vec![b * tt, c].into() }, &[x])?;
        let wte = t.param(self.wte.table())?;
        let logits = t.op(Op::MatMul { transpose_a: false, transpose_b: true }, &[x, wte])?;
        t.op(Op::Reshape { shape: vec![b, tt, v].into() }, &[logits])
    }
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.wte.parameters();
        v.extend(self.wpe.parameters());
        v.extend(self.h.iter().flat_map(|b| b.parameters()));
        v.extend(self.ln_f.parameters());
        v
    }
    fn kind(&self) -> &'static str {
        "GPT"
    }
}

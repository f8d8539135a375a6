//! Reference networks: MindSpore's LeNet5 and the seed-002 MLP.

use cellgraph_compiler::{NodeId, PadMode};

use crate::cell::{expect_inputs, Cell, Tracer};
use crate::error::Result;
use crate::init::Initializer;
use crate::layers::{Conv2d, Dense, Flatten, MaxPool2d, Pool2d, ReLU, SequentialCell};
use crate::param::{Parameter, Scope};

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
        let dense = |i, o| {
            move |s: &Scope| {
                Dense::new(s, i, o).weight_init(Initializer::from_name("normal").expect("known")).bias_init(Initializer::Zeros)
            }
        };
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

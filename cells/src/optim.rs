//! Optimizers as graph builders: each emits, per parameter, the update from its gradient
//! as `assign` nodes, and declares its state parameters with MindSpore's names.

use cellgraph_compiler::{NodeId, Op};

use crate::cell::Tracer;
use crate::error::Result;
use crate::param::Parameter;

/// An optimizer that writes its update into the graph.
pub trait Optimizer {
    /// State parameters for `params` (e.g. `moments.fc1.weight`), materialised with the rest.
    fn state(&self, params: &[Parameter]) -> Vec<Parameter>;
    /// Emits the update of parameter `p` (read by node `param`) from gradient `grad`.
    fn update(&self, t: &mut Tracer, p: &Parameter, param: NodeId, grad: NodeId) -> Result<()>;
    /// A short name for messages.
    fn name(&self) -> &'static str;
}

/// Plain stochastic gradient descent: `p -= lr * g` (MindSpore's `nn.SGD` with its defaults).
#[derive(Clone, Debug)]
pub struct SGD {
    pub learning_rate: f64,
}

impl SGD {
    /// SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        SGD { learning_rate: lr }
    }
}

impl Optimizer for SGD {
    fn state(&self, _params: &[Parameter]) -> Vec<Parameter> {
        Vec::new()
    }
    fn update(&self, t: &mut Tracer, p: &Parameter, param: NodeId, grad: NodeId) -> Result<()> {
        let lr = t.constant(self.learning_rate, p.ty.with_shape(cellgraph_compiler::Shape::scalar()))?;
        let step = t.op(Op::Mul, &[grad, lr])?;
        let new = t.op(Op::Sub, &[param, step])?;
        t.op(Op::Assign, &[param, new])?;
        Ok(())
    }
    fn name(&self) -> &'static str {
        "SGD"
    }
}

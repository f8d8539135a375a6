//! Building training graphs from cells: MindSpore's `GradOperation` and `TrainOneStepCell`.

use cellgraph_compiler::autodiff::{grad, Sens};
use cellgraph_compiler::update::{emit_updates, StateSpec};
use cellgraph_compiler::{Graph, NodeId, TensorType};

use crate::cell::{Cell, Tracer};
use crate::error::Result;
use crate::optim::Optimizer;
use crate::param::Parameter;

/// A traced loss with its gradients (what `GradOperation(get_by_list=True)` returns).
pub struct GradGraph {
    pub graph: Graph,
    pub loss: NodeId,
    /// `(parameter, its node, its gradient node)` for each trainable parameter.
    pub grads: Vec<(Parameter, NodeId, NodeId)>,
}

/// Traces `net_with_loss` on inputs of the given names and types and differentiates the loss
/// with respect to its trainable parameters. Outputs: the loss, then each gradient.
pub fn grad_graph(net_with_loss: &dyn Cell, name: &str, inputs: &[(&str, TensorType)], sens: Sens) -> Result<GradGraph> {
    grad_graph_in(Tracer::new(name), net_with_loss, inputs, sens)
}

/// [`grad_graph`] on a given tracer: [`Tracer::inference`] differentiates the inference
/// graph (batch norm on its moving statistics).
pub fn grad_graph_in(mut t: Tracer, net_with_loss: &dyn Cell, inputs: &[(&str, TensorType)], sens: Sens) -> Result<GradGraph> {
    let xs = inputs.iter().map(|(n, ty)| t.input(n, ty.clone())).collect::<Result<Vec<_>>>()?;
    let loss = t.call(net_with_loss, &xs)?;
    let params = net_with_loss.trainable_params();
    let nodes = params.iter().map(|p| t.param(p)).collect::<Result<Vec<_>>>()?;
    let g = grad(t.graph_mut(), loss, &nodes, sens)?;
    let grads: Vec<_> = params.into_iter().zip(nodes).zip(g.grads).map(|((p, n), d)| (p, n, d)).collect();
    let outputs = std::iter::once(loss).chain(grads.iter().map(|(_, _, d)| *d)).collect();
    Ok(GradGraph { graph: t.finish(outputs), loss, grads })
}

/// One training step (MindSpore's `TrainOneStepCell`): loss, gradients, optimizer update.
/// Inputs: the given ones, then the optimizer's scalar inputs (`learning_rate`, ...: feed
/// `opt.scalar_values(update)`). The one output is the loss; parameters and optimizer state
/// are written when the graph finishes.
pub fn train_one_step(net_with_loss: &dyn Cell, inputs: &[(&str, TensorType)], opt: &dyn Optimizer) -> Result<TrainStep> {
    let mut t = Tracer::new("train_one_step");
    let xs = inputs.iter().map(|(n, ty)| t.input(n, ty.clone())).collect::<Result<Vec<_>>>()?;
    let loss = t.call(net_with_loss, &xs)?;
    let params = net_with_loss.trainable_params();
    let nodes = params.iter().map(|p| t.param(p)).collect::<Result<Vec<_>>>()?;
    let g = grad(t.graph_mut(), loss, &nodes, Sens::One)?;
    let triples: Vec<_> = params.iter().zip(&nodes).zip(&g.grads).map(|((p, &n), &d)| (p.name.clone(), n, d)).collect();
    let state = emit_updates(t.graph_mut(), opt, &triples)?;
    Ok(TrainStep { graph: t.finish(vec![loss]), state })
}

/// A training-step graph and the optimizer state it reads and writes.
pub struct TrainStep {
    pub graph: Graph,
    pub state: Vec<StateSpec>,
}

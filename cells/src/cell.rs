//! The `Cell` trait and the tracer that records a cell's `construct` as a graph.
//!
//! Calling a child through [`Tracer::call`] pushes the child's scope, so every node carries the
//! Cell path it came from (`net.conv1`), and type errors name it.

use std::collections::HashMap;

use cellgraph_compiler::{Graph, NodeId, Op, TensorType};

use crate::error::{CellError, Result};
use crate::param::Parameter;

/// A network building block (MindSpore's `nn.Cell`). `construct` traces the cell's
/// computation into the graph; it runs once per compilation, never per step.
pub trait Cell {
    /// Adds this cell's computation on `xs` to the trace and returns its result.
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId>;
    /// Every parameter of this cell and its children, with full names.
    fn parameters(&self) -> Vec<Parameter> {
        Vec::new()
    }
    /// The cell's path (`conv1`, `dense_relu_sequential.0`); `None` for cells that inherit
    /// their caller's scope (stateless layers, losses, wrappers).
    fn path(&self) -> Option<&str> {
        None
    }
    /// A short type name for error messages.
    fn kind(&self) -> &'static str;
    /// Switches training behaviour (MindSpore's `set_train`). Built-in layers read the mode
    /// from the trace instead ([`Tracer::training`]): a training graph and an evaluation graph
    /// of one network come from one cell.
    fn set_train(&mut self, _train: bool) {}
    /// The network inside a loss wrapper (`WithLossCell`'s backbone), for evaluation.
    fn backbone(&self) -> Option<&dyn Cell> {
        None
    }
    /// Parameters the optimizer updates (MindSpore's `trainable_params()`).
    fn trainable_params(&self) -> Vec<Parameter> {
        self.parameters().into_iter().filter(|p| p.requires_grad).collect()
    }
}

/// Checks a cell got `n` inputs.
pub fn expect_inputs(cell: &dyn Cell, xs: &[NodeId], n: usize) -> Result<()> {
    if xs.len() == n {
        Ok(())
    } else {
        Err(CellError::Inputs { cell: cell.path().unwrap_or(cell.kind()).to_string(), expected: n, got: xs.len() })
    }
}

/// Records cells into a graph, in training mode (batch statistics, state updates) or in
/// inference mode.
pub struct Tracer {
    graph: Graph,
    scopes: Vec<String>,
    params: HashMap<String, NodeId>,
    phase: Phase,
    /// The number of items (tokens) the loss sums over, when a loss reports it
    /// ([`Tracer::set_count`]).
    count: Option<NodeId>,
    /// Dropout's keys: the implicit inputs [`ITEM_INDEX`] and [`UPDATE`], once asked for.
    keys: Option<(NodeId, NodeId)>,
}

/// What a trace records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A training step: batch statistics, state updates.
    Training,
    /// Evaluation and prediction: moving statistics, no writes.
    Inference,
    /// The state updates a [`GradAccumulation`](crate::GradAccumulation) window runs once, at
    /// its boundary (batch norm's once-per-window statistics); the network's computation is
    /// traced only to reach them and is dropped.
    Boundary,
}

/// The name of the implicit graph input holding each row's global item index (dropout's key),
/// and of the dataset column that provides it.
pub const ITEM_INDEX: &str = "item_index";
/// The name of the implicit graph input holding the number of updates applied (dropout's key).
pub const UPDATE: &str = "update";

/// The scope of the top-level network in traces.
pub const ROOT_SCOPE: &str = "net";

impl Tracer {
    /// An empty training trace producing a graph called `name` (what training graphs are
    /// built from: `BatchNorm2d` normalises with the batch's statistics and updates its moving
    /// ones).
    pub fn new(name: &str) -> Self {
        Tracer {
            graph: Graph::new(name),
            scopes: vec![ROOT_SCOPE.to_string()],
            params: HashMap::new(),
            phase: Phase::Training,
            count: None,
            keys: None,
        }
    }

    /// An empty inference trace (MindSpore's `set_train(False)`: `BatchNorm2d` normalises with
    /// its moving statistics and writes nothing).
    pub fn inference(name: &str) -> Self {
        Tracer { phase: Phase::Inference, ..Tracer::new(name) }
    }

    /// An empty trace of a window's boundary updates ([`Phase::Boundary`]).
    pub fn boundary(name: &str) -> Self {
        Tracer { phase: Phase::Boundary, ..Tracer::new(name) }
    }

    /// True in a training trace.
    pub fn training(&self) -> bool {
        self.phase == Phase::Training
    }

    /// What this trace records.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The scope new nodes are tagged with.
    pub fn scope(&self) -> &str {
        self.scopes.last().expect("root scope")
    }

    /// Adds the next graph input.
    pub fn input(&mut self, name: &str, ty: TensorType) -> Result<NodeId> {
        let index = self.graph.inputs().len();
        let scope = self.scope().to_string();
        Ok(self.graph.add_leaf(Op::Input { index, name: name.into() }, ty, &scope)?)
    }

    /// The node reading parameter `p` (one node per name).
    pub fn param(&mut self, p: &Parameter) -> Result<NodeId> {
        if let Some(&id) = self.params.get(&p.name) {
            return Ok(id);
        }
        let scope = self.scope().to_string();
        let id = self.graph.add_leaf(Op::Parameter { name: p.name.clone() }, p.ty.clone(), &scope)?;
        self.params.insert(p.name.clone(), id);
        Ok(id)
    }

    /// Adds an op in the current scope.
    pub fn op(&mut self, op: Op, xs: &[NodeId]) -> Result<NodeId> {
        let scope = self.scope().to_string();
        Ok(self.graph.add(op, xs, &scope)?)
    }

    /// Writes `value` into non-trainable state `p` when the graph finishes (`assign`): a
    /// moving statistic, say. A parameter is written at most once per graph.
    pub fn assign(&mut self, p: &Parameter, value: NodeId) -> Result<NodeId> {
        let target = self.param(p)?;
        self.op(Op::Assign, &[target, value])
    }

    /// A constant of type `ty` in the current scope.
    pub fn constant(&mut self, value: f64, ty: TensorType) -> Result<NodeId> {
        let scope = self.scope().to_string();
        Ok(self.graph.add_leaf(Op::Constant { value }, ty, &scope)?)
    }

    /// Traces `cell` on `xs` inside its own scope.
    pub fn call(&mut self, cell: &dyn Cell, xs: &[NodeId]) -> Result<NodeId> {
        match cell.path() {
            Some(p) => {
                self.scopes.push(if p.is_empty() { ROOT_SCOPE.to_string() } else { format!("{ROOT_SCOPE}.{p}") });
                let r = cell.construct(self, xs);
                self.scopes.pop();
                r
            }
            None => cell.construct(self, xs),
        }
    }

    /// Traces `cell` under an explicit scope name (for wrappers such as `WithLossCell`).
    pub fn call_in(&mut self, scope: &str, cell: &dyn Cell, xs: &[NodeId]) -> Result<NodeId> {
        self.scopes.push(format!("{ROOT_SCOPE}.{scope}"));
        let r = cell.construct(self, xs);
        self.scopes.pop();
        r
    }

    /// Reports the scalar count of items a summing loss covers (its non-ignored tokens), for
    /// token-weighted normalisation (`Normalization::Tokens`): the window's gradient is
    /// divided once by the counts of all its micro-batches and ranks.
    pub fn set_count(&mut self, count: NodeId) {
        self.count = Some(count);
    }

    /// Dropout's keys for activations of `rows` rows: the implicit graph inputs [`ITEM_INDEX`]
    /// (`i64 [rows]`, each row's global item index) and [`UPDATE`] (`i64 []`), added after the
    /// traced inputs the first time they are asked for; the runtime fills them.
    pub fn dropout_keys(&mut self, rows: usize) -> Result<(NodeId, NodeId)> {
        if let Some(k) = self.keys {
            return Ok(k);
        }
        let items = self.input(ITEM_INDEX, TensorType::new(cellgraph_compiler::DType::I64, [rows]))?;
        let update = self.input(UPDATE, TensorType::new(cellgraph_compiler::DType::I64, cellgraph_compiler::Shape::scalar()))?;
        self.keys = Some((items, update));
        Ok((items, update))
    }

    /// The count a loss reported, if any.
    pub fn count(&self) -> Option<NodeId> {
        self.count
    }

    /// The type of a traced node.
    pub fn ty(&self, id: NodeId) -> &TensorType {
        self.graph.ty(id)
    }

    /// Mutable access to the graph being built.
    pub fn graph_mut(&mut self) -> &mut Graph {
        &mut self.graph
    }

    /// Ends the trace with the given outputs.
    pub fn finish(mut self, outputs: Vec<NodeId>) -> Graph {
        self.graph.set_outputs(outputs);
        self.graph
    }
}

/// Traces `cell` on fresh inputs of the given names and types, for training; returns the
/// graph (with the cell's result as its one output) and the result node.
pub fn trace(cell: &dyn Cell, name: &str, inputs: &[(&str, TensorType)]) -> Result<(Graph, NodeId)> {
    trace_with(Tracer::new(name), cell, inputs)
}

/// [`trace`] in inference mode (evaluation, prediction).
pub fn trace_inference(cell: &dyn Cell, name: &str, inputs: &[(&str, TensorType)]) -> Result<(Graph, NodeId)> {
    trace_with(Tracer::inference(name), cell, inputs)
}

fn trace_with(mut t: Tracer, cell: &dyn Cell, inputs: &[(&str, TensorType)]) -> Result<(Graph, NodeId)> {
    let xs = inputs.iter().map(|(n, ty)| t.input(n, ty.clone())).collect::<Result<Vec<_>>>()?;
    let y = t.call(cell, &xs)?;
    Ok((t.finish(vec![y]), y))
}

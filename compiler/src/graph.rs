//! The graph: nodes with typed ids on petgraph's `StableGraph`, operands as ordered edges.
//!
//! A [`Node`] holds its [`Op`] (attributes included), its output [`TensorType`] and the Cell
//! scope it was traced from (`net.conv1`). An edge `a -> b` with weight `i` says "`a` is
//! operand `i` of `b`". Ids are stable under removal and print as `%N`.
//!
//! Graph semantics are functional: every `parameter` node reads the value the parameter had
//! when the graph started; `assign`/`assign_add` nodes write when the graph finishes. So the
//! order of effects inside one graph never matters, and at most one write per parameter is
//! allowed (the verifier checks it).

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use petgraph::stable_graph::{NodeIndex, StableGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;

use crate::error::{IrError, Result};
use crate::infer::infer;
use crate::op::Op;
use crate::types::TensorType;

/// A node's id, printed `%N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    fn ix(self) -> NodeIndex<u32> {
        NodeIndex::new(self.0 as usize)
    }
    /// The id as an index, for dense side tables.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One operation in a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub ty: TensorType,
    /// The Cell path the node was traced in, e.g. `net.fc1`; empty when unknown.
    pub scope: String,
}

/// A named dataflow graph with ordered outputs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    inner: StableGraph<Node, u32>,
    outputs: Vec<NodeId>,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Self {
        Graph { name: name.into(), inner: StableGraph::default(), outputs: Vec::new() }
    }

    /// Adds a node whose type is inferred from its operands.
    pub fn add(&mut self, op: Op, operands: &[NodeId], scope: &str) -> Result<NodeId> {
        if op.is_leaf() {
            return Err(IrError::Misuse {
                scope: scope.into(),
                op: op.name(),
                detail: "leaf ops are added with add_leaf and an explicit type".into(),
            });
        }
        if !op.arity().accepts(operands.len()) {
            return Err(IrError::Arity { scope: scope.into(), op: op.name(), expected: op.arity().to_string(), got: operands.len() });
        }
        let tys = operands.iter().map(|&o| self.try_node(o).map(|n| &n.ty)).collect::<Result<Vec<_>>>()?;
        let ty = infer(&op, &tys).map_err(|detail| IrError::Type { scope: scope.into(), op: op.name(), detail })?;
        Ok(self.add_unchecked(op, operands, ty, scope))
    }

    /// Adds a leaf (parameter, input, constant) of the given type.
    pub fn add_leaf(&mut self, op: Op, ty: TensorType, scope: &str) -> Result<NodeId> {
        if !op.is_leaf() {
            return Err(IrError::Misuse { scope: scope.into(), op: op.name(), detail: "only leaf ops take an explicit type".into() });
        }
        Ok(self.add_unchecked(op, &[], ty, scope))
    }

    /// Adds a node without checking anything; the verifier judges it later. Used by the parser.
    pub fn add_unchecked(&mut self, op: Op, operands: &[NodeId], ty: TensorType, scope: &str) -> NodeId {
        let id = NodeId(self.inner.add_node(Node { op, ty, scope: scope.into() }).index() as u32);
        for (i, &o) in operands.iter().enumerate() {
            self.inner.add_edge(o.ix(), id.ix(), i as u32);
        }
        id
    }

    /// Appends operand edges `operands` (in order) to `id`, unchecked. Used by the parser,
    /// which adds nodes first and edges after, to keep the text's ids.
    pub(crate) fn connect(&mut self, id: NodeId, operands: &[NodeId]) {
        for (i, &o) in operands.iter().enumerate() {
            self.inner.add_edge(o.ix(), id.ix(), i as u32);
        }
    }

    /// The node, or an error naming the id.
    pub fn try_node(&self, id: NodeId) -> Result<&Node> {
        self.inner.node_weight(id.ix()).ok_or(IrError::UnknownNode(id))
    }

    /// The node; panics on an id from another graph (a bug, not a user error).
    pub fn node(&self, id: NodeId) -> &Node {
        &self.inner[id.ix()]
    }

    /// True when the id names a live node.
    pub fn contains(&self, id: NodeId) -> bool {
        self.inner.contains_node(id.ix())
    }

    /// The type of a node.
    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.node(id).ty
    }

    /// The operands of a node, in order.
    pub fn operands(&self, id: NodeId) -> Vec<NodeId> {
        let mut e: Vec<(u32, NodeId)> =
            self.inner.edges_directed(id.ix(), Direction::Incoming).map(|e| (*e.weight(), NodeId(e.source().index() as u32))).collect();
        e.sort_unstable();
        e.into_iter().map(|(_, n)| n).collect()
    }

    /// The operand positions recorded on the incoming edges, sorted (for the verifier).
    pub(crate) fn operand_positions(&self, id: NodeId) -> Vec<u32> {
        let mut p: Vec<u32> = self.inner.edges_directed(id.ix(), Direction::Incoming).map(|e| *e.weight()).collect();
        p.sort_unstable();
        p
    }

    /// The distinct nodes that use this node as an operand, by id.
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let set: BTreeSet<NodeId> = self.inner.edges_directed(id.ix(), Direction::Outgoing).map(|e| NodeId(e.target().index() as u32)).collect();
        set.into_iter().collect()
    }

    /// Every live node id, ascending.
    pub fn ids(&self) -> Vec<NodeId> {
        self.inner.node_indices().map(|i| NodeId(i.index() as u32)).collect()
    }

    /// Number of live nodes.
    pub fn len(&self) -> usize {
        self.inner.node_count()
    }

    /// True when the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.inner.node_count() == 0
    }

    /// One past the largest id ever handed out (size for dense side tables).
    pub fn id_bound(&self) -> usize {
        petgraph::visit::NodeIndexable::node_bound(&self.inner)
    }

    /// The graph's results, in order.
    pub fn outputs(&self) -> &[NodeId] {
        &self.outputs
    }

    /// Replaces the results.
    pub fn set_outputs(&mut self, outputs: Vec<NodeId>) {
        self.outputs = outputs;
    }

    /// Appends one result.
    pub fn push_output(&mut self, id: NodeId) {
        self.outputs.push(id);
    }

    /// Removes a node and its edges. Outputs naming it are dropped.
    pub fn remove(&mut self, id: NodeId) {
        self.inner.remove_node(id.ix());
        self.outputs.retain(|&o| o != id);
    }

    /// The node `id`, to change its op in place (the caller keeps its type valid).
    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.inner[id.ix()]
    }

    /// Points every use of `old` (operands and outputs) at `new`, except `keep`'s operand
    /// (the node that reads `old` to make `new`).
    pub fn replace_uses_except(&mut self, old: NodeId, new: NodeId, keep: NodeId) {
        let uses: Vec<_> = self
            .inner
            .edges_directed(old.ix(), Direction::Outgoing)
            .filter(|e| e.target() != keep.ix())
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        for (e, target, pos) in uses {
            self.inner.remove_edge(e);
            self.inner.add_edge(new.ix(), target, pos);
        }
        for o in &mut self.outputs {
            if *o == old {
                *o = new;
            }
        }
    }

    /// Points every use of `old` (operands and outputs) at `new`.
    pub fn replace_uses(&mut self, old: NodeId, new: NodeId) {
        self.replace_uses_except(old, new, new);
    }

    /// A topological order, smallest id first among ready nodes; `Err(node)` names a node on a cycle.
    pub fn topo_order(&self) -> std::result::Result<Vec<NodeId>, NodeId> {
        let mut indeg: HashMap<NodeId, usize> = self.ids().into_iter().map(|id| (id, self.operands(id).len())).collect();
        let mut ready: BTreeSet<NodeId> = indeg.iter().filter(|(_, &d)| d == 0).map(|(&id, _)| id).collect();
        let mut order = Vec::with_capacity(indeg.len());
        while let Some(id) = ready.pop_first() {
            order.push(id);
            for e in self.inner.edges_directed(id.ix(), Direction::Outgoing) {
                let t = NodeId(e.target().index() as u32);
                let d = indeg.get_mut(&t).expect("edge to live node");
                *d -= 1;
                if *d == 0 {
                    ready.insert(t);
                }
            }
        }
        match indeg.into_iter().filter(|(id, _)| !order.contains(id)).map(|(id, _)| id).min() {
            Some(bad) => Err(bad),
            None => Ok(order),
        }
    }

    /// `(id, name)` of every parameter node, by id.
    pub fn parameters(&self) -> Vec<(NodeId, &str)> {
        self.ids()
            .into_iter()
            .filter_map(|id| match &self.node(id).op {
                Op::Parameter { name } => Some((id, name.as_str())),
                _ => None,
            })
            .collect()
    }

    /// The parameter node with this name.
    pub fn find_parameter(&self, name: &str) -> Option<NodeId> {
        self.parameters().into_iter().find(|(_, n)| *n == name).map(|(id, _)| id)
    }

    /// `(id, index, name)` of every input node, by index.
    pub fn inputs(&self) -> Vec<(NodeId, usize, &str)> {
        let mut v: Vec<_> = self
            .ids()
            .into_iter()
            .filter_map(|id| match &self.node(id).op {
                Op::Input { index, name } => Some((id, *index, name.as_str())),
                _ => None,
            })
            .collect();
        v.sort_by_key(|&(_, i, _)| i);
        v
    }

    /// Effect nodes (assign, assign_add), by id.
    pub fn effects(&self) -> Vec<NodeId> {
        self.ids().into_iter().filter(|&id| self.node(id).op.is_effect()).collect()
    }
}

/// Structural equality: the same nodes in id order (ids themselves may differ), with the same
/// ops, types, scopes and operands, and the same outputs.
impl PartialEq for Graph {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.ids(), other.ids());
        if self.name != other.name || a.len() != b.len() {
            return false;
        }
        let pos_a: HashMap<NodeId, usize> = a.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let pos_b: HashMap<NodeId, usize> = b.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let same_node = |x: NodeId, y: NodeId| {
            self.node(x) == other.node(y) && self.operands(x).iter().map(|o| pos_a[o]).eq(other.operands(y).iter().map(|o| pos_b[o]))
        };
        a.iter().zip(&b).all(|(&x, &y)| same_node(x, y)) && self.outputs.iter().map(|o| pos_a.get(o)).eq(other.outputs.iter().map(|o| pos_b.get(o)))
    }
}

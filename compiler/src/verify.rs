//! The verifier: checks a graph's invariants and reports every violation with its node.
//!
//! Invariants:
//! 1. Each node's incoming edges carry operand positions `0..n` exactly once.
//! 2. Each node has as many operands as its op's arity allows.
//! 3. Each non-leaf node's type equals the type inferred from its operands' types.
//! 4. The graph is acyclic.
//! 5. The graph has at least one output or effect, and every output is a live node.
//! 6. Parameter names are unique; input indices are distinct and cover `0..k`.
//! 7. The first operand of `assign`/`assign_add` is a parameter node, and each parameter is
//!    written at most once per graph (writes land when the graph finishes).
//!
//! [`verify`] runs after every pass in tests and debug builds.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::graph::{Graph, NodeId};
use crate::infer::infer;
use crate::op::Op;
use crate::print::print_annotated;

/// One broken invariant, at a node when it has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    pub node: Option<NodeId>,
    pub message: String,
}

/// All the errors found in one graph, with the graph printed and the errors attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyErrors {
    pub graph: String,
    pub errors: Vec<VerifyError>,
    pub listing: String,
}

impl fmt::Display for VerifyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph `{}` failed verification with {} error(s):", self.graph, self.errors.len())?;
        for e in &self.errors {
            match e.node {
                Some(n) => writeln!(f, "  {n}: {}", e.message)?,
                None => writeln!(f, "  {}", e.message)?,
            }
        }
        write!(f, "{}", self.listing)
    }
}

impl std::error::Error for VerifyErrors {}

/// Checks every invariant listed in the module doc; `Err` lists all violations.
pub fn verify(g: &Graph) -> Result<(), VerifyErrors> {
    let mut errs: Vec<VerifyError> = Vec::new();
    let mut at = |node: Option<NodeId>, message: String| errs.push(VerifyError { node, message });
    let mut param_names: HashMap<&str, NodeId> = HashMap::new();
    let mut input_indices: HashMap<usize, NodeId> = HashMap::new();
    let mut written: HashSet<NodeId> = HashSet::new();
    for id in g.ids() {
        let node = g.node(id);
        let ops = g.operands(id);
        let positions = g.operand_positions(id);
        if positions.iter().enumerate().any(|(i, &p)| p as usize != i) {
            at(Some(id), format!("operand positions {positions:?} are not 0..{}", positions.len()));
        }
        if !node.op.arity().accepts(ops.len()) {
            at(Some(id), format!("`{}` takes {} operands, has {}", node.op.name(), node.op.arity(), ops.len()));
            continue;
        }
        match &node.op {
            Op::Parameter { name } => {
                if let Some(prev) = param_names.insert(name, id) {
                    at(Some(id), format!("parameter `{name}` is already defined by {prev}"));
                }
            }
            Op::Input { index, .. } => {
                if let Some(prev) = input_indices.insert(*index, id) {
                    at(Some(id), format!("input index {index} is already used by {prev}"));
                }
            }
            Op::Assign | Op::AssignAdd => {
                let target = ops[0];
                if !matches!(g.node(target).op, Op::Parameter { .. }) {
                    at(Some(id), format!("`{}` must write a parameter, but operand 0 is {target}", node.op.name()));
                } else if !written.insert(target) {
                    at(Some(id), format!("parameter {target} is written more than once in one graph"));
                }
            }
            _ => {}
        }
        if !node.op.is_leaf() {
            let tys: Vec<_> = ops.iter().map(|&o| &g.node(o).ty).collect();
            match infer(&node.op, &tys) {
                Ok(t) if t == node.ty => {}
                Ok(t) => at(Some(id), format!("declared type {} but operands give {t}", node.ty)),
                Err(e) => at(Some(id), format!("`{}`: {e}", node.op.name())),
            }
        }
    }
    for i in 0..input_indices.len() {
        if !input_indices.contains_key(&i) {
            at(None, format!("inputs are numbered 0..{} but index {i} is missing", input_indices.len()));
        }
    }
    if let Err(n) = g.topo_order() {
        at(Some(n), "node is on a cycle".into());
    }
    if g.outputs().is_empty() && g.effects().is_empty() {
        at(None, "graph has no outputs and no effects: it computes nothing".into());
    }
    for &o in g.outputs() {
        if !g.contains(o) {
            at(None, format!("output {o} is not a node of the graph"));
        }
    }
    if errs.is_empty() {
        return Ok(());
    }
    let listing = print_annotated(g, &errs);
    Err(VerifyErrors { graph: g.name.clone(), errors: errs, listing })
}

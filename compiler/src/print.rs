//! The text format, printing side: one equation per line, typed binders, sorted attributes.
//!
//! ```text
//! graph lenet5 {
//!   %0: f32[32,1,32,32] = input {index=0, name="data"}  # net
//!   %1: f32[6,1,5,5] = parameter {name="conv1.weight"}  # net.conv1
//!   %2: f32[32,6,28,28] = conv2d(%0, %1) {dilation=[1,1], groups=1, pad=[0,0,0,0], pad_mode=valid, stride=[1,1]}  # net.conv1
//!   return %2
//! }
//! ```
//! Nodes print in topological order (smallest id first). [`crate::parse::parse`] reads it back.

use std::fmt::Write;

use crate::graph::{Graph, NodeId};
use crate::verify::VerifyError;

/// One node's equation, without indentation or newline.
pub fn node_line(g: &Graph, id: NodeId) -> String {
    let n = g.node(id);
    let mut s = format!("{id}: {} = {}", n.ty, n.op.name());
    let ops = g.operands(id);
    if !ops.is_empty() {
        let list: Vec<String> = ops.iter().map(|o| o.to_string()).collect();
        write!(s, "({})", list.join(", ")).unwrap();
    }
    let attrs = n.op.attrs();
    if !attrs.is_empty() {
        let list: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        write!(s, " {{{}}}", list.join(", ")).unwrap();
    }
    if !n.scope.is_empty() {
        write!(s, "  # {}", n.scope).unwrap();
    }
    s
}

fn order(g: &Graph) -> Vec<NodeId> {
    g.topo_order().unwrap_or_else(|_| g.ids())
}

/// Prints a graph in the round-trip text format.
pub fn print(g: &Graph) -> String {
    print_annotated(g, &[])
}

/// Prints a graph with verifier errors attached under the nodes they concern.
pub fn print_annotated(g: &Graph, errors: &[VerifyError]) -> String {
    let mut s = format!("graph {} {{\n", g.name);
    for id in order(g) {
        writeln!(s, "  {}", node_line(g, id)).unwrap();
        for e in errors.iter().filter(|e| e.node == Some(id)) {
            writeln!(s, "  ; error: {}", e.message).unwrap();
        }
    }
    let outs: Vec<String> = g.outputs().iter().map(|o| o.to_string()).collect();
    writeln!(s, "  return {}", outs.join(", ")).unwrap();
    s.push_str("}\n");
    s
}

/// Prints several graphs, separated by a blank line.
pub fn print_many<'a>(gs: impl IntoIterator<Item = &'a Graph>) -> String {
    gs.into_iter().map(print).collect::<Vec<_>>().join("\n")
}

//! Graph dumps, MindSpore's `save_graphs`: one file per compiler pass for every graph.
//!
//! Files are named `NN_<pass>_<graph>.<ext>` (`NN` is the pass's place in the graph's
//! pipeline) and written to the dump directory:
//! - level 1: `.ir`, the round-trip text format ([`crate::print`]);
//! - level 2: also `.json` (schema below);
//! - level 3: also `.dot` (Graphviz), with one cluster per phase.
//!
//! The JSON schema, `cellgraph.graph/1`:
//! ```text
//! { "schema": "cellgraph.graph/1", "graph": "micro_step", "pass": "dce",
//!   "nodes": [ { "id": 3, "op": "conv2d", "operands": [0, 1],
//!                "attrs": { "stride": "[1,1]", ... },       // values as the text format prints them
//!                "type": { "dtype": "f32", "shape": [32, 6, 28, 28] },
//!                "scope": "net.conv1", "phase": "forward" } ],
//!   "outputs": [25] }
//! ```
//! Nodes are in topological order. `phase` is derived from the scope: `backward` (scopes under
//! `Gradients/`), `accumulate`, `optimizer`, `clear`, otherwise `forward`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::graph::{Graph, NodeId};

/// Where and how much to dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpOptions {
    /// 1: `.ir`; 2: also `.json`; 3: also `.dot`. 0 dumps nothing.
    pub level: u8,
    pub dir: PathBuf,
}

impl DumpOptions {
    /// MindSpore's `MS_DEV_SAVE_GRAPHS` at the edge of a program: `CELLGRAPH_SAVE_GRAPHS=<level>`
    /// and `CELLGRAPH_SAVE_GRAPHS_PATH=<dir>` (default `graphs`). `None` when unset or 0; an
    /// error message for a level that is not 0-3.
    pub fn from_env() -> Result<Option<DumpOptions>, String> {
        let Ok(level) = std::env::var("CELLGRAPH_SAVE_GRAPHS") else { return Ok(None) };
        let level: u8 = match level.trim().parse() {
            Ok(l @ 0..=3) => l,
            _ => return Err(format!("CELLGRAPH_SAVE_GRAPHS={level}: expected a level 0-3 (1: .ir, 2: also .json, 3: also .dot)")),
        };
        let dir = std::env::var_os("CELLGRAPH_SAVE_GRAPHS_PATH").map_or_else(|| PathBuf::from("graphs"), PathBuf::from);
        Ok((level > 0).then_some(DumpOptions { level, dir }))
    }

    /// The same options writing under `rank_<rank>/` (multi-rank runs).
    pub fn for_rank(&self, rank: usize) -> DumpOptions {
        DumpOptions { level: self.level, dir: self.dir.join(format!("rank_{rank}")) }
    }
}

/// The phase a node belongs to, from its scope.
pub fn phase(scope: &str) -> &'static str {
    if scope.starts_with("Gradients/") {
        "backward"
    } else if scope.starts_with("accumulate") {
        "accumulate"
    } else if scope.starts_with("optimizer") {
        "optimizer"
    } else if scope.starts_with("clear") {
        "clear"
    } else {
        "forward"
    }
}

fn order(g: &Graph) -> Vec<NodeId> {
    g.topo_order().unwrap_or_else(|_| g.ids())
}

/// The graph as JSON (schema `cellgraph.graph/1`, see the module docs).
pub fn to_json(g: &Graph, pass: &str) -> Value {
    let nodes: Vec<Value> = order(g)
        .into_iter()
        .map(|id| {
            let n = g.node(id);
            let attrs: serde_json::Map<String, Value> =
                n.op.attrs()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), Value::String(if let crate::op::Attr::Str(s) = v { s } else { v.to_string() })))
                    .collect();
            json!({
                "id": id.index(),
                "op": n.op.name(),
                "operands": g.operands(id).iter().map(|o| o.index()).collect::<Vec<_>>(),
                "attrs": attrs,
                "type": { "dtype": n.ty.dtype.to_string(), "shape": n.ty.dims() },
                "scope": n.scope,
                "phase": phase(&n.scope),
            })
        })
        .collect();
    json!({
        "schema": "cellgraph.graph/1",
        "graph": g.name,
        "pass": pass,
        "nodes": nodes,
        "outputs": g.outputs().iter().map(|o| o.index()).collect::<Vec<_>>(),
    })
}

fn dot_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// The graph in Graphviz's DOT language: one cluster per phase, nodes labelled with their
/// id, op and type, edges from operands to users (labelled with the operand position when an
/// op takes more than one).
pub fn to_dot(g: &Graph) -> String {
    let mut s = format!("digraph \"{}\" {{\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n", dot_escape(&g.name));
    let ids = order(g);
    for ph in ["forward", "backward", "accumulate", "optimizer", "clear"] {
        let members: Vec<NodeId> = ids.iter().copied().filter(|&id| phase(&g.node(id).scope) == ph).collect();
        if members.is_empty() {
            continue;
        }
        writeln!(s, "  subgraph cluster_{ph} {{\n    label=\"{ph}\";").unwrap();
        for id in members {
            let n = g.node(id);
            let extra = match &n.op {
                crate::op::Op::Parameter { name } | crate::op::Op::Input { name, .. } => format!(" {name}"),
                _ => String::new(),
            };
            writeln!(s, "    n{} [label=\"{id} {}{}\\n{}\\n{}\"];", id.index(), n.op.name(), dot_escape(&extra), n.ty, dot_escape(&n.scope)).unwrap();
        }
        s.push_str("  }\n");
    }
    for id in &ids {
        let ops = g.operands(*id);
        for (k, o) in ops.iter().enumerate() {
            let label = if ops.len() > 1 { format!(" [label=\"{k}\"]") } else { String::new() };
            writeln!(s, "  n{} -> n{}{label};", o.index(), id.index()).unwrap();
        }
    }
    s.push_str("}\n");
    s
}

/// The file stem `NN_<pass>_<graph>`.
pub fn file_stem(seq: usize, pass: &str, graph: &str) -> String {
    format!("{seq:02}_{pass}_{graph}")
}

/// Writes the dumps of one pass of one graph; returns the files written.
pub fn write(opts: &DumpOptions, seq: usize, pass: &str, g: &Graph) -> std::io::Result<Vec<PathBuf>> {
    if opts.level == 0 {
        return Ok(Vec::new());
    }
    std::fs::create_dir_all(&opts.dir)?;
    let stem = file_stem(seq, pass, &g.name);
    let mut files = vec![(opts.dir.join(format!("{stem}.ir")), crate::print(g))];
    if opts.level >= 2 {
        let text = serde_json::to_string_pretty(&to_json(g, pass)).expect("JSON values serialise");
        files.push((opts.dir.join(format!("{stem}.json")), text + "\n"));
    }
    if opts.level >= 3 {
        files.push((opts.dir.join(format!("{stem}.dot")), to_dot(g)));
    }
    for (path, text) in &files {
        write_file(path, text)?;
    }
    Ok(files.into_iter().map(|(p, _)| p).collect())
}

fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::write(path, text).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

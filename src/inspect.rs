//! `cellgraph inspect`: questions users ask of graph dumps (see `cellgraph_compiler::dump`).
//!
//! - `inspect DIR`: the graphs and passes found, with node counts, parameter bytes, FLOPs and
//!   the planned peak memory of each; on the root of a multi-rank dump (`rank_0/`, `rank_1/`,
//!   ...), the rank directories and their dumps;
//! - `inspect FILE [--op OP] [--scope PREFIX] [--stats]`: one graph, filtered, or its op histogram;
//! - `inspect diff A B`: nodes added, removed and rewritten between two dumps;
//! - `inspect render FILE -o OUT.svg`: a picture, through Graphviz's `dot`;
//! - `inspect check FILE`: parse and verify a (hand-edited) dump; every error is
//!   `FILE:LINE:COLUMN: message`, the verifier's at the offending node's equation;
//! - `inspect plan FILE [--unbound]`: the dump compiled into a plan, each step with what it
//!   runs on the CPU (its bound kernel, or burn's ops and why).
//!
//! Every listing has a `--json` form for scripts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{Args, Subcommand};
use serde_json::json;

use cellgraph::compiler::print::node_line;
use cellgraph::compiler::{cost, dump, parse, verify, Graph, NodeId, Op};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Arguments of `cellgraph inspect`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct InspectArgs {
    #[command(subcommand)]
    cmd: Option<InspectCmd>,
    /// A dump directory (lists its graphs) or one `.ir` dump (prints it).
    path: Option<PathBuf>,
    /// Only nodes of this op (`conv2d`, `assign_add`, ...).
    #[arg(long)]
    op: Option<String>,
    /// Only nodes whose scope starts with this (`net.fc1`, `Gradients/`, `optimizer`).
    #[arg(long)]
    scope: Option<String>,
    /// An op histogram instead of the nodes.
    #[arg(long)]
    stats: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum InspectCmd {
    /// What changed between two dumps: nodes added, removed and rewritten (matched by id).
    Diff {
        a: PathBuf,
        b: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Renders a dump as SVG through Graphviz (`dot`), one cluster per phase.
    Render {
        file: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Parses and verifies a dump; errors carry file, line and column.
    Check { file: PathBuf },
    /// Compiles a dump into a plan and lists what each step runs on the CPU: its bound
    /// kernel, or why it runs on burn's ops.
    Plan {
        file: PathBuf,
        /// Only the steps that run on burn's ops, and the count.
        #[arg(long)]
        unbound: bool,
        #[arg(long)]
        json: bool,
        /// The backend to bind the plan for: `cpu` (the host kernels), `wgpu`, `cuda`,
        /// `cuda:N` or `auto`, as `cellgraph train --device`.
        #[arg(long, default_value = "cpu")]
        device: String,
    },
}

/// Runs `cellgraph inspect`.
pub fn run(args: InspectArgs) -> Res<()> {
    match (args.cmd, &args.path) {
        (Some(InspectCmd::Diff { a, b, json }), _) => diff(&load(&a)?, &load(&b)?, json),
        (Some(InspectCmd::Render { file, output }), _) => render(&load(&file)?, &output),
        (Some(InspectCmd::Check { file }), _) => check(&file),
        (Some(InspectCmd::Plan { file, unbound, json, device }), _) => plan(&file, unbound, json, &device),
        (None, Some(p)) if p.is_dir() => {
            if args.op.is_some() || args.scope.is_some() || args.stats {
                return Err(format!("{}: --op, --scope and --stats apply to one .ir dump, not a directory", p.display()).into());
            }
            list(p, args.json)
        }
        (None, Some(p)) => show(&load(p)?, args.op.as_deref(), args.scope.as_deref(), args.stats, args.json),
        (None, None) => Err("give a dump directory or file (cellgraph inspect --help)".into()),
    }
}

/// Reads and parses one `.ir` dump.
fn load(path: &Path) -> Res<Graph> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if path.extension().is_some_and(|e| e != "ir") {
        return Err(format!("{}: not a .ir dump (the .json and .dot twins are for other tools)", path.display()).into());
    }
    parse(&text).map_err(|e| format!("{}:{}:{}: {}", path.display(), e.line, e.col, e.message).into())
}

/// One row of `inspect DIR`.
fn summary(path: &Path, g: &Graph) -> Res<serde_json::Value> {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    let pass = stem.split_once('_').map_or("", |(_, rest)| rest.strip_suffix(&format!("_{}", g.name)).unwrap_or(rest));
    let peak = cellgraph::runtime::compile(g.clone()).map(|e| e.peak_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(json!({
        "file": path.file_name().and_then(|s| s.to_str()).unwrap_or_default(),
        "graph": g.name,
        "pass": pass,
        "nodes": g.len(),
        "parameter_bytes": cost::parameter_bytes(g),
        "flops": cost::flops(g),
        "peak_bytes": peak,
    }))
}

/// The `.ir` files directly in `dir`, sorted.
fn ir_files(dir: &Path) -> Res<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "ir"))
        .collect();
    files.sort();
    Ok(files)
}

/// The `rank_<id>/` subdirectories of a multi-rank dump with their dump counts, by rank.
fn rank_dirs(dir: &Path) -> Res<Vec<(usize, PathBuf, usize)>> {
    let mut ranks = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?.filter_map(Result::ok) {
        let name = entry.file_name();
        let rank = name.to_str().and_then(|n| n.strip_prefix("rank_")).and_then(|r| r.parse::<usize>().ok());
        if let (Some(rank), true) = (rank, entry.path().is_dir()) {
            ranks.push((rank, entry.path(), ir_files(&entry.path())?.len()));
        }
    }
    ranks.sort();
    Ok(ranks)
}

/// The root of a multi-rank dump: one row per `rank_<id>/`.
fn list_ranks(dir: &Path, ranks: &[(usize, PathBuf, usize)], as_json: bool) -> Res<()> {
    if as_json {
        let rows: Vec<_> = ranks.iter().map(|(r, p, n)| json!({ "rank": r, "dir": p.file_name().and_then(|s| s.to_str()), "dumps": n })).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("{}: a multi-rank dump, {} rank(s)", dir.display(), ranks.len());
    for (_, p, n) in ranks {
        println!("  {:<12} {n:>4} dumps", format!("{}/", p.file_name().and_then(|s| s.to_str()).unwrap_or_default()));
    }
    println!("inspect one rank: cellgraph inspect {}", ranks[0].1.display());
    Ok(())
}

fn list(dir: &Path, as_json: bool) -> Res<()> {
    let files = ir_files(dir)?;
    if files.is_empty() {
        let ranks = rank_dirs(dir)?;
        if !ranks.is_empty() {
            return list_ranks(dir, &ranks, as_json);
        }
        return Err(format!("{}: no .ir dumps here (write some with CELLGRAPH_SAVE_GRAPHS=1 or Model::save_graphs)", dir.display()).into());
    }
    let rows = files.iter().map(|p| summary(p, &load(p)?)).collect::<Res<Vec<_>>>()?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("{:<40} {:<16} {:<20} {:>6} {:>12} {:>14} {:>12}", "file", "graph", "pass", "nodes", "param bytes", "flops", "peak bytes");
    for r in rows {
        println!(
            "{:<40} {:<16} {:<20} {:>6} {:>12} {:>14} {:>12}",
            r["file"].as_str().unwrap_or_default(),
            r["graph"].as_str().unwrap_or_default(),
            r["pass"].as_str().unwrap_or_default(),
            r["nodes"].as_u64().unwrap_or_default(),
            r["parameter_bytes"].as_u64().unwrap_or_default(),
            r["flops"].as_u64().unwrap_or_default(),
            r["peak_bytes"].as_u64().unwrap_or_default()
        );
    }
    Ok(())
}

/// Every op name of the text format, sorted.
fn op_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Op::examples().iter().map(Op::name).collect();
    names.sort_unstable();
    names
}

fn show(g: &Graph, op: Option<&str>, scope: Option<&str>, stats: bool, as_json: bool) -> Res<()> {
    if let Some(o) = op.filter(|o| !op_names().contains(o)) {
        return Err(format!("--op {o}: no such op; the ops are {}", op_names().join(", ")).into());
    }
    let order = g.topo_order().map_err(|id| format!("graph `{}` has a cycle through {id}", g.name))?;
    let keep = |id: &NodeId| {
        let n = g.node(*id);
        op.is_none_or(|o| n.op.name() == o) && scope.is_none_or(|s| n.scope.starts_with(s))
    };
    let picked: Vec<NodeId> = order.into_iter().filter(keep).collect();
    if stats {
        let mut hist: BTreeMap<&str, usize> = BTreeMap::new();
        for id in &picked {
            *hist.entry(g.node(*id).op.name()).or_default() += 1;
        }
        if as_json {
            println!("{}", serde_json::to_string_pretty(&hist)?);
        } else {
            for (op, n) in hist {
                println!("{op:<28} {n:>6}");
            }
        }
        return Ok(());
    }
    if as_json {
        let all = dump::to_json(g, "");
        let ids: Vec<usize> = picked.iter().map(|id| id.index()).collect();
        let nodes: Vec<&serde_json::Value> =
            all["nodes"].as_array().into_iter().flatten().filter(|n| n["id"].as_u64().is_some_and(|i| ids.contains(&(i as usize)))).collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "graph": g.name, "nodes": nodes }))?);
        return Ok(());
    }
    println!("graph {} ({} of {} nodes)", g.name, picked.len(), g.len());
    for id in picked {
        println!("  {}", node_line(g, id));
    }
    Ok(())
}

fn diff(a: &Graph, b: &Graph, as_json: bool) -> Res<()> {
    let lines = |g: &Graph| -> BTreeMap<usize, String> { g.ids().into_iter().map(|id| (id.index(), node_line(g, id))).collect() };
    let (la, lb) = (lines(a), lines(b));
    let removed: Vec<&String> = la.iter().filter(|(k, _)| !lb.contains_key(k)).map(|(_, v)| v).collect();
    let added: Vec<&String> = lb.iter().filter(|(k, _)| !la.contains_key(k)).map(|(_, v)| v).collect();
    let rewritten: Vec<(&String, &String)> = la.iter().filter_map(|(k, v)| lb.get(k).filter(|w| *w != v).map(|w| (v, w))).collect();
    if as_json {
        let rw: Vec<_> = rewritten.iter().map(|(x, y)| json!({ "before": x, "after": y })).collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "added": added, "removed": removed, "rewritten": rw }))?);
        return Ok(());
    }
    println!("{} -> {}: {} added, {} removed, {} rewritten", a.name, b.name, added.len(), removed.len(), rewritten.len());
    for l in &removed {
        println!("- {l}");
    }
    for l in &added {
        println!("+ {l}");
    }
    for (x, y) in &rewritten {
        println!("~ {x}\n  -> {y}");
    }
    Ok(())
}

fn render(g: &Graph, output: &Path) -> Res<()> {
    let dot = std::env::temp_dir().join(format!("cellgraph-render-{}.dot", std::process::id()));
    std::fs::write(&dot, dump::to_dot(g)).map_err(|e| format!("{}: {e}", dot.display()))?;
    let result = Command::new("dot").arg("-Tsvg").arg(&dot).arg("-o").arg(output).output();
    let _ = std::fs::remove_file(&dot);
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err("Graphviz's `dot` is not installed: apt-get install graphviz (or brew install graphviz), then re-run".into())
        }
        Err(e) => Err(format!("running dot: {e}").into()),
        Ok(o) if !o.status.success() => Err(format!("dot failed: {}", String::from_utf8_lossy(&o.stderr)).into()),
        Ok(_) => {
            println!("wrote {}", output.display());
            Ok(())
        }
    }
}

/// Line and column (1-based) of each equation `%N: ...` in a dump's text, by value id.
fn equation_places(text: &str) -> BTreeMap<usize, (usize, usize)> {
    let mut places = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let body = line.trim_start();
        let id = body.strip_prefix('%').and_then(|r| r.split_once(':')).and_then(|(n, _)| n.trim().parse::<usize>().ok());
        if let Some(id) = id {
            places.insert(id, (i + 1, line.len() - body.len() + 1));
        }
    }
    places
}

fn check(path: &Path) -> Res<()> {
    let g = load(path)?;
    let Err(errs) = verify(&g) else {
        println!("{}: graph {} is valid ({} nodes)", path.display(), g.name, g.len());
        return Ok(());
    };
    // The parser keeps the ids as written, so a node's id finds its line.
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let places = equation_places(&text);
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for e in &errs.errors {
        match e.node.and_then(|n| places.get(&n.index())) {
            Some(&(line, col)) => out.push(format!("{}:{line}:{col}: {}\n    {}", path.display(), e.message, lines[line - 1].trim())),
            None => out.push(format!("{}: {}", path.display(), e.message)),
        }
    }
    Err(format!("graph `{}` failed verification with {} error(s):\n{}", errs.graph, errs.errors.len(), out.join("\n")).into())
}

/// What a session on a device binds each step of a plan to.
struct Steps<'a>(&'a cellgraph::runtime::Executable);

impl cellgraph::runtime::device::OnDevice for Steps<'_> {
    type Output = Vec<cellgraph::runtime::HostStep>;
    fn run<B: cellgraph::runtime::Backend>(self, device: cellgraph::runtime::burn_backend::tensor::Device<B>) -> Self::Output {
        cellgraph::runtime::Session::<B>::new(device).steps(self.0)
    }
}

/// `inspect plan FILE`: compiles the dump (the same pipeline as training) and lists each step
/// with what it runs on `device`'s backend; a summary line counts them.
fn plan(path: &Path, unbound: bool, json: bool, device: &str) -> Res<()> {
    use cellgraph::runtime::HostRun;
    let g = load(path)?;
    let exe = cellgraph::runtime::compile(g).map_err(|e| format!("{}: {e}", path.display()))?;
    let (spec, msg) = cellgraph::runtime::device::choose(device, 0)?;
    let host = spec == cellgraph::runtime::device::DeviceSpec::Cpu;
    if !host {
        eprintln!("{msg}");
    }
    let on = if host { "host kernels" } else { "the device's kernels" };
    let steps = cellgraph::runtime::device::dispatch(spec, Steps(&exe))?;
    let on_burn = steps.iter().filter(|s| matches!(s.run, HostRun::BurnOps(_))).count();
    let kernels = steps.iter().filter(|s| matches!(s.run, HostRun::Kernel(_))).count();
    let shown: Vec<_> = steps.iter().filter(|s| !unbound || matches!(s.run, HostRun::BurnOps(_))).collect();
    if json {
        let rows: Vec<serde_json::Value> = shown
            .iter()
            .map(|s| {
                let (kind, detail) = match &s.run {
                    HostRun::Kernel(k) => ("kernel", k.clone()),
                    HostRun::BurnOps(why) => ("burn_ops", why.clone()),
                    HostRun::Source => ("source", String::new()),
                    HostRun::Reshape => ("reshape", String::new()),
                    HostRun::AccumulateInPlace => ("assign_add_in_place", String::new()),
                    HostRun::Collective => ("collective", String::new()),
                    HostRun::Store => ("store", String::new()),
                    HostRun::Identity => ("identity", String::new()),
                    HostRun::RoundedWhenPacked => ("rounded_when_packed", String::new()),
                    HostRun::RoundedInProducer => ("rounded_in_producer", String::new()),
                    HostRun::SummedInProducer => ("summed_in_producer", String::new()),
                };
                json!({"node": s.node, "op": s.op, "type": s.ty.to_string(), "scope": s.scope, "runs": kind, "detail": detail})
            })
            .collect();
        println!("{}", json!({"graph": exe.graph().name, "steps": steps.len(), "kernels": kernels, "burn_ops": on_burn, "list": rows}));
        return Ok(());
    }
    for s in shown {
        println!("{s}");
    }
    println!("{}: {} steps, {kernels} on {on}, {on_burn} on burn's ops", exe.graph().name, steps.len());
    Ok(())
}

//! The runtime's structure, read from its source: no import circles between its modules, no
//! file over 800 lines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use petgraph::algo::tarjan_scc;
use petgraph::graph::DiGraph;

/// Every module of `runtime/src` (`host::conv`, `exec`; the crate root is ``) and its source
/// up to its unit tests, without comments.
fn runtime_modules() -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).expect("runtime/src is readable") {
            let p = e.expect("a directory entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime/src");
    let mut files = Vec::new();
    walk(&root, &mut files);
    files
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(&root).expect("under runtime/src").with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            let src = std::fs::read_to_string(&p).expect("a readable source file");
            let code = src.split("#[cfg(test)]").next().unwrap_or_default();
            let code: Vec<&str> = code.lines().filter(|l| !l.trim_start().starts_with("//")).collect();
            (parts.join("::"), code.join("\n"))
        })
        .collect()
}

/// The modules `src` (module `at`) names through `crate::` and `super::` paths: for each path,
/// the longest known module it starts with.
fn imports(at: &str, src: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let here: Vec<&str> = if at.is_empty() { Vec::new() } else { at.split("::").collect() };
    let mut out = BTreeSet::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut rest = src;
    while let Some(i) = rest.find(['c', 's']) {
        let tail = &rest[i..];
        let boundary = i == 0 || !rest[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let path: String = tail.chars().take_while(|&c| ident(c)).collect();
        rest = &tail[path.len().max(1)..];
        if !boundary {
            continue;
        }
        let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
        let base: Vec<&str> = match segs.first() {
            Some(&"crate") => {
                segs.remove(0);
                Vec::new()
            }
            Some(&"super") => {
                let ups = segs.iter().take_while(|s| **s == "super").count();
                segs.drain(..ups);
                here[..here.len().saturating_sub(ups)].to_vec()
            }
            _ => continue,
        };
        let full: Vec<&str> = base.into_iter().chain(segs).collect();
        if let Some(m) = (1..=full.len()).rev().map(|n| full[..n].join("::")).find(|m| known.contains(m)) {
            out.insert(m);
        }
    }
    out
}

/// No two modules of the runtime import each other, directly or around a longer circle, at
/// any depth of the module tree (`host` and `backend`; `host::conv` and `host::toeplitz`,
/// `data::dataset` and `data::mnist`). A module and its own parent or child may name each other.
#[test]
fn the_runtime_has_no_import_circles() {
    let modules = runtime_modules();
    let known: BTreeSet<String> = modules.keys().cloned().collect();
    assert!(known.contains("exec") && known.contains("host::conv"), "runtime modules: {known:?}");
    let edges: Vec<(String, String)> = modules.iter().flat_map(|(m, src)| imports(m, src, &known).into_iter().map(move |t| (m.clone(), t))).collect();
    assert!(edges.contains(&("exec".into(), "arena".into())), "the import reader finds `use crate::arena::Arena` in exec.rs");
    for depth in 1..=3 {
        let cut = |m: &str| m.split("::").take(depth).collect::<Vec<_>>().join("::");
        let mut g = DiGraph::<String, ()>::new();
        let mut nodes = BTreeMap::new();
        for (a, b) in edges.iter().map(|(a, b)| (cut(a), cut(b))) {
            let related = a == b || a.is_empty() || b.is_empty() || a.starts_with(&format!("{b}::")) || b.starts_with(&format!("{a}::"));
            if !related {
                let [a, b] = [a, b].map(|m| *nodes.entry(m.clone()).or_insert_with(|| g.add_node(m)));
                g.update_edge(a, b, ());
            }
        }
        let circles: Vec<Vec<&String>> = tarjan_scc(&g).into_iter().filter(|c| c.len() > 1).map(|c| c.into_iter().map(|n| &g[n]).collect()).collect();
        assert!(circles.is_empty(), "modules importing each other (depth {depth}): {circles:?}");
    }
}

/// No file of the runtime is a drawer: each holds one kernel family or one part of running
/// plans, at most 800 lines with its unit tests (a longer one is split by family, as
/// `host/reads.rs` from `host/program.rs`, `cube/update.rs` from `cube/mod.rs`).
#[test]
fn no_runtime_file_is_over_800_lines() {
    fn walk(dir: &Path, out: &mut Vec<(String, usize)>) {
        for e in std::fs::read_dir(dir).expect("runtime/src is readable") {
            let p = e.expect("a directory entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let lines = std::fs::read_to_string(&p).expect("a readable source file").lines().count();
                out.push((p.display().to_string(), lines));
            }
        }
    }
    let mut files = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime/src"), &mut files);
    assert!(files.len() > 40, "runtime files: {files:?}");
    let long: Vec<&(String, usize)> = files.iter().filter(|(_, n)| *n > 800).collect();
    assert!(long.is_empty(), "files over 800 lines: {long:?}");
}

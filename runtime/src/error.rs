//! The runtime's one error type.

use thiserror::Error;

use cellgraph_compiler::IrError;

/// Everything that can go wrong while compiling or running a graph, or reading data.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// A cell's configuration or trace is invalid.
    #[error(transparent)]
    Cells(#[from] cellgraph_cells::CellError),
    /// The graph itself is invalid.
    #[error(transparent)]
    Ir(#[from] IrError),
    /// A value passed in does not fit the graph.
    #[error("{what}: expected {expected}, got {got}")]
    Mismatch { what: String, expected: String, got: String },
    /// A parameter the graph reads has no value.
    #[error("parameter `{0}` has no value: initialise it (Session::init_params) or load a checkpoint")]
    MissingParam(String),
    /// An input outside the op's domain (for example a label out of range).
    #[error("{scope}: {op}: {detail}")]
    BadValue { scope: String, op: &'static str, detail: String },
    /// The op or dtype cannot run on this backend.
    #[error("{scope}: {op}: {detail}")]
    Unsupported { scope: String, op: &'static str, detail: String },
    /// A setting or input that cannot work, found before anything ran (`what` names it:
    /// the rank, the dataset, the file).
    #[error("{what}: {detail}")]
    Invalid { what: String, detail: String },
    /// A malformed data file.
    #[error("{path}: at byte offset {offset}: {detail}")]
    Data { path: String, offset: u64, detail: String },
    /// A communicator failed or the ranks disagree.
    #[error("{0}")]
    Comm(String),
    /// The requested device cannot be used.
    #[error("{0}")]
    Device(String),
    /// An I/O failure on a named file.
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
}

/// Result with [`RuntimeError`].
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Up to eight names of a list, and how many more: `a, b, c` or `a, ..., h and 4 more`.
pub(crate) fn listed(v: &[String]) -> String {
    let shown: Vec<&str> = v.iter().take(8).map(String::as_str).collect();
    let more = if v.len() > 8 { format!(" and {} more", v.len() - 8) } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

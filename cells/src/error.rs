//! The Cell API's one error type.

use thiserror::Error;

use cellgraph_compiler::IrError;

/// Errors raised while building or tracing cells.
#[derive(Debug, Error)]
pub enum CellError {
    /// The traced graph is ill-typed (the message names the Cell path and shapes).
    #[error(transparent)]
    Ir(#[from] IrError),
    /// A cell was called with the wrong number of inputs.
    #[error("{cell}: construct takes {expected} input(s), got {got}")]
    Inputs { cell: String, expected: usize, got: usize },
    /// A bad constructor argument.
    #[error("{cell}: {detail}")]
    Config { cell: String, detail: String },
}

/// Result with [`CellError`].
pub type Result<T, E = CellError> = std::result::Result<T, E>;

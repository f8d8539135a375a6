//! The compiler's one error type, grouped by category.

use thiserror::Error;

use crate::graph::NodeId;
use crate::parse::ParseError;
use crate::verify::VerifyErrors;

/// Everything that can go wrong while building, parsing, verifying or transforming a graph.
#[derive(Debug, Error)]
pub enum IrError {
    /// Operand types do not fit the op (shape or dtype mismatch).
    #[error("{scope}: {op}: {detail}")]
    Type { scope: String, op: &'static str, detail: String },
    /// Wrong number of operands.
    #[error("{scope}: {op} takes {expected} operands, got {got}")]
    Arity { scope: String, op: &'static str, expected: String, got: usize },
    /// A node id that is not in the graph.
    #[error("node {0} is not in the graph")]
    UnknownNode(NodeId),
    /// A leaf was built through the inferring path or the reverse.
    #[error("{scope}: {op}: {detail}")]
    Misuse { scope: String, op: &'static str, detail: String },
    /// Text that is not a valid graph.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// A graph that breaks the verifier's invariants.
    #[error(transparent)]
    Verify(#[from] VerifyErrors),
    /// Differentiation reached an op without a gradient rule.
    #[error("{scope}: no gradient rule for op `{op}` (node {node}); it cannot be differentiated")]
    NoGradient { scope: String, op: &'static str, node: NodeId },
    /// A differentiation request that cannot be met.
    #[error("autodiff: {0}")]
    Autodiff(String),
}

/// Result with [`IrError`].
pub type Result<T, E = IrError> = std::result::Result<T, E>;

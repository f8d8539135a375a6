//! cellgraph's compiler: the graph IR and everything that transforms it.
//!
//! - [`types`]: element types, shapes, tensor types.
//! - [`op`]: the ops, declared once, with the one print/parse attribute table.
//! - [`graph`]: the graph on petgraph's `StableGraph`, typed ids, ordered operand edges.
//! - [`infer`]: shape/dtype inference; [`window`]: conv/pool window arithmetic.
//! - [`verify`]: the verifier and its invariants.
//! - [`print`] and [`parse`]: the round-trip text format.
//! - [`autodiff`]: graph-mode reverse-mode differentiation; [`emit`]: the node builder.
//! - [`program`]: elementwise programs, the one format of fused nodes, epilogues and optimizer updates.
//! - [`passes`]: named rewrites run by one pipeline that verifies after each.
//! - [`dump`]: per-pass graph dumps (`.ir`, `.json`, `.dot`).
#![warn(missing_docs)]
#![allow(missing_docs)] // enum variants and small helpers are documented where it matters

pub mod autodiff;
pub mod cost;
pub mod dump;
pub mod emit;
pub mod error;
pub mod graph;
pub mod infer;
pub mod op;
pub mod parse;
pub mod passes;
pub mod print;
pub mod program;
pub mod tensor;
pub mod types;
pub mod update;
pub mod verify;
pub mod window;

pub use autodiff::{grad, Gradients, Sens};
pub use error::{IrError, Result};
pub use graph::{Graph, Node, NodeId};
pub use op::{Attr, Conv2dAttrs, Op, PadMode, Pool2dAttrs, ReduceAttrs, Reduction};
pub use parse::{parse, parse_many, ParseError};
pub use print::{print, print_many};
pub use tensor::{HostData, HostTensor};
pub use types::{DType, Shape, TensorType};
pub use verify::{verify, VerifyError, VerifyErrors};

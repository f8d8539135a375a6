//! Parameters and the naming scope that gives them MindSpore names.
//!
//! A [`Scope`] is passed to each layer's constructor, like candle's `VarBuilder`: a child
//! stored in field `conv1` is built with `s.child("conv1")`, so its weight is named
//! `conv1.weight`; `SequentialCell` children are `0.`, `1.`, ...; wrappers add nothing.
//! Parameters are descriptions (name, type, initializer): cells never hold values. Values are
//! materialised later, deterministically from a seed ([`materialize`]), which is MindSpore's
//! `no_init_parameters()` behaviour, always on.

use cellgraph_compiler::{HostTensor, TensorType};

use crate::init::Initializer;

/// A named parameter of a cell.
#[derive(Clone, Debug, PartialEq)]
pub struct Parameter {
    /// Full MindSpore name, e.g. `fc1.weight`.
    pub name: String,
    pub ty: TensorType,
    pub init: Initializer,
    /// False for state that the optimizer does not train (MindSpore's `requires_grad=False`).
    pub requires_grad: bool,
}

impl Parameter {
    /// A trainable parameter.
    pub fn new(name: impl Into<String>, ty: TensorType, init: Initializer) -> Self {
        Parameter { name: name.into(), ty, init, requires_grad: true }
    }
    /// A copy under another name with another initializer (MindSpore's `clone(prefix, init)`),
    /// not trainable: accumulators and optimizer state.
    pub fn clone_as(&self, prefix: &str, init: Initializer) -> Self {
        Parameter { name: format!("{prefix}.{}", self.name), ty: self.ty.clone(), init, requires_grad: false }
    }
    /// Draws this parameter's first value.
    pub fn materialize(&self, seed: u64) -> HostTensor {
        self.init.materialize(&self.ty, &self.name, seed)
    }
}

/// Draws the first value of every parameter.
pub fn materialize(params: &[Parameter], seed: u64) -> Vec<(String, HostTensor)> {
    params.iter().map(|p| (p.name.clone(), p.materialize(seed))).collect()
}

/// The naming path of the cell being built.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    path: String,
}

impl Scope {
    /// The root: parameters directly on the network have bare names (`weight`).
    pub fn root() -> Self {
        Scope::default()
    }
    /// The scope of a child stored under `name`.
    pub fn child(&self, name: &str) -> Scope {
        if self.path.is_empty() {
            Scope { path: name.to_string() }
        } else {
            Scope { path: format!("{}.{name}", self.path) }
        }
    }
    /// The dotted path, empty at the root.
    pub fn path(&self) -> &str {
        &self.path
    }
    /// A parameter of this cell.
    pub fn param(&self, local: &str, ty: TensorType, init: Initializer) -> Parameter {
        Parameter::new(self.child(local).path, ty, init)
    }
}

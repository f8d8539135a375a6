//! Named graph rewrites, one file each, run by [`pipeline::run`] which verifies after every
//! pass in debug builds and tests.

pub mod dce;
pub mod epilogue;
pub mod fuse;
pub mod grad_accumulation;
pub mod pipeline;
pub mod precision;

/// What the passes' tests build graphs from.
#[cfg(test)]
pub(crate) mod testing {
    use crate::graph::{Graph, NodeId};
    use crate::op::Op;
    use crate::types::TensorType;

    /// An f32 parameter `name` of extents `dims`.
    pub fn leaf(g: &mut Graph, name: &str, dims: Vec<usize>) -> NodeId {
        g.add_leaf(Op::Parameter { name: name.into() }, TensorType::f32(dims), "t").unwrap()
    }
}

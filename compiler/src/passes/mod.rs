//! Named graph rewrites, one file each, run by [`pipeline::run`] which verifies after every
//! pass in debug builds and tests.

pub mod dce;
pub mod epilogue;
pub mod fuse;
pub mod grad_accumulation;
pub mod pipeline;

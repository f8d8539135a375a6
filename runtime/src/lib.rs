//! cellgraph's runtime: executes compiled graphs on a burn backend.
//!
//! - [`exec`]: compile a graph to a plan; a [`Session`] holds parameters and runs plans.
//! - [`backend`]: the backend interface plans run on (burn's, extended).
//! - [`kernel`]: the kernel each hot step is bound to when a plan is compiled.
//! - [`host`]: those kernels on host memory (the CPU backend).
//! - [`lower`]: the exhaustive op-to-backend lowering (burn's ops) for everything else.
//! - [`value`]: device values and host transfers.
//! - [`data`]: datasets (MNIST IDX files).
//! - `cube` (features `cuda`, `wgpu`): burn's cubecl backend and the runtime's own kernels;
//!   `launches`: counting the kernels a process launches on them.

pub mod accumulate;
pub mod arena;
pub mod backend;
pub mod callback;
pub mod checkpoint;
pub mod comm;
#[cfg(feature = "cube")]
pub mod cube;
pub mod data;
pub mod device;
pub mod error;
pub mod exec;
pub mod hf;
pub mod host;
// Not in release builds (no sharing there) nor in this crate's unit tests (nothing links them).
#[cfg(all(debug_assertions, not(test)))]
#[doc(hidden)]
pub mod instances;
pub mod kernel;
#[cfg(feature = "cube")]
pub mod launches;
pub mod lower;
pub mod model;
pub mod replay;
pub mod value;

pub use accumulate::{Accumulator, Counters, LoadReport, Place, SessionOptions};
pub use backend::Backend;
/// burn's backend API, for code generic over [`Backend`] (`Device<B>`, tensor primitives).
pub use burn_backend;
pub use callback::{Callback, CheckpointConfig, LossLog, LossMonitor, ModelCheckpoint, Position, ProgressBar, RunContext, TimeMonitor};
pub use cellgraph_compiler::passes::pipeline::PipelineOptions;
pub use data::{Dataset, TensorDataset};
pub use error::{Result, RuntimeError};
pub use exec::{
    compile, compile_unfused, compile_with, compile_with_options, Bf16Products, Bf16Unit, DumpAt, Executable, HostRun, HostStep, KeptF32, LowStorage,
    Session,
};
pub use host::join_thread_pool;
pub use model::{Metric, Model};
pub use value::Value;

/// The CPU backend: burn's ndarray backend. A session computes in f32, or in f64 for
/// reference runs and gradient checks ([`Session::new_f64`]).
#[allow(deprecated)]
pub type Cpu = burn_ndarray::NdArray;

/// The CPU device.
#[allow(deprecated)]
pub fn cpu() -> burn_ndarray::NdArrayDevice {
    burn_ndarray::NdArrayDevice::Cpu
}

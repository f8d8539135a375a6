//! The runtime's generic surface instantiated once, here, for every backend the build has.
//!
//! Builds below opt-level 2 (the dev and test profiles) share generic instances between crates:
//! a crate that needs `Model::<Cpu>::train` links the one its upstream crate compiled instead of
//! compiling its own. Without these roots the runtime crate compiles almost nothing itself, and
//! the CLI, each sample and the test binary each compile the executor, the kernels and burn's ops
//! for every backend again. Release builds (opt-level 3) do not share instances, so there the
//! module is left out (`debug_assertions` stands for the dev and test profiles).

use crate::{Accumulator, Backend, Model, Session};

/// The entry points whose instances (and everything they call) this crate compiles for `B`.
fn roots<B: Backend>() -> Vec<*const ()> {
    vec![
        Model::<B>::train as *const (),
        Model::<B>::eval as *const (),
        Model::<B>::save_checkpoint as *const (),
        Model::<B>::load_checkpoint_with as *const (),
        Model::<B>::restore_with as *const (),
        Model::<B>::snapshot as *const (),
        Accumulator::<B>::new as *const (),
        Accumulator::<B>::new_f64 as *const (),
        Accumulator::<B>::step as *const (),
        Accumulator::<B>::finish as *const (),
        Accumulator::<B>::step_loss as *const (),
        Accumulator::<B>::run as *const (),
        Accumulator::<B>::snapshot as *const (),
        Accumulator::<B>::restore_with as *const (),
        Accumulator::<B>::set_parallel as *const (),
        Session::<B>::new as *const (),
        Session::<B>::new_f64 as *const (),
        Session::<B>::run as *const (),
        Session::<B>::run_over as *const (),
        Session::<B>::run_device as *const (),
        Session::<B>::run_device_over as *const (),
        Session::<B>::run_replayed as *const (),
        Session::<B>::params_host as *const (),
        Session::<B>::param as *const (),
        Session::<B>::set_param as *const (),
        Session::<B>::set_graphs as *const (),
    ]
}

/// The CPU backend's roots.
#[doc(hidden)]
pub fn cpu_roots() -> usize {
    roots::<crate::Cpu>().len()
}

/// wgpu's roots.
#[cfg(feature = "wgpu")]
#[doc(hidden)]
pub fn wgpu_roots() -> usize {
    roots::<crate::cube::Wgpu>().len()
}

/// CUDA's roots.
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub fn cuda_roots() -> usize {
    roots::<crate::cube::Cuda>().len()
}

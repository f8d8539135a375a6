//! OpenMPI through the `mpi` crate.

use std::sync::atomic::{AtomicBool, Ordering};

use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::environment::Universe;
use mpi::topology::{Communicator as _, SimpleCommunicator};

use super::Communicator;
use crate::error::{Result, RuntimeError};

/// MPI_COMM_WORLD. MPI is initialised once per process, and finalised when this is dropped.
pub struct Mpi {
    world: SimpleCommunicator,
    _universe: Universe,
}

static INITIALISED: AtomicBool = AtomicBool::new(false);

impl Mpi {
    /// Initialises MPI and installs a panic hook that aborts the whole job (`MPI_Abort`), so
    /// a rank that panics takes every rank down instead of leaving them in a collective.
    pub fn init() -> Result<Mpi> {
        if INITIALISED.swap(true, Ordering::SeqCst) {
            return Err(RuntimeError::Comm("MPI is already initialised in this process: call comm::init() once".into()));
        }
        let universe = mpi::initialize().ok_or_else(|| RuntimeError::Comm("MPI_Init failed".into()))?;
        let world = universe.world();
        let rank = world.rank();
        // Ranks share the machine's cores: one compute thread each (the host kernels' chunks
        // run on rayon's pool) unless RAYON_NUM_THREADS says otherwise.
        if world.size() > 1 && std::env::var_os("RAYON_NUM_THREADS").is_none() {
            // Fails only when the pool already exists; it then keeps its size.
            let _ = rayon::ThreadPoolBuilder::new().num_threads(1).build_global();
        }
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            eprintln!("rank {rank}: panicked; aborting the MPI job");
            // SAFETY: MPI is initialised (the hook is installed after MPI_Init) and
            // MPI_Abort may be called from any state.
            unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101) };
        }));
        Ok(Mpi { world, _universe: universe })
    }
}

impl Communicator for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn size(&self) -> usize {
        self.world.size() as usize
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        self.world.reduce_scatter_block_into(send, recv, SystemOperation::sum());
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        self.world.all_gather_into(send, recv);
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) {
        self.world.all_gather_into(send, recv);
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) {
        self.world.process_at_rank(root as i32).broadcast_into(buf);
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) {
        self.world.process_at_rank(root as i32).broadcast_into(buf);
    }
    fn barrier(&self) {
        self.world.barrier();
    }
    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

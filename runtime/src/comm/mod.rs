//! Communicators: the collectives data-parallel training needs, over OpenMPI or in-process.
//!
//! [`Communicator`] is the whole interface: rank, size, sum all-reduce, sum reduce-scatter,
//! all-gather, broadcast, barrier and abort. Implementations:
//! - [`Solo`]: a world of one process (no communication at all);
//! - [`LocalGroup`]: `n` ranks as threads of one process, for tests;
//! - `Mpi` (feature `mpi`): OpenMPI through the `mpi` crate.
//!
//! [`init`] picks MPI when the process was started by `mpirun` and a world of one otherwise,
//! and installs a panic hook that aborts the whole MPI job, so a failing rank never leaves the
//! others waiting in a collective. [`agree`] compares a hash across ranks: start-up uses it
//! for the configuration, graphs and initial parameters.

mod local;
#[cfg(feature = "mpi")]
mod mpi;

use std::sync::Arc;

#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;
pub use local::LocalGroup;

use crate::error::{Result, RuntimeError};

/// The collectives of one process group. Buffers have equal lengths on every rank.
pub trait Communicator {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Sums `buf` element-wise across ranks, in place.
    fn all_reduce_sum(&self, buf: &mut [f32]);
    /// Sums `send` (`size` chunks of `recv.len()`) across ranks; rank `r` receives chunk `r`.
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]);
    /// Concatenates every rank's `send` into `recv`, in rank order.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]);
    /// Concatenates every rank's bytes `send` into `recv`, in rank order.
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]);
    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(&self, buf: &mut [f32], root: usize);
    /// Copies `root`'s bytes `buf` into every rank's `buf`.
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize);
    /// Waits until every rank arrives.
    fn barrier(&self);
    /// Ends every rank of the job with exit status `code`.
    fn abort(&self, code: i32) -> !;
}

/// A world of one process.
#[derive(Clone, Copy, Debug, Default)]
pub struct Solo;

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) {}
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(&send[..recv.len()]);
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) {
        recv.copy_from_slice(send);
    }
    fn broadcast(&self, _buf: &mut [f32], _root: usize) {}
    fn broadcast_bytes(&self, _buf: &mut [u8], _root: usize) {}
    fn barrier(&self) {}
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// True when this process was started by an MPI launcher (OpenMPI, or a PMI/PMIx one).
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"].iter().any(|v| std::env::var_os(v).is_some())
}

/// MindSpore's `init()`: the world communicator. Under `mpirun` it is MPI (which must be
/// compiled in: feature `mpi`); otherwise a world of one. Call it once per process.
pub fn init() -> Result<Arc<dyn Communicator>> {
    if !launched_by_mpirun() {
        return Ok(Arc::new(Solo));
    }
    #[cfg(feature = "mpi")]
    {
        // One rank's communicator, shared by the objects of its one training thread.
        #[allow(clippy::arc_with_non_send_sync)]
        let comm = Arc::new(Mpi::init()?);
        Ok(comm)
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(RuntimeError::Comm("started by mpirun, but this build has no MPI support: rebuild with `--features mpi`".into()))
    }
}

/// Checks that every rank holds the same `what` (compared by a 64-bit hash of `bytes`); the
/// error names the ranks that differ from rank 0.
pub fn agree(comm: &dyn Communicator, what: &str, bytes: &[u8]) -> Result<()> {
    let mine = fnv1a(bytes).to_le_bytes();
    let mut all = vec![0u8; 8 * comm.size()];
    comm.all_gather_bytes(&mine, &mut all);
    let hashes: Vec<&[u8]> = all.chunks(8).collect();
    let differ: Vec<usize> = (1..comm.size()).filter(|&r| hashes[r] != hashes[0]).collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(RuntimeError::Comm(format!(
        "rank {}: ranks {differ:?} have a different {what} than rank 0; every rank must run the same program with the same arguments",
        comm.rank()
    )))
}

/// FNV-1a, 64 bits: a stable hash for comparing configurations across processes.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Hands `root`'s bytes to every rank: the length first, then the bytes. The root passes
/// `Some` (the others' argument is ignored), or `None` when it could not make them: every
/// rank then returns an error instead of waiting for bytes that never come.
pub fn share(comm: &dyn Communicator, root: usize, mine: Option<Vec<u8>>, what: &str) -> Result<Vec<u8>> {
    let mine = if comm.rank() == root { mine } else { None };
    let mut len = mine.as_ref().map_or(u64::MAX, |b| b.len() as u64).to_le_bytes();
    comm.broadcast_bytes(&mut len, root);
    let len = u64::from_le_bytes(len);
    if len == u64::MAX {
        return Err(RuntimeError::Comm(format!("rank {}: rank {root} could not make the {what}", comm.rank())));
    }
    let mut buf = mine.unwrap_or_else(|| vec![0; len as usize]);
    comm.broadcast_bytes(&mut buf, root);
    Ok(buf)
}

//! `n` ranks as threads of one process: the communicator the multi-rank tests run on.
//!
//! Each collective publishes the rank's buffer in a shared slot, waits for every rank, reads
//! what it needs in rank order (so every rank computes the same sums, bit for bit), and
//! waits again before the slots can be reused.

use std::sync::{Arc, Barrier, Mutex};

use super::Communicator;

struct Shared {
    barrier: Barrier,
    floats: Mutex<Vec<Vec<f32>>>,
    bytes: Mutex<Vec<Vec<u8>>>,
}

/// One rank of an in-process group; make the group with [`LocalGroup::new`].
pub struct LocalGroup {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// `size` communicators, one per rank; move each into its own thread.
    pub fn new(size: usize) -> Vec<LocalGroup> {
        let shared =
            Arc::new(Shared { barrier: Barrier::new(size), floats: Mutex::new(vec![Vec::new(); size]), bytes: Mutex::new(vec![Vec::new(); size]) });
        (0..size).map(|rank| LocalGroup { rank, size, shared: shared.clone() }).collect()
    }

    /// Publishes `mine`, waits for every rank, runs `read` over all ranks' buffers, waits.
    fn exchange<T: Clone>(&self, slots: &Mutex<Vec<Vec<T>>>, mine: &[T], read: impl FnOnce(&[Vec<T>])) {
        slots.lock().expect("no rank panicked")[self.rank] = mine.to_vec();
        self.shared.barrier.wait();
        read(&slots.lock().expect("no rank panicked"));
        self.shared.barrier.wait();
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) {
        let mine = buf.to_vec();
        self.exchange(&self.shared.floats, &mine, |all| {
            for (i, v) in buf.iter_mut().enumerate() {
                *v = all.iter().fold(0.0, |s, r| s + r[i]);
            }
        });
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        let (n, at) = (recv.len(), self.rank * recv.len());
        self.exchange(&self.shared.floats, send, |all| {
            for (i, v) in recv.iter_mut().enumerate() {
                *v = all.iter().fold(0.0, |s, r| s + r[at + i]);
            }
        });
        debug_assert_eq!(send.len(), n * self.size);
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        self.exchange(&self.shared.floats, send, |all| recv.copy_from_slice(&all.concat()));
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) {
        self.exchange(&self.shared.bytes, send, |all| recv.copy_from_slice(&all.concat()));
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) {
        let mine = buf.to_vec();
        self.exchange(&self.shared.floats, &mine, |all| buf.copy_from_slice(&all[root]));
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) {
        let mine = buf.to_vec();
        self.exchange(&self.shared.bytes, &mine, |all| buf.copy_from_slice(&all[root]));
    }
    fn barrier(&self) {
        self.shared.barrier.wait();
    }
    fn abort(&self, code: i32) -> ! {
        panic!("rank {} aborted the group with status {code}", self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::LocalGroup;
    use crate::comm::share;

    #[test]
    fn share_hands_the_roots_bytes_to_every_rank_or_an_error_to_all() {
        let run = |root_has: bool| -> Vec<Result<Vec<u8>, String>> {
            let ranks = LocalGroup::new(3);
            std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || {
                            let mine = (c.rank == 1 && root_has).then(|| b"tokens".to_vec());
                            share(&c, 1, mine, "token ids").map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        assert!(run(true).iter().all(|r| r.as_deref() == Ok(&b"tokens"[..])));
        let failed = run(false);
        assert!(failed.iter().all(|r| r.as_ref().is_err_and(|e| e.contains("rank 1 could not make the token ids"))), "{failed:?}");
    }
}

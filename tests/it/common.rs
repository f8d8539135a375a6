//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::ops::Deref;
use std::path::{Path, PathBuf};

use cellgraph::prelude::*;

/// LeNet5 + sparse softmax cross-entropy (mean), as in the seed programs.
pub fn lenet_with_loss() -> WithLossCell {
    WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean))
}

/// The seed-002 network + CrossEntropyLoss.
pub fn mlp_with_loss() -> WithLossCell {
    WithLossCell::new(Network::new(&Scope::root()), CrossEntropyLoss::new())
}

/// `(data, label)` input types for a batch of `n` images of `hw x hw`.
pub fn image_inputs(n: usize, hw: usize) -> [(&'static str, TensorType); 2] {
    [("data", TensorType::f32([n, 1, hw, hw])), ("label", TensorType::i32([n]))]
}

/// A test's own directory, `cellgraph-{name}-{pid}` under the system's temp dir: emptied when
/// made, removed when the test passes, kept (and named on stderr) when it fails.
pub struct TmpDir(PathBuf);

impl TmpDir {
    /// The directory, not created: for code under test that makes it.
    pub fn fresh(name: &str) -> TmpDir {
        let d = std::env::temp_dir().join(format!("cellgraph-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        TmpDir(d)
    }

    /// The directory, created.
    pub fn created(name: &str) -> TmpDir {
        let d = TmpDir::fresh(name);
        std::fs::create_dir_all(&d.0).unwrap();
        d
    }
}

impl Deref for TmpDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TmpDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TmpDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {} for the failing test", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The vendored MNIST directory.
pub fn mnist_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/mnist")
}

/// Compares `actual` with the golden file `tests/golden/{name}`; `BLESS=1` re-records it.
/// On mismatch, fails with a unified diff.
pub fn golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    if std::env::var_os("BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("missing golden file {}; run with BLESS=1 to record it", path.display()));
    if expected != actual {
        let diff = similar::TextDiff::from_lines(expected.as_str(), actual)
            .unified_diff()
            .header(&format!("{name} (expected)"), &format!("{name} (actual)"))
            .to_string();
        panic!("golden file {name} differs (re-record with BLESS=1 if intended):\n{diff}");
    }
}

/// The test binary's allocator: the system's, counting the calling thread's allocations while
/// [`allocations`] runs a closure on it. Allocations aligned to more than 16 bytes are counted
/// apart: no tensor or vector of numbers asks for that, SIMD scratch does (the `gemm` crate
/// allocates its packing buffers on every call, with no way to hand it memory).
pub mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    pub struct Counting;

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
        /// What [`allocations`] reports, since it began.
        static SEEN: Cell<Seen> = const { Cell::new(Seen { count: 0, bytes: 0, largest: 0, simd_bytes: 0 }) };
    }

    /// A thread's allocations while counted.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct Seen {
        /// Allocations (a grown vector counts its new size), and their bytes.
        pub count: u64,
        pub bytes: u64,
        /// The largest.
        pub largest: usize,
        /// Bytes of allocations aligned to more than 16 (SIMD scratch), not in the above.
        pub simd_bytes: u64,
    }

    fn note(l: Layout, size: usize) {
        let _ = ON.try_with(|on| {
            if on.get() {
                let _ = SEEN.try_with(|s| {
                    let mut seen = s.get();
                    if l.align() > 16 {
                        seen.simd_bytes += size as u64;
                    } else {
                        seen.count += 1;
                        seen.bytes += size as u64;
                        seen.largest = seen.largest.max(size);
                    }
                    s.set(seen);
                });
            }
        });
    }

    // SAFETY: every call goes to `System` unchanged; counting touches thread-locals only.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            note(l, l.size());
            unsafe { System.alloc(l) }
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            note(l, l.size());
            unsafe { System.alloc_zeroed(l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            note(l, new);
            unsafe { System.realloc(p, l, new) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            unsafe { System.dealloc(p, l) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// What `f` allocated on this thread.
    pub fn allocations<R>(f: impl FnOnce() -> R) -> (R, Seen) {
        SEEN.with(|s| s.set(Seen::default()));
        ON.with(|on| on.set(true));
        let r = f();
        ON.with(|on| on.set(false));
        (r, SEEN.with(Cell::get))
    }
}

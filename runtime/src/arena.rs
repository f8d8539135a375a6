//! The memory a session's plans write their values into ([`Arena`]): host buffers for the
//! host kernels and device buffers for a device's own kernels, by length. A leaf: backends
//! take it in their kernels' signatures, and a value goes back into it through
//! [`crate::Value::give_back`].

use std::collections::BTreeMap;

/// Free buffers of one element type, by length.
pub(crate) type Shelf<T> = BTreeMap<usize, Vec<Vec<T>>>;

/// A host element type the arena keeps buffers of (f32 and f64), and its shelf.
pub(crate) trait Shelved: Copy + Default + 'static {
    fn shelf(a: &mut Arena) -> &mut Shelf<Self>;
}

impl Shelved for f32 {
    fn shelf(a: &mut Arena) -> &mut Shelf<f32> {
        &mut a.f32
    }
}

impl Shelved for f64 {
    fn shelf(a: &mut Arena) -> &mut Shelf<f64> {
        &mut a.f64
    }
}

/// The memory a session's plans write their values into: float buffers by length, in host
/// memory for the host kernels, or device buffers for a device's own kernels. A plan says at
/// compile time how many buffers of each length it holds at once
/// ([`crate::Executable::arena`]); the arena keeps up to that many of each free, so once every
/// length has been seen a run takes all its buffers from here, and each value's last use
/// hands its buffer back ([`crate::Value::give_back`]) when nothing else holds it. Runs of one plan
/// take and give in the same order, so each step writes into the same buffers every run.
#[derive(Default)]
pub struct Arena {
    f32: Shelf<f32>,
    f64: Shelf<f64>,
    /// Free device buffers (a device backend's float tensors), by length and element size in
    /// bytes (f32 values, and bf16 or f16 ones a session stores in half the bytes).
    device: BTreeMap<(usize, usize), Vec<Box<dyn std::any::Any + Send>>>,
    /// A device kernel's scratch buffer of each length (taken and given back around a launch).
    scratch: BTreeMap<usize, Box<dyn std::any::Any + Send>>,
    /// Most free buffers kept per length: the most any plan run here holds at once.
    cap: BTreeMap<usize, usize>,
    /// Buffers allocated because none of their length was free.
    fresh: u64,
}

impl Arena {
    /// Makes room for a plan's buffers: `(elements, buffers)` pairs.
    pub fn size_for(&mut self, plan: &[(usize, usize)]) {
        for &(len, n) in plan {
            let cap = self.cap.entry(len).or_default();
            *cap = (*cap).max(n);
        }
    }

    /// Buffers allocated so far because none of their length was free (a steady state adds none).
    pub fn fresh(&self) -> u64 {
        self.fresh
    }

    /// A buffer of `len` elements, contents unspecified.
    pub(crate) fn take<F: Shelved>(&mut self, len: usize) -> Vec<F> {
        match F::shelf(self).get_mut(&len).and_then(Vec::pop) {
            Some(v) => v,
            None => {
                self.fresh += 1;
                vec![F::default(); len]
            }
        }
    }

    /// Keeps a host buffer for a later [`Self::take`] of its length, up to the plans' cap.
    pub(crate) fn give<F: Shelved>(&mut self, v: Vec<F>) {
        let cap = self.cap.get(&v.len()).copied().unwrap_or(0);
        let shelf = F::shelf(self).entry(v.len()).or_default();
        if shelf.len() < cap {
            shelf.push(v);
        }
    }

    /// A free device buffer `T` of `len` elements of `size` bytes, contents unspecified; `None`
    /// (counted as a fresh buffer: the caller makes one) when none is free.
    pub fn take_device<T: 'static>(&mut self, len: usize, size: usize) -> Option<T> {
        let t = self.device.get_mut(&(len, size)).and_then(Vec::pop).and_then(|b| b.downcast::<T>().ok()).map(|b| *b);
        if t.is_none() {
            self.fresh += 1;
        }
        t
    }

    /// The device scratch buffer `T` of `len` elements, `None` (counted as fresh) the first
    /// time; give it back after the launches that use it ([`Self::give_scratch`]).
    pub fn take_scratch<T: 'static>(&mut self, len: usize) -> Option<T> {
        let t = self.scratch.remove(&len).and_then(|b| b.downcast::<T>().ok()).map(|b| *b);
        if t.is_none() {
            self.fresh += 1;
        }
        t
    }

    /// Keeps a device scratch buffer of `len` elements for the next launch that needs one.
    pub fn give_scratch<T: Send + 'static>(&mut self, len: usize, t: T) {
        self.scratch.insert(len, Box::new(t));
    }

    /// Every device buffer the arena holds (free buffers and scratch buffers) that is a `T`.
    pub fn device_buffers<T: 'static>(&self) -> impl Iterator<Item = &T> {
        let free = self.device.values().flatten();
        free.chain(self.scratch.values()).filter_map(|b| b.downcast_ref::<T>())
    }

    /// Gives a device buffer of `len` elements of `size` bytes back, which nothing else may
    /// hold. Up to the plans' cap for the length are kept of each element size (a value stored
    /// in half the bytes holds no more buffers than in f32).
    pub fn give_device<T: Send + 'static>(&mut self, len: usize, size: usize, t: T) {
        let cap = self.cap.get(&len).copied().unwrap_or(0);
        let shelf = self.device.entry((len, size)).or_default();
        if shelf.len() < cap {
            shelf.push(Box::new(t));
        }
    }
}

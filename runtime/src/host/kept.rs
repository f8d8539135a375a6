//! What the host kernels keep in a session ([`Kept`]): rows and argmaxes for a gradient later
//! in the same run, and the dense filters of parameters (and their packings for the bf16
//! pairs) for as long as the parameter keeps its value, rebuilt in their own memory after a
//! write.

use std::collections::BTreeMap;

use super::float::HostFloat;
use super::{bf16, toeplitz, Elem, ROUNDED_BF16};
use crate::kernel::{Geometry, Tap};

/// Buffers kept between the steps of a run, by slot, each stamped with the run that wrote it.
#[derive(Default)]
struct Stamped<T>(Vec<(u64, Vec<T>)>);

impl<T: Copy + Default> Stamped<T> {
    fn slot(&mut self, run: u64, k: usize, len: usize) -> &mut [T] {
        if self.0.len() <= k {
            self.0.resize_with(k + 1, Default::default);
        }
        let (stamp, v) = &mut self.0[k];
        *stamp = run;
        v.resize(len, T::default());
        v
    }
    fn get(&self, run: u64, k: usize, len: usize) -> Option<&[T]> {
        self.0.get(k).filter(|(stamp, v)| *stamp == run && v.len() == len).map(|(_, v)| &v[..])
    }
}

/// What the host kernels keep of one float type: rows for a gradient later in the run, and the
/// dense filters of parameters, by parameter name (see [`Kept`]).
#[derive(Default)]
pub(crate) struct Typed<T> {
    rows: Stamped<T>,
    /// Per parameter: its dense filters.
    dense: BTreeMap<String, Vec<Derived<Vec<T>>>>,
}

/// What a kernel derived from a parameter's value and keeps ([`Kept`]): for a geometry (batch
/// 0) and a number of output channels (and, packed, for the forward or the input gradient).
/// A write of the parameter leaves it, not `current`: the next read rebuilds it in the same
/// memory (the layout depends on the geometry alone), where dropping it had freed the memory
/// and the rebuild had taken new pages from the system, zeroed, every window.
struct Derived<T> {
    key: Geometry,
    o: usize,
    forward: bool,
    current: bool,
    value: T,
}

impl<T> Derived<T> {
    fn is(&self, key: &Geometry, o: usize, forward: bool) -> bool {
        self.key == *key && self.o == o && self.forward == forward
    }
}

/// `g` with batch 0: what a derived value is kept for (any batch reads the same one).
fn batch_free(g: &Geometry) -> Geometry {
    Geometry { x: [0, g.x[1], g.x[2], g.x[3]], ..*g }
}

/// The dense filter of parameter `name` (value `w`) for geometry `g` (any batch) and `o`
/// output channels: the one built since the parameter was last written, else built now (in the
/// memory of one built before, if any).
fn dense_in<'a, F: HostFloat>(
    kept: &'a mut BTreeMap<String, Vec<Derived<Vec<F>>>>,
    name: &str,
    g: &Geometry,
    taps: &[Tap],
    o: usize,
    w: &[F],
) -> &'a [F] {
    let key = batch_free(g);
    let entries = kept.entry(name.to_string()).or_default();
    let at = match entries.iter().position(|d| d.is(&key, o, false)) {
        Some(at) => {
            let d = &mut entries[at];
            if !d.current {
                toeplitz::refill(g, taps, o, w, &mut d.value);
                d.current = true;
            }
            at
        }
        None => {
            entries.push(Derived { key, o, forward: false, current: true, value: toeplitz::dense(g, taps, o, w) });
            entries.len() - 1
        }
    };
    &entries[at].value
}

/// Per-session state the host kernels keep:
/// - between the steps of a run, for a gradient later in the same plan: the argmax of a max
///   pool ([`Native::MaxPool`](crate::kernel::Native::MaxPool)'s `keep`), the log-softmax of a loss
///   ([`Native::SoftmaxCrossEntropy`](crate::kernel::Native::SoftmaxCrossEntropy)'s `kept`) and an attention's probabilities
///   ([`Native::Attention`](crate::kernel::Native::Attention)'s `kept`), stamped with the run that wrote them (a
///   gradient only trusts its own run's); on device backends, a loss's gradient computed with
///   the loss (its `seed`), until its gradient step takes it;
/// - between runs, for as long as a parameter keeps its value: the dense filters of the
///   small-map convolutions that read it ([`Native::Conv`](crate::kernel::Native::Conv)'s `filter`), and, for bf16
///   products on the AVX-512 BF16 pairs, each packed as the forward's and the input
///   gradient's products read it ([`bf16::Packed`]). A window's micro-steps all read the same
///   weights, so each is built and packed once per window instead of twice per micro-step.
///   Whenever the session writes the parameter they stop being current ([`Self::forget`]),
///   and the next read rebuilds them in their own memory ([`Derived`]).
#[derive(Default)]
pub struct Kept {
    run: u64,
    argmax: Stamped<u32>,
    pub(super) f32: Typed<f32>,
    pub(super) f64: Typed<f64>,
    /// Per parameter: its dense filters packed for the bf16 pairs (the forward's left operand,
    /// or the input gradient's right one): an f32 session's, with bf16 products on the pairs.
    packed: BTreeMap<String, Vec<Derived<bf16::Packed>>>,
    device: BTreeMap<usize, Box<dyn std::any::Any + Send>>,
}

impl Kept {
    /// Marks what was derived from parameter `name`'s value (and from its bf16 copy, kept as
    /// [`ROUNDED_BF16`] `name`) as not current: the session calls it on every write of the
    /// parameter. The memory stays, for the rebuild.
    pub fn forget(&mut self, name: &str) {
        fn stale<T>(map: &mut BTreeMap<String, Vec<Derived<T>>>, key: &str) {
            map.get_mut(key).into_iter().flatten().for_each(|d| d.current = false);
        }
        let rounded = format!("{ROUNDED_BF16}{name}");
        for key in [name, &rounded] {
            stale(&mut self.f32.dense, key);
            stale(&mut self.f64.dense, key);
            stale(&mut self.packed, key);
        }
    }
    /// Drops what was derived from every parameter.
    pub fn forget_all(&mut self) {
        self.f32.dense.clear();
        self.f64.dense.clear();
        self.packed.clear();
    }
    /// [`Self::dense_filter`] packed for the bf16 pairs, as the forward's left operand
    /// (`forward`) or the input gradient's right one: packed once since the parameter was last
    /// written (a window's micro-steps all read it), instead of at every call.
    pub(super) fn packed_filter(&mut self, name: &str, g: &Geometry, taps: &[Tap], o: usize, w: &[f32], forward: bool) -> &bf16::Packed {
        let key = batch_free(g);
        let entries = self.packed.entry(name.to_string()).or_default();
        let at = match entries.iter().position(|d| d.is(&key, o, forward)) {
            Some(at) if entries[at].current => return &entries[at].value,
            Some(at) => at,
            None => {
                entries.push(Derived { key, o, forward, current: false, value: bf16::Packed::empty() });
                entries.len() - 1
            }
        };
        let (k, m) = (g.x[1] * g.x[2] * g.x[3], o * g.spatial());
        let t = dense_in(&mut self.f32.dense, name, g, taps, o, w);
        let d = &mut entries[at];
        // SAFETY: t is the m x k dense filter, row-major; the session chose the pairs.
        unsafe {
            if forward {
                d.value.pack_a(m, k, t.as_ptr(), k as isize, 1)
            } else {
                d.value.pack_b(m, k, t.as_ptr(), k as isize, 1)
            }
        };
        d.current = true;
        &d.value
    }
    /// The dense filter of parameter `name` (value `w`) for geometry `g` (any batch) and `o`
    /// output channels ([`dense_in`]).
    pub(super) fn dense_filter<F: Elem>(&mut self, name: &str, g: &Geometry, taps: &[Tap], o: usize, w: &[F]) -> &[F] {
        dense_in(&mut F::kept(self).dense, name, g, taps, o, w)
    }
    /// Starts a run: what earlier runs kept is stale from now on.
    pub fn begin_run(&mut self) {
        self.run += 1;
        self.device.clear();
    }
    /// Keeps a device value for slot `k` until [`Self::take_device`] (or the next run).
    pub(crate) fn keep_device<T: Send + 'static>(&mut self, k: usize, t: T) {
        self.device.insert(k, Box::new(t));
    }
    /// What slot `k` kept in this run, taken out.
    pub(crate) fn take_device<T: 'static>(&mut self, k: usize) -> Option<T> {
        let v = self.device.remove(&k)?;
        v.downcast().ok().map(|b| *b)
    }
    pub(super) fn argmax(&mut self, k: usize, len: usize) -> &mut [u32] {
        self.argmax.slot(self.run, k, len)
    }
    pub(super) fn argmax_of(&self, k: usize, len: usize) -> Option<&[u32]> {
        self.argmax.get(self.run, k, len)
    }
    pub(super) fn rows<F: Elem>(&mut self, k: usize, len: usize) -> &mut [F] {
        let run = self.run;
        F::kept(self).rows.slot(run, k, len)
    }
    pub(super) fn rows_of<F: Elem>(&mut self, k: usize, len: usize) -> Option<&[F]> {
        let run = self.run;
        F::kept(self).rows.get(run, k, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write of a parameter leaves its dense filters and their packings for the bf16 pairs
    /// stale, not dropped: the next read rebuilds them in the same memory, equal to ones built
    /// afresh from the new value, on a map whose dense filter has zeros off its taps; until a
    /// write, the one built stays (whatever value is passed).
    #[test]
    fn a_written_parameters_dense_filters_are_rebuilt_in_their_memory() {
        let g = Geometry { x: [2, 3, 1, 10], kernel: [1, 10], stride: [1, 1], dilation: [1, 1], pad: [0, 1], out: [1, 3] };
        let o = 6;
        let taps = crate::kernel::dense_taps(&g, 1, o).expect("a dense layer");
        let w: Vec<Vec<f32>> = (0..3).map(|s| (0..o * 30).map(|i| ((i * 37 + s * 11) % 29) as f32 / 7.0 - 2.0).collect()).collect();
        let mut kept = Kept::default();
        let first = kept.dense_filter("w", &g, &taps, o, &w[0]).as_ptr();
        assert_eq!(kept.dense_filter("w", &g, &taps, o, &w[1]), &toeplitz::dense(&g, &taps, o, &w[0])[..], "current until a write");
        for v in &w[1..] {
            kept.forget("w");
            assert!(matches!(&kept.f32.dense["w"][..], [d] if !d.current), "kept, not current");
            let t = kept.dense_filter("w", &g, &taps, o, v);
            assert_eq!(t.as_ptr(), first, "rebuilt in its memory");
            assert_eq!(t, &toeplitz::dense(&g, &taps, o, v)[..]);
            assert!(t.contains(&0.0), "zeros off the taps");
        }
        if !bf16::available() {
            return;
        }
        let (k, m) = (30, o * g.spatial());
        for (i, v) in w.iter().enumerate() {
            kept.forget("w");
            for forward in [true, false] {
                let t = toeplitz::dense(&g, &taps, o, v);
                // SAFETY: t is the m x k dense filter, row-major.
                let fresh = unsafe {
                    if forward {
                        bf16::Packed::a(m, k, t.as_ptr(), k as isize, 1)
                    } else {
                        bf16::Packed::b(m, k, t.as_ptr(), k as isize, 1)
                    }
                };
                assert!(*kept.packed_filter("w", &g, &taps, o, v, forward) == fresh, "value {i}, forward {forward}");
            }
            assert_eq!(kept.packed.get("w").map(Vec::len), Some(2), "one packing of each, reused");
        }
    }
}

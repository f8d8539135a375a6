//! What every host kernel builds on: the float trait ([`HostFloat`]: f32 and f64, their GEMM and
//! thread-local scratch), dispatch to the widest vector instructions ([`vectorized`]), the
//! threading helpers ([`each`], [`row_shares`]), whose cut of the work never depends on the
//! thread count, so results are the same on any number of threads, and the epilogue hook
//! kernels hand their finished output parts to ([`Post`]). A leaf: it imports no kernel.

use std::cell::Cell;

thread_local! {
    static SCRATCH_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static SCRATCH_F64: Cell<Vec<f64>> = const { Cell::new(Vec::new()) };
    static PARTIALS_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static PARTIALS_F64: Cell<Vec<f64>> = const { Cell::new(Vec::new()) };
}

/// A float element the host kernels compute in.
pub trait HostFloat:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::AddAssign
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + Send
    + Sync
    + 'static
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn is_nan(self) -> bool;
    /// `v` rounded to this type (as a `constant` node is).
    fn from_f64(v: f64) -> Self;
    fn exp(self) -> Self;
    /// `exp`, `erf` and `tanh` as elementwise programs (and those ops alone) compute them: on
    /// f32 [`super::math`]'s, which vectorise (within 1, 2 and 1.5 ulp); on f64, the
    /// reference backend, std's and libm's, as burn's ops.
    fn program_exp(self) -> Self;
    fn erf(self) -> Self;
    fn tanh(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    /// The nearest bf16 value (ties to even; half's conversion, as `round_to` everywhere).
    fn round_bf16(self) -> Self;
    /// The nearest f16 value (ties to even, subnormals kept, past 65504 to infinity).
    fn round_f16(self) -> Self;
    /// `self * a + b` with one rounding (an FMA instruction where the CPU has one).
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// Whether programs in this type read tables of their subtrees on bf16 operands
    /// ([`super::tables`], made in f32): f32's do, the f64 reference backend's never.
    const TABULATES: bool;
    /// `table`'s entry for `self`, a bf16 value (only where [`Self::TABULATES`]).
    fn lookup(self, table: &[f32; 1 << 16]) -> Self;
    /// The sum of `xs` by ndarray's own `sum` (eight running sums, paired): the order, and so
    /// the bits, of burn-ndarray's reductions, which the host loss kernels must reproduce.
    fn ndarray_sum(xs: &[Self]) -> Self;
    /// Runs `f` on `len` elements of this thread's scratch memory (grown, never shrunk: a
    /// steady state allocates nothing; the contents are whatever the last kernel left).
    fn scratch<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R;
    /// As [`Self::scratch`], in a second buffer for what a kernel's calling thread holds while
    /// the chunks it hands out use their own scratch (the filter gradient's partial sums).
    fn partials<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R;
    /// `C = A B + beta * C` with element strides (`beta` is 0 or 1; with 0, `C` is not read),
    /// on up to `threads` of rayon's threads (gemm splits the output, never the contraction,
    /// so the bits do not depend on it).
    ///
    /// # Safety
    /// The pointers and strides must describe matrices inside their allocations.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
        threads: usize,
    );
}

/// One implementation for both element types (`$scratch`: the type's thread-local scratch).
macro_rules! host_float {
    ($t:ident, $scratch:ident, $partials:ident, $exp:path, $erf:path, $tanh:path) => {
        impl HostFloat for $t {
            const ZERO: $t = 0.0;
            const NEG_INF: $t = $t::NEG_INFINITY;
            fn is_nan(self) -> bool {
                $t::is_nan(self)
            }
            fn from_f64(v: f64) -> $t {
                v as $t
            }
            fn exp(self) -> $t {
                $t::exp(self)
            }
            #[inline(always)]
            fn program_exp(self) -> $t {
                $exp(self)
            }
            #[inline(always)]
            fn erf(self) -> $t {
                $erf(self)
            }
            #[inline(always)]
            fn tanh(self) -> $t {
                $tanh(self)
            }
            fn ln(self) -> $t {
                $t::ln(self)
            }
            fn sqrt(self) -> $t {
                $t::sqrt(self)
            }
            // From f32 (f64 values, on the f64 reference backend, are rounded to f32 first:
            // the op rounds f32 values).
            #[inline(always)]
            fn round_bf16(self) -> $t {
                super::math::round_bf16(self as f32) as $t
            }
            fn round_f16(self) -> $t {
                half::f16::from_f32(self as f32).to_f32() as $t
            }
            #[inline(always)]
            fn mul_add(self, a: $t, b: $t) -> $t {
                $t::mul_add(self, a, b)
            }
            const TABULATES: bool = std::mem::size_of::<$t>() == 4;
            #[inline(always)]
            fn lookup(self, table: &[f32; 1 << 16]) -> $t {
                let b = (self as f32).to_bits();
                debug_assert!(Self::TABULATES && b & 0xffff == 0, "{self:e} read from a table is not a bf16 value");
                table[(b >> 16) as usize] as $t
            }
            fn ndarray_sum(xs: &[$t]) -> $t {
                ndarray::aview1(xs).sum()
            }
            fn scratch<R>(len: usize, f: impl FnOnce(&mut [$t]) -> R) -> R {
                grown(&$scratch, len, f)
            }
            fn partials<R>(len: usize, f: impl FnOnce(&mut [$t]) -> R) -> R {
                grown(&$partials, len, f)
            }
            unsafe fn gemm(
                m: usize,
                k: usize,
                n: usize,
                a: *const $t,
                rsa: isize,
                csa: isize,
                b: *const $t,
                rsb: isize,
                csb: isize,
                beta: $t,
                c: *mut $t,
                rsc: isize,
                csc: isize,
                threads: usize,
            ) {
                let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
                gemm::gemm(m, n, k, c, csc, rsc, beta != 0.0, a, csa, rsa, b, csb, rsb, beta, 1.0, false, false, false, par)
            }
        }
    };
}

host_float!(f32, SCRATCH_F32, PARTIALS_F32, super::math::exp, super::math::erf, super::math::tanh);
host_float!(f64, SCRATCH_F64, PARTIALS_F64, f64::exp, libm::erf, f64::tanh);

/// Runs `f` on the first `len` elements of a thread-local buffer, grown (never shrunk) to fit.
/// The buffer is taken out of the thread-local for the call: a thread waiting inside a kernel
/// may run another plan's jobs (rayon steals work while it waits), and a kernel there then
/// grows a buffer of its own; the larger goes back.
fn grown<T: Copy + Default + 'static, R>(key: &'static std::thread::LocalKey<Cell<Vec<T>>>, len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let mut v = key.take();
    if v.len() < len {
        v.resize(len, T::default());
    }
    let r = f(&mut v[..len]);
    key.with(|k| {
        let other = k.take();
        k.set(if other.len() > v.len() { other } else { v });
    });
    r
}

/// Runs `op` compiled for the widest vector instructions this CPU has (pulp: AVX-512, else
/// AVX2 with FMA, else none), chosen per call. Only code inlined into it is compiled so: the
/// kernels' loops are `#[inline(always)]`. A small closure is an op (the compiler vectorises
/// its loops), but a large one is called, not inlined, whatever its attributes, and runs on
/// the baseline instruction set (SSE2): the fused elementwise programs ran so, at 4 lanes,
/// until they became a struct whose `with_simd` holds the loop (`program::Program`). Check the
/// disassembly of `pulp::x86::v4::V4::vectorize::imp*` for calls when adding one.
/// [`crate::host::direct`]'s kernels take the instruction set as a type.
#[inline(always)]
pub(crate) fn vectorized<Op: pulp::WithSimd>(op: Op) -> Op::Output {
    #[cfg(test)]
    if tests::SCALAR.with(std::cell::Cell::get) {
        return pulp::Arch::Scalar.dispatch(op);
    }
    #[cfg(all(test, target_arch = "x86_64"))]
    if tests::AVX2.with(std::cell::Cell::get) {
        if let Some(v3) = pulp::x86::V3::try_new() {
            return pulp::Simd::vectorize(v3, op);
        }
    }
    pulp::Arch::new().dispatch(op)
}

/// Copies a short row (a convolution's output width) without a call to `memcpy`: eight
/// elements at a time, the tail as an overlapping last eight.
#[inline(always)]
pub(super) fn copy_row<F: Copy>(d: &mut [F], s: &[F]) {
    let n = d.len();
    if n < 8 {
        if n < 4 {
            return d.copy_from_slice(s);
        }
        // Four at a time, the tail as an overlapping last four (ResNet's 4x4 maps).
        let (a, b): ([F; 4], [F; 4]) = (s[..4].try_into().expect("four"), s[n - 4..n].try_into().expect("four"));
        d[..4].copy_from_slice(&a);
        d[n - 4..].copy_from_slice(&b);
        return;
    }
    let s = &s[..n];
    let mut i = 0;
    while i + 8 <= n {
        let c: [F; 8] = s[i..i + 8].try_into().expect("eight elements");
        d[i..i + 8].copy_from_slice(&c);
        i += 8;
    }
    if i < n {
        let c: [F; 8] = s[n - 8..].try_into().expect("eight elements");
        d[n - 8..].copy_from_slice(&c);
    }
}

/// Runs `f` on every item, across `rayon::current_num_threads()` threads when that is more
/// than one (one thread per rank under `mpirun`: see [`crate::comm`]).
///
/// On a pool thread (a plan runs on one: see [`crate::Session::run`]) each item is a job: this
/// thread works through them from its end of its queue while the other threads steal from the
/// front, and whatever no thread has taken it runs itself, so it never waits for a thread that
/// has not woken up. From outside the pool the items are cut into that many contiguous shares;
/// the calling thread works through one share itself while the pool's threads take the others.
pub(super) fn each<T: Send>(items: Vec<T>, f: impl Fn(T) + Send + Sync) {
    let threads = rayon::current_num_threads().min(items.len());
    if threads <= 1 {
        return items.into_iter().for_each(f);
    }
    let f = &f;
    if rayon::current_thread_index().is_some() {
        return rayon::in_place_scope(|s| {
            for item in items {
                s.spawn(move |_| f(item));
            }
        });
    }
    let per = items.len().div_ceil(threads);
    let mut shares: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut rest = items.into_iter();
    loop {
        let share: Vec<T> = rest.by_ref().take(per).collect();
        if share.is_empty() {
            break;
        }
        shares.push(share);
    }
    let mine = shares.remove(0);
    rayon::in_place_scope(|s| {
        for share in shares {
            s.spawn(move |_| share.into_iter().for_each(f));
        }
        mine.into_iter().for_each(f);
    });
}

/// `x` as f32 values, when `F` is f32 (a kernel with an f32-only fast path).
pub(super) fn as_f32<F: HostFloat>(x: &[F]) -> Option<&[f32]> {
    // SAFETY: `F` is `f32`.
    (std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>()).then(|| unsafe { std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()) })
}

/// [`as_f32`] for a slice written.
pub(super) fn as_f32_mut<F: HostFloat>(x: &mut [F]) -> Option<&mut [f32]> {
    // SAFETY: `F` is `f32`.
    (std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>())
        .then(|| unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut f32, x.len()) })
}

/// Output elements a fused program works at a time: each term runs over a whole block, so
/// its loop is a plain slice loop the compiler vectorises, and the stack stays in L1 (4 KiB a
/// slot: blocks of 256 switched between the operands' streams so often that a program over
/// operands out of L2 ran at a third of the speed).
pub(super) const BLOCK: usize = 1024;

/// What a kernel does to each part of its output once the part is final: `(first, part)`,
/// `first` being the index of the part's first element in the whole output (an epilogue's
/// program, run while the part is still in cache).
pub type Post<'a, F> = Option<&'a (dyn Fn(usize, &mut [F]) + Sync)>;

/// Runs `post` over the whole of `y` (for kernels that do not hand their output over in
/// parts), cut into per-thread shares of whole blocks.
pub fn post_all<F: HostFloat>(post: Post<F>, y: &mut [F]) {
    let Some(post) = post else { return };
    row_shares(y, BLOCK, |first, part| post(first * BLOCK, part));
}

/// Runs `f(first, part)` on `y` cut into shares of whole rows of `row` elements (`first`:
/// the share's first row) when there is more than one thread and `y` is large enough to be
/// worth it: up to four shares per thread, of 8 blocks or more, taken by the threads as they
/// come (a thread woken for the call starts tens of microseconds late; with one share each, the
/// caller finished its own and waited for the other's, and outputs of 128 Ki elements ran at
/// half the speed of one thread). Each element is computed the same way whatever the cut.
pub(super) fn row_shares<F: HostFloat>(y: &mut [F], row: usize, f: impl Fn(usize, &mut [F]) + Send + Sync) {
    let work = y.len();
    shares_of(y, row, work, f)
}

/// The most shares a kernel's work is cut into: up to four per thread, taken by the threads as
/// they come (see [`row_shares`]); one on one thread.
pub(super) fn most_shares() -> usize {
    match rayon::current_num_threads() {
        1 => 1,
        t => 4 * t,
    }
}

/// [`row_shares`] for a kernel whose work is `work` elements rather than its output's (a
/// reduction reads more than it writes).
pub(super) fn shares_of<F: HostFloat>(y: &mut [F], row: usize, work: usize, f: impl Fn(usize, &mut [F]) + Send + Sync) {
    if y.is_empty() {
        return;
    }
    let rows = y.len().checked_div(row).unwrap_or(0);
    let shares = most_shares().min(work / (8 * BLOCK)).min(rows);
    if shares <= 1 {
        return f(0, y);
    }
    let per = rows.div_ceil(shares);
    let shares: Vec<(usize, &mut [F])> = y.chunks_mut(per * row).enumerate().map(|(i, c)| (i * per, c)).collect();
    each(shares, |(first, part)| f(first, part));
}

#[cfg(test)]
pub(crate) mod tests {
    thread_local! {
        /// Makes [`vectorized`] run kernels without vector instructions, on this thread.
        pub(crate) static SCALAR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        /// Makes [`vectorized`] run kernels on AVX2 with FMA (8 f32 lanes), on this thread,
        /// where the CPU has it (an AVX-512 machine's tests then cover the narrower vectors).
        pub(crate) static AVX2: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A kernel's output as a new vector of `len` elements (filled with NaN first: every
    /// element must be written).
    pub(crate) fn new(len: usize, kernel: impl FnOnce(&mut [f32])) -> Vec<f32> {
        let mut v = vec![f32::NAN; len];
        kernel(&mut v);
        v
    }

    pub(crate) fn data(n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 - 1001.0) / 1001.0).collect()
    }
}

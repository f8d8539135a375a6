//! Products of bf16 values with f32 accumulation on AVX-512 BF16 (`vdpbf16ps`): the host's
//! low-precision matrix kernel, as a tensor core or PyTorch's CPU autocast computes a bf16
//! product. Each instruction multiplies 16 pairs of bf16 values and adds both products, in
//! order, to 16 f32 sums (denormals flushed to zero, round to nearest even), at twice the
//! multiply-adds of f32 FMA, from half the bytes.
//!
//! Used only where the plan knows both operands hold bf16 values (the precision pass rounded
//! them: [`crate::kernel::Products::Bf16`], decided at plan build). There a bf16 product is the
//! f32 product of the emulation summed in another order: every partial product of two bf16
//! values is exact in f32, so the results differ only by the rounding of the sums (and
//! denormals), within `k` f32 roundings of the sum of the magnitudes.
//!
//! Layout: the `k` extent is cut into blocks of [`KC`] values and the columns into blocks of
//! [`NC`]; `A`'s rows are packed once per block of `k` (for every block of columns), and each
//! block of `B` is packed as panels of [`NR`] columns holding, for each pair of
//! rows `2q, 2q + 1`, the 32-bit pair of each column's two values (the instruction's operand);
//! each row of `A`'s block is packed as its consecutive pairs. The micro-kernel holds an
//! [`MR`] x [`NR`] tile of `C` in 16 registers and broadcasts one pair of each of its rows
//! against two registers of `B`'s panel per pair of `k`.

/// Rows of the micro-kernel's tile of `C`.
const MR: usize = 8;
/// Columns of the micro-kernel's tile (two registers of 16 f32).
const NR: usize = 32;
/// The micro-kernel's tile of `C`, `(MR, NR)`: what a caller choosing between `C = A B` and
/// `C^T = B^T A^T` weighs the padding of.
pub const TILE: (usize, usize) = (MR, NR);
/// Values of `k` per packed block (an `MR`-row strip of `A` and a panel of `B` in L1/L2).
const KC: usize = 512;
/// Columns of `B` per packed block (`KC / 2 * NC * 4` bytes: 512 KiB, in L2).
const NC: usize = 512;

/// Whether this CPU multiplies bf16 pairs (AVX-512 F and AVX-512 BF16); checked once.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether plans give products of bf16 values to this kernel rather than to the f32 GEMM
/// (the emulation: the same products, summed in another order): the CPU multiplies bf16
/// pairs ([`available`]) and does so faster than it multiplies f32, which is the case on
/// AMD's cores (Zen 4 and 5 issue `vdpbf16ps` at the rate of their f32 FMA, twice its
/// multiply-adds) and not on Intel's: on a Sapphire or Emerald Rapids core `vdpbf16ps` does a
/// third to a half of the f32 FMA's multiply-adds (`benches/cpu_peak.sh` measures both: 51-56
/// against 104-167 GFLOP/s on one core of a Xeon reporting family 6 model 207, AMX hidden),
/// so where their AMX is absent or hidden ([`super::amx`]) the f32 GEMM is the faster kernel
/// for the same rounded values. `CELLGRAPH_BF16_PAIRS=1` chooses the pairs on any core that
/// has them, `0` on none (to time the two); checked once, so every plan of a process agrees.
pub fn pays() -> bool {
    choice().is_ok()
}

/// Why plans do not choose this kernel on this CPU, when they do not ([`pays`]).
pub fn declined() -> Option<&'static str> {
    choice().err()
}

/// Plans' choice of this kernel, made once per process from the CPU and
/// `CELLGRAPH_BF16_PAIRS` ([`super::units`]): chosen, or why not.
fn choice() -> Result<(), &'static str> {
    static CHOICE: std::sync::OnceLock<Result<(), &'static str>> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match super::units().pairs {
        _ if !available() => Err("this CPU has no AVX-512 BF16"),
        Some(true) => Ok(()),
        Some(false) => Err("CELLGRAPH_BF16_PAIRS=0 refuses the AVX-512 BF16 pairs"),
        None if intel() => Err("this Intel core multiplies AVX-512 BF16 pairs slower than f32; CELLGRAPH_BF16_PAIRS=1 runs them"),
        None => Ok(()),
    })
}

/// Whether the CPU is Intel's (CPUID's vendor string).
fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        [r.ebx, r.edx, r.ecx].iter().flat_map(|w| w.to_le_bytes()).eq(*b"GenuineIntel")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

thread_local! {
    /// Packed `A` and `B` blocks (grown, never shrunk).
    static PACKED: std::cell::Cell<(Vec<u32>, Vec<u32>)> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
    /// One line of pairs, packing a transposed operand.
    static LINE: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `C = A B + beta * C` (`beta` 0 or 1; with 0, `C` is not read) with element strides, on
/// the calling thread, for `A` and `B` holding bf16 values (any other value is rounded to the
/// nearest bf16, ties to even, as it is packed).
///
/// # Safety
/// The pointers and strides must describe matrices inside their allocations, and
/// [`available`] must be true.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    rsa: isize,
    csa: isize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    beta: f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    debug_assert!(available());
    if !trivial(m, k, n, beta, c, rsc, csc) {
        product(m, k, n, Side::Strided(a, rsa, csa), Side::Strided(b, rsb, csb), beta, c, rsc, csc);
    }
}

/// An operand packed once, as [`gemm`] packs it at each call, for every product that
/// multiplies it ([`gemm_a_packed`], [`gemm_b_packed`]): the products' bits are [`gemm`]'s. A
/// small map's dense convolution filter, kept while its parameter keeps its value, is
/// multiplied at every micro-step of a window (forward and input gradient): packed once per
/// window instead of at every call, and half the bytes to read.
#[derive(PartialEq)]
pub struct Packed {
    /// `A`'s rows, or `B`'s columns.
    lines: usize,
    /// The contraction.
    k: usize,
    /// Per block of `k` ([`KC`] values), and for `B` per block of columns ([`NC`]) within it:
    /// the pairs, and for `A` where pair `q` of row `i` is ([`pack_a`]'s strides).
    blocks: Vec<(Vec<u32>, (usize, usize))>,
}

impl Packed {
    /// Nothing packed yet ([`Self::pack_a`], [`Self::pack_b`] fill it).
    pub fn empty() -> Packed {
        Packed { lines: 0, k: 0, blocks: Vec::new() }
    }

    /// `A` (`m x k`, element strides `rsa`, `csa`), packed.
    ///
    /// # Safety
    /// As [`gemm`]'s for `A`.
    pub unsafe fn a(m: usize, k: usize, a: *const f32, rsa: isize, csa: isize) -> Packed {
        let mut p = Packed::empty();
        p.pack_a(m, k, a, rsa, csa);
        p
    }

    /// `B` (`k x n`, element strides `rsb`, `csb`), packed.
    ///
    /// # Safety
    /// As [`gemm`]'s for `B`.
    pub unsafe fn b(k: usize, n: usize, b: *const f32, rsb: isize, csb: isize) -> Packed {
        let mut p = Packed::empty();
        p.pack_b(k, n, b, rsb, csb);
        p
    }

    /// [`Self::a`] in this one's memory (its blocks' buffers reused, grown if short).
    ///
    /// # Safety
    /// As [`Self::a`].
    pub unsafe fn pack_a(&mut self, m: usize, k: usize, a: *const f32, rsa: isize, csa: isize) {
        debug_assert!(available());
        self.blocks.resize_with(k.div_ceil(KC), Default::default);
        for ((v, s), k0) in self.blocks.iter_mut().zip((0..k).step_by(KC)) {
            *s = pack_a(m, KC.min(k - k0), a.offset(k0 as isize * csa), rsa, csa, v);
        }
        (self.lines, self.k) = (m, k);
    }

    /// [`Self::b`] in this one's memory (its blocks' buffers reused, grown if short).
    ///
    /// # Safety
    /// As [`Self::b`].
    pub unsafe fn pack_b(&mut self, k: usize, n: usize, b: *const f32, rsb: isize, csb: isize) {
        debug_assert!(available());
        self.blocks.resize_with(k.div_ceil(KC) * n.div_ceil(NC), Default::default);
        let at = (0..k).step_by(KC).flat_map(|k0| (0..n).step_by(NC).map(move |j0| (k0, j0)));
        for ((v, s), (k0, j0)) in self.blocks.iter_mut().zip(at) {
            pack_b(KC.min(k - k0), NC.min(n - j0), b.offset(k0 as isize * rsb + j0 as isize * csb), rsb, csb, v);
            *s = (0, 0);
        }
        (self.lines, self.k) = (n, k);
    }
}

/// [`gemm`] with `A` packed before ([`Packed::a`]): rows `rows` of `A` times `B` into the
/// rows of `C` (`c` at the first); `rows.start` a multiple of the tile's rows ([`TILE`]).
///
/// # Safety
/// As [`gemm`]'s for `B` and `C`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_a_packed(
    a: &Packed,
    rows: std::ops::Range<usize>,
    n: usize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    beta: f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    debug_assert!(rows.end <= a.lines && rows.start.is_multiple_of(MR));
    if !trivial(rows.len(), a.k, n, beta, c, rsc, csc) {
        product(rows.len(), a.k, n, Side::Packed(a, rows.start), Side::Strided(b, rsb, csb), beta, c, rsc, csc);
    }
}

/// [`gemm`] with `B` packed before ([`Packed::b`]): `A` (`m` rows) times all of `B`.
///
/// # Safety
/// As [`gemm`]'s for `A` and `C`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_b_packed(m: usize, a: *const f32, rsa: isize, csa: isize, b: &Packed, beta: f32, c: *mut f32, rsc: isize, csc: isize) {
    if !trivial(m, b.k, b.lines, beta, c, rsc, csc) {
        product(m, b.k, b.lines, Side::Strided(a, rsa, csa), Side::Packed(b, 0), beta, c, rsc, csc);
    }
}

/// Where a product's operand comes from: a matrix packed block by block as the product goes
/// (element strides), or packed before (from its line `.1`).
#[derive(Clone, Copy)]
enum Side<'a> {
    Strided(*const f32, isize, isize),
    Packed(&'a Packed, usize),
}

/// `C = A B + beta * C` (non-trivial) for [`gemm`] and the products of packed operands: per
/// block of `k`, `A`'s block packed (or taken), then per block of columns `B`'s (or taken),
/// then the tiles.
#[allow(clippy::too_many_arguments)]
unsafe fn product(m: usize, k: usize, n: usize, a: Side, b: Side, beta: f32, c: *mut f32, rsc: isize, csc: isize) {
    let (mut pa, mut pb) = PACKED.take();
    let column_blocks = n.div_ceil(NC);
    for (kb, k0) in (0..k).step_by(KC).enumerate() {
        let kc = KC.min(k - k0);
        let kp = kc.div_ceil(2);
        let (rows_at, s) = match a {
            Side::Strided(a, rsa, csa) => {
                let s = pack_a(m, kc, a.offset(k0 as isize * csa), rsa, csa, &mut pa);
                (pa.as_ptr(), s)
            }
            Side::Packed(p, from) => (p.blocks[kb].0.as_ptr().add(from * kp), p.blocks[kb].1),
        };
        let add = k0 > 0 || beta != 0.0;
        for (jb, j0) in (0..n).step_by(NC).enumerate() {
            let nc = NC.min(n - j0);
            let panels = match b {
                Side::Strided(b, rsb, csb) => {
                    pack_b(kc, nc, b.offset(k0 as isize * rsb + j0 as isize * csb), rsb, csb, &mut pb);
                    pb.as_ptr()
                }
                Side::Packed(p, _) => p.blocks[kb * column_blocks + jb].0.as_ptr(),
            };
            for jp in 0..nc.div_ceil(NR) {
                let cols = NR.min(nc - jp * NR);
                let panel = panels.add(jp * kp * NR);
                for i0 in (0..m).step_by(MR) {
                    let rows = MR.min(m - i0);
                    let at = c.offset(i0 as isize * rsc + (j0 + jp * NR) as isize * csc);
                    tile(kp, rows_at.add(i0 * kp), s, panel, at, rsc, csc, rows, cols, add);
                }
            }
        }
    }
    PACKED.set((pa, pb));
}

/// Does the product if it is empty (nothing to write) or has no contraction (`C = 0`, or `C`
/// kept with `beta` 1), and says whether it was; the kernels take the others.
///
/// # Safety
/// As [`gemm`]'s for `C`.
pub(super) unsafe fn trivial(m: usize, k: usize, n: usize, beta: f32, c: *mut f32, rsc: isize, csc: isize) -> bool {
    if k == 0 && beta == 0.0 {
        for i in 0..m {
            for j in 0..n {
                *c.offset(i as isize * rsc + j as isize * csc) = 0.0;
            }
        }
    }
    m == 0 || n == 0 || k == 0
}

/// The first `len` elements of `v`, grown (never shrunk) to hold them, their contents what
/// the last user left: the packers overwrite what they use. Clearing and resizing each
/// block's buffer zeroed all of it on every call, a pass over memory as large as the packing's
/// own writes (on the AMX Xeon, 1.6% of the bf16 GPT's step in `memset` on the tiles' path).
pub(super) fn at_least(v: &mut Vec<u32>, len: usize) -> &mut [u32] {
    if v.len() < len {
        v.resize(len, 0);
    }
    &mut v[..len]
}

/// The 32-bit pair `(lo, hi)` of two values rounded to bf16.
#[inline]
pub(super) fn pair(lo: f32, hi: f32) -> u32 {
    half::bf16::from_f32(lo).to_bits() as u32 | (half::bf16::from_f32(hi).to_bits() as u32) << 16
}

/// Packs `A`'s `m x kc` block as `kc / 2` pairs per row (the last pair's high half zero when
/// `kc` is odd), and returns where pair `q` of row `i` is, as `(row stride, pair stride)`: rows
/// of pairs `(kc / 2, 1)`, or, for an operand whose columns are contiguous, panels of [`MR`]
/// rows with each pair's rows side by side `(1, MR)` (row `i`'s panel starting at
/// `i / MR * MR * kc / 2` either way).
unsafe fn pack_a(m: usize, kc: usize, a: *const f32, rsa: isize, csa: isize, out: &mut Vec<u32>) -> (usize, usize) {
    let kp = kc.div_ceil(2);
    // Every pair is written (zeros past the last row of a panel and in an odd `kc`'s last
    // high halves): the buffer is not zeroed first.
    if csa != 1 && rsa == 1 {
        // Each pair of columns converted 16 rows at a time, straight into two panels.
        let out = at_least(out, m.div_ceil(MR) * MR * kp);
        #[cfg(target_arch = "x86_64")]
        x86::columns_into_panels(m, kc, a, csa, out.as_mut_ptr());
        return (1, MR);
    }
    let out = at_least(out, m * kp);
    for i in 0..m {
        let row = a.offset(i as isize * rsa);
        let dst = &mut out[i * kp..(i + 1) * kp];
        if csa == 1 {
            pairs_of_row(row, kc, dst);
        } else {
            for (q, d) in dst.iter_mut().enumerate() {
                let hi = if 2 * q + 1 < kc { *row.offset((2 * q + 1) as isize * csa) } else { 0.0 };
                *d = pair(*row.offset(2 * q as isize * csa), hi);
            }
        }
    }
    (kp, 1)
}

/// Packs `B`'s `kc x nc` block as panels of [`NR`] columns, each `kc / 2` pairs of rows deep
/// (zeros past the last column and, for odd `kc`, in the last pair's high halves).
unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, rsb: isize, csb: isize, out: &mut Vec<u32>) {
    let kp = kc.div_ceil(2);
    let panels = nc.div_ceil(NR);
    // The columns past `nc` in the last panel are zeros: only then is that panel zeroed
    // first, as the packers below write the columns up to `nc` (or to the next 16) alone.
    let out = at_least(out, panels * kp * NR);
    if !nc.is_multiple_of(NR) {
        out[(panels - 1) * kp * NR..].fill(0);
    }
    if csb != 1 && rsb == 1 {
        // Each column's values along `k` are contiguous, so its pairs are too: 16 columns
        // converted as lines of pairs, then turned 16 x 16 in registers into their panel.
        return LINE.with_borrow_mut(|line| {
            line.resize(16 * kp, 0);
            for j0 in (0..nc).step_by(16) {
                let cols = 16.min(nc - j0);
                for jj in 0..cols {
                    pairs_of_row(b.offset((j0 + jj) as isize * csb), kc, &mut line[jj * kp..(jj + 1) * kp]);
                }
                line[cols * kp..].fill(0);
                let panel = out.as_mut_ptr().add(j0 / NR * kp * NR + j0 % NR);
                for q0 in (0..kp).step_by(16) {
                    // SAFETY: rows `q0..q0 + 16` (at most `kp`) of the panel's 16 columns from `j0 % NR`.
                    #[cfg(target_arch = "x86_64")]
                    x86::turn16(line.as_ptr().add(q0), kp, 16.min(kp - q0), panel.add(q0 * NR), NR);
                }
            }
        });
    }
    if csb == 1 {
        #[cfg(target_arch = "x86_64")]
        x86::rows_into_panels(kc, nc, b, rsb, out.as_mut_ptr());
        return;
    }
    for p in 0..panels {
        let cols = NR.min(nc - p * NR);
        for q in 0..kp {
            let dst = &mut out[(p * kp + q) * NR..(p * kp + q + 1) * NR];
            let lo = b.offset(2 * q as isize * rsb + (p * NR) as isize * csb);
            let hi = (2 * q + 1 < kc).then(|| lo.offset(rsb));
            for (j, d) in dst[..cols].iter_mut().enumerate() {
                let h = hi.map_or(0.0, |h| *h.offset(j as isize * csb));
                *d = pair(*lo.offset(j as isize * csb), h);
            }
        }
    }
}

/// `dst[q]` = the pair of `row[2q], row[2q + 1]` (`row` contiguous, `len` values).
pub(super) unsafe fn pairs_of_row(row: *const f32, len: usize, dst: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    return x86::pairs_of_row(row, len, dst);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 products run only where `available`")
}

/// `dst[j]` = the pair of `lo[j], hi[j]` for `j < cols` (`hi` absent: zeros).
pub(super) unsafe fn interleave_rows(lo: *const f32, hi: Option<*const f32>, cols: usize, dst: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    return x86::interleave_rows(lo, hi, cols, dst);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 products run only where `available`")
}

/// One `rows x cols` tile of `C` (at most [`MR`] x [`NR`]) from `kp` pairs: `a` holds the rows'
/// pairs (pair `q` of row `i` at `i * si + q * sq`), `panel` the columns' pairs; `add`: add to
/// `C` rather than overwrite.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    kp: usize,
    a: *const u32,
    (si, sq): (usize, usize),
    panel: *const u32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
    rows: usize,
    cols: usize,
    add: bool,
) {
    #[cfg(target_arch = "x86_64")]
    return x86::tile(kp, a, si, sq, panel, c, rsc, csc, rows, cols, add);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 products run only where `available`")
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// Lanes `0..w` of 16 (all of them for `w` of 16 or more).
    #[inline(always)]
    pub(in crate::host) fn lanes(w: usize) -> __mmask16 {
        if w >= 16 {
            0xffff
        } else {
            ((1u32 << w) - 1) as u16
        }
    }

    /// The pairs `(lo[j], hi[j])` of `j < w` (at most 16; `hi` absent: zeros), rounded to
    /// bf16, side by side in 16 lanes of 32 bits (zeros past `w`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(in crate::host) unsafe fn pairs16(lo: *const f32, hi: Option<*const f32>, w: usize) -> __m512i {
        // Lanes 0..16 of the converted pair hold `lo`'s 16 values, 16..32 `hi`'s: put each
        // column's two side by side.
        let idx =
            _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        let mask = lanes(w);
        let l = _mm512_maskz_loadu_ps(mask, lo);
        let h = hi.map_or(_mm512_setzero_ps(), |h| _mm512_maskz_loadu_ps(mask, h));
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
        _mm512_permutexvar_epi16(idx, v)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pairs_of_row(row: *const f32, len: usize, dst: &mut [u32]) {
        let mut q = 0;
        // 32 values, 16 pairs, at a time: `cvtne2ps` keeps their order.
        while 2 * q + 32 <= len {
            let lo = _mm512_loadu_ps(row.add(2 * q));
            let hi = _mm512_loadu_ps(row.add(2 * q + 16));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.as_mut_ptr().add(q) as *mut _, v);
            q += 16;
        }
        while 2 * q < len {
            let hi = if 2 * q + 1 < len { *row.add(2 * q + 1) } else { 0.0 };
            dst[q] = super::pair(*row.add(2 * q), hi);
            q += 1;
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn interleave_rows(lo: *const f32, hi: Option<*const f32>, cols: usize, dst: &mut [u32]) {
        let mut j = 0;
        while j < cols {
            let w = cols - j;
            let v = pairs16(lo.add(j), hi.map(|h| h.add(j)), w);
            _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(j) as *mut _, lanes(w), v);
            j += 16;
        }
    }

    /// [`super::pack_a`] for an operand whose rows are adjacent (`A`'s columns `csa` apart):
    /// each pair of columns `2q, 2q + 1` converted 16 rows at a time, the first 8 rows' pairs
    /// into their panel's pair `q`, the next 8 into the next panel's (zeros past `m`). Two
    /// panels at a time, along `q`: their writes are consecutive (panels are `kp * 32` bytes
    /// apart, a stride whose writes, one per panel, evicted each other from L1).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn columns_into_panels(m: usize, kc: usize, a: *const f32, csa: isize, out: *mut u32) {
        let (kp, panels) = (kc.div_ceil(2), m.div_ceil(MR));
        for i0 in (0..m).step_by(2 * MR) {
            for q in 0..kp {
                let lo = a.offset(2 * q as isize * csa);
                let hi = (2 * q + 1 < kc).then(|| lo.offset(csa));
                let v = pairs16(lo.add(i0), hi.map(|h| h.add(i0)), m - i0);
                let p = i0 / MR;
                _mm256_storeu_si256(out.add((p * kp + q) * MR) as *mut _, _mm512_castsi512_si256(v));
                if p + 1 < panels {
                    _mm256_storeu_si256(out.add(((p + 1) * kp + q) * MR) as *mut _, _mm512_extracti64x4_epi64::<1>(v));
                }
            }
        }
    }

    /// [`super::pack_b`] for a row-major operand (`B`'s columns contiguous, rows `rsb`
    /// apart): each panel's pair `q`, the pairs of rows `2q, 2q + 1` in its [`NR`] columns,
    /// converted 16 columns at a time (zeros past `nc`, and in the high halves of an odd
    /// `kc`'s last pair).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn rows_into_panels(kc: usize, nc: usize, b: *const f32, rsb: isize, out: *mut u32) {
        let kp = kc.div_ceil(2);
        for p in 0..nc.div_ceil(NR) {
            let cols = NR.min(nc - p * NR);
            for q in 0..kp {
                let lo = b.offset(2 * q as isize * rsb).add(p * NR);
                let hi = (2 * q + 1 < kc).then(|| lo.offset(rsb));
                let dst = out.add((p * kp + q) * NR);
                _mm512_storeu_si512(dst as *mut _, pairs16(lo, hi, cols));
                _mm512_storeu_si512(dst.add(16) as *mut _, pairs16(lo.add(16), hi.map(|h| h.add(16)), cols.saturating_sub(16)));
            }
        }
    }

    /// `t[ii * t_stride + r] = src[r * stride + ii]` for the 16 rows `r` and the first `n`
    /// columns `ii` of a block (`n` rows of `t` written, 16 values each): a 16 x 16
    /// transposition of 32-bit values in registers, by unpacking pairs of rows, then pairs of
    /// pairs, then 128-bit lanes twice.
    #[target_feature(enable = "avx512f")]
    pub(in crate::host) unsafe fn turn16(src: *const u32, stride: usize, n: usize, t: *mut u32, t_stride: usize) {
        let m = lanes(n);
        let r: [__m512i; 16] = std::array::from_fn(|i| _mm512_maskz_loadu_epi32(m, src.add(i * stride) as *const i32));
        // Rows 2i and 2i + 1 interleaved by 32 bits, then rows 4i..4i + 4 by 64 bits: each
        // 128-bit lane `l` of `c[4i + j]` holds column `4l + j` of rows 4i..4i + 4.
        let a: [__m512i; 16] = std::array::from_fn(|i| {
            let (x, y) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(x, y)
            } else {
                _mm512_unpackhi_epi32(x, y)
            }
        });
        let c: [__m512i; 16] = std::array::from_fn(|i| {
            let (q, j) = (i / 4 * 4, i % 4);
            let (x, y) = (a[q + j / 2], a[q + 2 + j / 2]);
            if j % 2 == 0 {
                _mm512_unpacklo_epi64(x, y)
            } else {
                _mm512_unpackhi_epi64(x, y)
            }
        });
        // 128-bit lanes gathered: `d[8h + j]` holds column `j` of rows 8h..8h + 4 and of rows
        // 8h + 4..8h + 8 in lanes 0 and 2, column `j + 8` in lanes 1 and 3; then each row of
        // the result, column `i` of the 16 rows, takes its lanes from `d[i % 8]` and `d[8 + i % 8]`.
        let d: [__m512i; 16] = std::array::from_fn(|i| {
            let (h, j) = (i / 8, i % 8);
            let (x, y) = (c[8 * h + j % 4], c[8 * h + 4 + j % 4]);
            if j < 4 {
                _mm512_shuffle_i32x4::<0x88>(x, y)
            } else {
                _mm512_shuffle_i32x4::<0xdd>(x, y)
            }
        });
        for i in 0..n.min(16) {
            let (x, y) = (d[i % 8], d[8 + i % 8]);
            let e = if i < 8 { _mm512_shuffle_i32x4::<0x88>(x, y) } else { _mm512_shuffle_i32x4::<0xdd>(x, y) };
            _mm512_storeu_si512(t.add(i * t_stride) as *mut _, e);
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile(
        kp: usize,
        a: *const u32,
        si: usize,
        sq: usize,
        panel: *const u32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
        rows: usize,
        cols: usize,
        add: bool,
    ) {
        // Rows past `rows` read row 0 again (their sums are not stored).
        let r: [*const u32; MR] = std::array::from_fn(|i| a.add(if i < rows { i * si } else { 0 }));
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for q in 0..kp {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(panel.add(q * NR) as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(panel.add(q * NR + 16) as *const _));
            for i in 0..MR {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*r[i].add(q * sq) as i32));
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
            }
        }
        if csc == 1 {
            let (m0, m1) = (lanes(cols), lanes(cols.saturating_sub(16)));
            for (i, acc) in acc.iter().enumerate().take(rows) {
                let p = c.offset(i as isize * rsc);
                let (mut x0, mut x1) = (acc[0], acc[1]);
                if add {
                    x0 = _mm512_add_ps(x0, _mm512_maskz_loadu_ps(m0, p));
                    x1 = _mm512_add_ps(x1, _mm512_maskz_loadu_ps(m1, p.add(16)));
                }
                _mm512_mask_storeu_ps(p, m0, x0);
                _mm512_mask_storeu_ps(p.add(16), m1, x1);
            }
        } else {
            let mut t = [[0f32; NR]; MR];
            for i in 0..rows {
                _mm512_storeu_ps(t[i].as_mut_ptr(), acc[i][0]);
                _mm512_storeu_ps(t[i].as_mut_ptr().add(16), acc[i][1]);
            }
            for (i, t) in t.iter().enumerate().take(rows) {
                for (j, &v) in t.iter().enumerate().take(cols) {
                    let p = c.offset(i as isize * rsc + j as isize * csc);
                    *p = if add { *p + v } else { v };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values rounded to bf16, of both signs and a spread of magnitudes.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                half::bf16::from_f32(u * (1 << (s % 5)) as f32).to_f32()
            })
            .collect()
    }

    /// The kernels this CPU runs bf16 products on: `vdpbf16ps` pairs, and AMX tiles where
    /// the core has them (each tested on its own, whichever the products pick).
    type Kernel = unsafe fn(usize, usize, usize, *const f32, isize, isize, *const f32, isize, isize, f32, *mut f32, isize, isize);
    fn kernels() -> Vec<(&'static str, Kernel)> {
        let mut out: Vec<(&'static str, Kernel)> = vec![("pairs", gemm)];
        #[cfg(target_arch = "x86_64")]
        if super::super::amx::available() {
            out.push(("amx", |m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc| unsafe {
                super::super::amx::gemm(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc, None)
            }));
        } else {
            eprintln!("AMX kernel not tested: this CPU (or Linux) gives no AMX tiles");
        }
        out
    }

    /// A packed operand gives [`gemm`]'s bits: `A` packed, in every orientation of `A` and of
    /// `B`, whole and in bands of rows (multiples of the tile's), and `B` packed, in every
    /// orientation, with `beta` 0 and 1; shapes past one block of `k` ([`KC`]) and of columns
    /// ([`NC`]), odd `k`, partial tiles.
    #[test]
    fn packed_operands_give_the_products_bits() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for &(m, k, n) in &[(1, 1, 1), (52, 640, 32), (9, 33, 600), (70, 1031, 45), (16, 2, 17)] {
            let (a, b, c0) = (values(m * k, 4), values(k * n, 5), values(m * n, 6));
            for (ta, tb, beta) in [(false, false, 0.0), (true, false, 1.0), (false, true, 0.0), (true, true, 1.0)] {
                let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
                let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
                let mut want = c0.clone();
                unsafe { gemm(m, k, n, a.as_ptr(), rsa, csa, b.as_ptr(), rsb, csb, beta, want.as_mut_ptr(), n as isize, 1) };
                let pa = unsafe { Packed::a(m, k, a.as_ptr(), rsa, csa) };
                // Whole, then in bands of two tiles' rows.
                for per in [m.max(1), 2 * MR] {
                    let bands: Vec<_> = (0..m).step_by(per).map(|r| r..(r + per).min(m)).collect();
                    let mut got = c0.clone();
                    for rows in bands {
                        let at = got.as_mut_ptr().wrapping_add(rows.start * n);
                        unsafe { gemm_a_packed(&pa, rows, n, b.as_ptr(), rsb, csb, beta, at, n as isize, 1) };
                    }
                    assert_eq!(bits(&got), bits(&want), "A packed, {m}x{k}x{n}, transposed {ta} {tb}");
                }
                let pb = unsafe { Packed::b(k, n, b.as_ptr(), rsb, csb) };
                let mut got = c0.clone();
                unsafe { gemm_b_packed(m, a.as_ptr(), rsa, csa, &pb, beta, got.as_mut_ptr(), n as isize, 1) };
                assert_eq!(bits(&got), bits(&want), "B packed, {m}x{k}x{n}, transposed {ta} {tb}");
            }
        }
    }

    /// Every orientation of both operands and of `C`, odd `k`, edges of every tile and block
    /// (AMX's 16 x 16 tiles, 32-row strips and 16-pair depth too), `beta` 1, on each kernel:
    /// each element within `k` f32 roundings of the f64 product of the same bf16 values
    /// (which is what the f32 emulation computes, up to its own order of sums). The shapes run
    /// in this order on one thread, so a smaller product's padding is packed into buffers that
    /// hold a larger one's values: a packer that left padding to a zeroed buffer would show.
    #[test]
    fn products_of_bf16_values_match_f64_in_every_orientation() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        for (name, gemm) in kernels() {
            for &(m, k, n) in
                &[(1, 1, 1), (3, 5, 7), (9, 33, 31), (17, 1031, 45), (70, 64, 600), (8, 2, 32), (33, 1100, 47), (16, 32, 16), (48, 513, 65)]
            {
                let a = values(m * k, 1);
                let b = values(k * n, 2);
                let c0 = values(m * n, 3);
                for (ta, tb, tc, beta) in [(false, false, false, 0.0), (true, false, false, 1.0), (false, true, true, 0.0), (true, true, true, 1.0)] {
                    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
                    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
                    let (rsc, csc) = if tc { (1, m as isize) } else { (n as isize, 1) };
                    let mut c = c0.clone();
                    unsafe { gemm(m, k, n, a.as_ptr(), rsa, csa, b.as_ptr(), rsb, csb, beta, c.as_mut_ptr(), rsc, csc) };
                    if m * n > 1 {
                        assert_ne!(c, c0, "{name} {m}x{k}x{n}: C unchanged");
                    }
                    for i in 0..m {
                        for j in 0..n {
                            let (mut exact, mut mag) = (0f64, 0f64);
                            for l in 0..k {
                                let x = a[(i as isize * rsa + l as isize * csa) as usize] as f64
                                    * b[(l as isize * rsb + j as isize * csb) as usize] as f64;
                                exact += x;
                                mag += x.abs();
                            }
                            let at = (i as isize * rsc + j as isize * csc) as usize;
                            if beta != 0.0 {
                                exact += c0[at] as f64;
                                mag += (c0[at] as f64).abs();
                            }
                            let err = (c[at] as f64 - exact).abs();
                            assert!(
                                err <= (k + 1) as f64 * f32::EPSILON as f64 * mag,
                                "{name} {m}x{k}x{n} {ta} {tb} {tc} at ({i}, {j}): {} against {exact}",
                                c[at]
                            );
                        }
                    }
                }
            }
        }
    }

    /// Values that are not bf16 are rounded to the nearest (ties to even) as they are packed,
    /// by the vector and the scalar packing alike.
    #[test]
    fn other_values_are_rounded_to_bf16_when_packed() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        let (m, k, n) = (2, 40, 40);
        let a: Vec<f32> = (0..m * k).map(|i| 1.0 + (i as f32) * 1e-3).collect();
        let b: Vec<f32> = (0..k * n).map(|i| if i % 7 == 0 { 1.0 } else { 0.0 }).collect();
        let round = |x: f32| half::bf16::from_f32(x).to_f32() as f64;
        for (name, gemm) in kernels() {
            for ta in [false, true] {
                let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
                let mut c = vec![0f32; m * n];
                unsafe { gemm(m, k, n, a.as_ptr(), rsa, csa, b.as_ptr(), n as isize, 1, 0.0, c.as_mut_ptr(), n as isize, 1) };
                for i in 0..m {
                    for j in 0..n {
                        let exact: f64 = (0..k).map(|l| round(a[(i as isize * rsa + l as isize * csa) as usize]) * b[l * n + j] as f64).sum();
                        assert!(
                            (c[i * n + j] as f64 - exact).abs() <= 1e-5 * exact.abs().max(1.0),
                            "{name} {ta} ({i}, {j}): {} against {exact}",
                            c[i * n + j]
                        );
                    }
                }
            }
        }
    }
}

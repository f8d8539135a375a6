//! Products of bf16 values with f32 accumulation on AMX tiles (`tdpbf16ps`): the host's
//! bf16 matrix kernel where the core has AMX-BF16 (Sapphire Rapids and later Xeons), at
//! several times the multiply-adds of AVX-512 BF16's `vdpbf16ps` ([`super::bf16`], which runs
//! them elsewhere). One instruction multiplies a 16 x 32 tile of bf16 values by a 32 x 16 one
//! and adds each element's 32 products, pair by pair, to a 16 x 16 tile of f32 sums (denormals
//! flushed to zero, round to nearest even, as `vdpbf16ps`).
//!
//! Rust has no stable AMX intrinsics: the six instructions are written as inline assembly,
//! and the tile data the kernel needs is asked of Linux once per process
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); where that is refused, or the CPU
//! has no AMX-BF16, [`available`] is false and the products go to [`super::bf16`]'s kernel
//! where it beats the f32 GEMM ([`super::bf16::pays`]: not on Intel's cores), else to the f32
//! GEMM. `CELLGRAPH_AMX=0` refuses the tiles too (to time the kernels against each other;
//! with `CELLGRAPH_BF16_PAIRS=1`, against the pairs).
//!
//! Layout: `k` in blocks of [`KC`] values and the columns in blocks of [`NC`]; each block of
//! `A` and of `B` is packed as whole tiles, each tile's 1 KiB contiguous (tile rows 64 bytes
//! apart), zero-padded: `A` as strips of 32 rows (two tiles of 16 rows of 16 bf16 pairs along
//! `k`, side by side for each 16 pairs), `B` as panels of 32 columns (two tiles of 16 pairs of
//! rows by 16 columns: AMX's "VNNI" layout of the right operand). The micro-kernel holds a 32
//! x 32 block of `C` in four accumulator tiles, with two tiles of the strip and two of the
//! panel; each block of `k` is summed in the tiles and then added to `C` (as [`super::bf16`]
//! adds its blocks), so an element's sum does not depend on how `C` is cut among threads.
//! A whole 32 x 32 block of a row-major `C` that is written, not added to (the first block of
//! `k`, `beta` 0), is stored from the tiles straight into `C`; the others go through a 4 KiB
//! block of sums (the qkv product of the GPT, 1024 x 128 by 128 x 384, took 146 us through it
//! and 130 straight, on a Xeon with AMX).

use super::bf16::{at_least, interleave_rows, pair, pairs_of_row};

/// Pairs of `k` in one tile row (64 bytes).
const TK: usize = 16;
/// Rows of a tile, and columns of an f32 tile.
const TR: usize = 16;
/// `u32` (pairs, or f32) in a tile.
const TILE_LEN: usize = TR * TK;
/// Rows of a strip of `A`, columns of a panel of `B` (two tiles).
const STRIP: usize = 2 * TR;
/// Values of `k` per packed block: 384 pairs, a strip of `A` and a panel of `B` 48 KiB each
/// (768 was the fastest of 384 to 1,024 at GPT-2-small's shapes on a Xeon with AMX).
const KC: usize = 768;
/// Columns of `B` per packed block (512 KiB of pairs, in L2).
const NC: usize = 512;
/// The micro-kernel's block of `C`, `(rows, columns)` (a block of at most 16 rows runs two of
/// its four tiles): what a caller choosing between `C = A B` and `C^T = B^T A^T` weighs.
pub const TILE: (usize, usize) = (TR, STRIP);

/// Whether this process multiplies bf16 values on AMX tiles: the CPU has AMX-TILE and
/// AMX-BF16 (and the AVX-512 BF16 the packing uses), Linux granted the tile data, and
/// `CELLGRAPH_AMX` is not `0` ([`super::units`]); checked once.
pub fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| super::units().amx != Some(false) && super::bf16::available() && x86::grant())
}

thread_local! {
    /// Packed `A` and `B` blocks and one line of pairs (grown, never shrunk).
    static PACKED: std::cell::Cell<[Vec<u32>; 3]> = const { std::cell::Cell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// `C = A B + beta * C` as [`super::bf16::gemm`] (same arguments, same rounding of values
/// that are not bf16), on AMX tiles; then, with `rows_done`, `rows_done(i, rows)` for each
/// strip of `C`'s rows `i..i + rows` once the product has finished them (its last block of `k`
/// and of columns), in order: every row of `C` exactly once, while the strip is still in
/// cache, so that what reads it next (an epilogue) does not fetch it again from memory.
///
/// # Safety
/// As [`super::bf16::gemm`], and [`available`] must be true; `rows_done` may read and write
/// the strip's rows of `C`, which the product no longer touches (and may run anything else,
/// products on tiles included: the tiles are released around it).
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
    rows_done: Option<&dyn Fn(usize, usize)>,
) {
    debug_assert!(available());
    if super::bf16::trivial(m, k, n, beta, c, rsc, csc) {
        if let Some(done) = rows_done.filter(|_| m > 0) {
            done(0, m);
        }
        return;
    }
    let [mut pa, mut pb, mut line] = PACKED.take();
    x86::configure();
    let mut t = [0f32; STRIP * STRIP];
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        let chunks = kc.div_ceil(2 * TK);
        let strip_len = chunks * 2 * TILE_LEN;
        let pa = at_least(&mut pa, m.div_ceil(STRIP) * strip_len);
        // `A` read transposed (its rows adjacent, a weight's gradient `X^T dY`): packed whole
        // first, in one pass along the rows of `X` in memory order (each strip packed on its
        // own read 128 bytes of every row of `X`, a stride the prefetchers do not follow:
        // fc2's weight gradient in the bf16 GPT took twice as long in the step as alone).
        let whole = rsa == 1 && csa != 1;
        if whole {
            pack(m, kc, a.offset(k0 as isize * csa), rsa, csa, false, pa, &mut line);
        }
        let add = k0 > 0 || beta != 0.0;
        for j0 in (0..n).step_by(NC) {
            let nc = NC.min(n - j0);
            // `B`'s columns are the rows of `B^T`: a panel of `B` is a strip of `B^T`, its
            // tiles laid out as AMX's right operand (a tile row per pair of `k`).
            let pb = at_least(&mut pb, nc.div_ceil(STRIP) * strip_len);
            pack(nc, kc, b.offset(k0 as isize * rsb + j0 as isize * csb), csb, rsb, true, pb, &mut line);
            for i0 in (0..m).step_by(STRIP) {
                let rows = STRIP.min(m - i0);
                let strip = &mut pa[i0 / STRIP * strip_len..][..strip_len];
                // Each strip of `A` is packed just before its first products (with the first
                // block of columns), so it is multiplied while still in cache (timed within
                // the noise of packing every strip first, on the Xeon it was written on).
                if j0 == 0 && !whole {
                    pack(rows, kc, a.offset(k0 as isize * csa + i0 as isize * rsa), rsa, csa, false, strip, &mut line);
                }
                let strip = strip.as_ptr();
                for jp in 0..nc.div_ceil(STRIP) {
                    let cols = STRIP.min(nc - jp * STRIP);
                    let panel = pb.as_ptr().add(jp * chunks * 2 * TILE_LEN);
                    let at = c.offset(i0 as isize * rsc + (j0 + jp * STRIP) as isize * csc);
                    if !add && csc == 1 && rsc > 0 && rows == STRIP && cols == STRIP {
                        // A whole block written, not added: the tiles straight into `C`.
                        x86::block(chunks, strip, panel, true, at, rsc as usize);
                        continue;
                    }
                    x86::block(chunks, strip, panel, rows > TR, t.as_mut_ptr(), STRIP);
                    if csc == 1 {
                        x86::put_rows(&t, rows, cols, at, rsc, add);
                    } else {
                        for (i, row) in t.chunks_exact(STRIP).take(rows).enumerate() {
                            let p = at.offset(i as isize * rsc);
                            for (j, &v) in row[..cols].iter().enumerate() {
                                let e = p.offset(j as isize * csc);
                                *e = if add { *e + v } else { v };
                            }
                        }
                    }
                }
                if let Some(done) = rows_done.filter(|_| k0 + kc == k && j0 + nc == n) {
                    // The tiles are let go around the call: it may share its work out on
                    // rayon, and this thread may run another product on tiles meanwhile
                    // (whose end releases them).
                    x86::release();
                    done(i0, rows);
                    x86::configure();
                }
            }
        }
    }
    x86::release();
    PACKED.set([pa, pb, line]);
}

/// Packs the `rows x kc` block `X` (element `(i, l)` at `i * rs + l * cs`, rounded to bf16
/// and paired along `k`; zeros past `kc` and past the last row) as strips of 32 rows, each
/// strip `kc / 32` (rounded up) steps of two tiles, the strip's first 16 rows then its next
/// 16. A tile holds 16 rows by 16 pairs: each tile row one row of `X` (`A`'s strips), or, with
/// `columns`, each tile row one pair of `X`'s 16 rows side by side (`B`'s panels, packed as
/// the strips of `B^T`).
///
/// `out` holds the strips (its contents are overwritten: zeroed first only where the packing
/// leaves padding, a last strip of fewer than 32 rows or `kc` not a multiple of 32).
#[allow(clippy::too_many_arguments)]
unsafe fn pack(rows: usize, kc: usize, x: *const f32, rs: isize, cs: isize, columns: bool, out: &mut [u32], line: &mut Vec<u32>) {
    let (pairs, chunks) = (kc.div_ceil(2), kc.div_ceil(2 * TK));
    assert_eq!(out.len(), rows.div_ceil(STRIP) * chunks * 2 * TILE_LEN, "the strips' extents");
    if !rows.is_multiple_of(STRIP) || !kc.is_multiple_of(2 * TK) {
        out.fill(0);
    }
    let tile = |i: usize, q: usize| ((i / STRIP * chunks + q / TK) * 2 + i % STRIP / TR) * TILE_LEN;
    let at = |i: usize, q: usize| tile(i, q) + if columns { q % TK * TR + i % TR } else { i % TR * TK + q % TK };
    if cs != 1 && rs == 1 {
        // Rows adjacent, each row's values along `k` `cs` apart: each pair of columns is
        // converted 16 rows at a time, straight into its tile row (`columns`), or as a line
        // of `rows` pairs, 16 such lines (a tile's pairs) at a time, turned into the tiles.
        line.resize(TK * rows, 0);
        for c in 0..chunks {
            for qq in 0..TK {
                let q = c * TK + qq;
                let lo = x.offset(2 * q as isize * cs);
                let hi = (2 * q + 1 < kc).then(|| lo.offset(cs));
                if columns {
                    if q < pairs {
                        // Every tile row this pair of rows fills lies inside `out`.
                        x86::pair_rows_into_tiles(lo, hi, rows, out.as_mut_ptr().add(at(0, q)), (chunks * 2 - 1) * TILE_LEN);
                    }
                } else if q < pairs {
                    interleave_rows(lo, hi, rows, &mut line[qq * rows..(qq + 1) * rows]);
                } else {
                    line[qq * rows..(qq + 1) * rows].fill(0);
                }
            }
            if !columns {
                // Pair `qq` of row `i` is `line[qq * rows + i]`.
                turn(line, rows, rows, |i| tile(i, c * TK), out);
            }
        }
        return;
    }
    let width = pairs.next_multiple_of(TK);
    line.resize(TK * width, 0);
    for i0 in (0..rows).step_by(TR) {
        let n = TR.min(rows - i0);
        for i in i0..i0 + n {
            let row = x.offset(i as isize * rs);
            if cs == 1 && !columns {
                // Every tile row of row `i` lies inside `out`, 2 tiles apart.
                x86::row_into_tiles(row, kc, out.as_mut_ptr().add(at(i, 0)), 2 * TILE_LEN);
                continue;
            }
            line[(i - i0) * width + pairs..(i - i0 + 1) * width].fill(0);
            let dst = &mut line[(i - i0) * width..][..pairs];
            if cs == 1 {
                pairs_of_row(row, kc, dst);
            } else {
                for (q, d) in dst.iter_mut().enumerate() {
                    let hi = if 2 * q + 1 < kc { *row.offset((2 * q + 1) as isize * cs) } else { 0.0 };
                    *d = pair(*row.offset(2 * q as isize * cs), hi);
                }
            }
            if !columns {
                // Runs of 16 pairs are one tile row.
                for (c, run) in dst.chunks(TK).enumerate() {
                    let to = at(i, c * TK);
                    out[to..to + run.len()].copy_from_slice(run);
                }
            }
        }
        if columns {
            // Pair `q` of row `i0 + r` is `line[r * width + q]`: each 16 pairs are turned into a
            // tile, its rows the pairs.
            line[n * width..TK * width].fill(0);
            for c in 0..chunks {
                turn(&line[c * TK..], width, TK, |_| tile(i0, c * TK), out);
            }
        }
    }
}

/// Writes `src`'s 16 x `count` block (element `(r, i)` at `r * stride + i`) turned, a tile
/// per 16 values of `i`: element `(r, i)` to `out[tile(i0) + (i - i0) * 16 + r]`, `i0` the
/// first `i` of its tile.
fn turn(src: &[u32], stride: usize, count: usize, tile: impl Fn(usize) -> usize, out: &mut [u32]) {
    for i0 in (0..count).step_by(TR) {
        let t = &mut out[tile(i0)..][..TILE_LEN];
        let n = TR.min(count - i0);
        assert!(src.len() >= (TK - 1) * stride + i0 + n, "the block lies in `src`");
        // SAFETY: row `r` of the block is `src[r * stride + i0..][..n]`, inside `src` (checked);
        // the tile is 16 x 16; the packers run where AVX-512 is (`available`).
        unsafe { super::bf16::x86::turn16(src.as_ptr().add(i0), stride, n, t.as_mut_ptr(), TR) };
        t[n * TR..].fill(0);
    }
}

mod x86 {
    use super::super::bf16::x86::{lanes, pairs16};
    use super::{STRIP, TILE_LEN, TK, TR};
    use std::arch::asm;

    /// Asks Linux for the AMX tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM,
    /// XFEATURE_XTILEDATA)`; once granted it holds for every thread of the process) after
    /// CPUID says the core has AMX-TILE and AMX-BF16.
    pub(super) fn grant() -> bool {
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        let (bf16, tile) = (edx >> 22 & 1 == 1, edx >> 24 & 1 == 1);
        if !(bf16 && tile) {
            return false;
        }
        const ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let r: i64;
        // SAFETY: the system call takes two integers and changes only the process's
        // permissions; it clobbers rcx and r11 as every `syscall` does.
        unsafe {
            asm!("syscall", inlateout("rax") ARCH_PRCTL => r, in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
                 lateout("rcx") _, lateout("r11") _, options(nostack));
        }
        r == 0
    }

    /// `C[i, ..cols] = t[i, ..cols]` (`add`: `+=`) for the block's first `rows` rows, `C`'s
    /// rows `rsc` apart and contiguous.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn put_rows(t: &[f32; STRIP * STRIP], rows: usize, cols: usize, c: *mut f32, rsc: isize, add: bool) {
        use std::arch::x86_64::*;
        let (m0, m1) = (lanes(cols), lanes(cols.saturating_sub(16)));
        for i in 0..rows {
            let (p, s) = (c.offset(i as isize * rsc), t.as_ptr().add(i * STRIP));
            let (mut x0, mut x1) = (_mm512_loadu_ps(s), _mm512_loadu_ps(s.add(16)));
            if add {
                x0 = _mm512_add_ps(x0, _mm512_maskz_loadu_ps(m0, p));
                x1 = _mm512_add_ps(x1, _mm512_maskz_loadu_ps(m1, p.add(16)));
            }
            _mm512_mask_storeu_ps(p, m0, x0);
            _mm512_mask_storeu_ps(p.add(16), m1, x1);
        }
    }

    /// Row `row` of `kc` values as bf16 pairs into its tile rows, 16 pairs (a tile row) at a
    /// time, the first at `out` and each next `step` further on (zeros past `kc`).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn row_into_tiles(row: *const f32, kc: usize, mut out: *mut u32, step: usize) {
        use std::arch::x86_64::*;
        let mut l = 0;
        while l < kc {
            let w = kc - l;
            let lo = _mm512_maskz_loadu_ps(lanes(w), row.add(l));
            let hi = _mm512_maskz_loadu_ps(lanes(w.saturating_sub(16)), row.add(l + 16));
            // `cvtne2ps` keeps the order: the 32 values' pairs side by side.
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out as *mut _, v);
            l += 2 * TK;
            out = out.wrapping_add(step);
        }
    }

    /// Rows `lo` and `hi` (absent: zeros) of `rows` values, the pair of each column, into the
    /// tile rows of a panel's pair: columns `0..16` at `out`, `16..32` a tile further on, the
    /// next 32 in the next panel, `next` after the second tile (zeros past `rows`).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pair_rows_into_tiles(lo: *const f32, hi: Option<*const f32>, rows: usize, mut out: *mut u32, next: usize) {
        use std::arch::x86_64::*;
        let mut j = 0;
        while j < rows {
            _mm512_storeu_si512(out as *mut _, pairs16(lo.add(j), hi.map(|h| h.add(j)), rows - j));
            out = out.wrapping_add(if j % STRIP == 0 { TILE_LEN } else { next });
            j += TR;
        }
    }

    /// The tile configuration: palette 1, eight tiles of 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut b = [0u8; 64];
        b[0] = 1;
        let mut t = 0;
        while t < 8 {
            b[16 + 2 * t] = 64;
            b[48 + t] = TR as u8;
            t += 1;
        }
        Config(b)
    };

    /// Loads the tile configuration on the calling thread.
    pub(super) unsafe fn configure() {
        asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
    }

    /// Gives the calling thread's tiles back (their state no longer saved on a switch).
    pub(super) unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem));
    }

    /// One 32 x 32 block of sums (16 x 32 when `both` is false) into `t` (rows `ld` f32
    /// apart: the block's own 32, or `C`'s rows) from `chunks` steps of the strip `a`
    /// and the panel `b` (each step two tiles of each, as [`super::pack`] lays them out).
    #[inline]
    pub(super) unsafe fn block(chunks: usize, a: *const u32, b: *const u32, both: bool, t: *mut f32, ld: usize) {
        let s = TK * 4;
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        for q in 0..chunks {
            let (a, b) = (a.add(q * 2 * TILE_LEN), b.add(q * 2 * TILE_LEN));
            if both {
                asm!(
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tileloadd tmm6, [{b0} + {s}*1]",
                    "tileloadd tmm7, [{b1} + {s}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm5, [{a1} + {s}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a, a1 = in(reg) a.add(TILE_LEN), b0 = in(reg) b, b1 = in(reg) b.add(TILE_LEN),
                    s = in(reg) s, options(nostack, readonly),
                );
            } else {
                asm!(
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tileloadd tmm6, [{b0} + {s}*1]",
                    "tileloadd tmm7, [{b1} + {s}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    a0 = in(reg) a, b0 = in(reg) b, b1 = in(reg) b.add(TILE_LEN),
                    s = in(reg) s, options(nostack, readonly),
                );
            }
        }
        let st = ld * 4;
        asm!(
            "tilestored [{t0} + {st}*1], tmm0",
            "tilestored [{t1} + {st}*1], tmm1",
            t0 = in(reg) t, t1 = in(reg) t.add(TR), st = in(reg) st, options(nostack),
        );
        if both {
            asm!(
                "tilestored [{t0} + {st}*1], tmm2",
                "tilestored [{t1} + {st}*1], tmm3",
                t0 = in(reg) t.add(TR * ld), t1 = in(reg) t.add(TR * ld + TR), st = in(reg) st, options(nostack),
            );
        }
    }
}

//! Max pooling of f32 planes on AVX-512, sixteen outputs a vector, with the comparisons of
//! [`super`]'s portable loops in their order (the same outputs and argmax, bit for bit):
//! - 2x2 windows at stride 2 inside the plane (LeNet's two pools): each row pair's inputs
//!   loaded as two vectors and split into even and odd columns by a permutation, where the
//!   portable loop ran at four lanes on rows of 14 and 5 outputs (118 against 19 us for
//!   LeNet's first pool over a batch of 32, `benches/kernels.rs`); its gradient writes each
//!   input's share (`0 + dy`, or `0`) as the scatter does;
//! - any window at a column stride of 1 or 2 ([`separable`]: ResNet's 3x3 at stride 2 padded
//!   by 1), in the portable path's two passes, each tap's inputs read straight from the row.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether this CPU has AVX-512 F; checked once.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
use crate::host::bf16::x86::lanes;

/// `0, 2, ..., 30`: the even lanes of two vectors to a permutation, and each lane's offset
/// at a stride of 2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn evens() -> __m512i {
    _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
}

/// Whether `v` replaces the best so far `b`: greater, or NaN (the portable paths' `takes`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn takes(v: __m512, b: __m512) -> __mmask16 {
    _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, b) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v)
}

/// `2n` values of a row from `r` (`n` at most 16), split into its even and odd ones.
///
/// # Safety
/// `r` must address `2n` readable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pairs(r: *const f32, n: usize) -> (__m512, __m512) {
    let lo = _mm512_maskz_loadu_ps(lanes(2 * n), r);
    let hi = _mm512_maskz_loadu_ps(lanes((2 * n).saturating_sub(16)), r.wrapping_add(16));
    let even = evens();
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    (_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi))
}

/// 2x2 max pooling at stride 2 over one `[h, w]` plane into `y` and `at` (`[oh, ow]`, every
/// window inside the plane): per window the top row's two inputs, then the bottom row's, the
/// first largest kept (the last NaN), as `pool_2x2` compares them.
///
/// # Safety
/// The CPU must have AVX-512 F ([`available`]); `plane` must hold the `2 oh` rows of `w`
/// that the windows read, `w >= 2 ow`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn pool_2x2(w: usize, ow: usize, plane: &[f32], at: &mut [u32], y: &mut [f32]) {
    let twice = evens();
    let (one, below, diagonal) = (_mm512_set1_epi32(1), _mm512_set1_epi32(w as i32), _mm512_set1_epi32(w as i32 + 1));
    for (oy, (at, y)) in at.chunks_exact_mut(ow).zip(y.chunks_exact_mut(ow)).enumerate() {
        let top = 2 * oy * w;
        let (r0, r1) = (plane[top..top + 2 * ow].as_ptr(), plane[top + w..top + w + 2 * ow].as_ptr());
        for x0 in (0..ow).step_by(16) {
            let n = (ow - x0).min(16);
            let ((a, b), (c, d)) = (pairs(r0.add(2 * x0), n), pairs(r1.add(2 * x0), n));
            // Left to right along the top row, then the bottom row; `k` the winner's place.
            let t1 = takes(b, a);
            let (m1, k1) = (_mm512_mask_blend_ps(t1, a, b), _mm512_maskz_mov_epi32(t1, one));
            let t2 = takes(c, m1);
            let (m2, k2) = (_mm512_mask_blend_ps(t2, m1, c), _mm512_mask_blend_epi32(t2, k1, below));
            let t3 = takes(d, m2);
            let (best, k) = (_mm512_mask_blend_ps(t3, m2, d), _mm512_mask_blend_epi32(t3, k2, diagonal));
            let first = _mm512_add_epi32(_mm512_set1_epi32((top + 2 * x0) as i32), twice);
            _mm512_mask_storeu_ps(y.as_mut_ptr().add(x0), lanes(n), best);
            _mm512_mask_storeu_epi32(at.as_mut_ptr().add(x0) as *mut i32, lanes(n), _mm512_add_epi32(first, k));
        }
    }
}

/// The gradient of [`pool_2x2`] over one plane: each input of a window takes `0 + dy` of the
/// window's output if it is the window's argmax, else `0` (the scatter's `0 += dy`, so a
/// `-0` gradient arrives as `+0` there too); inputs in no window are zeros.
///
/// # Safety
/// As [`pool_2x2`]; `at` must be its argmax of this plane's windows, `dx` the plane's `h * w`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn grad_2x2(h: usize, w: usize, ow: usize, at: &[u32], dy: &[f32], dx: &mut [f32]) {
    let oh = at.len() / ow.max(1);
    if 2 * oh != h || 2 * ow != w {
        dx.fill(0.0);
    }
    let twice = evens();
    let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    let (zero, one, below, diagonal) = (_mm512_setzero_ps(), _mm512_set1_epi32(1), _mm512_set1_epi32(w as i32), _mm512_set1_epi32(w as i32 + 1));
    for (oy, (at, dy)) in at.chunks_exact(ow).zip(dy.chunks_exact(ow)).enumerate() {
        let top = 2 * oy * w;
        for x0 in (0..ow).step_by(16) {
            let n = (ow - x0).min(16);
            let a = _mm512_maskz_loadu_epi32(lanes(n), at.as_ptr().add(x0) as *const i32);
            let g = _mm512_maskz_loadu_ps(lanes(n), dy.as_ptr().add(x0));
            let k = _mm512_sub_epi32(a, _mm512_add_epi32(_mm512_set1_epi32((top + 2 * x0) as i32), twice));
            let share = |place: __m512i| _mm512_add_ps(zero, _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(k, place), g));
            let rows = [(top, share(_mm512_setzero_si512()), share(one)), (top + w, share(below), share(diagonal))];
            for (row, left, right) in rows {
                let out = dx.as_mut_ptr().add(row + 2 * x0);
                _mm512_mask_storeu_ps(out, lanes(2 * n), _mm512_permutex2var_ps(left, lo, right));
                _mm512_mask_storeu_ps(out.wrapping_add(16), lanes((2 * n).saturating_sub(16)), _mm512_permutex2var_ps(left, hi, right));
            }
        }
    }
}

/// The load of a tap's inputs for 16 outputs at a stride of `sx` (1 or 2): columns
/// `c0 + sx * lane` of a row of `w` from `row`, -inf where a column lies outside `0..w`
/// (padding, never taken).
///
/// # Safety
/// `row` must address the row's `w` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn taps(row: *const f32, w: usize, c0: isize, sx: usize) -> __m512 {
    let inf = _mm512_set1_ps(f32::NEG_INFINITY);
    // Lanes `j` of the 16 (or 32) columns from `c0` that lie in the row.
    let inside = |from: isize| -> __mmask16 {
        let lo = (-from).clamp(0, 16) as usize;
        let hi = (w as isize - from).clamp(0, 16) as usize;
        lanes(hi) & !lanes(lo)
    };
    let load = |from: isize| _mm512_mask_loadu_ps(inf, inside(from), row.wrapping_offset(from));
    if sx == 1 {
        return load(c0);
    }
    _mm512_permutex2var_ps(load(c0), evens(), load(c0 + 16))
}

/// `pool_separable` of [`super`] for f32 planes at a column stride of 1 or 2 (ResNet's
/// 3x3 at stride 2 padded by 1): the same two passes, the same comparisons in the same
/// order, sixteen outputs a vector; the row pass reads each tap's inputs straight from the
/// row (padding as -inf), where the portable pass first dealt a padded copy of the row into
/// its phases one value at a time. `hv` and `hi` are `[h, ow]` scratch. Returns the outputs
/// left at -inf (for the caller's general path), as `oy * ow + ox`, in `left`.
///
/// # Safety
/// The CPU must have AVX-512 F; `g.stride[1]` must be 1 or 2; `plane` the `[h, w]` plane,
/// `at` and `y` its `[oh, ow]` outputs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn separable(
    g: &crate::kernel::Geometry,
    plane: &[f32],
    at: &mut [u32],
    y: &mut [f32],
    hv: &mut [f32],
    hi: &mut [u32],
    left: &mut Vec<usize>,
) {
    let [_, _, h, w] = g.x;
    let ([kh, kw], [sy, sx], [dy, dx], [py, px]) = (g.kernel, g.stride, g.dilation, g.pad);
    let ow = g.out[1];
    let step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let lane_cols = _mm512_mullo_epi32(step, _mm512_set1_epi32(sx as i32));
    let inf = _mm512_set1_ps(f32::NEG_INFINITY);
    for r in 0..h {
        let row = plane.as_ptr().add(r * w);
        for x0 in (0..ow).step_by(16) {
            let m = lanes(ow - x0);
            let (mut b, mut a) = (inf, _mm512_setzero_si512());
            for kx in 0..kw {
                // Column of output `x0`'s tap `kx`; its flat index (wrapping: padding is never
                // taken, so its index is never kept).
                let c0 = (x0 * sx + kx * dx) as isize - px as isize;
                let v = taps(row, w, c0, sx);
                let t = takes(v, b);
                b = _mm512_mask_blend_ps(t, b, v);
                let first = _mm512_add_epi32(_mm512_set1_epi32((r * w) as i32 + c0 as i32), lane_cols);
                a = _mm512_mask_blend_epi32(t, a, first);
            }
            _mm512_mask_storeu_ps(hv.as_mut_ptr().add(r * ow + x0), m, b);
            _mm512_mask_storeu_epi32(hi.as_mut_ptr().add(r * ow + x0) as *mut i32, m, a);
        }
    }
    let none = _mm512_set1_epi32(super::NO_ARGMAX as i32);
    for oy in 0..g.out[0] {
        for x0 in (0..ow).step_by(16) {
            let m = lanes(ow - x0);
            let (mut b, mut a) = (inf, none);
            for ky in 0..kh {
                let Some(r) = (oy * sy + ky * dy).checked_sub(py).filter(|&r| r < h) else { continue };
                let v = _mm512_maskz_loadu_ps(m, hv.as_ptr().add(r * ow + x0));
                let i = _mm512_maskz_loadu_epi32(m, hi.as_ptr().add(r * ow + x0) as *const i32);
                let t = takes(v, b);
                b = _mm512_mask_blend_ps(t, b, v);
                a = _mm512_mask_blend_epi32(t, a, i);
            }
            _mm512_mask_storeu_ps(y.as_mut_ptr().add(oy * ow + x0), m, b);
            _mm512_mask_storeu_epi32(at.as_mut_ptr().add(oy * ow + x0) as *mut i32, m, a);
            let mut still = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(m, b, inf);
            while still != 0 {
                left.push(oy * ow + x0 + still.trailing_zeros() as usize);
                still &= still - 1;
            }
        }
    }
}

//! `exp`, `erf` and `tanh` on f32 for the elementwise programs: straight-line arithmetic and
//! selects, no branches, so a loop over a block vectorises (libm's `expf` and `erf` are
//! calls, one element at a time). The polynomials, exp's argument reduction and the
//! small-argument forms `x + x R` use fused multiply-adds (`mul_add`, one rounding each), the
//! other steps plain multiplies and adds: a fused
//! multiply-add rounds the same way on every instruction set (an FMA instruction in the
//! programs' AVX2 and AVX-512 code, glibc's correctly rounded `fmaf` in scalar code on a CPU
//! without one), so a program's SIMD body and its remainder agree, and a fused plan equals
//! the unfused one whatever the CPU.
//!
//! Accuracy against the correctly rounded result, measured over every 3rd (7th for `exp`)
//! f32 bit pattern: `exp` within 0.975 ulp, `erf` within 0.97 ulp, `tanh` within 1.46 ulp.
//! NaN gives NaN, infinities give the limits, -0 stays -0 for `erf` and `tanh`, and
//! subnormal results are formed by one rounding.

/// `x` rounded to the nearest bf16 value (ties to even; past the largest finite value,
/// infinity; a NaN stays NaN, made quiet), bit for bit as `half::bf16::from_f32` then
/// `to_f32` (the precision pass's rounding), with selects in place of its branches so that a
/// program's loop over a block vectorises.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    let quiet = (b | 0x0040_0000) & 0xffff_0000;
    f32::from_bits(if b & 0x7fff_ffff > 0x7f80_0000 { quiet } else { rounded })
}

/// `e^x`: Cephes' `expf` (Cody-Waite reduction by `ln 2` in two parts, a degree-6 polynomial),
/// the power of two applied as two factors so that `2^n` for `n` in `-150..=128` needs no
/// subnormal or infinite factor. Overflow gives +inf and underflow 0 through the products.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2, C1 with 9 significant bits: `n * C1` is exact for |n| <= 2^15.
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits of the sum.
    const SHIFT: f32 = 12_582_912.0;
    let x = if x > 89.0 { 89.0 } else { x };
    let x = if x < -104.0 { -104.0 } else { x };
    let fx = x * LOG2E + SHIFT;
    let n = fx - SHIFT;
    let r = (-n).mul_add(C2, (-n).mul_add(C1, x));
    let p =
        1.987_569_1e-4f32.mul_add(r, 1.398_199_9e-3).mul_add(r, 8.333_452e-3).mul_add(r, 4.166_579_6e-2).mul_add(r, 1.666_666_5e-1).mul_add(r, 5e-1);
    // Plain, not `p.mul_add(r * r, r)`: that was 1.008 ulp off at -5.854.
    let y = p * (r * r) + r + 1.0;
    let n = (fx.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let (n1, n2) = (n >> 1, n - (n >> 1));
    let pow2 = |k: i32| f32::from_bits(((k + 127) << 23) as u32);
    y * pow2(n1) * pow2(n2)
}

/// The error function: `x + x R(x^2)` for `|x| < 0.875` (`R` a degree-5 fit of
/// `erf(x)/x - 1`, 8.6e-9 off), else `1 - erfc(|x|)` with the sign of `x`, `erfc` a
/// degree-10 polynomial in `|x| - c` on `[0.875, 2)` or `[2, 3.92]` (Chebyshev fits; past
/// 3.92 `erf` rounds to 1), the lane's interval picking the coefficients: no division and no
/// `exp` (a rational `erfc` times an exponential made `erf` the dearest term of GELU).
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    // Highest degree first: `ERFC_NEAR` for `[0.875, 2)` about 1.4375, `ERFC_FAR` for
    // `[2, 3.92]` about 2.96.
    const ERFC_NEAR: [f32; 11] = [
        -1.4828015e-4,
        -1.4575607e-3,
        3.3460988e-3,
        3.2417614e-3,
        -2.1110171e-2,
        2.2477785e-2,
        3.878314e-2,
        -1.4922485e-1,
        2.054159e-1,
        -1.4289802e-1,
        4.2059395e-2,
    ];
    const ERFC_FAR: [f32; 11] = [
        -2.607944e-5,
        2.1823054e-5,
        1.4325116e-4,
        -4.5975426e-4,
        8.5146347e-4,
        -1.1972423e-3,
        1.2667334e-3,
        -9.75083e-4,
        5.231258e-4,
        -1.766676e-4,
        2.8382698e-5,
    ];
    let a = x.abs();
    let s = x * x;
    let r = (-6.222_423e-4f32)
        .mul_add(s, 5.035_872e-3)
        .mul_add(s, -2.679_395_5e-2)
        .mul_add(s, 1.128_252_4e-1)
        .mul_add(s, -3.761_255_7e-1)
        .mul_add(s, 1.283_791_6e-1);
    let small = x.mul_add(r, x);
    let far = a >= 2.0;
    let u = (if a > 3.92 { 3.92 } else { a }) - if far { 2.96 } else { 1.4375 };
    let mut q = if far { ERFC_FAR[0] } else { ERFC_NEAR[0] };
    for k in 1..11 {
        q = q.mul_add(u, if far { ERFC_FAR[k] } else { ERFC_NEAR[k] });
    }
    let large = 1.0 - q;
    // The sign of `x` on both (-0 included: `-0 + -0 * r` is -0, but keep it obvious).
    (if a < 0.875 { small } else { large }).copysign(x)
}

/// The hyperbolic tangent: `x + x^3 P(x^2)` for `|x| < 0.55` (`P` a degree-5 fit, 2.8e-11
/// off), else `1 - 2 / (e^(2|x|) + 1)` with the sign of `x`.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let s = x * x;
    let p = 2.399_000_4e-3f32
        .mul_add(s, -8.416_794e-3)
        .mul_add(s, 2.178_376_8e-2)
        .mul_add(s, -5.395_979e-2)
        .mul_add(s, 1.333_329_5e-1)
        .mul_add(s, -3.333_333_3e-1);
    let small = (x * s).mul_add(p, x);
    let large = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    // The sign of `x` on both (-0 included, which `-0 + -0 * 0 * p` is not).
    (if a < 0.55 { small } else { large }).copysign(x)
}

#[cfg(test)]
mod tests {
    /// `f(x)`'s distance from `want` (exact, in f64) in units of the last place of `want`
    /// rounded to f32.
    fn ulps(f: f32, want: f64) -> f64 {
        let r = want as f32;
        if f == r || (f.is_nan() && want.is_nan()) {
            return 0.0;
        }
        let ulp = if r == 0.0 { f64::from(f32::from_bits(1)) } else { f64::from(f32::from_bits(r.abs().to_bits() + 1)) - f64::from(r.abs()) };
        (f64::from(f) - want).abs() / ulp
    }

    /// Every 13th f32 bit pattern and the edges (ties, the largest finite values, NaNs with
    /// payloads, infinities, zeros, subnormals): the same bits as `half`'s rounding.
    #[test]
    fn round_bf16_is_halfs_rounding() {
        let edges = [
            0x0000_8000u32,
            0x0001_8000,
            0x3f80_8000,
            0x3f81_8000,
            0x7f7f_ffff,
            0x7f7f_8000,
            0x7f7f_7fff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0xff80_0001,
            0x7fc0_0000,
            0x7fff_ffff,
            0,
            0x8000_0000,
            1,
            0x8000_7fff,
        ];
        for b in (0..=u32::MAX).step_by(13).chain(edges) {
            let x = f32::from_bits(b);
            assert_eq!(super::round_bf16(x).to_bits(), half::bf16::from_f32(x).to_f32().to_bits(), "{b:#010x}");
        }
    }

    /// Every 251st f32 bit pattern (both signs, subnormals to the largest): within the
    /// documented ulps of the f64 function.
    #[test]
    fn exp_erf_and_tanh_are_within_their_ulps_of_the_f64_functions() {
        type Case = (&'static str, fn(f32) -> f32, fn(f64) -> f64, f64);
        let cases: [Case; 3] = [("exp", super::exp, f64::exp, 1.0), ("erf", super::erf, libm::erf, 1.0), ("tanh", super::tanh, f64::tanh, 1.5)];
        for (name, f, want, limit) in cases {
            let (mut worst, mut at) = (0.0f64, 0.0f32);
            for bits in (0..=u32::MAX).step_by(251) {
                let x = f32::from_bits(bits);
                if x.is_finite() {
                    let e = ulps(f(x), want(f64::from(x)));
                    if e > worst {
                        (worst, at) = (e, x);
                    }
                }
            }
            assert!(worst <= limit, "{name}: {worst} ulp at {at:e} (limit {limit})");
        }
    }

    #[test]
    fn special_values_give_the_limits() {
        use super::{erf, exp, tanh};
        assert!(exp(f32::NAN).is_nan() && erf(f32::NAN).is_nan() && tanh(f32::NAN).is_nan());
        assert_eq!((exp(f32::INFINITY), exp(f32::NEG_INFINITY)), (f32::INFINITY, 0.0));
        assert_eq!((exp(88.72284), exp(88.7228), exp(-104.5)), (f32::INFINITY, 88.7228f32.exp(), 0.0));
        assert_eq!((exp(-103.9), exp(0.0), exp(-0.0)), (f32::from_bits(1), 1.0, 1.0));
        assert_eq!((erf(f32::INFINITY), erf(f32::NEG_INFINITY), tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0, 1.0, -1.0));
        // Never past +-1 where `erfc` is the smallest (one polynomial over the whole range was).
        for bits in 3.5f32.to_bits()..=4.5f32.to_bits() {
            let x = f32::from_bits(bits);
            assert!(erf(x) <= 1.0 && erf(-x) >= -1.0, "erf({x:e}) = {}", erf(x));
        }
        for f in [erf, tanh] {
            assert_eq!(f(-0.0).to_bits(), (-0.0f32).to_bits());
            assert_eq!(f(0.0).to_bits(), 0);
        }
    }
}

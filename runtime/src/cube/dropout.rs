//! Masks made on the device, so a plan that uses them reads nothing back and uploads nothing
//! (it can be captured as a graph): dropout, each element times its keyed factor, drawn in the
//! kernel from the host's hash ([`crate::kernel::dropout_factor`]: SplitMix64 over the seed,
//! the update and the item), every element with the host's bits; and causal masking.

use cubecl::prelude::*;

/// A dropout step's constants: the seed; the threshold a draw must fall below to drop (the
/// host's `u < p`, `u = (h >> 11) / 2^53`, is `h >> 11 < ceil(p * 2^53)` in integers); the kept
/// elements' factor `1 / (1 - p)` as f32 bits (the host's f64 factor converted to the float
/// type); the row length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DropoutKey {
    pub seed: u64,
    pub threshold: u64,
    pub scale: u32,
    pub row: u32,
}

impl DropoutKey {
    /// The constants of dropout with probability `p` (in `[0, 1)`) and `seed` over rows of
    /// `row` elements; `None` when a row is past `u32`.
    pub fn new(p: f64, seed: u64, row: usize) -> Option<DropoutKey> {
        let threshold = (p * (1u64 << 53) as f64).ceil() as u64;
        Some(DropoutKey { seed, threshold, scale: ((1.0 / (1.0 - p)) as f32).to_bits(), row: u32::try_from(row).ok()? })
    }
}

/// A 64-bit constant made from its two halves (a kernel's `u64` literals are built from
/// `i64`s, which do not hold the top half of the range).
#[cube]
fn wide(#[comptime] v: u64) -> u64 {
    let hi = u64::cast_from(u32::new(comptime!((v >> 32) as i64)));
    let lo = u64::cast_from(u32::new(comptime!((v & 0xffff_ffff) as i64)));
    (hi << 32u64) | lo
}

/// SplitMix64's finaliser, wrapping (as [`crate::kernel::dropout_factor`]'s).
#[cube]
fn mix(x: u64) -> u64 {
    let mut z = x + wide(0x9e37_79b9_7f4a_7c15u64);
    z = (z ^ (z >> 30u64)) * wide(0xbf58_476d_1ce4_e5b9u64);
    z = (z ^ (z >> 27u64)) * wide(0x94d0_49bb_1331_11ebu64);
    z ^ (z >> 31u64)
}

/// `y[i] = x[i] * factor`, the factor of element `i % row` of the row of item
/// `items[i / row]` at update `update[0]`: 0 when its draw falls below the threshold, else
/// the scale (see [`DropoutKey`]: compile-time constants, so a launch uploads nothing and can
/// be captured). `_id_type`: the items' element type (burn's int type on the device), given
/// at launch.
#[cube(launch_unchecked)]
pub fn dropout<F: Float, I: Int>(x: &[F], items: &[I], update: &[I], y: &mut [F], #[comptime] k: DropoutKey, #[define(I)] _id_type: ElemType) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        let row = comptime!(k.row as usize);
        let item = u64::cast_from(i64::cast_from(items[i / row]));
        let step = u64::cast_from(i64::cast_from(update[0]));
        let key = mix(mix(mix(wide(comptime!(k.seed))) ^ step) ^ item);
        let draw = mix(key + u64::cast_from(i % row)) >> 11u64;
        let mut factor = F::new(0.0);
        if draw >= wide(comptime!(k.threshold)) {
            factor = F::new(comptime!(f32::from_bits(k.scale)));
        }
        y[i] = x[i] * factor;
    }
}

/// Causal masking of `[..., t, s]` scores: `y = x` where key `j` of query row `i` (of each
/// `t x s` matrix) is visible (`j <= i + s - t`), else `fill` (its f32 bits), as the host's
/// `rows::causal_mask` (made on the device, where burn's ops built the mask from host ranges:
/// an upload a captured graph cannot hold).
#[cube(launch_unchecked)]
pub fn causal_mask<F: Float>(x: &[F], y: &mut [F], #[comptime] t: u32, #[comptime] s: u32, #[comptime] fill: u32) {
    let idx = ABSOLUTE_POS;
    if idx < y.len() {
        let (t, s) = comptime!((t as usize, s as usize));
        let j = idx % s;
        let i = (idx / s) % t;
        let mut v = x[idx];
        // `j > i + s - t`, without going below zero.
        if j + t > i + s {
            // From its bits: WGSL has no literal for infinity.
            v = F::reinterpret(u32::new(comptime!(fill as i64)));
        }
        y[idx] = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer threshold decides as the host's f64 comparison does, at the edges too.
    #[test]
    fn the_threshold_decides_as_the_hosts_comparison() {
        for p in [0.0, 0.1, 0.3, 0.5, 1.0 / 3.0, 0.999_999] {
            let t = DropoutKey::new(p, 1, 8).unwrap().threshold;
            for k in [t.saturating_sub(2), t.saturating_sub(1), t, t + 1, 0, (1 << 53) - 1] {
                let host = (k as f64 / (1u64 << 53) as f64) < p;
                assert_eq!(k < t, host, "p {p}, draw {k}, threshold {t}");
            }
        }
    }
}

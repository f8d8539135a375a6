//! Max pooling and its gradient on NCHW tensors, in place of burn's pools (which copy to NHWC
//! and back, and whose gradient runs the forward again with indices). The gradient is a
//! gather: each input element finds the windows that hold it, recomputes their argmax, and adds
//! the gradients of those whose first maximum it is, in output order (the host kernels'
//! order), so overlapping windows need no atomics and the bits do not depend on scheduling.

use cubecl::prelude::*;

use super::ew::{self, EwKernel};
use super::ConvDims;

/// The plane offset of window `(oy, ox)`'s first maximum (NaN wins; padding never does), or
/// -1 for a window with no element inside the plane. (`v != v` is the NaN test: `F::is_nan`
/// does not type as `bool` on a generic float.)
#[cube]
#[allow(clippy::eq_op)]
fn argmax<F: Float, X: Float>(x: &[X], base: usize, oy: usize, ox: usize, #[comptime] g: ConvDims) -> i32 {
    let (h, w) = comptime!((g.h as i32, g.w as i32));
    let (kh, kw, sh, sw, dh, dw, pt, pl) = comptime!(g.window());
    let mut best = F::new(0.0);
    // -1: none yet (a negative literal cannot start a runtime variable).
    let mut at = 0i32;
    at -= 1;
    for ky in 0..kh {
        let iy = oy as i32 * sh + ky as i32 * dh - pt;
        if iy >= 0 && iy < h {
            for kx in 0..kw {
                let ix = ox as i32 * sw + kx as i32 * dw - pl;
                if ix >= 0 && ix < w {
                    let k = iy * w + ix;
                    let v = F::cast_from(x[base + k as usize]);
                    if at < 0 || v > best || v != v {
                        best = v;
                        at = k;
                    }
                }
            }
        }
    }
    at
}

/// `y[p, oy, ox]` = the maximum of its window. Launched only where every window holds an
/// element of the plane ([`crate::kernel::Geometry::has_empty_window`]: the host kernels give
/// such a window -inf, and WGSL has no infinite literal).
#[cube(launch_unchecked)]
pub fn max_pool2d<F: Float, X: Float, Y: Float>(
    x: &[X],
    y: &mut [Y],
    #[comptime] g: ConvDims,
    #[define(X)] _x_type: ElemType,
    #[define(Y)] _out_type: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx < y.len() {
        let (hw, oh, ow) = comptime!(((g.h * g.w) as usize, g.oh as usize, g.ow as usize));
        let ox = idx % ow;
        let oy = (idx / ow) % oh;
        let base = (idx / (ow * oh)) * hw;
        let at = argmax::<F, X>(x, base, oy, ox, g);
        let mut v = F::new(0.0);
        if at >= 0 {
            v = F::cast_from(x[base + at as usize]);
        }
        y[idx] = Y::cast_from(v);
    }
}

/// `dx[p, iy, ix]` = the sum of `dy` over the windows whose first maximum it is, in output
/// order, stored through the epilogue `post` (as [`super::conv2d_forward`]'s).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn max_pool2d_grad<F: Float, X: Float, G: Float, Y: Float>(
    x: &[X],
    dy: &[G],
    dx: &mut [Y],
    x1: &[F],
    x2: &[F],
    x3: &[F],
    #[comptime] g: ConvDims,
    #[comptime] post: EwKernel,
    #[define(X)] _x_type: ElemType,
    #[define(G)] _dy_type: ElemType,
    #[define(Y)] _out_type: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx < dx.len() {
        let (h, w, oh, ow) = comptime!((g.h as usize, g.w as usize, g.oh as i32, g.ow as i32));
        let (kh, kw, sh, sw, dh, dw, pt, pl) = comptime!(g.window());
        let ix = idx % w;
        let iy = (idx / w) % h;
        let plane = idx / (w * h);
        let (base, obase) = (plane * h * w, plane * (oh * ow) as usize);
        let me = (iy * w + ix) as i32;
        let mut acc = F::new(0.0);
        // Kernel rows from the last down: output rows in increasing order.
        for qy in 0..kh {
            let ty = iy as i32 + pt - (kh - 1 - qy) as i32 * dh;
            if ty >= 0 && ty % sh == 0 && ty / sh < oh {
                let oy = ty / sh;
                for qx in 0..kw {
                    let tx = ix as i32 + pl - (kw - 1 - qx) as i32 * dw;
                    if tx >= 0 && tx % sw == 0 && tx / sw < ow {
                        let ox = tx / sw;
                        if argmax::<F, X>(x, base, oy as usize, ox as usize, g) == me {
                            acc += F::cast_from(dy[obase + (oy * ow + ox) as usize]);
                        }
                    }
                }
            }
        }
        dx[idx] = Y::cast_from(ew::apply::<F>(acc, x1, x2, x3, idx, post));
    }
}

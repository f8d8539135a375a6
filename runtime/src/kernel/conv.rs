//! Convolutions' geometry and the host's choice of algorithm for each, made when the plan is
//! built ([`ConvAlgo::choose`]); re-exported by [`crate::kernel`].

use std::sync::Arc;

use cellgraph_compiler::window;

/// The geometry of one 2-D convolution (or pooling window) over NCHW input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Geometry {
    /// `[n, c, h, w]` of the input.
    pub x: [usize; 4],
    /// `[kh, kw]`.
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    /// `[top, left]` padding (bottom and right follow from `out`).
    pub pad: [usize; 2],
    /// `[oh, ow]`.
    pub out: [usize; 2],
}

impl Geometry {
    pub(crate) fn spatial(&self) -> usize {
        self.out[0] * self.out[1]
    }
    /// Stride 1, dilation 1, no padding, and a window that fits: every output reads a
    /// contiguous run of each input row.
    pub(crate) fn is_dense(&self) -> bool {
        self.stride == [1, 1]
            && self.dilation == [1, 1]
            && self.pad == [0, 0]
            && self.out[0] > 0
            && self.out[1] > 0
            && self.out[0] + self.kernel[0] <= self.x[2] + 1
            && self.out[1] + self.kernel[1] <= self.x[3] + 1
    }
    /// True when some output's window lies wholly in the padding (no input element).
    pub fn has_empty_window(&self) -> bool {
        (0..2).any(|a| (0..self.out[a]).any(|o| (0..self.kernel[a]).all(|k| self.at(a, o, k).is_none())))
    }
    /// The input coordinate read by output `o` at kernel offset `k` along axis `a`, if inside.
    #[inline]
    pub(crate) fn at(&self, a: usize, o: usize, k: usize) -> Option<usize> {
        let i = (o * self.stride[a] + k * self.dilation[a]).checked_sub(self.pad[a])?;
        (i < self.x[2 + a]).then_some(i)
    }
    /// Why cubek's implicit-GEMM convolution (tensor cores, through burn-cubecl) does not
    /// take a convolution of this geometry in direction `kind` with `groups` groups; `None`
    /// when it does. Its routines take one group, pad both ends of an axis alike (so the
    /// windows must be the ones a symmetric padding of `pad` gives: the same outputs), and
    /// compute the input gradient at stride 1 only: at a larger stride it is the forward
    /// convolution of [`Self::upsampled`], where padding does not pass the dilated window.
    pub fn implicit_gemm_declines(&self, kind: ConvKind, groups: usize) -> Option<&'static str> {
        let symmetric = (0..2).all(|a| {
            let span = self.dilation[a] * self.kernel[a].saturating_sub(1) + 1;
            let padded = self.x[2 + a] + 2 * self.pad[a];
            padded >= span && (padded - span) / self.stride[a] + 1 == self.out[a]
        });
        if groups != 1 {
            Some("grouped")
        } else if !symmetric {
            Some("asymmetric padding")
        } else if kind == ConvKind::InputGrad && self.stride != [1, 1] && self.upsampled(1).is_none() {
            Some("strided input gradient padded past its window")
        } else {
            None
        }
    }
    /// The stride-1 forward convolution whose result is the input gradient of a strided
    /// convolution of this geometry (see `cube::conv::input_grad_by_upsampling`): over `dy`
    /// spread out by the stride (zeros between its elements and after the last, `[n, o, uh,
    /// uw]`), the filter flipped with its channel axes swapped, padding `(k - 1) * dilation -
    /// pad` on every side (its windows are symmetric), and the input's extents as output.
    /// `None` where the padding exceeds the dilated window (the gradient then has no such form).
    pub fn upsampled(&self, out_channels: usize) -> Option<Geometry> {
        let g = self;
        let mut spread = [0; 2];
        let mut pad = [0; 2];
        for a in 0..2 {
            let reach = g.dilation[a] * g.kernel[a].checked_sub(1)?;
            pad[a] = reach.checked_sub(g.pad[a])?;
            // `x + 2p - reach`: `dy`'s last element lands at `(out - 1) * stride` in it.
            spread[a] = (g.x[2 + a] + 2 * g.pad[a]).checked_sub(reach)?;
            if spread[a] < (g.out[a].checked_sub(1)?) * g.stride[a] + 1 {
                return None;
            }
        }
        Some(Geometry {
            x: [g.x[0], out_channels, spread[0], spread[1]],
            kernel: g.kernel,
            stride: [1, 1],
            dilation: g.dilation,
            pad,
            out: [g.x[2], g.x[3]],
        })
    }
    /// Output columns `[lo, hi)` whose input column at kernel offset `kx` lies inside.
    pub(crate) fn valid_cols(&self, kx: usize) -> (usize, usize) {
        let (s, off, w) = (self.stride[1], kx * self.dilation[1], self.x[3]);
        let lo = self.pad[1].saturating_sub(off).div_ceil(s).min(self.out[1]);
        let hi = if w + self.pad[1] > off { (w + self.pad[1] - off).div_ceil(s).min(self.out[1]) } else { 0 };
        (lo, hi.max(lo))
    }
}

/// Grid positions a direct convolution kernel holds in registers at a time, per channel.
pub const DIRECT_BLOCK: usize = 16;

/// Whether a convolution of geometry `g` with `groups` groups runs on the direct kernels:
/// dense (stride 1, dilation 1, no padding), one group, a kernel larger than one pixel, a
/// contraction `c * kh * kw` of at most 512 (beyond it im2col's GEMM reuses its operands
/// better), and at least one block of grid positions. Otherwise im2col + GEMM.
pub fn direct_conv(g: &Geometry, groups: usize) -> bool {
    let kk = g.kernel[0] * g.kernel[1];
    g.is_dense() && groups == 1 && kk > 1 && g.x[1] * kk <= 512 && (g.out[0] - 1) * g.x[3] + g.out[1] >= DIRECT_BLOCK
}

/// How host backends run a convolution, in each of its three directions: chosen once, when
/// the plan is built ([`ConvAlgo::choose`]), and stored in the step, so no kernel re-derives
/// it per call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConvAlgo {
    /// The direct kernels ([`crate::host::direct`]; where they apply: [`direct_conv`]).
    Direct,
    /// A map so small that the convolution is a dense layer ([`crate::host::toeplitz`]): the
    /// dense filter's nonzeros. `filter`: for a forward or input gradient whose filter is a
    /// parameter read as it is, that parameter's name: its dense filter is then built once per
    /// value of the parameter and kept between runs ([`crate::host::Kept`]), rather than on
    /// every call.
    Dense { taps: Arc<[Tap]>, filter: Option<Arc<str>> },
    /// im2col + GEMM ([`crate::host::conv`]).
    Im2col(Im2col),
}

/// One nonzero of a dense small-map filter: output position `p` reads input pixel `q` through
/// kernel tap `t` (flat indices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tap {
    pub p: u32,
    pub q: u32,
    pub t: u32,
}

/// An im2col convolution's resolved cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Im2col {
    /// The geometry the GEMMs run on: the step's own, or, where some kernel taps never read an
    /// input element (a 3 x 3 kernel padded by 1 on a 1 x 1 map reads its centre alone), the
    /// convolution by the cropped kernel, which computes the same sums without the terms that
    /// are always zero.
    pub g: Geometry,
    /// With a cropped kernel, the first tap kept on each axis.
    pub crop: Option<[usize; 2]>,
    /// Images per column matrix (a chunk; chunks run on the rayon pool's threads). The cut
    /// depends on the shapes only, never on the thread count, so neither do the results; it is
    /// sized for 4-byte elements, and f64 backends (the gradient checks) keep it.
    pub chunk: usize,
    /// The filter gradient is made transposed, as `[kk, og]` per group, and turned back while
    /// the chunks are added (with few output channels packing the chunk's `dy` is cheaper than
    /// gathering its column matrix; see [`crate::host::conv::filter_grad`]).
    pub transposed: bool,
}

/// A chunk's column matrix stays within about this many bytes (a core's L2 cache; larger
/// chunks give the GEMMs of small maps more columns).
const CHUNK_BYTES: usize = 1 << 20;

/// The dense filter's largest size in elements (16 MiB of f32).
const MAX_DENSE: usize = 1 << 22;

impl ConvAlgo {
    /// The algorithm for a convolution of geometry `g`, `groups` groups and `o` output
    /// channels: the direct kernels where [`direct_conv`] says so, else a dense layer where
    /// [`dense_taps`] finds one, else im2col ([`ConvAlgo::im2col`]).
    pub fn choose(g: &Geometry, groups: usize, o: usize) -> ConvAlgo {
        if direct_conv(g, groups) {
            return ConvAlgo::Direct;
        }
        ConvAlgo::gemm(g, groups, o)
    }
    /// A dense layer where [`dense_taps`] finds one, else im2col: the algorithms that run on
    /// the GEMM, whether or not the direct kernels would apply.
    pub fn gemm(g: &Geometry, groups: usize, o: usize) -> ConvAlgo {
        match dense_taps(g, groups, o) {
            Some(taps) => ConvAlgo::Dense { taps: taps.into(), filter: None },
            None => ConvAlgo::im2col(g, groups, o),
        }
    }
    /// im2col + GEMM for `g`, whatever else would apply (the benchmarks and tests compare the
    /// algorithms on one shape).
    pub fn im2col(g: &Geometry, groups: usize, o: usize) -> ConvAlgo {
        let (run, crop) = match cropped(g) {
            Some((small, at)) => (small, Some(at)),
            None => (*g, None),
        };
        let (og, kk) = (o / groups.max(1), run.x[1] / groups.max(1) * run.kernel[0] * run.kernel[1]);
        let per_image = (kk * run.spatial() * 4).max(1);
        let n = g.x[0].max(1);
        let most = (CHUNK_BYTES / per_image).clamp(1, n);
        // As many chunks as that needs, rounded up to a power of two so that two or four threads
        // share them evenly (five chunks on two threads left one idle for a fifth of the time),
        // of sizes as equal as they can be.
        let chunk = n.div_ceil(n.div_ceil(most).next_power_of_two().min(n));
        // With 128 output channels the arithmetic hides the packing and `dw`'s layout wins.
        let transposed = og <= 64 && kk >= og;
        ConvAlgo::Im2col(Im2col { g: run, crop, chunk, transposed })
    }
    /// Its name in plan listings: `direct`, `dense taps`, `im2col`, `im2col cropped`.
    pub fn name(&self) -> &'static str {
        match self {
            ConvAlgo::Direct => "direct",
            ConvAlgo::Dense { .. } => "dense taps",
            ConvAlgo::Im2col(Im2col { crop: None, .. }) => "im2col",
            ConvAlgo::Im2col(Im2col { crop: Some(_), .. }) => "im2col cropped",
        }
    }
}

/// `g`'s taps when the convolution (one group, `o` output channels) is better done as a dense
/// layer: the taps fill at least 9 in 10 of the (position, pixel) pairs of a map of at most
/// 64 of each, and the dense filter stays within [`MAX_DENSE`] elements. `None` otherwise
/// (im2col then wastes less), and for empty tensors (which the im2col path handles).
pub fn dense_taps(g: &Geometry, groups: usize, o: usize) -> Option<Vec<Tap>> {
    let [n, c, h, w] = g.x;
    let (sp, hw) = (g.spatial(), h * w);
    if groups != 1 || n * c * o * sp * hw == 0 || sp * hw > 64 || o * sp * c * hw > MAX_DENSE {
        return None;
    }
    let live = |a: usize| -> usize { (0..g.out[a]).map(|o| (0..g.kernel[a]).filter(|&k| g.at(a, o, k).is_some()).count()).sum() };
    if 10 * live(0) * live(1) < 9 * sp * hw {
        return None;
    }
    let mut taps = Vec::with_capacity(sp * hw);
    for oy in 0..g.out[0] {
        for ox in 0..g.out[1] {
            for ky in 0..g.kernel[0] {
                for kx in 0..g.kernel[1] {
                    let (Some(iy), Some(ix)) = (g.at(0, oy, ky), g.at(1, ox, kx)) else { continue };
                    let (p, q, t) = (oy * g.out[1] + ox, iy * w + ix, ky * g.kernel[1] + kx);
                    taps.push(Tap { p: p as u32, q: q as u32, t: t as u32 });
                }
            }
        }
    }
    Some(taps)
}

/// The kernel taps that read an input element for some output, `[rows, cols]` of taps, when
/// others never do: the geometry of the convolution by the cropped kernel, and the first tap
/// kept on each axis.
fn cropped(g: &Geometry) -> Option<(Geometry, [usize; 2])> {
    let live = |a: usize| {
        let read = |k: usize| (0..g.out[a]).any(|o| g.at(a, o, k).is_some());
        let lo = (0..g.kernel[a]).find(|&k| read(k))?;
        let hi = (0..g.kernel[a]).rev().find(|&k| read(k))? + 1;
        Some((lo, hi))
    };
    let (r, c) = (live(0)?, live(1)?);
    if (r.1 - r.0, c.1 - c.0) == (g.kernel[0], g.kernel[1]) {
        return None;
    }
    let pad = [g.pad[0].checked_sub(r.0 * g.dilation[0])?, g.pad[1].checked_sub(c.0 * g.dilation[1])?];
    Some((Geometry { kernel: [r.1 - r.0, c.1 - c.0], pad, ..*g }, [r.0, c.0]))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConvKind {
    Forward,
    InputGrad,
    FilterGrad,
}

/// The geometry of a convolution or pooling window over input extents `x`, resolved to `w`.
pub(super) fn geometry(x: &[usize], kernel: [usize; 2], stride: [usize; 2], dilation: [usize; 2], w: &window::Window) -> Geometry {
    Geometry { x: [x[0], x[1], x[2], x[3]], kernel, stride, dilation, pad: [w.pad[0], w.pad[2]], out: w.out }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A convolution's batch is cut into a power of two of equal chunks: ResNet-18's 3 x 3
    /// convolutions on 8 x 8 maps (147 KiB of columns per image, 7 to the MiB) take 8 chunks
    /// of 4 of a micro-batch of 32, not 5 of 7 (which left one of two threads idle a fifth of
    /// the time); LeNet5's first layer on 32 images, 4 chunks of 8, not 3 of 11.
    #[test]
    fn convolution_chunks_come_in_powers_of_two() {
        let g = |c: usize, hw: usize, k: usize, out: usize| Geometry {
            x: [32, c, hw, hw],
            kernel: [k, k],
            stride: [1, 1],
            dilation: [1, 1],
            pad: [k / 2, k / 2],
            out: [out, out],
        };
        let per = |g: Geometry, o: usize| match ConvAlgo::im2col(&g, 1, o) {
            ConvAlgo::Im2col(c) => c.chunk,
            other => panic!("{other:?}"),
        };
        assert_eq!(per(g(64, 8, 3, 8), 64), 4);
        assert_eq!(per(g(128, 4, 3, 4), 128), 8);
        let lenet = Geometry { x: [32, 1, 32, 32], kernel: [5, 5], stride: [1, 1], dilation: [1, 1], pad: [0, 0], out: [28, 28] };
        assert_eq!(per(lenet, 6), 8);
        // An image over the MiB on a batch of 3: 3 chunks of one (4 would leave one empty).
        assert_eq!(per(Geometry { x: [3, 512, 16, 16], ..g(512, 16, 3, 16) }, 512), 1);
    }

    /// Each convolution's algorithm is settled by its shape when the plan is built: LeNet5's
    /// second layer runs direct, ResNet-18's 2 x 2 maps dense, a grouped 3 x 3 kernel padded by
    /// 1 on a 1 x 1 map on im2col with its centre tap alone, and im2col's filter gradient is
    /// made transposed up to 64 output channels.
    #[test]
    fn convolution_algorithms_are_chosen_by_shape() {
        let geo = |n: usize, c: usize, hw: usize, k: usize, pad: usize, stride: usize| {
            let out = (hw + 2 * pad - k) / stride + 1;
            Geometry { x: [n, c, hw, hw], kernel: [k, k], stride: [stride; 2], dilation: [1, 1], pad: [pad; 2], out: [out, out] }
        };
        assert_eq!(ConvAlgo::choose(&geo(32, 6, 14, 5, 0, 1), 1, 16).name(), "direct");
        assert!(matches!(ConvAlgo::choose(&geo(32, 256, 2, 3, 1, 1), 1, 256), ConvAlgo::Dense { ref taps, filter: None } if taps.len() == 16));
        let centre = ConvAlgo::choose(&geo(32, 64, 1, 3, 1, 1), 2, 64);
        let ConvAlgo::Im2col(c) = centre else { panic!("{centre:?}") };
        assert_eq!((c.crop, c.g.kernel, c.g.pad), (Some([1, 1]), [1, 1], [0, 0]));
        let transposed = |o: usize| match ConvAlgo::choose(&geo(32, 64, 8, 3, 1, 2), 1, o) {
            ConvAlgo::Im2col(c) => c.transposed,
            other => panic!("{other:?}"),
        };
        assert!(transposed(64) && !transposed(128));
        assert_eq!(ConvAlgo::gemm(&geo(32, 6, 14, 5, 0, 1), 1, 16).name(), "im2col");
    }

    /// cubek's implicit GEMM takes a convolution when symmetric padding gives its windows:
    /// ResNet's padded 3 x 3 and strided 1 x 1 layers, LeNet5's valid 5 x 5; not a `same`
    /// window padded more at the bottom than the top, not two groups, and an input gradient
    /// only at stride 1.
    #[test]
    fn implicit_gemm_takes_symmetric_ungrouped_convolutions() {
        use cellgraph_compiler::op::PadMode;
        let geo = |hw: usize, k: usize, stride: usize, mode: PadMode, pad: usize| {
            let w = window::resolve([hw, hw], [k, k], [stride; 2], [1, 1], mode, [pad; 4]).unwrap();
            geometry(&[8, 16, hw, hw], [k, k], [stride; 2], [1, 1], &w)
        };
        let (fwd, dx, dw) = (ConvKind::Forward, ConvKind::InputGrad, ConvKind::FilterGrad);
        let resnet = geo(16, 3, 2, PadMode::Pad, 1);
        assert_eq!(resnet.out, [8, 8]);
        assert_eq!((resnet.implicit_gemm_declines(fwd, 1), resnet.implicit_gemm_declines(dw, 1)), (None, None));
        assert_eq!(resnet.implicit_gemm_declines(dx, 1), None);
        // The gradient of a 1 x 1 window padded by 1 at stride 2 has no upsampled form.
        assert_eq!(geo(16, 1, 2, PadMode::Pad, 1).implicit_gemm_declines(dx, 1), Some("strided input gradient padded past its window"));
        let up = resnet.upsampled(32).unwrap();
        assert_eq!((up.x, up.stride, up.pad, up.out), ([8, 32, 16, 16], [1, 1], [1, 1], [16, 16]));
        assert_eq!(geo(16, 3, 1, PadMode::Pad, 1).implicit_gemm_declines(dx, 1), None);
        assert_eq!(geo(16, 1, 2, PadMode::Pad, 0).implicit_gemm_declines(fwd, 1), None);
        assert_eq!(geo(32, 5, 1, PadMode::Valid, 0).implicit_gemm_declines(fwd, 1), None);
        // `same` over 16 at stride 2 pads 0 at the top and 1 at the bottom.
        let same = geo(16, 3, 2, PadMode::Same, 0);
        assert_eq!((same.pad, same.out), ([0, 0], [8, 8]));
        assert_eq!(same.implicit_gemm_declines(fwd, 1), Some("asymmetric padding"));
        assert_eq!(geo(16, 3, 1, PadMode::Same, 0).implicit_gemm_declines(fwd, 1), None);
        assert_eq!(resnet.implicit_gemm_declines(fwd, 2), Some("grouped"));
    }
}

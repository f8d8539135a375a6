//! Window arithmetic shared by shape inference and lowering: output extents and the
//! resolved `[top, bottom, left, right]` padding of convolution and pooling windows.

use crate::op::PadMode;

/// Padding and output extents of one 2-D window over an `[h, w]` input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// `[top, bottom, left, right]`.
    pub pad: [usize; 4],
    /// `[out_h, out_w]`.
    pub out: [usize; 2],
}

impl Window {
    /// True when top == bottom and left == right, so a symmetric-padding kernel can run it.
    pub fn is_symmetric(&self) -> bool {
        self.pad[0] == self.pad[1] && self.pad[2] == self.pad[3]
    }
}

/// Resolves a window of `kernel` (dilated by `dilation`) with `stride` over `input`.
/// Returns an error message when the window does not fit.
pub fn resolve(
    input: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    mode: PadMode,
    explicit: [usize; 4],
) -> Result<Window, String> {
    let mut pad = [0usize; 4];
    let mut out = [0usize; 2];
    for a in 0..2 {
        if stride[a] == 0 || kernel[a] == 0 || dilation[a] == 0 {
            return Err("kernel, stride and dilation must be positive".into());
        }
        let eff = (kernel[a] - 1) * dilation[a] + 1;
        let (lo, hi) = match mode {
            PadMode::Valid => (0, 0),
            PadMode::Pad => (explicit[2 * a], explicit[2 * a + 1]),
            PadMode::Same => {
                let o = input[a].div_ceil(stride[a]);
                let total = ((o - 1) * stride[a] + eff).saturating_sub(input[a]);
                (total / 2, total - total / 2)
            }
        };
        let padded = input[a] + lo + hi;
        if padded < eff {
            return Err(format!("window of extent {eff} does not fit input extent {} (padded {padded})", input[a]));
        }
        pad[2 * a] = lo;
        pad[2 * a + 1] = hi;
        out[a] = (padded - eff) / stride[a] + 1;
    }
    Ok(Window { pad, out })
}

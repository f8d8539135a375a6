//! Bound kernels ([`crate::kernel::Native`]) on backends that keep tensors in host memory
//! (burn-ndarray): the slice kernels in [`kernels`], and what they keep between the steps of
//! a run ([`Kept`]: a max pool's argmax for its gradient in the same plan).

pub mod kernels;

use burn_backend::tensor::{Device, FloatTensor};
use cellgraph_compiler::TensorType;

use crate::backend::{Backend, HostSlice, HostVec};
use crate::kernel::{ConvKind, Native};
use kernels::{HostFloat, Mat};

/// The element types the kernels run in, tied to their [`HostSlice`]/[`HostVec`] variants.
trait Elem: HostFloat {
    fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [Self]>;
    fn wrap(v: Vec<Self>) -> HostVec;
}

impl Elem for f32 {
    fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [f32]> {
        match s {
            HostSlice::F32(v) => Some(v),
            HostSlice::F64(_) => None,
        }
    }
    fn wrap(v: Vec<f32>) -> HostVec {
        HostVec::F32(v)
    }
}

impl Elem for f64 {
    fn slice<'a>(s: &'a HostSlice<'_>) -> Option<&'a [f64]> {
        match s {
            HostSlice::F64(v) => Some(v),
            HostSlice::F32(_) => None,
        }
    }
    fn wrap(v: Vec<f64>) -> HostVec {
        HostVec::F64(v)
    }
}

/// Per-session host state the kernels keep between steps of a run: the argmax of each max
/// pool whose gradient is later in the same plan ([`Native::MaxPool`]'s `keep`), stamped with
/// the run that wrote it (a gradient only trusts its own run's argmax).
#[derive(Default)]
pub struct Kept {
    run: u64,
    argmax: Vec<(u64, Vec<u32>)>,
}

impl Kept {
    /// Starts a run: what earlier runs kept is stale from now on.
    pub fn begin_run(&mut self) {
        self.run += 1;
    }
    fn slot(&mut self, k: usize, len: usize) -> &mut Vec<u32> {
        if self.argmax.len() <= k {
            self.argmax.resize_with(k + 1, Default::default);
        }
        let (stamp, v) = &mut self.argmax[k];
        *stamp = self.run;
        v.resize(len, 0);
        v
    }
    fn get(&self, k: usize, len: usize) -> Option<&[u32]> {
        self.argmax.get(k).filter(|(stamp, v)| *stamp == self.run && v.len() == len).map(|(_, v)| &v[..])
    }
}

/// Runs a bound kernel in element type `F`, or `None` if an operand is not `F`.
fn run<F: Elem>(k: &Native, args: &[HostSlice], tys: &[&TensorType], out: &TensorType, kept: &mut Kept) -> Option<Vec<F>> {
    let a: Vec<&[F]> = args.iter().map(F::slice).collect::<Option<_>>()?;
    let d = |i: usize| tys[i].dims();
    Some(match k {
        Native::MatMul { transpose_a, transpose_b, .. } => {
            let m = |i: usize, t: bool| Mat { data: a[i], rows: d(i)[0], cols: d(i)[1], transposed: t };
            kernels::matmul(m(0, *transpose_a), m(1, *transpose_b))
        }
        Native::Conv { kind: ConvKind::Forward, g, groups, out_channels } => kernels::conv2d(g, *groups, a[0], a[1], *out_channels),
        Native::Conv { kind: ConvKind::InputGrad, g, groups, out_channels } => kernels::conv2d_input_grad(g, *groups, a[0], a[1], *out_channels),
        Native::Conv { kind: ConvKind::FilterGrad, g, groups, out_channels } => kernels::conv2d_filter_grad(g, *groups, a[0], a[1], *out_channels),
        Native::MaxPool { g, keep } => match keep {
            Some(s) => kernels::max_pool2d(g, a[0], kept.slot(*s, out.numel())),
            None => kernels::max_pool2d(g, a[0], &mut vec![0; out.numel()]),
        },
        Native::MaxPoolGrad { g, kept: slot } => {
            let len = tys[1].numel();
            match slot.and_then(|s| kept.get(s, len)) {
                Some(at) => kernels::max_pool2d_grad(g, at, a[1]),
                None => {
                    let mut at = vec![0; len];
                    kernels::max_pool2d_argmax(g, a[0], &mut at);
                    kernels::max_pool2d_grad(g, &at, a[1])
                }
            }
        }
        Native::Relu => kernels::relu(a[0]),
        Native::ReluGrad => kernels::relu_grad(a[0], a[1]),
        Native::Fused(e) => kernels::fused(e, &a),
    })
    .filter(|v| v.len() == out.numel().max(1))
}

/// Runs a bound kernel on the host kernels when every operand is host-visible in one float
/// type; `None` sends the step to burn's generic lowering.
pub fn run_host<B: Backend>(k: &Native, args: &[&FloatTensor<B>], tys: &[&TensorType], out: &TensorType, device: &Device<B>, kept: &mut Kept) -> Option<FloatTensor<B>> {
    let slices: Vec<HostSlice> = args.iter().map(|t| B::host_slice(t)).collect::<Option<_>>()?;
    let data = match slices.first()? {
        HostSlice::F32(_) => run::<f32>(k, &slices, tys, out, kept).map(f32::wrap),
        HostSlice::F64(_) => run::<f64>(k, &slices, tys, out, kept).map(f64::wrap),
    }?;
    Some(B::from_host_vec(data, out.dims(), device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::bind;
    use cellgraph_compiler::{Op, PadMode, Pool2dAttrs};
    use std::borrow::Cow;

    /// A max pool's gradient routes by the argmax its forward kept in the same run, with the
    /// same bits as recomputing it; an argmax from an earlier run is never used.
    #[test]
    fn a_pool_gradient_routes_by_its_own_runs_argmax_only() {
        let p = Pool2dAttrs { kernel: [2, 2], stride: [2, 2], pad_mode: PadMode::Valid, pad: [0; 4] };
        let (xt, yt) = (TensorType::f32(vec![2, 3, 6, 6]), TensorType::f32(vec![2, 3, 3, 3]));
        let bound = |op: &Op, tys: &[&TensorType]| bind(op, tys).expect("pooling binds");
        let (fwd, grad) = (bound(&Op::MaxPool2d(p.clone()), &[&xt]), bound(&Op::MaxPool2dGrad(p.clone()), &[&xt, &yt]));
        let (Native::MaxPool { g, .. }, Native::MaxPoolGrad { .. }) = (&fwd, &grad) else { panic!("pooling kernels") };
        let (keep, kept) = (Native::MaxPool { g: *g, keep: Some(0) }, Native::MaxPoolGrad { g: *g, kept: Some(0) });
        let x1: Vec<f32> = (0..216).map(|i| ((i * 37) % 23) as f32).collect();
        let x2: Vec<f32> = x1.iter().rev().copied().collect();
        let dy: Vec<f32> = (0..54).map(|i| i as f32 + 0.5).collect();
        let s = |v: &[f32]| HostSlice::F32(Cow::Owned(v.to_vec()));
        let mut state = Kept::default();
        state.begin_run();
        run::<f32>(&keep, &[s(&x1)], &[&xt], &yt, &mut state).expect("forward");
        let routed = run::<f32>(&kept, &[s(&x1), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient");
        let searched = run::<f32>(&grad, &[s(&x1), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient");
        assert_eq!(routed.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), searched.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // The next run's gradient, on other input, before its forward ran: it must search.
        state.begin_run();
        let fresh = run::<f32>(&kept, &[s(&x2), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient");
        assert_eq!(fresh, run::<f32>(&grad, &[s(&x2), s(&dy)], &[&xt, &yt], &xt, &mut state).expect("gradient"));
        assert_ne!(fresh, routed);
    }
}

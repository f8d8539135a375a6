//! The boundary kernel: every parameter's optimizer update from its accumulator, and the
//! accumulator's clearing, in one launch over flat buffers ([`update_clear`]).

use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cellgraph_compiler::program::{Program, Step, Val};
use cubecl::prelude::*;

use super::{arr, empty, ew, grid};

/// Whether an update program reads operand `k`.
fn reads_operand(prog: &Program, k: u8) -> bool {
    prog.steps().iter().any(|s| s.reads().any(|v| v == Val::Arg(k)))
}

/// One optimizer's update [`Program`] over flat buffers, unrolled when the kernel is compiled
/// (every step becomes straight-line code, [`ew::step`]), then `acc = 0`: `g = acc * scale`
/// and the program's steps in order. Its operands are the parameter, `g` and the state
/// buffers `s0`, `s1` (any buffer where it keeps fewer; read only where the program reads
/// them), each read before anything is written; `scalars` are its scalar inputs.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // an unrolled loop reads the scalars
pub fn update_clear<F: Float>(p: &mut [F], acc: &mut [F], s0: &mut [F], s1: &mut [F], scalars: &[F], scale: f32, #[comptime] prog: Program) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let mut args = Sequence::<F>::new();
        args.push(p[i]);
        args.push(acc[i] * F::cast_from(scale));
        // Slots of states the program does not read hold a value it never reads.
        if comptime!(reads_operand(&prog, 2)) {
            args.push(s0[i]);
        } else {
            args.push(F::new(0.0));
        }
        if comptime!(reads_operand(&prog, 3)) {
            args.push(s1[i]);
        } else {
            args.push(F::new(0.0));
        }
        #[unroll]
        for k in 0..comptime!(scalars_read(&prog)) {
            args.push(scalars[k]);
        }
        let mut lets = Sequence::<F>::new();
        let n = comptime!(prog.steps().len());
        #[unroll]
        for k in 0..n {
            let s = comptime!(prog.steps()[k]);
            let x = ew::step::<F>(&args, &lets, s);
            // A write's output, counted from 1 (0: the step is an op).
            let out = comptime!(match s {
                Step::Write(o, _) => o as u32 + 1,
                _ => 0,
            });
            if comptime!(out == 1) {
                p[i] = x;
            } else if comptime!(out == 2) {
                s0[i] = x;
            } else if comptime!(out == 3) {
                s1[i] = x;
            }
            lets.push(x);
        }
        acc[i] = F::new(0.0);
    }
}

/// Scalar inputs an update program reads: one past the highest.
fn scalars_read(prog: &Program) -> usize {
    prog.steps().iter().flat_map(|s| s.reads()).filter_map(|v| if let Val::Scalar(k) = v { Some(k as usize + 1) } else { None }).max().unwrap_or(0)
}

/// Launches one optimizer-and-clear kernel ([`update_clear`]) over flat buffers of equal
/// length: `p` parameters, `acc` accumulators, `state` the rule's state buffers in its order,
/// `scalars` its scalar inputs (learning rate first). Returns the kernels launched (1).
pub fn launch_update<R: CubeRuntime>(
    prog: &Program,
    p: &CubeTensor<R>,
    acc: &CubeTensor<R>,
    state: &[CubeTensor<R>],
    scale: f32,
    scalars: &[f32],
) -> usize {
    let n = p.meta.num_elements();
    let client = &p.client;
    let (count, dim) = grid(client, n);
    // Unused state slots get a one-element buffer the program never touches.
    let spare = || empty::<R>(client, &p.device, &[1]);
    let s0 = state.first().cloned().unwrap_or_else(spare);
    let s1 = state.get(1).cloned().unwrap_or_else(spare);
    let c = client.create_from_slice(f32::as_bytes(if scalars.is_empty() { &[0.0] } else { scalars }));
    crate::value::count_upload();
    // SAFETY: `scalars.len()` f32 in the handle (one where there are none).
    let c = unsafe { BufferArg::from_raw_parts(c, scalars.len().max(1)) };
    update_clear::launch::<f32, R>(client, count, dim, arr(p), arr(acc), arr(&s0), arr(&s1), c, scale, prog.clone());
    1
}

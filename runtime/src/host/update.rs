//! The window's boundary on host slices: each parameter's optimizer update and the clearing
//! of its accumulator in one pass ([`update_clear`]), the update's program run a block at a
//! time on the programs' element ops ([`super::program`]).

use super::float::{each, vectorized, HostFloat, BLOCK};
use super::program::{binary_into, unary};
use super::reads::Src;
use cellgraph_compiler::program::{Program, Step, Val};

/// A window's boundary for one parameter in one pass: its optimizer's update (the
/// [`Program`] its graph comes from, [`cellgraph_compiler::update`]) and the clearing of its
/// accumulator, block by block: `g = acc * scale` (then `g * factor`, clipping's, unless it is
/// 1), the program's steps in order, `acc = 0`.
/// Reads of the parameter and of the states see their values before the update (the optimizer
/// graph's writes land when it finishes), and each op rounds to `F` as the graph's ops do, so
/// the results are the optimizer graph's bits. `scalars`: the rule's scalar inputs.
pub fn update_clear<F: HostFloat>(prog: &Program, p: &mut [F], acc: &mut [F], states: &mut [Vec<F>], scalars: &[F], scale: F, factor: F) {
    let n = p.len();
    assert!(acc.len() == n && states.iter().all(|s| s.len() == n), "one length for a parameter's buffers");
    // A value per step (`Let(i)` is step `i`'s; a write's is never read).
    let lets = prog.steps().len();
    // The buffers the program reads after writing them: those are read from copies. Buffer
    // 0 is the parameter (operand 0, output 0), buffer `1 + k` state `k` (operand `2 + k`,
    // output `1 + k`).
    let mut kept = vec![false; 1 + states.len()];
    let buffer = |v: Val| match v {
        Val::Arg(0) => Some(0),
        Val::Arg(a) if a >= 2 => Some(a as usize - 1),
        _ => None,
    };
    let mut written = vec![false; 1 + states.len()];
    for step in prog.steps() {
        for i in step.reads().filter_map(buffer) {
            kept[i] |= written[i];
        }
        if let Step::Write(o, _) = *step {
            written[o as usize] = true;
        }
    }
    let threads = rayon::current_num_threads().min(n / (16 * BLOCK)).max(1);
    let per = n.div_ceil(threads).div_ceil(BLOCK).max(1) * BLOCK;
    // Each share: its part of the parameter, the accumulator and every state.
    let mut parts: Vec<Vec<&mut [F]>> = states.iter_mut().map(|s| s.chunks_mut(per).collect()).collect();
    let shares: Vec<_> =
        p.chunks_mut(per).zip(acc.chunks_mut(per)).map(|(p, a)| (p, a, parts.iter_mut().map(|v| v.remove(0)).collect::<Vec<_>>())).collect();
    each(shares, |(p, acc, mut st)| {
        // Scratch: the gradient, the parameter and the states as they were, the steps' values.
        F::scratch((2 + st.len() + lets) * BLOCK, |scratch| {
            vectorized(Update { prog, kept: &kept, scalars, scale, factor, p, acc, states: &mut st, scratch })
        })
    });
}

/// [`update_clear`]'s loop over one share's blocks, as a [`vectorized`] op (too large for a
/// closure, which ran on SSE2: see there).
struct Update<'a, 'b, F> {
    prog: &'a Program,
    kept: &'a [bool],
    scalars: &'a [F],
    scale: F,
    factor: F,
    p: &'a mut [F],
    acc: &'a mut [F],
    states: &'a mut [&'b mut [F]],
    scratch: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for Update<'_, '_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Update { prog, kept, scalars, scale, factor, p, acc, states, scratch } = self;
        for start in (0..p.len()).step_by(BLOCK) {
            let m = BLOCK.min(p.len() - start);
            // The next block's lines of every buffer, asked for now, a line of each buffer in
            // turn: each buffer's block is a page of its own (4 KiB of f32), where the cores'
            // own prefetchers start again, and the steps read the buffers one after another.
            let next = (start + BLOCK).min(p.len())..(start + 2 * BLOCK).min(p.len());
            for at in next.step_by(LINE) {
                let line = at..(at + LINE).min(p.len());
                prefetch(&p[line.clone()]);
                prefetch(&acc[line.clone()]);
                for s in states.iter() {
                    prefetch(&s[line.clone()]);
                }
            }
            update_block(prog, kept, scalars, (scale, factor), &mut p[start..start + m], &mut acc[start..start + m], states, start, scratch);
        }
    }
}

/// One block of [`update_clear`]: `p` and `acc` the block's elements, `states` the share's
/// (the block's are `start..start + p.len()`). Every step writes its own slot of `lets`, in
/// one pass over its operands; the parameter and the states are read in place, or (`kept`:
/// where the program reads one after writing it) from copies taken first.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn update_block<F: HostFloat>(
    prog: &Program,
    kept: &[bool],
    scalars: &[F],
    (scale, factor): (F, F),
    p: &mut [F],
    acc: &mut [F],
    states: &mut [&mut [F]],
    start: usize,
    scratch: &mut [F],
) {
    let m = p.len();
    let k = states.len();
    let (fixed, lets) = scratch.split_at_mut((2 + k) * BLOCK);
    let (g, rest) = fixed.split_at_mut(BLOCK);
    let (w, old) = rest.split_at_mut(BLOCK);
    g[..m].iter_mut().zip(&*acc).for_each(|(g, &a)| *g = a * scale);
    if factor != F::from_f64(1.0) {
        g[..m].iter_mut().for_each(|g| *g = *g * factor);
    }
    if kept[0] {
        w[..m].copy_from_slice(p);
    }
    for (j, s) in states.iter().enumerate().filter(|(j, _)| kept[1 + j]) {
        old[j * BLOCK..][..m].copy_from_slice(&s[start..start + m]);
    }
    let leaf = |v: Val| match v {
        Val::Scalar(i) => scalars[i as usize],
        _ => F::from_f64(v.literal().expect("a scalar input or a literal")),
    };
    for (next, step) in prog.steps().iter().enumerate() {
        let (done, rest) = lets.split_at_mut(next * BLOCK);
        let dst = &mut rest[..m];
        // A write of a step's value or a constant lands straight in its target.
        let direct = match *step {
            Step::Write(o, Val::Let(i)) => Some((o, Src::Block(&done[i as usize * BLOCK..][..m]))),
            Step::Write(o, v @ (Val::Scalar(_) | Val::Lit(_))) => Some((o, Src::Splat(leaf(v)))),
            _ => None,
        };
        if let Some((o, x)) = direct {
            let to: &mut [F] = if o == 0 { &mut *p } else { &mut states[o as usize - 1][start..start + m] };
            x.copy_to(to);
            continue;
        }
        let val = |v: Val| match v {
            Val::Arg(0) if kept[0] => Src::Block(&w[..m]),
            Val::Arg(0) => Src::Block(&*p),
            Val::Arg(1) => Src::Block(&g[..m]),
            Val::Arg(a) if kept[a as usize - 1] => Src::Block(&old[(a as usize - 2) * BLOCK..][..m]),
            Val::Arg(a) => Src::Block(&states[a as usize - 2][start..start + m]),
            Val::Scalar(_) | Val::Lit(_) => Src::Splat(leaf(v)),
            Val::Let(i) => Src::Block(&done[i as usize * BLOCK..][..m]),
        };
        let write = match *step {
            Step::Unary(op, x) => {
                val(x).copy_to(dst);
                unary(op, dst, false);
                None
            }
            Step::Binary(op, a, b) => {
                binary_into(op, dst, val(a), val(b), false);
                None
            }
            // The parameter or a state written as it is: through this step's slot.
            Step::Write(o, x) => {
                val(x).copy_to(dst);
                Some(o)
            }
        };
        if let Some(o) = write {
            let to: &mut [F] = if o == 0 { &mut *p } else { &mut states[o as usize - 1][start..start + m] };
            to.copy_from_slice(dst);
        }
    }
    acc.fill(F::ZERO);
}

/// Values per cache line of f32 (two lines of f64), the step of [`prefetch`]'s turns.
const LINE: usize = 16;

/// Asks for `x`'s cache lines ahead of their reads. On the 2-core Zen 4 EPYC, asking for the
/// next block's lines of every buffer, a line of each in turn, made the boundary of 11.2 M
/// parameters (`benches/kernels.rs`) 1.34x faster under SGD with momentum (24 against 33 ms)
/// and 1.25x under AdamW (32 against 40 ms); asked for one buffer after another, 1.1x.
#[inline(always)]
fn prefetch<F>(x: &[F]) {
    #[cfg(target_arch = "x86_64")]
    {
        let (at, bytes) = (x.as_ptr() as *const i8, std::mem::size_of_val(x));
        for off in (0..bytes).step_by(64) {
            // SAFETY: an address inside `x`; a prefetch neither faults nor changes memory.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

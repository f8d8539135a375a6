//! The window's boundary on host slices: each parameter's optimizer update and the clearing
//! of its accumulator in one pass ([`update_clear`]), the update's program run through all its
//! steps a few vectors at a time, on the programs' element ops ([`super::program`]).

use super::float::{each, vectorized, HostFloat, BLOCK};
use super::program::{binary_into, unary};
use super::reads::Src;
use cellgraph_compiler::program::{Binary, Program, Step, Unary, Val};

/// Values [`update_clear`] carries through all the program's steps at once. Each step is one
/// pass over a slot of `LANES` values in a small register file (in L1), so the parameter, its
/// accumulator and its states are read and written once, side by side, where a step at a time
/// over a block of 1,024 values read one buffer after another. On the 2-core Zen 4 EPYC
/// (`benches/kernels.rs`, 11.2 M parameters) SGD with momentum and weight decay went from
/// 24.5 to 19.3 ms (1.27x) and AdamW from 33.1 to 22.9 ms (1.45x). Fewer lanes lose: at 16 each
/// step's dispatch costs more than its arithmetic (52 and 92 ms), and at 32 and 64 the fixed
/// lengths are unrolled into vectors loaded piece by piece (AdamW 59 and 43 ms); at 256 the
/// register file leaves L1 (23 and 29 ms).
const LANES: usize = 128;

/// How far ahead of the values it computes [`update_clear`] asks for the buffers' lines
/// ([`prefetch`]; 256 to 2,048 values gave the same times).
const AHEAD: usize = 512;

/// A window's boundary for one parameter in one pass: its optimizer's update (the
/// [`Program`] its graph comes from, [`cellgraph_compiler::update`]) and the clearing of its
/// accumulator, `LANES` (128) values at a time: `g = acc * scale` (then `g * factor`, clipping's,
/// unless it is 1), the program's steps in order, `acc = 0`.
/// Reads of the parameter and of the states see their values before the update (the optimizer
/// graph's writes land when it finishes), and each op rounds to `F` as the graph's ops do, so
/// the results are the optimizer graph's bits. `scalars`: the rule's scalar inputs.
pub fn update_clear<F: HostFloat>(prog: &Program, p: &mut [F], acc: &mut [F], states: &mut [Vec<F>], scalars: &[F], scale: F, factor: F) {
    let n = p.len();
    assert!(acc.len() == n && states.iter().all(|s| s.len() == n), "one length for a parameter's buffers");
    let code = Code::of(prog, states.len(), scalars);
    let threads = rayon::current_num_threads().min(n / (16 * BLOCK)).max(1);
    let per = n.div_ceil(threads).div_ceil(BLOCK).max(1) * BLOCK;
    // Each share: its part of the parameter, the accumulator and every state.
    let mut parts: Vec<Vec<&mut [F]>> = states.iter_mut().map(|s| s.chunks_mut(per).collect()).collect();
    let shares: Vec<_> =
        p.chunks_mut(per).zip(acc.chunks_mut(per)).map(|(p, a)| (p, a, parts.iter_mut().map(|v| v.remove(0)).collect::<Vec<_>>())).collect();
    each(shares, |(p, acc, mut st)| {
        let mut regs = code.regs.clone();
        let full = p.len() / LANES * LANES;
        vectorized(Update { code: &code, scale, factor, p: &mut p[..], acc: &mut acc[..], states: &mut st, regs: &mut regs, end: full });
        // The last few values, through copies padded to a whole slot (the padding's values
        // are computed and dropped).
        let m = p.len() - full;
        if m > 0 {
            let pad = |x: &[F]| {
                let mut v = vec![F::ZERO; LANES];
                v[..m].copy_from_slice(&x[full..]);
                v
            };
            let (mut tp, mut ta) = (pad(p), pad(acc));
            let mut ts: Vec<Vec<F>> = st.iter().map(|s| pad(s)).collect();
            let mut tsr: Vec<&mut [F]> = ts.iter_mut().map(|v| &mut v[..]).collect();
            vectorized(Update { code: &code, scale, factor, p: &mut tp, acc: &mut ta, states: &mut tsr, regs: &mut regs, end: LANES });
            p[full..].copy_from_slice(&tp[..m]);
            acc[full..].fill(F::ZERO);
            for (s, t) in st.iter_mut().zip(&ts) {
                s[full..].copy_from_slice(&t[..m]);
            }
        }
    });
}

/// A step of [`Code`]: its op, the slots it reads and the slot it writes, or a write of a
/// slot to the parameter (output 0) or a state (output `1 + k`).
#[derive(Clone, Copy)]
enum Inst {
    Unary(Unary, u16, u16),
    Binary(Binary, u16, u16, u16),
    Write(u8, u16),
}

/// An update's [`Program`] over slots of [`LANES`] values: slot 0 the parameter, 1 the
/// gradient, `2 + k` state `k` (each as it was before the update), then one per scalar input
/// or literal the program reads (filled once), then one per step.
struct Code<F> {
    insts: Vec<Inst>,
    /// The slots, with the constants' filled in.
    regs: Vec<[F; LANES]>,
}

impl<F: HostFloat> Code<F> {
    fn of(prog: &Program, states: usize, scalars: &[F]) -> Code<F> {
        let mut regs = vec![[F::ZERO; LANES]; 2 + states];
        let mut leaves: Vec<Val> = Vec::new();
        for v in prog.steps().iter().flat_map(|s| s.reads()) {
            if matches!(v, Val::Scalar(_) | Val::Lit(_)) && !leaves.contains(&v) {
                leaves.push(v);
                let x = match v {
                    Val::Scalar(i) => scalars[i as usize],
                    _ => F::from_f64(v.literal().expect("a literal")),
                };
                regs.push([x; LANES]);
            }
        }
        let first = regs.len();
        let slot = |v: Val| -> u16 {
            let s = match v {
                Val::Arg(a) => a as usize,
                Val::Let(i) => first + i as usize,
                _ => 2 + states + leaves.iter().position(|&l| l == v).expect("a leaf of the program"),
            };
            u16::try_from(s).expect("an update program of fewer than 65,536 values")
        };
        let insts = prog
            .steps()
            .iter()
            .enumerate()
            .map(|(i, step)| {
                let at = slot(Val::Let(i as u16));
                match *step {
                    Step::Unary(op, x) => Inst::Unary(op, slot(x), at),
                    Step::Binary(op, a, b) => Inst::Binary(op, slot(a), slot(b), at),
                    Step::Write(o, x) => Inst::Write(o, slot(x)),
                }
            })
            .collect();
        regs.resize(first + prog.steps().len(), [F::ZERO; LANES]);
        Code { insts, regs }
    }
}

/// [`update_clear`]'s loop over one share's values up to `end` (a multiple of [`LANES`]), as
/// a [`vectorized`] op (too large for a closure, which ran on SSE2: see there).
struct Update<'a, 'b, F> {
    code: &'a Code<F>,
    scale: F,
    factor: F,
    p: &'a mut [F],
    acc: &'a mut [F],
    states: &'a mut [&'b mut [F]],
    regs: &'a mut [[F; LANES]],
    end: usize,
}

impl<F: HostFloat> pulp::WithSimd for Update<'_, '_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Update { code, scale, factor, p, acc, states, regs, end } = self;
        let scaled = factor != F::from_f64(1.0);
        for at in (0..end).step_by(LANES) {
            // The lines `AHEAD` values on, of every buffer: the cores' own prefetchers start
            // again at each page, and the values of all buffers are read side by side.
            let next = (at + AHEAD).min(p.len())..(at + AHEAD + LANES).min(p.len());
            for line in next.step_by(LINE) {
                prefetch(&p[line..line + 1]);
                prefetch(&acc[line..line + 1]);
                for s in states.iter() {
                    prefetch(&s[line..line + 1]);
                }
            }
            let range = at..at + LANES;
            regs[0].copy_from_slice(&p[range.clone()]);
            let g = &mut regs[1];
            binary_into(Binary::Mul, g, Src::Block(&acc[range.clone()]), Src::Splat(scale), false);
            if scaled {
                let v = *g;
                binary_into(Binary::Mul, g, Src::Block(&v), Src::Splat(factor), false);
            }
            for (j, s) in states.iter().enumerate() {
                regs[2 + j].copy_from_slice(&s[range.clone()]);
            }
            for inst in &code.insts {
                match *inst {
                    // A step's slot comes after every slot it reads.
                    Inst::Unary(op, x, to) => {
                        let (read, at) = regs.split_at_mut(to as usize);
                        at[0] = read[x as usize];
                        unary(op, &mut at[0], false);
                    }
                    Inst::Binary(op, a, b, to) => {
                        let (read, at) = regs.split_at_mut(to as usize);
                        binary_into(op, &mut at[0], Src::Block(&read[a as usize]), Src::Block(&read[b as usize]), false);
                    }
                    Inst::Write(o, x) => {
                        let to: &mut [F] = if o == 0 { &mut *p } else { &mut *states[o as usize - 1] };
                        to[range.clone()].copy_from_slice(&regs[x as usize]);
                    }
                }
            }
            acc[range].fill(F::ZERO);
        }
    }
}

/// Values per cache line of f32 (two lines of f64), the step of [`prefetch`]'s turns.
const LINE: usize = 16;

/// Asks for `x`'s cache lines ahead of their reads. On the 2-core Zen 4 EPYC, the boundary of
/// 11.2 M parameters (`benches/kernels.rs`) took 19.3 ms with the lines [`AHEAD`] values on
/// asked for, a line of each buffer in turn, and 23.7 without under SGD with momentum; 22.9
/// and 28.7 ms under AdamW.
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

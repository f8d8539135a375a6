//! Elementwise programs as device kernels: a bound [`Elementwise`] (a `fused` node's program,
//! an epilogue's, ReLU and its gradient alone) becomes an [`EwKernel`] that [`elementwise`]
//! unrolls when it is compiled, so the whole program is one launch with its operands read
//! once and no intermediate in memory. The optimizer's boundary kernel
//! ([`super::update::update_clear`]) runs its [`Program`] through the same [`step`]s.

use cellgraph_compiler::program::{Binary, Program, Step, Unary, Val};
use cubecl::prelude::*;

use crate::kernel::{Elementwise, Read};

/// Operands an [`elementwise`] kernel reads (more fall back to burn's ops): six, a residual
/// join's two batch norms and ReLU (`relu(x * a + b + z * c + d)`), with the output seven
/// storage buffers, within WebGPU's default eight a shader stage may bind.
pub const MAX_OPERANDS: usize = 6;

/// Operands a program run inside a head kernel reads ([`apply`]: the head's result and three
/// more); a longer epilogue runs as its own [`elementwise`] launch after the head.
pub const HEAD_OPERANDS: usize = 4;

/// Output axes a strided read may span (more fall back to burn's ops).
pub const MAX_AXES: usize = 4;

/// How output element `i` finds an operand's value (the device form of [`Read`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KRead {
    Same,
    Splat,
    /// At `i % n`.
    Cycle(u32),
    /// At the sum over `rank` output axes of `(i / div) % extent * stride` (broadcast axes left
    /// out).
    Strided {
        axes: [(u32, u32, u32); MAX_AXES],
        rank: u8,
    },
}

impl KRead {
    fn of(r: &Read) -> Option<KRead> {
        let u = |v: usize| u32::try_from(v).ok();
        Some(match r {
            Read::Same => KRead::Same,
            Read::Splat => KRead::Splat,
            Read::Cycle(n) => KRead::Cycle(u(*n)?),
            Read::Strided { out, strides } => {
                let mut axes = [(1, 1, 0); MAX_AXES];
                let mut rank = 0;
                for a in (0..out.len()).filter(|&a| strides[a] != 0) {
                    let div: usize = out[a + 1..].iter().product();
                    *axes.get_mut(rank)? = (u(div)?, u(out[a])?, u(strides[a])?);
                    rank += 1;
                }
                KRead::Strided { axes, rank: rank as u8 }
            }
        })
    }
}

/// Where a kernel's program finds scalar input `k`: its values after `SCALARS` operands
/// (the boundary kernel's parameter, gradient and two states; elementwise programs have none).
pub const SCALARS: usize = 4;

/// An elementwise [`Program`] with how each of its operands is read. `in_place`: operand 0 is
/// the output buffer itself, read and overwritten element by element (an epilogue's program
/// over its head's output).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EwKernel {
    pub prog: Program,
    pub reads: Vec<KRead>,
    pub in_place: bool,
}

impl EwKernel {
    /// The kernel of `e`; `None` when it does not fit (more than [`MAX_OPERANDS`] operands, a
    /// read over more than [`MAX_AXES`] axes, extents past `u32`).
    pub fn new(e: &Elementwise, in_place: bool) -> Option<EwKernel> {
        if e.reads.len() > MAX_OPERANDS || (in_place && e.reads.first() != Some(&Read::Same)) {
            return None;
        }
        let reads = e.reads.iter().map(KRead::of).collect::<Option<Vec<_>>>()?;
        Some(EwKernel { prog: e.prog.clone(), reads, in_place })
    }

    /// The program that leaves operand 0 as it is (a head kernel without an epilogue).
    pub fn identity() -> EwKernel {
        let mut prog = Program::new();
        prog.write(0, Val::Arg(0));
        EwKernel { prog, reads: vec![KRead::Same], in_place: true }
    }

    /// `prog` over `arity` operands of the output's extents (ReLU, its gradient).
    pub fn same(arity: usize, prog: Program) -> EwKernel {
        EwKernel { prog, reads: vec![KRead::Same; arity], in_place: false }
    }
}

/// A one-operand op, as the host kernels compute it (ReLU: +0 for NaN and -0).
#[cube]
pub fn unary<F: Float>(x: F, #[comptime] op: Unary) -> F {
    match comptime!(op) {
        Unary::Neg => -x,
        Unary::Exp => F::exp(x),
        Unary::Log => F::ln(x),
        Unary::Relu => select(x > F::new(0.0), x, F::new(0.0)),
        Unary::Sqrt => F::sqrt(x),
        Unary::Tanh => F::tanh(x),
        Unary::Erf => F::erf(x),
        Unary::RoundBf16 => round_bf16::<F>(x),
        Unary::RoundF16 => round_f16::<F>(x),
    }
}

/// `x` (an f32) rounded to the nearest bf16 value, ties to even, on its bits: as the host's
/// conversion (`half`), NaN aside (kept as it is; `x != x` is the NaN test, as in
/// [`super::pool`]).
#[cube]
#[allow(clippy::eq_op)]
pub fn round_bf16<F: Float>(x: F) -> F {
    let b = u32::reinterpret(x);
    let r = (b + 0x7FFFu32 + ((b >> 16u32) & 1u32)) & 0xFFFF0000u32;
    select(x != x, x, F::reinterpret(r))
}

/// `x` (an f32) rounded to the nearest f16 value on its bits, as the host's conversion: ties
/// to even; from 65520 on, infinity; below 2^-14, f16's subnormals (multiples of 2^-24).
#[cube]
pub fn round_f16<F: Float>(x: F) -> F {
    let b = u32::reinterpret(x);
    let sign = b & 0x80000000u32;
    let a = b & 0x7FFFFFFFu32;
    // Infinity and NaN are kept.
    let mut r = a;
    if a < 0x7F800000u32 {
        if a >= 0x477FF000u32 {
            r = 0x7F800000u32;
        } else if a >= 0x38800000u32 {
            // A normal f16: 10 of the 23 fraction bits kept.
            r = (a + 0xFFFu32 + ((a >> 13u32) & 1u32)) & 0xFFFFE000u32;
        } else {
            let e = a >> 23u32;
            r = 0u32;
            if e >= 102u32 {
                // |x| = m 2^(e - 150): in units of 2^-24, m >> (126 - e), rounded to even.
                let m = (a & 0x7FFFFFu32) | 0x800000u32;
                let d = 126u32 - e;
                let q = (m + (1u32 << (d - 1u32)) - 1u32 + ((m >> d) & 1u32)) >> d;
                r = u32::reinterpret(F::cast_from(q) * F::new(5.9604645e-8));
            }
        }
    }
    F::reinterpret(r | sign)
}

/// A two-operand op, as the host kernels compute it (ReLU's gradient: `a` where `b > 0`).
#[cube]
pub fn binary<F: Float>(a: F, b: F, #[comptime] op: Binary) -> F {
    match comptime!(op) {
        Binary::Add => a + b,
        Binary::Sub => a - b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
        Binary::ReluGrad => select(b > F::new(0.0), a, F::new(0.0)),
    }
}

/// The index of output element `i` in an operand read as `r`.
#[cube]
#[allow(clippy::needless_range_loop)] // an unrolled loop indexes its compile-time table
fn read_at(i: usize, #[comptime] r: KRead) -> usize {
    let mut j = i;
    match comptime!(r) {
        KRead::Same => {}
        KRead::Splat => {
            j = 0;
        }
        KRead::Cycle(n) => {
            j = i % comptime!(n as usize);
        }
        KRead::Strided { axes, rank } => {
            j = 0;
            #[unroll]
            for a in 0..comptime!(rank as usize) {
                let (div, ext, stride) = comptime!(axes[a]);
                j += (i / comptime!(div as usize)) % comptime!(ext as usize) * comptime!(stride as usize);
            }
        }
    }
    j
}

/// The value `v`: operand `k` is `args[k]`, scalar input `k` is `args[SCALARS + k]`, step
/// `k`'s result is `lets[k]`.
#[cube]
fn value<F: Float>(args: &Sequence<F>, lets: &Sequence<F>, #[comptime] v: Val) -> F {
    match comptime!(v) {
        Val::Arg(k) => *args.index(k as usize),
        Val::Scalar(k) => *args.index(comptime!(SCALARS + k as usize)),
        Val::Lit(bits) => F::new(comptime!(f64::from_bits(bits) as f32)),
        Val::Let(k) => *lets.index(k as usize),
    }
}

/// Step `s`'s value: its op's result, or the value a write stores (the caller stores it).
#[cube]
pub fn step<F: Float>(args: &Sequence<F>, lets: &Sequence<F>, #[comptime] s: Step) -> F {
    match comptime!(s) {
        Step::Unary(op, x) => unary::<F>(value::<F>(args, lets, x), op),
        Step::Binary(op, a, b) => binary::<F>(value::<F>(args, lets, a), value::<F>(args, lets, b), op),
        Step::Write(_, x) => value::<F>(args, lets, x),
    }
}

/// Operand `k` at output element `i`, read from `x` as the program says, onto `args`; nothing
/// when the program has no operand `k` (its slot is never read).
#[cube]
fn push_read<F: Float>(args: &mut Sequence<F>, x: &[F], i: usize, #[comptime] k: usize, #[comptime] p: &EwKernel) {
    if comptime!(p.reads.len() > k) {
        args.push(x[read_at(i, comptime!(p.reads[k]))]);
    }
}

/// The program over its operands' values `args` (operand `k` is `args[k]`): every step's
/// value in order, the last (its write) the result.
#[cube]
fn program<F: Float>(args: &Sequence<F>, #[comptime] p: &EwKernel) -> F {
    let mut lets = Sequence::<F>::new();
    #[unroll]
    for k in 0..comptime!(p.prog.steps().len()) {
        lets.push(step::<F>(args, &lets, comptime!(p.prog.steps()[k])));
    }
    *lets.index(comptime!(p.prog.steps().len() - 1))
}

/// The program at output element `i`, operand 0 being `a0` (already read) and operands 1..
/// read from `x1`.. (at most [`HEAD_OPERANDS`]; slots the program does not use are never
/// read): what a head kernel stores when its epilogue runs inside it.
#[cube]
pub fn apply<F: Float>(a0: F, x1: &[F], x2: &[F], x3: &[F], i: usize, #[comptime] p: EwKernel) -> F {
    let mut args = Sequence::<F>::new();
    args.push(a0);
    push_read::<F>(&mut args, x1, i, 1usize, &p);
    push_read::<F>(&mut args, x2, i, 2usize, &p);
    push_read::<F>(&mut args, x3, i, 3usize, &p);
    program::<F>(&args, &p)
}

/// Operand `k` at output element `i`, read from `x` (of its own storage type `T`: f32, or a
/// bf16 / f16 value a session stores) as the program says, onto `args` as an `F`; nothing when
/// the program has no operand `k`.
#[cube]
fn push_stored<F: Float, T: Float>(args: &mut Sequence<F>, x: &[T], i: usize, #[comptime] k: usize, #[comptime] p: &EwKernel) {
    if comptime!(p.reads.len() > k) {
        args.push(F::cast_from(x[read_at(i, comptime!(p.reads[k]))]));
    }
}

/// `y[i]` = the program over the operands at `i` (operand 0 is `y[i]` itself when the program
/// is in place; unused operand slots are never read), computed in `F` (f32). Each operand and
/// the output has its own storage type (f32, or bf16 / f16 where a session stores a value in
/// it, [`crate::Session::set_low_precision_storage`]), defined at the launch: a low-precision
/// value is widened exactly when read, and the result, which the program rounds to the type
/// it is stored in, is narrowed exactly when written.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn elementwise<F: Float, Y: Float, T0: Float, T1: Float, T2: Float, T3: Float, T4: Float, T5: Float>(
    y: &mut [Y],
    x0: &[T0],
    x1: &[T1],
    x2: &[T2],
    x3: &[T3],
    x4: &[T4],
    x5: &[T5],
    #[comptime] p: EwKernel,
    #[define(F)] _f: ElemType,
    #[define(Y)] _out_type: ElemType,
    #[define(T0)] _t0: ElemType,
    #[define(T1)] _t1: ElemType,
    #[define(T2)] _t2: ElemType,
    #[define(T3)] _t3: ElemType,
    #[define(T4)] _t4: ElemType,
    #[define(T5)] _t5: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        let mut args = Sequence::<F>::new();
        if comptime!(p.in_place) {
            args.push(F::cast_from(y[i]));
        } else {
            push_stored::<F, T0>(&mut args, x0, i, 0usize, &p);
        }
        push_stored::<F, T1>(&mut args, x1, i, 1usize, &p);
        push_stored::<F, T2>(&mut args, x2, i, 2usize, &p);
        push_stored::<F, T3>(&mut args, x3, i, 3usize, &p);
        push_stored::<F, T4>(&mut args, x4, i, 4usize, &p);
        push_stored::<F, T5>(&mut args, x5, i, 5usize, &p);
        y[i] = Y::cast_from(program::<F>(&args, &p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_take_their_programs_with_device_reads() {
        // $0 $1 add 2.5 mul relu, the bias read cyclically.
        let prog: Program = "$0 $1 add 2.5 mul relu".parse().unwrap();
        let e = Elementwise::new(prog.clone(), vec![Read::Same, Read::Cycle(4)], 12);
        let k = EwKernel::new(&e, true).unwrap();
        assert_eq!((k.prog, k.reads.clone()), (prog, vec![KRead::Same, KRead::Cycle(4)]));
        // In place needs operand 0 at the output's extents; seven operands do not fit.
        assert!(EwKernel::new(&Elementwise { reads: vec![Read::Cycle(4), Read::Same], ..e }, true).is_none());
        let one: Program = "$0".parse().unwrap();
        let seven = Elementwise::new(one.clone(), vec![Read::Same; 7], 1);
        assert!(EwKernel::new(&seven, false).is_none());
        assert!(EwKernel::new(&Elementwise { reads: vec![Read::Same; 6], ..seven }, false).is_some());
        assert_eq!(EwKernel::identity().prog, one);
    }

    #[test]
    fn strided_reads_keep_only_the_axes_they_move_along() {
        // A [1, 3, 1, 1] per-channel operand over a [2, 3, 4, 5] output.
        let r = KRead::of(&Read::Strided { out: vec![2, 3, 4, 5], strides: vec![0, 1, 0, 0] }).unwrap();
        let KRead::Strided { axes, rank } = r else { panic!("{r:?}") };
        assert_eq!((rank, axes[0]), (1, (20, 3, 1)));
        let deep = Read::Strided { out: vec![2; 6], strides: vec![1; 6] };
        assert!(KRead::of(&deep).is_none(), "six moving axes do not fit");
    }
}

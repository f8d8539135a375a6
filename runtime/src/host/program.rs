//! The interpreter of the plans' small programs on host slices: fused elementwise programs and
//! epilogues ([`fused`], [`epilogue`]) a block of elements at a time, their operands read in
//! runs (whole, one element, periodic, broadcast or strided); the optimizer's
//! update-and-clear programs run on its element ops ([`super::update`]).

use super::float::{post_all, shares_of, vectorized, HostFloat, BLOCK};
use super::reads::{gather, Runs, Src, MIN_RUN};
use super::rows::{add_runs, relu1};
use super::tables::Tables;
use crate::kernel::{Elementwise, Read};
use cellgraph_compiler::program::{Binary, Step, Unary, Val};

/// Where a program's operands are: all in slices, or (an epilogue) operand 0 in the output
/// itself and operand `i` > 0 in slice `i - 1`.
#[derive(Clone, Copy)]
enum Operands<'a, F> {
    All(&'a [&'a [F]]),
    Head(&'a [&'a [F]]),
}

/// A fused elementwise program ([`Elementwise`]) over its operands, block by block. Each op
/// rounds to `F` exactly as the unfused op does, in the same order, so the bits are the
/// unfused plan's. Large outputs are cut into per-thread shares of whole blocks.
///
/// An operand read in runs too short to read in place, repeating along a broadcast leading
/// axis (a per-channel statistic over 2 x 2 and 4 x 4 maps), is first written out for one
/// period of the output, then read as a cycle over that: the same values.
pub fn fused<F: HostFloat>(e: &Elementwise, args: &[&[F]], out: &mut [F]) {
    assert_eq!(out.len(), e.len, "output extents");
    periodic(e, args, |reads, args| post_all(Some(&|first, part: &mut [F]| program(e, reads, Operands::All(args), first, part)), out))
}

/// `f(reads, args)` with `e`'s operands read as `e.reads` says, except operands worth writing
/// out for one period ([`period`]), read as a cycle over their period written out.
fn periodic<F: HostFloat, R>(e: &Elementwise, args: &[&[F]], f: impl FnOnce(&[Read], &[&[F]]) -> R) -> R {
    let periods: Vec<Option<usize>> = e.reads.iter().map(|r| period(r, e.len)).collect();
    if periods.iter().all(Option::is_none) {
        return f(&e.reads, args);
    }
    let expanded: Vec<Option<Vec<F>>> = periods
        .iter()
        .zip(&e.reads)
        .zip(args)
        .map(|((p, r), x)| {
            p.map(|p| {
                let mut v = vec![F::ZERO; p];
                gather(r, x, 0, &mut v);
                v
            })
        })
        .collect();
    let reads: Vec<Read> = periods.iter().zip(&e.reads).map(|(p, r)| p.map_or_else(|| r.clone(), Read::Cycle)).collect();
    let args: Vec<&[F]> = expanded.iter().zip(args).map(|(v, x)| v.as_deref().unwrap_or(x)).collect();
    f(&reads, &args)
}

/// The sums of a fused program's output `[outer, out.len(), inner]` over its first and last
/// axes, times `scale`, without writing the output out: a few rows of it at a time are
/// computed into scratch and summed there as [`super::rows::sum_planes`] sums a written
/// output (each row's run summed, then added to its sum plane after plane, from zero), so the
/// bits are those of the program's output summed (each element is computed the same way
/// whatever the cut, [`fused`]). Threads take shares of whole rows.
pub fn sum_of<F: HostFloat>(e: &Elementwise, args: &[&[F]], outer: usize, inner: usize, scale: Option<F>, out: &mut [F]) {
    assert_eq!(outer * out.len() * inner, e.len, "a program's output summed over {outer} planes and runs of {inner}");
    let (rows, plane) = ((BLOCK / inner).max(1), out.len() * inner);
    periodic(e, args, |reads, args| {
        shares_of(out, rows, e.len, |first, part| {
            F::partials(rows * inner, |values| {
                for (k, sums) in part.chunks_mut(rows).enumerate() {
                    let row = first * rows + k * rows;
                    let values = &mut values[..sums.len() * inner];
                    sums.fill(F::ZERO);
                    for p in 0..outer {
                        program(e, reads, Operands::All(args), p * plane + row * inner, values);
                        add_runs(values, inner, sums);
                    }
                    if let Some(s) = scale {
                        sums.iter_mut().for_each(|v| *v = *v * s);
                    }
                }
            })
        })
    })
}

/// [`fused`] on the calling thread alone, for a program whose operands are read whole
/// ([`Read::Same`]): the tables' own runs ([`super::tables::make`]), made while other threads
/// wait for them, so that they hand no work to rayon (a thread waiting on its handed-out work
/// could take up another part of the program being tabulated, and wait for its own tables).
fn fused_here<F: HostFloat>(e: &Elementwise, args: &[&[F]], out: &mut [F]) {
    assert!(out.len() == e.len && e.reads.iter().all(|r| *r == Read::Same), "a program over whole operands");
    program(e, &e.reads, Operands::All(args), 0, out)
}

/// The most elements [`fused`] writes out for one period of an operand (64 KiB of f32).
const MAX_PERIOD: usize = 1 << 14;

/// The period of a strided read worth writing out ([`fused`]): it repeats along the output's
/// broadcast leading axis, every period of at most [`MAX_PERIOD`] elements (repeated at least
/// twice), and runs along its last axis are shorter than [`MIN_RUN`].
fn period(r: &Read, len: usize) -> Option<usize> {
    let Read::Strided { out, strides } = r else { return None };
    let p: usize = out[1..].iter().product();
    (strides[0] == 0 && *out.last()? < MIN_RUN && (MIN_RUN..=MAX_PERIOD).contains(&p) && 2 * p <= len).then_some(p)
}

/// An epilogue's program ([`crate::kernel::Native::Epilogue`]) over `part` of the output, in
/// place: operand 0 is the head's output (the part itself), operand `i` > 0 is `extras[i - 1]`;
/// `first` is the part's first element's index in the whole output.
pub fn epilogue<F: HostFloat>(e: &Elementwise, extras: &[&[F]], first: usize, part: &mut [F]) {
    if let ([Step::Binary(op, Val::Arg(0), Val::Arg(1)), Step::Write(0, Val::Let(0))], [_, Read::Same]) = (e.prog.steps(), &e.reads[..]) {
        // One op with an operand of the output's extents (an accumulator, say): in one pass.
        let x = &extras[0][first..first + part.len()];
        return vectorized(
            #[inline(always)]
            || binary(*op, part, x, false),
        );
    }
    program(e, &e.reads, Operands::Head(extras), first, part)
}

/// `$body` with `$f` bound to binary op `$op`'s element function `(a, b) -> a op b` (for
/// `relu_grad`, as the host kernel: `dy` where `y > 0`): one closure per op, so each loop in
/// `$body` is compiled (and vectorised) for its op alone.
macro_rules! with_binary {
    ($op:expr, |$f:ident| $body:expr) => {
        match $op {
            Binary::Add => {
                let $f = |x: F, y: F| x + y;
                $body
            }
            Binary::Sub => {
                let $f = |x: F, y: F| x - y;
                $body
            }
            Binary::Mul => {
                let $f = |x: F, y: F| x * y;
                $body
            }
            Binary::Div => {
                let $f = |x: F, y: F| x / y;
                $body
            }
            Binary::ReluGrad => {
                let $f = |x: F, y: F| if y > F::ZERO { x } else { F::ZERO };
                $body
            }
        }
    };
}

/// `$body` with `$g` bound to what a step does to each value it computes: nothing, or
/// (`$round`) round it to bf16, the program's next step (`round_bf16` of this step's value,
/// as the bf16 emulation writes after every op) done in the same pass: the same value, one
/// pass over the block instead of two.
macro_rules! with_round {
    ($round:expr, |$g:ident| $body:expr) => {
        if $round {
            let $g = |v: F| v.round_bf16();
            $body
        } else {
            let $g = |v: F| v;
            $body
        }
    };
}

/// `a = a op b` (`round`: rounded to bf16), element by element.
#[inline(always)]
fn binary<F: HostFloat>(op: Binary, a: &mut [F], b: &[F], round: bool) {
    with_binary!(op, |f| with_round!(round, |g| a.iter_mut().zip(b).for_each(|(a, &b)| *a = g(f(*a, b)))))
}

/// `x = op(x)` (`round`: rounded to bf16), element by element.
#[inline(always)]
pub(super) fn unary<F: HostFloat>(op: Unary, x: &mut [F], round: bool) {
    with_round!(round, |g| unary_then(op, x, g))
}

/// `x = g(op(x))`, element by element.
#[inline(always)]
fn unary_then<F: HostFloat>(op: Unary, x: &mut [F], g: impl Fn(F) -> F) {
    // `for` loops, not `for_each`: a closure as large as erf's makes `for_each` a call that
    // is not inlined, and so compiled for the baseline instruction set, not the caller's.
    macro_rules! each {
        (|$v:ident| $e:expr) => {
            for $v in x.iter_mut() {
                *$v = g($e);
            }
        };
    }
    match op {
        // burn's neg is a multiplication by -1 (a NaN keeps its sign).
        Unary::Neg => each!(|v| *v * F::from_f64(-1.0)),
        Unary::Exp => each!(|v| v.program_exp()),
        Unary::Erf => each!(|v| v.erf()),
        Unary::Tanh => each!(|v| v.tanh()),
        Unary::Log => each!(|v| v.ln()),
        Unary::Sqrt => each!(|v| v.sqrt()),
        // As the host kernel `relu`.
        Unary::Relu => each!(|v| relu1(*v)),
        Unary::RoundBf16 => each!(|v| v.round_bf16()),
        Unary::RoundF16 => each!(|v| v.round_f16()),
    }
}

/// `a = a op b` (`round`: rounded to bf16), element by element.
#[inline(always)]
fn binary_assign<F: HostFloat>(op: Binary, a: &mut [F], b: Src<F>, round: bool) {
    match b {
        Src::Block(b) => binary(op, a, b, round),
        Src::Splat(y) => with_binary!(op, |f| with_round!(round, |g| a.iter_mut().for_each(|x| *x = g(f(*x, y))))),
    }
}

/// `dst = a op b` (`round`: rounded to bf16), element by element, in one pass.
#[inline(always)]
pub(super) fn binary_into<F: HostFloat>(op: Binary, dst: &mut [F], a: Src<F>, b: Src<F>, round: bool) {
    with_binary!(op, |f| with_round!(round, |g| match (a, b) {
        (Src::Block(a), Src::Block(b)) => dst.iter_mut().zip(a).zip(b).for_each(|((d, &x), &y)| *d = g(f(x, y))),
        (Src::Block(a), Src::Splat(y)) => dst.iter_mut().zip(a).for_each(|(d, &x)| *d = g(f(x, y))),
        (Src::Splat(x), Src::Block(b)) => dst.iter_mut().zip(b).for_each(|(d, &y)| *d = g(f(x, y))),
        (Src::Splat(x), Src::Splat(y)) => dst.fill(g(f(x, y))),
    }))
}

/// `e` over `part` (output elements from `first` on), its operands read as `reads` say
/// (`e.reads`, or [`fused`]'s with written-out periods).
fn program<F: HostFloat>(e: &Elementwise, reads: &[Read], args: Operands<F>, first: usize, part: &mut [F]) {
    // An epilogue's operand 0 is the output as the head left it, overwritten by the program
    // from its first op on: a first step whose first operand it is computes in place, and
    // any other read of it is of a copy, taken per block.
    let steps = e.prog.steps();
    let head = matches!(args, Operands::Head(_));
    let in_place = head && matches!(steps.first(), Some(Step::Unary(_, Val::Arg(0)) | Step::Binary(_, Val::Arg(0), _) | Step::Write(_, Val::Arg(0))));
    let save = head && steps.iter().flat_map(|s| s.reads()).filter(|&v| v == Val::Arg(0)).count() > usize::from(in_place);
    // Subtrees on bf16 operands read from tables, made on the first run ([`super::tables`]).
    let tables = (F::TABULATES && !head && !e.bf16_args.is_empty()).then(|| e.tables.get_or_init(|| super::tables::make(e, fused_here::<f32>)));
    let tables = tables.filter(|t| !t.tables.is_empty());
    // A block for the saved operand 0, then one per value beyond the first.
    F::scratch((e.depth + 1) * BLOCK, |stack| vectorized(Blocks { e, reads, args, tables, in_place, save, first, stack, part }))
}

/// [`program`]'s loop over blocks, as a [`vectorized`] op (too large for a closure: see there).
struct Blocks<'a, F> {
    e: &'a Elementwise,
    reads: &'a [Read],
    args: Operands<'a, F>,
    tables: Option<&'a Tables>,
    in_place: bool,
    save: bool,
    first: usize,
    stack: &'a mut [F],
    part: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for Blocks<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let at = Head { in_place: self.in_place, save: self.save };
        for (b, dst) in self.part.chunks_mut(BLOCK).enumerate() {
            fused_block(self.e, self.reads, self.args, self.tables, at, self.first + b * BLOCK, self.stack, dst);
        }
    }
}

/// Where an epilogue's operand 0 is ([`program`]): in the output block for the first step
/// (`in_place`), and copied first for reads after it (`save`).
#[derive(Clone, Copy)]
struct Head {
    in_place: bool,
    save: bool,
}

/// Slots `t` and `t + 1` of a block's values: slot 0 is `dst`, slot `t > 0` is `stack`'s
/// `t - 1`-th block.
#[inline(always)]
fn slots<'a, F>(dst: &'a mut [F], stack: &'a mut [F], t: usize) -> (&'a mut [F], &'a mut [F]) {
    let n = dst.len();
    if t == 0 {
        return (dst, &mut stack[..n]);
    }
    let (lo, hi) = stack.split_at_mut(t * BLOCK);
    (&mut lo[(t - 1) * BLOCK..][..n], &mut hi[..n])
}

/// `a = a op b`, or (`rev`) `a = b op a` (`round`: rounded to bf16), element by element.
#[inline(always)]
fn assign<F: HostFloat>(op: Binary, a: &mut [F], b: Src<F>, rev: bool, round: bool) {
    if !rev {
        return binary_assign(op, a, b, round);
    }
    with_binary!(op, |f| with_round!(round, |g| match b {
        Src::Block(b) => a.iter_mut().zip(b).for_each(|(x, &y)| *x = g(f(y, *x))),
        Src::Splat(y) => a.iter_mut().for_each(|x| *x = g(f(y, *x))),
    }))
}

/// One block of a program: output elements `[start, start + dst.len())`. The program is a
/// tree in postfix order, so the values it holds form a stack: slot 0 is `dst` itself (the
/// program's value ends there), the others are `stack`'s. An op on the value on top and an
/// operand reads the operand straight from its memory, piece by piece ([`Runs`]), into the
/// top slot; an op on two operands whose blocks are whole is computed into a new slot in one
/// pass; only operands read in short pieces are gathered into a slot first. Every op is the
/// same op on the same values as in the unfused plan, so the bits are the unfused plan's.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fused_block<F: HostFloat>(
    e: &Elementwise,
    reads: &[Read],
    args: Operands<F>,
    tables: Option<&Tables>,
    at: Head,
    start: usize,
    stack: &mut [F],
    dst: &mut [F],
) {
    let n = dst.len();
    let steps = e.prog.steps();
    let Head { in_place, save } = at;
    let (saved, stack) = stack.split_at_mut(BLOCK);
    if save {
        saved[..n].copy_from_slice(dst);
    }
    let leaves = Leaves { reads, args, saved: &saved[..n], start, n };
    let mut sp = 0;
    let mut k = 0;
    while k < steps.len() {
        // A tabulated subtree: its operand's values looked up, into a new slot.
        if let Some(t) = tables.and_then(|t| t.at(k)) {
            let top = slots(dst, stack, sp).0;
            match leaves.whole(Val::Arg(t.arg)) {
                Some(Src::Block(x)) => top.iter_mut().zip(x).for_each(|(y, &x)| *y = x.lookup(&t.values)),
                _ => {
                    leaves.load(Val::Arg(t.arg), top);
                    top.iter_mut().for_each(|y| *y = y.lookup(&t.values));
                }
            }
            sp += 1;
            k = t.last + 1;
            continue;
        }
        // The first step's operand 0 of an epilogue is already in slot 0.
        let ready = in_place && k == 0;
        // An op whose value the next step rounds to bf16 rounds it as it computes it.
        let round = !matches!(steps[k], Step::Write(..)) && matches!(steps.get(k + 1), Some(Step::Unary(Unary::RoundBf16, v)) if !v.is_leaf());
        match steps[k] {
            Step::Unary(op, x) => {
                if x.is_leaf() {
                    if !ready {
                        leaves.load(x, slots(dst, stack, sp).0);
                    }
                    sp += 1;
                }
                unary(op, slots(dst, stack, sp - 1).0, round);
            }
            Step::Binary(op, a, b) => match (a.is_leaf(), b.is_leaf()) {
                (false, false) => {
                    let (lo, hi) = slots(dst, stack, sp - 2);
                    binary(op, lo, hi, round);
                    sp -= 1;
                }
                (false, true) => {
                    let (top, spare) = slots(dst, stack, sp - 1);
                    leaves.apply(op, top, b, false, round, spare);
                }
                (true, false) => {
                    let (top, spare) = slots(dst, stack, sp - 1);
                    leaves.apply(op, top, a, true, round, spare);
                }
                (true, true) => {
                    let (top, spare) = slots(dst, stack, sp);
                    if ready {
                        leaves.apply(op, top, b, false, round, spare);
                    } else {
                        match (leaves.whole(a), leaves.whole(b)) {
                            (Some(x), Some(y)) => binary_into(op, top, x, y, round),
                            // One operand in one piece: the other read piece by piece beside it,
                            // in one pass (no copy of the first into the slot).
                            (Some(x), None) => leaves.apply_beside(op, top, x, b, false, round, spare),
                            (None, Some(y)) => leaves.apply_beside(op, top, y, a, true, round, spare),
                            (None, None) => {
                                leaves.load(a, top);
                                leaves.apply(op, top, b, false, round, spare);
                            }
                        }
                    }
                    sp += 1;
                }
            },
            Step::Write(_, v) => {
                if v.is_leaf() && !ready {
                    leaves.load(v, dst);
                }
            }
        }
        k += 1 + usize::from(round);
    }
}

/// How [`fused_block`] reads a program's leaves (operands and literals) for one block.
struct Leaves<'a, F> {
    reads: &'a [Read],
    args: Operands<'a, F>,
    /// An epilogue's operand 0 as the head left it (where the program reads it again).
    saved: &'a [F],
    /// The block's first output element, and its length.
    start: usize,
    n: usize,
}

impl<'a, F: HostFloat> Leaves<'a, F> {
    /// Operand `i`: how the block reads it, its memory, and the index of the block's first
    /// element in that memory's frame.
    #[inline(always)]
    fn operand(&self, i: u8) -> (&'a Read, &'a [F], usize) {
        static SAME: Read = Read::Same;
        match self.args {
            Operands::All(a) => (&self.reads[i as usize], a[i as usize], self.start),
            Operands::Head(_) if i == 0 => (&SAME, self.saved, 0),
            Operands::Head(a) => (&self.reads[i as usize], a[i as usize - 1], self.start),
        }
    }

    #[inline(always)]
    fn literal(v: Val) -> F {
        F::from_f64(v.literal().expect("an elementwise program's leaves are operands and literals"))
    }

    /// A leaf's values for the block in one piece, where they are.
    #[inline(always)]
    fn whole(&self, v: Val) -> Option<Src<'a, F>> {
        let Val::Arg(i) = v else { return Some(Src::Splat(Self::literal(v))) };
        match self.operand(i) {
            (Read::Same, x, at) => Some(Src::Block(&x[at..at + self.n])),
            (Read::Splat, x, _) => Some(Src::Splat(x[0])),
            _ => None,
        }
    }

    /// A leaf's values into `slot`.
    #[inline(always)]
    fn load(&self, v: Val, slot: &mut [F]) {
        match v {
            Val::Arg(i) => {
                let (r, x, at) = self.operand(i);
                gather(r, x, at, slot);
            }
            _ => slot.fill(Self::literal(v)),
        }
    }

    /// `top = top op v` (`rev`: `v op top`; `round`: rounded to bf16), the leaf `v` read piece
    /// by piece where it can be, else gathered into `spare` first.
    #[inline(always)]
    fn apply(&self, op: Binary, top: &mut [F], v: Val, rev: bool, round: bool, spare: &mut [F]) {
        let Val::Arg(i) = v else { return assign(op, top, Src::Splat(Self::literal(v)), rev, round) };
        let (r, x, at) = self.operand(i);
        match Runs::new(r, x, at, self.n) {
            Some(runs) => {
                for (o, len, b) in runs {
                    assign(op, &mut top[o..o + len], b, rev, round);
                }
            }
            None => {
                gather(r, x, at, spare);
                assign(op, top, Src::Block(spare), rev, round);
            }
        }
    }
    /// `top = x op v` (`rev`: `v op x`; `round`: rounded to bf16), `x` a block's values in
    /// one piece and the leaf `v` read piece by piece where it can be, else gathered into
    /// `spare` first: [`Self::apply`] without first copying `x` into `top`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn apply_beside(&self, op: Binary, top: &mut [F], x: Src<F>, v: Val, rev: bool, round: bool, spare: &mut [F]) {
        let Val::Arg(i) = v else { unreachable!("a literal is read in one piece") };
        let (r, m, at) = self.operand(i);
        match Runs::new(r, m, at, self.n) {
            Some(runs) => {
                for (o, len, b) in runs {
                    let (p, q) = ordered(rev, x.piece(o, len), b);
                    binary_into(op, &mut top[o..o + len], p, q, round);
                }
            }
            None => {
                gather(r, m, at, spare);
                let (p, q) = ordered(rev, x, Src::Block(spare));
                binary_into(op, top, p, q, round);
            }
        }
    }
}

/// `(a, b)`, or (`rev`) `(b, a)`.
#[inline(always)]
fn ordered<T>(rev: bool, a: T, b: T) -> (T, T) {
    if rev {
        (b, a)
    } else {
        (a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::float::tests::{data, new};
    use cellgraph_compiler::program::Program;

    /// Program `expr` bound as a fused elementwise kernel over f32 operands of extents `dims`.
    fn bound<D: AsRef<[usize]>>(expr: &Program, dims: &[D]) -> std::sync::Arc<Elementwise> {
        use cellgraph_compiler::{Op, TensorType};
        let tys: Vec<TensorType> = dims.iter().map(|d| TensorType::f32(d.as_ref().to_vec())).collect();
        let Some(crate::kernel::Native::Fused(e)) = crate::kernel::bind(&Op::Fused { expr: expr.clone() }, &tys.iter().collect::<Vec<_>>()) else {
            panic!("fused binds")
        };
        e
    }

    /// A fused program reading one operand of each kind (the output's extents, one element, a
    /// trailing bias, and two broadcasts that need strides), over several blocks and thread
    /// shares, against the same ops written out per element.
    #[test]
    fn fused_programs_read_every_broadcast_and_round_as_the_ops_do() {
        let expr: cellgraph_compiler::program::Program =
            "$0 $1 mul $2 add $3 sub relu $4 div $0 relu_grad 0.5 add exp log sqrt neg tanh erf".parse().unwrap();
        let dims: [&[usize]; 5] = [&[4, 100, 100], &[], &[100], &[100, 1], &[4, 1, 100]];
        let e = bound(&expr, &dims);
        assert_eq!(e.reads[..3], [Read::Same, Read::Splat, Read::Cycle(100)]);
        assert!(matches!(e.reads[3], Read::Strided { .. }) && matches!(e.reads[4], Read::Strided { .. }));
        let mut xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i)).collect();
        xs[4].iter_mut().for_each(|v| *v = v.abs() + 0.5);
        let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
        let got = new(e.len, |out| fused(&e, &args, out));
        assert_eq!(got.len(), 40_000);
        for (i, &g) in got.iter().enumerate() {
            let (a, b, c) = (i / 10_000, i / 100 % 100, i % 100);
            let x0 = xs[0][i];
            let v = x0 * xs[1][0] + xs[2][c] - xs[3][b];
            let v = if v > 0.0 { v } else { 0.0 } / xs[4][a * 100 + c];
            let v = if x0 > 0.0 { v } else { 0.0 };
            use crate::host::math::{erf, exp, tanh};
            let want = erf(tanh(-(exp(v + 0.5f32).ln().sqrt())));
            assert_eq!(g.to_bits(), want.to_bits(), "element {i}: {g} vs {want}");
        }
    }

    /// Steps whose value the next step rounds to bf16 (as every op of the bf16 emulation is
    /// followed) round it in their own pass: after a unary op on an operand and on a value, a
    /// binary op on two values, on two whole operands, on a value and an operand read piece by
    /// piece (on either side) or gathered, and a literal; a rounding of an operand and a
    /// rounding of a rounding stay steps of their own. Against the ops written out per
    /// element, each rounded by `half`, in a program and as an epilogue.
    #[test]
    fn steps_round_their_values_as_the_rounding_step_after_them_does() {
        let expr: cellgraph_compiler::program::Program = "$0 erf round_bf16 $0 $0 mul round_bf16 $1 add round_bf16 mul round_bf16 \
             $2 sub round_bf16 $3 $0 round_bf16 mul round_bf16 div round_bf16 exp round_bf16 0.5 mul round_bf16 round_bf16 \
             $4 mul round_bf16 $3 $0 relu_grad round_bf16 sub round_bf16 tanh round_bf16"
            .parse()
            .unwrap();
        let (a, b, c) = (4, 30, 40);
        let dims: [Vec<usize>; 5] = [vec![a, b, c], vec![c], vec![a, b, 1], vec![a, b, c], vec![a, 1, c]];
        let e = bound(&expr, &dims);
        let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i + 3)).collect();
        let r = |v: f32| half::bf16::from_f32(v).to_f32();
        use crate::host::math::{erf, exp, tanh};
        let want: Vec<f32> = (0..e.len)
            .map(|i| {
                let (n, row, col) = (i / (b * c), i / c % b, i % c);
                let x0 = xs[0][i];
                let v = r(erf(x0)) * r(r(x0 * x0) + xs[1][col]);
                let v = r(r(v) - xs[2][n * b + row]);
                let w = r(xs[3][i] * r(x0));
                let v = r(r(exp(r(v / w))) * 0.5);
                let v = r(r(v) * xs[4][n * c + col]);
                let g = r(if x0 > 0.0 { xs[3][i] } else { 0.0 });
                r(tanh(r(v - g)))
            })
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
        assert_eq!(bits(&new(e.len, |out| fused(&e, &args, out))), bits(&want), "a program");
        let mut got = xs[0].clone();
        let (p, q) = got.split_at_mut(1_001);
        for (first, part) in [(0, p), (1_001, q)] {
            epilogue(&e, &args[1..], first, part);
        }
        assert_eq!(bits(&got), bits(&want), "an epilogue");
    }

    /// Ops on operands alone: a unary op on a whole operand and on a broadcast one, and binary
    /// ops on two operands, one whole and the other a bias or a broadcast read piece by piece
    /// (on either side; a literal as the whole one), or gathered where the pieces are short
    /// (rows of 5). Against the ops written out per element, as a program and as an epilogue,
    /// rounded and not.
    #[test]
    fn ops_on_operands_alone_read_them_in_every_way() {
        let expr: cellgraph_compiler::program::Program =
            "$0 exp round_bf16 $0 $2 sub round_bf16 mul $2 $0 sub $1 $0 mul add mul 2.0 $2 add round_bf16 sub $0 $3 add mul $3 tanh add"
                .parse()
                .unwrap();
        for [a, b, c] in [[4, 30, 40], [6, 7, 5]] {
            let dims: [Vec<usize>; 4] = [vec![a, b, c], vec![c], vec![a, b, 1], vec![a, 1, c]];
            let e = bound(&expr, &dims);
            let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i + 1)).collect();
            let r = |v: f32| half::bf16::from_f32(v).to_f32();
            use crate::host::math::{exp, tanh};
            let want: Vec<f32> = (0..e.len)
                .map(|i| {
                    let (n, row, col) = (i / (b * c), i / c % b, i % c);
                    let (x0, x1, x2, x3) = (xs[0][i], xs[1][col], xs[2][n * b + row], xs[3][n * c + col]);
                    let v = r(exp(x0)) * r(x0 - x2) * ((x2 - x0) + x1 * x0);
                    (v - r(2.0 + x2)) * (x0 + x3) + tanh(x3)
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
            assert_eq!(bits(&new(e.len, |out| fused(&e, &args, out))), bits(&want), "{a}x{b}x{c}: a program");
            let mut got = xs[0].clone();
            let (p, q) = got.split_at_mut(1_001.min(e.len / 2));
            let cut = p.len();
            for (first, part) in [(0, p), (cut, q)] {
                epilogue(&e, &args[1..], first, part);
            }
            assert_eq!(bits(&got), bits(&want), "{a}x{b}x{c}: an epilogue");
        }
    }

    /// An operand on the left of a value already computed is applied to it in place, read
    /// piece by piece where its runs are long (a whole operand, one element, a bias, strided
    /// rows of 20) and gathered first where they are short (rows of 5): `$4 - $3 * ($2 / ($1 -
    /// $0 * $0)) + $0`, against the ops written out per element.
    #[test]
    fn operands_before_a_computed_value_are_read_in_every_way() {
        let expr: cellgraph_compiler::program::Program = "$0 $4 $3 $2 $1 $0 $0 mul sub div mul sub add".parse().unwrap();
        for [a, b, c] in [[4, 30, 20], [6, 7, 5]] {
            let dims: [Vec<usize>; 5] = [vec![a, b, c], vec![], vec![c], vec![b, 1], vec![a, 1, c]];
            let e = bound(&expr, &dims);
            let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i)).collect();
            let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
            let got = new(e.len, |out| fused(&e, &args, out));
            for (i, &g) in got.iter().enumerate() {
                let (n, r, col) = (i / (b * c), i / c % b, i % c);
                let x0 = xs[0][i];
                let v = xs[2][col] / (xs[1][0] - x0 * x0);
                let want = x0 + (xs[4][n * c + col] - xs[3][r] * v);
                assert_eq!(g.to_bits(), want.to_bits(), "{a}x{b}x{c}, element {i}: {g} vs {want}");
            }
        }
    }

    /// Per-channel operands over 2 x 2 maps (runs of 4, repeating every image) are written
    /// out for one image and read as a cycle, with the values of the strided reads.
    #[test]
    fn short_periodic_reads_are_written_out_once_with_the_same_values() {
        let expr: cellgraph_compiler::program::Program = "$0 $1 sub $2 div $0 mul".parse().unwrap();
        let dims: [&[usize]; 3] = [&[40, 64, 2, 2], &[1, 64, 1, 1], &[64, 1, 1]];
        let e = bound(&expr, &dims);
        assert_eq!(e.reads[1..].iter().map(|r| period(r, e.len)).collect::<Vec<_>>(), [Some(256), Some(256)]);
        let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i)).collect();
        let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            let got = pool.install(|| new(e.len, |out| fused(&e, &args, out)));
            for (i, &g) in got.iter().enumerate() {
                let ch = i / 4 % 64;
                let x0 = xs[0][i];
                let want = (x0 - xs[1][ch]) / xs[2][ch] * x0;
                assert_eq!(g.to_bits(), want.to_bits(), "element {i} on {threads}: {g} vs {want}");
            }
        }
    }

    /// A program's output summed over its last axis, or over its first and last (batch norm's
    /// per-channel sums), as it is computed ([`sum_of`]) gives the bits of the output written
    /// out and summed by `sum_planes`'s kernel: rows of 128, 48 (several rows a chunk, chunks
    /// across thread shares), 5 (a sum in order) and 1, in one plane and in three, a per-row
    /// statistic, a bias and a bf16 rounding read, with and without a scale (a mean), on one
    /// thread and on three.
    #[test]
    fn programs_summed_as_they_are_computed_give_the_sums_of_their_outputs() {
        let expr: Program = "$0 $1 sub $0 $1 sub mul round_bf16 $2 mul".parse().unwrap();
        for (rows, inner) in [(300, 128), (1000, 48), (77, 5), (3000, 1)] {
            for outer in [1, 3] {
                let dims: [Vec<usize>; 3] = [vec![outer, rows, inner], vec![rows, 1], vec![inner]];
                let e = bound(&expr, &dims);
                let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i + 5)).collect();
                let args: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
                for scale in [None, Some(1.0 / (outer * inner) as f32)] {
                    for threads in [1, 3] {
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
                        let (got, want) = pool.install(|| {
                            let written = new(e.len, |out| fused(&e, &args, out));
                            let want = new(rows, |out| crate::host::rows::sum_planes(&written, outer, inner, scale, out));
                            (new(rows, |out| sum_of(&e, &args, outer, inner, scale, out)), want)
                        });
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{outer} x {rows} rows of {inner}, scale {scale:?}, {threads} threads");
                    }
                }
            }
        }
    }

    /// An epilogue's program runs in the output's own memory: its operand 0 (the head's
    /// output) read again after the program has started overwriting it, broadcasts read piece
    /// by piece across rows and blocks, and parts starting anywhere, against the ops written
    /// out per element.
    #[test]
    fn epilogue_programs_read_the_heads_output_as_it_was() {
        let expr: cellgraph_compiler::program::Program = "$0 $1 add $0 mul $2 sub 2.0 $0 mul $3 mul add".parse().unwrap();
        let dims: [&[usize]; 4] = [&[4, 100, 100], &[100], &[4, 100, 1], &[4, 1, 100]];
        let e = bound(&expr, &dims);
        let xs: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, d)| data(d.iter().product(), i)).collect();
        let extras: Vec<&[f32]> = xs[1..].iter().map(|v| &v[..]).collect();
        let mut got = xs[0].clone();
        let (a, rest) = got.split_at_mut(5_003);
        let (b, c) = rest.split_at_mut(17_120);
        for (first, part) in [(0, a), (5_003, b), (22_123, c)] {
            epilogue(&e, &extras, first, part);
        }
        for (i, &g) in got.iter().enumerate() {
            let (n, r, col) = (i / 10_000, i / 100 % 100, i % 100);
            let x0 = xs[0][i];
            let want = (x0 + xs[1][col]) * x0 - xs[2][n * 100 + r] + 2.0 * x0 * xs[3][n * 100 + col];
            assert_eq!(g.to_bits(), want.to_bits(), "element {i}: {g} vs {want}");
        }
    }
}

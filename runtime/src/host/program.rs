//! The interpreter of the plans' small programs on host slices: fused elementwise programs and
//! epilogues ([`fused`], [`epilogue`]) a block of elements at a time, their operands read in
//! runs (whole, one element, periodic, broadcast or strided), and the optimizer's
//! update-and-clear programs ([`update_clear`]).

use super::float::{each, post_all, vectorized, HostFloat, BLOCK};
use super::rows::relu1;
use crate::kernel::{Elementwise, KStep, KVal, Read, UpdateKernel};
use cellgraph_compiler::expr::{Binary, Term, Unary};
use cellgraph_compiler::update::Target;

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
    let periods: Vec<Option<usize>> = e.reads.iter().map(|r| period(r, e.len)).collect();
    if periods.iter().all(Option::is_none) {
        return post_all(Some(&|first, part: &mut [F]| program(e, &e.reads, Operands::All(args), first, part)), out);
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
    post_all(Some(&|first, part: &mut [F]| program(e, &reads, Operands::All(&args), first, part)), out);
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
    if let ([Term::Arg(0), Term::Arg(1), Term::Binary(op)], [_, Read::Same]) = (&e.terms[..], &e.reads[..]) {
        // One op with an operand of the output's extents (an accumulator, say): in one pass.
        let x = &extras[0][first..first + part.len()];
        return vectorized(
            #[inline(always)]
            || binary(*op, part, x),
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

/// `a = a op b`, element by element.
#[inline(always)]
fn binary<F: HostFloat>(op: Binary, a: &mut [F], b: &[F]) {
    with_binary!(op, |f| a.iter_mut().zip(b).for_each(|(a, &b)| *a = f(*a, b)))
}

/// `x = op(x)`, element by element.
#[inline(always)]
fn unary<F: HostFloat>(op: Unary, x: &mut [F]) {
    // `for` loops, not `for_each`: a closure as large as erf's makes `for_each` a call that
    // is not inlined, and so compiled for the baseline instruction set, not the caller's.
    macro_rules! each {
        (|$v:ident| $e:expr) => {
            for $v in x.iter_mut() {
                *$v = $e;
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

/// A window's boundary for one parameter in one pass: its optimizer's update
/// ([`UpdateKernel`], the program its graph comes from) and the clearing of its accumulator,
/// block by block: `g = acc * scale`, the program's steps in order, `acc = 0`. Reads of the
/// parameter and of the states see their values before the update (the optimizer graph's
/// writes land when it finishes), and each op rounds to `F` as the graph's ops do, so the
/// results are the optimizer graph's bits. `consts`: the scalar inputs, then the literals.
pub fn update_clear<F: HostFloat>(prog: &UpdateKernel, p: &mut [F], acc: &mut [F], states: &mut [Vec<F>], consts: &[F], scale: F) {
    let n = p.len();
    assert!(acc.len() == n && states.iter().all(|s| s.len() == n), "one length for a parameter's buffers");
    // A value per step (`Let(i)` is step `i`'s; a write's is never read).
    let lets = prog.steps.len();
    // The buffers the program reads after writing them: those are read from copies.
    let mut kept = vec![false; 1 + states.len()];
    let slot = |v: KVal| match v {
        KVal::Param => Some(0),
        KVal::State(j) => Some(1 + j as usize),
        _ => None,
    };
    let mut written = vec![false; 1 + states.len()];
    for step in &prog.steps {
        let reads: &[KVal] = match step {
            KStep::Unary(_, x) | KStep::Write(_, x) => std::slice::from_ref(x),
            KStep::Binary(_, a, b) => &[*a, *b][..],
        };
        for i in reads.iter().filter_map(|&v| slot(v)) {
            kept[i] |= written[i];
        }
        if let KStep::Write(t, _) = step {
            written[match t {
                Target::Param => 0,
                Target::State(j) => 1 + j,
            }] = true;
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
        F::scratch((2 + st.len() + lets) * BLOCK, |scratch| vectorized(Update { prog, kept: &kept, consts, scale, p, acc, states: &mut st, scratch }))
    });
}

/// `a = a op b`, element by element.
#[inline(always)]
fn binary_assign<F: HostFloat>(op: Binary, a: &mut [F], b: Src<F>) {
    match b {
        Src::Block(b) => binary(op, a, b),
        Src::Splat(y) => with_binary!(op, |f| a.iter_mut().for_each(|x| *x = f(*x, y))),
    }
}

/// An operand: a block's values, or one value for every element.
#[derive(Clone, Copy)]
enum Src<'a, F> {
    Block(&'a [F]),
    Splat(F),
}

impl<F: Copy> Src<'_, F> {
    /// Writes the values into `dst`.
    #[inline(always)]
    fn copy_to(self, dst: &mut [F]) {
        match self {
            Src::Block(x) => dst.copy_from_slice(x),
            Src::Splat(x) => dst.fill(x),
        }
    }
}

/// `dst = a op b`, element by element, in one pass.
#[inline(always)]
fn binary_into<F: HostFloat>(op: Binary, dst: &mut [F], a: Src<F>, b: Src<F>) {
    with_binary!(op, |f| match (a, b) {
        (Src::Block(a), Src::Block(b)) => dst.iter_mut().zip(a).zip(b).for_each(|((d, &x), &y)| *d = f(x, y)),
        (Src::Block(a), Src::Splat(y)) => dst.iter_mut().zip(a).for_each(|(d, &x)| *d = f(x, y)),
        (Src::Splat(x), Src::Block(b)) => dst.iter_mut().zip(b).for_each(|(d, &y)| *d = f(x, y)),
        (Src::Splat(x), Src::Splat(y)) => dst.fill(f(x, y)),
    })
}

/// [`update_clear`]'s loop over one share's blocks, as a [`vectorized`] op (too large for a
/// closure, which ran on SSE2: see there).
struct Update<'a, 'b, F> {
    prog: &'a UpdateKernel,
    kept: &'a [bool],
    consts: &'a [F],
    scale: F,
    p: &'a mut [F],
    acc: &'a mut [F],
    states: &'a mut [&'b mut [F]],
    scratch: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for Update<'_, '_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Update { prog, kept, consts, scale, p, acc, states, scratch } = self;
        for start in (0..p.len()).step_by(BLOCK) {
            let m = BLOCK.min(p.len() - start);
            update_block(prog, kept, consts, scale, &mut p[start..start + m], &mut acc[start..start + m], states, start, scratch);
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
    prog: &UpdateKernel,
    kept: &[bool],
    consts: &[F],
    scale: F,
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
    if kept[0] {
        w[..m].copy_from_slice(p);
    }
    for (j, s) in states.iter().enumerate().filter(|(j, _)| kept[1 + j]) {
        old[j * BLOCK..][..m].copy_from_slice(&s[start..start + m]);
    }
    for (next, step) in prog.steps.iter().enumerate() {
        let (done, rest) = lets.split_at_mut(next * BLOCK);
        let dst = &mut rest[..m];
        // A write of a step's value or a constant lands straight in its target.
        let direct = match *step {
            KStep::Write(t, KVal::Let(i)) => Some((t, Src::Block(&done[i as usize * BLOCK..][..m]))),
            KStep::Write(t, KVal::Const(i)) => Some((t, Src::Splat(consts[i as usize]))),
            _ => None,
        };
        if let Some((t, x)) = direct {
            let to: &mut [F] = match t {
                Target::Param => &mut *p,
                Target::State(j) => &mut states[j][start..start + m],
            };
            x.copy_to(to);
            continue;
        }
        let val = |v: KVal| match v {
            KVal::Param if kept[0] => Src::Block(&w[..m]),
            KVal::Param => Src::Block(&*p),
            KVal::Grad => Src::Block(&g[..m]),
            KVal::State(j) if kept[1 + j as usize] => Src::Block(&old[j as usize * BLOCK..][..m]),
            KVal::State(j) => Src::Block(&states[j as usize][start..start + m]),
            KVal::Const(i) => Src::Splat(consts[i as usize]),
            KVal::Let(i) => Src::Block(&done[i as usize * BLOCK..][..m]),
        };
        let write = match *step {
            KStep::Unary(op, x) => {
                val(x).copy_to(dst);
                unary(op, dst);
                None
            }
            KStep::Binary(op, a, b) => {
                binary_into(op, dst, val(a), val(b));
                None
            }
            // The parameter or a state written as it is: through this step's slot.
            KStep::Write(t, x) => {
                val(x).copy_to(dst);
                Some(t)
            }
        };
        if let Some(t) = write {
            let to: &mut [F] = match t {
                Target::Param => &mut *p,
                Target::State(j) => &mut states[j][start..start + m],
            };
            to.copy_from_slice(dst);
        }
    }
    acc.fill(F::ZERO);
}

/// `e` over `part` (output elements from `first` on), its operands read as `reads` say
/// (`e.reads`, or [`fused`]'s with written-out periods).
fn program<F: HostFloat>(e: &Elementwise, reads: &[Read], args: Operands<F>, first: usize, part: &mut [F]) {
    F::scratch(e.depth.max(1) * BLOCK, |stack| vectorized(Program { e, reads, args, first, stack, part }))
}

/// [`program`]'s loop over blocks, as a [`vectorized`] op (too large for a closure: see there).
struct Program<'a, F> {
    e: &'a Elementwise,
    reads: &'a [Read],
    args: Operands<'a, F>,
    first: usize,
    stack: &'a mut [F],
    part: &'a mut [F],
}

impl<F: HostFloat> pulp::WithSimd for Program<'_, F> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for (b, dst) in self.part.chunks_mut(BLOCK).enumerate() {
            fused_block(self.e, self.reads, self.args, self.first + b * BLOCK, self.stack, dst);
        }
    }
}

/// One block of a program: output elements `[start, start + dst.len())`. The stack's bottom
/// slot is `dst` itself (the program's value ends there), the others are `stack`'s. An
/// operand followed by a binary op is applied to the top of the stack straight from its
/// memory, piece by piece ([`Runs`]), and the first operand with the op after it is computed
/// into `dst` in one pass; only operands read in short pieces are gathered into a slot first.
/// Every op is the same op on the same values as in the unfused plan, in the same order.
#[inline(always)]
fn fused_block<F: HostFloat>(e: &Elementwise, reads: &[Read], args: Operands<F>, start: usize, stack: &mut [F], dst: &mut [F]) {
    static SAME: Read = Read::Same;
    let n = dst.len();
    // An epilogue's operand 0 is `dst` as the head left it, overwritten by the program from
    // its first op on: any read of it after the first term is of a copy, taken now.
    let (saved, stack) = stack.split_at_mut(BLOCK);
    let head = matches!(args, Operands::Head(_));
    if head && e.terms.iter().enumerate().any(|(k, t)| k > 0 && *t == Term::Arg(0)) {
        saved[..n].copy_from_slice(dst);
    }
    let saved = &saved[..n];
    // Operand `i`: how the block reads it, its memory, and the index of the block's first
    // element in that memory's frame.
    let operand = |i: usize| -> (&Read, &[F], usize) {
        match args {
            Operands::All(a) => (&reads[i], a[i], start),
            Operands::Head(_) if i == 0 => (&SAME, saved, 0),
            Operands::Head(a) => (&reads[i], a[i - 1], start),
        }
    };
    let terms = &e.terms[..];
    let mut sp = 0;
    let mut k = 0;
    while k < terms.len() {
        let next = match terms.get(k + 1) {
            Some(&Term::Binary(op)) => Some(op),
            _ => None,
        };
        // An operand or a literal, then a binary op: applied to the top of the stack.
        if let (Some(op), true) = (next, sp >= 1) {
            let top = if sp == 1 { &mut *dst } else { &mut stack[(sp - 2) * BLOCK..][..n] };
            let done = match terms[k] {
                Term::Lit(v) => {
                    binary_assign(op, top, Src::Splat(F::from_f64(v)));
                    true
                }
                Term::Arg(i) => {
                    let (r, x, at) = operand(i);
                    // A `for` loop: a closure this large would be called, not inlined (see
                    // [`vectorized`]).
                    match Runs::new(r, x, at, n) {
                        Some(runs) => {
                            for (o, len, b) in runs {
                                binary_assign(op, &mut top[o..o + len], b);
                            }
                            true
                        }
                        None => false,
                    }
                }
                _ => false,
            };
            if done {
                k += 2;
                continue;
            }
        }
        // The first operand, an operand or a literal, and a binary op: into `dst` in one pass.
        if let (0, Term::Arg(i), Some(&Term::Binary(op))) = (sp, terms[k], terms.get(k + 2)) {
            let (r, x, at) = operand(i);
            let first = if head && i == 0 && k == 0 { None } else { Runs::new(r, x, at, n).and_then(Runs::whole) };
            let second = match terms[k + 1] {
                Term::Lit(v) => Some(Src::Splat(F::from_f64(v))),
                Term::Arg(j) => {
                    let (r, x, at) = operand(j);
                    Runs::new(r, x, at, n).and_then(Runs::whole)
                }
                _ => None,
            };
            if let (Some(a), Some(b)) = (first, second) {
                binary_into(op, dst, a, b);
                sp = 1;
                k += 3;
                continue;
            }
        }
        match terms[k] {
            Term::Arg(i) => {
                let slot = if sp == 0 { &mut *dst } else { &mut stack[(sp - 1) * BLOCK..][..n] };
                // An epilogue's output read first is already where it belongs.
                if !(head && i == 0 && k == 0) {
                    let (r, x, at) = operand(i);
                    gather(r, x, at, slot);
                }
                sp += 1;
            }
            Term::Lit(v) => {
                let slot = if sp == 0 { &mut *dst } else { &mut stack[(sp - 1) * BLOCK..][..n] };
                slot.fill(F::from_f64(v));
                sp += 1;
            }
            Term::Unary(u) => unary(u, if sp == 1 { &mut *dst } else { &mut stack[(sp - 2) * BLOCK..][..n] }),
            Term::Binary(op) => {
                if sp == 2 {
                    binary(op, dst, &stack[..n]);
                } else {
                    let (lo, hi) = stack.split_at_mut((sp - 2) * BLOCK);
                    binary(op, &mut lo[(sp - 3) * BLOCK..][..n], &hi[..n]);
                }
                sp -= 1;
            }
        }
        k += 1;
    }
    debug_assert_eq!(sp, 1, "a program leaves one value");
}

/// An operand's values for a block of output elements, piece by piece: `(offset in the
/// block, length, values)`, the values a slice of the operand's memory or one value for the
/// piece. Only reads whose pieces are long (a bias's rows, a per-row statistic broadcast
/// along rows of 16 or more) are read so; the others are gathered ([`gather`]).
struct Runs<'a, F> {
    x: &'a [F],
    kind: RunKind<'a>,
    /// The block's elements done, and its length.
    k: usize,
    n: usize,
    /// Where the next piece starts in `x` (`at`), and (strided reads) the multi-index of its
    /// element.
    od: Odometer,
}

enum RunKind<'a> {
    Same,
    Splat,
    Cycle(usize),
    Strided { out: &'a [usize], strides: &'a [usize] },
}

/// Pieces shorter than this are not worth a loop of their own.
const MIN_RUN: usize = 16;

impl<'a, F: Copy> Runs<'a, F> {
    /// The pieces of output elements `[start, start + n)` of operand `x` read as `r`, or `None`
    /// if they would be short.
    #[inline(always)]
    fn new(r: &'a Read, x: &'a [F], start: usize, n: usize) -> Option<Self> {
        let at = |at| Odometer { idx: [0; MAX_RANK], at };
        let (kind, od) = match r {
            Read::Same => (RunKind::Same, at(start)),
            Read::Splat => (RunKind::Splat, at(0)),
            Read::Cycle(m) if *m >= MIN_RUN => (RunKind::Cycle(*m), at(start % m)),
            Read::Strided { out, strides } if out.len() <= MAX_RANK && *out.last()? >= MIN_RUN && *strides.last()? <= 1 => {
                (RunKind::Strided { out, strides }, Odometer::new(out, strides, start))
            }
            _ => return None,
        };
        Some(Runs { x, kind, k: 0, n, od })
    }

    /// The block's values as one piece, when they are.
    #[inline(always)]
    fn whole(self) -> Option<Src<'a, F>> {
        match self.kind {
            RunKind::Same => Some(Src::Block(&self.x[self.od.at..self.od.at + self.n])),
            RunKind::Splat => Some(Src::Splat(self.x[0])),
            _ => None,
        }
    }
}

impl<'a, F: Copy> Iterator for Runs<'a, F> {
    type Item = (usize, usize, Src<'a, F>);
    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let (k, left) = (self.k, self.n - self.k);
        if left == 0 {
            return None;
        }
        let at = self.od.at;
        let (len, src) = match self.kind {
            RunKind::Same => (left, Src::Block(&self.x[at..at + left])),
            RunKind::Splat => (left, Src::Splat(self.x[0])),
            RunKind::Cycle(m) => {
                let len = (m - at).min(left);
                self.od.at = if at + len == m { 0 } else { at + len };
                (len, Src::Block(&self.x[at..at + len]))
            }
            RunKind::Strided { out, strides } => {
                let len = self.od.left(out).min(left);
                let src = if strides[out.len() - 1] == 0 { Src::Splat(self.x[at]) } else { Src::Block(&self.x[at..at + len]) };
                self.od.advance(out, strides, len);
                (len, src)
            }
        };
        self.k += len;
        Some((k, len, src))
    }
}

/// Reads output elements `[start, start + dst.len())`'s values of one operand.
#[inline(always)]
fn gather<F: HostFloat>(r: &Read, x: &[F], start: usize, dst: &mut [F]) {
    match r {
        Read::Same => dst.copy_from_slice(&x[start..start + dst.len()]),
        Read::Splat => dst.fill(x[0]),
        Read::Cycle(m) => {
            let mut j = start % m;
            for d in dst {
                *d = x[j];
                j += 1;
                if j == *m {
                    j = 0;
                }
            }
        }
        Read::Strided { out, strides } if out.len() <= MAX_RANK => strided_runs(out, strides, x, start, dst),
        Read::Strided { out, strides } => {
            for (k, d) in dst.iter_mut().enumerate() {
                let (mut i, mut at) = (start + k, 0);
                for a in (0..out.len()).rev() {
                    at += (i % out[a]) * strides[a];
                    i /= out[a];
                }
                *d = x[at];
            }
        }
    }
}

/// Ranks [`strided_runs`] keeps its index for.
const MAX_RANK: usize = 8;

/// [`Read::Strided`] by runs along the last axis: the multi-index of `start` is worked out
/// once, then advanced like an odometer (a per-channel operand of an NCHW output is a `fill`
/// per row instead of a division per axis per element).
#[inline(always)]
fn strided_runs<F: HostFloat>(out: &[usize], strides: &[usize], x: &[F], start: usize, dst: &mut [F]) {
    let mut od = Odometer::new(out, strides, start);
    let step = strides[out.len() - 1];
    let mut k = 0;
    while k < dst.len() {
        let run = od.left(out).min(dst.len() - k);
        let d = &mut dst[k..k + run];
        if step == 0 {
            d.fill(x[od.at]);
        } else {
            d.iter_mut().enumerate().for_each(|(j, v)| *v = x[od.at + j * step]);
        }
        k += run;
        od.advance(out, strides, run);
    }
}

/// A multi-index over output extents `out` and the element it reaches through `strides`
/// (`at`), moved along the last axis and carried into the axes before like an odometer.
#[derive(Clone, Copy)]
struct Odometer {
    idx: [usize; MAX_RANK],
    at: usize,
}

impl Odometer {
    /// At output element `start` (`out` has at most [`MAX_RANK`] axes).
    #[inline(always)]
    fn new(out: &[usize], strides: &[usize], start: usize) -> Self {
        let (mut idx, mut i, mut at) = ([0; MAX_RANK], start, 0);
        for a in (0..out.len()).rev() {
            idx[a] = i % out[a];
            at += idx[a] * strides[a];
            i /= out[a];
        }
        Odometer { idx, at }
    }
    /// Elements left along the last axis.
    #[inline(always)]
    fn left(&self, out: &[usize]) -> usize {
        let last = out.len() - 1;
        out[last] - self.idx[last]
    }
    /// `len` elements on along the last axis (at most [`Self::left`]).
    #[inline(always)]
    fn advance(&mut self, out: &[usize], strides: &[usize], len: usize) {
        let last = out.len() - 1;
        self.at += len * strides[last];
        self.idx[last] += len;
        let mut a = last;
        while a > 0 && self.idx[a] == out[a] {
            self.at -= out[a] * strides[a];
            self.idx[a] = 0;
            a -= 1;
            self.idx[a] += 1;
            self.at += strides[a];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::float::tests::{data, new};

    /// A fused program reading one operand of each kind (the output's extents, one element, a
    /// trailing bias, and two broadcasts that need strides), over several blocks and thread
    /// shares, against the same ops written out per element.
    #[test]
    fn fused_programs_read_every_broadcast_and_round_as_the_ops_do() {
        use cellgraph_compiler::{Op, TensorType};
        let expr: cellgraph_compiler::expr::Expr =
            "$0 $1 mul $2 add $3 sub relu $4 div $0 relu_grad 0.5 add exp log sqrt neg tanh erf".parse().unwrap();
        let dims: [&[usize]; 5] = [&[4, 100, 100], &[], &[100], &[100, 1], &[4, 1, 100]];
        let tys: Vec<TensorType> = dims.iter().map(|d| TensorType::f32(d.to_vec())).collect();
        let Some(crate::kernel::Native::Fused(e)) = crate::kernel::bind(&Op::Fused { expr }, &tys.iter().collect::<Vec<_>>()) else {
            panic!("fused binds")
        };
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

    /// Per-channel operands over 2 x 2 maps (runs of 4, repeating every image) are written
    /// out for one image and read as a cycle, with the values of the strided reads.
    #[test]
    fn short_periodic_reads_are_written_out_once_with_the_same_values() {
        use cellgraph_compiler::{Op, TensorType};
        let expr: cellgraph_compiler::expr::Expr = "$0 $1 sub $2 div $0 mul".parse().unwrap();
        let dims: [&[usize]; 3] = [&[40, 64, 2, 2], &[1, 64, 1, 1], &[64, 1, 1]];
        let tys: Vec<TensorType> = dims.iter().map(|d| TensorType::f32(d.to_vec())).collect();
        let Some(crate::kernel::Native::Fused(e)) = crate::kernel::bind(&Op::Fused { expr }, &tys.iter().collect::<Vec<_>>()) else {
            panic!("fused binds")
        };
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

    /// An epilogue's program runs in the output's own memory: its operand 0 (the head's
    /// output) read again after the program has started overwriting it, broadcasts read piece
    /// by piece across rows and blocks, and parts starting anywhere, against the ops written
    /// out per element.
    #[test]
    fn epilogue_programs_read_the_heads_output_as_it_was() {
        use cellgraph_compiler::{Op, TensorType};
        let expr: cellgraph_compiler::expr::Expr = "$0 $1 add $0 mul $2 sub 2.0 $0 mul $3 mul add".parse().unwrap();
        let dims: [&[usize]; 4] = [&[4, 100, 100], &[100], &[4, 100, 1], &[4, 1, 100]];
        let tys: Vec<TensorType> = dims.iter().map(|d| TensorType::f32(d.to_vec())).collect();
        let Some(crate::kernel::Native::Fused(e)) = crate::kernel::bind(&Op::Fused { expr }, &tys.iter().collect::<Vec<_>>()) else {
            panic!("fused binds")
        };
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

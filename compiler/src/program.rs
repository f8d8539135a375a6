//! Elementwise programs: the one format of a `fused` node's body, an epilogue's, and an
//! optimizer's per-element update.
//!
//! A [`Program`] is straight-line code in single-assignment form: each [`Step`] applies an
//! op to values ([`Val`]: an operand, a scalar input, a literal or an earlier step's result),
//! and [`Step::Write`] stores a value to an output. Everything that runs one reads this form:
//! the reference lowering on burn's ops, the host's interpreter and the devices' `#[cube]`
//! kernels, which unroll it when they are compiled.
//!
//! - **Elementwise** (fused nodes and epilogues): operands `$0, $1, ...` broadcast
//!   numpy-style as the unfused ops do, one output, written by the last step. The program is
//!   a tree whose steps come in postfix order (each result read once, by a later step, in the
//!   order a stack machine pops them), so its text is postfix: `$0 $1 add relu` is
//!   `relu($0 + $1)`. It computes per output element the same ops in the same order and
//!   precision as the nodes it replaced, so a fused plan gives the same bits.
//!   [`crate::passes::fuse`] builds these.
//! - **Updates** ([`crate::update`]): operand 0 is the parameter, 1 its gradient, `2 + k`
//!   its state `k`; scalar inputs (the learning rate first) are [`Val::Scalar`]; output 0 is
//!   the parameter and `1 + k` state `k`. Reads see the values before the update.

use std::fmt;
use std::str::FromStr;

use crate::infer::broadcast_shapes;
use crate::op::Op;
use crate::types::{DType, TensorType};

/// A one-operand elementwise op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    Neg,
    Exp,
    Log,
    Relu,
    Sqrt,
    Tanh,
    Erf,
    /// `round_to` bf16 (printed `round_bf16`).
    RoundBf16,
    /// `round_to` f16 (printed `round_f16`).
    RoundF16,
}

/// A two-operand elementwise op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    /// `dy * (y > 0)` over `(dy, y)` of equal extents.
    ReluGrad,
}

impl Unary {
    /// The unfused op.
    pub fn op(self) -> Op {
        match self {
            Unary::Neg => Op::Neg,
            Unary::Exp => Op::Exp,
            Unary::Log => Op::Log,
            Unary::Relu => Op::Relu,
            Unary::Sqrt => Op::Sqrt,
            Unary::Tanh => Op::Tanh,
            Unary::Erf => Op::Erf,
            Unary::RoundBf16 => Op::RoundTo { dtype: DType::BF16 },
            Unary::RoundF16 => Op::RoundTo { dtype: DType::F16 },
        }
    }

    /// The word a program prints for it: the op's name, the rounding's with its format.
    pub fn word(self) -> &'static str {
        match self {
            Unary::RoundBf16 => "round_bf16",
            Unary::RoundF16 => "round_f16",
            u => u.op().name(),
        }
    }
}

impl Binary {
    /// The unfused op.
    pub fn op(self) -> Op {
        match self {
            Binary::Add => Op::Add,
            Binary::Sub => Op::Sub,
            Binary::Mul => Op::Mul,
            Binary::Div => Op::Div,
            Binary::ReluGrad => Op::ReluGrad,
        }
    }
}

/// An op a program step can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementOp {
    Unary(Unary),
    Binary(Binary),
}

impl ElementOp {
    /// The step op computing `op`, for the elementwise ops a program can hold.
    pub fn of(op: &Op) -> Option<ElementOp> {
        Some(match op {
            Op::Neg => ElementOp::Unary(Unary::Neg),
            Op::Exp => ElementOp::Unary(Unary::Exp),
            Op::Log => ElementOp::Unary(Unary::Log),
            Op::Relu => ElementOp::Unary(Unary::Relu),
            Op::Sqrt => ElementOp::Unary(Unary::Sqrt),
            Op::Tanh => ElementOp::Unary(Unary::Tanh),
            Op::Erf => ElementOp::Unary(Unary::Erf),
            Op::RoundTo { dtype: DType::BF16 } => ElementOp::Unary(Unary::RoundBf16),
            Op::RoundTo { dtype: DType::F16 } => ElementOp::Unary(Unary::RoundF16),
            Op::Add => ElementOp::Binary(Binary::Add),
            Op::Sub => ElementOp::Binary(Binary::Sub),
            Op::Mul => ElementOp::Binary(Binary::Mul),
            Op::Div => ElementOp::Binary(Binary::Div),
            Op::ReluGrad => ElementOp::Binary(Binary::ReluGrad),
            _ => return None,
        })
    }

    /// The unfused op.
    pub fn op(self) -> Op {
        match self {
            ElementOp::Unary(u) => u.op(),
            ElementOp::Binary(b) => b.op(),
        }
    }

    /// The word a program prints for it.
    pub fn word(self) -> &'static str {
        match self {
            ElementOp::Unary(u) => u.word(),
            ElementOp::Binary(b) => b.op().name(),
        }
    }
}

/// A value a step reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Val {
    /// Operand `i`, at the output element.
    Arg(u8),
    /// Scalar input `i` (an update's learning rate and what depends on the update count).
    Scalar(u8),
    /// A literal, its f64 bits ([`Val::lit`]), rounded to the output's dtype where it is read
    /// (as a `constant` node is).
    Lit(u64),
    /// The result of step `i`.
    Let(u16),
}

impl Val {
    /// The literal `c`.
    pub fn lit(c: f64) -> Val {
        Val::Lit(c.to_bits())
    }

    /// A literal's value.
    pub fn literal(self) -> Option<f64> {
        match self {
            Val::Lit(bits) => Some(f64::from_bits(bits)),
            _ => None,
        }
    }

    /// True for an operand, a scalar input or a literal: a value no step computes.
    pub fn is_leaf(self) -> bool {
        !matches!(self, Val::Let(_))
    }
}

/// One step of a [`Program`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Unary(Unary, Val),
    Binary(Binary, Val, Val),
    /// Stores a value to output `i`; a write has no result.
    Write(u8, Val),
}

impl Step {
    /// The values the step reads, in order.
    pub fn reads(&self) -> impl Iterator<Item = Val> {
        let (a, b) = match *self {
            Step::Unary(_, x) | Step::Write(_, x) => (x, None),
            Step::Binary(_, a, b) => (a, Some(b)),
        };
        std::iter::once(a).chain(b)
    }

    /// Its op (`None` for a write).
    pub fn op(&self) -> Option<ElementOp> {
        match *self {
            Step::Unary(u, _) => Some(ElementOp::Unary(u)),
            Step::Binary(b, ..) => Some(ElementOp::Binary(b)),
            Step::Write(..) => None,
        }
    }
}

/// A program; built with its methods, parsed from postfix text, or made by the passes.
///
/// ```
/// use cellgraph_compiler::program::{Program, Val};
/// // relu($0 + $1)
/// let mut p = Program::new();
/// let s = p.add(Val::Arg(0), Val::Arg(1));
/// let r = p.relu(s);
/// p.write(0, r);
/// assert_eq!(p.to_string(), "$0 $1 add relu");
/// assert_eq!(p, "$0 $1 add relu".parse().unwrap());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Program {
    steps: Vec<Step>,
}

impl Program {
    /// An empty program.
    pub fn new() -> Program {
        Program::default()
    }

    /// The steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    fn push(&mut self, s: Step) -> Val {
        self.steps.push(s);
        Val::Let(u16::try_from(self.steps.len() - 1).expect("a program of at most 65,536 steps"))
    }
    pub fn unary(&mut self, op: Unary, x: Val) -> Val {
        self.push(Step::Unary(op, x))
    }
    pub fn binary(&mut self, op: Binary, a: Val, b: Val) -> Val {
        self.push(Step::Binary(op, a, b))
    }
    /// `op` over `xs` (one value for a unary op, two for a binary one).
    pub fn apply(&mut self, op: ElementOp, xs: &[Val]) -> Val {
        match (op, xs) {
            (ElementOp::Unary(u), &[x]) => self.unary(u, x),
            (ElementOp::Binary(b), &[x, y]) => self.binary(b, x, y),
            _ => panic!("{op:?} over {} values", xs.len()),
        }
    }
    pub fn add(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Add, a, b)
    }
    pub fn sub(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Sub, a, b)
    }
    pub fn mul(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Mul, a, b)
    }
    pub fn div(&mut self, a: Val, b: Val) -> Val {
        self.binary(Binary::Div, a, b)
    }
    pub fn sqrt(&mut self, x: Val) -> Val {
        self.unary(Unary::Sqrt, x)
    }
    pub fn relu(&mut self, x: Val) -> Val {
        self.unary(Unary::Relu, x)
    }
    /// `x * c`.
    pub fn scale(&mut self, x: Val, c: f64) -> Val {
        self.mul(x, Val::lit(c))
    }
    /// Stores `v` to output `out`.
    pub fn write(&mut self, out: u8, v: Val) {
        self.steps.push(Step::Write(out, v));
    }

    /// `op` over operands `$0 .. $(arity - 1)`: one unfused elementwise op as a program.
    pub fn of_op(op: &Op, arity: usize) -> Option<Program> {
        let op = ElementOp::of(op)?;
        let mut p = Program::new();
        let xs: Vec<Val> = (0..arity).map(|i| Val::Arg(i as u8)).collect();
        let r = p.apply(op, &xs);
        p.write(0, r);
        Some(p)
    }

    /// The value an elementwise program writes to its output (the value of its last step, a
    /// write to output 0).
    pub fn result(&self) -> Val {
        match self.steps.last() {
            Some(&Step::Write(0, v)) => v,
            _ => panic!("an elementwise program ends with its write: {self:?}"),
        }
    }

    /// Number of op steps (what a fused node replaced).
    pub fn ops(&self) -> usize {
        self.steps.iter().filter(|s| s.op().is_some()).count()
    }

    /// Number of terms of its postfix text: the ops, and every operand and literal read.
    pub fn terms(&self) -> usize {
        self.steps.iter().map(|s| usize::from(s.op().is_some()) + s.reads().filter(|v| v.is_leaf()).count()).sum::<usize>()
    }

    /// The most values a stack machine running an elementwise program's postfix text holds
    /// at once (operands and literals pushed before the op that reads them).
    pub fn depth(&self) -> usize {
        fn walk(p: &Program, v: Val, sp: &mut usize, depth: &mut usize) {
            if let Val::Let(k) = v {
                let s = p.steps[k as usize];
                s.reads().for_each(|x| walk(p, x, sp, depth));
                *sp -= s.reads().count();
            }
            *sp += 1;
            *depth = (*depth).max(*sp);
        }
        let (mut sp, mut depth) = (0, 0);
        walk(self, self.result(), &mut sp, &mut depth);
        depth
    }

    /// Appends the steps computing value `v` of `self` to `out`, its operands read through
    /// `arg` (which may append steps of its own), in postfix order; returns `v`'s value in
    /// `out`. A step read twice is computed twice.
    pub fn rebuild(&self, v: Val, out: &mut Program, arg: &mut dyn FnMut(u8, &mut Program) -> Val) -> Val {
        match v {
            Val::Arg(i) => arg(i, out),
            Val::Let(k) => match self.steps[k as usize] {
                Step::Unary(op, x) => {
                    let x = self.rebuild(x, out, arg);
                    out.unary(op, x)
                }
                Step::Binary(op, a, b) => {
                    let a = self.rebuild(a, out, arg);
                    let b = self.rebuild(b, out, arg);
                    out.binary(op, a, b)
                }
                Step::Write(..) => unreachable!("checked: a step reads results"),
            },
            leaf => leaf,
        }
    }

    /// Checks the form every program has: each step reads results of earlier op steps, and
    /// each output is written at most once.
    pub fn check_form(&self) -> Result<(), String> {
        let mut written = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            for v in s.reads() {
                if let Val::Let(k) = v {
                    if k as usize >= i || self.steps[k as usize].op().is_none() {
                        return Err(format!("step {i} reads step {k}, which is not an earlier value"));
                    }
                }
            }
            if let Step::Write(o, _) = *s {
                if written.contains(&o) {
                    return Err(format!("step {i} writes output {o} a second time"));
                }
                written.push(o);
            }
        }
        Ok(())
    }

    /// Checks an elementwise program: one write, of output 0, at the end; no scalar inputs;
    /// a tree in postfix order (each result read once, by a later step, as a stack machine
    /// pops it).
    pub fn check_elementwise(&self) -> Result<(), String> {
        self.check_form()?;
        let mut stack: Vec<u16> = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            if let Some(v) = s.reads().find(|v| matches!(v, Val::Scalar(_))) {
                return Err(format!("step {i} reads {v:?}: an elementwise program has no scalar inputs"));
            }
            let lets: Vec<u16> = s.reads().filter_map(|v| if let Val::Let(k) = v { Some(k) } else { None }).collect();
            if stack.len() < lets.len() || stack[stack.len() - lets.len()..] != lets[..] {
                return Err(format!("step {i} reads {lets:?} out of postfix order (live: {stack:?})"));
            }
            stack.truncate(stack.len() - lets.len());
            match s {
                Step::Write(0, _) if i + 1 == self.steps.len() => {}
                Step::Write(..) => return Err(format!("step {i}: an elementwise program writes output 0 once, at its end")),
                _ => stack.push(i as u16),
            }
        }
        if !matches!(self.steps.last(), Some(Step::Write(0, _))) {
            return Err("an elementwise program ends with its write to output 0".into());
        }
        if !stack.is_empty() {
            return Err(format!("steps {stack:?} compute values nothing reads"));
        }
        Ok(())
    }

    /// The output type of an elementwise program over operands of types `xs`: every operand
    /// used, one float dtype, and every op's operands fitting as they would unfused (binary
    /// ops broadcast, `relu_grad` needs equal extents).
    pub fn infer(&self, xs: &[&TensorType]) -> Result<TensorType, String> {
        self.check_elementwise()?;
        let Some(first) = xs.first() else { return Err("a fused node needs at least one operand".into()) };
        if !first.dtype.is_float() || xs.iter().any(|x| x.dtype != first.dtype) {
            let list: Vec<String> = xs.iter().map(|t| t.to_string()).collect();
            return Err(format!("operands must share one float dtype, got {}", list.join(", ")));
        }
        let mut used = vec![false; xs.len()];
        let mut lets: Vec<Vec<usize>> = Vec::with_capacity(self.steps.len());
        let mut dims = |v: Val, lets: &[Vec<usize>]| -> Result<Vec<usize>, String> {
            Ok(match v {
                Val::Arg(i) => {
                    let x = xs.get(i as usize).ok_or_else(|| format!("`${i}` names no operand: the node has {}", xs.len()))?;
                    used[i as usize] = true;
                    x.dims().to_vec()
                }
                Val::Let(k) => lets[k as usize].clone(),
                Val::Lit(_) | Val::Scalar(_) => vec![],
            })
        };
        let mut out = vec![];
        for s in &self.steps {
            let d = match *s {
                Step::Unary(_, x) => dims(x, &lets)?,
                Step::Binary(b, x, y) => {
                    let (x, y) = (dims(x, &lets)?, dims(y, &lets)?);
                    let s = match b {
                        Binary::ReluGrad if x != y => None,
                        _ => broadcast_shapes(&x, &y),
                    };
                    s.ok_or_else(|| format!("`{}` cannot combine extents {x:?} and {y:?}", b.op().name()))?
                }
                Step::Write(_, v) => {
                    out = dims(v, &lets)?;
                    vec![]
                }
            };
            lets.push(d);
        }
        if let Some(i) = used.iter().position(|u| !u) {
            return Err(format!("operand {i} is never read (`${i}` is missing)"));
        }
        Ok(TensorType::new(first.dtype, out))
    }

    /// Writes the postfix text of value `v` (after a space unless `first`).
    fn postfix(&self, v: Val, f: &mut fmt::Formatter<'_>, first: &mut bool) -> fmt::Result {
        if let Val::Let(k) = v {
            let s = self.steps[k as usize];
            for x in s.reads() {
                self.postfix(x, f, first)?;
            }
        }
        f.write_str(if std::mem::take(first) { "" } else { " " })?;
        match v {
            Val::Arg(i) => write!(f, "${i}"),
            Val::Scalar(i) => write!(f, "%{i}"),
            Val::Lit(bits) => write!(f, "{:?}", f64::from_bits(bits)),
            Val::Let(k) => f.write_str(self.steps[k as usize].op().expect("a result").word()),
        }
    }
}

/// An elementwise program prints as postfix text (`$0 $1 add relu`); any other program as its
/// steps, one per line.
impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.check_elementwise().is_ok() {
            return self.postfix(self.result(), f, &mut true);
        }
        for (i, s) in self.steps.iter().enumerate() {
            writeln!(f, "{i}: {s:?}")?;
        }
        Ok(())
    }
}

/// Parses postfix text: `$i` reads operand `i`, a number is a literal, an op's name applies it
/// to the values before it.
impl FromStr for Program {
    type Err = String;

    fn from_str(s: &str) -> Result<Program, String> {
        let mut p = Program::new();
        let mut stack: Vec<Val> = Vec::new();
        for (i, w) in s.split_whitespace().enumerate() {
            if let Some(k) = w.strip_prefix('$') {
                let k = k.parse().map_err(|_| format!("`{w}`: an operand is `$` and its index (at most 255)"))?;
                stack.push(Val::Arg(k));
                continue;
            }
            if let Ok(v) = w.parse::<f64>() {
                stack.push(Val::lit(v));
                continue;
            }
            let op = match w {
                "round_bf16" => ElementOp::Unary(Unary::RoundBf16),
                "round_f16" => ElementOp::Unary(Unary::RoundF16),
                _ => {
                    let op = Op::from_parts(w, Default::default()).ok();
                    op.as_ref().and_then(ElementOp::of).ok_or_else(|| format!("`{w}` is not an operand, a number or an elementwise op"))?
                }
            };
            let n = if matches!(op, ElementOp::Unary(_)) { 1 } else { 2 };
            let at = stack.len().checked_sub(n).ok_or_else(|| format!("term {i} needs {n} values, the stack holds {}", stack.len()))?;
            let xs = stack.split_off(at);
            stack.push(p.apply(op, &xs));
        }
        match stack[..] {
            [v] => p.write(0, v),
            _ => return Err(format!("a program must leave one value, this one leaves {}", stack.len())),
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_print_and_parse_back() {
        for s in [
            "$0 $1 add relu",
            "$0 0.9 mul $1 $2 mul add",
            "$0 $1 $2 mul sub",
            "$0 -0.125 div neg exp log sqrt $0 relu_grad",
            "$0 round_bf16 $1 round_f16 mul",
            "$0",
        ] {
            let p: Program = s.parse().unwrap();
            assert_eq!(p.to_string(), s);
            assert_eq!(p.check_elementwise(), Ok(()));
        }
        let p: Program = "$0 $1 $2 mul sub".parse().unwrap();
        use {Step as S, Val as V};
        assert_eq!(p.steps(), [S::Binary(Binary::Mul, V::Arg(1), V::Arg(2)), S::Binary(Binary::Sub, V::Arg(0), V::Let(0)), S::Write(0, V::Let(1))]);
        // `$0 $1 add relu` holds two values; `$0` pushed below `$1 $2 mul` makes three.
        assert_eq!(("$0 $1 add relu".parse::<Program>().unwrap().depth(), p.depth()), (2, 3));
        assert_eq!((p.ops(), p.terms()), (2, 5));
    }

    #[test]
    fn malformed_programs_say_what_is_wrong() {
        assert!("$0 add".parse::<Program>().unwrap_err().contains("needs 2 values"));
        assert!("$0 $1".parse::<Program>().unwrap_err().contains("leaves 2"));
        assert!("$0 frob".parse::<Program>().unwrap_err().contains("`frob`"));
        assert!("$0 matmul".parse::<Program>().unwrap_err().contains("elementwise"));
        let e: Program = "$0 $2 add".parse().unwrap();
        let t = TensorType::f32(vec![2]);
        assert!(e.infer(&[&t, &t, &t]).unwrap_err().contains("operand 1 is never read"));
        assert!(e.infer(&[&t, &t]).unwrap_err().contains("`$2` names no operand"));
        // A result read twice, or out of postfix order, is not an elementwise program.
        let mut p = Program::new();
        let a = p.add(Val::Arg(0), Val::Arg(1));
        let b = p.mul(a, a);
        p.write(0, b);
        assert!(p.infer(&[&t, &t]).unwrap_err().contains("postfix order"));
        let mut p = Program::new();
        let a = p.relu(Val::Arg(0));
        let b = p.relu(Val::Arg(1));
        let c = p.sub(b, a);
        p.write(0, c);
        assert!(p.check_elementwise().unwrap_err().contains("postfix order"));
        let mut p = Program::new();
        let a = p.relu(Val::Arg(0));
        p.write(0, a);
        p.write(1, a);
        assert!(p.check_elementwise().unwrap_err().contains("once, at its end"));
    }

    #[test]
    fn types_follow_the_unfused_ops() {
        let (a, b) = (TensorType::f32(vec![8, 120]), TensorType::f32(vec![120]));
        let e: Program = "$0 $1 add relu".parse().unwrap();
        assert_eq!(e.infer(&[&a, &b]).unwrap(), a);
        let g: Program = "$0 $1 relu_grad".parse().unwrap();
        assert!(g.infer(&[&a, &b]).unwrap_err().contains("relu_grad"));
        let i = TensorType::new(crate::types::DType::I32, vec![120]);
        assert!(e.infer(&[&a, &i]).unwrap_err().contains("one float dtype"));
        let lit: Program = "0.5 $0 mul".parse().unwrap();
        assert_eq!(lit.infer(&[&b]).unwrap(), b);
    }

    /// Rebuilding splices programs into each other in postfix order: `$1` of `$0 $1 sub`
    /// replaced by `$0 $1 mul` over other operands, the others renumbered.
    #[test]
    fn rebuilding_splices_operands_in_postfix_order() {
        let outer: Program = "$0 $1 sub relu".parse().unwrap();
        let inner: Program = "$0 $1 mul".parse().unwrap();
        let mut out = Program::new();
        let v = outer.rebuild(outer.result(), &mut out, &mut |i, out| match i {
            0 => Val::Arg(2),
            _ => inner.rebuild(inner.result(), out, &mut |j, _| if j == 0 { Val::Arg(0) } else { Val::lit(2.0) }),
        });
        out.write(0, v);
        assert_eq!(out.to_string(), "$2 $0 2.0 mul sub relu");
        assert_eq!(out, "$2 $0 2.0 mul sub relu".parse().unwrap());
    }
}

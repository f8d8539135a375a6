//! The body of a `fused` node: a postfix program over the node's operands.
//!
//! `$0 $1 add relu` is `relu($0 + $1)`. `$i` pushes operand `i`, a number pushes a literal,
//! and an op pops its operands and pushes its result. Binary ops broadcast numpy-style, as
//! the unfused ops do. A program computes, per output element, the same ops in the same order
//! and precision as the nodes it replaced, so a fused plan gives the same bits.
//!
//! [`crate::passes::fuse`] builds these; the text format prints them as the `expr` attribute.

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

/// One term of a program.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Term {
    /// Pushes operand `i`.
    Arg(usize),
    /// Pushes a literal, rounded to the node's dtype (as a `constant` node is).
    Lit(f64),
    Unary(Unary),
    Binary(Binary),
}

impl Term {
    /// The term computing `op`, for the elementwise ops a program can hold.
    pub fn of(op: &Op) -> Option<Term> {
        Some(match op {
            Op::Neg => Term::Unary(Unary::Neg),
            Op::Exp => Term::Unary(Unary::Exp),
            Op::Log => Term::Unary(Unary::Log),
            Op::Relu => Term::Unary(Unary::Relu),
            Op::Sqrt => Term::Unary(Unary::Sqrt),
            Op::Tanh => Term::Unary(Unary::Tanh),
            Op::Erf => Term::Unary(Unary::Erf),
            Op::RoundTo { dtype: DType::BF16 } => Term::Unary(Unary::RoundBf16),
            Op::RoundTo { dtype: DType::F16 } => Term::Unary(Unary::RoundF16),
            Op::Add => Term::Binary(Binary::Add),
            Op::Sub => Term::Binary(Binary::Sub),
            Op::Mul => Term::Binary(Binary::Mul),
            Op::Div => Term::Binary(Binary::Div),
            Op::ReluGrad => Term::Binary(Binary::ReluGrad),
            _ => return None,
        })
    }

    /// The unfused op an op term computes (`None` for operands and literals).
    pub fn op(self) -> Option<Op> {
        match self {
            Term::Unary(u) => Some(u.op()),
            Term::Binary(b) => Some(b.op()),
            Term::Arg(_) | Term::Lit(_) => None,
        }
    }

    /// `(popped, pushed)` stack slots.
    fn arity(self) -> (usize, usize) {
        match self {
            Term::Arg(_) | Term::Lit(_) => (0, 1),
            Term::Unary(_) => (1, 1),
            Term::Binary(_) => (2, 1),
        }
    }
}

/// A well-formed program: every op finds its operands, and one value is left.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    terms: Vec<Term>,
    depth: usize,
}

impl Expr {
    /// Checks the stack discipline of `terms`.
    pub fn new(terms: Vec<Term>) -> Result<Expr, String> {
        let (mut sp, mut depth) = (0usize, 0usize);
        for (i, t) in terms.iter().enumerate() {
            let (pop, push) = t.arity();
            sp = sp.checked_sub(pop).ok_or_else(|| format!("term {i} needs {pop} values, the stack holds {sp}"))? + push;
            depth = depth.max(sp);
        }
        if sp != 1 {
            return Err(format!("a program must leave one value, this one leaves {sp}"));
        }
        Ok(Expr { terms, depth })
    }

    /// The terms, in order.
    pub fn terms(&self) -> &[Term] {
        &self.terms
    }

    /// The most values on the stack at once.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Number of op terms (what the fused node replaced).
    pub fn ops(&self) -> usize {
        self.terms.iter().filter(|t| matches!(t, Term::Unary(_) | Term::Binary(_))).count()
    }

    /// The output type over operands of types `xs`: every operand used, one float dtype, and
    /// every op's operands fitting as they would unfused (binary ops broadcast, `relu_grad`
    /// needs equal extents).
    pub fn infer(&self, xs: &[&TensorType]) -> Result<TensorType, String> {
        let Some(first) = xs.first() else { return Err("a fused node needs at least one operand".into()) };
        if !first.dtype.is_float() || xs.iter().any(|x| x.dtype != first.dtype) {
            let list: Vec<String> = xs.iter().map(|t| t.to_string()).collect();
            return Err(format!("operands must share one float dtype, got {}", list.join(", ")));
        }
        let mut used = vec![false; xs.len()];
        let mut stack: Vec<Vec<usize>> = Vec::with_capacity(self.depth);
        for t in &self.terms {
            match *t {
                Term::Arg(i) => {
                    let x = xs.get(i).ok_or_else(|| format!("`${i}` names no operand: the node has {}", xs.len()))?;
                    used[i] = true;
                    stack.push(x.dims().to_vec());
                }
                Term::Lit(_) => stack.push(vec![]),
                Term::Unary(_) => {}
                Term::Binary(b) => {
                    let (y, x) = (stack.pop().expect("checked by new"), stack.pop().expect("checked by new"));
                    let s = match b {
                        Binary::ReluGrad if x != y => None,
                        _ => broadcast_shapes(&x, &y),
                    };
                    stack.push(s.ok_or_else(|| format!("`{}` cannot combine extents {x:?} and {y:?}", Term::Binary(b)))?);
                }
            }
        }
        if let Some(i) = used.iter().position(|u| !u) {
            return Err(format!("operand {i} is never read (`${i}` is missing)"));
        }
        Ok(TensorType::new(first.dtype, stack.pop().expect("checked by new")))
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Term::Arg(i) => write!(f, "${i}"),
            Term::Lit(v) => write!(f, "{v:?}"),
            Term::Unary(u) => f.write_str(u.word()),
            op => f.write_str(op.op().expect("an op term").name()),
        }
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, t) in self.terms.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{t}")?;
        }
        Ok(())
    }
}

impl FromStr for Expr {
    type Err = String;

    fn from_str(s: &str) -> Result<Expr, String> {
        let term = |w: &str| -> Result<Term, String> {
            if let Some(i) = w.strip_prefix('$') {
                return i.parse().map(Term::Arg).map_err(|_| format!("`{w}`: an operand is `$` and its index"));
            }
            if let Ok(v) = w.parse::<f64>() {
                return Ok(Term::Lit(v));
            }
            match w {
                "round_bf16" => return Ok(Term::Unary(Unary::RoundBf16)),
                "round_f16" => return Ok(Term::Unary(Unary::RoundF16)),
                _ => {}
            }
            let op = Op::from_parts(w, Default::default()).ok();
            op.as_ref().and_then(Term::of).ok_or_else(|| format!("`{w}` is not an operand, a number or an elementwise op"))
        };
        Expr::new(s.split_whitespace().map(term).collect::<Result<_, _>>()?)
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
        ] {
            let e: Expr = s.parse().unwrap();
            assert_eq!(e.to_string(), s);
        }
        assert_eq!("$0 $1 add relu".parse::<Expr>().unwrap().depth(), 2);
    }

    #[test]
    fn malformed_programs_say_what_is_wrong() {
        assert!("$0 add".parse::<Expr>().unwrap_err().contains("needs 2 values"));
        assert!("$0 $1".parse::<Expr>().unwrap_err().contains("leaves 2"));
        assert!("$0 frob".parse::<Expr>().unwrap_err().contains("`frob`"));
        assert!("$0 matmul".parse::<Expr>().unwrap_err().contains("elementwise"));
        let e: Expr = "$0 $2 add".parse().unwrap();
        let t = TensorType::f32(vec![2]);
        assert!(e.infer(&[&t, &t, &t]).unwrap_err().contains("operand 1 is never read"));
        assert!(e.infer(&[&t, &t]).unwrap_err().contains("`$2` names no operand"));
    }

    #[test]
    fn types_follow_the_unfused_ops() {
        let (a, b) = (TensorType::f32(vec![8, 120]), TensorType::f32(vec![120]));
        let e: Expr = "$0 $1 add relu".parse().unwrap();
        assert_eq!(e.infer(&[&a, &b]).unwrap(), a);
        let g: Expr = "$0 $1 relu_grad".parse().unwrap();
        assert!(g.infer(&[&a, &b]).unwrap_err().contains("relu_grad"));
        let i = TensorType::new(crate::types::DType::I32, vec![120]);
        assert!(e.infer(&[&a, &i]).unwrap_err().contains("one float dtype"));
    }
}

//! The text format, reading side: the inverse of [`crate::print`].
//!
//! `parse(&print(g)) == g` for every graph. Errors carry a 1-based line and column. The
//! parser checks syntax and names (values defined before use, known ops and attributes);
//! type consistency is the verifier's job, so a hand-edited dump can be parsed and then
//! verified with every error listed.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::graph::{Graph, NodeId};
use crate::op::{Attr, Op};
use crate::types::{DType, Shape, TensorType};

/// Text that is not a valid graph, with its position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}: {}", self.line, self.col, self.message)
    }
}

impl std::error::Error for ParseError {}

type PResult<T> = Result<T, ParseError>;

/// A cursor over one line.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
    line: usize,
}

impl<'a> Cursor<'a> {
    fn err<T>(&self, message: impl Into<String>) -> PResult<T> {
        let col = self.s[..self.pos].chars().count() + 1;
        Err(ParseError { line: self.line, col, message: message.into() })
    }
    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }
    fn skip_ws(&mut self) {
        let r = self.rest();
        self.pos += r.len() - r.trim_start().len();
    }
    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.rest().chars().next()
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += c.len_utf8();
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: char) -> PResult<()> {
        if self.eat(c) {
            Ok(())
        } else {
            let found = self.peek().map_or("end of line".to_string(), |c| format!("`{c}`"));
            self.err(format!("expected `{c}`, found {found}"))
        }
    }
    fn word(&mut self) -> PResult<&'a str> {
        self.skip_ws();
        let r = self.rest();
        let n = r.find(|c: char| !(c.is_alphanumeric() || "_.-+".contains(c))).unwrap_or(r.len());
        if n == 0 {
            return self.err("expected a name");
        }
        self.pos += n;
        Ok(&r[..n])
    }
    fn uint(&mut self) -> PResult<u64> {
        let w = self.word()?;
        w.parse().or_else(|_| {
            self.pos -= w.len();
            self.err(format!("expected a non-negative integer, found `{w}`"))
        })
    }
    fn at_end(&mut self) -> bool {
        self.peek().is_none()
    }
}

fn value_id(c: &mut Cursor, names: &HashMap<u64, NodeId>) -> PResult<NodeId> {
    c.expect('%')?;
    let start = c.pos;
    let n = c.uint()?;
    match names.get(&n) {
        Some(&id) => Ok(id),
        None => {
            c.pos = start - 1;
            c.err(format!("use of undefined value %{n}"))
        }
    }
}

fn tensor_type(c: &mut Cursor) -> PResult<TensorType> {
    c.skip_ws();
    let start = c.pos;
    let r = c.rest();
    let n = r.find('[').unwrap_or(r.len());
    let Some(dtype) = DType::from_name(r[..n].trim()) else {
        return c.err(format!("expected a dtype (f32, f16, bf16, i32, i64, bool), found `{}`", r[..n].trim()));
    };
    c.pos = start + n;
    c.expect('[')?;
    let mut dims = Vec::new();
    if !c.eat(']') {
        loop {
            dims.push(c.uint()? as usize);
            if c.eat(']') {
                break;
            }
            if !c.eat(',') {
                let found = c.peek().map_or("end of line".to_string(), |ch| format!("`{ch}`"));
                return c.err(format!("expected `,` or `]` in the shape, found {found}"));
            }
        }
    }
    Ok(TensorType::new(dtype, Shape(dims)))
}

fn string_lit(c: &mut Cursor) -> PResult<String> {
    c.skip_ws();
    let open = c.pos;
    c.expect('"')?;
    let mut out = String::new();
    let mut chars = c.rest().char_indices();
    while let Some((i, ch)) = chars.next() {
        match ch {
            '"' => {
                c.pos += i + 1;
                return Ok(out);
            }
            '\\' => match chars.next() {
                Some((_, '"')) => out.push('"'),
                Some((_, '\\')) => out.push('\\'),
                Some((_, 'n')) => out.push('\n'),
                Some((_, 't')) => out.push('\t'),
                _ => {
                    c.pos += i;
                    return c.err("unsupported escape in string");
                }
            },
            ch => out.push(ch),
        }
    }
    c.pos = open;
    c.err("unterminated string")
}

fn attr_value(c: &mut Cursor) -> PResult<Attr> {
    match c.peek() {
        Some('"') => Ok(Attr::Str(string_lit(c)?)),
        Some('[') => {
            c.expect('[')?;
            let mut v = Vec::new();
            if !c.eat(']') {
                loop {
                    let w = c.word()?;
                    v.push(w.parse::<i64>().or_else(|_| c.err(format!("expected an integer, found `{w}`")))?);
                    if c.eat(']') {
                        break;
                    }
                    c.expect(',')?;
                }
            }
            Ok(Attr::Ints(v))
        }
        _ => {
            let start = c.pos;
            let w = c.word()?;
            if w == "true" || w == "false" {
                return Ok(Attr::Bool(w == "true"));
            }
            if let Ok(i) = w.parse::<i64>() {
                return Ok(Attr::Int(i));
            }
            let numeric = w.starts_with(|ch: char| ch.is_ascii_digit() || ch == '-' || ch == '+') || matches!(w, "inf" | "NaN");
            if numeric {
                return w.parse::<f64>().map(Attr::Float).or_else(|_| {
                    c.pos = start;
                    c.skip_ws();
                    c.err(format!("malformed number `{w}`"))
                });
            }
            Ok(Attr::Sym(w.to_string()))
        }
    }
}

fn attrs(c: &mut Cursor) -> PResult<BTreeMap<String, Attr>> {
    let mut m = BTreeMap::new();
    if !c.eat('{') {
        return Ok(m);
    }
    if c.eat('}') {
        return Ok(m);
    }
    loop {
        c.skip_ws();
        let key_pos = c.pos;
        let k = c.word()?.to_string();
        c.expect('=')?;
        let v = attr_value(c)?;
        if m.insert(k.clone(), v).is_some() {
            c.pos = key_pos;
            return c.err(format!("attribute `{k}` given twice"));
        }
        if c.eat('}') {
            return Ok(m);
        }
        c.expect(',')?;
    }
}

/// One parsed equation, added to the graph when the graph closes (so ids keep the text's).
struct Equation {
    id: u32,
    op: Op,
    operands: Vec<NodeId>,
    ty: TensorType,
    scope: String,
}

/// The largest value id a dump may use (ids are allocated densely, holes included).
const MAX_ID: u64 = 1 << 24;

/// Builds the graph with every value at the id the text gave it: nodes are added in id
/// order, holes filled by placeholders that are removed at the end (the graph keeps them as
/// vacant ids, as after dead-code elimination).
fn build(g: &mut Graph, mut eqs: Vec<Equation>) {
    eqs.sort_by_key(|e| e.id);
    let mut holes = Vec::new();
    let mut next = 0u32;
    for e in &eqs {
        while next < e.id {
            holes.push(g.add_unchecked(Op::Constant { value: 0.0 }, &[], TensorType::f32(crate::types::Shape::scalar()), ""));
            next += 1;
        }
        let id = g.add_unchecked(e.op.clone(), &[], e.ty.clone(), &e.scope);
        debug_assert_eq!(id, NodeId(e.id));
        next += 1;
    }
    for e in &eqs {
        g.connect(NodeId(e.id), &e.operands);
    }
    for h in holes {
        g.remove(h);
    }
}

/// Parses one equation line.
fn equation(c: &mut Cursor, eqs: &mut Vec<Equation>, names: &mut HashMap<u64, NodeId>) -> PResult<()> {
    c.expect('%')?;
    let def_pos = c.pos - 1;
    let n = c.uint()?;
    if names.contains_key(&n) {
        c.pos = def_pos;
        return c.err(format!("value %{n} is defined twice"));
    }
    if n >= MAX_ID {
        c.pos = def_pos;
        return c.err(format!("value id %{n} is too large (ids below {MAX_ID})"));
    }
    c.expect(':')?;
    let ty = tensor_type(c)?;
    c.expect('=')?;
    c.skip_ws();
    let op_pos = c.pos;
    let op_name = c.word()?;
    let mut operands = Vec::new();
    if c.eat('(') && !c.eat(')') {
        loop {
            operands.push(value_id(c, names)?);
            if c.eat(')') {
                break;
            }
            c.expect(',')?;
        }
    }
    let a = attrs(c)?;
    let op = Op::from_parts(op_name, a).or_else(|m| {
        c.pos = op_pos;
        c.err(m)
    })?;
    if !op.arity().accepts(operands.len()) {
        c.pos = op_pos;
        return c.err(format!("`{op_name}` takes {} operands, got {}", op.arity(), operands.len()));
    }
    let scope = if c.eat('#') { c.rest().trim().to_string() } else { String::new() };
    if scope.is_empty() && !c.at_end() {
        return c.err(format!("unexpected `{}` after the equation", c.rest().trim()));
    }
    names.insert(n, NodeId(n as u32));
    eqs.push(Equation { id: n as u32, op, operands, ty, scope });
    Ok(())
}

/// A graph being read: the graph, its names, whether its `return` was seen, its equations.
type Reading = (Graph, HashMap<u64, NodeId>, bool, Vec<Equation>);

/// Parses every graph in the text (a file may hold several, separated by blank lines).
pub fn parse_many(text: &str) -> Result<Vec<Graph>, ParseError> {
    let mut graphs = Vec::new();
    let mut current: Option<Reading> = None;
    let mut last_line = 0;
    for (i, raw) in text.lines().enumerate() {
        last_line = i + 1;
        let mut c = Cursor { s: raw, pos: 0, line: i + 1 };
        if c.at_end() || c.rest().starts_with(';') {
            continue;
        }
        match current.as_mut() {
            None => {
                if c.word()? != "graph" {
                    c.pos = 0;
                    return c.err("expected `graph NAME {`");
                }
                let name = c.word()?.to_string();
                c.expect('{')?;
                if !c.at_end() {
                    return c.err("expected end of line after `{`");
                }
                current = Some((Graph::new(name), HashMap::new(), false, Vec::new()));
            }
            Some((g, names, returned, eqs)) => {
                if c.eat('}') {
                    if !*returned {
                        c.pos -= 1;
                        return c.err(format!("graph `{}` ends without `return`", g.name));
                    }
                    let (mut g, _, _, eqs) = current.take().unwrap();
                    build(&mut g, eqs);
                    graphs.push(g);
                } else if *returned {
                    return c.err("expected `}` after `return`");
                } else if c.rest().trim_start().starts_with("return") {
                    c.word()?;
                    let mut outs = Vec::new();
                    while !c.at_end() {
                        outs.push(value_id(&mut c, names)?);
                        if !c.at_end() {
                            c.expect(',')?;
                        }
                    }
                    g.set_outputs(outs);
                    *returned = true;
                } else {
                    equation(&mut c, eqs, names)?;
                }
            }
        }
    }
    if let Some((g, _, _, _)) = current {
        return Err(ParseError { line: last_line, col: 1, message: format!("graph `{}` is not closed with `}}`", g.name) });
    }
    Ok(graphs)
}

/// Parses text holding exactly one graph.
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let mut gs = parse_many(text)?;
    match gs.len() {
        1 => Ok(gs.pop().unwrap()),
        n => Err(ParseError { line: 1, col: 1, message: format!("expected one graph, found {n}") }),
    }
}

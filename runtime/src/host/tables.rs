//! Tabulated subtrees of elementwise programs. Under `Precision::bf16()` the host stores every
//! activation in f32 holding a bf16 value, so an operand the plan knows holds only bf16 values
//! ([`crate::kernel::Elementwise::bf16_args`]) takes at most 65,536 values. A subtree of a
//! program that reads that one operand and literals, and computes a transcendental on it
//! (GELU's `x * 0.5 * (erf(x * 0.7071) + 1)`, the `erf` and `exp` of its gradient), is computed
//! once for every bf16 value, by the same interpreter on the same f32 values, into a table
//! read at the value's upper 16 bits: the same bits as computing it, for a gather in place of
//! a few dozen vector instructions. Tables are made on a program's first run on the host, on
//! one thread while the program's other threads wait, once per process for each subtree (a
//! model's layers and its plans for other shapes share them), and kept with the bound kernels
//! (`CELLGRAPH_TABLES=0` refuses them, to time the two).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cellgraph_compiler::program::{Program, Step, Unary, Val};

use crate::kernel::{Elementwise, Read};

pub use crate::kernel::{Table, Tables, BF16_VALUES as ENTRIES};

/// Whether this process tabulates (`CELLGRAPH_TABLES` is not `0`: [`super::units`]).
pub fn enabled() -> bool {
    super::units().tables != Some(false)
}

/// What one subtree of a program reads, step by step (see [`subtrees`]).
#[derive(Clone, Copy, PartialEq)]
enum Reads {
    /// Literals only.
    Literals,
    /// One operand holding bf16 values, and literals.
    One(u8),
    /// Anything else: two operands, one not known to hold bf16 values, a scalar input.
    Other,
}

/// The subtrees of `prog` worth a table, as `(first, last, arg)`: the largest that read one
/// operand `$i` with `bf16[i]` and literals, computing `exp`, `erf`, `tanh` or `log` on it.
pub fn subtrees(prog: &Program, bf16: &[bool]) -> Vec<(usize, usize, u8)> {
    let steps = prog.steps();
    let mut reads = Vec::with_capacity(steps.len());
    let mut dear = Vec::with_capacity(steps.len());
    // The first step of each step's subtree, and its number of steps.
    let mut first = Vec::with_capacity(steps.len());
    let mut size = Vec::with_capacity(steps.len());
    for (k, s) in steps.iter().enumerate() {
        let (mut r, mut d, mut lo, mut n) = (Reads::Literals, false, k, 1usize);
        for v in s.reads() {
            let vr = match v {
                Val::Arg(i) if bf16.get(i as usize).copied().unwrap_or(false) => Reads::One(i),
                Val::Arg(_) | Val::Scalar(_) => Reads::Other,
                Val::Lit(_) => Reads::Literals,
                Val::Let(j) => {
                    let j = j as usize;
                    d |= dear[j];
                    lo = lo.min(first[j]);
                    n += size[j];
                    reads[j]
                }
            };
            r = match (r, vr) {
                (Reads::Literals, x) | (x, Reads::Literals) => x,
                (Reads::One(a), Reads::One(b)) if a == b => Reads::One(a),
                _ => Reads::Other,
            };
        }
        d |= matches!(s, Step::Unary(Unary::Exp | Unary::Erf | Unary::Tanh | Unary::Log, _));
        if matches!(s, Step::Write(..)) {
            r = Reads::Other;
        }
        reads.push(r);
        dear.push(d);
        first.push(lo);
        size.push(n);
    }
    let worth = |k: usize| matches!(reads[k], Reads::One(_)) && dear[k] && k + 1 - first[k] == size[k];
    // A step's reader (each value is read once: the program is a tree).
    let mut parent = vec![None; steps.len()];
    for (k, s) in steps.iter().enumerate() {
        for v in s.reads() {
            if let Val::Let(j) = v {
                parent[j as usize] = Some(k);
            }
        }
    }
    (0..steps.len())
        .filter(|&k| worth(k) && !parent[k].is_some_and(worth))
        .map(|k| {
            let Reads::One(i) = reads[k] else { unreachable!("worth a table") };
            (first[k], k, i)
        })
        .collect()
}

/// The tables of `e`'s program: each subtree run as a program of its own over every bf16 value
/// with `run` (the interpreter on the calling thread: `program::fused_here`), or the table an
/// earlier program with the same subtree made; empty where no operand holds bf16 values, or
/// tables are refused.
pub fn make(e: &Elementwise, run: impl Fn(&Elementwise, &[&[f32]], &mut [f32])) -> Tables {
    if !enabled() || !e.bf16_args.iter().any(|&b| b) {
        return Tables::default();
    }
    // Held while a table is made: `run` hands no work to other threads, so none waits on it.
    static MADE: OnceLock<Mutex<HashMap<Program, Arc<[f32; ENTRIES]>>>> = OnceLock::new();
    let mut made = MADE.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let tables = subtrees(&e.prog, &e.bf16_args)
        .into_iter()
        .map(|(first, last, arg)| {
            let mut sub = Program::new();
            let r = e.prog.rebuild(Val::Let(last as u16), &mut sub, &mut |_, _| Val::Arg(0));
            sub.write(0, r);
            let values = made.entry(sub).or_insert_with_key(|sub| {
                let inputs: Vec<f32> = (0..ENTRIES as u32).map(|b| f32::from_bits(b << 16)).collect();
                let mut values: Box<[f32; ENTRIES]> = vec![0.0f32; ENTRIES].into_boxed_slice().try_into().expect("ENTRIES values");
                run(&Elementwise::new(sub.clone(), vec![Read::Same], ENTRIES), &[&inputs], &mut values[..]);
                Arc::from(values)
            });
            Table { first, last, arg, values: Arc::clone(values) }
        })
        .collect();
    Tables { tables }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_subtrees_of_one_bf16_operand_with_a_transcendental_are_chosen() {
        // GELU: $0 * 0.5 * (erf($0 * 0.7071) + 1), all of it on $0.
        let gelu: Program = "$0 0.5 mul $0 0.7071 mul erf 1 add mul".parse().unwrap();
        assert_eq!(subtrees(&gelu, &[true]), vec![(0, 4, 0)]);
        assert_eq!(subtrees(&gelu, &[false]), vec![]);
        // Its gradient's shape: $1 * (erf($0 ...) + $0 * exp(...)): the part on $0 only.
        let grad: Program = "$1 $0 0.7071 mul erf 1 add $0 $0 $0 mul -0.5 mul exp mul add mul".parse().unwrap();
        assert_eq!(subtrees(&grad, &[true, true]), vec![(0, 7, 0)]);
        assert_eq!(subtrees(&grad, &[true, false]), vec![(0, 7, 0)]);
        // Two operands under the transcendental, or a product alone: nothing.
        let two: Program = "$0 $1 mul exp".parse().unwrap();
        assert_eq!(subtrees(&two, &[true, true]), vec![]);
        let cheap: Program = "$0 0.5 mul $1 add".parse().unwrap();
        assert_eq!(subtrees(&cheap, &[true, true]), vec![]);
        // Two tables in one program, on different operands.
        let both: Program = "$0 exp $1 erf add".parse().unwrap();
        assert_eq!(subtrees(&both, &[true, true]), vec![(0, 0, 0), (1, 1, 1)]);
    }

    /// `e`'s program over `args`, its subtrees on bf16 operands read from tables or not: the
    /// output's bits, and the program's tables.
    fn run_tables(e: &Elementwise, bf16: &[bool], args: &[&[f32]]) -> (Vec<u32>, Vec<Arc<[f32; ENTRIES]>>) {
        let e = e.with_bf16_args(bf16.to_vec());
        let mut out = vec![0.0f32; e.len];
        crate::host::program::fused(&e, args, &mut out);
        let tables = e.tables.get().map_or_else(Vec::new, |t| t.tables.iter().map(|t| Arc::clone(&t.values)).collect());
        (out.iter().map(|v| v.to_bits()).collect(), tables)
    }

    /// [`run_tables`] with the number of tables.
    fn run(e: &Elementwise, bf16: &[bool], args: &[&[f32]]) -> (Vec<u32>, usize) {
        let (bits, tables) = run_tables(e, bf16, args);
        (bits, tables.len())
    }

    /// The GPT's GELU and its gradient in a bf16 plan (their programs as the fusion pass
    /// writes them), over every bf16 value (NaNs, infinities, subnormals, zeros) read whole
    /// and read cyclically (a bias's read, gathered first): the tables give the bits of
    /// computing the programs.
    #[test]
    fn tabulated_programs_give_the_bits_of_computing_them() {
        let forward: Program = "$0 0.5 mul $0 0.70703125 mul erf 1.0 add mul round_bf16".parse().unwrap();
        let gradient: Program = "$0 $1 0.70703125 mul erf 1.0 add mul 0.5 mul $0 $1 0.5 mul mul round_bf16 $1 0.70703125 mul \
             $1 0.70703125 mul mul neg exp 1.125 mul mul 0.70703125 mul add round_bf16"
            .parse()
            .unwrap();
        let every: Vec<f32> = (0..ENTRIES as u32).map(|b| f32::from_bits(b << 16)).collect();
        // dy: bf16 values of either sign and many sizes, in an order unrelated to x's.
        let dy: Vec<f32> = (0..ENTRIES as u32)
            .map(|i| f32::from_bits((0x3c00u32.wrapping_add(i.wrapping_mul(2_654_435_761) % 0x0a00) | (i & 1) << 15) << 16))
            .collect();
        let whole = |p: &Program, n| Elementwise::new(p.clone(), vec![Read::Same; n], ENTRIES);
        let (plain, none) = run(&whole(&forward, 1), &[false], &[&every]);
        let (tabled, one) = run(&whole(&forward, 1), &[true], &[&every]);
        assert_eq!((none, one), (0, 1));
        assert!(plain == tabled, "the forward differs at {:?}", plain.iter().zip(&tabled).position(|(a, b)| a != b).map(|i| every[i]));
        let (plain, _) = run(&whole(&gradient, 2), &[false, false], &[&dy, &every]);
        let (tabled, two) = run(&whole(&gradient, 2), &[true, true], &[&dy, &every]);
        assert_eq!(two, 2, "erf's and exp's subtrees on $1");
        assert!(plain == tabled, "the gradient differs at {:?}", plain.iter().zip(&tabled).position(|(a, b)| a != b).map(|i| every[i]));
        // x read as a bias of 512 (gathered into the block, not read in place).
        let cyclic = Elementwise::new(gradient, vec![Read::Same, Read::Cycle(512)], ENTRIES);
        let bias = &every[0x3e00..0x4000];
        let (plain, _) = run(&cyclic, &[false, false], &[&dy, bias]);
        let (tabled, two) = run(&cyclic, &[false, true], &[&dy, bias]);
        assert_eq!(two, 2);
        assert!(plain == tabled, "the cyclic read differs");
        // Another program with the same subtrees (a second layer's) reads the same tables.
        let (_, first) = run_tables(&whole(&forward, 1), &[true], &[&every]);
        let (_, again) = run_tables(&whole(&forward, 1), &[true], &[&every]);
        assert!(Arc::ptr_eq(&first[0], &again[0]), "the forward's table was made twice");
    }
}

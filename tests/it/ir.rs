//! The IR: golden text dumps, print/parse round-trips, and the verifier's and parser's errors.

use crate::common::*;
use cellgraph::compiler::passes::dce::dce;
use cellgraph::compiler::{ParseError, ReduceAttrs};
use cellgraph::prelude::*;

/// Every graph the suite builds, by name.
fn suite_graphs() -> Vec<(&'static str, Graph)> {
    let lenet = lenet_with_loss();
    let mlp = mlp_with_loss();
    vec![
        ("lenet5_forward", trace(&LeNet5::new(&Scope::root(), 10, 1), "lenet5_forward", &image_inputs(32, 32)[..1]).unwrap().0),
        ("lenet5_train_step", train_one_step(&lenet, &image_inputs(32, 32), &SGD::new(0.01)).unwrap().graph),
        ("lenet5_grad_sens", grad_graph(&lenet, "lenet5_grad_sens", &image_inputs(8, 32), Sens::Input).unwrap().graph),
        ("mlp_train_step", train_one_step(&mlp, &image_inputs(32, 28), &Momentum::new(0.01, 0.9)).unwrap().graph),
    ]
}

#[test]
fn golden_dumps() {
    for (name, g) in suite_graphs() {
        verify(&g).unwrap();
        golden(&format!("{name}.ir"), &print(&g));
    }
}

#[test]
fn parse_print_round_trips_every_suite_graph() {
    for (name, g) in suite_graphs() {
        let text = print(&g);
        let back = parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(back, g, "{name}");
        assert_eq!(print(&back), text, "{name}: printing is stable");
        // With holes in the id space (after dead-code elimination).
        let mut pruned = g.clone();
        pruned.set_outputs(g.outputs()[..1].to_vec());
        dce(&mut pruned);
        assert_eq!(parse(&print(&pruned)).unwrap(), pruned, "{name} after dce");
    }
}

#[test]
fn round_trip_every_op_with_its_attributes() {
    // A graph using every op example, each node with a fresh `input` per operand so types are free.
    let mut g = Graph::new("all_ops");
    let mut k = 0;
    for op in Op::examples() {
        let n = match op.arity() {
            cellgraph::compiler::op::Arity::Exactly(n) => n,
            cellgraph::compiler::op::Arity::AtLeast(n) => n + 1,
        };
        let xs: Vec<NodeId> = (0..n)
            .map(|_| {
                k += 1;
                g.add_unchecked(Op::Input { index: k - 1, name: format!("x{k}") }, &[], TensorType::f32([2, 3]), "s")
            })
            .collect();
        if !matches!(op, Op::Input { .. }) {
            let id = g.add_unchecked(op, &xs, TensorType::new(DType::BF16, [1]), "net.scope/with:odd-chars");
            g.push_output(id);
        }
    }
    let back = parse(&print(&g)).unwrap();
    assert_eq!(back, g);
}

fn parse_err(text: &str) -> ParseError {
    parse(text).expect_err("should not parse")
}

#[test]
fn parser_reports_line_and_column() {
    let cases: &[(&str, usize, usize, &str)] = &[
        ("graph g {\n  %0: f32[2] = input {index=0, name=\"x\"}\n  return %1\n}\n", 3, 10, "use of undefined value %1"),
        ("graph g {\n  %0: f33[2] = input {index=0, name=\"x\"}\n", 2, 7, "expected a dtype"),
        ("graph g {\n  %0: f32[2] = frob(%0)\n", 2, 21, "use of undefined value %0"),
        ("graph g {\n  %0: f32[2] = frob\n  return %0\n}\n", 2, 16, "unknown op `frob`"),
        ("graph g {\n  %0: f32[2] = constant {value=1.0, value=2.0}\n", 2, 37, "given twice"),
        ("graph g {\n  %0: f32[2] = add {}\n", 2, 16, "`add` takes 2 operands, got 0"),
        ("graph g {\n  %0: f32[2] = constant {value=x}\n", 2, 16, "must be a number"),
        ("graph g {\n  %0: f32[2] = constant {value=1.0}\n  %0: f32[2] = constant {value=1.0}\n", 3, 3, "defined twice"),
        ("graph g {\n  %0: f32[2] = constant {value=1.0}\n", 2, 1, "not closed"),
        ("graph g {\n  %0: f32[2] = constant {value=1.0}\n}\n", 3, 1, "ends without `return`"),
        ("grph g {\n", 1, 1, "expected `graph NAME {`"),
        ("graph g {\n  %0: f32[2 = constant {value=1.0}\n", 2, 13, "expected `,` or `]` in the shape, found `=`"),
        ("graph g {\n  %0: f32[2] = input {index=0, name=\"x}\n", 2, 37, "unterminated string"),
        ("graph g {\n  %0: f32[2] = constant {value=1.0} junk\n", 2, 37, "unexpected `junk`"),
    ];
    for &(text, line, col, msg) in cases {
        let e = parse_err(text);
        assert!(e.message.contains(msg), "{text:?}: got `{e}`, want `{msg}`");
        assert_eq!((e.line, e.col), (line, col), "{text:?}: {e}");
    }
}

#[test]
fn verifier_collects_every_error_with_its_node() {
    let text = "graph bad {
  %0: f32[4,3] = input {index=0, name=\"x\"}
  %1: f32[5,3] = parameter {name=\"w\"}
  %2: f32[4,4] = matmul(%0, %1) {transpose_a=false, transpose_b=true}  # net.fc1
  %3: f32[4,4] = relu(%2)
  %4: f32[4,3] = assign(%0, %0)
  %5: f32[2] = input {index=2, name=\"y\"}
  return %3
}
";
    let g = parse(text).unwrap();
    let err = verify(&g).unwrap_err();
    let shown = err.to_string();
    // %3 is consistent with %2's declared type, so it is not reported.
    assert_eq!(err.errors.len(), 3, "{shown}");
    assert!(shown.contains("%2: declared type f32[4,4] but operands give f32[4,5]"), "{shown}");
    assert!(shown.contains("%4: `assign` must write a parameter"), "{shown}");
    assert!(shown.contains("index 1 is missing"), "{shown}");
    assert!(shown.contains("  ; error: declared type f32[4,4] but operands give f32[4,5]"), "errors are attached to the listing:\n{shown}");
}

#[test]
fn verifier_rejects_double_writes_cycles_and_missing_outputs() {
    let mut g = Graph::new("g");
    let p = g.add_leaf(Op::Parameter { name: "p".into() }, TensorType::f32([2]), "").unwrap();
    let c = g.add_leaf(Op::Constant { value: 1.0 }, TensorType::f32([2]), "").unwrap();
    g.add(Op::AssignAdd, &[p, c], "").unwrap();
    g.add(Op::Assign, &[p, c], "").unwrap();
    let e = verify(&g).unwrap_err().to_string();
    assert!(e.contains("written more than once"), "{e}");

    let mut g = Graph::new("nothing");
    g.add_leaf(Op::Parameter { name: "p".into() }, TensorType::f32([2]), "").unwrap();
    assert!(verify(&g).unwrap_err().to_string().contains("no outputs and no effects"));

    let mut g = Graph::new("cyc");
    let a = g.add_leaf(Op::Parameter { name: "a".into() }, TensorType::f32([2]), "").unwrap();
    let b = g.add(Op::Neg, &[a], "").unwrap();
    let d = g.add(Op::Neg, &[b], "").unwrap();
    g.replace_uses(a, d);
    g.set_outputs(vec![d]);
    assert!(verify(&g).unwrap_err().to_string().contains("on a cycle"));
}

#[test]
fn shape_errors_name_the_cell_path_op_and_both_shapes() {
    // A Dense(400, 120) fed 500 features.
    let fc1 = Dense::new(&Scope::root().child("fc1"), 400, 120);
    let err = trace(&fc1, "g", &[("x", TensorType::f32([32, 500]))]).unwrap_err().to_string();
    assert!(err.starts_with("net.fc1: matmul:"), "{err}");
    assert!(err.contains("f32[32,500]") && err.contains("f32[120,400]"), "{err}");

    // LeNet5 fed 28x28 images: the mismatch surfaces at fc1 with both shapes.
    let err = trace(&LeNet5::new(&Scope::root(), 10, 1), "g", &image_inputs(4, 28)[..1]).unwrap_err().to_string();
    assert!(err.starts_with("net.fc1: matmul:") && err.contains("f32[4,256]"), "{err}");

    // Conv2d with the wrong channel count.
    let conv = Conv2d::new(&Scope::root().child("conv1"), 3, 6, 5);
    let err = trace(&conv, "g", &image_inputs(2, 32)[..1]).unwrap_err().to_string();
    assert!(err.starts_with("net.conv1: conv2d:") && err.contains("1 channels but weight f32[6,3,5,5] expects 3"), "{err}");

    // Sparse labels of the wrong length.
    let err = trace(&lenet_with_loss(), "g", &[("data", TensorType::f32([4, 1, 32, 32])), ("label", TensorType::i32([5]))]).unwrap_err().to_string();
    assert!(err.starts_with("net.loss_fn: softmax_cross_entropy:") && err.contains("i32[5]"), "{err}");
}

#[test]
fn dce_keeps_outputs_and_effects() {
    let mut g = Graph::new("g");
    let p = g.add_leaf(Op::Parameter { name: "p".into() }, TensorType::f32([2]), "").unwrap();
    let dead = g.add(Op::Exp, &[p], "").unwrap();
    let one = g.add_leaf(Op::Constant { value: 1.0 }, TensorType::f32([2]), "").unwrap();
    let w = g.add(Op::AssignAdd, &[p, one], "").unwrap();
    let s = g.add(Op::ReduceSum(ReduceAttrs { axes: vec![0], keep_dims: false }), &[p], "").unwrap();
    g.set_outputs(vec![s]);
    assert_eq!(dce(&mut g), 1);
    assert!(!g.contains(dead) && g.contains(w) && g.contains(one));
    verify(&g).unwrap();
}

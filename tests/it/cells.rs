//! The Cell API: MindSpore parameter names and counts, initializers, wrappers.

use crate::common::*;
use cellgraph::prelude::*;

fn names(c: &dyn Cell) -> Vec<String> {
    c.parameters().into_iter().map(|p| p.name).collect()
}

fn count(c: &dyn Cell) -> usize {
    c.parameters().iter().map(|p| p.ty.numel()).sum()
}

#[test]
fn lenet5_has_mindspore_names_shapes_and_61684_parameters() {
    let net = LeNet5::new(&Scope::root(), 10, 1);
    assert_eq!(names(&net), ["conv1.weight", "conv2.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]);
    let shapes: Vec<Vec<usize>> = net.parameters().iter().map(|p| p.ty.dims().to_vec()).collect();
    assert_eq!(shapes[0], [6, 1, 5, 5]);
    assert_eq!(shapes[2], [120, 400]);
    assert_eq!(count(&net), 61_684);
}

#[test]
fn seed002_network_names_follow_sequential_indices() {
    let net = Network::new(&Scope::root());
    assert_eq!(
        names(&net),
        [
            "dense_relu_sequential.0.weight",
            "dense_relu_sequential.0.bias",
            "dense_relu_sequential.2.weight",
            "dense_relu_sequential.2.bias",
            "dense_relu_sequential.4.weight",
            "dense_relu_sequential.4.bias"
        ]
    );
    assert_eq!(count(&net), 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10);
}

#[test]
fn wrappers_keep_names_and_children_get_prefixes() {
    assert_eq!(names(&lenet_with_loss()), names(&LeNet5::new(&Scope::root(), 10, 1)));
    let nested = LeNet5::new(&Scope::root().child("backbone"), 10, 1);
    assert_eq!(names(&nested)[0], "backbone.conv1.weight");
    let conv = Conv2d::new(&Scope::root().child("c"), 4, 8, 3).with_bias().groups(2).unwrap();
    assert_eq!(names(&conv), ["c.weight", "c.bias"]);
    assert_eq!(conv.parameters()[0].ty.dims(), [8, 2, 3, 3]);
    assert!(Conv2d::new(&Scope::root().child("c"), 4, 8, 3).groups(3).unwrap_err().to_string().contains("groups 3 must divide"));
    // The bias [8] is added over the channel axis of [2, 8, 6, 6].
    let (g, y) = trace(&conv, "g", &[("x", TensorType::f32([2, 4, 6, 6]))]).unwrap();
    assert_eq!(g.ty(y), &TensorType::f32([2, 8, 6, 6]));
    assert!(print(&g).contains("reshape(%") && print(&g).contains("{shape=[8,1,1]}"));
}

#[test]
fn trainable_params_skip_state() {
    let p = Parameter::new("w", TensorType::f32([2]), Initializer::Zeros);
    let acc = p.clone_as("accu_grads", Initializer::Zeros);
    assert_eq!(acc.name, "accu_grads.w");
    assert!(!acc.requires_grad);
}

fn stats(v: &[f32]) -> (f64, f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    let max = v.iter().map(|&x| (x as f64).abs()).fold(0.0, f64::max);
    (mean, var.sqrt(), max)
}

#[test]
fn initializers_follow_mindspore_formulas() {
    let ty = TensorType::f32([256, 400]);
    let draw = |i: Initializer| i.materialize(&ty, "w", 3).to_f32();
    let (m, s, _) = stats(&draw(Initializer::normal(0.02)));
    assert!(m.abs() < 1e-3 && (s - 0.02).abs() < 1e-3, "normal: {m} {s}");
    let (_, s, max) = stats(&draw(Initializer::TruncatedNormal { sigma: 0.01 }));
    assert!(max <= 0.02 + 1e-7 && s < 0.01, "truncated: {s} {max}");
    // HeUniform(sqrt 5) bound = 1/sqrt(fan_in) = 0.05 (MindSpore's Dense default).
    let (_, _, max) = stats(&draw(Initializer::HeUniform { negative_slope: 5f64.sqrt() }));
    assert!(max <= 0.05 && max > 0.049, "he_uniform: {max}");
    let (_, s, _) = stats(&draw(Initializer::from_name("he_normal").unwrap()));
    assert!((s - (2.0f64 / 400.0).sqrt()).abs() < 2e-3, "he_normal: {s}");
    let (_, _, max) = stats(&draw(Initializer::from_name("xavier_uniform").unwrap()));
    let bound = (6.0f64 / 656.0).sqrt();
    assert!(max <= bound && max > 0.99 * bound, "xavier_uniform: {max}");
    let (_, s, _) = stats(&draw(Initializer::from_name("xavier_normal").unwrap()));
    assert!((s - (2.0f64 / 656.0).sqrt()).abs() < 2e-3, "xavier_normal: {s}");
    let (_, _, max) = stats(&draw(Initializer::from_name("uniform").unwrap()));
    assert!(max <= 0.07 && max > 0.069);
    assert!(draw(Initializer::from_name("zeros").unwrap()).iter().all(|&x| x == 0.0));
    assert!(draw(Initializer::from_name("ones").unwrap()).iter().all(|&x| x == 1.0));
    assert_eq!(Initializer::from_name("truncatednormal").unwrap(), Initializer::TruncatedNormal { sigma: 0.01 });
    let e = Initializer::from_name("kaiming").unwrap_err().to_string();
    assert!(e.contains("unknown initializer `kaiming`") && e.contains("he_uniform"), "{e}");
}

#[test]
fn materialisation_is_deterministic_per_seed_and_name() {
    let net = LeNet5::new(&Scope::root(), 10, 1);
    let a = materialize(&net.parameters(), 5);
    let b = materialize(&net.parameters(), 5);
    let c = materialize(&net.parameters(), 6);
    assert_eq!(a, b);
    assert_ne!(a[0].1, c[0].1);
    // Independent of which other parameters exist or their order.
    let only_fc1: Vec<_> = net.parameters().into_iter().filter(|p| p.name == "fc1.weight").collect();
    assert_eq!(materialize(&only_fc1, 5)[0], a[2]);
}

#[test]
fn cells_check_their_input_count() {
    let err = trace(&lenet_with_loss(), "g", &image_inputs(2, 32)[..1]).unwrap_err().to_string();
    assert_eq!(err, "WithLossCell: construct takes 2 input(s), got 1");
}

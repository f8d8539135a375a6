//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use cellgraph::prelude::*;

/// LeNet5 + sparse softmax cross-entropy (mean), as in the seed programs.
pub fn lenet_with_loss() -> WithLossCell {
    WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean))
}

/// The seed-002 network + CrossEntropyLoss.
pub fn mlp_with_loss() -> WithLossCell {
    WithLossCell::new(Network::new(&Scope::root()), CrossEntropyLoss::new())
}

/// `(data, label)` input types for a batch of `n` images of `hw x hw`.
pub fn image_inputs(n: usize, hw: usize) -> [(&'static str, TensorType); 2] {
    [("data", TensorType::f32([n, 1, hw, hw])), ("label", TensorType::i32([n]))]
}

/// The vendored MNIST directory.
pub fn mnist_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/mnist")
}

/// Compares `actual` with the golden file `tests/golden/{name}`; `BLESS=1` re-records it.
/// On mismatch, fails with a unified diff.
pub fn golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    if std::env::var_os("BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("missing golden file {}; run with BLESS=1 to record it", path.display()));
    if expected != actual {
        let diff = similar::TextDiff::from_lines(expected.as_str(), actual)
            .unified_diff()
            .header(&format!("{name} (expected)"), &format!("{name} (actual)"))
            .to_string();
        panic!("golden file {name} differs (re-record with BLESS=1 if intended):\n{diff}");
    }
}

//! Datasets, checkpoints and the Model API: sharding and shuffling, exact checkpoint bytes,
//! corruption, callbacks, evaluation, and bit-identical resume from a mid-window checkpoint.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;

use cellgraph::cells::accumulate::{GradAccumulation, Normalization};
use cellgraph::prelude::*;
use cellgraph::runtime::checkpoint::{self, from_ckpt_bytes, to_ckpt_bytes, Tensors};
use cellgraph::runtime::data::{create_dataset, create_eval_dataset, ImageOp, MnistDataset};
use cellgraph::runtime::{Callback, CheckpointConfig, LossMonitor, ModelCheckpoint, RunContext, TensorDataset};
use crate::common::*;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cellgraph-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn shards_are_equal_sized_cover_the_data_and_shuffle_per_epoch() {
    let base = MnistDataset::new(&mnist_dir(), "t10k").unwrap();
    let labels_of = |d: &MnistDataset, epoch| d.epoch(epoch, 0).flat_map(|b| b.label.to_f64()).collect::<Vec<_>>();
    let shards: Vec<MnistDataset> = (0..3).map(|i| base.clone().shuffle(7).batch(32, false).unwrap().shard(3, i).unwrap()).collect();
    let sizes: Vec<usize> = shards.iter().map(|s| s.get_dataset_size()).collect();
    assert_eq!(sizes, vec![21, 21, 21], "2000 items / 3 shards = 667 each (padded), 21 batches");
    let mut histogram = [0usize; 10];
    shards.iter().flat_map(|s| labels_of(s, 0)).for_each(|l| histogram[l as usize] += 1);
    let mut full = [0usize; 10];
    labels_of(&base.clone().batch(2000, false).unwrap(), 0).iter().for_each(|&l| full[l as usize] += 1);
    assert!(histogram.iter().zip(&full).all(|(h, f)| h >= f && h - f <= 1), "union covers every item once (+1 pad)");
    let s = base.clone().shuffle(7).batch(32, true).unwrap();
    assert_eq!(labels_of(&s, 0), labels_of(&s, 0), "deterministic");
    assert_ne!(labels_of(&s, 0), labels_of(&s, 1), "a new order each epoch");
    assert_eq!(s.get_dataset_size(), 62, "drop_remainder");
    assert_eq!(base.clone().batch(32, false).unwrap().repeat(2).get_dataset_size(), 125);
    let b = base.clone().map([ImageOp::Resize(32, 32), ImageOp::Hwc2Chw]).batch(4, true).unwrap().epoch(0, 0).next().unwrap();
    assert_eq!((b.data.shape.clone(), b.label.shape.clone()), (vec![4, 1, 32, 32], vec![4]));
    assert!(base.clone().shard(2, 2).unwrap_err().to_string().contains("shard_id in 0..2"));
    assert!(base.batch(0, true).is_err());
}

#[test]
fn the_eval_pipeline_scores_every_test_image_in_file_order() {
    let dir = mnist_dir();
    let eval = create_eval_dataset(&dir, "t10k", 32).unwrap();
    let train_like = create_dataset(&dir, "t10k", 32, 1, 0).unwrap();
    assert_eq!((eval.get_dataset_size(), train_like.get_dataset_size()), (63, 62), "2,000 = 62 x 32 + 16; drop_remainder scores 1,984");
    let batches: Vec<_> = eval.epoch(0, 0).collect();
    assert_eq!(batches.iter().map(|b| b.label.shape[0]).sum::<usize>(), 2000);
    assert_eq!(batches.last().unwrap().data.shape, vec![16, 1, 32, 32]);
    let labels: Vec<f64> = batches.iter().flat_map(|b| b.label.to_f64()).collect();
    let file = Mnist::load(&dir, "t10k").unwrap();
    assert!(labels.iter().enumerate().all(|(i, &l)| l == file.labels[i] as f64), "file order, no shuffle");
    // The same image ops as training: the first image is the LeNet transform of the file's (to
    // f32 rounding: the pipeline applies its two rescales one after the other).
    let want = lenet_transform(file.image(0), 28, 28);
    assert!(batches[0].data.to_f32()[..1024].iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6));
}

#[test]
fn mindspore_ckpt_has_the_exact_protobuf_layout() {
    let mut t = Tensors::new();
    t.insert("w".into(), HostTensor::f32(vec![2], vec![1.0, -2.0]).unwrap());
    t.insert("s".into(), HostTensor::i32(vec![], vec![7]).unwrap());
    let bytes = to_ckpt_bytes(&t);
    // Checkpoint.value (field 1, length-delimited) per tensor, sorted by name:
    //   Value { tag (1) = "s"; tensor (2) = TensorProto { dims (1, unpacked) = 0; tensor_type (2) = "Int32"; content (3) } }
    let mut want = vec![0x0a, 0x14, 0x0a, 0x01, b's', 0x12, 0x0f, 0x08, 0x00, 0x12, 0x05];
    want.extend(b"Int32");
    want.extend([0x1a, 0x04, 7, 0, 0, 0]);
    want.extend([0x0a, 0x1a, 0x0a, 0x01, b'w', 0x12, 0x15, 0x08, 0x02, 0x12, 0x07]);
    want.extend(b"Float32");
    want.extend([0x1a, 0x08]);
    want.extend(1.0f32.to_le_bytes());
    want.extend((-2.0f32).to_le_bytes());
    assert_eq!(bytes, want);
    assert_eq!(from_ckpt_bytes(std::path::Path::new("x.ckpt"), &bytes).unwrap(), t);
}

#[test]
fn checkpoints_round_trip_atomically_and_corruption_is_an_error() {
    let dir = tmpdir("ckpt");
    let mut t = Tensors::new();
    t.insert("fc.weight".into(), HostTensor::f32(vec![2, 3], (0..6).map(|i| i as f32).collect()).unwrap());
    t.insert("cellgraph.updates".into(), HostTensor { shape: vec![], data: HostData::I64(vec![3]) });
    for name in ["a.safetensors", "a.ckpt"] {
        let p = dir.join(name);
        checkpoint::save(&p, &t, &BTreeMap::new()).unwrap();
        assert_eq!(checkpoint::load(&p).unwrap().0, t, "{name}");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        let e = checkpoint::load(&p).unwrap_err().to_string();
        assert!(e.starts_with(&p.display().to_string()), "{name}: {e}");
    }
    let p = dir.join("flip.safetensors");
    checkpoint::save(&p, &t, &BTreeMap::new()).unwrap();
    let mut bytes = std::fs::read(&p).unwrap();
    let n = bytes.len();
    bytes[n - 30] ^= 0x40;
    std::fs::write(&p, &bytes).unwrap();
    let e = checkpoint::load(&p).unwrap_err().to_string();
    assert!(e.contains("checksum mismatch") && e.contains("corrupt"), "{e}");
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().contains(".tmp")).collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A writer tests can read back.
#[derive(Clone, Default)]
struct Shared(Rc<RefCell<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The Accelerate example's data: x = 1..8, y = 2x.
fn toy(batch: usize) -> TensorDataset {
    let x: Vec<f32> = (1..=8).map(|v| v as f32).collect();
    let y: Vec<f32> = x.iter().map(|v| 2.0 * v).collect();
    TensorDataset { columns: vec![HostTensor::f32(vec![8, 1], x).unwrap(), HostTensor::f32(vec![8, 1], y).unwrap()], batch_size: batch }
}

fn toy_net() -> WithLossCell {
    WithLossCell::new(Dense::new(&Scope::root(), 1, 1).without_bias().weight_init(Initializer::Zeros), MSELoss::new())
}

#[test]
fn accelerate_toy_reaches_2_04_with_and_without_accumulation_and_loss_monitor_prints_mindspore_lines() {
    let buf = Shared::default();
    let mut monitor = LossMonitor::to_writer(2, Box::new(buf.clone()));
    let acc = GradAccumulation::across_steps(toy_net(), 4).normalization(Normalization::Mean);
    let mut m = Model::<Cpu>::new(acc, SGD::new(0.02), cpu(), 0).unwrap();
    m.train(1, &toy(2), &mut [&mut monitor]).unwrap();
    let w = m.accumulator().session.param("weight").unwrap().scalar();
    assert!((w - 2.04).abs() < 1e-6, "{w}");
    let text = String::from_utf8(buf.0.borrow().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[0].starts_with("epoch: 1 step: 2, loss is ") && lines[1].starts_with("epoch: 1 step: 4, loss is "), "{text}");

    let mut plain = Model::<Cpu>::plain(toy_net(), SGD::new(0.02), cpu(), 0).unwrap();
    plain.train(1, &toy(8), &mut []).unwrap();
    assert!((plain.accumulator().session.param("weight").unwrap().scalar() - 2.04).abs() < 1e-6);
}

#[test]
fn a_non_finite_loss_stops_training_with_a_clear_error() {
    let mut bad = toy(2);
    if let HostData::F32(v) = &mut bad.columns[0].data {
        v[3] = f32::INFINITY;
    }
    let mut m = Model::<Cpu>::plain(toy_net(), SGD::new(0.02), cpu(), 0).unwrap();
    let mut monitor = LossMonitor::to_writer(1, Box::new(Shared::default()));
    let e = m.train(1, &bad, &mut [&mut monitor]).unwrap_err().to_string();
    assert!(e.contains("epoch 1 step 2") && (e.contains("loss is NaN") || e.contains("loss is inf")), "{e}");
}

#[test]
fn eval_reports_accuracy_of_the_backbone() {
    let net = WithLossCell::new(Dense::new(&Scope::root(), 2, 2).without_bias(), CrossEntropyLoss::new());
    let mut m = Model::<Cpu>::plain(net, SGD::new(0.0), cpu(), 0).unwrap();
    m.accumulator_mut().session.set_param("weight", &HostTensor::f32(vec![2, 2], vec![1.0, 0.0, 0.0, 1.0]).unwrap());
    let x = HostTensor::f32(vec![3, 2], vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0]).unwrap();
    let y = HostTensor::i32(vec![3], vec![0, 1, 1]).unwrap();
    let r = m.eval(&TensorDataset { columns: vec![x, y], batch_size: 2 }).unwrap();
    assert!((r["Accuracy"] - 2.0 / 3.0).abs() < 1e-12, "{r:?}");
}

struct StopAfter(usize);

impl Callback<Cpu> for StopAfter {
    fn step_end(&mut self, cx: &mut RunContext<Cpu>) -> cellgraph::runtime::Result<()> {
        if cx.position.step == self.0 && cx.epoch == 2 {
            cx.request_stop();
        }
        Ok(())
    }
}

fn random_images(n: usize) -> TensorDataset {
    let mut s = 1u64;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    let x: Vec<f32> = (0..n * 16 * 16).map(|_| next()).collect();
    let y: Vec<i32> = (0..n).map(|i| (i % 10) as i32).collect();
    TensorDataset { columns: vec![HostTensor::f32(vec![n, 1, 16, 16], x).unwrap(), HostTensor::i32(vec![n], y).unwrap()], batch_size: 4 }
}

fn resume_model() -> Model<Cpu> {
    let s = Scope::root();
    let backbone = SequentialCell::new(&s.child("dense_relu_sequential"))
        .add(|_| Flatten::new())
        .add(|s| Dense::new(s, 256, 32))
        .add(|_| ReLU::new())
        .add(|s| Dense::new(s, 32, 10));
    let net = WithLossCell::new(backbone, CrossEntropyLoss::new());
    Model::<Cpu>::new(GradAccumulation::across_steps(net, 4), Adam::new(1e-3), cpu(), 5).unwrap()
}

#[test]
fn resume_from_a_mid_window_checkpoint_is_bit_identical() {
    let data = random_images(40); // 10 batches per epoch: windows cross epoch ends
    let mut straight = resume_model();
    straight.train(3, &data, &mut []).unwrap();

    let dir = tmpdir("resume");
    for name in ["mid.safetensors", "mid.ckpt"] {
        let mut first = resume_model();
        first.train(3, &data, &mut [&mut StopAfter(6)]).unwrap();
        assert_eq!(first.accumulator().window_len(), 2, "stopped mid-window");
        let path = dir.join(name);
        first.save_checkpoint(&path).unwrap();
        let mut resumed = resume_model();
        resumed.load_checkpoint(&path).unwrap();
        resumed.train(3, &data, &mut []).unwrap();
        assert_eq!(resumed.accumulator().session.params_host(), straight.accumulator().session.params_host(), "{name}");
        assert_eq!(resumed.accumulator().counters(), straight.accumulator().counters(), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn model_checkpoint_writes_prefix_epoch_step_and_keeps_the_newest() {
    let dir = tmpdir("modelckpt");
    let mut cb = ModelCheckpoint::new("lenet", &dir, CheckpointConfig { save_checkpoint_steps: 3, keep_checkpoint_max: 2, format: "ckpt" });
    let mut m = resume_model();
    m.train(1, &random_images(40), &mut [&mut cb]).unwrap();
    let names: Vec<String> = cb.kept().iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["lenet-1_6.ckpt", "lenet-1_9.ckpt"]);
    let on_disk = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(on_disk, 2);
    let (t, _) = checkpoint::load(&cb.kept()[1]).unwrap();
    assert!(t.contains_key("moment1.dense_relu_sequential.1.weight") && t.contains_key("accu_grads.dense_relu_sequential.1.weight"));
    std::fs::remove_dir_all(&dir).unwrap();
}

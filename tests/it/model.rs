//! Datasets, checkpoints and the Model API: sharding and shuffling, exact checkpoint bytes,
//! corruption, callbacks, evaluation, and bit-identical resume from a mid-window checkpoint.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;

use crate::common::*;
use cellgraph::cells::accumulate::{GradAccumulation, Normalization};
use cellgraph::prelude::*;
use cellgraph::runtime::checkpoint::{self, from_ckpt_bytes, to_ckpt_bytes, Tensors};
use cellgraph::runtime::data::{create_dataset, create_eval_dataset, ImageOp, MnistDataset};
use cellgraph::runtime::Place;
use cellgraph::runtime::{Callback, CheckpointConfig, LossMonitor, ModelCheckpoint, RunContext, TensorDataset};

fn tmpdir(name: &str) -> TmpDir {
    TmpDir::created(name)
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
fn mindspore_ckpt_is_byte_for_byte_what_mindspore_writes_with_its_crc() {
    // tests/data/mindspore_crc.ckpt: MindSpore 2.10's save_checkpoint(..., crc_check=True) of
    // a = [[1.5, -2, 3.25], [0, 1e-3, 7]] (f32), b = [1, 2, 3] (i32), c = 0.5 (f32 scalar);
    // tests/data/mindspore_crc.py wrote it.
    let reference = std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/mindspore_crc.ckpt")).unwrap();
    let mut t = Tensors::new();
    t.insert("a".into(), HostTensor::f32(vec![2, 3], vec![1.5, -2.0, 3.25, 0.0, 1e-3, 7.0]).unwrap());
    t.insert("b".into(), HostTensor::i32(vec![3], vec![1, 2, 3]).unwrap());
    t.insert("c".into(), HostTensor::f32(vec![], vec![0.5]).unwrap());
    let bytes = to_ckpt_bytes(&t);
    assert_eq!(bytes, reference);
    // One Checkpoint message per tensor, then `crc_num` and the CRC-32 in 10 big-endian bytes.
    assert_eq!(&bytes[bytes.len() - 17..], b"crc_num\0\0\0\0\0\0\x91\x0e\xab\x16");
    let path = std::path::Path::new("x.ckpt");
    assert_eq!(from_ckpt_bytes(path, &reference).unwrap(), t);
    // Without the trailer (crc_check=False) it loads too; MindSpore 1.x's `dims = [0]`
    // scalars read as scalars.
    assert_eq!(from_ckpt_bytes(path, &reference[..reference.len() - 17]).unwrap(), t);
}

/// The same values saved again are the same bytes: safetensors writes its metadata from a
/// hash map, in an order of its own each time; the header is rewritten in key order (eight
/// saves of four keys would all agree by chance once in 24^7).
#[test]
fn checkpoints_of_the_same_values_are_the_same_bytes() {
    let mut t = Tensors::new();
    t.insert("fc.weight".into(), HostTensor::f32(vec![2, 3], (0..6).map(|i| i as f32).collect()).unwrap());
    t.insert("cellgraph.updates".into(), HostTensor { shape: vec![], data: HostData::I64(vec![3]) });
    let meta: BTreeMap<String, String> = [("net", "lenet"), ("epoch", "2")].into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let first = checkpoint::to_safetensors_bytes(&t, &meta).unwrap();
    for _ in 0..7 {
        assert_eq!(checkpoint::to_safetensors_bytes(&t, &meta).unwrap(), first);
    }
    let n = u64::from_le_bytes(first[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0, "the header is padded to 8 bytes");
    let header = std::str::from_utf8(&first[8..8 + n]).unwrap();
    let at = |k: &str| header.find(&format!("\"{k}\"")).unwrap_or_else(|| panic!("{k} in {header}"));
    assert!(at("cellgraph.crc32") < at("epoch") && at("epoch") < at("format") && at("format") < at("net"), "{header}");
    let (back, m) = checkpoint::from_safetensors_bytes(std::path::Path::new("mem"), &first).unwrap();
    assert_eq!((back, m.get("net").map(String::as_str)), (t, Some("lenet")));
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
    let leftovers: Vec<_> =
        std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().contains(".tmp")).collect();
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
    let w = m.accumulator().session().param("weight").unwrap().scalar();
    assert!((w - 2.04).abs() < 1e-6, "{w}");
    let text = String::from_utf8(buf.0.borrow().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[0].starts_with("epoch: 1 step: 2, loss is ") && lines[1].starts_with("epoch: 1 step: 4, loss is "), "{text}");

    let mut plain = Model::<Cpu>::plain(toy_net(), SGD::new(0.02), cpu(), 0).unwrap();
    plain.train(1, &toy(8), &mut []).unwrap();
    assert!((plain.accumulator().session().param("weight").unwrap().scalar() - 2.04).abs() < 1e-6);
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
    m.accumulator_mut().set_param("weight", &HostTensor::f32(vec![2, 2], vec![1.0, 0.0, 0.0, 1.0]).unwrap()).unwrap();
    let x = HostTensor::f32(vec![3, 2], vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0]).unwrap();
    let y = HostTensor::i32(vec![3], vec![0, 1, 1]).unwrap();
    let r = m.eval(&TensorDataset { columns: vec![x, y], batch_size: 2 }).unwrap();
    assert!((r["Accuracy"] - 2.0 / 3.0).abs() < 1e-12, "{r:?}");
}

/// Setting a parameter that does not exist, or with another shape, is an error naming it, and
/// changes nothing.
#[test]
fn setting_an_unknown_or_misshapen_parameter_is_an_error() {
    let net = WithLossCell::new(Dense::new(&Scope::root(), 2, 2).without_bias(), CrossEntropyLoss::new());
    let mut m = Model::<Cpu>::plain(net, SGD::new(0.0), cpu(), 0).unwrap();
    let before = m.accumulator().session().param("weight").unwrap().to_f32();
    let e = m.accumulator_mut().set_param("wieght", &HostTensor::f32(vec![2, 2], vec![0.0; 4]).unwrap()).unwrap_err().to_string();
    assert!(e.contains("`wieght`") && e.contains("weight"), "{e}");
    let e = m.accumulator_mut().set_param("weight", &HostTensor::f32(vec![4], vec![0.0; 4]).unwrap()).unwrap_err().to_string();
    assert!(e.contains("parameter `weight`") && e.contains("[2, 2]") && e.contains("[4]"), "{e}");
    assert_eq!(m.accumulator().session().param("weight").unwrap().to_f32(), before);
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
    Model::<Cpu>::new(GradAccumulation::across_steps(small_net(), 4), Adam::new(1e-3), cpu(), 5).unwrap()
}

/// A small MLP over `random_images`' 16 x 16 pixels, with its loss.
fn small_net() -> WithLossCell {
    let s = Scope::root();
    let backbone = SequentialCell::new(&s.child("dense_relu_sequential"))
        .add(|_| Flatten::new())
        .add(|s| Dense::new(s, 256, 32))
        .add(|_| ReLU::new())
        .add(|s| Dense::new(s, 32, 10));
    WithLossCell::new(backbone, CrossEntropyLoss::new())
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
        let first_updates = first.accumulator().updates();
        let mut resumed = resume_model();
        resumed.load_checkpoint(&path).unwrap();
        resumed.train(3, &data, &mut []).unwrap();
        assert_eq!(resumed.accumulator().session().params_host(), straight.accumulator().session().params_host(), "{name}");
        // Which boundary ran is not checkpointed: the resumed run counts its own.
        let counted = |m: &Model<Cpu>| cellgraph::runtime::Counters { host_boundaries: 0, ..m.accumulator().counters() };
        assert_eq!(counted(&resumed), counted(&straight), "{name}");
        assert_eq!(resumed.accumulator().counters().host_boundaries, resumed.accumulator().updates() - first_updates, "{name}");
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

/// What a LossMonitor printed.
fn monitor_lines(per_print_times: usize, epochs: usize, data: &TensorDataset) -> Vec<String> {
    let buf = Shared::default();
    let mut monitor = LossMonitor::to_writer(per_print_times, Box::new(buf.clone()));
    let mut m = Model::<Cpu>::plain(toy_net(), SGD::new(0.02), cpu(), 0).unwrap();
    m.train(epochs, data, &mut [&mut monitor]).unwrap();
    let text = String::from_utf8(buf.0.borrow().clone()).unwrap();
    text.lines().map(String::from).collect()
}

#[test]
fn loss_monitor_counts_global_steps_across_epochs_like_mindspore() {
    // 4 steps per epoch, per_print_times 5: MindSpore prints at global steps 5 and 10, shown
    // as the step within the epoch (epoch 2 step 1, epoch 3 step 2); `step % 5` never fires.
    let lines = monitor_lines(5, 3, &toy(2));
    let heads: Vec<&str> = lines.iter().map(|l| l.split(", loss is ").next().unwrap()).collect();
    assert_eq!(heads, ["epoch: 2 step: 1", "epoch: 3 step: 2"], "{lines:?}");
    // The f32 loss at full precision, as Python prints float(np.float32): it parses back to
    // an f32 exactly and has more digits than `{}` of the f32 would give.
    for l in &lines {
        let v: f64 = l.split(", loss is ").nth(1).unwrap().parse().unwrap();
        assert_eq!(v, v as f32 as f64, "{l}");
    }
    assert!(monitor_lines(0, 3, &toy(2)).is_empty(), "per_print_times = 0 prints nothing");
    assert_eq!(monitor_lines(1, 1, &toy(2)).len(), 4);
}

#[test]
fn losses_print_as_python_floats() {
    use cellgraph::runtime::callback::py_float;
    assert_eq!(py_float(7.793_934_f32 as f64), "7.793933868408203");
    assert_eq!(py_float(2.0), "2.0");
    assert_eq!(py_float(0.1f32 as f64), "0.10000000149011612");
    assert_eq!(py_float(1e-5), "1e-05");
    assert_eq!(py_float(3.25e-7f32 as f64), "3.250000020216248e-07");
    assert_eq!(py_float(1.5e16), "1.5e+16");
    assert_eq!(py_float(123456.0), "123456.0");
    assert_eq!(py_float(f64::NAN), "nan");
}

#[test]
fn a_short_last_batch_is_sliced_into_near_equal_micro_batches() {
    use cellgraph::runtime::accumulate::micro_ranges;
    assert_eq!(micro_ranges(11, 4), [(0, 3), (3, 6), (6, 9), (9, 11)]);
    assert_eq!(micro_ranges(8, 4), [(0, 2), (2, 4), (4, 6), (6, 8)]);
    assert_eq!(micro_ranges(2, 4), [(0, 1), (1, 2)], "fewer items than micro_size: one micro-batch each");
    // 27 items in batches of 8 under in-step slicing by 4: 8, 8, 8 and a short 3 (1, 1, 1).
    let data = random_images(27);
    let net = GradAccumulation::new(small_net(), 4).normalization(Normalization::ItemWeighted);
    let mut m = Model::<Cpu>::new(net, Momentum::new(0.01, 0.9), cpu(), 1).unwrap();
    m.train(1, &TensorDataset { batch_size: 8, ..data.clone() }, &mut []).unwrap();
    let c = m.accumulator().counters();
    assert_eq!((c.micro_steps, c.optimizer_runs, m.accumulator().updates()), (15, 4, 4));
    // The same batch given as a full step is MindSpore's error, naming the fix.
    let mut a = Model::<Cpu>::new(GradAccumulation::new(small_net(), 4), Momentum::new(0.01, 0.9), cpu(), 1).unwrap();
    let ten = TensorDataset { batch_size: 10, ..data };
    let e = a.accumulator_mut().step(&ten.batches(0, 0).next().unwrap(), Place::Regular).unwrap_err().to_string();
    assert!(e.contains("must be divided by micro_size (4)"), "{e}");
}

#[test]
fn batches_that_cannot_be_sliced_fail_before_the_first_step() {
    // Batch 10 with micro_size 4: the first batch is already wrong. Nothing runs.
    let mut m = Model::<Cpu>::new(GradAccumulation::new(small_net(), 4), Momentum::new(0.01, 0.9), cpu(), 1).unwrap();
    let e = m.train(1, &TensorDataset { batch_size: 10, ..random_images(27) }, &mut []).unwrap_err().to_string();
    assert!(e.contains("batch 1 of each epoch has 10 items") && e.contains("multiple of 4 (such as 8 or 12)"), "{e}");
    assert_eq!(m.accumulator().counters().micro_steps, 0, "checked before the first step");
    // A dataset with no batch, or fewer items than one batch, is an error, not an epoch of nothing.
    let empty = TensorDataset {
        columns: vec![HostTensor::f32(vec![0, 1, 32, 32], vec![]).unwrap(), HostTensor::i32(vec![0], vec![]).unwrap()],
        batch_size: 8,
    };
    let e = m.train(1, &empty, &mut []).unwrap_err().to_string();
    assert!(e.contains("gives no batch per epoch"), "{e}");
    let e = m.train(1, &TensorDataset { batch_size: 32, ..random_images(12) }, &mut []).unwrap_err().to_string();
    assert!(e.contains("holds 12 items, fewer than one batch of 32"), "{e}");
    let e = m.train(0, &random_images(8), &mut []).unwrap_err().to_string();
    assert!(e.contains("epoch must be at least 1"), "{e}");
    let e = m.eval(&empty).unwrap_err().to_string();
    assert!(e.contains("no batch to evaluate"), "{e}");
    let mnist = create_dataset(&mnist_dir(), "t10k", 4096, 1, 0).unwrap();
    let e = m.train(1, &mnist, &mut []).unwrap_err().to_string();
    assert!(e.contains("MNIST t10k") && e.contains("2000 items per epoch") && e.contains("gives no batch"), "{e}");
}

#[test]
fn bad_hyperparameters_are_refused_before_anything_runs() {
    let model = |opt: Box<dyn Fn() -> Result<Model<Cpu>, cellgraph::runtime::RuntimeError>>| opt().err().map(|e| e.to_string()).unwrap_or_default();
    let acc = || GradAccumulation::new(small_net(), 4);
    let e = model(Box::new(move || Model::new(acc(), Momentum::new(-0.5, 0.9), cpu(), 1)));
    assert!(e.contains("Momentum") && e.contains("learning rate must be a finite number >= 0, got -0.5"), "{e}");
    let e = model(Box::new(move || Model::new(acc(), SGD::new(f64::NAN), cpu(), 1)));
    assert!(e.contains("SGD") && e.contains("got NaN"), "{e}");
    let e = model(Box::new(move || Model::new(acc(), Adam::new(f64::INFINITY), cpu(), 1)));
    assert!(e.contains("Adam") && e.contains("got inf"), "{e}");
    let e = model(Box::new(move || Model::new(GradAccumulation::across_steps(small_net(), 0), SGD::new(0.1), cpu(), 1)));
    assert!(e.contains("must be at least 1, got 0"), "{e}");
    let e = model(Box::new(move || Model::new(GradAccumulation::new(small_net(), 0), SGD::new(0.1), cpu(), 1)));
    assert!(e.contains("micro_size must be at least 1"), "{e}");
}

#[test]
fn checkpoints_that_are_empty_damaged_or_incomplete_do_not_load() {
    let dir = tmpdir("ckpt-strict");
    let mut m = resume_model();
    m.train(1, &random_images(8), &mut []).unwrap();
    let full = dir.join("full.ckpt");
    m.save_checkpoint(&full).unwrap();
    let bytes = std::fs::read(&full).unwrap();
    let load = |name: &str, b: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        resume_model().load_checkpoint(&p).err().map(|e| e.to_string()).unwrap_or_else(|| "loaded".into())
    };
    assert!(load("empty.ckpt", &[]).contains("empty"), "an empty file is no checkpoint");
    assert!(load("empty.safetensors", &[]).contains("empty"));
    let e = load("cut.ckpt", &bytes[..bytes.len() / 2]);
    assert!(e.contains("cut.ckpt") && e.contains("truncated"), "{e}");
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x04;
    let e = load("flip.ckpt", &flipped);
    assert!(e.contains("CRC check failed") && e.contains("damaged"), "{e}");
    assert_eq!(load("copy.ckpt", &bytes), "loaded");

    // A checkpoint without one of the network's parameters: strict loading names it; non-strict
    // loading keeps its value and reports it, as load_param_into_net(strict_load=False).
    let (mut t, _) = checkpoint::load(&full).unwrap();
    t.remove("dense_relu_sequential.3.bias");
    let partial = dir.join("partial.safetensors");
    checkpoint::save(&partial, &t, &BTreeMap::new()).unwrap();
    let mut fresh = resume_model();
    let before = fresh.accumulator().session().params_host();
    let e = fresh.load_checkpoint(&partial).unwrap_err().to_string();
    assert!(e.contains("partial.safetensors") && e.contains("lacks 1 of the network's 4 parameters: dense_relu_sequential.3.bias"), "{e}");
    assert_eq!(fresh.accumulator().session().params_host(), before, "a refused checkpoint changes nothing");
    let report = fresh.load_checkpoint_with(&partial, false).unwrap();
    assert_eq!(report.missing, ["dense_relu_sequential.3.bias"]);
    assert_eq!(fresh.accumulator().session().param("dense_relu_sequential.3.bias"), before.get("dense_relu_sequential.3.bias").cloned());
    // Only some of the optimizer state: refused too.
    t.insert("dense_relu_sequential.3.bias".into(), before["dense_relu_sequential.3.bias"].clone());
    t.remove("moment1.dense_relu_sequential.1.weight");
    checkpoint::save(&partial, &t, &BTreeMap::new()).unwrap();
    let e = resume_model().load_checkpoint(&partial).unwrap_err().to_string();
    assert!(e.contains("only part of the optimizer state") && e.contains("moment1.dense_relu_sequential.1.weight"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn checkpoint_targets_that_cannot_be_written_are_found_first_and_leave_no_litter() {
    let dir = tmpdir("ckpt-target");
    let e = checkpoint::check_writable(&dir).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    let file = dir.join("plain");
    std::fs::write(&file, b"x").unwrap();
    let under_a_file = file.join("model.ckpt");
    let e = checkpoint::check_writable(&under_a_file).unwrap_err().to_string();
    assert!(e.starts_with(&format!("cannot write checkpoint {}", under_a_file.display())), "{e}");
    let m = resume_model();
    let e = m.save_checkpoint(&dir).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    checkpoint::check_writable(&dir.join("sub/ok.ckpt")).unwrap();
    // A full disk: a 64 KiB tmpfs (root only; CI runs as root). The failed save removes its
    // temporary file, so the disk is not left full, and the error names the target.
    let small = dir.join("small");
    std::fs::create_dir_all(&small).unwrap();
    let mounted =
        std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"]).arg(&small).status().is_ok_and(|s| s.success());
    if mounted {
        let target = small.join("big.ckpt");
        let e = checkpoint::write_atomic(&target, &vec![7u8; 256 * 1024]).unwrap_err().to_string();
        let left: Vec<_> = std::fs::read_dir(&small).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        let _ = std::process::Command::new("umount").arg(&small).status();
        assert!(e.starts_with(&format!("cannot write checkpoint {}", target.display())) && !e.contains(".tmp"), "{e}");
        assert!(left.is_empty(), "a failed save left {left:?}");
    } else {
        eprintln!("SKIPPED (full-disk case): mounting a tmpfs needs root");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

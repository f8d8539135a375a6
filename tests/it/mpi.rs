//! The seed-002 program under a real `mpirun` (OpenMPI): training and logs on 2 ranks, a rank
//! that panics takes the whole job down quickly, ranks started with different arguments fail
//! with a clear error. Skipped (with a message) where `mpirun` is not installed.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::TmpDir;

const BIN: &str = env!("CARGO_BIN_EXE_distributed_gradient_accumulation");

fn have_mpirun() -> bool {
    let ok = Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    }
    ok
}

/// `mpirun` with this machine's flags; `apps` are MPMD parts `[(ranks, extra args)]`.
fn mpirun(apps: &[(usize, &[&str])], log_dir: &Path) -> (Output, Duration) {
    mpirun_env(apps, log_dir, &[])
}

fn mpirun_env(apps: &[(usize, &[&str])], log_dir: &Path, env: &[(&str, &Path)]) -> (Output, Duration) {
    let mut c = Command::new("timeout");
    c.args(["60", "mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]);
    for (i, (n, extra)) in apps.iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.args(["-n", &n.to_string(), BIN, "--epochs", "1", "--print-every", "5"]);
        c.args(["--data-path", concat!(env!("CARGO_MANIFEST_DIR"), "/data/mnist"), "--log-dir"]).arg(log_dir).args(*extra);
    }
    c.env("MATMUL_NUM_THREADS", "1").env("RAYON_NUM_THREADS", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    launch(c, log_dir)
}

/// Runs one `mpirun` at a time, each with its own OpenMPI session directory. Two `mpirun`s
/// started together race to create the shared `/tmp/ompi.<host>.<uid>` and one fails in
/// `orte_init` ("mkdir ... File exists"); one at a time also keeps the timing checks honest
/// on a 2-core machine.
fn launch(mut c: Command, log_dir: &Path) -> (Output, Duration) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let session = log_dir.with_extension("ompi");
    std::fs::create_dir_all(&session).expect("create the OpenMPI session directory");
    c.env("OMPI_MCA_orte_tmpdir_base", &session);
    let t = Instant::now();
    let out = c.output().expect("run mpirun");
    let took = t.elapsed();
    let _ = std::fs::remove_dir_all(&session);
    (out, took)
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn tmp(name: &str) -> TmpDir {
    TmpDir::fresh(&format!("mpi-{name}"))
}

#[test]
fn two_ranks_train_with_one_collective_per_update_and_write_worker_logs() {
    if !have_mpirun() {
        return;
    }
    let dir = tmp("ok");
    let graphs = dir.join("graphs");
    let level = Path::new("1");
    let (out, _) = mpirun_env(&[(2, &["--net", "lenet"])], &dir, &[("CELLGRAPH_SAVE_GRAPHS", level), ("CELLGRAPH_SAVE_GRAPHS_PATH", &graphs)]);
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("ranks: 2, updates: 125, gradient collectives: 125"), "{s}");
    for r in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("worker_{r}.log"))).unwrap();
        assert!(log.starts_with("epoch: 1 step: 5, loss is "), "worker_{r}.log: {log}");
        // CELLGRAPH_SAVE_GRAPHS: each rank dumps its graphs under rank_<id>/.
        for f in ["00_trace_forward.ir", "02_dce_micro_step.ir", "02_dce_optimizer_shard.ir", "02_dce_clear.ir"] {
            assert!(graphs.join(format!("rank_{r}")).join(f).is_file(), "rank_{r}/{f} missing");
        }
    }
}

#[test]
fn two_ranks_equal_one_process_on_the_gathered_batch() {
    if !have_mpirun() {
        return;
    }
    // The shard interleaves one shuffled order, so each update's two per-rank batches of 32
    // are together the single process's batch of 64 (8 micro-batches of 8 either way). A
    // small learning rate keeps training out of the chaotic regime that follows LeNet5's
    // plateau at 0.01, where any rounding difference grows to order one.
    let dir = tmp("equal");
    std::fs::create_dir_all(&dir).unwrap();
    let (two, one) = (dir.join("two.safetensors"), dir.join("one.safetensors"));
    let (out, _) = mpirun(&[(2, &["--net", "lenet", "--lr", "0.001", "--ckpt", two.to_str().unwrap()])], &dir);
    assert!(out.status.success(), "{}", text(&out));
    let single = Command::new(BIN)
        .args(["--net", "lenet", "--lr", "0.001", "--epochs", "1", "--batch-size", "64", "--micro-size", "8", "--log-dir"])
        .arg(&dir)
        .args(["--data-path", concat!(env!("CARGO_MANIFEST_DIR"), "/data/mnist"), "--ckpt", one.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(single.status.success(), "{}", text(&single));
    let (a, _) = cellgraph::runtime::checkpoint::load(&two).unwrap();
    let (b, _) = cellgraph::runtime::checkpoint::load(&one).unwrap();
    for name in ["conv1.weight", "conv2.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc3.bias", "moments.fc1.weight"] {
        let (x, y) = (a[name].to_f64(), b[name].to_f64());
        let scale = y.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
        let d = x.iter().zip(&y).fold(0.0f64, |m, (p, q)| m.max((p - q).abs())) / scale;
        eprintln!("{name}: {d:.2e}");
        assert!(d < 1e-6, "{name}: 2 ranks vs 1 process differ by {d} (relative)");
    }
    assert_eq!(a["cellgraph.updates"].scalar(), 125.0);
}

#[test]
fn a_rank_that_panics_ends_the_job_within_seconds() {
    if !have_mpirun() {
        return;
    }
    let dir = tmp("panic");
    let (out, took) = mpirun(&[(3, &["--net", "lenet", "--panic-at", "1:3"])], &dir);
    let s = text(&out);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("rank 1 panics at step 3"), "{s}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {s}");
    let log = std::fs::read_to_string(dir.join("worker_1.log")).unwrap();
    assert!(log.contains("rank 1 panics at step 3"), "the panic is in the rank's worker log: {log}");
    // This job's ranks carry its unique log directory on their command line.
    let stray = Command::new("pgrep").arg("-f").arg(&dir).output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    assert!(stray.is_empty(), "stray ranks left running: {stray}");
}

#[test]
fn ranks_started_with_different_arguments_fail_with_a_clear_error() {
    if !have_mpirun() {
        return;
    }
    let (out, took) = mpirun(&[(1, &["--lr", "0.01"]), (1, &["--lr", "0.02"])], &tmp("mismatch"));
    let s = text(&out);
    assert!(!out.status.success(), "{s}");
    assert!(s.contains("ranks [1] have a different configuration"), "{s}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

/// `mpirun -n ranks` of the program in its default configuration but for `extra`.
fn mpirun_default(ranks: usize, extra: &[&str], log_dir: &Path) -> (Output, Duration) {
    let mut c = mpirun_command(ranks, BIN);
    c.args(["--data-path", concat!(env!("CARGO_MANIFEST_DIR"), "/data/mnist"), "--log-dir"]).arg(log_dir).args(extra);
    launch(c, log_dir)
}

/// `mpirun` with this machine's flags running `ranks` copies of `exe` (one compute thread
/// each), under a 120 s timeout; the program's arguments follow.
fn mpirun_command(ranks: usize, exe: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("timeout");
    c.args(["120", "mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader", "-n", &ranks.to_string()]).arg(exe);
    c.env("MATMUL_NUM_THREADS", "1").env("RAYON_NUM_THREADS", "1");
    c
}

#[test]
fn the_default_job_runs_on_3_and_7_ranks_and_every_worker_log_has_its_loss_lines() {
    if !have_mpirun() {
        return;
    }
    // 8,000 images over 3 ranks: 2,667 per shard (wrapped), 84 batches of 32 per epoch, the
    // last of 11 items (sliced 3, 3, 3, 2). LossMonitor(100) counts global steps: one line at
    // step 100 = epoch 2 step 16, on every rank, although an epoch is shorter than 100 steps.
    let dir = tmp("three");
    let (out, _) = mpirun_default(3, &["--epochs", "2"], &dir);
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("ranks: 3, updates: 168, gradient collectives: 168"), "{s}");
    assert!(s.lines().any(|l| l.starts_with("epoch: 2 step: 16, loss is ")), "rank 0 prints its lines: {s}");
    for r in 0..3 {
        let log = std::fs::read_to_string(dir.join(format!("worker_{r}.log"))).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 1, "worker_{r}.log: {log}");
        let loss: f64 = lines[0].strip_prefix("epoch: 2 step: 16, loss is ").expect(&log).parse().unwrap();
        assert!(loss.is_finite() && loss == loss as f32 as f64, "worker_{r}.log: {log}");
    }
    // 7 ranks: 1,143 per shard, 36 batches per epoch, the last of 23 items (6, 6, 6, 5).
    let dir = tmp("seven");
    let (out, _) = mpirun_default(7, &["--epochs", "2", "--print-every", "36"], &dir);
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("ranks: 7, updates: 72, gradient collectives: 72"), "{s}");
    for r in 0..7 {
        let log = std::fs::read_to_string(dir.join(format!("worker_{r}.log"))).unwrap();
        let heads: Vec<&str> = log.lines().map(|l| l.split(", loss").next().unwrap()).collect();
        assert_eq!(heads, ["epoch: 1 step: 36", "epoch: 2 step: 36"], "worker_{r}.log: {log}");
    }
}

#[test]
fn a_batch_micro_size_cannot_slice_fails_on_every_rank_before_the_first_step() {
    if !have_mpirun() {
        return;
    }
    let dir = tmp("slice");
    let (out, took) = mpirun_default(2, &["--batch-size", "30", "--micro-size", "4"], &dir);
    let s = text(&out);
    assert!(!out.status.success(), "{s}");
    assert!(took < Duration::from_secs(20), "took {took:?}: {s}");
    assert!(s.contains("batch 1 of each epoch has 30 items") && s.contains("multiple of 4 (such as 28 or 32)"), "{s}");
    // The error is in the failing rank's worker log (whichever rank got there first), and no
    // rank trained.
    let logs: Vec<String> = (0..2).map(|r| std::fs::read_to_string(dir.join(format!("worker_{r}.log"))).unwrap_or_default()).collect();
    assert!(logs.iter().any(|l| l.contains("error: rank ") && l.contains("multiple of 4")), "{logs:?}");
    assert!(logs.iter().all(|l| !l.contains("loss is")), "{logs:?}");
}

/// The Colossal-AI ResNet-18 example under `mpirun -n 2` (TorchDDPPlugin + `no_sync`): each
/// rank reads its shard, the parameters change only at the fourth iteration, and the window
/// took one gradient collective.
#[test]
fn the_resnet18_example_on_two_ranks_reduces_once_per_window() {
    if !have_mpirun() {
        return;
    }
    let dir = tmp("resnet18");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap().parent().and_then(Path::parent).unwrap().join("examples/colossal_resnet18");
    let mut c = mpirun_command(2, &exe);
    c.args(["--batch-size", "2", "--mnist-path", concat!(env!("CARGO_MANIFEST_DIR"), "/data/mnist")]);
    let (out, _) = launch(c, &dir);
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("The parameter is only updated in the last iteration") && s.contains("ranks: 2, gradient collectives: 1\n"), "{s}");
    assert_eq!(s.matches("iteration 3, first 10 elements").count(), 1, "rank 0 prints: {s}");
    // SyncBatchNorm over MPI: 20 batch norms, 4 collectives each per micro-step, 4 micro-steps.
    let mut c = mpirun_command(2, &exe);
    c.args(["--batch-size", "2", "--sync-bn", "--mnist-path", concat!(env!("CARGO_MANIFEST_DIR"), "/data/mnist")]);
    let (out, _) = launch(c, &dir);
    let s = text(&out);
    assert!(out.status.success() && s.contains("ranks: 2, gradient collectives: 1, batch-norm collectives: 320"), "{s}");
}

/// `run.sh --net resnet18` on 2 ranks of a tiny MNIST directory (16 digits, batches of 2):
/// the ranks agree on the network traced at their micro-batch size (batch norm refuses one
/// item on layer4's 1x1 maps), on the trained parameters (not the per-rank moving
/// statistics), and LossMonitor prints once per epoch by default.
#[test]
fn the_resnet18_job_runs_on_two_ranks() {
    if !have_mpirun() {
        return;
    }
    let dir = tmp("resnet18-job");
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let idx = |magic: u8, dims: &[u32], body: Vec<u8>| {
        let mut v = vec![0, 0, 8, magic];
        dims.iter().for_each(|d| v.extend(d.to_be_bytes()));
        v.extend(body);
        v
    };
    for split in ["train", "t10k"] {
        let pixels: Vec<u8> = (0..16 * 784).map(|i| ((i * 37) % 251) as u8).collect();
        std::fs::write(data.join(format!("{split}-images-idx3-ubyte")), idx(3, &[16, 28, 28], pixels)).unwrap();
        std::fs::write(data.join(format!("{split}-labels-idx1-ubyte")), idx(1, &[16], (0..16).map(|i| (i % 10) as u8).collect())).unwrap();
    }
    let mut c = mpirun_command(2, BIN);
    c.args(["--net", "resnet18", "--batch-size", "2", "--epochs", "2", "--data-path"]).arg(&data).arg("--log-dir").arg(dir.join("logs"));
    let (out, _) = launch(c, &dir);
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    // 8 items per rank, 4 steps per epoch: one window of 4 per epoch.
    assert!(s.contains("training on its MNIST digits") && s.contains("ranks: 2, updates: 2, gradient collectives: 2"), "{s}");
    let heads: Vec<&str> = s.lines().filter(|l| l.contains(", loss is ")).map(|l| l.split(", loss").next().unwrap()).collect();
    assert_eq!(heads, ["epoch: 1 step: 4", "epoch: 2 step: 4"], "{s}");
    // With SyncBatchNorm the ranks end with the same moving statistics too (the final
    // agreement then compares every parameter); 4 micro-steps x 20 batch norms x 4.
    let mut c = mpirun_command(2, BIN);
    c.args(["--net", "resnet18", "--sync-bn", "--batch-size", "2", "--epochs", "1", "--data-path"]).arg(&data).arg("--log-dir").arg(dir.join("logs"));
    let (out, _) = launch(c, &dir);
    let s = text(&out);
    assert!(out.status.success() && s.contains("batch-norm collectives: 320 (SyncBatchNorm)"), "{s}");
}

/// `cellgraph finetune` on 2 ranks of 4 sequences per update (2 micro-batches each) ends where
/// one process on the 8-sequence batches (4 micro-batches) does (the loss on a fixed sequence
/// within 1e-4 of how far the 4 updates moved it): the tiny GPT-2, line items padded per batch
/// (so ranks and micro-batches carry different numbers of tokens), the window's tokens counted
/// across ranks. Only rank 0 prints and saves.
#[test]
fn finetune_on_two_ranks_equals_one_process() {
    if !have_mpirun() {
        return;
    }
    let dir = TmpDir::created("mpi-finetune");
    let data = crate::hf::shakespeare_text(&dir, 40_000);
    let bin = env!("CARGO_BIN_EXE_cellgraph");
    let run = |out: &str, batch: &str, micro: &str| -> Vec<String> {
        vec![
            bin,
            "finetune",
            "--model",
            "tests/assets/tiny-gpt2",
            "--data",
            data.to_str().unwrap(),
            "--split",
            "lines",
            "--no-shuffle",
            "--dropout",
            "0",
            "--val-fraction",
            "0",
            "--steps",
            "4",
            "--block-size",
            "32",
            "--lr",
            "3e-3",
            "--sample-tokens",
            "0",
            "--device",
            "cpu",
            "--out",
        ]
        .into_iter()
        .map(String::from)
        .chain([dir.join(out).to_str().unwrap().to_string(), "--batch-size".into(), batch.into(), "--micro-size".into(), micro.into()])
        .collect()
    };
    let one = Command::new(bin).args(&run("one", "8", "4")[1..]).env("RAYON_NUM_THREADS", "1").output().unwrap();
    assert!(one.status.success(), "{}", text(&one));
    let mut c = Command::new("timeout");
    c.args(["120", "mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader", "-n", "2"]).args(run("two", "4", "2"));
    c.env("MATMUL_NUM_THREADS", "1").env("RAYON_NUM_THREADS", "1");
    let (two, _) = launch(c, &dir.join("logs"));
    let out = text(&two);
    assert!(two.status.success(), "{out}");
    assert!(out.contains("trained 4 updates on 2 ranks") && out.matches("saved ").count() == 1, "{out}");
    // Compared by what the parameters do (the loss on a fixed sequence), not element by element:
    // Adam moves an element whose gradient is at rounding level (attention's key bias, whose
    // exact gradient is zero) by up to a step either way, whatever sums its gradient.
    let loss = |d: &Path| crate::hf::reference_loss(&cellgraph::runtime::hf::load(d, &Default::default()).unwrap());
    let (base, one, two) = (loss(Path::new("tests/assets/tiny-gpt2")), loss(&dir.join("one")), loss(&dir.join("two")));
    eprintln!("reference loss: {base} before, {one} after one process, {two} after 2 ranks");
    assert!((one - two).abs() <= 1e-4 * (base - one).abs(), "loss {base} before, {one} after one process, {two} after 2 ranks");
}

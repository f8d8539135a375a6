//! Training callbacks (MindSpore's `LossMonitor`, `TimeMonitor`, `ModelCheckpoint`), a loss
//! log in JSON lines, and a progress bar.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::Backend;

use crate::accumulate::Accumulator;
use crate::error::{Result, RuntimeError};
use cellgraph_compiler::{HostData, HostTensor};

/// Where training stands: epochs completed and batches done in the current epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Position {
    pub epoch: usize,
    pub step: usize,
}

/// The accumulator's snapshot plus the training position (`cellgraph.epoch`, `cellgraph.step`).
pub fn snapshot_at<B: Backend>(acc: &Accumulator<B>, position: Position) -> crate::checkpoint::Tensors {
    let mut t = acc.snapshot();
    for (k, v) in [("cellgraph.epoch", position.epoch), ("cellgraph.step", position.step)] {
        t.insert(k.into(), HostTensor { shape: vec![], data: HostData::I64(vec![v as i64]) });
    }
    t
}

/// What a callback sees.
pub struct RunContext<'a, B: Backend> {
    /// 1-based epoch.
    pub epoch: usize,
    pub epochs: usize,
    /// Batches done in this epoch (1-based at `step_end`).
    pub step: usize,
    pub steps_per_epoch: usize,
    /// True when this step applied an optimizer update.
    pub applied: bool,
    /// Seconds the epoch took (at `epoch_end`).
    pub epoch_seconds: f64,
    /// Training position after this step (what a checkpoint resumes from).
    pub position: Position,
    pub accumulator: &'a Accumulator<B>,
    /// Set to stop training after this step (MindSpore's `request_stop`).
    pub stop_requested: bool,
}

impl<'a, B: Backend> RunContext<'a, B> {
    pub(crate) fn new(epoch: usize, epochs: usize, steps_per_epoch: usize, accumulator: &'a Accumulator<B>) -> Self {
        RunContext {
            epoch,
            epochs,
            step: 0,
            steps_per_epoch,
            applied: false,
            epoch_seconds: 0.0,
            position: Position::default(),
            accumulator,
            stop_requested: false,
        }
    }
    /// The last step's loss (NaN before the first step). On a device backend the step's loss
    /// stays on the device until a callback asks for it here (the first call after a step
    /// waits for the device to finish the step and reads it back; later ones do not).
    pub fn loss(&self) -> f64 {
        self.accumulator.step_loss()
    }

    /// Asks training to stop after this step.
    pub fn request_stop(&mut self) {
        self.stop_requested = true;
    }
}

/// Hooks called during `Model::train`.
pub trait Callback<B: Backend> {
    fn epoch_begin(&mut self, _cx: &mut RunContext<B>) -> Result<()> {
        Ok(())
    }
    fn step_end(&mut self, _cx: &mut RunContext<B>) -> Result<()> {
        Ok(())
    }
    fn epoch_end(&mut self, _cx: &mut RunContext<B>) -> Result<()> {
        Ok(())
    }
}

/// MindSpore 2.x's `LossMonitor(per_print_times)`: prints `epoch: E step: S, loss is L` when
/// the global step count (counted across epochs) has advanced by `per_print_times` since the
/// last print, so an epoch shorter than `per_print_times` steps still prints every few epochs.
/// `S` is the step within the epoch and `L` the f32 loss as Python prints it
/// (`loss is 7.793933868408203`); `per_print_times = 0` prints nothing. A NaN or infinite loss
/// stops training with an error either way.
pub struct LossMonitor {
    per_print_times: usize,
    last_print: usize,
    out: Box<dyn Write>,
}

impl LossMonitor {
    /// Prints to standard output.
    pub fn new(per_print_times: usize) -> Self {
        Self::to_writer(per_print_times, Box::new(std::io::stdout()))
    }
    /// Prints to `out` (a log file, a buffer in tests).
    pub fn to_writer(per_print_times: usize, out: Box<dyn Write>) -> Self {
        LossMonitor { per_print_times, last_print: 0, out }
    }
}

impl<B: Backend> Callback<B> for LossMonitor {
    fn step_end(&mut self, cx: &mut RunContext<B>) -> Result<()> {
        if !cx.loss().is_finite() {
            return Err(RuntimeError::BadValue {
                scope: format!("epoch {} step {}", cx.epoch, cx.step),
                op: "LossMonitor",
                detail: format!("loss is {}; training stopped (lower the learning rate or check the data)", cx.loss()),
            });
        }
        let global = (cx.epoch - 1) * cx.steps_per_epoch + cx.step;
        // A resumed run starts past the last print (MindSpore's rollback rule).
        while self.per_print_times != 0 && global <= self.last_print && self.last_print > 0 {
            self.last_print = self.last_print.saturating_sub(self.per_print_times);
        }
        if self.per_print_times != 0 && global - self.last_print >= self.per_print_times {
            self.last_print = global;
            let _ = writeln!(self.out, "epoch: {} step: {}, loss is {}", cx.epoch, cx.step, py_float(cx.loss() as f32 as f64));
            let _ = self.out.flush();
        }
        Ok(())
    }
}

/// `x` as Python's `repr(float)` writes it: the shortest digits that read back to `x`, in
/// fixed notation for exponents -4..16 and scientific (`1e-05`, `1.5e+16`) outside.
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `d.ddde[-]x`.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Prints `Train epoch time: X ms, per step time: Y ms` at the end of each epoch.
pub struct TimeMonitor {
    out: Box<dyn Write>,
}

impl TimeMonitor {
    /// Prints to standard output.
    pub fn new() -> Self {
        TimeMonitor { out: Box::new(std::io::stdout()) }
    }
}

impl Default for TimeMonitor {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Callback<B> for TimeMonitor {
    fn epoch_end(&mut self, cx: &mut RunContext<B>) -> Result<()> {
        let ms = cx.epoch_seconds * 1e3;
        let _ = writeln!(self.out, "Train epoch time: {ms:.3} ms, per step time: {:.3} ms", ms / cx.steps_per_epoch.max(1) as f64);
        Ok(())
    }
}

/// MindSpore's `CheckpointConfig`.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    pub save_checkpoint_steps: usize,
    pub keep_checkpoint_max: usize,
    /// File extension: `ckpt` (MindSpore's protobuf) or `safetensors` (native).
    pub format: &'static str,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { save_checkpoint_steps: 1, keep_checkpoint_max: 5, format: "safetensors" }
    }
}

/// Writes `{prefix}-{epoch}_{step}.{format}` every `save_checkpoint_steps` steps, keeping the
/// newest `keep_checkpoint_max` files. Each file holds everything needed to resume.
pub struct ModelCheckpoint {
    prefix: String,
    directory: PathBuf,
    config: CheckpointConfig,
    kept: VecDeque<PathBuf>,
    total_steps: usize,
}

impl ModelCheckpoint {
    /// Checkpoints named `{prefix}-...` in `directory`.
    pub fn new(prefix: &str, directory: &Path, config: CheckpointConfig) -> Self {
        ModelCheckpoint { prefix: prefix.into(), directory: directory.into(), config, kept: VecDeque::new(), total_steps: 0 }
    }
    /// Files written and still kept, oldest first.
    pub fn kept(&self) -> Vec<PathBuf> {
        self.kept.iter().cloned().collect()
    }
}

impl<B: Backend> Callback<B> for ModelCheckpoint {
    fn epoch_begin(&mut self, cx: &mut RunContext<B>) -> Result<()> {
        if self.total_steps == 0 && cx.accumulator.rank() == 0 {
            // Found before the first step, not at the first save.
            crate::checkpoint::check_writable(&self.directory.join(format!("{}-check.{}", self.prefix, self.config.format)))?;
        }
        Ok(())
    }
    fn step_end(&mut self, cx: &mut RunContext<B>) -> Result<()> {
        self.total_steps += 1;
        if !self.total_steps.is_multiple_of(self.config.save_checkpoint_steps.max(1)) {
            return Ok(());
        }
        let path = self.directory.join(format!("{}-{}_{}.{}", self.prefix, cx.epoch, cx.step, self.config.format));
        // Every rank takes the snapshot (with hsdp it gathers the optimizer state); rank 0
        // writes it, since parameters are replicated.
        let t = snapshot_at(cx.accumulator, cx.position);
        if cx.accumulator.rank() != 0 {
            return Ok(());
        }
        crate::checkpoint::save(&path, &t, &Default::default())?;
        self.kept.retain(|p| p != &path);
        self.kept.push_back(path);
        while self.kept.len() > self.config.keep_checkpoint_max.max(1) {
            if let Some(old) = self.kept.pop_front() {
                let _ = std::fs::remove_file(old);
            }
        }
        Ok(())
    }
}

/// Appends one JSON object per step (`epoch`, `step`, `updates`, `loss`) to a file, for plots.
pub struct LossLog {
    file: std::fs::File,
    path: PathBuf,
}

impl LossLog {
    /// Creates (truncates) the log file.
    pub fn create(path: &Path) -> Result<Self> {
        let file = std::fs::File::create(path).map_err(|source| RuntimeError::Io { path: path.display().to_string(), source })?;
        Ok(LossLog { file, path: path.into() })
    }
}

impl<B: Backend> Callback<B> for LossLog {
    fn step_end(&mut self, cx: &mut RunContext<B>) -> Result<()> {
        let line = serde_json::json!({"epoch": cx.epoch, "step": cx.step, "updates": cx.accumulator.updates(), "loss": cx.loss()});
        writeln!(self.file, "{line}").map_err(|source| RuntimeError::Io { path: self.path.display().to_string(), source })
    }
}

/// A progress bar on standard error when it is a terminal; silent otherwise.
pub struct ProgressBar {
    bar: Option<indicatif::ProgressBar>,
}

impl ProgressBar {
    /// A bar, shown only on a terminal.
    pub fn new() -> Self {
        use std::io::IsTerminal;
        ProgressBar { bar: std::io::stderr().is_terminal().then(indicatif::ProgressBar::hidden) }
    }
}

impl Default for ProgressBar {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Callback<B> for ProgressBar {
    fn epoch_begin(&mut self, cx: &mut RunContext<B>) -> Result<()> {
        if self.bar.is_some() {
            let b = indicatif::ProgressBar::new(cx.steps_per_epoch as u64);
            b.set_style(indicatif::ProgressStyle::with_template("epoch {msg} [{bar:30}] {pos}/{len} {per_sec}").expect("valid template"));
            b.set_message(format!("{}/{}", cx.epoch, cx.epochs));
            self.bar = Some(b);
        }
        Ok(())
    }
    fn step_end(&mut self, cx: &mut RunContext<B>) -> Result<()> {
        if let Some(b) = &self.bar {
            b.set_position(cx.step as u64);
        }
        Ok(())
    }
    fn epoch_end(&mut self, _cx: &mut RunContext<B>) -> Result<()> {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        Ok(())
    }
}

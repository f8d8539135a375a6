//! Running a [`GradAccumulation`] network: micro-steps, window boundaries, counters.
//!
//! The [`Accumulator`] owns the compiled `micro_step` graphs (one per micro-batch shape, so a
//! short last batch just compiles another), the `optimizer` and `clear` graphs, and a
//! [`Session`] holding parameters, accumulators and optimizer state. A window ends after
//! `micro_size` micro-batches: the optimizer runs once with the window's normalisation scale
//! and its update number (for the learning-rate schedule), then clear runs once.

use std::collections::HashMap;
use std::rc::Rc;

use burn_backend::tensor::Device;
use burn_backend::Backend;
use cellgraph_cells::{Cell, GradAccumulation, Normalization, Optimizer, Slicing};
use cellgraph_compiler::{HostData, HostTensor, TensorType};

use crate::error::Result;
use crate::exec::{compile, Executable, Session};

/// How many times each graph ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub micro_steps: u64,
    pub optimizer_runs: u64,
    pub clear_runs: u64,
}

/// What one call to [`Accumulator::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// The step's loss: the sum of its micro losses (in-step slicing) or the micro loss.
    pub loss: f64,
    /// True when this step ended a window and the optimizer ran.
    pub applied: bool,
}

/// Drives one GradAccumulation network on one device.
pub struct Accumulator<B: Backend> {
    net: Rc<GradAccumulation>,
    opt: Rc<dyn Optimizer>,
    micro: HashMap<Vec<TensorType>, Executable>,
    optimizer: Executable,
    clear: Executable,
    /// Parameters, accumulators and optimizer state.
    pub session: Session<B>,
    window_micro: usize,
    window_items: usize,
    updates: u64,
    counters: Counters,
    names: Vec<String>,
}

/// Rows `start..end` (along dim 0) of a host tensor.
pub fn slice_rows(t: &HostTensor, start: usize, end: usize) -> HostTensor {
    let row: usize = t.shape[1..].iter().product();
    let (a, b) = (start * row, end * row);
    let data = match &t.data {
        HostData::F32(v) => HostData::F32(v[a..b].to_vec()),
        HostData::F64(v) => HostData::F64(v[a..b].to_vec()),
        HostData::I32(v) => HostData::I32(v[a..b].to_vec()),
        HostData::I64(v) => HostData::I64(v[a..b].to_vec()),
        HostData::Bool(v) => HostData::Bool(v[a..b].to_vec()),
    };
    let mut shape = t.shape.clone();
    shape[0] = end - start;
    HostTensor { shape, data }
}

impl<B: Backend> Accumulator<B> {
    /// Compiles the boundary graphs of `net` and fills a new session on `device`: parameters
    /// drawn from `seed`, zero accumulators, initial optimizer state. Micro-step graphs are
    /// compiled on first use, one per micro-batch shape.
    pub fn new(net: Rc<GradAccumulation>, opt: Rc<dyn Optimizer>, device: Device<B>, seed: u64) -> Result<Self> {
        let (optimizer, clear, accumulators, state) = net.boundary_graphs(opt.as_ref())?;
        let mut session = Session::new(device);
        session.init_params(&net.parameters(), seed);
        for (name, ty) in &accumulators {
            session.set_param(name, &HostTensor::full(ty, 0.0));
        }
        session.init_state(&state);
        Ok(Accumulator {
            net,
            opt,
            micro: HashMap::new(),
            optimizer: compile(optimizer)?,
            clear: compile(clear)?,
            session,
            window_micro: 0,
            window_items: 0,
            updates: 0,
            counters: Counters::default(),
            names: Vec::new(),
        })
    }

    /// Names the inputs of micro-step graphs (default `input0`, `input1`, ...), as they appear
    /// in dumps.
    pub fn set_input_names(&mut self, names: &[&str]) {
        self.names = names.iter().map(|n| n.to_string()).collect();
    }

    /// The wrapped network.
    pub fn network(&self) -> &GradAccumulation {
        &self.net
    }

    /// The graphs' run counts.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Optimizer updates applied so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Micro-batches accumulated in the open window.
    pub fn window_len(&self) -> usize {
        self.window_micro
    }

    /// The compiled micro-step for a first micro-batch of the given shapes (for dumps).
    pub fn micro_plans(&self) -> impl Iterator<Item = &Executable> {
        self.micro.values()
    }

    /// The compiled optimizer and clear plans.
    pub fn boundary_plans(&self) -> (&Executable, &Executable) {
        (&self.optimizer, &self.clear)
    }

    /// Runs one micro-batch: forward, backward, gradients added into the accumulators.
    pub fn micro_step(&mut self, inputs: &[HostTensor]) -> Result<f64> {
        let key: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
        if !self.micro.contains_key(&key) {
            let named: Vec<(String, TensorType)> = key
                .iter()
                .enumerate()
                .map(|(i, t)| (self.names.get(i).cloned().unwrap_or_else(|| format!("input{i}")), t.clone()))
                .collect();
            let g = self.net.micro_step_graph(&named)?;
            self.micro.insert(key.clone(), compile(g)?);
        }
        let loss = self.session.run(&self.micro[&key], inputs)?[0].scalar();
        self.counters.micro_steps += 1;
        self.window_micro += 1;
        self.window_items += inputs.first().and_then(|t| t.shape.first().copied()).unwrap_or(1);
        Ok(loss)
    }

    /// Ends the open window: the optimizer once (normalised by the window's true counts),
    /// then clear once. Does nothing on an empty window.
    pub fn apply(&mut self) -> Result<()> {
        if self.window_micro == 0 {
            return Ok(());
        }
        let scale = match self.net.normalization {
            Normalization::Sum => 1.0,
            Normalization::Mean => 1.0 / self.window_micro as f64,
            Normalization::ItemWeighted => 1.0 / self.window_items as f64,
        };
        let mut inputs = vec![HostTensor::scalar_f32(scale)];
        inputs.extend(self.opt.scalar_values(self.updates).into_iter().map(HostTensor::scalar_f32));
        self.session.run(&self.optimizer, &inputs)?;
        self.counters.optimizer_runs += 1;
        self.updates += 1;
        self.clear_window()
    }

    /// Everything needed to resume bit-identically: parameters, accumulators, optimizer
    /// state, and the counters as `cellgraph.*` int64 scalars.
    pub fn snapshot(&self) -> crate::checkpoint::Tensors {
        let mut t = self.session.params_host();
        let counters = [
            ("cellgraph.updates", self.updates as i64),
            ("cellgraph.window_micro", self.window_micro as i64),
            ("cellgraph.window_items", self.window_items as i64),
            ("cellgraph.micro_steps", self.counters.micro_steps as i64),
            ("cellgraph.optimizer_runs", self.counters.optimizer_runs as i64),
            ("cellgraph.clear_runs", self.counters.clear_runs as i64),
        ];
        for (k, v) in counters {
            t.insert(k.into(), HostTensor { shape: vec![], data: HostData::I64(vec![v]) });
        }
        t
    }

    /// Loads a snapshot (or a MindSpore checkpoint holding just parameters): tensors whose
    /// names the session knows replace their values, after a shape check; counters are
    /// restored when present. Unknown names are an error naming them.
    pub fn restore(&mut self, tensors: &crate::checkpoint::Tensors) -> Result<()> {
        let known: std::collections::BTreeSet<String> = self.session.param_names().into_iter().collect();
        let mut unknown = Vec::new();
        for (name, t) in tensors {
            if let Some(counter) = name.strip_prefix("cellgraph.") {
                let v = t.scalar() as u64;
                match counter {
                    "updates" => self.updates = v,
                    "window_micro" => self.window_micro = v as usize,
                    "window_items" => self.window_items = v as usize,
                    "micro_steps" => self.counters.micro_steps = v,
                    "optimizer_runs" => self.counters.optimizer_runs = v,
                    "clear_runs" => self.counters.clear_runs = v,
                    _ => {}
                }
            } else if known.contains(name) {
                let have = self.session.param(name).expect("known").shape;
                if have != t.shape {
                    return Err(crate::error::RuntimeError::Mismatch {
                        what: format!("checkpoint tensor `{name}`"),
                        expected: format!("shape {have:?}"),
                        got: format!("shape {:?}", t.shape),
                    });
                }
                self.session.set_param(name, t);
            } else if !matches!(name.as_str(), "global_step" | "learning_rate" | "epoch_num" | "step_num") {
                unknown.push(name.clone());
            }
        }
        if !unknown.is_empty() {
            return Err(crate::error::RuntimeError::Mismatch {
                what: "checkpoint".into(),
                expected: "only parameters of this network, its accumulators and optimizer state".into(),
                got: format!("unknown tensors {unknown:?}"),
            });
        }
        Ok(())
    }

    fn clear_window(&mut self) -> Result<()> {
        self.session.run(&self.clear, &[])?;
        self.counters.clear_runs += 1;
        self.window_micro = 0;
        self.window_items = 0;
        Ok(())
    }

    /// One training step. In-step slicing: the batch is split into `micro_size` micro-batches
    /// and the window applied; the loss is their sum. Across steps: the batch is one
    /// micro-batch, and the window is applied when it is full.
    pub fn step(&mut self, batch: &[HostTensor]) -> Result<StepOutcome> {
        let k = self.net.micro_size;
        match self.net.slicing {
            Slicing::InStep => {
                let b = batch.first().and_then(|t| t.shape.first().copied()).unwrap_or(0);
                self.net.check_batch(b)?;
                let m = b / k;
                let mut loss = 0.0;
                for i in 0..k {
                    let micro: Vec<HostTensor> = batch.iter().map(|t| slice_rows(t, i * m, (i + 1) * m)).collect();
                    loss += self.micro_step(&micro)?;
                }
                self.apply()?;
                Ok(StepOutcome { loss, applied: true })
            }
            Slicing::AcrossSteps => {
                let loss = self.micro_step(batch)?;
                let applied = self.window_micro == k;
                if applied {
                    self.apply()?;
                }
                Ok(StepOutcome { loss, applied })
            }
        }
    }

    /// At the end of the data: an incomplete window is applied with its true counts, or
    /// dropped (accumulators cleared, no update) when the network asks for that. Returns
    /// whether an update was applied.
    pub fn finish(&mut self) -> Result<bool> {
        if self.window_micro == 0 {
            return Ok(false);
        }
        if self.net.drop_incomplete_window {
            self.clear_window()?;
            return Ok(false);
        }
        self.apply()?;
        Ok(true)
    }
}

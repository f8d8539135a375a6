//! `GradAccumulation`: a network (with its loss) trained in windows of micro-batches.
//!
//! Three MindSpore flavours, one wrapper:
//! - [`GradAccumulation::new`] (`mindspore.parallel.GradAccumulation(net, micro_size)`): each
//!   step's batch is sliced along dim 0 into `micro_size` micro-batches; the step's loss is the
//!   SUM of the micro losses; gradients are summed.
//! - [`GradAccumulation::across_steps`] (the r1.6 tutorial's `mini_steps`): one step is one
//!   micro-batch; every `mini_steps` steps the optimizer runs on the summed gradients.
//! - [`GradAccumulation::boost`] (`mindspore.boost.GradientAccumulation`): like
//!   `across_steps`, with the MEAN of the gradients.
//!
//! [`Normalization`] picks sum, mean over micro-batches, mean over items (correct when
//! micro-batches differ in size), or mean over tokens (a summing loss that counts its
//! non-ignored tokens: the window's count over micro-batches and ranks divides once). Parameter names are the wrapped network's, unchanged.

pub use cellgraph_compiler::passes::grad_accumulation::{accumulator_name, LossScale, Normalization, Precision};
use cellgraph_compiler::passes::grad_accumulation::{clear_graph, clip_graph, micro_graph, optimizer_graph, AccumulationOptions};
use cellgraph_compiler::update::StateSpec;

/// [`GradAccumulation::boundary_graphs`]: the optimizer graph, the clear graph, the optimizer
/// state's parameters (name, type) and their specs.
pub type BoundaryGraphs = (Graph, Graph, Vec<(String, TensorType)>, Vec<StateSpec>);
use cellgraph_compiler::Graph;
use cellgraph_compiler::{NodeId, TensorType};

use crate::cell::{Cell, Tracer};
use crate::error::{CellError, Result};
use crate::optim::Optimizer;
use crate::param::Parameter;

/// Where micro-batches come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slicing {
    /// One step's batch is split into `micro_size` equal micro-batches.
    InStep,
    /// Each step is one micro-batch; a window spans `micro_size` steps.
    AcrossSteps,
}

/// A network whose gradients are accumulated over `micro_size` micro-batches per update.
pub struct GradAccumulation {
    pub network: Box<dyn Cell>,
    pub micro_size: usize,
    pub slicing: Slicing,
    pub normalization: Normalization,
    /// Clip the window's gradient to this global norm, once per window.
    pub clip_global_norm: Option<f64>,
    /// At the end of the data, drop an incomplete window instead of applying it.
    pub drop_incomplete_window: bool,
    /// Mixed precision (emulated low-precision compute, f32 accumulators and optimizer state,
    /// optional dynamic loss scaling); `None`: f32 throughout.
    pub precision: Option<Precision>,
}

impl GradAccumulation {
    /// MindSpore's `parallel.GradAccumulation(network, micro_size)`.
    pub fn new(network: impl Cell + 'static, micro_size: usize) -> Self {
        GradAccumulation {
            network: Box::new(network),
            micro_size,
            slicing: Slicing::InStep,
            normalization: Normalization::Sum,
            clip_global_norm: None,
            drop_incomplete_window: false,
            precision: None,
        }
    }
    /// The r1.6 tutorial's accumulation over `mini_steps` successive steps (summed).
    pub fn across_steps(network: impl Cell + 'static, mini_steps: usize) -> Self {
        GradAccumulation { slicing: Slicing::AcrossSteps, ..Self::new(network, mini_steps) }
    }
    /// MindSpore boost's `GradientAccumulation(max_accumulation_step)`: the mean over steps.
    pub fn boost(network: impl Cell + 'static, max_accumulation_step: usize) -> Self {
        GradAccumulation { normalization: Normalization::Mean, ..Self::across_steps(network, max_accumulation_step) }
    }
    /// Sets the normalisation.
    pub fn normalization(mut self, n: Normalization) -> Self {
        self.normalization = n;
        self
    }
    /// Clips each window's gradient to global norm `max_norm`.
    pub fn clip_global_norm(mut self, max_norm: f64) -> Self {
        self.clip_global_norm = Some(max_norm);
        self
    }
    /// Computes in low precision: [`Precision::bf16`] or [`Precision::f16`] (with dynamic loss
    /// scaling), emulated (f32 arithmetic, values rounded where they are stored).
    pub fn precision(mut self, p: Precision) -> Self {
        self.precision = Some(p);
        self
    }
    /// Drops an incomplete last window instead of stepping with the true count.
    pub fn drop_incomplete_window(mut self) -> Self {
        self.drop_incomplete_window = true;
        self
    }

    /// Checks the configuration: `micro_size` at least 1, a clipping norm finite and positive.
    pub fn check(&self) -> Result<()> {
        let what = match self.slicing {
            Slicing::InStep => "micro_size",
            Slicing::AcrossSteps => "the number of steps per window (mini_steps, max_accumulation_step)",
        };
        if self.micro_size == 0 {
            return Err(CellError::Config { cell: "GradAccumulation".into(), detail: format!("{what} must be at least 1, got 0") });
        }
        if let Some(c) = self.clip_global_norm.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(CellError::Config {
                cell: "GradAccumulation".into(),
                detail: format!("clip_global_norm must be a finite number > 0, got {c}"),
            });
        }
        if let Some(p) = &self.precision {
            use cellgraph_compiler::DType;
            let config = |detail: String| Err(CellError::Config { cell: "GradAccumulation".into(), detail });
            if !matches!(p.compute, DType::F16 | DType::BF16 | DType::F32) {
                return config(format!("precision: compute must be f16, bf16 or f32, got {}", p.compute.name()));
            }
            if p.accumulators != DType::F32 && p.accumulators != p.compute {
                return config(format!(
                    "precision: accumulators must be f32 or the compute format ({}), got {}",
                    p.compute.name(),
                    p.accumulators.name()
                ));
            }
            if let Some(s) = p.loss_scale {
                if !(s.init.is_finite() && s.init > 0.0) || s.growth_interval == 0 {
                    return config(format!(
                        "loss scale: init must be a finite number > 0 and growth_interval at least 1, got {} and {}",
                        s.init, s.growth_interval
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the configuration and a step's batch size.
    pub fn check_batch(&self, batch: usize) -> Result<()> {
        self.check()?;
        if self.slicing == Slicing::InStep && !batch.is_multiple_of(self.micro_size) {
            return Err(CellError::Config {
                cell: "GradAccumulation".into(),
                detail: format!(
                    "the 0th dimension of the inputs ({batch}) must be divided by micro_size ({}); use a batch size that is a multiple of {}",
                    self.micro_size, self.micro_size
                ),
            });
        }
        Ok(())
    }

    fn options(&self) -> AccumulationOptions {
        AccumulationOptions { normalization: self.normalization, clip_global_norm: self.clip_global_norm, precision: self.precision }
    }

    fn trained(&self) -> Vec<(String, TensorType)> {
        self.network.trainable_params().into_iter().map(|p| (p.name, p.ty)).collect()
    }

    /// The `micro_step` graph for micro-batches of the given types.
    pub fn micro_step_graph(&self, micro_inputs: &[(String, TensorType)]) -> Result<Graph> {
        Ok(self.traced_micro_step(micro_inputs)?.1)
    }

    /// The traced forward graph (named `forward`) and the `micro_step` graph rewritten from it.
    pub fn traced_micro_step(&self, micro_inputs: &[(String, TensorType)]) -> Result<(Graph, Graph)> {
        let (forward, loss) = self.trace_forward(micro_inputs)?;
        let names: Vec<String> = self.trained().into_iter().map(|(n, _)| n).collect();
        let micro = micro_graph(&forward, loss, &names, &self.options())?;
        Ok((forward, micro))
    }

    /// The `optimizer` and `clear` graphs (they do not depend on the micro-batch shape), the
    /// accumulators and the optimizer state.
    pub fn boundary_graphs(&self, opt: &dyn Optimizer) -> Result<BoundaryGraphs> {
        let trained = self.trained();
        let (optimizer, state) = optimizer_graph(&trained, opt, &self.options())?;
        let clear = clear_graph(&trained)?;
        let accumulators = trained.iter().map(|(n, t)| (accumulator_name(n), t.clone())).collect();
        Ok((optimizer, clear, accumulators, state))
    }

    /// The `clip` graph (the optimizer graph's clipping by global norm alone: the factor, then
    /// the norm; see [`clip_graph`]), `None` without clipping.
    pub fn clip_graph(&self) -> Result<Option<Graph>> {
        self.clip_global_norm.map(|max| clip_graph(&self.trained(), max)).transpose().map_err(Into::into)
    }

    /// The `window_stats` graph: the state updates the network's cells make once per window,
    /// at its boundary ([`Phase::Boundary`](crate::cell::Phase): batch norm's once-per-window
    /// statistics), traced on micro-batches of the given types; `None` when no cell has any.
    pub fn window_graph(&self, micro_inputs: &[(String, TensorType)]) -> Result<Option<Graph>> {
        let mut t = Tracer::boundary("window_stats");
        let xs = micro_inputs.iter().map(|(n, ty)| t.input(n, ty.clone())).collect::<Result<Vec<_>>>()?;
        t.call(self.network.as_ref(), &xs)?;
        let mut g = t.finish(Vec::new());
        if g.effects().is_empty() {
            return Ok(None);
        }
        cellgraph_compiler::passes::dce::dce(&mut g);
        Ok(Some(g))
    }

    fn trace_forward(&self, micro_inputs: &[(String, TensorType)]) -> Result<(Graph, NodeId)> {
        let mut t = Tracer::new("forward");
        let xs = micro_inputs.iter().map(|(n, ty)| t.input(n, ty.clone())).collect::<Result<Vec<_>>>()?;
        let loss = t.call(self.network.as_ref(), &xs)?;
        for p in self.network.trainable_params() {
            t.param(&p)?;
        }
        // A loss that counts its tokens leaves the count as a second output.
        let outputs = std::iter::once(loss).chain(t.count()).collect();
        Ok((t.finish(outputs), loss))
    }
}

impl Cell for GradAccumulation {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        t.call(self.network.as_ref(), xs)
    }
    fn parameters(&self) -> Vec<Parameter> {
        self.network.parameters()
    }
    fn kind(&self) -> &'static str {
        "GradAccumulation"
    }
    fn backbone(&self) -> Option<&dyn Cell> {
        self.network.backbone()
    }
    fn set_train(&mut self, train: bool) {
        self.network.set_train(train);
    }
}

/// MindSpore's `AutoParallel(net)` for data parallelism over a [`GradAccumulation`] network:
/// the accumulated gradients cross ranks once per window. Gradients are summed across ranks
/// (MindSpore's default) unless [`AutoParallel::enable_gradients_mean`]; [`AutoParallel::hsdp`]
/// shards the optimizer state (ZeRO-1: reduce-scatter the gradients, update a 1/size slice
/// of the flat parameters, all-gather them).
pub struct AutoParallel {
    pub network: GradAccumulation,
    pub hsdp: bool,
    pub gradients_mean: bool,
}

impl AutoParallel {
    /// Data parallel, gradients summed across ranks, optimizer state replicated.
    pub fn new(network: GradAccumulation) -> Self {
        AutoParallel { network, hsdp: false, gradients_mean: false }
    }
    /// Shards optimizer state (and the update) across ranks.
    pub fn hsdp(mut self) -> Self {
        self.hsdp = true;
        self
    }
    /// Averages gradients across ranks instead of summing them.
    pub fn enable_gradients_mean(mut self) -> Self {
        self.gradients_mean = true;
        self
    }
}

impl From<GradAccumulation> for AutoParallel {
    fn from(network: GradAccumulation) -> Self {
        AutoParallel::new(network)
    }
}

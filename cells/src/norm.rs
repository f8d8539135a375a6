//! Batch normalisation (MindSpore's `nn.BatchNorm2d`), written as the graph's own ops.
//!
//! Training (a training trace, [`Tracer::training`]): each call normalises with the statistics
//! of the batch it is given, over `N, H, W` per channel, with the biased variance, and writes
//! the moving statistics once (`assign`):
//!
//! ```text
//! moving_mean     = momentum * moving_mean     + (1 - momentum) * mean
//! moving_variance = momentum * moving_variance + (1 - momentum) * var * n / (n - 1)
//! ```
//!
//! MindSpore's convention (`momentum = 0.9` keeps 90% of the old value); PyTorch's `momentum`
//! is the other share (`torch.nn.BatchNorm2d(momentum=0.1)` is `BatchNorm2d::momentum(0.9)`
//! here), and both update the moving variance with the unbiased variance (`n = N * H * W`).
//! Inference traces normalise with the moving statistics and write nothing.
//!
//! Under gradient accumulation every micro-step is such a call: each micro-batch normalises
//! with its own statistics and updates the moving ones, which is what MindSpore, PyTorch,
//! Accelerate, Colossal-AI and DeepSpeed do. K micro-batches of `b` therefore equal *ghost*
//! batch normalisation of the `K * b` batch in groups of `b` ([`BatchNorm2d::ghost_batch`]),
//! not batch normalisation of the whole window.
//!
//! Option [`BatchNorm2d::window_statistics`]: each micro-step still normalises with its own
//! batch's statistics (no mode can normalise with statistics of micro-batches not yet seen),
//! but instead of updating the moving statistics it merges its batch's count, mean and sum of
//! squared deviations into window state (`window_count`, `window_mean`, `window_m2`: Chan et
//! al.'s pairwise update, exact where raw sums of squares cancel); at the window's boundary
//! the moving statistics are updated ONCE from the whole window's mean and unbiased variance,
//! and the window state is zeroed.
//!
//! Option [`BatchNorm2d::sync`] (MindSpore's and PyTorch's `SyncBatchNorm`): under data
//! parallelism each micro-step normalises with the statistics of the micro-batch of *every*
//! rank together: W ranks with micro-batches of `b` normalise as one process with micro-batches
//! of `W * b`. The statistics cross the ranks in the graph (`all_reduce`): the per-channel sums
//! with the item count, then the sums of squared deviations from that global mean (the
//! two-pass variance, which does not cancel), and the gradient sums both back: four
//! collectives per batch norm per micro-step, counted in `Counters::step_collectives`. The
//! moving statistics, updated from the global statistics, stay equal on every rank. In a world
//! of one it is the default batch norm.
//!
//! The ops are the graph's own (reductions, elementwise arithmetic), so the gradient is the
//! autodiff of what runs, and the compiler's passes fuse the elementwise parts.

use cellgraph_compiler::{NodeId, Op, ReduceAttrs, TensorType};

use crate::cell::{expect_inputs, Cell, Phase, Tracer};
use crate::error::{CellError, Result};
use crate::init::Initializer;
use crate::param::{Parameter, Scope};

/// Batch normalisation over the channels of NCHW input, with MindSpore's parameter names
/// (`gamma`, `beta`, `moving_mean`, `moving_variance`), defaults (`eps = 1e-5`,
/// `momentum = 0.9`, gamma ones, beta zeros, moving mean zeros, moving variance ones) and
/// momentum convention (see the module documentation).
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    path: String,
    gamma: Parameter,
    beta: Parameter,
    moving_mean: Parameter,
    moving_variance: Parameter,
    eps: f64,
    momentum: f64,
    ghost: Option<usize>,
    /// Statistics summed across ranks (SyncBatchNorm).
    sync: bool,
    /// `window_count`, `window_mean`, `window_m2` when the moving statistics are updated once
    /// per accumulation window.
    window: Option<[Parameter; 3]>,
}

impl BatchNorm2d {
    /// Batch normalisation of `num_features` channels.
    pub fn new(s: &Scope, num_features: usize) -> Self {
        let ty = TensorType::f32([num_features]);
        let state = |name: &str, init| Parameter { requires_grad: false, ..s.param(name, ty.clone(), init) };
        BatchNorm2d {
            path: s.path().to_string(),
            moving_mean: state("moving_mean", Initializer::Zeros),
            moving_variance: state("moving_variance", Initializer::Ones),
            gamma: s.param("gamma", ty.clone(), Initializer::Ones),
            beta: s.param("beta", ty.clone(), Initializer::Zeros),
            eps: 1e-5,
            momentum: 0.9,
            ghost: None,
            sync: false,
            window: None,
        }
    }

    /// Updates the moving statistics once per gradient-accumulation window, from the mean and
    /// unbiased variance of every item the window's micro-steps normalised (see the module
    /// documentation). Adds three state tensors, zero between windows: `window_count` (a
    /// scalar; f32, so exact up to 2^24 values per channel per window), `window_mean` and
    /// `window_m2` (`[C]`). Outside [`GradAccumulation`](crate::GradAccumulation) nothing runs
    /// the boundary and the moving statistics stay put.
    pub fn window_statistics(mut self) -> Result<Self> {
        if self.ghost.is_some() {
            return Err(self.config("ghost batches and once-per-window statistics do not combine: choose one".into()));
        }
        let c = self.num_features();
        let scope = if self.path.is_empty() { Scope::root() } else { Scope::root().child(&self.path) };
        let state = |name: &str, ty: TensorType| Parameter { requires_grad: false, ..scope.param(name, ty, Initializer::Zeros) };
        self.window = Some([
            state("window_count", TensorType::f32(cellgraph_compiler::Shape::scalar())),
            state("window_mean", TensorType::f32([c])),
            state("window_m2", TensorType::f32([c])),
        ]);
        Ok(self)
    }

    /// Sets `eps`, added to the variance (positive).
    pub fn eps(mut self, eps: f64) -> Result<Self> {
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(self.config(format!("eps must be positive and finite, got {eps}")));
        }
        self.eps = eps;
        Ok(self)
    }

    /// Sets the momentum in MindSpore's convention: the share of the old moving statistics
    /// kept at each update, in `[0, 1]` (PyTorch's `momentum` is `1 -` this).
    pub fn momentum(mut self, momentum: f64) -> Result<Self> {
        if !(0.0..=1.0).contains(&momentum) {
            return Err(self.config(format!(
                "momentum must be in [0, 1] (MindSpore's convention: the share of the old moving statistics kept), got {momentum}"
            )));
        }
        self.momentum = momentum;
        Ok(self)
    }

    /// Ghost batch normalisation: in training, the batch is normalised in consecutive groups
    /// of `size` items, each with its own statistics (the batch size must be a multiple of
    /// `size`); the moving statistics are updated once, from the groups' means and unbiased
    /// variances averaged over the groups. What K micro-batches of `size` do under gradient
    /// accumulation, in one call.
    pub fn ghost_batch(mut self, size: usize) -> Result<Self> {
        if self.window.is_some() {
            return Err(self.config("ghost batches and once-per-window statistics do not combine: choose one".into()));
        }
        if self.sync {
            return Err(self.config("ghost batches and statistics synchronised across ranks do not combine: choose one".into()));
        }
        if size == 0 {
            return Err(self.config("a ghost batch needs at least one item".into()));
        }
        self.ghost = Some(size);
        Ok(self)
    }

    /// SyncBatchNorm: in training, the statistics are those of every rank's batch together
    /// (see the module documentation); four collectives per micro-step. Combines with
    /// [`Self::window_statistics`], not with ghost batches.
    pub fn sync(mut self) -> Result<Self> {
        if self.ghost.is_some() {
            return Err(self.config("ghost batches and statistics synchronised across ranks do not combine: choose one".into()));
        }
        self.sync = true;
        Ok(self)
    }

    /// The channel count.
    pub fn num_features(&self) -> usize {
        self.gamma.ty.dims()[0]
    }

    fn config(&self, detail: String) -> CellError {
        CellError::Config { cell: format!("BatchNorm2d `{}`", self.path), detail }
    }

    /// A `[C]` parameter viewed as `[1, C, 1, 1]` (or with a leading group axis).
    fn per_channel(&self, t: &mut Tracer, p: NodeId, rank: usize) -> Result<NodeId> {
        let c = self.num_features();
        let mut shape = vec![1; rank];
        shape[rank - 3] = c;
        t.op(Op::Reshape { shape: shape.into() }, &[p])
    }

    /// Normalises `x` (`[..., C, H, W]` with the statistics' axes `axes`) with its own
    /// statistics; returns `(y, mean, biased variance)`, the statistics with kept axes.
    fn normalise_with_batch(&self, t: &mut Tracer, x: NodeId, axes: Vec<usize>) -> Result<(NodeId, NodeId, NodeId)> {
        let mean = t.op(Op::ReduceMean(ReduceAttrs { axes: axes.clone(), keep_dims: true }), &[x])?;
        let xc = t.op(Op::Sub, &[x, mean])?;
        let sq = t.op(Op::Mul, &[xc, xc])?;
        let var = t.op(Op::ReduceMean(ReduceAttrs { axes, keep_dims: true }), &[sq])?;
        let y = self.scale(t, xc, var)?;
        Ok((y, mean, var))
    }

    /// Normalises NCHW `x` with the statistics of every rank's batch together; `count` is
    /// this rank's values per channel. Returns `(y, mean, biased variance, count)`, the
    /// statistics `[C]` and the count of all ranks `[1]`.
    fn normalise_across_ranks(&self, t: &mut Tracer, x: NodeId, count: usize) -> Result<(NodeId, NodeId, NodeId, NodeId)> {
        let c = self.num_features();
        let dtype = t.ty(x).dtype;
        let sum = |t: &mut Tracer, v| t.op(Op::ReduceSum(ReduceAttrs { axes: vec![0, 2, 3], keep_dims: false }), &[v]);
        let part = |t: &mut Tracer, v, range: std::ops::Range<usize>| t.op(Op::Slice { begin: vec![range.start], end: vec![range.end] }, &[v]);
        // The sums and the count, in one collective.
        let s = sum(t, x)?;
        let n = t.constant(count as f64, TensorType::new(dtype, [1]))?;
        let packed = t.op(Op::Concat { axis: 0 }, &[s, n])?;
        let total = t.op(Op::AllReduce, &[packed])?;
        let (s, n) = (part(t, total, 0..c)?, part(t, total, c..c + 1)?);
        let mean = t.op(Op::Div, &[s, n])?;
        let m = self.per_channel(t, mean, 4)?;
        let xc = t.op(Op::Sub, &[x, m])?;
        // Then the squared deviations from the global mean.
        let sq = t.op(Op::Mul, &[xc, xc])?;
        let q = sum(t, sq)?;
        let q = t.op(Op::AllReduce, &[q])?;
        let var = t.op(Op::Div, &[q, n])?;
        let v = self.per_channel(t, var, 4)?;
        let y = self.scale(t, xc, v)?;
        Ok((y, mean, var, n))
    }

    /// `xc / sqrt(var + eps)`.
    fn scale(&self, t: &mut Tracer, xc: NodeId, var: NodeId) -> Result<NodeId> {
        let ty = t.ty(var).clone();
        let eps = t.constant(self.eps, TensorType::new(ty.dtype, cellgraph_compiler::Shape::scalar()))?;
        let v = t.op(Op::Add, &[var, eps])?;
        let sd = t.op(Op::Sqrt, &[v])?;
        t.op(Op::Div, &[xc, sd])
    }

    /// `old * momentum + new * (1 - momentum)` written into `p` (`new`: `[C]`).
    fn update(&self, t: &mut Tracer, p: &Parameter, new: NodeId) -> Result<NodeId> {
        let old = t.param(p)?;
        let scalar = TensorType::f32(cellgraph_compiler::Shape::scalar());
        let (m, rest) = (t.constant(self.momentum, scalar.clone())?, t.constant(1.0 - self.momentum, scalar)?);
        let kept = t.op(Op::Mul, &[old, m])?;
        let added = t.op(Op::Mul, &[new, rest])?;
        let v = t.op(Op::Add, &[kept, added])?;
        t.assign(p, v)
    }

    /// Merges one batch of `n_b` values per channel (its mean and biased variance, `[C]`) into
    /// the window state: `n = n_a + n_b`, `d = mean_b - mean_a`,
    /// `mean = mean_a + d * n_b / n`, `m2 = m2_a + var_b * n_b + d^2 * n_a * n_b / n`.
    fn merge_window(&self, t: &mut Tracer, w: &[Parameter; 3], nb: NodeId, mean_b: NodeId, var_b: NodeId) -> Result<()> {
        let (n_a, mean_a, m2_a) = (t.param(&w[0])?, t.param(&w[1])?, t.param(&w[2])?);
        let n = t.op(Op::Add, &[n_a, nb])?;
        let share = t.op(Op::Div, &[nb, n])?;
        let d = t.op(Op::Sub, &[mean_b, mean_a])?;
        let step = t.op(Op::Mul, &[d, share])?;
        let mean = t.op(Op::Add, &[mean_a, step])?;
        let m2_b = t.op(Op::Mul, &[var_b, nb])?;
        let dd = t.op(Op::Mul, &[d, d])?;
        let cross = t.op(Op::Mul, &[n_a, share])?;
        let cross = t.op(Op::Mul, &[dd, cross])?;
        let m2 = t.op(Op::Add, &[m2_a, m2_b])?;
        let m2 = t.op(Op::Add, &[m2, cross])?;
        t.assign(&w[0], n)?;
        t.assign(&w[1], mean)?;
        t.assign(&w[2], m2)?;
        Ok(())
    }

    /// At a window's boundary: the moving statistics from the window's mean and unbiased
    /// variance `m2 / (n - 1)`, then the window state zeroed.
    fn fold_window(&self, t: &mut Tracer, w: &[Parameter; 3]) -> Result<()> {
        let scalar = TensorType::f32(cellgraph_compiler::Shape::scalar());
        let (n, mean, m2) = (t.param(&w[0])?, t.param(&w[1])?, t.param(&w[2])?);
        let one = t.constant(1.0, scalar)?;
        let dof = t.op(Op::Sub, &[n, one])?;
        let var = t.op(Op::Div, &[m2, dof])?;
        self.update(t, &self.moving_mean, mean)?;
        self.update(t, &self.moving_variance, var)?;
        for p in w {
            let zero = t.constant(0.0, p.ty.clone())?;
            t.assign(p, zero)?;
        }
        Ok(())
    }

    /// The `[C]` values of kept-axis statistics, averaged over ghost groups when there are any.
    fn channels(&self, t: &mut Tracer, s: NodeId) -> Result<NodeId> {
        let c = self.num_features();
        let rank = t.ty(s).rank();
        let s = if rank == 5 { t.op(Op::ReduceMean(ReduceAttrs { axes: vec![0], keep_dims: false }), &[s])? } else { s };
        t.op(Op::Reshape { shape: vec![c].into() }, &[s])
    }
}

impl Cell for BatchNorm2d {
    fn construct(&self, t: &mut Tracer, xs: &[NodeId]) -> Result<NodeId> {
        expect_inputs(self, xs, 1)?;
        let x = xs[0];
        let ty = t.ty(x).clone();
        let c = self.num_features();
        let dims = ty.dims().to_vec();
        if dims.len() != 4 || dims[1] != c || !ty.dtype.is_float() {
            return Err(self.config(format!("expects float NCHW input with {c} channels, got {ty}")));
        }
        if t.phase() == Phase::Boundary {
            if let Some(w) = &self.window {
                self.fold_window(t, w)?;
            }
            // The rest of the network is traced only to reach other cells' boundary updates.
            return Ok(x);
        }
        let (gamma, beta) = (t.param(&self.gamma)?, t.param(&self.beta)?);
        let y = if t.training() {
            let [n, _, h, w] = dims[..] else { unreachable!("rank checked above") };
            let group = self.ghost.unwrap_or(n);
            if n % group != 0 {
                return Err(self.config(format!("ghost batches of {group} must divide the batch of {n} (input {ty})")));
            }
            let count = group * h * w;
            if count < 2 {
                return Err(self.config(format!(
                    "in training needs more than one value per channel to normalise with, got {count} (input {ty}{}); use a larger batch",
                    if self.ghost.is_some() { format!(", ghost batches of {group}") } else { String::new() }
                )));
            }
            let scalar = TensorType::f32(cellgraph_compiler::Shape::scalar());
            // The statistics `[C]` and, across ranks, the count of all ranks' values.
            let (y, mean, var, across) = if self.sync {
                let (y, mean, var, n) = self.normalise_across_ranks(t, x, count)?;
                (y, mean, var, Some(n))
            } else if group == n {
                let (y, mean, var) = self.normalise_with_batch(t, x, vec![0, 2, 3])?;
                (y, self.channels(t, mean)?, self.channels(t, var)?, None)
            } else {
                let x5 = t.op(Op::Reshape { shape: vec![n / group, group, c, h, w].into() }, &[x])?;
                let (y5, mean, var) = self.normalise_with_batch(t, x5, vec![1, 3, 4])?;
                (t.op(Op::Reshape { shape: dims.clone().into() }, &[y5])?, self.channels(t, mean)?, self.channels(t, var)?, None)
            };
            match &self.window {
                Some(w) => {
                    let nb = match across {
                        Some(n) => t.op(Op::Reshape { shape: cellgraph_compiler::Shape::scalar() }, &[n])?,
                        None => t.constant(count as f64, scalar)?,
                    };
                    self.merge_window(t, w, nb, mean, var)?
                }
                None => {
                    let unbiased = match across {
                        Some(n) => {
                            let one = t.constant(1.0, scalar)?;
                            let dof = t.op(Op::Sub, &[n, one])?;
                            t.op(Op::Div, &[n, dof])?
                        }
                        None => t.constant(count as f64 / (count - 1) as f64, scalar)?,
                    };
                    let var = t.op(Op::Mul, &[var, unbiased])?;
                    self.update(t, &self.moving_mean, mean)?;
                    self.update(t, &self.moving_variance, var)?;
                }
            }
            y
        } else {
            let (mm, mv) = (t.param(&self.moving_mean)?, t.param(&self.moving_variance)?);
            let (mm, mv) = (self.per_channel(t, mm, 4)?, self.per_channel(t, mv, 4)?);
            let xc = t.op(Op::Sub, &[x, mm])?;
            self.scale(t, xc, mv)?
        };
        let (gamma, beta) = (self.per_channel(t, gamma, 4)?, self.per_channel(t, beta, 4)?);
        let y = t.op(Op::Mul, &[y, gamma])?;
        t.op(Op::Add, &[y, beta])
    }
    fn parameters(&self) -> Vec<Parameter> {
        // MindSpore's order, then the window state when there is one.
        let mut v = vec![self.moving_mean.clone(), self.moving_variance.clone(), self.gamma.clone(), self.beta.clone()];
        v.extend(self.window.iter().flatten().cloned());
        v
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn kind(&self) -> &'static str {
        "BatchNorm2d"
    }
}

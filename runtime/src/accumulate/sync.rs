//! How a window's gradients come together before its update ([`GradSync`]): this process
//! alone, or data-parallel, where every rank first checks that it runs the same graphs from
//! the same parameters, then each window's gradients cross the ranks once, in one flat buffer:
//! an all-reduce of the accumulators (with the window's item count), or under hsdp (ZeRO-1) a
//! reduce-scatter to this rank's slice, that slice's update, and an all-gather of the
//! parameters.

use std::sync::Arc;

use cellgraph_compiler::passes::grad_accumulation::{optimizer_graph, AccumulationOptions};
use cellgraph_compiler::update::StateSpec;
use cellgraph_compiler::{HostTensor, TensorType};

use cellgraph_cells::{GradAccumulation, Normalization};

use super::store::{Kind, Slot, Store};
use super::window::{clipped, finite, scale, Ended, Progress};
use super::Accumulator;
use crate::comm::Communicator;
use crate::error::Result;
use crate::exec::{compile, Executable, Session};
use crate::value::Value;
use crate::Backend;

/// The name the hsdp shard's parameter takes in the session.
pub const SHARD: &str = "hsdp.shard";

/// How a window's gradients come together before its update: this process's own
/// ([`Local`]), summed over the ranks by one all-reduce ([`Replicated`]), or reduce-scattered
/// so that each rank updates its slice of the parameters ([`Sharded`], hsdp / ZeRO-1).
pub(super) trait GradSync<B: Backend> {
    /// Ends the window: brings the gradients together, decides whether the window applies
    /// (a token-weighted window without a token, an overflow under loss scaling: on every rank
    /// alike) and applies it.
    fn end_window(&mut self, w: &mut Boundary<'_, B>) -> Result<Ended>;

    /// The communicator, when training data-parallel.
    fn comm(&self) -> Option<&Arc<dyn Communicator>> {
        None
    }

    /// This rank's shard, under hsdp.
    fn shard(&self) -> Option<&Shard> {
        None
    }

    /// This rank's shard, to recompile its optimizer (graph dumps).
    fn shard_mut(&mut self) -> Option<&mut Shard> {
        None
    }
}

/// What a window's end reads and writes in the accumulator, borrowed apart from its
/// [`GradSync`].
pub(super) struct Boundary<'a, B: Backend> {
    pub net: &'a GradAccumulation,
    pub session: &'a mut Session<B>,
    pub store: &'a mut Store<B>,
    pub progress: &'a mut Progress,
    /// The optimizer over every parameter (the unsharded one).
    pub optimizer: &'a Executable,
    /// The optimizer graph's clipping alone (host backends under clipping by global norm).
    pub clip: Option<&'a Executable>,
    /// The scale the micro-steps seeded the backward pass with, under dynamic loss scaling.
    pub loss_scale: Option<f64>,
    /// The optimizer's host scalars for this update (the learning rate...).
    pub scalars: &'a [f64],
}

impl<B: Backend> Boundary<'_, B> {
    /// Whether a window of `items` items (over every rank), with or without a non-finite
    /// gradient on some rank, skips its update, and why: a token-weighted window without a
    /// token (whose gradient is 0/0) and, under loss scaling, an overflow. `None`: it applies.
    fn skipped(&self, items: f64, overflow: bool) -> Option<Ended> {
        if self.net.normalization == Normalization::Tokens && items <= 0.0 {
            Some(Ended::Empty)
        } else if overflow && self.loss_scale.is_some() {
            Some(Ended::Overflow)
        } else {
            None
        }
    }

    /// The optimizer's gradient factor for a window of `items` items over `ranks` ranks, with
    /// the loss scale divided out.
    fn scale(&self, items: f64, ranks: usize, mean_over_ranks: bool) -> f64 {
        scale(self.net.normalization, self.progress.micro, items, ranks, mean_over_ranks) / self.loss_scale.unwrap_or(1.0)
    }

    /// The optimizer over every parameter: one fused kernel on flat device buffers, one pass
    /// per parameter on a host backend (under clipping, with the factor the clip graph gives,
    /// which the optimizer graph computes with the same ops), else the graph. Returns whether
    /// the accumulators were zeroed with it.
    fn run_optimizer(&mut self, scale: f64) -> Result<bool> {
        if let Some(launches) = self.store.fused_update(scale, self.net.clip_global_norm, self.scalars) {
            self.progress.counters.fused_launches += launches? as u64;
            return Ok(true);
        }
        // Under clipping the one pass needs the clip graph (which host backends compile).
        let one_pass = self.net.clip_global_norm.is_none() || self.clip.is_some();
        if one_pass && self.store.host_update(self.session, scale, self.clip, self.scalars)? {
            self.progress.counters.host_boundaries += 1;
            return Ok(true);
        }
        self.session.run(self.optimizer, &optimizer_inputs(scale, self.scalars))?;
        Ok(false)
    }

    /// What this rank appends to its gradients in the boundary collective: the window's item
    /// count and, under loss scaling only, its overflow flag (1 when one of `grads` is not
    /// finite). Summed over ranks, [`Self::read_tail`] takes them back off.
    fn tail(&self, grads: &[f32]) -> Vec<f32> {
        let mut tail = vec![self.progress.items as f32];
        if self.loss_scale.is_some() {
            tail.push(if finite(grads) { 0.0 } else { 1.0 });
        }
        tail
    }

    /// Pops the summed [`Self::tail`] off `buf`: the window's item count over every rank and
    /// whether any rank overflowed.
    fn read_tail(&self, buf: &mut Vec<f32>) -> (f64, bool) {
        let overflow = self.loss_scale.is_some() && buf.pop().unwrap_or(0.0) > 0.0;
        (buf.pop().unwrap_or(0.0) as f64, overflow)
    }
}

/// One process: the window's own gradients.
pub(super) struct Local;

impl<B: Backend> GradSync<B> for Local {
    fn end_window(&mut self, w: &mut Boundary<'_, B>) -> Result<Ended> {
        let items = w.progress.items as f64;
        let overflow = w.loss_scale.is_some() && !finite(&w.store.gather(w.session, Kind::Accu)?);
        if let Some(ended) = w.skipped(items, overflow) {
            return Ok(ended);
        }
        let scale = w.scale(items, 1, false);
        w.run_optimizer(scale).map(Ended::Applied)
    }
}

/// Every rank holds every parameter: one all-reduce of the flat accumulators, then the same
/// update on every rank.
pub(super) struct Replicated {
    pub comm: Arc<dyn Communicator>,
    /// Gradients averaged over the ranks (MindSpore's `gradients_mean`), else summed.
    pub gradients_mean: bool,
}

/// hsdp (ZeRO-1): each rank updates its slice of the flat parameters and holds that slice of
/// the optimizer state.
pub(super) struct Sharded {
    pub comm: Arc<dyn Communicator>,
    pub gradients_mean: bool,
    pub shard: Shard,
}

/// ZeRO-1: this rank updates elements `rank*len..(rank+1)*len` of the flat parameters.
pub(super) struct Shard {
    pub len: usize,
    pub optimizer: Executable,
    /// This rank's slice of each optimizer state (`moments.hsdp.shard`, ...), in the
    /// optimizer's order.
    pub state: Vec<StateSpec>,
}

/// The optimizer graph's inputs: the gradient scale, then the rule's host scalars.
fn optimizer_inputs(scale: f64, scalars: &[f64]) -> Vec<HostTensor> {
    std::iter::once(scale).chain(scalars.iter().copied()).map(HostTensor::scalar_f32).collect()
}

/// Rank `r`'s slice of `len` elements of a flat buffer, padded with `pad` past its end.
pub(crate) fn shard_of(v: &[f32], r: usize, len: usize, pad: f32) -> Vec<f32> {
    let start = (r * len).min(v.len());
    let mut s = v[start..(start + len).min(v.len())].to_vec();
    s.resize(len, pad);
    s
}

impl<B: Backend> GradSync<B> for Replicated {
    /// One all-reduce of the flat accumulators (with the window's item count and the ranks'
    /// overflow flags appended), then the optimizer on every rank.
    fn end_window(&mut self, w: &mut Boundary<'_, B>) -> Result<Ended> {
        let mut flat = w.store.gather(w.session, Kind::Accu)?;
        let tail = w.tail(&flat);
        flat.extend(tail);
        self.comm.all_reduce_sum(&mut flat);
        w.progress.counters.grad_collectives += 1;
        let (items, overflow) = w.read_tail(&mut flat);
        if let Some(ended) = w.skipped(items, overflow) {
            return Ok(ended);
        }
        w.store.scatter(w.session, Kind::Accu, &flat);
        let scale = w.scale(items, self.comm.size(), self.gradients_mean);
        w.run_optimizer(scale).map(Ended::Applied)
    }

    fn comm(&self) -> Option<&Arc<dyn Communicator>> {
        Some(&self.comm)
    }
}

impl<B: Backend> GradSync<B> for Sharded {
    /// One reduce-scatter gives this rank the summed gradients of its slice (and the global
    /// item count and overflow flags); it updates that slice of the parameters and of the
    /// optimizer state; one all-gather brings every rank the whole updated parameters. Updates
    /// nothing when the window applies no update.
    fn end_window(&mut self, w: &mut Boundary<'_, B>) -> Result<Ended> {
        let comm = &self.comm;
        let len = self.shard.len;
        let (size, rank, total) = (comm.size(), comm.rank(), w.store.total());
        // Each rank's slice of the gradients, then the window's item count (and overflow flag).
        let grads = w.store.gather(w.session, Kind::Accu)?;
        let tail = w.tail(&grads);
        let mut send = Vec::with_capacity(size * (len + tail.len()));
        for r in 0..size {
            let part = &grads[(r * len).min(total)..((r + 1) * len).min(total)];
            send.extend_from_slice(part);
            send.resize(send.len() + len - part.len(), 0.0);
            send.extend_from_slice(&tail);
        }
        drop(grads);
        let mut mine = vec![0.0f32; len + tail.len()];
        comm.reduce_scatter_sum(&send, &mut mine);
        w.progress.counters.grad_collectives += 1;
        let (items, overflow) = w.read_tail(&mut mine);
        if let Some(ended) = w.skipped(items, overflow) {
            return Ok(ended);
        }
        let mut scale = w.scale(items, size, self.gradients_mean);
        if w.net.clip_global_norm.is_some() {
            let mut sq = [mine.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>() as f32];
            comm.all_reduce_sum(&mut sq);
            scale = clipped(scale, sq[0] as f64, w.net.clip_global_norm);
        }
        let params = w.store.gather_range(w.session, Kind::Param, rank * len, len)?;
        let (device, settings) = (w.session.device().clone(), w.session.settings());
        w.session.set_value(SHARD, Value::from_host_owned(HostTensor::f32(vec![len], params).expect("len"), &device, &settings));
        w.session
            .set_value(&super::accumulator_name(SHARD), Value::from_host_owned(HostTensor::f32(vec![len], mine).expect("len"), &device, &settings));
        w.session.run(&self.shard.optimizer, &optimizer_inputs(scale, w.scalars))?;
        let updated = w.session.param(SHARD).expect("written by the optimizer").to_f32();
        let mut all = vec![0.0f32; size * len];
        comm.all_gather(&updated, &mut all);
        all.truncate(total);
        w.store.scatter(w.session, Kind::Param, &all);
        Ok(Ended::Applied(false))
    }

    fn comm(&self) -> Option<&Arc<dyn Communicator>> {
        Some(&self.comm)
    }

    fn shard(&self) -> Option<&Shard> {
        Some(&self.shard)
    }

    fn shard_mut(&mut self) -> Option<&mut Shard> {
        Some(&mut self.shard)
    }
}

impl<B: Backend> Accumulator<B> {
    /// Trains data-parallel over `comm`: gradients are all-reduced (or, with `hsdp`,
    /// reduce-scattered) once per window, in one flat buffer. Checks that every rank has the
    /// same graphs and initial parameters.
    pub fn set_parallel(&mut self, comm: Arc<dyn Communicator>, gradients_mean: bool, hsdp: bool) -> Result<()> {
        let net = &self.net;
        let mut fingerprint =
            format!("{}\n{}\n", cellgraph_compiler::print(self.plans.optimizer.graph()), cellgraph_compiler::print(self.plans.clear.graph()));
        fingerprint += &format!(
            "{:?} {:?} {} {:?} {} {gradients_mean} {hsdp}\n",
            net.slicing, net.normalization, net.micro_size, net.clip_global_norm, net.drop_incomplete_window
        );
        // The learning-rate schedule and other host scalars are inputs, not graph constants.
        fingerprint += &format!("{:?}\n", [0, 1, 10, 1000].map(|u| self.opt.scalar_values(u)));
        crate::comm::agree(comm.as_ref(), "configuration (network, optimizer, accumulation options)", fingerprint.as_bytes())?;
        let params: Vec<u8> = self.store.gather(&self.session, Kind::Param)?.iter().flat_map(|v| v.to_le_bytes()).collect();
        crate::comm::agree(comm.as_ref(), "initial parameters (seed)", &params)?;
        // Non-trainable state (batch norm's moving statistics) starts equal too.
        let state: Vec<u8> = cellgraph_cells::Cell::parameters(net.as_ref())
            .iter()
            .filter(|p| !p.requires_grad)
            .filter_map(|p| self.session.param(&p.name))
            .flat_map(|t| t.to_f32())
            .flat_map(|v| v.to_le_bytes())
            .collect();
        crate::comm::agree(comm.as_ref(), "initial non-trainable state (moving statistics)", &state)?;
        let shard: Box<dyn GradSync<B>> = if hsdp {
            self.store.leave_flat(&mut self.session);
            let shard = self.shard(comm.size())?;
            // The unsharded state (`moments.fc1.weight`, ...) gives way to this rank's slice.
            for k in 0..shard.state.len() {
                for s in self.store.slots(Kind::State(k)) {
                    self.session.remove_param(self.store.name(s));
                }
            }
            self.session.init_state(&shard.state);
            Box::new(Sharded { comm, gradients_mean, shard })
        } else {
            Box::new(Replicated { comm, gradients_mean })
        };
        self.sync = shard;
        Ok(())
    }

    /// The optimizer graph and state of one hsdp shard of `ranks` (clipping, which needs the
    /// global norm, is folded into the scale on the host).
    fn shard(&self, ranks: usize) -> Result<Shard> {
        let len = self.store.total().div_ceil(ranks);
        let opts = AccumulationOptions { normalization: self.net.normalization, clip_global_norm: None, precision: None };
        let (mut g, state) = optimizer_graph(&[(SHARD.to_string(), TensorType::f32(vec![len]))], self.opt.as_ref(), &opts)?;
        g.name = "optimizer_shard".into();
        Ok(Shard { len, optimizer: compile(g)?, state })
    }

    /// With hsdp, this rank's slice of each optimizer state gathered from every rank and
    /// split back into the unsharded slots (`moments.fc1.weight`, ...): every rank must call
    /// this together. Empty otherwise.
    pub(super) fn gathered_state(&self, params: &std::collections::BTreeMap<String, HostTensor>) -> Vec<(String, HostTensor)> {
        let (Some(comm), Some(shard)) = (self.sync.comm(), self.sync.shard()) else { return Vec::new() };
        let mut out = Vec::new();
        for (k, spec) in shard.state.iter().enumerate() {
            let mine = params.get(&spec.name).expect("shard state lives in the session").to_f32();
            let mut all = vec![0.0f32; comm.size() * shard.len];
            comm.all_gather(&mine, &mut all);
            for (param, t) in self.store.split(&all) {
                out.push((self.store.name(Slot { kind: Kind::State(k), param }).to_string(), t));
            }
        }
        out
    }

    /// With hsdp: checkpoint tensors with the unsharded optimizer state (`moments.fc1.weight`,
    /// ...) replaced by this rank's slice of it (`moments.hsdp.shard`); otherwise unchanged.
    pub(super) fn sharded_state(&self, tensors: crate::checkpoint::Tensors) -> Result<crate::checkpoint::Tensors> {
        let mut out = tensors;
        let (Some(comm), Some(shard)) = (self.sync.comm(), self.sync.shard()) else {
            return Ok(out);
        };
        for (k, spec) in shard.state.iter().enumerate() {
            let names: Vec<&str> = self.store.slots(Kind::State(k)).map(|s| self.store.name(s)).collect();
            if !names.iter().any(|n| out.contains_key(*n)) {
                continue;
            }
            let mut flat = Vec::new();
            for n in names {
                let t = out.remove(n).ok_or_else(|| crate::error::RuntimeError::Mismatch {
                    what: "checkpoint".into(),
                    expected: format!("optimizer state `{n}`"),
                    got: "nothing".into(),
                })?;
                flat.extend(t.to_f32());
            }
            let mine = shard_of(&flat, comm.rank(), shard.len, spec.init as f32);
            out.insert(spec.name.clone(), HostTensor::f32(vec![shard.len], mine).expect("len"));
        }
        Ok(out)
    }
}

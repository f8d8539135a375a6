//! Data parallelism: every rank first checks that it runs the same graphs from the same
//! parameters; then each window's gradients cross the ranks once, in one flat buffer: an
//! all-reduce of the accumulators (with the window's item count), or under hsdp (ZeRO-1) a
//! reduce-scatter to this rank's slice, that slice's update, and an all-gather of the
//! parameters.

use std::sync::Arc;

use cellgraph_compiler::passes::grad_accumulation::{optimizer_graph, AccumulationOptions};
use cellgraph_compiler::update::StateSpec;
use cellgraph_compiler::{HostTensor, TensorType};

use super::store::{Kind, Slot};
use super::window::{clipped, finite, scale, Ended};
use super::{optimizer_inputs, Accumulator};
use crate::comm::Communicator;
use crate::error::Result;
use crate::exec::{compile, Executable};
use crate::value::Value;
use crate::Backend;

/// The name the hsdp shard's parameter takes in the session.
pub const SHARD: &str = "hsdp.shard";

/// The communicator and how gradients cross it.
pub(crate) struct Parallel {
    pub comm: Arc<dyn Communicator>,
    pub gradients_mean: bool,
    /// With hsdp: this rank's slice of the flat parameters and its optimizer.
    pub shard: Option<Shard>,
}

/// ZeRO-1: this rank updates elements `rank*len..(rank+1)*len` of the flat parameters.
pub(crate) struct Shard {
    pub len: usize,
    pub optimizer: Executable,
    /// This rank's slice of each optimizer state (`moments.hsdp.shard`, ...), in the
    /// optimizer's order.
    pub state: Vec<StateSpec>,
}

/// Rank `r`'s slice of `len` elements of a flat buffer, padded with `pad` past its end.
pub(crate) fn shard_of(v: &[f32], r: usize, len: usize, pad: f32) -> Vec<f32> {
    let start = (r * len).min(v.len());
    let mut s = v[start..(start + len).min(v.len())].to_vec();
    s.resize(len, pad);
    s
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
        let shard = if hsdp {
            self.store.leave_flat(&mut self.session);
            let shard = self.shard(comm.size())?;
            // The unsharded state (`moments.fc1.weight`, ...) gives way to this rank's slice.
            for k in 0..shard.state.len() {
                for s in self.store.slots(Kind::State(k)) {
                    self.session.remove_param(self.store.name(s));
                }
            }
            self.session.init_state(&shard.state);
            Some(shard)
        } else {
            None
        };
        self.parallel = Some(Parallel { comm, gradients_mean, shard });
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

    /// What this rank appends to its gradients in the boundary collective: the window's item
    /// count and, under loss scaling only, its overflow flag (1 when one of `grads` is not
    /// finite). Summed over ranks, [`Self::read_tail`] takes them back off.
    fn tail(&self, grads: &[f32]) -> Vec<f32> {
        let mut tail = vec![self.progress.items as f32];
        if self.scaler.is_some() {
            tail.push(if finite(grads) { 0.0 } else { 1.0 });
        }
        tail
    }

    /// Pops the summed [`Self::tail`] off `buf`: the window's item count over every rank and
    /// whether any rank overflowed.
    fn read_tail(&self, buf: &mut Vec<f32>) -> (f64, bool) {
        let overflow = self.scaler.is_some() && buf.pop().unwrap_or(0.0) > 0.0;
        (buf.pop().unwrap_or(0.0) as f64, overflow)
    }

    /// One all-reduce of the flat accumulators (with the window's item count and the ranks'
    /// overflow flags appended), then the optimizer on every rank. Returns how the window
    /// ended (with whether the accumulators were zeroed with the update).
    pub(super) fn apply_replicated(&mut self, scalars: &[f64]) -> Result<Ended> {
        let p = self.parallel.as_ref().expect("parallel");
        let (comm, mean) = (p.comm.clone(), p.gradients_mean);
        let mut flat = self.store.gather(&self.session, Kind::Accu)?;
        let tail = self.tail(&flat);
        flat.extend(tail);
        comm.all_reduce_sum(&mut flat);
        self.progress.counters.grad_collectives += 1;
        let (items, overflow) = self.read_tail(&mut flat);
        if let Some(ended) = self.skipped(items, overflow) {
            return Ok(ended);
        }
        self.store.scatter(&mut self.session, Kind::Accu, &flat);
        let scale = self.unscaled(scale(self.net.normalization, self.progress.micro, items, comm.size(), mean));
        self.run_optimizer(scale, scalars).map(Ended::Applied)
    }

    /// ZeRO-1: one reduce-scatter gives this rank the summed gradients of its slice (and the
    /// global item count and overflow flags); it updates that slice of the parameters and of
    /// the optimizer state; one all-gather brings every rank the whole updated parameters.
    /// Updates nothing when the window applies no update (no token on any rank, or an
    /// overflow under loss scaling).
    pub(super) fn apply_sharded(&mut self, scalars: &[f64]) -> Result<Ended> {
        let p = self.parallel.as_ref().expect("parallel");
        let (comm, mean) = (p.comm.clone(), p.gradients_mean);
        let len = p.shard.as_ref().expect("sharded").len;
        let (size, rank, total) = (comm.size(), comm.rank(), self.store.total());
        // Each rank's slice of the gradients, then the window's item count (and overflow flag).
        let grads = self.store.gather(&self.session, Kind::Accu)?;
        let tail = self.tail(&grads);
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
        self.progress.counters.grad_collectives += 1;
        let (items, overflow) = self.read_tail(&mut mine);
        if let Some(ended) = self.skipped(items, overflow) {
            return Ok(ended);
        }
        let mut scale = self.unscaled(scale(self.net.normalization, self.progress.micro, items, size, mean));
        if self.net.clip_global_norm.is_some() {
            let mut sq = [mine.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>() as f32];
            comm.all_reduce_sum(&mut sq);
            scale = clipped(scale, sq[0] as f64, self.net.clip_global_norm);
        }
        let params = self.store.gather_range(&self.session, Kind::Param, rank * len, len)?;
        let (device, settings) = (self.session.device().clone(), self.session.settings());
        self.session.set_value(SHARD, Value::from_host_owned(HostTensor::f32(vec![len], params).expect("len"), &device, &settings));
        self.session
            .set_value(&super::accumulator_name(SHARD), Value::from_host_owned(HostTensor::f32(vec![len], mine).expect("len"), &device, &settings));
        let shard = self.parallel.as_ref().and_then(|p| p.shard.as_ref()).expect("sharded");
        self.session.run(&shard.optimizer, &optimizer_inputs(scale, scalars))?;
        let updated = self.session.param(SHARD).expect("written by the optimizer").to_f32();
        let mut all = vec![0.0f32; size * len];
        comm.all_gather(&updated, &mut all);
        all.truncate(total);
        self.store.scatter(&mut self.session, Kind::Param, &all);
        Ok(Ended::Applied(false))
    }

    /// With hsdp, this rank's slice of each optimizer state gathered from every rank and
    /// split back into the unsharded slots (`moments.fc1.weight`, ...): every rank must call
    /// this together. Empty otherwise.
    pub(super) fn gathered_state(&self, params: &std::collections::BTreeMap<String, HostTensor>) -> Vec<(String, HostTensor)> {
        let Some((comm, shard)) = self.parallel.as_ref().and_then(|p| Some((&p.comm, p.shard.as_ref()?))) else { return Vec::new() };
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
    pub(super) fn sharded_state(&self, tensors: &crate::checkpoint::Tensors) -> Result<crate::checkpoint::Tensors> {
        let mut out = tensors.clone();
        let Some((comm, shard)) = self.parallel.as_ref().and_then(|p| Some((&p.comm, p.shard.as_ref()?))) else {
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

//! Checkpoints of an accumulating run: everything needed to resume bit-identically
//! (parameters, accumulators, optimizer state and the counters), and loading it back,
//! strictly (MindSpore's `load_param_into_net(strict_load=True)`) or not.

use std::collections::{BTreeMap, BTreeSet};

use cellgraph_cells::Cell;
use cellgraph_compiler::{HostData, HostTensor};

use super::sync::SHARD;
use super::Accumulator;
use crate::error::{listed, Result, RuntimeError};
use crate::Backend;

/// What a checkpoint load did (MindSpore's `load_param_into_net` returns the first two).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Parameters and state left as they were (`param_not_load`).
    pub missing: Vec<String>,
    /// Tensors of the checkpoint that were not loaded (`ckpt_not_load`).
    pub unused: Vec<String>,
    /// What was loaded.
    pub loaded: Vec<String>,
}

/// Names MindSpore's checkpoints carry besides the network's tensors; never an error.
const MINDSPORE_EXTRAS: [&str; 4] = ["global_step", "learning_rate", "epoch_num", "step_num"];

/// The loss scale and its clean-window count, as `cellgraph.<name>` scalars.
const LOSS_SCALE: &str = "loss_scale";
const LOSS_SCALE_CLEAN: &str = "loss_scale_clean_windows";

impl<B: Backend> Accumulator<B> {
    /// Everything needed to resume bit-identically: parameters, accumulators, optimizer
    /// state, and the counters as `cellgraph.*` int64 scalars.
    ///
    /// With hsdp the optimizer state is gathered from every rank and stored under the
    /// unsharded names (`moments.fc1.weight`), so the checkpoint is the same as an unsharded
    /// run's; every rank must call this together.
    pub fn snapshot(&self) -> crate::checkpoint::Tensors {
        let mut t = self.session.params_host();
        let gathered = self.gathered_state(&t);
        if let Some(shard) = self.sync.shard() {
            t.remove(SHARD);
            t.remove(&super::accumulator_name(SHARD));
            for spec in &shard.state {
                t.remove(&spec.name);
            }
        }
        t.extend(gathered);
        for (name, v) in self.settled_progress().saved() {
            t.insert(name, HostTensor { shape: vec![], data: HostData::I64(vec![v]) });
        }
        if let Some(s) = &self.scaler {
            t.insert(format!("cellgraph.{LOSS_SCALE}"), HostTensor { shape: vec![], data: HostData::F32(vec![s.scale as f32]) });
            t.insert(format!("cellgraph.{LOSS_SCALE_CLEAN}"), HostTensor { shape: vec![], data: HostData::I64(vec![s.clean as i64]) });
        }
        t
    }

    /// The network's parameters (batch norm's moving statistics included), copied to the
    /// host, by name: what a model directory or `load_param_into_net` needs (PyTorch's
    /// `state_dict()`), without the accumulators and optimizer state that a resume needs
    /// ([`Self::snapshot`]). Needs no other rank.
    pub fn parameters(&self) -> crate::checkpoint::Tensors {
        self.net.parameters().into_iter().filter_map(|p| self.session.param(&p.name).map(|t| (p.name, t))).collect()
    }

    /// [`Self::parameters`] without copying them where the session holds them in host memory
    /// as f32 (the CPU's): each parameter's shape and values borrowed from the session (copied
    /// from a device, or from f64). What a save reads while the model goes on.
    pub fn parameter_values(&self) -> crate::hf::ParamValues<'_> {
        fn values<B: Backend>(v: &crate::value::Value<B>) -> Option<std::borrow::Cow<'_, [f32]>> {
            match v {
                crate::value::Value::Float(t) => match B::host_slice(t) {
                    Some(crate::backend::HostSlice::F32(c)) => Some(c),
                    _ => None,
                },
                _ => None,
            }
        }
        let net = self.net.parameters();
        net.into_iter()
            .filter_map(|p| {
                let v = self.session.value(&p.name)?;
                let (dims, values) = match values(v) {
                    Some(c) => (v.dims(), c),
                    // Copied once: an f32 copy's memory is kept, not copied again.
                    None => match v.to_host() {
                        HostTensor { shape, data: HostData::F32(v) } => (shape, std::borrow::Cow::Owned(v)),
                        t => (t.shape.clone(), std::borrow::Cow::Owned(t.to_f32())),
                    },
                };
                Some((p.name, (dims, values)))
            })
            .collect()
    }

    /// Loads a snapshot, or a checkpoint of the network's parameters alone (MindSpore's
    /// `load_param_into_net(net, params, strict_load=True)`): every parameter of the network
    /// must be there with its shape, optimizer state and accumulators come all or none per kind
    /// (`moments.*`), and names the session does not know are an error. Nothing is changed
    /// unless everything checks.
    pub fn restore(&mut self, tensors: &crate::checkpoint::Tensors) -> Result<()> {
        self.restore_with(tensors, true).map(|_| ())
    }

    /// [`Self::restore`]; with `strict = false` (`strict_load=False`) missing parameters keep
    /// their values and unknown tensors are skipped, both reported.
    pub fn restore_with(&mut self, tensors: &crate::checkpoint::Tensors, strict: bool) -> Result<LoadReport> {
        self.restore_owned(tensors.clone(), strict)
    }

    /// [`Self::restore_with`], taking the tensors: the session keeps their memory as the
    /// values (a host backend's), with no copy.
    pub fn restore_owned(&mut self, tensors: crate::checkpoint::Tensors, strict: bool) -> Result<LoadReport> {
        let mut tensors = self.sharded_state(tensors)?;
        let known: BTreeSet<String> = self.session.param_names().into_iter().collect();
        let network: BTreeSet<String> = self.net.parameters().into_iter().map(|p| p.name).collect();
        let mut report = LoadReport::default();
        let mut counters = Vec::new();
        let mut values = Vec::new();
        for (name, t) in &tensors {
            if let Some(counter) = name.strip_prefix("cellgraph.") {
                counters.push((counter.to_string(), t.scalar()));
            } else if known.contains(name) {
                let have = self.session.param_shape(name).expect("known");
                if have != t.shape {
                    return Err(RuntimeError::Mismatch {
                        what: format!("checkpoint tensor `{name}`"),
                        expected: format!("shape {have:?}"),
                        got: format!("shape {:?}", t.shape),
                    });
                }
                values.push(name.clone());
            } else if !MINDSPORE_EXTRAS.contains(&name.as_str()) {
                report.unused.push(name.clone());
            }
        }
        report.missing = network.iter().filter(|n| !tensors.contains_key(*n)).cloned().collect();
        // Optimizer state and accumulators: all or none of each kind.
        let mut kinds: BTreeMap<&str, (usize, Vec<&str>)> = BTreeMap::new();
        for n in known.iter().filter(|n| !network.contains(*n)) {
            let e = kinds.entry(n.split('.').next().unwrap_or(n)).or_default();
            match tensors.contains_key(n) {
                true => e.0 += 1,
                false => e.1.push(n),
            }
        }
        let partial: Vec<String> =
            kinds.values().filter(|(have, miss)| *have > 0 && !miss.is_empty()).flat_map(|(_, m)| m.iter().map(|s| s.to_string())).collect();
        if strict {
            let mut problems = Vec::new();
            if !report.missing.is_empty() {
                problems.push(format!(
                    "it lacks {} of the network's {} parameters: {}",
                    report.missing.len(),
                    network.len(),
                    listed(&report.missing)
                ));
            }
            if !partial.is_empty() {
                problems.push(format!("it has only part of the optimizer state; missing: {}", listed(&partial)));
            }
            if !report.unused.is_empty() {
                problems.push(format!("it holds tensors this network does not have: {}", listed(&report.unused)));
            }
            if !problems.is_empty() {
                return Err(RuntimeError::Invalid {
                    what: "checkpoint".into(),
                    detail: format!(
                        "{} (a checkpoint of another network? load it non-strictly to skip them: strict_load=False)",
                        problems.join("; ")
                    ),
                });
            }
        }
        report.missing.extend(partial);
        for (counter, v) in counters {
            // Counters this version does not keep (a newer writer's) are skipped, and so is
            // the loss scale of a run that scaled into one that does not.
            match (counter.as_str(), &mut self.scaler) {
                (LOSS_SCALE, Some(s)) => s.scale = v,
                (LOSS_SCALE_CLEAN, Some(s)) => s.clean = v as u64,
                (counter, _) => {
                    self.progress.restore(counter, v as u64);
                }
            }
        }
        for name in values {
            let t = tensors.remove(&name).expect("checked above");
            self.session.set_param_owned(&name, t);
            report.loaded.push(name);
        }
        if self.store.is_flat() {
            // The restored values replaced views: pack them into new flat buffers.
            self.store.enter_flat(&mut self.session, self.opt.as_ref())?;
        }
        Ok(report)
    }
}

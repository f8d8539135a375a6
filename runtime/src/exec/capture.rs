//! Graph replay on a session: a plan's first run probes it, its second captures it, and later
//! runs of the same shape replay the captured graph (see [`crate::replay`]).

use cellgraph_compiler::{HostTensor, Op, TensorType};

use super::plan::{Executable, Step};
use super::{Captured, Session, Watch};
use crate::arena::Arena;
use crate::error::{Result, RuntimeError};
use crate::replay::{Graphs, ReplayCounts};
use crate::value::{settings, Value};
use crate::Backend;

/// A captured plan shape: the plan's id and its inputs' types.
type GraphKey = (u64, Vec<TensorType>);

/// An error of `exe`'s graph replay.
fn replay_error(exe: &Executable, detail: String) -> RuntimeError {
    RuntimeError::Device(format!("graph replay of `{}`: {detail}", exe.graph.name))
}

impl<B: Backend> Session<B> {
    /// Whether [`Self::run_replayed`] captures and replays graphs (off by default: an opt-in,
    /// `--graphs`, until replay is checked against the CPU on CUDA; see [`crate::replay`]).
    pub fn graphs(&self) -> bool {
        self.replay
    }

    /// Turns graph replay on or off (see [`crate::replay`]); turning it off forgets every
    /// captured graph. Host backends have no graphs: turning it on there is an error.
    pub fn set_graphs(&mut self, on: bool) -> Result<()> {
        if on && B::HOST {
            return Err(RuntimeError::Invalid { what: "graph replay".into(), detail: "the CPU backend runs its host kernels directly and has no graphs to capture; use a device (--device cuda or wgpu), or leave graphs off".into() });
        }
        if !on {
            self.graphs = Graphs::default();
        }
        self.replay = on;
        Ok(())
    }

    /// What replay has done in this session.
    pub fn replay_counts(&self) -> ReplayCounts {
        self.graphs.counts
    }

    /// Why plans run op by op although replay is on: for each plan shape that cannot be
    /// captured, the step that reads the device or uploads (`scope: op: what`).
    pub fn replay_blockers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.graphs.entries.values().filter_map(|e| e.blocker.clone()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// [`Self::run_device`] through a captured graph (see [`crate::replay`]): the first two
    /// runs of a plan shape run op by op, the second then captures the plan; every later run
    /// of that shape is one replay. The plan must not have collectives (they read the device);
    /// the outputs are new buffers each run.
    pub fn run_replayed(&mut self, exe: &Executable, inputs: &[HostTensor]) -> Result<Vec<Value<B>>> {
        if !self.replay || exe.collectives > 0 || B::HOST {
            return Err(replay_error(
                exe,
                "replay is off, the plan has collectives, or the backend has no graphs (the caller runs it op by op)".into(),
            ));
        }
        // A replay runs no step on the host: the ids are checked here, before any upload.
        exe.check_inputs(inputs)?;
        let key = (exe.id, inputs.iter().map(|t| t.ty()).collect::<Vec<_>>());
        let Some(entry) = self.graphs.entries.get_mut(&key) else {
            return self.first_run(exe, inputs, key);
        };
        let s = settings::<B>(&self.device, self.float);
        for (t, v) in inputs.iter().zip(&entry.inputs) {
            let written = match v {
                Value::Float(d) => B::write_float(d, crate::value::device_data(t.clone(), &s)),
                Value::Int(d) => B::write_int(d, crate::value::device_data(t.clone(), &s)),
                Value::Bool(_) => false,
            };
            if !written {
                return Err(replay_error(exe, format!("an input of type {} cannot be written in place on this backend", t.ty())));
            }
            crate::value::count_upload();
        }
        if entry.blocker.is_some() {
            // Known at the first run: op by op, counted (see `replay_blockers`).
            self.graphs.counts.uncaptured += 1;
            return self.in_own_arena(&key, |s, fixed| s.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone()));
        }
        if entry.graph.is_none() {
            return self.second_run(exe, inputs, &key);
        }
        let Some((graph, outs)) = &entry.graph else { unreachable!("checked above") };
        // SAFETY: every buffer the graph touches is held by this session (inputs, outputs,
        // parameters, which stay in their buffers while graphs are on and whose graphs are
        // forgotten when one is set from outside; the plan's own arena, which only this entry
        // holds) or pinned by the backend at capture; writes and replays go to the one stream
        // this thread uses.
        unsafe { B::graph_replay(&self.device, graph) }.map_err(|e| replay_error(exe, format!("replay: {e:?}")))?;
        let outs = outs.clone();
        self.graphs.counts.replays += 1;
        self.in_own_arena(&key, |s, _| s.copied_out(outs)).map_err(|e| replay_error(exe, e))
    }

    /// The first run of a plan shape: its inputs uploaded into the contiguous buffers kept for
    /// the plan's life, then the plan op by op in an arena of its own, probed for a step that
    /// reads the device or uploads (which would keep it from being captured).
    fn first_run(&mut self, exe: &Executable, inputs: &[HostTensor], key: GraphKey) -> Result<Vec<Value<B>>> {
        let s = self.settings();
        let fixed: Option<Vec<Value<B>>> = inputs
            .iter()
            .map(|t| match t.dtype().is_float() {
                true => B::contiguous_float(crate::value::device_data(t.clone(), &s), &self.device).map(Value::Float),
                false => B::contiguous_int(crate::value::device_data(t.clone(), &s), &self.device).map(Value::Int),
            })
            .collect();
        let fixed = fixed.ok_or_else(|| replay_error(exe, "this backend cannot keep an input in a fixed buffer".into()))?;
        inputs.iter().for_each(|_| crate::value::count_upload());
        let names = exe
            .steps
            .iter()
            .filter_map(|st| match &st.op {
                Op::Parameter { name } => Some(name.clone()),
                _ => None,
            })
            .chain(exe.writes.iter().map(|(n, _)| n.clone()))
            .collect();
        self.graphs.entries.insert(
            key.clone(),
            crate::replay::Entry { inputs: fixed, names, graph: None, pins: Vec::new(), blocker: None, tries: 0, arena: Arena::default() },
        );
        self.graphs.counts.warmups += 1;
        self.watch = Watch::Probe(None);
        let outs = self.in_own_arena(&key, |s, fixed| s.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone()));
        let Watch::Probe(blocker) = std::mem::replace(&mut self.watch, Watch::Off) else { unreachable!("set above") };
        self.graphs.entries.get_mut(&key).expect("inserted above").blocker = blocker;
        let outs = outs?;
        self.in_own_arena(&key, |s, _| s.copied_out(outs)).map_err(|e| replay_error(exe, e))
    }

    /// The second run of a plan shape: op by op (this run's results), then, when the run took
    /// every buffer from the plan's arena, the capture, in one call (a stream holds one
    /// prepared capture at a time). When the run took a new buffer, or the capture found a
    /// step it cannot record, the graph is dropped (its launches were recorded, never run:
    /// this run's results stand) and the next run tries again; after three tries the plan
    /// stays op by op, named. (Whether a buffer is free again is cubecl's count of its handles,
    /// which a launch still queued for the device may hold a moment longer: a try can fail by
    /// timing alone.)
    fn second_run(&mut self, exe: &Executable, inputs: &[HostTensor], key: &GraphKey) -> Result<Vec<Value<B>>> {
        B::graph_prepare(&self.device).map_err(|e| replay_error(exe, format!("preparing the device for a capture: {e:?}")))?;
        self.graphs.counts.warmups += 1;
        let (outs, steady) = self.in_own_arena(key, |s, fixed| {
            let fresh = s.arena.fresh();
            let outs = s.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone()).and_then(|o| s.copied_out(o).map_err(|e| replay_error(exe, e)));
            (outs, s.arena.fresh() == fresh)
        });
        let failed = if steady {
            // A prepare must be followed by a capture on the stream, even after a failed run.
            match self.in_own_arena(key, |s, fixed| s.capture(exe, inputs, fixed)) {
                Ok((graph, outs, pins, None)) => {
                    let entry = self.graphs.entries.get_mut(key).expect("made at the first run");
                    entry.graph = Some((graph, outs));
                    entry.pins = pins;
                    self.graphs.counts.captures += 1;
                    None
                }
                Ok((_, _, _, Some(why))) => Some(why),
                Err(RuntimeError::Device(d)) => return Err(replay_error(exe, d)),
                Err(e) => return Err(e),
            }
        } else {
            let closed = B::graph_start_capture(&self.device).and_then(|_| B::graph_stop_capture(&self.device).map(drop));
            closed.map_err(|e| replay_error(exe, format!("closing an empty capture: {e:?}")))?;
            Some("its runs still take new buffers (no steady set of buffers to capture)".to_string())
        };
        if let Some(why) = failed {
            let entry = self.graphs.entries.get_mut(key).expect("made at the first run");
            entry.tries += 1;
            if entry.tries >= 3 {
                entry.blocker = Some(format!("{why}, at each of {} tries", entry.tries));
            }
        }
        outs
    }

    /// Runs `f` with the plan shape's own arena as the session's (a graph's buffers are never
    /// lent to another plan, which could keep one past the next replay) and its input buffers.
    fn in_own_arena<T>(&mut self, key: &GraphKey, f: impl FnOnce(&mut Self, &[Value<B>]) -> T) -> T {
        let entry = self.graphs.entries.get_mut(key).expect("a plan shape's entry");
        let fixed = entry.inputs.clone();
        std::mem::swap(&mut self.arena, &mut entry.arena);
        let out = f(self, &fixed);
        let entry = self.graphs.entries.get_mut(key).expect("forgotten only from outside a run");
        std::mem::swap(&mut self.arena, &mut entry.arena);
        out
    }

    /// Records `exe`'s launches reading the input buffers `fixed`; returns the graph, the
    /// buffers its outputs land in, pins on the buffers the arena held (see
    /// [`crate::replay::Entry::pins`]), and the first step it could not record, if any (that
    /// graph must not be replayed). A parameter the plan writes into a new buffer is copied
    /// into its own inside the graph (see [`Self::run_here`]).
    fn capture(&mut self, exe: &Executable, inputs: &[HostTensor], fixed: &[Value<B>]) -> Result<Captured<B>> {
        let pins = self.arena.device_buffers::<burn_backend::tensor::FloatTensor<B>>().filter_map(B::device_pin).collect();
        B::graph_start_capture(&self.device).map_err(|e| RuntimeError::Device(format!("starting the capture: {e:?}")))?;
        self.watch = Watch::Capture(None);
        let outs = self.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone());
        let Watch::Capture(why) = std::mem::replace(&mut self.watch, Watch::Off) else { unreachable!("set above") };
        let graph = B::graph_stop_capture(&self.device);
        let outs = outs?;
        let graph = graph.map_err(|e| {
            RuntimeError::Device(format!("capture failed (an allocation or a host copy inside the plan, outside the runtime's checks): {e:?}"))
        })?;
        Ok((graph, outs, pins, why))
    }

    /// Copies of a run's outputs (their buffers are written again by the next run), the
    /// outputs' own buffers back to the arena.
    fn copied_out(&mut self, outs: Vec<Value<B>>) -> std::result::Result<Vec<Value<B>>, String> {
        outs.into_iter()
            .map(|v| match &v {
                Value::Float(t) => {
                    let c = B::device_copy(t).ok_or("this backend cannot copy an output out of its graph buffer")?;
                    v.give_back(&mut self.arena);
                    Ok(Value::Float(c))
                }
                _ => Err("a replayed plan's outputs must be floats".to_string()),
            })
            .collect()
    }

    /// A step that read the device, uploaded or took a new buffer cannot be in a graph: found
    /// by the first run's probe (a read or an upload; a constant's first upload does not
    /// count, later runs share it) and by the capture (any of the three); the first such step
    /// is kept, named, for the plan.
    pub(super) fn check_capturable(&mut self, step: &Step, (reads, uploads, fresh): (u64, u64, u64)) {
        let what = if crate::value::device_reads() != reads {
            "reads the device back to the host"
        } else if crate::value::device_uploads() != uploads && !matches!(step.op, Op::Constant { .. }) {
            "uploads from the host"
        } else if self.arena.fresh() != fresh && matches!(self.watch, Watch::Capture(_)) {
            "takes a buffer the plan's arena does not hold (a new allocation)"
        } else {
            return;
        };
        if let Watch::Probe(found) | Watch::Capture(found) = &mut self.watch {
            found.get_or_insert_with(|| format!("{}: {}: {what}, which a captured graph cannot do", step.scope, step.op.label()));
        }
    }
}

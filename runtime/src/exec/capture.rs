//! Graph replay on a session: a plan's first run probes it, its second captures it, and later
//! runs of the same shape replay the captured graph (see [`crate::replay`]).

use burn_backend::TensorData;
use cellgraph_compiler::{HostTensor, Op, TensorType};

use super::plan::{Executable, Step};
use super::{Captured, Session, Watch};
use crate::arena::Arena;
use crate::error::{Result, RuntimeError};
use crate::replay::{GraphKey, Graphs, ReplayCounts};
use crate::value::{settings, Value};
use crate::Backend;

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

    /// What graph replay did in this session, as the programs print it after training
    /// (whether it did what `--graphs` asked, and why not where it did not): a `graph replay:`
    /// line, then a `  not captured: ...` line per blocker; `None` when graphs are off.
    pub fn replay_report(&self) -> Option<String> {
        if !self.graphs() {
            return None;
        }
        let r = self.replay_counts();
        let mut out = format!(
            "graph replay: {} captured, {} replayed ({} of them whole windows, the rest micro-steps), {} op by op while warming up, {} op by op (not capturable)\n",
            r.captures, r.replays, r.windows, r.warmups, r.uncaptured
        );
        for why in self.replay_blockers() {
            out += &format!("  not captured: {why}\n");
        }
        Some(out)
    }

    /// The most plan shapes this session captures ([`crate::replay::MAX_SHAPES`] by default);
    /// a later new shape runs op by op, counted in [`ReplayCounts::uncaptured`] and named by
    /// [`Self::replay_blockers`].
    pub fn set_max_graph_shapes(&mut self, n: usize) {
        self.graphs.max_shapes = n;
    }

    /// Why plans run op by op although replay is on: for each plan shape that cannot be
    /// captured, the step that reads the device or uploads (`scope: op: what`); and the first
    /// shape past those the session captures.
    pub fn replay_blockers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.graphs.entries.values().filter_map(|e| e.blocker.clone()).chain(self.graphs.over.iter().cloned()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// [`Self::run_device`] through a captured graph (see [`crate::replay`]): the first two
    /// runs of a plan shape run op by op, the second then captures the plan; every later run
    /// of that shape is one replay. The plan must not have collectives (they read the device);
    /// the outputs are new buffers each run.
    pub fn run_replayed(&mut self, exe: &Executable, inputs: &[HostTensor]) -> Result<Vec<Value<B>>> {
        let replays = self.graphs.counts.replays;
        let (outs, key) = self.replay_runs(exe, &[inputs])?;
        if self.graphs.counts.replays == replays {
            return Ok(outs);
        }
        // The graph's own output buffers: the next replay writes them again.
        self.in_own_arena(&key, |s, _| s.copied_out(outs)).map_err(|e| replay_error(exe, e))
    }

    /// A whole window in one graph (see [`crate::replay`]): `exe` run once for each input set
    /// of `sets` (the window's micro-batches, one shape), warmed up and captured as
    /// [`Self::run_replayed`] does with one run, then replayed in one launch per window. A
    /// scalar input must be the same in every set. Returns each run's outputs; once the window
    /// is captured they are the graph's own buffers, valid until the next run of a window of
    /// this shape (read them, or drop them, before that).
    pub fn run_window_replayed(&mut self, exe: &Executable, sets: &[&[HostTensor]]) -> Result<Vec<Vec<Value<B>>>> {
        if sets.len() < 2 {
            return Err(replay_error(exe, format!("a window of {} micro-steps is not replayed as a window", sets.len())));
        }
        if let Some(other) = sets.iter().find(|s| s.len() != sets[0].len()) {
            return Err(replay_error(exe, format!("a window's micro-steps must have as many inputs: {} after {}", other.len(), sets[0].len())));
        }
        let scalars_shared = (0..sets[0].len()).all(|i| !sets[0][i].shape.is_empty() || sets.iter().all(|s| s[i] == sets[0][i]));
        if !scalars_shared {
            return Err(replay_error(exe, "a window's micro-steps must share their scalar inputs".into()));
        }
        let replays = self.graphs.counts.replays;
        let (outs, _) = self.replay_runs(exe, sets)?;
        if self.graphs.counts.replays > replays {
            self.graphs.counts.windows += 1;
        }
        let per = exe.outputs.len().max(1);
        let mut outs = outs.into_iter();
        Ok((0..sets.len()).map(|_| outs.by_ref().take(per).collect()).collect())
    }

    /// Runs `exe` once for each of `sets` (one graph holds them all): warm-up, capture or
    /// replay. Returns every run's outputs, in order (copies while warming up, the graph's own
    /// buffers once replayed), and the plan shape's key.
    fn replay_runs(&mut self, exe: &Executable, sets: &[&[HostTensor]]) -> Result<(Vec<Value<B>>, GraphKey)> {
        if !self.replay || exe.collectives > 0 || B::HOST {
            return Err(replay_error(
                exe,
                "replay is off, the plan has collectives, or the backend has no graphs (the caller runs it op by op)".into(),
            ));
        }
        // A replay runs no step on the host: the ids are checked here, before any upload.
        for inputs in sets {
            exe.check_inputs(inputs)?;
        }
        let types: Vec<TensorType> = sets[0].iter().map(|t| t.ty()).collect();
        if let Some(other) = sets.iter().find(|s| s.iter().map(|t| t.ty()).ne(types.iter().cloned())) {
            let got: Vec<String> = other.iter().map(|t| t.ty().to_string()).collect();
            return Err(replay_error(exe, format!("a window's micro-steps must have one shape: got [{}] after the first", got.join(", "))));
        }
        let key = (exe.id, types, sets.len());
        if !self.graphs.entries.contains_key(&key) {
            if self.graphs.entries.len() >= self.graphs.max_shapes {
                let outs = self.past_max_shapes(exe, sets, &key)?;
                return Ok((outs, key));
            }
            let outs = self.first_run(exe, sets, key.clone())?;
            return Ok((outs, key));
        }
        let s = settings::<B>(&self.device, self.float);
        let entry = self.graphs.entries.get(&key).expect("checked above");
        for (i, v) in entry.inputs.iter().enumerate() {
            let data = window_data(sets, i, &s);
            let ty = sets[0][i].ty();
            let written = match v {
                Value::Float(d) => B::write_float(d, data).is_ok(),
                Value::Int(d) => B::write_int(d, data).is_ok(),
                Value::Bool(_) => false,
            };
            if !written {
                return Err(replay_error(exe, format!("an input of type {ty} cannot be written in place on this backend")));
            }
            crate::value::count_upload();
        }
        if entry.blocker.is_some() {
            // Known at the first run: op by op, counted (see `replay_blockers`).
            self.graphs.counts.uncaptured += sets.len() as u64;
            let outs = self.in_own_arena(&key, |s, bound| s.runs_here(exe, sets, bound))?;
            return Ok((outs, key));
        }
        if entry.graph.is_none() {
            let outs = self.second_run(exe, sets, &key)?;
            return Ok((outs, key));
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
        Ok((outs, key))
    }

    /// A new plan shape in a session that holds as many as it captures: each run op by op,
    /// its inputs uploaded, counted as not capturable; the first such shape is named.
    fn past_max_shapes(&mut self, exe: &Executable, sets: &[&[HostTensor]], key: &GraphKey) -> Result<Vec<Value<B>>> {
        if self.graphs.over.is_none() {
            let types: Vec<String> = key.1.iter().map(ToString::to_string).collect();
            let runs = if key.2 > 1 { format!(", windows of {}", key.2) } else { String::new() };
            self.graphs.over = Some(format!(
                "`{}` of inputs [{}]{runs}: past the {} shapes a session captures, this and later new shapes run op by op; feed the network fewer shapes (batches padded to a few lengths)",
                exe.graph.name,
                types.join(", "),
                self.graphs.max_shapes,
            ));
        }
        self.graphs.counts.uncaptured += sets.len() as u64;
        let mut outs = Vec::new();
        for inputs in sets {
            outs.extend(self.run_here(exe, inputs, None, None, &|v, _| v.clone())?);
        }
        Ok(outs)
    }

    /// Runs `exe` once for each of `sets`, reading `bound`'s inputs, op by op; a run's outputs
    /// are held until every run is done (a later run must not take their buffers).
    fn runs_here(&mut self, exe: &Executable, sets: &[&[HostTensor]], bound: &[Vec<Value<B>>]) -> Result<Vec<Value<B>>> {
        if sets.len() > 1 {
            // Room in the arena for the earlier runs' outputs beside a run's own values (else
            // their buffers, given back after the window, would not all be kept).
            let mut room = exe.arena.clone();
            for st in exe.steps.iter().filter(|st| exe.outputs.contains(&st.slot)) {
                let n = st.ty.numel();
                match room.iter_mut().find(|r| r.0 == n) {
                    Some(r) => r.1 += sets.len() - 1,
                    None => room.push((n, sets.len() - 1)),
                }
            }
            self.arena.size_for(&room);
        }
        let mut outs = Vec::new();
        for (inputs, fixed) in sets.iter().zip(bound) {
            outs.extend(self.run_here(exe, inputs, Some(fixed), None, &|v, _| v.clone())?);
        }
        Ok(outs)
    }

    /// The first run of a plan shape: its inputs uploaded into the contiguous buffers kept for
    /// the plan's life (for a window, each input's micro-batches in one buffer, each run
    /// reading its views), then the plan op by op in an arena of its own, probed for a step
    /// that reads the device or uploads (which would keep it from being captured).
    fn first_run(&mut self, exe: &Executable, sets: &[&[HostTensor]], key: GraphKey) -> Result<Vec<Value<B>>> {
        let s = self.settings();
        let fixed: Option<Vec<Value<B>>> = (0..sets[0].len())
            .map(|i| match sets[0][i].dtype().is_float() {
                true => B::contiguous_float(window_data(sets, i, &s), &self.device).map(Value::Float),
                false => B::contiguous_int(window_data(sets, i, &s), &self.device).map(Value::Int),
            })
            .collect();
        let fixed = fixed.ok_or_else(|| replay_error(exe, "this backend cannot keep an input in a fixed buffer".into()))?;
        fixed.iter().for_each(|_| crate::value::count_upload());
        let bound = match sets.len() {
            1 => vec![fixed.clone()],
            k => (0..k)
                .map(|j| fixed.iter().zip(sets[j].iter()).map(|(buffer, t)| window_view(buffer, j, &t.shape)).collect::<Option<Vec<_>>>())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| replay_error(exe, "this backend cannot view a window's micro-batches in one buffer".into()))?,
        };
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
            crate::replay::Entry { inputs: fixed, bound, names, graph: None, pins: Vec::new(), blocker: None, tries: 0, arena: Arena::default() },
        );
        self.graphs.counts.warmups += 1;
        self.watch = Watch::Probe(None);
        let outs = self.in_own_arena(&key, |s, bound| s.runs_here(exe, sets, bound));
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
    fn second_run(&mut self, exe: &Executable, sets: &[&[HostTensor]], key: &GraphKey) -> Result<Vec<Value<B>>> {
        B::graph_prepare(&self.device).map_err(|e| replay_error(exe, format!("preparing the device for a capture: {e:?}")))?;
        self.graphs.counts.warmups += 1;
        let (outs, steady) = self.in_own_arena(key, |s, bound| {
            let fresh = s.arena.fresh();
            let outs = s.runs_here(exe, sets, bound).and_then(|o| s.copied_out(o).map_err(|e| replay_error(exe, e)));
            (outs, s.arena.fresh() == fresh)
        });
        let failed = if steady {
            // A prepare must be followed by a capture on the stream, even after a failed run.
            match self.in_own_arena(key, |s, bound| s.capture(exe, sets, bound)) {
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
    fn in_own_arena<T>(&mut self, key: &GraphKey, f: impl FnOnce(&mut Self, &[Vec<Value<B>>]) -> T) -> T {
        let entry = self.graphs.entries.get_mut(key).expect("a plan shape's entry");
        let bound = entry.bound.clone();
        std::mem::swap(&mut self.arena, &mut entry.arena);
        let out = f(self, &bound);
        let entry = self.graphs.entries.get_mut(key).expect("forgotten only from outside a run");
        std::mem::swap(&mut self.arena, &mut entry.arena);
        out
    }

    /// Records `exe`'s launches, one run for each of `sets` reading `bound`'s inputs; returns
    /// the graph, the buffers its outputs land in (every run's), pins on the buffers the arena held (see
    /// [`crate::replay::Entry::pins`]), and the first step it could not record, if any (that
    /// graph must not be replayed). A parameter the plan writes into a new buffer is copied
    /// into its own inside the graph (see [`Self::run_here`]).
    fn capture(&mut self, exe: &Executable, sets: &[&[HostTensor]], bound: &[Vec<Value<B>>]) -> Result<Captured<B>> {
        let pins = self.arena.device_buffers::<burn_backend::tensor::FloatTensor<B>>().filter_map(B::device_pin).collect();
        B::graph_start_capture(&self.device).map_err(|e| RuntimeError::Device(format!("starting the capture: {e:?}")))?;
        self.watch = Watch::Capture(None);
        let outs = self.runs_here(exe, sets, bound);
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

/// Input `i` of a window's runs as one buffer's data: each run's values at a multiple of the
/// backend's view alignment (zeros between), or the value itself for one run or a scalar
/// (which the runs share).
fn window_data(sets: &[&[HostTensor]], i: usize, s: &burn_backend::DeviceSettings) -> TensorData {
    if sets.len() == 1 || sets[0][i].shape.is_empty() {
        return crate::value::device_data(sets[0][i].clone(), s);
    }
    let parts: Vec<TensorData> = sets.iter().map(|set| crate::value::device_data(set[i].clone(), s)).collect();
    let (dtype, n) = (parts[0].dtype, sets[0][i].data.len());
    let (size, stride) = (dtype.size(), window_stride(n));
    let mut bytes = vec![0u8; sets.len() * stride * size];
    for (j, part) in parts.iter().enumerate() {
        bytes[j * stride * size..][..n * size].copy_from_slice(part.as_bytes());
    }
    TensorData::from_bytes_vec(bytes, crate::backend::bshape(&[sets.len() * stride]), dtype)
}

/// Elements between two runs' values of an input of `n` elements in its window buffer: `n`
/// rounded up to the backend's view alignment.
fn window_stride(n: usize) -> usize {
    n.next_multiple_of(crate::backend::FLAT_ALIGN)
}

/// Run `j`'s view of a window's input buffer (see [`window_data`]): a scalar reads the buffer
/// itself.
fn window_view<B: Backend>(buffer: &Value<B>, j: usize, shape: &[usize]) -> Option<Value<B>> {
    if shape.is_empty() {
        return Some(buffer.clone());
    }
    let offset = j * window_stride(shape.iter().product());
    match buffer {
        Value::Float(t) => B::flat_view(t, offset, shape).map(Value::Float),
        Value::Int(t) => B::flat_view_int(t, offset, shape).map(Value::Int),
        Value::Bool(_) => None,
    }
}

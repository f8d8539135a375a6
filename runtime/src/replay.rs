//! Replaying a plan as one captured device graph (CUDA graphs; wgpu's recorded graphs):
//! MindSpore's sink mode, without user code.
//!
//! A plan shape (plan and input types: a short last batch is another shape, with its own
//! graph) runs op by op twice before it is captured, since a capture may take no buffer the
//! plan's arena does not already hold, and one run is not always enough to fill it (a value
//! still held when its run ends gives its buffer back only at the next):
//!
//! 1. **First run**: the inputs are uploaded into contiguous buffers kept for the plan's
//!    life, and the plan runs op by op (kernels compiled, buffers made).
//! 2. **Second run**: the inputs are written into those buffers, the backend is told a
//!    capture is coming (`graph_prepare`: allocations go to pools a graph can pin; a stream
//!    holds one prepared capture at a time, so this and the capture happen in one call), the
//!    plan runs op by op again (this run's results), then runs a third time between
//!    `graph_start_capture` and `graph_stop_capture`, reading the same input buffers: its
//!    launches are recorded, not run. A step that reads the device, uploads, or takes a
//!    buffer the arena does not hold fails the capture with an error naming it (a graph
//!    cannot carry a host copy or an allocation).
//!
//! Two rules keep every buffer a graph touches its own:
//! - **Each plan shape has its own arena** ([`Entry::arena`]): its intermediates (and so the
//!   graph's) are never lent to another plan, whose values (a loss, a parameter) could
//!   outlive the next replay, which would write over them.
//! - **A graph's buffers stay out of the device's pool while it lives**: cubecl pins what it
//!   allocated inside the capture; the entry pins every buffer its arena held when the capture
//!   began ([`Entry::pins`]), which is every other buffer the capture run could write (it may
//!   take no new one). A run lets some values go instead of giving them back to the arena
//!   (another value still held the buffer, or the arena held its count of that length);
//!   without the pins such a buffer went back to the pool, was handed to another owner, and
//!   every replay wrote over it (another session's batch-norm moving statistics came out
//!   wrong that way, by timing).
//! - **While graphs are on, a parameter stays in its buffer**: a plan that computes a
//!   parameter's new value into another buffer copies it into the parameter's own (a launch,
//!   captured into the graph with the rest), whichever plan runs (a captured one, a short last
//!   batch op by op, the boundary), so every graph reads and writes the buffers the session
//!   holds. (Without it, ResNet-18's moving statistics came out wrong: the buffer a graph
//!   wrote them into had gone back to the device's pool.)
//!
//! A plan whose first run had a step read the device or upload (a loss checking labels the
//! plan computed; dropout's factors are drawn on the device, not read) is never captured: its
//! runs stay op by op, counted ([`ReplayCounts::uncaptured`]) and named
//! ([`crate::Session::replay_blockers`]).
//!
//! Every later run is a **replay**: inputs written in place (an upload and a copy kernel each,
//! enqueued, no wait), one launch for the whole plan, then its outputs copied out (the next
//! replay writes the same buffers).
//!
//! **A whole window in one graph**: with in-step slicing a step holds every micro-batch of its
//! window, so the K micro-steps are captured together, one after the other, in one graph
//! ([`crate::Session::run_window_replayed`]; the key counts the runs). Each input is one
//! buffer holding the K micro-batches' values at aligned offsets (one upload and one copy
//! kernel per input and window), each run reading its own views; a scalar input (dropout's
//! update number, the loss scale) is one buffer the runs share. The runs' outputs stay in the
//! graph's buffers, lent to the caller until the next replay of that window (a window's losses
//! are read, or dropped, before the next step runs), so a window costs its uploads, their
//! copies, one replay and the boundary's launch, where K micro-step replays cost K of each
//! plus K copies out.
//!
//! A parameter set from outside a run (a checkpoint loaded, the accumulators replaced)
//! forgets every graph that reads it; its plan warms up and is captured again.

use std::collections::{BTreeSet, HashMap};

use burn_backend::BackendGraph;
use cellgraph_compiler::TensorType;

use crate::arena::Arena;
use crate::value::Value;
use crate::Backend;

/// What replay did in a session: see [`crate::Session::replay_counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayCounts {
    /// Runs op by op before a capture (one per plan shape, and again after a forget).
    pub warmups: u64,
    /// Graphs captured.
    pub captures: u64,
    /// Runs replayed from a captured graph.
    pub replays: u64,
    /// Graphs forgotten because a parameter they read was set from outside a run.
    pub forgotten: u64,
    /// Runs op by op because their plan cannot be captured (a step reads the device or
    /// uploads), or because the session already holds [`MAX_SHAPES`] plan shapes:
    /// [`crate::Session::replay_blockers`] names it.
    pub uncaptured: u64,
    /// Of `replays`: whole windows replayed as one graph (every micro-step of an in-step
    /// window in one launch, [`crate::Session::run_window_replayed`]).
    pub windows: u64,
}

/// The most plan shapes (a micro-step's plan for one micro-batch shape, and the runs one graph
/// holds) a session captures: a later new shape runs op by op, counted and named, as
/// `torch._dynamo` stops recompiling a function at its `cache_size_limit` of 8. Each shape
/// holds its own buffers for its graph's life, so a network fed ever new shapes (text batches
/// padded to their longest line) would otherwise hold the device's memory many times over, and
/// spend most of its runs warming up.
pub const MAX_SHAPES: usize = 8;

/// A captured plan shape: the plan's id, its inputs' types, and how many runs of the plan one
/// graph holds (1 for a micro-step; K for a window of K micro-steps).
pub(crate) type GraphKey = (u64, Vec<TensorType>, usize);

/// One plan shape's buffers and graph.
pub(crate) struct Entry<B: Backend> {
    /// The input buffers written in place before each replay: one per input of the plan (for
    /// a window, each holds that input for every run, at aligned offsets, unless it is a
    /// scalar, which the window's runs share).
    pub inputs: Vec<Value<B>>,
    /// What each run of the graph reads as the plan's inputs: `inputs` itself for one run,
    /// views into them for a window's runs.
    pub bound: Vec<Vec<Value<B>>>,
    /// Session values the plan reads or writes: setting one from outside forgets the graph.
    pub names: BTreeSet<String>,
    /// The captured graph and the buffers it leaves its outputs in (every run's, in order);
    /// `None` after the first run (captured at the second).
    pub graph: Option<(BackendGraph<B>, Vec<Value<B>>)>,
    /// Pins on every buffer the plan's arena held when the graph was recorded (the capture
    /// run took all its buffers from there; what cubecl allocated inside the capture, it pins
    /// itself): kept while the graph lives, so that none of them goes back to the device's pool
    /// when its value is let go (given back while something else still held it, or beyond the
    /// arena's count), where another owner would be handed memory every replay writes.
    pub pins: Vec<Box<dyn std::any::Any + Send>>,
    /// Why the plan cannot be captured, found by the first run (a step that reads the device
    /// or uploads): every later run is op by op, counted.
    pub blocker: Option<String>,
    /// Second runs that took new buffers (not yet steady), so were not captured.
    pub tries: u32,
    /// The plan's own buffers (its intermediates, and the graph's once captured): lent to no
    /// other plan, whose values could outlive a replay that writes them.
    pub arena: Arena,
}

/// A session's captured plans, by plan id and input types.
pub(crate) struct Graphs<B: Backend> {
    pub entries: HashMap<GraphKey, Entry<B>>,
    pub counts: ReplayCounts,
    /// Plan shapes captured at most ([`MAX_SHAPES`] unless set otherwise).
    pub max_shapes: usize,
    /// The first new shape past `max_shapes`, named.
    pub over: Option<String>,
}

impl<B: Backend> Default for Graphs<B> {
    fn default() -> Self {
        Graphs { entries: HashMap::new(), counts: ReplayCounts::default(), max_shapes: MAX_SHAPES, over: None }
    }
}

impl<B: Backend> Graphs<B> {
    /// Forgets the graphs of plans that read or write `name`.
    pub fn forget(&mut self, name: &str) {
        let before = self.entries.len();
        self.entries.retain(|_, e| !e.names.contains(name));
        self.counts.forgotten += (before - self.entries.len()) as u64;
    }
}

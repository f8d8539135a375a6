//! Where accumulation stands and what a window's end applies: the micro-batches and items of
//! the open window, the updates applied and how often each graph ran (with the one table of
//! the counters a checkpoint stores), the window's normalisation scale, and clipping by
//! global norm where the host computes the norm.

use cellgraph_cells::{LossScale, Normalization};

/// How many times each graph ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub micro_steps: u64,
    pub optimizer_runs: u64,
    pub clear_runs: u64,
    /// Collectives that carried gradients across ranks (one per applied update).
    pub grad_collectives: u64,
    /// Collectives inside micro-steps, across ranks (SyncBatchNorm: four per batch norm per
    /// micro-step); not counted in a world of one.
    pub step_collectives: u64,
    /// Windows that ended without an update: token-weighted windows without a token, and
    /// loss-scaled windows whose gradients overflowed on some rank.
    pub skipped_updates: u64,
    /// Of those, the loss-scaled windows whose gradients overflowed (each halved the scale).
    pub overflows: u64,
    /// Fused optimizer-and-clear kernel launches (device backends with flat buffers: one per
    /// update, whatever the number of parameters).
    pub fused_launches: u64,
    /// Windows whose boundary ran as one pass per parameter on a host backend (the optimizer
    /// and clear graphs' bits, each buffer read and written once), not as those graphs. Not
    /// checkpointed: a resumed run counts its own.
    pub host_boundaries: u64,
    /// Device micro-steps run op by op although the session replays graphs: plans with
    /// collectives inside (SyncBatchNorm over ranks), which read the device.
    pub uncaptured_steps: u64,
}

/// The open window, the updates applied, and the run counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    /// Micro-batches accumulated in the open window.
    pub micro: u64,
    /// Items in those micro-batches (tokens, under token-weighted normalisation).
    pub items: u64,
    /// Optimizer updates applied (the learning-rate schedule's step).
    pub updates: u64,
    pub counters: Counters,
}

/// A counter a checkpoint stores: its name (as `cellgraph.<name>`, an int64 scalar) and where
/// it lives.
type Checkpointed = (&'static str, fn(&mut Progress) -> &mut u64);

/// Every counter a checkpoint stores, the one list that saving and restoring both read.
const CHECKPOINTED: [Checkpointed; 6] = [
    ("updates", |p| &mut p.updates),
    ("window_micro", |p| &mut p.micro),
    ("window_items", |p| &mut p.items),
    ("micro_steps", |p| &mut p.counters.micro_steps),
    ("optimizer_runs", |p| &mut p.counters.optimizer_runs),
    ("clear_runs", |p| &mut p.counters.clear_runs),
];

impl Progress {
    /// One micro-batch of `items` accumulated.
    pub fn micro_step(&mut self, items: usize) {
        self.counters.micro_steps += 1;
        self.micro += 1;
        self.items += items as u64;
    }

    /// The window closed (its update applied or dropped) and its accumulators cleared.
    pub fn cleared(&mut self) {
        self.counters.clear_runs += 1;
        self.micro = 0;
        self.items = 0;
    }

    /// `(cellgraph.<name>, value)` of every checkpointed counter.
    pub fn saved(&self) -> Vec<(String, i64)> {
        let mut p = *self;
        CHECKPOINTED.iter().map(|(name, at)| (format!("cellgraph.{name}"), *at(&mut p) as i64)).collect()
    }

    /// Sets the checkpointed counter `name` (without the `cellgraph.` prefix); false when
    /// there is none of that name.
    pub fn restore(&mut self, name: &str, value: u64) -> bool {
        match CHECKPOINTED.iter().find(|(n, _)| *n == name) {
            Some((_, at)) => {
                *at(self) = value;
                true
            }
            None => false,
        }
    }
}

/// How a window ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The update was applied; `true` when the accumulators were zeroed with it.
    Applied(bool),
    /// No token on any rank: nothing to apply.
    Empty,
    /// A gradient was not finite on some rank (under loss scaling): skipped.
    Overflow,
}

/// Dynamic loss scaling's state: the scale the micro-steps seed the backward pass with, and
/// the clean windows since it last changed (both in checkpoints).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scaler {
    pub scale: f64,
    pub clean: u64,
    pub config: LossScale,
}

impl Scaler {
    pub fn new(config: LossScale) -> Self {
        Scaler { scale: config.init, clean: 0, config }
    }

    /// A window ended with (`overflow`) or without a non-finite gradient: halve the scale (not
    /// below 1, as MindSpore's manager), or count a clean window and double the scale after
    /// `growth_interval` of them in a row.
    pub fn window(&mut self, overflow: bool) {
        if overflow {
            self.scale = (self.scale / 2.0).max(1.0);
            self.clean = 0;
        } else {
            self.clean += 1;
            if self.clean >= self.config.growth_interval {
                self.scale *= 2.0;
                self.clean = 0;
            }
        }
    }
}

/// Whether every value is finite (the loss scaler's overflow check).
pub(crate) fn finite(v: &[f32]) -> bool {
    v.iter().all(|x| x.is_finite())
}

/// The factor a window's summed gradients are multiplied by: `micro` micro-batches and
/// `items` items counted over every rank, the gradients summed over `ranks` (averaged when
/// `mean_over_ranks`).
pub(crate) fn scale(normalization: Normalization, micro: u64, items: f64, ranks: usize, mean_over_ranks: bool) -> f64 {
    let per_rank = if mean_over_ranks { 1.0 / ranks as f64 } else { 1.0 };
    match normalization {
        Normalization::Sum => per_rank,
        Normalization::Mean => per_rank / micro as f64,
        Normalization::ItemWeighted | Normalization::Tokens => 1.0 / items,
    }
}

/// Clipping by global norm where the host computes the norm (flat device buffers, hsdp
/// shards), as the optimizer graph's `clip_by_global_norm` does: the gradients are the
/// accumulators times `scale`, whose squares sum to `scale^2 * sum_sq`; when their norm
/// reaches `max`, the scale is multiplied by `max / norm`.
pub(crate) fn clipped(scale: f64, sum_sq: f64, max: Option<f64>) -> f64 {
    let Some(max) = max else { return scale };
    let norm = scale * sum_sq.sqrt();
    if norm >= max {
        scale * max / norm
    } else {
        scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every checkpointed counter survives saving and restoring, by its own name.
    #[test]
    fn checkpointed_counters_round_trip() {
        let mut p = Progress {
            micro: 3,
            items: 96,
            updates: 7,
            counters: Counters {
                micro_steps: 31,
                optimizer_runs: 7,
                clear_runs: 7,
                grad_collectives: 7,
                step_collectives: 0,
                skipped_updates: 0,
                overflows: 0,
                fused_launches: 0,
                host_boundaries: 0,
                uncaptured_steps: 0,
            },
        };
        let saved = p.saved();
        assert_eq!(saved.len(), 6);
        assert!(saved.contains(&("cellgraph.window_items".into(), 96)));
        let mut q = Progress::default();
        for (name, v) in &saved {
            assert!(q.restore(name.strip_prefix("cellgraph.").unwrap(), *v as u64), "{name}");
        }
        p.counters.grad_collectives = 0; // not checkpointed: a resumed run counts its own
        assert_eq!(q, p);
        assert!(!q.restore("epoch", 1), "the position is the model's");
    }

    /// Halved once per overflowing window (not below 1), doubled after `growth_interval` clean
    /// windows in a row, the count restarting at every change.
    #[test]
    fn the_loss_scale_halves_on_overflow_and_grows_after_clean_windows() {
        let mut s = Scaler::new(LossScale { init: 8.0, growth_interval: 3 });
        s.window(false);
        s.window(false);
        s.window(true);
        assert_eq!((s.scale, s.clean), (4.0, 0));
        for _ in 0..3 {
            s.window(false);
        }
        assert_eq!((s.scale, s.clean), (8.0, 0));
        for _ in 0..5 {
            s.window(true);
        }
        assert_eq!(s.scale, 1.0);
    }

    #[test]
    fn clipping_scales_down_only_at_or_past_the_norm() {
        assert_eq!(clipped(0.5, 16.0, None), 0.5);
        assert_eq!(clipped(0.5, 16.0, Some(3.0)), 0.5, "norm 2 < 3");
        assert_eq!(clipped(0.5, 16.0, Some(2.0)), 0.5, "norm 2 reaches 2: factor 1");
        assert_eq!(clipped(0.5, 16.0, Some(1.0)), 0.25, "norm 2 > 1: halved");
    }
}

//! A step's losses and the window's token counts: kept where they were computed (on a device,
//! until asked for) and read back together, in one read.

use std::cell::Cell;

use cellgraph_cells::Normalization;

use crate::exec::Session;
use crate::value::Value;
use crate::Backend;

/// A micro-batch's loss: read (host backends read it at once, at no cost), or on the device.
enum Loss<B: Backend> {
    Read(f64),
    Device(Value<B>),
}

/// The last step's micro-batch losses and the token counts of the open window not yet read.
pub(super) struct Readback<B: Backend> {
    losses: Vec<Loss<B>>,
    /// Their sum (or mean per token) once read.
    loss: Cell<Option<f64>>,
    /// Under token-weighted normalisation, the last step's token count as far as it has been
    /// read ([`Self::counts`] holds the rest).
    tokens: f64,
    /// Token counts of micro-steps run on a device, not yet read back (each read is a sync):
    /// read together at the window's boundary, or with the step's loss. `true`: of the last step.
    counts: Vec<(Value<B>, bool)>,
}

impl<B: Backend> Readback<B> {
    pub fn new() -> Self {
        Readback { losses: Vec::new(), loss: Cell::new(None), tokens: 0.0, counts: Vec::new() }
    }

    /// Starts a new step: the last step's losses are dropped, those on the device giving their
    /// memory back to `session` (the next step's losses are written there).
    pub fn forget(&mut self, session: &mut Session<B>) {
        for l in self.losses.drain(..) {
            if let Loss::Device(v) = l {
                session.give_back(v);
            }
        }
        self.loss.set(None);
        self.tokens = 0.0;
        for c in &mut self.counts {
            c.1 = false;
        }
    }

    /// A micro-step's loss and, under token-weighted normalisation, its token count, both read.
    pub fn push_read(&mut self, loss: f64, tokens: Option<f64>) {
        self.losses.push(Loss::Read(loss));
        self.tokens += tokens.unwrap_or(0.0);
    }

    /// A micro-step's loss and token count left on the device (the count is read with the
    /// window's others by [`Self::settle`], or with the step's loss).
    pub fn push_device(&mut self, loss: Value<B>, count: Option<Value<B>>) {
        self.losses.push(Loss::Device(loss));
        self.counts.extend(count.map(|c| (c, true)));
    }

    /// The last step's loss: the sum of its micro-batches' losses (each as the network computed
    /// it, added in f64), NaN before the first step; under token-weighted normalisation that
    /// sum divided by the step's tokens (0, the empty sum, without a token). The first call
    /// after a step reads what is still on the device, in one read.
    pub fn step_loss(&self, normalization: Normalization) -> f64 {
        if let Some(l) = self.loss.get() {
            return l;
        }
        let on_device: Vec<_> =
            self.losses.iter().filter_map(|l| if let Loss::Device(Value::Float(t)) = l { Some(t.clone()) } else { None }).collect();
        let losses = on_device.len();
        let counts = self.counts.iter().filter(|c| c.1).map(|c| c.0.clone());
        let mut read = read_scalars::<B>(on_device.into_iter().map(Value::Float).chain(counts).collect()).into_iter();
        let tokens = self.tokens + read.clone().skip(losses).sum::<f64>();
        let l = if self.losses.is_empty() {
            f64::NAN
        } else {
            self.losses
                .iter()
                .map(|l| match l {
                    Loss::Read(v) => *v,
                    Loss::Device(Value::Float(_)) => read.next().unwrap_or(f64::NAN),
                    Loss::Device(v) => v.to_host().scalar(),
                })
                .sum()
        };
        let l = if normalization == Normalization::Tokens && tokens > 0.0 { l / tokens } else { l };
        self.loss.set(Some(l));
        l
    }

    /// Reads the window's unread token counts in one read, adds the last step's to its tokens,
    /// and returns their sum (items the window has not counted yet).
    pub fn settle(&mut self) -> u64 {
        let counts = std::mem::take(&mut self.counts);
        let read = read_scalars::<B>(counts.iter().map(|c| c.0.clone()).collect());
        let mut items = 0;
        for ((_, last), c) in counts.into_iter().zip(read) {
            items += c as u64;
            if last {
                self.tokens += c;
            }
        }
        items
    }

    /// What [`Self::settle`] would return, without taking the counts (a snapshot's copy).
    pub fn unread_items(&self) -> u64 {
        read_scalars::<B>(self.counts.iter().map(|c| c.0.clone()).collect()).into_iter().map(|c| c as u64).sum()
    }
}

/// Device scalars (losses, token counts) as f64, in one read: gathered on the device first.
fn read_scalars<B: Backend>(vals: Vec<Value<B>>) -> Vec<f64> {
    match vals.len() {
        0 => Vec::new(),
        1 => vals[0].to_host().to_f64(),
        _ => {
            let floats: Option<Vec<_>> = vals.iter().map(|v| if let Value::Float(t) = v { Some(t.clone()) } else { None }).collect();
            match floats {
                Some(ts) => Value::<B>::Float(B::float_cat(ts, 0)).to_host().to_f64(),
                None => vals.iter().flat_map(|v| v.to_host().to_f64()).collect(),
            }
        }
    }
}

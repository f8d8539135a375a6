//! The trained parameters' buffers: each trained parameter's value, its accumulator and each
//! of its optimizer states, addressed by a typed [`Slot`] whose session name is worked out once;
//! flat host copies of one kind of buffer (what crosses the ranks); and, on device backends,
//! the flat buffers behind them.

use burn_backend::tensor::FloatTensor;
use cellgraph_cells::Optimizer;
use cellgraph_compiler::{HostData, HostTensor, TensorType};

use crate::backend::{HostSlice, HostVec, FLAT_ALIGN};
use crate::error::{Result, RuntimeError};
use crate::exec::{Executable, Session};
use crate::value::Value;
use crate::Backend;
use cellgraph_compiler::program::Program;

/// Which of a trained parameter's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Param,
    Accu,
    /// The optimizer's `i`-th state (`moments` for Momentum).
    State(usize),
}

impl Kind {
    fn index(self) -> usize {
        match self {
            Kind::Param => 0,
            Kind::Accu => 1,
            Kind::State(i) => 2 + i,
        }
    }
}

/// One buffer of one trained parameter (`param`: its place in flat-buffer order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    pub kind: Kind,
    pub param: usize,
}

/// A trained parameter.
#[derive(Clone, Debug)]
struct Trained {
    name: String,
    shape: Vec<usize>,
    len: usize,
}

/// Flat device buffers (see [`Backend::flat_buffers`]): every trained parameter, its
/// accumulator and each of its optimizer states is a view of one buffer per kind, at an
/// aligned offset, so a boundary is one fused kernel launch and a collective moves one buffer.
struct Flat<B: Backend> {
    /// The optimizer's update, the boundary kernel's program.
    prog: Program,
    /// Each trained parameter's offset, in flat-buffer order.
    offsets: Vec<usize>,
    len: usize,
    /// One buffer per kind, in [`Kind::index`] order.
    buffers: Vec<FloatTensor<B>>,
}

/// The trained parameters' buffers in a session.
pub(crate) struct Store<B: Backend> {
    params: Vec<Trained>,
    /// `names[kind.index()][param]`: the session name of each slot.
    names: Vec<Vec<String>>,
    /// Each kind's initial value (what pads its flat buffer).
    inits: Vec<f32>,
    flat: Option<Flat<B>>,
    /// On host backends: the optimizer's update, run as a one-pass boundary program (see
    /// [`Self::host_update`]).
    host: Option<Program>,
}

impl<B: Backend> Store<B> {
    /// The buffers of the parameters `(name, type)` trained with `opt`: accumulators named
    /// `accumulator(name)`, state as the optimizer names it.
    pub fn new(params: &[(String, TensorType)], accumulator: impl Fn(&str) -> String, opt: &dyn Optimizer) -> Self {
        let specs: Vec<_> = params.iter().map(|(name, ty)| opt.state(name, ty)).collect();
        let kinds = specs.first().map_or(0, Vec::len);
        let mut names = vec![params.iter().map(|(n, _)| n.clone()).collect(), params.iter().map(|(n, _)| accumulator(n)).collect()];
        names.extend((0..kinds).map(|k| specs.iter().map(|s| s[k].name.clone()).collect()));
        let mut inits = vec![0.0, 0.0];
        inits.extend(specs.first().into_iter().flatten().map(|s| s.init as f32));
        let params = params.iter().map(|(name, ty)| Trained { name: name.clone(), shape: ty.dims().to_vec(), len: ty.numel() }).collect();
        let host = B::HOST.then(|| opt.update());
        Store { params, names, inits, flat: None, host }
    }

    /// Whether [`Self::host_update`] runs (on host backends).
    pub fn set_one_pass(&mut self, opt: &dyn Optimizer, on: bool) {
        self.host = (B::HOST && on).then(|| opt.update());
    }

    /// The session name of a slot.
    pub fn name(&self, s: Slot) -> &str {
        &self.names[s.kind.index()][s.param]
    }

    /// Every kind: the parameters, the accumulators, each optimizer state.
    pub fn kinds(&self) -> impl Iterator<Item = Kind> {
        [Kind::Param, Kind::Accu].into_iter().chain((0..self.names.len() - 2).map(Kind::State))
    }

    /// The slots of one kind, in flat-buffer order.
    pub fn slots(&self, kind: Kind) -> impl Iterator<Item = Slot> {
        (0..self.params.len()).map(move |param| Slot { kind, param })
    }

    /// The trained parameters' names, in flat-buffer order.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.params.iter().map(|p| p.name.as_str())
    }

    /// Elements of one kind's flat buffer, unpadded.
    pub fn total(&self) -> usize {
        self.params.iter().map(|p| p.len).sum()
    }

    pub fn is_flat(&self) -> bool {
        self.flat.is_some()
    }

    /// Splits a flat buffer of one kind into one tensor per trained parameter, shaped like it.
    pub fn split<'a>(&'a self, flat: &'a [f32]) -> impl Iterator<Item = (usize, HostTensor)> + 'a {
        self.params.iter().enumerate().scan(0, move |at, (i, p)| {
            let t = HostTensor::f32(p.shape.clone(), flat[*at..*at + p.len].to_vec()).expect("sizes match");
            *at += p.len;
            Some((i, t))
        })
    }

    /// One kind's buffers as one flat f32 buffer (from the device buffer when flat: one read).
    pub fn gather(&self, session: &Session<B>, kind: Kind) -> Result<Vec<f32>> {
        self.gather_range(session, kind, 0, self.total())
    }

    /// Elements `lo..lo + len` of one kind's flat buffer (unpadded order), zeros past its end:
    /// on host backends one copy, straight out of the session's memory.
    pub fn gather_range(&self, session: &Session<B>, kind: Kind, lo: usize, len: usize) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(len);
        let all = self.flat.as_ref().map(|f| Value::<B>::Float(f.buffers[kind.index()].clone()).to_host().to_f32());
        let mut at = 0;
        for (s, p) in self.slots(kind).zip(&self.params) {
            let (a, b) = (lo.max(at), (lo + len).min(at + p.len));
            if a < b {
                let part = a - at..b - at;
                match (&all, &self.flat) {
                    (Some(all), Some(f)) => out.extend_from_slice(&all[f.offsets[s.param]..][part]),
                    _ => {
                        let name = self.name(s);
                        let v = session.value(name).ok_or_else(|| RuntimeError::MissingParam(name.into()))?;
                        let not_f32 = || {
                            RuntimeError::Comm(format!(
                                "data parallelism needs f32 values; `{name}` is held in another type (use the f32 CPU backend or a device)"
                            ))
                        };
                        match v {
                            Value::Float(t) => match B::host_slice(t) {
                                Some(HostSlice::F32(h)) => out.extend_from_slice(&h[part]),
                                Some(HostSlice::F64(_)) => return Err(not_f32()),
                                None => match &v.to_host().data {
                                    HostData::F32(h) => out.extend_from_slice(&h[part]),
                                    _ => return Err(not_f32()),
                                },
                            },
                            _ => return Err(not_f32()),
                        }
                    }
                }
            }
            at += p.len;
        }
        out.resize(len, 0.0);
        Ok(out)
    }

    /// Sets one kind's buffers from a flat f32 buffer (into the device buffer when flat).
    pub fn scatter(&mut self, session: &mut Session<B>, kind: Kind, data: &[f32]) {
        if self.flat.is_some() {
            return self.upload(session, kind, data);
        }
        for (param, t) in self.split(data) {
            session.write_param(self.name(Slot { kind, param }), t);
        }
    }

    /// Moves every buffer into flat device buffers, when the backend keeps them so and the
    /// optimizer's update fits the boundary kernel (re-packs them when already flat, after
    /// values were set from the host).
    pub fn enter_flat(&mut self, session: &mut Session<B>, opt: &dyn Optimizer) -> Result<()> {
        if !B::flat_buffers() || self.params.is_empty() {
            return Ok(());
        }
        let prog = opt.update();
        if !crate::kernel::boundary_kernel_takes(&prog) {
            return Ok(());
        }
        let mut offsets = Vec::new();
        let mut len = 0;
        for p in &self.params {
            offsets.push(len);
            len += p.len.div_ceil(FLAT_ALIGN) * FLAT_ALIGN;
        }
        let mut buffers = Vec::new();
        for kind in self.kinds() {
            let mut v = vec![self.inits[kind.index()]; len];
            for (s, &at) in self.slots(kind).zip(&offsets) {
                let name = self.name(s);
                let t = session.param(name).ok_or_else(|| RuntimeError::MissingParam(name.into()))?;
                v[at..at + self.params[s.param].len].copy_from_slice(&t.to_f32());
            }
            buffers.push(B::from_host_vec(HostVec::F32(v), &[len], session.device()));
        }
        self.flat = Some(Flat { prog, offsets, len, buffers });
        for kind in self.kinds() {
            self.bind_views(session, kind);
        }
        session.set_in_place_accumulation(true);
        Ok(())
    }

    /// Back to one tensor per name (hsdp updates slices on the host).
    pub fn leave_flat(&mut self, session: &mut Session<B>) {
        if self.flat.take().is_none() {
            return;
        }
        for kind in self.kinds() {
            for s in self.slots(kind) {
                let name = self.name(s);
                if let Some(t) = session.param(name) {
                    session.set_param(name, &t);
                }
            }
        }
        session.set_in_place_accumulation(false);
    }

    /// Points every slot of `kind` at its part of the flat buffer.
    fn bind_views(&self, session: &mut Session<B>, kind: Kind) {
        let Some(f) = &self.flat else { return };
        for (s, &at) in self.slots(kind).zip(&f.offsets) {
            let view = B::flat_view(&f.buffers[kind.index()], at, &self.params[s.param].shape).expect("flat offsets are aligned and in bounds");
            session.set_value(self.name(s), Value::Float(view));
        }
    }

    /// Sets the flat buffer of `kind` to `data` (unpadded, in flat-buffer order): into the
    /// buffer's own memory where the backend writes into one (a device's), so that its views,
    /// and the captured graphs that read them, stay (a data-parallel boundary scatters the
    /// ranks' summed accumulators here every window; a new buffer made every micro-step graph
    /// forget itself, and nothing replayed); elsewhere a new buffer, whose new views forget the
    /// captured graphs that read the old ones (see [`crate::replay`]).
    fn upload(&mut self, session: &mut Session<B>, kind: Kind, data: &[f32]) {
        let Some(f) = &mut self.flat else { return };
        let mut v = vec![self.inits[kind.index()]; f.len];
        let mut from = 0;
        for (p, &at) in self.params.iter().zip(&f.offsets) {
            v[at..at + p.len].copy_from_slice(&data[from..from + p.len]);
            from += p.len;
        }
        let v = match B::write_float(&f.buffers[kind.index()], burn_backend::TensorData::new(v, [f.len])) {
            Ok(()) => return,
            Err(d) => d.try_into_vec::<f32>().expect("written as f32"),
        };
        f.buffers[kind.index()] = B::from_host_vec(HostVec::F32(v), &[f.len], session.device());
        self.bind_views(session, kind);
    }

    /// Zeroes the accumulators of flat buffers, in their own memory where the backend writes
    /// into a buffer (a device's: [`Backend::write_float`]), so that their views, and the
    /// captured graphs that read them, stay. (A new buffer gave the accumulators new views,
    /// and every graph reading them forgot itself: under f16 loss scaling each window skipped
    /// for an overflow made the micro-step warm up and be captured again.)
    pub fn clear_flat(&mut self, session: &mut Session<B>) {
        if let Some(f) = &self.flat {
            let zeros = burn_backend::TensorData::new(vec![0.0f32; f.len], [f.len]);
            if B::write_float(&f.buffers[Kind::Accu.index()], zeros).is_ok() {
                return;
            }
        }
        let zeros = vec![0.0; self.total()];
        self.upload(session, Kind::Accu, &zeros);
    }

    /// The boundary on a host backend: for each trained parameter one pass updates it (and its
    /// optimizer states) from its accumulator times `scale` and zeroes the accumulator, in the
    /// memory the session holds them in: the optimizer and clear graphs' results, bit for bit,
    /// reading and writing each buffer once instead of once per op. Under clipping by global
    /// norm, `clip` (the optimizer graph's clipping alone) runs first, and its factor
    /// multiplies each gradient as the optimizer graph's does. Returns false (and changes
    /// nothing) where it does not apply: a device backend, a program that does not fit, values
    /// that are not f32.
    pub fn host_update(&self, session: &mut Session<B>, scale: f64, clip: Option<&Executable>, scalars: &[f64]) -> Result<bool> {
        let Some(prog) = &self.host else { return Ok(false) };
        // Every buffer an f32 host value of its parameter's length, before any is changed.
        let host_f32 = |kind, i: usize, t: &Trained| match session.value(self.name(Slot { kind, param: i })) {
            Some(Value::Float(v)) => crate::host::is_host_f32::<B>(v, t.len),
            _ => false,
        };
        if !self.params.iter().enumerate().all(|(i, t)| self.kinds().all(|k| host_f32(k, i, t))) {
            return Ok(false);
        }
        let factor = match clip {
            Some(clip) => session.run(clip, &[HostTensor::scalar_f32(scale)])?[0].to_f32()[0],
            None => 1.0,
        };
        let scalars: Vec<f32> = scalars.iter().map(|&v| v as f32).collect();
        let device = session.device().clone();
        for (i, t) in self.params.iter().enumerate() {
            let names: Vec<&str> = self.kinds().map(|kind| self.name(Slot { kind, param: i })).collect();
            let bufs: Vec<FloatTensor<B>> = names
                .iter()
                .map(|n| match session.take_value(n) {
                    Some(Value::Float(t)) => t,
                    _ => unreachable!("checked above"),
                })
                .collect();
            let Ok(out) = crate::host::update_clear::<B>(prog, bufs, &t.shape, &scalars, scale as f32, factor, &device) else {
                unreachable!("f32 host values of one length, checked above")
            };
            for (n, b) in names.iter().zip(out) {
                session.set_value(n, Value::Float(b));
            }
        }
        Ok(true)
    }

    /// The boundary on flat buffers: one fused kernel updates every parameter from its
    /// accumulator times `scale` (clipped by global norm when `clip` is given) and zeroes the
    /// accumulators. Returns the kernels launched; `None` when the buffers are not flat.
    pub fn fused_update(&self, scale: f64, clip: Option<f64>, scalars: &[f64]) -> Option<Result<usize>> {
        let f = self.flat.as_ref()?;
        let [params, accu, state @ ..] = &f.buffers[..] else { unreachable!("flat buffers hold parameters and accumulators") };
        let mut scale = scale;
        if clip.is_some() {
            let sq = B::sum_in_order(B::float_mul(accu.clone(), accu.clone()));
            scale = super::window::clipped(scale, Value::<B>::Float(sq).to_host().scalar(), clip);
        }
        let scalars: Vec<f32> = scalars.iter().map(|&v| v as f32).collect();
        Some(
            B::fused_update(&f.prog, params, accu, state, scale as f32, &scalars)
                .ok_or_else(|| RuntimeError::Device("the backend keeps flat buffers but has no fused update kernel".into())),
        )
    }
}

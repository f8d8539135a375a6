//! What a plan says it runs: each step's kernel on a host backend
//! ([`Executable::host_steps`], `cellgraph inspect plan`) and where its bf16 products run
//! ([`Executable::bf16_products`]).

use std::collections::BTreeMap;

use cellgraph_compiler::{Op, TensorType};

use super::bind::{self, Exec, HostRun, KeptF32};
use super::plan::{self, Executable, Step};
use super::Session;
use crate::kernel::{Native, Products};
use crate::Backend;

/// How a plan multiplies the products whose operands hold bf16 values (see
/// [`Executable::bf16_products`]): chosen when the plan was compiled.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bf16Products {
    /// Where the fast ones run: AMX tiles or AVX-512 BF16 pairs on host backends, tensor cores
    /// on devices.
    pub unit: Bf16Unit,
    /// Products on that unit with f32 sums: [`crate::kernel::Products::Bf16`] on the host; on
    /// a device, every matmul and batched matmul (and epilogue head) of bf16 values, every
    /// convolution cubek's implicit GEMM takes ([`crate::kernel::Geometry::implicit_gemm_declines`])
    /// and every attention forward cubek's flash attention takes
    /// ([`crate::kernel::flash_attention_takes`]).
    pub fast: usize,
    /// Of `fast`: attention forwards, on f16 fragments (`cube::flash`).
    pub flash: usize,
    /// Those that multiply in exact f32 (the emulation), by op: attention and direct
    /// convolutions have no bf16 kernel on the host; attention's gradient (and its forward
    /// where cubek's flash attention does not take the width), grouped convolutions and
    /// convolutions the implicit GEMM does not take (asymmetric padding, an input gradient
    /// at stride > 1) none on devices; on a CPU without AVX-512 BF16, or an Intel core
    /// without AMX (where the f32 GEMM is faster: [`crate::host::bf16::pays`]), all of them.
    pub in_f32: BTreeMap<&'static str, usize>,
}

/// The unit that multiplies a plan's fast bf16 products ([`Bf16Products`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Unit {
    /// The CPU's `vdpbf16ps`: pairs of bf16 values multiplied, summed in f32. Also the host
    /// unit named where plans choose neither it nor the tiles ([`crate::host::bf16::pays`]):
    /// then every product is in `in_f32` and the line says why.
    #[default]
    Avx512Pairs,
    /// The CPU's AMX tiles (`tdpbf16ps`: 16 x 32 by 32 x 16 bf16 values into 16 x 16 f32
    /// sums), where the core has AMX-BF16 and Linux grants the tile data
    /// ([`crate::host::amx::available`]; `CELLGRAPH_AMX=0` refuses them).
    AmxTiles,
    /// cubek's tensor-core matmul and implicit-GEMM convolution on TF32 operands with f32
    /// sums. A bf16 value is a TF32 value (8 significant bits of TF32's 11), so these are the
    /// products of bf16 tensor cores, not a rounding of them; where the device has no
    /// tensor-core kernel the exact-f32 kernels run them, counted
    /// ([`crate::cube::tf32_fallbacks`]).
    Tf32TensorCores,
}

impl std::fmt::Display for Bf16Products {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let f32s: usize = self.in_f32.values().sum();
        let unit = match self.unit {
            Bf16Unit::Avx512Pairs => "AVX-512 BF16 pairs",
            Bf16Unit::AmxTiles => "AMX tiles",
            Bf16Unit::Tf32TensorCores => "tensor cores (TF32 operands, exact for bf16 values)",
        };
        let flash = match self.flash {
            0 => String::new(),
            n => format!(" ({n} of them attention forwards, on f16 fragments)"),
        };
        write!(f, "bf16 products: {} on {unit}{flash}, {f32s} in f32", self.fast)?;
        if let Some(why) = crate::host::bf16::declined().filter(|_| self.unit == Bf16Unit::Avx512Pairs) {
            write!(f, " (f32 emulation: {why})")?;
        } else if f32s > 0 {
            let each: Vec<String> = self.in_f32.iter().map(|(op, n)| format!("{op} {n}")).collect();
            write!(f, " ({})", each.join(", "))?;
        }
        Ok(())
    }
}

/// What a device session stores in bf16 / f16 of a low-precision plan
/// ([`Session::low_precision_storage`]), counted over the values the plan holds in that type
/// (its reshapes, views, left out).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LowStorage {
    /// The plan's low-precision type.
    pub dtype: cellgraph_compiler::DType,
    /// Values stored in it, and their bytes.
    pub values: usize,
    pub bytes: usize,
    /// Values of it stored in f32, and their bytes.
    pub f32_values: usize,
    pub f32_bytes: usize,
    /// Why those stay f32, by reason (the first reader that does not read the type...).
    pub kept_f32: KeptF32,
    /// The most bytes the micro-step's values hold at once with this storage, and in f32
    /// ([`Executable::peak_bytes`]): the schedule's liveness simulation.
    pub peak_bytes: usize,
    pub f32_peak_bytes: usize,
}

impl std::fmt::Display for LowStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |b: usize| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "{} storage: {} values in {} ({:.2} MiB), {} in f32 ({:.2} MiB)",
            self.dtype,
            self.values,
            self.dtype,
            mb(self.bytes),
            self.f32_values,
            mb(self.f32_bytes)
        )?;
        write!(f, "; peak {:.2} MiB (f32 storage: {:.2} MiB)", mb(self.peak_bytes), mb(self.f32_peak_bytes))?;
        if !self.kept_f32.is_empty() {
            let each: Vec<String> = self.kept_f32.iter().map(|(why, n)| format!("{why} {n}")).collect();
            write!(f, "; f32 where {}", each.join(", "))?;
        }
        Ok(())
    }
}

impl<B: Backend> Session<B> {
    /// What each step of `exe` runs in this session, in order (`cellgraph inspect plan
    /// --device`): on a host backend [`Executable::host_steps`]; on a device the same kinds, as
    /// the session binds them: a kernel (the device's own), a source, a collective, or burn's
    /// ops and why (no kernel bound for the op, or one the device's kernels decline:
    /// [`Backend::device_declines`]).
    pub fn steps(&self, exe: &Executable) -> Vec<HostStep> {
        if B::HOST && self.native {
            let mut steps = exe.host_steps();
            // As the binding decides ([`Self::decide`]).
            let execs = self.decide(exe);
            for ((hs, st), e) in steps.iter_mut().zip(&exe.steps).zip(&execs) {
                if self.rounded_when_packed(st) {
                    hs.run = HostRun::RoundedWhenPacked;
                }
                if let (Exec::Merged, Some(m)) = (e, &st.merged) {
                    hs.run = HostRun::Kernel(bind::kernel_name(&m.kernel));
                }
            }
            for (i, st) in exe.steps.iter().enumerate() {
                let Some(j) = st.merged_into.filter(|&j| execs[j] == Exec::Merged && execs[i] == Exec::Pass(0)) else { continue };
                steps[i].run = match exe.steps[j].merged.as_ref().map(|m| m.kind) {
                    Some(plan::Merge::Rounding) => HostRun::RoundedInProducer,
                    Some(plan::Merge::Sum) => HostRun::SummedInProducer,
                    None => unreachable!("bound as merged with a merged kernel"),
                };
            }
            return steps;
        }
        exe.steps
            .iter()
            .map(|st| {
                let declined = self.declines(st);
                let why = declined.why();
                let run = match bind::exec_of(st, B::HOST, self.native, self.in_place, &declined) {
                    Exec::Deferred | Exec::Param | Exec::Input | Exec::SharedConstant => HostRun::Source,
                    Exec::Collective => HostRun::Collective,
                    Exec::ReshapeInPlace => HostRun::Reshape,
                    Exec::AddInPlace => HostRun::AccumulateInPlace,
                    Exec::Pass(0) => HostRun::Identity,
                    Exec::Pass(_) => HostRun::Store,
                    Exec::Kernel | Exec::Merged | Exec::AccumulateInto(_) => match &st.kernel {
                        Some(k) => HostRun::Kernel(bind::kernel_name(k)),
                        None => HostRun::BurnOps(format!("no kernel for `{}`", st.op.label())),
                    },
                    Exec::HeadKernel => match &st.kernel {
                        Some(Native::Epilogue { head, .. }) => HostRun::Kernel(format!(
                            "{}, then its program on burn's ops: the device's kernels decline it: {}",
                            bind::kernel_name(head),
                            why.unwrap_or_default()
                        )),
                        _ => unreachable!("bound to epilogues only"),
                    },
                    // A reshape moves no values (on a device, a view of its operand's buffer).
                    Exec::Burn if matches!(st.op, Op::Reshape { .. } | Op::Flatten) => HostRun::Reshape,
                    Exec::Burn => HostRun::BurnOps(match (why, &st.kernel) {
                        (Some(why), _) => format!("the device's kernels decline it: {why}"),
                        (None, Some(_)) => "bound kernels are off in this session".into(),
                        (None, None) => format!("no kernel for `{}`", st.op.label()),
                    }),
                };
                HostStep { node: st.slot, op: st.op.label(), scope: st.scope.clone(), ty: st.ty.clone(), run }
            })
            .collect()
    }

    /// Stores a low-precision plan's values (`Precision::bf16()` / `f16()`: values the
    /// precision pass rounds) in bf16 / f16 on a device, half the bytes of f32, where the
    /// device's kernels read and write them: results of fused programs and of products'
    /// epilogues read only by such programs and by cubek's matmuls (on by default). They hold
    /// the same values as in f32 storage, so a run gives the same bits either way; off, every
    /// value is f32 (the emulation). Host backends, f32 plans and devices without the type
    /// (bf16 on wgpu) store f32. See [`Self::low_precision_storage`].
    pub fn set_low_precision_storage(&mut self, on: bool) {
        self.low_storage = on;
    }

    /// What [`Self::set_low_precision_storage`] stores of `exe` in this session: `None` when
    /// it computes in f32 (or the session stores nothing low).
    pub fn low_precision_storage(&mut self, exe: &Executable) -> Option<LowStorage> {
        let dtype = exe.steps.iter().find_map(|st| st.holds)?;
        let b = self.execs(exe);
        let bytes = |st: &Step| st.ty.numel() * 4;
        let peak_bytes = super::plan::simulate_peak_stored(&exe.graph, &exe.steps, &b.stores);
        let kept_f32 = b.kept_f32.clone();
        let mut s = LowStorage { dtype, values: 0, bytes: 0, f32_values: 0, f32_bytes: 0, kept_f32, peak_bytes, f32_peak_bytes: exe.peak_bytes };
        for (st, store) in exe.steps.iter().zip(&b.stores) {
            let view = matches!(st.op, Op::Reshape { .. } | Op::Flatten);
            if view || st.holds.is_none() {
                continue;
            }
            if store.is_some() {
                s.values += 1;
                s.bytes += bytes(st) / 2;
            } else {
                s.f32_values += 1;
                s.f32_bytes += bytes(st);
            }
        }
        Some(s)
    }
}

/// One step of a plan as [`Executable::host_steps`] lists it.
#[derive(Clone, Debug)]
pub struct HostStep {
    /// The graph node the step computes.
    pub node: usize,
    /// The op's label (`matmul`, `fused`).
    pub op: &'static str,
    /// The op's scope (`net.fc1`, `Gradients/...`).
    pub scope: String,
    /// The step's result type.
    pub ty: TensorType,
    pub run: HostRun,
}

impl std::fmt::Display for HostStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let run = match &self.run {
            HostRun::Source => "source".to_string(),
            HostRun::Reshape => "reshape (a view at the operand's last use)".to_string(),
            HostRun::AccumulateInPlace => "assign_add in place".to_string(),
            HostRun::Collective => "collective".to_string(),
            HostRun::Store => "store (the new value, moved)".to_string(),
            HostRun::Identity => "identity (its operand)".to_string(),
            HostRun::RoundedWhenPacked => "none: the bf16 products that read it round it as they pack it".to_string(),
            HostRun::RoundedInProducer => "none: the attention before it rounds its result as it writes it".to_string(),
            HostRun::SummedInProducer => "none: the program before it sums its values as it computes them".to_string(),
            HostRun::Kernel(k) => format!("kernel {k}"),
            HostRun::BurnOps(why) => format!("burn ops: {why}"),
        };
        write!(f, "%{} {} {} [{}]: {run}", self.node, self.op, self.ty, self.scope)
    }
}

impl Executable {
    /// What each step of the plan runs on a host backend, in order: a bound kernel, a source,
    /// a reshape, an accumulation in place, a collective, or burn's ops and why
    /// (`cellgraph inspect plan`). Device backends run the same bound kernels on their own
    /// kernels where they have them.
    pub fn host_steps(&self) -> Vec<HostStep> {
        self.steps
            .iter()
            .map(|st| {
                let run = super::bind::host_run(st);
                HostStep { node: st.slot, op: st.op.label(), scope: st.scope.clone(), ty: st.ty.clone(), run }
            })
            .collect()
    }

    /// The plan's products whose operands hold bf16 values (a plan compiled from a graph the
    /// precision pass rounded to bf16), and what each runs on on backend `B`; `None` when it
    /// has none.
    pub fn bf16_products<B: Backend>(&self) -> Option<Bf16Products> {
        let unit = match B::HOST {
            true if crate::host::bf16_on_amx() => Bf16Unit::AmxTiles,
            true => Bf16Unit::Avx512Pairs,
            false => Bf16Unit::Tf32TensorCores,
        };
        let mut out = Bf16Products { unit, ..Default::default() };
        for st in self.steps.iter().filter(|st| st.bf16_operands) {
            let head = match &st.kernel {
                Some(Native::Epilogue { head, .. }) => Some(&**head),
                k => k.as_ref(),
            };
            let fast = match head {
                Some(Native::MatMul { .. } | Native::BatchMatMul { .. }) if !B::HOST => true,
                Some(Native::Conv { kind, g, groups, .. }) if !B::HOST => g.implicit_gemm_declines(*kind, *groups).is_none(),
                // The forward on cubek's flash attention; its gradient on the runtime's kernels.
                Some(&Native::Attention { grad: false, heads, d, .. }) if !B::HOST => crate::kernel::flash_attention_takes(heads, d),
                Some(
                    Native::MatMul { products: Products::Bf16, .. }
                    | Native::BatchMatMul { products: Products::Bf16, .. }
                    | Native::Conv { products: Products::Bf16, .. },
                ) => B::HOST,
                _ => false,
            };
            if fast {
                out.fast += 1;
                out.flash += usize::from(matches!(head, Some(Native::Attention { .. })));
            } else {
                let op = match &st.op {
                    Op::Epilogue { head, .. } => head.label(),
                    op => op.label(),
                };
                *out.in_f32.entry(op).or_default() += 1;
            }
        }
        (out.fast + out.in_f32.values().sum::<usize>() > 0).then_some(out)
    }
}

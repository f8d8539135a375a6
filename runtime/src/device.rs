//! Choosing where a program runs: `--device cpu | cuda | cuda:N | wgpu | auto`.
//!
//! `auto` (the programs' default) takes a CUDA GPU when the binary was built with the `cuda`
//! feature and the driver reports one (rank `r` of a job takes GPU `r % count`), and the CPU
//! otherwise; the returned message says which and why.

use crate::error::{Result, RuntimeError};

/// A device a program can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// burn-ndarray with the host kernels.
    Cpu,
    /// CUDA GPU `N` through cubecl (feature `cuda`).
    Cuda(usize),
    /// cubecl's wgpu runtime, default adapter (feature `wgpu`).
    Wgpu,
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceSpec::Wgpu => write!(f, "wgpu"),
        }
    }
}

/// CUDA GPUs the driver reports; 0 without the driver, without a GPU, or without the `cuda`
/// feature.
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to open the driver library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    0
}

fn bad(flag: &str, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Device(format!("--device {flag}: {}", detail.into()))
}

/// Resolves a `--device` value for the process of local rank `local_rank`; returns the
/// device and a one-line message saying what was chosen and why.
pub fn choose(requested: &str, local_rank: usize) -> Result<(DeviceSpec, String)> {
    let gpus = cuda_device_count();
    let cuda_built = cfg!(feature = "cuda");
    match requested {
        "cpu" => Ok((DeviceSpec::Cpu, "device: cpu".into())),
        "auto" if gpus > 0 => {
            let d = DeviceSpec::Cuda(local_rank % gpus);
            Ok((d, format!("device: {d} (auto: {gpus} CUDA GPU(s) found)")))
        }
        "auto" => {
            let why = if cuda_built { "no CUDA GPU or driver found" } else { "built without the `cuda` feature" };
            Ok((DeviceSpec::Cpu, format!("device: cpu (auto: {why})")))
        }
        "wgpu" if cfg!(feature = "wgpu") => Ok((DeviceSpec::Wgpu, "device: wgpu".into())),
        "wgpu" => Err(bad(requested, "this binary was built without the `wgpu` feature; rebuild with `--features wgpu`")),
        s if s == "cuda" || s.starts_with("cuda:") => {
            if !cuda_built {
                return Err(bad(s, "this binary was built without the `cuda` feature; rebuild with `--features cuda`"));
            }
            if gpus == 0 {
                return Err(bad(s, "no CUDA GPU found (the driver library libcuda.so did not load or reports no device); use `--device cpu`"));
            }
            let index = match s.strip_prefix("cuda:") {
                None => local_rank % gpus,
                Some(n) => n.parse::<usize>().map_err(|_| bad(s, "expected `cuda:N` with N a GPU index"))?,
            };
            if index >= gpus {
                return Err(bad(s, format!("GPU {index} does not exist; this machine has {gpus} (cuda:0..cuda:{})", gpus - 1)));
            }
            Ok((DeviceSpec::Cuda(index), format!("device: cuda:{index} ({gpus} CUDA GPU(s) found)")))
        }
        other => Err(bad(other, "expected cpu, cuda, cuda:N, wgpu or auto")),
    }
}

/// The local rank under mpirun (`OMPI_COMM_WORLD_LOCAL_RANK`), else 0.
pub fn local_rank() -> usize {
    std::env::var("OMPI_COMM_WORLD_LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A job generic over the backend, run by [`dispatch`] on the backend a [`DeviceSpec`] names.
pub trait OnDevice {
    type Output;
    fn run<B: crate::Backend>(self, device: burn_backend::tensor::Device<B>) -> Self::Output;
}

/// Runs `job` on the device `spec` names: CPU (f32), CUDA GPU `N`, or wgpu's default adapter.
/// A device this binary was built without is an error naming the feature.
pub fn dispatch<T: OnDevice>(spec: DeviceSpec, job: T) -> Result<T::Output> {
    match spec {
        DeviceSpec::Cpu => Ok(job.run::<crate::Cpu>(crate::cpu())),
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda(index) => Ok(job.run::<crate::cube::Cuda>(crate::cube::CudaDevice { index })),
        #[cfg(feature = "wgpu")]
        DeviceSpec::Wgpu => Ok(job.run::<crate::cube::Wgpu>(crate::cube::WgpuDevice::DefaultDevice)),
        #[allow(unreachable_patterns)]
        other => Err(RuntimeError::Device(format!("device {other}: this binary was built without its feature (`cuda` or `wgpu`)"))),
    }
}

//! The CUDA backend of distattn: flash attention kernels compiled at run time by NVRTC, on one
//! GPU, and this GPU as a backend of the plan interpreter.
//!
//! * [`compile`]: the kernel sources (`src/kernels/`: common helpers, sm80 forward and
//!   backward on `mma.sync`, sm90 primitives and forward and backward on `wgmma` and TMA, the
//!   auxiliary kernels) compiled by NVRTC for the GPU found, one path for every module, cached
//!   on disk; [`params`] holds the parameter structs the kernels take, checked field by field.
//! * [`CudaBackend`] ([`device`]): a GPU's context, its compute and comm streams, its loaded
//!   modules; attention on device buffers ([`attention`]) and on host slices ([`host`]); masks
//!   arrive as per-tile lists built on the host ([`tiles::TilePlan`]): empty tiles are never
//!   visited, full tiles run without mask arithmetic, partial tiles read a bitmask.
//! * [`external`]: the same kernels on memory and a stream another library owns (the Python
//!   package launches them on PyTorch's tensors and current stream).
//! * [`backend`]: `CudaBackend` as a `distattn_exec::Backend` on [`GpuBuf`]s ([`buffer`]), so
//!   every plan runs on GPUs through the one interpreter; between GPU ranks of one process,
//!   NCCL (crate `distattn-nccl`) or, without it and on a single GPU, [`peer`] copies.
//!
//! CUDA is loaded at run time: the crate builds, and its host-side tests run, on machines
//! without it; [`cuda_available`] says whether a GPU can be used, and every failure is a
//! [`distattn_core::Error`], never a panic.

pub mod attention;
pub mod aux;
pub mod backend;
pub mod buffer;
pub mod compile;
pub mod decode;
pub mod device;
pub mod external;
pub mod fp8;
pub mod host;
pub mod params;
pub mod peer;
pub mod tiles;
mod tma;

pub use buffer::{DeviceElement, GpuBuf};
pub use cudarc;
pub use device::CudaBackend;

use compile::backend_err;
use cudarc::driver::{sys, CudaContext, DriverError, ValidAsZeroBits};
use distattn_core::Error;

/// Element types the attention kernels take (bf16, f16).
pub trait CudaElement: DeviceElement + ValidAsZeroBits + Unpin {}
impl CudaElement for half::bf16 {}
impl CudaElement for half::f16 {}

/// Maps a driver error to [`Error::Backend`], saying what was being done (and naming an
/// out-of-memory failure as such).
pub fn driver_err(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| {
        let oom = e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        backend_err(if oom { format!("{what}: out of GPU memory") } else { format!("{what}: {e:?}") })
    }
}

/// True when the CUDA driver library loads and reports at least one GPU. Never panics.
pub fn cuda_available() -> bool {
    gpu_count() > 0
}

/// Number of CUDA GPUs visible (0 without a driver).
pub fn gpu_count() -> usize {
    // SAFETY: only opens libcuda by the names cudarc knows, to see whether it loads, and drops the
    // handle; opening it runs its initialisers, as the first driver call would.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    std::panic::catch_unwind(|| CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_panic_without_gpu() {
        // On a machine without CUDA this must say so, not panic; with a GPU it must open it.
        if cuda_available() {
            assert!(CudaBackend::new(0).is_ok());
        } else {
            assert!(matches!(CudaBackend::new(0), Err(Error::Backend { .. })));
        }
        assert!(CudaBackend::new(1 << 20).is_err());
    }
}

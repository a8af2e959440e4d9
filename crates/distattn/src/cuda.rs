//! The single-GPU execution of [`crate::Attention`]: the typed API dispatched to the CUDA
//! kernels of the inputs' dtype (bf16 or f16).

use distattn_core::dtype::reinterpret;
use distattn_core::outputs::convert_vec;
use distattn_core::{AttnOptions, AttnShape, DType, Element, Error, Forward, Grads, Mask, Result};
use distattn_cuda::{CudaBackend, CudaElement};
use distattn_exec::HostTensors;
use half::{bf16, f16};

fn unsupported(dtype: DType) -> Error {
    Error::UnsupportedDType(format!("{dtype} on the CUDA backend, which takes bf16 or f16"))
}

fn forward_as<T: Element, E: CudaElement, O: Element>(
    gpu: &CudaBackend,
    full: &HostTensors<'_, T>,
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Forward<O>> {
    let (q, k, v) = (reinterpret::<T, E>(full.q)?, reinterpret::<T, E>(full.k)?, reinterpret::<T, E>(full.v)?);
    Ok(gpu.forward_host(q, k, v, shape, mask, opts)?.into_dtype())
}

/// Forward on one GPU; O comes back as `O` (from the kernel's f32 output).
pub(crate) fn forward<T: Element, O: Element>(
    gpu: &CudaBackend,
    full: &HostTensors<'_, T>,
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Forward<O>> {
    match T::DTYPE {
        DType::BF16 => forward_as::<T, bf16, O>(gpu, full, shape, mask, opts),
        DType::F16 => forward_as::<T, f16, O>(gpu, full, shape, mask, opts),
        d => Err(unsupported(d)),
    }
}

fn backward_as<T: Element, E: CudaElement, O: Element>(
    gpu: &CudaBackend,
    full: &HostTensors<'_, T>,
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Grads<O>> {
    let bwd = full.backward.as_ref().ok_or_else(|| Error::invalid("inputs", "a backward pass needs O, LSE and dO"))?;
    let (q, k, v) = (reinterpret::<T, E>(full.q)?, reinterpret::<T, E>(full.k)?, reinterpret::<T, E>(full.v)?);
    // The kernels read O in the input dtype (as FlashAttention's backward does).
    let o: Vec<E> = convert_vec(bwd.o.to_vec());
    let d_o = reinterpret::<T, E>(bwd.d_o)?;
    Ok(gpu.backward_host(q, k, v, &o, bwd.lse, d_o, shape, mask, opts)?.into_dtype())
}

/// Backward on one GPU; the gradients come back as `O`.
pub(crate) fn backward<T: Element, O: Element>(
    gpu: &CudaBackend,
    full: &HostTensors<'_, T>,
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Grads<O>> {
    match T::DTYPE {
        DType::BF16 => backward_as::<T, bf16, O>(gpu, full, shape, mask, opts),
        DType::F16 => backward_as::<T, f16, O>(gpu, full, shape, mask, opts),
        d => Err(unsupported(d)),
    }
}

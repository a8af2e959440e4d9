//! Attention on memory and a stream that another library owns — a PyTorch process's tensors
//! and its current stream. The caller allocates every tensor, the workspace included; these
//! functions check sizes and alignment they can see (shapes, head dims, 16-byte alignment),
//! enqueue the kernels on the caller's stream in the device's primary context (the one PyTorch
//! uses) and return without waiting, so they can be captured in a CUDA graph once the kernels of
//! the dtype and head dim are loaded and the mask's tile plan is on the device (any earlier call
//! with the same shapes and mask does both).

use crate::attention::{BackwardPtrs, DkDvPtrs, ForwardPtrs};
use crate::buffer::GpuBuf;
use crate::compile::backend_err;
use crate::device::CudaBackend;
use cudarc::driver::{sys, CudaStream};
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask, Result};
use std::sync::Arc;

/// Addresses of a forward's tensors, all allocated by the caller: Q `[b, nq, h, d]`, K and V
/// `[b, nk, hkv, d]` and O like Q, of the call's dtype; LSE `[b, h, nq]` f32.
#[derive(Debug, Clone, Copy)]
pub struct ExternalForward {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
}

/// Addresses of a backward's tensors, all allocated by the caller: the forward's inputs, O and
/// LSE, the output gradient dO, the gradients dQ, dK, dV (like Q, K, V), and the workspace:
/// `delta` (`[b, h, nq]` f32, any contents) and `dq_acc` (`[b, nq, h, d]` f32, **zeroed**), or 0
/// where [`CudaBackend::backward_dq_workspace`] says the backward needs none.
#[derive(Debug, Clone, Copy)]
pub struct ExternalBackward {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub d_o: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub delta: u64,
    pub dq_acc: u64,
}

/// `ptr` if it is a non-null, 16-byte aligned device address.
pub(crate) fn aligned(name: &str, ptr: u64) -> Result<u64> {
    if ptr == 0 || !ptr.is_multiple_of(16) {
        return Err(Error::invalid(name, format!("device address {ptr:#x} is null or not 16-byte aligned")));
    }
    Ok(ptr)
}

fn attention_dtype(dtype: DType) -> Result<DType> {
    match dtype {
        DType::BF16 | DType::F16 => Ok(dtype),
        d => Err(Error::UnsupportedDType(format!("{d} on the CUDA backend, which takes bf16 or f16"))),
    }
}

impl CudaBackend {
    /// Wraps a stream of this GPU's primary context that another library owns (PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default stream).
    ///
    /// # Safety
    /// `raw` is a live stream of this device's primary context, and stays alive while the
    /// returned wrapper (or work launched through it) is in use.
    pub unsafe fn borrow_stream(&self, raw: u64) -> Arc<CudaStream> {
        // SAFETY: the caller guarantees the stream belongs to this context and outlives the
        // wrapper, which does not destroy it.
        unsafe { self.context().wrap_borrowed_stream(raw as sys::CUstream) }
    }

    /// Enqueues the forward pass on `stream`, on the caller's memory.
    ///
    /// # Safety
    /// `stream` is a stream of this context; the addresses of `t` are device memory of this
    /// context holding the tensors [`ExternalForward`] lists in `dtype` (bf16 or f16) for
    /// `shape`, each large enough, not written by other work while the kernel runs.
    pub unsafe fn forward_external(
        &self,
        stream: &CudaStream,
        dtype: DType,
        t: &ExternalForward,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        let dtype = attention_dtype(dtype)?;
        let cfg = self.check_common(dtype, shape, mask)?;
        let p = ForwardPtrs {
            q: aligned("q", t.q)?,
            k: aligned("k", t.k)?,
            v: aligned("v", t.v)?,
            o: aligned("o", t.o)?,
            o_f32: 0,
            lse: aligned("lse", t.lse)?,
            merge: false,
        };
        self.check_stream(stream)?;
        // SAFETY: the caller's contract covers sizes and use; alignment was checked above, and
        // cfg comes from check_common.
        unsafe { self.launch_forward(stream, dtype, cfg, &p, shape, mask, opts) }
    }

    /// Enqueues the backward pass (row delta, dK/dV with dQ accumulation, dQ conversion) on
    /// `stream`, on the caller's memory.
    ///
    /// # Safety
    /// As [`CudaBackend::forward_external`], for the tensors [`ExternalBackward`] lists (with
    /// `dq_acc` zeroed where the backward needs it).
    pub unsafe fn backward_external(
        &self,
        stream: &CudaStream,
        dtype: DType,
        t: &ExternalBackward,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        let dtype = attention_dtype(dtype)?;
        let cfg = self.backward_config(dtype, shape, mask)?;
        let dq_acc = match cfg.bwd_dq_by_query() {
            true => 0,
            false => aligned("dq_acc", t.dq_acc)?,
        };
        let p = BackwardPtrs {
            dkdv: DkDvPtrs {
                q: aligned("q", t.q)?,
                k: aligned("k", t.k)?,
                v: aligned("v", t.v)?,
                d_o: aligned("d_o", t.d_o)?,
                lse: aligned("lse", t.lse)?,
                delta: aligned("delta", t.delta)?,
                dq_acc,
                dq: 0,
                dk: aligned("dk", t.dk)?,
                dv: aligned("dv", t.dv)?,
                dkdv_acc: false,
            },
            o: aligned("o", t.o)?,
            dq: aligned("dq", t.dq)?,
        };
        self.check_stream(stream)?;
        // SAFETY: the caller's contract covers sizes, dq_acc's zeroing and use; alignment was
        // checked above, and cfg comes from backward_config.
        unsafe { self.launch_backward(stream, dtype, cfg, &p, shape, mask, opts) }
    }

    /// Writes the buffer `src` (f32, or already of `dtype`) to the caller's memory at `dst` as
    /// `dtype`, on the backend's compute stream: a copy where the dtypes match, rounded to
    /// nearest even from f32 to bf16 and f16 (one pass, where a copy and then a conversion by
    /// the caller would read and write the f32 values twice).
    ///
    /// # Safety
    /// `dst` is device memory of this GPU's context with room for `src.len()` elements of
    /// `dtype`, 16-byte aligned, not used by other work until the write has run on the stream.
    pub unsafe fn store_external(&self, src: &GpuBuf, dst: u64, dtype: DType) -> Result<()> {
        if src.dtype() != DType::F32 && src.dtype() != dtype {
            return Err(Error::UnsupportedDType(format!(
                "storing a {} buffer as {dtype}; f32 or {dtype} is stored",
                src.dtype()
            )));
        }
        if src.is_empty() {
            // Nothing to store, and an empty tensor's address may be null (a serving step's rank
            // that holds no query rows).
            return Ok(());
        }
        let s = self.stream();
        let dst = aligned("output", dst)?;
        if src.dtype() == dtype {
            // SAFETY: the caller's contract covers `dst` for src.len() values of `dtype`.
            return unsafe { src.copy_to(s, dst) };
        }
        let aux = self.aux(attention_dtype(dtype)?)?;
        // SAFETY: `src` holds src.len() f32 on this stream's context and `dst` room for as many
        // values of the module's type, `dtype` (the caller's contract); both 16-byte aligned.
        unsafe { aux.convert_f32(s, src.ptr(s), dst, src.len()) }
    }

    pub(crate) fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.context().cu_ctx() {
            return Err(backend_err("the stream belongs to another CUDA context than this GPU's"));
        }
        // Kernel launches go to the current context: PyTorch's thread may have another bound.
        self.context().bind_to_thread().map_err(crate::driver_err("binding the GPU's context"))
    }
}

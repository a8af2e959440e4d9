//! The FP8 forward (Hopper, sm_90a, head dim 128): Q, K and V in e4m3 (`float8_e4m3fn`), each
//! with optional per-(batch, KV head) f32 descales (the stored value times its descale is the
//! real one); O in bf16 or f16 and the LSE (f32, natural log). Any mask the bf16 forward takes.
//!
//! Scores and P V accumulate in f32; P is rounded to e4m3 for its product with V (as FP8
//! attention elsewhere does), the row sums that normalise it are of the unrounded P. V is first
//! transposed into a workspace (`[b, hkv, d, k_pad]` bytes, [`e4m3_vt_len`]): 8-bit tensor-core
//! products read both operands along the reduced dimension.
#![allow(clippy::too_many_arguments)] // a launch takes each buffer its kernel reads or writes

use crate::attention::{fwd_grid, fwd_params, ForwardPtrs};
use crate::compile::{backend_err, E4M3_VT_KEYS};
use crate::device::CudaBackend;
use crate::external::aligned;
use crate::params::{E4m3FwdParams, TransposeVParams};
use crate::{driver_err, tma, CudaElement};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask, Result};

/// Keys of the transposed V's rows: the key count rounded up to whole blocks of the transpose.
/// (A last tile of the forward that reaches past them reads zeros: TMA fills boxes beyond the
/// tensor's end.)
fn k_pad(k_len: usize) -> usize {
    k_len.div_ceil(E4M3_VT_KEYS) * E4M3_VT_KEYS
}

/// Bytes of the FP8 forward's workspace (V transposed) for `shape`.
pub fn e4m3_vt_len(shape: &AttnShape) -> usize {
    shape.batch * shape.kv_heads * shape.head_dim * k_pad(shape.k_len)
}

/// Device addresses of an FP8 forward's tensors, all allocated by the caller: Q `[b, nq, h, d]`,
/// K and V `[b, nk, hkv, d]` (e4m3), the workspace `vt` ([`e4m3_vt_len`] bytes, any contents),
/// the descales (`[b, hkv]` f32 each, or 0 for none), O like Q (bf16 or f16) and the LSE
/// (`[b, h, nq]` f32).
#[derive(Debug, Clone, Copy)]
pub struct ExternalE4m3Forward {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub vt: u64,
    pub q_descale: u64,
    pub k_descale: u64,
    pub v_descale: u64,
    pub o: u64,
    pub lse: u64,
}

fn aligned_or_none(name: &str, ptr: u64) -> Result<u64> {
    if ptr != 0 && !ptr.is_multiple_of(4) {
        return Err(Error::invalid(name, format!("device address {ptr:#x} is not 4-byte aligned")));
    }
    Ok(ptr)
}

impl CudaBackend {
    /// Whether this GPU runs the FP8 forward (an sm_90a GPU: the H100 and H200).
    pub fn has_e4m3_forward(&self) -> bool {
        self.arch() == "sm_90a"
    }

    /// FP8 forward on device buffers: Q, K, V e4m3 bytes; `descales`, if given, holds the
    /// descales of Q, K and V, `[3][b][hkv]` f32; writes O (`T`) and the LSE. The V^T workspace
    /// is allocated on the compute stream and freed in its order.
    pub fn forward_e4m3<T: CudaElement>(
        &self,
        q: &impl DevicePtr<u8>,
        k: &impl DevicePtr<u8>,
        v: &impl DevicePtr<u8>,
        descales: Option<&impl DevicePtr<f32>>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        o: &mut impl DevicePtrMut<T>,
        lse: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.check_e4m3(T::DTYPE, shape, mask)?;
        let s = self.stream();
        let bh = shape.batch * shape.kv_heads;
        let (qd, kd, vd) = match descales {
            Some(d) => {
                let base = self.checked_ptr("descales", d, 3 * bh, shape)?;
                (base, base + 4 * bh as u64, base + 8 * bh as u64)
            }
            None => (0, 0, 0),
        };
        // SAFETY: the transpose, launched on `s` below, writes every byte of the workspace
        // before the forward, later on `s`, reads it; nothing else sees the buffer.
        let vt = unsafe { s.alloc::<u8>(e4m3_vt_len(shape)) }.map_err(driver_err("allocating V^T"))?;
        let t = ExternalE4m3Forward {
            q: self.checked_ptr("q", q, shape.q_elems(), shape)?,
            k: self.checked_ptr("k", k, shape.kv_elems(), shape)?,
            v: self.checked_ptr("v", v, shape.kv_elems(), shape)?,
            vt: vt.device_ptr(s).0,
            q_descale: qd,
            k_descale: kd,
            v_descale: vd,
            o: self.checked_mut_ptr("o", o, shape.q_elems(), shape)?,
            lse: self.checked_mut_ptr("lse", lse, shape.lse_elems(), shape)?,
        };
        // SAFETY: every address was checked above to hold what `shape` says, aligned, in
        // buffers of this context used on the compute stream; vt was allocated above with
        // e4m3_vt_len(shape) bytes.
        unsafe { self.launch_forward_e4m3(s, T::DTYPE, &t, shape, mask, opts) }
    }

    /// Enqueues the FP8 forward on `stream`, on the caller's memory.
    ///
    /// # Safety
    /// `stream` is a stream of this context; the addresses of `t` are device memory of this
    /// context holding the tensors [`ExternalE4m3Forward`] lists for `shape` (O of `dtype`),
    /// each large enough, not used by other work while the kernels run.
    pub unsafe fn forward_e4m3_external(
        &self,
        stream: &CudaStream,
        dtype: DType,
        t: &ExternalE4m3Forward,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        self.check_e4m3(dtype, shape, mask)?;
        let t = ExternalE4m3Forward {
            q: aligned("q", t.q)?,
            k: aligned("k", t.k)?,
            v: aligned("v", t.v)?,
            vt: aligned("vt", t.vt)?,
            q_descale: aligned_or_none("q_descale", t.q_descale)?,
            k_descale: aligned_or_none("k_descale", t.k_descale)?,
            v_descale: aligned_or_none("v_descale", t.v_descale)?,
            o: aligned("o", t.o)?,
            lse: aligned("lse", t.lse)?,
        };
        self.check_stream(stream)?;
        // SAFETY: the caller's contract covers sizes and use; alignment was checked above.
        unsafe { self.launch_forward_e4m3(stream, dtype, &t, shape, mask, opts) }
    }

    fn check_e4m3(&self, dtype: DType, shape: &AttnShape, mask: &Mask) -> Result<()> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDType(format!("{dtype} for the FP8 forward's output, which is bf16 or f16")));
        }
        if shape.head_dim != 128 {
            return Err(Error::UnsupportedHeadDim {
                head_dim: shape.head_dim,
                backend: "cuda (FP8 forward)",
                supported: "128".into(),
            });
        }
        if !self.has_e4m3_forward() {
            return Err(backend_err(format!(
                "the FP8 forward needs an sm_90a GPU (H100, H200); this one is {}",
                self.arch()
            )));
        }
        self.check_common(dtype, shape, mask).map(|_| ())
    }

    /// Launches V's transpose and the FP8 forward on `s`.
    ///
    /// # Safety
    /// [`CudaBackend::check_e4m3`] passed for `dtype`, `shape` and `mask`; the addresses of `t`
    /// are aligned buffers of this context holding what [`ExternalE4m3Forward`] says for
    /// `shape`, not used by another stream while the kernels run.
    unsafe fn launch_forward_e4m3(
        &self,
        s: &CudaStream,
        dtype: DType,
        t: &ExternalE4m3Forward,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        let kern = self.kernels(dtype, shape.head_dim)?;
        let e = kern.e4m3.as_ref().ok_or_else(|| {
            backend_err(
                "the FP8 forward runs on the warp-specialized pipeline, which DISTATTN_KCFG's fwd_wg=0 turns off",
            )
        })?;
        let k_pad = k_pad(shape.k_len);
        let tp = TransposeVParams {
            v: t.v,
            vt: t.vt,
            k_len: shape.k_len as i32,
            kv_heads: shape.kv_heads as i32,
            k_pad: k_pad as i32,
            pad_: 0,
        };
        let grid = LaunchConfig {
            grid_dim: ((k_pad / E4M3_VT_KEYS) as u32, shape.kv_heads as u32, shape.batch as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: TransposeVParams by value (layout asserted at every compile); v holds
        // kv_elems() bytes and vt e4m3_vt_len(shape) = b·hkv·d·k_pad bytes (the contract), which
        // the grid of k_pad / 64 key blocks x hkv x b covers exactly.
        unsafe { s.launch_builder(&e.transpose_v).arg(&tp).launch(grid) }
            .map_err(driver_err("launching the V transpose"))?;
        let tiling = self.e4m3_tiling(|rows| shape.q_len.div_ceil(rows) * shape.heads * shape.batch);
        let (bm, bn) = (tiling.rows, tiling.keys);
        let tiles = self.tiles(mask, bm, bn, false)?;
        let f = ForwardPtrs { q: t.q, k: t.k, v: t.v, o: t.o, o_f32: 0, lse: t.lse, merge: false };
        let p = E4m3FwdParams {
            f: fwd_params(s, &f, &tiles, shape, opts, self.sm_count(), kern.cfg.fwd_prefetch)?,
            q_descale: t.q_descale,
            k_descale: t.k_descale,
            v_descale: t.v_descale,
        };
        let maps = [
            tma::TensorMap::rows_u8(t.q, tma::RowsTensor::of_queries(shape), bm as u32)?,
            tma::TensorMap::rows_u8(t.k, tma::RowsTensor::of_keys(shape), bn as u32)?,
            tma::TensorMap::transposed_u8(t.vt, tma::RowsTensor::of_keys(shape), k_pad)?,
        ];
        let mut launch = s.launch_builder(e.fwd(tiling));
        launch.arg(&p);
        for m in &maps {
            launch.arg(m);
        }
        // SAFETY: the kernel takes E4m3FwdParams and three tensor maps by value (layouts
        // asserted at every compile). The maps describe q and k as [b, n, h, 128] bytes and vt
        // as written by the transpose above, on the same stream; o, lse and the descales hold
        // what `shape` says (the contract); the tile plan was built for this mask and the
        // kernel's tile sizes and stays alive until the launch (an evicted plan is freed after
        // every stream's work); sizes fit the i32 fields (check_common).
        unsafe { launch.launch(fwd_grid(&tiles, shape, tiling.threads(), tiling.smem(shape.head_dim))?) }
            .map_err(driver_err("launching the FP8 forward kernel"))?;
        Ok(())
    }
}

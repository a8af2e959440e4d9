//! Flash attention on device buffers: the launches of the forward, the block backward (dK, dV
//! and a dQ accumulation, given the global LSE and D) and the whole backward, and the LSE merge
//! of partial results. Every launch goes to the compute stream.
//!
//! Buffers are any cudarc device memory of the right element type (slices or views); lengths
//! and 16-byte alignment are checked, never assumed. A launch takes each buffer its kernel
//! reads or writes, which is more than clippy's argument limit. The launches themselves take
//! checked addresses and a stream, so that [`crate::external`] runs the same kernels on memory
//! and streams another library owns.
#![allow(clippy::too_many_arguments)] // a launch takes each buffer its kernel reads or writes

use crate::aux::{MergeDims, OLse};
use crate::compile::{backend_err, KernelConfig};
use crate::device::{CudaBackend, DeviceTiles};
use crate::params::{BwdParams, FwdParams};
use crate::{driver_err, tma, CudaElement};
use cudarc::driver::{sys, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask, Result};

const LOG2E: f32 = std::f32::consts::LOG2_E;

impl CudaBackend {
    pub(crate) fn check_common(&self, dtype: DType, shape: &AttnShape, mask: &Mask) -> Result<KernelConfig> {
        shape.validate()?;
        mask.check_fits(shape)?;
        if shape.q_len > i32::MAX as usize / 2 || shape.k_len > i32::MAX as usize / 2 {
            return Err(Error::invalid("sequence length", "too long for 32-bit tile indices"));
        }
        self.kernel_config(dtype, shape.head_dim)
    }

    /// The buffer's address after checking its length and alignment.
    pub(crate) fn checked_ptr<U>(
        &self,
        name: &str,
        buf: &impl DevicePtr<U>,
        expected: usize,
        shape: &AttnShape,
    ) -> Result<u64> {
        shape.check_len(name, buf.len(), expected)?;
        let p = buf.device_ptr(self.stream()).0;
        if !p.is_multiple_of(16) {
            return Err(backend_err(format!("misaligned pointer: {name} at {p:#x} is not 16-byte aligned")));
        }
        Ok(p)
    }

    /// Forward pass on device buffers: writes `o` (`[b, nq, h, d]`), `lse` (`[b, h, nq]`, f32,
    /// natural log; −inf where no key is kept) and, if given, an f32 copy of O (exact partial
    /// results to merge).
    pub fn forward<T: CudaElement>(
        &self,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        o: &mut impl DevicePtrMut<T>,
        lse: &mut impl DevicePtrMut<f32>,
        o_f32: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        let o = self.checked_mut_ptr("o", o, shape.q_elems(), shape)?;
        let o_f32 = match o_f32 {
            Some(of) => self.checked_mut_ptr("o_f32", of, shape.q_elems(), shape)?,
            None => 0,
        };
        self.forward_into((q, k, v), shape, mask, opts, (o, o_f32), lse, false).map(|_| ())
    }

    /// The forward into checked output addresses `(o, o_f32)` (either may be 0: not written).
    /// With `merge`, `o_f32` and `lse` hold an earlier partial result of the same rows (f32 O,
    /// natural-log LSE), which the kernel merges the block's rows into by LSE weights in its
    /// epilogue. Only the sm_90a warp-specialized kernel merges or leaves a 0 `o` unwritten:
    /// elsewhere such a call runs nothing and answers `false`.
    #[allow(clippy::too_many_arguments)] // the forward's tensors
    pub(crate) fn forward_into<T: CudaElement>(
        &self,
        (q, k, v): (&impl DevicePtr<T>, &impl DevicePtr<T>, &impl DevicePtr<T>),
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        (o, o_f32): (u64, u64),
        lse: &mut impl DevicePtrMut<f32>,
        merge: bool,
    ) -> Result<bool> {
        let cfg = self.check_common(T::DTYPE, shape, mask)?;
        if merge && o_f32 == 0 {
            return Err(backend_err("a merging forward needs the earlier partial's f32 O"));
        }
        if (merge || o == 0) && !self.kernels(T::DTYPE, shape.head_dim)?.cfg.fwd_wg {
            return Ok(false);
        }
        let t = ForwardPtrs {
            q: self.checked_ptr("q", q, shape.q_elems(), shape)?,
            k: self.checked_ptr("k", k, shape.kv_elems(), shape)?,
            v: self.checked_ptr("v", v, shape.kv_elems(), shape)?,
            o,
            o_f32,
            lse: self.checked_mut_ptr("lse", lse, shape.lse_elems(), shape)?,
            merge,
        };
        // SAFETY: cfg comes from check_common; every address was checked (by this function or
        // its callers) to hold what `shape` says, 16-byte aligned, in buffers of this context
        // used on the compute stream, or is 0 where the kernel writes nothing (o_f32 always; o
        // only for the warp-specialized kernel, checked above). Merging, that kernel reads
        // o_f32 and lse before it overwrites them, each element by the thread that writes it
        // (an LSE by its quad's lane 0, passed to the quad before the write).
        unsafe { self.launch_forward(self.stream(), T::DTYPE, cfg, &t, shape, mask, opts) }?;
        Ok(true)
    }

    /// Launches the forward kernel on `s`.
    ///
    /// # Safety
    /// `cfg` is what [`CudaBackend::check_common`] returned for `dtype`, `shape` and `mask` (so
    /// the sizes fit the kernels' i32 fields). The addresses of `t` are, in this context, 16-byte aligned buffers of `dtype` (`o_f32`
    /// and `lse`: f32; `o_f32` may be 0) holding what `shape` says (q, o, o_f32: q_elems(); k, v:
    /// kv_elems(); lse: lse_elems()), not used by another stream while the kernel runs.
    pub(crate) unsafe fn launch_forward(
        &self,
        s: &CudaStream,
        dtype: DType,
        cfg: KernelConfig,
        t: &ForwardPtrs,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        let kern = self.kernels(dtype, shape.head_dim)?;
        let (cfg, f) = self.fwd_tiling(cfg, &kern, shape);
        let tiles = self.tiles(mask, cfg.fwd_bm(), cfg.fwd_bn, false)?;
        let p = fwd_params(s, t, &tiles, shape, opts, self.sm_count(), cfg.fwd_prefetch)?;
        let launch_cfg = fwd_grid(&tiles, shape, cfg.fwd_threads(), cfg.fwd_smem())?;
        let mut launch = s.launch_builder(f);
        launch.arg(&p);
        let maps;
        if cfg.fwd_wg {
            // The warp-specialized kernel loads Q, K and V through TMA tensor maps and stores O
            // by TMA in boxes of 64 rows (a consumer's) where it writes O alone (no f32 copy, no
            // merge). Where o is 0 it writes no O and reads no map of it: Q's stands in.
            let (bm, bn) = (cfg.fwd_bm() as u32, cfg.fwd_bn as u32);
            let (q_rows, kv_rows) = (tma::RowsTensor::of_queries(shape), tma::RowsTensor::of_keys(shape));
            maps = [
                tma::TensorMap::rows(p.q, q_rows, dtype, bm)?,
                tma::TensorMap::rows(p.k, kv_rows, dtype, bn)?,
                tma::TensorMap::rows(p.v, kv_rows, dtype, bn)?,
                tma::TensorMap::rows(if p.o != 0 { p.o } else { p.q }, q_rows, dtype, 64)?,
            ];
            for m in &maps {
                launch.arg(m);
            }
        }
        // SAFETY: the kernel takes FwdParams (and, warp-specialized, the four tensor maps) by
        // value, layouts asserted against params.cuh at every compile. Every address in it holds
        // what `shape` says, 16-byte aligned (this function's contract), with sizes that fit its
        // i32 fields (check_common); the tile plan was built for this mask and these tile sizes
        // and is complete on the device (DeviceTiles), where `tiles` keeps it alive until the
        // launch (an evicted plan is freed after every stream's work). The maps describe q, k, v
        // and o (q where o is 0: the kernel then writes no O) as those buffers.
        unsafe { launch.launch(launch_cfg) }.map_err(driver_err("launching the forward kernel"))?;
        Ok(())
    }

    pub(crate) fn checked_mut_ptr<U>(
        &self,
        name: &str,
        buf: &mut impl DevicePtrMut<U>,
        expected: usize,
        shape: &AttnShape,
    ) -> Result<u64> {
        shape.check_len(name, buf.len(), expected)?;
        let p = buf.device_ptr_mut(self.stream()).0;
        if !p.is_multiple_of(16) {
            return Err(backend_err(format!("misaligned pointer: {name} at {p:#x} is not 16-byte aligned")));
        }
        Ok(p)
    }

    /// The kernel configuration of a backward pass, or the error saying why this GPU cannot run
    /// it (its shared memory is too small for the backward's tiles at this head dim).
    pub(crate) fn backward_config(&self, dtype: DType, shape: &AttnShape, mask: &Mask) -> Result<KernelConfig> {
        let cfg = self.check_common(dtype, shape, mask)?;
        if self.kernels(dtype, shape.head_dim)?.dkdv.is_none() {
            return Err(backend_err(format!(
                "the backward at head dim {} needs {} bytes of shared memory, the GPU allows {}",
                shape.head_dim,
                cfg.bwd_smem(),
                self.max_smem()
            )));
        }
        Ok(cfg)
    }

    /// Backward of one block from Q, K, V, dO, the global LSE and D (`[b, h, nq]`, f32): adds
    /// scale·dS·K into `dq_acc` (f32, `[b, nq, h, d]`) and this block's dK and dV into `dk_acc`
    /// and `dv_acc` (f32, `[b, nk, h_kv, d]`), all accumulated, not overwritten. What a rank of a
    /// distributed backward computes; the kernel's epilogue adds, so a rank's partials need no
    /// buffer of their own and no separate add.
    pub fn backward_block<T: CudaElement>(
        &self,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        d_o: &impl DevicePtr<T>,
        lse: &impl DevicePtr<f32>,
        delta: &impl DevicePtr<f32>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        dq_acc: &mut impl DevicePtrMut<f32>,
        dk_acc: &mut impl DevicePtrMut<f32>,
        dv_acc: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let cfg = self.backward_config(T::DTYPE, shape, mask)?;
        let delta = self.checked_ptr("delta", delta, shape.lse_elems(), shape)?;
        let dq_acc = self.checked_mut_ptr("dq_acc", dq_acc, shape.q_elems(), shape)?;
        let t = self.dkdv_ptrs(q, k, v, d_o, lse, delta, dq_acc, dk_acc, dv_acc, true, shape)?;
        // SAFETY: cfg comes from backward_config; every address was checked above to hold what
        // `shape` says, 16-byte aligned, in buffers of this context used on the compute stream.
        unsafe { self.launch_dkdv(self.stream(), T::DTYPE, cfg, &t, shape, mask, opts) }
    }

    /// Backward of one block whose gradients are final (no other block adds to them): writes
    /// dQ (`[b, nq, h, d]`), dK and dV (`[b, nk, h_kv, d]`) in `T`, rounded once. dQ is
    /// accumulated in an f32 workspace and converted, as in [`CudaBackend::backward`], where
    /// [`CudaBackend::backward_dq_workspace`] says so; otherwise it comes straight from the
    /// kernel, as dK and dV do. What a Ulysses rank computes: its gradients are sent
    /// back from these buffers, with no f32 accumulators to zero and round.
    #[allow(clippy::too_many_arguments)] // one buffer per tensor of a backward block
    pub fn backward_block_final<T: CudaElement>(
        &self,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        d_o: &impl DevicePtr<T>,
        lse: &impl DevicePtr<f32>,
        delta: &impl DevicePtr<f32>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        dq: &mut impl DevicePtrMut<T>,
        dk: &mut impl DevicePtrMut<T>,
        dv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let cfg = self.backward_config(T::DTYPE, shape, mask)?;
        let s = self.stream();
        let dq_out = self.checked_mut_ptr("dq", dq, shape.q_elems(), shape)?;
        let dq_acc = match cfg.bwd_dq_by_query() {
            false => Some(s.alloc_zeros::<f32>(shape.q_elems()).map_err(driver_err("allocating the dQ accumulator"))?),
            true => None,
        };
        let delta = self.checked_ptr("delta", delta, shape.lse_elems(), shape)?;
        let dq_acc_ptr = dq_acc.as_ref().map_or(0, |a| a.device_ptr(s).0);
        let t = self.dkdv_ptrs(q, k, v, d_o, lse, delta, dq_acc_ptr, dk, dv, false, shape)?;
        // SAFETY: cfg comes from backward_config; the caller's addresses were checked above to
        // hold what `shape` says (dq, dk, dv of `T`), 16-byte aligned; dq_acc, where this
        // configuration uses one, was allocated above (q_elems() f32, zeroed) and is freed in
        // stream order when it drops here; all in this context and used on the compute stream.
        unsafe { self.launch_final_grads(s, T::DTYPE, cfg, &t, dq_out, shape, mask, opts) }
    }

    /// Whether a whole backward of `dtype` at `head_dim` on this GPU needs the zeroed f32 dQ
    /// workspace of [`crate::external::ExternalBackward`] (`dq_acc`). Where it does not, its kernel computes
    /// each dQ row whole and writes it in `dtype` (above d 128 on Hopper).
    pub fn backward_dq_workspace(&self, dtype: DType, head_dim: usize) -> Result<bool> {
        Ok(!self.kernel_config(dtype, head_dim)?.bwd_dq_by_query())
    }

    /// The addresses of a dK/dV launch over `shape`: Q, K, V, dO (of `T`), LSE, and dK, dV (f32
    /// accumulators where `dkdv_acc`, else of `T`), each checked to hold what `shape` says;
    /// `delta` and `dq_acc` as the caller has them.
    #[allow(clippy::too_many_arguments)] // one argument per tensor of the launch
    fn dkdv_ptrs<T: CudaElement, G>(
        &self,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        d_o: &impl DevicePtr<T>,
        lse: &impl DevicePtr<f32>,
        delta: u64,
        dq_acc: u64,
        dk: &mut impl DevicePtrMut<G>,
        dv: &mut impl DevicePtrMut<G>,
        dkdv_acc: bool,
        shape: &AttnShape,
    ) -> Result<DkDvPtrs> {
        Ok(DkDvPtrs {
            q: self.checked_ptr("q", q, shape.q_elems(), shape)?,
            k: self.checked_ptr("k", k, shape.kv_elems(), shape)?,
            v: self.checked_ptr("v", v, shape.kv_elems(), shape)?,
            d_o: self.checked_ptr("d_o", d_o, shape.q_elems(), shape)?,
            lse: self.checked_ptr("lse", lse, shape.lse_elems(), shape)?,
            delta,
            dq_acc,
            dq: 0,
            dk: self.checked_mut_ptr("dk", dk, shape.kv_elems(), shape)?,
            dv: self.checked_mut_ptr("dv", dv, shape.kv_elems(), shape)?,
            dkdv_acc,
        })
    }

    /// Launches the dK/dV kernel (which also accumulates dQ) on `s`.
    ///
    /// # Safety
    /// `cfg` is what [`CudaBackend::backward_config`] returned for `dtype`, `shape` and `mask`.
    /// The addresses of `t` are, in this context, 16-byte aligned buffers holding what `shape`
    /// says (q, d_o: q_elems() of `dtype`; dq_acc: q_elems() f32, unless `t.dq` is set and `cfg`
    /// computes dQ by query, which writes it there; k, v: kv_elems() of `dtype`;
    /// dk, dv: kv_elems() f32 where `t.dkdv_acc`, else of `dtype`; lse, delta: lse_elems() f32),
    /// not used by another stream while the kernel runs.
    pub(crate) unsafe fn launch_dkdv(
        &self,
        s: &CudaStream,
        dtype: DType,
        cfg: KernelConfig,
        t: &DkDvPtrs,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        let scale = opts.scale_for(shape.head_dim)?;
        let kern = self.kernels(dtype, shape.head_dim)?;
        let tiles = self.tiles(mask, cfg.bwd_bm, cfg.bwd_bn(), true)?;
        let bp = BwdParams {
            q: t.q,
            k: t.k,
            v: t.v,
            dout: t.d_o,
            lse: t.lse,
            delta: t.delta,
            dq_acc: t.dq_acc,
            dq: 0,
            dk: t.dk,
            dv: t.dv,
            tile_ptr: tiles.ptr.device_ptr(s).0,
            tiles: tiles.tiles.device_ptr(s).0,
            bits: tiles.bits.device_ptr(s).0,
            batch: shape.batch as i32,
            q_len: shape.q_len as i32,
            k_len: shape.k_len as i32,
            heads: shape.heads as i32,
            kv_heads: shape.kv_heads as i32,
            n_tiles: tiles.n_major as i32,
            scale_log2: scale * LOG2E,
            scale,
            group: launch_group(&tiles, cfg.bwd_parts(), shape, self.sm_count()),
            dkdv_acc: t.dkdv_acc.into(),
        };
        let dkdv = kern.dkdv.as_ref().ok_or_else(|| Error::Internal("the dK/dV kernel was not loaded".into()))?;
        let mut blocks = tiles.n_major * cfg.bwd_parts() * shape.kv_heads * shape.batch;
        let (q_rows, kv_rows) = (tma::RowsTensor::of_queries(shape), tma::RowsTensor::of_keys(shape));
        let (bm, bn) = (cfg.bwd_bm as u32, cfg.bwd_bn() as u32);
        // The dQ job's parameters and by-query plan, where the launch has one (the plan kept
        // alive until the launch).
        let mut dq_job = None;
        let mut maps = Vec::new();
        if cfg.bwd_wg {
            // The warp-specialized kernels load Q, dO, K and V through TMA tensor maps.
            maps = vec![
                tma::TensorMap::rows(bp.q, q_rows, dtype, bm)?,
                tma::TensorMap::rows(bp.dout, q_rows, dtype, bm)?,
                tma::TensorMap::rows(bp.k, kv_rows, dtype, bn)?,
                tma::TensorMap::rows(bp.v, kv_rows, dtype, bn)?,
            ];
            if cfg.bwd_dq_by_query() {
                // dQ as a second job of the same launch, by query tile (backward_wide.cu).
                let (qm, qn) = cfg.dq_tile();
                let qt = self.tiles(mask, qm, qn, false)?;
                let bq = BwdParams {
                    dq: t.dq,
                    tile_ptr: qt.ptr.device_ptr(s).0,
                    tiles: qt.tiles.device_ptr(s).0,
                    bits: qt.bits.device_ptr(s).0,
                    n_tiles: qt.n_major as i32,
                    group: launch_group(&qt, shape.heads / shape.kv_heads, shape, self.sm_count()),
                    ..bp
                };
                blocks += qt.n_major * shape.heads * shape.batch;
                maps.extend([
                    tma::TensorMap::rows(bp.q, q_rows, dtype, qm as u32)?,
                    tma::TensorMap::rows(bp.dout, q_rows, dtype, qm as u32)?,
                    tma::TensorMap::rows(bp.k, kv_rows, dtype, qn as u32)?,
                    tma::TensorMap::rows(bp.v, kv_rows, dtype, qn as u32)?,
                ]);
                dq_job = Some((bq, qt));
            } else {
                // It adds dQ into dq_acc with TMA reductions, 64 rows a consumer warpgroup.
                maps.push(tma::TensorMap::rows(bp.dq_acc, q_rows, DType::F32, 64)?);
            }
        }
        let launch_cfg = LaunchConfig {
            grid_dim: (grid_x(blocks)?, 1, 1),
            block_dim: (cfg.bwd_threads() as u32, 1, 1),
            shared_mem_bytes: cfg.bwd_smem() as u32,
        };
        let mut launch = s.launch_builder(dkdv);
        launch.arg(&bp);
        if let Some((bq, _)) = &dq_job {
            launch.arg(bq);
        }
        for m in &maps {
            launch.arg(m);
        }
        // SAFETY: the kernel takes BwdParams (warp-specialized above d 128: two, the dK/dV and
        // the dQ job's) and, warp-specialized, the tensor maps by value, layouts asserted against
        // params.cuh at every compile. Every address in them holds what `shape` says, 16-byte
        // aligned (this function's contract), with sizes that fit their i32 fields
        // (check_common); each tile plan was built for this mask and its tile sizes and is
        // complete on the device (DeviceTiles), where `tiles` and `dq_job` keep it alive until
        // the launch (an evicted plan is freed after every stream's work). The maps describe
        // q, d_o, k, v (and dq_acc) as those buffers, with the box rows each job reads.
        unsafe { launch.launch(launch_cfg) }.map_err(driver_err("launching the backward kernel"))?;
        Ok(())
    }

    /// Backward pass on device buffers: from Q, K, V, the forward's O and LSE and the output
    /// gradient dO, writes dQ, dK and dV (dK/dV summed over the query heads of each KV head).
    pub fn backward<T: CudaElement>(
        &self,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        o: &impl DevicePtr<T>,
        lse: &impl DevicePtr<f32>,
        d_o: &impl DevicePtr<T>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        dq: &mut impl DevicePtrMut<T>,
        dk: &mut impl DevicePtrMut<T>,
        dv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.backward_config(T::DTYPE, shape, mask)?;
        let s = self.stream();
        let (o, d_o_ptr) =
            (self.checked_ptr("o", o, shape.q_elems(), shape)?, self.checked_ptr("d_o", d_o, shape.q_elems(), shape)?);
        // SAFETY: the row delta launched below on `s` writes all lse_elems() values before the
        // backward, later on `s`, reads them; nothing else sees the buffer.
        let delta = unsafe { s.alloc::<f32>(shape.lse_elems()) }.map_err(driver_err("allocating delta"))?;
        // SAFETY: o and d_o hold q_elems() values of `T` (checked above), delta lse_elems() f32,
        // all 16-byte aligned, in this context and used on `s`.
        unsafe { self.aux(T::DTYPE)?.row_delta(s, o, T::DTYPE, d_o_ptr, delta.device_ptr(s).0, shape) }?;
        // Every gradient of a whole backward is final. (delta is freed in stream order.)
        self.backward_block_final(q, k, v, d_o, lse, &delta, shape, mask, opts, dq, dk, dv)
    }

    /// Launches the whole backward on `s`: the row delta and the kernels of
    /// [`CudaBackend::launch_final_grads`].
    ///
    /// # Safety
    /// `cfg` and the addresses of `t.dkdv` are as [`CudaBackend::launch_final_grads`] requires;
    /// `t.o` and `t.dq` are 16-byte aligned buffers of q_elems() of `dtype`; none is used by
    /// another stream while the kernels run.
    pub(crate) unsafe fn launch_backward(
        &self,
        s: &CudaStream,
        dtype: DType,
        cfg: KernelConfig,
        t: &BackwardPtrs,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        let d = &t.dkdv;
        // SAFETY: o and d_o hold q_elems() values of `dtype` and delta lse_elems() f32, 16-byte
        // aligned (this function's contract); the kernel runs on `s` like the ones after it.
        unsafe { self.aux(dtype)?.row_delta(s, t.o, dtype, d.d_o, d.delta, shape) }?;
        // SAFETY: this function's contract is launch_final_grads's for `t.dkdv` and `t.dq`.
        unsafe { self.launch_final_grads(s, dtype, cfg, d, t.dq, shape, mask, opts) }
    }

    /// Launches the dK/dV kernel writing dK and dV (`t.dkdv_acc` false) and dQ into `dq` (of
    /// `dtype`), on `s`: by its by-query job where `cfg` has one, else accumulated in f32 and
    /// converted.
    ///
    /// # Safety
    /// As [`CudaBackend::launch_dkdv`] for `t`, with `dq_acc` zeroed unless `cfg` computes dQ
    /// by query ([`KernelConfig::bwd_dq_by_query`], which does not read it); `dq` is a 16-byte
    /// aligned buffer of q_elems() of `dtype`, not used by another stream while the kernels run.
    #[allow(clippy::too_many_arguments)] // the launch's configuration, tensors and problem
    pub(crate) unsafe fn launch_final_grads(
        &self,
        s: &CudaStream,
        dtype: DType,
        cfg: KernelConfig,
        t: &DkDvPtrs,
        dq: u64,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<()> {
        if cfg.bwd_dq_by_query() {
            // SAFETY: this function's contract is launch_dkdv's for `t`, and `dq` holds
            // q_elems() of `dtype`, 16-byte aligned, for the dQ job to write.
            return unsafe { self.launch_dkdv(s, dtype, cfg, &DkDvPtrs { dq, ..*t }, shape, mask, opts) };
        }
        // SAFETY: this function's contract is launch_dkdv's for `t`.
        unsafe { self.launch_dkdv(s, dtype, cfg, t, shape, mask, opts) }?;
        // SAFETY: dq_acc holds q_elems() f32 and dq q_elems() of `dtype`, 16-byte aligned; the
        // conversion runs on `s` after the dK/dV kernel that accumulated into dq_acc.
        unsafe { self.aux(dtype)?.convert_f32(s, t.dq_acc, dq, shape.q_elems()) }
    }

    /// Merges `n_parts` partial results over disjoint key sets: `o_parts` is `n_parts`
    /// consecutive f32 O tensors (`[b, nq, h, d]` each), `lse_parts` as many LSE tensors.
    /// Writes the merged f32 O and LSE; rows no part reaches get O = 0, LSE = −inf.
    pub fn merge(
        &self,
        o_parts: &impl DevicePtr<f32>,
        lse_parts: &impl DevicePtr<f32>,
        n_parts: usize,
        shape: &AttnShape,
        o_out: &mut impl DevicePtrMut<f32>,
        lse_out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        shape.validate()?;
        if n_parts == 0 {
            return Err(Error::ZeroDim { what: "merge parts" });
        }
        let o_parts = self.checked_ptr("o_parts", o_parts, n_parts * shape.q_elems(), shape)?;
        let lse_parts = self.checked_ptr("lse_parts", lse_parts, n_parts * shape.lse_elems(), shape)?;
        let o_out = self.checked_mut_ptr("o_out", o_out, shape.q_elems(), shape)?;
        let lse_out = self.checked_mut_ptr("lse_out", lse_out, shape.lse_elems(), shape)?;
        let aux = self.aux(DType::F32)?;
        let s = self.stream();
        // The accumulators start empty (O = 0, LSE = −inf: what rows no part reaches keep); each
        // part is merged into them through the identity spec (every row to the same row).
        // SAFETY: o_out and lse_out passed checked_mut_ptr above for q_elems() and lse_elems() f32,
        // the numbers of 4-byte words the memsets write, on `s` like every later use.
        unsafe {
            sys::cuMemsetD32Async(o_out, 0, shape.q_elems(), s.cu_stream())
                .result()
                .map_err(driver_err("clearing O"))?;
            sys::cuMemsetD32Async(lse_out, f32::NEG_INFINITY.to_bits(), shape.lse_elems(), s.cu_stream())
                .result()
                .map_err(driver_err("clearing the LSE"))?;
        }
        let dims = MergeDims {
            batch: shape.batch,
            heads: shape.heads,
            hs: shape.heads,
            hd: shape.heads,
            hs0: 0,
            hd0: 0,
            ns: shape.q_len,
            nd: shape.q_len,
            head_dim: shape.head_dim,
            n_pieces: 1,
            total: shape.q_len,
        };
        let quads = s.clone_htod(&[0, 0, shape.q_len as i64, 0]).map_err(driver_err("uploading the merge spec"))?;
        let acc = OLse { o: o_out, lse: lse_out };
        for part in 0..n_parts {
            let o = o_parts + (part * shape.q_elems() * 4) as u64;
            let lse = lse_parts + (part * shape.lse_elems() * 4) as u64;
            // SAFETY: o_parts and lse_parts passed checked_ptr for n_parts parts, so part `part`
            // holds the q_elems() / lse_elems() f32 the identity spec covers, as do the outputs;
            // the one quad was uploaded above on `s`, and `quads` is freed at the end of this
            // function in `s`'s order, after the launches.
            unsafe { aux.merge(s, OLse { o, lse }, acc, &dims, quads.device_ptr(s).0) }?;
        }
        Ok(())
    }
}

/// The forward kernels' parameters for the tensors at `t`, the tile plan `tiles` and `shape`,
/// on a GPU of `sms` multiprocessors; `prefetch`: whether each block prefetches the Q tile of the
/// block a wave later (the warp-specialized kernel, one block an SM).
pub(crate) fn fwd_params(
    s: &CudaStream,
    t: &ForwardPtrs,
    tiles: &DeviceTiles,
    shape: &AttnShape,
    opts: &AttnOptions,
    sms: usize,
    prefetch: bool,
) -> Result<FwdParams> {
    Ok(FwdParams {
        q: t.q,
        k: t.k,
        v: t.v,
        o: t.o,
        o_f32: t.o_f32,
        lse: t.lse,
        tile_ptr: tiles.ptr.device_ptr(s).0,
        tiles: tiles.tiles.device_ptr(s).0,
        bits: tiles.bits.device_ptr(s).0,
        batch: shape.batch as i32,
        q_len: shape.q_len as i32,
        k_len: shape.k_len as i32,
        heads: shape.heads as i32,
        kv_heads: shape.kv_heads as i32,
        n_tiles: tiles.n_major as i32,
        scale_log2: opts.scale_for(shape.head_dim)? * LOG2E,
        group: launch_group(tiles, shape.heads / shape.kv_heads, shape, sms),
        merge: i32::from(t.merge),
        prefetch: if prefetch { i32::try_from(sms).unwrap_or(0) } else { 0 },
    })
}

/// A forward kernel's launch: one block per (query tile, head, batch), in the order of
/// fwd_block (kernels/params.cuh).
pub(crate) fn fwd_grid(tiles: &DeviceTiles, shape: &AttnShape, threads: usize, smem: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (grid_x(tiles.n_major * shape.heads * shape.batch)?, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    })
}

/// The (batch, KV head) pairs per group of the launch order (grid_slot in kernels/params.cuh)
/// for the tile plan `tiles` with `subs` blocks a major tile on `sms` multiprocessors. Where
/// tiles differ in work, the fewest pairs whose blocks make two waves of one block per
/// multiprocessor, so that the last group's heavy blocks start while two waves of others run
/// beside them, and no more, so a group's shared tiles stay in the L2. (A list-scheduling
/// simulation of causal 4k-16k backwards puts the tail within 5 % of a perfect balance from
/// there, and up to 60 % above it with one pair a group; on an H100 the GQA 32/8 causal 4k
/// backward went from 1.030 to 0.773 ms.) Where every tile has the same work, one pair a group
/// (groups cost the d 64 forward without a mask 2-3 %).
pub(crate) fn launch_group(tiles: &DeviceTiles, subs: usize, shape: &AttnShape, sms: usize) -> i32 {
    let pairs = shape.batch * shape.kv_heads;
    if tiles.uniform {
        return 1;
    }
    (2 * sms).div_ceil((tiles.n_major * subs).max(1)).clamp(1, pairs.max(1)) as i32
}

/// A one-dimensional grid of `blocks` blocks (at most 2^31 - 1).
fn grid_x(blocks: usize) -> Result<u32> {
    u32::try_from(blocks)
        .ok()
        .filter(|&b| b < 1 << 31)
        .ok_or_else(|| backend_err(format!("{blocks} blocks exceed a launch grid's 2^31 - 1")))
}

/// Device addresses of a forward launch's tensors (`o_f32` may be 0: no f32 copy of O), and
/// whether `o_f32` and `lse` hold a partial result the kernel merges into.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ForwardPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub o_f32: u64,
    pub lse: u64,
    pub merge: bool,
}

/// Device addresses of a dK/dV launch's tensors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DkDvPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub d_o: u64,
    pub lse: u64,
    pub delta: u64,
    pub dq_acc: u64,
    /// dQ's final destination, of the input dtype, where the launch writes it (the by-query dQ
    /// job of a whole backward, [`KernelConfig::bwd_dq_by_query`]); 0 where dQ is added into
    /// `dq_acc`, which such a launch does not use.
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    /// `dk` and `dv` are f32 accumulators the kernel adds into (a context-parallel block's);
    /// otherwise they are of the input dtype and written.
    pub dkdv_acc: bool,
}

/// Device addresses of a whole backward's tensors: the dK/dV launch's, O and dQ.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BackwardPtrs {
    pub dkdv: DkDvPtrs,
    pub o: u64,
    pub dq: u64,
}

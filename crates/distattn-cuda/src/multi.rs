//! The backward of one block given a precomputed D = rowsum(dO ∘ O) and an f32 dQ
//! accumulator: what the multi-GPU executor (crate `distattn-nccl`) needs (its plans carry the
//! global LSE and D, never O), and the core of [`CudaBackend::backward`].

use super::*;

impl CudaBackend {
    /// Backward of one block from Q, K, V, dO, the global LSE and D (`[b, h, nq]`, f32): adds
    /// scale·dS·K into `dq_acc` (f32, `[b, nq, h, d]`, accumulated, not overwritten) and writes
    /// dK and dV (dtype `T`, overwritten) for this block's keys.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_with_delta<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        dout: &CudaSlice<T>,
        lse: &CudaSlice<f32>,
        delta: &CudaSlice<f32>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        dq_acc: &mut CudaSlice<f32>,
        dk: &mut CudaSlice<T>,
        dv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let cfg = self.backward_config::<T>(shape, mask)?;
        self.check_buf("q", q, shape.q_elems(), shape)?;
        self.check_buf("dout", dout, shape.q_elems(), shape)?;
        self.check_buf("k", k, shape.kv_elems(), shape)?;
        self.check_buf("v", v, shape.kv_elems(), shape)?;
        self.check_buf("lse", lse, shape.lse_elems(), shape)?;
        self.check_buf("delta", delta, shape.lse_elems(), shape)?;
        self.check_buf("dq_acc", dq_acc, shape.q_elems(), shape)?;
        self.check_buf("dk", dk, shape.kv_elems(), shape)?;
        self.check_buf("dv", dv, shape.kv_elems(), shape)?;
        let kern = self.kernels(T::DTYPE, shape.head_dim)?;
        let plan = self.plan(mask, cfg.bwd_bm, cfg.bwd_bn(), true)?;
        let s = &self.stream;
        let scale = opts.scale_for(shape.head_dim);
        let bp = BwdParams {
            q: ptr_of(q, s),
            k: ptr_of(k, s),
            v: ptr_of(v, s),
            dout: ptr_of(dout, s),
            lse: ptr_of(lse, s),
            delta: ptr_of(delta, s),
            dq_acc: ptr_of(dq_acc, s),
            dk: ptr_of(dk, s),
            dv: ptr_of(dv, s),
            tile_ptr: ptr_of(&plan.ptr, s),
            tiles: ptr_of(&plan.tiles, s),
            bits: ptr_of(&plan.bits, s),
            batch: shape.batch as i32,
            q_len: shape.q_len as i32,
            k_len: shape.k_len as i32,
            heads: shape.heads as i32,
            kv_heads: shape.kv_heads as i32,
            n_tiles: plan.n_major as i32,
            scale_log2: scale * LOG2E,
            scale,
        };
        let lc = LaunchConfig {
            grid_dim: (plan.n_major as u32, shape.kv_heads as u32, shape.batch as u32),
            block_dim: (cfg.bwd_threads() as u32, 1, 1),
            shared_mem_bytes: cfg.bwd_smem() as u32,
        };
        let dkdv = kern.dkdv.as_ref().ok_or_else(|| backend_err("dK/dV kernel missing"))?;
        let mut launch = s.launch_builder(dkdv);
        launch.arg(&bp);
        let maps;
        if cfg.bwd_wg {
            // The warp-specialized kernel loads Q, dO, K and V and adds into dq_acc through TMA
            // tensor maps.
            let (q_rows, kv_rows) = (tma::RowsTensor::of_queries(shape), tma::RowsTensor::of_keys(shape));
            let (bm, bn) = (cfg.bwd_bm as u32, cfg.bwd_bn() as u32);
            maps = [
                tma::TensorMap::rows(bp.q, q_rows, T::DTYPE, bm)?,
                tma::TensorMap::rows(bp.dout, q_rows, T::DTYPE, bm)?,
                tma::TensorMap::rows(bp.k, kv_rows, T::DTYPE, bn)?,
                tma::TensorMap::rows(bp.v, kv_rows, T::DTYPE, bn)?,
                tma::TensorMap::rows(bp.dq_acc, q_rows, DType::F32, bm)?,
            ];
            for m in &maps {
                launch.arg(m);
            }
        }
        unsafe { launch.launch(lc) }.map_err(drv("launching the dK/dV kernel"))?;
        Ok(())
    }
}

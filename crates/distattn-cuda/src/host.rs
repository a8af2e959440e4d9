//! Attention on host slices: upload, run on the compute stream, download.

use crate::device::CudaBackend;
use crate::{driver_err, CudaElement, DeviceElement};
use cudarc::driver::{CudaSlice, ValidAsZeroBits};
use distattn_core::{AttnOptions, AttnShape, Forward, Grads, Mask, Result};

impl CudaBackend {
    fn upload<T: CudaElement>(&self, name: &str, v: &[T], expected: usize, shape: &AttnShape) -> Result<CudaSlice<T>> {
        shape.check_len(name, v.len(), expected)?;
        self.stream().clone_htod(v).map_err(driver_err("uploading inputs"))
    }

    fn zeros<T: DeviceElement + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream().alloc_zeros::<T>(n).map_err(driver_err("allocating outputs"))
    }

    fn download<T: DeviceElement>(&self, s: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream().clone_dtoh(s).map_err(driver_err("downloading results"))
    }

    /// Forward on host slices: O in f32 (the kernel's unrounded output) and the LSE.
    pub fn forward_host<T: CudaElement>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<Forward> {
        shape.validate()?;
        let (dq, dk, dv) = (
            self.upload("q", q, shape.q_elems(), shape)?,
            self.upload("k", k, shape.kv_elems(), shape)?,
            self.upload("v", v, shape.kv_elems(), shape)?,
        );
        let mut o = self.zeros::<T>(shape.q_elems())?;
        let mut o_f32 = self.zeros::<f32>(shape.q_elems())?;
        let mut lse = self.zeros::<f32>(shape.lse_elems())?;
        self.forward(&dq, &dk, &dv, shape, mask, opts, &mut o, &mut lse, Some(&mut o_f32.as_view_mut()))?;
        let out = Forward { o: self.download(&o_f32)?, lse: self.download(&lse)? };
        self.synchronize()?;
        Ok(out)
    }

    /// Backward on host slices, from the forward's O and LSE and the output gradient `d_o`
    /// (arguments in the order of every backward: Q, K, V, O, LSE, dO).
    #[allow(clippy::too_many_arguments)] // public API: the six tensors of a backward and the problem
    pub fn backward_host<T: CudaElement>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        o: &[T],
        lse: &[f32],
        d_o: &[T],
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<Grads<T>> {
        shape.validate()?;
        shape.check_len("lse", lse.len(), shape.lse_elems())?;
        let (gq_in, gk_in, gv_in) = (
            self.upload("q", q, shape.q_elems(), shape)?,
            self.upload("k", k, shape.kv_elems(), shape)?,
            self.upload("v", v, shape.kv_elems(), shape)?,
        );
        let (o, d_o) = (self.upload("o", o, shape.q_elems(), shape)?, self.upload("d_o", d_o, shape.q_elems(), shape)?);
        let lse = self.stream().clone_htod(lse).map_err(driver_err("uploading inputs"))?;
        let mut dq = self.zeros::<T>(shape.q_elems())?;
        let mut dk = self.zeros::<T>(shape.kv_elems())?;
        let mut dv = self.zeros::<T>(shape.kv_elems())?;
        self.backward(&gq_in, &gk_in, &gv_in, &o, &lse, &d_o, shape, mask, opts, &mut dq, &mut dk, &mut dv)?;
        let out = Grads { dq: self.download(&dq)?, dk: self.download(&dk)?, dv: self.download(&dv)? };
        self.synchronize()?;
        Ok(out)
    }
}

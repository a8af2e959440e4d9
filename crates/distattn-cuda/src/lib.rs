//! CUDA backend of distattn.
//!
//! Flash attention forward and backward and the LSE merge of partial results, as CUDA kernels
//! (`src/kernels`, tensor-core `mma.sync.m16n8k16`, `ldmatrix`, `cp.async` double
//! buffering, online softmax in exp2) compiled at run time by NVRTC for the GPU found and
//! cached on disk ([`compile`]). Masks of `distattn-core` arrive as per-tile lists built on the
//! host ([`plan::TilePlan`]): empty tiles are never visited, full tiles run without mask
//! arithmetic, partial tiles read a per-tile bitmask.
//!
//! The library loads CUDA dynamically: it builds, and its host-side tests run, on machines
//! without CUDA; [`cuda_available`] says whether a GPU can be used, and every failure is a
//! [`distattn_core::Error`], never a panic.
//!
//! Entry points: [`CudaBackend::new`], then [`CudaBackend::forward`] / [`CudaBackend::backward`]
//! / [`CudaBackend::merge`] on device buffers, or [`CudaBackend::forward_host`] /
//! [`CudaBackend::backward_host`] on host slices.

pub mod aux;
pub mod compile;
mod multi;
mod params;
pub mod plan;
mod tma;

use aux::{AuxKernels, MergeDims};
use compile::{backend_err, KernelConfig};
pub use cudarc;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use distattn_core::{AttnOptions, AttnShape, DType, Element, Error, Mask, Result};
use params::{BwdParams, FwdParams};
use plan::TilePlan;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Element types the kernels take (bf16, f16).
pub trait CudaElement: Element + DeviceRepr + ValidAsZeroBits + Unpin {}
impl CudaElement for half::bf16 {}
impl CudaElement for half::f16 {}

fn drv(what: &str) -> impl Fn(DriverError) -> Error + '_ {
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
    // SAFETY: tries to dlopen libcuda by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    std::panic::catch_unwind(|| CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)).unwrap_or(0)
}

/// Output of a forward pass on host slices.
#[derive(Debug, Clone)]
pub struct HostForward<T> {
    pub o: Vec<T>,
    /// `[batch, heads, q_len]`, natural log; `-inf` for rows that see no key.
    pub lse: Vec<f32>,
}

/// Gradients on host slices.
#[derive(Debug, Clone)]
pub struct HostGrads<T> {
    pub dq: Vec<T>,
    pub dk: Vec<T>,
    pub dv: Vec<T>,
}

struct Kernels {
    cfg: KernelConfig,
    _module: Arc<CudaModule>,
    fwd: CudaFunction,
    dkdv: Option<CudaFunction>,
}

/// A tile plan uploaded to the device.
struct DevicePlan {
    ptr: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    bits: CudaSlice<u32>,
    n_major: usize,
}

const LOG2E: f32 = std::f32::consts::LOG2_E;

/// (mask hash, bm, bn, by key)
type PlanKey = (u64, usize, usize, bool);

/// The CUDA backend on one GPU: a context, a stream, compiled kernels and cached mask plans.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    cc: (i32, i32),
    max_smem: usize,
    modules: Mutex<HashMap<(DType, usize), Arc<Kernels>>>,
    aux: Mutex<HashMap<DType, Arc<AuxKernels>>>,
    plans: Mutex<HashMap<PlanKey, Arc<DevicePlan>>>,
}

fn ptr_of<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

fn mask_key(mask: &Mask) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    mask.q_len().hash(&mut h);
    mask.k_len().hash(&mut h);
    mask.slices().hash(&mut h);
    h.finish()
}

impl CudaBackend {
    /// Opens GPU `ordinal`. Fails with [`Error::Backend`] when no CUDA driver or GPU is found.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !unsafe { sys::is_culib_present() } {
            return Err(backend_err("no CUDA driver found (libcuda.so could not be loaded)"));
        }
        let n = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
        if ordinal >= n.max(0) as usize {
            return Err(backend_err(format!("GPU {ordinal} requested but {n} found")));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("creating the CUDA context"))?;
        // One stream: cudarc's per-buffer event tracking only adds launch overhead.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let cc = ctx.compute_capability().map_err(drv("compute capability"))?;
        let max_smem = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("shared memory limit"))? as usize;
        if cc.0 < 8 {
            return Err(backend_err(format!(
                "compute capability {}.{} found; the kernels need 8.0 or newer",
                cc.0, cc.1
            )));
        }
        Ok(CudaBackend {
            ctx,
            stream,
            arch: compile::arch_for(cc),
            cc,
            max_smem,
            modules: Mutex::new(HashMap::new()),
            aux: Mutex::new(HashMap::new()),
            plans: Mutex::new(HashMap::new()),
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// NVRTC target of this GPU (e.g. `sm_90a`).
    pub fn arch(&self) -> &str {
        &self.arch
    }
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }
    /// Device name as the driver reports it.
    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown CUDA device".into())
    }
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }

    fn kernels(&self, dtype: DType, head_dim: usize) -> Result<Arc<Kernels>> {
        let mut map = self.modules.lock().map_err(|_| backend_err("module cache poisoned"))?;
        if let Some(k) = map.get(&(dtype, head_dim)) {
            return Ok(k.clone());
        }
        let cfg = KernelConfig::new(dtype, head_dim)?.for_arch(&self.arch);
        let compiled = compile::compile_module(&compile::ModuleKind::Flash(cfg), &self.arch, false)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))
            .map_err(drv("loading the compiled module"))?;
        let f = |name: &str| module.load_function(name).map_err(drv("loading a kernel"));
        let k = Kernels {
            cfg,
            fwd: f(cfg.fwd_kernel())?,
            dkdv: if cfg.has_backward() { Some(f(cfg.dkdv_kernel())?) } else { None },
            _module: module.clone(),
        };
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        if cfg.fwd_smem() > self.max_smem || (cfg.has_backward() && cfg.bwd_smem() > self.max_smem) {
            return Err(backend_err(format!(
                "head dim {head_dim} needs {} / {} bytes of shared memory, the GPU allows {}",
                cfg.fwd_smem(),
                cfg.bwd_smem(),
                self.max_smem
            )));
        }
        k.fwd.set_attribute(attr, cfg.fwd_smem() as i32).map_err(drv("raising the smem limit"))?;
        if let Some(d) = &k.dkdv {
            d.set_attribute(attr, cfg.bwd_smem() as i32).map_err(drv("raising the smem limit"))?;
        }
        let k = Arc::new(k);
        map.insert((dtype, head_dim), k.clone());
        Ok(k)
    }

    /// The auxiliary kernels of `dtype` (row delta, conversion, merge), loaded on first use.
    fn aux(&self, dtype: DType) -> Result<Arc<AuxKernels>> {
        let mut map = self.aux.lock().map_err(|_| backend_err("module cache poisoned"))?;
        if let Some(a) = map.get(&dtype) {
            return Ok(a.clone());
        }
        let a = Arc::new(AuxKernels::load(&self.ctx, dtype)?);
        map.insert(dtype, a.clone());
        Ok(a)
    }

    /// Compiles (or loads from the cache) the kernels of a dtype and head dim ahead of use, and
    /// the auxiliary kernels of the dtype.
    pub fn prepare(&self, dtype: DType, head_dim: usize) -> Result<()> {
        self.kernels(dtype, head_dim)?;
        self.aux(dtype).map(|_| ())
    }

    fn plan(&self, mask: &Mask, bm: usize, bn: usize, by_key: bool) -> Result<Arc<DevicePlan>> {
        let key = (mask_key(mask), bm, bn, by_key);
        if let Some(p) = self.plans.lock().map_err(|_| backend_err("plan cache poisoned"))?.get(&key) {
            return Ok(p.clone());
        }
        let tp = if by_key { TilePlan::by_key(mask, bm, bn)? } else { TilePlan::by_query(mask, bm, bn)? };
        let flat: Vec<i32> = tp.tiles.iter().flat_map(|e| [e[0], e[1]]).collect();
        let up_i = |v: &[i32]| -> Result<CudaSlice<i32>> {
            if v.is_empty() {
                self.stream.alloc_zeros::<i32>(2).map_err(drv("allocating a plan"))
            } else {
                self.stream.clone_htod(v).map_err(drv("uploading a plan"))
            }
        };
        let bits = if tp.bits.is_empty() {
            self.stream.alloc_zeros::<u32>(1).map_err(drv("allocating a plan"))?
        } else {
            self.stream.clone_htod(&tp.bits).map_err(drv("uploading a plan"))?
        };
        let dp = Arc::new(DevicePlan { ptr: up_i(&tp.ptr)?, tiles: up_i(&flat)?, bits, n_major: tp.n_major });
        let mut cache = self.plans.lock().map_err(|_| backend_err("plan cache poisoned"))?;
        if cache.len() >= 512 {
            cache.clear();
        }
        cache.insert(key, dp.clone());
        Ok(dp)
    }

    fn check_common<T: CudaElement>(&self, shape: &AttnShape, mask: &Mask) -> Result<KernelConfig> {
        shape.validate()?;
        mask.check_fits(shape)?;
        if shape.q_len > i32::MAX as usize / 2 || shape.k_len > i32::MAX as usize / 2 {
            return Err(backend_err("sequence too long for 32-bit tile indices"));
        }
        Ok(KernelConfig::new(T::DTYPE, shape.head_dim)?.for_arch(&self.arch))
    }

    fn check_buf<U>(&self, name: &str, s: &CudaSlice<U>, expected: usize, shape: &AttnShape) -> Result<()> {
        shape.check_len(name, s.len(), expected)?;
        let p = ptr_of(s, &self.stream);
        #[allow(clippy::manual_is_multiple_of)] // MSRV 1.80
        if p % 16 != 0 {
            return Err(backend_err(format!("misaligned pointer: {name} at {p:#x} is not 16-byte aligned")));
        }
        Ok(())
    }

    /// Forward pass on device buffers: writes `o` (`[b, nq, h, d]`), `lse` (`[b, h, nq]`, f32,
    /// natural log) and, if given, an f32 copy of O (for merging partial results).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        o: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
        o_f32: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let cfg = self.check_common::<T>(shape, mask)?;
        self.check_buf("q", q, shape.q_elems(), shape)?;
        self.check_buf("k", k, shape.kv_elems(), shape)?;
        self.check_buf("v", v, shape.kv_elems(), shape)?;
        self.check_buf("o", o, shape.q_elems(), shape)?;
        self.check_buf("lse", lse, shape.lse_elems(), shape)?;
        if let Some(of) = &o_f32 {
            self.check_buf("o_f32", of, shape.q_elems(), shape)?;
        }
        let kern = self.kernels(T::DTYPE, shape.head_dim)?;
        let plan = self.plan(mask, cfg.fwd_bm(), cfg.fwd_bn, false)?;
        let s = &self.stream;
        let p = FwdParams {
            q: ptr_of(q, s),
            k: ptr_of(k, s),
            v: ptr_of(v, s),
            o: ptr_of(o, s),
            o_f32: o_f32.as_ref().map(|x| ptr_of(x, s)).unwrap_or(0),
            lse: ptr_of(lse, s),
            tile_ptr: ptr_of(&plan.ptr, s),
            tiles: ptr_of(&plan.tiles, s),
            bits: ptr_of(&plan.bits, s),
            batch: shape.batch as i32,
            q_len: shape.q_len as i32,
            k_len: shape.k_len as i32,
            heads: shape.heads as i32,
            kv_heads: shape.kv_heads as i32,
            n_tiles: plan.n_major as i32,
            scale_log2: opts.scale_for(shape.head_dim) * LOG2E,
            pad_: 0,
        };
        let cfg_l = LaunchConfig {
            // x: query tile x query head within its KV head group (see fwd_block in kernels/params.cuh).
            grid_dim: (
                (plan.n_major * (shape.heads / shape.kv_heads)) as u32,
                shape.kv_heads as u32,
                shape.batch as u32,
            ),
            block_dim: (kern.cfg.fwd_threads() as u32, 1, 1),
            shared_mem_bytes: kern.cfg.fwd_smem() as u32,
        };
        let mut launch = s.launch_builder(&kern.fwd);
        launch.arg(&p);
        let maps;
        if kern.cfg.fwd_wg {
            // The warp-specialized kernel loads Q, K and V through TMA tensor maps.
            let (bm, bn) = (kern.cfg.fwd_bm() as u32, kern.cfg.fwd_bn as u32);
            let kv_rows = tma::RowsTensor::of_keys(shape);
            maps = [
                tma::TensorMap::rows(p.q, tma::RowsTensor::of_queries(shape), T::DTYPE, bm)?,
                tma::TensorMap::rows(p.k, kv_rows, T::DTYPE, bn)?,
                tma::TensorMap::rows(p.v, kv_rows, T::DTYPE, bn)?,
            ];
            for m in &maps {
                launch.arg(m);
            }
        }
        unsafe { launch.launch(cfg_l) }.map_err(drv("launching the forward kernel"))?;
        Ok(())
    }

    /// The kernel configuration of a backward pass, or the error saying the head dim has none.
    fn backward_config<T: CudaElement>(&self, shape: &AttnShape, mask: &Mask) -> Result<KernelConfig> {
        let cfg = self.check_common::<T>(shape, mask)?;
        if !cfg.has_backward() {
            return Err(Error::UnsupportedHeadDim {
                head_dim: shape.head_dim,
                backend: "cuda (backward)",
                supported: "64, 96, 128".into(),
            });
        }
        Ok(cfg)
    }

    /// Backward pass on device buffers: from Q, K, V, O, dO and the forward's LSE, writes dQ,
    /// dK and dV (dK/dV summed over the query heads of each KV head).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: CudaElement>(
        &self,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        o: &CudaSlice<T>,
        dout: &CudaSlice<T>,
        lse: &CudaSlice<f32>,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        dq: &mut CudaSlice<T>,
        dk: &mut CudaSlice<T>,
        dv: &mut CudaSlice<T>,
    ) -> Result<()> {
        self.backward_config::<T>(shape, mask)?;
        // (The rest is checked by backward_with_delta; these three are used only here.)
        for (n, b) in [("o", o), ("dout", dout), ("dq", &*dq)] {
            self.check_buf(n, b, shape.q_elems(), shape)?;
        }
        let aux = self.aux(T::DTYPE)?;
        let s = &self.stream;
        let delta = unsafe { s.alloc::<f32>(shape.lse_elems()) }.map_err(drv("allocating delta"))?;
        let mut dq_acc = s.alloc_zeros::<f32>(shape.q_elems()).map_err(drv("allocating the dQ accumulator"))?;
        // SAFETY: O and dO were checked to hold q_elems() values of T, delta holds lse_elems()
        // f32; all are on this backend's stream.
        unsafe { aux.row_delta(s, ptr_of(o, s), T::DTYPE, ptr_of(dout, s), ptr_of(&delta, s), shape) }?;
        self.backward_with_delta(q, k, v, dout, lse, &delta, shape, mask, opts, &mut dq_acc, dk, dv)?;
        // SAFETY: dq_acc and dq hold q_elems() values (f32, T) on this stream.
        unsafe { aux.convert_f32(s, ptr_of(&dq_acc, s), ptr_of(dq, s), shape.q_elems()) }?;
        // Workspace buffers are freed in stream order (async free) when they drop here.
        Ok(())
    }

    /// Merges `n_parts` partial results over disjoint key sets: `o_parts` is `n_parts`
    /// consecutive f32 O tensors (`[b, nq, h, d]` each), `lse_parts` as many LSE tensors.
    /// Writes the merged f32 O and LSE; rows no part reaches get O = 0, LSE = -inf.
    #[allow(clippy::too_many_arguments)]
    pub fn merge<T: CudaElement>(
        &self,
        o_parts: &CudaSlice<f32>,
        lse_parts: &CudaSlice<f32>,
        n_parts: usize,
        shape: &AttnShape,
        o_out: &mut CudaSlice<f32>,
        lse_out: &mut CudaSlice<f32>,
        o_out_t: Option<&mut CudaSlice<T>>,
    ) -> Result<()> {
        shape.validate()?;
        KernelConfig::new(T::DTYPE, shape.head_dim)?;
        if n_parts == 0 {
            return Err(Error::ZeroDim { what: "merge parts" });
        }
        self.check_buf("o_parts", o_parts, n_parts * shape.q_elems(), shape)?;
        self.check_buf("lse_parts", lse_parts, n_parts * shape.lse_elems(), shape)?;
        self.check_buf("o_out", o_out, shape.q_elems(), shape)?;
        self.check_buf("lse_out", lse_out, shape.lse_elems(), shape)?;
        if let Some(t) = &o_out_t {
            self.check_buf("o_out_t", t, shape.q_elems(), shape)?;
        }
        let aux = self.aux(T::DTYPE)?;
        let s = &self.stream;
        // The accumulators start empty (O = 0, LSE = -inf: what rows no part reaches keep); each
        // part is merged into them through the identity spec (every row to the same row).
        s.memset_zeros(o_out).map_err(drv("clearing the merged O"))?;
        let lse_out_ptr = ptr_of(lse_out, s);
        // SAFETY: lse_out holds lse_elems() f32 on this stream.
        unsafe { sys::cuMemsetD32Async(lse_out_ptr, f32::NEG_INFINITY.to_bits(), shape.lse_elems(), s.cu_stream()) }
            .result()
            .map_err(drv("clearing the merged LSE"))?;
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
        let quads = s.clone_htod(&[0, 0, shape.q_len as i64, 0]).map_err(drv("uploading the merge spec"))?;
        let (o_out_ptr, quads_ptr) = (ptr_of(o_out, s), ptr_of(&quads, s));
        for part in 0..n_parts {
            let o = ptr_of(o_parts, s) + (part * shape.q_elems() * 4) as u64;
            let lse = ptr_of(lse_parts, s) + (part * shape.lse_elems() * 4) as u64;
            // SAFETY: part `part` of o_parts / lse_parts and the outputs hold the q_elems() /
            // lse_elems() f32 the identity spec covers; the quads are uploaded above; all on
            // this stream.
            unsafe { aux.merge(s, o, lse, o_out_ptr, lse_out_ptr, &dims, quads_ptr) }?;
        }
        if let Some(t) = o_out_t {
            // SAFETY: o_out and t hold q_elems() values (f32, T) on this stream.
            unsafe { aux.convert_f32(s, o_out_ptr, ptr_of(t, s), shape.q_elems()) }?;
        }
        Ok(())
    }

    fn upload<T: CudaElement>(&self, name: &str, v: &[T], expected: usize, shape: &AttnShape) -> Result<CudaSlice<T>> {
        shape.check_len(name, v.len(), expected)?;
        self.stream.clone_htod(v).map_err(drv("uploading inputs"))
    }

    fn alloc<U: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<U>> {
        self.stream.alloc_zeros::<U>(n).map_err(drv("allocating outputs"))
    }

    fn download<U: DeviceRepr + Default + Clone>(&self, s: &CudaSlice<U>) -> Result<Vec<U>> {
        self.stream.clone_dtoh(s).map_err(drv("downloading results"))
    }

    /// Forward on host slices: upload, run, download.
    pub fn forward_host<T: CudaElement>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<HostForward<T>> {
        shape.validate()?;
        let dq = self.upload("q", q, shape.q_elems(), shape)?;
        let dk = self.upload("k", k, shape.kv_elems(), shape)?;
        let dv = self.upload("v", v, shape.kv_elems(), shape)?;
        let mut o = self.alloc::<T>(shape.q_elems())?;
        let mut lse = self.alloc::<f32>(shape.lse_elems())?;
        self.forward(&dq, &dk, &dv, shape, mask, opts, &mut o, &mut lse, None)?;
        let out = HostForward { o: self.download(&o)?, lse: self.download(&lse)? };
        self.synchronize()?;
        Ok(out)
    }

    /// Backward on host slices: upload, run, download.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_host<T: CudaElement>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        o: &[T],
        dout: &[T],
        lse: &[f32],
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<HostGrads<T>> {
        shape.validate()?;
        let d_q = self.upload("q", q, shape.q_elems(), shape)?;
        let d_k = self.upload("k", k, shape.kv_elems(), shape)?;
        let d_v = self.upload("v", v, shape.kv_elems(), shape)?;
        let d_o = self.upload("o", o, shape.q_elems(), shape)?;
        let d_do = self.upload("dout", dout, shape.q_elems(), shape)?;
        shape.check_len("lse", lse.len(), shape.lse_elems())?;
        let d_lse = self.stream.clone_htod(lse).map_err(drv("uploading inputs"))?;
        let mut gq = self.alloc::<T>(shape.q_elems())?;
        let mut gk = self.alloc::<T>(shape.kv_elems())?;
        let mut gv = self.alloc::<T>(shape.kv_elems())?;
        self.backward(&d_q, &d_k, &d_v, &d_o, &d_do, &d_lse, shape, mask, opts, &mut gq, &mut gk, &mut gv)?;
        let out = HostGrads { dq: self.download(&gq)?, dk: self.download(&gk)?, dv: self.download(&gv)? };
        self.synchronize()?;
        Ok(out)
    }
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

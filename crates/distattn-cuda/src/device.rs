//! One GPU: its context, its two streams (the compute lane and the comm lane), the kernel
//! modules compiled for it, and the device copies of tile lists and index lists.

use crate::aux::AuxKernels;
use crate::buffer::GpuBuf;
use crate::compile::{self, backend_err, E4m3Tiling, KernelConfig, ModuleKind};
use crate::driver_err;
use crate::tiles::TilePlan;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr};
use distattn_core::schedule::Lane;
use distattn_core::{AttnShape, DType, Error, Mask, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The attention kernels of one (dtype, head dim), with their configuration.
pub(crate) struct Kernels {
    pub cfg: KernelConfig,
    _module: Arc<CudaModule>,
    pub fwd: CudaFunction,
    /// The forward in the configuration's tiling for short grids, where it has one
    /// (`KernelConfig::fwd_short`).
    pub fwd_short: Option<CudaFunction>,
    pub dkdv: Option<CudaFunction>,
    pub decode: CudaFunction,
    /// The FP8 forward and its V transpose, where the configuration has them.
    pub e4m3: Option<E4m3Kernels>,
}

/// The FP8 forward in both tilings (`flash_fwd_e4m3_192x64`, `flash_fwd_e4m3_128x128`) and the
/// transpose of V it reads (`transpose_v_e4m3`).
pub(crate) struct E4m3Kernels {
    pub tall: CudaFunction,
    pub short: CudaFunction,
    pub transpose_v: CudaFunction,
}

impl E4m3Kernels {
    /// The forward kernel of `tiling`.
    pub fn fwd(&self, tiling: E4m3Tiling) -> &CudaFunction {
        if tiling == E4m3Tiling::TALL {
            &self.tall
        } else {
            &self.short
        }
    }
}

/// A tile plan uploaded to the device, complete there before it is handed out: kernels on any
/// stream of the context (the compute lane, or a stream another library owns) may read it.
pub(crate) struct DeviceTiles {
    pub ptr: CudaSlice<i32>,
    pub tiles: CudaSlice<i32>,
    pub bits: CudaSlice<u32>,
    pub n_major: usize,
    /// Whether every major tile lists the same number of tiles (no tile is heavier than
    /// another: the launch order needs no heavy-first grouping, launch_group).
    pub uniform: bool,
}

/// (mask hash, bm, bn, by key)
type TilesKey = (u64, usize, usize, bool);

/// Index lists (pieces, merge runs) uploaded once per lane, by content.
type IndexKey = (u64, Lane);

/// The CUDA backend on one GPU: a context, a compute stream and a comm stream, compiled
/// kernels and cached device copies of tile and index lists. It runs attention on device
/// buffers ([`crate::attention`]), on host slices ([`crate::host`]), and plans through the
/// interpreter of `distattn-exec` ([`crate::backend`]).
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    arch: String,
    cc: (i32, i32),
    max_smem: usize,
    /// SMs, and shared memory per SM (bytes): what sizes the decode grid.
    sms: usize,
    smem_per_sm: usize,
    modules: Mutex<HashMap<(DType, usize), Arc<Kernels>>>,
    aux: Mutex<HashMap<DType, Arc<AuxKernels>>>,
    tiles: Mutex<HashMap<TilesKey, Arc<DeviceTiles>>>,
    indices: Mutex<HashMap<IndexKey, Arc<CudaSlice<i64>>>>,
    /// The FP8 forward's tiling, where one is fixed (else picked by the grid's size).
    e4m3_tiling: Mutex<Option<E4m3Tiling>>,
    /// Whether forwards take their short-grid tiling, where fixed (else picked by the grid's
    /// size).
    fwd_short: Mutex<Option<bool>>,
}

fn mask_key(mask: &Mask) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    mask.q_len().hash(&mut h);
    mask.k_len().hash(&mut h);
    mask.slices().hash(&mut h);
    h.finish()
}

fn poisoned(what: &str) -> Error {
    Error::Internal(format!("the {what} cache was poisoned by a panic"))
}

impl CudaBackend {
    /// Opens GPU `ordinal`. Fails with [`Error::Backend`] when no CUDA driver or GPU is found.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: only opens libcuda by the names cudarc knows, to see whether it loads, and
        // drops the handle; opening it runs its initialisers, as the first driver call would.
        if !unsafe { sys::is_culib_present() } {
            return Err(backend_err("no CUDA driver found (libcuda.so could not be loaded)"));
        }
        let n = CudaContext::device_count().map_err(driver_err("cuDeviceGetCount"))?;
        if ordinal >= n.max(0) as usize {
            return Err(backend_err(format!("GPU {ordinal} requested but {n} found")));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating the CUDA context"))?;
        // SAFETY: without event tracking (which would add events to every launch), what it
        // guaranteed across streams is this crate's to keep, and it does: attention on device
        // buffers and host slices uses only the compute stream; index lists are uploaded and
        // used per lane; peer copies wait for their sender's event (peer.rs); and on GpuBufs the
        // interpreter orders the two lanes with events so that no buffer is used on a lane before
        // its allocation, written by both lanes at once, or freed before its uses on the other
        // lane are done.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        // The comm stream gets the highest priority: a transfer's few blocks are scheduled as
        // soon as SMs free up instead of queueing behind a whole attention grid.
        let comm_stream = match cudarc::driver::result::stream::get_priority_range() {
            Ok((_, greatest)) => ctx.new_stream_with_priority(greatest),
            Err(_) => ctx.new_stream(),
        }
        .or_else(|_| ctx.new_stream())
        .map_err(driver_err("creating the comm stream"))?;
        let cc = ctx.compute_capability().map_err(driver_err("compute capability"))?;
        let max_smem = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver_err("shared memory limit"))? as usize;
        let attr = |a| ctx.attribute(a).map(|v| v.max(0) as usize).map_err(driver_err("device attributes"));
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let smem_per_sm = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?;
        if cc.0 < 8 {
            return Err(backend_err(format!(
                "compute capability {}.{} found; the kernels need 8.0 or newer",
                cc.0, cc.1
            )));
        }
        Ok(CudaBackend {
            ctx,
            stream,
            comm_stream,
            arch: compile::arch_for(cc),
            cc,
            max_smem,
            sms,
            smem_per_sm,
            modules: Mutex::new(HashMap::new()),
            aux: Mutex::new(HashMap::new()),
            tiles: Mutex::new(HashMap::new()),
            indices: Mutex::new(HashMap::new()),
            e4m3_tiling: Mutex::new(compile::kcfg_overrides().get("e4m3_rows").and_then(|&r| E4m3Tiling::of_rows(r))),
            fwd_short: Mutex::new(compile::kcfg_overrides().get("fwd_short").map(|&v| v != 0)),
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The compute lane: every kernel launch goes here.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The comm lane: transfers (and the copies that feed them) go here.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm_stream
    }

    /// The stream of `lane`.
    pub fn lane(&self, lane: Lane) -> &Arc<CudaStream> {
        match lane {
            Lane::Compute => &self.stream,
            Lane::Comm => &self.comm_stream,
        }
    }

    /// NVRTC target of this GPU (e.g. `sm_90a`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Largest dynamic shared memory a block may opt into, bytes.
    pub fn max_smem(&self) -> usize {
        self.max_smem
    }

    /// SMs of the GPU.
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    /// Fixes the FP8 forward's tiling ([`E4m3Tiling::TALL`] or [`E4m3Tiling::SHORT`]) for
    /// later calls, or with `None` lets each call pick it by its grid's size (the default; or
    /// what `DISTATTN_KCFG`'s `e4m3_rows` says). Both compute the same result; this is for
    /// tests and measurements.
    pub fn set_e4m3_tiling(&self, tiling: Option<E4m3Tiling>) {
        *self.e4m3_tiling.lock().unwrap_or_else(|e| e.into_inner()) = tiling;
    }

    /// The FP8 forward's tiling for a grid of `blocks_of(rows)` blocks.
    pub(crate) fn e4m3_tiling(&self, blocks_of: impl Fn(usize) -> usize) -> E4m3Tiling {
        let fixed = *self.e4m3_tiling.lock().unwrap_or_else(|e| e.into_inner());
        fixed.unwrap_or_else(|| E4m3Tiling::for_grid(self.sms, blocks_of))
    }

    /// Fixes whether the bf16/f16 forwards run their tiling for short grids
    /// ([`KernelConfig::fwd_short`], where the module has one) on every grid (`Some(true)`) or
    /// on none (`Some(false)`), or with `None` lets each call pick by its grid's size (the
    /// default; or what `DISTATTN_KCFG`'s `fwd_short=0|1` says). Both compute the same result;
    /// this is for tests and measurements.
    pub fn set_fwd_short(&self, short: Option<bool>) {
        *self.fwd_short.lock().unwrap_or_else(|e| e.into_inner()) = short;
    }

    /// The configuration and kernel of a bf16/f16 forward of `shape` in `kern`, whose
    /// configuration is `cfg`: [`KernelConfig::fwd_for_grid`] of its grid on this GPU.
    pub(crate) fn fwd_tiling<'k>(
        &self,
        cfg: KernelConfig,
        kern: &'k Kernels,
        shape: &AttnShape,
    ) -> (KernelConfig, &'k CudaFunction) {
        let fixed = *self.fwd_short.lock().unwrap_or_else(|e| e.into_inner());
        let chosen = cfg.fwd_for_grid(self.sms, shape.q_len, shape.heads * shape.batch, fixed);
        match &kern.fwd_short {
            Some(f) if chosen != cfg => (chosen, f),
            _ => (cfg, &kern.fwd),
        }
    }

    /// Shared memory per SM, bytes.
    pub fn smem_per_sm(&self) -> usize {
        self.smem_per_sm
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// Device name as the driver reports it.
    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown CUDA device".into())
    }

    /// Waits for the work issued on the compute lane.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronize"))
    }

    /// The kernel configuration of `dtype` and `head_dim` on this GPU's architecture.
    pub(crate) fn kernel_config(&self, dtype: DType, head_dim: usize) -> Result<KernelConfig> {
        Ok(KernelConfig::new(dtype, head_dim)?.for_arch(&self.arch))
    }

    pub(crate) fn kernels(&self, dtype: DType, head_dim: usize) -> Result<Arc<Kernels>> {
        let mut map = self.modules.lock().map_err(|_| poisoned("kernel module"))?;
        if let Some(k) = map.get(&(dtype, head_dim)) {
            return Ok(k.clone());
        }
        let cfg = self.kernel_config(dtype, head_dim)?;
        let compiled = compile::compile_module(&ModuleKind::Flash(cfg), &self.arch, false)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))
            .map_err(driver_err("loading the compiled module"))?;
        let f = |name: &str| module.load_function(name).map_err(driver_err("loading a kernel"));
        let k = Kernels {
            cfg,
            fwd: f(cfg.fwd_kernel())?,
            fwd_short: cfg.fwd_short().map(|_| f("flash_fwd_ws_short")).transpose()?,
            // (A GPU without room for the backward's tiles still runs the forward; the backward
            // says why it cannot run: CudaBackend::backward_config.)
            dkdv: if cfg.bwd_smem() <= self.max_smem { Some(f(cfg.dkdv_kernel())?) } else { None },
            decode: f("flash_decode")?,
            e4m3: if cfg.has_e4m3_forward() {
                Some(E4m3Kernels {
                    tall: f(&E4m3Tiling::TALL.kernel())?,
                    short: f(&E4m3Tiling::SHORT.kernel())?,
                    transpose_v: f("transpose_v_e4m3")?,
                })
            } else {
                None
            },
            _module: module.clone(),
        };
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        if cfg.fwd_smem() > self.max_smem {
            return Err(backend_err(format!(
                "the forward at head dim {head_dim} needs {} bytes of shared memory, the GPU allows {}",
                cfg.fwd_smem(),
                self.max_smem
            )));
        }
        k.fwd.set_attribute(attr, cfg.fwd_smem() as i32).map_err(driver_err("raising the smem limit"))?;
        if let (Some(f), Some(c)) = (&k.fwd_short, cfg.fwd_short()) {
            if c.fwd_smem() > self.max_smem {
                return Err(backend_err(format!(
                    "the short-grid forward at head dim {head_dim} needs {} bytes of shared memory, the GPU allows {}",
                    c.fwd_smem(),
                    self.max_smem
                )));
            }
            f.set_attribute(attr, c.fwd_smem() as i32).map_err(driver_err("raising the smem limit"))?;
        }
        if let Some(d) = &k.dkdv {
            d.set_attribute(attr, cfg.bwd_smem() as i32).map_err(driver_err("raising the smem limit"))?;
        }
        if let Some(e) = &k.e4m3 {
            for t in [E4m3Tiling::TALL, E4m3Tiling::SHORT] {
                let smem = t.smem(head_dim) as i32;
                e.fwd(t).set_attribute(attr, smem).map_err(driver_err("raising the smem limit"))?;
            }
        }
        // (A GPU without room for the decode kernel's stages still runs the others; decode
        // launches check.)
        if cfg.decode_smem() <= self.max_smem {
            k.decode.set_attribute(attr, cfg.decode_smem() as i32).map_err(driver_err("raising the smem limit"))?;
        }
        let k = Arc::new(k);
        map.insert((dtype, head_dim), k.clone());
        Ok(k)
    }

    /// The auxiliary kernels of `dtype`, loaded on first use. Their f32 kernels (merges, f32
    /// adds and copies) are in every module, so f32 asks for any loaded one (bf16's if none).
    pub(crate) fn aux(&self, dtype: DType) -> Result<Arc<AuxKernels>> {
        let mut map = self.aux.lock().map_err(|_| poisoned("auxiliary module"))?;
        let dtype = match dtype {
            DType::F32 => map.keys().next().copied().unwrap_or(DType::BF16),
            d => d,
        };
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

    /// The tile plan of `mask` for `bm × bn` tiles, listed by query or by key tile, on the
    /// device (built and uploaded once per mask).
    pub(crate) fn tiles(&self, mask: &Mask, bm: usize, bn: usize, by_key: bool) -> Result<Arc<DeviceTiles>> {
        let key = (mask_key(mask), bm, bn, by_key);
        if let Some(p) = self.tiles.lock().map_err(|_| poisoned("tile plan"))?.get(&key) {
            return Ok(p.clone());
        }
        let tp = if by_key { TilePlan::by_key(mask, bm, bn)? } else { TilePlan::by_query(mask, bm, bn)? };
        let flat: Vec<i32> = tp.tiles.iter().flat_map(|e| [e[0], e[1]]).collect();
        let up_i = |v: &[i32]| -> Result<CudaSlice<i32>> {
            if v.is_empty() {
                self.stream.alloc_zeros::<i32>(2).map_err(driver_err("allocating a tile plan"))
            } else {
                self.stream.clone_htod(v).map_err(driver_err("uploading a tile plan"))
            }
        };
        let bits = if tp.bits.is_empty() {
            self.stream.alloc_zeros::<u32>(1).map_err(driver_err("allocating a tile plan"))?
        } else {
            self.stream.clone_htod(&tp.bits).map_err(driver_err("uploading a tile plan"))?
        };
        let uniform = tp.ptr.windows(3).all(|w| w[1] - w[0] == w[2] - w[1]);
        let dp = Arc::new(DeviceTiles { ptr: up_i(&tp.ptr)?, tiles: up_i(&flat)?, bits, n_major: tp.n_major, uniform });
        // Once per mask: the plan is read by kernels on whatever stream the caller launches on,
        // which the upload's stream does not order.
        self.stream.synchronize().map_err(driver_err("uploading a tile plan"))?;
        let mut cache = self.tiles.lock().map_err(|_| poisoned("tile plan"))?;
        if cache.len() >= 512 {
            // Kernels on any stream may still read an evicted plan: free it after all of them.
            // A plan a caller still holds (a launch that took it before this call) stays: its
            // kernels are not issued yet, and dropping the caller's reference after them would
            // free it on this backend's stream, not ordered after theirs.
            self.ctx.synchronize().map_err(driver_err("evicting tile plans"))?;
            cache.retain(|_, plan| Arc::strong_count(plan) > 1);
        }
        cache.insert(key, dp.clone());
        Ok(dp)
    }

    /// An index list (piece triples, merge runs) on the device for work on `lane`, uploaded
    /// once per content.
    pub(crate) fn indices(&self, lane: Lane, v: &[i64]) -> Result<Arc<CudaSlice<i64>>> {
        let key = (compile::fnv64(&[bytemuck::cast_slice(v)]), lane);
        if let Some(x) = self.indices.lock().map_err(|_| poisoned("index list"))?.get(&key) {
            return Ok(x.clone());
        }
        let one = [0i64];
        let up = self
            .lane(lane)
            .clone_htod(if v.is_empty() { &one[..] } else { v })
            .map_err(driver_err("uploading indices"))?;
        let up = Arc::new(up);
        let mut c = self.indices.lock().map_err(|_| poisoned("index list"))?;
        if c.len() > 4096 {
            c.clear();
        }
        c.insert(key, up.clone());
        Ok(up)
    }

    /// Raw address of an index list on `lane`.
    pub(crate) fn index_ptr(&self, lane: Lane, list: &CudaSlice<i64>) -> u64 {
        list.device_ptr(self.lane(lane)).0
    }

    fn memory_pool(&self) -> Result<sys::CUmemoryPool> {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the driver writes one handle into the local `pool`; `cu_device()` is the device
        // of this live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(driver_err("memory pool"))?;
        Ok(pool)
    }

    /// Sets the device memory pool so that a block freed on one stream is reused only once it
    /// is free (no hidden cross-stream waits) and memory is kept between runs.
    pub fn keep_memory_pool(&self) -> Result<()> {
        let pool = self.memory_pool()?;
        let mut zero: i32 = 0;
        let mut max: u64 = u64::MAX;
        // SAFETY: `pool` is the device's default pool (from memory_pool above); each attribute is
        // read from a live local of the type the driver expects for it (an int for the reuse
        // flag, a u64 for the threshold).
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                &mut zero as *mut i32 as *mut _,
            )
            .result()
            .map_err(driver_err("memory pool"))?;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut max as *mut u64 as *mut _,
            )
            .result()
            .map_err(driver_err("memory pool"))
        }
    }

    /// Returns the memory pool's unused blocks to the device (what [`Self::keep_memory_pool`]
    /// keeps between runs).
    pub fn release_memory_pool(&self) -> Result<()> {
        let pool = self.memory_pool()?;
        // SAFETY: `pool` is the device's default pool (from memory_pool above); trimming frees
        // only blocks no allocation holds.
        unsafe { sys::cuMemPoolTrimTo(pool, 0) }.result().map_err(driver_err("memory pool"))
    }

    /// Peak bytes in use in the device's memory pool since the last reset (and resets it when
    /// asked).
    pub fn pool_peak_bytes(&self, reset: bool) -> Result<u64> {
        let pool = self.memory_pool()?;
        let mut v: u64 = 0;
        // SAFETY: `pool` is the device's default pool (from memory_pool above); the high-water
        // mark attribute is a u64, written into the local `v` and reset from the local `z`.
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut v as *mut u64 as *mut _,
            )
            .result()
            .map_err(driver_err("memory pool"))?;
            if reset {
                let mut z: u64 = 0;
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    &mut z as *mut u64 as *mut _,
                )
                .result()
                .map_err(driver_err("memory pool"))?;
            }
        }
        Ok(v)
    }

    /// A new buffer of `n` deterministic values (bf16 or f16) uniform in `[-a, a)`, made on the
    /// compute lane: inputs for timing runs, generated where they are used.
    pub fn random_buf(&self, dtype: DType, n: usize, seed: u64, a: f32) -> Result<GpuBuf> {
        let aux = self.aux(dtype)?;
        if aux.dtype() != dtype {
            return Err(Error::UnsupportedDType(format!("{dtype} (random fills are bf16 or f16)")));
        }
        let s = &self.stream;
        let buf = GpuBuf::alloc(s, dtype, n)?;
        // SAFETY: `buf` holds n values of the module's type (dtypes checked above), and the fill
        // runs on the compute stream, ordered with the buffer's other uses there.
        unsafe { aux.rand_fill(s, buf.ptr(s), n, seed, a) }?;
        Ok(buf)
    }
}

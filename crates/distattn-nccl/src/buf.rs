//! Device buffers of the multi-GPU executor and the small kernels it needs besides attention:
//! piece copies and adds (with bf16/f16 → f32), LSE merges of partial results, fills.

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use distattn_core::{DType, Error, Result};
use half::{bf16, f16};
use std::sync::Arc;

pub(crate) fn gpu_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| {
        let oom = e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        Error::Backend {
            backend: "cuda",
            reason: if oom { format!("{what}: out of GPU memory") } else { format!("{what}: {e:?}") },
        }
    }
}

/// Typed device storage.
#[derive(Debug)]
pub enum GpuData {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
}

/// A device buffer: `len` elements of its dtype (storage is at least one element, so empty
/// buffers exist too).
#[derive(Debug)]
pub struct GpuBuf {
    pub data: GpuData,
    pub len: usize,
}

impl GpuBuf {
    pub fn dtype(&self) -> DType {
        match &self.data {
            GpuData::F32(_) => DType::F32,
            GpuData::BF16(_) => DType::BF16,
            GpuData::F16(_) => DType::F16,
        }
    }

    pub fn bytes(&self) -> usize {
        self.len * self.dtype().size()
    }

    /// Raw device address (no synchronisation: streams are ordered by the executor).
    pub fn ptr(&self, s: &CudaStream) -> u64 {
        match &self.data {
            GpuData::F32(x) => x.device_ptr(s).0,
            GpuData::BF16(x) => x.device_ptr(s).0,
            GpuData::F16(x) => x.device_ptr(s).0,
        }
    }

    /// Uninitialised buffer on `stream` (stream-ordered allocation).
    pub fn alloc(stream: &Arc<CudaStream>, dtype: DType, len: usize) -> Result<GpuBuf> {
        let n = len.max(1);
        let f = gpu_err("allocating a buffer");
        // SAFETY: contents are written before they are read (fills, receives, kernels).
        let data = unsafe {
            match dtype {
                DType::F32 => GpuData::F32(stream.alloc::<f32>(n).map_err(f)?),
                DType::BF16 => GpuData::BF16(stream.alloc::<bf16>(n).map_err(f)?),
                DType::F16 => GpuData::F16(stream.alloc::<f16>(n).map_err(f)?),
            }
        };
        Ok(GpuBuf { data, len })
    }

    /// Buffer filled with `fill` (0 or −inf for f32; 0 for 16-bit types).
    pub fn filled(stream: &Arc<CudaStream>, dtype: DType, len: usize, fill: f32) -> Result<GpuBuf> {
        let b = Self::alloc(stream, dtype, len)?;
        b.fill(stream, fill)?;
        Ok(b)
    }

    pub fn fill(&self, stream: &Arc<CudaStream>, fill: f32) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let p = self.ptr(stream);
        let r = unsafe {
            match self.dtype() {
                DType::F32 => sys::cuMemsetD32Async(p, fill.to_bits(), self.len, stream.cu_stream()),
                DType::BF16 => sys::cuMemsetD16Async(p, bf16::from_f32(fill).to_bits(), self.len, stream.cu_stream()),
                DType::F16 => sys::cuMemsetD16Async(p, f16::from_f32(fill).to_bits(), self.len, stream.cu_stream()),
            }
        };
        r.result().map_err(gpu_err("filling a buffer"))
    }

    /// Frees the buffer in the order of `stream` (which must be ordered after every use).
    pub fn free_on(self, stream: &CudaStream) {
        let ptr = match self.data {
            GpuData::F32(x) => x.leak(),
            GpuData::BF16(x) => x.leak(),
            GpuData::F16(x) => x.leak(),
        };
        unsafe {
            let _ = sys::cuMemFreeAsync(ptr, stream.cu_stream());
        }
    }

    /// Host copy as f32 (synchronous).
    pub fn download_f32(&self, stream: &Arc<CudaStream>) -> Result<Vec<f32>> {
        let f = gpu_err("downloading a buffer");
        let mut v: Vec<f32> = match &self.data {
            GpuData::F32(x) => stream.clone_dtoh(x).map_err(f)?,
            GpuData::BF16(x) => stream.clone_dtoh(x).map_err(f)?.into_iter().map(|v| v.to_f32()).collect(),
            GpuData::F16(x) => stream.clone_dtoh(x).map_err(f)?.into_iter().map(|v| v.to_f32()).collect(),
        };
        stream.synchronize().map_err(gpu_err("synchronising a download"))?;
        v.truncate(self.len);
        Ok(v)
    }

    /// Uploads a host slice of a storage dtype (synchronous w.r.t. the host data).
    pub fn upload<T: distattn_core::Element>(stream: &Arc<CudaStream>, data: &[T]) -> Result<GpuBuf> {
        let f = gpu_err("uploading a buffer");
        let one = [T::default()];
        let src: &[T] = if data.is_empty() { &one } else { data };
        // SAFETY: the dtype tag says what T is; the element types have identical layouts.
        let buf = unsafe {
            match T::DTYPE {
                DType::F32 => GpuData::F32(
                    stream.clone_htod(std::slice::from_raw_parts(src.as_ptr() as *const f32, src.len())).map_err(f)?,
                ),
                DType::BF16 => GpuData::BF16(
                    stream.clone_htod(std::slice::from_raw_parts(src.as_ptr() as *const bf16, src.len())).map_err(f)?,
                ),
                DType::F16 => GpuData::F16(
                    stream.clone_htod(std::slice::from_raw_parts(src.as_ptr() as *const f16, src.len())).map_err(f)?,
                ),
            }
        };
        Ok(GpuBuf { data: buf, len: data.len() })
    }
}

/// Access to a buffer as a typed slice.
pub trait GpuElem: Sized {
    fn of(b: &GpuBuf) -> Result<&CudaSlice<Self>>;
    fn of_mut(b: &mut GpuBuf) -> Result<&mut CudaSlice<Self>>;
}

macro_rules! gpu_elem {
    ($t:ty, $v:ident) => {
        impl GpuElem for $t {
            fn of(b: &GpuBuf) -> Result<&CudaSlice<$t>> {
                let d = b.dtype();
                match &b.data {
                    GpuData::$v(x) => Ok(x),
                    _ => Err(Error::DTypeMismatch {
                        a: "buffer".into(),
                        a_dtype: d.to_string(),
                        b: "expected".into(),
                        b_dtype: stringify!($t).into(),
                    }),
                }
            }
            fn of_mut(b: &mut GpuBuf) -> Result<&mut CudaSlice<$t>> {
                let d = b.dtype();
                match &mut b.data {
                    GpuData::$v(x) => Ok(x),
                    _ => Err(Error::DTypeMismatch {
                        a: "buffer".into(),
                        a_dtype: d.to_string(),
                        b: "expected".into(),
                        b_dtype: stringify!($t).into(),
                    }),
                }
            }
        }
    };
}
gpu_elem!(f32, F32);
gpu_elem!(bf16, BF16);
gpu_elem!(f16, F16);

const AUX_SRC: &str = r#"
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
__device__ __forceinline__ float bf2f(u16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ float h2f(u16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

#define PIECE_KERNEL(NAME, ST, DT, EXPR) \
extern "C" __global__ void NAME(const ST* __restrict__ src, DT* __restrict__ dst, const i64* __restrict__ pieces) { \
    const i64 s = pieces[3 * blockIdx.x], d = pieces[3 * blockIdx.x + 1], n = pieces[3 * blockIdx.x + 2]; \
    for (i64 i = (i64)blockIdx.y * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.y * blockDim.x) { EXPR; } \
}
PIECE_KERNEL(copy_u16, u16, u16, dst[d + i] = src[s + i])
PIECE_KERNEL(copy_u32, u32, u32, dst[d + i] = src[s + i])
PIECE_KERNEL(add_f32, float, float, dst[d + i] += src[s + i])
PIECE_KERNEL(add_bf16, u16, float, dst[d + i] += bf2f(src[s + i]))
PIECE_KERNEL(add_f16, u16, float, dst[d + i] += h2f(src[s + i]))

__device__ __forceinline__ void merge_one(const float* o, const float* lse, float* oacc, float* lacc,
                                          i64 sl, i64 dl, i64 so, i64 dof, int d, int lane) {
    const float lb = lse[sl];
    const float la = lacc[dl];
    __syncwarp();
    if (!(lb > -3.0e38f)) return;  // -inf or NaN: nothing to add
    if (!(la > -3.0e38f)) {
        for (int c = lane; c < d; c += 32) oacc[dof + c] = o[so + c];
        if (lane == 0) lacc[dl] = lb;
        return;
    }
    const float m = fmaxf(la, lb);
    float wa = expf(la - m), wb = expf(lb - m);
    const float sum = wa + wb;
    wa /= sum;
    wb /= sum;
    for (int c = lane; c < d; c += 32) oacc[dof + c] = wa * oacc[dof + c] + wb * o[so + c];
    if (lane == 0) lacc[dl] = m + logf(sum);
}

struct MergeArgs {
    const float* o; const float* lse; float* oacc; float* lacc;
    const i64* tp;  // per token piece: src token, dst token, length, start in the flattened pieces
    i64 total; i64 ns; i64 nd;
    int n_pieces; int batch; int nh; int hs; int hd; int hs0; int hd0; int d;
};

// One warp per (batch, head, token) row of the token pieces.
extern "C" __global__ void merge_pieces(MergeArgs a) {
    const i64 row = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= (i64)a.batch * a.nh * a.total) return;
    const i64 t = row % a.total;
    const i64 bh = row / a.total;
    const int h = (int)(bh % a.nh), b = (int)(bh / a.nh);
    int lo = 0, hi = a.n_pieces - 1;
    while (lo < hi) { int mid = (lo + hi + 1) / 2; if (a.tp[4 * mid + 3] <= t) lo = mid; else hi = mid - 1; }
    const i64 off = t - a.tp[4 * lo + 3];
    const i64 i = a.tp[4 * lo] + off, j = a.tp[4 * lo + 1] + off;
    const int hsl = a.hs0 + h, hdl = a.hd0 + h;
    merge_one(a.o, a.lse, a.oacc, a.lacc,
              ((i64)b * a.hs + hsl) * a.ns + i, ((i64)b * a.hd + hdl) * a.nd + j,
              (((i64)b * a.ns + i) * a.hs + hsl) * a.d, (((i64)b * a.nd + j) * a.hd + hdl) * a.d, a.d, lane);
}

// Explicit rows (source LSE index, destination LSE index, source O offset, destination O offset).
extern "C" __global__ void merge_list(const float* o, const float* lse, float* oacc, float* lacc, const i64* rows, i64 n, int d) {
    const i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= n) return;
    merge_one(o, lse, oacc, lacc, rows[4 * r], rows[4 * r + 1], rows[4 * r + 2], rows[4 * r + 3], d, threadIdx.x & 31);
}

// Deterministic pseudo-random fill, uniform in [-a, a).
__device__ __forceinline__ float hash_unit(unsigned long long x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return (float)(x >> 40) * (1.0f / 16777216.0f);
}
extern "C" __global__ void rand_bf16(u16* dst, i64 n, unsigned long long seed, float a) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = f2bf((hash_unit(seed * 0x9e3779b97f4a7c15ULL + i) * 2.f - 1.f) * a);
}
"#;

#[repr(C)]
#[derive(Clone, Copy)]
struct MergeArgs {
    o: u64,
    lse: u64,
    oacc: u64,
    lacc: u64,
    tp: u64,
    total: i64,
    ns: i64,
    nd: i64,
    n_pieces: i32,
    batch: i32,
    nh: i32,
    hs: i32,
    hd: i32,
    hs0: i32,
    hd0: i32,
    d: i32,
}
unsafe impl DeviceRepr for MergeArgs {}

/// The compact description of a merge: token pieces and a head range.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeSpec {
    pub batch: usize,
    pub heads: usize,
    pub hs: usize,
    pub hd: usize,
    pub hs0: usize,
    pub hd0: usize,
    pub ns: usize,
    pub nd: usize,
    pub head_dim: usize,
    /// `(src token, dst token, len, start)` quads.
    pub quads: Vec<i64>,
    pub total: usize,
}

impl MergeSpec {
    /// Merge of a partial covering `src` into an accumulator covering `dst`.
    pub fn new(
        src: &distattn_core::plan::BufDesc,
        dst: &distattn_core::plan::BufDesc,
        shape: &distattn_core::AttnShape,
    ) -> MergeSpec {
        let tp = src.tokens.pieces_into(&dst.tokens);
        let (h0, h1) = (src.heads.start.max(dst.heads.start), src.heads.end.min(dst.heads.end));
        let mut quads = Vec::new();
        let mut total = 0usize;
        for (sa, sb, n) in tp {
            quads.extend([sa as i64, sb as i64, n as i64, total as i64]);
            total += n;
        }
        MergeSpec {
            batch: shape.batch,
            heads: h1.saturating_sub(h0),
            hs: src.heads.len(),
            hd: dst.heads.len(),
            hs0: h0.saturating_sub(src.heads.start),
            hd0: h0.saturating_sub(dst.heads.start),
            ns: src.tokens.len(),
            nd: dst.tokens.len(),
            head_dim: shape.head_dim,
            quads,
            total,
        }
    }

    /// The rows it merges, in `distattn_dist::exec::merge_rows` form (for tests).
    pub fn rows(&self) -> Vec<(usize, usize, usize, usize)> {
        let mut out = Vec::new();
        for b in 0..self.batch {
            for h in 0..self.heads {
                for q in self.quads.chunks(4) {
                    for off in 0..q[2] as usize {
                        let (i, j) = (q[0] as usize + off, q[1] as usize + off);
                        let (hsl, hdl) = (self.hs0 + h, self.hd0 + h);
                        out.push((
                            (b * self.hs + hsl) * self.ns + i,
                            (b * self.hd + hdl) * self.nd + j,
                            ((b * self.ns + i) * self.hs + hsl) * self.head_dim,
                            ((b * self.nd + j) * self.hd + hdl) * self.head_dim,
                        ));
                    }
                }
            }
        }
        out
    }
}

/// The auxiliary kernels, loaded in one context.
pub struct Aux {
    _module: Arc<CudaModule>,
    copy_u16: CudaFunction,
    copy_u32: CudaFunction,
    add_f32: CudaFunction,
    add_bf16: CudaFunction,
    add_f16: CudaFunction,
    merge_pieces: CudaFunction,
    merge_list: CudaFunction,
    rand_bf16: CudaFunction,
}

/// Compiles the auxiliary kernels to PTX (no GPU needed; NVRTC must load).
pub fn compile_aux() -> Result<cudarc::nvrtc::Ptx> {
    cudarc::nvrtc::compile_ptx(AUX_SRC)
        .map_err(|e| Error::Backend { backend: "cuda", reason: format!("compiling the auxiliary kernels: {e}") })
}

impl Aux {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Aux> {
        let ptx = compile_aux()?;
        let m = ctx.load_module(ptx).map_err(gpu_err("loading the auxiliary kernels"))?;
        let f = |n: &str| m.load_function(n).map_err(gpu_err("loading an auxiliary kernel"));
        Ok(Aux {
            copy_u16: f("copy_u16")?,
            copy_u32: f("copy_u32")?,
            add_f32: f("add_f32")?,
            add_bf16: f("add_bf16")?,
            add_f16: f("add_f16")?,
            merge_pieces: f("merge_pieces")?,
            merge_list: f("merge_list")?,
            rand_bf16: f("rand_bf16")?,
            _module: m,
        })
    }

    /// Copies (`add = false`, same dtype) or adds into f32 (`add = true`) the given pieces
    /// (`(src, dst, len)` triples uploaded as i64, `n_pieces` of them, longest `max_len`).
    pub fn pieces(
        &self,
        s: &Arc<CudaStream>,
        src: &GpuBuf,
        dst: &GpuBuf,
        pieces: &CudaSlice<i64>,
        n_pieces: usize,
        max_len: usize,
        add: bool,
    ) -> Result<()> {
        if n_pieces == 0 || max_len == 0 {
            return Ok(());
        }
        let f = match (add, src.dtype(), dst.dtype()) {
            (false, a, b) if a == b && a.size() == 2 => &self.copy_u16,
            (false, a, b) if a == b && a.size() == 4 => &self.copy_u32,
            (true, DType::F32, DType::F32) => &self.add_f32,
            (true, DType::BF16, DType::F32) => &self.add_bf16,
            (true, DType::F16, DType::F32) => &self.add_f16,
            (_, a, b) => {
                return Err(Error::DTypeMismatch {
                    a: "piece source".into(),
                    a_dtype: a.to_string(),
                    b: "destination".into(),
                    b_dtype: b.to_string(),
                })
            }
        };
        let y = max_len.div_ceil(256 * 4).clamp(1, 4096) as u32;
        let mut left = n_pieces;
        let mut first = 0usize;
        while left > 0 {
            let n = left.min(65535 * 1024);
            let (sp, dp) = (src.ptr(s), dst.ptr(s));
            let pp = pieces.device_ptr(s).0 + (first * 3 * 8) as u64;
            let cfg = LaunchConfig { grid_dim: (n as u32, y, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            unsafe { s.launch_builder(f).arg(&sp).arg(&dp).arg(&pp).launch(cfg) }
                .map_err(gpu_err("launching a piece copy"))?;
            left -= n;
            first += n;
        }
        Ok(())
    }

    /// Merges a partial (O, LSE) into accumulators by a compact spec whose quads are uploaded.
    #[allow(clippy::too_many_arguments)]
    pub fn merge(
        &self,
        s: &Arc<CudaStream>,
        o: &GpuBuf,
        lse: &GpuBuf,
        oacc: &GpuBuf,
        lacc: &GpuBuf,
        spec: &MergeSpec,
        quads: &CudaSlice<i64>,
    ) -> Result<()> {
        let rows = spec.batch * spec.heads * spec.total;
        if rows == 0 {
            return Ok(());
        }
        for b in [o, lse, oacc, lacc] {
            if b.dtype() != DType::F32 {
                return Err(Error::Backend { backend: "cuda", reason: "merge of non-f32 buffers".into() });
            }
        }
        let a = MergeArgs {
            o: o.ptr(s),
            lse: lse.ptr(s),
            oacc: oacc.ptr(s),
            lacc: lacc.ptr(s),
            tp: quads.device_ptr(s).0,
            total: spec.total as i64,
            ns: spec.ns as i64,
            nd: spec.nd as i64,
            n_pieces: (spec.quads.len() / 4) as i32,
            batch: spec.batch as i32,
            nh: spec.heads as i32,
            hs: spec.hs as i32,
            hd: spec.hd as i32,
            hs0: spec.hs0 as i32,
            hd0: spec.hd0 as i32,
            d: spec.head_dim as i32,
        };
        let cfg =
            LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe { s.launch_builder(&self.merge_pieces).arg(&a).launch(cfg) }
            .map_err(gpu_err("launching merge_pieces"))?;
        Ok(())
    }

    /// Merges explicit rows (uploaded quads of i64).
    #[allow(clippy::too_many_arguments)]
    pub fn merge_rows(
        &self,
        s: &Arc<CudaStream>,
        o: &GpuBuf,
        lse: &GpuBuf,
        oacc: &GpuBuf,
        lacc: &GpuBuf,
        rows: &CudaSlice<i64>,
        n: usize,
        d: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (po, pl, pa, pla, pr) = (o.ptr(s), lse.ptr(s), oacc.ptr(s), lacc.ptr(s), rows.device_ptr(s).0);
        let (n64, d32) = (n as i64, d as i32);
        let cfg = LaunchConfig { grid_dim: (n.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe {
            s.launch_builder(&self.merge_list)
                .arg(&po)
                .arg(&pl)
                .arg(&pa)
                .arg(&pla)
                .arg(&pr)
                .arg(&n64)
                .arg(&d32)
                .launch(cfg)
        }
        .map_err(gpu_err("launching merge_list"))?;
        Ok(())
    }

    /// Fills a bf16 buffer with deterministic uniform values in [-a, a).
    pub fn rand_bf16(&self, s: &Arc<CudaStream>, b: &GpuBuf, seed: u64, a: f32) -> Result<()> {
        if b.len == 0 {
            return Ok(());
        }
        if b.dtype() != DType::BF16 {
            return Err(Error::Backend { backend: "cuda", reason: "rand_bf16 on a non-bf16 buffer".into() });
        }
        let (p, n) = (b.ptr(s), b.len as i64);
        let cfg = LaunchConfig { grid_dim: (1024, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe { s.launch_builder(&self.rand_bf16).arg(&p).arg(&n).arg(&seed).arg(&a).launch(cfg) }
            .map_err(gpu_err("launching rand_bf16"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distattn_core::plan::{BufDesc, Tensor, TokenSet};
    use distattn_core::AttnShape;

    #[test]
    fn aux_kernels_compile_when_nvrtc_is_present() {
        if !distattn_cuda::compile::nvrtc_available() {
            eprintln!("NVRTC not found: skipped");
            return;
        }
        let ptx = compile_aux().unwrap();
        let src = ptx.to_src();
        for k in ["copy_u16", "add_bf16", "merge_pieces", "merge_list", "rand_bf16"] {
            assert!(src.contains(k), "{k} missing from the PTX");
        }
    }

    #[test]
    fn merge_spec_matches_the_executor_rows() {
        let shape = AttnShape::new(2, 64, 64, 8, 4, 16).unwrap();
        let cases = [
            (
                BufDesc::new(Tensor::O, TokenSet::range(8..24), 0..8),
                BufDesc::new(Tensor::O, TokenSet::range(0..32), 0..8),
            ),
            (
                BufDesc::new(Tensor::O, TokenSet::range(0..32), 2..6),
                BufDesc::new(Tensor::O, TokenSet::range(0..64), 0..8),
            ),
            (
                BufDesc::new(Tensor::O, TokenSet::union([&TokenSet::range(0..8), &TokenSet::range(40..48)]), 0..4),
                BufDesc::new(Tensor::O, TokenSet::union([&TokenSet::range(0..16), &TokenSet::range(32..48)]), 2..8),
            ),
        ];
        for (src, dst) in cases {
            let spec = MergeSpec::new(&src, &dst, &shape);
            let mut want = distattn_dist::exec::merge_rows(&src, &dst, &shape);
            let mut got = spec.rows();
            want.sort();
            got.sort();
            assert_eq!(got, want, "{src:?} -> {dst:?}");
        }
    }
}

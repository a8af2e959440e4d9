//! Device buffers of the multi-GPU executor, and the compact spec of its LSE merges (the kernels
//! they feed are `distattn_cuda::aux`'s).

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use distattn_core::{DType, Error, Result};
use distattn_cuda::aux::{AuxKernels, MergeDims};
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

    /// Fills the buffer, of `aux`'s dtype, with deterministic uniform values in [-a, a).
    pub fn rand_fill(&self, stream: &Arc<CudaStream>, aux: &AuxKernels, seed: u64, a: f32) -> Result<()> {
        if self.dtype() != aux.dtype() {
            return Err(Error::DTypeMismatch {
                a: "random fill".into(),
                a_dtype: self.dtype().to_string(),
                b: "auxiliary kernels".into(),
                b_dtype: aux.dtype().to_string(),
            });
        }
        // SAFETY: the buffer holds `len` values of the kernels' dtype on `stream`'s device.
        unsafe { aux.rand_fill(stream, self.ptr(stream), self.len, seed, a) }
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

    /// The spec as the merge kernel takes it (the quads uploaded apart).
    pub fn dims(&self) -> MergeDims {
        MergeDims {
            batch: self.batch,
            heads: self.heads,
            hs: self.hs,
            hd: self.hd,
            hs0: self.hs0,
            hd0: self.hd0,
            ns: self.ns,
            nd: self.nd,
            head_dim: self.head_dim,
            n_pieces: self.quads.len() / 4,
            total: self.total,
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

#[cfg(test)]
mod tests {
    use super::*;
    use distattn_core::plan::{BufDesc, Tensor, TokenSet};
    use distattn_core::AttnShape;

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

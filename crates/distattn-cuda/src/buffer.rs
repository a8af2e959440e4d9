//! Device buffers of any storage dtype: one untyped allocation with its dtype and length, and
//! typed views for the kernels.

use crate::driver_err;
use cudarc::driver::{sys, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr};
use distattn_core::{DType, Element, Error, Result};
use half::{bf16, f16};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// A device buffer: `len` elements of `dtype` (its storage holds at least one element, so
/// empty buffers exist too), allocated here or lent by another library ([`GpuBuf::lent`]).
#[derive(Debug)]
pub struct GpuBuf {
    /// Dropped by hand: a lent buffer's memory is its owner's to free.
    mem: ManuallyDrop<CudaSlice<u8>>,
    dtype: DType,
    len: usize,
    lent: bool,
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        // SAFETY: `mem` is taken once, here, and not used again.
        let mem = unsafe { ManuallyDrop::take(&mut self.mem) };
        if self.lent {
            mem.leak();
        }
    }
}

/// An element type the kernels read and write (f32, bf16, f16).
pub trait DeviceElement: Element + DeviceRepr {}
impl DeviceElement for f32 {}
impl DeviceElement for bf16 {}
impl DeviceElement for f16 {}

impl GpuBuf {
    /// An unwritten buffer, allocated in the order of `stream`.
    pub fn alloc(stream: &Arc<CudaStream>, dtype: DType, len: usize) -> Result<GpuBuf> {
        let bytes = len
            .max(1)
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::invalid("buffer length", format!("{len} elements overflow")))?;
        // SAFETY: the memory is left unset, which Rust cannot observe: the host sees device
        // memory only as bytes the driver copies back, and every bit pattern is a valid u8 (and
        // f32, bf16, f16). Callers write it before they read it (fills, receives, kernel outputs).
        let mem = unsafe { stream.alloc::<u8>(bytes) }.map_err(driver_err("allocating a buffer"))?;
        Ok(GpuBuf { mem: ManuallyDrop::new(mem), dtype, len, lent: false })
    }

    /// A buffer of `len` values `fill` (0 or −inf in f32; 0 in 16-bit types).
    pub fn filled(stream: &Arc<CudaStream>, dtype: DType, len: usize, fill: f32) -> Result<GpuBuf> {
        let b = Self::alloc(stream, dtype, len)?;
        b.fill(stream, fill)?;
        Ok(b)
    }

    /// A buffer holding `data` (the host data is read before this returns).
    pub fn upload<T: Element>(stream: &Arc<CudaStream>, data: &[T]) -> Result<GpuBuf> {
        let one = [T::default()];
        let src: &[T] = if data.is_empty() { &one } else { data };
        let mem = stream.clone_htod(bytemuck::cast_slice::<T, u8>(src)).map_err(driver_err("uploading a buffer"))?;
        Ok(GpuBuf { mem: ManuallyDrop::new(mem), dtype: T::DTYPE, len: data.len(), lent: false })
    }

    /// A buffer holding a copy of the `len` elements of `dtype` at device address `src`, copied
    /// in the order of `stream` (memory another library owns: a PyTorch tensor).
    ///
    /// # Safety
    /// `src` is device memory of `stream`'s context holding `len` elements of `dtype`, not
    /// written by other work until the copy has run on `stream`.
    pub unsafe fn copy_of(stream: &Arc<CudaStream>, dtype: DType, src: u64, len: usize) -> Result<GpuBuf> {
        let b = Self::alloc(stream, dtype, len)?;
        if len > 0 {
            // SAFETY: `b` holds `len` elements of `dtype`; the caller's contract covers `src`.
            unsafe { sys::cuMemcpyDtoDAsync_v2(b.ptr(stream), src, b.bytes(), stream.cu_stream()) }
                .result()
                .map_err(driver_err("copying a tensor into a buffer"))?;
        }
        Ok(b)
    }

    /// The `len` elements of `dtype` at device address `ptr`, memory another library owns (a
    /// PyTorch tensor), without a copy: dropping or freeing the buffer leaves the memory to its
    /// owner.
    ///
    /// # Safety
    /// `ptr` is device memory of `stream`'s context holding `len` elements of `dtype`, aligned
    /// to 16 bytes; it stays allocated, and no other work writes it (nor reads it, where the
    /// buffer is written), while the buffer or work using it lives.
    pub unsafe fn lent(stream: &Arc<CudaStream>, dtype: DType, ptr: u64, len: usize) -> Result<GpuBuf> {
        if len == 0 {
            return Self::alloc(stream, dtype, 0);
        }
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::invalid("buffer length", format!("{len} elements overflow")))?;
        // SAFETY: the caller's contract; event tracking is off on this backend's context, so
        // the slice records nothing, and `Drop` leaks it instead of freeing it.
        let mem = unsafe { stream.upgrade_device_ptr::<u8>(ptr, bytes) };
        Ok(GpuBuf { mem: ManuallyDrop::new(mem), dtype, len, lent: true })
    }

    /// Copies the buffer's elements to device address `dst`, in the order of `stream`.
    ///
    /// # Safety
    /// `dst` is device memory of `stream`'s context with room for [`GpuBuf::bytes`] bytes, not
    /// read or written by other work until the copy has run on `stream`.
    pub unsafe fn copy_to(&self, stream: &Arc<CudaStream>, dst: u64) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the buffer holds `bytes()` bytes; the caller's contract covers `dst`.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, self.ptr(stream), self.bytes(), stream.cu_stream()) }
            .result()
            .map_err(driver_err("copying a buffer into a tensor"))
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the `len` elements.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// Raw device address (no synchronisation: the interpreter orders the streams).
    pub fn ptr(&self, stream: &CudaStream) -> u64 {
        self.mem.device_ptr(stream).0
    }

    fn check_dtype<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                a: "device buffer".into(),
                a_dtype: self.dtype.to_string(),
                b: "expected".into(),
                b_dtype: T::DTYPE.to_string(),
            });
        }
        Ok(())
    }

    /// The buffer as `len` elements of `T`, which must be its dtype.
    pub fn view<T: DeviceElement>(&self) -> Result<CudaView<'_, T>> {
        self.check_dtype::<T>()?;
        // SAFETY: the bytes hold values of the buffer's dtype, which is T (checked), and any
        // bit pattern is a valid T (Element is Pod); the allocation holds at least len of them.
        unsafe { self.mem.transmute::<T>(self.len) }
            .ok_or_else(|| Error::Internal("a device buffer is shorter than its length".into()))
    }

    /// The buffer as `len` writable elements of `T`, which must be its dtype.
    pub fn view_mut<T: DeviceElement>(&mut self) -> Result<CudaViewMut<'_, T>> {
        self.check_dtype::<T>()?;
        let len = self.len;
        // SAFETY: as in `view`; every write of a T leaves valid bytes.
        unsafe { self.mem.transmute_mut::<T>(len) }
            .ok_or_else(|| Error::Internal("a device buffer is shorter than its length".into()))
    }

    /// Sets every element to `fill`, in the order of `stream`.
    pub fn fill(&self, stream: &Arc<CudaStream>, fill: f32) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let p = self.ptr(stream);
        // SAFETY: the allocation holds `len` elements of the dtype's size at `p`, and the
        // memset is ordered on `stream` like every other use of the buffer.
        let r = unsafe {
            match self.dtype {
                DType::F32 => sys::cuMemsetD32Async(p, fill.to_bits(), self.len, stream.cu_stream()),
                DType::BF16 => sys::cuMemsetD16Async(p, bf16::from_f32(fill).to_bits(), self.len, stream.cu_stream()),
                DType::F16 => sys::cuMemsetD16Async(p, f16::from_f32(fill).to_bits(), self.len, stream.cu_stream()),
            }
        };
        r.result().map_err(driver_err("filling a buffer"))
    }

    /// Frees the buffer in the order of `stream`, which must be ordered after every use (a lent
    /// one is only let go).
    pub fn free_on(mut self, stream: &CudaStream) {
        if self.lent {
            return;
        }
        // SAFETY: `mem` is taken once; `self` is then forgotten, so `Drop` does not take it again.
        let mem = unsafe { ManuallyDrop::take(&mut self.mem) };
        std::mem::forget(self);
        let ptr = mem.leak();
        // SAFETY: `leak` gave up the CudaSlice's ownership of `ptr`, an allocation of this
        // buffer's stream's context, so nothing else frees it; the free is stream-ordered, and
        // this method's contract is that `stream` is ordered after every use of the buffer.
        unsafe {
            let _ = sys::cuMemFreeAsync(ptr, stream.cu_stream());
        }
    }

    /// The values as f32 on the host, after the work issued on `stream`.
    pub fn download_f32(&self, stream: &Arc<CudaStream>) -> Result<Vec<f32>> {
        let bytes = stream.clone_dtoh(&*self.mem).map_err(driver_err("downloading a buffer"))?;
        stream.synchronize().map_err(driver_err("synchronising a download"))?;
        let bytes = &bytes[..self.bytes()];
        Ok(match self.dtype {
            DType::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(bytes),
            DType::BF16 => bytemuck::pod_collect_to_vec::<u8, bf16>(bytes).into_iter().map(|v| v.to_f32()).collect(),
            DType::F16 => bytemuck::pod_collect_to_vec::<u8, f16>(bytes).into_iter().map(|v| v.to_f32()).collect(),
        })
    }
}

//! The compute backend of the plan executor, and its CPU implementation.
//!
//! The executor only moves data through these calls, so a CUDA backend implements the same
//! trait with device buffers (and pairs with a communicator whose `Buf` is its
//! [`Backend::CommBuf`], e.g. NCCL on device memory).

use distattn_core::comm::{as_bytes, as_bytes_mut};
use distattn_core::{AttnOptions, AttnShape, DType, Element, Error, Mask, Result};
use half::{bf16, f16};

/// `(source offset, destination offset, length)` in elements.
pub type Piece = (usize, usize, usize);

/// One row of a merge: `(source LSE index, destination LSE index, source O offset,
/// destination O offset)`; O rows are `head_dim` long.
pub type MergeRow = (usize, usize, usize, usize);

/// What the executor needs from a compute device.
pub trait Backend: Sync {
    /// A buffer on the device, with its dtype.
    type Buf: Send;
    /// What a communicator moves (host bytes for the CPU).
    type CommBuf: ?Sized;

    fn name(&self) -> &'static str;
    /// A buffer holding `data`.
    fn upload<T: Element>(&self, data: &[T]) -> Result<Self::Buf>;
    /// A buffer of `elems` values of `dtype`, all `fill`.
    fn alloc(&self, dtype: DType, elems: usize, fill: f32) -> Result<Self::Buf>;
    /// The buffer's values as f32 on the host.
    fn download_f32(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// The buffer as the communicator sees it.
    fn comm_view<'a>(&self, buf: &'a Self::Buf) -> &'a Self::CommBuf;
    fn comm_view_mut<'a>(&self, buf: &'a mut Self::Buf) -> &'a mut Self::CommBuf;
    /// `dst[d..d+n] = src[s..s+n]` for every piece (same dtype).
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf, pieces: &[Piece]) -> Result<()>;
    /// `dst[d..d+n] += src[s..s+n]` for every piece (f32).
    fn add(&self, src: &Self::Buf, dst: &mut Self::Buf, pieces: &[Piece]) -> Result<()>;
    /// Overflow-safe f32 LSE merge of partial rows into accumulator rows.
    fn merge(
        &self,
        o: &Self::Buf,
        lse: &Self::Buf,
        o_acc: &mut Self::Buf,
        lse_acc: &mut Self::Buf,
        rows: &[MergeRow],
        head_dim: usize,
    ) -> Result<()>;
    /// Attention of one block: returns (O, LSE) in f32.
    fn forward(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<(Self::Buf, Self::Buf)>;
    /// Exact partial gradients of one block given the global LSE and D: (dQ, dK, dV) in f32.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        d_o: &Self::Buf,
        lse: &Self::Buf,
        delta: &Self::Buf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<(Self::Buf, Self::Buf, Self::Buf)>;
}

/// A host buffer of one of the storage dtypes.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl HostBuf {
    pub fn dtype(&self) -> DType {
        match self {
            HostBuf::F32(_) => DType::F32,
            HostBuf::BF16(_) => DType::BF16,
            HostBuf::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostBuf::F32(v) => v.len(),
            HostBuf::BF16(v) => v.len(),
            HostBuf::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn f32(&self) -> Result<&[f32]> {
        match self {
            HostBuf::F32(v) => Ok(v),
            other => Err(Error::DTypeMismatch {
                a: "buffer".into(),
                a_dtype: other.dtype().to_string(),
                b: "expected".into(),
                b_dtype: "f32".into(),
            }),
        }
    }

    fn f32_mut(&mut self) -> Result<&mut [f32]> {
        match self {
            HostBuf::F32(v) => Ok(v),
            other => Err(Error::DTypeMismatch {
                a: "buffer".into(),
                a_dtype: other.dtype().to_string(),
                b: "expected".into(),
                b_dtype: "f32".into(),
            }),
        }
    }
}

/// The CPU backend: host buffers and the `distattn-cpu` flash kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

fn copy_pieces<T: Copy>(src: &[T], dst: &mut [T], pieces: &[Piece]) -> Result<()> {
    for &(s, d, n) in pieces {
        if s + n > src.len() || d + n > dst.len() {
            return Err(Error::Comm(format!(
                "copy piece {s}+{n} -> {d} outside buffers of {} / {}",
                src.len(),
                dst.len()
            )));
        }
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
    Ok(())
}

macro_rules! with_input {
    ($buf:expr, |$v:ident| $body:expr) => {
        match $buf {
            HostBuf::F32($v) => $body,
            HostBuf::BF16($v) => $body,
            HostBuf::F16($v) => $body,
        }
    };
}

fn typed<'a, T: Element>(b: &'a HostBuf, what: &str) -> Result<&'a [T]> {
    let dtype = b.dtype();
    if dtype != T::DTYPE {
        return Err(Error::DTypeMismatch {
            a: what.into(),
            a_dtype: dtype.to_string(),
            b: "q".into(),
            b_dtype: T::DTYPE.to_string(),
        });
    }
    // SAFETY: the dtype tag matches T, so the variant's element type is T.
    Ok(unsafe {
        match b {
            HostBuf::F32(v) => std::slice::from_raw_parts(v.as_ptr() as *const T, v.len()),
            HostBuf::BF16(v) => std::slice::from_raw_parts(v.as_ptr() as *const T, v.len()),
            HostBuf::F16(v) => std::slice::from_raw_parts(v.as_ptr() as *const T, v.len()),
        }
    })
}

fn cpu_fwd<T: Element>(
    q: &[T],
    k: &HostBuf,
    v: &HostBuf,
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<(HostBuf, HostBuf)> {
    let f = distattn_cpu::forward(q, typed::<T>(k, "k")?, typed::<T>(v, "v")?, shape, mask, opts)?;
    Ok((HostBuf::F32(f.o), HostBuf::F32(f.lse)))
}

#[allow(clippy::too_many_arguments)]
fn cpu_bwd<T: Element>(
    q: &[T],
    k: &HostBuf,
    v: &HostBuf,
    d_o: &HostBuf,
    lse: &[f32],
    delta: &[f32],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<(HostBuf, HostBuf, HostBuf)> {
    let g = distattn_cpu::backward(
        q,
        typed::<T>(k, "k")?,
        typed::<T>(v, "v")?,
        typed::<T>(d_o, "d_o")?,
        lse,
        delta,
        shape,
        mask,
        opts,
    )?;
    Ok((HostBuf::F32(g.dq), HostBuf::F32(g.dk), HostBuf::F32(g.dv)))
}

impl Backend for CpuBackend {
    type Buf = HostBuf;
    type CommBuf = [u8];

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload<T: Element>(&self, data: &[T]) -> Result<HostBuf> {
        let mut b = self.alloc(T::DTYPE, data.len(), 0.0)?;
        match &mut b {
            HostBuf::F32(v) => T::convert_to_f32(data, v),
            HostBuf::BF16(v) => {
                for (d, s) in v.iter_mut().zip(data) {
                    *d = bf16::from_f32(s.to_f32());
                }
            }
            HostBuf::F16(v) => {
                for (d, s) in v.iter_mut().zip(data) {
                    *d = f16::from_f32(s.to_f32());
                }
            }
        }
        Ok(b)
    }

    fn alloc(&self, dtype: DType, elems: usize, fill: f32) -> Result<HostBuf> {
        Ok(match dtype {
            DType::F32 => HostBuf::F32(vec![fill; elems]),
            DType::BF16 => HostBuf::BF16(vec![bf16::from_f32(fill); elems]),
            DType::F16 => HostBuf::F16(vec![f16::from_f32(fill); elems]),
        })
    }

    fn download_f32(&self, buf: &HostBuf) -> Result<Vec<f32>> {
        Ok(with_input!(buf, |v| v.iter().map(|x| x.to_f32()).collect()))
    }

    fn comm_view<'a>(&self, buf: &'a HostBuf) -> &'a [u8] {
        with_input!(buf, |v| as_bytes(v))
    }

    fn comm_view_mut<'a>(&self, buf: &'a mut HostBuf) -> &'a mut [u8] {
        with_input!(buf, |v| as_bytes_mut(v))
    }

    fn copy(&self, src: &HostBuf, dst: &mut HostBuf, pieces: &[Piece]) -> Result<()> {
        match (src, dst) {
            (HostBuf::F32(s), HostBuf::F32(d)) => copy_pieces(s, d, pieces),
            (HostBuf::BF16(s), HostBuf::BF16(d)) => copy_pieces(s, d, pieces),
            (HostBuf::F16(s), HostBuf::F16(d)) => copy_pieces(s, d, pieces),
            (s, d) => Err(Error::DTypeMismatch {
                a: "copy source".into(),
                a_dtype: s.dtype().to_string(),
                b: "destination".into(),
                b_dtype: d.dtype().to_string(),
            }),
        }
    }

    fn add(&self, src: &HostBuf, dst: &mut HostBuf, pieces: &[Piece]) -> Result<()> {
        let (s, d) = (src.f32()?, dst.f32_mut()?);
        for &(a, b, n) in pieces {
            if a + n > s.len() || b + n > d.len() {
                return Err(Error::Comm("add piece outside buffers".into()));
            }
            for (x, y) in d[b..b + n].iter_mut().zip(&s[a..a + n]) {
                *x += *y;
            }
        }
        Ok(())
    }

    fn merge(
        &self,
        o: &HostBuf,
        lse: &HostBuf,
        o_acc: &mut HostBuf,
        lse_acc: &mut HostBuf,
        rows: &[MergeRow],
        d: usize,
    ) -> Result<()> {
        let (po, pl) = (o.f32()?, lse.f32()?);
        let (ao, al) = (o_acc.f32_mut()?, lse_acc.f32_mut()?);
        for &(sl, dl, so, dof) in rows {
            let (la, lb) = (al[dl], pl[sl]);
            if lb == f32::NEG_INFINITY || lb.is_nan() {
                continue;
            }
            let (acc, part) = (&mut ao[dof..dof + d], &po[so..so + d]);
            if la == f32::NEG_INFINITY || la.is_nan() {
                acc.copy_from_slice(part);
                al[dl] = lb;
                continue;
            }
            let m = la.max(lb);
            let (wa, wb) = ((la - m).exp(), (lb - m).exp());
            let sum = wa + wb;
            let (wa, wb) = (wa / sum, wb / sum);
            for (x, &y) in acc.iter_mut().zip(part) {
                *x = wa * *x + wb * y;
            }
            al[dl] = m + sum.ln();
        }
        Ok(())
    }

    fn forward(
        &self,
        q: &HostBuf,
        k: &HostBuf,
        v: &HostBuf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<(HostBuf, HostBuf)> {
        match q {
            HostBuf::F32(q) => cpu_fwd(q, k, v, shape, mask, opts),
            HostBuf::BF16(q) => cpu_fwd(q, k, v, shape, mask, opts),
            HostBuf::F16(q) => cpu_fwd(q, k, v, shape, mask, opts),
        }
    }

    fn backward(
        &self,
        q: &HostBuf,
        k: &HostBuf,
        v: &HostBuf,
        d_o: &HostBuf,
        lse: &HostBuf,
        delta: &HostBuf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<(HostBuf, HostBuf, HostBuf)> {
        let (l, dl) = (lse.f32()?, delta.f32()?);
        match q {
            HostBuf::F32(q) => cpu_bwd(q, k, v, d_o, l, dl, shape, mask, opts),
            HostBuf::BF16(q) => cpu_bwd(q, k, v, d_o, l, dl, shape, mask, opts),
            HostBuf::F16(q) => cpu_bwd(q, k, v, d_o, l, dl, shape, mask, opts),
        }
    }
}

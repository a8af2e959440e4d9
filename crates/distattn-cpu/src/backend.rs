//! The CPU backend of the interpreter: host buffers ([`HostData`]) and the flash kernels of
//! this crate. Every call completes before it returns, so lanes need no ordering and an event
//! is the time it was recorded (which makes the interpreter's timelines work here too).

use crate::merge::merge_row;
use distattn_core::schedule::Lane;
use distattn_core::{AttnOptions, AttnShape, DType, Element, Error, HostData, Result};
use distattn_exec::{Backend, Block, BwdInputs, FwdInputs, GradAccs, MergeSpec, Piece};
use half::{bf16, f16};
use std::time::Instant;

/// The CPU backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

fn out_of_bounds(what: &str, piece: Piece, src: usize, dst: usize) -> Error {
    Error::InvalidPlan(format!("{what} piece {piece:?} outside buffers of {src} and {dst} elements"))
}

/// Row runs of `pieces`, each checked to lie inside both buffers.
fn checked_runs<'a>(
    what: &'a str,
    pieces: &'a [Piece],
    src: usize,
    dst: usize,
) -> Result<impl Iterator<Item = (usize, usize, usize)> + 'a> {
    match pieces.iter().find(|p| !p.fits(src, dst)) {
        Some(&p) => Err(out_of_bounds(what, p, src, dst)),
        None => Ok(pieces.iter().flat_map(|p| p.row_runs())),
    }
}

fn copy_pieces<T: Copy>(src: &[T], dst: &mut [T], pieces: &[Piece]) -> Result<()> {
    for (s, d, n) in checked_runs("copy", pieces, src.len(), dst.len())? {
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
    Ok(())
}

/// Copies between f32 and the input dtype: a final output narrowed for a link, or widened back.
fn convert_pieces<S: Element, T: Element>(src: &[S], dst: &mut [T], pieces: &[Piece]) -> Result<()> {
    for (s, d, n) in checked_runs("copy", pieces, src.len(), dst.len())? {
        for (y, x) in dst[d..d + n].iter_mut().zip(&src[s..s + n]) {
            *y = T::from_f32(x.to_f32());
        }
    }
    Ok(())
}

fn add_pieces<T: Element>(src: &[T], dst: &mut [f32], pieces: &[Piece]) -> Result<()> {
    for (s, d, n) in checked_runs("add", pieces, src.len(), dst.len())? {
        for (x, y) in dst[d..d + n].iter_mut().zip(&src[s..s + n]) {
            *x += y.to_f32();
        }
    }
    Ok(())
}

/// Runs `$body` with `$v` bound to the typed slice of `$buf`, whatever its dtype.
macro_rules! with_typed {
    ($buf:expr, |$v:ident| $body:expr) => {
        match $buf {
            HostData::F32($v) => $body,
            HostData::BF16($v) => $body,
            HostData::F16($v) => $body,
        }
    };
}

fn block_forward<T: Element>(
    block: &Block,
    inputs: &FwdInputs<'_, HostData>,
    opts: &AttnOptions,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let f = crate::forward(
        inputs.q.as_slice::<T>()?,
        inputs.k.as_slice::<T>()?,
        inputs.v.as_slice::<T>()?,
        &block.shape,
        &block.mask,
        opts,
    )?;
    Ok((f.o, f.lse))
}

fn block_backward<T: Element>(
    block: &Block,
    i: &BwdInputs<'_, HostData>,
    opts: &AttnOptions,
) -> Result<distattn_core::Grads> {
    crate::backward(
        i.q.as_slice::<T>()?,
        i.k.as_slice::<T>()?,
        i.v.as_slice::<T>()?,
        i.d_o.as_slice::<T>()?,
        i.lse.as_slice::<f32>()?,
        i.delta.as_slice::<f32>()?,
        &block.shape,
        &block.mask,
        opts,
    )
}

impl Backend for CpuBackend {
    type Buf = HostData;
    type CommBuf = [u8];
    type Event = Instant;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, _lane: Lane, dtype: DType, elems: usize, fill: Option<f32>) -> Result<HostData> {
        // An unfilled buffer starts as NaN, so a plan reading what it never wrote shows in the
        // results rather than passing on zeros.
        Ok(HostData::filled(dtype, elems, fill.unwrap_or(f32::NAN)))
    }

    fn free(&self, _lane: Lane, buf: HostData) {
        drop(buf);
    }

    fn upload<T: Element>(&self, data: &[T]) -> Result<HostData> {
        Ok(HostData::from_slice(data))
    }

    fn download_f32(&self, buf: &HostData) -> Result<Vec<f32>> {
        Ok(buf.to_f32())
    }

    fn comm_view<'a>(&self, buf: &'a HostData) -> &'a [u8] {
        buf.as_bytes()
    }

    fn comm_view_mut<'a>(&self, buf: &'a mut HostData) -> &'a mut [u8] {
        buf.as_bytes_mut()
    }

    fn record(&self, _lane: Lane, _timed: bool) -> Result<Instant> {
        Ok(Instant::now())
    }

    fn wait(&self, _lane: Lane, _event: &Instant) -> Result<()> {
        Ok(())
    }

    fn is_done(&self, _event: &Instant) -> Result<bool> {
        Ok(true)
    }

    fn elapsed_ms(&self, start: &Instant, end: &Instant) -> Result<f64> {
        Ok(end.saturating_duration_since(*start).as_secs_f64() * 1e3)
    }

    fn copy(&self, _lane: Lane, src: &HostData, dst: &mut HostData, pieces: &[Piece]) -> Result<()> {
        match (src, dst) {
            (HostData::F32(s), HostData::F32(d)) => copy_pieces(s, d, pieces),
            (HostData::BF16(s), HostData::BF16(d)) => copy_pieces(s, d, pieces),
            (HostData::F16(s), HostData::F16(d)) => copy_pieces(s, d, pieces),
            (HostData::F32(s), HostData::BF16(d)) => convert_pieces(s, d, pieces),
            (HostData::F32(s), HostData::F16(d)) => convert_pieces(s, d, pieces),
            (HostData::BF16(s), HostData::F32(d)) => convert_pieces(s, d, pieces),
            (HostData::F16(s), HostData::F32(d)) => convert_pieces(s, d, pieces),
            (s, d) => Err(Error::DTypeMismatch {
                a: "copy source".into(),
                a_dtype: s.dtype().to_string(),
                b: "destination".into(),
                b_dtype: d.dtype().to_string(),
            }),
        }
    }

    fn add(&self, _lane: Lane, src: &HostData, dst: &mut HostData, pieces: &[Piece]) -> Result<()> {
        let dst = dst.as_mut_slice::<f32>()?;
        with_typed!(src, |s| add_pieces(s, dst, pieces))
    }

    fn merge(
        &self,
        o: &HostData,
        lse: &HostData,
        o_acc: &mut HostData,
        lse_acc: &mut HostData,
        spec: &MergeSpec,
    ) -> Result<()> {
        let (po, pl) = (o.as_slice::<f32>()?, lse.as_slice::<f32>()?);
        let (ao, al) = (o_acc.as_mut_slice::<f32>()?, lse_acc.as_mut_slice::<f32>()?);
        let d = spec.head_dim;
        for (sl, dl, so, dof) in spec.rows() {
            if sl >= pl.len() || dl >= al.len() || so + d > po.len() || dof + d > ao.len() {
                return Err(Error::InvalidPlan(format!("merge row ({sl}, {dl}, {so}, {dof}) outside its buffers")));
            }
            merge_row(&mut ao[dof..dof + d], &mut al[dl], &po[so..so + d], pl[sl]);
        }
        Ok(())
    }

    fn forward(
        &self,
        block: &Block,
        inputs: FwdInputs<'_, HostData>,
        opts: &AttnOptions,
        o: &mut HostData,
        lse: &mut HostData,
        rounded: Option<&mut HostData>,
    ) -> Result<()> {
        let (bo, bl) = match inputs.q.dtype() {
            DType::F32 => block_forward::<f32>(block, &inputs, opts)?,
            DType::BF16 => block_forward::<bf16>(block, &inputs, opts)?,
            DType::F16 => block_forward::<f16>(block, &inputs, opts)?,
        };
        block.shape.check_len("o", o.len(), bo.len())?;
        block.shape.check_len("lse", lse.len(), bl.len())?;
        if let Some(r) = rounded {
            block.shape.check_len("rounded o", r.len(), bo.len())?;
            *r = HostData::from_f32(&bo, r.dtype());
        }
        // O held in the input dtype: a final result, rounded once.
        *o = match o.dtype() {
            DType::F32 => HostData::F32(bo),
            narrow => HostData::from_f32(&bo, narrow),
        };
        *lse = HostData::F32(bl);
        Ok(())
    }

    fn backward(
        &self,
        block: &Block,
        inputs: BwdInputs<'_, HostData>,
        opts: &AttnOptions,
        grads: GradAccs<'_, HostData>,
    ) -> Result<()> {
        let g = match inputs.q.dtype() {
            DType::F32 => block_backward::<f32>(block, &inputs, opts)?,
            DType::BF16 => block_backward::<bf16>(block, &inputs, opts)?,
            DType::F16 => block_backward::<f16>(block, &inputs, opts)?,
        };
        for (name, acc, part) in [("dq", grads.dq, &g.dq), ("dk", grads.dk, &g.dk), ("dv", grads.dv, &g.dv)] {
            block.shape.check_len(name, acc.len(), part.len())?;
            match acc.dtype() {
                DType::F32 => {
                    for (a, x) in acc.as_mut_slice::<f32>()?.iter_mut().zip(part) {
                        *a += x;
                    }
                }
                // A final gradient held in the input dtype: rounded once.
                narrow => *acc = HostData::from_f32(part, narrow),
            }
        }
        Ok(())
    }

    fn row_delta(&self, o: &HostData, d_o: &HostData, rows: &AttnShape) -> Result<HostData> {
        if rows.q_len == 0 {
            // A rank whose layout holds no query rows (a shape of no rows is otherwise invalid).
            return Ok(HostData::F32(Vec::new()));
        }
        Ok(HostData::F32(with_typed!(o, |o| with_typed!(d_o, |g| crate::row_delta(o, g, rows)))?))
    }
}

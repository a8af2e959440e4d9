//! The CUDA backend of the plan interpreter: device buffers ([`GpuBuf`]), the compute and comm
//! lanes as two streams ordered by CUDA events, piece copies and merges by the auxiliary
//! kernels, and blocks by the attention kernels.

use crate::aux::{MergeDims, OLse, PieceList, PieceOp};
use crate::buffer::GpuBuf;
use crate::decode::decode_reads_pay;
use crate::device::CudaBackend;
use crate::{driver_err, CudaElement};
use cudarc::driver::{sys, CudaEvent};
use distattn_core::schedule::Lane;
use distattn_core::{AttnOptions, AttnShape, DType, Element, Error, Result};
use distattn_exec::{Backend, Block, BwdInputs, FwdInputs, GradAccs, MergeSpec, Piece};
use half::{bf16, f16};

fn f32_only(what: &str, bufs: &[&GpuBuf]) -> Result<()> {
    match bufs.iter().find(|b| b.dtype() != DType::F32) {
        Some(b) => Err(Error::DTypeMismatch {
            a: what.into(),
            a_dtype: b.dtype().to_string(),
            b: "expected".into(),
            b_dtype: "f32".into(),
        }),
        None => Ok(()),
    }
}

fn in_bounds(what: &str, pieces: &[Piece], src: &GpuBuf, dst: &GpuBuf) -> Result<()> {
    match pieces.iter().find(|p| !p.fits(src.len(), dst.len())) {
        Some(p) => Err(Error::InvalidPlan(format!(
            "{what} piece {p:?} outside buffers of {} and {} elements",
            src.len(),
            dst.len()
        ))),
        None => Ok(()),
    }
}

/// The widest unit (16, 8 or 4 bytes, else the element's) dividing both addresses and every
/// offset, length and stride of `pieces`, which count `elem`-byte elements. Units are powers of
/// two, so one divides every value exactly when it divides their bitwise OR.
fn copy_unit(elem: usize, src: u64, dst: u64, pieces: &[Piece]) -> usize {
    let fields = pieces.iter().flat_map(|p| [p.src, p.dst, p.len, p.src_stride, p.dst_stride]);
    let bytes = fields.fold(src | dst, |acc, x| acc | (x * elem) as u64);
    [16, 8, 4].into_iter().find(|&u| u > elem && bytes.is_multiple_of(u as u64)).unwrap_or(elem)
}

impl CudaBackend {
    /// Copies or adds `pieces` of `src` into `dst` on `lane`.
    pub(crate) fn run_pieces(&self, lane: Lane, src: &GpuBuf, dst: &GpuBuf, pieces: &[Piece], add: bool) -> Result<()> {
        if pieces.is_empty() {
            return Ok(());
        }
        let (op, aux_dtype) = match (add, src.dtype(), dst.dtype()) {
            (false, a, b) if a == b => (PieceOp::Copy { unit_bytes: a.size() }, a),
            (false, DType::F32, b) => (PieceOp::Narrow, b),
            (false, a, DType::F32) => (PieceOp::Widen, a),
            (true, a, DType::F32) => (PieceOp::Add { src: a }, a),
            (_, a, b) => {
                return Err(Error::DTypeMismatch {
                    a: "piece source".into(),
                    a_dtype: a.to_string(),
                    b: "destination".into(),
                    b_dtype: b.to_string(),
                })
            }
        };
        in_bounds(if add { "add" } else { "copy" }, pieces, src, dst)?;
        let s = self.lane(lane);
        let (src_ptr, dst_ptr) = (src.ptr(s), dst.ptr(s));
        // Copies move the widest unit that every address, offset, length and stride allows.
        let (op, unit) = match op {
            PieceOp::Copy { unit_bytes: elem } => {
                let unit = copy_unit(elem, src_ptr, dst_ptr, pieces);
                (PieceOp::Copy { unit_bytes: unit }, unit / elem)
            }
            // Conversions move two values at a time (a head dim is even).
            PieceOp::Narrow | PieceOp::Widen => {
                let odd =
                    pieces.iter().flat_map(|p| [p.src, p.dst, p.len, p.src_stride, p.dst_stride]).any(|x| x % 2 == 1);
                if odd {
                    return Err(Error::InvalidPlan("a converting copy has pieces of odd offset or length".into()));
                }
                (op, 2)
            }
            add => (add, 1),
        };
        let flat: Vec<i64> = pieces
            .iter()
            .flat_map(|p| [p.src / unit, p.dst / unit, p.len / unit, p.rows, p.src_stride / unit, p.dst_stride / unit])
            .map(|x| x as i64)
            .collect();
        let max_units = pieces.iter().map(|p| p.len * p.rows / unit).max().unwrap_or(0);
        let list = self.indices(lane, &flat)?;
        let aux = self.aux(aux_dtype)?;
        let piece_list = PieceList { ptr: self.index_ptr(lane, &list), len: pieces.len(), max_units };
        // SAFETY: the list holds the sextuples in `op`'s units, uploaded for this lane's stream
        // (`list` and the cache keep them; an evicted list is freed in that stream's order, after
        // the kernel); every piece lies within both buffers (checked above), the unit divides
        // both addresses (copy_unit), and the dtypes select `op`.
        unsafe { aux.pieces(s, op, src_ptr, dst_ptr, piece_list) }
    }

    /// Forward of one block into (O, LSE) buffers of the block's rows (O f32, or in the input
    /// dtype: a final result), and where given O rounded to the input dtype into `rounded` (a
    /// final output beside an f32 `o`): a decode-shaped block (a few rows, a run of keys each)
    /// by the split-KV decode kernel, any other by the flash kernels. With `merge`, the buffers
    /// hold an earlier f32 partial of these rows that the flash kernel merges into; `false`:
    /// this GPU's kernel does not, or the block is decode-shaped, and nothing ran.
    #[allow(clippy::too_many_arguments)] // the block, its inputs and its three outputs
    fn block_forward<T: CudaElement>(
        &self,
        block: &Block,
        inputs: &FwdInputs<'_, GpuBuf>,
        opts: &AttnOptions,
        o: &mut GpuBuf,
        lse: &mut GpuBuf,
        rounded: Option<&mut GpuBuf>,
        merge: bool,
    ) -> Result<bool> {
        let (shape, mask) = (&block.shape, &block.mask);
        if o.dtype() == T::DTYPE && (merge || rounded.is_some()) {
            return Err(Error::Internal("an O held in the input dtype is neither merged into nor rounded".into()));
        }
        if let Some(runs) = block.row_runs.as_ref().filter(|r| decode_reads_pay(r, shape.k_len)) {
            if merge {
                return Ok(false);
            }
            if self.decode_blocks(T::DTYPE, shape.head_dim).is_ok() {
                self.block_decode::<T>(block, runs, inputs.q, inputs.k, inputs.v, opts, o, lse)?;
                if let Some(r) = rounded {
                    self.copy(Lane::Compute, o, r, &[Piece::run(0, 0, shape.q_elems())])?;
                }
                return Ok(true);
            }
        }
        let (q, k, v) = (inputs.q.view::<T>()?, inputs.k.view::<T>()?, inputs.v.view::<T>()?);
        let mut lse = lse.view_mut::<f32>()?;
        if o.dtype() == T::DTYPE {
            return self
                .forward::<T>(&q, &k, &v, shape, mask, opts, &mut o.view_mut::<T>()?, &mut lse, None)
                .map(|_| true);
        }
        let o_f32 = self.checked_mut_ptr("o_f32", &mut o.view_mut::<f32>()?, shape.q_elems(), shape)?;
        let o_t = match rounded {
            Some(r) => self.checked_mut_ptr("rounded o", &mut r.view_mut::<T>()?, shape.q_elems(), shape)?,
            None => 0,
        };
        // The warp-specialized kernel writes the f32 O (and the rounded one where asked) or
        // merges into it; any kernel runs here when asked for the rounded O without a merge.
        if self.forward_into((&q, &k, &v), shape, mask, opts, (o_t, o_f32), &mut lse, merge)? {
            return Ok(true);
        }
        if merge {
            return Ok(false);
        }
        // The other kernels write O in the input dtype too: into a scratch buffer.
        let s = self.stream();
        let scratch = GpuBuf::alloc(s, T::DTYPE, shape.q_elems())?;
        let r = self.forward_into((&q, &k, &v), shape, mask, opts, (scratch.ptr(s), o_f32), &mut lse, false);
        scratch.free_on(s);
        r.map(|_| true)
    }

    /// [`Self::block_forward`] for the inputs' dtype.
    #[allow(clippy::too_many_arguments)] // as block_forward
    fn block_forward_of_dtype(
        &self,
        block: &Block,
        inputs: &FwdInputs<'_, GpuBuf>,
        opts: &AttnOptions,
        o: &mut GpuBuf,
        lse: &mut GpuBuf,
        rounded: Option<&mut GpuBuf>,
        merge: bool,
    ) -> Result<bool> {
        match inputs.q.dtype() {
            DType::BF16 => self.block_forward::<bf16>(block, inputs, opts, o, lse, rounded, merge),
            DType::F16 => self.block_forward::<f16>(block, inputs, opts, o, lse, rounded, merge),
            d => Err(cuda_dtype(d)),
        }
    }

    /// Backward of one block: with dQ, dK and dV all f32, the block's gradients are added into
    /// them (partials of a context-parallel backward); with all three in the input dtype, they
    /// are written (final).
    fn block_backward<T: CudaElement>(
        &self,
        block: &Block,
        i: &BwdInputs<'_, GpuBuf>,
        opts: &AttnOptions,
        g: GradAccs<'_, GpuBuf>,
    ) -> Result<()> {
        let (q, k, v, d_o) = (i.q.view::<T>()?, i.k.view::<T>()?, i.v.view::<T>()?, i.d_o.view::<T>()?);
        let (lse, delta, (shape, mask)) = (i.lse.view::<f32>()?, i.delta.view::<f32>()?, (&block.shape, &block.mask));
        let wide = [&*g.dq, &*g.dk, &*g.dv].map(|b| b.dtype() == DType::F32);
        if wide == [true; 3] {
            let (dq, dk, dv) =
                (&mut g.dq.view_mut::<f32>()?, &mut g.dk.view_mut::<f32>()?, &mut g.dv.view_mut::<f32>()?);
            return self.backward_block::<T>(&q, &k, &v, &d_o, &lse, &delta, shape, mask, opts, dq, dk, dv);
        }
        // Otherwise final gradients, all three in the input dtype.
        for (name, b) in [("dq", &*g.dq), ("dk", &*g.dk), ("dv", &*g.dv)] {
            if b.dtype() != T::DTYPE {
                return Err(Error::DTypeMismatch {
                    a: format!("a final {name}"),
                    a_dtype: b.dtype().to_string(),
                    b: "the inputs".into(),
                    b_dtype: T::DTYPE.to_string(),
                });
            }
        }
        let (dq, dk, dv) = (&mut g.dq.view_mut::<T>()?, &mut g.dk.view_mut::<T>()?, &mut g.dv.view_mut::<T>()?);
        self.backward_block_final::<T>(&q, &k, &v, &d_o, &lse, &delta, shape, mask, opts, dq, dk, dv)
    }
}

fn cuda_dtype(dtype: DType) -> Error {
    Error::UnsupportedDType(format!("{dtype} (the CUDA kernels take bf16 and f16)"))
}

impl Backend for CudaBackend {
    type Buf = GpuBuf;
    type CommBuf = GpuBuf;
    type Event = CudaEvent;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, lane: Lane, dtype: DType, elems: usize, fill: Option<f32>) -> Result<GpuBuf> {
        let s = self.lane(lane);
        match fill {
            Some(v) => GpuBuf::filled(s, dtype, elems, v),
            None => GpuBuf::alloc(s, dtype, elems),
        }
    }

    fn free(&self, lane: Lane, buf: GpuBuf) {
        buf.free_on(self.lane(lane));
    }

    fn upload<T: Element>(&self, data: &[T]) -> Result<GpuBuf> {
        GpuBuf::upload(self.stream(), data)
    }

    fn download_f32(&self, buf: &GpuBuf) -> Result<Vec<f32>> {
        buf.download_f32(self.stream())
    }

    fn view(&self, parent: &mut GpuBuf, offset: usize, elems: usize) -> Result<Option<GpuBuf>> {
        if offset.checked_add(elems).is_none_or(|end| end > parent.len()) {
            return Err(Error::Internal(format!(
                "a view of elements {offset}..+{elems} of a buffer of {}",
                parent.len()
            )));
        }
        let s = self.lane(Lane::Comm);
        let at = parent.ptr(s) + (offset * parent.dtype().size()) as u64;
        if !at.is_multiple_of(16) {
            // Lent buffers are 16-byte aligned (kernels read them in 16-byte chunks): the
            // interpreter copies this part instead.
            return Ok(None);
        }
        // SAFETY: elements offset..offset + elems lie inside `parent` (checked above), a live
        // allocation of this context, at a 16-byte aligned address (checked above); the view is
        // lent (dropping it frees nothing), and only a transfer uses it (a receive writes it, a
        // send reads it) before the plan frees it, while `parent` lives (Plan::validate).
        unsafe { GpuBuf::lent(s, parent.dtype(), at, elems) }.map(Some)
    }

    fn comm_view<'a>(&self, buf: &'a GpuBuf) -> &'a GpuBuf {
        buf
    }

    fn comm_view_mut<'a>(&self, buf: &'a mut GpuBuf) -> &'a mut GpuBuf {
        buf
    }

    fn record(&self, lane: Lane, timed: bool) -> Result<CudaEvent> {
        let flags = timed.then_some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        self.lane(lane).record_event(flags).map_err(driver_err("recording an event"))
    }

    fn wait(&self, lane: Lane, event: &CudaEvent) -> Result<()> {
        self.lane(lane).wait(event).map_err(driver_err("ordering the streams"))
    }

    fn is_done(&self, event: &CudaEvent) -> Result<bool> {
        event.try_is_complete().map_err(driver_err("waiting for the GPU"))
    }

    fn elapsed_ms(&self, start: &CudaEvent, end: &CudaEvent) -> Result<f64> {
        Ok(start.elapsed_ms(end).map_err(driver_err("reading event times"))? as f64)
    }

    fn copy(&self, lane: Lane, src: &GpuBuf, dst: &mut GpuBuf, pieces: &[Piece]) -> Result<()> {
        self.run_pieces(lane, src, dst, pieces, false)
    }

    fn add(&self, lane: Lane, src: &GpuBuf, dst: &mut GpuBuf, pieces: &[Piece]) -> Result<()> {
        self.run_pieces(lane, src, dst, pieces, true)
    }

    fn merge(
        &self,
        o: &GpuBuf,
        lse: &GpuBuf,
        o_acc: &mut GpuBuf,
        lse_acc: &mut GpuBuf,
        spec: &MergeSpec,
    ) -> Result<()> {
        if spec.row_count() == 0 {
            return Ok(());
        }
        f32_only("merged buffer", &[o, lse, o_acc, lse_acc])?;
        let (src_rows, dst_rows) =
            (spec.batch * spec.src_heads * spec.src_tokens, spec.batch * spec.dst_heads * spec.dst_tokens);
        if lse.len() < src_rows
            || lse_acc.len() < dst_rows
            || o.len() < src_rows * spec.head_dim
            || o_acc.len() < dst_rows * spec.head_dim
        {
            return Err(Error::InvalidPlan("a merge spec reaches beyond its buffers".into()));
        }
        let runs: Vec<i64> = spec.runs.iter().flatten().copied().collect();
        let list = self.indices(Lane::Compute, &runs)?;
        let dims = MergeDims {
            batch: spec.batch,
            heads: spec.heads,
            hs: spec.src_heads,
            hd: spec.dst_heads,
            hs0: spec.src_head0,
            hd0: spec.dst_head0,
            ns: spec.src_tokens,
            nd: spec.dst_tokens,
            head_dim: spec.head_dim,
            n_pieces: spec.runs.len(),
            total: spec.tokens,
        };
        let aux = self.aux(DType::F32)?;
        let s = self.stream();
        let (part, acc) = (OLse { o: o.ptr(s), lse: lse.ptr(s) }, OLse { o: o_acc.ptr(s), lse: lse_acc.ptr(s) });
        // SAFETY: the four buffers are f32 and cover the spec's rows (both checked above); the run
        // list was uploaded for the compute stream, where the merge runs (`list` and the cache
        // keep it; an evicted list is freed in that stream's order, after the kernel).
        unsafe { aux.merge(s, part, acc, &dims, self.index_ptr(Lane::Compute, &list)) }
    }

    fn forward(
        &self,
        block: &Block,
        inputs: FwdInputs<'_, GpuBuf>,
        opts: &AttnOptions,
        o: &mut GpuBuf,
        lse: &mut GpuBuf,
        rounded: Option<&mut GpuBuf>,
    ) -> Result<()> {
        self.block_forward_of_dtype(block, &inputs, opts, o, lse, rounded, false).map(|_| ())
    }

    fn forward_merging(
        &self,
        block: &Block,
        inputs: FwdInputs<'_, GpuBuf>,
        opts: &AttnOptions,
        o_acc: &mut GpuBuf,
        lse_acc: &mut GpuBuf,
        rounded: Option<&mut GpuBuf>,
    ) -> Result<bool> {
        self.block_forward_of_dtype(block, &inputs, opts, o_acc, lse_acc, rounded, true)
    }

    fn backward(
        &self,
        block: &Block,
        inputs: BwdInputs<'_, GpuBuf>,
        opts: &AttnOptions,
        grads: GradAccs<'_, GpuBuf>,
    ) -> Result<()> {
        match inputs.q.dtype() {
            DType::BF16 => self.block_backward::<bf16>(block, &inputs, opts, grads),
            DType::F16 => self.block_backward::<f16>(block, &inputs, opts, grads),
            d => Err(cuda_dtype(d)),
        }
    }

    fn row_delta(&self, o: &GpuBuf, d_o: &GpuBuf, rows: &AttnShape) -> Result<GpuBuf> {
        if rows.q_len == 0 {
            // A rank whose layout holds no query rows (a shape of no rows is otherwise invalid).
            return self.upload::<f32>(&[]);
        }
        rows.check_len("o", o.len(), rows.q_elems())?;
        rows.check_len("d_o", d_o.len(), rows.q_elems())?;
        let aux = self.aux(d_o.dtype())?;
        if aux.dtype() != d_o.dtype() {
            return Err(cuda_dtype(d_o.dtype()));
        }
        if o.dtype() != DType::F32 && o.dtype() != d_o.dtype() {
            return Err(Error::DTypeMismatch {
                a: "row delta's O".into(),
                a_dtype: o.dtype().to_string(),
                b: "dO".into(),
                b_dtype: d_o.dtype().to_string(),
            });
        }
        let s = self.stream();
        let delta = GpuBuf::alloc(s, DType::F32, rows.lse_elems())?;
        // SAFETY: O (f32 or dO's type) and dO (the module's type) hold q_elems() values and
        // delta, allocated above, lse_elems() f32 (all checked above); each is a whole CUDA
        // allocation or a lent one (16-byte aligned); all three are used on the compute stream,
        // where this runs.
        unsafe { aux.row_delta(s, o.ptr(s), o.dtype(), d_o.ptr(s), delta.ptr(s), rows) }?;
        Ok(delta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_move_the_widest_unit_every_offset_allows() {
        // bf16 head slices of d 128 rows: 256-byte rows, 16-byte units.
        let head_slice = [Piece::strided(256, 0, 256, 100, 1024, 256)];
        assert_eq!(copy_unit(2, 0, 4096, &head_slice), 16);
        // An address only 8-byte aligned caps the unit.
        assert_eq!(copy_unit(2, 8, 4096, &head_slice), 8);
        // An odd offset leaves the element itself.
        assert_eq!(copy_unit(2, 0, 0, &[Piece::run(3, 0, 64)]), 2);
        // f32 LSE rows of 6 elements: 8 bytes.
        assert_eq!(copy_unit(4, 0, 0, &[Piece::strided(0, 6, 6, 4, 12, 6)]), 8);
        assert_eq!(copy_unit(4, 0, 0, &[Piece::run(1, 0, 3)]), 4);
    }
}

//! One rank on one GPU: the CUDA kernels, an NCCL communicator, and two executors of plans —
//! the overlapped one ([`GpuRank::execute`]: compute and transfers on their own streams,
//! ordered by events per the [`schedule`](crate::schedule), with an optional per-step timeline)
//! and the generic one of `distattn-dist` through the [`Backend`] trait ([`GpuRank`] implements
//! it; transfers then block).

use crate::buf::{gpu_err, GpuBuf, GpuElem, MergeSpec};
use crate::nccl::NcclComm;
use crate::schedule::{schedule, Lane, Schedule};
use crate::timeline::{StepTimes, Timeline};
use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use distattn_core::plan::{sub_mask, BufDesc, Op, Plan, Tensor};
use distattn_core::{AttnOptions, AttnShape, DType, Element, Error, Mask, Result};
use distattn_cuda::aux::{AuxKernels, MergeDims, PieceOp};
use distattn_cuda::{CudaBackend, CudaElement};
use distattn_dist::backend::{Backend, MergeRow, Piece};
use distattn_dist::exec::{pieces, FailureKind, InjectedFailure};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One rank: a GPU, its kernels and its communicator.
pub struct GpuRank {
    pub be: CudaBackend,
    pub comm: NcclComm,
    /// The auxiliary kernels (piece copies and adds, merges, fills) by dtype, loaded on first use.
    aux: Mutex<HashMap<DType, Arc<AuxKernels>>>,
    /// Uploaded index lists, by content and stream.
    cache: Mutex<HashMap<(u64, usize), Arc<CudaSlice<i64>>>>,
}

/// Result of one overlapped run.
pub struct RunOutput {
    /// This rank's outputs in the order of its program's `outputs`.
    pub outputs: Vec<GpuBuf>,
    pub timeline: Option<Timeline>,
}

fn ev_err(e: cudarc::driver::DriverError) -> Error {
    gpu_err("events")(e)
}

/// A run of explicit merge rows: `len` rows from `first` on, whose source and accumulator LSE
/// indices step by 1 and O offsets by `o_steps` (source, accumulator; multiples of the head dim).
#[derive(Debug, Clone, PartialEq)]
struct RowRun {
    first: MergeRow,
    len: usize,
    o_steps: [usize; 2],
}

impl RowRun {
    /// The O steps with which row `r` continues this run, if it does.
    fn steps_to(&self, r: MergeRow, head_dim: usize) -> Option<[usize; 2]> {
        let (sl, dl, so, dof) = self.first;
        let n = self.len;
        if r.0 != sl + n || r.1 != dl + n || r.2 <= so || r.3 <= dof {
            return None;
        }
        let (ds, dd) = (r.2 - so, r.3 - dof);
        #[allow(clippy::manual_is_multiple_of)] // MSRV 1.80
        let steps = (ds % n == 0 && dd % n == 0).then_some([ds / n, dd / n])?;
        #[allow(clippy::manual_is_multiple_of)] // MSRV 1.80
        let fits = steps.iter().all(|&st| st % head_dim == 0) && (n == 1 || steps == self.o_steps);
        fits.then_some(steps)
    }
}

/// `rows` as maximal runs, in order (a run of one row steps by one O row).
fn row_runs(rows: &[MergeRow], head_dim: usize) -> Vec<RowRun> {
    let mut runs: Vec<RowRun> = Vec::new();
    for &r in rows {
        if let Some(run) = runs.last_mut() {
            if let Some(steps) = run.steps_to(r, head_dim) {
                run.o_steps = steps;
                run.len += 1;
                continue;
            }
        }
        runs.push(RowRun { first: r, len: 1, o_steps: [head_dim; 2] });
    }
    runs
}

/// Sets the device memory pool so that freed blocks are reused only when already free (no
/// hidden cross-stream waits) and memory is kept between runs.
pub fn tune_mem_pool(be: &CudaBackend) -> Result<()> {
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        sys::cuDeviceGetDefaultMemPool(&mut pool, be.context().cu_device()).result().map_err(gpu_err("memory pool"))?;
        let mut zero: i32 = 0;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            &mut zero as *mut i32 as *mut _,
        )
        .result()
        .map_err(gpu_err("memory pool"))?;
        let mut max: u64 = u64::MAX;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut max as *mut u64 as *mut _,
        )
        .result()
        .map_err(gpu_err("memory pool"))?;
    }
    Ok(())
}

/// Peak bytes in use in the device's memory pool since the last reset (and resets it).
pub fn pool_peak_bytes(be: &CudaBackend, reset: bool) -> Result<u64> {
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        sys::cuDeviceGetDefaultMemPool(&mut pool, be.context().cu_device()).result().map_err(gpu_err("memory pool"))?;
        let mut v: u64 = 0;
        sys::cuMemPoolGetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut v as *mut u64 as *mut _,
        )
        .result()
        .map_err(gpu_err("memory pool"))?;
        if reset {
            let mut z: u64 = 0;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut z as *mut u64 as *mut _,
            )
            .result()
            .map_err(gpu_err("memory pool"))?;
        }
        Ok(v)
    }
}

impl GpuRank {
    pub fn new(be: CudaBackend, comm: NcclComm) -> Result<GpuRank> {
        tune_mem_pool(&be)?;
        comm.set_producer(be.stream().clone());
        Ok(GpuRank { be, comm, aux: Mutex::new(HashMap::new()), cache: Mutex::new(HashMap::new()) })
    }

    /// The auxiliary kernels of `dtype` (bf16 or f16). Their f32 kernels are in the module of
    /// either: for `F32`, one already loaded (else bf16's).
    pub fn aux(&self, dtype: DType) -> Result<Arc<AuxKernels>> {
        let mut map = self.aux.lock().map_err(|_| Error::Comm("auxiliary kernels poisoned".into()))?;
        let dtype = match dtype {
            DType::F32 => map.keys().next().copied().unwrap_or(DType::BF16),
            d => d,
        };
        if let Some(a) = map.get(&dtype) {
            return Ok(a.clone());
        }
        let a = Arc::new(AuxKernels::load(self.be.context(), dtype)?);
        map.insert(dtype, a.clone());
        Ok(a)
    }

    pub fn rank(&self) -> usize {
        use distattn_core::Communicator;
        self.comm.rank()
    }

    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        self.be.stream()
    }

    fn stream(&self, lane: Lane) -> &Arc<CudaStream> {
        match lane {
            Lane::Compute => self.be.stream(),
            Lane::Comm => self.comm.stream(),
        }
    }

    /// An index list uploaded on `s` (cached by content).
    fn indices(&self, s: &Arc<CudaStream>, lane: usize, v: &[i64]) -> Result<Arc<CudaSlice<i64>>> {
        let bytes =
            distattn_core::comm::as_bytes(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u64, v.len()) });
        let key = (distattn_cuda::compile::fnv64(&[bytes]), lane);
        if let Some(x) = self.cache.lock().map_err(|_| Error::Comm("cache poisoned".into()))?.get(&key) {
            return Ok(x.clone());
        }
        let one = [0i64];
        let up = s.clone_htod(if v.is_empty() { &one[..] } else { v }).map_err(gpu_err("uploading indices"))?;
        let up = Arc::new(up);
        let mut c = self.cache.lock().map_err(|_| Error::Comm("cache poisoned".into()))?;
        if c.len() > 4096 {
            c.clear();
        }
        c.insert(key, up.clone());
        Ok(up)
    }

    fn run_pieces(&self, lane: Lane, src: &GpuBuf, dst: &GpuBuf, p: &[Piece], add: bool) -> Result<()> {
        if p.is_empty() {
            return Ok(());
        }
        let s = self.stream(lane);
        let (op, aux_dtype) = match (add, src.dtype(), dst.dtype()) {
            (false, a, b) if a == b => (PieceOp::Copy { elem_bytes: a.size() }, a),
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
        let flat: Vec<i64> = p.iter().flat_map(|&(a, b, n)| [a as i64, b as i64, n as i64]).collect();
        let max = p.iter().map(|x| x.2).max().unwrap_or(0);
        let dev = self.indices(s, lane.index(), &flat)?;
        let aux = self.aux(aux_dtype)?;
        let pieces = dev.device_ptr(s).0;
        // SAFETY: `pieces` holds the triples on `s`, and the executor's pieces lie within both
        // buffers, whose dtypes select `op`.
        unsafe { aux.pieces(s, op, src.ptr(s), dst.ptr(s), pieces, p.len(), max) }
    }

    /// Merges a partial (O, LSE) into accumulators by the `dims` spec (quads uploaded at
    /// `quads`), the four buffers' addresses offset by `base` elements (O, LSE, O acc, LSE acc).
    #[allow(clippy::too_many_arguments)]
    fn merge_spec(
        &self,
        o: &GpuBuf,
        lse: &GpuBuf,
        oacc: &GpuBuf,
        lacc: &GpuBuf,
        base: [usize; 4],
        dims: &MergeDims,
        quads: &CudaSlice<i64>,
    ) -> Result<()> {
        for b in [o, lse, oacc, lacc] {
            if b.dtype() != DType::F32 {
                return Err(Error::Backend { backend: "cuda", reason: "merge of non-f32 buffers".into() });
            }
        }
        let s = self.be.stream();
        let at = |b: &GpuBuf, i: usize| b.ptr(s) + (base[i] * 4) as u64;
        let aux = self.aux(DType::F32)?;
        let quads = quads.device_ptr(s).0;
        // SAFETY: the four buffers are f32 on `s` and cover the rows of `dims` from their bases
        // (the executor's specs and row runs lie within them); `quads` holds its pieces.
        unsafe { aux.merge(s, at(o, 0), at(lse, 1), at(oacc, 2), at(lacc, 3), dims, quads) }
    }

    fn run_merge(
        &self,
        o: &GpuBuf,
        lse: &GpuBuf,
        oacc: &GpuBuf,
        lacc: &GpuBuf,
        src: &BufDesc,
        dst: &BufDesc,
        shape: &AttnShape,
    ) -> Result<()> {
        let spec = MergeSpec::new(src, dst, shape);
        if spec.quads.is_empty() {
            return Ok(());
        }
        let dev = self.indices(self.be.stream(), 0, &spec.quads)?;
        self.merge_spec(o, lse, oacc, lacc, [0; 4], &spec.dims(), &dev)
    }

    /// Forward of one block into fresh f32 (O, LSE).
    fn block_fwd<T: CudaElement + GpuElem>(
        &self,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<(GpuBuf, GpuBuf)> {
        let s = self.be.stream();
        let mut of = GpuBuf::alloc(s, DType::F32, shape.q_elems())?;
        let mut l = GpuBuf::alloc(s, DType::F32, shape.lse_elems())?;
        self.block_fwd_into::<T>(q, k, v, shape, mask, opts, &mut of, &mut l)?;
        Ok((of, l))
    }

    /// Forward of one block written into f32 (O, LSE) buffers of the block's rows.
    #[allow(clippy::too_many_arguments)]
    fn block_fwd_into<T: CudaElement + GpuElem>(
        &self,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        of: &mut GpuBuf,
        l: &mut GpuBuf,
    ) -> Result<()> {
        let s = self.be.stream();
        let mut ot = GpuBuf::alloc(s, T::DTYPE, shape.q_elems())?;
        let r = self.be.forward::<T>(
            T::of(q)?,
            T::of(k)?,
            T::of(v)?,
            shape,
            mask,
            opts,
            T::of_mut(&mut ot)?,
            f32::of_mut(l)?,
            Some(f32::of_mut(of)?),
        );
        ot.free_on(s);
        r
    }

    /// Backward of one block: dQ added into `dq_acc` (f32, the block's query layout) and fresh
    /// dK, dV in the input dtype.
    #[allow(clippy::too_many_arguments)]
    fn block_bwd<T: CudaElement + GpuElem>(
        &self,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        d_o: &GpuBuf,
        lse: &GpuBuf,
        delta: &GpuBuf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
        dq_acc: &mut GpuBuf,
    ) -> Result<(GpuBuf, GpuBuf)> {
        let s = self.be.stream();
        let mut gk = GpuBuf::filled(s, T::DTYPE, shape.kv_elems(), 0.0)?;
        let mut gv = GpuBuf::filled(s, T::DTYPE, shape.kv_elems(), 0.0)?;
        self.be.backward_with_delta::<T>(
            T::of(q)?,
            T::of(k)?,
            T::of(v)?,
            T::of(d_o)?,
            f32::of(lse)?,
            f32::of(delta)?,
            shape,
            mask,
            opts,
            f32::of_mut(dq_acc)?,
            T::of_mut(&mut gk)?,
            T::of_mut(&mut gv)?,
        )?;
        Ok((gk, gv))
    }

    /// Runs this rank's program of `plan` with transfers overlapped with compute. `inputs` are
    /// this rank's shards (program order), on the compute stream. With `timeline`, per-step
    /// intervals are measured with events. Returns when the run has completed on the GPU.
    #[allow(clippy::too_many_arguments)]
    pub fn execute(
        &self,
        plan: &Plan,
        sched: Option<&Schedule>,
        mask: &Mask,
        opts: &AttnOptions,
        inputs: Vec<GpuBuf>,
        timeline: bool,
        fail: Option<InjectedFailure>,
    ) -> Result<RunOutput> {
        // The whole run is under the stall clock, restarted by every block computed (the final
        // wait polls their events): a rank stuck anywhere is aborted, a long healthy run is not.
        let began = self.comm.busy_begin();
        let r = match plan.dtype {
            DType::BF16 => self.execute_t::<bf16>(plan, sched, mask, opts, inputs, timeline, fail),
            DType::F16 => self.execute_t::<f16>(plan, sched, mask, opts, inputs, timeline, fail),
            d => Err(Error::UnsupportedDType(format!("{d} (the GPU executor takes bf16 and f16)"))),
        };
        if began {
            self.comm.busy_end();
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn execute_t<T: CudaElement + GpuElem>(
        &self,
        plan: &Plan,
        sched: Option<&Schedule>,
        mask: &Mask,
        opts: &AttnOptions,
        inputs: Vec<GpuBuf>,
        timeline: bool,
        fail: Option<InjectedFailure>,
    ) -> Result<RunOutput> {
        let rank = self.rank();
        let prog = plan.ranks.get(rank).ok_or_else(|| Error::Comm(format!("plan has no rank {rank}")))?;
        if inputs.len() != prog.inputs.len() {
            return Err(Error::Comm(format!(
                "rank {rank}: {} inputs given, plan needs {}",
                inputs.len(),
                prog.inputs.len()
            )));
        }
        let own;
        let sched = match sched {
            Some(s) => s,
            None => {
                own = schedule(prog);
                &own
            }
        };
        let shape = plan.shape;
        let (sc, sm) = (self.be.stream().clone(), self.comm.stream().clone());
        self.be.context().bind_to_thread().map_err(gpu_err("binding the context"))?;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let t_start = if timeline { Some(sc.record_event(timing).map_err(ev_err)?) } else { None };
        // Inputs were written on the compute stream.
        sm.wait(&sc.record_event(None).map_err(ev_err)?).map_err(ev_err)?;

        let mut store: Vec<Option<GpuBuf>> = (0..prog.bufs.len()).map(|_| None).collect();
        for ((_, id), b) in prog.inputs.iter().zip(inputs) {
            store[*id] = Some(b);
        }
        let desc = |b: usize| &prog.bufs[b];
        let dtype = |b: usize| desc(b).tensor.dtype(plan.dtype);
        let missing = |b: usize| {
            Error::Comm(format!("rank {rank}: buffer {b} used before it was allocated or after it was freed"))
        };
        let mut events: Vec<Option<CudaEvent>> = (0..sched.ops.len()).map(|_| None).collect();
        // Buffers holding only their fill (allocated, not yet written): a forward block into a
        // fresh (O, LSE) accumulator of its own rows writes it directly instead of merging.
        let mut fresh = vec![false; prog.bufs.len()];
        // Timeline events per step: compute [first start, last end], and each transfer's own
        // (start, end): a step's transfers can lie far apart (the backward ring returns a
        // gradient partial only after the next step's compute), so no span stands for them.
        let nsteps = prog.steps.len();
        let mut tl: Vec<[Option<CudaEvent>; 2]> = (0..nsteps).map(|_| Default::default()).collect();
        let mut transfers: Vec<Vec<(CudaEvent, CudaEvent)>> = (0..nsteps).map(|_| Vec::new()).collect();
        let flat: Vec<&Op> = prog.steps.iter().flatten().collect();
        let mut progress: Vec<CudaEvent> = Vec::new();
        for so in sched.issue.iter().map(|&i| &sched.ops[i]) {
            if let Some(f) = fail.filter(|f| f.rank == rank && f.step == so.step) {
                match f.kind {
                    FailureKind::Error => {
                        return Err(Error::Backend {
                            backend: "test",
                            reason: format!("injected failure at step {}", so.step),
                        })
                    }
                    FailureKind::Panic => panic!("injected panic at step {}", so.step),
                }
            }
            let op = flat[so.id];
            let s = self.stream(so.lane).clone();
            if let Some(w) = so.wait {
                let ev = events[w].as_ref().ok_or_else(|| Error::Comm("schedule waits for an unrecorded op".into()))?;
                s.wait(ev).map_err(ev_err)?;
            }
            let timed = timeline
                && matches!(
                    (op, so.lane),
                    (Op::Comm { .. }, Lane::Comm)
                        | (
                            Op::Fwd { .. } | Op::Bwd { .. } | Op::Merge { .. } | Op::Add { .. } | Op::Copy { .. },
                            Lane::Compute
                        )
                );
            let mut transfer_start = None;
            if timed && so.lane == Lane::Comm {
                transfer_start = Some(s.record_event(timing).map_err(ev_err)?);
            } else if timed && tl[so.step][0].is_none() {
                tl[so.step][0] = Some(s.record_event(timing).map_err(ev_err)?);
            }
            match op {
                Op::Alloc { buf, fill } => {
                    store[*buf] = Some(GpuBuf::filled(&s, dtype(*buf), desc(*buf).elems(&shape), fill.value())?);
                }
                Op::Free { buf } => {
                    if let Some(b) = store[*buf].take() {
                        b.free_on(&s);
                    }
                }
                Op::Comm { sends, recvs, .. } => {
                    let mut got = Vec::with_capacity(recvs.len());
                    for &(_, b) in recvs {
                        got.push(GpuBuf::alloc(&s, dtype(b), desc(b).elems(&shape))?);
                    }
                    let sv = sends
                        .iter()
                        .map(|&(to, b)| Ok((to, store[b].as_ref().ok_or_else(|| missing(b))?)))
                        .collect::<Result<Vec<_>>>()?;
                    let rv: Vec<(usize, &GpuBuf)> = recvs.iter().zip(&got).map(|(&(from, _), g)| (from, g)).collect();
                    self.comm.group_async(&sv, &rv)?;
                    for (&(_, b), g) in recvs.iter().zip(got) {
                        store[b] = Some(g);
                    }
                }
                Op::Copy { src, dst } | Op::Add { src, dst } => {
                    let p = pieces(desc(*src), desc(*dst), &shape);
                    let (a, b) = (
                        store[*src].as_ref().ok_or_else(|| missing(*src))?,
                        store[*dst].as_ref().ok_or_else(|| missing(*dst))?,
                    );
                    self.run_pieces(so.lane, a, b, &p, matches!(op, Op::Add { .. }))?;
                }
                Op::Merge { o, lse, o_acc, lse_acc } => {
                    let g = |b: usize| store[b].as_ref().ok_or_else(|| missing(b));
                    self.run_merge(g(*o)?, g(*lse)?, g(*o_acc)?, g(*lse_acc)?, desc(*o), desc(*o_acc), &shape)?;
                }
                Op::Fwd { q, k, v, o, lse, .. } => {
                    let (qd, kd) = (desc(*q), desc(*k));
                    let bshape = BufDesc::block_shape(qd, kd, &shape);
                    let m = sub_mask(mask, &qd.tokens, &kd.tokens)?;
                    let own_rows = |b: usize| desc(b).tokens == qd.tokens && desc(b).heads == qd.heads;
                    if fresh[*o] && fresh[*lse] && own_rows(*o) && own_rows(*lse) {
                        let (mut ob, mut lb) = (
                            store[*o].take().ok_or_else(|| missing(*o))?,
                            store[*lse].take().ok_or_else(|| missing(*lse))?,
                        );
                        let g = |b: usize| store[b].as_ref().ok_or_else(|| missing(b));
                        let r = match (g(*q), g(*k), g(*v)) {
                            (Ok(a), Ok(b), Ok(c)) => {
                                self.block_fwd_into::<T>(a, b, c, &bshape, &m, opts, &mut ob, &mut lb)
                            }
                            _ => Err(Error::Comm(format!("rank {rank}: a forward input is missing"))),
                        };
                        store[*o] = Some(ob);
                        store[*lse] = Some(lb);
                        r?;
                    } else {
                        let g = |b: usize| store[b].as_ref().ok_or_else(|| missing(b));
                        let (po, pl) = self.block_fwd::<T>(g(*q)?, g(*k)?, g(*v)?, &bshape, &m, opts)?;
                        let part = BufDesc::new(Tensor::O, qd.tokens.clone(), qd.heads.clone());
                        self.run_merge(&po, &pl, g(*o)?, g(*lse)?, &part, desc(*o), &shape)?;
                        po.free_on(&sc);
                        pl.free_on(&sc);
                    }
                }
                Op::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, .. } => {
                    let (qd, kd) = (desc(*q), desc(*k));
                    let bshape = BufDesc::block_shape(qd, kd, &shape);
                    let m = sub_mask(mask, &qd.tokens, &kd.tokens)?;
                    let same_q = desc(*dq).tokens == qd.tokens && desc(*dq).heads == qd.heads;
                    let mut acc = if same_q {
                        store[*dq].take().ok_or_else(|| missing(*dq))?
                    } else {
                        GpuBuf::filled(&sc, DType::F32, bshape.q_elems(), 0.0)?
                    };
                    let r = {
                        let g = |b: usize| store[b].as_ref().ok_or_else(|| missing(b));
                        match (g(*q), g(*k), g(*v), g(*d_o), g(*lse), g(*delta)) {
                            (Ok(a), Ok(b), Ok(c), Ok(d), Ok(e), Ok(f)) => {
                                self.block_bwd::<T>(a, b, c, d, e, f, &bshape, &m, opts, &mut acc)
                            }
                            _ => Err(Error::Comm(format!("rank {rank}: a backward input is missing"))),
                        }
                    };
                    let (gk, gv) = match r {
                        Ok(x) => x,
                        Err(e) => {
                            if same_q {
                                store[*dq] = Some(acc);
                            }
                            return Err(e);
                        }
                    };
                    if same_q {
                        store[*dq] = Some(acc);
                    } else {
                        let part = BufDesc::new(Tensor::DQ, qd.tokens.clone(), qd.heads.clone());
                        let p = pieces(&part, desc(*dq), &shape);
                        self.run_pieces(
                            Lane::Compute,
                            &acc,
                            store[*dq].as_ref().ok_or_else(|| missing(*dq))?,
                            &p,
                            true,
                        )?;
                        acc.free_on(&sc);
                    }
                    for (g, acc_id, t) in [(gk, *dk, Tensor::DK), (gv, *dv, Tensor::DV)] {
                        let part = BufDesc::new(t, kd.tokens.clone(), kd.heads.clone());
                        let p = pieces(&part, desc(acc_id), &shape);
                        self.run_pieces(
                            Lane::Compute,
                            &g,
                            store[acc_id].as_ref().ok_or_else(|| missing(acc_id))?,
                            &p,
                            true,
                        )?;
                        g.free_on(&sc);
                    }
                }
            }
            // Any other use may have written it (conservative: reads count too).
            for b in op.uses() {
                fresh[b] = matches!(op, Op::Alloc { .. });
            }
            if timed {
                let end = s.record_event(timing).map_err(ev_err)?;
                match transfer_start {
                    Some(start) => transfers[so.step].push((start, end)),
                    None => tl[so.step][1] = Some(end),
                }
            }
            if matches!(op, Op::Fwd { .. } | Op::Bwd { .. }) {
                progress.push(s.record_event(None).map_err(ev_err)?);
            }
            if so.signals {
                events[so.id] = Some(s.record_event(None).map_err(ev_err)?);
            }
        }
        // Join the comm stream into compute and wait for the end, polling for failures.
        sc.wait(&sm.record_event(None).map_err(ev_err)?).map_err(ev_err)?;
        let end = sc.record_event(if timeline { timing } else { None }).map_err(ev_err)?;
        self.comm.wait_event_progress(&end, &progress)?;
        let timeline = match t_start {
            Some(t0) => {
                let ms = |e: &CudaEvent| -> Result<f64> { Ok(t0.elapsed_ms(e).map_err(ev_err)? as f64) };
                let mut steps = Vec::new();
                for (t, (c, tr)) in tl.iter().zip(&transfers).enumerate() {
                    let compute = match c {
                        [Some(a), Some(b)] => Some((ms(a)?, ms(b)?)),
                        _ => None,
                    };
                    let tr = tr.iter().map(|(a, b)| Ok((ms(a)?, ms(b)?))).collect::<Result<Vec<_>>>()?;
                    steps.push(StepTimes::new(t, compute, tr));
                }
                Some(Timeline { rank, total_ms: t0.elapsed_ms(&end).map_err(ev_err)? as f64, steps })
            }
            None => None,
        };
        let outputs =
            prog.outputs.iter().map(|&(_, b)| store[b].take().ok_or_else(|| missing(b))).collect::<Result<Vec<_>>>()?;
        // Remaining buffers (inputs) are freed on the compute stream when dropped.
        Ok(RunOutput { outputs, timeline })
    }
}

/// The generic executor's view: every op on the compute stream, transfers blocking.
impl Backend for GpuRank {
    type Buf = GpuBuf;
    type CommBuf = GpuBuf;

    fn name(&self) -> &'static str {
        "cuda+nccl"
    }

    fn upload<T: Element>(&self, data: &[T]) -> Result<GpuBuf> {
        GpuBuf::upload(self.be.stream(), data)
    }

    fn alloc(&self, dtype: DType, elems: usize, fill: f32) -> Result<GpuBuf> {
        GpuBuf::filled(self.be.stream(), dtype, elems, fill)
    }

    fn download_f32(&self, buf: &GpuBuf) -> Result<Vec<f32>> {
        buf.download_f32(self.be.stream())
    }

    fn comm_view<'a>(&self, buf: &'a GpuBuf) -> &'a GpuBuf {
        buf
    }

    fn comm_view_mut<'a>(&self, buf: &'a mut GpuBuf) -> &'a mut GpuBuf {
        buf
    }

    fn copy(&self, src: &GpuBuf, dst: &mut GpuBuf, p: &[Piece]) -> Result<()> {
        self.run_pieces(Lane::Compute, src, dst, p, false)
    }

    fn add(&self, src: &GpuBuf, dst: &mut GpuBuf, p: &[Piece]) -> Result<()> {
        self.run_pieces(Lane::Compute, src, dst, p, true)
    }

    fn merge(
        &self,
        o: &GpuBuf,
        lse: &GpuBuf,
        o_acc: &mut GpuBuf,
        lse_acc: &mut GpuBuf,
        rows: &[MergeRow],
        head_dim: usize,
    ) -> Result<()> {
        // Explicit rows, merged a run at a time: a run is one piece of one head at the run's
        // first row (LSE indices step by 1, O offsets by a head stride on each side).
        for run in row_runs(rows, head_dim) {
            let dims = MergeDims {
                batch: 1,
                heads: 1,
                hs: run.o_steps[0] / head_dim,
                hd: run.o_steps[1] / head_dim,
                hs0: 0,
                hd0: 0,
                ns: run.len,
                nd: run.len,
                head_dim,
                n_pieces: 1,
                total: run.len,
            };
            let quads = self.indices(self.be.stream(), 0, &[0, 0, run.len as i64, 0])?;
            let (sl, dl, so, dof) = run.first;
            self.merge_spec(o, lse, o_acc, lse_acc, [so, sl, dof, dl], &dims, &quads)?;
        }
        Ok(())
    }

    fn forward(
        &self,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<(GpuBuf, GpuBuf)> {
        match q.dtype() {
            DType::BF16 => self.block_fwd::<bf16>(q, k, v, shape, mask, opts),
            DType::F16 => self.block_fwd::<f16>(q, k, v, shape, mask, opts),
            d => Err(Error::UnsupportedDType(d.to_string())),
        }
    }

    fn backward(
        &self,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        d_o: &GpuBuf,
        lse: &GpuBuf,
        delta: &GpuBuf,
        shape: &AttnShape,
        mask: &Mask,
        opts: &AttnOptions,
    ) -> Result<(GpuBuf, GpuBuf, GpuBuf)> {
        let s = self.be.stream();
        let mut dq = GpuBuf::filled(s, DType::F32, shape.q_elems(), 0.0)?;
        let (gk, gv) = match q.dtype() {
            DType::BF16 => self.block_bwd::<bf16>(q, k, v, d_o, lse, delta, shape, mask, opts, &mut dq)?,
            DType::F16 => self.block_bwd::<f16>(q, k, v, d_o, lse, delta, shape, mask, opts, &mut dq)?,
            d => return Err(Error::UnsupportedDType(d.to_string())),
        };
        let whole = [(0usize, 0usize, shape.kv_elems())];
        let dk = GpuBuf::filled(s, DType::F32, shape.kv_elems(), 0.0)?;
        let dv = GpuBuf::filled(s, DType::F32, shape.kv_elems(), 0.0)?;
        self.run_pieces(Lane::Compute, &gk, &dk, &whole, true)?;
        self.run_pieces(Lane::Compute, &gv, &dv, &whole, true)?;
        Ok((dq, dk, dv))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distattn_core::plan::TokenSet;

    /// The rows a list of runs stands for.
    fn rows_of(runs: &[RowRun]) -> Vec<MergeRow> {
        let mut out = Vec::new();
        for run in runs {
            let (sl, dl, so, dof) = run.first;
            for t in 0..run.len {
                out.push((sl + t, dl + t, so + t * run.o_steps[0], dof + t * run.o_steps[1]));
            }
        }
        out
    }

    #[test]
    fn row_runs_cover_the_executor_rows() {
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
            let rows = distattn_dist::exec::merge_rows(&src, &dst, &shape);
            let runs = row_runs(&rows, shape.head_dim);
            assert_eq!(rows_of(&runs), rows, "{src:?} -> {dst:?}");
            // One run per (batch, head, token piece).
            let pieces = src.tokens.pieces_into(&dst.tokens).len();
            let heads = src.heads.end.min(dst.heads.end) - src.heads.start.max(dst.heads.start);
            assert_eq!(runs.len(), shape.batch * heads * pieces, "{src:?} -> {dst:?}");
        }
        // Rows that follow no pattern stay rows of their own.
        let odd = [(5, 1, 80, 16), (9, 2, 96, 48), (6, 3, 32, 0)];
        let runs = row_runs(&odd, 16);
        assert_eq!(runs.len(), 3);
        assert_eq!(rows_of(&runs), odd);
    }
}

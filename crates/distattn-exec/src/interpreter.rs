//! The one interpreter of plans: runs a [`PreparedRank`] on any [`Backend`] and
//! [`Communicator`], following its schedule — ops issued in the schedule's order onto the
//! compute and comm lanes, each waiting for the event of the op of the other lane it depends
//! on — and, when asked, timing every step.
//!
//! CPU thread ranks and NCCL GPU ranks both run through [`execute`]; it knows nothing about
//! strategies (everything comes from the prepared program) or devices (everything goes through
//! the backend).

use crate::backend::{Backend, BwdInputs, FwdInputs, GradAccs};
use crate::comm::Communicator;
use crate::pieces::Piece;
use crate::prepare::{FwdOutput, GradOutput, PreparedOp, PreparedRank};
use distattn_core::plan::{BufId, Tensor};
use distattn_core::schedule::Lane;
use distattn_core::timeline::{StepTimes, Timeline};
use distattn_core::{AttnOptions, DType, Error, Result};
use std::time::Duration;

/// How a test makes a rank fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The rank returns an error.
    Error,
    /// The rank panics (the runners turn it into an error naming the rank).
    Panic,
    /// The rank stops making progress without failing, as one stuck computing: it never sends
    /// again and, like the interpreter between two blocks, only checks whether the group has
    /// failed (which its waiting peers declare once their timeout passes).
    Hang,
}

/// A test hook: make `rank` fail when it reaches `step` (the last step of a plan with fewer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectedFailure {
    pub rank: usize,
    pub step: usize,
    pub kind: FailureKind,
}

/// Options of one execution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// Record the per-step timeline (compute span and each transfer).
    pub timeline: bool,
    /// Test hook: make a rank fail.
    pub fail: Option<InjectedFailure>,
    /// Runs of the program back to back on the same inputs, waited for once at the end, as a
    /// model's layers run one after another without the host waiting between them (a
    /// sustained timing: total time over runs); the last run's outputs and timeline are
    /// returned. 0 means 1. A buffer one lane frees after the other lane used it is reused
    /// only once the device has passed the free, so the runs' such buffers can all be held at
    /// once: meant for steps whose buffers are small (a decode step), not for prefill.
    pub runs: usize,
}

/// What one execution returns.
pub struct RankRun<Buf> {
    /// The outputs, in the order of the program's `outputs`.
    pub outputs: Vec<Buf>,
    /// What a forward keeps for its backward, in the order of the program's `saved`.
    pub saved: Vec<Buf>,
    pub timeline: Option<Timeline>,
}

/// The buffers of a running program, by id.
struct Store<Buf> {
    rank: usize,
    bufs: Vec<Option<Buf>>,
}

impl<Buf> Store<Buf> {
    fn missing(&self, b: BufId) -> Error {
        Error::InvalidPlan(format!("rank {}: buffer {b} used before it was allocated or after it was freed", self.rank))
    }

    fn get(&self, b: BufId) -> Result<&Buf> {
        self.bufs[b].as_ref().ok_or_else(|| self.missing(b))
    }

    /// A forward block's inputs.
    fn fwd_inputs(&self, q: BufId, k: BufId, v: BufId) -> Result<FwdInputs<'_, Buf>> {
        Ok(FwdInputs { q: self.get(q)?, k: self.get(k)?, v: self.get(v)? })
    }

    fn take(&mut self, b: BufId) -> Result<Buf> {
        self.bufs[b].take().ok_or_else(|| self.missing(b))
    }

    fn put(&mut self, b: BufId, buf: Buf) {
        self.bufs[b] = Some(buf);
    }

    /// Runs `f` on buffer `dst` (taken out for the call, so other buffers can be read) and puts
    /// it back, also when `f` fails.
    fn with_mut<R>(&mut self, dst: BufId, f: impl FnOnce(&Self, &mut Buf) -> Result<R>) -> Result<R> {
        let mut d = self.take(dst)?;
        let r = f(self, &mut d);
        self.put(dst, d);
        r
    }

    /// Like [`Store::with_mut`] for two buffers.
    fn with_mut2<R>(
        &mut self,
        a: BufId,
        b: BufId,
        f: impl FnOnce(&Self, &mut Buf, &mut Buf) -> Result<R>,
    ) -> Result<R> {
        let mut x = self.take(a)?;
        let mut y = match self.take(b) {
            Ok(y) => y,
            Err(e) => {
                self.put(a, x);
                return Err(e);
            }
        };
        let r = f(self, &mut x, &mut y);
        self.put(a, x);
        self.put(b, y);
        r
    }
}

/// Runs `prog` on `backend` and `comm`. `inputs` are this rank's shards in the order of
/// `prog.inputs`, written on the compute lane. Returns when the run has completed on the
/// device, or with the first failure of this rank, a peer or the transport.
pub fn execute<B, C>(
    prog: &PreparedRank,
    backend: &B,
    comm: &C,
    opts: &AttnOptions,
    inputs: Vec<B::Buf>,
    ctl: &ExecOptions,
) -> Result<RankRun<B::Buf>>
where
    B: Backend,
    C: Communicator<Buf = B::CommBuf>,
{
    let watching = begin_run(prog, comm, inputs.len())?;
    let r = (|| {
        // Blocks issued, in issue order, and how many of them have completed.
        let (mut progress, mut done) = (Vec::new(), 0);
        let mut inputs = inputs;
        let untimed = ExecOptions { timeline: false, ..*ctl };
        for _ in 1..ctl.runs.max(1) {
            let mut issued = issue(prog, backend, comm, opts, inputs, &untimed, &mut progress, &mut done)?;
            // The next run is issued on the same lanes after this one's end, so it reads the
            // inputs after this run has; the rest is freed on the compute lane, which the end
            // orders after both lanes' last use.
            inputs = prog.inputs.iter().map(|&(_, id)| issued.store.take(id)).collect::<Result<_>>()?;
            for buf in issued.store.bufs.into_iter().flatten() {
                backend.free(Lane::Compute, buf);
            }
        }
        let mut issued = issue(prog, backend, comm, opts, inputs, ctl, &mut progress, &mut done)?;
        wait_done(backend, comm, &issued.end, &progress, done)?;
        let timeline = issued.timeline(backend, prog.rank)?;
        // What is left in the store (the inputs) is released when it drops.
        issued.hand_back(prog, timeline)
    })();
    if watching {
        comm.stall_watch_end();
    }
    r
}

/// A run issued onto the lanes whose completion the caller takes over ([`execute_deferred`]):
/// its end, its blocks' completion events and whether it started the stall clock.
pub struct Completion<Event> {
    pub end: Event,
    pub progress: Vec<Event>,
    /// Blocks of `progress` already seen complete.
    pub done: usize,
    /// The run started the communicator's stall clock (its completion stops it).
    pub watching: bool,
}

impl<Event> Completion<Event> {
    /// Waits until the run has completed on the device, polling the transport for failures as
    /// [`execute`] does.
    pub fn wait<B, C>(self, backend: &B, comm: &C) -> Result<()>
    where
        B: Backend<Event = Event>,
        C: Communicator,
    {
        let r = wait_done(backend, comm, &self.end, &self.progress, self.done);
        if self.watching {
            comm.stall_watch_end();
        }
        r
    }
}

/// What [`execute_deferred`] returns: the run's outputs, and its completion to take over.
pub type Deferred<B> = (RankRun<<B as Backend>::Buf>, Completion<<B as Backend>::Event>);

/// Like [`execute`] with one run and no timeline, but returns once the run is issued: the
/// outputs are valid in the compute lane's order, and the caller owns the [`Completion`] (wait
/// for it, or hand it to a transport that watches it, before the next run reports this one's
/// failures). Buffers the run frees are released in stream order.
pub fn execute_deferred<B, C>(
    prog: &PreparedRank,
    backend: &B,
    comm: &C,
    opts: &AttnOptions,
    inputs: Vec<B::Buf>,
) -> Result<Deferred<B>>
where
    B: Backend,
    C: Communicator<Buf = B::CommBuf>,
{
    let watching = begin_run(prog, comm, inputs.len())?;
    let r = (|| {
        let (mut progress, mut done) = (Vec::new(), 0);
        let mut issued = issue(prog, backend, comm, opts, inputs, &ExecOptions::default(), &mut progress, &mut done)?;
        let run = issued.hand_back(prog, None)?;
        Ok((run, Completion { end: issued.end, progress, done, watching }))
    })();
    if r.is_err() && watching {
        comm.stall_watch_end();
    }
    r
}

/// Checks the program against the transport and its inputs, completes a run handed back
/// earlier (its failures are reported here) and starts the stall clock: the whole run is under
/// it, restarted by every block completed, so a rank stuck anywhere is aborted and a long
/// healthy run is not. Whether this run started the clock (and so stops it).
fn begin_run<C: Communicator>(prog: &PreparedRank, comm: &C, inputs: usize) -> Result<bool> {
    check_program(prog, comm, inputs)?;
    comm.settle()?;
    Ok(comm.stall_watch_begin())
}

/// The program is this rank's and gets as many inputs as it takes.
fn check_program<C: Communicator>(prog: &PreparedRank, comm: &C, inputs: usize) -> Result<()> {
    if comm.rank() != prog.rank || comm.world() != prog.world {
        return Err(Error::InvalidPlan(format!(
            "the program of rank {} of {} run as rank {} of {}",
            prog.rank,
            prog.world,
            comm.rank(),
            comm.world()
        )));
    }
    if inputs != prog.inputs.len() {
        return Err(Error::invalid(
            "inputs",
            format!("rank {}: {} given, the program takes {}", prog.rank, inputs, prog.inputs.len()),
        ));
    }
    Ok(())
}

/// One run of a program issued onto the lanes, not yet waited for.
struct Issued<B: Backend> {
    store: Store<B::Buf>,
    /// Recorded on the compute lane after both lanes' last op.
    end: B::Event,
    /// With a timeline: the run's start, each step's compute span and transfers.
    t_start: Option<B::Event>,
    compute_span: Vec<[Option<B::Event>; 2]>,
    transfers: Vec<Vec<(B::Event, B::Event)>>,
}

impl<B: Backend> Issued<B> {
    /// The run's outputs and saved buffers, taken out of the store, with `timeline`.
    fn hand_back(&mut self, prog: &PreparedRank, timeline: Option<Timeline>) -> Result<RankRun<B::Buf>> {
        let mut take = |list: &[(Tensor, BufId)]| list.iter().map(|&(_, b)| self.store.take(b)).collect::<Result<_>>();
        Ok(RankRun { outputs: take(&prog.outputs)?, saved: take(&prog.saved)?, timeline })
    }

    /// The run's timeline (once it has completed), if one was recorded.
    fn timeline(&self, backend: &B, rank: usize) -> Result<Option<Timeline>> {
        let Some(t0) = &self.t_start else { return Ok(None) };
        let ms = |e: &B::Event| backend.elapsed_ms(t0, e);
        let mut steps = Vec::with_capacity(self.compute_span.len());
        for (t, (span, tr)) in self.compute_span.iter().zip(&self.transfers).enumerate() {
            let compute = match span {
                [Some(a), Some(b)] => Some((ms(a)?, ms(b)?)),
                _ => None,
            };
            let tr = tr.iter().map(|(a, b)| Ok((ms(a)?, ms(b)?))).collect::<Result<Vec<_>>>()?;
            steps.push(StepTimes::new(t, compute, tr));
        }
        Ok(Some(Timeline { rank, total_ms: ms(&self.end)?, steps }))
    }
}

/// Issues every op of `prog` in the schedule's order; each block's completion event goes to
/// `progress` (those already done, all of them on the CPU, advance `done` as they issue).
#[allow(clippy::too_many_arguments)]
fn issue<B, C>(
    prog: &PreparedRank,
    backend: &B,
    comm: &C,
    opts: &AttnOptions,
    inputs: Vec<B::Buf>,
    ctl: &ExecOptions,
    progress: &mut Vec<B::Event>,
    done: &mut usize,
) -> Result<Issued<B>>
where
    B: Backend,
    C: Communicator<Buf = B::CommBuf>,
{
    let sched = &prog.schedule;
    let timed = ctl.timeline;
    let t_start = if timed { Some(backend.record(Lane::Compute, true)?) } else { None };
    // Inputs were written on the compute lane.
    backend.wait(Lane::Comm, &backend.record(Lane::Compute, false)?)?;

    let mut store = Store { rank: prog.rank, bufs: (0..prog.bufs.len()).map(|_| None).collect() };
    for (&(_, id), buf) in prog.inputs.iter().zip(inputs) {
        store.put(id, buf);
    }
    let mut events: Vec<Option<B::Event>> = (0..sched.ops.len()).map(|_| None).collect();
    // Timeline events per step: the compute span [first start, last end], and each transfer's
    // own (start, end): a step's transfers can lie far apart (the backward ring returns a
    // gradient partial only after the next step's compute), so no span stands for them.
    let mut compute_span: Vec<[Option<B::Event>; 2]> = (0..prog.steps).map(|_| [None, None]).collect();
    let mut transfers: Vec<Vec<(B::Event, B::Event)>> = (0..prog.steps).map(|_| Vec::new()).collect();

    let fail_step =
        ctl.fail.filter(|f| f.rank == prog.rank).map(|f| (f.kind, f.step.min(prog.steps.saturating_sub(1))));
    for so in sched.issue.iter().map(|&i| &sched.ops[i]) {
        if let Some((kind, _)) = fail_step.filter(|&(_, step)| step == so.step) {
            match kind {
                FailureKind::Error => {
                    return Err(Error::Backend {
                        backend: "test",
                        reason: format!("injected failure at step {}", so.step),
                    })
                }
                FailureKind::Panic => panic!("injected panic at step {}", so.step),
                FailureKind::Hang => loop {
                    comm.check()?;
                    std::thread::sleep(Duration::from_millis(10));
                },
            }
        }
        let op = &prog.ops[so.id];
        // A rank busy computing stops at its next block once the group has failed (a peer's
        // error, or a peer that gave up waiting for this one), rather than running to its end.
        if op.is_block() {
            comm.check()?;
        }
        let lane = so.lane;
        if let Some(w) = so.wait {
            let ev = events[w]
                .as_ref()
                .ok_or_else(|| Error::Internal("the schedule waits for an op not yet issued".into()))?;
            backend.wait(lane, ev)?;
        }
        let timed_op = timed
            && match (op, lane) {
                (PreparedOp::Comm { .. }, Lane::Comm) => true,
                (PreparedOp::Alloc { .. } | PreparedOp::Free { .. } | PreparedOp::Comm { .. }, _) => false,
                (_, l) => l == Lane::Compute,
            };
        let mut transfer_start = None;
        if timed_op && lane == Lane::Comm {
            transfer_start = Some(backend.record(lane, true)?);
        } else if timed_op && compute_span[so.step][0].is_none() {
            compute_span[so.step][0] = Some(backend.record(lane, true)?);
        }
        run_op(prog, backend, comm, opts, &mut store, op, lane)?;
        if timed_op {
            let end = backend.record(lane, true)?;
            match transfer_start {
                Some(start) => transfers[so.step].push((start, end)),
                None => compute_span[so.step][1] = Some(end),
            }
        }
        if op.is_block() {
            progress.push(backend.record(lane, false)?);
            // Blocks already done (all of them on the CPU) restart the stall clock now, so a
            // long run reports progress while it issues.
            report_progress(backend, comm, progress, done)?;
        }
        if so.signals {
            events[so.id] = Some(backend.record(lane, false)?);
        }
    }
    // Join the comm lane into compute: the end covers both.
    backend.wait(Lane::Compute, &backend.record(Lane::Comm, false)?)?;
    let end = backend.record(Lane::Compute, timed)?;
    Ok(Issued { store, end, t_start, compute_span, transfers })
}

/// Waits until `end` has completed, polling the transport for failures; each block of
/// `progress` (in completion order) that completes restarts the stall clock.
fn wait_done<B: Backend, C: Communicator>(
    backend: &B,
    comm: &C,
    end: &B::Event,
    progress: &[B::Event],
    mut done: usize,
) -> Result<()> {
    loop {
        if backend.is_done(end)? {
            return Ok(());
        }
        report_progress(backend, comm, progress, &mut done)?;
        comm.check()?;
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Reports each block of `progress` past `done` that has completed, in order (each restarts the
/// stall clock).
fn report_progress<B: Backend, C: Communicator>(
    backend: &B,
    comm: &C,
    progress: &[B::Event],
    done: &mut usize,
) -> Result<()> {
    while *done < progress.len() && backend.is_done(&progress[*done])? {
        *done += 1;
        comm.stall_watch_progress();
    }
    Ok(())
}

fn run_op<B, C>(
    prog: &PreparedRank,
    backend: &B,
    comm: &C,
    opts: &AttnOptions,
    store: &mut Store<B::Buf>,
    op: &PreparedOp,
    lane: Lane,
) -> Result<()>
where
    B: Backend,
    C: Communicator<Buf = B::CommBuf>,
{
    match op {
        PreparedOp::Alloc { buf, fill } => {
            let b = backend.alloc(lane, prog.dtype_of(*buf), prog.elems_of(*buf), *fill)?;
            store.put(*buf, b);
        }
        PreparedOp::Free { buf } => {
            if let Some(b) = store.bufs[*buf].take() {
                backend.free(lane, b);
            }
        }
        PreparedOp::Comm { sends, recvs } => {
            // Each receive's buffer: a view of the buffer gathering it where the backend lends
            // one, else a new one (copied into that buffer after the group, where it has one).
            let mut got = Vec::with_capacity(recvs.len());
            for r in recvs {
                let elems = prog.elems_of(r.buf);
                let view = match r.into {
                    Some((p, at)) => store.with_mut(p, |_, parent| backend.view(parent, at, elems))?,
                    None => None,
                };
                got.push(match view {
                    Some(v) => (v, None),
                    None => (backend.alloc(lane, prog.dtype_of(r.buf), elems, None)?, r.into),
                });
            }
            // Each send stored inside another buffer: a view of it where the backend lends one,
            // else a copy of that part (put in the store, so the plan's free releases it).
            for s in sends {
                if let Some((p, at)) = s.out_of {
                    let elems = prog.elems_of(s.buf);
                    let part = match store.with_mut(p, |_, parent| backend.view(parent, at, elems))? {
                        Some(v) => v,
                        None => {
                            let mut t = backend.alloc(lane, prog.dtype_of(s.buf), elems, None)?;
                            backend.copy(lane, store.get(p)?, &mut t, &[Piece::run(at, 0, elems)])?;
                            t
                        }
                    };
                    store.put(s.buf, part);
                }
            }
            {
                let send_views = sends
                    .iter()
                    .map(|s| Ok((s.to, backend.comm_view(store.get(s.buf)?))))
                    .collect::<Result<Vec<_>>>()?;
                let mut recv_views: Vec<(usize, &mut B::CommBuf)> =
                    recvs.iter().zip(got.iter_mut()).map(|(r, g)| (r.from, backend.comm_view_mut(&mut g.0))).collect();
                // SAFETY: the plan frees each of these buffers on the comm lane or after an
                // event of it (the schedule puts a free on its buffer's last lane), and every
                // op reading a received buffer or writing a sent one runs on the comm lane or
                // after such an event: nothing touches them before the transfers are done.
                unsafe { comm.group(&send_views, &mut recv_views)? };
            }
            for (r, (g, copy_into)) in recvs.iter().zip(got) {
                match copy_into {
                    Some((p, at)) => {
                        let piece = [Piece::run(0, at, prog.elems_of(r.buf))];
                        store.with_mut(p, |_, parent| backend.copy(lane, &g, parent, &piece))?;
                        backend.free(lane, g);
                    }
                    None => store.put(r.buf, g),
                }
            }
        }
        PreparedOp::Copy { src, dst, pieces } => {
            store.with_mut(*dst, |s, d| backend.copy(lane, s.get(*src)?, d, pieces))?;
        }
        PreparedOp::Add { src, dst, pieces } => {
            store.with_mut(*dst, |s, d| backend.add(lane, s.get(*src)?, d, pieces))?;
        }
        PreparedOp::Merge { o, lse, o_acc, lse_acc, spec } => {
            store.with_mut2(*o_acc, *lse_acc, |s, ao, al| backend.merge(s.get(*o)?, s.get(*lse)?, ao, al, spec))?;
        }
        PreparedOp::Fwd { q, k, v, o, lse, block, output, rounded } => {
            let block = &prog.blocks[*block];
            // The rounded final O, taken out of the store for the call.
            let mut rb = rounded.as_ref().map(|(y, _)| store.take(*y)).transpose()?;
            let fwd = |s: &Store<B::Buf>, ob: &mut B::Buf, lb: &mut B::Buf, rd: Option<&mut B::Buf>| {
                backend.forward(block, s.fwd_inputs(*q, *k, *v)?, opts, ob, lb, rd)
            };
            let merging = |s: &Store<B::Buf>, ao: &mut B::Buf, al: &mut B::Buf, rd: Option<&mut B::Buf>| {
                backend.forward_merging(block, s.fwd_inputs(*q, *k, *v)?, opts, ao, al, rd)
            };
            let r = match output {
                FwdOutput::Direct => store.with_mut2(*o, *lse, |s, ob, lb| fwd(s, ob, lb, rb.as_mut())),
                // (The guard runs the merging kernel; where the backend has none, the next arm merges.)
                FwdOutput::MergeInKernel(_)
                    if store.with_mut2(*o, *lse, |s, ao, al| merging(s, ao, al, rb.as_mut()))? =>
                {
                    Ok(())
                }
                FwdOutput::Merge(spec) | FwdOutput::MergeInKernel(spec) => {
                    let s = &block.shape;
                    let mut po = backend.alloc(Lane::Compute, DType::F32, s.q_elems(), None)?;
                    let mut pl = backend.alloc(Lane::Compute, DType::F32, s.lse_elems(), None)?;
                    fwd(store, &mut po, &mut pl, None)?;
                    store.with_mut2(*o, *lse, |_, ao, al| backend.merge(&po, &pl, ao, al, spec))?;
                    backend.free(Lane::Compute, po);
                    backend.free(Lane::Compute, pl);
                    match (rounded, rb.as_mut()) {
                        (Some((_, pieces)), Some(y)) => backend.copy(Lane::Compute, store.get(*o)?, y, pieces),
                        _ => Ok(()),
                    }
                }
            };
            if let (Some((y, _)), Some(b)) = (rounded, rb) {
                store.put(*y, b);
            }
            r?;
        }
        PreparedOp::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, block, dq_output, dk_output, dv_output } => {
            let block = &prog.blocks[*block];
            let s = &block.shape;
            let outs = [(*dq, dq_output, s.q_elems()), (*dk, dk_output, s.kv_elems()), (*dv, dv_output, s.kv_elems())];
            // The kernel adds into the accumulators that cover exactly the block's rows or keys
            // (or writes those held in the input dtype), taken out of the store for the call; the
            // others get a fresh zeroed partial, added into them by pieces afterwards. (A failure
            // ends the run, store and all.)
            let mut target = |&(id, out, elems): &(BufId, &GradOutput, usize)| match out {
                GradOutput::Direct => store.take(id),
                GradOutput::Add(_) => backend.alloc(Lane::Compute, DType::F32, elems, Some(0.0)),
            };
            let [mut gq, mut gk, mut gv] = [target(&outs[0])?, target(&outs[1])?, target(&outs[2])?];
            let inputs = BwdInputs {
                q: store.get(*q)?,
                k: store.get(*k)?,
                v: store.get(*v)?,
                d_o: store.get(*d_o)?,
                lse: store.get(*lse)?,
                delta: store.get(*delta)?,
            };
            backend.backward(block, inputs, opts, GradAccs { dq: &mut gq, dk: &mut gk, dv: &mut gv })?;
            for (&(id, out, _), t) in outs.iter().zip([gq, gk, gv]) {
                match out {
                    GradOutput::Direct => store.put(id, t),
                    GradOutput::Add(pieces) => {
                        store.with_mut(id, |_, acc| backend.add(Lane::Compute, &t, acc, pieces))?;
                        backend.free(Lane::Compute, t);
                    }
                }
            }
        }
    }
    Ok(())
}

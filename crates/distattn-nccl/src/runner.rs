//! Multi-GPU runners: thread ranks in one process (one GPU each, `distattn run/bench --gpus N`)
//! and one rank per process from a launcher's environment (`distattn launch --nproc N`).

use crate::buf::GpuBuf;
use crate::gpu::GpuRank;
use crate::launch::LaunchEnv;
use crate::nccl::{unique_id, GroupState, NcclComm};
use crate::timeline::Timeline;
use distattn_core::plan::{build, BufDesc, Pass, Plan, PlanOptions, Tensor};
use distattn_core::{AttnOptions, AttnShape, DType, Element, Error, Mask, Result, Strategy};
use distattn_cuda::CudaBackend;
use distattn_dist::comm::panic_message;
use distattn_dist::{execute_rank, gather_forward, gather_grads, shard, Forward, Grads, InjectedFailure};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of a multi-GPU run.
#[derive(Debug, Clone)]
pub struct GpuRunOptions {
    /// Planner options (the pass is set by the entry point).
    pub plan: PlanOptions,
    /// A stalled transfer aborts the communicators after this long.
    pub timeout: Duration,
    /// Overlapped two-stream executor (default) or the generic blocking one.
    pub overlap: bool,
    /// Record per-step timelines (overlapped executor).
    pub timeline: bool,
    /// First GPU ordinal; rank r uses GPU `first_gpu + r`.
    pub first_gpu: usize,
    /// Test hook: make a rank fail.
    pub fail: Option<InjectedFailure>,
}

impl Default for GpuRunOptions {
    fn default() -> Self {
        GpuRunOptions {
            plan: PlanOptions::default(),
            timeout: Duration::from_secs(60),
            overlap: true,
            timeline: false,
            first_gpu: 0,
            fail: None,
        }
    }
}

/// Opens GPUs `first_gpu..first_gpu + world` as thread ranks, each with its NCCL communicator
/// (one unique id shared in-process), and runs `f` on every rank. A rank's error or panic
/// aborts every communicator; the call returns an error naming the first failed rank.
pub fn with_gpu_ranks<R: Send>(
    world: usize,
    first_gpu: usize,
    timeout: Duration,
    f: impl Fn(&GpuRank) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    if world == 0 {
        return Err(Error::ZeroDim { what: "world size" });
    }
    let id = unique_id()?;
    let group = Arc::new(GroupState::default());
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (f, group) = (&f, group.clone());
                s.spawn(move || {
                    let open = || -> Result<GpuRank> {
                        let be = CudaBackend::new(first_gpu + r)?;
                        let comm = NcclComm::init(be.context(), r, world, id, Some(group.clone()), timeout)?;
                        GpuRank::new(be, comm)
                    };
                    let g = match open() {
                        Ok(g) => g,
                        Err(e) => {
                            if !matches!(e, Error::RankFailed { .. }) {
                                group.fail(r, &e.to_string());
                            }
                            return Err(e);
                        }
                    };
                    match catch_unwind(AssertUnwindSafe(|| f(&g))) {
                        Ok(Ok(v)) => Ok(v),
                        Ok(Err(e)) => {
                            if !matches!(&e, Error::RankFailed { rank, .. } if *rank != r) {
                                g.comm.fail(&e.to_string());
                            }
                            Err(e)
                        }
                        Err(p) => {
                            let reason = format!("panicked: {}", panic_message(p.as_ref()));
                            g.comm.fail(&reason);
                            Err(Error::RankFailed { rank: r, reason })
                        }
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Comm("rank thread lost".into())))).collect()
    });
    if let Some((rank, reason)) = group.failure() {
        return Err(Error::RankFailed { rank, reason });
    }
    results.into_iter().collect()
}

/// Process mode: this process's rank from the launcher's environment (`RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `NCCL_COMM_ID`); `Ok(None)` when not launched.
pub fn gpu_rank_from_env(timeout: Duration) -> Result<Option<GpuRank>> {
    let Some(env) = LaunchEnv::from_env()? else { return Ok(None) };
    let be = CudaBackend::new(env.local_rank)?;
    let comm = NcclComm::from_launch(be.context(), &env, timeout)?;
    Ok(Some(GpuRank::new(be, comm)?))
}

/// Uploads this rank's input shards of `plan` from full host tensors (`full(t)` gives the full
/// tensor of `t` as host values of the input dtype, or f32 for LSE/D).
pub fn upload_inputs<'a, T: Element>(
    g: &GpuRank,
    plan: &Plan,
    full_in: &dyn Fn(Tensor) -> Option<&'a [T]>,
    full_f32: &dyn Fn(Tensor) -> Option<&'a [f32]>,
) -> Result<Vec<GpuBuf>> {
    let prog = &plan.ranks[g.rank()];
    let s = g.compute_stream();
    let mut out = Vec::new();
    for &(t, id) in &prog.inputs {
        let d = &prog.bufs[id];
        let b = if t.is_input() {
            GpuBuf::upload(
                s,
                &shard(full_in(t).ok_or_else(|| Error::Comm(format!("no input for {t:?}")))?, d, &plan.shape),
            )?
        } else {
            GpuBuf::upload(
                s,
                &shard(full_f32(t).ok_or_else(|| Error::Comm(format!("no input for {t:?}")))?, d, &plan.shape),
            )?
        };
        out.push(b);
    }
    Ok(out)
}

/// Runs one plan on thread ranks from full host tensors; returns every rank's outputs
/// (descriptor and f32 values) and timelines.
fn run_plan_host<'a, T: Element>(
    plan: &Plan,
    mask: &Mask,
    opts: &AttnOptions,
    full_in: &(dyn Fn(Tensor) -> Option<&'a [T]> + Sync),
    full_f32: &(dyn Fn(Tensor) -> Option<&'a [f32]> + Sync),
    run: &GpuRunOptions,
) -> Result<(Vec<(Tensor, BufDesc, Vec<f32>)>, Vec<Timeline>)> {
    let per_rank = with_gpu_ranks(plan.world, run.first_gpu, run.timeout, |g| {
        let inputs = upload_inputs::<T>(g, plan, full_in, full_f32)?;
        let prog = &plan.ranks[g.rank()];
        let (outs, tl) = if run.overlap {
            let r = g.execute(plan, None, mask, opts, inputs, run.timeline, run.fail)?;
            (r.outputs, r.timeline)
        } else {
            (execute_rank(plan, g, &g.comm, mask, opts, inputs, run.fail)?, None)
        };
        let mut res = Vec::new();
        for (&(t, id), b) in prog.outputs.iter().zip(&outs) {
            res.push((t, prog.bufs[id].clone(), b.download_f32(g.compute_stream())?));
        }
        Ok((res, tl))
    })?;
    let mut all = Vec::new();
    let mut tls = Vec::new();
    for (r, t) in per_rank {
        all.extend(r);
        tls.extend(t);
    }
    Ok((all, tls))
}

/// One call on `world` GPUs: plans `strategy`, shards the full Q, K, V, runs the ranks and
/// gathers the full (O, LSE) in f32, with the ranks' timelines if asked for.
#[allow(clippy::too_many_arguments)]
pub fn gpu_forward<T: Element>(
    strategy: Strategy,
    world: usize,
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    run: &GpuRunOptions,
) -> Result<(Forward, Vec<Timeline>)> {
    let popts = run.plan.with_pass(Pass::Forward);
    let plan = build(strategy, world, shape, mask, T::DTYPE, &popts)?;
    let full_in = |t: Tensor| match t {
        Tensor::Q => Some(q),
        Tensor::K => Some(k),
        Tensor::V => Some(v),
        _ => None,
    };
    let (outs, tl) = run_plan_host::<T>(&plan, mask, opts, &full_in, &|_| None, run)?;
    Ok((gather_forward(shape, outs), tl))
}

/// One call: the backward on `world` GPUs given the forward's O (f32) and LSE and dO; returns
/// the full f32 gradients. `run.plan.ring_backward` picks the ring variant.
#[allow(clippy::too_many_arguments)]
pub fn gpu_backward<T: Element>(
    strategy: Strategy,
    world: usize,
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[f32],
    lse: &[f32],
    d_o: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    run: &GpuRunOptions,
) -> Result<(Grads, Vec<Timeline>)> {
    let popts = run.plan.with_pass(Pass::Backward);
    let plan = build(strategy, world, shape, mask, T::DTYPE, &popts)?;
    let delta = distattn_cpu::row_delta(o, d_o, shape)?;
    let full_in = |t: Tensor| match t {
        Tensor::Q => Some(q),
        Tensor::K => Some(k),
        Tensor::V => Some(v),
        Tensor::DO => Some(d_o),
        _ => None,
    };
    let full_f = |t: Tensor| match t {
        Tensor::Lse => Some(lse),
        Tensor::Delta => Some(&delta[..]),
        _ => None,
    };
    let (outs, tl) = run_plan_host::<T>(&plan, mask, opts, &full_in, &full_f, run)?;
    Ok((gather_grads(shape, outs), tl))
}

/// This rank's inputs of `plan`, generated on its GPU: random bf16 values for Q, K, V, dO and
/// O, LSE = 12 and delta = 0 (values that keep every exponent finite). For timing runs.
pub fn device_inputs(g: &GpuRank, plan: &Plan, seed: u64) -> Result<Vec<GpuBuf>> {
    if plan.dtype != DType::BF16 {
        return Err(Error::UnsupportedDType(format!("{} (timing inputs are generated in bf16)", plan.dtype)));
    }
    let prog = &plan.ranks[g.rank()];
    let s = g.compute_stream();
    let aux = g.aux(DType::BF16)?;
    let mut out = Vec::new();
    for (i, &(t, id)) in prog.inputs.iter().enumerate() {
        let n = prog.bufs[id].elems(&plan.shape);
        let b = match t {
            Tensor::Lse => GpuBuf::filled(s, DType::F32, n, 12.0)?,
            Tensor::Delta => GpuBuf::filled(s, DType::F32, n, 0.0)?,
            _ => {
                let b = GpuBuf::alloc(s, DType::BF16, n)?;
                b.rand_fill(s, &aux, seed * 131 + (g.rank() * 17 + i) as u64, 1.7)?;
                b
            }
        };
        out.push(b);
    }
    Ok(out)
}

/// What [`time_gpu_strategy`] measured.
#[derive(Debug, Clone, Default)]
pub struct GpuTiming {
    /// Median forward time of the slowest rank, ms.
    pub fwd_ms: f64,
    /// Median backward time of the slowest rank, ms (when asked for).
    pub bwd_ms: Option<f64>,
    /// With `run.timeline`: every rank's timelines of one more run, ranks in order, each
    /// rank's forward then backward (the layout of [`crate::TimelineRun::ranks`]).
    pub timelines: Vec<Timeline>,
}

/// Times `strategy` on `world` local GPUs for a bf16 problem, with the ranks, communicators and
/// plans set up once: per pass one warm-up run, then `repeats` runs on inputs generated on the
/// GPUs, each from a barrier to its end on the slowest rank. Returns the median forward and
/// (with `backward`) backward times, and with `run.timeline` the timelines of one more run.
#[allow(clippy::too_many_arguments)]
pub fn time_gpu_strategy(
    strategy: Strategy,
    world: usize,
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    backward: bool,
    repeats: usize,
    run: &GpuRunOptions,
) -> Result<GpuTiming> {
    let fwd = build(strategy, world, shape, mask, DType::BF16, &run.plan.with_pass(Pass::Forward))?;
    let bwd = if backward {
        Some(build(strategy, world, shape, mask, DType::BF16, &run.plan.with_pass(Pass::Backward))?)
    } else {
        None
    };
    let plans: Vec<&Plan> = std::iter::once(&fwd).chain(&bwd).collect();
    let per_rank = with_gpu_ranks(world, run.first_gpu, run.timeout, |g| {
        let time = |plan: &Plan, seed: u64, timeline: bool| -> Result<(f64, Option<Timeline>)> {
            let inputs = device_inputs(g, plan, seed)?;
            g.comm.wait_stream(g.compute_stream())?;
            distattn_core::Communicator::barrier(&g.comm)?;
            let t0 = Instant::now();
            let r = g.execute(plan, None, mask, opts, inputs, timeline, None)?;
            drop(r.outputs);
            Ok((t0.elapsed().as_secs_f64() * 1e3, r.timeline))
        };
        // times[pass][repetition]; the first run of each pass is the warm-up.
        let mut times = vec![Vec::new(); plans.len()];
        for it in 0..=repeats.max(1) {
            for (p, plan) in plans.iter().enumerate() {
                let (ms, _) = time(plan, (plans.len() * it + p) as u64, false)?;
                if it > 0 {
                    times[p].push(ms);
                }
            }
        }
        let mut timelines = Vec::new();
        if run.timeline {
            for plan in &plans {
                timelines.extend(time(plan, 0, true)?.1);
            }
        }
        Ok((times, timelines))
    })?;
    // Slowest rank per repetition, then the median.
    let slowest = |p: usize| -> Option<f64> {
        let n = per_rank[0].0.get(p)?.len();
        if n == 0 {
            return None;
        }
        let mut v: Vec<f64> = (0..n).map(|i| per_rank.iter().map(|r| r.0[p][i]).fold(0.0, f64::max)).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        Some(v[n / 2])
    };
    Ok(GpuTiming {
        fwd_ms: slowest(0).ok_or_else(|| Error::Comm("no timing".into()))?,
        bwd_ms: slowest(1),
        timelines: per_rank.into_iter().flat_map(|r| r.1).collect(),
    })
}

//! GPU ranks: one GPU's CUDA backend and its NCCL communicator ([`GpuRank`]), opened as
//! thread ranks of one process ([`with_gpu_ranks`]: what `distattn run/bench --gpus N` and
//! `Execution::GpuRanks` use) or as the one rank of a process started by a launcher
//! ([`gpu_rank_from_env`]: `distattn launch --nproc N`, torchrun, Slurm). Plans run on them
//! through the one interpreter of `distattn-exec`.

use crate::comm::{unique_id, GroupState, NcclComm, UniqueId};
use crate::launch::LaunchEnv;
use distattn_core::plan::{Pass, Plan, Tensor};
use distattn_core::planner::build;
use distattn_core::timeline::Timeline;
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask, PlanOptions, Result, Strategy};
use distattn_cuda::{CudaBackend, GpuBuf};
use distattn_exec::rendezvous::panic_message;
use distattn_exec::{execute, prepare, Communicator, ExecOptions, PreparedRank};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank: a GPU's backend and its communicator.
pub struct GpuRank {
    backend: CudaBackend,
    comm: NcclComm,
}

impl GpuRank {
    /// Opens GPU `ordinal` as rank `rank` of `world`, joining the communicator of `id`.
    fn open(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: UniqueId,
        group: Option<Arc<GroupState>>,
        timeout: Duration,
    ) -> Result<GpuRank> {
        let backend = CudaBackend::new(ordinal)?;
        // Memory freed on one stream is reused on the other only once free, and kept between
        // runs: no hidden cross-stream waits, no allocation cost per step.
        backend.keep_memory_pool()?;
        let comm = NcclComm::init(&backend, rank, world, id, group, timeout)?;
        Ok(GpuRank { backend, comm })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    pub fn comm(&self) -> &NcclComm {
        &self.comm
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
                    let g = match GpuRank::open(first_gpu + r, r, world, id, Some(group.clone()), timeout) {
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
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank thread ended without a result".into()))))
            .collect()
    });
    if let Some((rank, reason)) = group.failure() {
        return Err(Error::RankFailed { rank, reason });
    }
    results.into_iter().collect()
}

/// Process mode: this process's rank from the launcher's environment (`RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `NCCL_COMM_ID` or `MASTER_ADDR`/`MASTER_PORT`); `Ok(None)` when not launched.
pub fn gpu_rank_from_env(timeout: Duration) -> Result<Option<GpuRank>> {
    let Some(env) = LaunchEnv::from_env()? else { return Ok(None) };
    std::env::set_var("NCCL_COMM_ID", &env.comm_id);
    let id = unique_id()?;
    Ok(Some(GpuRank::open(env.local_rank, env.rank, env.world, id, None, timeout)?))
}

/// This rank's inputs of `prog`, generated on its GPU: random bf16 values for Q, K, V and dO,
/// LSE = 12 and D = 0 (values that keep every exponent finite). For timing runs.
pub fn device_inputs(g: &GpuRank, prog: &PreparedRank, seed: u64) -> Result<Vec<GpuBuf>> {
    if prog.dtype != DType::BF16 {
        return Err(Error::UnsupportedDType(format!("{} (timing inputs are generated in bf16)", prog.dtype)));
    }
    let s = g.backend.stream();
    let mut out = Vec::with_capacity(prog.inputs.len());
    for (i, &(t, id)) in prog.inputs.iter().enumerate() {
        let n = prog.elems_of(id);
        out.push(match t {
            Tensor::Lse => GpuBuf::filled(s, DType::F32, n, 12.0)?,
            Tensor::Delta => GpuBuf::filled(s, DType::F32, n, 0.0)?,
            _ => g.backend.random_buf(DType::BF16, n, seed * 131 + (g.rank() * 17 + i) as u64, 1.7)?,
        });
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
    /// With `timeline`: every rank's timelines of one more run, ranks in order, each rank's
    /// forward then backward (the layout of `TimelineRun::ranks`).
    pub timelines: Vec<Timeline>,
}

/// A strategy to time on local GPUs: the ranks, the plans' options, and whether to time the
/// backward and record timelines.
#[derive(Debug, Clone)]
pub struct GpuBench {
    pub strategy: Strategy,
    pub world: usize,
    pub first_gpu: usize,
    pub plan: PlanOptions,
    pub timeout: Duration,
    pub backward: bool,
    /// Timed runs per pass (0 means 1).
    pub repeats: usize,
    pub timeline: bool,
    /// Runs per timed call, issued back to back and waited for once (a decode step's layers:
    /// the host does not wait between them); the time per run is reported. 0 means 1.
    pub runs: usize,
}

/// Times a strategy on local GPUs for a bf16 problem, with the ranks, communicators and
/// prepared plans set up once: per pass one warm-up run, then `repeats` runs on inputs
/// generated on the GPUs, each from a barrier to its end on the slowest rank. Returns the
/// median forward and (when asked) backward times, and the timelines of one more run.
pub fn time_gpu_strategy(bench: &GpuBench, shape: &AttnShape, mask: &Mask, opts: &AttnOptions) -> Result<GpuTiming> {
    let mut plans: Vec<Plan> =
        vec![build(bench.strategy, bench.world, shape, mask, DType::BF16, &bench.plan.with_pass(Pass::Forward))?];
    if bench.backward {
        plans.push(build(
            bench.strategy,
            bench.world,
            shape,
            mask,
            DType::BF16,
            &bench.plan.with_pass(Pass::Backward),
        )?);
    }
    let per_rank = with_gpu_ranks(bench.world, bench.first_gpu, bench.timeout, |g| {
        let progs = plans.iter().map(|p| prepare(p, g.rank(), mask)).collect::<Result<Vec<_>>>()?;
        let time = |prog: &PreparedRank, seed: u64, timeline: bool| -> Result<(f64, Option<Timeline>)> {
            let inputs = device_inputs(g, prog, seed)?;
            g.comm.wait_stream(g.backend.stream())?;
            g.comm.barrier()?;
            // A timeline comes from one run alone.
            let runs = if timeline { 1 } else { bench.runs.max(1) };
            let t0 = Instant::now();
            let r = execute(
                prog,
                &g.backend,
                &g.comm,
                opts,
                inputs,
                &ExecOptions { timeline, runs, ..Default::default() },
            )?;
            drop(r.outputs);
            Ok((t0.elapsed().as_secs_f64() * 1e3 / runs as f64, r.timeline))
        };
        // times[pass][repetition]; the first run of each pass is the warm-up.
        let mut times = vec![Vec::new(); progs.len()];
        for it in 0..=bench.repeats.max(1) {
            for (p, prog) in progs.iter().enumerate() {
                let (ms, _) = time(prog, (progs.len() * it + p) as u64, false)?;
                if it > 0 {
                    times[p].push(ms);
                }
            }
        }
        let mut timelines = Vec::new();
        if bench.timeline {
            for prog in &progs {
                timelines.extend(time(prog, 0, true)?.1);
            }
        }
        Ok((times, timelines))
    })?;
    // Slowest rank per repetition, then the median.
    let slowest = |p: usize| -> Option<f64> {
        let n = per_rank.first()?.0.get(p)?.len();
        let mut v: Vec<f64> = (0..n).map(|i| per_rank.iter().map(|r| r.0[p][i]).fold(0.0, f64::max)).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(n / 2).copied()
    };
    Ok(GpuTiming {
        fwd_ms: slowest(0).ok_or_else(|| Error::Internal("no forward timing was recorded".into()))?,
        bwd_ms: slowest(1),
        timelines: per_rank.into_iter().flat_map(|r| r.1).collect(),
    })
}

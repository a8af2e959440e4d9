//! Multi-GPU benchmark of distattn (run on a machine with several GPUs; the exactness checks
//! are the ignored tests of `tests/gpus.rs`).
//!
//! Subcommands `bench`, `probe`, `links`, `doc-lens`, `kill-test` and `worker` (one rank of a
//! launched run);
//! `distattn-multigpu-bench <subcommand> --help` lists the options.

use distattn_core::mask::DocKind;
use distattn_core::plan::{Pass, Plan, PlanOptions, RingBackward};
use distattn_core::planner::build;
use distattn_core::schedule::Lane;
use distattn_core::timeline::{Timeline, TimelineRun};
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask, MaskSpec, Result, Strategy};
use distattn_cuda::{CudaBackend, GpuBuf};
use distattn_exec::{execute, prepare, Backend, Communicator, ExecOptions};
use distattn_nccl::launch::LaunchEnv;
use distattn_nccl::{device_inputs, gpu_rank_from_env, with_gpu_ranks, GpuRank};
use half::bf16;
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A case's forward and backward plans and its mask, or why they could not be built.
type CasePlans = std::result::Result<(Plan, Plan, Mask), String>;

/// Multi-GPU benchmark of distattn's context-parallel strategies.
#[derive(clap::Parser)]
#[command(name = "distattn-multigpu-bench", version)]
enum Cli {
    /// Times strategies against the single-GPU kernel (JSON rows with --out).
    Bench(BenchArgs),
    /// The longest sequence each length of --seqs reaches: runs until the first failure.
    Probe(ProbeArgs),
    /// All-to-all rate through distattn's NCCL groups, as the strategies post them.
    Links(LinksArgs),
    /// Document lengths of a packed-documents mask at each length of --seqs (JSON on stdout),
    /// for peers that take documents as cumulative lengths (`bench/torch_cp.py --doc-lens`).
    DocLens(DocLensArgs),
    /// Kills one rank mid-run and checks that every other rank reports it and exits.
    KillTest(KillTestArgs),
    /// One rank of a launched run (RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/MASTER_PORT or NCCL_COMM_ID from the launcher).
    Worker,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// GPUs (ranks).
    #[arg(long, default_value_t = 4)]
    gpus: usize,
    #[arg(long, value_delimiter = ',', default_value = "32768,131072")]
    seqs: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "zigzag,balanced,dispatch")]
    strategies: Vec<Strategy>,
    /// Passes to time: fwd, fwdbwd.
    #[arg(long, value_delimiter = ',', default_value = "fwd,fwdbwd")]
    passes: Vec<String>,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value = "causal")]
    mask: MaskSpec,
    /// Timed iterations per case.
    #[arg(long, default_value_t = 4)]
    iters: usize,
    /// Write the report (JSON) here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write every run's per-step timelines (JSON) here.
    #[arg(long)]
    timelines: Option<PathBuf>,
    /// Record a timeline in every timed iteration too (written with --timelines, each with its
    /// iteration and wall time), to compare slow iterations with fast ones; the events add a
    /// little to the times.
    #[arg(long)]
    timeline_every_iter: bool,
    /// Skip the single-GPU reference rows.
    #[arg(long)]
    no_single: bool,
    /// Ulysses head chunks (default: the planner's; more than one needs `--keep-head-sharded
    /// false`).
    #[arg(long)]
    head_chunks: Option<usize>,
    /// Ulysses and hybrid keep the forward's head-sharded Q, K, V, LSE for the backward
    /// (`PlanOptions::keep_head_sharded`), as the Python package runs them and as the
    /// all-to-all baseline's autograd keeps its tensors.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    keep_head_sharded: bool,
}

#[derive(clap::Args)]
struct ProbeArgs {
    #[arg(long, default_value_t = 4)]
    gpus: usize,
    #[arg(long, value_delimiter = ',', default_value = "262144,524288")]
    seqs: Vec<usize>,
    #[arg(long, default_value = "zigzag")]
    strategy: Strategy,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(clap::Args)]
struct LinksArgs {
    #[arg(long, default_value_t = 4)]
    gpus: usize,
    /// MB each rank holds (1/P of it stays local), as in `bench/torch_cp.py --a2a-mb`.
    #[arg(long, value_delimiter = ',', default_value = "8,24,48,96,192")]
    mb: Vec<usize>,
    /// Messages per peer the bytes for a peer are split into (Ulysses sends Q, K and V: 3).
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    parts: Vec<usize>,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(clap::Args)]
struct DocLensArgs {
    /// docs, docs-causal, docs-random or docs-random-causal.
    #[arg(long)]
    mask: MaskSpec,
    #[arg(long, value_delimiter = ',', default_value = "32768,131072")]
    seqs: Vec<usize>,
}

#[derive(clap::Args)]
struct KillTestArgs {
    #[arg(long, default_value_t = 4)]
    gpus: usize,
    /// Seconds a surviving rank waits for the dead one.
    #[arg(long, default_value_t = 10)]
    timeout_s: usize,
    /// Seconds after the start when the victim is killed.
    #[arg(long, default_value_t = 6)]
    kill_after_s: usize,
    /// The rank killed.
    #[arg(long, default_value_t = 1)]
    victim: usize,
}

fn device_name() -> String {
    CudaBackend::new(0).map(|b| b.device_name()).unwrap_or_else(|_| "unknown".into())
}

/// The forward and backward plans of one case (backward circulates K and V).
fn fwd_bwd_plans(
    st: Strategy,
    world: usize,
    shape: &AttnShape,
    mask: &Mask,
    spec: &MaskSpec,
    head_chunks: Option<usize>,
    keep_head_sharded: bool,
) -> Result<(Plan, Plan)> {
    let opts = |pass| PlanOptions {
        pass: Some(pass),
        ring_backward: RingBackward::KvCirculate,
        documents: spec.doc_lens(shape.q_len),
        head_chunks,
        // Training keeps O and the gradients in bf16, as the PyTorch peers return them.
        narrow_outputs: true,
        keep_head_sharded,
        ..Default::default()
    };
    let f = build(st, world, shape, mask, DType::BF16, &opts(Pass::Forward))?;
    let b = build(st, world, shape, mask, DType::BF16, &opts(Pass::Backward))?;
    Ok((f, b))
}

// ------------------------------------------------------------------------------------ cases

/// Runs `f(rank, case)` for every case on thread ranks. A case that fails ends that group of
/// ranks (its communicators are aborted); the remaining cases continue on fresh ranks. Returns,
/// per case, every rank's result in rank order or the error.
fn run_cases<R: Send>(
    world: usize,
    timeout: Duration,
    n: usize,
    f: impl Fn(&GpuRank, usize) -> Result<R> + Sync,
) -> Vec<std::result::Result<Vec<R>, String>> {
    let done: std::sync::Mutex<HashMap<usize, Vec<(usize, R)>>> = Default::default();
    let mut failed: HashMap<usize, String> = HashMap::new();
    let mut start = 0;
    while start < n {
        let r = with_gpu_ranks(world, 0, timeout, |g| {
            for ci in start..n {
                let r = f(g, ci)?;
                done.lock().unwrap().entry(ci).or_default().push((g.rank(), r));
            }
            Ok(())
        });
        match r {
            Ok(_) => break,
            Err(e) => {
                let d = done.lock().unwrap();
                let bad = (start..n).find(|ci| d.get(ci).map_or(0, |v| v.len()) < world).unwrap_or(n);
                drop(d);
                eprintln!("case {bad} failed: {e}; continuing with the next cases on fresh ranks");
                failed.insert(bad, e.to_string());
                start = bad + 1;
            }
        }
    }
    let mut d = done.into_inner().unwrap();
    (0..n)
        .map(|ci| match (failed.remove(&ci), d.remove(&ci)) {
            (Some(e), _) => Err(e),
            (None, Some(mut v)) if v.len() == world => {
                v.sort_by_key(|x| x.0);
                Ok(v.into_iter().map(|x| x.1).collect())
            }
            _ => Err("not run".into()),
        })
        .collect()
}

// ------------------------------------------------------------------------------------ bench

fn flops_fwd(mask: &Mask, shape: &AttnShape) -> f64 {
    4.0 * mask.area() as f64 * shape.batch as f64 * shape.head_dim as f64 * shape.heads as f64
}

/// Seconds of a case's work run before it is timed.
const WARM_S: f64 = 0.3;
/// The rate per GPU that turns [`WARM_S`] into a number of runs (a round figure: the count
/// only has to be the same on every rank and in `bench/torch_cp.py`, which uses this rule).
const WARM_RATE_PER_GPU: f64 = 500e12;

/// Warm-up runs of a case of `flops` on `gpus` GPUs: about [`WARM_S`] of its work, at least
/// one. The first tens of milliseconds of load run at clocks the power cap then takes back (on
/// 4 H200s the first two 32k iterations ran 8-10% faster than the rest), so every case, ours
/// and the peers', is timed after the same warm-up.
fn warm_runs(flops: f64, gpus: usize) -> usize {
    ((WARM_S * WARM_RATE_PER_GPU * gpus as f64 / flops).ceil() as usize).clamp(1, 1000)
}

/// Times single-GPU kernels (forward, backward) on GPU 0, ms (median).
fn single_gpu(shape: &AttnShape, mask: &Mask, iters: usize) -> Result<(f64, f64)> {
    let be = CudaBackend::new(0)?;
    let s = be.stream().clone();
    let opts = AttnOptions::default();
    let mk = |n: usize, seed: u64| be.random_buf(DType::BF16, n, seed, 1.7);
    let (q, k, v, dout) =
        (mk(shape.q_elems(), 1)?, mk(shape.kv_elems(), 2)?, mk(shape.kv_elems(), 3)?, mk(shape.q_elems(), 4)?);
    let mut o = GpuBuf::alloc(&s, DType::BF16, shape.q_elems())?;
    let mut lse = GpuBuf::alloc(&s, DType::F32, shape.lse_elems())?;
    let mut dq = GpuBuf::alloc(&s, DType::BF16, shape.q_elems())?;
    let mut dk = GpuBuf::alloc(&s, DType::BF16, shape.kv_elems())?;
    let mut dv = GpuBuf::alloc(&s, DType::BF16, shape.kv_elems())?;
    let time = |f: &mut dyn FnMut() -> Result<()>, flops: f64| -> Result<f64> {
        for _ in 0..warm_runs(flops, 1) {
            f()?;
        }
        be.synchronize()?;
        let mut ts = Vec::new();
        for _ in 0..iters {
            let t0 = Instant::now();
            f()?;
            be.synchronize()?;
            ts.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        ts.sort_by(|a, b| a.total_cmp(b));
        Ok(ts[ts.len() / 2])
    };
    let (qv, kv, vv, dov) = (q.view::<bf16>()?, k.view::<bf16>()?, v.view::<bf16>()?, dout.view::<bf16>()?);
    let fl = flops_fwd(mask, shape);
    let fwd = time(
        &mut || be.forward::<bf16>(&qv, &kv, &vv, shape, mask, &opts, &mut o.view_mut()?, &mut lse.view_mut()?, None),
        fl,
    )?;
    let bwd = time(
        &mut || {
            be.backward::<bf16>(
                &qv,
                &kv,
                &vv,
                &o.view()?,
                &lse.view()?,
                &dov,
                shape,
                mask,
                &opts,
                &mut dq.view_mut()?,
                &mut dk.view_mut()?,
                &mut dv.view_mut()?,
            )
        },
        2.5 * fl,
    )?;
    Ok((fwd, bwd))
}

/// A case's runs over every rank: each iteration's slowest rank (ms), the peak bytes, the last
/// run's timelines, and each iteration's timelines (with --timeline-every-iter).
type CaseRuns = (Vec<f64>, u64, Vec<Timeline>, Vec<Vec<Timeline>>);

struct BenchCase {
    seq: usize,
    strategy: Strategy,
    fwdbwd: bool,
}

fn bench(a: &BenchArgs) -> Res<()> {
    let (world, seqs, strategies, passes) = (a.gpus, a.seqs.clone(), a.strategies.clone(), a.passes.clone());
    let (h, kvh, d) = (a.heads, a.kv_heads, 128);
    let spec = a.mask.clone();
    let iters = a.iters;
    let opts = AttnOptions::default();
    let dev = device_name();
    let mut rows = Vec::new();
    let row = |imp: &str,
               pass: &str,
               seq: usize,
               gpus: usize,
               strategy: &str,
               tflops: f64,
               ms: f64,
               extra: serde_json::Value| {
        let mut r = json!({"impl": imp, "pass": pass, "causal": spec.is_causal(), "batch": 1, "seq": seq, "heads": h,
            "head_dim": d, "dtype": "bf16", "tflops": tflops, "gpus": gpus, "strategy": strategy, "mask": spec.to_string(),
            "kv_heads": kvh, "tflops_per_gpu": tflops / gpus as f64, "ms": ms, "head_chunks": a.head_chunks,
            "keep_head_sharded": a.keep_head_sharded});
        if let (Some(o), Some(e)) = (r.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        r
    };
    // Single-GPU kernel throughput (the scaling reference).
    let mut single: HashMap<(usize, bool), f64> = HashMap::new();
    if !a.no_single {
        for &n in &seqs {
            let shape = AttnShape::new(1, n, n, h, kvh, d)?;
            let mask = spec.build(n, n)?;
            let (f, b) = single_gpu(&shape, &mask, 2)?;
            let fl = flops_fwd(&mask, &shape);
            println!(
                "single GPU  seq {n:>7}: fwd {f:8.2} ms {:6.1} TFLOP/s | fwd+bwd {:8.2} ms {:6.1} TFLOP/s",
                fl / f / 1e9,
                f + b,
                3.5 * fl / (f + b) / 1e9
            );
            single.insert((n, false), fl / f / 1e9);
            single.insert((n, true), 3.5 * fl / (f + b) / 1e9);
            rows.push(row("distattn-1gpu", "fwd", n, 1, "single", fl / f / 1e9, f, json!({})));
            rows.push(row("distattn-1gpu", "fwd+bwd", n, 1, "single", 3.5 * fl / (f + b) / 1e9, f + b, json!({})));
        }
    }
    let mut cases = Vec::new();
    for &n in &seqs {
        for &st in &strategies {
            for p in &passes {
                cases.push(BenchCase { seq: n, strategy: st, fwdbwd: p == "fwdbwd" });
            }
        }
    }
    // Plans (host) once.
    let mut plans: HashMap<(usize, Strategy), CasePlans> = HashMap::new();
    for &n in &seqs {
        for &st in &strategies {
            let shape = AttnShape::new(1, n, n, h, kvh, d)?;
            let mask = spec.build(n, n)?;
            let t0 = Instant::now();
            let r = fwd_bwd_plans(st, world, &shape, &mask, &spec, a.head_chunks, a.keep_head_sharded)
                .map(|(f, b)| (f, b, mask));
            println!(
                "plan {st} seq {n}: {:.0} ms{}",
                t0.elapsed().as_secs_f64() * 1e3,
                r.as_ref().err().map(|e| format!(" ({e})")).unwrap_or_default()
            );
            plans.insert((n, st), r.map_err(|e| e.to_string()));
        }
    }
    let t0 = Instant::now();
    // Per case and rank: (times ms per iteration, peak bytes, timelines).
    let results = run_cases(world, Duration::from_secs(120), cases.len(), |g, ci| {
        let c = &cases[ci];
        let Some(Ok((pf, pb, mask))) = plans.get(&(c.seq, c.strategy)) else { return Ok(None) };
        let (pf_r, pb_r) = (prepare(pf, g.rank(), mask)?, prepare(pb, g.rank(), mask)?);
        let run = |timeline: bool| -> Result<(f64, Vec<Timeline>)> {
            let fin = device_inputs(g, &pf_r, 1)?;
            let bin = if c.fwdbwd { Some(device_inputs(g, &pb_r, 2)?) } else { None };
            g.comm().wait_stream(g.backend().stream())?;
            g.comm().barrier()?;
            let t0 = Instant::now();
            let ctl = ExecOptions { timeline, ..Default::default() };
            let r = execute(&pf_r, g.backend(), g.comm(), &opts, fin, &ctl)?;
            let mut tls: Vec<Timeline> = r.timeline.into_iter().collect();
            drop(r.outputs);
            if let Some(bin) = bin {
                let r = execute(&pb_r, g.backend(), g.comm(), &opts, bin, &ctl)?;
                tls.extend(r.timeline);
            }
            Ok((t0.elapsed().as_secs_f64() * 1e3, tls))
        };
        g.backend().pool_peak_bytes(true)?;
        // Warm-up: the first run uploads index lists and tile plans and opens NCCL connections.
        let fl = flops_fwd(mask, &pf.shape) * if c.fwdbwd { 3.5 } else { 1.0 };
        for _ in 0..warm_runs(fl, world) {
            run(false)?;
        }
        let (mut times, mut iter_tls) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            let (t, tls) = run(a.timeline_every_iter)?;
            times.push(t);
            iter_tls.push(tls);
        }
        let peak = g.backend().pool_peak_bytes(true)?;
        let (_, tls) = run(true)?;
        Ok(Some((times, peak, tls, iter_tls)))
    });
    println!("distattn cases on {world} GPUs in {:.1} s", t0.elapsed().as_secs_f64());
    let mut timelines = Vec::new();
    let mut agg: HashMap<usize, CaseRuns> = HashMap::new();
    let mut errors: HashMap<usize, String> = HashMap::new();
    for (ci, r) in results.into_iter().enumerate() {
        match r {
            Err(e) => {
                errors.insert(ci, e);
            }
            Ok(v) => {
                for (times, peak, tls, iter_tls) in v.into_iter().flatten() {
                    let n = times.len();
                    let e = agg.entry(ci).or_insert_with(|| (vec![0.0; n], 0, Vec::new(), vec![Vec::new(); n]));
                    for (a, t) in e.0.iter_mut().zip(&times) {
                        *a = a.max(*t);
                    }
                    e.1 = e.1.max(peak);
                    e.2.extend(tls);
                    for (all, it) in e.3.iter_mut().zip(iter_tls) {
                        all.extend(it);
                    }
                }
            }
        }
    }
    println!(
        "{:<10} {:>8} {:<8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "strategy", "seq", "pass", "ms", "TFLOP/s", "/GPU", "eff", "GB/GPU", "hidden"
    );
    for (ci, c) in cases.iter().enumerate() {
        let pass = if c.fwdbwd { "fwd+bwd" } else { "fwd" };
        let Some((times, peak, tls, iter_tls)) = agg.get_mut(&ci) else {
            let why = plans
                .get(&(c.seq, c.strategy))
                .and_then(|p| p.as_ref().err().cloned())
                .or_else(|| errors.get(&ci).cloned())
                .unwrap_or_default();
            println!("{:<10} {:>8} {:<8} skipped: {why}", c.strategy.to_string(), c.seq, pass);
            continue;
        };
        for (i, (wall, its)) in times.iter().zip(iter_tls.iter_mut()).enumerate() {
            if !its.is_empty() {
                its.sort_by_key(|t| t.rank);
                timelines.push(TimelineRun {
                    strategy: c.strategy.to_string(),
                    seq: c.seq,
                    pass: pass.to_string(),
                    mask: spec.to_string(),
                    ranks: std::mem::take(its),
                    iteration: Some(i),
                    wall_ms: Some(*wall),
                });
            }
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let ms = times[times.len() / 2];
        let shape = AttnShape::new(1, c.seq, c.seq, h, kvh, d)?;
        let mask = spec.build(c.seq, c.seq)?;
        let fl = flops_fwd(&mask, &shape) * if c.fwdbwd { 3.5 } else { 1.0 };
        let tf = fl / ms / 1e9;
        let eff = single.get(&(c.seq, c.fwdbwd)).map(|s| tf / world as f64 / s);
        let ov: Vec<_> = tls.iter().map(|t| t.overlap()).collect();
        let (cm, hid): (f64, f64) = ov.iter().fold((0.0, 0.0), |a, o| (a.0 + o.comm_ms, a.1 + o.hidden_ms));
        let hidden = if cm > 0.0 { hid / cm } else { 1.0 };
        let exposed_ms = ov.iter().map(|o| o.exposed_ms).fold(0.0, f64::max);
        println!(
            "{:<10} {:>8} {:<8} {:>9.2} {:>9.1} {:>9.1} {:>8} {:>8.2} {:>7.0}%",
            c.strategy.to_string(),
            c.seq,
            pass,
            ms,
            tf,
            tf / world as f64,
            eff.map_or("-".into(), |e| format!("{:.0}%", 100.0 * e)),
            *peak as f64 / 1e9,
            100.0 * hidden
        );
        rows.push(row(
            "distattn",
            pass,
            c.seq,
            world,
            &c.strategy.to_string(),
            tf,
            ms,
            json!({"mem_gb_per_gpu": *peak as f64 / 1e9, "scaling_eff": eff, "comm_hidden_frac": hidden,
                   "max_exposed_comm_ms": exposed_ms, "iters_ms": times}),
        ));
        tls.sort_by_key(|t| t.rank);
        timelines.push(TimelineRun {
            strategy: c.strategy.to_string(),
            seq: c.seq,
            pass: pass.to_string(),
            mask: spec.to_string(),
            ranks: std::mem::take(tls),
            ..Default::default()
        });
    }
    // Show one timeline so overlap is seen (`distattn timeline FILE --svg DIR` draws them all).
    if let Some(run) = timelines.iter().rev().find(|t| t.pass == "fwd") {
        if let Some(tl) = run.ranks.first() {
            println!("timeline of {} seq {} fwd:\n{}", run.strategy, run.seq, tl.render());
        }
    }
    let out = json!({"device": dev, "date": today(), "commit": std::env::var("DISTATTN_COMMIT").unwrap_or_else(|_| "unknown".into()), "rows": rows});
    if let Some(p) = &a.out {
        std::fs::write(p, serde_json::to_string_pretty(&out)?)?;
    }
    if let Some(p) = &a.timelines {
        std::fs::write(p, serde_json::to_string(&timelines)?)?;
    }
    Ok(())
}

fn today() -> String {
    std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Longest sequence that runs fwd+bwd: one iteration per size, stops at the first failure.
fn probe(a: &ProbeArgs) -> Res<()> {
    let (world, seqs, st) = (a.gpus, a.seqs.clone(), a.strategy);
    let (h, kvh, d) = (a.heads, a.kv_heads, 128);
    let opts = AttnOptions::default();
    let mut rows = Vec::new();
    for n in seqs {
        let shape = AttnShape::new(1, n, n, h, kvh, d)?;
        let mask = Mask::causal(n, n)?;
        let spec = MaskSpec::Causal;
        let (pf, pb) = fwd_bwd_plans(st, world, &shape, &mask, &spec, None, false)?;
        let t0 = Instant::now();
        let r = with_gpu_ranks(world, 0, Duration::from_secs(120), |g| {
            let (pf_r, pb_r) = (prepare(&pf, g.rank(), &mask)?, prepare(&pb, g.rank(), &mask)?);
            let fin = device_inputs(g, &pf_r, 1)?;
            let bin = device_inputs(g, &pb_r, 2)?;
            g.backend().pool_peak_bytes(true)?;
            let t = Instant::now();
            drop(execute(&pf_r, g.backend(), g.comm(), &opts, fin, &ExecOptions::default())?);
            drop(execute(&pb_r, g.backend(), g.comm(), &opts, bin, &ExecOptions::default())?);
            Ok((t.elapsed().as_secs_f64() * 1e3, g.backend().pool_peak_bytes(true)?))
        });
        match r {
            Ok(v) => {
                let ms = v.iter().map(|x| x.0).fold(0.0, f64::max);
                let gb = v.iter().map(|x| x.1).max().unwrap_or(0) as f64 / 1e9;
                let tf = 3.5 * flops_fwd(&mask, &shape) / ms / 1e9;
                println!("probe {st} seq {n}: fwd+bwd {ms:.0} ms (first run, cold), {tf:.0} TFLOP/s, peak {gb:.1} GB/GPU ({:.0} s)", t0.elapsed().as_secs_f64());
                rows.push(json!({"impl": "distattn", "strategy": st.to_string(), "seq": n, "gpus": world, "ok": true, "ms": ms, "mem_gb_per_gpu": gb, "tflops": tf}));
            }
            Err(e) => {
                println!("probe {st} seq {n}: failed: {e}");
                rows.push(json!({"impl": "distattn", "strategy": st.to_string(), "seq": n, "gpus": world, "ok": false, "error": e.to_string()}));
                break;
            }
        }
    }
    if let Some(p) = &a.out {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}

// ------------------------------------------------------------------------- kill test, worker

fn worker() -> Res<()> {
    let timeout =
        Duration::from_secs(std::env::var("DISTATTN_TIMEOUT_S").ok().and_then(|v| v.parse().ok()).unwrap_or(10));
    let env = LaunchEnv::from_env()?
        .ok_or("worker needs RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/MASTER_PORT or NCCL_COMM_ID")?;
    let r = (|| -> Result<()> {
        let g = gpu_rank_from_env(timeout)?.ok_or_else(|| Error::Comm("not launched".into()))?;
        let n = 32768;
        let shape = AttnShape::new(1, n, n, 32, 8, 128)?;
        let mask = Mask::causal(n, n)?;
        let plan = build(Strategy::Zigzag, env.world, &shape, &mask, DType::BF16, &PlanOptions::forward())?;
        let prog = prepare(&plan, g.rank(), &mask)?;
        let opts = AttnOptions::default();
        eprintln!("rank {} (pid {}): communicator up, running", env.rank, std::process::id());
        for it in 0..100000 {
            let inputs = device_inputs(&g, &prog, it as u64)?;
            drop(execute(&prog, g.backend(), g.comm(), &opts, inputs, &ExecOptions::default())?);
            if it % 50 == 0 {
                eprintln!("rank {} iteration {it}", env.rank);
            }
        }
        Ok(())
    })();
    match r {
        Ok(()) => Ok(()),
        Err(e) => {
            eprintln!("rank {} ERROR: {e}", env.rank);
            std::process::exit(3);
        }
    }
}

fn kill_test(a: &KillTestArgs) -> Res<bool> {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let (world, timeout, kill_after, victim) = (a.gpus, a.timeout_s, a.kill_after_s, a.victim);
    let exe = std::env::current_exe()?;
    let port = 29000 + (std::process::id() % 1000) as u16;
    let mut children = Vec::new();
    for r in 0..world {
        let mut c = Command::new(&exe);
        c.arg("worker").env("DISTATTN_TIMEOUT_S", timeout.to_string()).stderr(Stdio::piped()).stdout(Stdio::null());
        for (k, v) in LaunchEnv::for_rank(0, r, world, 1, "127.0.0.1", port) {
            c.env(k, v);
        }
        children.push(c.spawn()?);
    }
    // Collect each child's stderr lines in a thread.
    let logs: Vec<std::sync::Arc<std::sync::Mutex<Vec<String>>>> = (0..world).map(|_| Default::default()).collect();
    for (r, ch) in children.iter_mut().enumerate() {
        let err = ch.stderr.take().unwrap();
        let log = logs[r].clone();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(|l| l.ok()) {
                log.lock().unwrap().push(l);
            }
        });
    }
    std::thread::sleep(Duration::from_secs(kill_after as u64));
    let running = logs.iter().all(|l| l.lock().unwrap().iter().any(|x| x.contains("iteration")));
    println!(
        "kill test: {world} processes, all iterating before the kill: {running}; killing rank {victim} (pid {})",
        children[victim].id()
    );
    children[victim].kill()?;
    let t_kill = Instant::now();
    let _ = children[victim].wait();
    let deadline = Duration::from_secs(timeout as u64 + 30);
    let mut ok = running;
    for (r, ch) in children.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let status = loop {
            if let Some(s) = ch.try_wait()? {
                break Some(s);
            }
            if t_kill.elapsed() > deadline {
                let _ = ch.kill();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        std::thread::sleep(Duration::from_millis(100));
        let last = logs[r]
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|l| l.contains("ERROR"))
            .cloned()
            .unwrap_or_else(|| "(no error line)".into());
        let named = last.contains(&format!("rank {victim} failed"));
        println!(
            "  rank {r}: {} after {:.1} s; {last}; names rank {victim}: {named}",
            status.map_or("HUNG (killed by the test)".to_string(), |s| format!("exit {s}")),
            t_kill.elapsed().as_secs_f64()
        );
        ok &= status.is_some_and(|s| !s.success()) && last.contains("ERROR");
    }
    println!(
        "kill test: {}",
        if ok { "PASS (every surviving rank ended with an error within the timeout)" } else { "FAIL" }
    );
    Ok(ok)
}

/// Times one group of sends and receives per size and split: each rank sends (P-1)/P of its
/// bytes, `parts` messages to each peer, by CUDA events on the comm stream after a barrier.
fn links(a: &LinksArgs) -> Res<()> {
    if a.iters == 0 || a.parts.contains(&0) {
        return Err("--iters and every --parts must be at least 1".into());
    }
    let world = a.gpus;
    let cases: Vec<(usize, usize)> = a.mb.iter().flat_map(|&mb| a.parts.iter().map(move |&k| (mb, k))).collect();
    let results = run_cases(world, Duration::from_secs(60), cases.len(), |g, ci| {
        let (mb, parts) = cases[ci];
        let msg = (mb << 20) / world / parts;
        let s = g.backend().stream();
        let peers: Vec<usize> = (0..world).filter(|&p| p != g.rank()).collect();
        let bufs = |n: usize| (0..n).map(|_| GpuBuf::alloc(s, DType::BF16, msg / 2)).collect::<Result<Vec<_>>>();
        let sends = bufs(peers.len() * parts)?;
        let mut recvs = bufs(peers.len() * parts)?;
        let mut times = Vec::new();
        for i in 0..3 + a.iters {
            g.comm().wait_stream(s)?;
            g.comm().barrier()?;
            let t0 = g.backend().record(Lane::Comm, true)?;
            let send: Vec<(usize, &GpuBuf)> = sends.iter().enumerate().map(|(j, b)| (peers[j / parts], b)).collect();
            let mut recv: Vec<(usize, &mut GpuBuf)> =
                recvs.iter_mut().enumerate().map(|(j, b)| (peers[j / parts], b)).collect();
            // SAFETY: the host waits for the comm stream (t1) before the next use of the
            // buffers, and they are dropped only after the loop.
            unsafe { g.comm().group(&send, &mut recv)? };
            let t1 = g.backend().record(Lane::Comm, true)?;
            g.comm().wait_event(&t1)?;
            if i >= 3 {
                times.push(g.backend().elapsed_ms(&t0, &t1)?);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    });
    let mut rows = Vec::new();
    for ((mb, parts), r) in cases.iter().zip(results) {
        let ms = r?.into_iter().fold(0.0, f64::max);
        let sent = ((*mb << 20) / world / parts * parts * (world - 1)) as f64;
        println!(
            "[links] {mb:>5} MB per rank, {parts} message(s) a peer: {ms:.3} ms, {:.0} GB/s sent per rank",
            sent / ms / 1e6
        );
        rows.push(json!({"mb_per_rank": mb, "parts": parts, "ms": ms, "send_gb_per_s": sent / ms / 1e6}));
    }
    if let Some(out) = &a.out {
        let doc = json!({"device": device_name(), "gpus": world, "rows": rows});
        std::fs::write(out, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// `{"mask", "causal" (inside each document), "lens": {seq: [len, ...]}}`.
fn doc_lens(a: &DocLensArgs) -> Res<serde_json::Value> {
    let causal = match &a.mask {
        MaskSpec::Documents { kind, .. } | MaskSpec::RandomDocuments { kind, .. } => *kind == DocKind::Causal,
        other => {
            return Err(format!(
                "mask '{other}' is not packed documents (docs, docs-causal, docs-random, docs-random-causal)"
            )
            .into())
        }
    };
    let mut lens = serde_json::Map::new();
    for &n in &a.seqs {
        a.mask.build(n, n)?; // the lengths add up to n
        lens.insert(n.to_string(), json!(a.mask.doc_lens(n)));
    }
    Ok(json!({"mask": a.mask.to_string(), "causal": causal, "lens": lens}))
}

fn main() {
    distattn_nccl::comm::nccl_env_defaults();
    let r: Res<bool> = match <Cli as clap::Parser>::parse() {
        Cli::Bench(a) => bench(&a).map(|_| true),
        Cli::Probe(a) => probe(&a).map(|_| true),
        Cli::Links(a) => links(&a).map(|_| true),
        Cli::DocLens(a) => doc_lens(&a).map(|v| println!("{v}")).map(|_| true),
        Cli::KillTest(a) => kill_test(&a),
        Cli::Worker => worker().map(|_| true),
    };
    match r {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

//! `distattn bench`: forward and backward throughput on the backend present, with a
//! correctness check against the f64 reference first.

use crate::decode_bench::Spread;
use crate::run::BackendArg;
use crate::tensors;
use anyhow::{bail, Result};
use clap::Args;
use distattn::timeline::{Timeline, TimelineRun};
use distattn::{
    Attention, AttnOptions, AttnShape, DType, Execution, HostData, HostTensor, Mask, MaskSpec, Ranks, Strategy,
};
use distattn_cuda::{CudaBackend, CudaElement};
use distattn_nccl::{time_gpu_strategy, GpuBench};
use distattn_testkit::{lse_err, reference, rel_err};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
#[command(after_help = "\
Masks (--mask, repeatable): any spec of `distattn run --help`, or the shorthands
  window  = window:256,0 (causal sliding window of 257 keys)
  docs    = docs-causal with four documents of 1/8, 1/4, 1/8 and 1/2 of the sequence
Throughput follows the FlashAttention convention: forward 4*batch*heads*area*head_dim FLOPs
(area = kept query-key pairs: seq^2 for full, about seq^2/2 for causal), backward 2.5x that.")]
pub struct BenchArgs {
    /// Sequence lengths [CPU default: 1024,4096; CUDA: 4096,16384].
    #[arg(long, value_delimiter = ',')]
    seqs: Vec<usize>,
    /// Masks to time (repeatable).
    #[arg(long = "mask", default_values_t = ["full".to_string(), "causal".to_string(), "window".to_string(), "docs".to_string()])]
    masks: Vec<String>,
    /// Head dimensions [default: 64,128; --cached-prefill: 128, the first given].
    #[arg(long, value_delimiter = ',')]
    head_dims: Vec<usize>,
    /// Storage dtypes [CPU default: f32,bf16; CUDA and --decode: bf16].
    #[arg(long, value_delimiter = ',')]
    dtypes: Vec<DType>,
    /// Query heads [CPU default: 4; CUDA: 16].
    #[arg(long)]
    heads: Option<usize>,
    /// Kernels to time: auto (CUDA when a GPU is present), cpu or cuda.
    // (The values' own descriptions are `run`'s, where auto also depends on the inputs' dtype.)
    #[arg(long, value_enum, default_value_t = BackendArg::Auto, hide_possible_values = true)]
    backend: BackendArg,
    /// Key/value heads (default: as many as query heads; with --decode or --cached-prefill, a
    /// quarter of them where the heads are a multiple of 8).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(..=1_000_000))]
    repeats: usize,
    /// Skip the backward pass.
    #[arg(long)]
    forward_only: bool,
    /// Write the rows as JSON to this file ('-' for standard output).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Random seed of the inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also time context-parallel strategies on this many in-process ranks.
    #[arg(long, default_value_t = 1)]
    world: usize,
    /// Also time context-parallel strategies across this many local GPUs (NCCL; bf16 only):
    /// ranks set up once, inputs generated on the GPUs, each run timed from a barrier to its
    /// end on the slowest rank.
    #[arg(long)]
    gpus: Option<usize>,
    /// With --gpus: write every strategy's per-step timelines (one more run each; with
    /// --decode, of one layer of each spread step) to this file; `distattn timeline FILE --svg
    /// DIR` prints and draws them.
    #[arg(long, value_name = "FILE")]
    timelines: Option<PathBuf>,
    /// Strategies timed when --world or --gpus > 1.
    #[arg(long, value_delimiter = ',', default_values_t = ["ring".parse::<Strategy>().unwrap(), "zigzag".parse().unwrap(), "balanced".parse().unwrap(), "ulysses".parse().unwrap(), "allgather".parse().unwrap(), "dispatch".parse().unwrap()])]
    strategies: Vec<Strategy>,
    /// Time decode attention over a paged KV cache instead: --seqs are the context lengths
    /// (every request of the batch that long; CPU default 4096,32768, CUDA 32768,131072),
    /// --heads/--kv-heads default to 32/8, causal, one step planned and run layer after layer,
    /// with the K/V bytes read per second. With --world P (CPU ranks) or --gpus P (bf16) also
    /// the step over a cache spread over P ranks (pass-q: the queries travel), request i homed
    /// on rank i mod P, and its time against one device's.
    #[arg(long, conflicts_with = "forward_only")]
    decode: bool,
    /// With --decode: query rows per request (1 to 16).
    #[arg(long, default_value_t = 1, requires = "decode")]
    q_rows: usize,
    /// With --decode: tokens per page of the KV cache.
    #[arg(long, default_value_t = 16, requires = "decode", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=distattn::MAX_SEQ_LEN as u64))]
    page_size: usize,
    /// With --decode or --cached-prefill and --world/--gpus: how a request's cache is dealt out
    /// to the ranks (contiguous[:N], zigzag[:N] or pages:N; see `distattn plan --help`)
    /// [default: contiguous].
    #[arg(long)]
    placement: Option<String>,
    /// Time a prefill of --new-tokens per request onto --seqs cached tokens instead, the cache
    /// spread over --world/--gpus ranks by --placement, each query beside its key: with pass-q
    /// and with pass-KV (ring), against one device's flash kernel, and which the planner's
    /// time model picks (and its estimate). --heads/--kv-heads default to 32/8, the first
    /// --head-dims.
    #[arg(long, conflicts_with_all = ["decode", "timelines", "forward_only"], requires = "new_tokens")]
    cached_prefill: bool,
    /// With --cached-prefill: new tokens per request.
    #[arg(long, value_delimiter = ',', requires = "cached_prefill")]
    new_tokens: Vec<usize>,
}

/// One measured row, in the format shared by every distattn benchmark.
#[derive(Serialize, Clone)]
struct Row {
    #[serde(rename = "impl")]
    implementation: String,
    backend: String,
    /// `single` for one kernel call, else the context-parallel strategy.
    strategy: String,
    world: usize,
    pass: String,
    mask: String,
    causal: bool,
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: String,
    ms: f64,
    tflops: f64,
    /// GPUs used (0 on the CPU).
    gpus: usize,
    /// Throughput per GPU (per rank on the CPU).
    tflops_per_gpu: f64,
    /// Per-GPU (per-rank) throughput over the single kernel's in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    scaling_eff: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    device: String,
    date: String,
    commit: String,
    check: String,
    rows: Vec<Row>,
}

fn expand_mask(name: &str, seq: usize) -> Result<MaskSpec> {
    Ok(match name {
        "window" => "window:256,0".parse()?,
        "docs" => {
            let (a, b) = (seq / 8, seq / 4);
            MaskSpec::Documents { lens: vec![a, b, a, seq - 2 * a - b], kind: distattn::mask::DocKind::Causal }
        }
        other => other.parse()?,
    })
}

pub(crate) fn random_tensor(rng: &mut rand::rngs::StdRng, shape: Vec<usize>, dtype: DType) -> HostTensor {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    HostTensor::from_f32(shape, &vals, dtype)
}

pub(crate) fn median_ms(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    median_of(repeats, || {
        let t = Instant::now();
        f()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    })
}

/// Median of `repeats` measurements returned by `f`, after one warm-up call (page faults,
/// thread pool start, kernel compilation).
fn median_of(repeats: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        times.push(f()?);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// Forward and backward of a small GQA causal case against the f64 reference.
fn check(seed: u64, exec: &Execution) -> Result<String> {
    let shape = AttnShape::new(1, 300, 300, 4, 2, 64)?;
    let mask = Mask::causal(300, 300)?;
    let opts = AttnOptions::default();
    let attn = Attention::new(shape, mask.clone())?.on(exec.clone());
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xC0FFEE);
    let mut worst = 0.0f64;
    // Tolerances per dtype as documented in the CPU backend's tests.
    let cases: &[(DType, f64)] = match exec {
        Execution::Cuda(_) => &[(DType::BF16, 1e-2), (DType::F16, 2e-3)],
        _ => &[(DType::F32, 1e-5), (DType::BF16, 1e-2)],
    };
    for &(dtype, tol) in cases {
        let q = random_tensor(&mut rng, vec![1, 300, 4, 64], dtype);
        let k = random_tensor(&mut rng, vec![1, 300, 2, 64], dtype);
        let v = random_tensor(&mut rng, vec![1, 300, 2, 64], dtype);
        let g = random_tensor(&mut rng, vec![1, 300, 4, 64], dtype);
        let fwd = tensors::forward(&attn, &q, &k, &v)?;
        let grads = tensors::backward(&attn, &q, &k, &v, &fwd, &g)?;
        let (rq, rk, rv, rg) = (q.to_f32(), k.to_f32(), v.to_f32(), g.to_f32());
        let rf = reference::forward(&rq, &rk, &rv, &shape, &mask, &opts)?;
        let rb = reference::backward(&rq, &rk, &rv, &rg, &shape, &mask, &opts)?;
        for (name, e) in [
            ("o", rel_err(&fwd.o, &rf.o)),
            ("lse", lse_err(&fwd.lse, &rf.lse)),
            ("dq", rel_err(&grads.dq, &rb.dq)),
            ("dk", rel_err(&grads.dk, &rb.dk)),
            ("dv", rel_err(&grads.dv, &rb.dv)),
        ] {
            if e.is_nan() || e > tol {
                bail!("self-check failed: {dtype} {name} relative error {e:.2e} exceeds {tol:.0e}");
            }
            worst = worst.max(e / tol);
        }
    }
    Ok(format!(
        "self-check on {} vs f64 reference (seq 300, causal, 4 q / 2 kv heads, d 64): O, LSE, dQ, dK, dV within tolerance ({}; worst at {:.0}% of it)",
        exec.describe(),
        cases.iter().map(|(d, t)| format!("{d} {t:.0e}")).collect::<Vec<_>>().join(", "),
        worst * 100.0
    ))
}

pub(crate) fn cpu_name() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("cpu: {model}, {} threads", rayon::current_num_threads())
}

/// The commit measured: `DISTATTN_COMMIT` when set (a copied tree's git may be stale), else git's.
fn commit() -> String {
    if let Ok(c) = std::env::var("DISTATTN_COMMIT") {
        return c;
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// The results table, printed a configuration at a time as each finishes: on standard output,
/// or on standard error when the JSON report takes standard output (`--json -`). Throughput is
/// in GFLOP/s on the CPU and TFLOP/s on GPUs; the efficiency column appears only when ranks
/// are timed.
struct Table {
    to_stderr: bool,
    /// Divide FLOP/s by this for the unit in `unit`.
    scale: f64,
    unit: &'static str,
    /// The efficiency column's title, when ranks are timed.
    ranks: Option<&'static str>,
}

impl Table {
    fn new(to_stderr: bool, gpu: bool, ranks: Option<&'static str>) -> Table {
        let (scale, unit) = if gpu { (1e12, "TFLOP/s") } else { (1e9, "GFLOP/s") };
        Table { to_stderr, scale, unit, ranks }
    }

    fn header(&self) -> String {
        let mut line = format!(
            "{:<7} {:<12} {:<5} {:<22} {:>6} {:>5} {:>4} {:>10} {:>12} {:>10} {:>12}",
            "backend",
            "strategy",
            "dtype",
            "mask",
            "seq",
            "heads",
            "d",
            "fwd ms",
            format!("fwd {}", self.unit),
            "bwd ms",
            format!("bwd {}", self.unit),
        );
        if let Some(title) = self.ranks {
            line += &format!(" {title:>13}");
        }
        line
    }

    /// One line per forward row of `rows` (one configuration), with its backward beside it.
    fn lines(&self, rows: &[Row]) -> Vec<String> {
        let rate = |flops_per_s: f64| format!("{:.1}", flops_per_s / self.scale);
        // Three significant digits: GPU kernels take fractions of a millisecond.
        let ms = |t: f64| match t {
            t if t < 1.0 => format!("{t:.3}"),
            t if t < 10.0 => format!("{t:.2}"),
            t => format!("{t:.1}"),
        };
        rows.iter()
            .filter(|r| r.pass == "fwd")
            .map(|fwd| {
                let bwd = rows.iter().find(|r| r.pass == "bwd" && r.strategy == fwd.strategy && r.world == fwd.world);
                let (bms, brate) = bwd.map_or(("-".into(), "-".into()), |b| (ms(b.ms), rate(b.tflops * 1e12)));
                let mut mask = fwd.mask.clone();
                if mask.len() > 22 {
                    mask.truncate(19);
                    mask.push_str("...");
                }
                let mut line = format!(
                    "{:<7} {:<12} {:<5} {:<22} {:>6} {:>5} {:>4} {:>10} {:>12} {:>10} {:>12}",
                    fwd.backend,
                    if fwd.world > 1 { format!("{}x{}", fwd.strategy, fwd.world) } else { fwd.strategy.clone() },
                    fwd.dtype,
                    mask,
                    fwd.seq,
                    fwd.heads,
                    fwd.head_dim,
                    ms(fwd.ms),
                    rate(fwd.tflops * 1e12),
                    bms,
                    brate,
                );
                if self.ranks.is_some() {
                    // Per-rank throughput against the single kernel's, fwd / bwd.
                    let pct = |r: Option<&Row>| {
                        r.and_then(|r| r.scaling_eff).map_or("-".to_string(), |e| format!("{:.0}%", 100.0 * e))
                    };
                    let eff = if fwd.world > 1 { format!("{} / {}", pct(Some(fwd)), pct(bwd)) } else { "-".into() };
                    line += &format!(" {eff:>13}");
                }
                line
            })
            .collect()
    }

    /// Prints `line` where the table goes, out of the progress bar's way.
    fn print(&self, bar: &ProgressBar, line: &str) {
        bar.suspend(|| {
            if self.to_stderr {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
        });
    }
}

/// One configuration to time: the problem (shape, mask, where it runs) and its inputs.
struct Timed<'a> {
    attn: &'a Attention,
    q: &'a HostTensor,
    k: &'a HostTensor,
    v: &'a HostTensor,
    d_o: &'a HostTensor,
}

/// Forward and backward of one configuration on the GPU, on device buffers uploaded once.
fn time_cuda<T: CudaElement>(
    gpu: &CudaBackend,
    attn: &Attention,
    [q, k, v, g]: [&[T]; 4],
    repeats: usize,
    backward: bool,
) -> Result<(f64, Option<f64>)> {
    let (shape, mask, opts) = (attn.shape(), attn.mask(), attn.options());
    let s = gpu.stream();
    let (dq, dk, dv, dg) = (s.clone_htod(q)?, s.clone_htod(k)?, s.clone_htod(v)?, s.clone_htod(g)?);
    let mut o = s.alloc_zeros::<T>(shape.q_elems())?;
    let mut lse = s.alloc_zeros::<f32>(shape.lse_elems())?;
    let fwd = median_ms(repeats, || {
        gpu.forward(&dq, &dk, &dv, shape, mask, opts, &mut o, &mut lse, None)?;
        Ok(gpu.synchronize()?)
    })?;
    if !backward {
        return Ok((fwd, None));
    }
    let mut gq = s.alloc_zeros::<T>(shape.q_elems())?;
    let mut gk = s.alloc_zeros::<T>(shape.kv_elems())?;
    let mut gv = s.alloc_zeros::<T>(shape.kv_elems())?;
    let bwd = median_ms(repeats, || {
        gpu.backward(&dq, &dk, &dv, &o, &lse, &dg, shape, mask, opts, &mut gq, &mut gk, &mut gv)?;
        Ok(gpu.synchronize()?)
    })?;
    Ok((fwd, Some(bwd)))
}

/// The GPU ranks' timing of `r`'s strategy and plan: `repeats` runs (and with `timeline` one more,
/// recorded), forward and with `backward` backward.
pub(crate) fn gpu_bench(r: &Ranks, backward: bool, repeats: usize, timeline: bool) -> GpuBench {
    GpuBench {
        strategy: r.strategy,
        world: r.world,
        first_gpu: r.first_gpu,
        plan: r.plan.clone(),
        timeout: r.timeout,
        backward,
        repeats,
        timeline,
        runs: 1,
    }
}

/// Times forward (and backward unless `forward_only`) of one configuration; milliseconds, and
/// with `timeline` the GPU ranks' timelines of one more run.
fn time_exec(
    t: &Timed<'_>,
    repeats: usize,
    forward_only: bool,
    timeline: bool,
) -> Result<(f64, Option<f64>, Vec<Timeline>)> {
    let attn = t.attn;
    match attn.execution() {
        Execution::GpuRanks(r) => {
            // Ranks, communicators and plans set up once; inputs generated on the GPUs.
            let g = time_gpu_strategy(
                &gpu_bench(r, !forward_only, repeats, timeline),
                attn.shape(),
                attn.mask(),
                attn.options(),
            )?;
            return Ok((g.fwd_ms, g.bwd_ms, g.timelines));
        }
        Execution::Cuda(gpu) => {
            let (f, b) = match (&t.q.data, &t.k.data, &t.v.data, &t.d_o.data) {
                (HostData::BF16(q), HostData::BF16(k), HostData::BF16(v), HostData::BF16(g)) => {
                    time_cuda(gpu, attn, [q, k, v, g], repeats, !forward_only)?
                }
                (HostData::F16(q), HostData::F16(k), HostData::F16(v), HostData::F16(g)) => {
                    time_cuda(gpu, attn, [q, k, v, g], repeats, !forward_only)?
                }
                _ => bail!("the cuda backend takes bf16 or f16, not {}", t.q.dtype()),
            };
            return Ok((f, b, Vec::new()));
        }
        _ => {}
    }
    let mut fwd = None;
    let fwd_ms = median_ms(repeats, || {
        fwd = Some(tensors::forward(attn, t.q, t.k, t.v)?);
        Ok(())
    })?;
    let Some(fwd) = fwd.filter(|_| !forward_only) else { return Ok((fwd_ms, None, Vec::new())) };
    let bwd_ms = median_ms(repeats, || {
        tensors::backward(attn, t.q, t.k, t.v, &fwd, t.d_o)?;
        Ok(())
    })?;
    Ok((fwd_ms, Some(bwd_ms), Vec::new()))
}

pub fn bench(mut args: BenchArgs) -> Result<()> {
    // Where the ranks run, checked before any work (the decode bench spreads its cache on them).
    let gpus = args.gpus.unwrap_or(0);
    if args.gpus == Some(0) {
        bail!("--gpus must be at least 1");
    }
    if gpus > 0 && args.world > 1 {
        bail!("--world times in-process CPU ranks and --gpus local GPUs: pass one of them");
    }
    if gpus > 0 && args.backend == BackendArg::Cpu {
        bail!("--gpus runs on the GPUs: drop --backend cpu");
    }
    if args.timelines.is_some() && gpus < 2 {
        bail!("--timelines records runs across GPUs: add --gpus N (N >= 2)");
    }
    // The reports are written at the end: a path that cannot take them fails now, not then.
    let json = args.json.as_deref().filter(|p| p.as_os_str() != "-").map(|p| ("json", p));
    let timelines = args.timelines.as_deref().map(|p| ("timelines", p));
    crate::run::check_report_paths(&json.into_iter().chain(timelines).collect::<Vec<_>>())?;
    if gpus > 0 {
        let found = distattn_cuda::gpu_count();
        if found < gpus {
            bail!("--gpus {gpus} needs {gpus} CUDA GPUs; {found} found");
        }
    }
    // In-process ranks run on the CPU, and so does the single call they are compared with.
    if args.world > 1 && args.backend == BackendArg::Auto {
        args.backend = BackendArg::Cpu;
    }
    if args.placement.is_some() && !(args.decode || args.cached_prefill) {
        bail!("--placement places a serving cache: add --decode or --cached-prefill");
    }
    let spread = Spread::from_args(gpus, args.world, args.placement.take().unwrap_or_else(|| "contiguous".into()))?;
    // The serving benches default to 32 query heads, GQA 4:1 where the heads allow.
    let serving_heads = args.heads.unwrap_or(32);
    let serving_kv_heads =
        args.kv_heads.unwrap_or(if serving_heads.is_multiple_of(8) { serving_heads / 4 } else { serving_heads });
    if args.cached_prefill {
        let Some(spread) = spread else {
            bail!("--cached-prefill spreads the cache: add --gpus N or --world N (N >= 2)")
        };
        let gpu = match args.backend.execution(DType::BF16)? {
            Execution::Cuda(g) => Some(g),
            _ => None,
        };
        return crate::cached_prefill::run(crate::cached_prefill::CachedPrefill {
            cached: if args.seqs.is_empty() { vec![131072] } else { args.seqs },
            new_tokens: args.new_tokens,
            batch: args.batch,
            heads: serving_heads,
            kv_heads: serving_kv_heads,
            head_dim: args.head_dims.first().copied().unwrap_or(128),
            gpu,
            spread,
            repeats: args.repeats,
            json: args.json,
            seed: args.seed,
        });
    }
    if args.head_dims.is_empty() {
        args.head_dims = vec![64, 128];
    }
    if args.decode {
        let gpu = args.backend != BackendArg::Cpu && distattn_cuda::cuda_available();
        if args.seqs.is_empty() {
            args.seqs = if gpu { vec![32768, 131072] } else { vec![4096, 32768] };
        }
        if args.dtypes.is_empty() {
            args.dtypes = vec![DType::BF16];
        }
        return crate::decode_bench::run(crate::decode_bench::DecodeBench {
            lengths: args.seqs,
            batch: args.batch,
            q_rows: args.q_rows,
            heads: serving_heads,
            kv_heads: serving_kv_heads,
            head_dims: args.head_dims,
            dtypes: args.dtypes,
            page_size: args.page_size,
            backend: args.backend,
            repeats: args.repeats,
            json: args.json,
            seed: args.seed,
            spread,
            timelines: args.timelines,
        });
    }
    let single = args.backend.execution(DType::BF16)?;
    let gpu = matches!(single, Execution::Cuda(_));
    let pick = |given: &mut Vec<usize>, cpu: &[usize], cuda: &[usize]| {
        if given.is_empty() {
            *given = if gpu { cuda.to_vec() } else { cpu.to_vec() };
        }
    };
    pick(&mut args.seqs, &[1024, 4096], &[4096, 16384]);
    if args.dtypes.is_empty() {
        args.dtypes = if gpu { vec![DType::BF16] } else { vec![DType::F32, DType::BF16] };
    }
    let heads = args.heads.unwrap_or(if gpu { 16 } else { 4 });
    let kv_heads = args.kv_heads.unwrap_or(heads);
    let device = match &single {
        Execution::Cuda(g) if gpus > 1 => format!("cuda: {} x {gpus}", g.device_name()),
        Execution::Cuda(g) => format!("cuda: {}", g.device_name()),
        _ => cpu_name(),
    };
    eprintln!("{device}");
    let check = check(args.seed, &single)?;
    eprintln!("{check}");
    let mut configs = Vec::new();
    for &seq in &args.seqs {
        for name in &args.masks {
            let spec = expand_mask(name, seq)?;
            for &d in &args.head_dims {
                for &dtype in &args.dtypes {
                    configs.push((seq, spec.clone(), d, dtype));
                }
            }
        }
    }
    let to_stderr = args.json.as_ref().is_some_and(|p| p.as_os_str() == "-");
    let eff_title = if gpus > 0 {
        Some("per-GPU eff")
    } else if args.world > 1 {
        Some("per-rank eff")
    } else {
        None
    };
    let table = Table::new(to_stderr, gpu || gpus > 0, eff_title);
    if args.world > 1 && !gpu {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if args.world > cores {
            eprintln!(
                "note: {} ranks share {cores} cores here, so a rank runs at a fraction of one core: the per-rank \
                 efficiency measures that sharing, not the strategy's scaling",
                args.world
            );
        }
    }
    // On a terminal a progress bar; otherwise (a log, CI) one plain line per configuration.
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new(configs.len() as u64);
        bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed_precise} {msg}")?);
        bar
    } else {
        ProgressBar::hidden()
    };
    table.print(&bar, &table.header());
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut rows = Vec::new();
    let mut timelines = Vec::new();
    let started = Instant::now();
    let n_configs = configs.len();
    for (i, (seq, spec, d, dtype)) in configs.into_iter().enumerate() {
        let what = format!("{dtype} {spec} seq {seq} d {d}");
        if bar.is_hidden() {
            eprintln!("[{}/{n_configs}, {:.0} s] {what}", i + 1, started.elapsed().as_secs_f64());
        }
        bar.set_message(what);
        let first_row = rows.len();
        let shape = AttnShape::new(args.batch, seq, seq, heads, kv_heads, d)?;
        let mask = spec.build(seq, seq)?;
        let q = random_tensor(&mut rng, vec![args.batch, seq, heads, d], dtype);
        let k = random_tensor(&mut rng, vec![args.batch, seq, kv_heads, d], dtype);
        let v = random_tensor(&mut rng, vec![args.batch, seq, kv_heads, d], dtype);
        let flops = 4.0 * (args.batch * heads) as f64 * mask.area() as f64 * d as f64;
        let g = random_tensor(&mut rng, vec![args.batch, seq, heads, d], dtype);
        let ranks = |world, strategy| Ranks {
            plan: distattn::PlanOptions { documents: spec.doc_lens(seq), ..Default::default() },
            ..Ranks::new(world, strategy)
        };
        let mut execs = vec![single.clone()];
        if args.world > 1 {
            execs.extend(args.strategies.iter().map(|&s| Execution::CpuRanks(ranks(args.world, s))));
        }
        if gpus > 0 && dtype == DType::BF16 {
            execs.extend(args.strategies.iter().map(|&s| Execution::GpuRanks(ranks(gpus, s))));
        }
        let mut single_tflops: Option<(f64, Option<f64>)> = None;
        for exec in execs {
            let (backend, strategy, world, n_gpus) = match &exec {
                Execution::Cuda(_) => ("cuda", "single".to_string(), 1, 1),
                Execution::CpuRanks(r) => ("cpu", r.strategy.to_string(), r.world, 0),
                Execution::GpuRanks(r) => ("cuda", r.strategy.to_string(), r.world, r.world),
                _ => ("cpu", "single".to_string(), 1, 0),
            };
            let attn = Attention::new(shape, mask.clone())?.on(exec);
            let problem = Timed { attn: &attn, q: &q, k: &k, v: &v, d_o: &g };
            let timed = time_exec(&problem, args.repeats, args.forward_only, args.timelines.is_some());
            let (fwd_ms, bwd_ms, ranks) = match timed {
                Ok(t) => t,
                // A strategy that cannot serve this shape (e.g. Ulysses with heads not divisible
                // by the world size) is reported and skipped; other errors end the run.
                Err(e) if matches!(e.downcast_ref::<distattn::Error>(), Some(distattn::Error::Unsupported { .. })) => {
                    bar.println(format!("skipped {strategy}: {e}"));
                    continue;
                }
                Err(e) => return Err(e),
            };
            if !ranks.is_empty() {
                let pass = if args.forward_only { "fwd" } else { "fwd+bwd" }.to_string();
                timelines.push(TimelineRun {
                    strategy: strategy.clone(),
                    seq,
                    pass,
                    mask: spec.to_string(),
                    ranks,
                    ..Default::default()
                });
            }
            let row = Row {
                implementation: "distattn".into(),
                backend: backend.into(),
                strategy,
                world,
                pass: "fwd".into(),
                mask: spec.to_string(),
                causal: spec.is_causal(),
                batch: args.batch,
                seq,
                heads,
                kv_heads,
                head_dim: d,
                dtype: dtype.to_string(),
                ms: fwd_ms,
                tflops: flops / fwd_ms / 1e9,
                gpus: n_gpus,
                tflops_per_gpu: flops / fwd_ms / 1e9 / world as f64,
                scaling_eff: None,
            };
            let bwd = bwd_ms.map(|ms| Row {
                pass: "bwd".into(),
                ms,
                tflops: 2.5 * flops / ms / 1e9,
                tflops_per_gpu: 2.5 * flops / ms / 1e9 / world as f64,
                ..row.clone()
            });
            match single_tflops {
                None => single_tflops = Some((row.tflops, bwd.as_ref().map(|b| b.tflops))),
                Some((f, b)) => {
                    rows.push(Row { scaling_eff: Some(row.tflops_per_gpu / f), ..row });
                    if let (Some(bwd), Some(b)) = (bwd, b) {
                        rows.push(Row { scaling_eff: Some(bwd.tflops_per_gpu / b), ..bwd });
                    }
                    continue;
                }
            }
            rows.push(row);
            rows.extend(bwd);
        }
        for line in table.lines(&rows[first_row..]) {
            table.print(&bar, &line);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(path) = &args.timelines {
        std::fs::write(path, serde_json::to_string(&timelines)?)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let path = path.display();
        eprintln!("timelines of {} runs in {path} (distattn timeline {path} --svg DIR draws them)", timelines.len());
    }
    if let Some(path) = &args.json {
        let report = Report {
            device,
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            commit: commit(),
            check,
            rows,
        };
        let text = serde_json::to_string_pretty(&report)?;
        if path.as_os_str() == "-" {
            println!("{text}");
        } else {
            std::fs::write(path, text + "\n").map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}

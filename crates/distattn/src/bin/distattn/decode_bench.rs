//! `distattn bench --decode`: decode attention over a paged KV cache, one step planned and then
//! run as one layer after another, with the bytes of K and V read per second; with
//! `--world P` / `--gpus P` also the same step over a KV cache spread over P ranks
//! (DistAttention: a pass-q plan, so the queries travel and the cache stays).

use crate::run::BackendArg;
use crate::tensors;
use anyhow::{bail, Result};
use distattn::decode::{decode, DecodeOptions, DecodeShape};
use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
use distattn::timeline::{Timeline, TimelineRun};
use distattn::{Attention, DType, Element, Execution, HostTensor, PlanOptions, Ranks, Strategy};
use distattn_cuda::decode::DecodeBuffers;
use distattn_cuda::{CudaBackend, CudaElement};
use distattn_nccl::{time_gpu_strategy, GpuBench};
use distattn_testkit::decode::{reference, DecodeCase};
use distattn_testkit::{cast, lse_err, rel_err};
use half::{bf16, f16};
use rand::SeedableRng;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// What `distattn bench --decode` measures.
pub struct DecodeBench {
    pub lengths: Vec<usize>,
    pub batch: usize,
    pub q_rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dims: Vec<usize>,
    pub dtypes: Vec<DType>,
    pub page_size: usize,
    pub backend: BackendArg,
    pub repeats: usize,
    pub json: Option<PathBuf>,
    pub seed: u64,
    /// The step also over a cache spread over ranks.
    pub spread: Option<Spread>,
    /// Write the GPU ranks' timelines of one layer of each spread step here.
    pub timelines: Option<PathBuf>,
}

/// A decode step over a KV cache spread over `ranks` ranks: in-process CPU ranks, or local
/// GPUs with NCCL. Request `i` is homed on rank `i mod ranks`; its cache is dealt out by
/// `placement` (a `KvPlacement::from_spec` spec).
pub struct Spread {
    pub ranks: usize,
    pub on_gpus: bool,
    pub placement: String,
}

impl Spread {
    /// The ranks `--gpus G` (G > 1) or else `--world W` (W > 1) spread a cache over, placed by
    /// `placement` (checked now, before any work); `None` for one device.
    pub fn from_args(gpus: usize, world: usize, placement: String) -> Result<Option<Spread>> {
        let (ranks, on_gpus) = match (gpus, world) {
            (g, _) if g > 1 => (g, true),
            (_, w) if w > 1 => (w, false),
            _ => return Ok(None),
        };
        KvPlacement::from_spec(&placement, 1, ranks)?;
        Ok(Some(Spread { ranks, on_gpus, placement }))
    }
}

#[derive(Serialize)]
struct Row {
    backend: String,
    /// `single` (one device, the paged decode kernel) or `pass-q` (the cache spread over ranks).
    strategy: String,
    /// Devices (CPU ranks or GPUs) the step ran on.
    ranks: usize,
    /// The spread cache's placement.
    #[serde(skip_serializing_if = "Option::is_none")]
    placement: Option<String>,
    batch: usize,
    context: usize,
    q_rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
    dtype: String,
    /// Milliseconds per layer (the step planned once).
    ms: f64,
    /// K and V bytes read per second (all ranks together).
    gb_per_s: f64,
    /// One device's time over `ranks` times this one's (where one device's was measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    scaling_eff: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    device: String,
    check: String,
    rows: Vec<Row>,
}

/// Layers timed back to back, one device's and a spread cache's alike: what one layer of a
/// decode step costs while the host does not wait between layers.
const LAYERS: usize = 20;

/// Median milliseconds of `f` over `repeats` runs after a warm-up.
fn median(repeats: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    f()?;
    let mut t: Vec<f64> = (0..repeats.max(1)).map(|_| f()).collect::<Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// A ragged paged batch (shuffled pages, one request without keys) against the f64 reference.
fn check(gpu: Option<&CudaBackend>, seed: u64) -> Result<String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let shape = DecodeShape::new(4, 2, 8, 2, 64)?;
    let case = DecodeCase::random(&mut rng, shape, 16, &[700, 0, 33, 1500]);
    let opts = DecodeOptions { causal: true, ..Default::default() };
    let (q, k, v) = (cast::<bf16>(&case.q), cast::<bf16>(&case.k_cache), cast::<bf16>(&case.v_cache));
    let out = match gpu {
        Some(g) => g.decode_host(&q, &case.cache(&k, &v), &shape, &opts)?,
        None => decode(&q, &case.cache(&k, &v), &shape, &opts, 7)?,
    };
    let (ro, rl) = reference(&case, &q, &k, &v, &opts);
    let (eo, el) = (rel_err(&out.o, &ro), lse_err(&out.lse, &rl));
    let tol = if gpu.is_some() { (1e-2, 1e-3) } else { (1e-2, 1e-5) };
    anyhow::ensure!(eo < tol.0 && el < tol.1, "decode check failed: O error {eo:.1e}, LSE error {el:.1e}");
    Ok(format!(
        "check (bf16 ragged paged batch, GQA 8/2, 2 query rows, causal) vs f64: O rel err {eo:.1e}, LSE {el:.1e}"
    ))
}

/// One GPU's decode of `shape`, every request `context` keys long, on a cache of random values
/// made on the GPU (pages in order), one layer's milliseconds.
fn time_gpu<T: CudaElement>(
    gpu: &CudaBackend,
    shape: &DecodeShape,
    page_size: usize,
    context: usize,
    opts: &DecodeOptions,
    repeats: usize,
) -> Result<f64> {
    let step = DecodeBuffers::<T>::random(gpu, shape, page_size, &vec![context; shape.batch], opts, 7)?;
    step.plan(gpu)?;
    // Layers back to back between two events.
    let st = gpu.stream();
    let flags = Some(distattn_cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    median(repeats, || {
        let a = st.record_event(flags)?;
        for _ in 0..LAYERS {
            step.run(gpu)?;
        }
        let b = st.record_event(flags)?;
        Ok(a.elapsed_ms(&b)? as f64 / LAYERS as f64)
    })
}

fn time_cpu<T: Element>(case: &DecodeCase, opts: &DecodeOptions, repeats: usize) -> Result<f64> {
    let (q, k, v) = (cast::<T>(&case.q), cast::<T>(&case.k_cache), cast::<T>(&case.v_cache));
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    median(repeats, || {
        let t = Instant::now();
        decode(&q, &case.cache(&k, &v), &case.shape, opts, workers)?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    })
}

/// One decode step of `requests` over a cache spread over `s.ranks` ranks, as the attention
/// problem the interpreter runs (a pass-q plan over the placed layout).
fn spread_step(s: &Spread, requests: &[StepRequest], heads: usize, kv_heads: usize, d: usize) -> Result<Attention> {
    let capacity = requests.iter().map(|r| r.cached + r.new).max().unwrap_or(1).max(1);
    let placement = KvPlacement::from_spec(&s.placement, capacity, s.ranks)?;
    let step = ServingStep::new(&placement, requests, Queries::AtHome, heads, kv_heads, d)?;
    let ranks = Ranks {
        plan: PlanOptions { layout: Some(step.layout.clone()), ..Default::default() },
        ..Ranks::new(s.ranks, Strategy::PassQ)
    };
    let exec = if s.on_gpus { Execution::GpuRanks(ranks) } else { Execution::CpuRanks(ranks) };
    Ok(Attention::new(step.shape, step.mask)?.on(exec))
}

pub(crate) fn random_inputs(rng: &mut rand::rngs::StdRng, attn: &Attention, dtype: DType) -> [HostTensor; 3] {
    let sh = attn.shape();
    let t = |rng: &mut rand::rngs::StdRng, rows, heads| {
        crate::bench::random_tensor(rng, vec![sh.batch, rows, heads, sh.head_dim], dtype)
    };
    [t(rng, sh.q_len, sh.heads), t(rng, sh.k_len, sh.kv_heads), t(rng, sh.k_len, sh.kv_heads)]
}

/// A ragged decode batch (homes on different ranks, one request without cached keys) over the
/// spread cache against the f64 reference.
fn check_spread(s: &Spread, seed: u64) -> Result<String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5EED);
    let p = s.ranks;
    let requests: Vec<StepRequest> = [700, 0, 33, 1500]
        .iter()
        .enumerate()
        .map(|(i, &cached)| StepRequest { home: (i * 3) % p, cached, new: 1 })
        .collect();
    let attn = spread_step(s, &requests, 8, 2, 64)?;
    let dtypes: &[(DType, f64)] =
        if s.on_gpus { &[(DType::BF16, 1e-2)] } else { &[(DType::F32, 1e-5), (DType::BF16, 1e-2)] };
    let mut errs = Vec::new();
    for &(dtype, tol) in dtypes {
        let [q, k, v] = random_inputs(&mut rng, &attn, dtype);
        let got = tensors::forward(&attn, &q, &k, &v)?;
        let want = distattn_testkit::reference::forward(
            &q.to_f32(),
            &k.to_f32(),
            &v.to_f32(),
            attn.shape(),
            attn.mask(),
            attn.options(),
        )?;
        let (eo, el) = (rel_err(&got.o, &want.o), lse_err(&got.lse, &want.lse));
        anyhow::ensure!(
            eo <= tol && el <= 1e-3,
            "spread decode check failed: {dtype} O error {eo:.1e}, LSE error {el:.1e}"
        );
        errs.push(format!("{dtype} O rel err {eo:.1e}, LSE {el:.1e}"));
    }
    Ok(format!(
        "check (decode batch of 4 over a cache spread over {p} {}, {}, pass-q) vs f64: {}",
        if s.on_gpus { "GPUs" } else { "CPU ranks" },
        s.placement,
        errs.join("; ")
    ))
}

/// Median milliseconds of one spread step: on GPUs `runs` steps issued back to back (the host
/// not waiting between them) from a barrier to the slowest rank's end, over `runs`, inputs
/// generated on the GPUs, and with `timeline` every rank's timeline of one more step alone; on
/// CPU ranks around one whole call.
pub(crate) fn time_spread(
    attn: &Attention,
    dtype: DType,
    repeats: usize,
    runs: usize,
    timeline: bool,
    rng: &mut rand::rngs::StdRng,
) -> Result<(f64, Vec<Timeline>)> {
    match attn.execution() {
        Execution::GpuRanks(r) => {
            if dtype != DType::BF16 {
                bail!("--decode --gpus times bf16 caches, not {dtype}");
            }
            let bench = GpuBench { runs, ..crate::bench::gpu_bench(r, false, repeats, timeline) };
            let t = time_gpu_strategy(&bench, attn.shape(), attn.mask(), attn.options())?;
            Ok((t.fwd_ms, t.timelines))
        }
        _ => {
            let [q, k, v] = random_inputs(rng, attn, dtype);
            let ms = median(repeats, || {
                let t = Instant::now();
                tensors::forward(attn, &q, &k, &v)?;
                Ok(t.elapsed().as_secs_f64() * 1e3)
            })?;
            Ok((ms, Vec::new()))
        }
    }
}

/// The host's available memory (Linux: MemAvailable of /proc/meminfo), bytes.
fn host_memory_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn run(a: DecodeBench) -> Result<()> {
    if a.lengths.iter().any(|&c| c < a.q_rows) {
        bail!("every context length (--seqs) must hold the step's {} new tokens (--q-rows)", a.q_rows);
    }
    // Sizes checked before any buffer is made from them (an overflowing product would panic, a
    // huge one allocate first).
    let max = distattn::MAX_SEQ_LEN;
    if let Some(c) = a.lengths.iter().find(|&&c| c > max) {
        bail!("--seqs {c}: longer than {max} tokens");
    }
    for &c in &a.lengths {
        for &d in &a.head_dims {
            let cache = c.div_ceil(a.page_size).checked_mul(a.page_size).and_then(|t| t.checked_mul(a.batch));
            let elems = cache
                .and_then(|t| t.checked_mul(a.kv_heads))
                .and_then(|t| t.checked_mul(d))
                .filter(|&e| e <= isize::MAX as usize / 16);
            let q = a.batch.checked_mul(a.q_rows).and_then(|r| r.checked_mul(a.heads)).and_then(|r| r.checked_mul(d));
            if elems.is_none() || q.is_none() {
                bail!("--batch {} x --seqs {c} (pages of {}) x head dim {d}: too large to hold", a.batch, a.page_size);
            }
        }
    }
    let exec = a.backend.execution(DType::BF16)?;
    let gpu = match &exec {
        Execution::Cuda(g) => Some(g.clone()),
        _ => None,
    };
    let device = match (&gpu, &a.spread) {
        (Some(g), Some(s)) if s.on_gpus => format!("cuda: {} x {}", g.device_name(), s.ranks),
        (Some(g), _) => format!("cuda: {}", g.device_name()),
        (None, _) => crate::bench::cpu_name(),
    };
    eprintln!("{device}");
    let mut check = check(gpu.as_deref(), a.seed)?;
    eprintln!("{check}");
    if let Some(s) = &a.spread {
        let c = check_spread(s, a.seed)?;
        eprintln!("{c}");
        check = format!("{check}; {c}");
    }
    let to_stderr = a.json.as_ref().is_some_and(|p| p.as_os_str() == "-");
    let say = |line: String| if to_stderr { eprintln!("{line}") } else { println!("{line}") };
    say(format!(
        "{:<8} {:<7} {:>5} {:>5} {:>9} {:>6} {:>9} {:>4} {:>5} {:<5} {:>10} {:>8} {:>6}",
        "backend",
        "strat",
        "ranks",
        "batch",
        "context",
        "q_rows",
        "heads",
        "d",
        "page",
        "dtype",
        "ms/layer",
        "GB/s",
        "eff"
    ));
    let print = |r: &Row| {
        say(format!(
            "{:<8} {:<7} {:>5} {:>5} {:>9} {:>6} {:>9} {:>4} {:>5} {:<5} {:>10.4} {:>8.1} {:>6}",
            r.backend,
            r.strategy,
            r.ranks,
            r.batch,
            r.context,
            r.q_rows,
            format!("{}/{}", r.heads, r.kv_heads),
            r.head_dim,
            r.page_size,
            r.dtype,
            r.ms,
            r.gb_per_s,
            r.scaling_eff.map_or(String::new(), |e| format!("{:.0}%", e * 100.0))
        ))
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let opts = DecodeOptions { causal: true, ..Default::default() };
    let mut rows = Vec::new();
    let mut timelines = Vec::new();
    for &context in &a.lengths {
        for &d in &a.head_dims {
            let shape = DecodeShape::new(a.batch, a.q_rows, a.heads, a.kv_heads, d)?;
            // One CPU's case is generated on the host (f32, then cast): beside a spread cache, a
            // context too large for this host's memory is timed spread only. A GPU makes its own.
            let host_bytes = 2 * a.batch * context * a.kv_heads * d * (4 + 4);
            let case = match (&a.spread, host_memory_available()) {
                _ if gpu.is_some() => None,
                (Some(_), Some(avail)) if host_bytes > avail / 2 => {
                    eprintln!(
                        "one device, context {context}: its inputs ({:.0} GB) are built on the host, which has {:.0} GB \
                         available: timed spread only",
                        host_bytes as f64 / 1e9,
                        avail as f64 / 1e9
                    );
                    None
                }
                _ => Some(DecodeCase::random(&mut rng, shape, a.page_size, &vec![context; a.batch])),
            };
            for &dtype in &a.dtypes {
                let single = match (&gpu, dtype, &case) {
                    (Some(g), DType::BF16, _) => {
                        Some(time_gpu::<bf16>(g, &shape, a.page_size, context, &opts, a.repeats))
                    }
                    (Some(g), DType::F16, _) => {
                        Some(time_gpu::<f16>(g, &shape, a.page_size, context, &opts, a.repeats))
                    }
                    (Some(_), d, _) => Some(Err(anyhow::anyhow!("the CUDA decode takes bf16 or f16, not {d}"))),
                    (None, _, None) => None,
                    (None, DType::F32, Some(case)) => Some(time_cpu::<f32>(case, &opts, a.repeats)),
                    (None, DType::BF16, Some(case)) => Some(time_cpu::<bf16>(case, &opts, a.repeats)),
                    (None, DType::F16, Some(case)) => Some(time_cpu::<f16>(case, &opts, a.repeats)),
                };
                // A context beyond one device is what a spread cache is for: say so, go on.
                let single = match single {
                    None => None,
                    Some(Ok(ms)) => Some(ms),
                    Some(Err(e)) if a.spread.is_some() => {
                        eprintln!("one device, context {context}: {e:#}");
                        None
                    }
                    Some(Err(e)) => return Err(e),
                };
                let bytes = 2.0 * (a.batch * context * a.kv_heads * d * dtype.size()) as f64;
                let row = |strategy: &str, ranks: usize, placement: Option<String>, ms: f64, eff: Option<f64>| Row {
                    backend: if gpu.is_some() { "cuda" } else { "cpu" }.into(),
                    strategy: strategy.into(),
                    ranks,
                    placement,
                    batch: a.batch,
                    context,
                    q_rows: a.q_rows,
                    heads: a.heads,
                    kv_heads: a.kv_heads,
                    head_dim: d,
                    page_size: a.page_size,
                    dtype: dtype.to_string(),
                    ms,
                    gb_per_s: bytes / ms / 1e6,
                    scaling_eff: eff,
                };
                if let Some(ms) = single {
                    rows.push(row("single", 1, None, ms, None));
                    print(&rows[rows.len() - 1]);
                }
                if let Some(s) = &a.spread {
                    let requests: Vec<StepRequest> = (0..a.batch)
                        .map(|i| StepRequest { home: i % s.ranks, cached: context - a.q_rows, new: a.q_rows })
                        .collect();
                    let attn = spread_step(s, &requests, a.heads, a.kv_heads, d)?;
                    let (ms, ranks) = time_spread(&attn, dtype, a.repeats, LAYERS, a.timelines.is_some(), &mut rng)?;
                    if !ranks.is_empty() {
                        timelines.push(TimelineRun {
                            strategy: "pass-q".into(),
                            seq: context,
                            pass: format!("decode b{}", a.batch),
                            mask: s.placement.clone(),
                            ranks,
                            ..Default::default()
                        });
                    }
                    let eff = single.map(|t| t / (s.ranks as f64 * ms));
                    rows.push(row("pass-q", s.ranks, Some(s.placement.clone()), ms, eff));
                    print(&rows[rows.len() - 1]);
                }
            }
        }
    }
    if let Some(path) = &a.timelines {
        std::fs::write(path, serde_json::to_string(&timelines)?)?;
        eprintln!("timelines of {} steps in {} (distattn timeline FILE prints them)", timelines.len(), path.display());
    }
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&Report { device, check, rows })?;
        if to_stderr {
            println!("{text}");
        } else {
            std::fs::write(path, text)?;
        }
    }
    Ok(())
}

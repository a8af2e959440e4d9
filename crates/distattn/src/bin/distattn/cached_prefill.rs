//! `distattn bench --cached-prefill`: a prompt's new tokens onto a cached prefix, the cache
//! spread over P ranks (context-parallel inference): each new token's query beside its key, the
//! step run with pass-q (queries travel; partial O and LSE return) and with pass-KV (a ring over
//! the same placement: the cache travels), each against one device's flash kernel on the whole
//! problem, with the plan the planner's time model picks (`planner::fastest`, with its default
//! rates) and that model's estimate. Where the measured faster one and the pick differ, the
//! model's crossover is off.

use crate::decode_bench::{random_inputs, time_spread, Spread};
use anyhow::{bail, Result};
use distattn::decode::{DecodeOptions, DecodeShape, MAX_DECODE_ROWS};
use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
use distattn::plan::Rates;
use distattn::planner::{build, fastest};
use distattn::{Attention, DType, Execution, PlanOptions, Ranks, Strategy};
use distattn_cuda::decode::DecodeBuffers;
use distattn_cuda::{CudaBackend, GpuBuf};
use half::bf16;
use rand::SeedableRng;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// What `distattn bench --cached-prefill` measures.
pub struct CachedPrefill {
    /// Cached tokens per request.
    pub cached: Vec<usize>,
    /// New tokens per request.
    pub new_tokens: Vec<usize>,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// One device's kernel (the baseline): a GPU, or the CPU.
    pub gpu: Option<Arc<CudaBackend>>,
    pub spread: Spread,
    pub repeats: usize,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

#[derive(Serialize)]
struct Row {
    backend: String,
    /// `single` (one device, the flash kernel), `single-decode` (one GPU, the paged decode
    /// kernel: up to 16 new tokens), `pass-q` or `ring` (pass-KV).
    strategy: String,
    ranks: usize,
    placement: Option<String>,
    batch: usize,
    cached: usize,
    new: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ms: f64,
    /// Forward TFLOP/s per rank (4 · heads · kept pairs · head_dim).
    tflops_per_rank: f64,
    /// Bytes the plan moves between ranks.
    bytes_moved: u64,
    /// The strategy the planner's time model picks for this step.
    picked: bool,
    /// The time model's estimate, milliseconds.
    estimate_ms: Option<f64>,
    /// One device's time over `ranks` times this one's.
    scaling_eff: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    device: String,
    rows: Vec<Row>,
}

/// One GPU's paged decode kernel on the step (its new tokens as each request's query rows,
/// causal), one call at a time as the spread side is timed, median milliseconds; `None` beyond
/// the decode kernel's rows or without a GPU. For a few new tokens this is the faster
/// one-device kernel: the flash kernel's tiles are mostly padding there.
fn time_single_decode(c: &CachedPrefill, cached: usize, new: usize) -> Result<Option<f64>> {
    let Some(gpu) = c.gpu.as_deref().filter(|_| new <= MAX_DECODE_ROWS) else {
        return Ok(None);
    };
    let shape = DecodeShape::new(c.batch, new, c.heads, c.kv_heads, c.head_dim)?;
    let opts = DecodeOptions { causal: true, ..Default::default() };
    let step = DecodeBuffers::<bf16>::random(gpu, &shape, 16, &vec![cached + new; c.batch], &opts, 7)?;
    step.plan(gpu)?;
    let ms = crate::bench::median_ms(c.repeats, || {
        step.run(gpu)?;
        Ok(gpu.synchronize()?)
    })?;
    Ok(Some(ms))
}

/// One device's forward of the whole step, median milliseconds (on a GPU, of inputs made there).
fn time_single(c: &CachedPrefill, attn: &Attention, rng: &mut rand::rngs::StdRng) -> Result<f64> {
    let (shape, mask, opts) = (attn.shape(), attn.mask(), attn.options());
    let Some(gpu) = &c.gpu else {
        let [q, k, v] = random_inputs(rng, attn, DType::BF16);
        return crate::bench::median_ms(c.repeats, || Ok(crate::tensors::forward(attn, &q, &k, &v).map(|_| ())?));
    };
    let s = gpu.stream();
    let random = |n: usize, seed: u64| gpu.random_buf(DType::BF16, n, seed, 1.7);
    let (q, k, v) = (random(shape.q_elems(), 1)?, random(shape.kv_elems(), 2)?, random(shape.kv_elems(), 3)?);
    let mut o = GpuBuf::alloc(s, DType::BF16, shape.q_elems())?;
    let mut lse = GpuBuf::alloc(s, DType::F32, shape.lse_elems())?;
    crate::bench::median_ms(c.repeats, || {
        gpu.forward::<bf16>(
            &q.view()?,
            &k.view()?,
            &v.view()?,
            shape,
            mask,
            opts,
            &mut o.view_mut()?,
            &mut lse.view_mut()?,
            None,
        )?;
        Ok(gpu.synchronize()?)
    })
}

pub fn run(c: CachedPrefill) -> Result<()> {
    let s = &c.spread;
    if c.new_tokens.is_empty() || c.new_tokens.contains(&0) {
        bail!("--new-tokens: give one or more positive counts");
    }
    let device = match &c.gpu {
        Some(g) if s.on_gpus => format!("cuda: {} x {}", g.device_name(), s.ranks),
        Some(g) => format!("cuda: {}; {} CPU ranks", g.device_name(), s.ranks),
        None => format!("{}; {} CPU ranks", crate::bench::cpu_name(), s.ranks),
    };
    eprintln!("{device}");
    // With `--json -` the report goes to standard output and the table to standard error.
    let to_stderr = c.json.as_ref().is_some_and(|p| p.as_os_str() == "-");
    let say = |line: String| if to_stderr { eprintln!("{line}") } else { println!("{line}") };
    say(format!(
        "{:<7} {:>5} {:>5} {:>9} {:>8} {:>10} {:>9} {:>10} {:>6} {:>6} {:>10}",
        "strat", "ranks", "batch", "cached", "new", "ms", "TF/rank", "moved MB", "picked", "eff", "model ms"
    ));
    let mut rng = rand::rngs::StdRng::seed_from_u64(c.seed);
    let mut rows = Vec::new();
    for &cached in &c.cached {
        for &new in &c.new_tokens {
            let requests: Vec<StepRequest> =
                (0..c.batch).map(|i| StepRequest { home: i % s.ranks, cached, new }).collect();
            let placement = KvPlacement::from_spec(&s.placement, cached + new, s.ranks)?;
            let step = ServingStep::new(&placement, &requests, Queries::WithKeys, c.heads, c.kv_heads, c.head_dim)?;
            let opts = PlanOptions { layout: Some(step.layout.clone()), ..PlanOptions::forward() };
            let t0 = Instant::now();
            let strategies = [Strategy::PassQ, Strategy::Ring];
            let rates = Rates::default();
            let pick = fastest(&strategies, s.ranks, &step.shape, &step.mask, DType::BF16, &opts, &rates)?.strategy;
            let flops = 4.0 * (step.mask.area() * (c.heads * c.head_dim) as u64) as f64;
            let one = Attention::new(step.shape, step.mask.clone())?;
            eprintln!("cached {cached}, new {new}: one device ...");
            let flash = time_single(&c, &one, &mut rng)?;
            let decode = time_single_decode(&c, cached, new)?;
            // The spread steps are compared with the faster one-device kernel.
            let single = decode.map_or(flash, |d| d.min(flash));
            let row = |strategy: &str, ranks: usize, ms: f64, bytes_moved: u64, picked: bool, estimate_ms| Row {
                backend: if c.gpu.is_some() { "cuda" } else { "cpu" }.into(),
                strategy: strategy.into(),
                ranks,
                placement: (ranks > 1).then(|| s.placement.clone()),
                batch: c.batch,
                cached,
                new,
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
                ms,
                tflops_per_rank: flops / ms / 1e9 / ranks as f64,
                bytes_moved,
                picked,
                estimate_ms,
                scaling_eff: (ranks > 1).then(|| single / (ranks as f64 * ms)),
            };
            let first = rows.len();
            rows.push(row("single", 1, flash, 0, false, None));
            if let Some(ms) = decode {
                rows.push(row("single-decode", 1, ms, 0, false, None));
            }
            for st in strategies {
                let plan = build(st, s.ranks, &step.shape, &step.mask, DType::BF16, &opts)?;
                let (bytes, estimate) = (plan.summary().bytes_moved, plan.estimate(&rates).ms);
                let ranks = Ranks { plan: opts.clone(), ..Ranks::new(s.ranks, st) };
                let exec = if s.on_gpus { Execution::GpuRanks(ranks) } else { Execution::CpuRanks(ranks) };
                let attn = Attention::new(step.shape, step.mask.clone())?.on(exec);
                eprintln!("cached {cached}, new {new}: {st} on {} ranks ...", s.ranks);
                // One call at a time, as the one-device side (a prompt is not a layer loop).
                let (ms, _) = time_spread(&attn, DType::BF16, c.repeats, 1, false, &mut rng)?;
                rows.push(row(&st.to_string(), s.ranks, ms, bytes, st == pick, Some(estimate)));
            }
            for r in &rows[first..] {
                say(format!(
                    "{:<7} {:>5} {:>5} {:>9} {:>8} {:>10.3} {:>9.1} {:>10.1} {:>6} {:>6} {:>10}",
                    r.strategy,
                    r.ranks,
                    r.batch,
                    r.cached,
                    r.new,
                    r.ms,
                    r.tflops_per_rank,
                    r.bytes_moved as f64 / 1e6,
                    if r.picked { "yes" } else { "" },
                    r.scaling_eff.map_or(String::new(), |e| format!("{:.0}%", 100.0 * e)),
                    r.estimate_ms.map_or(String::new(), |e| format!("{e:.3}"))
                ));
            }
            eprintln!("cached {cached}, new {new}: {:.1} s", t0.elapsed().as_secs_f64());
        }
    }
    if let Some(path) = &c.json {
        let text = serde_json::to_string_pretty(&Report { device, rows })?;
        if to_stderr {
            println!("{text}");
        } else {
            std::fs::write(path, text)?;
        }
    }
    Ok(())
}

//! `distattn bench --decode`: decode attention over a paged KV cache, one step planned and then
//! run as one layer after another, with the bytes of K and V read per second.

use crate::run::BackendArg;
use anyhow::Result;
use distattn::decode::{decode, DecodeOptions, DecodeShape};
use distattn::{DType, Element, Execution};
use distattn_cuda::decode::DecodeBuffers;
use distattn_cuda::{CudaBackend, CudaElement};
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
}

#[derive(Serialize)]
struct Row {
    backend: String,
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
    /// K and V bytes read per second.
    gb_per_s: f64,
}

#[derive(Serialize)]
struct Report {
    device: String,
    check: String,
    rows: Vec<Row>,
}

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

fn time_gpu<T: CudaElement>(gpu: &CudaBackend, case: &DecodeCase, opts: &DecodeOptions, repeats: usize) -> Result<f64> {
    let (q, k, v) = (cast::<T>(&case.q), cast::<T>(&case.k_cache), cast::<T>(&case.v_cache));
    let step = DecodeBuffers::upload(gpu, &q, &case.cache(&k, &v), &case.shape, opts)?;
    step.plan(gpu)?;
    // Layers back to back between two events: what one layer of a decode step costs.
    const LAYERS: usize = 20;
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

pub fn run(a: DecodeBench) -> Result<()> {
    let exec = a.backend.execution(DType::BF16)?;
    let gpu = match &exec {
        Execution::Cuda(g) => Some(g.clone()),
        _ => None,
    };
    let device = match &gpu {
        Some(g) => format!("cuda: {}", g.device_name()),
        None => crate::bench::cpu_name(),
    };
    eprintln!("{device}");
    let check = check(gpu.as_deref(), a.seed)?;
    eprintln!("{check}");
    let to_stderr = a.json.as_ref().is_some_and(|p| p.as_os_str() == "-");
    let say = |line: String| if to_stderr { eprintln!("{line}") } else { println!("{line}") };
    say(format!(
        "{:<8} {:>5} {:>9} {:>6} {:>9} {:>4} {:>5} {:<5} {:>10} {:>8}",
        "backend", "batch", "context", "q_rows", "heads", "d", "page", "dtype", "ms/layer", "GB/s"
    ));
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let opts = DecodeOptions { causal: true, ..Default::default() };
    let mut rows = Vec::new();
    for &context in &a.lengths {
        for &d in &a.head_dims {
            let shape = DecodeShape::new(a.batch, a.q_rows, a.heads, a.kv_heads, d)?;
            let case = DecodeCase::random(&mut rng, shape, a.page_size, &vec![context; a.batch]);
            for &dtype in &a.dtypes {
                let ms = match (&gpu, dtype) {
                    (Some(g), DType::BF16) => time_gpu::<bf16>(g, &case, &opts, a.repeats)?,
                    (Some(g), DType::F16) => time_gpu::<f16>(g, &case, &opts, a.repeats)?,
                    (Some(_), d) => anyhow::bail!("the CUDA decode takes bf16 or f16, not {d}"),
                    (None, DType::F32) => time_cpu::<f32>(&case, &opts, a.repeats)?,
                    (None, DType::BF16) => time_cpu::<bf16>(&case, &opts, a.repeats)?,
                    (None, DType::F16) => time_cpu::<f16>(&case, &opts, a.repeats)?,
                };
                let bytes = 2.0 * (a.batch * context * a.kv_heads * d * dtype.size()) as f64;
                let row = Row {
                    backend: if gpu.is_some() { "cuda" } else { "cpu" }.into(),
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
                };
                say(format!(
                    "{:<8} {:>5} {:>9} {:>6} {:>9} {:>4} {:>5} {:<5} {:>10.4} {:>8.1}",
                    row.backend,
                    row.batch,
                    row.context,
                    row.q_rows,
                    format!("{}/{}", row.heads, row.kv_heads),
                    row.head_dim,
                    row.page_size,
                    row.dtype,
                    row.ms,
                    row.gb_per_s
                ));
                rows.push(row);
            }
        }
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

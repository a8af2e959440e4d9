//! Benchmark of the CUDA kernels on one GPU (run on a machine with a GPU; the correctness
//! checks are the ignored tests of `tests/gpu_kernels.rs`).
//!
//! `distattn-cuda-bench bench --out FILE [--dims 128,64] [--quick] [--seqs 16384,...]
//! [--sustain SECONDS]`: times forward and backward (CUDA events, one warm-up, the median of 10
//! runs, 3 at 64k and beyond) on the standard grid (16k tokens per batch, 2048 / head dim heads,
//! bf16, causal and not) and writes JSON rows. With `--sustain S`, each time is instead the
//! median of runs repeated for at least S seconds after three warm-ups, and rows also give the
//! time per call of calls issued back to back — the two timings of `bench/python_bench.py`,
//! so that the two compare at the same (sustained-load) clocks.
//!
//! `distattn-cuda-bench dump DIR`: runs forward and backward on the cases PyTorch can run too
//! (full and causal, no GQA) for bf16 and f16 at every head dim, and writes inputs, outputs and
//! a `meta.json` per case, for `bench/torch_peer.py accuracy`, which measures our error and
//! PyTorch flash's against an f64 reference on the same inputs.

use distattn_core::{AttnOptions, AttnShape, DType, Mask};
use distattn_cuda::cudarc::driver::{sys::CUevent_flags, CudaSlice};
use distattn_cuda::{CudaBackend, CudaElement};
use half::{bf16, f16};
use std::io::Write;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// `n` values of unit variance (uniform in ±√3), from a fast xorshift generator.
fn random<T: CudaElement>(n: usize, seed: u64) -> Vec<T> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            T::from_f32((u - 0.5) * 3.4641)
        })
        .collect()
}

fn upload<T: CudaElement>(be: &CudaBackend, v: &[T]) -> Res<CudaSlice<T>> {
    Ok(be.stream().clone_htod(v)?)
}

#[derive(serde::Serialize)]
struct BenchRow {
    #[serde(rename = "impl")]
    imp: String,
    pass: String,
    causal: bool,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    dtype: String,
    tflops: f64,
    ms: f64,
    /// With `--sustain`: milliseconds per call of calls issued back to back (no wait between
    /// them), the time a training loop sees once launch latency hides behind the GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    ms_back_to_back: Option<f64>,
}

/// How a row is timed: warm-up calls, then at least `reps` samples and `sustain` seconds; a
/// sample is CUDA events around `batch` calls issued back to back, per call.
#[derive(Clone, Copy)]
struct Timing {
    warmups: usize,
    reps: usize,
    sustain: f64,
    batch: usize,
}

impl Timing {
    /// One warm-up, then the median of `reps` single calls.
    fn quick(reps: usize) -> Timing {
        Timing { warmups: 1, reps, sustain: 0.0, batch: 1 }
    }

    /// Three warm-ups, then at least `sustain` seconds of single calls (or of batches of 10
    /// issued back to back): the two timings of bench/python_bench.py.
    fn sustained(sustain: f64, back_to_back: bool) -> Timing {
        Timing {
            warmups: 3,
            reps: if back_to_back { 3 } else { 10 },
            sustain,
            batch: if back_to_back { 10 } else { 1 },
        }
    }
}

/// Median milliseconds per call of `f`, timed as `t` says.
fn time_ms(be: &CudaBackend, t: Timing, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    for _ in 0..t.warmups {
        f()?;
    }
    be.synchronize()?;
    let start = std::time::Instant::now();
    let mut ts = Vec::new();
    while ts.len() < t.reps || start.elapsed().as_secs_f64() < t.sustain {
        let a = be.stream().record_event(flags)?;
        for _ in 0..t.batch {
            f()?;
        }
        let b = be.stream().record_event(flags)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64 / t.batch as f64);
    }
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts[ts.len() / 2])
}

fn bench(be: &CudaBackend, out: &str, dims: &[usize], quick: bool, seqs: Option<Vec<usize>>, sustain: f64) -> Res<()> {
    let mut rows = Vec::new();
    let mut grid: Vec<(usize, usize)> = [512, 1024, 2048, 4096, 8192, 16384].iter().map(|&s| (16384 / s, s)).collect();
    if !quick {
        grid.push((1, 65536));
        grid.push((1, 131072));
    }
    if let Some(only) = seqs {
        grid.retain(|(_, s)| only.contains(s));
    }
    for &d in dims {
        let heads = 2048 / d;
        for &(batch, seq) in &grid {
            let shape = AttnShape::self_attn(batch, seq, heads, d)?;
            let q = upload(be, &random::<bf16>(shape.q_elems(), 1))?;
            let k = upload(be, &random::<bf16>(shape.kv_elems(), 2))?;
            let v = upload(be, &random::<bf16>(shape.kv_elems(), 3))?;
            let d_o = upload(be, &random::<bf16>(shape.q_elems(), 4))?;
            let s = be.stream();
            let mut o = s.alloc_zeros::<bf16>(shape.q_elems())?;
            let mut lse = s.alloc_zeros::<f32>(shape.lse_elems())?;
            let mut dq = s.alloc_zeros::<bf16>(shape.q_elems())?;
            let mut dk = s.alloc_zeros::<bf16>(shape.kv_elems())?;
            let mut dv = s.alloc_zeros::<bf16>(shape.kv_elems())?;
            for causal in [false, true] {
                let mask = if causal { Mask::causal(seq, seq)? } else { Mask::full(seq, seq)? };
                let opts = AttnOptions::default();
                let fwd_flops = 4.0 * (batch * heads) as f64 * mask.area() as f64 * d as f64;
                let reps = if seq >= 65536 { 3 } else { 10 };
                let mut fwd = || Ok(be.forward(&q, &k, &v, &shape, &mask, &opts, &mut o, &mut lse, None)?);
                let per_call = if sustain > 0.0 { Timing::sustained(sustain, false) } else { Timing::quick(reps) };
                let back_to_back = (sustain > 0.0).then(|| Timing::sustained(sustain, true));
                let tf = time_ms(be, per_call, &mut fwd)?;
                let fwd_b2b = back_to_back.map(|t| time_ms(be, t, &mut fwd)).transpose()?;
                let mut bwd =
                    || Ok(be.backward(&q, &k, &v, &o, &lse, &d_o, &shape, &mask, &opts, &mut dq, &mut dk, &mut dv)?);
                let tb = time_ms(be, per_call, &mut bwd)?;
                let bwd_b2b = back_to_back.map(|t| time_ms(be, t, &mut bwd)).transpose()?;
                for (pass, t, b2b, fl) in [("fwd", tf, fwd_b2b, fwd_flops), ("bwd", tb, bwd_b2b, 2.5 * fwd_flops)] {
                    let tflops = fl / (t * 1e-3) / 1e12;
                    println!("distattn {pass} causal={causal} b={batch} n={seq} h={heads} d={d}: {t:.3} ms {tflops:.1} TFLOP/s");
                    rows.push(BenchRow {
                        imp: "distattn".into(),
                        pass: pass.into(),
                        causal,
                        batch,
                        seq,
                        heads,
                        head_dim: d,
                        dtype: "bf16".into(),
                        tflops,
                        ms: t,
                        ms_back_to_back: b2b,
                    });
                }
                std::io::stdout().flush()?;
            }
        }
    }
    std::fs::write(out, serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

fn write_raw<T: bytemuck::Pod>(path: &std::path::Path, v: &[T]) -> Res<()> {
    Ok(std::fs::write(path, bytemuck::cast_slice::<T, u8>(v))?)
}

/// Forward and backward of one case, inputs and outputs written under `dir/<case>`.
fn dump_case<T: CudaElement>(
    be: &CudaBackend,
    dir: &std::path::Path,
    name: &str,
    mask: &Mask,
    shape: &AttnShape,
    seed: u64,
) -> Res<()> {
    let opts = AttnOptions::default();
    let (q, k, v, d_o) = (
        random::<T>(shape.q_elems(), seed),
        random::<T>(shape.kv_elems(), seed + 1),
        random::<T>(shape.kv_elems(), seed + 2),
        random::<T>(shape.q_elems(), seed + 3),
    );
    let f = be.forward_host(&q, &k, &v, shape, mask, &opts)?;
    let o: Vec<T> = f.o.iter().map(|&x| T::from_f32(x)).collect();
    let grads = (shape.head_dim <= 128)
        .then(|| be.backward_host(&q, &k, &v, &o, &f.lse, &d_o, shape, mask, &opts))
        .transpose()?;
    let sub = dir.join(format!("{name}-{}-d{}", T::DTYPE, shape.head_dim));
    std::fs::create_dir_all(&sub)?;
    for (file, data) in [("q.bin", &q), ("k.bin", &k), ("v.bin", &v), ("do.bin", &d_o), ("o.bin", &o)] {
        write_raw(&sub.join(file), data)?;
    }
    write_raw(&sub.join("lse.bin"), &f.lse)?;
    if let Some(g) = &grads {
        write_raw(&sub.join("dq.bin"), &g.dq)?;
        write_raw(&sub.join("dk.bin"), &g.dk)?;
        write_raw(&sub.join("dv.bin"), &g.dv)?;
    }
    let meta = serde_json::json!({
        "case": name, "dtype": T::DTYPE.to_string(), "batch": shape.batch, "q_len": shape.q_len,
        "k_len": shape.k_len, "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "causal": name.starts_with("causal"), "grads": grads.is_some(),
    });
    std::fs::write(sub.join("meta.json"), meta.to_string())?;
    Ok(())
}

fn dump(be: &CudaBackend, dir: &std::path::Path) -> Res<()> {
    let cases = [
        ("full-257", Mask::full(257, 257)?, 2, 4),
        ("causal-300", Mask::causal(300, 300)?, 2, 4),
        ("causal-1100", Mask::causal(1100, 1100)?, 1, 2),
    ];
    let mut seed = 1;
    for d in [64, 128, 96, 256] {
        for (name, mask, batch, heads) in &cases {
            let shape = AttnShape::self_attn(*batch, mask.q_len(), *heads, d)?;
            dump_case::<bf16>(be, dir, name, mask, &shape, seed)?;
            dump_case::<f16>(be, dir, name, mask, &shape, seed + 4)?;
            seed += 8;
        }
    }
    println!("dumped {} cases to {}", 2 * 4 * cases.len(), dir.display());
    Ok(())
}

/// Benchmark of the CUDA kernels on GPU 0.
#[derive(clap::Parser)]
#[command(name = "distattn-cuda-bench", version)]
enum Cli {
    /// Times forward and backward on the standard grid and writes JSON rows.
    Bench {
        /// Where the JSON rows go.
        #[arg(long, default_value = "distattn_bench.json")]
        out: String,
        /// Head dims (2048 / d heads each).
        #[arg(long, value_delimiter = ',', default_value = "128")]
        dims: Vec<usize>,
        /// Skip the 64k and 128k rows.
        #[arg(long)]
        quick: bool,
        /// Only these sequence lengths of the grid.
        #[arg(long, value_delimiter = ',')]
        seqs: Option<Vec<usize>>,
        /// Time each row by the median over at least this many seconds of sustained runs (and
        /// back to back), as bench/python_bench.py does; 0: one warm-up, median of 10.
        #[arg(long, default_value_t = 0.0)]
        sustain: f64,
    },
    /// Writes inputs and outputs of the cases PyTorch runs too, for bench/torch_peer.py.
    Dump {
        /// Output folder.
        dir: std::path::PathBuf,
    },
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    let be = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("no GPU: {e}");
            std::process::exit(2);
        }
    };
    println!("device {} ({}), cache {:?}", be.device_name(), be.arch(), distattn_cuda::compile::cache_dir());
    let res = match cli {
        Cli::Bench { out, dims, quick, seqs, sustain } => dims
            .iter()
            .try_for_each(|&d| -> Res<()> { Ok(be.prepare(DType::BF16, d)?) })
            .and_then(|_| bench(&be, &out, &dims, quick, seqs, sustain)),
        Cli::Dump { dir } => dump(&be, &dir),
    };
    if let Err(e) = res {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

//! Times distattn-cpu forward and backward and prints one JSON row per case (the same fields
//! as bench/peers/torch_cpu.py), or measures one forward+backward for a peak-RSS run.
//!
//! cargo run --release -p distattn-cpu --example cpu_bench -- \
//!     [--seq 2048,4096] [--heads 4] [--dim 64,128] [--dtype f32,bf16] [--causal both|yes|no]
//!     [--pass fwd,bwd] [--reps 5] [--batch 1] [--out FILE] [--once] [--tiles FQ,FK,BQ,BK]
//!
//! FLOPs: forward 4·B·H·area·d (area = kept (q, k) pairs), backward 2.5× forward.
//! `--once` runs one forward + backward of the first case and prints its time (for
//! `/usr/bin/time -v`).
//!
//! `--serve` reads commands on stdin, for a peer script that interleaves its own timings
//! with ours rep by rep (bench/peers/torch_cpu.py --distattn BIN):
//!   `case SEQ HEADS DIM CAUSAL(0|1) DTYPE BATCH` sets up inputs and answers `ok`;
//!   `fwd` / `bwd` runs one pass and answers its wall time in seconds.

use distattn_core::{AttnOptions, AttnShape, Element, Mask};
use half::{bf16, f16};
use std::io::Write;
use std::time::Instant;

struct Args {
    seqs: Vec<usize>,
    heads: usize,
    dims: Vec<usize>,
    dtypes: Vec<String>,
    causal: Vec<bool>,
    passes: Vec<String>,
    reps: usize,
    batch: usize,
    out: Option<String>,
    once: bool,
    cpu_time: bool,
    tiles: Option<distattn_cpu::TileConfig>,
}

fn list<T: std::str::FromStr>(s: &str) -> Vec<T> {
    s.split(',').map(|x| x.trim().parse().unwrap_or_else(|_| panic!("bad value {x}"))).collect()
}

fn parse() -> Args {
    let mut a = Args {
        seqs: vec![2048, 4096, 8192],
        heads: 4,
        dims: vec![64, 128],
        dtypes: vec!["f32".into(), "bf16".into()],
        causal: vec![false, true],
        passes: vec!["fwd".into(), "bwd".into()],
        reps: 5,
        batch: 1,
        out: None,
        once: false,
        cpu_time: false,
        tiles: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--seq" => a.seqs = list(&v),
            "--heads" => a.heads = v.parse().unwrap(),
            "--dim" => a.dims = list(&v),
            "--dtype" => a.dtypes = list(&v),
            "--causal" => {
                a.causal = match v.as_str() {
                    "yes" | "true" => vec![true],
                    "no" | "false" => vec![false],
                    _ => vec![false, true],
                }
            }
            "--pass" => a.passes = list(&v),
            "--reps" => a.reps = v.parse().unwrap(),
            "--batch" => a.batch = v.parse().unwrap(),
            "--out" => a.out = Some(v),
            "--tiles" => {
                let t: Vec<usize> = list(&v);
                a.tiles = Some(distattn_cpu::TileConfig { fwd_q: t[0], fwd_k: t[1], bwd_q: t[2], bwd_k: t[3] });
            }
            "--cpu-time" => {
                a.cpu_time = true;
                i += 1;
                continue;
            }
            "--once" => {
                a.once = true;
                i += 1;
                continue;
            }
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

fn randn(n: usize, seed: u64) -> Vec<f32> {
    // Cheap deterministic normal-ish values (sum of uniforms): inputs only need to be generic.
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            let mut acc = 0f32;
            for _ in 0..4 {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                acc += ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
            }
            acc * 1.7
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

struct Case<'a> {
    shape: AttnShape,
    mask: &'a Mask,
    causal: bool,
    dtype: &'a str,
}

fn run<T: Element>(c: &Case, a: &Args, rows: &mut Vec<String>) {
    let s = c.shape;
    let cast = |x: Vec<f32>| -> Vec<T> { x.into_iter().map(T::from_f32).collect() };
    let q = cast(randn(s.q_elems(), 1));
    let k = cast(randn(s.kv_elems(), 2));
    let v = cast(randn(s.kv_elems(), 3));
    let d_o = cast(randn(s.q_elems(), 4));
    let opts = AttnOptions::default();
    let tiles = a.tiles.unwrap_or(distattn_cpu::TileConfig::for_head_dim(s.head_dim));
    let fwd_flops = 4.0 * (s.batch * s.heads) as f64 * c.mask.area() as f64 * s.head_dim as f64;
    if a.once {
        let t = Instant::now();
        let f = distattn_cpu::forward_with(&q, &k, &v, &s, c.mask, &opts, tiles).unwrap();
        let delta = distattn_cpu::row_delta(&f.o, &d_o, &s).unwrap();
        let g = distattn_cpu::backward_with(&q, &k, &v, &d_o, &f.lse, &delta, &s, c.mask, &opts, tiles).unwrap();
        println!("once: {} fwd+bwd in {:.2}s (dq[0]={})", s, t.elapsed().as_secs_f64(), g.dq[0]);
        return;
    }
    let f = distattn_cpu::forward_with(&q, &k, &v, &s, c.mask, &opts, tiles).unwrap();
    for pass in &a.passes {
        let mut times = Vec::new();
        for _ in 0..a.reps + 1 {
            let t = Instant::now();
            let c0 = cpu_time::ProcessTime::now();
            if pass == "fwd" {
                std::hint::black_box(distattn_cpu::forward_with(&q, &k, &v, &s, c.mask, &opts, tiles).unwrap());
            } else {
                let delta = distattn_cpu::row_delta(&f.o, &d_o, &s).unwrap();
                std::hint::black_box(
                    distattn_cpu::backward_with(&q, &k, &v, &d_o, &f.lse, &delta, &s, c.mask, &opts, tiles).unwrap(),
                );
            }
            times.push(if a.cpu_time { c0.elapsed().as_secs_f64() } else { t.elapsed().as_secs_f64() });
        }
        times.remove(0); // warm-up
        let flops = if pass == "fwd" { fwd_flops } else { 2.5 * fwd_flops };
        let t = median(times.clone());
        let best = times.iter().cloned().fold(f64::INFINITY, f64::min);
        let row = format!(
            "{{\"impl\": \"distattn-cpu\", \"pass\": \"{pass}\", \"causal\": {}, \"batch\": {}, \"seq\": {}, \"heads\": {}, \"head_dim\": {}, \"dtype\": \"{}\", \"tflops\": {:.5}, \"tflops_best\": {:.5}, \"ms\": {:.3}, \"threads\": {}}}",
            c.causal, s.batch, s.q_len, s.heads, s.head_dim, c.dtype, flops / t / 1e12, flops / best / 1e12, t * 1e3, rayon::current_num_threads()
        );
        println!("{row}");
        std::io::stdout().flush().ok();
        rows.push(row);
    }
}

type Runner = Box<dyn FnMut(bool) -> f64>;

fn runner<T: Element>(s: AttnShape, mask: Mask) -> Runner {
    let cast = |x: Vec<f32>| -> Vec<T> { x.into_iter().map(T::from_f32).collect() };
    let q = cast(randn(s.q_elems(), 1));
    let k = cast(randn(s.kv_elems(), 2));
    let v = cast(randn(s.kv_elems(), 3));
    let d_o = cast(randn(s.q_elems(), 4));
    let opts = AttnOptions::default();
    let f = distattn_cpu::forward(&q, &k, &v, &s, &mask, &opts).unwrap();
    Box::new(move |bwd| {
        let t = Instant::now();
        if bwd {
            let delta = distattn_cpu::row_delta(&f.o, &d_o, &s).unwrap();
            std::hint::black_box(distattn_cpu::backward(&q, &k, &v, &d_o, &f.lse, &delta, &s, &mask, &opts).unwrap());
        } else {
            std::hint::black_box(distattn_cpu::forward(&q, &k, &v, &s, &mask, &opts).unwrap());
        }
        t.elapsed().as_secs_f64()
    })
}

fn serve() {
    use std::io::BufRead;
    let mut run: Option<Runner> = None;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["case", n, h, d, c, dt, b] => {
                let (n, h, d, b): (usize, usize, usize, usize) =
                    (n.parse().unwrap(), h.parse().unwrap(), d.parse().unwrap(), b.parse().unwrap());
                let mask = if *c == "1" { Mask::causal(n, n).unwrap() } else { Mask::full(n, n).unwrap() };
                let s = AttnShape::self_attn(b, n, h, d).unwrap();
                run = Some(match *dt {
                    "f32" => runner::<f32>(s, mask),
                    "bf16" => runner::<bf16>(s, mask),
                    "f16" => runner::<f16>(s, mask),
                    other => panic!("unknown dtype {other}"),
                });
                "ok".to_string()
            }
            ["fwd"] | ["bwd"] => format!("{:.9}", run.as_mut().expect("no case")(w[0] == "bwd")),
            ["quit"] => break,
            _ => format!("error: unknown command '{line}'"),
        };
        writeln!(out, "{reply}").ok();
        out.flush().ok();
    }
}

fn main() {
    if std::env::args().any(|a| a == "--serve") {
        return serve();
    }
    let a = parse();
    let mut rows = Vec::new();
    'outer: for &n in &a.seqs {
        for &d in &a.dims {
            for &causal in &a.causal {
                let mask = if causal { Mask::causal(n, n).unwrap() } else { Mask::full(n, n).unwrap() };
                for dt in &a.dtypes {
                    let c = Case {
                        shape: AttnShape::self_attn(a.batch, n, a.heads, d).unwrap(),
                        mask: &mask,
                        causal,
                        dtype: dt,
                    };
                    match dt.as_str() {
                        "f32" => run::<f32>(&c, &a, &mut rows),
                        "bf16" => run::<bf16>(&c, &a, &mut rows),
                        "f16" => run::<f16>(&c, &a, &mut rows),
                        other => panic!("unknown dtype {other}"),
                    }
                    if a.once {
                        break 'outer;
                    }
                }
            }
        }
    }
    if let Some(path) = a.out {
        std::fs::write(&path, rows.join("\n") + "\n").expect("write --out");
    }
}

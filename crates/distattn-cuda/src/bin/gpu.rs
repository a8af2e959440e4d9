//! GPU checks and benchmarks of the CUDA backend (run on a machine with a GPU).
//!
//! `distattn-cuda-gpu check [--dump DIR]`: forward (O, LSE), backward (dQ, dK, dV) and the LSE
//! merge against an f64 reference on fresh random inputs, for dtype x head dim x mask x GQA x
//! awkward lengths. Outputs are poisoned (NaN) before each run. With `--dump`, the inputs and
//! outputs of the cases PyTorch can run too (full / causal, no GQA) are written for
//! `bench/torch_peer.py accuracy`, which measures PyTorch flash's error on the same inputs.
//! Exit status 1 if any case fails.
//!
//! `distattn-cuda-gpu bench --out FILE [--dims 128,64] [--quick]`: times forward and backward
//! (CUDA events, warm-up, median) on the standard grid and writes JSON rows.

use distattn_core::mask::DocKind;
use distattn_core::{AttnOptions, AttnShape, Element, Mask};
use distattn_cuda::{cudarc, CudaBackend, CudaElement};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::io::Write;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn randn(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let u1: f32 = rng.random::<f32>().max(1e-7);
        let u2: f32 = rng.random::<f32>();
        let r = (-2.0 * u1.ln()).sqrt();
        let th = 2.0 * std::f32::consts::PI * u2;
        v.push(r * th.cos());
        if v.len() < n {
            v.push(r * th.sin());
        }
    }
    v
}

struct Reference {
    o: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Exact attention in f64 (forward and backward), row by row from the mask's intervals.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
fn reference(s: &AttnShape, mask: &Mask, scale: f64, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> Reference {
    let d = s.head_dim;
    let g = s.group();
    let rows: Vec<Vec<(usize, usize)>> = (0..s.q_len).map(|i| mask.row_intervals(i).collect()).collect();
    // Per (b, h): o rows, lse, dq rows, dk/dv partial (k_len x d).
    #[allow(clippy::type_complexity)]
    let per: Vec<(usize, usize, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>)> = (0..s.batch * s.heads)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / s.heads, bh % s.heads);
            let kh = h / g;
            let mut o = vec![0.0; s.q_len * d];
            let mut lse = vec![f64::NEG_INFINITY; s.q_len];
            let mut dq = vec![0.0; s.q_len * d];
            let mut dk = vec![0.0; s.k_len * d];
            let mut dv = vec![0.0; s.k_len * d];
            let mut p = vec![0.0; s.k_len];
            for i in 0..s.q_len {
                let qi = &q[s.q_offset(b, i, h)..][..d];
                let doi = &dout[s.q_offset(b, i, h)..][..d];
                let mut m = f64::NEG_INFINITY;
                for &(lo, hi) in &rows[i] {
                    for j in lo..hi {
                        let kj = &k[s.kv_offset(b, j, kh)..][..d];
                        let x = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                        p[j] = x;
                        m = m.max(x);
                    }
                }
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let mut sum = 0.0;
                for &(lo, hi) in &rows[i] {
                    for j in lo..hi {
                        p[j] = (p[j] - m).exp();
                        sum += p[j];
                    }
                }
                lse[i] = m + sum.ln();
                let oi = &mut o[i * d..][..d];
                for &(lo, hi) in &rows[i] {
                    for j in lo..hi {
                        p[j] /= sum;
                        let vj = &v[s.kv_offset(b, j, kh)..][..d];
                        for c in 0..d {
                            oi[c] += p[j] * vj[c];
                        }
                    }
                }
                let di: f64 = doi.iter().zip(oi.iter()).map(|(a, b)| a * b).sum();
                let dqi = &mut dq[i * d..][..d];
                for &(lo, hi) in &rows[i] {
                    for j in lo..hi {
                        let vj = &v[s.kv_offset(b, j, kh)..][..d];
                        let kj = &k[s.kv_offset(b, j, kh)..][..d];
                        let dp: f64 = doi.iter().zip(vj).map(|(a, b)| a * b).sum();
                        let ds = p[j] * (dp - di);
                        for c in 0..d {
                            dqi[c] += scale * ds * kj[c];
                            dk[j * d + c] += scale * ds * qi[c];
                            dv[j * d + c] += p[j] * doi[c];
                        }
                    }
                }
            }
            (b, h, o, lse, dq, dk, dv)
        })
        .collect();
    let mut r = Reference {
        o: vec![0.0; s.q_elems()],
        lse: vec![0.0; s.lse_elems()],
        dq: vec![0.0; s.q_elems()],
        dk: vec![0.0; s.kv_elems()],
        dv: vec![0.0; s.kv_elems()],
    };
    for (b, h, o, lse, dq, dk, dv) in per {
        for i in 0..s.q_len {
            r.o[s.q_offset(b, i, h)..][..d].copy_from_slice(&o[i * d..][..d]);
            r.dq[s.q_offset(b, i, h)..][..d].copy_from_slice(&dq[i * d..][..d]);
            r.lse[s.lse_offset(b, h, i)] = lse[i];
        }
        for j in 0..s.k_len {
            let off = s.kv_offset(b, j, h / g);
            for c in 0..d {
                r.dk[off + c] += dk[j * d + c];
                r.dv[off + c] += dv[j * d + c];
            }
        }
    }
    r
}

/// ||x - ref|| / ||ref|| over finite reference entries; NaN/inf in x where ref is finite fails
/// (returned as infinity); -inf positions of the reference must match exactly.
fn rel_err(x: &[f32], r: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (a, b) in x.iter().zip(r) {
        if b.is_finite() {
            if !a.is_finite() {
                return f64::INFINITY;
            }
            num += (*a as f64 - b).powi(2);
            den += b * b;
        } else if *a as f64 != *b {
            return f64::INFINITY;
        }
    }
    if den == 0.0 {
        return num.sqrt();
    }
    (num / den).sqrt()
}

struct Case {
    name: String,
    mask: Mask,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    torch: bool,
}

fn cases() -> Res<Vec<Case>> {
    let mut v = Vec::new();
    let mut add = |name: &str, mask: Mask, batch: usize, heads: usize, kv: usize, torch: bool| {
        v.push(Case { name: name.into(), mask, batch, heads, kv_heads: kv, torch });
    };
    add("full-257", Mask::full(257, 257)?, 2, 4, 4, true);
    add("causal-300", Mask::causal(300, 300)?, 2, 4, 4, true);
    add("causal-q130-k333", Mask::causal(130, 333)?, 2, 4, 2, false);
    add("causal-q333-k130", Mask::causal(333, 130)?, 1, 4, 1, false);
    add("full-q100-k389-gqa", Mask::full(100, 389)?, 2, 4, 2, false);
    add("swa64-causal-400", Mask::sliding_window(400, 400, Some(64), Some(0))?, 1, 4, 2, false);
    add("docs-causal", Mask::documents(&[100, 37, 180, 83], DocKind::Causal)?, 1, 4, 1, false);
    add("docs-full", Mask::documents(&[70, 130, 1, 55], DocKind::Full)?, 1, 4, 2, false);
    add("prefix-lm-300", Mask::prefix_lm(300, 90)?, 1, 4, 4, false);
    add("window-global-350", Mask::window_global(350, Some(40), Some(40), 16)?, 1, 4, 1, false);
    add("causal-1100", Mask::causal(1100, 1100)?, 1, 2, 2, true);
    Ok(v)
}

fn write_raw<T: Copy>(path: &std::path::Path, v: &[T]) -> Res<()> {
    let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) };
    std::fs::write(path, bytes)?;
    Ok(())
}

#[derive(serde::Serialize)]
struct CheckRow {
    case: String,
    dtype: String,
    head_dim: usize,
    batch: usize,
    q_len: usize,
    k_len: usize,
    heads: usize,
    kv_heads: usize,
    err_o: f64,
    err_lse: f64,
    err_dq: Option<f64>,
    err_dk: Option<f64>,
    err_dv: Option<f64>,
    pass: bool,
}

fn to_f32<T: Element>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn run_case<T: CudaElement>(
    be: &CudaBackend,
    c: &Case,
    d: usize,
    seed: u64,
    dump: Option<&std::path::Path>,
    tol: f64,
) -> Res<CheckRow> {
    let shape = AttnShape::new(c.batch, c.mask.q_len(), c.mask.k_len(), c.heads, c.kv_heads, d)?;
    let opts = AttnOptions::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let conv = |v: Vec<f32>| -> Vec<T> { v.into_iter().map(T::from_f32).collect() };
    let q = conv(randn(&mut rng, shape.q_elems()));
    let k = conv(randn(&mut rng, shape.kv_elems()));
    let v = conv(randn(&mut rng, shape.kv_elems()));
    let dout = conv(randn(&mut rng, shape.q_elems()));
    let s = be.stream();
    let (dq_, dk_, dv_) = (s.clone_htod(&q)?, s.clone_htod(&k)?, s.clone_htod(&v)?);
    let nan_t = vec![T::from_f32(f32::NAN); shape.q_elems()];
    let mut o = s.clone_htod(&nan_t)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; shape.lse_elems()])?;
    let mut of32 = s.clone_htod(&vec![f32::NAN; shape.q_elems()])?;
    be.forward(&dq_, &dk_, &dv_, &shape, &c.mask, &opts, &mut o, &mut lse, Some(&mut of32))?;
    let o_h: Vec<T> = s.clone_dtoh(&o)?;
    let lse_h: Vec<f32> = s.clone_dtoh(&lse)?;
    let of_h: Vec<f32> = s.clone_dtoh(&of32)?;
    let f64v = |x: &[T]| -> Vec<f64> { x.iter().map(|e| e.to_f32() as f64).collect() };
    let r = reference(&shape, &c.mask, opts.scale_for(d) as f64, &f64v(&q), &f64v(&k), &f64v(&v), &f64v(&dout));
    let err_o = rel_err(&to_f32(&o_h), &r.o).max(rel_err(&of_h, &r.o));
    let err_lse = rel_err(&lse_h, &r.lse);
    let mut row = CheckRow {
        case: c.name.clone(),
        dtype: T::DTYPE.to_string(),
        head_dim: d,
        batch: c.batch,
        q_len: shape.q_len,
        k_len: shape.k_len,
        heads: c.heads,
        kv_heads: c.kv_heads,
        err_o,
        err_lse,
        err_dq: None,
        err_dk: None,
        err_dv: None,
        pass: err_o <= tol && err_lse <= 1e-3,
    };
    let mut grads = None;
    if d <= 128 {
        let d_o = s.clone_htod(&o_h)?;
        let d_do = s.clone_htod(&dout)?;
        let mut gq = s.clone_htod(&nan_t)?;
        let nan_kv = vec![T::from_f32(f32::NAN); shape.kv_elems()];
        let mut gk = s.clone_htod(&nan_kv)?;
        let mut gv = s.clone_htod(&nan_kv)?;
        be.backward(&dq_, &dk_, &dv_, &d_o, &d_do, &lse, &shape, &c.mask, &opts, &mut gq, &mut gk, &mut gv)?;
        let (gq, gk, gv): (Vec<T>, Vec<T>, Vec<T>) = (s.clone_dtoh(&gq)?, s.clone_dtoh(&gk)?, s.clone_dtoh(&gv)?);
        row.err_dq = Some(rel_err(&to_f32(&gq), &r.dq));
        row.err_dk = Some(rel_err(&to_f32(&gk), &r.dk));
        row.err_dv = Some(rel_err(&to_f32(&gv), &r.dv));
        row.pass &= row.err_dq.unwrap() <= tol && row.err_dk.unwrap() <= tol && row.err_dv.unwrap() <= tol;
        grads = Some((gq, gk, gv));
    }
    if let (Some(dir), true) = (dump, c.torch) {
        let tag = format!("{}-{}-d{}", c.name, T::DTYPE, d);
        let sub = dir.join(&tag);
        std::fs::create_dir_all(&sub)?;
        write_raw(&sub.join("q.bin"), &q)?;
        write_raw(&sub.join("k.bin"), &k)?;
        write_raw(&sub.join("v.bin"), &v)?;
        write_raw(&sub.join("do.bin"), &dout)?;
        write_raw(&sub.join("o.bin"), &o_h)?;
        write_raw(&sub.join("lse.bin"), &lse_h)?;
        if let Some((gq, gk, gv)) = &grads {
            write_raw(&sub.join("dq.bin"), gq)?;
            write_raw(&sub.join("dk.bin"), gk)?;
            write_raw(&sub.join("dv.bin"), gv)?;
        }
        let meta = serde_json::json!({
            "case": c.name, "dtype": T::DTYPE.to_string(), "batch": c.batch, "q_len": shape.q_len,
            "k_len": shape.k_len, "heads": c.heads, "kv_heads": c.kv_heads, "head_dim": d,
            "causal": c.name.starts_with("causal"), "grads": grads.is_some(),
        });
        std::fs::write(sub.join("meta.json"), meta.to_string())?;
    }
    Ok(row)
}

/// Splits the keys in two, runs the forward on each half (f32 O), merges, compares with the
/// reference of the whole.
fn merge_case<T: CudaElement>(be: &CudaBackend, seed: u64, d: usize) -> Res<(f64, f64)> {
    let (nq, nk, h) = (300usize, 410usize, 4usize);
    let mask = Mask::causal(nq, nk)?;
    let shape = AttnShape::new(1, nq, nk, h, h, d)?;
    let split = 170;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let conv = |v: Vec<f32>| -> Vec<T> { v.into_iter().map(T::from_f32).collect() };
    let q = conv(randn(&mut rng, shape.q_elems()));
    let k = conv(randn(&mut rng, shape.kv_elems()));
    let v = conv(randn(&mut rng, shape.kv_elems()));
    let s = be.stream();
    let opts = AttnOptions::default();
    let mut o_parts = Vec::new();
    let mut lse_parts = Vec::new();
    for (a, b) in [(0, split), (split, nk)] {
        let sub = AttnShape::new(1, nq, b - a, h, h, d)?;
        let row = h * d;
        let ks = s.clone_htod(&k[a * row..b * row])?;
        let vs = s.clone_htod(&v[a * row..b * row])?;
        let qd = s.clone_htod(&q)?;
        let m = mask.restrict(0..nq, a..b)?;
        let mut o = s.alloc_zeros::<T>(sub.q_elems())?;
        let mut l = s.alloc_zeros::<f32>(sub.lse_elems())?;
        let mut of = s.alloc_zeros::<f32>(sub.q_elems())?;
        be.forward(&qd, &ks, &vs, &sub, &m, &opts, &mut o, &mut l, Some(&mut of))?;
        o_parts.extend(s.clone_dtoh(&of)?);
        lse_parts.extend(s.clone_dtoh(&l)?);
    }
    let op = s.clone_htod(&o_parts)?;
    let lp = s.clone_htod(&lse_parts)?;
    let mut oo = s.alloc_zeros::<f32>(shape.q_elems())?;
    let mut lo = s.alloc_zeros::<f32>(shape.lse_elems())?;
    be.merge::<T>(&op, &lp, 2, &shape, &mut oo, &mut lo, None)?;
    let (oo, lo): (Vec<f32>, Vec<f32>) = (s.clone_dtoh(&oo)?, s.clone_dtoh(&lo)?);
    let f64v = |x: &[T]| -> Vec<f64> { x.iter().map(|e| e.to_f32() as f64).collect() };
    let zeros = vec![0.0; shape.q_elems()];
    let r = reference(&shape, &mask, opts.scale_for(d) as f64, &f64v(&q), &f64v(&k), &f64v(&v), &zeros);
    Ok((rel_err(&oo, &r.o), rel_err(&lo, &r.lse)))
}

fn check(be: &CudaBackend, dump: Option<&std::path::Path>) -> Res<bool> {
    let cs = cases()?;
    let mut rows = Vec::new();
    let mut all = true;
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
    println!("seed base {seed}");
    println!(
        "{:<20} {:<5} {:>4} {:>5} {:>5} {:>3}/{:<2} {:>9} {:>9} {:>9} {:>9} {:>9}  result",
        "case", "dtype", "d", "nq", "nk", "h", "kv", "O", "LSE", "dQ", "dK", "dV"
    );
    for d in [64, 128, 96, 256] {
        for c in &cs {
            for dt in ["bf16", "f16"] {
                seed = seed.wrapping_add(0x9e3779b97f4a7c15);
                let t0 = Instant::now();
                let r = if dt == "bf16" {
                    run_case::<bf16>(be, c, d, seed, dump, 1e-2)
                } else {
                    run_case::<f16>(be, c, d, seed, dump, 1e-2)
                };
                match r {
                    Ok(row) => {
                        let f = |x: Option<f64>| x.map(|v| format!("{v:9.2e}")).unwrap_or(format!("{:>9}", "-"));
                        println!(
                            "{:<20} {:<5} {:>4} {:>5} {:>5} {:>3}/{:<2} {:9.2e} {:9.2e} {} {} {}  {} ({:.1}s)",
                            row.case,
                            row.dtype,
                            d,
                            row.q_len,
                            row.k_len,
                            row.heads,
                            row.kv_heads,
                            row.err_o,
                            row.err_lse,
                            f(row.err_dq),
                            f(row.err_dk),
                            f(row.err_dv),
                            if row.pass { "ok" } else { "FAIL" },
                            t0.elapsed().as_secs_f64()
                        );
                        all &= row.pass;
                        rows.push(row);
                    }
                    Err(e) => {
                        println!("{:<20} {dt:<5} {d:>4} ERROR {e}", c.name);
                        all = false;
                    }
                }
            }
        }
    }
    for d in [64, 128] {
        let (eo, el) = merge_case::<bf16>(be, seed ^ d as u64, d)?;
        let ok = eo <= 1e-2 && el <= 1e-3;
        all &= ok;
        println!(
            "merge (2 key halves, causal 300x410) bf16 d{d}: O {eo:.2e} LSE {el:.2e} {}",
            if ok { "ok" } else { "FAIL" }
        );
    }
    // Errors are typed, not panics.
    let shape = AttnShape::new(1, 64, 64, 2, 2, 80)?;
    let r = be.forward_host::<bf16>(
        &vec![bf16::ZERO; shape.q_elems()],
        &vec![bf16::ZERO; shape.kv_elems()],
        &vec![bf16::ZERO; shape.kv_elems()],
        &shape,
        &Mask::full(64, 64)?,
        &AttnOptions::default(),
    );
    println!("head dim 80 -> {:?}", r.err());
    if let Some(dir) = dump {
        std::fs::write(dir.join("rust_check.json"), serde_json::to_string_pretty(&rows)?)?;
    }
    println!("{} of {} cases passed", rows.iter().filter(|r| r.pass).count(), rows.len());
    Ok(all)
}

fn fill_random<T: CudaElement>(be: &CudaBackend, n: usize, seed: u64) -> Res<cudarc::driver::CudaSlice<T>> {
    // Fast host generator (xorshift, roughly unit-variance uniform), parallel over chunks.
    let mut v = vec![T::default(); n];
    v.par_chunks_mut(1 << 20).enumerate().for_each(|(ci, ch)| {
        let mut x = seed ^ ((ci as u64 + 1).wrapping_mul(0x9e3779b97f4a7c15));
        for e in ch.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32; // [0,1)
            *e = T::from_f32((u - 0.5) * 3.4641); // var 1
        }
    });
    Ok(be.stream().clone_htod(&v)?)
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
}

fn time_ms(be: &CudaBackend, reps: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    let ctx = be.context();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    f()?; // warm-up
    be.synchronize()?;
    let mut ts = Vec::new();
    for _ in 0..reps {
        let a = ctx.new_event(flags)?;
        let b = ctx.new_event(flags)?;
        a.record(be.stream())?;
        f()?;
        b.record(be.stream())?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(ts[ts.len() / 2])
}

fn bench(be: &CudaBackend, out: &str, dims: &[usize], quick: bool, seqs: Option<Vec<usize>>) -> Res<()> {
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
            let q = fill_random::<bf16>(be, shape.q_elems(), 1)?;
            let k = fill_random::<bf16>(be, shape.kv_elems(), 2)?;
            let v = fill_random::<bf16>(be, shape.kv_elems(), 3)?;
            let dout = fill_random::<bf16>(be, shape.q_elems(), 4)?;
            let s = be.stream();
            let mut o = s.alloc_zeros::<bf16>(shape.q_elems())?;
            let mut lse = s.alloc_zeros::<f32>(shape.lse_elems())?;
            let mut gq = s.alloc_zeros::<bf16>(shape.q_elems())?;
            let mut gk = s.alloc_zeros::<bf16>(shape.kv_elems())?;
            let mut gv = s.alloc_zeros::<bf16>(shape.kv_elems())?;
            for causal in [false, true] {
                let mask = if causal { Mask::causal(seq, seq)? } else { Mask::full(seq, seq)? };
                let opts = AttnOptions::default();
                let fwd_flops =
                    4.0 * (batch * heads) as f64 * (seq as f64).powi(2) * d as f64 / if causal { 2.0 } else { 1.0 };
                let reps = if seq >= 65536 { 3 } else { 10 };
                let tf = time_ms(be, reps, || {
                    be.forward(&q, &k, &v, &shape, &mask, &opts, &mut o, &mut lse, None)?;
                    Ok(())
                })?;
                let tb = time_ms(be, reps, || {
                    be.backward(&q, &k, &v, &o, &dout, &lse, &shape, &mask, &opts, &mut gq, &mut gk, &mut gv)?;
                    Ok(())
                })?;
                for (pass, t, fl) in [("fwd", tf, fwd_flops), ("bwd", tb, 2.5 * fwd_flops)] {
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
                    });
                }
                std::io::stdout().flush()?;
            }
        }
    }
    std::fs::write(out, serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let be = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("no GPU: {e}");
            std::process::exit(2);
        }
    };
    println!("device {} ({}), cache {:?}", be.device_name(), be.arch(), distattn_cuda::compile::cache_dir());
    let t0 = Instant::now();
    let bench_mode = args.get(1).map(|s| s == "bench").unwrap_or(false);
    let prep_dims: Vec<usize> = if bench_mode {
        get("--dims").unwrap_or_else(|| "128".into()).split(',').filter_map(|x| x.parse().ok()).collect()
    } else {
        vec![64, 96, 128, 256]
    };
    for &d in &prep_dims {
        for dt in [distattn_core::DType::BF16, distattn_core::DType::F16] {
            if bench_mode && dt != distattn_core::DType::BF16 {
                continue;
            }
            if let Err(e) = be.prepare(dt, d) {
                eprintln!("prepare {dt} d{d}: {e}");
                std::process::exit(1);
            }
        }
    }
    println!("kernels ready in {:.2}s", t0.elapsed().as_secs_f64());
    let res = match args.get(1).map(|s| s.as_str()) {
        Some("check") => {
            let dump = get("--dump").map(std::path::PathBuf::from);
            check(&be, dump.as_deref()).map(|ok| if ok { 0 } else { 1 })
        }
        Some("bench") => {
            let out = get("--out").unwrap_or_else(|| "distattn_bench.json".into());
            let dims: Vec<usize> =
                get("--dims").unwrap_or_else(|| "128".into()).split(',').filter_map(|x| x.parse().ok()).collect();
            let seqs = get("--seqs").map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect());
            bench(&be, &out, &dims, args.iter().any(|a| a == "--quick"), seqs).map(|_| 0)
        }
        _ => {
            eprintln!("usage: distattn-cuda-gpu check [--dump DIR] | bench --out FILE [--dims 128,64] [--quick]");
            Ok(2)
        }
    };
    match res {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

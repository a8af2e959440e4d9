//! Single-thread GFLOP/s of the tile GEMM micro-kernel (data in L1/L2), per second of thread
//! CPU time, for tuning.
//! cargo run --release -p distattn-cpu --example kernel_bench
use distattn_cpu::flash::gemm::{gemm, simd_available, AOp, BOp, COp, Dims};

fn main() {
    let simd = simd_available();
    for &(m, n, k, trans) in &[
        (96, 64, 64, false),
        (96, 64, 128, false),
        (96, 128, 64, false),
        (64, 64, 64, true),
        (64, 128, 64, true),
        (96, 128, 128, false),
    ] {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let mut c = vec![0f32; m * n];
        let (rs, cs) = if trans { (1, m) } else { (k, 1) };
        let (ao, bo, co) =
            (AOp { ptr: a.as_ptr(), rs, cs }, BOp::rows(b.as_ptr(), n), COp { ptr: c.as_mut_ptr(), ld: n });
        let iters = 20000;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = cpu_time::ThreadTime::now();
            for _ in 0..iters {
                // SAFETY: `a` holds the m·k floats (rs, cs) address, (k, 1) or (1, m); `b` holds k
                // rows of n floats and `c` m rows of n; every n listed is a multiple of 16; the
                // three are separate vectors.
                unsafe { gemm(simd, Dims { m, n, k }, ao, bo, co, true) };
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("m={m} n={n} k={k} transA={trans}: {:.1} GFLOP/s", 2.0 * (m * n * k * iters) as f64 / best / 1e9);
    }
    // Softmax row step (exp2 throughput): rows of 64 scores.
    let mut row: Vec<f32> = (0..64 * 96).map(|i| ((i * 31 % 97) as f32) * 0.1).collect();
    let mut best = f64::INFINITY;
    let iters = 2000;
    for _ in 0..5 {
        let t = cpu_time::ThreadTime::now();
        let mut acc = 0f32;
        for _ in 0..iters {
            for r in row.chunks_mut(std::env::var("ROWLEN").map(|v| v.parse().unwrap()).unwrap_or(64)) {
                acc += distattn_cpu::flash::vmath::fwd_row(simd, r, 0.18, 12.0).2;
                r[3] = 5.0;
            }
        }
        std::hint::black_box(acc);
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("fwd_row: {:.3} ns per score", best / (iters * row.len()) as f64 * 1e9);
}

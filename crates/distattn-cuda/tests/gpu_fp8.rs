//! The FP8 forward against the f64 reference on the inputs' exact values, on an sm_90a GPU
//! (`cargo test --release -p distattn-cuda -- --ignored`; elsewhere these tests fail, saying
//! so).
//!
//! Q, K and V are drawn at unit scale, divided by random per-(batch, KV head) descales and
//! rounded to e4m3; the reference takes code × descale. Masks, GQA and lengths that do not fill
//! tiles as in the bf16 kernels' tests; outputs are poisoned (NaN) before each run.

use distattn_core::mask::DocKind;
use distattn_core::{AttnOptions, AttnShape, Error, Mask};
use distattn_cuda::compile::E4m3Tiling;
use distattn_cuda::CudaBackend;
use distattn_testkit::fp8::{e4m3_from_f32, e4m3_to_f32};
use distattn_testkit::{lse_err, randn, reference, rel_err, seeded_rng, uniform};
use half::bf16;
use rand::rngs::StdRng;

/// P is rounded to e4m3 (3 mantissa bits) for P V: O's relative error is a few 1e-2 at most.
const O_TOL: f64 = 3e-2;
/// Scores and row sums stay in f32: the LSE is as exact as the bf16 kernels'.
const LSE_TOL: f64 = 1e-3;

fn gpu() -> CudaBackend {
    let g = CudaBackend::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"));
    assert!(g.has_e4m3_forward(), "these tests need an sm_90a GPU, not {}", g.arch());
    g
}

/// e4m3 codes of `x / descale` (descale per (batch, KV head) of a `[b, n, heads, d]` tensor)
/// and the values they stand for.
fn quantize(x: &[f32], shape: &AttnShape, n: usize, heads: usize, descale: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let d = shape.head_dim;
    let group = heads / shape.kv_heads;
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let (b, h) = (i / (n * heads * d), (i / d) % heads);
            let s = descale[b * shape.kv_heads + h / group];
            let c = e4m3_from_f32(v / s);
            (c, e4m3_to_f32(c) * s)
        })
        .unzip()
}

/// O and LSE errors of one case (descales drawn in [0.5, 2], or none).
fn errors(
    gpu: &CudaBackend,
    mask: &Mask,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    scaled: bool,
    rng: &mut StdRng,
) -> (f64, f64) {
    let shape = AttnShape::new(batch, mask.q_len(), mask.k_len(), heads, kv_heads, 128).unwrap();
    let bh = batch * kv_heads;
    let descales = if scaled { uniform(rng, 3 * bh, 0.5, 2.0) } else { vec![1.0; 3 * bh] };
    let (q8, q) = quantize(&randn(rng, shape.q_elems(), 1.0), &shape, shape.q_len, heads, &descales[..bh]);
    let (k8, k) = quantize(&randn(rng, shape.kv_elems(), 1.0), &shape, shape.k_len, kv_heads, &descales[bh..2 * bh]);
    let (v8, v) = quantize(&randn(rng, shape.kv_elems(), 1.0), &shape, shape.k_len, kv_heads, &descales[2 * bh..]);
    let s = gpu.stream();
    let (gq, gk, gv) = (s.clone_htod(&q8).unwrap(), s.clone_htod(&k8).unwrap(), s.clone_htod(&v8).unwrap());
    let gd = s.clone_htod(&descales).unwrap();
    let mut o = s.clone_htod(&vec![bf16::NAN; shape.q_elems()]).unwrap();
    let mut lse = s.clone_htod(&vec![f32::NAN; shape.lse_elems()]).unwrap();
    let opts = AttnOptions::default();
    gpu.forward_e4m3(&gq, &gk, &gv, scaled.then_some(&gd), &shape, mask, &opts, &mut o, &mut lse).unwrap();
    let o_h: Vec<bf16> = s.clone_dtoh(&o).unwrap();
    let lse_h: Vec<f32> = s.clone_dtoh(&lse).unwrap();
    let r = reference::forward(&q, &k, &v, &shape, mask, &opts).unwrap();
    (rel_err(&o_h, &r.o), lse_err(&lse_h, &r.lse))
}

#[test]
#[ignore = "needs an sm_90a GPU"]
fn fp8_forward_matches_the_f64_reference() {
    let gpu = gpu();
    let (mut rng, seed) = seeded_rng("fp8_forward_matches_the_f64_reference");
    let cases = [
        ("full-257", Mask::full(257, 257).unwrap(), 2, 4, 4, true),
        ("causal-300", Mask::causal(300, 300).unwrap(), 2, 4, 2, true),
        ("causal-q130-k333-gqa4", Mask::causal(130, 333).unwrap(), 2, 4, 1, true),
        ("full-q1-k500", Mask::full(1, 500).unwrap(), 3, 8, 2, true),
        ("swa64-causal-400", Mask::sliding_window(400, 400, Some(64), Some(0)).unwrap(), 1, 4, 2, true),
        ("docs-causal", Mask::documents(&[100, 37, 180, 83], DocKind::Causal).unwrap(), 1, 4, 1, true),
        ("causal-1100-unscaled", Mask::causal(1100, 1100).unwrap(), 1, 2, 2, false),
        ("full-2048", Mask::full(2048, 2048).unwrap(), 1, 4, 2, true),
    ];
    let mut failures = Vec::new();
    // Both block shapes on every case (these grids are small enough to pick SHORT by themselves).
    for tiling in [E4m3Tiling::TALL, E4m3Tiling::SHORT] {
        gpu.set_e4m3_tiling(Some(tiling));
        let t = format!("{}x{}", tiling.rows, tiling.keys);
        for (name, mask, b, h, hkv, scaled) in &cases {
            let (eo, el) = errors(&gpu, mask, *b, *h, *hkv, *scaled, &mut rng);
            let ok = eo <= O_TOL && el <= LSE_TOL;
            println!("{t:<8} {name:<24} O {eo:.2e} LSE {el:.2e} {}", if ok { "ok" } else { "FAIL" });
            if !ok {
                failures.push(format!("{t} {name}: O {eo:.2e}, LSE {el:.2e}"));
            }
        }
    }
    assert!(failures.is_empty(), "DISTATTN_SEED={seed}:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs an sm_90a GPU"]
fn fp8_forward_refuses_what_it_cannot_run() {
    let gpu = gpu();
    let s = gpu.stream();
    let opts = AttnOptions::default();
    let mask = Mask::causal(64, 64).unwrap();
    let run = |d: usize, q_len: usize| {
        let shape = AttnShape::new(1, 64, 64, 2, 2, d).unwrap();
        let q = s.alloc_zeros::<u8>(q_len).unwrap();
        let kv = s.alloc_zeros::<u8>(shape.kv_elems()).unwrap();
        let mut o = s.alloc_zeros::<bf16>(shape.q_elems()).unwrap();
        let mut lse = s.alloc_zeros::<f32>(shape.lse_elems()).unwrap();
        gpu.forward_e4m3(
            &q,
            &kv,
            &kv,
            None::<&distattn_cuda::cudarc::driver::CudaSlice<f32>>,
            &shape,
            &mask,
            &opts,
            &mut o,
            &mut lse,
        )
    };
    assert!(matches!(run(64, 64 * 2 * 64), Err(Error::UnsupportedHeadDim { head_dim: 64, .. })));
    let r = run(128, 100);
    assert!(matches!(&r, Err(Error::ShapeMismatch { tensor, .. }) if tensor == "q"), "{r:?}");
    run(128, 64 * 2 * 128).expect("a well-formed call runs");
}

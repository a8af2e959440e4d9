//! The CUDA kernels against the f64 reference of the test kit, on a GPU
//! (`cargo test --release -p distattn-cuda -- --ignored`; without a GPU these tests fail,
//! saying so).
//!
//! Forward (O, LSE), backward (dQ, dK, dV) and the LSE merge, on fresh random inputs (the seed
//! is printed; `DISTATTN_SEED` replays it), for dtype × head dim × mask × GQA × awkward
//! lengths. Outputs are poisoned (NaN) before each run, so an element a kernel never writes
//! fails the check.

use distattn_core::mask::DocKind;
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask};
use distattn_cuda::compile::KernelConfig;
use distattn_cuda::cudarc::driver::CudaSlice;
use distattn_cuda::{CudaBackend, CudaElement, GpuBuf};
use distattn_testkit::{cast, lse_err, randn, reference, rel_err, seeded_rng};
use half::{bf16, f16};
use rand::rngs::StdRng;

/// Relative error bound of the bf16/f16 kernels against f64 on the stored inputs.
const TOL: f64 = 1e-2;
/// The LSE is computed in f32 throughout.
const LSE_TOL: f64 = 1e-3;

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"))
}

struct Case {
    name: &'static str,
    mask: Mask,
    batch: usize,
    heads: usize,
    kv_heads: usize,
}

fn cases() -> Vec<Case> {
    let c = |name, mask, batch, heads, kv_heads| Case { name, mask, batch, heads, kv_heads };
    vec![
        c("full-257", Mask::full(257, 257).unwrap(), 2, 4, 4),
        c("causal-300", Mask::causal(300, 300).unwrap(), 2, 4, 4),
        c("causal-q130-k333", Mask::causal(130, 333).unwrap(), 2, 4, 2),
        c("causal-q333-k130", Mask::causal(333, 130).unwrap(), 1, 4, 1),
        c("full-q100-k389-gqa", Mask::full(100, 389).unwrap(), 2, 4, 2),
        c("swa64-causal-400", Mask::sliding_window(400, 400, Some(64), Some(0)).unwrap(), 1, 4, 2),
        c("docs-causal", Mask::documents(&[100, 37, 180, 83], DocKind::Causal).unwrap(), 1, 4, 1),
        c("docs-full", Mask::documents(&[70, 130, 1, 55], DocKind::Full).unwrap(), 1, 4, 2),
        c("prefix-lm-300", Mask::prefix_lm(300, 90).unwrap(), 1, 4, 4),
        c("window-global-350", Mask::window_global(350, Some(40), Some(40), 16).unwrap(), 1, 4, 1),
        c("causal-1100", Mask::causal(1100, 1100).unwrap(), 1, 2, 2),
    ]
}

/// Fresh random Q, K, V and dO of `shape` (unit normal, rounded to `T`).
fn inputs<T: CudaElement>(rng: &mut StdRng, shape: &AttnShape) -> [Vec<T>; 4] {
    let (nq, nk) = (shape.q_elems(), shape.kv_elems());
    [nq, nk, nk, nq].map(|n| cast(&randn(rng, n, 1.0)))
}

/// The keys of a one-batch problem split at `split`: each half's shape, mask and K, V rows (what
/// two context-parallel ranks hold).
struct KeyHalf<'a, T> {
    shape: AttnShape,
    mask: Mask,
    k: &'a [T],
    v: &'a [T],
}
fn key_halves<'a, T>(shape: &AttnShape, mask: &Mask, split: usize, k: &'a [T], v: &'a [T]) -> [KeyHalf<'a, T>; 2] {
    assert_eq!(shape.batch, 1, "key rows are sliced as one batch's");
    let row = shape.kv_heads * shape.head_dim;
    [(0, split), (split, shape.k_len)].map(|(a, b)| KeyHalf {
        shape: AttnShape::new(1, shape.q_len, b - a, shape.heads, shape.kv_heads, shape.head_dim).unwrap(),
        mask: mask.restrict(0..shape.q_len, a..b).unwrap(),
        k: &k[a * row..b * row],
        v: &v[a * row..b * row],
    })
}

/// Errors of one case: O (alone, and with the f32 copy: the dtype output and the copy), LSE, dQ,
/// dK and dV.
fn errors<T: CudaElement>(gpu: &CudaBackend, c: &Case, d: usize, rng: &mut StdRng) -> Vec<(&'static str, f64)> {
    let shape = AttnShape::new(c.batch, c.mask.q_len(), c.mask.k_len(), c.heads, c.kv_heads, d).unwrap();
    let opts = AttnOptions::default();
    let [q, k, v, d_o] = inputs::<T>(rng, &shape);
    let s = gpu.stream();
    let up = |x: &[T]| s.clone_htod(x).unwrap();
    let (gq, gk, gv, gd_o) = (up(&q), up(&k), up(&v), up(&d_o));
    let nan_q = vec![T::from_f32(f32::NAN); shape.q_elems()];
    let nan_lse = vec![f32::NAN; shape.lse_elems()];
    // O alone (on sm_90a stored by TMA through shared memory), then O with its f32 copy (stored
    // by each thread).
    let (mut o, mut lse) = (s.clone_htod(&nan_q).unwrap(), s.clone_htod(&nan_lse).unwrap());
    gpu.forward(&gq, &gk, &gv, &shape, &c.mask, &opts, &mut o, &mut lse, None).unwrap();
    let (mut o2, mut lse2) = (s.clone_htod(&nan_q).unwrap(), s.clone_htod(&nan_lse).unwrap());
    let mut o_f32 = s.clone_htod(&vec![f32::NAN; shape.q_elems()]).unwrap();
    gpu.forward(&gq, &gk, &gv, &shape, &c.mask, &opts, &mut o2, &mut lse2, Some(&mut o_f32.as_view_mut())).unwrap();
    let rf = reference::forward(&q, &k, &v, &shape, &c.mask, &opts).unwrap();
    let o_err = |x: &CudaSlice<T>| rel_err(&s.clone_dtoh(x).unwrap(), &rf.o);
    let lse_of = |x: &CudaSlice<f32>| lse_err(&s.clone_dtoh(x).unwrap(), &rf.lse);
    let of_err = rel_err(&s.clone_dtoh(&o_f32).unwrap(), &rf.o);
    let mut errs = vec![("O", o_err(&o).max(o_err(&o2)).max(of_err)), ("LSE", lse_of(&lse).max(lse_of(&lse2)))];
    let nan_kv = vec![T::from_f32(f32::NAN); shape.kv_elems()];
    let (mut dq, mut dk, mut dv) =
        (s.clone_htod(&nan_q).unwrap(), s.clone_htod(&nan_kv).unwrap(), s.clone_htod(&nan_kv).unwrap());
    gpu.backward(&gq, &gk, &gv, &o, &lse, &gd_o, &shape, &c.mask, &opts, &mut dq, &mut dk, &mut dv).unwrap();
    let rg = reference::backward(&q, &k, &v, &d_o, &shape, &c.mask, &opts).unwrap();
    let host = |x: &CudaSlice<T>| s.clone_dtoh(x).unwrap();
    errs.push(("dQ", rel_err(&host(&dq), &rg.dq)));
    errs.push(("dK", rel_err(&host(&dk), &rg.dk)));
    errs.push(("dV", rel_err(&host(&dv), &rg.dv)));
    errs
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_match_the_f64_reference() {
    let gpu = gpu();
    let (mut rng, seed) = seeded_rng("kernels_match_the_f64_reference");
    let mut failures = Vec::new();
    let mut n = 0;
    for d in [64, 128, 96, 192, 256] {
        // Where the forward has a second tiling for short grids (d 64 and 96 on Hopper), every case
        // runs on both: the cases' grids are all short, so the default would test only one.
        let has_short = KernelConfig::new(DType::BF16, d).unwrap().for_arch(gpu.arch()).fwd_short().is_some();
        let tilings: &[Option<bool>] = if has_short { &[Some(true), Some(false)] } else { &[None] };
        for &short in tilings {
            gpu.set_fwd_short(short);
            let tiling = match short {
                Some(true) => " short",
                Some(false) => " long",
                None => "",
            };
            for c in cases() {
                for dtype in [DType::BF16, DType::F16] {
                    let errs = match dtype {
                        DType::BF16 => errors::<bf16>(&gpu, &c, d, &mut rng),
                        _ => errors::<f16>(&gpu, &c, d, &mut rng),
                    };
                    n += 1;
                    let line = errs.iter().map(|(w, e)| format!("{w} {e:.2e}")).collect::<Vec<_>>().join(", ");
                    let ok = errs.iter().all(|&(w, e)| e <= if w == "LSE" { LSE_TOL } else { TOL });
                    println!("{:<20} {dtype:<5} d{d:<4}{tiling} {line} {}", c.name, if ok { "ok" } else { "FAIL" });
                    if !ok {
                        failures.push(format!("{} {dtype} d{d}{tiling}: {line}", c.name));
                    }
                }
            }
        }
        gpu.set_fwd_short(None);
    }
    assert!(
        failures.is_empty(),
        "{} of {n} cases fail (DISTATTN_SEED={seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn merge_of_key_halves_equals_the_whole() {
    let gpu = gpu();
    let (mut rng, seed) = seeded_rng("merge_of_key_halves_equals_the_whole");
    let s = gpu.stream();
    let opts = AttnOptions::default();
    for d in [64, 128] {
        // Causal 300 x 410: the first rows see no key of the second half, some none at all of
        // the first; the merge must keep both.
        let (nq, nk, h, split) = (300usize, 410usize, 4usize, 170usize);
        let mask = Mask::causal(nq, nk).unwrap();
        let shape = AttnShape::new(1, nq, nk, h, h, d).unwrap();
        let [q, k, v, _] = inputs::<bf16>(&mut rng, &shape);
        let (mut o_parts, mut lse_parts) = (Vec::new(), Vec::new());
        for half in key_halves(&shape, &mask, split, &k, &v) {
            let part = gpu.forward_host(&q, half.k, half.v, &half.shape, &half.mask, &opts).unwrap();
            o_parts.extend(part.o);
            lse_parts.extend(part.lse);
        }
        let (op, lp) = (s.clone_htod(&o_parts).unwrap(), s.clone_htod(&lse_parts).unwrap());
        let mut o = s.alloc_zeros::<f32>(shape.q_elems()).unwrap();
        let mut lse = s.alloc_zeros::<f32>(shape.lse_elems()).unwrap();
        gpu.merge(&op, &lp, 2, &shape, &mut o, &mut lse).unwrap();
        let (o, lse): (Vec<f32>, Vec<f32>) = (s.clone_dtoh(&o).unwrap(), s.clone_dtoh(&lse).unwrap());
        let r = reference::forward(&q, &k, &v, &shape, &mask, &opts).unwrap();
        let (eo, el) = (rel_err(&o, &r.o), lse_err(&lse, &r.lse));
        println!("merge of two key halves, d{d}: O {eo:.2e} LSE {el:.2e}");
        assert!(eo <= TOL && el <= LSE_TOL, "d{d}: O {eo:.2e} LSE {el:.2e} (DISTATTN_SEED={seed})");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_blocks_over_key_halves_add_up_to_the_whole() {
    // What a context-parallel rank's backward does: each block adds its dQ into one f32
    // accumulator (above d 128 from the by-query dQ job, which a whole backward has write dQ
    // instead) and its dK, dV into its own keys' accumulators.
    let gpu = gpu();
    let (mut rng, seed) = seeded_rng("backward_blocks_over_key_halves_add_up_to_the_whole");
    let s = gpu.stream();
    let opts = AttnOptions::default();
    for d in [128, 256] {
        let (nq, nk, h, hkv, split) = (300usize, 410usize, 4usize, 2usize, 170usize);
        let mask = Mask::causal(nq, nk).unwrap();
        let shape = AttnShape::new(1, nq, nk, h, hkv, d).unwrap();
        let [q, k, v, d_o] = inputs::<bf16>(&mut rng, &shape);
        let r = reference::forward(&q, &k, &v, &shape, &mask, &opts).unwrap();
        let g = reference::backward(&q, &k, &v, &d_o, &shape, &mask, &opts).unwrap();
        // The global LSE and D = rowsum(dO * O) (`[b, h, nq]`), from the reference's O.
        let lse: Vec<f32> = r.lse.iter().map(|&x| x as f32).collect();
        let mut delta = vec![0f32; shape.lse_elems()];
        for n in 0..nq {
            for hh in 0..h {
                let at = (n * h + hh) * d;
                delta[hh * nq + n] = (0..d).map(|i| d_o[at + i].to_f64() * r.o[at + i]).sum::<f64>() as f32;
            }
        }
        let (gq, gd_o) = (s.clone_htod(&q).unwrap(), s.clone_htod(&d_o).unwrap());
        let (glse, gdelta) = (s.clone_htod(&lse).unwrap(), s.clone_htod(&delta).unwrap());
        let mut dq_acc = s.alloc_zeros::<f32>(shape.q_elems()).unwrap();
        let (mut dk, mut dv) = (Vec::new(), Vec::new());
        for half in key_halves(&shape, &mask, split, &k, &v) {
            let (gk, gv) = (s.clone_htod(half.k).unwrap(), s.clone_htod(half.v).unwrap());
            let mut dk_acc = s.alloc_zeros::<f32>(half.shape.kv_elems()).unwrap();
            let mut dv_acc = s.alloc_zeros::<f32>(half.shape.kv_elems()).unwrap();
            gpu.backward_block(
                &gq,
                &gk,
                &gv,
                &gd_o,
                &glse,
                &gdelta,
                &half.shape,
                &half.mask,
                &opts,
                &mut dq_acc,
                &mut dk_acc,
                &mut dv_acc,
            )
            .unwrap();
            dk.extend(s.clone_dtoh(&dk_acc).unwrap());
            dv.extend(s.clone_dtoh(&dv_acc).unwrap());
        }
        let dq: Vec<f32> = s.clone_dtoh(&dq_acc).unwrap();
        let errs = [("dQ", rel_err(&dq, &g.dq)), ("dK", rel_err(&dk, &g.dk)), ("dV", rel_err(&dv, &g.dv))];
        let line = errs.iter().map(|(w, e)| format!("{w} {e:.2e}")).collect::<Vec<_>>().join(", ");
        println!("backward of two key halves, d{d}: {line}");
        assert!(errs.iter().all(|&(_, e)| e <= TOL), "d{d}: {line} (DISTATTN_SEED={seed})");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_inputs_are_typed_errors() {
    let gpu = gpu();
    let opts = AttnOptions::default();
    let z = |n| vec![bf16::from_f32(0.5); n];
    let shape = AttnShape::new(1, 64, 64, 2, 2, 80).unwrap();
    let r = gpu.forward_host(
        &z(shape.q_elems()),
        &z(shape.kv_elems()),
        &z(shape.kv_elems()),
        &shape,
        &Mask::full(64, 64).unwrap(),
        &opts,
    );
    assert!(matches!(r, Err(Error::UnsupportedHeadDim { head_dim: 80, .. })), "{r:?}");
    let shape = AttnShape::new(1, 64, 64, 2, 2, 64).unwrap();
    let r = gpu.forward_host(
        &z(10),
        &z(shape.kv_elems()),
        &z(shape.kv_elems()),
        &shape,
        &Mask::full(64, 64).unwrap(),
        &opts,
    );
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
    let r = gpu.forward_host(
        &z(shape.q_elems()),
        &z(shape.kv_elems()),
        &z(shape.kv_elems()),
        &shape,
        &Mask::full(32, 64).unwrap(),
        &opts,
    );
    assert!(
        matches!(&r, Err(Error::ShapeMismatch { tensor, .. }) if tensor == "mask"),
        "a mask of the wrong size: {r:?}"
    );
    let shape80 = AttnShape::new(1, 64, 64, 2, 2, 80).unwrap();
    let (q, kv) = (z(shape80.q_elems()), z(shape80.kv_elems()));
    let r = gpu.backward_host(
        &q,
        &kv,
        &kv,
        &q,
        &vec![0.0; shape80.lse_elems()],
        &q,
        &shape80,
        &Mask::full(64, 64).unwrap(),
        &opts,
    );
    assert!(matches!(r, Err(Error::UnsupportedHeadDim { head_dim: 80, .. })), "{r:?}");
}

/// A rank of a step that holds no query rows has empty outputs, which torch gives a null
/// address: storing one stores nothing (it once failed on the address, then on a launch of no
/// blocks), and a non-empty store still refuses a null address.
#[test]
#[ignore = "needs a CUDA GPU"]
fn empty_outputs_store_nothing() {
    let gpu = gpu();
    let s = gpu.stream();
    let empty = GpuBuf::alloc(s, DType::F32, 0).unwrap();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // SAFETY: nothing is written: the buffer is empty.
        let r = unsafe { gpu.store_external(&empty, 0, dtype) };
        assert!(r.is_ok(), "{dtype}: {r:?}");
    }
    let one = GpuBuf::filled(s, DType::F32, 2, 1.0).unwrap();
    // SAFETY: refused before any write: the address is null.
    let r = unsafe { gpu.store_external(&one, 0, DType::BF16) };
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    s.synchronize().unwrap();
}

/// An output already in the tensor's dtype (a plan's final results held narrowed) is copied as
/// is; one of a third dtype is refused, not reinterpreted.
#[test]
#[ignore = "needs a CUDA GPU"]
fn outputs_in_the_tensors_dtype_are_copied() {
    let gpu = gpu();
    let s = gpu.stream();
    let (mut rng, _) = seeded_rng("outputs_in_the_tensors_dtype_are_copied");
    let values: Vec<bf16> = cast(&randn(&mut rng, 1000, 1.0));
    let src = GpuBuf::upload(s, &values).unwrap();
    let dst = GpuBuf::filled(s, DType::BF16, values.len(), 0.0).unwrap();
    // SAFETY: `dst` holds as many bf16 as `src`, is a whole allocation (aligned) on this
    // stream, and nothing else uses it until the synchronize below.
    unsafe { gpu.store_external(&src, dst.ptr(s), DType::BF16) }.unwrap();
    let got = dst.download_f32(s).unwrap();
    assert!(got.iter().zip(&values).all(|(g, v)| *g == v.to_f32()));
    // SAFETY: refused before any write.
    let r = unsafe { gpu.store_external(&src, dst.ptr(s), DType::F16) };
    assert!(matches!(r, Err(Error::UnsupportedDType(_))), "{r:?}");
    s.synchronize().unwrap();
}

/// A NaN or infinite query row gives NaN in that row only; a NaN key gives NaN in exactly the
/// rows that see it (never O = 0, LSE = −inf, which means "sees no key").
#[test]
#[ignore = "needs a CUDA GPU"]
fn non_finite_inputs_give_nan_where_they_reach() {
    let gpu = gpu();
    let (mut rng, _) = seeded_rng("non_finite_inputs_give_nan_where_they_reach");
    let opts = AttnOptions::default();
    let n = 300;
    for d in [64, 128, 256] {
        let shape = AttnShape::new(1, n, n, 2, 1, d).unwrap();
        let q: Vec<bf16> = cast(&randn(&mut rng, shape.q_elems(), 1.0));
        let k: Vec<bf16> = cast(&randn(&mut rng, shape.kv_elems(), 1.0));
        let v: Vec<bf16> = cast(&randn(&mut rng, shape.kv_elems(), 1.0));
        let row = |f: &distattn_core::Forward, i: usize, h: usize| {
            let off = shape.q_offset(0, i, h);
            (f.o[off..off + d].to_vec(), f.lse[shape.lse_offset(0, h, i)])
        };
        for mask in [Mask::causal(n, n).unwrap(), Mask::full(n, n).unwrap()] {
            let clean = gpu.forward_host(&q, &k, &v, &shape, &mask, &opts).unwrap();
            for bad in [f32::NAN, f32::INFINITY] {
                let mut q2 = q.clone();
                q2[shape.q_offset(0, 77, 1) + 5] = bf16::from_f32(bad);
                let got = gpu.forward_host(&q2, &k, &v, &shape, &mask, &opts).unwrap();
                for i in 0..n {
                    for h in 0..2 {
                        let (o, lse) = row(&got, i, h);
                        if (i, h) == (77, 1) {
                            assert!(o.iter().all(|x| x.is_nan()) && lse.is_nan(), "d{d} {bad}: row {i}: {lse}");
                        } else {
                            assert_eq!((o, lse), row(&clean, i, h), "d{d} {bad}: row {i} head {h}");
                        }
                    }
                }
            }
        }
        let mask = Mask::causal(n, n).unwrap();
        let clean = gpu.forward_host(&q, &k, &v, &shape, &mask, &opts).unwrap();
        let j = 200;
        let mut k2 = k.clone();
        k2[shape.kv_offset(0, j, 0) + 3] = bf16::from_f32(f32::NAN);
        let got = gpu.forward_host(&q, &k2, &v, &shape, &mask, &opts).unwrap();
        for i in 0..n {
            for h in 0..2 {
                let (o, lse) = row(&got, i, h);
                if i >= j {
                    assert!(o.iter().all(|x| x.is_nan()) && lse.is_nan(), "d{d}: row {i} sees key {j}");
                } else {
                    assert_eq!((o, lse), row(&clean, i, h), "d{d}: row {i} does not see key {j}");
                }
            }
        }
    }
}

//! Every strategy × mask × world size × GQA on/off × uneven lengths, on in-process CPU ranks
//! through the one interpreter: distributed forward (O, LSE) and backward (dQ, dK, dV) equal the
//! single call to f32 rounding; plus failure handling and merge precision.

use distattn::plan::RingBackward;
use distattn::{
    Attention, AttnOptions, AttnShape, Element, Error, Execution, FailureKind, Forward, Grads, InjectedFailure, Mask,
    PlanOptions, Ranks, Strategy,
};
use distattn_testkit::{cast, lse_err, reference, rel_err as rel_err_f64, rel_err_f32 as rel_err, seeded_rng, uniform};
use half::bf16;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

/// `n` values uniform in [-1, 1), stored as `T`.
fn randv<T: Element>(n: usize, rng: &mut rand::rngs::StdRng) -> Vec<T> {
    cast(&uniform(rng, n, -1.0, 1.0))
}

fn masks(n: usize) -> Vec<(&'static str, Mask)> {
    let a = n / 3;
    let b = n / 5 + 1;
    vec![
        ("full", Mask::full(n, n).unwrap()),
        ("causal", Mask::causal(n, n).unwrap()),
        ("window", Mask::sliding_window(n, n, Some(7), Some(0)).unwrap()),
        ("docs", Mask::documents(&[a, b, n - a - b], distattn_core::mask::DocKind::Causal).unwrap()),
        ("prefix", Mask::prefix_lm(n, n / 4).unwrap()),
    ]
}

fn strategies(p: usize) -> Vec<Strategy> {
    let mut v = vec![
        Strategy::Ring,
        Strategy::Zigzag,
        Strategy::Striped,
        Strategy::Balanced,
        Strategy::Ulysses,
        Strategy::Allgather,
        Strategy::Dispatch,
        Strategy::PassQ,
    ];
    let u = if p.is_multiple_of(2) { 2 } else { p };
    v.push(Strategy::Hybrid { ulysses_degree: u });
    // Inner rings of 2 (two or more outer steps at even P) and of 1 (every block crosses the
    // outer ring; each rank starts inner rings with others' blocks).
    v.push(Strategy::DoubleRing { inner: u });
    v.push(Strategy::DoubleRing { inner: 1 });
    v
}

const TOL: f64 = 1e-5;

/// Fresh Q, K, V, dO of `shape`, uniform in [-1, 1), from `test`'s seed (printed; a failing
/// test's output shows it).
fn qkv_do<T: Element>(shape: &AttnShape, test: &str) -> (Vec<T>, Vec<T>, Vec<T>, Vec<T>) {
    let (mut rng, _) = seeded_rng(test);
    let (q, k) = (randv(shape.q_elems(), &mut rng), randv(shape.kv_elems(), &mut rng));
    (q, k, randv(shape.kv_elems(), &mut rng), randv(shape.q_elems(), &mut rng))
}

/// The problem on the CPU, one call.
fn single(shape: &AttnShape, mask: &Mask) -> Attention {
    Attention::new(*shape, mask.clone()).unwrap()
}

/// The problem on `ranks`.
fn on_ranks(shape: &AttnShape, mask: &Mask, ranks: Ranks) -> Attention {
    single(shape, mask).on(Execution::CpuRanks(ranks))
}

/// The problem on `p` ranks running `s` with default options.
fn on(s: Strategy, p: usize, shape: &AttnShape, mask: &Mask) -> Attention {
    on_ranks(shape, mask, Ranks::new(p, s))
}

/// The single call's forward and backward.
/// Forward and backward of `s` on `world` ranks against the single call's (`want`, `wg`).
fn assert_matches_single(
    s: Strategy,
    world: usize,
    shape: &AttnShape,
    mask: &Mask,
    (q, k, v, d_o): (&[f32], &[f32], &[f32], &[f32]),
    (want, wg): &(Forward, Grads),
) {
    let attn = on(s, world, shape, mask);
    let got = attn.forward(q, k, v).unwrap();
    assert!(rel_err(&got.o, &want.o) < TOL && rel_err(&got.lse, &want.lse) < TOL, "{s}");
    let g = attn.backward(q, k, v, want, d_o).unwrap();
    assert!(rel_err(&g.dq, &wg.dq) < TOL && rel_err(&g.dk, &wg.dk) < TOL && rel_err(&g.dv, &wg.dv) < TOL, "{s}");
}

fn single_fwd_bwd<T: Element>(
    shape: &AttnShape,
    mask: &Mask,
    q: &[T],
    k: &[T],
    v: &[T],
    d_o: &[T],
) -> (Forward, Grads) {
    let a = single(shape, mask);
    let f = a.forward(q, k, v).unwrap();
    let g = a.backward(q, k, v, &f, d_o).unwrap();
    (f, g)
}

#[test]
fn every_strategy_matches_single_rank() {
    let t0 = Instant::now();
    let (_, seed) = seeded_rng("every_strategy_matches_single_rank");
    let mut cases = 0;
    let d = 16;
    for (gi, (heads, kv_heads)) in [(24usize, 24usize), (48, 24)].into_iter().enumerate() {
        for (pi, p) in [1usize, 2, 3, 4, 8].into_iter().enumerate() {
            // Uneven lengths that change with the case (none divisible by 2P for P > 1).
            let n = [37, 53, 70, 45, 61][(pi + gi) % 5];
            let shape = AttnShape::new(1, n, n, heads, kv_heads, d).unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (n * 131 + p * 7 + heads) as u64);
            let q: Vec<f32> = randv(shape.q_elems(), &mut rng);
            let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
            let v: Vec<f32> = randv(shape.kv_elems(), &mut rng);
            let d_o: Vec<f32> = randv(shape.q_elems(), &mut rng);
            for (mname, mask) in masks(n) {
                let (want, want_g) = single_fwd_bwd(&shape, &mask, &q, &k, &v, &d_o);
                // The single call itself against f64 (the CPU crate's tests cover it too).
                let opts = AttnOptions::default();
                let rf = reference::forward(&q, &k, &v, &shape, &mask, &opts).unwrap();
                let rg = reference::backward(&q, &k, &v, &d_o, &shape, &mask, &opts).unwrap();
                let single_errs = [
                    rel_err_f64(&want.o, &rf.o),
                    lse_err(&want.lse, &rf.lse),
                    rel_err_f64(&want_g.dq, &rg.dq),
                    rel_err_f64(&want_g.dk, &rg.dk),
                    rel_err_f64(&want_g.dv, &rg.dv),
                ];
                assert!(single_errs.iter().all(|&e| e < TOL), "single call, mask={mname} n={n}: {single_errs:.2?}");
                for s in strategies(p) {
                    let ctx = format!("{s} P={p} mask={mname} n={n} heads={heads}/{kv_heads}");
                    let got = on(s, p, &shape, &mask).forward(&q, &k, &v).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    let (eo, el) = (rel_err(&got.o, &want.o), rel_err(&got.lse, &want.lse));
                    assert!(eo < TOL && el < TOL, "{ctx}: forward error O {eo:.2e} LSE {el:.2e}");
                    let variants: &[RingBackward] = if s.is_ring() {
                        &[RingBackward::KvCirculate, RingBackward::QCirculate]
                    } else {
                        &[RingBackward::KvCirculate]
                    };
                    for &rb in variants {
                        let ranks =
                            Ranks { plan: PlanOptions { ring_backward: rb, ..Default::default() }, ..Ranks::new(p, s) };
                        let g = on_ranks(&shape, &mask, ranks)
                            .backward(&q, &k, &v, &want, &d_o)
                            .unwrap_or_else(|e| panic!("{ctx} {rb:?}: {e}"));
                        let (a, b, c) =
                            (rel_err(&g.dq, &want_g.dq), rel_err(&g.dk, &want_g.dk), rel_err(&g.dv, &want_g.dv));
                        assert!(
                            a < TOL && b < TOL && c < TOL,
                            "{ctx} {rb:?}: grad errors dQ {a:.2e} dK {b:.2e} dV {c:.2e}"
                        );
                    }
                    cases += 1;
                }
            }
        }
    }
    println!("{cases} cases in {:?}", t0.elapsed());
}

#[test]
fn batch_and_cross_lengths() {
    // batch > 1 and q_len != k_len (bottom-right causal) through the same executor.
    let shape = AttnShape::new(2, 29, 41, 8, 4, 16).unwrap();
    let (mut rng, _) = seeded_rng("batch_and_cross_lengths");
    let q: Vec<f32> = randv(shape.q_elems(), &mut rng);
    let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let v: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let d_o: Vec<f32> = randv(shape.q_elems(), &mut rng);
    for mask in [Mask::causal(29, 41).unwrap(), Mask::full(29, 41).unwrap()] {
        let want_grads = single_fwd_bwd(&shape, &mask, &q, &k, &v, &d_o);
        for s in [
            Strategy::Ring,
            Strategy::Zigzag,
            Strategy::Balanced,
            Strategy::Ulysses,
            Strategy::Allgather,
            Strategy::Dispatch,
            Strategy::Hybrid { ulysses_degree: 2 },
        ] {
            assert_matches_single(s, 4, &shape, &mask, (&q, &k, &v, &d_o), &want_grads);
        }
    }
}

#[test]
fn unsupported_cases_are_clear_errors() {
    let shape = AttnShape::new(1, 40, 40, 6, 2, 16).unwrap();
    let mask = Mask::causal(40, 40).unwrap();
    let x = vec![0f32; shape.q_elems()];
    let kv = vec![0f32; shape.kv_elems()];
    let e = on(Strategy::Ulysses, 4, &shape, &mask).forward(&x, &kv, &kv).unwrap_err();
    assert!(matches!(e, Error::Unsupported { ref strategy, .. } if strategy == "ulysses"), "{e}");
    println!("{e}");
    let e = on(Strategy::Hybrid { ulysses_degree: 4 }, 8, &shape, &mask).forward(&x, &kv, &kv).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
}

#[test]
fn failed_rank_stops_everyone_with_its_name() {
    let shape = AttnShape::new(1, 64, 64, 8, 4, 16).unwrap();
    let mask = Mask::causal(64, 64).unwrap();
    let (mut rng, _) = seeded_rng("failed_rank_stops_everyone_with_its_name");
    let q: Vec<f32> = randv(shape.q_elems(), &mut rng);
    let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    // Step 1 is the last step of single-step plans (allgather, dispatch).
    for s in [Strategy::Ring, Strategy::Balanced, Strategy::Ulysses, Strategy::Allgather, Strategy::Dispatch] {
        for kind in [FailureKind::Error, FailureKind::Panic] {
            let t0 = Instant::now();
            let ranks = Ranks {
                timeout: Duration::from_secs(60),
                fail: Some(InjectedFailure { rank: 2, step: 1, kind }),
                ..Ranks::new(4, s)
            };
            let e = on_ranks(&shape, &mask, ranks).forward(&q, &k, &k).unwrap_err();
            assert!(matches!(e, Error::RankFailed { rank: 2, .. }), "{s} {kind:?}: {e}");
            assert!(t0.elapsed() < Duration::from_secs(5), "{s}: took {:?}", t0.elapsed());
            println!("{s} {kind:?}: {e} after {:?}", t0.elapsed());
        }
    }
}

#[test]
fn a_rank_that_stops_making_progress_is_given_up_on_after_the_timeout() {
    let shape = AttnShape::new(1, 64, 64, 8, 4, 16).unwrap();
    let mask = Mask::causal(64, 64).unwrap();
    let (mut rng, _) = seeded_rng("a_rank_that_stops_making_progress_is_given_up_on_after_the_timeout");
    let q: Vec<f32> = randv(shape.q_elems(), &mut rng);
    let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    for s in [Strategy::Ring, Strategy::Ulysses, Strategy::Allgather] {
        let t0 = Instant::now();
        let ranks = Ranks {
            timeout: Duration::from_millis(500),
            fail: Some(InjectedFailure { rank: 1, step: 1, kind: FailureKind::Hang }),
            ..Ranks::new(4, s)
        };
        let e = on_ranks(&shape, &mask, ranks).forward(&q, &k, &k).unwrap_err();
        // A peer that waited for rank 1 gives up and names the stall; every rank then stops.
        assert!(matches!(e, Error::Comm(_) | Error::RankFailed { .. }), "{s}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{s}: took {:?}", t0.elapsed());
        println!("{s} hang: {e} after {:?}", t0.elapsed());
    }
}

#[test]
fn merge_error_does_not_grow_with_ranks() {
    let n = 512;
    let shape = AttnShape::new(1, n, n, 4, 2, 32).unwrap();
    let mask = Mask::causal(n, n).unwrap();
    let (mut rng, _) = seeded_rng("merge_error_does_not_grow_with_ranks");
    // Peaky softmax (|q| up to 4) so that partials from different ranks carry real weight.
    let q: Vec<bf16> = (0..shape.q_elems()).map(|_| bf16::from_f32(rng.random_range(-4.0f32..4.0))).collect();
    let k: Vec<bf16> = randv(shape.kv_elems(), &mut rng);
    let v: Vec<bf16> = randv(shape.kv_elems(), &mut rng);
    let reference = reference::forward(&q, &k, &v, &shape, &mask, &AttnOptions::default()).unwrap();
    for s in [Strategy::Ring, Strategy::Zigzag] {
        let mut maxes = Vec::new();
        for p in [1, 2, 4, 8] {
            let got = on(s, p, &shape, &mask).forward(&q, &k, &v).unwrap();
            let diffs: Vec<f64> = got.o.iter().zip(&reference.o).map(|(&a, &b)| (a as f64 - b).abs()).collect();
            let max = diffs.iter().cloned().fold(0.0, f64::max);
            let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
            let (eo, el) = (rel_err_f64(&got.o, &reference.o), lse_err(&got.lse, &reference.lse));
            println!("bf16 inputs, {s} P={p}: max |O - O_f64| = {max:.3e}, mean = {mean:.3e}, O error {eo:.2e}, LSE error {el:.2e}");
            // The inputs are bf16, the arithmetic and the outputs f32: f32 rounding whatever P is.
            assert!(eo < 1e-5 && el < 1e-5, "{s} P={p}: O error {eo:.2e}, LSE error {el:.2e} against f64");
            maxes.push(max);
        }
        assert!(maxes[3] <= 2.0 * maxes[0], "{s}: P=8 error {} vs P=1 error {}", maxes[3], maxes[0]);
    }
}

#[test]
fn merges_are_overflow_safe() {
    // Logits in the hundreds: exp() of an unshifted score would overflow f32.
    let n = 96;
    let shape = AttnShape::new(1, n, n, 2, 2, 16).unwrap();
    let mask = Mask::causal(n, n).unwrap();
    let (mut rng, _) = seeded_rng("merges_are_overflow_safe");
    let q: Vec<f32> = (0..shape.q_elems()).map(|_| rng.random_range(-300.0f32..300.0)).collect();
    let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let v: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let want = single(&shape, &mask).forward(&q, &k, &v).unwrap();
    assert!(want.lse.iter().any(|&l| l > 88.8), "some exp(LSE) must overflow f32");
    for s in [Strategy::Ring, Strategy::Balanced, Strategy::Dispatch] {
        let got = on(s, 8, &shape, &mask).forward(&q, &k, &v).unwrap();
        assert!(rel_err(&got.o, &want.o) < 1e-5 && rel_err(&got.lse, &want.lse) < 1e-5, "{s}");
    }
}

#[test]
fn one_token_per_rank_and_no_fewer() {
    // Every rank holds a single token: the answer does not change. One rank more would hold
    // none, which is refused as a configuration mistake.
    let shape = AttnShape::new(1, 5, 5, 10, 10, 16).unwrap();
    let (mut rng, _) = seeded_rng("one_token_per_rank_and_no_fewer");
    let q: Vec<f32> = randv(shape.q_elems(), &mut rng);
    let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let v: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let d_o: Vec<f32> = randv(shape.q_elems(), &mut rng);
    for mask in [Mask::causal(5, 5).unwrap(), Mask::full(5, 5).unwrap()] {
        let want_grads = single_fwd_bwd(&shape, &mask, &q, &k, &v, &d_o);
        for s in strategies(5) {
            assert_matches_single(s, 5, &shape, &mask, (&q, &k, &v, &d_o), &want_grads);
        }
        for s in strategies(6) {
            let err = on(s, 6, &shape, &mask).forward(&q, &k, &v).unwrap_err();
            assert!(matches!(&err, Error::InvalidArgument { what, .. } if what == "world size"), "{s}: {err}");
        }
    }
}

#[test]
fn document_aware_zigzag_layout() {
    let lens = distattn::mask::long_tailed_doc_lens(67, 4);
    let shape = AttnShape::new(1, 67, 67, 4, 2, 16).unwrap();
    let mask = Mask::documents(&lens, distattn::mask::DocKind::Causal).unwrap();
    let (mut rng, _) = seeded_rng("document_aware_zigzag_layout");
    let q: Vec<f32> = randv(shape.q_elems(), &mut rng);
    let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let want = single(&shape, &mask).forward(&q, &k, &k).unwrap();
    let ranks = Ranks {
        plan: PlanOptions { documents: Some(lens.clone()), ..Default::default() },
        ..Ranks::new(4, Strategy::Zigzag)
    };
    let got = on_ranks(&shape, &mask, ranks).forward(&q, &k, &k).unwrap();
    assert!(rel_err(&got.o, &want.o) < TOL && rel_err(&got.lse, &want.lse) < TOL);
}

/// Executor overhead at a moderate size (run with `--ignored --nocapture`).
#[test]
#[ignore]
fn timing_moderate() {
    let n = 8192;
    let shape = AttnShape::new(1, n, n, 8, 4, 64).unwrap();
    let mask = Mask::causal(n, n).unwrap();
    let (mut rng, _) = seeded_rng("timing_moderate");
    let q: Vec<bf16> = randv(shape.q_elems(), &mut rng);
    let k: Vec<bf16> = randv(shape.kv_elems(), &mut rng);
    let t = Instant::now();
    let want = single(&shape, &mask).forward(&q, &k, &k).unwrap();
    println!("single rank forward: {:?}", t.elapsed());
    for s in [Strategy::Ring, Strategy::Zigzag, Strategy::Balanced, Strategy::Ulysses, Strategy::Dispatch] {
        let attn = on(s, 4, &shape, &mask);
        let t = Instant::now();
        let got = attn.forward(&q, &k, &k).unwrap();
        println!("{s} P=4 forward: {:?} (err {:.1e})", t.elapsed(), rel_err(&got.o, &want.o));
        let t = Instant::now();
        attn.backward(&q, &k, &k, &got, &q).unwrap();
        println!("{s} P=4 backward: {:?}", t.elapsed());
    }
}

#[test]
fn rows_with_several_key_runs() {
    // Global tokens + sliding window: rows keep two separate key runs.
    let shape = AttnShape::new(1, 58, 58, 6, 3, 16).unwrap();
    let mask = Mask::window_global(58, Some(5), Some(2), 4).unwrap();
    let (mut rng, _) = seeded_rng("rows_with_several_key_runs");
    let q: Vec<f32> = randv(shape.q_elems(), &mut rng);
    let k: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let v: Vec<f32> = randv(shape.kv_elems(), &mut rng);
    let d_o: Vec<f32> = randv(shape.q_elems(), &mut rng);
    let want_grads = single_fwd_bwd(&shape, &mask, &q, &k, &v, &d_o);
    for s in strategies(3) {
        assert_matches_single(s, 3, &shape, &mask, (&q, &k, &v, &d_o), &want_grads);
    }
}

/// Ulysses in head chunks (each chunk's all-to-all beside the previous chunk's attention): one
/// chunk, uneven chunks of whole KV heads (GQA) and one per KV head give the single call's
/// answer; zero chunks or more than a rank's KV heads are clear errors.
#[test]
fn ulysses_head_chunks_match_single_and_bad_counts_are_errors() {
    let shape = AttnShape::new(1, 43, 43, 20, 10, 8).unwrap();
    let mask = Mask::causal(43, 43).unwrap();
    let (q, k, v, d_o) = qkv_do::<f32>(&shape, "ulysses_head_chunks_match_single_and_bad_counts_are_errors");
    let (want, wg) = single_fwd_bwd(&shape, &mask, &q, &k, &v, &d_o);
    let with = |chunks| Ranks {
        plan: PlanOptions { head_chunks: Some(chunks), ..Default::default() },
        ..Ranks::new(2, Strategy::Ulysses)
    };
    // 5 KV heads per rank: chunks of 5, of 2-3 and of 1.
    for chunks in [1, 2, 5] {
        let attn = on_ranks(&shape, &mask, with(chunks));
        let got = attn.forward(&q, &k, &v).unwrap();
        assert!(rel_err(&got.o, &want.o) < TOL && rel_err(&got.lse, &want.lse) < TOL, "{chunks} chunks");
        let g = attn.backward(&q, &k, &v, &want, &d_o).unwrap();
        let errs = [rel_err(&g.dq, &wg.dq), rel_err(&g.dk, &wg.dk), rel_err(&g.dv, &wg.dv)];
        assert!(errs.iter().all(|&e| e < TOL), "{chunks} chunks: grad errors {errs:?}");
    }
    for chunks in [0, 6] {
        let e = on_ranks(&shape, &mask, with(chunks)).forward(&q, &k, &v).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{chunks} chunks: {e}");
        assert!(e.to_string().contains("head chunks"), "{e}");
    }
    // Hybrid with a ring part takes no chunks (one chunk is what it runs).
    let hybrid = |chunks| Ranks {
        plan: PlanOptions { head_chunks: Some(chunks), ..Default::default() },
        ..Ranks::new(4, Strategy::Hybrid { ulysses_degree: 2 })
    };
    let e = on_ranks(&shape, &mask, hybrid(2)).forward(&q, &k, &v).unwrap_err();
    assert!(e.to_string().contains("without a ring"), "{e}");
    let got = on_ranks(&shape, &mask, hybrid(1)).forward(&q, &k, &v).unwrap();
    assert!(rel_err(&got.o, &want.o) < TOL, "hybrid, one chunk");
}

/// With `narrow_outputs` the outputs come back in bf16 (Ulysses and hybrid send them so; the
/// others round their f32 accumulators, a ring's O in its last block): each equals the f32
/// path's output rounded, bit for bit, and the LSE does not change. Some values must come back
/// rounded, or nothing was narrowed.
#[test]
fn narrowed_outputs_round_to_the_f32_paths_values() {
    let shape = AttnShape::new(1, 37, 37, 8, 4, 16).unwrap();
    let mask = Mask::causal(37, 37).unwrap();
    let (q, k, v, d_o) = qkv_do::<bf16>(&shape, "narrowed_outputs_round_to_the_f32_paths_values");
    let rounded = |x: &[f32]| x.iter().map(|&a| bf16::from_f32(a)).collect::<Vec<_>>();
    let is_bf16 = |a: f32| bf16::from_f32(a).to_f32() == a;
    for (s, p) in [
        (Strategy::Ulysses, 2),
        (Strategy::Ulysses, 4),
        (Strategy::Hybrid { ulysses_degree: 2 }, 4),
        (Strategy::Zigzag, 3),
        (Strategy::Ring, 2),
        (Strategy::Dispatch, 4),
        (Strategy::PassQ, 3),
    ] {
        let wide = on(s, p, &shape, &mask);
        let narrow = on_ranks(
            &shape,
            &mask,
            Ranks { plan: PlanOptions { narrow_outputs: true, ..Default::default() }, ..Ranks::new(p, s) },
        );
        let (fw, fnar) = (wide.forward(&q, &k, &v).unwrap(), narrow.forward(&q, &k, &v).unwrap());
        assert_eq!(rounded(&fnar.o), rounded(&fw.o), "{s} P={p}: O");
        assert_eq!(fnar.lse, fw.lse, "{s} P={p}: LSE");
        let (gw, gn) = (wide.backward(&q, &k, &v, &fw, &d_o).unwrap(), narrow.backward(&q, &k, &v, &fw, &d_o).unwrap());
        for (name, a, b) in [("dQ", &gn.dq, &gw.dq), ("dK", &gn.dk, &gw.dk), ("dV", &gn.dv, &gw.dv)] {
            assert_eq!(rounded(a), rounded(b), "{s} P={p}: {name}");
        }
        for (name, got, f32_path) in [("O", &fnar.o, &fw.o), ("dQ", &gn.dq, &gw.dq)] {
            let came_rounded = got.iter().zip(f32_path.iter()).filter(|&(&a, &b)| a != b && is_bf16(a)).count();
            assert!(came_rounded > got.len() / 4, "{s} P={p}: {name}: {came_rounded} of {} values narrowed", got.len());
        }
    }
}

/// Ulysses and hybrid with the forward's head-sharded Q, K, V and LSE kept for the backward:
/// the backward, given them in that layout, matches the single call (GQA, a length no world
/// size divides); chunked heads refuse the option.
#[test]
fn backward_from_kept_head_sharded_inputs_matches_single() {
    let shape = AttnShape::new(1, 43, 43, 8, 4, 8).unwrap();
    let mask = Mask::causal(43, 43).unwrap();
    let (q, k, v, d_o) = qkv_do::<f32>(&shape, "backward_from_kept_head_sharded_inputs_matches_single");
    let want = single_fwd_bwd(&shape, &mask, &q, &k, &v, &d_o);
    let keep = |p, s, head_chunks| Ranks {
        plan: PlanOptions { keep_head_sharded: true, head_chunks, ..Default::default() },
        ..Ranks::new(p, s)
    };
    for (p, s) in [(2, Strategy::Ulysses), (4, Strategy::Ulysses), (4, Strategy::Hybrid { ulysses_degree: 2 })] {
        let attn = on_ranks(&shape, &mask, keep(p, s, None));
        let got = attn.forward(&q, &k, &v).unwrap();
        assert!(rel_err(&got.o, &want.0.o) < TOL && rel_err(&got.lse, &want.0.lse) < TOL, "{s} P={p}");
        let g = attn.backward(&q, &k, &v, &want.0, &d_o).unwrap();
        let errs = [rel_err(&g.dq, &want.1.dq), rel_err(&g.dk, &want.1.dk), rel_err(&g.dv, &want.1.dv)];
        assert!(errs.iter().all(|&e| e < TOL), "{s} P={p}: grad errors {errs:?}");
    }
    let e = on_ranks(&shape, &mask, keep(2, Strategy::Ulysses, Some(2))).forward(&q, &k, &v).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }) && e.to_string().contains("needs one chunk"), "{e}");
}

//! A KV cache spread over ranks (DistAttention): a serving step planned with pass-q (queries
//! travel, the cache stays) or a ring over the same placement (pass-KV), run on in-process
//! CPU ranks through the one interpreter, equals decode over one whole cache and the f64
//! reference — ragged batches, GQA, 1 and 4 new tokens, contiguous, interleaved and zig-zag
//! placements.

use distattn::decode::{decode, DecodeOptions, DecodeShape, PagedCache, PagedLayout};
use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
use distattn::plan::{Op, Pass};
use distattn::planner::{build, fastest};
use distattn::{Attention, DType, Execution, PlanOptions, Ranks, Strategy};
use distattn_testkit::{cast, reference, rel_err, seeded_rng, uniform};
use rand::Rng;

fn placements(world: usize, capacity: usize) -> Vec<(&'static str, KvPlacement)> {
    vec![
        ("contiguous", KvPlacement::contiguous(capacity, world).unwrap()),
        ("pages of 16", KvPlacement::interleaved(16, world).unwrap()),
        ("pages of 1", KvPlacement::interleaved(1, world).unwrap()),
        ("zig-zag chunks", KvPlacement::zigzag(capacity, world).unwrap()),
    ]
}

#[test]
fn distributed_decode_equals_one_cache_and_f64() {
    let (mut rng, seed) = seeded_rng("distributed_decode");
    let (h, hkv, d) = (8, 2, 32);
    for world in [2, 3, 4] {
        for (new, short) in [(1, false), (4, false), (1, true)] {
            // `short`: one request of fewer keys than ranks (some ranks hold nothing).
            let batch = if short { 1 } else { rng.random_range(1..6) };
            let most = if short { world - new } else { 300 };
            let requests: Vec<StepRequest> = (0..batch)
                .map(|_| StepRequest { home: rng.random_range(0..world), cached: rng.random_range(0..most), new })
                .collect();
            let capacity = requests.iter().map(|r| r.cached + r.new).max().unwrap();
            for (name, placement) in placements(world, capacity) {
                let case = format!("P={world}, {new} new, {name}, {requests:?} (seed {seed})");
                // One new token: decode, queries at home; four: a chunked prefill beside the keys.
                let queries = if new == 1 { Queries::AtHome } else { Queries::WithKeys };
                let step = ServingStep::new(&placement, &requests, queries, h, hkv, d).unwrap();
                let shape = step.shape;
                let q: Vec<f32> = cast(&uniform(&mut rng, shape.q_elems(), -1.0, 1.0));
                let k: Vec<f32> = cast(&uniform(&mut rng, shape.kv_elems(), -1.0, 1.0));
                let v: Vec<f32> = cast(&uniform(&mut rng, shape.kv_elems(), -1.0, 1.0));
                let want = reference::forward(&q, &k, &v, &shape, &step.mask, &Default::default()).unwrap();

                // The same step as decode over one contiguous cache (a page per request).
                let layout = PagedLayout::new(batch, capacity, hkv, d).unwrap();
                let (mut kc, mut vc) = (vec![0f32; layout.elems()], vec![0f32; layout.elems()]);
                let row = hkv * d;
                for (i, r) in requests.iter().enumerate() {
                    let n = (r.cached + r.new) * row;
                    let at = step.k_offsets[i] * row;
                    kc[i * capacity * row..][..n].copy_from_slice(&k[at..at + n]);
                    vc[i * capacity * row..][..n].copy_from_slice(&v[at..at + n]);
                }
                let table: Vec<i32> = (0..batch as i32).collect();
                let lengths: Vec<usize> = requests.iter().map(|r| r.cached + r.new).collect();
                let cache = PagedCache { k: &kc, v: &vc, layout, page_table: &table, lengths: &lengths };
                let ds = DecodeShape::new(batch, new, h, hkv, d).unwrap();
                let one = decode(&q, &cache, &ds, &DecodeOptions { causal: true, ..Default::default() }, 3).unwrap();
                assert!(rel_err(&one.o, &want.o) < 1e-5, "{case}: decode itself");

                for strategy in [Strategy::PassQ, Strategy::Ring] {
                    let mut ranks = Ranks::new(world, strategy);
                    ranks.plan = PlanOptions { layout: Some(step.layout.clone()), ..Default::default() };
                    let attn = Attention::new(shape, step.mask.clone()).unwrap().on(Execution::CpuRanks(ranks));
                    let got = attn.forward(&q, &k, &v).unwrap_or_else(|e| panic!("{case} {strategy}: {e}"));
                    let e = rel_err(&got.o, &want.o);
                    assert!(e < 1e-5, "{case} {strategy}: O error {e}");
                    let lse = distattn_testkit::lse_err(&got.lse, &want.lse);
                    assert!(lse < 1e-5, "{case} {strategy}: LSE error {lse}");
                    // Pass-q never moves the cache.
                    if strategy == Strategy::PassQ {
                        let plan = attn.plan(Pass::Forward, DType::F32).unwrap();
                        plan.validate().unwrap_or_else(|e| panic!("{case}: {e}"));
                        for prog in &plan.ranks {
                            for op in prog.steps.iter().flatten() {
                                if let Op::Comm { sends, .. } = op {
                                    for &(_, b) in sends {
                                        assert!(
                                            !prog.bufs[b].tensor.is_kv(),
                                            "{case}: pass-q sends {:?}",
                                            prog.bufs[b].tensor
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_time_model_picks_pass_q_for_decode_and_new_tokens_on_one_rank_and_pass_kv_for_a_fresh_prompt() {
    let (h, hkv, d, world) = (32, 8, 128, 4);
    let pick = |requests: &[StepRequest], prefill: bool| {
        let cap = requests.iter().map(|r| r.cached + r.new).max().unwrap();
        let pl = KvPlacement::contiguous(cap, world).unwrap();
        let queries = if prefill { Queries::WithKeys } else { Queries::AtHome };
        let step = ServingStep::new(&pl, requests, queries, h, hkv, d).unwrap();
        let opts = PlanOptions { layout: Some(step.layout), ..Default::default() };
        fastest(
            &[Strategy::PassQ, Strategy::Ring],
            world,
            &step.shape,
            &step.mask,
            DType::BF16,
            &opts,
            &Default::default(),
        )
        .unwrap()
        .strategy
    };
    // Decode: 1 new token against 100k cached; a short prompt onto a long cached prefix.
    assert_eq!(pick(&[StepRequest { home: 0, cached: 100_000, new: 1 }], false), Strategy::PassQ);
    assert_eq!(pick(&[StepRequest { home: 1, cached: 60_000, new: 2_000 }], true), Strategy::PassQ);
    // A fresh 16k prompt: every query meets every earlier key, and with GQA 32/8 a query row
    // (plus its f32 partial coming back) outweighs a K/V row several times: the keys travel.
    assert_eq!(pick(&[StepRequest { home: 0, cached: 0, new: 16_384 }], true), Strategy::Ring);
    // As many new tokens as cached (2 H200s, 2026-11-26: pass-q 1.79 s, the ring 2.65 s): the
    // new tokens all sit on the last ranks, so the ring leaves the first ranks without work
    // while pass-q sends them the queries. By traffic alone the ring moved less.
    assert_eq!(pick(&[StepRequest { home: 0, cached: 262_144, new: 262_144 }], true), Strategy::PassQ);
    // A layout given to a strategy that picks its own is an error.
    let pl = KvPlacement::contiguous(64, world).unwrap();
    let step =
        ServingStep::new(&pl, &[StepRequest { home: 0, cached: 0, new: 64 }], Queries::WithKeys, h, hkv, d).unwrap();
    let opts = PlanOptions { layout: Some(step.layout), ..Default::default() };
    let e = build(Strategy::Zigzag, world, &step.shape, &step.mask, DType::BF16, &opts).unwrap_err();
    assert!(e.to_string().contains("placement"), "{e}");
}

#[path = "../examples/spread_decode.rs"]
mod spread_decode_example;

#[test]
fn the_spread_decode_example_runs() {
    spread_decode_example::main().unwrap();
}

//! One rank per thread holding only its shards, as a training process does: every strategy's
//! forward and backward through `RankAttention`, from the rank's own rows of Q, K, V and dO,
//! equal the f64 reference on the whole sequence (uneven lengths, GQA).

use distattn::plan::{Pass, TokenSet};
use distattn::{
    run_ranks, AttnShape, Backend, Communicator, CpuBackend, DType, Error, HostData, Mask, PlanOptions, RankAttention,
    Strategy, ThreadComm,
};
use distattn_testkit::{cast, reference, rel_err, seeded_rng, uniform};
use std::time::Duration;

/// Rows `tokens` of a `[b, n, heads, d]` tensor, in order.
fn rows(x: &[f32], shape: &AttnShape, heads: usize, tokens: &TokenSet) -> Vec<f32> {
    let row = heads * shape.head_dim;
    let mut out = Vec::new();
    for b in 0..shape.batch {
        for r in tokens.to_runs() {
            out.extend_from_slice(&x[(b * shape.q_len + r.start) * row..(b * shape.q_len + r.end) * row]);
        }
    }
    out
}

/// Writes rows `tokens` of a `[b, n, heads, d]` tensor.
fn put_rows(part: &[f32], shape: &AttnShape, heads: usize, tokens: &TokenSet, full: &mut [f32]) {
    let row = heads * shape.head_dim;
    let mut at = 0;
    for b in 0..shape.batch {
        for r in tokens.to_runs() {
            let n = r.len() * row;
            full[(b * shape.q_len + r.start) * row..][..n].copy_from_slice(&part[at..at + n]);
            at += n;
        }
    }
}

/// Entries `tokens` of a `[b, h, n]` statistic.
fn stat_rows(x: &[f32], shape: &AttnShape, tokens: &TokenSet) -> Vec<f32> {
    let mut out = Vec::new();
    for bh in 0..shape.batch * shape.heads {
        for r in tokens.to_runs() {
            out.extend_from_slice(&x[bh * shape.q_len + r.start..bh * shape.q_len + r.end]);
        }
    }
    out
}

/// Seeded random Q, K, V, dO of `shape` (f32) and the f64 forward and backward under `mask`.
struct Problem {
    seed: u64,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
    want: reference::RefForward,
    want_g: reference::RefGrads,
}

impl Problem {
    /// Rank-local Q, K, V (rows `t`) uploaded to the CPU backend.
    fn shards(&self, shape: &AttnShape, t: &TokenSet) -> Result<[HostData; 3], Error> {
        let (h, hkv) = (shape.heads, shape.kv_heads);
        let [q, k, v] =
            [(&self.q, h), (&self.k, hkv), (&self.v, hkv)].map(|(x, n)| CpuBackend.upload(&rows(x, shape, n, t)));
        Ok([q?, k?, v?])
    }
}

fn problem(name: &str, shape: &AttnShape, mask: &Mask) -> Problem {
    let (mut rng, seed) = seeded_rng(name);
    let [q, k, v, d_o] = [shape.q_elems(), shape.kv_elems(), shape.kv_elems(), shape.q_elems()]
        .map(|n| cast::<f32>(&uniform(&mut rng, n, -1.0, 1.0)));
    let opts = Default::default();
    let want = reference::forward(&q, &k, &v, shape, mask, &opts).unwrap();
    let want_g = reference::backward(&q, &k, &v, &d_o, shape, mask, &opts).unwrap();
    Problem { seed, q, k, v, d_o, want, want_g }
}

/// dQ, dK, dV gathered from every rank's `(tokens, [dq, dk, dv])` match the f64 gradients.
fn assert_grads(case: &str, shape: &AttnShape, ranks: &[(TokenSet, &[Vec<f32>])], p: &Problem) {
    let (mut dq, mut dk, mut dv) =
        (vec![0f32; shape.q_elems()], vec![0f32; shape.kv_elems()], vec![0f32; shape.kv_elems()]);
    for (t, g) in ranks {
        put_rows(&g[0], shape, shape.heads, t, &mut dq);
        put_rows(&g[1], shape, shape.kv_heads, t, &mut dk);
        put_rows(&g[2], shape, shape.kv_heads, t, &mut dv);
    }
    for (name, got, r) in [("dq", &dq, &p.want_g.dq), ("dk", &dk, &p.want_g.dk), ("dv", &dv, &p.want_g.dv)] {
        let e = rel_err(got, r);
        assert!(e < 1e-4, "{case}: {name} error {e}");
    }
}

#[test]
fn every_strategy_from_local_shards_matches_f64() {
    let shape = AttnShape::new(2, 203, 203, 4, 2, 16).unwrap();
    let mask = Mask::causal(203, 203).unwrap();
    let p = problem("rank_attention", &shape, &mask);
    let (seed, d_o, want) = (p.seed, &p.d_o, &p.want);
    let o_full: Vec<f32> = want.o.iter().map(|&x| x as f32).collect();
    let lse_full: Vec<f32> = want.lse.iter().map(|&x| x as f32).collect();
    for world in [2, 3, 4] {
        for strategy in Strategy::ALL {
            if matches!(strategy, Strategy::Ulysses | Strategy::Hybrid { .. }) && !2usize.is_multiple_of(world) {
                continue; // 2 KV heads split over at most 2 ranks
            }
            let case = format!("{strategy} on {world} ranks (seed {seed})");
            let results = run_ranks(world, Duration::from_secs(30), |comm: &ThreadComm| {
                let me = RankAttention::new(shape, mask.clone(), strategy, world, comm.rank())?;
                let t = me.tokens().clone();
                let h = shape.heads;
                let cpu = CpuBackend;
                let up = |x: Vec<f32>| cpu.upload(&x);
                let [qs, ks, vs] = p.shards(&shape, &t)?;
                let [o, lse] = me.forward(&cpu, comm, DType::F32, qs, ks, vs)?;
                // D = rowsum(dO ∘ O) of this rank's rows, from the f64 O.
                let d_o_local = up(rows(d_o, &shape, h, &t))?;
                let delta = cpu.row_delta(&up(rows(&o_full, &shape, h, &t))?, &d_o_local, &me.local_shape())?;
                let [qs, ks, vs] = p.shards(&shape, &t)?;
                let grads = me.backward(
                    &cpu,
                    comm,
                    DType::F32,
                    qs,
                    ks,
                    vs,
                    d_o_local,
                    up(stat_rows(&lse_full, &shape, &t))?,
                    delta,
                )?;
                let f32s = |b: &HostData| cpu.download_f32(b);
                Ok((t, f32s(&o)?, f32s(&lse)?, grads.iter().map(f32s).collect::<Result<Vec<_>, Error>>()?))
            })
            .unwrap_or_else(|e| panic!("{case}: {e}"));
            let mut o = vec![0f32; shape.q_elems()];
            let mut lse_err = 0f64;
            let mut covered = 0;
            for (t, o_r, lse_r, _) in &results {
                covered += t.len();
                put_rows(o_r, &shape, shape.heads, t, &mut o);
                for (a, b) in lse_r.iter().zip(stat_rows(&lse_full, &shape, t)) {
                    lse_err = lse_err.max((a - b).abs() as f64);
                }
            }
            assert_eq!(covered, shape.q_len, "{case}: the ranks' tokens are not a partition");
            assert!(rel_err(&o, &want.o) < 1e-5, "{case}: O error {}", rel_err(&o, &want.o));
            assert!(lse_err < 1e-4, "{case}: LSE error {lse_err}");
            let grads: Vec<_> = results.iter().map(|(t, _, _, g)| (t.clone(), g.as_slice())).collect();
            assert_grads(&case, &shape, &grads, &p);
        }
    }
}

/// With `keep_head_sharded`, a Ulysses or hybrid forward hands back the head-sharded Q, K, V and
/// LSE it computed with (`RankAttention::kept` gives their shapes); the backward given those,
/// not the shards, matches f64. A strategy without head sharding keeps nothing.
#[test]
fn a_backward_from_the_forwards_kept_buffers_matches_f64() {
    let shape = AttnShape::new(1, 97, 97, 8, 4, 16).unwrap();
    let mask = Mask::causal(97, 97).unwrap();
    let p = problem("rank_attention_kept", &shape, &mask);
    let (seed, d_o, want) = (p.seed, &p.d_o, &p.want);
    let keep = PlanOptions { keep_head_sharded: true, ..PlanOptions::default() };
    for (strategy, world, n_kept) in
        [(Strategy::Ulysses, 4, 4), (Strategy::Hybrid { ulysses_degree: 2 }, 4, 4), (Strategy::Zigzag, 2, 0)]
    {
        let case = format!("{strategy} on {world} ranks (seed {seed})");
        let results = run_ranks(world, Duration::from_secs(30), |comm: &ThreadComm| {
            let me = RankAttention::with_options(shape, mask.clone(), strategy, world, comm.rank(), keep.clone())?;
            let t = me.tokens().clone();
            let cpu = CpuBackend;
            let [qs, ks, vs] = p.shards(&shape, &t)?;
            let run = me.forward_deferred(&cpu, comm, DType::F32, qs, ks, vs)?;
            run.completion.wait(&cpu, comm)?;
            let [o, _] = run.outputs;
            let kept = me.kept(DType::F32)?;
            assert_eq!(kept.len(), n_kept, "{strategy}: {kept:?}");
            for ((_, dims), buf) in kept.iter().zip(&run.saved) {
                assert_eq!(dims.iter().product::<usize>(), buf.len(), "{strategy}: {dims:?}");
            }
            let d_o_local = cpu.upload(&rows(d_o, &shape, shape.heads, &t))?;
            let delta = cpu.row_delta(&o, &d_o_local, &me.local_shape())?;
            let (q_b, k_b, v_b, lse_b) = if n_kept == 0 {
                let lse = stat_rows(&want.lse.iter().map(|&x| x as f32).collect::<Vec<_>>(), &shape, &t);
                let [qs, ks, vs] = p.shards(&shape, &t)?;
                (qs, ks, vs, cpu.upload(&lse)?)
            } else {
                let [q_b, k_b, v_b, lse_b]: [HostData; 4] =
                    run.saved.try_into().map_err(|_| Error::Internal("four kept buffers".into()))?;
                (q_b, k_b, v_b, lse_b)
            };
            let grads = me.backward(&cpu, comm, DType::F32, q_b, k_b, v_b, d_o_local, lse_b, delta)?;
            Ok((t, grads.iter().map(|b| cpu.download_f32(b)).collect::<Result<Vec<_>, Error>>()?))
        })
        .unwrap_or_else(|e| panic!("{case}: {e}"));
        let grads: Vec<_> = results.iter().map(|(t, g)| (t.clone(), g.as_slice())).collect();
        assert_grads(&case, &shape, &grads, &p);
    }
}

#[test]
fn bad_ranks_and_shapes_are_errors() {
    let shape = AttnShape::new(1, 64, 64, 2, 2, 8).unwrap();
    let mask = Mask::causal(64, 64).unwrap();
    let e = RankAttention::new(shape, mask.clone(), Strategy::Zigzag, 4, 4).err().unwrap();
    assert!(matches!(&e, Error::InvalidArgument { what, .. } if what == "rank"), "{e}");
    let cross = AttnShape::new(1, 64, 32, 2, 2, 8).unwrap();
    let e = RankAttention::new(cross, Mask::full(64, 32).unwrap(), Strategy::Ring, 2, 0).err().unwrap();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("q_len"), "{e}");
    // Ulysses needs the heads divisible by the world.
    let me = RankAttention::new(shape, mask, Strategy::Ulysses, 4, 0);
    let e = me.and_then(|m| m.program(Pass::Forward, DType::BF16)).err().unwrap();
    assert!(matches!(&e, Error::Unsupported { strategy, .. } if strategy == "ulysses"), "{e}");
}

/// Rows `tokens` of a `[b, n, heads, d]` tensor of `n` tokens per batch element.
fn rows_of(x: &[f32], n: usize, row: usize, batch: usize, tokens: &TokenSet) -> Vec<f32> {
    let mut out = Vec::new();
    for b in 0..batch {
        for r in tokens.to_runs() {
            out.extend_from_slice(&x[(b * n + r.start) * row..(b * n + r.end) * row]);
        }
    }
    out
}

#[test]
fn a_serving_step_runs_the_plan_chosen_by_the_time_model() {
    use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
    use distattn::planner::fastest;
    use distattn::PlanOptions;
    let (mut rng, seed) = seeded_rng("serving_step_plan");
    let world = 3;
    // Caches long enough that moving them (ring) costs more than a transfer group's latency.
    let requests = [
        StepRequest { home: 0, cached: 20000, new: 1 },
        StepRequest { home: 2, cached: 7, new: 1 },
        StepRequest { home: 1, cached: 26000, new: 1 },
    ];
    let placement = KvPlacement::interleaved(16, world).unwrap();
    let step = ServingStep::new(&placement, &requests, Queries::AtHome, 4, 2, 16).unwrap();
    let shape = step.shape;
    let [q, k, v] =
        [shape.q_elems(), shape.kv_elems(), shape.kv_elems()].map(|n| cast::<f32>(&uniform(&mut rng, n, -1.0, 1.0)));
    let want = reference::forward(&q, &k, &v, &shape, &step.mask, &Default::default()).unwrap();
    let opts = PlanOptions { layout: Some(step.layout.clone()), ..Default::default() };
    // Chosen (and costed) in bf16, run in f32: a plan's steps do not depend on the dtype.
    let plan =
        fastest(&[Strategy::PassQ, Strategy::Ring], world, &shape, &step.mask, DType::BF16, &opts, &Default::default())
            .unwrap();
    assert_eq!(plan.strategy, Strategy::PassQ, "decode moves the queries");
    let (qrow, kvrow) = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    let results = run_ranks(world, Duration::from_secs(30), |comm: &ThreadComm| {
        let me = RankAttention::placed_plan(plan.clone(), step.mask.clone(), comm.rank())?;
        let (t, kt) = (me.tokens().clone(), me.kv_tokens().clone());
        let cpu = CpuBackend;
        let [o, _lse] = me.forward(
            &cpu,
            comm,
            DType::F32,
            cpu.upload(&rows_of(&q, shape.q_len, qrow, shape.batch, &t))?,
            cpu.upload(&rows_of(&k, shape.k_len, kvrow, shape.batch, &kt))?,
            cpu.upload(&rows_of(&v, shape.k_len, kvrow, shape.batch, &kt))?,
        )?;
        Ok((t, cpu.download_f32(&o)?))
    })
    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let mut o = vec![0f32; shape.q_elems()];
    for (t, o_r) in &results {
        put_rows(o_r, &shape, shape.heads, t, &mut o);
    }
    let e = rel_err(&o, &want.o);
    assert!(e < 1e-5, "seed {seed}: O error {e}");
    let backward = distattn::planner::build(
        Strategy::PassQ,
        world,
        &shape,
        &step.mask,
        DType::F32,
        &opts.with_pass(Pass::Backward),
    )
    .unwrap();
    let err = RankAttention::placed_plan(backward, step.mask.clone(), 0).err().unwrap();
    assert!(err.to_string().contains("forward plan"), "{err}");
}

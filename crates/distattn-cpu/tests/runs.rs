//! Runs of a program issued back to back (`ExecOptions::runs`, how the decode bench times a
//! step's layers) read the same inputs each time: the last run's outputs equal one run's, for
//! a forward and a backward plan on thread ranks, and the f64 reference's to f32 rounding.

use distattn_core::plan::Pass;
use distattn_core::planner::build;
use distattn_core::{AttnOptions, AttnShape, DType, Mask, PlanOptions, Strategy};
use distattn_cpu::CpuBackend;
use distattn_exec::{
    gather_forward, gather_grads, prepare_all, run_rank, run_ranks, BackwardTensors, Communicator, ExecOptions,
    HostTensors, Shard,
};
use distattn_testkit::random::{randn, seeded_rng};
use distattn_testkit::{lse_err, reference, rel_err};
use std::time::Duration;

fn shards(strategy: Strategy, pass: Pass, runs: usize, full: &HostTensors<'_, f32>, shape: &AttnShape) -> Vec<Shard> {
    let mask = Mask::causal(shape.q_len, shape.k_len).unwrap();
    let plan = build(strategy, 3, shape, &mask, DType::F32, &PlanOptions::forward().with_pass(pass)).unwrap();
    let progs = prepare_all(&plan, &mask).unwrap();
    let ctl = ExecOptions { runs, ..Default::default() };
    run_ranks(3, Duration::from_secs(30), |comm| {
        run_rank(&progs[comm.rank()], &CpuBackend, comm, full, &AttnOptions::default(), &ctl)
    })
    .unwrap()
    .into_iter()
    .flat_map(|r| r.shards)
    .collect()
}

/// Largest difference between two runs' shards relative to the largest value (the CPU backend's
/// parallel reductions may add in another order from one run to the next).
fn differ(a: &[Shard], b: &[Shard]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut scale = 0f32;
    let mut diff = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!((x.tensor, &x.desc), (y.tensor, &y.desc));
        for (p, q) in x.data.iter().zip(&y.data) {
            scale = scale.max(p.abs());
            diff = diff.max((p - q).abs());
        }
    }
    diff / scale.max(f32::MIN_POSITIVE)
}

#[test]
fn runs_back_to_back_return_what_one_run_does() {
    let (mut rng, seed) = seeded_rng("runs_back_to_back_return_what_one_run_does");
    // 301 tokens over 3 ranks: uneven shards; GQA 4/2.
    let shape = AttnShape::new(1, 301, 301, 4, 2, 16).unwrap();
    let (q, k, v) = (
        randn(&mut rng, shape.q_elems(), 1.0),
        randn(&mut rng, shape.kv_elems(), 1.0),
        randn(&mut rng, shape.kv_elems(), 1.0),
    );
    let fwd = HostTensors { q: &q, k: &k, v: &v, backward: None };
    let mask = Mask::causal(301, 301).unwrap();
    let out = reference::forward(&q, &k, &v, &shape, &mask, &AttnOptions::default()).unwrap();
    for strategy in [Strategy::PassQ, Strategy::Zigzag] {
        let one = shards(strategy, Pass::Forward, 1, &fwd, &shape);
        let four = shards(strategy, Pass::Forward, 4, &fwd, &shape);
        let e = differ(&four, &one);
        assert!(e < 1e-6, "seed {seed}: {strategy:?} forward differs by {e:e}");
        let got = gather_forward(&shape, four);
        let (eo, el) = (rel_err(&got.o, &out.o), lse_err(&got.lse, &out.lse));
        assert!(eo < 1e-5 && el < 1e-5, "seed {seed}: {strategy:?} forward errors O {eo:.2e} LSE {el:.2e} against f64");
    }
    let (o, lse): (Vec<f32>, Vec<f32>) =
        (out.o.iter().map(|&x| x as f32).collect(), out.lse.iter().map(|&x| x as f32).collect());
    let d_o = randn(&mut rng, shape.q_elems(), 1.0);
    let bwd = HostTensors { backward: Some(BackwardTensors { o: &o, lse: &lse, d_o: &d_o }), ..fwd };
    let one = shards(Strategy::Zigzag, Pass::Backward, 1, &bwd, &shape);
    let three = shards(Strategy::Zigzag, Pass::Backward, 3, &bwd, &shape);
    let e = differ(&three, &one);
    assert!(e < 1e-6, "seed {seed}: zigzag backward differs by {e:e}");
    let g = gather_grads(&shape, three);
    let r = reference::backward(&q, &k, &v, &d_o, &shape, &mask, &AttnOptions::default()).unwrap();
    let errs = [rel_err(&g.dq, &r.dq), rel_err(&g.dk, &r.dk), rel_err(&g.dv, &r.dv)];
    assert!(errs.iter().all(|&e| e < 1e-5), "seed {seed}: zigzag backward errors {errs:.2?} against f64");
}

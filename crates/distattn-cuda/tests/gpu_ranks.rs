//! Every strategy's plan on GPU ranks through the one interpreter and the CUDA backend,
//! against the f64 reference (`cargo test --release -p distattn-cuda -- --ignored`; needs one
//! CUDA GPU: the ranks are threads sharing GPU 0, and move data by device copies,
//! `distattn_cuda::peer`). The GPU side of the CPU matrix test: the same plans and interpreter,
//! on the CUDA backend's two streams with events between them.

use distattn_core::AttnOptions;
use distattn_cuda::gpu_count;
use distattn_cuda::peer::with_peer_ranks;
use distattn_exec::{run_rank, Communicator, ExecOptions};
use distattn_testkit::plans::check_every_strategy;
use std::time::Duration;

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_strategy_on_gpu_ranks_matches_the_reference() {
    let gpus = gpu_count();
    assert!(gpus > 0, "this test needs a CUDA GPU");
    let opts = AttnOptions::default();
    check_every_strategy("every_strategy_on_gpu_ranks_matches_the_reference", &[2, 4], &|world, runs, full| {
        with_peer_ranks(world, 0, Duration::from_secs(60), |backend, comm| {
            runs.iter()
                .map(|run| {
                    Ok(run_rank(&run.ranks[comm.rank()], backend, comm, full, &opts, &ExecOptions::default())?.shards)
                })
                .collect()
        })
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_failed_rank_stops_the_others_with_its_name() {
    use distattn_core::planner::build;
    use distattn_core::{AttnShape, DType, Error, Mask, PlanOptions, Strategy};
    use distattn_exec::{prepare_all, FailureKind, HostTensors, InjectedFailure};
    let gpus = gpu_count();
    assert!(gpus > 0, "this test needs a CUDA GPU");
    let shape = AttnShape::new(1, 4096, 4096, 8, 4, 128).unwrap();
    let mask = Mask::causal(4096, 4096).unwrap();
    let plan = build(Strategy::Zigzag, 4, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
    let progs = prepare_all(&plan, &mask).unwrap();
    let (q, kv) = (vec![half::bf16::ONE; shape.q_elems()], vec![half::bf16::ONE; shape.kv_elems()]);
    let full = HostTensors { q: &q, k: &kv, v: &kv, backward: None };
    for kind in [FailureKind::Error, FailureKind::Panic] {
        let ctl = ExecOptions { fail: Some(InjectedFailure { rank: 2, step: 1, kind }), ..Default::default() };
        let t0 = std::time::Instant::now();
        let e = with_peer_ranks(4, 0, Duration::from_secs(60), |backend, comm| {
            run_rank(&progs[comm.rank()], backend, comm, &full, &AttnOptions::default(), &ctl)
        })
        .err()
        .expect("the run fails");
        println!("{kind:?}: {e} after {:?}", t0.elapsed());
        assert!(matches!(e, Error::RankFailed { rank: 2, .. }), "{kind:?}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(20), "{kind:?}: took {:?}", t0.elapsed());
    }
}

//! The interpreter times every step on the CPU backend too: a plan run on thread ranks with
//! timelines asked for returns, per rank, each step's compute span and transfers.

use distattn_core::planner::build;
use distattn_core::{AttnOptions, AttnShape, DType, Mask, PlanOptions, Strategy};
use distattn_cpu::CpuBackend;
use distattn_exec::{prepare_all, run_rank, run_ranks, Communicator, ExecOptions, HostTensors};
use std::time::Duration;

#[test]
fn cpu_ranks_record_their_timelines() {
    let shape = AttnShape::new(1, 512, 512, 4, 2, 32).unwrap();
    let mask = Mask::causal(512, 512).unwrap();
    let plan = build(Strategy::Ring, 4, &shape, &mask, DType::F32, &PlanOptions::forward()).unwrap();
    let progs = prepare_all(&plan, &mask).unwrap();
    let (q, kv) = (vec![0.5f32; shape.q_elems()], vec![0.25f32; shape.kv_elems()]);
    let full = HostTensors { q: &q, k: &kv, v: &kv, backward: None };
    let ctl = ExecOptions { timeline: true, ..Default::default() };
    let runs = run_ranks(4, Duration::from_secs(30), |comm| {
        run_rank(&progs[comm.rank()], &CpuBackend, comm, &full, &AttnOptions::default(), &ctl)
    })
    .unwrap();
    for (r, run) in runs.iter().enumerate() {
        let tl = run.timeline.as_ref().expect("a timeline was asked for");
        assert_eq!((tl.rank, tl.steps.len()), (r, plan.steps()));
        for st in &tl.steps {
            // Under the causal ring, rank r computes at steps 0..=r (K/V of ranks r, r-1, ...)
            // and sends at every step but the last.
            match st.compute {
                Some((a, b)) => {
                    assert!(st.step <= r && 0.0 <= a && a <= b && b <= tl.total_ms, "rank {r} step {}", st.step)
                }
                None => assert!(st.step > r, "rank {r} computes nothing at step {}", st.step),
            }
            assert_eq!(st.transfers.len(), usize::from(st.step + 1 < plan.steps()), "rank {r} step {}", st.step);
            for &(s, e) in &st.transfers {
                assert!(0.0 <= s && s <= e && e <= tl.total_ms);
            }
        }
        let o = tl.overlap();
        // Every step but the last transfers.
        assert!(o.compute_ms > 0.0 && o.comm_ms > 0.0, "{o:?}");
    }
}

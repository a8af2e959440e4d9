//! Every strategy's plan on GPU ranks through the one interpreter and the CUDA backend,
//! against the f64 reference (`cargo test --release -p distattn-cuda -- --ignored`; needs one
//! CUDA GPU: the ranks are threads sharing the GPUs there are, and move data by device copies,
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
        with_peer_ranks(
            world,
            |r| r % gpus,
            Duration::from_secs(60),
            |backend, comm| {
                runs.iter()
                    .map(|run| {
                        Ok(run_rank(&run.ranks[comm.rank()], backend, comm, full, &opts, &ExecOptions::default())?
                            .shards)
                    })
                    .collect()
            },
        )
    });
}

//! Every strategy's plan on several GPUs over NCCL, against the f64 reference
//! (`cargo test --release -p distattn-nccl -- --ignored` on a machine with 2 or more GPUs and
//! `libnccl.so` on the loader path; with fewer GPUs it fails, saying so).

use distattn_core::AttnOptions;
use distattn_cuda::gpu_count;
use distattn_exec::{run_rank, ExecOptions};
use distattn_nccl::with_gpu_ranks;
use distattn_testkit::plans::check_every_strategy;
use std::time::Duration;

#[test]
#[ignore = "needs 2 or more CUDA GPUs and NCCL"]
fn every_strategy_on_gpus_matches_the_reference() {
    let gpus = gpu_count();
    assert!(gpus >= 2, "this test needs 2 or more CUDA GPUs; {gpus} found");
    let worlds: Vec<usize> = [2, 4, 8].into_iter().filter(|&w| w <= gpus).collect();
    let opts = AttnOptions::default();
    check_every_strategy("every_strategy_on_gpus_matches_the_reference", &worlds, &|world, runs, full| {
        with_gpu_ranks(world, 0, Duration::from_secs(60), |g| {
            runs.iter()
                .map(|run| {
                    Ok(run_rank(&run.ranks[g.rank()], g.backend(), g.comm(), full, &opts, &ExecOptions::default())?
                        .shards)
                })
                .collect()
        })
    });
}

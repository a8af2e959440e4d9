//! One decode step of a ragged batch over a KV cache spread over 4 ranks (DistAttention):
//! `cargo run --release -p distattn --example spread_decode`. Each request's cache is dealt
//! out to the ranks in pages of 16 tokens from its home rank; the step is one packed attention
//! problem whose layout puts every key where the cache keeps it and every query on its home
//! rank, run by a pass-q plan (the queries travel, partial outputs merge by log-sum-exp) on
//! in-process CPU ranks — `Execution::GpuRanks` runs the same plan on GPUs. The output equals
//! one call over the whole cache. (`tests/serving.rs` runs this file.)

use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
use distattn::planner::build;
use distattn::{Attention, DType, Execution, PlanOptions, Ranks, Strategy};

pub fn main() -> Result<(), distattn::Error> {
    let world = 4;
    // Four requests: (home rank, cached tokens, new tokens this step); one speculative step of 3.
    let requests = [(0, 5000, 1), (1, 37, 1), (3, 1200, 3), (2, 0, 1)].map(|(home, cached, new)| StepRequest {
        home,
        cached,
        new,
    });
    let placement = KvPlacement::interleaved(16, world)?;
    let step = ServingStep::new(&placement, &requests, Queries::AtHome, 8, 2, 64)?;
    let opts = PlanOptions { layout: Some(step.layout.clone()), ..PlanOptions::forward() };
    println!("{}", build(Strategy::PassQ, world, &step.shape, &step.mask, DType::F32, &opts)?);

    // The packed queries [1, Σ new, 8, 64] and keys/values [1, Σ (cached + new), 2, 64].
    let values = |n: usize, seed: usize| (0..n).map(|i| ((i * 7919 + seed) % 1000) as f32 / 500.0 - 1.0).collect();
    let (q, k, v): (Vec<f32>, Vec<f32>, Vec<f32>) =
        (values(step.shape.q_elems(), 1), values(step.shape.kv_elems(), 2), values(step.shape.kv_elems(), 3));

    let one = Attention::new(step.shape, step.mask.clone())?;
    let spread = one.clone().on(Execution::CpuRanks(Ranks { plan: opts, ..Ranks::new(world, Strategy::PassQ) }));
    let (want, got) = (one.forward(&q, &k, &v)?, spread.forward(&q, &k, &v)?);
    let diff = got.o.iter().zip(&want.o).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("{} query rows over {world} ranks differ from one call by at most {diff:.1e}", step.shape.q_len);
    assert!(diff < 1e-4, "the spread step differs from one call");
    Ok(())
}

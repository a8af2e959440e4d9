//! Planners: one short file per strategy. Each turns (world, shape, mask) into a [`Plan`]
//! through the shared plan builder; none of them executes anything. [`build`] is the one way
//! to build a plan.

mod allgather;
mod balanced;
mod builder;
mod dispatch;
mod double_ring;
mod hybrid;
mod pass_q;
mod ring;
mod ulysses;
mod zigzag;

pub use dispatch::dispatch_layout;
pub use double_ring::default_inner_ring;
pub use hybrid::default_ulysses_degree;

use crate::plan::{Pass, Plan, PlanOptions, Rates};
use crate::{AttnShape, DType, Error, Mask, Result, Strategy};
use builder::Builder;

/// The most ranks a plan is built for.
pub const MAX_WORLD: usize = 1024;

/// Builds the plan of `strategy` for `world` ranks (at most [`MAX_WORLD`], and at most one per
/// token).
pub fn build(
    strategy: Strategy,
    world: usize,
    shape: &AttnShape,
    mask: &Mask,
    dtype: DType,
    opts: &PlanOptions,
) -> Result<Plan> {
    shape.validate()?;
    if world == 0 {
        return Err(Error::ZeroDim { what: "world size" });
    }
    // A ring plan has world² (step, rank) entries: 1024 ranks already take seconds and a
    // gigabyte to plan, beyond that the planner would run out of memory rather than fail.
    if world > MAX_WORLD {
        return Err(Error::invalid("world size", format!("{world} ranks; plans are built for at most {MAX_WORLD}")));
    }
    // A rank without a single token to hold is a mistake, not a plan, where the planner places
    // the tokens; a caller's placement (serving: a short request's cache on a large group) may
    // leave ranks empty.
    let tokens = shape.q_len.max(shape.k_len);
    if world > tokens && opts.layout.is_none() {
        return Err(Error::invalid(
            "world size",
            format!("{world} ranks for {tokens} tokens: every rank needs at least one token"),
        ));
    }
    mask.check_fits(shape)?;
    if let Some(layout) = &opts.layout {
        if !matches!(strategy, Strategy::PassQ | Strategy::Ring) {
            return Err(Error::invalid(
                "layout",
                format!("{strategy} chooses its own layout; only pass-q and ring take the caller's placement"),
            ));
        }
        if layout.q.len() != world || layout.k.len() != world {
            return Err(Error::invalid(
                "layout",
                format!("{} query and {} key sets for {world} ranks", layout.q.len(), layout.k.len()),
            ));
        }
        layout.validate(shape.q_len, shape.k_len)?;
    }
    let mut b = Builder::new(strategy, world, shape, mask, dtype, opts);
    match strategy {
        Strategy::Ring => ring::plan(&mut b),
        Strategy::Zigzag => zigzag::plan(&mut b),
        Strategy::Striped => zigzag::plan_striped(&mut b),
        Strategy::Balanced => balanced::plan(&mut b),
        Strategy::Ulysses => ulysses::plan(&mut b),
        Strategy::Hybrid { ulysses_degree } => hybrid::plan(&mut b, ulysses_degree),
        Strategy::DoubleRing { inner } => double_ring::plan(&mut b, inner),
        Strategy::Allgather => allgather::plan(&mut b),
        Strategy::Dispatch => dispatch::plan(&mut b),
        Strategy::PassQ => pass_q::plan(&mut b),
    }?;
    b.finish()
}

/// The plan of whichever of `candidates` [`Plan::estimate`] finds fastest at `rates` (then the
/// one moving fewer bytes, then the first) — pass-q against a ring (pass-KV) over a placed KV
/// cache: what each moves (queries and partial outputs, or keys) and whether the ranks that
/// hold no new tokens get work.
pub fn fastest(
    candidates: &[Strategy],
    world: usize,
    shape: &AttnShape,
    mask: &Mask,
    dtype: DType,
    opts: &PlanOptions,
    rates: &Rates,
) -> Result<Plan> {
    let mut best: Option<((f64, u64), Plan)> = None;
    for &s in candidates {
        let plan = build(s, world, shape, mask, dtype, opts)?;
        let key = (plan.estimate(rates).ms, plan.summary().bytes_moved);
        if best.as_ref().is_none_or(|(b, _)| key < *b) {
            best = Some((key, plan));
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| Error::invalid("candidates", "no strategy to choose from"))
}

/// The strategies [`fastest_training`] chooses among: one of each family (rings over the
/// zig-zag layout, all-to-all, both, all-gather, mask-aware dispatch).
pub const TRAINING_CANDIDATES: [Strategy; 5] = [
    Strategy::Zigzag,
    Strategy::Ulysses,
    Strategy::Hybrid { ulysses_degree: 0 },
    Strategy::Dispatch,
    Strategy::Allgather,
];

/// Whichever of `candidates` has the smallest estimated forward plus backward time at `rates`
/// (then the first), for a training step. A candidate that cannot plan the problem (Ulysses
/// with heads the world does not divide, say) is passed over; if none can, the last error.
/// On 4 × H200 (32/8 heads, d 128; causal, full and packed documents at 32k and 128k, with the
/// Python package's options: outputs in the inputs' dtype, kept head-sharded inputs) the choice
/// (Ulysses on causal and full masks, dispatch on documents) was within 1.8% of the fastest
/// measured strategy in every case, and on 2 × H200 (dispatch on causal masks and documents,
/// Ulysses on full masks) within 2.1%. Without the estimate's fixed cost per tile, zigzag's P
/// blocks a rank tied with all-gather's two and beat Ulysses' one, up to 5.3% slower than the
/// fastest.
pub fn fastest_training(
    candidates: &[Strategy],
    world: usize,
    shape: &AttnShape,
    mask: &Mask,
    dtype: DType,
    opts: &PlanOptions,
    rates: &Rates,
) -> Result<Strategy> {
    let mut best: Option<(f64, Strategy)> = None;
    let mut last_err = None;
    for &s in candidates {
        let ms = [Pass::Forward, Pass::Backward]
            .iter()
            .map(|&pass| build(s, world, shape, mask, dtype, &opts.with_pass(pass)).map(|p| p.estimate(rates).ms))
            .sum::<Result<f64>>();
        match ms {
            Ok(ms) if best.is_none_or(|(b, _)| ms < b) => best = Some((ms, s)),
            Ok(_) => {}
            Err(e) => last_err = Some(e),
        }
    }
    match (best, last_err) {
        (Some((_, s)), _) => Ok(s),
        (None, Some(e)) => Err(e),
        (None, None) => Err(Error::invalid("candidates", "no strategy to choose from")),
    }
}

#[cfg(test)]
mod tests;

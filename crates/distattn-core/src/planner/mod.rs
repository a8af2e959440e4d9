//! Planners: one short file per strategy. Each turns (world, shape, mask) into a [`Plan`]
//! through the shared plan builder; none of them executes anything.
//!
//! [`Plan`]: crate::plan::Plan
// Planners index per-rank tables by rank on purpose; `%` keeps the MSRV (1.80).
#![allow(clippy::needless_range_loop, clippy::manual_is_multiple_of, clippy::type_complexity)]

mod allgather;
mod balanced;
mod dispatch;
mod hybrid;
mod ring;
mod ulysses;
mod zigzag;

pub use dispatch::dispatch_layout;
pub use hybrid::default_ulysses_degree;

use crate::plan::Builder;
use crate::Result;
use crate::Strategy;

pub(crate) fn plan_into(strategy: Strategy, b: &mut Builder) -> Result<()> {
    match strategy {
        Strategy::Ring => ring::plan(b),
        Strategy::Zigzag => zigzag::plan(b),
        Strategy::Striped => zigzag::plan_striped(b),
        Strategy::Balanced => balanced::plan(b),
        Strategy::Ulysses => ulysses::plan(b),
        Strategy::Hybrid { ulysses_degree } => hybrid::plan(b, ulysses_degree),
        Strategy::Allgather => allgather::plan(b),
        Strategy::Dispatch => dispatch::plan(b),
    }
}

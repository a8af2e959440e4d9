//! Context-parallel attention as plans: pure data that says, for every rank and step, which
//! buffers to send and receive, which (query set × key set) block to compute with which mask
//! area, and how partial results merge.
//!
//! A [`Plan`] is built by a strategy's planner ([`crate::planner::build`]) and run by one
//! interpreter (crate `distattn-exec`) that knows nothing about strategies. Each rank runs a
//! [`RankProgram`]: a list of steps, each a list of [`Op`]s over rank-local buffers
//! ([`BufDesc`]: a tensor, a [`TokenSet`] of global tokens and a head range). Communication is
//! point-to-point sends and receives posted together as one group ([`Op::Comm`]); every rank
//! posts its groups in the same global (step, phase) order, so no schedule can deadlock.
//!
//! Plans are per chunk, never per token: building one for 128k tokens and 8 ranks takes
//! milliseconds, and [`Plan::summary`] reports FLOPs, bytes, imbalance and peak memory.
//!
//! This module is the plan data ([`Plan`], [`RankProgram`], [`Op`], …), its checks
//! ([`Plan::validate`]), layouts ([`layout`]), costs ([`cost`]) and time estimates
//! ([`estimate`]); it knows no planner.

pub mod cost;
mod data;
pub mod estimate;
pub mod layout;
mod validate;

pub use cost::{PlanSummary, StepCost};
pub use data::{BufDesc, BufId, Fill, Op, Pass, Plan, PlanOptions, RankProgram, RingBackward, Tensor};
pub use estimate::{Estimate, Rates};
pub use layout::{area, even_part, split_even, sub_mask, Layout, LayoutKind, TokenSet};
pub use validate::MAX_SENDS_TO_A_PEER;

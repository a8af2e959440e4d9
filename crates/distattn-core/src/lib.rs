//! Hardware-free core of distattn.
//!
//! Everything here is plain data and pure functions: tensor shapes and storage dtypes
//! ([`AttnShape`], [`Element`]), attention masks as lists of slices ([`Mask`]) with per-tile
//! classification ([`TileClass`]), and the typed [`Error`] every crate of the workspace returns.
//! Backends (CPU, CUDA) and planners build on these types.

pub mod comm;
pub mod dtype;
pub mod error;
pub mod mask;
pub mod plan;
pub mod planner;
pub mod shape;
pub mod strategy;

pub use comm::Communicator;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use mask::{Mask, MaskSlice, MaskSpec, SliceKind, TileClass, TileInfo};
pub use plan::{Plan, PlanOptions, PlanSummary};
pub use shape::{AttnOptions, AttnShape};
pub use strategy::Strategy;

//! Hardware-free core of distattn.
//!
//! Everything here is plain data and pure functions: tensor shapes and storage dtypes
//! ([`AttnShape`], [`Element`], [`HostData`]), attention masks as lists of slices ([`Mask`])
//! with per-tile classification ([`TileClass`]), context-parallel plans and their planners,
//! the two-lane [`schedule`] every interpreter follows, per-step [`timeline`]s, the outputs of
//! attention ([`Forward`], [`Grads`]) and the typed [`Error`] every crate of the workspace
//! returns. Nothing here touches hardware: the interpreter (crate `distattn-exec`) and the
//! backends (CPU, CUDA) build on these types.

pub mod decode;
pub mod dtype;
pub mod error;
pub mod kv_placement;
pub mod mask;
pub mod outputs;
pub mod plan;
pub mod planner;
pub mod schedule;
pub mod shape;
pub mod strategy;
pub mod timeline;

pub use dtype::{DType, Element, HostData};
pub use error::{Error, Result};
pub use mask::{Mask, MaskSlice, MaskSpec, SliceKind, TileClass, TileInfo};
pub use outputs::{Forward, Grads};
pub use plan::{Plan, PlanOptions, PlanSummary};
pub use shape::{AttnOptions, AttnShape, MAX_SEQ_LEN};
pub use strategy::Strategy;

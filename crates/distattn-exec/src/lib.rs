//! The one interpreter of distattn's plans.
//!
//! A distributed attention call is a [`Plan`](distattn_core::Plan) (crate `distattn-core`):
//! for every rank, which blocks to compute and which buffers to move. This crate runs it:
//!
//! * [`backend`]: the [`Backend`] trait a device implements (buffers, a compute and a comm
//!   lane with events between them, copies, merges, attention blocks) — the CPU backend lives
//!   in `distattn-cpu`, the CUDA backend in `distattn-cuda`;
//! * [`comm`]: the [`Communicator`] trait a transport implements — [`threads::ThreadComm`]
//!   here for ranks as threads, NCCL in `distattn-nccl`;
//! * [`prepare`](mod@prepare): a rank's program made ready once (schedule, sub-masks, pieces, merge specs);
//! * [`interpreter`]: [`execute`], the one interpreter, for every backend and transport, with
//!   per-step timelines; [`execute_deferred`] issues a run and hands its [`Completion`] back
//!   (the Python package's GPU calls give it to the NCCL communicator to watch);
//! * [`shard`](mod@shard) and [`run`]: whole host tensors to a rank's shards and back ([`run_rank`]);
//! * [`rendezvous`]: mailboxes, barrier and failure of ranks in one process, what thread
//!   transports build on.
//!
//! Ranks of one process run through [`threads::run_ranks`]; see the `distattn` crate for the
//! one-call API over every backend.

pub mod backend;
pub mod comm;
pub mod interpreter;
pub mod pieces;
pub mod prepare;
pub mod rendezvous;
pub mod run;
pub mod shard;
pub mod threads;

pub use backend::{Backend, Block, BwdInputs, FwdInputs, GradAccs};
pub use comm::Communicator;
pub use interpreter::{
    execute, execute_deferred, Completion, Deferred, ExecOptions, FailureKind, InjectedFailure, RankRun,
};
pub use pieces::{MergeSpec, Piece};
pub use prepare::{prepare, prepare_all, PreparedRank};
pub use run::{run_rank, BackwardTensors, HostTensors, RankResult};
pub use shard::{gather_forward, gather_grads, shard, unshard_into, Shard};
pub use threads::{run_ranks, ThreadComm};

//! Several GPUs for distattn.
//!
//! * [`nccl`]: [`NcclComm`], the NCCL implementation of [`distattn_core::Communicator`] on
//!   device buffers — non-blocking communicators, a watchdog that aborts on a peer's failure,
//!   an NCCL error or a stall, and errors that name the failed rank.
//! * [`gpu`]: [`GpuRank`] (one GPU: CUDA kernels + communicator). It implements the plan
//!   executor's [`distattn_dist::Backend`] (generic, blocking transfers) and runs any plan
//!   overlapped ([`GpuRank::execute`]): compute and transfers on two streams ordered by events
//!   following the [`schedule`], double-buffered, with per-step [`timeline`]s.
//! * [`runner`]: thread ranks in one process ([`with_gpu_ranks`], [`gpu_forward`],
//!   [`gpu_backward`]) — what `distattn run/bench --gpus N` calls — and one rank per process
//!   from a launcher's environment ([`gpu_rank_from_env`], [`launch::LaunchEnv`]) — what the
//!   processes of `distattn launch --nproc N` call.
//!
//! NCCL is loaded at run time as `libnccl.so` (link `libnccl.so.2` under that name on
//! `LD_LIBRARY_PATH`); `NCCL_NVLS_ENABLE=0` is set unless the caller set it.
#![allow(clippy::too_many_arguments, clippy::type_complexity, clippy::needless_range_loop)]

pub mod buf;
pub mod gpu;
pub mod launch;
pub mod nccl;
pub mod runner;
pub mod schedule;
pub mod timeline;

pub use buf::GpuBuf;
pub use gpu::{GpuRank, RunOutput};
pub use launch::LaunchEnv;
pub use nccl::{nccl_available, NcclComm};
pub use runner::{
    gpu_backward, gpu_forward, gpu_rank_from_env, time_gpu_strategy, with_gpu_ranks, GpuRunOptions, GpuTiming,
};
pub use schedule::{schedule, Lane, Schedule};
pub use timeline::{Overlap, Timeline, TimelineRun};

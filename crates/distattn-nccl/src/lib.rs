//! Several GPUs for distattn, through NCCL.
//!
//! * [`comm`]: [`NcclComm`], the NCCL implementation of `distattn_exec::Communicator` on
//!   device buffers — non-blocking communicators, a watchdog that aborts on a peer's failure,
//!   an NCCL error or a stall, and errors that name the failed rank.
//! * [`ranks`]: [`GpuRank`] (a GPU's CUDA backend and its communicator) opened as thread ranks
//!   of one process ([`with_gpu_ranks`]) or one rank per process ([`gpu_rank_from_env`]), and
//!   [`time_gpu_strategy`], the benchmark of a strategy on local GPUs. Plans run on them through
//!   the one interpreter of `distattn-exec`.
//! * [`launch`]: the environment a launcher sets for each rank ([`LaunchEnv`]).
//!
//! NCCL is loaded at run time as `libnccl.so` (link `libnccl.so.2` under that name on
//! `LD_LIBRARY_PATH`); `NCCL_NVLS_ENABLE=0` is set unless the caller set it.

pub mod comm;
pub mod launch;
pub mod ranks;

pub use comm::{nccl_available, NcclComm};
pub use launch::LaunchEnv;
pub use ranks::{device_inputs, gpu_rank_from_env, time_gpu_strategy, with_gpu_ranks, GpuBench, GpuRank, GpuTiming};

//! distattn: exact, memory-efficient attention over very long sequences, on one device and
//! across many.
//!
//! [`Attention`] is the one way to call it: a problem (shape, mask, softmax scale), where it
//! runs ([`Execution`]: the CPU, a CUDA GPU, in-process CPU ranks or local GPUs running a
//! context-parallel [`Strategy`]), and `forward` / `backward` with one argument order
//! whatever runs them. Everything of the hardware-free core (shapes, dtypes, masks, plans,
//! errors) is re-exported here.
//!
//! Features: `cuda` (CUDA kernels), `nccl` (several GPUs), `npy` (`.npy` files), `cli` (the
//! `distattn` command-line tool); none is on by default, and CUDA and NCCL are loaded at run
//! time, so every feature builds on a machine without them.
//!
//! ```
//! use distattn::{Attention, AttnShape, Mask};
//!
//! // One sequence of 300 tokens, 4 query heads sharing 2 KV heads (GQA), head dim 64.
//! let shape = AttnShape::new(1, 300, 300, 4, 2, 64)?;
//! let q = vec![0.1f32; shape.q_elems()];
//! let k = vec![0.2f32; shape.kv_elems()];
//! let v = vec![0.3f32; shape.kv_elems()];
//! let mask = Mask::sliding_window(300, 300, Some(128), Some(0))?; // causal window of 129 keys
//! let out = Attention::new(shape, mask)?.forward(&q, &k, &v)?;
//! assert_eq!(out.o.len(), shape.q_elems());
//! assert_eq!(out.lse.len(), shape.lse_elems()); // [batch, heads, q_len], natural log
//! # Ok::<(), distattn::Error>(())
//! ```

mod attention;
#[cfg(feature = "cuda")]
mod cuda;
pub mod decode;
mod rank;
pub mod tensor;

pub use attention::{Attention, Execution, Ranks};
pub use distattn_core::*;
pub use distattn_cpu::CpuBackend;
pub use distattn_exec::{run_ranks, Backend, Communicator, FailureKind, InjectedFailure, ThreadComm};
pub use rank::{Deferred, RankAttention};
pub use tensor::HostTensor;

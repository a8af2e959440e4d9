//! distattn: exact, memory-efficient attention over very long sequences.
//!
//! This crate is the front door: it re-exports the hardware-free core (shapes, dtypes, masks,
//! plans, errors), the CPU backend and the distributed executor on in-process ranks, and adds dtype-erased host tensors with `.npy` input/output.
//!
//! ```
//! use distattn::{AttnOptions, AttnShape, Mask};
//!
//! // One sequence of 300 tokens, 4 query heads sharing 2 KV heads (GQA), head dim 64.
//! let shape = AttnShape::new(1, 300, 300, 4, 2, 64)?;
//! let q = vec![0.1f32; shape.q_elems()];
//! let k = vec![0.2f32; shape.kv_elems()];
//! let v = vec![0.3f32; shape.kv_elems()];
//! let mask = Mask::sliding_window(300, 300, Some(128), Some(0))?; // causal window of 129 keys
//! let out = distattn::cpu::forward(&q, &k, &v, &shape, &mask, &AttnOptions::default())?;
//! assert_eq!(out.o.len(), shape.q_elems());
//! assert_eq!(out.lse.len(), shape.lse_elems());
//! # Ok::<(), distattn::Error>(())
//! ```

pub mod host;
pub mod tensor;

pub use distattn_core::*;
pub use distattn_cpu as cpu;
pub use distattn_cuda as cuda;
pub use distattn_dist as dist;
pub use distattn_nccl as nccl;
pub use tensor::{HostTensor, TensorData};

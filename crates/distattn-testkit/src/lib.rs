//! What distattn's tests, GPU checks and self-checks share, so that every one measures the
//! same way:
//!
//! * [`reference`]: dense, quadratic attention in f64 (forward and backward), the oracle;
//! * [`random`]: inputs drawn from a seed that is printed and can be replayed
//!   (`DISTATTN_SEED=<n>`), never zeros;
//! * [`compare`]: relative errors against the f64 reference, with −inf (rows that see no key)
//!   required to match exactly and NaN always failing;
//! * [`fp8`]: e4m3 codes and their values, for the FP8 kernels' inputs;
//! * [`decode`]: random ragged batches in a shuffled paged KV cache, and decode attention's
//!   f64 reference over them;
//! * [`plans`]: every strategy's plans run on a caller's ranks against the reference (the
//!   GPU tests of the CUDA and NCCL crates).

pub mod compare;
pub mod decode;
pub mod fp8;
pub mod plans;
pub mod random;
pub mod reference;

pub use compare::{lse_err, rel_err, rel_err_f32};
pub use random::{cast, randn, seeded_rng, uniform};
pub use reference::{widen, RefForward, RefGrads};

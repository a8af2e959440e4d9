//! The error type shared by every distattn crate.

use thiserror::Error;

/// Everything that can go wrong in distattn, as data the caller can match on.
///
/// Library code never panics on user input; it returns one of these.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A tensor's element count or dimensions do not match the attention shape.
    #[error("shape mismatch for {tensor}: expected {expected}, got {got}")]
    ShapeMismatch { tensor: String, expected: String, got: String },

    /// Query heads must be a whole multiple of key/value heads (GQA / MQA).
    #[error("query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")]
    HeadsNotDivisible { heads: usize, kv_heads: usize },

    /// A dimension that must be positive is zero.
    #[error("{what} must be positive")]
    ZeroDim { what: &'static str },

    /// Tensors passed together must share a storage dtype.
    #[error("dtype mismatch: {a} is {a_dtype}, {b} is {b_dtype}")]
    DTypeMismatch { a: String, a_dtype: String, b: String, b_dtype: String },

    /// The dtype is not one the operation supports.
    #[error("unsupported dtype {0} (supported: f32, bf16, f16)")]
    UnsupportedDType(String),

    /// The head dimension is not one the backend supports.
    #[error("unsupported head dimension {head_dim} for {backend} (supported: {supported})")]
    UnsupportedHeadDim { head_dim: usize, backend: &'static str, supported: String },

    /// A mask is malformed (slice out of bounds, overlapping slices, bad parameters).
    #[error("invalid mask: {0}")]
    InvalidMask(String),

    /// A mask specification string could not be parsed.
    #[error("unknown mask '{spec}': {reason}")]
    MaskSpec { spec: String, reason: String },

    /// An input holds NaN or infinity (only checked when asked for).
    #[error("{tensor} contains a non-finite value at flat index {index}")]
    NonFinite { tensor: String, index: usize },

    /// A strategy cannot serve this configuration.
    #[error("strategy {strategy} cannot run this case: {reason}")]
    Unsupported { strategy: String, reason: String },

    /// A rank of a distributed run failed; the others stop with this error.
    #[error("rank {rank} failed: {reason}")]
    RankFailed { rank: usize, reason: String },

    /// Communication between ranks failed or timed out.
    #[error("communication error: {0}")]
    Comm(String),

    /// A backend-specific failure (driver, compiler, allocation).
    #[error("{backend} backend: {reason}")]
    Backend { backend: &'static str, reason: String },

    /// Reading or writing a file failed.
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
}

/// Result alias with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

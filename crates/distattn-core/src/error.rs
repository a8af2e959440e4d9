//! The error type shared by every distattn crate.

use std::sync::Arc;
use thiserror::Error;

/// Everything that can go wrong in distattn, as data the caller can match on.
///
/// Library code never panics on user input; it returns one of these. Variants say whose fault
/// an error is: the caller's arguments ([`Error::InvalidArgument`] and the shape, dtype and
/// mask variants), a plan ([`Error::InvalidPlan`]), a peer or the transport
/// ([`Error::RankFailed`], [`Error::Comm`]), the device ([`Error::Backend`]), a file
/// ([`Error::Io`], [`Error::InvalidFile`]), or distattn itself ([`Error::Internal`]).
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

    /// An input holds NaN or infinity (only checked when asked for); `index` is the element's
    /// position, one entry per dimension.
    #[error("non-finite value (NaN or infinity) at {tensor}[{}]", join_index(index))]
    NonFinite { tensor: String, index: Vec<usize> },

    /// An argument outside its valid range (a softmax scale, a world size, an option).
    #[error("invalid {what}: {reason}")]
    InvalidArgument { what: String, reason: String },

    /// A strategy cannot serve this configuration.
    #[error("strategy {strategy} cannot run this case: {reason}")]
    Unsupported { strategy: String, reason: String },

    /// A plan breaks its invariants (a buffer used before it exists, a send nobody receives,
    /// a plan run on the wrong number of ranks).
    #[error("invalid plan: {0}")]
    InvalidPlan(String),

    /// A rank of a distributed run failed; the others stop with this error.
    #[error("rank {rank} failed: {reason}")]
    RankFailed { rank: usize, reason: String },

    /// Communication between ranks failed or timed out.
    #[error("communication error: {0}")]
    Comm(String),

    /// A backend-specific failure (driver, compiler, allocation).
    #[error("{backend} backend: {reason}")]
    Backend { backend: &'static str, reason: String },

    /// Reading or writing a file failed; the I/O error is the source.
    #[error("I/O error on {path}")]
    Io {
        path: String,
        #[source]
        source: IoError,
    },

    /// A file was read but does not hold what it should (a malformed `.npy`, a wrong length).
    #[error("{path}: {reason}")]
    InvalidFile { path: String, reason: String },

    /// An invariant of distattn itself failed: a bug to report, not a usage error.
    #[error("internal error: {0}")]
    Internal(String),
}

/// `[0, 5, 2]` as `0, 5, 2`, the way an element is written after a tensor's name.
fn join_index(index: &[usize]) -> String {
    index.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

impl Error {
    /// An [`Error::InvalidArgument`].
    pub fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::InvalidArgument { what: what.into(), reason: reason.into() }
    }

    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Error {
        Error::Io { path: path.as_ref().display().to_string(), source: IoError(Arc::new(source)) }
    }
}

/// An I/O error kept as the source of [`Error::Io`]; shared so that [`Error`] stays `Clone`,
/// and compared by kind and message.
#[derive(Debug, Clone)]
pub struct IoError(pub Arc<std::io::Error>);

impl IoError {
    /// The underlying I/O error.
    pub fn get(&self) -> &std::io::Error {
        &self.0
    }
}

impl PartialEq for IoError {
    fn eq(&self, other: &Self) -> bool {
        self.0.kind() == other.0.kind() && self.0.to_string() == other.0.to_string()
    }
}

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for IoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Result alias with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn io_errors_keep_their_source() {
        let e = Error::io("/no/such", std::io::Error::new(std::io::ErrorKind::NotFound, "gone"));
        assert_eq!(e.to_string(), "I/O error on /no/such");
        let src = e.source().and_then(|s| s.downcast_ref::<IoError>()).expect("the I/O error as source");
        assert_eq!((src.get().kind(), src.to_string().as_str()), (std::io::ErrorKind::NotFound, "gone"));
        // Errors compare by what they say (an I/O source by its kind and message).
        let io = |kind, msg: &str| Error::io("/no/such", std::io::Error::new(kind, msg.to_string()));
        assert_eq!(e, io(std::io::ErrorKind::NotFound, "gone"));
        assert_ne!(e, io(std::io::ErrorKind::NotFound, "went"));
        assert_ne!(e, io(std::io::ErrorKind::PermissionDenied, "gone"));
        assert_ne!(Error::invalid("scale", "must be positive"), Error::invalid("scale", "must be finite"));
        assert_eq!(Error::invalid("scale", "must be positive").to_string(), "invalid scale: must be positive");
    }
}

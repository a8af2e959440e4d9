//! Attention shapes and options.
//!
//! Layouts follow FlashAttention: Q is `[batch, q_len, heads, head_dim]`, K and V are
//! `[batch, k_len, kv_heads, head_dim]`, O matches Q, and the log-sum-exp is
//! `[batch, heads, q_len]` in f32. The packed variable-length layout
//! (`[total_tokens, heads, head_dim]` plus cumulative offsets) is the case `batch = 1` with a
//! document mask built from the offsets (see [`crate::Mask::documents`]).

use crate::{Error, Result};

/// The longest query or key sequence: kernels and their parameters index tokens with 32-bit
/// signed integers.
pub const MAX_SEQ_LEN: usize = i32::MAX as usize;

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct AttnShape {
    pub batch: usize,
    pub q_len: usize,
    pub k_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// A validated shape. `heads` must be a multiple of `kv_heads` (GQA / MQA).
    pub fn new(
        batch: usize,
        q_len: usize,
        k_len: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let s = AttnShape { batch, q_len, k_len, heads, kv_heads, head_dim };
        s.validate()?;
        Ok(s)
    }

    /// Self-attention shape: `q_len == k_len`, `kv_heads == heads`.
    pub fn self_attn(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Result<Self> {
        Self::new(batch, seq, seq, heads, heads, head_dim)
    }

    /// Checks that every size is positive, heads divide evenly, sequences are at most
    /// [`MAX_SEQ_LEN`] and every tensor's size in bytes (as f32) is addressable, so that
    /// element counts and offsets computed from the shape cannot overflow.
    pub fn validate(&self) -> Result<()> {
        for (v, what) in [
            (self.batch, "batch"),
            (self.q_len, "query length"),
            (self.k_len, "key length"),
            (self.heads, "heads"),
            (self.kv_heads, "kv heads"),
            (self.head_dim, "head dim"),
        ] {
            if v == 0 {
                return Err(Error::ZeroDim { what });
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::HeadsNotDivisible { heads: self.heads, kv_heads: self.kv_heads });
        }
        for (len, what) in [(self.q_len, "query length"), (self.k_len, "key length")] {
            if len > MAX_SEQ_LEN {
                return Err(Error::invalid(what, format!("{len} is more than the supported {MAX_SEQ_LEN} tokens")));
            }
        }
        let f32_bytes = |dims: [usize; 4]| {
            dims.iter().try_fold(4usize, |acc, &d| acc.checked_mul(d)).filter(|&b| b <= isize::MAX as usize)
        };
        for (dims, what) in [
            ([self.batch, self.q_len, self.heads, self.head_dim], "q"),
            ([self.batch, self.k_len, self.kv_heads, self.head_dim], "k"),
            ([self.batch, self.heads, self.q_len, 1], "lse"),
        ] {
            if f32_bytes(dims).is_none() {
                return Err(Error::invalid("shape", format!("{self}: {what} would not fit in memory")));
            }
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Elements of Q (and O, dO, dQ).
    pub fn q_elems(&self) -> usize {
        self.batch * self.q_len * self.heads * self.head_dim
    }

    /// Elements of K (and V, dK, dV).
    pub fn kv_elems(&self) -> usize {
        self.batch * self.k_len * self.kv_heads * self.head_dim
    }

    /// Elements of the LSE (and of the row sums D).
    pub fn lse_elems(&self) -> usize {
        self.batch * self.heads * self.q_len
    }

    /// Flat offset of row `(b, i, h)` of Q / O.
    #[inline(always)]
    pub fn q_offset(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.q_len + i) * self.heads + h) * self.head_dim
    }

    /// Flat offset of row `(b, j, kh)` of K / V.
    #[inline(always)]
    pub fn kv_offset(&self, b: usize, j: usize, kh: usize) -> usize {
        ((b * self.k_len + j) * self.kv_heads + kh) * self.head_dim
    }

    /// Flat offset of the LSE entry `(b, h, i)`.
    #[inline(always)]
    pub fn lse_offset(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.heads + h) * self.q_len + i
    }

    /// Checks a tensor's element count, naming it in the error.
    pub fn check_len(&self, tensor: &str, got: usize, expected: usize) -> Result<()> {
        if got != expected {
            return Err(Error::ShapeMismatch {
                tensor: tensor.to_string(),
                expected: format!("{expected} elements for {self}"),
                got: format!("{got} elements"),
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for AttnShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "batch={} q_len={} k_len={} heads={} kv_heads={} head_dim={}",
            self.batch, self.q_len, self.k_len, self.heads, self.kv_heads, self.head_dim
        )
    }
}

/// Options of an attention call.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AttnOptions {
    /// Softmax scale; `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
}

impl AttnOptions {
    /// The softmax scale for this head dimension, or the error for one that is not positive
    /// and finite.
    pub fn scale_for(&self, head_dim: usize) -> Result<f32> {
        let s = self.scale.unwrap_or_else(|| 1.0 / (head_dim as f32).sqrt());
        if !(s.is_finite() && s > 0.0) {
            return Err(Error::invalid("softmax scale", format!("must be positive and finite, got {s}")));
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gqa_validation() {
        assert!(AttnShape::new(1, 4, 4, 8, 2, 64).is_ok());
        assert_eq!(AttnShape::new(1, 4, 4, 6, 4, 64), Err(Error::HeadsNotDivisible { heads: 6, kv_heads: 4 }));
        assert_eq!(AttnShape::new(1, 0, 4, 1, 1, 64), Err(Error::ZeroDim { what: "query length" }));
        let s = AttnShape::new(2, 3, 5, 4, 2, 8).unwrap();
        assert_eq!(s.group(), 2);
        assert_eq!(s.q_elems(), 2 * 3 * 4 * 8);
        assert_eq!(s.kv_elems(), 2 * 5 * 2 * 8);
        assert_eq!(s.q_offset(1, 2, 3), ((3 + 2) * 4 + 3) * 8);
        assert!(s.check_len("q", 1, 2).is_err());
    }

    #[test]
    fn sizes_that_overflow_are_refused() {
        let huge = 1usize << 40;
        for (b, nq, nk, h, kvh, d) in [
            (1, huge, 16, 1, 1, 64),
            (1, 16, huge, 1, 1, 64),
            (1, 16, 16, 1, 1, 1 << 62),
            (1 << 40, 1 << 20, 16, 1, 1, 64),
            (1, 1 << 30, 16, 1 << 40, 1, 1),
        ] {
            let err = AttnShape::new(b, nq, nk, h, kvh, d).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        }
        assert!(AttnShape::new(1, MAX_SEQ_LEN, MAX_SEQ_LEN, 1, 1, 8).is_ok());
    }

    #[test]
    fn default_scale() {
        assert_eq!(AttnOptions::default().scale_for(64), Ok(0.125));
        assert_eq!(AttnOptions { scale: Some(0.5) }.scale_for(64), Ok(0.5));
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let err = AttnOptions { scale: Some(bad) }.scale_for(64).unwrap_err();
            assert!(matches!(&err, Error::InvalidArgument { what, .. } if what == "softmax scale"), "{bad}: {err}");
        }
    }
}

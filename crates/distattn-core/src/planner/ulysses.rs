//! DeepSpeed-Ulysses: an all-to-all turns the sequence-sharded Q, K, V (contiguous layout)
//! into head-sharded ones (rank j gets every token for query heads j·H/P.. and key/value heads
//! j·KV/P..), every rank runs full local attention for its heads, and an all-to-all returns O
//! and LSE (backward: dQ, dK, dV) to sequence sharding. Needs both head counts divisible by P
//! (else `Error::Unsupported`). It is the hybrid planner with one group of P ranks.

use super::builder::Builder;
use super::hybrid;
use crate::plan::Layout;
use crate::Result;

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let (h, kvh) = (b.shape.heads, b.shape.kv_heads);
    if !h.is_multiple_of(p) || !kvh.is_multiple_of(p) {
        return Err(
            b.unsupported(format!("heads ({h}) and kv heads ({kvh}) must both be divisible by the world size {p}"))
        );
    }
    hybrid::grouped(b, p, Layout::contiguous(b.shape.q_len, b.shape.k_len, p))
}

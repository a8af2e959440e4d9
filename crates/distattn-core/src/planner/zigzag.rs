//! Zig-zag ring: the sequence is cut into 2P chunks and rank r holds chunks r and 2P−1−r, so
//! under a causal mask every rank has the same kept area at every ring step. With
//! packed documents (`PlanOptions::documents`, else the mask's diagonal blocks) the cut is made
//! inside every document (document-aware layout): a plain zig-zag balances the whole causal
//! triangle, not the documents' small triangles.
//! Striped ring: token i on rank i mod P; every step is a near-triangular block.

use super::builder::Builder;
use super::ring;
use crate::plan::Layout;
use crate::Result;

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    let layout = layout(b);
    ring::over_layout(b, layout, "zigzag")
}

/// The zig-zag layout over all ranks, cut inside every document of the options or the mask.
pub(super) fn layout(b: &Builder) -> Layout {
    match documents(b) {
        Some(lens) => Layout::doc_zigzag(&lens, b.world),
        None => Layout::zigzag(b.shape.q_len, b.shape.k_len, b.world),
    }
}

/// The packed documents a zig-zag cuts inside: the options' lengths, else the mask's diagonal
/// blocks; `None` unless they cover a self-attention sequence.
pub(super) fn documents(b: &Builder) -> Option<Vec<usize>> {
    let (q, k) = (b.shape.q_len, b.shape.k_len);
    let lens = b.opts.documents.clone().or_else(|| b.mask.diagonal_blocks())?;
    (q == k && lens.iter().sum::<usize>() == q).then_some(lens)
}

pub(super) fn plan_striped(b: &mut Builder) -> Result<()> {
    let layout = Layout::striped(b.shape.q_len, b.shape.k_len, b.world);
    ring::over_layout(b, layout, "striped")
}

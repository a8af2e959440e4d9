//! Ring attention: K/V blocks circulate around the ranks; each step every rank computes its
//! queries against the block it holds, skipping blocks the mask leaves empty (the causal steps
//! above the diagonal). The ring core here is shared by zigzag, striped and hybrid.
//!
//! Backward comes in two variants ([`RingBackward`]): K and V circulate (dQ stays), or
//! BurstAttention's Q, dO, LSE and D circulate (K, V, dK, dV stay). Either way the gradient a
//! rank computes for a visiting block goes straight back to the block's owner.

use super::builder::{BufSet, Builder, BwdBufs, FwdBufs, GradBufs, KvBufs, PassBufs};
use crate::plan::{BufId, Fill, Layout, Op, RingBackward};
use crate::Result;
use std::ops::Range;

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    // A caller's placement (a KV cache spread over the ranks: pass-KV), else contiguous.
    let layout = b.opts.layout.clone().unwrap_or_else(|| Layout::contiguous(b.shape.q_len, b.shape.k_len, b.world));
    over_layout(b, layout, "ring")
}

/// A ring over all ranks in rank order, on the given layout.
pub(super) fn over_layout(b: &mut Builder, layout: Layout, name: &str) -> Result<()> {
    let members: Vec<usize> = (0..b.world).collect();
    match b.declare_pass(layout) {
        PassBufs::Forward(bufs) => forward(b, 0, &members, &bufs, name),
        PassBufs::Backward(bufs) => backward(b, 0, &[BwdRing::own(&members)], &bufs, &bufs, name),
    }
    Ok(())
}

/// A ring step's label: at step 0 each member works on its own block; at step `t` on the block
/// of the member `t` places back in the ring.
fn step_label(name: &str, t: usize, what: &str) -> String {
    match t {
        0 => format!("{name} 0: own {what}"),
        t => format!("{name} {t}: {what} of rank r-{t}"),
    }
}

/// Forward ring among `members` (ranks, in ring order) starting at `step0`; `bufs[r]` is rank
/// r's own shard and accumulators. Uses steps `step0 .. step0 + members.len()`.
pub(super) fn forward(b: &mut Builder, step0: usize, members: &[usize], bufs: &[FwdBufs], name: &str) {
    let n = members.len();
    // held[i]: the K/V member i holds at this step.
    let mut held: Vec<KvBufs> = members.iter().map(|&r| bufs[r].kv).collect();
    for t in 0..n {
        let step = step0 + t;
        b.label(step, step_label(name, t, "kv"));
        let mut next = held.clone();
        if t + 1 < n {
            for (i, &kv) in held.iter().enumerate() {
                let to = (i + 1) % n;
                next[to] = b.transfer_set(step, 0, members[i], members[to], kv);
            }
        }
        for (&rank, &kv) in members.iter().zip(&held) {
            b.fwd(rank, step, FwdBufs { kv, ..bufs[rank] });
        }
        held = next;
    }
}

/// A ring of a backward pass: its members (ranks, in ring order) and, per member, the rank
/// that owns the travelling side of the block the member starts with (the member itself,
/// except in a double ring's later outer steps).
pub(super) struct BwdRing {
    pub members: Vec<usize>,
    pub owners: Vec<usize>,
}

impl BwdRing {
    /// A ring whose members start with their own blocks.
    pub fn own(members: &[usize]) -> BwdRing {
        BwdRing { members: members.to_vec(), owners: members.to_vec() }
    }
}

/// Backward rings of equal length on disjoint ranks, side by side; `own[r]` is rank r's own
/// shard and accumulators, and each member starts with `start[member]` (its own, or in a double
/// ring a block that came from elsewhere). Uses steps `step0 .. step0 + ring length`.
///
/// The gradient of a travelling block does not travel with it: a member computing with its own
/// block adds into its own accumulators; with another's it computes into a fresh buffer that
/// goes straight back to the block's owner (phase 1), which adds it after its next step's
/// compute. So no step waits for a neighbour's previous compute, only for inputs sent a step
/// ahead. A member's own block is cut by query rows into halves of equal work: the first runs
/// at the first step, beside the first transfer, the second at the last step after the visiting
/// block, beside the return of its partial, which would otherwise follow all compute. Every
/// ring's compute of a step is emitted before any partial of it is sent (an owner may be in
/// another ring).
pub(super) fn backward(
    b: &mut Builder,
    step0: usize,
    rings: &[BwdRing],
    start: &[BwdBufs],
    own: &[BwdBufs],
    name: &str,
) {
    let n = rings.first().map_or(0, |r| r.members.len());
    // What travels: the K/V side (gradients dK, dV) or the query side (Q, dO, LSE, D; dQ).
    let travelling = b.opts.ring_backward;
    let what = match travelling {
        RingBackward::KvCirculate => "kv",
        RingBackward::QCirculate => "q,dO,lse,D",
    };
    // held[ring][i]: the buffers member i computes with at this step.
    let mut held: Vec<Vec<BwdBufs>> = rings.iter().map(|g| g.members.iter().map(|&r| start[r]).collect()).collect();
    // Partials received in the previous step: (rank, received buffer, its accumulator there).
    let mut pending: Vec<(usize, BufId, BufId)> = Vec::new();
    // Second halves of own blocks, for the last step: (rank, block, its query rows).
    let mut own_rest: Vec<(usize, BwdBufs, Range<usize>)> = Vec::new();
    for t in 0..n {
        let step = step0 + t;
        b.label(step, step_label(name, t, what));
        let mut next = held.clone();
        if t + 1 < n {
            for (g, ring) in rings.iter().enumerate() {
                for (i, own_block) in held[g].iter().enumerate() {
                    let to = (i + 1) % n;
                    let (from_rank, to_rank) = (ring.members[i], ring.members[to]);
                    match travelling {
                        RingBackward::KvCirculate => {
                            next[g][to].kv = b.transfer_set(step, 0, from_rank, to_rank, own_block.kv)
                        }
                        RingBackward::QCirculate => {
                            next[g][to].query = b.transfer_set(step, 0, from_rank, to_rank, own_block.query)
                        }
                    }
                }
            }
        }
        // (computing rank, owner rank, partial gradient, the owner's accumulator)
        let mut partials = Vec::new();
        for (g, ring) in rings.iter().enumerate() {
            for (i, &block) in held[g].iter().enumerate() {
                let rank = ring.members[i];
                let owner = ring.owners[(i + n - t % n) % n];
                let mut block = block;
                if owner != rank {
                    if b.area(rank, block.query.q, block.kv.k) == 0 {
                        continue;
                    }
                    // The visiting side's gradients go into fresh buffers, sent back to its owner.
                    let owner_grads = own[owner].grads;
                    let mut partial = |acc: BufId| {
                        let desc = b.desc(owner, acc).clone();
                        let part = b.alloc(rank, step, desc, Fill::Zero);
                        partials.push((rank, owner, part, acc));
                        part
                    };
                    block.grads = match travelling {
                        RingBackward::KvCirculate => GradBufs { dkv: owner_grads.dkv.map(&mut partial), ..block.grads },
                        RingBackward::QCirculate => GradBufs { dq: partial(owner_grads.dq), ..block.grads },
                    };
                } else if n > 1 {
                    if let Some(cut) = b.half_area_rows(rank, block.query.q, block.kv.k) {
                        b.bwd_rows(rank, step, block, Some(0..cut));
                        let rows = b.desc(rank, block.query.q).tokens.len();
                        own_rest.push((rank, block, cut..rows));
                        continue;
                    }
                }
                b.bwd(rank, step, block);
            }
        }
        if t + 1 == n {
            for (rank, block, rows) in own_rest.drain(..) {
                b.bwd_rows(rank, step, block, Some(rows));
            }
        }
        // The previous step's partials, added after this step's compute (they had it to arrive).
        add_pending(b, step, &mut pending);
        for (rank, owner, part, acc) in partials {
            let got = b.transfer(step, 1, rank, owner, part);
            pending.push((owner, got, acc));
        }
        if t + 1 == n {
            add_pending(b, step, &mut pending);
        }
        held = next;
    }
}

/// Adds every pending (rank, received partial, accumulator) at `step` and empties the list.
fn add_pending(b: &mut Builder, step: usize, pending: &mut Vec<(usize, BufId, BufId)>) {
    for (rank, got, acc) in pending.drain(..) {
        b.push(rank, step, Op::Add { src: got, dst: acc });
    }
}

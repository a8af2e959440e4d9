//! Double ring (LoongTrain's 2D ring): the P ranks form P / I groups of I adjacent ranks (a
//! node's GPUs). For each of the P / I outer steps, every group runs an inner ring over the
//! blocks its ranks hold (I steps, fast links); meanwhile each rank sends the block it started
//! the inner ring with to the same rank of the next group (one transfer over the slow link per
//! outer step, under I steps of compute), which starts the next inner ring with it. A plain ring
//! crossing nodes waits on the slow link at every step; this one at P / I - 1 of them. Zig-zag
//! layout, so every (query block, key block) pair is the same causal work. In backward the
//! travelling side (K/V or the query side, `PlanOptions::ring_backward`) goes round both rings
//! and its gradient partials go straight back to its owner.

use super::builder::{Builder, BwdBufs, FwdBufs, PassBufs};
use super::ring::{self, BwdRing};
use super::zigzag;
use crate::plan::RingBackward;
use crate::Result;

/// The inner ring size picked when none is given: the ranks per node when they divide the
/// world (so inner rings stay inside nodes), else the smallest divisor of the world at least its
/// square root (a prime world: one inner ring of every rank, a plain ring).
pub fn default_inner_ring(world: usize, ranks_per_node: Option<usize>) -> usize {
    if let Some(n) = ranks_per_node.filter(|&n| n > 0 && n <= world && world.is_multiple_of(n)) {
        return n;
    }
    (1..=world).find(|&i| world.is_multiple_of(i) && i * i >= world).unwrap_or(world)
}

pub(super) fn plan(b: &mut Builder, inner: usize) -> Result<()> {
    let p = b.world;
    let inner = if inner == 0 { default_inner_ring(p, b.opts.ranks_per_node) } else { inner };
    if !p.is_multiple_of(inner) {
        return Err(b.unsupported(format!("inner ring size {inner} does not divide the world size {p}")));
    }
    let layout = zigzag::layout(b);
    let groups = p / inner;
    let members = |g: usize| -> Vec<usize> { (g * inner..(g + 1) * inner).collect() };
    let next = |r: usize| (r + inner) % p;
    match b.declare_pass(layout) {
        PassBufs::Forward(own) => {
            // start[r]: what rank r starts this outer step's inner ring with.
            let mut start: Vec<FwdBufs> = own.clone();
            for o in 0..groups {
                let step0 = o * inner;
                let mut arriving = start.clone();
                if o + 1 < groups {
                    for (r, held) in start.iter().enumerate() {
                        arriving[next(r)].kv = b.transfer_set(step0, 0, r, next(r), held.kv);
                    }
                }
                for g in 0..groups {
                    ring::forward(b, step0, &members(g), &start, &format!("double ring {o}"));
                }
                start = own.iter().zip(&arriving).map(|(mine, a)| FwdBufs { kv: a.kv, ..*mine }).collect();
            }
        }
        PassBufs::Backward(own) => {
            let travelling = b.opts.ring_backward;
            let mut start: Vec<BwdBufs> = own.clone();
            // owner[r]: whose travelling side rank r starts the outer step with.
            let mut owner: Vec<usize> = (0..p).collect();
            for o in 0..groups {
                let step0 = o * inner;
                let mut arriving = start.clone();
                if o + 1 < groups {
                    for (r, held) in start.iter().enumerate() {
                        let to = next(r);
                        match travelling {
                            RingBackward::KvCirculate => arriving[to].kv = b.transfer_set(step0, 0, r, to, held.kv),
                            RingBackward::QCirculate => {
                                arriving[to].query = b.transfer_set(step0, 0, r, to, held.query)
                            }
                        }
                    }
                }
                // All groups side by side: a partial may go back to a rank of another group.
                let rings: Vec<BwdRing> = (0..groups)
                    .map(|g| {
                        let m = members(g);
                        BwdRing { owners: m.iter().map(|&r| owner[r]).collect(), members: m }
                    })
                    .collect();
                ring::backward(b, step0, &rings, &start, &own, &format!("double ring {o}"));
                start = own
                    .iter()
                    .zip(&arriving)
                    .map(|(mine, a)| match travelling {
                        RingBackward::KvCirculate => BwdBufs { kv: a.kv, ..*mine },
                        RingBackward::QCirculate => BwdBufs { query: a.query, ..*mine },
                    })
                    .collect();
                owner = (0..p).map(|r| owner[(r + p - inner) % p]).collect();
            }
        }
    }
    Ok(())
}

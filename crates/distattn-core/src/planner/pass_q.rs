//! Pass-Q: queries travel to the keys (Infinite-LLM's DistAttention; the pass-Q ring of
//! context-parallel inference). K and V never move: they stay where the layout places them,
//! which for a KV cache spread over the ranks is where the cache lives. Step 0 is every rank's
//! own block. In step 1 every rank sends its queries to each rank holding keys they attend, in
//! one group; at step t a rank computes the queries of the rank t places before it against its
//! K/V into a partial (O, LSE) and sends it straight back (phase 1); the owner merges each
//! returned partial by LSE. All queries leave at once because a rank's comm lane runs in
//! order: a query send queued behind the return of step t − 1 would wait for that step's
//! compute elsewhere, and a decode step's P − 1 remote blocks would run one after another
//! instead of side by side. Small partials (a decode step's) all go back in one group at the
//! last step instead, which saves the host a group launch per step.
//!
//! Bytes moved per rank: its queries to each rank that needs them and an f32 O and LSE back,
//! against the K/V a ring would move: the cheaper side when few queries meet many keys
//! (decode, or a prompt's new tokens against a long cached prefix).
//!
//! Backward runs the ring backward over the same layout (the gradients of K/V go back to where
//! they live).

use super::builder::{Builder, FwdBufs, OutBufs, PassBufs};
use super::ring;
use crate::plan::{BufDesc, Fill, Layout, Op, Tensor};
use crate::Result;

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    let layout = b.opts.layout.clone().unwrap_or_else(|| Layout::contiguous(b.shape.q_len, b.shape.k_len, b.world));
    let members: Vec<usize> = (0..b.world).collect();
    match b.declare_pass(layout) {
        PassBufs::Forward(bufs) => forward(b, &bufs),
        PassBufs::Backward(bufs) => {
            ring::backward(b, 0, &[ring::BwdRing::own(&members)], &bufs, &bufs, "pass-q backward")
        }
    }
    Ok(())
}

/// Partials up to this size (an owner's f32 O) all go back in one group at the last step:
/// launching a group costs the host about 0.1 ms (4 × H200, NCCL 2.28: a decode step's three
/// returns took 0.12–0.14 ms each after their data was sent), more than such a transfer takes.
/// Larger ones go back as computed, overlapping the blocks after them.
const RETURN_TOGETHER_BYTES: usize = 16 << 20;

fn forward(b: &mut Builder, bufs: &[FwdBufs]) {
    let p = b.world;
    let s = b.shape;
    let largest = (0..p).map(|r| b.desc(r, bufs[r].q).tokens.len()).max().unwrap_or(0);
    let together = largest * s.batch * s.heads * s.head_dim * 4 <= RETURN_TOGETHER_BYTES;
    // (step, owner, partial as received by the owner)
    let mut returned = Vec::new();
    // (owner, rank that computed it, partial) not yet sent back.
    let mut computed = Vec::new();
    for t in 0..p {
        b.label(
            t,
            match t {
                0 => "pass-q 0: own keys".to_string(),
                1 => "pass-q 1: all out; from r-1".to_string(),
                _ => format!("pass-q {t}: queries from r-{t}"),
            },
        );
        // Every rank's compute of the step is emitted before the partials go back (phase 1),
        // so a rank's return group never precedes the block that fills it.
        for owner in 0..p {
            let at = (owner + t) % p;
            let own = bufs[owner];
            if t == 0 {
                b.fwd(owner, 0, own);
                continue;
            }
            // Only where the owner's queries attend any of `at`'s keys.
            let q_tokens = b.desc(owner, own.q).tokens.clone();
            let k_tokens = b.desc(at, bufs[at].kv.k).tokens.clone();
            if crate::plan::area(b.mask, &q_tokens, &k_tokens) == 0 {
                continue;
            }
            let q = b.transfer(1, 0, owner, at, own.q);
            let heads = b.all_heads(Tensor::O);
            let part = OutBufs {
                o: b.alloc(at, t, BufDesc::new(Tensor::O, q_tokens.clone(), heads.clone()), Fill::Zero),
                lse: b.alloc(at, t, BufDesc::new(Tensor::Lse, q_tokens, heads), Fill::NegInf),
            };
            b.fwd(at, t, FwdBufs { q, kv: bufs[at].kv, out: part });
            computed.push((owner, at, part));
        }
        if !together || t + 1 == p {
            for (owner, at, part) in computed.drain(..) {
                returned.push((t, owner, b.transfer_set(t, 1, at, owner, part)));
            }
        }
    }
    // Each partial is merged on its owner once received, after the step's own compute.
    for (t, owner, part) in returned {
        let acc = bufs[owner].out;
        b.push(owner, t, Op::Merge { o: part.o, lse: part.lse, o_acc: acc.o, lse_acc: acc.lse });
    }
}

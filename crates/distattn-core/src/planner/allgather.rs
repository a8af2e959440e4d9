//! All-gather: every rank gathers the K and V of the ranks whose keys its queries see, whole,
//! and computes its queries against them (zig-zag layout, document-aware as the zig-zag ring's,
//! so causal work is balanced). Backward gathers K and V again the same way and returns the
//! dK/dV partials to their owners (a reduce-scatter), who add them.
//!
//! [`compute_gathered`] runs such a gather for this planner and for dispatch: the K/V a rank
//! receives land in one buffer while the rank computes its queries against its own K/V, and
//! then its queries meet the gathered K/V in one block. Two kernels a rank, where computing
//! against each sender's K/V apart took P smaller ones, each with its own tail.

use super::builder::{BufSet, Builder, BwdBufs, FwdBufs, GradBufs, KvBufs, KvGradBufs, PassBufs};
use crate::plan::{area, BufDesc, Fill, Tensor, TokenSet, MAX_SENDS_TO_A_PEER};
use crate::Result;

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let layout = super::zigzag::layout(b);
    let bufs = b.declare_pass(layout);
    let tokens = |b: &Builder, r: usize, buf: usize| b.desc(r, buf).tokens.clone();
    let mut sends = Vec::new();
    for r in 0..p {
        let q = tokens(b, r, bufs.query(r));
        for s in (0..p).filter(|&s| s != r) {
            let k = tokens(b, s, bufs.kv(s).k);
            if area(b.mask, &q, &k) > 0 {
                sends.push(Send { owner: s, to: r, kv: bufs.kv(s), tokens: k });
            }
        }
    }
    compute_gathered(b, &bufs, &sends, "all-gather K,V");
    Ok(())
}

/// The most runs of tokens sent as pieces of their own between two ranks: a group sends two
/// buffers a run (K and V, or dK and dV), at most [`MAX_SENDS_TO_A_PEER`] a peer. Past it the
/// tokens go as one copied piece (a zig-zag rank cut inside each of 70 packed documents holds
/// 70–140 runs).
const MAX_RUNS_APART: usize = MAX_SENDS_TO_A_PEER / 2;

/// How `tokens` travel between two ranks: each run on its own (sent from inside the buffer
/// holding it, received into the one gathering it) up to [`MAX_RUNS_APART`] runs, else all
/// together.
fn send_units(tokens: &TokenSet) -> Vec<TokenSet> {
    let runs = tokens.to_runs();
    if runs.len() > MAX_RUNS_APART {
        return vec![tokens.clone()];
    }
    runs.into_iter().map(TokenSet::range).collect()
}

/// The `tokens` of rank `owner`'s K/V buffers `kv` (all of them, or a part) that it sends to
/// rank `to`.
pub(super) struct Send {
    pub owner: usize,
    pub to: usize,
    pub kv: KvBufs,
    pub tokens: TokenSet,
}

/// One step: every rank receives the K/V of `sends` addressed to it into one buffer pair (phase
/// 0) while it computes its queries against its own K/V, then computes them against the
/// gathered K/V. Backward computes that block into zeroed dK/dV partials and returns each
/// sender's part to it (phase 1), where it is added, while the second half of the rank's own
/// block runs. `what` names the gather. A piece is one run of tokens (up to
/// [`MAX_RUNS_APART`] a peer pair), sent from inside the buffer that holds it and received
/// into the buffer that gathers it where both allow (no copies; see
/// [`Builder::part_to_send`]).
pub(super) fn compute_gathered(b: &mut Builder, bufs: &PassBufs, sends: &[Send], what: &str) {
    let p = b.world;
    b.label(0, format!("{what} + compute"));
    let gathered: Vec<Option<KvBufs>> = (0..p)
        .map(|r| {
            let mine: Vec<&Send> = sends.iter().filter(|x| x.to == r).collect();
            (!mine.is_empty()).then(|| {
                let tokens = TokenSet::union(mine.iter().map(|x| &x.tokens));
                let heads = b.all_heads(Tensor::K);
                let mut alloc = |t| b.alloc(r, 0, BufDesc::new(t, tokens.clone(), heads.clone()), Fill::Overwritten);
                KvBufs { k: alloc(Tensor::K), v: alloc(Tensor::V) }
            })
        })
        .collect();
    // The pieces first (copies, where a piece cannot be sent from inside its buffer, precede
    // the group that sends them), then the transfers, then the blocks: each rank posts its
    // groups in (step, phase) order.
    let mut pieces = Vec::new();
    for x in sends {
        let Some(into) = gathered[x.to] else { continue };
        for tokens in send_units(&x.tokens) {
            let part = x.kv.map(|src| b.part_to_send(x.owner, 0, src, tokens.clone()));
            pieces.push((x.owner, x.to, part, into));
        }
    }
    for (owner, to, part, into) in pieces {
        b.transfer_gathered(0, 0, owner, to, part.k, into.k);
        b.transfer_gathered(0, 0, owner, to, part.v, into.v);
    }
    match bufs {
        PassBufs::Forward(own) => {
            for (r, x) in own.iter().enumerate() {
                b.fwd(r, 0, *x);
                if let Some(kv) = gathered[r] {
                    b.fwd(r, 0, FwdBufs { kv, ..*x });
                }
            }
        }
        PassBufs::Backward(own) => {
            // Every rank's blocks and the parts it returns are issued before any transfer that
            // sends them (a transfer waits for the op that wrote what it sends). The own block
            // is cut in two by query rows around the gathered one: its first half runs under
            // the gather, its second under the return of the partials.
            let mut parts = Vec::new();
            for (r, x) in own.iter().enumerate() {
                let Some(kv) = gathered[r] else {
                    b.bwd(r, 0, *x);
                    continue;
                };
                let cut = b.half_area_rows(r, x.query.q, x.kv.k);
                b.bwd_rows(r, 0, *x, cut.map(|c| 0..c));
                let dkv = b.kv_grad_partials(r, 0, kv);
                b.bwd(r, 0, BwdBufs { kv, grads: GradBufs { dkv, ..x.grads }, ..*x });
                for y in sends.iter().filter(|y| y.to == r) {
                    for tokens in send_units(&y.tokens) {
                        let part = dkv.map(|g| b.part_to_send(r, 0, g, tokens.clone()));
                        parts.push((r, y.owner, part));
                    }
                }
                if let Some(c) = cut {
                    b.bwd_rows(r, 0, *x, Some(c..b.desc(r, x.query.q).tokens.len()));
                }
            }
            let got: Vec<(usize, KvGradBufs)> =
                parts.into_iter().map(|(r, owner, part)| (owner, b.transfer_set(0, 1, r, owner, part))).collect();
            for (owner, part) in got {
                b.add_set(owner, 0, part, own[owner].grads.dkv);
            }
        }
    }
}

//! Mask-aware dispatch (MagiAttention-style). The query sequence is cut into chunks whose kept
//! area is known in closed form; a greedy solver puts the largest remaining chunk on the least
//! loaded rank (ties: fewer tokens, then lower rank), so every rank gets about the same
//! *unmasked area*. For self-attention each token's K/V live with its query. Then every K/V
//! chunk is sent only to the ranks whose queries keep a pair in it ("group-cast", one grouped
//! transfer of every (owner, needer) pair's chunks) — no redundant bytes — and backward returns
//! the dK/dV partials the same way ("group-reduce"). The chunks a rank receives are computed
//! as one block (`allgather::compute_gathered`).

use super::allgather::{compute_gathered, Send};
use super::builder::Builder;
use crate::plan::{area, split_even, Layout, LayoutKind, TokenSet};
use crate::{AttnShape, Error, Mask, Result};
use std::ops::Range;

/// Default chunk size: about 16 chunks per rank.
fn default_chunk(n: usize, world: usize) -> usize {
    n.div_ceil(16 * world).max(1)
}

fn chunks(n: usize, c: usize) -> Vec<Range<usize>> {
    (0..n.div_ceil(c)).map(|i| i * c..((i + 1) * c).min(n)).collect()
}

/// Slack of the greedy solver: a chunk may go to a rank up to this fraction of the mean
/// per-rank area above the least-loaded one, if that rank already holds K/V the chunk needs.
const SLACK: f64 = 0.04;
/// A candidate layout is acceptable if its area imbalance is at most this…
const MAX_IMBALANCE: f64 = 1.05;
/// …and no rank holds more than this many times the mean token count (memory).
const MAX_TOKENS: f64 = 2.0;

/// K/V tokens (on the chunk grid) that each rank's queries keep a pair with.
fn needed(mask: &Mask, q: &[TokenSet], c: usize) -> Vec<TokenSet> {
    q.iter()
        .map(|set| {
            TokenSet::from_runs(
                set.to_runs().into_iter().flat_map(|run| mask.key_tiles(run, c)).map(|(k, _)| k).collect(),
            )
        })
        .collect()
}

/// (area imbalance, max tokens / mean tokens, K/V tokens received) of a self-attention layout.
fn score(mask: &Mask, q: &[TokenSet], c: usize) -> (f64, f64, usize) {
    let p = q.len() as f64;
    let full = TokenSet::range(0..mask.k_len());
    let loads: Vec<u64> = q.iter().map(|s| area(mask, s, &full)).collect();
    let mean = loads.iter().sum::<u64>() as f64 / p;
    let imb = if mean > 0.0 { *loads.iter().max().unwrap_or(&0) as f64 / mean } else { 1.0 };
    let tokens = q.iter().map(|s| s.len()).max().unwrap_or(0) as f64 / (mask.q_len() as f64 / p);
    let bytes = needed(mask, q, c).iter().zip(q).map(|(n, own)| n.len() - n.intersect(own).len()).sum();
    (imb, tokens, bytes)
}

/// Greedy candidate: chunks largest-area-first onto the least-loaded rank, or onto a rank
/// within the slack that already holds most of the K/V the chunk needs.
fn greedy(mask: &Mask, world: usize, c: usize, self_attn: bool) -> Vec<TokenSet> {
    let qc = chunks(mask.q_len(), c);
    let areas: Vec<u64> = qc.iter().map(|r| mask.tile(r.clone(), 0..mask.k_len()).area).collect();
    let total: u64 = areas.iter().sum();
    let slack = (SLACK * total as f64 / world as f64) as u64;
    let needs: Vec<Vec<usize>> = if self_attn {
        qc.iter().map(|r| mask.key_tiles(r.clone(), c).into_iter().map(|(k, _)| k.start / c).collect()).collect()
    } else {
        vec![Vec::new(); qc.len()]
    };
    let mut order: Vec<usize> = (0..qc.len()).collect();
    order.sort_by(|&a, &b| areas[b].cmp(&areas[a]).then(a.cmp(&b)));
    let mut load = vec![(0u64, 0usize); world];
    let mut owner: Vec<Option<usize>> = vec![None; qc.len()];
    let mut runs: Vec<Vec<Range<usize>>> = vec![Vec::new(); world];
    for i in order {
        let least = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        let mut best = least;
        if self_attn && slack > 0 {
            let mut held = vec![0usize; world];
            for &j in &needs[i] {
                if let Some(r) = owner[j] {
                    held[r] += qc[j].len();
                }
            }
            best = (0..world)
                .filter(|&r| load[r].0 <= load[least].0 + slack)
                .max_by_key(|&r| (held[r], std::cmp::Reverse((load[r], r))))
                .unwrap_or(least);
        }
        load[best].0 += areas[i];
        load[best].1 += qc[i].len();
        owner[i] = Some(best);
        runs[best].push(qc[i].clone());
    }
    runs.into_iter().map(TokenSet::from_runs).collect()
}

/// Contiguous candidate: one range per rank, cut at the tokens that split the kept area
/// evenly (maximal locality: a rank only receives K/V of documents crossing its start).
fn contiguous_by_area(mask: &Mask, world: usize) -> Vec<TokenSet> {
    let (n, k) = (mask.q_len(), mask.k_len());
    let total = mask.area();
    let mut cuts = vec![0usize];
    for r in 1..world {
        let target = (total as u128 * r as u128 / world as u128) as u64;
        let (mut lo, mut hi) = (*cuts.last().unwrap_or(&0), n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if mask.tile(0..mid, 0..k).area < target {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        cuts.push(lo);
    }
    cuts.push(n);
    cuts.windows(2).map(|w| TokenSet::range(w[0]..w[1])).collect()
}

/// The dispatch solver's layout. Query chunks of `chunk` tokens (default about 16 per rank);
/// two candidates — the greedy largest-first assignment and the area-balanced contiguous cut
/// — and the one that receives the fewest K/V tokens among those with area imbalance ≤ 1.05
/// and at most twice the mean tokens on any rank (else the greedy one). For self-attention
/// each token's K/V live with its query.
pub fn dispatch_layout(world: usize, shape: &AttnShape, mask: &Mask, chunk: Option<usize>) -> Layout {
    let c = chunk.unwrap_or_else(|| default_chunk(shape.q_len, world)).max(1);
    let self_attn = shape.q_len == shape.k_len;
    let mut q = greedy(mask, world, c, self_attn);
    if self_attn && world > 1 {
        let (gi, gt, gb) = score(mask, &q, c);
        let cont = contiguous_by_area(mask, world);
        let (ci, ct, cb) = score(mask, &cont, c);
        let ok = |i: f64, t: f64| i <= MAX_IMBALANCE && t <= MAX_TOKENS;
        if ok(ci, ct) && (!ok(gi, gt) || cb < gb) {
            q = cont;
        }
    }
    let k =
        if self_attn { q.clone() } else { split_even(shape.k_len, world).into_iter().map(TokenSet::range).collect() };
    Layout { kind: LayoutKind::Dispatched, q, k }
}

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let layout = dispatch_layout(p, &b.shape, b.mask, b.opts.chunk_tokens);
    let c = b.opts.chunk_tokens.unwrap_or_else(|| default_chunk(b.shape.q_len, p)).max(1);
    // Chunks so large that some rank gets none leave it without a token (as a world larger
    // than the sequence would): a mistake, not a plan.
    if let Some(r) = layout.q.iter().position(|s| s.is_empty()) {
        if b.shape.q_len < p {
            return Err(Error::Unsupported {
                strategy: "dispatch".into(),
                reason: format!("{} query tokens for {p} ranks: it deals every rank queries", b.shape.q_len),
            });
        }
        return Err(Error::invalid(
            "chunk_tokens",
            format!("chunks of {c} tokens leave rank {r} of {p} without queries ({} tokens)", b.shape.q_len),
        ));
    }
    let (q_sets, k_sets) = (layout.q.clone(), layout.k.clone());
    let bufs = b.declare_pass(layout);
    // Each owner s sends rank r the chunks of its K/V that r's queries keep a pair with.
    let mut sends = Vec::new();
    for (s, k_set) in k_sets.iter().enumerate() {
        let kchunks: Vec<Range<usize>> = k_set
            .to_runs()
            .into_iter()
            .flat_map(|run| chunks(run.len(), c).into_iter().map(move |x| run.start + x.start..run.start + x.end))
            .collect();
        for r in (0..p).filter(|&r| r != s) {
            let needed: Vec<Range<usize>> = kchunks
                .iter()
                .filter(|ch| area(b.mask, &q_sets[r], &TokenSet::range((*ch).clone())) > 0)
                .cloned()
                .collect();
            if needed.is_empty() {
                continue;
            }
            sends.push(Send { owner: s, to: r, kv: bufs.kv(s), tokens: TokenSet::from_runs(needed) });
        }
    }
    compute_gathered(b, &bufs, &sends, "group-cast K,V");
    Ok(())
}

//! Mask-aware dispatch (MagiAttention-style). The query sequence is cut into chunks whose kept
//! area is known in closed form; a greedy solver puts the largest remaining chunk on the least
//! loaded rank (ties: fewer tokens, then lower rank), so every rank gets about the same
//! *unmasked area*. For self-attention each token's K/V live with its query. Then every K/V
//! chunk is sent only to the ranks whose queries keep a pair in it ("group-cast", one grouped
//! send per (owner, needer) pair) — no redundant bytes — and backward returns the dK/dV partials
//! the same way ("group-reduce").

use crate::plan::{area, split_even, BufDesc, Builder, Layout, LayoutKind, Op, Pass, Tensor, TokenSet};
use crate::{AttnShape, Mask, Result};
use std::ops::Range;

/// Default chunk size: about 16 chunks per rank.
fn default_chunk(n: usize, world: usize) -> usize {
    n.div_ceil(16 * world).max(1)
}

fn chunks(n: usize, c: usize) -> Vec<Range<usize>> {
    (0..n.div_ceil(c)).map(|i| i * c..((i + 1) * c).min(n)).collect()
}

/// The dispatch solver's layout: query chunks of `chunk` tokens (default about 16 per rank)
/// assigned largest-area-first to the least-loaded rank.
pub fn dispatch_layout(world: usize, shape: &AttnShape, mask: &Mask, chunk: Option<usize>) -> Layout {
    let c = chunk.unwrap_or_else(|| default_chunk(shape.q_len, world)).max(1);
    let qc = chunks(shape.q_len, c);
    let mut order: Vec<(u64, usize)> = qc.iter().enumerate().map(|(i, r)| (mask.tile(r.clone(), 0..shape.k_len).area, i)).collect();
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut load = vec![(0u64, 0usize); world];
    let mut runs: Vec<Vec<Range<usize>>> = vec![Vec::new(); world];
    for (a, i) in order {
        let r = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r].0 += a;
        load[r].1 += qc[i].len();
        runs[r].push(qc[i].clone());
    }
    let q: Vec<TokenSet> = runs.into_iter().map(TokenSet::from_runs).collect();
    let k = if shape.q_len == shape.k_len {
        q.clone()
    } else {
        split_even(shape.k_len, world).into_iter().map(TokenSet::range).collect()
    };
    Layout { kind: LayoutKind::Dispatched, q, k }
}

pub(crate) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let layout = dispatch_layout(p, &b.shape, b.mask, b.opts.chunk_tokens);
    let c = b.opts.chunk_tokens.unwrap_or_else(|| default_chunk(b.shape.q_len, p)).max(1);
    let (q_sets, k_sets) = (layout.q.clone(), layout.k.clone());
    let inputs = b.pass_inputs(layout);
    let outputs = b.pass_outputs();
    let fwd = b.pass() == Pass::Forward;
    let kvh = b.all_heads(true);
    b.label(0, "group-cast K,V + compute");
    // need[s][r]: tokens of rank s's K/V that rank r's queries keep a pair with.
    let mut sends = Vec::new();
    for s in 0..p {
        let kchunks: Vec<Range<usize>> = k_sets[s]
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
            let tokens = TokenSet::from_runs(needed);
            let (k, v) = if tokens == k_sets[s] {
                (inputs[s][1], inputs[s][2])
            } else {
                (b.extract(s, 0, inputs[s][1], tokens.clone(), kvh.clone()), b.extract(s, 0, inputs[s][2], tokens, kvh.clone()))
            };
            sends.push((s, r, k, v));
        }
    }
    let mut recv = vec![Vec::new(); p];
    for &(s, r, k, v) in &sends {
        let gk = b.transfer(0, 0, s, r, k);
        let gv = b.transfer(0, 0, s, r, v);
        recv[r].push((s, gk, gv));
    }
    let mut back = Vec::new();
    for r in 0..p {
        let i = inputs[r].clone();
        let o = outputs[r].clone();
        let mut blocks = vec![(r, i[1], i[2])];
        blocks.extend(recv[r].iter().copied());
        for (s, k, v) in blocks {
            if fwd {
                b.fwd(r, 0, i[0], k, v, o[0], o[1]);
            } else if s == r {
                b.bwd(r, 0, [i[0], k, v, i[3], i[4], i[5]], o[0], o[1], o[2]);
            } else {
                let d = b.desc(r, k).clone();
                let dk = b.alloc(r, 0, BufDesc::new(Tensor::DK, d.tokens.clone(), d.heads.clone()), 0.0);
                let dv = b.alloc(r, 0, BufDesc::new(Tensor::DV, d.tokens, d.heads), 0.0);
                b.bwd(r, 0, [i[0], k, v, i[3], i[4], i[5]], o[0], dk, dv);
                back.push((r, s, dk, dv));
            }
        }
    }
    let mut adds = Vec::new();
    for (r, s, dk, dv) in back {
        let gk = b.transfer(0, 1, r, s, dk);
        let gv = b.transfer(0, 1, r, s, dv);
        adds.push((s, gk, outputs[s][1]));
        adds.push((s, gv, outputs[s][2]));
    }
    for (s, src, dst) in adds {
        b.push(s, 0, Op::Add { src, dst });
    }
    Ok(())
}

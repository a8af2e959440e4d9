//! USP / 2D attention: P = U × R. Ranks form R groups of U adjacent ranks. Inside a group an
//! all-to-all turns sequence sharding into head sharding (rank u of the group gets the group's
//! tokens for heads slice u); across groups, the ranks with the same head slice run a ring
//! over the groups' token sets; a final all-to-all inside the group returns outputs to
//! sequence sharding. The layout is zig-zag over the R groups (balanced causal rings), each
//! group's two chunks split evenly among its U ranks. U = P is Ulysses; U = 1 is zig-zag ring.

use super::builder::{accumulator_fill, Builder, PassBufs};
use super::ring;
use crate::plan::{BufDesc, BufId, Fill, Layout, Op, Tensor, TokenSet};
use crate::{AttnShape, Result};
use std::ops::Range;

/// The Ulysses degree U picked when none is given: the largest proper divisor of `world` that
/// divides both head counts (1 if none), the ring part then spanning P / U groups. Given the
/// ranks per node, U also divides them, so every all-to-all stays inside a node (fast links)
/// and only the ring crosses nodes.
pub fn default_ulysses_degree(world: usize, shape: &AttnShape, ranks_per_node: Option<usize>) -> usize {
    let within = ranks_per_node.filter(|&n| n > 0 && n < world && world.is_multiple_of(n));
    (1..world)
        .rev()
        .find(|&u| {
            world.is_multiple_of(u)
                && shape.heads.is_multiple_of(u)
                && shape.kv_heads.is_multiple_of(u)
                && within.is_none_or(|n| n.is_multiple_of(u))
        })
        .unwrap_or(1)
}

fn head_slice(n: usize, parts: usize, u: usize) -> Range<usize> {
    u * n / parts..(u + 1) * n / parts
}

pub(super) fn plan(b: &mut Builder, degree: usize) -> Result<()> {
    let p = b.world;
    let u_deg = if degree == 0 { default_ulysses_degree(p, &b.shape, b.opts.ranks_per_node) } else { degree };
    if !p.is_multiple_of(u_deg) {
        return Err(b.unsupported(format!("Ulysses degree {u_deg} does not divide the world size {p}")));
    }
    let layout = if u_deg == p {
        Layout::contiguous(b.shape.q_len, b.shape.k_len, p)
    } else {
        Layout::grouped_zigzag(b.shape.q_len, b.shape.k_len, p / u_deg, u_deg)
    };
    grouped(b, u_deg, layout)
}

/// Ulysses inside groups of `u_deg` ranks and a ring across the groups, on `layout`.
pub(super) fn grouped(b: &mut Builder, u_deg: usize, layout: Layout) -> Result<()> {
    let p = b.world;
    let (h, kvh) = (b.shape.heads, b.shape.kv_heads);
    if !h.is_multiple_of(u_deg) || !kvh.is_multiple_of(u_deg) {
        return Err(b.unsupported(format!(
            "heads ({h}) and kv heads ({kvh}) must both be divisible by the Ulysses degree {u_deg}"
        )));
    }
    let r_deg = p / u_deg;
    let bufs = b.declare_pass(layout.clone());
    let group = |r: usize| (r / u_deg, r % u_deg);
    let members = |g: usize| g * u_deg..(g + 1) * u_deg;
    let heads_of = |t: Tensor, u: usize| if t.is_kv() { head_slice(kvh, u_deg, u) } else { head_slice(h, u_deg, u) };
    let group_tokens = |g: usize, t: Tensor| TokenSet::union(members(g).map(|r| layout.tokens(t, r)));

    // Step 0: all-to-all inside each group (sequence → heads).
    b.label(0, format!("all-to-all in groups of {u_deg}"));
    // pieces[r]: (tensor, buffer on rank r holding part of it for r's head slice), own parts first.
    let mut pieces: Vec<Vec<(Tensor, BufId)>> = vec![Vec::new(); p];
    let mut sends = Vec::new();
    for (a, on_a) in pieces.iter_mut().enumerate() {
        let (g, _) = group(a);
        for dst in members(g) {
            let (_, ub) = group(dst);
            for (t, src) in bufs.inputs(a) {
                if dst == a {
                    on_a.push((t, src));
                } else {
                    let tokens = b.desc(a, src).tokens.clone();
                    let x = b.extract(a, 0, src, tokens, heads_of(t, ub));
                    sends.push((a, dst, t, x));
                }
            }
        }
    }
    for (a, dst, t, x) in sends {
        let got = b.transfer(0, 0, a, dst, x);
        pieces[dst].push((t, got));
    }
    // The group-wide, head-sliced inputs (assembled from the pieces) and accumulators.
    let sliced = if u_deg == 1 {
        bufs.clone()
    } else {
        let gathered = bufs.map_inputs(|r, t, _| {
            let (g, u) = group(r);
            let dst = b.alloc(r, 0, BufDesc::new(t, group_tokens(g, t), heads_of(t, u)), Fill::Zero);
            for &(_, src) in pieces[r].iter().filter(|piece| piece.0 == t) {
                b.push(r, 0, Op::Copy { src, dst });
            }
            dst
        });
        gathered.map_outputs(|r, t, _| {
            let (g, u) = group(r);
            b.alloc(r, 0, BufDesc::new(t, group_tokens(g, t), heads_of(t, u)), accumulator_fill(t))
        })
    };
    // Steps 1..=R: rings across groups, one per head slice.
    for u in 0..u_deg {
        let ring_members: Vec<usize> = (0..r_deg).map(|g| g * u_deg + u).collect();
        let name = if r_deg == 1 { "local".to_string() } else { format!("ring/{u}") };
        match &sliced {
            PassBufs::Forward(own) => ring::forward(b, 1, &ring_members, own, &name),
            PassBufs::Backward(own) => ring::backward(b, 1, &[ring::BwdRing::own(&ring_members)], own, own, &name),
        }
    }
    if u_deg == 1 {
        return Ok(());
    }
    // Step R+1: all-to-all back (heads → sequence).
    let last = r_deg + 1;
    b.label(last, "all-to-all back");
    // (source rank, destination rank, part of an accumulator on the source, output on the
    // destination); every extract of the step comes before its transfers.
    let mut back = Vec::new();
    for src_rank in 0..p {
        let (g, _) = group(src_rank);
        for dst in members(g) {
            for ((t, acc), (_, out)) in sliced.outputs(src_rank).into_iter().zip(bufs.outputs(dst)) {
                let part = if dst == src_rank {
                    acc
                } else {
                    let heads = b.desc(src_rank, acc).heads.clone();
                    b.extract(src_rank, last, acc, layout.tokens(t, dst).clone(), heads)
                };
                back.push((src_rank, dst, part, out));
            }
        }
    }
    let mut copies = Vec::new();
    for (src_rank, dst, part, out) in back {
        let got = if dst == src_rank { part } else { b.transfer(last, 0, src_rank, dst, part) };
        copies.push((dst, got, out));
    }
    for (r, src, dst) in copies {
        b.push(r, last, Op::Copy { src, dst });
    }
    Ok(())
}

//! USP / 2D attention: P = U × R. Ranks form R groups of U adjacent ranks. Inside a group an
//! all-to-all turns sequence sharding into head sharding (rank u of the group gets the group's
//! tokens for heads slice u); across groups, the ranks with the same head slice run a ring
//! over the groups' token sets; a final all-to-all inside the group returns outputs to
//! sequence sharding. The layout is zig-zag over the R groups (balanced causal rings), each
//! group's two chunks split evenly among its U ranks. U = P is Ulysses; U = 1 is zig-zag ring.

use super::builder::Builder;
use super::ring;
use crate::plan::{BufDesc, BufId, Fill, Layout, Pass, Tensor, TokenSet};
use crate::{AttnShape, Result};
use std::ops::Range;

/// The largest proper divisor U of `world` that divides both head counts (1 if none); the
/// ring part then spans P / U groups.
pub fn default_ulysses_degree(world: usize, shape: &AttnShape) -> usize {
    (1..world).rev().find(|&u| world % u == 0 && shape.heads % u == 0 && shape.kv_heads % u == 0).unwrap_or(1)
}

fn head_slice(n: usize, parts: usize, u: usize) -> Range<usize> {
    u * n / parts..(u + 1) * n / parts
}

pub(crate) fn plan(b: &mut Builder, degree: usize) -> Result<()> {
    let p = b.world;
    let u_deg = if degree == 0 { default_ulysses_degree(p, &b.shape) } else { degree };
    if p % u_deg != 0 {
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
pub(crate) fn grouped(b: &mut Builder, u_deg: usize, layout: Layout) -> Result<()> {
    let p = b.world;
    let (h, kvh) = (b.shape.heads, b.shape.kv_heads);
    if h % u_deg != 0 || kvh % u_deg != 0 {
        return Err(b.unsupported(format!(
            "heads ({h}) and kv heads ({kvh}) must both be divisible by the Ulysses degree {u_deg}"
        )));
    }
    let r_deg = p / u_deg;
    let fwd = b.pass() == Pass::Forward;
    let q_sets = layout.q.clone();
    let k_sets = layout.k.clone();
    let inputs = b.pass_inputs(layout);
    let outputs = b.pass_outputs();
    let tensors: Vec<Tensor> = if fwd {
        vec![Tensor::Q, Tensor::K, Tensor::V]
    } else {
        vec![Tensor::Q, Tensor::K, Tensor::V, Tensor::DO, Tensor::Lse, Tensor::Delta]
    };
    let group = |r: usize| (r / u_deg, r % u_deg);
    let members = |g: usize| (g * u_deg..(g + 1) * u_deg).collect::<Vec<_>>();
    let heads_of = |t: Tensor, u: usize| if t.is_kv() { head_slice(kvh, u_deg, u) } else { head_slice(h, u_deg, u) };
    let group_tokens = |g: usize, kv: bool| {
        let sets = if kv { &k_sets } else { &q_sets };
        TokenSet::union(members(g).iter().map(|&r| &sets[r]))
    };

    // Step 0: all-to-all inside each group (sequence → heads).
    b.label(0, format!("all-to-all in groups of {u_deg}"));
    // pieces[b][ti] = buffers on rank b holding parts of tensor ti (own part included).
    let mut pieces: Vec<Vec<Vec<BufId>>> = vec![vec![Vec::new(); tensors.len()]; p];
    let mut sends = Vec::new();
    for a in 0..p {
        let (g, _) = group(a);
        for &dst in &members(g) {
            let (_, ub) = group(dst);
            for (ti, &t) in tensors.iter().enumerate() {
                let src = inputs[a][ti];
                if dst == a {
                    pieces[a][ti].push(src);
                } else {
                    let tokens = b.desc(a, src).tokens.clone();
                    let x = b.extract(a, 0, src, tokens, heads_of(t, ub));
                    sends.push((a, dst, ti, x));
                }
            }
        }
    }
    for (a, dst, ti, x) in sends {
        let got = b.transfer(0, 0, a, dst, x);
        pieces[dst][ti].push(got);
    }
    // Assemble the group-wide, head-sliced buffers.
    let mut gathered: Vec<Vec<BufId>> = Vec::new();
    for r in 0..p {
        let (g, u) = group(r);
        let mut row = Vec::new();
        for (ti, &t) in tensors.iter().enumerate() {
            if u_deg == 1 {
                row.push(inputs[r][ti]);
                continue;
            }
            let d = BufDesc::new(t, group_tokens(g, t.is_kv()), heads_of(t, u));
            let dst = b.alloc(r, 0, d, Fill::Zero);
            for &src in &pieces[r][ti] {
                b.push(r, 0, crate::plan::Op::Copy { src, dst });
            }
            row.push(dst);
        }
        gathered.push(row);
    }
    // Group-wide accumulators.
    let acc_tensors: Vec<(Tensor, Fill)> = if fwd {
        vec![(Tensor::O, Fill::Zero), (Tensor::Lse, Fill::NegInf)]
    } else {
        vec![(Tensor::DQ, Fill::Zero), (Tensor::DK, Fill::Zero), (Tensor::DV, Fill::Zero)]
    };
    let mut accs: Vec<Vec<BufId>> = Vec::new();
    for r in 0..p {
        let (g, u) = group(r);
        if u_deg == 1 {
            accs.push(outputs[r].clone());
            continue;
        }
        let row = acc_tensors
            .iter()
            .map(|&(t, fill)| b.alloc(r, 0, BufDesc::new(t, group_tokens(g, t.is_kv()), heads_of(t, u)), fill))
            .collect();
        accs.push(row);
    }
    // Steps 1..=R: rings across groups, one per head slice.
    for u in 0..u_deg {
        let ring_members: Vec<usize> = (0..r_deg).map(|g| g * u_deg + u).collect();
        let name = if r_deg == 1 { "local".to_string() } else { format!("ring/{u}") };
        if fwd {
            let bufs: Vec<[BufId; 5]> = ring_members
                .iter()
                .map(|&r| [gathered[r][0], gathered[r][1], gathered[r][2], accs[r][0], accs[r][1]])
                .collect();
            ring::forward(b, 1, &ring_members, &bufs, &name);
        } else {
            let bufs: Vec<[BufId; 9]> = ring_members
                .iter()
                .map(|&r| {
                    let (x, a) = (&gathered[r], &accs[r]);
                    [x[0], x[1], x[2], x[3], x[4], x[5], a[0], a[1], a[2]]
                })
                .collect();
            ring::backward(b, 1, &ring_members, &bufs, &name);
        }
    }
    if u_deg == 1 {
        return Ok(());
    }
    // Step R+1: all-to-all back (heads → sequence).
    let last = r_deg + 1;
    b.label(last, "all-to-all back");
    let mut back = Vec::new();
    for src_rank in 0..p {
        let (g, _) = group(src_rank);
        for &dst in &members(g) {
            for (ai, &(t, _)) in acc_tensors.iter().enumerate() {
                let acc = accs[src_rank][ai];
                if dst == src_rank {
                    back.push((dst, acc, outputs[dst][ai], false));
                } else {
                    let tokens = if t.is_kv() { k_sets[dst].clone() } else { q_sets[dst].clone() };
                    let heads = b.desc(src_rank, acc).heads.clone();
                    let x = b.extract(src_rank, last, acc, tokens, heads);
                    back.push((src_rank, x, outputs[dst][ai], true));
                }
            }
        }
    }
    // Transfers after every extract of the step.
    let mut copies = Vec::new();
    let mut k = 0;
    for src_rank in 0..p {
        let (g, _) = group(src_rank);
        for &dst in &members(g) {
            for _ in 0..acc_tensors.len() {
                let (_, buf, out, remote) = back[k];
                k += 1;
                if remote {
                    let got = b.transfer(last, 0, src_rank, dst, buf);
                    copies.push((dst, got, out));
                } else {
                    copies.push((dst, buf, out));
                }
            }
        }
    }
    for (r, src, dst) in copies {
        b.push(r, last, crate::plan::Op::Copy { src, dst });
    }
    Ok(())
}

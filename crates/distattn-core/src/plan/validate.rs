//! Structural checks of a plan.

use super::{BufDesc, BufId, Fill, Op, Plan, RankProgram, Tensor, TokenSet};
use crate::{Error, Result};
use std::collections::HashMap;
use std::ops::Range;

/// The most buffers one transfer group sends to one peer. On 4 H200s an NCCL group of about
/// 280 sends a peer pair never completed (the watchdog aborted it after 120 s); groups of a few
/// a pair run.
pub const MAX_SENDS_TO_A_PEER: usize = 16;

impl Plan {
    /// Checks structural invariants: a valid shape, one program per rank, every buffer an op
    /// uses is in its rank's table, sends and receives match (the same tensor part), no group
    /// sends one peer more than [`MAX_SENDS_TO_A_PEER`] buffers, compute blocks are consistent
    /// with the shapes. A plan may come from a file, so a broken one is an
    /// [`Error::InvalidPlan`], never a panic.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Error::InvalidPlan(format!("{}: {m}", self.strategy));
        if self.ranks.len() != self.world {
            return Err(bad(format!("{} rank programs for a world of {}", self.ranks.len(), self.world)));
        }
        self.shape.validate().map_err(|e| bad(e.to_string()))?;
        let g = self.shape.group();
        for (r, prog) in self.ranks.iter().enumerate() {
            if prog.steps.len() != self.steps() {
                return Err(bad(format!("rank {r} has {} steps, expected {}", prog.steps.len(), self.steps())));
            }
            for op in prog.steps.iter().flatten() {
                for b in op.uses() {
                    if b >= prog.bufs.len() {
                        return Err(bad(format!("rank {r} uses undefined buffer {b}")));
                    }
                }
                match op {
                    Op::Fwd { q, k, v, .. } | Op::Bwd { q, k, v, .. } => {
                        let (q, k, v) = (&prog.bufs[*q], &prog.bufs[*k], &prog.bufs[*v]);
                        if k.tokens != v.tokens
                            || k.heads != v.heads
                            || q.heads.start != k.heads.start * g
                            || q.heads.len() != k.heads.len() * g
                        {
                            return Err(bad(format!("rank {r}: inconsistent block {q:?} × {k:?}")));
                        }
                        if let Op::Bwd { rows: Some(rows), .. } = op {
                            if rows.start >= rows.end || rows.end > q.tokens.len() {
                                return Err(bad(format!(
                                    "rank {r}: query rows {rows:?} of a block of {} rows",
                                    q.tokens.len()
                                )));
                            }
                        }
                        if let Op::Fwd { q, o, rounded: Some(y), .. } = op {
                            let (q, o, y) = (&prog.bufs[*q], &prog.bufs[*o], &prog.bufs[*y]);
                            if !q.same_region(o) || !y.same_region(o) || !y.narrow || y.tensor != Tensor::O {
                                return Err(bad(format!(
                                    "rank {r}: a block rounds its O into {y:?}, not its rows' O held narrowed"
                                )));
                            }
                        }
                    }
                    Op::Comm { phase, sends, .. } => {
                        if let Some(to) =
                            (0..self.world).find(|&to| sends.iter().filter(|x| x.0 == to).count() > MAX_SENDS_TO_A_PEER)
                        {
                            return Err(bad(format!(
                                "rank {r} sends more than {MAX_SENDS_TO_A_PEER} buffers to rank {to} in one group"
                            )));
                        }
                        for &(to, buf) in sends {
                            let peer = self.ranks.get(to).ok_or_else(|| bad(format!("rank {r} sends to rank {to}")))?;
                            if !peer_posts(peer, *phase, r, &prog.bufs[buf], |op| op.1) {
                                return Err(bad(format!(
                                    "rank {r} sends buffer {buf} to {to}, which never receives it"
                                )));
                            }
                        }
                    }
                    _ => {}
                }
            }
            self.check_stored_inside(r, prog).map_err(bad)?;
            self.check_liveness(r, prog).map_err(bad)?;
            check_overwritten(r, prog).map_err(bad)?;
            check_inputs_only_read(r, prog).map_err(bad)?;
        }
        // The mirror of the sends' check, once every rank's buffers are sound: a receive that no
        // peer sends would wait forever.
        for (r, prog) in self.ranks.iter().enumerate() {
            for op in prog.steps.iter().flatten() {
                let Op::Comm { phase, recvs, .. } = op else { continue };
                for &(from, buf) in recvs {
                    let peer =
                        self.ranks.get(from).ok_or_else(|| bad(format!("rank {r} receives from rank {from}")))?;
                    if !peer_posts(peer, *phase, r, &prog.bufs[buf], |op| op.0) {
                        return Err(bad(format!("rank {r} receives buffer {buf} from {from}, which never sends it")));
                    }
                }
            }
        }
        Ok(())
    }

    /// A buffer stored inside another ([`BufDesc::within`]) is a contiguous part of a buffer
    /// stored on its own, and only a transfer group uses it (a receive or a send; or a free
    /// releases it).
    fn check_stored_inside(&self, r: usize, prog: &RankProgram) -> std::result::Result<(), String> {
        for (b, d) in prog.bufs.iter().enumerate() {
            let Some(p) = d.within else { continue };
            let parent =
                prog.bufs.get(p).ok_or_else(|| format!("rank {r}: buffer {b} lies in undefined buffer {p}"))?;
            if parent.within.is_some() || d.offset_in(parent, &self.shape).is_none() {
                return Err(format!(
                    "rank {r}: buffer {b} ({d:?}) is not a contiguous part of buffer {p} ({parent:?})"
                ));
            }
        }
        for op in prog.steps.iter().flatten() {
            let stray = match op {
                Op::Free { .. } | Op::Comm { .. } => None,
                op => op.uses().into_iter().find(|b| prog.bufs.get(*b).is_some_and(|d| d.within.is_some())),
            };
            if let Some(b) = stray {
                return Err(format!("rank {r}: buffer {b}, stored inside another, is used other than by a transfer"));
            }
        }
        Ok(())
    }

    /// In program order, every buffer an op reads or sends is live: an input, allocated or
    /// received, and not yet freed; and every output is live at the end. A transfer into or
    /// from a buffer stored inside another needs that one live.
    fn check_liveness(&self, r: usize, prog: &RankProgram) -> std::result::Result<(), String> {
        let mut live = vec![false; prog.bufs.len()];
        for &(_, b) in &prog.inputs {
            *live.get_mut(b).ok_or_else(|| format!("rank {r}: input buffer {b} is undefined"))? = true;
        }
        for (t, op) in prog.steps.iter().enumerate() {
            for op in op {
                let dead =
                    |b: usize| format!("rank {r}, step {t}: buffer {b} used before it exists or after it is freed");
                match op {
                    Op::Alloc { buf, .. } => live[*buf] = true,
                    Op::Comm { sends, recvs, .. } => {
                        for &(_, b) in sends {
                            match prog.bufs[b].within {
                                Some(p) if !live[p] => return Err(dead(p)),
                                Some(_) => live[b] = true,
                                None if !live[b] => return Err(dead(b)),
                                None => {}
                            }
                        }
                        for &(_, b) in recvs {
                            if let Some(p) = prog.bufs[b].within.filter(|&p| !live[p]) {
                                return Err(dead(p));
                            }
                            live[b] = true;
                        }
                    }
                    Op::Free { buf } => {
                        if !live[*buf] {
                            return Err(dead(*buf));
                        }
                        live[*buf] = false;
                    }
                    op => {
                        if let Some(b) = op.uses().into_iter().find(|&b| !live[b]) {
                            return Err(dead(b));
                        }
                    }
                }
            }
        }
        match prog.outputs.iter().chain(&prog.saved).find(|&&(_, b)| !live.get(b).copied().unwrap_or(false)) {
            Some(&(tensor, b)) => Err(format!("rank {r}: output {tensor:?} (buffer {b}) is not live at the end")),
            None => Ok(()),
        }
    }
}

/// Whether `peer`'s group of `phase` posts, towards rank `r`, the other side of a transfer of
/// `desc`: `side` picks that group's list (`.0` its sends, `.1` its receives), whose buffer
/// must hold the same tensor part.
fn peer_posts<'a>(
    peer: &'a RankProgram,
    phase: usize,
    r: usize,
    desc: &BufDesc,
    side: impl Fn((&'a Vec<(usize, BufId)>, &'a Vec<(usize, BufId)>)) -> &'a Vec<(usize, BufId)>,
) -> bool {
    peer.steps.iter().flatten().any(|o| match o {
        Op::Comm { phase: p, sends, recvs } => {
            *p == phase
                && side((sends, recvs))
                    .iter()
                    .any(|&(rank, b)| rank == r && peer.bufs.get(b).is_some_and(|d| d.same_part(desc)))
        }
        _ => false,
    })
}

/// Every buffer allocated [`Fill::Overwritten`] is written whole by copies into it and
/// receives into buffers stored inside it, in the step of its allocation, before any other op
/// uses it.
fn check_overwritten(r: usize, prog: &RankProgram) -> std::result::Result<(), String> {
    // Overwritten buffers not yet used, with the (tokens, heads) regions copied into them so far.
    let mut pending: HashMap<BufId, Vec<(TokenSet, Range<usize>)>> = HashMap::new();
    // The region of `dst` that `src`'s tokens and heads cover.
    let overlap = |src: BufId, dst: BufId| {
        let (s, d) = (&prog.bufs[src], &prog.bufs[dst]);
        (s.tokens.intersect(&d.tokens), s.heads.start.max(d.heads.start)..s.heads.end.min(d.heads.end))
    };
    for (t, ops) in prog.steps.iter().enumerate() {
        for op in ops {
            // (buffer, region) this op writes into a pending buffer: a copy's, or a receive's
            // into a buffer stored inside it.
            let mut written = Vec::new();
            match op {
                Op::Alloc { buf, fill: Fill::Overwritten } => {
                    pending.insert(*buf, Vec::new());
                    continue;
                }
                Op::Copy { src, dst } if pending.contains_key(dst) => written.push((*dst, overlap(*src, *dst))),
                // A block's rounded O covers its query rows.
                Op::Fwd { q, rounded: Some(y), .. } if pending.contains_key(y) => written.push((*y, overlap(*q, *y))),
                // A backward block writes whole the gradients held in the input dtype that
                // cover exactly its rows (dQ) or keys (dK, dV); it adds into the others.
                Op::Bwd { q, k, dq, dk, dv, .. } => {
                    for (g, src) in [(*dq, *q), (*dk, *k), (*dv, *k)] {
                        if pending.contains_key(&g) && prog.bufs[g].narrow && prog.bufs[g].same_region(&prog.bufs[src])
                        {
                            written.push((g, overlap(src, g)));
                        }
                    }
                }
                Op::Comm { recvs, .. } => {
                    for &(_, b) in recvs {
                        let d = &prog.bufs[b];
                        if let Some(p) = d.within.filter(|p| pending.contains_key(p)) {
                            written.push((p, (d.tokens.clone(), d.heads.clone())));
                        }
                    }
                }
                _ => {}
            }
            for b in op.uses_in(&prog.bufs) {
                if written.iter().any(|w| w.0 == b) {
                    continue;
                }
                if let Some(regions) = pending.remove(&b) {
                    if !covers(&prog.bufs[b], &regions) {
                        return Err(format!("rank {r}, step {t}: buffer {b} is used before copies wrote all of it"));
                    }
                }
            }
            for (b, region) in written {
                pending.entry(b).or_default().push(region);
            }
        }
        for (b, regions) in pending.drain() {
            if !covers(&prog.bufs[b], &regions) {
                return Err(format!("rank {r}, step {t}: copies leave part of buffer {b} unwritten"));
            }
        }
    }
    Ok(())
}

/// No op writes an input, and no input is handed back as an output or saved: callers may lend
/// their own tensors as inputs (the Python package lends PyTorch's) and read them afterwards.
fn check_inputs_only_read(r: usize, prog: &RankProgram) -> std::result::Result<(), String> {
    let input = |b: BufId| prog.inputs.iter().find(|&&(_, i)| i == b).map(|&(t, _)| t);
    for (t, op) in prog.steps.iter().enumerate() {
        for op in op.iter().filter(|op| !matches!(op, Op::Free { .. })) {
            if let Some((b, tensor)) =
                crate::schedule::reads_writes(op, &prog.bufs).1.into_iter().find_map(|b| Some((b, input(b)?)))
            {
                return Err(format!("rank {r}, step {t}: writes buffer {b}, its input {tensor:?}"));
            }
        }
    }
    match prog.outputs.iter().chain(&prog.saved).find_map(|&(out, b)| Some((out, input(b)?))) {
        Some((out, tensor)) => Err(format!("rank {r}: hands back its input {tensor:?} as {out:?}")),
        None => Ok(()),
    }
}

/// Whether `regions` (tokens × heads, inside `desc`) cover all of `desc`.
fn covers(desc: &BufDesc, regions: &[(TokenSet, Range<usize>)]) -> bool {
    desc.heads.clone().all(|h| {
        let sets = regions.iter().filter(|(_, hs)| hs.contains(&h)).map(|(ts, _)| ts);
        TokenSet::union(sets).len() == desc.tokens.len()
    })
}

#[cfg(test)]
mod tests {
    use crate::plan::{BufDesc, Fill, Layout, Op, Pass, Plan, RankProgram, RingBackward, Tensor, TokenSet};
    use crate::{AttnShape, DType, Error, Strategy};

    /// Two ranks; rank 0 sends its K shard to rank 1.
    fn send_k() -> Plan {
        let k0 = BufDesc::new(Tensor::K, TokenSet::range(0..4), 0..1);
        let program = |bufs, inputs, comm| RankProgram {
            bufs,
            inputs,
            outputs: Vec::new(),
            saved: Vec::new(),
            steps: vec![vec![comm]],
        };
        Plan {
            strategy: Strategy::Ring,
            pass: Pass::Forward,
            ring_backward: RingBackward::KvCirculate,
            world: 2,
            shape: AttnShape::new(1, 8, 8, 1, 1, 16).unwrap(),
            dtype: DType::F32,
            layout: Layout::contiguous(8, 8, 2),
            step_labels: vec!["send".into()],
            ranks_per_node: None,
            ranks: vec![
                program(
                    vec![k0.clone()],
                    vec![(Tensor::K, 0)],
                    Op::Comm { phase: 0, sends: vec![(1, 0)], recvs: Vec::new() },
                ),
                program(vec![k0], Vec::new(), Op::Comm { phase: 0, sends: Vec::new(), recvs: vec![(0, 0)] }),
            ],
        }
    }

    #[test]
    fn broken_plans_are_invalid_plan_errors() {
        send_k().validate().unwrap();
        let mut to_nobody = send_k();
        if let Op::Comm { sends, .. } = &mut to_nobody.ranks[0].steps[0][0] {
            sends[0].0 = 7;
        }
        let mut unreceived = send_k();
        unreceived.ranks[1].bufs[0].tokens = TokenSet::range(4..8);
        let mut undefined = send_k();
        undefined.ranks[1].steps[0].push(Op::Free { buf: 1 });
        let mut received_into_nothing = send_k();
        if let Op::Comm { recvs, .. } = &mut received_into_nothing.ranks[1].steps[0][0] {
            recvs[0].1 = 5;
        }
        let mut missing_rank = send_k();
        missing_rank.ranks.pop();
        // A buffer sent before it exists (a return group emitted before the block filling it).
        let mut sent_before_alloc = send_k();
        sent_before_alloc.ranks[0].inputs.clear();
        sent_before_alloc.ranks[0].steps[0].push(Op::Alloc { buf: 0, fill: crate::plan::Fill::Zero });
        let mut used_after_free = send_k();
        used_after_free.ranks[0].steps[0].insert(0, Op::Free { buf: 0 });
        let mut dead_output = send_k();
        dead_output.ranks[1].outputs.push((Tensor::K, 0));
        dead_output.ranks[1].steps[0].push(Op::Free { buf: 0 });
        // Inputs may be the caller's own tensors: never written, never handed back.
        let mut input_received_into = send_k();
        input_received_into.ranks[1].inputs.push((Tensor::K, 0));
        let mut input_as_output = send_k();
        input_as_output.ranks[0].outputs.push((Tensor::O, 0));
        let e = input_received_into.validate().unwrap_err().to_string();
        assert!(e.contains("rank 1, step 0: writes buffer 0, its input K"), "{e}");
        let e = input_as_output.validate().unwrap_err().to_string();
        assert!(e.contains("rank 0: hands back its input K as O"), "{e}");
        for broken in [
            to_nobody,
            unreceived,
            undefined,
            received_into_nothing,
            missing_rank,
            sent_before_alloc,
            used_after_free,
            dead_output,
        ] {
            let e = broken.validate().unwrap_err();
            assert!(matches!(e, Error::InvalidPlan(_)), "{e}");
            assert!(e.to_string().starts_with("invalid plan: ring: "), "{e}");
        }
    }

    /// Rank 0 copies inputs holding tokens `parts` (start, end) of K into an unfilled buffer of
    /// tokens 0..4 and sends that.
    fn send_cut(parts: &[(usize, usize)]) -> Plan {
        let mut plan = send_k();
        let prog = &mut plan.ranks[0];
        let whole = prog.bufs[0].clone();
        let send = std::mem::replace(&mut prog.steps[0], vec![Op::Alloc { buf: 1, fill: Fill::Overwritten }]);
        prog.bufs.push(whole.clone());
        for (i, part) in parts.iter().enumerate() {
            prog.bufs.push(BufDesc { tokens: TokenSet::range(part.0..part.1), ..whole.clone() });
            prog.inputs.push((Tensor::K, 2 + i));
            prog.steps[0].push(Op::Copy { src: 2 + i, dst: 1 });
        }
        prog.steps[0].extend(send.into_iter().map(|op| match op {
            Op::Comm { phase, recvs, .. } => Op::Comm { phase, sends: vec![(1, 1)], recvs },
            op => op,
        }));
        plan
    }

    #[test]
    fn unfilled_buffers_must_be_written_whole_before_use() {
        send_cut(&[(0, 4)]).validate().unwrap();
        send_cut(&[(2, 4), (0, 3)]).validate().unwrap();
        for parts in [&[(0, 3)][..], &[(0, 1), (2, 4)], &[]] {
            let e = send_cut(parts).validate().unwrap_err();
            assert!(e.to_string().contains("used before copies wrote all of it"), "{parts:?}: {e}");
        }
        // Written whole but never used: still checked at the end of the step.
        let mut unused = send_cut(&[(0, 2)]);
        unused.ranks[0].steps[0].retain(|op| !matches!(op, Op::Comm { .. }));
        unused.ranks[1].steps[0].clear();
        let e = unused.validate().unwrap_err();
        assert!(e.to_string().contains("leave part of buffer 1 unwritten"), "{e}");
    }
}

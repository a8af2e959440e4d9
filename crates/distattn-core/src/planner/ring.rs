//! Ring attention: K/V blocks circulate around the ranks; each step every rank computes its
//! queries against the block it holds, skipping blocks the mask leaves empty (the causal steps
//! above the diagonal). The ring core here is shared by zigzag, striped and hybrid.
//!
//! Backward comes in two variants ([`RingBackward`]): K and V circulate (dQ stays), or
//! BurstAttention's Q, dO, LSE and D circulate (K, V, dK, dV stay). Either way the gradient a
//! rank computes for a visiting block goes straight back to the block's owner.

use super::builder::Builder;
use crate::plan::{BufId, Fill, Layout, Op, Pass, RingBackward};
use crate::Result;

pub(crate) fn plan(b: &mut Builder) -> Result<()> {
    let layout = Layout::contiguous(b.shape.q_len, b.shape.k_len, b.world);
    over_layout(b, layout, "ring")
}

/// A ring over all ranks in rank order, on the given layout.
pub(crate) fn over_layout(b: &mut Builder, layout: Layout, name: &str) -> Result<()> {
    let inputs = b.pass_inputs(layout);
    let outputs = b.pass_outputs();
    let members: Vec<usize> = (0..b.world).collect();
    match b.pass() {
        Pass::Forward => {
            let m: Vec<[BufId; 5]> = (0..b.world)
                .map(|r| [inputs[r][0], inputs[r][1], inputs[r][2], outputs[r][0], outputs[r][1]])
                .collect();
            forward(b, 0, &members, &m, name);
        }
        Pass::Backward => {
            let m: Vec<[BufId; 9]> = (0..b.world)
                .map(|r| {
                    let (i, o) = (&inputs[r], &outputs[r]);
                    [i[0], i[1], i[2], i[3], i[4], i[5], o[0], o[1], o[2]]
                })
                .collect();
            backward(b, 0, &members, &m, name);
        }
    }
    Ok(())
}

/// Forward ring among `members` (ranks, in ring order) starting at `step0`; member i holds
/// `bufs[i] = [q, k, v, o_acc, lse_acc]`. Uses steps `step0 .. step0 + members.len()`.
pub(crate) fn forward(b: &mut Builder, step0: usize, members: &[usize], bufs: &[[BufId; 5]], name: &str) {
    let n = members.len();
    let mut cur: Vec<(BufId, BufId)> = bufs.iter().map(|x| (x[1], x[2])).collect();
    for t in 0..n {
        let step = step0 + t;
        b.label(step, format!("{name} {t}: kv from -{t}"));
        let mut next = cur.clone();
        if t + 1 < n {
            for i in 0..n {
                let to = (i + 1) % n;
                let k = b.transfer(step, 0, members[i], members[to], cur[i].0);
                let v = b.transfer(step, 0, members[i], members[to], cur[i].1);
                next[to] = (k, v);
            }
        }
        for i in 0..n {
            let [q, _, _, o, lse] = bufs[i];
            b.fwd(members[i], step, q, cur[i].0, cur[i].1, o, lse);
        }
        cur = next;
    }
}

/// Backward ring among `members`; member i holds
/// `bufs[i] = [q, k, v, dO, lse, delta, dq_acc, dk_acc, dv_acc]` (its own shard and its own
/// accumulators). Uses steps `step0 .. step0 + members.len()`.
///
/// The gradient of a travelling block does not travel with it: at step 0 a member adds into
/// its own accumulators, and at a later step it computes into a fresh buffer that goes straight
/// back to the block's owner (phase 1), which adds it after its next step's compute. So no
/// step waits for a neighbour's previous compute, only for inputs sent a step ahead; just the
/// last step's partials are waited for, at the end.
pub(crate) fn backward(b: &mut Builder, step0: usize, members: &[usize], bufs: &[[BufId; 9]], name: &str) {
    let n = members.len();
    if n == 1 {
        let x = bufs[0];
        b.label(step0, format!("{name} 0"));
        b.bwd(members[0], step0, [x[0], x[1], x[2], x[3], x[4], x[5]], x[6], x[7], x[8]);
        return;
    }
    let qc = b.opts.ring_backward == RingBackward::QCirculate;
    // What travels: the K/V side (k, v; gradients dk, dv) or the Q side (q, dO, lse, delta; dq).
    let travel_inputs: &[usize] = if qc { &[0, 3, 4, 5] } else { &[1, 2] };
    let travel_accs: &[usize] = if qc { &[6] } else { &[7, 8] };
    // cur[i][j]: the input buffer member i uses in slot j at this step.
    let mut cur: Vec<[BufId; 9]> = bufs.to_vec();
    // Partials received in the previous step: (member, received buffer, its owner's accumulator).
    let mut pending: Vec<(usize, BufId, BufId)> = Vec::new();
    for t in 0..n {
        let step = step0 + t;
        let what = if qc { "q,dO,lse,D" } else { "kv" };
        b.label(step, format!("{name} {t}: {what} from -{t}"));
        let mut next = cur.clone();
        if t + 1 < n {
            for i in 0..n {
                let to = (i + 1) % n;
                for &j in travel_inputs {
                    next[to][j] = b.transfer(step, 0, members[i], members[to], cur[i][j]);
                }
            }
        }
        let mut partials = Vec::new();
        for i in 0..n {
            let owner = (i + n - t % n) % n;
            let mut c = cur[i];
            if t > 0 {
                let (q, k) = if qc { (c[0], bufs[i][1]) } else { (bufs[i][0], c[1]) };
                if b.area(members[i], q, members[i], k) == 0 {
                    continue;
                }
                for &j in travel_accs {
                    let d = b.desc(members[owner], bufs[owner][j]).clone();
                    c[j] = b.alloc(members[i], step, d, Fill::Zero);
                    partials.push((i, owner, c[j], bufs[owner][j]));
                }
            }
            b.bwd(members[i], step, [c[0], c[1], c[2], c[3], c[4], c[5]], c[6], c[7], c[8]);
        }
        // The previous step's partials, added after this step's compute (they had it to arrive).
        for (i, got, acc) in pending.drain(..) {
            b.push(members[i], step, Op::Add { src: got, dst: acc });
        }
        for (i, owner, part, acc) in partials {
            let got = b.transfer(step, 1, members[i], members[owner], part);
            pending.push((owner, got, acc));
        }
        if t + 1 == n {
            for (i, got, acc) in pending.drain(..) {
                b.push(members[i], step, Op::Add { src: got, dst: acc });
            }
        }
        cur = next;
    }
}

//! DistFlashAttn's load-balanced schedule (arXiv 2310.03294 §3.1), contiguous layout.
//!
//! Step 0: every rank computes its diagonal block. At step t ≥ 1 a rank r ≥ t computes
//! (q_r, kv_{r−t}) itself (it receives that K/V), while a rank r < t — idle in a plain ring —
//! *helps*: it receives q_{r+P−t} from its owner, computes it against its own kv_r and returns
//! the partial (O, LSE), which the owner merges. All P(P−1)/2 lower blocks are done in
//! ⌊P/2⌋ + 1 steps. For even P the published last step (t = P/2) leaves half the ranks idle; we
//! split each of its blocks at the query row that halves its kept area, the helper taking the
//! first half, so the last step is balanced too.
//!
//! Backward follows the same schedule: helpers receive (q, dO, LSE, D) and return dQ
//! partials; owners receive K/V and return dK/dV partials. Masks with kept pairs above the
//! diagonal (non-causal) run the mirrored schedule for the upper blocks in further steps.

use super::builder::Builder;
use crate::plan::{area, BufDesc, BufId, Fill, Layout, Op, Pass, Tensor};
use crate::Result;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Who {
    Owner,
    Helper,
    Split,
}

/// Steps 1.. of the schedule over lower pairs (q owner i > kv owner j).
fn schedule(p: usize) -> Vec<Vec<(usize, usize, Who)>> {
    let mut steps = Vec::new();
    for t in 1..=p / 2 {
        let mut s = Vec::new();
        if 2 * t == p {
            for r in t..p {
                s.push((r, r - t, Who::Split));
            }
        } else {
            for r in t..p {
                s.push((r, r - t, Who::Owner));
            }
            for r in 0..t {
                s.push((r + p - t, r, Who::Helper));
            }
        }
        steps.push(s);
    }
    steps
}

pub(crate) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let layout = Layout::contiguous(b.shape.q_len, b.shape.k_len, p);
    let inputs = b.pass_inputs(layout);
    let outputs = b.pass_outputs();
    let fwd = b.pass() == Pass::Forward;
    // Step 0: diagonal blocks.
    b.label(0, "diagonal");
    for r in 0..p {
        let (i, o) = (&inputs[r], &outputs[r]);
        if fwd {
            b.fwd(r, 0, i[0], i[1], i[2], o[0], o[1]);
        } else {
            b.bwd(r, 0, [i[0], i[1], i[2], i[3], i[4], i[5]], o[0], o[1], o[2]);
        }
    }
    let sched = schedule(p);
    let mut step = 1;
    for mirrored in [false, true] {
        for (t, tasks) in sched.iter().enumerate() {
            let tasks: Vec<(usize, usize, Who)> =
                tasks.iter().map(|&(i, j, w)| if mirrored { (p - 1 - i, p - 1 - j, w) } else { (i, j, w) }).collect();
            let side = if mirrored { "upper" } else { "lower" };
            b.label(step, format!("{side} t={}", t + 1));
            run_step(b, step, &tasks, &inputs, &outputs);
            step += 1;
        }
    }
    Ok(())
}

/// The query rows (local) that halve the kept area of the block (q_i, kv_j).
fn split_row(b: &Builder, qi: &BufDesc, kj: &BufDesc) -> usize {
    let total = area(b.mask, &qi.tokens, &kj.tokens);
    let (mut lo, mut hi) = (0, qi.tokens.len());
    while lo < hi {
        let mid = (lo + hi) / 2;
        if 2 * area(b.mask, &qi.tokens.local_slice(0..mid), &kj.tokens) < total {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

fn run_step(
    b: &mut Builder,
    step: usize,
    tasks: &[(usize, usize, Who)],
    inputs: &[Vec<BufId>],
    outputs: &[Vec<BufId>],
) {
    let fwd = b.pass() == Pass::Forward;
    let q_side: &[usize] = if fwd { &[0] } else { &[0, 3, 4, 5] }; // q (, dO, lse, D)
                                                                   // Resolve each task into (owner rows, helper rows) as lists of q-side buffers.
    struct Job {
        i: usize,
        j: usize,
        own: Option<Vec<BufId>>,  // on rank i
        help: Option<Vec<BufId>>, // on rank i, to send to j
    }
    let mut jobs = Vec::new();
    for &(i, j, who) in tasks {
        let (qd, kd) = (b.desc(i, inputs[i][0]).clone(), b.desc(j, inputs[j][1]).clone());
        if area(b.mask, &qd.tokens, &kd.tokens) == 0 {
            continue;
        }
        let whole: Vec<BufId> = q_side.iter().map(|&x| inputs[i][x]).collect();
        let job = match who {
            Who::Owner => Job { i, j, own: Some(whole), help: None },
            Who::Helper => Job { i, j, own: None, help: Some(whole) },
            Who::Split if b.opts.balanced_no_split => Job { i, j, own: Some(whole), help: None },
            Who::Split => {
                let m = split_row(b, &qd, &kd);
                let n = qd.tokens.len();
                if m == 0 || m == n {
                    Job { i, j, own: Some(whole), help: None }
                } else {
                    let (lo, hi) = (qd.tokens.local_slice(0..m), qd.tokens.local_slice(m..n));
                    let mut help = Vec::new();
                    let mut own = Vec::new();
                    for &src in &whole {
                        let heads = b.desc(i, src).heads.clone();
                        help.push(b.extract(i, step, src, lo.clone(), heads.clone()));
                        own.push(b.extract(i, step, src, hi.clone(), heads));
                    }
                    Job { i, j, own: Some(own), help: Some(help) }
                }
            }
        };
        jobs.push(job);
    }
    // Phase 0: K/V to owners that compute, query side to helpers.
    let mut recv_kv = Vec::new();
    let mut recv_q = Vec::new();
    for job in &jobs {
        recv_kv.push(job.own.as_ref().map(|_| {
            let k = b.transfer(step, 0, job.j, job.i, inputs[job.j][1]);
            let v = b.transfer(step, 0, job.j, job.i, inputs[job.j][2]);
            (k, v)
        }));
        recv_q.push(
            job.help.as_ref().map(|h| h.iter().map(|&x| b.transfer(step, 0, job.i, job.j, x)).collect::<Vec<_>>()),
        );
    }
    // Compute.
    let mut partials: Vec<(Option<Vec<BufId>>, Option<Vec<BufId>>)> = Vec::new(); // (on i for j, on j for i)
    for (n, job) in jobs.iter().enumerate() {
        let (i, j) = (job.i, job.j);
        let mut for_j = None;
        let mut for_i = None;
        if let (Some(own), Some((k, v))) = (&job.own, recv_kv[n]) {
            if fwd {
                b.fwd(i, step, own[0], k, v, outputs[i][0], outputs[i][1]);
            } else {
                let kd = b.desc(i, k).clone();
                let dk = b.alloc(i, step, BufDesc::new(Tensor::DK, kd.tokens.clone(), kd.heads.clone()), Fill::Zero);
                let dv = b.alloc(i, step, BufDesc::new(Tensor::DV, kd.tokens, kd.heads), Fill::Zero);
                b.bwd(i, step, [own[0], k, v, own[1], own[2], own[3]], outputs[i][0], dk, dv);
                for_j = Some(vec![dk, dv]);
            }
        }
        if let Some(q) = &recv_q[n] {
            let qd = b.desc(j, q[0]).clone();
            if fwd {
                let o = b.alloc(j, step, BufDesc::new(Tensor::O, qd.tokens.clone(), qd.heads.clone()), Fill::Zero);
                let l = b.alloc(j, step, BufDesc::new(Tensor::Lse, qd.tokens, qd.heads), Fill::NegInf);
                b.fwd(j, step, q[0], inputs[j][1], inputs[j][2], o, l);
                for_i = Some(vec![o, l]);
            } else {
                let dq = b.alloc(j, step, BufDesc::new(Tensor::DQ, qd.tokens, qd.heads), Fill::Zero);
                b.bwd(j, step, [q[0], inputs[j][1], inputs[j][2], q[1], q[2], q[3]], dq, outputs[j][1], outputs[j][2]);
                for_i = Some(vec![dq]);
            }
        }
        partials.push((for_j, for_i));
    }
    // Phase 1: partials back to their owners, then merged / added.
    let mut merges = Vec::new();
    for (n, job) in jobs.iter().enumerate() {
        if let Some(bufs) = &partials[n].0 {
            let got: Vec<BufId> = bufs.iter().map(|&x| b.transfer(step, 1, job.i, job.j, x)).collect();
            merges.push((job.j, got, vec![outputs[job.j][1], outputs[job.j][2]]));
        }
        if let Some(bufs) = &partials[n].1 {
            let got: Vec<BufId> = bufs.iter().map(|&x| b.transfer(step, 1, job.j, job.i, x)).collect();
            let dst = if fwd { vec![outputs[job.i][0], outputs[job.i][1]] } else { vec![outputs[job.i][0]] };
            merges.push((job.i, got, dst));
        }
    }
    for (rank, got, dst) in merges {
        if fwd {
            b.push(rank, step, Op::Merge { o: got[0], lse: got[1], o_acc: dst[0], lse_acc: dst[1] });
        } else {
            for (s, d) in got.into_iter().zip(dst) {
                b.push(rank, step, Op::Add { src: s, dst: d });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_covers_lower_pairs_once() {
        for p in 1..=9 {
            let mut seen = std::collections::HashSet::new();
            for step in schedule(p) {
                let mut busy = std::collections::HashSet::new();
                for (i, j, who) in step {
                    assert!(i > j);
                    assert!(seen.insert((i, j)));
                    let runner = if who == Who::Helper { j } else { i };
                    assert!(busy.insert(runner), "rank {runner} twice in a step (P={p})");
                }
            }
            assert_eq!(seen.len(), p * (p - 1) / 2);
        }
    }
}

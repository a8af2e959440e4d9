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

use super::builder::{BufSet, Builder, BwdBufs, FwdBufs, GradBufs, KvBufs, OutBufs, PassBufs, QueryBufs};
use crate::plan::{area, BufDesc, BufId, Fill, Layout, Op, Tensor};
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

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let layout = Layout::contiguous(b.shape.q_len, b.shape.k_len, p);
    let bufs = b.declare_pass(layout);
    // Step 0: diagonal blocks.
    b.label(0, "diagonal");
    for r in 0..p {
        match &bufs {
            PassBufs::Forward(own) => b.fwd(r, 0, own[r]),
            PassBufs::Backward(own) => b.bwd(r, 0, own[r]),
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
            match &bufs {
                PassBufs::Forward(own) => forward_step(b, step, &tasks, own),
                PassBufs::Backward(own) => backward_step(b, step, &tasks, own),
            }
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

/// The query rows of a block and what travels with them: Q (forward) or Q, dO, LSE, D
/// (backward).
trait QuerySide: BufSet {
    fn q(self) -> BufId;
}

impl QuerySide for BufId {
    fn q(self) -> BufId {
        self
    }
}

impl QuerySide for QueryBufs {
    fn q(self) -> BufId {
        self.q
    }
}

/// A block of a step, the query rows of rank `i` against the K/V of rank `j`, with its
/// buffers as phase 0 delivers them.
struct Job<S> {
    i: usize,
    j: usize,
    /// Rows rank i computes itself, with j's K/V as received on i.
    own: Option<(S, KvBufs)>,
    /// Rows rank j computes for i, as received on j.
    help: Option<S>,
}

/// Resolves the step's tasks into jobs, skipping empty blocks and splitting the rows of
/// [`Who::Split`] blocks, then posts phase 0: K/V to ranks that compute their own rows, query
/// sides to helpers. `query[r]` and `kv[r]` are rank r's own.
fn prepare<S: QuerySide>(
    b: &mut Builder,
    step: usize,
    tasks: &[(usize, usize, Who)],
    query: &[S],
    kv: &[KvBufs],
) -> Vec<Job<S>> {
    // (i, j, rows i computes, rows j computes), all on rank i.
    let mut rows = Vec::new();
    for &(i, j, who) in tasks {
        let whole = query[i];
        let (qd, kd) = (b.desc(i, whole.q()).clone(), b.desc(j, kv[j].k).clone());
        if area(b.mask, &qd.tokens, &kd.tokens) == 0 {
            continue;
        }
        let (own, help) = match who {
            Who::Owner => (Some(whole), None),
            Who::Helper => (None, Some(whole)),
            Who::Split if b.opts.balanced_no_split => (Some(whole), None),
            Who::Split => {
                let m = split_row(b, &qd, &kd);
                let n = qd.tokens.len();
                if m == 0 || m == n {
                    (Some(whole), None)
                } else {
                    // The helper takes the first m rows, the owner the rest.
                    let (first, rest) = (qd.tokens.local_slice(0..m), qd.tokens.local_slice(m..n));
                    let (help, own) = whole.unzip_map(|src| {
                        let heads = b.desc(i, src).heads.clone();
                        let help = b.extract(i, step, src, first.clone(), heads.clone());
                        let own = b.extract(i, step, src, rest.clone(), heads);
                        (help, own)
                    });
                    (Some(own), Some(help))
                }
            }
        };
        rows.push((i, j, own, help));
    }
    let mut jobs = Vec::new();
    for (i, j, own, help) in rows {
        let own = own.map(|rows| (rows, b.transfer_set(step, 0, j, i, kv[j])));
        let help = help.map(|rows| b.transfer_set(step, 0, i, j, rows));
        jobs.push(Job { i, j, own, help });
    }
    jobs
}

/// A forward step: owners merge their rows into their accumulators; helpers compute into
/// fresh (O, LSE) that go back to the owner (phase 1) and are merged there.
fn forward_step(b: &mut Builder, step: usize, tasks: &[(usize, usize, Who)], bufs: &[FwdBufs]) {
    let query: Vec<BufId> = bufs.iter().map(|x| x.q).collect();
    let kv: Vec<KvBufs> = bufs.iter().map(|x| x.kv).collect();
    let jobs = prepare(b, step, tasks, &query, &kv);
    // (helper, owner, partial O and LSE on the helper)
    let mut partials = Vec::new();
    for job in &jobs {
        if let Some((q, kv)) = job.own {
            b.fwd(job.i, step, FwdBufs { q, kv, ..bufs[job.i] });
        }
        if let Some(q) = job.help {
            let qd = b.desc(job.j, q).clone();
            let o = b.alloc(job.j, step, BufDesc::new(Tensor::O, qd.tokens.clone(), qd.heads.clone()), Fill::Zero);
            let lse = b.alloc(job.j, step, BufDesc::new(Tensor::Lse, qd.tokens, qd.heads), Fill::NegInf);
            let out = OutBufs { o, lse };
            b.fwd(job.j, step, FwdBufs { q, kv: bufs[job.j].kv, out });
            partials.push((job.j, job.i, out));
        }
    }
    let returned: Vec<_> =
        partials.into_iter().map(|(from, to, out)| (to, b.transfer_set(step, 1, from, to, out))).collect();
    for (rank, got) in returned {
        let acc = bufs[rank].out;
        b.push(rank, step, Op::Merge { o: got.o, lse: got.lse, o_acc: acc.o, lse_acc: acc.lse });
    }
}

/// A backward step: owners compute their rows into their dQ and fresh dK, dV for the K/V
/// owner; helpers compute visiting rows into their dK, dV and a fresh dQ for the query owner.
/// Partials go back in phase 1 and are added there.
fn backward_step(b: &mut Builder, step: usize, tasks: &[(usize, usize, Who)], bufs: &[BwdBufs]) {
    let query: Vec<QueryBufs> = bufs.iter().map(|x| x.query).collect();
    let kv: Vec<KvBufs> = bufs.iter().map(|x| x.kv).collect();
    let jobs = prepare(b, step, tasks, &query, &kv);
    // Per job: (dK, dV partial on i for j, dQ partial on j for i).
    let mut partials = Vec::new();
    for job in &jobs {
        let (i, j) = (job.i, job.j);
        let for_j = job.own.map(|(query, kv)| {
            let dkv = b.kv_grad_partials(i, step, kv);
            b.bwd(i, step, BwdBufs { query, kv, grads: GradBufs { dkv, ..bufs[i].grads } });
            dkv
        });
        let for_i = job.help.map(|query| {
            let qd = b.desc(j, query.q).clone();
            let dq = b.alloc(j, step, BufDesc::new(Tensor::DQ, qd.tokens, qd.heads), Fill::Zero);
            b.bwd(j, step, BwdBufs { query, grads: GradBufs { dq, ..bufs[j].grads }, ..bufs[j] });
            dq
        });
        partials.push((for_j, for_i));
    }
    let mut returned = Vec::new();
    for (job, (for_j, for_i)) in jobs.iter().zip(partials) {
        let dkv = for_j.map(|part| b.transfer_set(step, 1, job.i, job.j, part));
        let dq = for_i.map(|part| b.transfer(step, 1, job.j, job.i, part));
        returned.push((dkv, dq));
    }
    for (job, (dkv, dq)) in jobs.iter().zip(returned) {
        if let Some(got) = dkv {
            b.add_set(job.j, step, got, bufs[job.j].grads.dkv);
        }
        if let Some(got) = dq {
            b.add_set(job.i, step, got, bufs[job.i].grads.dq);
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

//! A rank's program as issued on two lanes, as pure data: the interpreter of every backend
//! follows it (a lane is a stream on a GPU; on the CPU lanes only order the work, which runs
//! as it is issued).
//!
//! A rank's program is issued in program order onto two lanes: the **compute** lane (blocks,
//! merges, adds) and the **comm** lane (transfer groups, and copies whose source no compute op has
//! written, such as the extraction of a query chunk that is about to be sent). Each op waits
//! only for the latest op of the *other* lane that touched one of its buffers (a write it reads,
//! or any use of a buffer it writes or frees); ops of one lane run in order. So step t+1's
//! transfer never waits for step t's compute unless it sends something that compute produced.
//!
//! Double buffering: the first comm op of step t also waits for the end of step t−2's compute,
//! so at most two steps of received blocks are alive at once.
//!
//! A transfer group that only receives waits for the compute ops of its step that come before it
//! in program order: a posted NCCL group holds SMs until its peers arrive, so a rank that posts
//! the receipt of partials its peers compute in this step (dispatch's rank holding the early
//! keys under a causal mask) would run its own block on fewer SMs for as long as theirs take:
//! 14–15% slower on 2 and 4 × H200 (2026-11-27). Groups that send are posted when their data is.
//!
//! Allocation is lazy: an `Alloc` runs on the lane of the buffer's first user; a `Free` runs on
//! the lane of the buffer's last user (a stream-ordered free), after the other lane's last use,
//! so freeing a received block never makes the comm lane wait for compute.
//!
//! Issue order: the host enqueues the compute lane's next op before the comm lane's whenever
//! it waits for nothing unissued. In program order the step-0 NCCL group came first, and the
//! host waits for a non-blocking group call to settle: the timelines (4 × H200, 32k forward)
//! show the first transfer starting 0.03 ms into the run but the first kernel 0.15–0.42 ms in.
//! Lanes keep program order and every wait names an op issued before it, so the streams get
//! the same work and the same dependencies.

use crate::plan::{BufDesc, BufId, Op, RankProgram};

/// An execution lane (one CUDA stream each on a GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Lane {
    Compute,
    Comm,
}

impl Lane {
    pub fn other(self) -> Lane {
        match self {
            Lane::Compute => Lane::Comm,
            Lane::Comm => Lane::Compute,
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One op of the program with its lane and its cross-lane dependency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedOp {
    /// Position in the flattened program (all steps, in order).
    pub id: usize,
    pub step: usize,
    /// Index of the op within its step.
    pub index: usize,
    pub lane: Lane,
    /// Wait for op `wait` (of the other lane) to complete before this op starts.
    pub wait: Option<usize>,
    /// Some later op of the other lane waits for this one (so the executor records an event).
    pub signals: bool,
}

/// A program as issued on two lanes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// In program order (`ops[i].id == i`).
    pub ops: Vec<SchedOp>,
    /// The order in which the host issues `ops` (indices into it).
    pub issue: Vec<usize>,
    /// Lane each buffer was allocated on (inputs: compute).
    pub home: Vec<Lane>,
}

/// Buffers an op reads and buffers it writes; a receive into a buffer stored inside another
/// ([`BufDesc::within`]) writes that one too, and a send from one reads it.
pub fn reads_writes(op: &Op, bufs: &[BufDesc]) -> (Vec<BufId>, Vec<BufId>) {
    match op {
        Op::Comm { sends, recvs, .. } => {
            let within = |b: BufId| bufs.get(b).and_then(|d| d.within);
            let with_parent = |list: &[(usize, BufId)]| -> Vec<BufId> {
                list.iter().flat_map(|&(_, b)| std::iter::once(b).chain(within(b))).collect()
            };
            (with_parent(sends), with_parent(recvs))
        }
        Op::Alloc { buf, .. } => (vec![], vec![*buf]),
        Op::Copy { src, dst } => (vec![*src], vec![*dst]),
        Op::Add { src, dst } => (vec![*src, *dst], vec![*dst]),
        Op::Merge { o, lse, o_acc, lse_acc } => (vec![*o, *lse, *o_acc, *lse_acc], vec![*o_acc, *lse_acc]),
        Op::Fwd { q, k, v, o, lse, rounded, .. } => {
            (vec![*q, *k, *v, *o, *lse], [*o, *lse].into_iter().chain(*rounded).collect())
        }
        Op::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, .. } => {
            (vec![*q, *k, *v, *d_o, *lse, *delta, *dq, *dk, *dv], vec![*dq, *dk, *dv])
        }
        Op::Free { buf } => (vec![], vec![*buf]),
    }
}

#[derive(Clone, Default)]
struct BufState {
    /// Latest op id per lane that wrote the buffer.
    writer: [Option<usize>; 2],
    /// Latest op id per lane that used (read or wrote) the buffer.
    user: [Option<usize>; 2],
}

/// Schedules one rank's program.
pub fn schedule(prog: &RankProgram) -> Schedule {
    let flat: Vec<(usize, usize, &Op)> = prog
        .steps
        .iter()
        .enumerate()
        .flat_map(|(t, ops)| ops.iter().enumerate().map(move |(i, op)| (t, i, op)))
        .collect();
    let nb = prog.bufs.len();
    // Lane of each op; allocs follow their buffer's first user.
    let mut lanes: Vec<Option<Lane>> = vec![None; flat.len()];
    let mut home: Vec<Lane> = vec![Lane::Compute; nb];
    let mut compute_written = vec![false; nb];
    let mut pending_alloc: Vec<Option<usize>> = vec![None; nb];
    let mut last_lane: Vec<Lane> = vec![Lane::Compute; nb];
    for (id, &(_, _, op)) in flat.iter().enumerate() {
        let lane = match op {
            Op::Alloc { buf, .. } => {
                pending_alloc[*buf] = Some(id);
                continue;
            }
            Op::Free { buf } => last_lane[*buf],
            Op::Comm { .. } => Lane::Comm,
            Op::Copy { src, .. } if !compute_written[*src] => Lane::Comm,
            _ => Lane::Compute,
        };
        lanes[id] = Some(lane);
        let (r, w) = reads_writes(op, &prog.bufs);
        for b in r.iter().chain(&w) {
            if let Some(a) = pending_alloc[*b].take() {
                lanes[a] = Some(lane);
                home[*b] = lane;
            }
        }
        if let Op::Comm { recvs, .. } = op {
            for &(_, b) in recvs {
                home[b] = Lane::Comm;
            }
        }
        for b in r.iter().chain(&w) {
            last_lane[*b] = lane;
        }
        if lane == Lane::Compute {
            for b in &w {
                compute_written[*b] = true;
            }
        } else if !matches!(op, Op::Free { .. }) {
            for b in &w {
                compute_written[*b] = false;
            }
        }
    }
    // Allocs of buffers never used: compute.
    let lanes: Vec<Lane> = lanes.into_iter().map(|l| l.unwrap_or(Lane::Compute)).collect();

    let mut st = vec![BufState::default(); nb];
    let mut ops = Vec::with_capacity(flat.len());
    // Latest op id per lane that the other lane has already waited for (dedup).
    let mut waited: [Option<usize>; 2] = [None, None];
    let mut last_compute_of_step: Vec<Option<usize>> = vec![None; prog.steps.len()];
    let mut first_comm_seen = vec![false; prog.steps.len()];
    for (id, &(step, index, op)) in flat.iter().enumerate() {
        let lane = lanes[id];
        let o = lane.other().index();
        let (r, w) = reads_writes(op, &prog.bufs);
        let mut need: Option<usize> = None;
        let mut want = |x: Option<usize>| {
            if let Some(x) = x {
                need = Some(need.map_or(x, |n: usize| n.max(x)));
            }
        };
        for b in &r {
            want(st[*b].writer[o]);
        }
        for b in &w {
            want(st[*b].user[o]);
        }
        if let Op::Comm { sends, .. } = op {
            if sends.is_empty() {
                want(last_compute_of_step[step]);
            }
        }
        if lane == Lane::Comm && !first_comm_seen[step] {
            first_comm_seen[step] = true;
            if step >= 2 {
                // Double buffering: the last compute op issued up to step t-2.
                want((0..=step - 2).rev().find_map(|s| last_compute_of_step[s]));
            }
        }
        let wait = match (need, waited[lane.index()]) {
            (Some(n), Some(done)) if n <= done => None,
            (n, _) => n,
        };
        if let Some(n) = wait {
            waited[lane.index()] = Some(n);
        }
        let li = lane.index();
        for b in &r {
            st[*b].user[li] = Some(id);
        }
        for b in &w {
            st[*b].user[li] = Some(id);
            st[*b].writer[li] = Some(id);
        }
        if lane == Lane::Compute {
            last_compute_of_step[step] = Some(id);
        }
        ops.push(SchedOp { id, step, index, lane, wait, signals: false });
    }
    let waits: Vec<usize> = ops.iter().filter_map(|o| o.wait).collect();
    for w in waits {
        ops[w].signals = true;
    }
    let issue = issue_order(&ops);
    Schedule { ops, issue, home }
}

/// Compute first wherever possible (module docs). The comm lane's next op is always ready when
/// the compute lane's is not: every op before the lower of the two heads has been issued, and
/// a wait names an earlier op.
fn issue_order(ops: &[SchedOp]) -> Vec<usize> {
    let lane = |l: Lane| ops.iter().filter(|o| o.lane == l).map(|o| o.id).collect::<Vec<_>>();
    let (compute, comm) = (lane(Lane::Compute), lane(Lane::Comm));
    let (mut c, mut m) = (0, 0);
    let mut issued = vec![false; ops.len()];
    let mut order = Vec::with_capacity(ops.len());
    while c < compute.len() || m < comm.len() {
        let compute_ready = c < compute.len() && ops[compute[c]].wait.is_none_or(|w| issued[w]);
        let id = if compute_ready || m == comm.len() {
            c += 1;
            compute[c - 1]
        } else {
            m += 1;
            comm[m - 1]
        };
        issued[id] = true;
        order.push(id);
    }
    order
}

impl Schedule {
    /// For every op, the latest op of each lane known complete when it starts (through lane
    /// order and waits, transitively). Used by tests to check that every dependency is covered.
    pub fn known_done(&self) -> Vec<[Option<usize>; 2]> {
        let mut last_on_lane: [Option<usize>; 2] = [None, None];
        let mut known: Vec<[Option<usize>; 2]> = Vec::with_capacity(self.ops.len());
        for op in &self.ops {
            let li = op.lane.index();
            let mut k = match last_on_lane[li] {
                Some(p) => {
                    let mut kp = known[p];
                    kp[li] = Some(p);
                    kp
                }
                None => [None, None],
            };
            if let Some(w) = op.wait {
                let mut kw = known[w];
                kw[op.lane.other().index()] = Some(w);
                for l in 0..2 {
                    k[l] = match (k[l], kw[l]) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                }
            }
            known.push(k);
            last_on_lane[li] = Some(op.id);
        }
        known
    }

    /// Comm ops of step `t` that wait for compute issued in step `t-1` (no overlap possible).
    pub fn comm_blocked_by_previous_step(&self, t: usize) -> usize {
        self.ops
            .iter()
            .filter(|o| o.step == t && o.lane == Lane::Comm)
            .filter(|o| o.wait.is_some_and(|w| self.ops[w].step + 1 == t && self.ops[w].lane == Lane::Compute))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Pass, PlanOptions, RingBackward};
    use crate::planner::build;
    use crate::{AttnShape, DType, Mask, Strategy};

    fn check_deps(prog: &RankProgram, s: &Schedule) {
        let flat: Vec<&Op> = prog.steps.iter().flatten().collect();
        let known = s.known_done();
        for (b_id, b) in flat.iter().enumerate() {
            let (rb, wb) = reads_writes(b, &prog.bufs);
            for (a_id, a) in flat[..b_id].iter().enumerate() {
                let (ra, wa) = reads_writes(a, &prog.bufs);
                let conflict = wa.iter().any(|x| rb.contains(x) || wb.contains(x)) || ra.iter().any(|x| wb.contains(x));
                let (la, lb) = (s.ops[a_id].lane, s.ops[b_id].lane);
                if !conflict || la == lb {
                    continue;
                }
                let k = known[b_id][la.index()];
                assert!(
                    k.is_some_and(|k| k >= a_id),
                    "op {b_id} {b:?} on {lb:?} does not wait for op {a_id} {a:?} on {la:?}"
                );
            }
        }
    }

    #[test]
    fn every_strategy_schedule_covers_dependencies() {
        let shape = AttnShape::new(1, 512, 512, 8, 4, 16).unwrap();
        let masks = [
            Mask::causal(512, 512).unwrap(),
            Mask::full(512, 512).unwrap(),
            Mask::sliding_window(512, 512, Some(60), Some(0)).unwrap(),
        ];
        for p in [2usize, 4] {
            for st in Strategy::ALL {
                for mask in &masks {
                    let mut opts = vec![PlanOptions::forward()];
                    opts.push(PlanOptions::backward(RingBackward::KvCirculate));
                    if st.is_ring() {
                        opts.push(PlanOptions::backward(RingBackward::QCirculate));
                    }
                    for o in opts {
                        let plan = match build(st, p, &shape, mask, DType::BF16, &o) {
                            Ok(pl) => pl,
                            Err(crate::Error::Unsupported { .. }) => continue,
                            Err(e) => panic!("{st:?} on {p} ranks: {e}"),
                        };
                        for prog in &plan.ranks {
                            let s = schedule(prog);
                            check_deps(prog, &s);
                            check_issue_order(&s);
                        }
                    }
                }
            }
        }
    }

    /// The issue order is a permutation that keeps each lane's order, issues every waited-for
    /// op before its waiter, and puts compute first where it can.
    fn check_issue_order(s: &Schedule) {
        let mut seen = vec![false; s.ops.len()];
        let mut last = [None::<usize>; 2];
        for &i in &s.issue {
            let o = &s.ops[i];
            assert!(!seen[i], "op {i} issued twice");
            if let Some(w) = o.wait {
                assert!(seen[w], "op {i} waits for op {w}, not yet issued");
            }
            assert!(last[o.lane.index()].is_none_or(|p| p < i), "lane {:?} out of program order at op {i}", o.lane);
            last[o.lane.index()] = Some(i);
            seen[i] = true;
        }
        assert!(seen.iter().all(|&x| x), "some op never issued");
        // Compute first: a comm op is issued only while the compute lane's next op waits for
        // something unissued, or when no compute op is left.
        let mut done = vec![false; s.ops.len()];
        let compute: Vec<usize> = s.ops.iter().filter(|o| o.lane == Lane::Compute).map(|o| o.id).collect();
        let mut c = 0;
        for &i in &s.issue {
            if s.ops[i].lane == Lane::Comm && c < compute.len() {
                let w = s.ops[compute[c]].wait;
                assert!(w.is_some_and(|w| !done[w]), "comm op {i} issued before ready compute op {}", compute[c]);
            }
            if s.ops[i].lane == Lane::Compute {
                c += 1;
            }
            done[i] = true;
        }
    }

    #[test]
    fn ring_forward_transfers_overlap_compute() {
        let shape = AttnShape::new(1, 1024, 1024, 8, 8, 16).unwrap();
        let mask = Mask::causal(1024, 1024).unwrap();
        for st in [Strategy::Ring, Strategy::Zigzag, Strategy::Striped] {
            let plan = build(st, 4, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
            for (r, prog) in plan.ranks.iter().enumerate() {
                let s = schedule(prog);
                for t in 1..plan.steps() {
                    assert_eq!(
                        s.comm_blocked_by_previous_step(t),
                        0,
                        "{st} step {t}: transfer waits for the previous compute"
                    );
                }
                // The own block's kernel is issued before the first NCCL group.
                let first = |l: Lane| {
                    s.issue.iter().position(|&i| {
                        s.ops[i].lane == l
                            && matches!(prog.steps.iter().flatten().nth(i), Some(Op::Fwd { .. } | Op::Comm { .. }))
                    })
                };
                assert!(first(Lane::Compute) < first(Lane::Comm), "{st} rank {r}: {:?}", s.issue);
                // Received blocks live on the comm lane, compute reads them after a wait (the last
                // rank uses every block it receives under every layout).
                if r == 3 {
                    assert!(s.ops.iter().any(|o| o.lane == Lane::Compute && o.wait.is_some()), "{st}");
                }
            }
        }
    }

    #[test]
    fn kv_circulate_backward_sends_depend_on_compute() {
        let shape = AttnShape::new(1, 1024, 1024, 8, 8, 16).unwrap();
        let mask = Mask::full(1024, 1024).unwrap();
        let plan =
            build(Strategy::Ring, 4, &shape, &mask, DType::BF16, &PlanOptions::backward(RingBackward::KvCirculate))
                .unwrap();
        assert_eq!(plan.pass, Pass::Backward);
        let s = schedule(&plan.ranks[1]);
        // dK/dV accumulators travel with K/V: some transfer must wait for compute.
        assert!(s.ops.iter().any(|o| o.lane == Lane::Comm && o.wait.is_some_and(|w| s.ops[w].lane == Lane::Compute)));
    }

    #[test]
    fn double_buffering_bounds_inflight_steps() {
        let shape = AttnShape::new(1, 2048, 2048, 8, 8, 16).unwrap();
        let mask = Mask::full(2048, 2048).unwrap();
        let plan = build(Strategy::Ring, 8, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
        let s = schedule(&plan.ranks[3]);
        let known = s.known_done();
        for o in s.ops.iter().filter(|o| o.lane == Lane::Comm && o.step >= 2) {
            let k = known[o.id][Lane::Compute.index()].expect("waits for compute");
            assert!(
                s.ops[k].step + 2 >= o.step,
                "comm of step {} starts before compute of step {} ended",
                o.step,
                o.step - 2
            );
        }
    }

    #[test]
    fn a_group_that_only_receives_waits_for_its_steps_earlier_blocks() {
        // Dispatch, causal: rank 0 holds the early keys, so its backward sends nothing back and
        // receives the partial dK/dV the others compute for its keys.
        let shape = AttnShape::new(1, 4096, 4096, 8, 8, 16).unwrap();
        let mask = Mask::causal(4096, 4096).unwrap();
        let plan =
            build(Strategy::Dispatch, 4, &shape, &mask, DType::BF16, &PlanOptions::backward(RingBackward::default()))
                .unwrap();
        let prog = &plan.ranks[0];
        let s = schedule(prog);
        let flat: Vec<&Op> = prog.steps.iter().flatten().collect();
        let mut checked = 0;
        for o in &s.ops {
            let Op::Comm { sends, .. } = flat[o.id] else { continue };
            if !sends.is_empty() {
                continue;
            }
            let before = s.ops[..o.id].iter().filter(|p| p.step == o.step && matches!(flat[p.id], Op::Bwd { .. }));
            let last = before.map(|p| p.id).max().expect("a block before the receive");
            let known = s.known_done()[o.id][Lane::Compute.index()];
            assert!(known.is_some_and(|k| k >= last), "receive {} posted before block {last} ends", o.id);
            checked += 1;
        }
        assert_eq!(checked, 1);
    }
}

//! Incremental construction of a plan, shared by the planners.

use crate::plan::{area, BufDesc, BufId, Fill, Layout, Op, Pass, Plan, PlanOptions, RankProgram, Tensor, TokenSet};
use crate::{AttnShape, DType, Error, Mask, Result, Strategy};
use std::ops::Range;

/// Incremental construction of a plan; used by the strategy planners.
pub(crate) struct Builder<'a> {
    pub strategy: Strategy,
    pub world: usize,
    pub shape: AttnShape,
    pub mask: &'a Mask,
    pub dtype: DType,
    pub opts: &'a PlanOptions,
    pub layout: Option<Layout>,
    pub progs: Vec<RankProgram>,
    labels: Vec<String>,
    /// (rank, step, phase) → index of that group's Comm op in the step.
    comm_at: std::collections::HashMap<(usize, usize, usize), usize>,
}

impl<'a> Builder<'a> {
    pub(super) fn new(
        strategy: Strategy,
        world: usize,
        shape: &AttnShape,
        mask: &'a Mask,
        dtype: DType,
        opts: &'a PlanOptions,
    ) -> Self {
        let empty = RankProgram { bufs: Vec::new(), inputs: Vec::new(), outputs: Vec::new(), steps: Vec::new() };
        Builder {
            strategy,
            world,
            shape: *shape,
            mask,
            dtype,
            opts,
            layout: None,
            progs: vec![empty; world],
            labels: Vec::new(),
            comm_at: Default::default(),
        }
    }

    pub fn pass(&self) -> Pass {
        self.opts.pass()
    }

    pub fn unsupported(&self, reason: impl Into<String>) -> Error {
        Error::Unsupported { strategy: self.strategy.to_string(), reason: reason.into() }
    }

    /// All query heads / all kv heads.
    pub fn all_heads(&self, kv: bool) -> Range<usize> {
        0..if kv { self.shape.kv_heads } else { self.shape.heads }
    }

    pub fn buf(&mut self, rank: usize, desc: BufDesc) -> BufId {
        self.progs[rank].bufs.push(desc);
        self.progs[rank].bufs.len() - 1
    }

    pub fn desc(&self, rank: usize, buf: BufId) -> &BufDesc {
        &self.progs[rank].bufs[buf]
    }

    /// Sets the layout and declares every rank's input shards; returns their buffer ids per
    /// rank, in the order of `tensors`.
    pub fn inputs(&mut self, layout: Layout, tensors: &[Tensor]) -> Vec<Vec<BufId>> {
        let mut out = Vec::new();
        for r in 0..self.world {
            let mut ids = Vec::new();
            for &t in tensors {
                let tokens = if t.is_kv() { layout.k[r].clone() } else { layout.q[r].clone() };
                let id = self.buf(r, BufDesc::new(t, tokens, self.all_heads(t.is_kv())));
                self.progs[r].inputs.push((t, id));
                ids.push(id);
            }
            out.push(ids);
        }
        self.layout = Some(layout);
        out
    }

    /// Declares standard inputs of the pass: forward Q, K, V; backward Q, K, V, dO, LSE, D.
    pub fn pass_inputs(&mut self, layout: Layout) -> Vec<Vec<BufId>> {
        let t: &[Tensor] = match self.pass() {
            Pass::Forward => &[Tensor::Q, Tensor::K, Tensor::V],
            Pass::Backward => &[Tensor::Q, Tensor::K, Tensor::V, Tensor::DO, Tensor::Lse, Tensor::Delta],
        };
        self.inputs(layout, t)
    }

    /// Allocates the standard output accumulators of the pass in the layout (forward O, LSE;
    /// backward dQ, dK, dV) at step 0, and marks them as outputs.
    pub fn pass_outputs(&mut self) -> Vec<Vec<BufId>> {
        let layout = self.layout.clone().expect("inputs declared first");
        let t: &[(Tensor, Fill)] = match self.pass() {
            Pass::Forward => &[(Tensor::O, Fill::Zero), (Tensor::Lse, Fill::NegInf)],
            Pass::Backward => &[(Tensor::DQ, Fill::Zero), (Tensor::DK, Fill::Zero), (Tensor::DV, Fill::Zero)],
        };
        let mut out = Vec::new();
        for r in 0..self.world {
            let mut ids = Vec::new();
            for &(tensor, fill) in t {
                let tokens = if tensor.is_kv() { layout.k[r].clone() } else { layout.q[r].clone() };
                let id = self.alloc(r, 0, BufDesc::new(tensor, tokens, self.all_heads(tensor.is_kv())), fill);
                self.progs[r].outputs.push((tensor, id));
                ids.push(id);
            }
            out.push(ids);
        }
        out
    }

    /// Ensures steps `0..=step` exist, labelling new ones.
    pub fn label(&mut self, step: usize, label: impl Into<String>) {
        self.ensure(step);
        self.labels[step] = label.into();
    }

    fn ensure(&mut self, step: usize) {
        while self.labels.len() <= step {
            self.labels.push(format!("step {}", self.labels.len()));
        }
        for p in &mut self.progs {
            while p.steps.len() <= step {
                p.steps.push(Vec::new());
            }
        }
    }

    pub fn push(&mut self, rank: usize, step: usize, op: Op) {
        self.ensure(step);
        self.progs[rank].steps[step].push(op);
    }

    /// A new buffer, allocated with `fill` at `step`.
    pub fn alloc(&mut self, rank: usize, step: usize, desc: BufDesc, fill: Fill) -> BufId {
        let id = self.buf(rank, desc);
        self.push(rank, step, Op::Alloc { buf: id, fill });
        id
    }

    /// A new buffer holding the `tokens × heads` part of `src`.
    pub fn extract(&mut self, rank: usize, step: usize, src: BufId, tokens: TokenSet, heads: Range<usize>) -> BufId {
        let tensor = self.desc(rank, src).tensor;
        let dst = self.alloc(rank, step, BufDesc::new(tensor, tokens, heads), Fill::Zero);
        self.push(rank, step, Op::Copy { src, dst });
        dst
    }

    fn comm_op(&mut self, rank: usize, step: usize, phase: usize) -> &mut Op {
        self.ensure(step);
        let at = match self.comm_at.get(&(rank, step, phase)) {
            Some(&i) => i,
            None => {
                let steps = &mut self.progs[rank].steps[step];
                steps.push(Op::Comm { phase, sends: Vec::new(), recvs: Vec::new() });
                let i = steps.len() - 1;
                self.comm_at.insert((rank, step, phase), i);
                i
            }
        };
        &mut self.progs[rank].steps[step][at]
    }

    /// Sends buffer `src` of rank `from` to rank `to` in the group (step, phase); returns the
    /// id of the received buffer on `to`. Every rank must post its groups in increasing
    /// (step, phase) order, so planners emit phase-0 transfers of a step before its compute.
    pub fn transfer(&mut self, step: usize, phase: usize, from: usize, to: usize, src: BufId) -> BufId {
        assert_ne!(from, to, "transfer to self");
        let global_phase = step * 16 + phase;
        let desc = self.desc(from, src).clone();
        let dst = self.buf(to, desc);
        if let Op::Comm { sends, .. } = self.comm_op(from, step, global_phase) {
            sends.push((to, src));
        }
        if let Op::Comm { recvs, .. } = self.comm_op(to, step, global_phase) {
            recvs.push((from, dst));
        }
        dst
    }

    /// Kept pairs between two buffers' token sets.
    pub fn area(&self, q_rank: usize, q: BufId, k_rank: usize, k: BufId) -> u64 {
        area(self.mask, &self.desc(q_rank, q).tokens, &self.desc(k_rank, k).tokens)
    }

    /// Pushes a forward block if it keeps any pair.
    pub fn fwd(&mut self, rank: usize, step: usize, q: BufId, k: BufId, v: BufId, o: BufId, lse: BufId) -> bool {
        let area = self.area(rank, q, rank, k);
        if area > 0 {
            self.push(rank, step, Op::Fwd { q, k, v, o, lse, area });
        }
        area > 0
    }

    /// Pushes a backward block if it keeps any pair.
    #[allow(clippy::too_many_arguments)]
    pub fn bwd(&mut self, rank: usize, step: usize, inp: [BufId; 6], dq: BufId, dk: BufId, dv: BufId) -> bool {
        let [q, k, v, d_o, lse, delta] = inp;
        let area = self.area(rank, q, rank, k);
        if area > 0 {
            self.push(rank, step, Op::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, area });
        }
        area > 0
    }

    /// Drops empty steps, inserts frees after each buffer's last use, and assembles the plan.
    pub(super) fn finish(mut self) -> Result<Plan> {
        let layout = self
            .layout
            .take()
            .ok_or_else(|| Error::Internal(format!("the {} planner declared no layout", self.strategy)))?;
        self.ensure(0);
        // Drop steps in which no rank does anything.
        let keep: Vec<bool> =
            (0..self.labels.len()).map(|t| self.progs.iter().any(|p| !p.steps[t].is_empty())).collect();
        let mut labels = Vec::new();
        for (t, l) in self.labels.iter().enumerate() {
            if keep[t] {
                labels.push(l.clone());
            }
        }
        for p in &mut self.progs {
            let steps = std::mem::take(&mut p.steps);
            p.steps = steps.into_iter().zip(&keep).filter(|(_, k)| **k).map(|(s, _)| s).collect();
            insert_frees(p);
        }
        if labels.is_empty() {
            labels.push("step 0".into());
            for p in &mut self.progs {
                p.steps.push(Vec::new());
            }
        }
        let plan = Plan {
            strategy: self.strategy,
            pass: self.pass(),
            ring_backward: self.opts.ring_backward,
            world: self.world,
            shape: self.shape,
            dtype: self.dtype,
            layout,
            step_labels: labels,
            ranks: self.progs,
        };
        debug_assert!(plan.validate().is_ok(), "{:?}", plan.validate());
        Ok(plan)
    }
}

/// Frees every non-input, non-output buffer right after its last use.
fn insert_frees(p: &mut RankProgram) {
    let n = p.bufs.len();
    let mut keep = vec![false; n];
    for &(_, b) in p.inputs.iter().chain(&p.outputs) {
        keep[b] = true;
    }
    let mut last: Vec<Option<(usize, usize)>> = vec![None; n];
    for (t, ops) in p.steps.iter().enumerate() {
        for (i, op) in ops.iter().enumerate() {
            for b in op.uses() {
                last[b] = Some((t, i));
            }
        }
    }
    let mut frees_at: std::collections::HashMap<(usize, usize), Vec<BufId>> = Default::default();
    for b in 0..n {
        if let (false, Some(at)) = (keep[b], last[b]) {
            frees_at.entry(at).or_default().push(b);
        }
    }
    for (t, ops) in p.steps.iter_mut().enumerate() {
        let old = std::mem::take(ops);
        for (i, op) in old.into_iter().enumerate() {
            ops.push(op);
            if let Some(bs) = frees_at.get(&(t, i)) {
                ops.extend(bs.iter().map(|&buf| Op::Free { buf }));
            }
        }
    }
}

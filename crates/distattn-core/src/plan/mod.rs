//! Context-parallel attention as plans: pure data that says, for every rank and step, which
//! buffers to send and receive, which (query set × key set) block to compute with which mask
//! area, and how partial results merge.
//!
//! A [`Plan`] is built by a strategy's planner ([`build`]) and run by a generic executor (crate
//! `distattn-dist`) that knows nothing about strategies. Each rank runs a [`RankProgram`]: a
//! list of steps, each a list of [`Op`]s over rank-local buffers ([`BufDesc`]: a tensor, a
//! [`TokenSet`] of global tokens and a head range). Communication is point-to-point sends and
//! receives posted together as one group ([`Op::Comm`]); every rank posts its groups in the same
//! global (step, phase) order, so no schedule can deadlock.
//!
//! Plans are per chunk, never per token: building one for 128k tokens and 8 ranks takes
//! milliseconds, and [`Plan::summary`] reports FLOPs, bytes, imbalance and peak memory.
#![allow(clippy::too_many_arguments, clippy::single_range_in_vec_init)]

pub mod cost;
pub mod layout;

pub use cost::{PlanSummary, StepCost};
pub use layout::{area, split_even, sub_mask, Layout, LayoutKind, TokenSet};

use crate::{AttnShape, DType, Error, Mask, Result, Strategy};
use std::ops::Range;

/// Index of a buffer in a rank's buffer table.
pub type BufId = usize;

/// The tensor a buffer holds a piece of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Tensor {
    Q,
    K,
    V,
    /// Output (or a partial output), f32.
    O,
    /// Log-sum-exp (or a partial one), f32, `[b, h, n]`.
    Lse,
    /// Output gradient, input dtype.
    DO,
    /// Row sums D = rowsum(dO ∘ O), f32, `[b, h, n]`.
    Delta,
    DQ,
    DK,
    DV,
}

impl Tensor {
    /// Stored `[batch, heads, tokens]` (one value per row) rather than `[batch, tokens, heads, d]`.
    pub fn is_stats(self) -> bool {
        matches!(self, Tensor::Lse | Tensor::Delta)
    }

    /// Stored in the input dtype (otherwise f32).
    pub fn is_input(self) -> bool {
        matches!(self, Tensor::Q | Tensor::K | Tensor::V | Tensor::DO)
    }

    /// Indexed by key tokens and key/value heads.
    pub fn is_kv(self) -> bool {
        matches!(self, Tensor::K | Tensor::V | Tensor::DK | Tensor::DV)
    }

    /// Storage dtype given the input dtype.
    pub fn dtype(self, input: DType) -> DType {
        if self.is_input() {
            input
        } else {
            DType::F32
        }
    }
}

/// What a rank-local buffer holds: `tensor` restricted to `tokens` (global positions) and
/// `heads` (query heads, or key/value heads for K, V, dK, dV). Memory order is
/// `[batch, tokens, heads, head_dim]`, or `[batch, heads, tokens]` for LSE and D.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BufDesc {
    pub tensor: Tensor,
    pub tokens: TokenSet,
    pub heads: Range<usize>,
}

impl BufDesc {
    pub fn new(tensor: Tensor, tokens: TokenSet, heads: Range<usize>) -> Self {
        BufDesc { tensor, tokens, heads }
    }

    /// Element count.
    pub fn elems(&self, shape: &AttnShape) -> usize {
        let per = if self.tensor.is_stats() { 1 } else { shape.head_dim };
        shape.batch * self.tokens.len() * self.heads.len() * per
    }

    /// Size in bytes given the input dtype.
    pub fn bytes(&self, shape: &AttnShape, input: DType) -> u64 {
        (self.elems(shape) * self.tensor.dtype(input).size()) as u64
    }

    /// The kernel shape of a (query buffer, key buffer) block.
    pub fn block_shape(q: &BufDesc, k: &BufDesc, shape: &AttnShape) -> AttnShape {
        AttnShape {
            batch: shape.batch,
            q_len: q.tokens.len(),
            k_len: k.tokens.len(),
            heads: q.heads.len(),
            kv_heads: k.heads.len(),
            head_dim: shape.head_dim,
        }
    }
}

/// Initial value of an allocated buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fill {
    /// 0 (sums, outputs).
    Zero,
    /// −inf (an LSE accumulator no key has reached yet).
    NegInf,
}

impl Fill {
    pub fn value(self) -> f32 {
        match self {
            Fill::Zero => 0.0,
            Fill::NegInf => f32::NEG_INFINITY,
        }
    }

    fn from_value(x: f32) -> Fill {
        if x == f32::NEG_INFINITY {
            Fill::NegInf
        } else {
            debug_assert_eq!(x, 0.0, "buffers start at 0 or -inf");
            Fill::Zero
        }
    }
}

/// One operation of a rank's program.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Op {
    /// Point-to-point sends and receives posted together as one group. Received buffers are
    /// allocated from their descriptors.
    Comm { phase: usize, sends: Vec<(usize, BufId)>, recvs: Vec<(usize, BufId)> },
    /// Allocates a buffer filled with `fill` (0 for sums, −inf for an LSE accumulator).
    Alloc { buf: BufId, fill: Fill },
    /// Copies the (tokens ∩, heads ∩) part of `src` into `dst`.
    Copy { src: BufId, dst: BufId },
    /// Adds the (tokens ∩, heads ∩) part of `src` into `dst` (f32 gradients).
    Add { src: BufId, dst: BufId },
    /// Merges a partial (O, LSE) into an accumulator covering its tokens and heads.
    Merge { o: BufId, lse: BufId, o_acc: BufId, lse_acc: BufId },
    /// Attention of the query buffer against the key/value buffers, merged into (o, lse).
    /// `area` is the number of kept (query, key) pairs per head and batch entry.
    Fwd { q: BufId, k: BufId, v: BufId, o: BufId, lse: BufId, area: u64 },
    /// Exact partial gradients of the block, added into dq, dk, dv.
    Bwd {
        q: BufId,
        k: BufId,
        v: BufId,
        d_o: BufId,
        lse: BufId,
        delta: BufId,
        dq: BufId,
        dk: BufId,
        dv: BufId,
        area: u64,
    },
    /// The buffer is no longer needed.
    Free { buf: BufId },
}

impl Op {
    /// Buffers the op reads or writes.
    pub fn uses(&self) -> Vec<BufId> {
        match self {
            Op::Comm { sends, recvs, .. } => sends.iter().chain(recvs).map(|x| x.1).collect(),
            Op::Alloc { buf, .. } | Op::Free { buf } => vec![*buf],
            Op::Copy { src, dst } | Op::Add { src, dst } => vec![*src, *dst],
            Op::Merge { o, lse, o_acc, lse_acc } => vec![*o, *lse, *o_acc, *lse_acc],
            Op::Fwd { q, k, v, o, lse, .. } => vec![*q, *k, *v, *o, *lse],
            Op::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, .. } => vec![*q, *k, *v, *d_o, *lse, *delta, *dq, *dk, *dv],
        }
    }
}

/// One rank's program.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankProgram {
    /// Descriptors of every buffer the program uses, indexed by [`BufId`].
    pub bufs: Vec<BufDesc>,
    /// Buffers the caller provides (this rank's shard of each input tensor, in layout order).
    pub inputs: Vec<(Tensor, BufId)>,
    /// Buffers the caller gets back (this rank's shard of each output).
    pub outputs: Vec<(Tensor, BufId)>,
    /// `steps[t]` is the ops of step t, executed in order.
    pub steps: Vec<Vec<Op>>,
}

/// Forward or backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    Forward,
    Backward,
}

/// How ring-style strategies run the backward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RingBackward {
    /// K and V circulate (each visit's dK/dV goes back to the owner); Q, dO, LSE, D, dQ stay.
    #[default]
    KvCirculate,
    /// BurstAttention: Q, dO, LSE and D circulate (each visit's dQ goes back to the owner);
    /// K, V, dK, dV stay.
    QCirculate,
}

/// Options of a planner.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PlanOptions {
    /// Forward (default) or backward.
    pub pass: Option<Pass>,
    /// Backward variant of ring strategies.
    pub ring_backward: RingBackward,
    /// Chunk size in tokens of the dispatch solver (default: about 16 chunks per rank).
    pub chunk_tokens: Option<usize>,
    /// Document lengths of a packed batch: zigzag then uses the per-document zig-zag layout.
    pub documents: Option<Vec<usize>>,
    /// Balanced: run the published last step (owners only, half the ranks idle for even P)
    /// instead of splitting its blocks between owner and idle rank.
    #[serde(default)]
    pub balanced_no_split: bool,
}

impl PlanOptions {
    pub fn forward() -> Self {
        PlanOptions { pass: Some(Pass::Forward), ..Default::default() }
    }

    pub fn backward(ring_backward: RingBackward) -> Self {
        PlanOptions { pass: Some(Pass::Backward), ring_backward, ..Default::default() }
    }

    /// These options for `pass`.
    pub fn with_pass(&self, pass: Pass) -> Self {
        PlanOptions { pass: Some(pass), ..self.clone() }
    }

    pub fn pass(&self) -> Pass {
        self.pass.unwrap_or(Pass::Forward)
    }
}

/// A complete distributed schedule (serialisable: `serde_json::to_string(&plan)` gives every
/// rank's program).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    pub strategy: Strategy,
    pub pass: Pass,
    pub ring_backward: RingBackward,
    pub world: usize,
    pub shape: AttnShape,
    pub dtype: DType,
    pub layout: Layout,
    /// One label per step (for the table).
    pub step_labels: Vec<String>,
    pub ranks: Vec<RankProgram>,
}

impl Plan {
    pub fn steps(&self) -> usize {
        self.step_labels.len()
    }

    /// Checks structural invariants: buffers are defined before use, sends match receives with
    /// equal descriptors, compute blocks are consistent with the shapes.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Error::Comm(format!("invalid plan ({}): {m}", self.strategy));
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
                    }
                    Op::Comm { phase, sends, .. } => {
                        for &(to, buf) in sends {
                            let peer = &self.ranks[to];
                            let ok = peer.steps.iter().flatten().any(|o| match o {
                                Op::Comm { phase: p, recvs, .. } => {
                                    p == phase
                                        && recvs.iter().any(|&(from, rb)| from == r && peer.bufs[rb] == prog.bufs[buf])
                                }
                                _ => false,
                            });
                            if !ok {
                                return Err(bad(format!(
                                    "rank {r} sends buffer {buf} to {to}, which never receives it"
                                )));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// Builds the plan of `strategy` for `world` ranks.
pub fn build(
    strategy: Strategy,
    world: usize,
    shape: &AttnShape,
    mask: &Mask,
    dtype: DType,
    opts: &PlanOptions,
) -> Result<Plan> {
    shape.validate()?;
    if world == 0 {
        return Err(Error::ZeroDim { what: "world size" });
    }
    mask.check_fits(shape)?;
    let mut b = Builder::new(strategy, world, shape, mask, dtype, opts);
    crate::planner::plan_into(strategy, &mut b)?;
    b.finish()
}

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
    fn new(
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
        let t: &[(Tensor, f32)] = match self.pass() {
            Pass::Forward => &[(Tensor::O, 0.0), (Tensor::Lse, f32::NEG_INFINITY)],
            Pass::Backward => &[(Tensor::DQ, 0.0), (Tensor::DK, 0.0), (Tensor::DV, 0.0)],
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
    pub fn alloc(&mut self, rank: usize, step: usize, desc: BufDesc, fill: f32) -> BufId {
        let id = self.buf(rank, desc);
        self.push(rank, step, Op::Alloc { buf: id, fill: Fill::from_value(fill) });
        id
    }

    /// A new buffer holding the `tokens × heads` part of `src`.
    pub fn extract(&mut self, rank: usize, step: usize, src: BufId, tokens: TokenSet, heads: Range<usize>) -> BufId {
        let tensor = self.desc(rank, src).tensor;
        let dst = self.alloc(rank, step, BufDesc::new(tensor, tokens, heads), 0.0);
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
    fn finish(mut self) -> Result<Plan> {
        let layout = self.layout.take().ok_or_else(|| self.unsupported("planner declared no layout"))?;
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

#[cfg(test)]
mod tests;

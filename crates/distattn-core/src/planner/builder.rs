//! Incremental construction of a plan, shared by the planners, and the named buffer sets they
//! move and compute on.

use crate::plan::{area, BufDesc, BufId, Fill, Layout, Op, Pass, Plan, PlanOptions, RankProgram, Tensor, TokenSet};
use crate::{AttnShape, DType, Error, Mask, Result, Strategy};
use std::ops::Range;

/// A named set of buffers that planners send, split and add as a unit.
pub(crate) trait BufSet: Copy {
    /// Maps every buffer, in field order, to a pair; returns the set of first and the set of
    /// second elements. Field order is the order in which planners create and send buffers.
    fn unzip_map(self, f: impl FnMut(BufId) -> (BufId, BufId)) -> (Self, Self);

    /// The set with every buffer replaced by `f(buffer)`, called in field order.
    fn map(self, mut f: impl FnMut(BufId) -> BufId) -> Self {
        self.unzip_map(|buf| {
            let new = f(buf);
            (new, new)
        })
        .0
    }

    /// The buffers, in field order.
    fn bufs(self) -> Vec<BufId> {
        let mut bufs = Vec::new();
        self.map(|buf| {
            bufs.push(buf);
            buf
        });
        bufs
    }
}

/// A single buffer (the query side of a forward block, a dQ partial).
impl BufSet for BufId {
    fn unzip_map(self, mut f: impl FnMut(BufId) -> (BufId, BufId)) -> (Self, Self) {
        f(self)
    }
}

/// Key and value buffers of a block: what a forward ring circulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvBufs {
    pub k: BufId,
    pub v: BufId,
}

impl BufSet for KvBufs {
    fn unzip_map(self, mut f: impl FnMut(BufId) -> (BufId, BufId)) -> (Self, Self) {
        let (k, v) = (f(self.k), f(self.v));
        (KvBufs { k: k.0, v: v.0 }, KvBufs { k: k.1, v: v.1 })
    }
}

/// The query side of a backward block: query rows and the per-row inputs their gradient needs.
/// What BurstAttention's backward ring circulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueryBufs {
    pub q: BufId,
    pub d_o: BufId,
    pub lse: BufId,
    pub delta: BufId,
}

impl BufSet for QueryBufs {
    fn unzip_map(self, mut f: impl FnMut(BufId) -> (BufId, BufId)) -> (Self, Self) {
        let (q, d_o, lse, delta) = (f(self.q), f(self.d_o), f(self.lse), f(self.delta));
        (
            QueryBufs { q: q.0, d_o: d_o.0, lse: lse.0, delta: delta.0 },
            QueryBufs { q: q.1, d_o: d_o.1, lse: lse.1, delta: delta.1 },
        )
    }
}

/// A forward block's output (or partial output) and its log-sum-exp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutBufs {
    pub o: BufId,
    pub lse: BufId,
}

impl BufSet for OutBufs {
    fn unzip_map(self, mut f: impl FnMut(BufId) -> (BufId, BufId)) -> (Self, Self) {
        let (o, lse) = (f(self.o), f(self.lse));
        (OutBufs { o: o.0, lse: lse.0 }, OutBufs { o: o.1, lse: lse.1 })
    }
}

/// Gradients of a block's keys and values (accumulators, or partials for their owner).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvGradBufs {
    pub dk: BufId,
    pub dv: BufId,
}

impl BufSet for KvGradBufs {
    fn unzip_map(self, mut f: impl FnMut(BufId) -> (BufId, BufId)) -> (Self, Self) {
        let (dk, dv) = (f(self.dk), f(self.dv));
        (KvGradBufs { dk: dk.0, dv: dv.0 }, KvGradBufs { dk: dk.1, dv: dv.1 })
    }
}

/// Gradient accumulators of a backward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GradBufs {
    pub dq: BufId,
    pub dkv: KvGradBufs,
}

/// Everything a forward block reads and writes: {q, k, v, o, lse}.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FwdBufs {
    pub q: BufId,
    pub kv: KvBufs,
    pub out: OutBufs,
}

impl FwdBufs {
    /// These buffers with the inputs replaced by `f(tensor, buffer)`, in declaration order.
    fn map_inputs(self, mut f: impl FnMut(Tensor, BufId) -> BufId) -> Self {
        let q = f(Tensor::Q, self.q);
        let k = f(Tensor::K, self.kv.k);
        let v = f(Tensor::V, self.kv.v);
        FwdBufs { q, kv: KvBufs { k, v }, ..self }
    }

    /// These buffers with the outputs replaced by `f(tensor, buffer)`, in declaration order.
    fn map_outputs(self, mut f: impl FnMut(Tensor, BufId) -> BufId) -> Self {
        let o = f(Tensor::O, self.out.o);
        let lse = f(Tensor::Lse, self.out.lse);
        FwdBufs { out: OutBufs { o, lse }, ..self }
    }
}

/// Everything a backward block reads and writes: {q, k, v, dO, lse, delta, dq, dk, dv}.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BwdBufs {
    pub query: QueryBufs,
    pub kv: KvBufs,
    pub grads: GradBufs,
}

impl BwdBufs {
    /// These buffers with the inputs replaced by `f(tensor, buffer)`, in declaration order.
    fn map_inputs(self, mut f: impl FnMut(Tensor, BufId) -> BufId) -> Self {
        let q = f(Tensor::Q, self.query.q);
        let k = f(Tensor::K, self.kv.k);
        let v = f(Tensor::V, self.kv.v);
        let d_o = f(Tensor::DO, self.query.d_o);
        let lse = f(Tensor::Lse, self.query.lse);
        let delta = f(Tensor::Delta, self.query.delta);
        BwdBufs { query: QueryBufs { q, d_o, lse, delta }, kv: KvBufs { k, v }, ..self }
    }

    /// These buffers with the outputs replaced by `f(tensor, buffer)`, in declaration order.
    fn map_outputs(self, mut f: impl FnMut(Tensor, BufId) -> BufId) -> Self {
        let dq = f(Tensor::DQ, self.grads.dq);
        let dk = f(Tensor::DK, self.grads.dkv.dk);
        let dv = f(Tensor::DV, self.grads.dkv.dv);
        BwdBufs { grads: GradBufs { dq, dkv: KvGradBufs { dk, dv } }, ..self }
    }
}

/// Every rank's buffers of the pass, indexed by rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PassBufs {
    Forward(Vec<FwdBufs>),
    Backward(Vec<BwdBufs>),
}

impl PassBufs {
    /// The query buffer (Q) of `rank`.
    pub fn query(&self, rank: usize) -> BufId {
        match self {
            PassBufs::Forward(ranks) => ranks[rank].q,
            PassBufs::Backward(ranks) => ranks[rank].query.q,
        }
    }

    /// The K/V of `rank`.
    pub fn kv(&self, rank: usize) -> KvBufs {
        match self {
            PassBufs::Forward(ranks) => ranks[rank].kv,
            PassBufs::Backward(ranks) => ranks[rank].kv,
        }
    }

    /// These buffers with every input replaced by `f(rank, tensor, buffer)`, rank by rank, in
    /// declaration order.
    pub fn map_inputs(&self, mut f: impl FnMut(usize, Tensor, BufId) -> BufId) -> PassBufs {
        match self {
            PassBufs::Forward(ranks) => {
                PassBufs::Forward(ranks.iter().enumerate().map(|(r, x)| x.map_inputs(|t, buf| f(r, t, buf))).collect())
            }
            PassBufs::Backward(ranks) => {
                PassBufs::Backward(ranks.iter().enumerate().map(|(r, x)| x.map_inputs(|t, buf| f(r, t, buf))).collect())
            }
        }
    }

    /// These buffers with every output replaced by `f(rank, tensor, buffer)`, rank by rank, in
    /// declaration order.
    pub fn map_outputs(&self, mut f: impl FnMut(usize, Tensor, BufId) -> BufId) -> PassBufs {
        match self {
            PassBufs::Forward(ranks) => {
                PassBufs::Forward(ranks.iter().enumerate().map(|(r, x)| x.map_outputs(|t, buf| f(r, t, buf))).collect())
            }
            PassBufs::Backward(ranks) => PassBufs::Backward(
                ranks.iter().enumerate().map(|(r, x)| x.map_outputs(|t, buf| f(r, t, buf))).collect(),
            ),
        }
    }

    /// The inputs of `rank` with their tensors, in declaration order.
    pub fn inputs(&self, rank: usize) -> Vec<(Tensor, BufId)> {
        let mut inputs = Vec::new();
        let record = |t, buf| {
            inputs.push((t, buf));
            buf
        };
        match self {
            PassBufs::Forward(ranks) => {
                ranks[rank].map_inputs(record);
            }
            PassBufs::Backward(ranks) => {
                ranks[rank].map_inputs(record);
            }
        }
        inputs
    }

    /// The outputs of `rank` with their tensors, in declaration order.
    pub fn outputs(&self, rank: usize) -> Vec<(Tensor, BufId)> {
        let mut outputs = Vec::new();
        let record = |t, buf| {
            outputs.push((t, buf));
            buf
        };
        match self {
            PassBufs::Forward(ranks) => {
                ranks[rank].map_outputs(record);
            }
            PassBufs::Backward(ranks) => {
                ranks[rank].map_outputs(record);
            }
        }
        outputs
    }
}

/// Where a pass input is not in the layout: `(rank, tensor)` → its descriptor.
pub(crate) type Given<'a> = dyn Fn(usize, Tensor) -> Option<BufDesc> + 'a;

/// How an accumulator of `tensor` starts: −inf for an LSE (no key has reached it yet), else 0.
pub(crate) fn accumulator_fill(tensor: Tensor) -> Fill {
    if tensor == Tensor::Lse {
        Fill::NegInf
    } else {
        Fill::Zero
    }
}

/// Incremental construction of a plan; used by the strategy planners.
pub(crate) struct Builder<'a> {
    pub world: usize,
    pub shape: AttnShape,
    pub mask: &'a Mask,
    pub opts: &'a PlanOptions,
    strategy: Strategy,
    dtype: DType,
    layout: Option<Layout>,
    progs: Vec<RankProgram>,
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
        let empty = RankProgram {
            bufs: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            saved: Vec::new(),
            steps: Vec::new(),
        };
        Builder {
            world,
            shape: *shape,
            mask,
            opts,
            strategy,
            dtype,
            layout: None,
            progs: vec![empty; world],
            labels: Vec::new(),
            comm_at: Default::default(),
        }
    }

    pub fn pass(&self) -> Pass {
        self.opts.pass()
    }

    /// Whether final results of `tensor` are held in the input dtype
    /// ([`PlanOptions::narrow_outputs`]): it must be f32 and the input narrower.
    pub fn narrows(&self, tensor: Tensor) -> bool {
        self.opts.narrow_outputs && tensor.dtype(self.dtype) != self.dtype && !tensor.is_stats()
    }

    /// Holds `buf` of `rank` in the input dtype where its tensor [narrows](Self::narrows):
    /// for a buffer nothing has used yet that copies write (a pass output gathered from
    /// pieces) or one block writes whole (a forward's O no merge follows, a backward's
    /// gradients no addition follows).
    pub fn hold_narrowed(&mut self, rank: usize, buf: BufId) {
        if self.narrows(self.desc(rank, buf).tensor) {
            self.progs[rank].bufs[buf].narrow = true;
        }
    }

    /// Rounds every output that should be narrowed but is still an f32 accumulator into a new
    /// narrowed buffer, and hands that one back instead: an O that a forward block of all its
    /// rows writes last is rounded by that block (the kernel's epilogue stores both), any other
    /// output by a copy after the last step's ops.
    fn narrow_final_outputs(&mut self) {
        let Some(last) = self.labels.len().checked_sub(1) else { return };
        for rank in 0..self.world {
            for i in 0..self.progs[rank].outputs.len() {
                let (tensor, acc) = self.progs[rank].outputs[i];
                let desc = self.desc(rank, acc).clone();
                if desc.narrow || !self.narrows(tensor) {
                    continue;
                }
                let out = self.buf(rank, desc.narrowed());
                let alloc = Op::Alloc { buf: out, fill: Fill::Overwritten };
                match self.last_writer(rank, acc) {
                    Some((t, j)) if self.rounds_in_block(rank, t, j, acc) => {
                        let ops = &mut self.progs[rank].steps[t];
                        if let Op::Fwd { rounded, .. } = &mut ops[j] {
                            *rounded = Some(out);
                        }
                        ops.insert(j, alloc);
                    }
                    _ => {
                        self.push(rank, last, alloc);
                        self.push(rank, last, Op::Copy { src: acc, dst: out });
                    }
                }
                self.progs[rank].outputs[i].1 = out;
            }
        }
    }

    /// (step, index) of the last op of `rank` that writes `buf`.
    fn last_writer(&self, rank: usize, buf: BufId) -> Option<(usize, usize)> {
        let prog = &self.progs[rank];
        let at = |t: usize, j: usize| crate::schedule::reads_writes(&prog.steps[t][j], &prog.bufs).1.contains(&buf);
        (0..prog.steps.len()).rev().find_map(|t| (0..prog.steps[t].len()).rev().find(|&j| at(t, j)).map(|j| (t, j)))
    }

    /// Whether op `j` of step `t` is a forward block over all of O accumulator `acc`'s rows.
    fn rounds_in_block(&self, rank: usize, t: usize, j: usize, acc: BufId) -> bool {
        match self.progs[rank].steps[t][j] {
            Op::Fwd { q, o, .. } => o == acc && self.desc(rank, q).same_region(self.desc(rank, acc)),
            _ => false,
        }
    }

    pub fn unsupported(&self, reason: impl Into<String>) -> Error {
        Error::Unsupported { strategy: self.strategy.to_string(), reason: reason.into() }
    }

    /// All heads of `tensor`: query heads, or key/value heads for K, V, dK, dV.
    pub fn all_heads(&self, tensor: Tensor) -> Range<usize> {
        0..if tensor.is_kv() { self.shape.kv_heads } else { self.shape.heads }
    }

    fn buf(&mut self, rank: usize, desc: BufDesc) -> BufId {
        self.progs[rank].bufs.push(desc);
        self.progs[rank].bufs.len() - 1
    }

    pub fn desc(&self, rank: usize, buf: BufId) -> &BufDesc {
        &self.progs[rank].bufs[buf]
    }

    /// Sets the layout and declares every rank's shards of the pass's inputs (forward Q, K, V;
    /// backward Q, K, V, dO, LSE, D) and output accumulators (forward O, LSE; backward dQ, dK,
    /// dV; allocated at step 0).
    pub fn declare_pass(&mut self, layout: Layout) -> PassBufs {
        self.declare_pass_with(layout, &|_, _| None)
    }

    /// [`Builder::declare_pass`], a backward's inputs described by `given` where it says.
    pub fn declare_pass_with(&mut self, layout: Layout, given: &Given<'_>) -> PassBufs {
        let bufs = match self.pass() {
            Pass::Forward => PassBufs::Forward((0..self.world).map(|r| self.declare_forward(&layout, r)).collect()),
            Pass::Backward => {
                PassBufs::Backward((0..self.world).map(|r| self.declare_backward_with(&layout, r, given)).collect())
            }
        };
        self.layout = Some(layout);
        bufs
    }

    /// Hands `buf` of `rank` back as a saved buffer of `tensor` (see [`RankProgram::saved`]).
    pub fn save(&mut self, rank: usize, tensor: Tensor, buf: BufId) {
        self.progs[rank].saved.push((tensor, buf));
    }

    fn declare_forward(&mut self, layout: &Layout, rank: usize) -> FwdBufs {
        let q = self.input(layout, rank, Tensor::Q);
        let k = self.input(layout, rank, Tensor::K);
        let v = self.input(layout, rank, Tensor::V);
        let o = self.output(layout, rank, Tensor::O);
        let lse = self.output(layout, rank, Tensor::Lse);
        FwdBufs { q, kv: KvBufs { k, v }, out: OutBufs { o, lse } }
    }

    /// The backward's buffers of `rank`, inputs in `layout` except where `given(rank, tensor)`
    /// names another descriptor (Q, K, V, LSE a forward kept head-sharded).
    fn declare_backward_with(&mut self, layout: &Layout, rank: usize, given: &Given<'_>) -> BwdBufs {
        let mut input = |t| match given(rank, t) {
            Some(desc) => self.input_as(rank, t, desc),
            None => self.input(layout, rank, t),
        };
        let q = input(Tensor::Q);
        let k = input(Tensor::K);
        let v = input(Tensor::V);
        let d_o = input(Tensor::DO);
        let lse = input(Tensor::Lse);
        let delta = input(Tensor::Delta);
        let dq = self.output(layout, rank, Tensor::DQ);
        let dk = self.output(layout, rank, Tensor::DK);
        let dv = self.output(layout, rank, Tensor::DV);
        BwdBufs {
            query: QueryBufs { q, d_o, lse, delta },
            kv: KvBufs { k, v },
            grads: GradBufs { dq, dkv: KvGradBufs { dk, dv } },
        }
    }

    /// Declares `rank`'s shard of input `tensor` in `layout`.
    fn input(&mut self, layout: &Layout, rank: usize, tensor: Tensor) -> BufId {
        let desc = BufDesc::new(tensor, layout.tokens(tensor, rank).clone(), self.all_heads(tensor));
        self.input_as(rank, tensor, desc)
    }

    /// Declares `rank`'s input of `tensor` as `desc`.
    fn input_as(&mut self, rank: usize, tensor: Tensor, desc: BufDesc) -> BufId {
        let id = self.buf(rank, desc);
        self.progs[rank].inputs.push((tensor, id));
        id
    }

    /// Allocates `rank`'s accumulator of output `tensor` in `layout` at step 0.
    fn output(&mut self, layout: &Layout, rank: usize, tensor: Tensor) -> BufId {
        let desc = BufDesc::new(tensor, layout.tokens(tensor, rank).clone(), self.all_heads(tensor));
        let id = self.alloc(rank, 0, desc, accumulator_fill(tensor));
        self.progs[rank].outputs.push((tensor, id));
        id
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

    /// Moves the allocation of `buf` of `rank` (nothing has used it yet) to the start of `step`,
    /// with `fill`.
    pub fn allocate_at(&mut self, rank: usize, buf: BufId, step: usize, fill: Fill) {
        self.ensure(step);
        for ops in &mut self.progs[rank].steps {
            ops.retain(|op| !matches!(op, Op::Alloc { buf: b, .. } if *b == buf));
        }
        self.progs[rank].steps[step].insert(0, Op::Alloc { buf, fill });
        // The rank's transfer groups moved within their steps.
        let steps = &self.progs[rank].steps;
        for (&(r, t, phase), at) in self.comm_at.iter_mut() {
            if r == rank {
                if let Some(i) = steps[t].iter().position(|op| matches!(op, Op::Comm { phase: p, .. } if *p == phase)) {
                    *at = i;
                }
            }
        }
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
        self.extract_as(rank, step, src, BufDesc::new(tensor, tokens, heads))
    }

    /// The `tokens` of `src` on `rank` (all its heads), for transfers to send: `src` itself
    /// where that is all of it, a buffer stored inside `src` where they are one contiguous run
    /// of it (sent with no copy), else a copy made at `step`.
    pub fn part_to_send(&mut self, rank: usize, step: usize, src: BufId, tokens: TokenSet) -> BufId {
        let whole = self.desc(rank, src).clone();
        if whole.tokens == tokens {
            return src;
        }
        let part = BufDesc { tokens, within: None, ..whole.clone() };
        if whole.within.is_none() && part.offset_in(&whole, &self.shape).is_some() {
            return self.buf(rank, part.inside(src));
        }
        self.extract_as(rank, step, src, part)
    }

    /// A new buffer of `desc` (a part of `src`, possibly narrowed) holding that part of `src`.
    pub fn extract_as(&mut self, rank: usize, step: usize, src: BufId, desc: BufDesc) -> BufId {
        let dst = self.alloc(rank, step, desc, Fill::Overwritten);
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
        let desc = BufDesc { within: None, ..self.desc(from, src).clone() };
        let dst = self.buf(to, desc);
        self.post(step, phase, from, to, src, dst);
        dst
    }

    /// Sends buffer `src` of rank `from` to rank `to`, for `to`'s buffer `into` (allocated
    /// already) to gather: received straight into it where the part is contiguous there
    /// ([`BufDesc::offset_in`]), else received apart and copied in.
    pub fn transfer_gathered(&mut self, step: usize, phase: usize, from: usize, to: usize, src: BufId, into: BufId) {
        let desc = BufDesc { within: None, ..self.desc(from, src).clone() };
        if desc.offset_in(self.desc(to, into), &self.shape).is_some() {
            let dst = self.buf(to, desc.inside(into));
            self.post(step, phase, from, to, src, dst);
        } else {
            let got = self.transfer(step, phase, from, to, src);
            self.push(to, step, Op::Copy { src: got, dst: into });
        }
    }

    /// Adds the send of `src` on `from` and the receive into `dst` on `to` to their groups.
    fn post(&mut self, step: usize, phase: usize, from: usize, to: usize, src: BufId, dst: BufId) {
        assert_ne!(from, to, "transfer to self");
        let global_phase = step * 16 + phase;
        if let Op::Comm { sends, .. } = self.comm_op(from, step, global_phase) {
            sends.push((to, src));
        }
        if let Op::Comm { recvs, .. } = self.comm_op(to, step, global_phase) {
            recvs.push((from, dst));
        }
    }

    /// Sends every buffer of `set` from rank `from` to rank `to` in the group (step, phase);
    /// returns the set as received on `to`.
    pub fn transfer_set<S: BufSet>(&mut self, step: usize, phase: usize, from: usize, to: usize, set: S) -> S {
        set.map(|buf| self.transfer(step, phase, from, to, buf))
    }

    /// Adds every buffer of `src` into the same buffer of `dst`, on `rank` at `step`.
    pub fn add_set<S: BufSet>(&mut self, rank: usize, step: usize, src: S, dst: S) {
        for (src, dst) in src.bufs().into_iter().zip(dst.bufs()) {
            self.push(rank, step, Op::Add { src, dst });
        }
    }

    /// Zeroed dK and dV for a block against `kv` on `rank`: the partial gradients of K/V that
    /// another rank owns, to send back to it.
    pub fn kv_grad_partials(&mut self, rank: usize, step: usize, kv: KvBufs) -> KvGradBufs {
        let BufDesc { tokens, heads, .. } = self.desc(rank, kv.k).clone();
        let dk = self.alloc(rank, step, BufDesc::new(Tensor::DK, tokens.clone(), heads.clone()), Fill::Zero);
        let dv = self.alloc(rank, step, BufDesc::new(Tensor::DV, tokens, heads), Fill::Zero);
        KvGradBufs { dk, dv }
    }

    /// Kept pairs between the token sets of buffers `q` and `k` of `rank`.
    pub fn area(&self, rank: usize, q: BufId, k: BufId) -> u64 {
        area(self.mask, &self.desc(rank, q).tokens, &self.desc(rank, k).tokens)
    }

    /// Pushes a forward block if it keeps any pair.
    pub fn fwd(&mut self, rank: usize, step: usize, bufs: FwdBufs) {
        let FwdBufs { q, kv: KvBufs { k, v }, out: OutBufs { o, lse } } = bufs;
        let area = self.area(rank, q, k);
        if area > 0 {
            self.push(rank, step, Op::Fwd { q, k, v, o, lse, area, rounded: None });
        }
    }

    /// Pushes a backward block if it keeps any pair.
    pub fn bwd(&mut self, rank: usize, step: usize, bufs: BwdBufs) {
        self.bwd_rows(rank, step, bufs, None);
    }

    /// Pushes the part of a backward block over its query rows `rows` (all with `None`), if it
    /// keeps any pair.
    pub fn bwd_rows(&mut self, rank: usize, step: usize, bufs: BwdBufs, rows: Option<Range<usize>>) {
        let BwdBufs { query: QueryBufs { q, d_o, lse, delta }, kv: KvBufs { k, v }, grads } = bufs;
        let GradBufs { dq, dkv: KvGradBufs { dk, dv } } = grads;
        let area = match &rows {
            Some(r) => self.rows_area(rank, q, k, r.clone()),
            None => self.area(rank, q, k),
        };
        if area > 0 {
            self.push(rank, step, Op::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, area, rows });
        }
    }

    /// Kept pairs between query rows `rows` (positions in buffer `q`) and buffer `k` of `rank`.
    fn rows_area(&self, rank: usize, q: BufId, k: BufId, rows: Range<usize>) -> u64 {
        area(self.mask, &self.desc(rank, q).tokens.local_slice(rows), &self.desc(rank, k).tokens)
    }

    /// Where to cut the query rows of block `q` × `k` of `rank` so that each side keeps about
    /// half its pairs: a multiple of [`Self::SPLIT_ROWS`] strictly inside the block, or `None`
    /// where no such cut leaves work on both sides.
    pub fn half_area_rows(&self, rank: usize, q: BufId, k: BufId) -> Option<usize> {
        let n = self.desc(rank, q).tokens.len();
        let total = self.area(rank, q, k);
        // The smallest cut (in units of SPLIT_ROWS) whose first side keeps at least half.
        let (mut lo, mut hi) = (1, n.div_ceil(Self::SPLIT_ROWS));
        while lo < hi {
            let mid = (lo + hi) / 2;
            if 2 * self.rows_area(rank, q, k, 0..mid * Self::SPLIT_ROWS) >= total {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let cut = lo * Self::SPLIT_ROWS;
        let both = cut < n && self.rows_area(rank, q, k, 0..cut) > 0 && self.rows_area(rank, q, k, cut..n) > 0;
        both.then_some(cut)
    }

    /// Row granularity of a split block: the kernels' query tiles (64 and 128 rows) then never
    /// straddle the cut.
    pub const SPLIT_ROWS: usize = 128;

    /// Drops empty steps, inserts frees after each buffer's last use, and assembles the plan.
    pub(super) fn finish(mut self) -> Result<Plan> {
        let layout = self
            .layout
            .take()
            .ok_or_else(|| Error::Internal(format!("the {} planner declared no layout", self.strategy)))?;
        self.ensure(0);
        self.narrow_final_outputs();
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
            ranks_per_node: self.opts.ranks_per_node_of(self.world),
        };
        debug_assert!(plan.validate().is_ok(), "{:?}", plan.validate());
        Ok(plan)
    }
}

/// Frees every buffer that is no input, output or saved buffer right after its last use.
fn insert_frees(p: &mut RankProgram) {
    let n = p.bufs.len();
    let mut keep = vec![false; n];
    for &(_, b) in p.inputs.iter().chain(&p.outputs).chain(&p.saved) {
        keep[b] = true;
    }
    let mut last: Vec<Option<(usize, usize)>> = vec![None; n];
    for (t, ops) in p.steps.iter().enumerate() {
        for (i, op) in ops.iter().enumerate() {
            for b in op.uses_in(&p.bufs) {
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

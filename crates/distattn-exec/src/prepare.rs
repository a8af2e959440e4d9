//! A rank's program made ready to run, once per plan: the schedule on two lanes, every block's
//! kernel shape and sub-mask, every copy's element pieces and every merge's spec. The
//! interpreter then only runs it; a benchmark or a training loop runs it many times.

use crate::backend::Block;
use crate::pieces::{pieces, MergeSpec, Piece};
use distattn_core::plan::{sub_mask, BufDesc, BufId, Op, Pass, Plan, Tensor};
use distattn_core::schedule::{schedule, Schedule};
use distattn_core::{AttnShape, DType, Error, Mask, Result};

/// Where a forward block's output goes.
#[derive(Debug, Clone, PartialEq)]
pub enum FwdOutput {
    /// Straight into the accumulators: they still hold their fill and cover exactly the
    /// block's rows, so merging into them would only copy.
    Direct,
    /// Into fresh partials, then merged into the accumulators.
    Merge(MergeSpec),
    /// Merged into the accumulators by the kernel where the backend can: they cover exactly
    /// the block's rows but hold an earlier partial (else as `Merge`).
    MergeInKernel(MergeSpec),
}

/// Where a backward block's dQ, dK or dV goes.
#[derive(Debug, Clone, PartialEq)]
pub enum GradOutput {
    /// Added straight into the accumulator (it covers exactly the block's rows or keys), or
    /// written into it where it is held in the input dtype (a final gradient).
    Direct,
    /// Into a fresh zeroed buffer, then added into the accumulator by these pieces.
    Add(Vec<Piece>),
}

impl GradOutput {
    /// Where the gradient `part` (laid out as the block's own rows or keys) goes in `acc`.
    fn of(part: &BufDesc, acc: &BufDesc, shape: &AttnShape) -> GradOutput {
        if part.same_region(acc) {
            GradOutput::Direct
        } else {
            GradOutput::Add(pieces(part, acc, shape))
        }
    }
}

/// One send of a transfer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Send {
    pub to: usize,
    pub buf: BufId,
    /// Where the buffer is stored inside another ([`BufDesc::within`]): that buffer and the
    /// element offset there.
    pub out_of: Option<(BufId, usize)>,
}

/// One receive of a transfer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recv {
    pub from: usize,
    pub buf: BufId,
    /// Where the buffer is stored inside another ([`BufDesc::within`]): that buffer and the
    /// element offset there.
    pub into: Option<(BufId, usize)>,
}

/// One op of the program with everything it needs computed.
#[derive(Debug, Clone, PartialEq)]
pub enum PreparedOp {
    /// A transfer group: sends, of buffers or straight from a part of the buffer that holds
    /// them, and receives into new buffers, or straight into a part of a buffer that gathers
    /// them.
    Comm {
        sends: Vec<Send>,
        recvs: Vec<Recv>,
    },
    Alloc {
        buf: BufId,
        /// The initial value; `None` for a buffer that copies overwrite.
        fill: Option<f32>,
    },
    Copy {
        src: BufId,
        dst: BufId,
        pieces: Vec<Piece>,
    },
    Add {
        src: BufId,
        dst: BufId,
        pieces: Vec<Piece>,
    },
    Merge {
        o: BufId,
        lse: BufId,
        o_acc: BufId,
        lse_acc: BufId,
        spec: MergeSpec,
    },
    /// A forward block (`block` indexes [`PreparedRank::blocks`]); with `rounded`, the final O
    /// also goes, rounded to the input dtype, into that buffer (by these pieces of `o` where
    /// the merge is not the kernel's).
    Fwd {
        q: BufId,
        k: BufId,
        v: BufId,
        o: BufId,
        lse: BufId,
        block: usize,
        output: FwdOutput,
        rounded: Option<(BufId, Vec<Piece>)>,
    },
    /// A backward block; each gradient goes into its accumulator as its output says.
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
        block: usize,
        dq_output: GradOutput,
        dk_output: GradOutput,
        dv_output: GradOutput,
    },
    Free {
        buf: BufId,
    },
}

impl PreparedOp {
    /// A compute block (what the stall clock counts as progress).
    pub fn is_block(&self) -> bool {
        matches!(self, PreparedOp::Fwd { .. } | PreparedOp::Bwd { .. })
    }
}

/// One rank's program of a plan, ready to run.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedRank {
    pub rank: usize,
    pub world: usize,
    pub pass: Pass,
    /// The shape of the whole problem.
    pub shape: AttnShape,
    /// The input dtype.
    pub dtype: DType,
    /// Every buffer's descriptor, indexed by [`BufId`].
    pub bufs: Vec<BufDesc>,
    /// The buffers the caller provides, in order.
    pub inputs: Vec<(Tensor, BufId)>,
    /// The buffers the caller gets back, in order.
    pub outputs: Vec<(Tensor, BufId)>,
    /// Buffers handed back for the backward ([`distattn_core::plan::RankProgram::saved`]).
    pub saved: Vec<(Tensor, BufId)>,
    /// Steps of the plan (for timelines and injected failures).
    pub steps: usize,
    /// The ops in program order (indexed like [`Schedule::ops`]).
    pub ops: Vec<PreparedOp>,
    pub schedule: Schedule,
    pub blocks: Vec<Block>,
}

impl PreparedRank {
    /// Storage dtype of buffer `b`.
    pub fn dtype_of(&self, b: BufId) -> DType {
        self.bufs[b].dtype(self.dtype)
    }

    /// Element count of buffer `b`.
    pub fn elems_of(&self, b: BufId) -> usize {
        self.bufs[b].elems(&self.shape)
    }
}

/// Prepares rank `rank`'s program of `plan`, whose mask is `mask`.
pub fn prepare(plan: &Plan, rank: usize, mask: &Mask) -> Result<PreparedRank> {
    let prog = plan
        .ranks
        .get(rank)
        .ok_or_else(|| Error::InvalidPlan(format!("rank {rank} of a plan for {} ranks", plan.world)))?;
    mask.check_fits(&plan.shape)?;
    let shape = plan.shape;
    let desc =
        |b: BufId| prog.bufs.get(b).ok_or_else(|| Error::InvalidPlan(format!("rank {rank} uses undefined buffer {b}")));
    let mut blocks = Vec::new();
    // A block's mask: the plan mask's part over its tokens, with only `rows` kept where given.
    let mut block_of = |q: &BufDesc, k: &BufDesc, rows: &Option<std::ops::Range<usize>>| -> Result<usize> {
        let mut m = sub_mask(mask, &q.tokens, &k.tokens)?;
        if let Some(r) = rows {
            m = m.keep_rows(r.clone())?;
        }
        blocks.push(Block::new(BufDesc::block_shape(q, k, &shape), m));
        Ok(blocks.len() - 1)
    };
    // Buffers that hold only their fill: allocated, not yet used by anything else.
    let mut fresh = vec![false; prog.bufs.len()];
    let mut ops = Vec::new();
    for op in prog.steps.iter().flatten() {
        let uses = op.uses();
        if let Some(&b) = uses.iter().find(|&&b| b >= prog.bufs.len()) {
            return Err(Error::InvalidPlan(format!("rank {rank} uses undefined buffer {b}")));
        }
        ops.push(match op {
            Op::Comm { sends, recvs, .. } => {
                // Where a buffer stored inside another lies in it.
                let part = |buf: BufId| -> Result<Option<(BufId, usize)>> {
                    let d = desc(buf)?;
                    let Some(p) = d.within else { return Ok(None) };
                    let at = d.offset_in(desc(p)?, &shape).ok_or_else(|| {
                        Error::InvalidPlan(format!("rank {rank}: buffer {buf} is not a contiguous part of {p}"))
                    })?;
                    Ok(Some((p, at)))
                };
                PreparedOp::Comm {
                    sends: sends
                        .iter()
                        .map(|&(to, buf)| Ok(Send { to, buf, out_of: part(buf)? }))
                        .collect::<Result<_>>()?,
                    recvs: recvs
                        .iter()
                        .map(|&(from, buf)| Ok(Recv { from, buf, into: part(buf)? }))
                        .collect::<Result<_>>()?,
                }
            }
            Op::Alloc { buf, fill } => PreparedOp::Alloc { buf: *buf, fill: fill.value() },
            Op::Copy { src, dst } => {
                PreparedOp::Copy { src: *src, dst: *dst, pieces: pieces(desc(*src)?, desc(*dst)?, &shape) }
            }
            Op::Add { src, dst } => {
                PreparedOp::Add { src: *src, dst: *dst, pieces: pieces(desc(*src)?, desc(*dst)?, &shape) }
            }
            Op::Merge { o, lse, o_acc, lse_acc } => PreparedOp::Merge {
                o: *o,
                lse: *lse,
                o_acc: *o_acc,
                lse_acc: *lse_acc,
                spec: MergeSpec::new(desc(*o)?, desc(*o_acc)?, &shape),
            },
            Op::Fwd { q, k, v, o, lse, rounded, .. } => {
                let (qd, kd) = (desc(*q)?, desc(*k)?);
                let own_rows = |b: BufId| desc(b).is_ok_and(|d| d.same_region(qd));
                let spec = || -> Result<MergeSpec> {
                    let part = BufDesc::new(Tensor::O, qd.tokens.clone(), qd.heads.clone());
                    Ok(MergeSpec::new(&part, desc(*o)?, &shape))
                };
                let output = match (fresh[*o] && fresh[*lse], own_rows(*o) && own_rows(*lse)) {
                    (true, true) => FwdOutput::Direct,
                    (false, true) => FwdOutput::MergeInKernel(spec()?),
                    _ => FwdOutput::Merge(spec()?),
                };
                // An O held in the input dtype is written whole by one block; merges are in f32.
                if desc(*o)?.narrow && output != FwdOutput::Direct {
                    return Err(Error::InvalidPlan(format!(
                        "rank {rank}: a forward block merges into buffer {o}, which is held in the input dtype"
                    )));
                }
                let rounded = match rounded {
                    Some(y) => Some((*y, pieces(desc(*o)?, desc(*y)?, &shape))),
                    None => None,
                };
                let block = block_of(qd, kd, &None)?;
                PreparedOp::Fwd { q: *q, k: *k, v: *v, o: *o, lse: *lse, block, output, rounded }
            }
            Op::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, rows, .. } => {
                let (qd, kd) = (desc(*q)?, desc(*k)?);
                let dq_part = BufDesc::new(Tensor::DQ, qd.tokens.clone(), qd.heads.clone());
                let kv_part = |t: Tensor| BufDesc::new(t, kd.tokens.clone(), kd.heads.clone());
                let dq_output = GradOutput::of(&dq_part, desc(*dq)?, &shape);
                let dk_output = GradOutput::of(&kv_part(Tensor::DK), desc(*dk)?, &shape);
                let dv_output = GradOutput::of(&kv_part(Tensor::DV), desc(*dv)?, &shape);
                // A gradient held in the input dtype is final: one block writes it whole, once.
                for (g, out) in [(*dq, &dq_output), (*dk, &dk_output), (*dv, &dv_output)] {
                    if desc(g)?.narrow && (*out != GradOutput::Direct || !fresh[g]) {
                        return Err(Error::InvalidPlan(format!(
                            "rank {rank}: a backward block adds into buffer {g}, which is held in the input dtype"
                        )));
                    }
                }
                let block = block_of(qd, kd, rows)?;
                PreparedOp::Bwd {
                    q: *q,
                    k: *k,
                    v: *v,
                    d_o: *d_o,
                    lse: *lse,
                    delta: *delta,
                    dq: *dq,
                    dk: *dk,
                    dv: *dv,
                    block,
                    dq_output,
                    dk_output,
                    dv_output,
                }
            }
            Op::Free { buf } => PreparedOp::Free { buf: *buf },
        });
        for b in uses {
            fresh[b] = matches!(op, Op::Alloc { .. });
        }
    }
    Ok(PreparedRank {
        rank,
        world: plan.world,
        pass: plan.pass,
        shape,
        dtype: plan.dtype,
        bufs: prog.bufs.clone(),
        inputs: prog.inputs.clone(),
        outputs: prog.outputs.clone(),
        saved: prog.saved.clone(),
        steps: prog.steps.len(),
        ops,
        schedule: schedule(prog),
        blocks,
    })
}

/// Every rank's program of `plan`.
pub fn prepare_all(plan: &Plan, mask: &Mask) -> Result<Vec<PreparedRank>> {
    (0..plan.world).map(|r| prepare(plan, r, mask)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use distattn_core::planner::build;
    use distattn_core::{PlanOptions, Strategy};

    /// A ring forward over a full mask: each rank's first block writes its accumulators
    /// directly, every later one (its own queries again, the accumulators holding a partial)
    /// may merge in the kernel.
    #[test]
    fn later_blocks_of_a_ring_merge_in_the_kernel() {
        let shape = AttnShape::new(1, 64, 64, 4, 2, 16).unwrap();
        let mask = Mask::full(64, 64).unwrap();
        let plan = build(Strategy::Ring, 4, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
        for rank in prepare_all(&plan, &mask).unwrap() {
            let outputs: Vec<&FwdOutput> = rank
                .ops
                .iter()
                .filter_map(|op| match op {
                    PreparedOp::Fwd { output, .. } => Some(output),
                    _ => None,
                })
                .collect();
            assert_eq!(outputs.len(), 4);
            assert!(matches!(outputs[0], FwdOutput::Direct));
            assert!(outputs[1..].iter().all(|o| matches!(o, FwdOutput::MergeInKernel(_))), "{outputs:?}");
        }
    }

    /// Ulysses' backward writes its bf16 gradients directly; a ring's adds into f32 ones, and
    /// a plan whose block would add into a gradient held in bf16 is refused.
    #[test]
    fn only_final_gradients_are_held_narrowed() {
        let shape = AttnShape::new(1, 64, 64, 4, 4, 16).unwrap();
        let mask = Mask::causal(64, 64).unwrap();
        let opts = PlanOptions { narrow_outputs: true, ..PlanOptions::backward(Default::default()) };
        let grads = |rank: &PreparedRank| -> Vec<(bool, GradOutput)> {
            let mut out = Vec::new();
            for op in &rank.ops {
                if let PreparedOp::Bwd { dq, dk, dv, dq_output, dk_output, dv_output, .. } = op {
                    for (g, o) in [(dq, dq_output), (dk, dk_output), (dv, dv_output)] {
                        out.push((rank.bufs[*g].narrow, o.clone()));
                    }
                }
            }
            out
        };
        let plan = build(Strategy::Ulysses, 2, &shape, &mask, DType::BF16, &opts).unwrap();
        for rank in prepare_all(&plan, &mask).unwrap() {
            assert!(grads(&rank).iter().all(|(narrow, o)| *narrow && *o == GradOutput::Direct));
        }
        let full = Mask::full(64, 64).unwrap();
        let mut ring = build(Strategy::Ring, 2, &shape, &full, DType::BF16, &opts).unwrap();
        for rank in prepare_all(&ring, &full).unwrap() {
            assert!(grads(&rank).iter().all(|(narrow, _)| !narrow));
        }
        // The ring's second block adds into the first one's dQ: held in bf16, that is refused.
        let prog = &mut ring.ranks[0];
        let dq = prog.steps.iter().flatten().find_map(|op| match op {
            Op::Bwd { dq, .. } => Some(*dq),
            _ => None,
        });
        prog.bufs[dq.unwrap()].narrow = true;
        let e = prepare(&ring, 0, &full).unwrap_err();
        assert!(e.to_string().contains("held in the input dtype"), "{e}");
    }
}

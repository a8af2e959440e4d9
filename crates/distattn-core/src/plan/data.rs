//! Plan data: buffers, ops, rank programs, options and the plan itself.

use super::{Layout, TokenSet};
use crate::{AttnShape, DType, Strategy};
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

    /// Handed from a Ulysses or hybrid forward to its backward in the head-sharded layout it
    /// computed with ([`PlanOptions::keep_head_sharded`]).
    pub fn is_kept_head_sharded(self) -> bool {
        matches!(self, Tensor::Q | Tensor::K | Tensor::V | Tensor::Lse)
    }

    /// A gradient (a backward's output).
    pub fn is_grad(self) -> bool {
        matches!(self, Tensor::DQ | Tensor::DK | Tensor::DV)
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
    /// Held in the input dtype rather than f32 ([`PlanOptions::narrow_outputs`]): a final
    /// output (O, dQ, dK, dV), a piece of one on its way over a link, or an accumulator whose
    /// one forward block writes it whole (Ulysses' head-sharded O). Copies between it and f32
    /// convert.
    #[serde(default)]
    pub narrow: bool,
    /// Stored inside buffer `within` of the same rank (the part of it [`BufDesc::offset_in`]
    /// finds) rather than on its own: a piece received straight into the buffer that gathers
    /// it, or sent straight from the buffer that holds it, with no copy. Only a transfer group
    /// uses it (a receive writes it, a send reads it); otherwise the data is used through the
    /// parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<BufId>,
}

impl BufDesc {
    pub fn new(tensor: Tensor, tokens: TokenSet, heads: Range<usize>) -> Self {
        BufDesc { tensor, tokens, heads, narrow: false, within: None }
    }

    /// This descriptor stored inside buffer `parent`.
    pub fn inside(self, parent: BufId) -> Self {
        BufDesc { within: Some(parent), ..self }
    }

    /// Whether both cover the same tokens and heads (an accumulator a block adds into in place).
    pub fn same_region(&self, other: &BufDesc) -> bool {
        self.tokens == other.tokens && self.heads == other.heads
    }

    /// Whether both describe the same part of a tensor in the same dtype, wherever each is
    /// stored (what a send and its receive must agree on).
    pub fn same_part(&self, other: &BufDesc) -> bool {
        self.tensor == other.tensor && self.same_region(other) && self.narrow == other.narrow
    }

    /// The element offset of this part inside `parent`, where it is one contiguous run there:
    /// the same tensor and dtype, all of the parent's heads, tokens that are one run of the
    /// parent's, one batch entry, and rows of `[tokens, heads, d]` (not LSE or D). `None`
    /// otherwise.
    pub fn offset_in(&self, parent: &BufDesc, shape: &AttnShape) -> Option<usize> {
        if shape.batch != 1
            || self.tensor.is_stats()
            || self.tensor != parent.tensor
            || self.heads != parent.heads
            || self.narrow != parent.narrow
        {
            return None;
        }
        match self.tokens.pieces_into(&parent.tokens).as_slice() {
            &[(0, at, n)] if n == self.tokens.len() => Some(at * self.heads.len() * shape.head_dim),
            _ => None,
        }
    }

    /// This descriptor held in the input dtype.
    pub fn narrowed(self) -> Self {
        BufDesc { narrow: true, ..self }
    }

    /// Storage dtype given the input dtype.
    pub fn dtype(&self, input: DType) -> DType {
        if self.narrow {
            input
        } else {
            self.tensor.dtype(input)
        }
    }

    /// Element count.
    pub fn elems(&self, shape: &AttnShape) -> usize {
        let per = if self.tensor.is_stats() { 1 } else { shape.head_dim };
        shape.batch * self.tokens.len() * self.heads.len() * per
    }

    /// Size in bytes given the input dtype.
    pub fn bytes(&self, shape: &AttnShape, input: DType) -> u64 {
        (self.elems(shape) * self.dtype(input).size()) as u64
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
    /// None: copies later in the same step write every element before any is read (a piece
    /// cut out for a transfer, a buffer gathered from pieces). [`Plan::validate`] checks it.
    Overwritten,
}

impl Fill {
    /// The initial value, if any.
    pub fn value(self) -> Option<f32> {
        match self {
            Fill::Zero => Some(0.0),
            Fill::NegInf => Some(f32::NEG_INFINITY),
            Fill::Overwritten => None,
        }
    }
}

/// One operation of a rank's program.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Op {
    /// Point-to-point sends and receives posted together as one group. Received buffers are
    /// allocated from their descriptors.
    Comm { phase: usize, sends: Vec<(usize, BufId)>, recvs: Vec<(usize, BufId)> },
    /// Allocates a buffer filled with `fill` (0 for sums, −inf for an LSE accumulator, nothing
    /// for one that copies overwrite).
    Alloc { buf: BufId, fill: Fill },
    /// Copies the (tokens ∩, heads ∩) part of `src` into `dst`, converting where one of them
    /// is narrowed.
    Copy { src: BufId, dst: BufId },
    /// Adds the (tokens ∩, heads ∩) part of `src` into `dst` (f32 gradients).
    Add { src: BufId, dst: BufId },
    /// Merges a partial (O, LSE) into an accumulator covering its tokens and heads.
    Merge { o: BufId, lse: BufId, o_acc: BufId, lse_acc: BufId },
    /// Attention of the query buffer against the key/value buffers, merged into (o, lse).
    /// `area` is the number of kept (query, key) pairs per head and batch entry. With
    /// `rounded`, the block also writes the merged O, rounded to the input dtype, into that
    /// buffer: `o`'s final value, held narrowed ([`PlanOptions::narrow_outputs`]); the block
    /// covers all of `o`'s rows and no later op writes `o`.
    Fwd {
        q: BufId,
        k: BufId,
        v: BufId,
        o: BufId,
        lse: BufId,
        area: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rounded: Option<BufId>,
    },
    /// Exact partial gradients of the block, added into dq, dk, dv. With `rows`, only those
    /// query rows of the block (positions in `q`'s tokens) count, the rest left to another op
    /// over the same buffers (a block split in two launches).
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
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rows: Option<Range<usize>>,
    },
    /// The buffer is no longer needed.
    Free { buf: BufId },
}

impl Op {
    /// Buffers the op reads or writes, with the buffers that those stored inside another
    /// ([`BufDesc::within`]) lie in: what must be alive while it runs. (Freeing a part stored
    /// inside another does not use that one.)
    pub fn uses_in(&self, bufs: &[BufDesc]) -> Vec<BufId> {
        let used = self.uses();
        if matches!(self, Op::Free { .. }) {
            return used;
        }
        let parents: Vec<BufId> = used.iter().filter_map(|&b| bufs.get(b).and_then(|d| d.within)).collect();
        used.into_iter().chain(parents).collect()
    }

    /// Buffers the op reads or writes.
    pub fn uses(&self) -> Vec<BufId> {
        match self {
            Op::Comm { sends, recvs, .. } => sends.iter().chain(recvs).map(|x| x.1).collect(),
            Op::Alloc { buf, .. } | Op::Free { buf } => vec![*buf],
            Op::Copy { src, dst } | Op::Add { src, dst } => vec![*src, *dst],
            Op::Merge { o, lse, o_acc, lse_acc } => vec![*o, *lse, *o_acc, *lse_acc],
            Op::Fwd { q, k, v, o, lse, rounded, .. } => [*q, *k, *v, *o, *lse].into_iter().chain(*rounded).collect(),
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
    /// Buffers a forward hands back for its backward beside the outputs
    /// ([`PlanOptions::keep_head_sharded`]).
    #[serde(default)]
    pub saved: Vec<(Tensor, BufId)>,
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
    /// Document lengths of a packed batch: zigzag, all-gather and hybrid's ring then cut every
    /// document alike. Default: the mask's diagonal blocks ([`crate::Mask::diagonal_blocks`]).
    pub documents: Option<Vec<usize>>,
    /// Balanced: run the published last step (owners only, half the ranks idle for even P)
    /// instead of splitting its blocks between owner and idle rank.
    #[serde(default)]
    pub balanced_no_split: bool,
    /// Where the tokens are (pass-q only): the ranks holding each query and each key, as a KV
    /// cache spread over the ranks places them. Other strategies choose their own layout.
    #[serde(default)]
    pub layout: Option<Layout>,
    /// Ranks per node (host), where the launcher says: consecutive ranks share a node. Hybrid
    /// then keeps its all-to-alls inside nodes and rings across them.
    #[serde(default)]
    pub ranks_per_node: Option<usize>,
    /// Ulysses (hybrid without a ring): head chunks, whole KV heads each, whose all-to-alls
    /// overlap the previous chunk's attention. Default 1: on 2 H200s (32/8 heads, 32k and 128k)
    /// 2 chunks matched one and 4 lost up to 17%, the chunks' copy and NCCL kernels waiting for
    /// SMs the attention kernel holds (`bench/results/h200x2-2026-11-26-serving-ulysses`).
    #[serde(default)]
    pub head_chunks: Option<usize>,
    /// The caller takes the outputs in the input dtype: the program's final O, dQ, dK and dV
    /// are held in it (rounded once, from the f32 accumulators), and final results cross links
    /// in it, so the all-to-all back of Ulysses and hybrid moves half the bytes and lands
    /// without widening. Off by default: the outputs are f32.
    #[serde(default)]
    pub narrow_outputs: bool,
    /// Ulysses and hybrid (one head chunk): the forward also hands back the head-sharded Q, K,
    /// V and LSE it computed with ([`RankProgram::saved`]), and the backward takes Q, K, V and
    /// LSE in that layout, so its all-to-all moves only dO and D (the all-to-all baseline's
    /// autograd keeps them the same way). Costs one more copy of this rank's Q, K, V until the
    /// backward.
    #[serde(default)]
    pub keep_head_sharded: bool,
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

    /// The ranks per node on `world` ranks when they span more than one node, else `None`.
    pub fn ranks_per_node_of(&self, world: usize) -> Option<usize> {
        self.ranks_per_node.filter(|&n| n > 0 && n < world)
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
    /// Ranks per node, consecutive ranks sharing one ([`PlanOptions::ranks_per_node`]): what
    /// the estimate sends over the network rather than NVLink. `None`: one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks_per_node: Option<usize>,
}

impl Plan {
    pub fn steps(&self) -> usize {
        self.step_labels.len()
    }
}

//! The compute backend the interpreter runs a plan on: buffers, two ordered lanes with events
//! between them, data movement, and the attention blocks.
//!
//! On a GPU the lanes are two streams and events are device events, so transfers run beside
//! compute; on the CPU every call completes before it returns, lanes only name the work, and an
//! event is the time it was recorded. The interpreter issues the same calls either way.

use crate::pieces::{MergeSpec, Piece};
use distattn_core::schedule::Lane;
use distattn_core::{AttnOptions, AttnShape, DType, Element, Mask, Result};

/// A block of a rank's program — one query set against one key set — prepared once: its
/// kernel shape, its mask re-indexed to the block's own rows and keys, and for a block of at
/// most [`Block::RUN_ROWS`] rows each keeping one run of keys (a decode step's block over a
/// spread cache), those runs, which a backend may hand a split-KV decode kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub shape: AttnShape,
    pub mask: Mask,
    /// Per query row `(first key, keys)` ([`Mask::row_runs`]), for blocks of few rows.
    pub row_runs: Option<Vec<(usize, usize)>>,
}

impl Block {
    /// Query rows at most whose key runs a block keeps.
    pub const RUN_ROWS: usize = 64;

    pub fn new(shape: AttnShape, mask: Mask) -> Block {
        let row_runs = if mask.q_len() <= Self::RUN_ROWS { mask.row_runs() } else { None };
        Block { shape, mask, row_runs }
    }
}

/// The inputs of a block's forward, in the input dtype.
pub struct FwdInputs<'a, B> {
    pub q: &'a B,
    pub k: &'a B,
    pub v: &'a B,
}

/// The inputs of a block's backward: Q, K, V, dO in the input dtype; the global LSE and
/// D = rowsum(dO ∘ O) of the block's query rows in f32.
pub struct BwdInputs<'a, B> {
    pub q: &'a B,
    pub k: &'a B,
    pub v: &'a B,
    pub d_o: &'a B,
    pub lse: &'a B,
    pub delta: &'a B,
}

/// Where a block's backward puts its gradients: dQ over the block's query rows
/// `[b, q rows, h, d]`, dK and dV over its keys `[b, keys, h_kv, d]`. An f32 buffer is an
/// accumulator the gradient is added into; one of the input dtype holds a final gradient, which
/// the block writes (rounded once, whatever the buffer held).
pub struct GradAccs<'a, B> {
    pub dq: &'a mut B,
    pub dk: &'a mut B,
    pub dv: &'a mut B,
}

/// What the interpreter needs from a compute device.
pub trait Backend: Sync {
    /// A buffer on the device, with its dtype.
    type Buf: Send;
    /// What a communicator moves (host bytes for the CPU, device buffers for NCCL).
    type CommBuf: ?Sized;
    /// A point in a lane's work, to order the other lane after it or to time it.
    type Event;

    fn name(&self) -> &'static str;

    /// A buffer of `elems` values of `dtype`, set to `fill`, or unwritten with `None` (a
    /// buffer about to be received into or fully written), ordered on `lane`.
    fn alloc(&self, lane: Lane, dtype: DType, elems: usize, fill: Option<f32>) -> Result<Self::Buf>;
    /// Releases `buf` once the work issued on `lane` so far is done with it.
    fn free(&self, lane: Lane, buf: Self::Buf);
    /// A buffer holding `data` (on the compute lane).
    fn upload<T: Element>(&self, data: &[T]) -> Result<Self::Buf>;
    /// The buffer's values as f32, after the work issued on the compute lane.
    fn download_f32(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// A buffer over elements `offset .. offset + elems` of `parent`, sharing its memory (a
    /// receive lands there, or a send reads it), where the backend can lend one; `Ok(None)`
    /// where it cannot (the interpreter then receives apart and copies in, or copies out and
    /// sends the copy). Freeing the view leaves the memory to `parent`.
    fn view(&self, _parent: &mut Self::Buf, _offset: usize, _elems: usize) -> Result<Option<Self::Buf>> {
        Ok(None)
    }
    /// The buffer as the communicator sees it.
    fn comm_view<'a>(&self, buf: &'a Self::Buf) -> &'a Self::CommBuf;
    fn comm_view_mut<'a>(&self, buf: &'a mut Self::Buf) -> &'a mut Self::CommBuf;

    /// Marks the work issued on `lane` so far; `timed` events can be compared with
    /// [`Backend::elapsed_ms`].
    fn record(&self, lane: Lane, timed: bool) -> Result<Self::Event>;
    /// Work issued on `lane` from now on starts after `event`.
    fn wait(&self, lane: Lane, event: &Self::Event) -> Result<()>;
    /// Whether the work before `event` has completed (never blocks).
    fn is_done(&self, event: &Self::Event) -> Result<bool>;
    /// Milliseconds from `start` to `end` (both timed).
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f64>;

    /// `dst[d..d+n] = src[s..s+n]` for every piece (same dtype).
    fn copy(&self, lane: Lane, src: &Self::Buf, dst: &mut Self::Buf, pieces: &[Piece]) -> Result<()>;
    /// `dst[d..d+n] += src[s..s+n]` for every piece; `dst` is f32, `src` f32 or the input dtype.
    fn add(&self, lane: Lane, src: &Self::Buf, dst: &mut Self::Buf, pieces: &[Piece]) -> Result<()>;
    /// Overflow-safe LSE merge of a partial (O, LSE) into accumulators (all f32), on the
    /// compute lane. Rows the partial does not reach (LSE = −inf) leave the accumulator as is.
    fn merge(
        &self,
        o: &Self::Buf,
        lse: &Self::Buf,
        o_acc: &mut Self::Buf,
        lse_acc: &mut Self::Buf,
        spec: &MergeSpec,
    ) -> Result<()>;
    /// Attention of one block, writing its O `[b, q rows, h, d]` (f32, or the input dtype where
    /// `o` is of it: a final result no merge follows) and f32 LSE `[b, h, q rows]` (every row;
    /// O = 0 and LSE = −inf where no key is kept), on the compute lane; with `rounded`, also O
    /// rounded to the input dtype there (a final output; `o` f32).
    fn forward(
        &self,
        block: &Block,
        inputs: FwdInputs<'_, Self::Buf>,
        opts: &AttnOptions,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
        rounded: Option<&mut Self::Buf>,
    ) -> Result<()>;
    /// Attention of one block merged into accumulators `o_acc`, `lse_acc` that cover exactly
    /// its rows and hold an earlier partial result, where the backend merges in the kernel
    /// (what [`Backend::forward`] then [`Backend::merge`] would give), the merged O also
    /// written rounded into `rounded` where given. `Ok(false)`: the backend does not, nothing
    /// ran, and the caller merges.
    fn forward_merging(
        &self,
        _block: &Block,
        _inputs: FwdInputs<'_, Self::Buf>,
        _opts: &AttnOptions,
        _o_acc: &mut Self::Buf,
        _lse_acc: &mut Self::Buf,
        _rounded: Option<&mut Self::Buf>,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Exact partial gradients of one block given the global LSE and D, added into `grads`
    /// (written into those of the input dtype), on the compute lane.
    fn backward(
        &self,
        block: &Block,
        inputs: BwdInputs<'_, Self::Buf>,
        opts: &AttnOptions,
        grads: GradAccs<'_, Self::Buf>,
    ) -> Result<()>;
    /// D = rowsum(dO ∘ O) of `rows.q_len` tokens (`rows` gives batch, tokens, heads and head
    /// dim): `o` f32 or in the input dtype and `d_o` in the input dtype, `[b, tokens, h, d]`;
    /// returns f32 `[b, h, tokens]`, empty for a rank of no tokens (`rows.q_len` 0, which a
    /// layout may leave a rank).
    fn row_delta(&self, o: &Self::Buf, d_o: &Self::Buf, rows: &AttnShape) -> Result<Self::Buf>;
}

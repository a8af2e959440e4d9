//! One rank of a plan run from whole host tensors: upload this rank's shards, compute D for its
//! own rows (backward), execute, download its output shards. Every runner (thread ranks on the
//! CPU, GPU ranks over NCCL) calls [`run_rank`] on each rank and gathers the shards.

use crate::backend::Backend;
use crate::comm::Communicator;
use crate::interpreter::{execute, ExecOptions};
use crate::prepare::PreparedRank;
use crate::shard::{shard, Shard};
use distattn_core::plan::{BufDesc, Pass, Tensor};
use distattn_core::timeline::Timeline;
use distattn_core::{AttnOptions, AttnShape, Element, Error, Result};

/// The whole tensors of a call, on the host: Q, K, V, and for a backward pass the forward's O
/// (f32) and LSE and the output gradient dO.
#[derive(Debug, Clone, Copy)]
pub struct HostTensors<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub backward: Option<BackwardTensors<'a, T>>,
}

/// The forward's results and the output gradient, for a backward pass.
#[derive(Debug, Clone, Copy)]
pub struct BackwardTensors<'a, T> {
    pub o: &'a [f32],
    pub lse: &'a [f32],
    pub d_o: &'a [T],
}

impl<T> HostTensors<'_, T> {
    /// Checks every length against `shape`, and that a backward pass has its tensors.
    pub fn check(&self, shape: &AttnShape, pass: Pass) -> Result<()> {
        shape.check_len("q", self.q.len(), shape.q_elems())?;
        shape.check_len("k", self.k.len(), shape.kv_elems())?;
        shape.check_len("v", self.v.len(), shape.kv_elems())?;
        match (pass, &self.backward) {
            (Pass::Forward, _) => Ok(()),
            (Pass::Backward, None) => Err(Error::invalid("inputs", "a backward pass needs O, LSE and dO")),
            (Pass::Backward, Some(b)) => {
                shape.check_len("o", b.o.len(), shape.q_elems())?;
                shape.check_len("lse", b.lse.len(), shape.lse_elems())?;
                shape.check_len("d_o", b.d_o.len(), shape.q_elems())
            }
        }
    }
}

/// What one rank returns: its output shards (f32) and its timeline if one was asked for.
pub struct RankResult {
    pub shards: Vec<Shard>,
    pub timeline: Option<Timeline>,
}

/// Uploads this rank's shards of `full`, runs `prog` and downloads its outputs.
pub fn run_rank<T, B, C>(
    prog: &PreparedRank,
    backend: &B,
    comm: &C,
    full: &HostTensors<'_, T>,
    opts: &AttnOptions,
    ctl: &ExecOptions,
) -> Result<RankResult>
where
    T: Element,
    B: Backend,
    C: Communicator<Buf = B::CommBuf>,
{
    if T::DTYPE != prog.dtype {
        return Err(Error::DTypeMismatch {
            a: "inputs".into(),
            a_dtype: T::DTYPE.to_string(),
            b: "plan".into(),
            b_dtype: prog.dtype.to_string(),
        });
    }
    full.check(&prog.shape, prog.pass)?;
    let shape = &prog.shape;
    let bwd = full.backward.as_ref();
    let mut inputs = Vec::with_capacity(prog.inputs.len());
    for &(tensor, id) in &prog.inputs {
        let d = &prog.bufs[id];
        let missing =
            || Error::invalid("inputs", format!("the plan takes {tensor:?}, which a {:?} pass lacks", prog.pass));
        inputs.push(match tensor {
            Tensor::Q => backend.upload(&shard(full.q, d, shape))?,
            Tensor::K => backend.upload(&shard(full.k, d, shape))?,
            Tensor::V => backend.upload(&shard(full.v, d, shape))?,
            Tensor::DO => backend.upload(&shard(bwd.ok_or_else(missing)?.d_o, d, shape))?,
            Tensor::Lse => backend.upload(&shard(bwd.ok_or_else(missing)?.lse, d, shape))?,
            Tensor::Delta => own_delta(backend, bwd.ok_or_else(missing)?, d, shape)?,
            other => return Err(Error::InvalidPlan(format!("{other:?} is not an input of a pass"))),
        });
    }
    let run = execute(prog, backend, comm, opts, inputs, ctl)?;
    let mut shards = Vec::with_capacity(run.outputs.len());
    for (&(tensor, id), buf) in prog.outputs.iter().zip(&run.outputs) {
        shards.push(Shard { tensor, desc: prog.bufs[id].clone(), data: backend.download_f32(buf)? });
    }
    Ok(RankResult { shards, timeline: run.timeline })
}

/// D = rowsum(dO ∘ O) of the rows of `delta` (a D buffer of this rank), computed here from
/// the rank's own O and dO rows.
fn own_delta<T: Element, B: Backend>(
    backend: &B,
    bwd: &BackwardTensors<'_, T>,
    delta: &BufDesc,
    shape: &AttnShape,
) -> Result<B::Buf> {
    // (A rank without rows gets an empty delta from the backend.)
    let rows = AttnShape { q_len: delta.tokens.len(), heads: delta.heads.len(), ..*shape };
    let o =
        backend.upload(&shard(bwd.o, &BufDesc::new(Tensor::O, delta.tokens.clone(), delta.heads.clone()), shape))?;
    let d_o =
        backend.upload(&shard(bwd.d_o, &BufDesc::new(Tensor::DO, delta.tokens.clone(), delta.heads.clone()), shape))?;
    backend.row_delta(&o, &d_o, &rows)
}

//! Distributed attention on in-process ranks.
//!
//! * [`comm`]: [`ThreadComm`], the thread implementation of [`distattn_core::Communicator`],
//!   and [`run_ranks`], which runs P ranks and turns a failed rank into an error naming it.
//! * [`backend`]: the [`Backend`] trait the executor computes through, and [`CpuBackend`].
//! * [`exec`]: the generic executor of any [`Plan`].
//! * [`distributed_forward`] / [`distributed_backward`]: one call that builds the plan, shards
//!   the full inputs by its layout, runs P thread-ranks and gathers the full result back.
//!
//! The pieces below the one-call API ([`run_forward`], [`run_backward`], [`shard`],
//! [`unshard_into`], [`exec::execute_rank`]) are public so other drivers (a CUDA executor, a
//! multi-process launcher) can reuse them.
//!
//! ```
//! use distattn_core::{AttnOptions, AttnShape, Mask, Strategy};
//! use distattn_dist::{distributed_backward, distributed_forward, RunOptions};
//!
//! let shape = AttnShape::new(1, 50, 50, 4, 2, 16).unwrap();
//! let mask = Mask::causal(50, 50).unwrap();
//! let q = vec![0.1f32; shape.q_elems()];
//! let kv = vec![0.2f32; shape.kv_elems()];
//! let strategy: Strategy = "zigzag".parse().unwrap();
//! let run = RunOptions::default();
//! let fwd = distributed_forward(strategy, 4, &q, &kv, &kv, &shape, &mask, &AttnOptions::default(), &run).unwrap();
//! let grads = distributed_backward(strategy, 4, &q, &kv, &kv, &fwd.o, &fwd.lse, &q, &shape, &mask,
//!                                  &AttnOptions::default(), &run).unwrap();
//! assert_eq!(grads.dk.len(), shape.kv_elems());
//! ```
#![allow(clippy::too_many_arguments, clippy::type_complexity, clippy::manual_is_multiple_of)]

pub mod backend;
pub mod comm;
pub mod exec;

pub use backend::{Backend, CpuBackend, HostBuf};
pub use comm::{run_ranks, ThreadComm};
pub use distattn_cpu::{Forward, Grads};
pub use exec::{execute_rank, FailureKind, InjectedFailure};

use distattn_core::plan::{BufDesc, Pass, Plan, PlanOptions, Tensor, TokenSet};
use distattn_core::planner::build;
use distattn_core::{AttnOptions, AttnShape, Element, Error, Mask, Result, Strategy};
use std::time::Duration;

/// Options of a distributed run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Planner options (the pass is set by the entry point).
    pub plan: PlanOptions,
    /// A blocked communication call gives up after this long without progress.
    pub timeout: Duration,
    /// Test hook: make a rank fail.
    pub fail: Option<InjectedFailure>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { plan: PlanOptions::default(), timeout: Duration::from_secs(60), fail: None }
    }
}

/// The elements of a full tensor (`[b, n, H, d]` or, for LSE/D, `[b, H, n]`) that belong to a
/// buffer of descriptor `desc`, in the buffer's order.
pub fn shard<T: Copy>(full: &[T], desc: &BufDesc, shape: &AttnShape) -> Vec<T> {
    let full_desc = full_desc(desc, shape);
    let mut out = Vec::with_capacity(desc.elems(shape));
    // Pieces from the full tensor into the shard, in shard order.
    let mut p = exec::pieces(&full_desc, desc, shape);
    p.sort_by_key(|x| x.1);
    for (s, _, n) in p {
        out.extend_from_slice(&full[s..s + n]);
    }
    out
}

/// Writes a shard back into the full tensor.
pub fn unshard_into<T: Copy>(part: &[T], desc: &BufDesc, shape: &AttnShape, full: &mut [T]) {
    let full_desc = full_desc(desc, shape);
    for (s, d, n) in exec::pieces(desc, &full_desc, shape) {
        full[d..d + n].copy_from_slice(&part[s..s + n]);
    }
}

fn full_desc(desc: &BufDesc, shape: &AttnShape) -> BufDesc {
    let (n, h) = if desc.tensor.is_kv() { (shape.k_len, shape.kv_heads) } else { (shape.q_len, shape.heads) };
    BufDesc::new(desc.tensor, TokenSet::range(0..n), 0..h)
}

/// The full tensor an input of the program refers to.
enum Full<'a, T> {
    In(&'a [T]),
    F32(&'a [f32]),
}

#[allow(clippy::too_many_arguments)]
fn run_plan<'a, T: Element, B: Backend<CommBuf = [u8]>>(
    plan: &Plan,
    backend: &B,
    mask: &Mask,
    opts: &AttnOptions,
    full: &(dyn Fn(Tensor) -> Option<Full<'a, T>> + Sync),
    delta_from: Option<(&'a [f32], &'a [T])>,
    run: &RunOptions,
) -> Result<Vec<Vec<(Tensor, BufDesc, Vec<f32>)>>> {
    let shape = plan.shape;
    run_ranks(plan.world, run.timeout, |comm| {
        use distattn_core::Communicator;
        let prog = &plan.ranks[comm.rank()];
        let mut inputs = Vec::new();
        for &(t, id) in &prog.inputs {
            let d = &prog.bufs[id];
            let buf = match (t, delta_from) {
                (Tensor::Delta, Some((o, d_o))) => {
                    // D = rowsum(dO ∘ O) of this rank's own rows, computed locally.
                    let (od, dd) = (
                        BufDesc::new(Tensor::O, d.tokens.clone(), d.heads.clone()),
                        BufDesc::new(Tensor::DO, d.tokens.clone(), d.heads.clone()),
                    );
                    let local = AttnShape { q_len: d.tokens.len(), ..shape };
                    if local.q_len == 0 {
                        backend.upload::<f32>(&[])?
                    } else {
                        backend.upload(&distattn_cpu::row_delta(
                            &shard(o, &od, &shape),
                            &shard(d_o, &dd, &shape),
                            &local,
                        )?)?
                    }
                }
                _ => match full(t) {
                    Some(Full::In(x)) => backend.upload(&shard(x, d, &shape))?,
                    Some(Full::F32(x)) => backend.upload(&shard(x, d, &shape))?,
                    None => return Err(Error::Comm(format!("no input for {t:?}"))),
                },
            };
            inputs.push(buf);
        }
        let outs = execute_rank(plan, backend, comm, mask, opts, inputs, run.fail)?;
        prog.outputs
            .iter()
            .zip(outs)
            .map(|(&(t, id), b)| Ok((t, prog.bufs[id].clone(), backend.download_f32(&b)?)))
            .collect()
    })
}

fn check_inputs(shape: &AttnShape, mask: &Mask, lens: &[(&str, usize, usize)]) -> Result<()> {
    shape.validate()?;
    for &(name, got, want) in lens {
        shape.check_len(name, got, want)?;
    }
    mask.check_fits(shape)
}

/// Runs a forward plan on thread-ranks from full inputs; returns the full (O, LSE).
pub fn run_forward<T: Element, B: Backend<CommBuf = [u8]>>(
    plan: &Plan,
    backend: &B,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: &Mask,
    opts: &AttnOptions,
    run: &RunOptions,
) -> Result<Forward> {
    let shape = plan.shape;
    check_inputs(
        &shape,
        mask,
        &[("q", q.len(), shape.q_elems()), ("k", k.len(), shape.kv_elems()), ("v", v.len(), shape.kv_elems())],
    )?;
    if plan.pass != Pass::Forward {
        return Err(Error::Comm("run_forward needs a forward plan".into()));
    }
    let full = |t: Tensor| match t {
        Tensor::Q => Some(Full::In(q)),
        Tensor::K => Some(Full::In(k)),
        Tensor::V => Some(Full::In(v)),
        _ => None,
    };
    let outs = run_plan(plan, backend, mask, opts, &full, None, run)?;
    Ok(gather_forward(&shape, outs.into_iter().flatten()))
}

/// The full (O, LSE) from every rank's output shards (tensor, descriptor, f32 data).
pub fn gather_forward(shape: &AttnShape, shards: impl IntoIterator<Item = (Tensor, BufDesc, Vec<f32>)>) -> Forward {
    let mut o = vec![0f32; shape.q_elems()];
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_elems()];
    for (t, d, data) in shards {
        match t {
            Tensor::O => unshard_into(&data, &d, shape, &mut o),
            Tensor::Lse => unshard_into(&data, &d, shape, &mut lse),
            _ => {}
        }
    }
    Forward { o, lse }
}

/// The full (dQ, dK, dV) from every rank's output shards (tensor, descriptor, f32 data).
pub fn gather_grads(shape: &AttnShape, shards: impl IntoIterator<Item = (Tensor, BufDesc, Vec<f32>)>) -> Grads {
    let mut g =
        Grads { dq: vec![0f32; shape.q_elems()], dk: vec![0f32; shape.kv_elems()], dv: vec![0f32; shape.kv_elems()] };
    for (t, d, data) in shards {
        match t {
            Tensor::DQ => unshard_into(&data, &d, shape, &mut g.dq),
            Tensor::DK => unshard_into(&data, &d, shape, &mut g.dk),
            Tensor::DV => unshard_into(&data, &d, shape, &mut g.dv),
            _ => {}
        }
    }
    g
}

/// Runs a backward plan on thread-ranks from full inputs (O and LSE from the forward pass);
/// every rank computes D for its own rows. Returns the full gradients.
#[allow(clippy::too_many_arguments)]
pub fn run_backward<T: Element, B: Backend<CommBuf = [u8]>>(
    plan: &Plan,
    backend: &B,
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[f32],
    lse: &[f32],
    d_o: &[T],
    mask: &Mask,
    opts: &AttnOptions,
    run: &RunOptions,
) -> Result<Grads> {
    let shape = plan.shape;
    check_inputs(
        &shape,
        mask,
        &[
            ("q", q.len(), shape.q_elems()),
            ("k", k.len(), shape.kv_elems()),
            ("v", v.len(), shape.kv_elems()),
            ("o", o.len(), shape.q_elems()),
            ("lse", lse.len(), shape.lse_elems()),
            ("d_o", d_o.len(), shape.q_elems()),
        ],
    )?;
    if plan.pass != Pass::Backward {
        return Err(Error::Comm("run_backward needs a backward plan".into()));
    }
    let full = |t: Tensor| match t {
        Tensor::Q => Some(Full::In(q)),
        Tensor::K => Some(Full::In(k)),
        Tensor::V => Some(Full::In(v)),
        Tensor::DO => Some(Full::In(d_o)),
        Tensor::Lse => Some(Full::F32(lse)),
        _ => None,
    };
    let outs = run_plan(plan, backend, mask, opts, &full, Some((o, d_o)), run)?;
    Ok(gather_grads(&shape, outs.into_iter().flatten()))
}

/// One call: plans `strategy` for `world` ranks, shards the full Q, K, V by its layout, runs
/// the ranks as threads on the CPU backend and returns the full (O, LSE).
#[allow(clippy::too_many_arguments)]
pub fn distributed_forward<T: Element>(
    strategy: Strategy,
    world: usize,
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    run: &RunOptions,
) -> Result<Forward> {
    let popts = run.plan.with_pass(Pass::Forward);
    let plan = build(strategy, world, shape, mask, T::DTYPE, &popts)?;
    run_forward(&plan, &CpuBackend, q, k, v, mask, opts, run)
}

/// One call: the backward of [`distributed_forward`] given its O and LSE and the output
/// gradient dO; returns the full (dQ, dK, dV). `run.plan.ring_backward` picks the ring variant.
#[allow(clippy::too_many_arguments)]
pub fn distributed_backward<T: Element>(
    strategy: Strategy,
    world: usize,
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[f32],
    lse: &[f32],
    d_o: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    run: &RunOptions,
) -> Result<Grads> {
    let popts = run.plan.with_pass(Pass::Backward);
    let plan = build(strategy, world, shape, mask, T::DTYPE, &popts)?;
    run_backward(&plan, &CpuBackend, q, k, v, o, lse, d_o, mask, opts, run)
}

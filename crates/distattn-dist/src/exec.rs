//! The generic plan executor: runs one rank's program of any [`Plan`] on any [`Backend`] and
//! [`Communicator`]. It knows nothing about strategies; every index it needs comes from the
//! buffer descriptors of the plan.

use crate::backend::{Backend, MergeRow, Piece};
use distattn_core::plan::{sub_mask, BufDesc, Op, Plan};
use distattn_core::{AttnOptions, AttnShape, Communicator, Error, Mask, Result};

/// A failure injected for tests of failure handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The rank returns an error.
    Error,
    /// The rank panics.
    Panic,
}

/// Make `rank` fail at the start of `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectedFailure {
    pub rank: usize,
    pub step: usize,
    pub kind: FailureKind,
}

/// Element pieces copying the (tokens ∩, heads ∩) part of `src` into `dst`.
pub fn pieces(src: &BufDesc, dst: &BufDesc, shape: &AttnShape) -> Vec<Piece> {
    let tp = src.tokens.pieces_into(&dst.tokens);
    let (h0, h1) = (src.heads.start.max(dst.heads.start), src.heads.end.min(dst.heads.end));
    let mut out = Vec::new();
    if h0 >= h1 || tp.is_empty() {
        return out;
    }
    let (ns, nd) = (src.tokens.len(), dst.tokens.len());
    let (hs, hd) = (src.heads.len(), dst.heads.len());
    if src.tensor.is_stats() {
        for b in 0..shape.batch {
            for h in h0..h1 {
                let (bs, bd) = ((b * hs + h - src.heads.start) * ns, (b * hd + h - dst.heads.start) * nd);
                out.extend(tp.iter().map(|&(sa, sb, n)| (bs + sa, bd + sb, n)));
            }
        }
        return out;
    }
    let d = shape.head_dim;
    for b in 0..shape.batch {
        for &(sa, sb, n) in &tp {
            if hs == h1 - h0 && hd == h1 - h0 {
                out.push((((b * ns + sa) * hs) * d, ((b * nd + sb) * hd) * d, n * hs * d));
            } else {
                for t in 0..n {
                    let so = ((b * ns + sa + t) * hs + h0 - src.heads.start) * d;
                    let dof = ((b * nd + sb + t) * hd + h0 - dst.heads.start) * d;
                    out.push((so, dof, (h1 - h0) * d));
                }
            }
        }
    }
    out
}

/// Merge rows mapping a partial (O, LSE) with the tokens and heads of `src` into an
/// accumulator described by `dst`.
pub fn merge_rows(src: &BufDesc, dst: &BufDesc, shape: &AttnShape) -> Vec<MergeRow> {
    let tp = src.tokens.pieces_into(&dst.tokens);
    let (h0, h1) = (src.heads.start.max(dst.heads.start), src.heads.end.min(dst.heads.end));
    let (ns, nd) = (src.tokens.len(), dst.tokens.len());
    let (hs, hd) = (src.heads.len(), dst.heads.len());
    let d = shape.head_dim;
    let mut out = Vec::new();
    for b in 0..shape.batch {
        for h in h0..h1 {
            let (hsl, hdl) = (h - src.heads.start, h - dst.heads.start);
            for &(sa, sb, n) in &tp {
                for t in 0..n {
                    let (i, j) = (sa + t, sb + t);
                    out.push((
                        (b * hs + hsl) * ns + i,
                        (b * hd + hdl) * nd + j,
                        ((b * ns + i) * hs + hsl) * d,
                        ((b * nd + j) * hd + hdl) * d,
                    ));
                }
            }
        }
    }
    out
}

fn missing(rank: usize, buf: usize) -> Error {
    Error::Comm(format!("rank {rank}: buffer {buf} used before it was allocated or after it was freed"))
}

/// Runs rank `comm.rank()`'s program of `plan`. `inputs` are this rank's shards in the order of
/// its program's `inputs`; returns its outputs in the order of the program's `outputs`.
#[allow(clippy::too_many_arguments)]
pub fn execute_rank<B: Backend, C: Communicator<Buf = B::CommBuf>>(
    plan: &Plan,
    backend: &B,
    comm: &C,
    mask: &Mask,
    opts: &AttnOptions,
    inputs: Vec<B::Buf>,
    fail: Option<InjectedFailure>,
) -> Result<Vec<B::Buf>> {
    let rank = comm.rank();
    if comm.world() != plan.world {
        return Err(Error::Comm(format!("plan for {} ranks run on {}", plan.world, comm.world())));
    }
    let prog = &plan.ranks[rank];
    let shape = plan.shape;
    if inputs.len() != prog.inputs.len() {
        return Err(Error::Comm(format!(
            "rank {rank}: {} inputs given, plan needs {}",
            inputs.len(),
            prog.inputs.len()
        )));
    }
    let mut store: Vec<Option<B::Buf>> = (0..prog.bufs.len()).map(|_| None).collect();
    for ((_, id), buf) in prog.inputs.iter().zip(inputs) {
        store[*id] = Some(buf);
    }
    let desc = |b: usize| &prog.bufs[b];
    let dtype = |b: usize| desc(b).tensor.dtype(plan.dtype);
    for (t, ops) in prog.steps.iter().enumerate() {
        if let Some(f) = fail.filter(|f| f.rank == rank && f.step == t) {
            match f.kind {
                FailureKind::Error => {
                    return Err(Error::Backend { backend: "test", reason: format!("injected failure at step {t}") })
                }
                FailureKind::Panic => panic!("injected panic at step {t}"),
            }
        }
        for op in ops {
            match op {
                Op::Comm { sends, recvs, .. } => {
                    let mut got: Vec<B::Buf> = recvs
                        .iter()
                        .map(|&(_, b)| backend.alloc(dtype(b), desc(b).elems(&shape), 0.0))
                        .collect::<Result<_>>()?;
                    let send_views = sends
                        .iter()
                        .map(|&(to, b)| Ok((to, backend.comm_view(store[b].as_ref().ok_or_else(|| missing(rank, b))?))))
                        .collect::<Result<Vec<_>>>()?;
                    let mut recv_views: Vec<(usize, &mut B::CommBuf)> = recvs
                        .iter()
                        .zip(got.iter_mut())
                        .map(|(&(from, _), g)| (from, backend.comm_view_mut(g)))
                        .collect();
                    comm.group(&send_views, &mut recv_views)?;
                    drop(recv_views);
                    for (&(_, b), g) in recvs.iter().zip(got) {
                        store[b] = Some(g);
                    }
                }
                Op::Alloc { buf, fill } => {
                    store[*buf] = Some(backend.alloc(dtype(*buf), desc(*buf).elems(&shape), fill.value())?)
                }
                Op::Copy { src, dst } | Op::Add { src, dst } => {
                    let p = pieces(desc(*src), desc(*dst), &shape);
                    let mut d = store[*dst].take().ok_or_else(|| missing(rank, *dst))?;
                    let s = store[*src].as_ref().ok_or_else(|| missing(rank, *src))?;
                    let r = if matches!(op, Op::Copy { .. }) {
                        backend.copy(s, &mut d, &p)
                    } else {
                        backend.add(s, &mut d, &p)
                    };
                    store[*dst] = Some(d);
                    r?;
                }
                Op::Merge { o, lse, o_acc, lse_acc } => {
                    let rows = merge_rows(desc(*o), desc(*o_acc), &shape);
                    let mut ao = store[*o_acc].take().ok_or_else(|| missing(rank, *o_acc))?;
                    let mut al = store[*lse_acc].take().ok_or_else(|| missing(rank, *lse_acc))?;
                    let r = backend.merge(
                        store[*o].as_ref().ok_or_else(|| missing(rank, *o))?,
                        store[*lse].as_ref().ok_or_else(|| missing(rank, *lse))?,
                        &mut ao,
                        &mut al,
                        &rows,
                        shape.head_dim,
                    );
                    store[*o_acc] = Some(ao);
                    store[*lse_acc] = Some(al);
                    r?;
                }
                Op::Fwd { q, k, v, o, lse, .. } => {
                    let (qd, kd) = (desc(*q), desc(*k));
                    let bshape = BufDesc::block_shape(qd, kd, &shape);
                    let m = sub_mask(mask, &qd.tokens, &kd.tokens)?;
                    let get = |b: usize| store[b].as_ref().ok_or_else(|| missing(rank, b));
                    let (po, pl) = backend.forward(get(*q)?, get(*k)?, get(*v)?, &bshape, &m, opts)?;
                    let rows = merge_rows(qd, desc(*o), &shape);
                    let mut ao = store[*o].take().ok_or_else(|| missing(rank, *o))?;
                    let mut al = store[*lse].take().ok_or_else(|| missing(rank, *lse))?;
                    let r = backend.merge(&po, &pl, &mut ao, &mut al, &rows, shape.head_dim);
                    store[*o] = Some(ao);
                    store[*lse] = Some(al);
                    r?;
                }
                Op::Bwd { q, k, v, d_o, lse, delta, dq, dk, dv, .. } => {
                    let (qd, kd) = (desc(*q), desc(*k));
                    let bshape = BufDesc::block_shape(qd, kd, &shape);
                    let m = sub_mask(mask, &qd.tokens, &kd.tokens)?;
                    let get = |b: usize| store[b].as_ref().ok_or_else(|| missing(rank, b));
                    let (gq, gk, gv) = backend.backward(
                        get(*q)?,
                        get(*k)?,
                        get(*v)?,
                        get(*d_o)?,
                        get(*lse)?,
                        get(*delta)?,
                        &bshape,
                        &m,
                        opts,
                    )?;
                    for (g, part_desc, acc) in [(&gq, qd, *dq), (&gk, kd, *dk), (&gv, kd, *dv)] {
                        let p = pieces(part_desc, desc(acc), &shape);
                        let mut a = store[acc].take().ok_or_else(|| missing(rank, acc))?;
                        let r = backend.add(g, &mut a, &p);
                        store[acc] = Some(a);
                        r?;
                    }
                }
                Op::Free { buf } => store[*buf] = None,
            }
        }
    }
    prog.outputs.iter().map(|&(_, b)| store[b].take().ok_or_else(|| missing(rank, b))).collect()
}

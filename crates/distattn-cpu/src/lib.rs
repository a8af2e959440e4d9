//! CPU backend of distattn: exact attention over long sequences in linear memory.
//!
//! * [`forward`] / [`backward`]: tiled flash attention (f32 accumulation for f32, bf16 and f16
//!   storage), parallel with rayon, AVX2/FMA micro-kernels with a portable fallback.
//! * [`row_delta`]: `D = rowsum(dO ∘ O)`, the per-row term of the backward pass.
//! * [`merge`]: combining partial (O, LSE) over disjoint key sets, and its backward.
//! * [`CpuBackend`]: these kernels as a backend of the plan interpreter (`distattn-exec`), so
//!   plans run on thread ranks of one process.
//!
//! Layouts (see [`AttnShape`]): Q, O, dO, dQ are `[batch, q_len, heads, head_dim]`; K, V, dK,
//! dV are `[batch, k_len, kv_heads, head_dim]`; LSE and D are `[batch, heads, q_len]` (natural
//! log). Rows that no key reaches have O = 0, LSE = −inf and dQ = 0.

mod backend;
pub mod decode;
pub mod flash;
pub mod merge;

pub use backend::CpuBackend;
use distattn_core::{AttnOptions, AttnShape, Element, Forward, Grads, Mask, Result};
pub use flash::TileConfig;

pub(crate) fn check_qkv(shape: &AttnShape, mask: &Mask, q: usize, k: usize, v: usize) -> Result<()> {
    shape.validate()?;
    shape.check_len("q", q, shape.q_elems())?;
    shape.check_len("k", k, shape.kv_elems())?;
    shape.check_len("v", v, shape.kv_elems())?;
    mask.check_fits(shape)
}

/// Flash attention forward.
pub fn forward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Forward> {
    forward_with(q, k, v, shape, mask, opts, TileConfig::for_head_dim(shape.head_dim))
}

/// [`forward`] with explicit tile sizes (for tests and tuning).
pub fn forward_with<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    tiles: TileConfig,
) -> Result<Forward> {
    check_qkv(shape, mask, q.len(), k.len(), v.len())?;
    let scale = opts.scale_for(shape.head_dim)?;
    Ok(flash::forward::run(q, k, v, shape, mask, scale, tiles.sanitized()))
}

/// D = rowsum(dO ∘ O), layout `[batch, heads, q_len]`.
pub fn row_delta<A: Element, B: Element>(o: &[A], d_o: &[B], shape: &AttnShape) -> Result<Vec<f32>> {
    use rayon::prelude::*;
    shape.validate()?;
    shape.check_len("o", o.len(), shape.q_elems())?;
    shape.check_len("d_o", d_o.len(), shape.q_elems())?;
    let AttnShape { batch, q_len: nq, heads, head_dim: d, .. } = *shape;
    let simd = flash::gemm::simd_available();
    // Computed per (batch, query row) in the natural layout, then transposed.
    let mut rows = vec![0f32; batch * nq * heads];
    rows.par_chunks_mut(heads).enumerate().for_each_init(
        || (vec![0f32; d], vec![0f32; d]),
        |(a, b), (bi, dst)| {
            for (h, x) in dst.iter_mut().enumerate() {
                let off = (bi * heads + h) * d;
                A::convert_to_f32(&o[off..off + d], a);
                B::convert_to_f32(&d_o[off..off + d], b);
                *x = flash::vmath::dot(simd, a, b);
            }
        },
    );
    let mut out = vec![0f32; shape.lse_elems()];
    for b in 0..batch {
        for i in 0..nq {
            for h in 0..heads {
                out[shape.lse_offset(b, h, i)] = rows[(b * nq + i) * heads + h];
            }
        }
    }
    Ok(out)
}

/// Flash attention backward over this key set, with a given (possibly global) LSE and
/// `delta = D = rowsum(dO ∘ O)` from the final O. Returns the exact partial gradients:
/// summing the results over disjoint key sets gives the gradients of the full attention.
#[allow(clippy::too_many_arguments)] // public API the README calls: a backward's six tensors and the problem
pub fn backward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    d_o: &[T],
    lse: &[f32],
    delta: &[f32],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Grads> {
    backward_with(q, k, v, d_o, lse, delta, shape, mask, opts, TileConfig::for_head_dim(shape.head_dim))
}

/// [`backward`] with explicit tile sizes (for tests and tuning).
#[allow(clippy::too_many_arguments)] // public API: the arguments of `backward` and the tiles
pub fn backward_with<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    d_o: &[T],
    lse: &[f32],
    delta: &[f32],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    tiles: TileConfig,
) -> Result<Grads> {
    check_qkv(shape, mask, q.len(), k.len(), v.len())?;
    shape.check_len("d_o", d_o.len(), shape.q_elems())?;
    shape.check_len("lse", lse.len(), shape.lse_elems())?;
    shape.check_len("delta", delta.len(), shape.lse_elems())?;
    let scale = opts.scale_for(shape.head_dim)?;
    let x = flash::backward::Tensors { q, k, v, d_o, lse, delta };
    Ok(flash::backward::run(x, shape, mask, scale, tiles.sanitized()))
}

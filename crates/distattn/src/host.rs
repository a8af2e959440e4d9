//! Attention on dtype-erased host tensors: shape inference from tensor dimensions and dtype
//! dispatch to the typed kernels.

use crate::tensor::{HostTensor, TensorData};
use distattn_core::{AttnOptions, AttnShape, Error, Mask, Result};
use distattn_cpu::{Forward, Grads};

/// Infers the attention shape from Q `[batch, q_len, heads, d]` (or packed `[tokens, heads, d]`)
/// and K, V of the same rank with `kv_heads` heads.
pub fn infer_shape(q: &HostTensor, k: &HostTensor, v: &HostTensor) -> Result<AttnShape> {
    let mismatch = |tensor: &str, expected: String, got: &[usize]| Error::ShapeMismatch {
        tensor: tensor.to_string(),
        expected,
        got: format!("{got:?}"),
    };
    let dims4 = |t: &HostTensor, name: &str| -> Result<[usize; 4]> {
        match t.shape[..] {
            [b, n, h, d] => Ok([b, n, h, d]),
            [n, h, d] => Ok([1, n, h, d]),
            _ => Err(mismatch(name, "[batch, seq, heads, head_dim] or [tokens, heads, head_dim]".into(), &t.shape)),
        }
    };
    let [b, nq, h, d] = dims4(q, "q")?;
    let [bk, nk, hk, dk] = dims4(k, "k")?;
    if q.shape.len() != k.shape.len() || bk != b || dk != d {
        return Err(mismatch("k", format!("[{b}, seq, kv_heads, {d}] (batch and head_dim of q)"), &k.shape));
    }
    if v.shape != k.shape {
        return Err(mismatch("v", format!("{:?} (the shape of k)", k.shape), &v.shape));
    }
    AttnShape::new(b, nq, nk, h, hk, d)
}

fn same_dtype(q: &HostTensor, other: &HostTensor, name: &str) -> Result<()> {
    if q.dtype() != other.dtype() {
        return Err(Error::DTypeMismatch {
            a: "q".into(),
            a_dtype: q.dtype().to_string(),
            b: name.into(),
            b_dtype: other.dtype().to_string(),
        });
    }
    Ok(())
}

/// Forward attention on the CPU backend for host tensors of one dtype.
pub fn forward(q: &HostTensor, k: &HostTensor, v: &HostTensor, shape: &AttnShape, mask: &Mask, opts: &AttnOptions) -> Result<Forward> {
    same_dtype(q, k, "k")?;
    same_dtype(q, v, "v")?;
    match (&q.data, &k.data, &v.data) {
        (TensorData::F32(q), TensorData::F32(k), TensorData::F32(v)) => distattn_cpu::forward(q, k, v, shape, mask, opts),
        (TensorData::BF16(q), TensorData::BF16(k), TensorData::BF16(v)) => distattn_cpu::forward(q, k, v, shape, mask, opts),
        (TensorData::F16(q), TensorData::F16(k), TensorData::F16(v)) => distattn_cpu::forward(q, k, v, shape, mask, opts),
        _ => unreachable!("dtypes checked above"),
    }
}

/// Backward attention on the CPU backend: recomputes D from `o` and `d_o`, then returns dQ, dK, dV.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    o: &[f32],
    d_o: &HostTensor,
    lse: &[f32],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Grads> {
    same_dtype(q, k, "k")?;
    same_dtype(q, v, "v")?;
    same_dtype(q, d_o, "grad-out")?;
    shape.check_len("grad-out", d_o.len(), shape.q_elems())?;
    match (&q.data, &k.data, &v.data, &d_o.data) {
        (TensorData::F32(q), TensorData::F32(k), TensorData::F32(v), TensorData::F32(g)) => {
            let delta = distattn_cpu::row_delta(o, g, shape)?;
            distattn_cpu::backward(q, k, v, g, lse, &delta, shape, mask, opts)
        }
        (TensorData::BF16(q), TensorData::BF16(k), TensorData::BF16(v), TensorData::BF16(g)) => {
            let delta = distattn_cpu::row_delta(o, g, shape)?;
            distattn_cpu::backward(q, k, v, g, lse, &delta, shape, mask, opts)
        }
        (TensorData::F16(q), TensorData::F16(k), TensorData::F16(v), TensorData::F16(g)) => {
            let delta = distattn_cpu::row_delta(o, g, shape)?;
            distattn_cpu::backward(q, k, v, g, lse, &delta, shape, mask, opts)
        }
        _ => unreachable!("dtypes checked above"),
    }
}

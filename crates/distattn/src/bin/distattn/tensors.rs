//! Attention on dtype-erased host tensors (what `.npy` files hold): the typed API of
//! [`Attention`] for the dtype the tensors share.

use distattn::{Attention, Error, Forward, Grads, HostData, HostTensor, Result};

fn mismatch(q: &HostTensor, other: &HostTensor, name: &str) -> Error {
    Error::DTypeMismatch {
        a: "q".into(),
        a_dtype: q.dtype().to_string(),
        b: name.into(),
        b_dtype: other.dtype().to_string(),
    }
}

/// Forward of Q, K, V of one dtype.
pub fn forward(attn: &Attention, q: &HostTensor, k: &HostTensor, v: &HostTensor) -> Result<Forward> {
    match (&q.data, &k.data, &v.data) {
        (HostData::F32(q), HostData::F32(k), HostData::F32(v)) => attn.forward(q, k, v),
        (HostData::BF16(q), HostData::BF16(k), HostData::BF16(v)) => attn.forward(q, k, v),
        (HostData::F16(q), HostData::F16(k), HostData::F16(v)) => attn.forward(q, k, v),
        _ if k.dtype() != q.dtype() => Err(mismatch(q, k, "k")),
        _ => Err(mismatch(q, v, "v")),
    }
}

/// Backward of Q, K, V and dO of one dtype, from the forward's result.
pub fn backward(
    attn: &Attention,
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    fwd: &Forward,
    d_o: &HostTensor,
) -> Result<Grads> {
    match (&q.data, &k.data, &v.data, &d_o.data) {
        (HostData::F32(q), HostData::F32(k), HostData::F32(v), HostData::F32(g)) => attn.backward(q, k, v, fwd, g),
        (HostData::BF16(q), HostData::BF16(k), HostData::BF16(v), HostData::BF16(g)) => attn.backward(q, k, v, fwd, g),
        (HostData::F16(q), HostData::F16(k), HostData::F16(v), HostData::F16(g)) => attn.backward(q, k, v, fwd, g),
        _ if k.dtype() != q.dtype() => Err(mismatch(q, k, "k")),
        _ if v.dtype() != q.dtype() => Err(mismatch(q, v, "v")),
        _ => Err(mismatch(q, d_o, "grad-out")),
    }
}

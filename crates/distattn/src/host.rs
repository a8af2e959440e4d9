//! Attention on dtype-erased host tensors: shape inference from tensor dimensions, dtype
//! dispatch to the typed kernels, on one call or on in-process ranks running a plan.

use crate::tensor::{HostTensor, TensorData};
use distattn_core::{AttnOptions, AttnShape, Element, Error, Mask, Result, Strategy};
use distattn_cpu::{Forward, Grads};
use distattn_cuda::{CudaBackend, CudaElement};
use distattn_dist::{distributed_backward, distributed_forward, RunOptions};
use distattn_nccl::{gpu_backward, gpu_forward, GpuRunOptions};
use std::sync::Arc;

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

/// Where an attention call runs.
#[derive(Clone, Default)]
pub enum Execution {
    /// One call of the CPU kernels.
    #[default]
    Single,
    /// `world` in-process ranks running the plan of `strategy` on the CPU backend.
    Ranks { strategy: Strategy, world: usize, run: RunOptions },
    /// One call of the CUDA kernels (bf16 and f16 inputs).
    Cuda(Arc<CudaBackend>),
    /// `world` local GPUs (a thread each, NCCL between them) running the plan of `strategy`.
    GpuRanks { strategy: Strategy, world: usize, run: GpuRunOptions },
}

impl Execution {
    /// A short description for logs and reports.
    pub fn describe(&self) -> String {
        match self {
            Execution::Single => "cpu".into(),
            Execution::Ranks { strategy, world, .. } => format!("cpu, {strategy} on {world} ranks"),
            Execution::Cuda(gpu) => format!("cuda, {}", gpu.device_name()),
            Execution::GpuRanks { strategy, world, .. } => format!("cuda, {strategy} on {world} GPUs"),
        }
    }
}

fn cuda_dtype_error(q: &HostTensor) -> Error {
    Error::UnsupportedDType(format!("{} on the cuda backend, which takes bf16 or f16 (pass --dtype bf16)", q.dtype()))
}

fn cuda_forward<T: CudaElement>(
    gpu: &CudaBackend,
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Forward> {
    let out = gpu.forward_host(q, k, v, shape, mask, opts)?;
    Ok(Forward { o: to_f32(&out.o), lse: out.lse })
}

#[allow(clippy::too_many_arguments)]
fn cuda_backward<T: CudaElement>(
    gpu: &CudaBackend,
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[f32],
    d_o: &[T],
    lse: &[f32],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<Grads> {
    shape.check_len("o", o.len(), shape.q_elems())?;
    // O came from the kernel in T, so the round trip through f32 is exact.
    let mut o_t = vec![T::default(); o.len()];
    T::convert_from_f32(o, &mut o_t);
    let g = gpu.backward_host(q, k, v, &o_t, d_o, lse, shape, mask, opts)?;
    Ok(Grads { dq: to_f32(&g.dq), dk: to_f32(&g.dk), dv: to_f32(&g.dv) })
}

fn to_f32<T: Element>(x: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    T::convert_to_f32(x, &mut out);
    out
}

fn forward_typed<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    exec: &Execution,
) -> Result<Forward> {
    match exec {
        Execution::Single => distattn_cpu::forward(q, k, v, shape, mask, opts),
        Execution::Ranks { strategy, world, run } => {
            distributed_forward(*strategy, *world, q, k, v, shape, mask, opts, run)
        }
        Execution::GpuRanks { strategy, world, run } => {
            Ok(gpu_forward(*strategy, *world, q, k, v, shape, mask, opts, run)?.0)
        }
        Execution::Cuda(_) => unreachable!("dispatched before"),
    }
}

#[allow(clippy::too_many_arguments)]
fn backward_typed<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[f32],
    d_o: &[T],
    lse: &[f32],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    exec: &Execution,
) -> Result<Grads> {
    match exec {
        Execution::Single => {
            let delta = distattn_cpu::row_delta(o, d_o, shape)?;
            distattn_cpu::backward(q, k, v, d_o, lse, &delta, shape, mask, opts)
        }
        Execution::Ranks { strategy, world, run } => {
            distributed_backward(*strategy, *world, q, k, v, o, lse, d_o, shape, mask, opts, run)
        }
        Execution::GpuRanks { strategy, world, run } => {
            Ok(gpu_backward(*strategy, *world, q, k, v, o, lse, d_o, shape, mask, opts, run)?.0)
        }
        Execution::Cuda(_) => unreachable!("dispatched before"),
    }
}

/// Forward attention for host tensors of one dtype: O (f32) and LSE.
pub fn forward(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
    exec: &Execution,
) -> Result<Forward> {
    same_dtype(q, k, "k")?;
    same_dtype(q, v, "v")?;
    if let Execution::Cuda(gpu) = exec {
        return match (&q.data, &k.data, &v.data) {
            (TensorData::BF16(q), TensorData::BF16(k), TensorData::BF16(v)) => {
                cuda_forward(gpu, q, k, v, shape, mask, opts)
            }
            (TensorData::F16(q), TensorData::F16(k), TensorData::F16(v)) => {
                cuda_forward(gpu, q, k, v, shape, mask, opts)
            }
            _ => Err(cuda_dtype_error(q)),
        };
    }
    match (&q.data, &k.data, &v.data) {
        (TensorData::F32(q), TensorData::F32(k), TensorData::F32(v)) => forward_typed(q, k, v, shape, mask, opts, exec),
        (TensorData::BF16(q), TensorData::BF16(k), TensorData::BF16(v)) => {
            forward_typed(q, k, v, shape, mask, opts, exec)
        }
        (TensorData::F16(q), TensorData::F16(k), TensorData::F16(v)) => forward_typed(q, k, v, shape, mask, opts, exec),
        _ => unreachable!("dtypes checked above"),
    }
}

/// Backward attention for host tensors of one dtype: dQ, dK, dV from the forward's O and LSE.
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
    exec: &Execution,
) -> Result<Grads> {
    same_dtype(q, k, "k")?;
    same_dtype(q, v, "v")?;
    same_dtype(q, d_o, "grad-out")?;
    shape.check_len("grad-out", d_o.len(), shape.q_elems())?;
    if let Execution::Cuda(gpu) = exec {
        return match (&q.data, &k.data, &v.data, &d_o.data) {
            (TensorData::BF16(q), TensorData::BF16(k), TensorData::BF16(v), TensorData::BF16(g)) => {
                cuda_backward(gpu, q, k, v, o, g, lse, shape, mask, opts)
            }
            (TensorData::F16(q), TensorData::F16(k), TensorData::F16(v), TensorData::F16(g)) => {
                cuda_backward(gpu, q, k, v, o, g, lse, shape, mask, opts)
            }
            _ => Err(cuda_dtype_error(q)),
        };
    }
    match (&q.data, &k.data, &v.data, &d_o.data) {
        (TensorData::F32(q), TensorData::F32(k), TensorData::F32(v), TensorData::F32(g)) => {
            backward_typed(q, k, v, o, g, lse, shape, mask, opts, exec)
        }
        (TensorData::BF16(q), TensorData::BF16(k), TensorData::BF16(v), TensorData::BF16(g)) => {
            backward_typed(q, k, v, o, g, lse, shape, mask, opts, exec)
        }
        (TensorData::F16(q), TensorData::F16(k), TensorData::F16(v), TensorData::F16(g)) => {
            backward_typed(q, k, v, o, g, lse, shape, mask, opts, exec)
        }
        _ => unreachable!("dtypes checked above"),
    }
}

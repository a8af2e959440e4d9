//! `distattn._native`: the Rust side of the `distattn` Python package.
//!
//! It never links libtorch. The Python layer (`distattn/_ops.py`) allocates every tensor —
//! outputs and the GPU workspace — with torch and passes each as a descriptor: data address,
//! shape, strides, dtype and device. This module checks the descriptors against each other and
//! the problem (one set of checks for every caller: the library's own), then runs the CPU
//! kernels on host memory or enqueues the CUDA kernels on torch's current stream, without
//! waiting. Errors become `ValueError` (bad input), `TypeError` (dtypes) or `RuntimeError`
//! (the device); a panic becomes a `RuntimeError` and never unwinds into Python.

mod context_parallel;
mod kvcache;
mod problem;

use distattn::{DType, Error};
use kvcache::DecodeCall;
use problem::{dtype_of, gpu, Problem, Seqlens, TensorDesc};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The Python exception for a library error.
fn to_py(e: Error) -> PyErr {
    match e {
        Error::UnsupportedDType(_) | Error::DTypeMismatch { .. } => PyTypeError::new_err(e.to_string()),
        Error::Backend { .. } | Error::Internal(_) | Error::Io { .. } | Error::Comm(_) | Error::RankFailed { .. } => {
            PyRuntimeError::new_err(e.to_string())
        }
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// Runs `f` without the GIL (CPU attention takes a while; GPU calls may compile kernels) and
/// turns a panic into a `RuntimeError`.
fn guarded(py: Python<'_>, f: impl FnOnce() -> distattn::Result<()> + Send) -> PyResult<()> {
    let r = py.detach(|| catch_unwind(AssertUnwindSafe(f)));
    match r {
        Ok(r) => r.map_err(to_py),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(PyRuntimeError::new_err(format!("distattn internal error (please report it): {msg}")))
        }
    }
}

/// Forward: writes O (like Q) and LSE (`[b, h, nq]` f32, natural log).
#[pyfunction]
#[pyo3(signature = (q, k, v, o, lse, mask, softmax_scale, seqlens, stream))]
#[allow(clippy::too_many_arguments)] // one descriptor per tensor the kernels touch
fn forward(
    py: Python<'_>,
    q: TensorDesc,
    k: TensorDesc,
    v: TensorDesc,
    o: TensorDesc,
    lse: TensorDesc,
    mask: &str,
    softmax_scale: Option<f64>,
    seqlens: Option<Seqlens>,
    stream: u64,
) -> PyResult<()> {
    let mask = mask.to_string();
    guarded(py, move || {
        let p = Problem::new(&q, &k, &v, &mask, seqlens.as_ref(), softmax_scale)?;
        p.expect("o", &o, &p.q_dims(), p.dtype)?;
        p.expect("lse", &lse, &p.lse_dims(), DType::F32)?;
        p.forward(&q, &k, &v, &o, &lse, stream)
    })
}

/// FP8 forward (GPU, sm_90a, head dim 128): Q, K, V `float8_e4m3fn` with optional descales
/// (`[b, hkv]` f32); writes O (bf16 or f16, `[b, nq, h, d]`) and LSE. `vt` is the workspace,
/// [`e4m3_workspace_len`] uint8 bytes.
#[pyfunction]
#[pyo3(signature = (q, k, v, q_descale, k_descale, v_descale, vt, o, lse, mask, softmax_scale, seqlens, stream))]
#[allow(clippy::too_many_arguments)] // one descriptor per tensor the kernels touch
fn forward_e4m3(
    py: Python<'_>,
    q: TensorDesc,
    k: TensorDesc,
    v: TensorDesc,
    q_descale: Option<TensorDesc>,
    k_descale: Option<TensorDesc>,
    v_descale: Option<TensorDesc>,
    vt: TensorDesc,
    o: TensorDesc,
    lse: TensorDesc,
    mask: &str,
    softmax_scale: Option<f64>,
    seqlens: Option<Seqlens>,
    stream: u64,
) -> PyResult<()> {
    let mask = mask.to_string();
    guarded(py, move || {
        let out = problem::dtype_of("o", &o)?;
        let p = Problem::e4m3(&q, &k, &v, out, &mask, seqlens.as_ref(), softmax_scale)?;
        p.expect("o", &o, &p.q_dims(), p.dtype)?;
        p.expect("lse", &lse, &p.lse_dims(), DType::F32)?;
        let descales = [q_descale.as_ref(), k_descale.as_ref(), v_descale.as_ref()];
        p.forward_e4m3([&q, &k, &v], descales, &vt, [&o, &lse], stream)
    })
}

/// Bytes of the FP8 forward's workspace for Q `[b, nq, h, d]` and K `[b, nk, hkv, d]`.
#[pyfunction]
fn e4m3_workspace_len(b: usize, nk: usize, hkv: usize, d: usize) -> PyResult<usize> {
    let shape = distattn::AttnShape::new(b, 1, nk, hkv, hkv, d).map_err(to_py)?;
    Ok(distattn_cuda::fp8::e4m3_vt_len(&shape))
}

/// Element counts of a GPU decode's workspace: `(cu_tiles int64, part_o float32, part_lse
/// float32, counters int32)`, for the call's tensors; any contents.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, page_table, cache_seqlens))]
fn decode_workspace(
    py: Python<'_>,
    q: TensorDesc,
    k_cache: TensorDesc,
    v_cache: TensorDesc,
    page_table: TensorDesc,
    cache_seqlens: TensorDesc,
) -> PyResult<(usize, usize, usize, usize)> {
    let mut sizes = (0, 0, 0, 0);
    guarded(py, || {
        let call = DecodeCall::new(&q, &k_cache, &v_cache, &page_table, &cache_seqlens, None, None, false)?;
        sizes = call.workspace()?;
        Ok(())
    })?;
    Ok(sizes)
}

/// Decode over a KV cache: appends `k`/`v` (if given) at `cache_seqlens` in the caches, then
/// writes O (like Q) and LSE (`[b, h, s]` f32, natural log); on a GPU with `workspace`
/// (see `decode_workspace`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, page_table, cache_seqlens, k, v, o, lse, workspace, planned, softmax_scale, causal, stream))]
#[allow(clippy::too_many_arguments)] // one descriptor per tensor the kernels touch
fn decode(
    py: Python<'_>,
    q: TensorDesc,
    k_cache: TensorDesc,
    v_cache: TensorDesc,
    page_table: TensorDesc,
    cache_seqlens: TensorDesc,
    k: Option<TensorDesc>,
    v: Option<TensorDesc>,
    o: TensorDesc,
    lse: TensorDesc,
    workspace: Option<(TensorDesc, TensorDesc, TensorDesc, TensorDesc)>,
    planned: bool,
    softmax_scale: Option<f64>,
    causal: bool,
    stream: u64,
) -> PyResult<()> {
    guarded(py, move || {
        let new_kv = match (&k, &v) {
            (Some(k), Some(v)) => Some((k, v)),
            (None, None) => None,
            _ => return Err(Error::invalid("k, v", "give both new K and new V, or neither")),
        };
        let call = DecodeCall::new(&q, &k_cache, &v_cache, &page_table, &cache_seqlens, new_kv, softmax_scale, causal)?;
        let ws = workspace.as_ref().map(|(a, b, c, d)| [a, b, c, d]);
        call.run(&o, &lse, ws, planned, stream)
    })
}

/// Enqueues a GPU decode step's plan into `workspace` (see `decode_workspace`), for calls whose
/// new tokens number `seqlen_new`.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, page_table, cache_seqlens, seqlen_new, workspace, stream))]
#[allow(clippy::too_many_arguments)] // one descriptor per tensor the plan reads or writes
fn decode_plan(
    py: Python<'_>,
    q: TensorDesc,
    k_cache: TensorDesc,
    v_cache: TensorDesc,
    page_table: TensorDesc,
    cache_seqlens: TensorDesc,
    seqlen_new: usize,
    workspace: (TensorDesc, TensorDesc, TensorDesc, TensorDesc),
    stream: u64,
) -> PyResult<()> {
    guarded(py, move || {
        let call = DecodeCall::new(&q, &k_cache, &v_cache, &page_table, &cache_seqlens, None, None, false)?;
        let (a, b, c, d) = &workspace;
        call.plan(seqlen_new, [a, b, c, d], stream)
    })
}

/// Whether a GPU backward of Q's dtype and head dim needs the zeroed f32 dQ workspace
/// (`dq_acc` of `backward`); `False` on the CPU.
#[pyfunction]
fn backward_dq_workspace(py: Python<'_>, q: TensorDesc) -> PyResult<bool> {
    let mut needed = false;
    guarded(py, || {
        if q.4 >= 0 {
            let head_dim = q.1.last().copied().ok_or_else(|| Error::invalid("q", "has no dimensions"))?;
            needed = gpu(q.4)?.backward_dq_workspace(dtype_of("q", &q)?, head_dim)?;
        }
        Ok(())
    })?;
    Ok(needed)
}

/// Backward: writes dQ, dK, dV (like Q, K, V) from the forward's inputs, O, LSE and dO. On a
/// GPU, `delta` (`[b, h, nq]` f32) is workspace, and so is `dq_acc` (`[b, nq, h, d]` f32,
/// zeroed) where `backward_dq_workspace` says so (else `None`); on the CPU both are `None`.
#[pyfunction]
#[pyo3(signature = (q, k, v, o, lse, d_o, dq, dk, dv, delta, dq_acc, mask, softmax_scale, seqlens, stream))]
#[allow(clippy::too_many_arguments)] // one descriptor per tensor the kernels touch
fn backward(
    py: Python<'_>,
    q: TensorDesc,
    k: TensorDesc,
    v: TensorDesc,
    o: TensorDesc,
    lse: TensorDesc,
    d_o: TensorDesc,
    dq: TensorDesc,
    dk: TensorDesc,
    dv: TensorDesc,
    delta: Option<TensorDesc>,
    dq_acc: Option<TensorDesc>,
    mask: &str,
    softmax_scale: Option<f64>,
    seqlens: Option<Seqlens>,
    stream: u64,
) -> PyResult<()> {
    let mask = mask.to_string();
    guarded(py, move || {
        let p = Problem::new(&q, &k, &v, &mask, seqlens.as_ref(), softmax_scale)?;
        let (q_dims, kv_dims) = (p.q_dims(), p.kv_dims());
        for (name, t, dims) in [("o", &o, &q_dims), ("d_o", &d_o, &q_dims), ("dq", &dq, &q_dims)] {
            p.expect(name, t, dims, p.dtype)?;
        }
        p.expect("dk", &dk, &kv_dims, p.dtype)?;
        p.expect("dv", &dv, &kv_dims, p.dtype)?;
        p.expect("lse", &lse, &p.lse_dims(), DType::F32)?;
        let workspace = match (&delta, &dq_acc) {
            (Some(delta), dq_acc) => {
                p.expect("delta", delta, &p.lse_dims(), DType::F32)?;
                if let Some(dq_acc) = dq_acc {
                    p.expect("dq_acc", dq_acc, &q_dims, DType::F32)?;
                }
                Some((delta, dq_acc.as_ref()))
            }
            (None, None) => None,
            (None, Some(_)) => return Err(Error::invalid("workspace", "dq_acc was given without delta")),
        };
        p.backward([&q, &k, &v, &o, &lse, &d_o], [&dq, &dk, &dv], workspace, stream)
    })
}

/// Whether a CUDA driver and GPU can be used by the kernels.
#[pyfunction]
fn cuda_available() -> bool {
    distattn_cuda::cuda_available()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(forward_e4m3, m)?)?;
    m.add_function(wrap_pyfunction!(e4m3_workspace_len, m)?)?;
    m.add_function(wrap_pyfunction!(decode_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(decode, m)?)?;
    m.add_function(wrap_pyfunction!(decode_plan, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(backward_dq_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::cp_layout, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::cp_kept, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::strategy_name, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::cp_auto_strategy, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::kv_owners, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::kv_positions, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::launcher_ranks_per_node, m)?)?;
    m.add_function(wrap_pyfunction!(context_parallel::release_cached_memory, m)?)?;
    m.add_class::<context_parallel::CpRank>()?;
    m.add_class::<context_parallel::CpTransport>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

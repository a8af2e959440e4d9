//! Context parallelism from PyTorch: the native side of `distattn.distributed.ContextParallel`.
//!
//! Each process holds its shards of one sequence as torch tensors. A [`CpRank`] is its rank of
//! a strategy's plan for the whole problem ([`RankAttention`]), run through the one interpreter
//! on the tensors' device with one of two transports:
//! * CPU tensors: the Python process group itself ([`GroupComm`]: every transfer calls back
//!   into the Python object that wraps `torch.distributed`, gloo in practice);
//! * CUDA tensors: distattn's own NCCL communicator, joined with a unique id that rank 0 made
//!   and broadcast over the group, on the backend's comm stream; the inputs are copied from
//!   torch's memory after an event on torch's current stream, and torch's stream waits for
//!   the outputs' copies by another event.

use crate::problem::{cached_mask, dtype_of, expect, gpu, host, where_is, TensorDesc};
use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
use distattn::plan::{Tensor, TokenSet};
use distattn::planner::{fastest, fastest_training, TRAINING_CANDIDATES};
use distattn::{
    AttnShape, Backend, Communicator, CpuBackend, DType, Error, HostData, Mask, PlanOptions, RankAttention, Result,
    Strategy,
};
use distattn_cuda::{CudaBackend, GpuBuf};
use distattn_nccl::comm::UniqueId;
use distattn_nccl::NcclComm;
use half::{bf16, f16};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use std::sync::Arc;
use std::time::Duration;

/// A host communicator whose transfers are made by a Python object over a
/// `torch.distributed` process group. Its methods take and return `bytes`:
/// `group(sends: [(peer, bytes)], recvs: [(peer, nbytes)]) -> [bytes]`, `all_gather(bytes)`,
/// `all_to_all(bytes)`, `reduce_scatter_f32(bytes)`, `barrier()`, `abort(reason)`.
pub struct GroupComm {
    obj: Py<PyAny>,
    rank: usize,
    world: usize,
}

fn comm_err(what: &str) -> impl Fn(PyErr) -> Error + '_ {
    move |e| Error::Comm(format!("{what} over the torch.distributed group: {e}"))
}

impl GroupComm {
    /// Calls `method(args)` on the Python object and copies the returned `bytes` objects into
    /// `outs` (each of exactly its size).
    fn call<'a>(
        &self,
        method: &str,
        args: impl for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, PyTuple>>,
        outs: impl IntoIterator<Item = &'a mut [u8]>,
    ) -> Result<()> {
        Python::attach(|py| {
            let err = comm_err(method);
            let got = self.obj.bind(py).call_method1(method, args(py).map_err(&err)?).map_err(&err)?;
            let mut outs = outs.into_iter().peekable();
            if outs.peek().is_none() {
                return Ok(());
            }
            let got: Vec<Bound<'_, PyBytes>> = got.extract().map_err(&err)?;
            let mut n = 0;
            for (out, b) in outs.zip(&got) {
                let b = b.as_bytes();
                if b.len() != out.len() {
                    return Err(Error::Comm(format!("{method}: received {} bytes, expected {}", b.len(), out.len())));
                }
                out.copy_from_slice(b);
                n += 1;
            }
            if n != got.len() {
                return Err(Error::Comm(format!("{method}: {} messages returned, {n} expected", got.len())));
            }
            Ok(())
        })
    }
}

impl Communicator for GroupComm {
    type Buf = [u8];

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    unsafe fn group(&self, sends: &[(usize, &[u8])], recvs: &mut [(usize, &mut [u8])]) -> Result<()> {
        let sizes: Vec<(usize, usize)> = recvs.iter().map(|(p, b)| (*p, b.len())).collect();
        self.call(
            "group",
            |py| {
                let s: Vec<(usize, Bound<'_, PyBytes>)> =
                    sends.iter().map(|(p, b)| (*p, PyBytes::new(py, b))).collect();
                (s, sizes).into_pyobject(py)
            },
            recvs.iter_mut().map(|(_, b)| &mut **b),
        )
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.call("all_gather", |py| PyTuple::new(py, [PyBytes::new(py, send)]), [recv])
    }

    fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.call("all_to_all", |py| PyTuple::new(py, [PyBytes::new(py, send)]), [recv])
    }

    fn reduce_scatter_f32(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.call("reduce_scatter_f32", |py| PyTuple::new(py, [PyBytes::new(py, send)]), [recv])
    }

    fn barrier(&self) -> Result<()> {
        self.call("barrier", |py| Ok(PyTuple::empty(py)), std::iter::empty())
    }

    fn abort(&self, reason: &str) {
        // Nothing travels: the peers learn of the failure from the process group itself (a
        // closed connection or its timeout).
        let _ = self.call("abort", |py| PyTuple::new(py, [reason]), std::iter::empty());
    }
}

/// How the ranks of a group talk: made once per group, shared by every problem's [`CpRank`].
enum Transport {
    Host(GroupComm),
    Nccl { gpu: Arc<CudaBackend>, comm: NcclComm },
}

/// The transport of one process group.
#[pyclass(module = "distattn._native", frozen)]
pub struct CpTransport(Arc<Transport>);

#[pymethods]
impl CpTransport {
    /// Transfers of CPU tensors made by `obj` (see [`GroupComm`]), rank `rank` of `world`.
    #[staticmethod]
    fn host(obj: Py<PyAny>, rank: usize, world: usize) -> CpTransport {
        CpTransport(Arc::new(Transport::Host(GroupComm { obj, rank, world })))
    }

    /// distattn's NCCL communicator on GPU `ordinal`, rank `rank` of `world`, joined with the
    /// unique id every rank got from rank 0; a peer silent for `timeout` seconds fails the group.
    #[staticmethod]
    fn nccl(
        py: Python<'_>,
        ordinal: i64,
        id: Vec<u8>,
        rank: usize,
        world: usize,
        timeout: f64,
    ) -> PyResult<CpTransport> {
        let id = UniqueId::from_bytes(&id).map_err(crate::to_py)?;
        let timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|_| crate::to_py(Error::invalid("timeout", format!("{timeout} s is not a duration"))))?;
        let mut joined = None;
        crate::guarded(py, || {
            let gpu = gpu(ordinal)?;
            // A run's buffers come from the device's memory pool. Kept between calls (as torch's
            // caching allocator keeps its blocks), the next call reuses them; trimmed at every
            // synchronisation, as by default, each call maps its memory again (a third of a
            // 32k-token forward on two GPUs). `release_cached_memory` gives them back.
            gpu.keep_memory_pool()?;
            let comm = NcclComm::init(&gpu, rank, world, id, None, timeout)?;
            joined = Some(Transport::Nccl { gpu, comm });
            Ok(())
        })?;
        let t = joined.ok_or_else(|| crate::to_py(Error::Internal("NCCL communicator missing".into())))?;
        Ok(CpTransport(Arc::new(t)))
    }

    /// Waits for the last attention call's device work and raises the failure it met, if any.
    /// (GPU calls return once their work is queued; the next call, or this, reports its end.)
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        crate::guarded(py, || match &*self.0 {
            Transport::Host(_) => Ok(()),
            Transport::Nccl { comm, .. } => comm.settle(),
        })
    }
}

/// One rank of a context-parallel strategy over a process group, for one problem.
#[pyclass(module = "distattn._native", frozen)]
pub struct CpRank {
    attn: RankAttention,
    transport: Arc<Transport>,
}

/// A fresh NCCL unique id (rank 0 makes it; the group broadcasts it).
#[pyfunction]
pub fn nccl_unique_id(py: Python<'_>) -> PyResult<Py<PyBytes>> {
    let id = distattn_nccl::comm::unique_id().map_err(crate::to_py)?;
    Ok(PyBytes::new(py, &id.to_bytes()).unbind())
}

/// Returns to the device the memory context-parallel runs on GPU `ordinal` keep for their next
/// call (blocks of the device's default memory pool that no run holds).
#[pyfunction]
pub fn release_cached_memory(py: Python<'_>, ordinal: i64) -> PyResult<()> {
    crate::guarded(py, || gpu(ordinal)?.release_memory_pool())
}

/// Ranks per node as the launcher's variables say (torchrun's `LOCAL_WORLD_SIZE`, else Slurm's
/// `SLURM_NTASKS_PER_NODE` or its list `SLURM_TASKS_PER_NODE` where the nodes are alike), or
/// `None`; a malformed count is a `ValueError`.
#[pyfunction]
pub fn launcher_ranks_per_node() -> PyResult<Option<usize>> {
    distattn_nccl::launch::ranks_per_node(|k| std::env::var(k).ok()).map_err(crate::to_py)
}

/// The rank holding each of positions `start..start + count` of a request homed on `home`, its
/// cache placed by `placement` (`pages:N`, `contiguous:N` or `zigzag:N`) over `world` ranks.
#[pyfunction]
pub fn kv_owners(placement: &str, world: usize, home: usize, start: usize, count: usize) -> PyResult<Vec<usize>> {
    let p = KvPlacement::from_spec(placement, start + count, world).map_err(crate::to_py)?;
    Ok((start..start + count).map(|pos| p.owner(home, pos)).collect())
}

/// The positions (of `0..length`) of a request homed on `home` that `rank` holds, as runs
/// `(start, end)`, its cache placed by `placement` over `world` ranks (`capacity`: the longest
/// request of the step, for placements named without one).
#[pyfunction]
pub fn kv_positions(
    placement: &str,
    world: usize,
    capacity: usize,
    home: usize,
    length: usize,
    rank: usize,
) -> PyResult<Vec<(usize, usize)>> {
    let p = KvPlacement::from_spec(placement, capacity, world).map_err(crate::to_py)?;
    if rank >= world || home >= world {
        return Err(crate::to_py(Error::invalid("rank", format!("ranks {home} and {rank} of a world of {world}"))));
    }
    Ok(p.positions(home, length, rank).into_iter().map(|r| (r.start, r.end)).collect())
}

/// The strategy named `name` (`hybrid:U` for a Ulysses degree), as distattn prints it; an
/// unknown name is a `ValueError` listing the strategies.
#[pyfunction]
pub fn strategy_name(name: &str) -> PyResult<String> {
    name.parse::<Strategy>().map(|s| s.to_string()).map_err(crate::to_py)
}

/// The strategy a training step of the problem `(batch, seq, heads, kv_heads, head_dim)` under
/// the mask `spec` on `world` ranks runs fastest by the planner's time model (forward plus
/// backward; `planner::fastest_training` over its usual candidates), as distattn prints it.
#[pyfunction]
#[pyo3(signature = (world, shape, mask, ranks_per_node=None))]
pub fn cp_auto_strategy(
    world: usize,
    shape: (usize, usize, usize, usize, usize),
    mask: &str,
    ranks_per_node: Option<usize>,
) -> PyResult<String> {
    let pick = || -> Result<Strategy> {
        let (shape, mask, opts) = problem(shape, mask, ranks_per_node)?;
        fastest_training(&TRAINING_CANDIDATES, world, &shape, &mask, DType::BF16, &opts, &Default::default())
    };
    pick().map(|s| s.to_string()).map_err(crate::to_py)
}

/// The whole problem `(batch, seq, heads, kv_heads, head_dim)` under the mask spec, and the
/// options every context-parallel plan of the package is built with.
fn problem(
    (b, n, h, hkv, d): (usize, usize, usize, usize, usize),
    mask: &str,
    ranks_per_node: Option<usize>,
) -> Result<(AttnShape, Arc<Mask>, PlanOptions)> {
    let shape = AttnShape::new(b, n, n, h, hkv, d)?;
    let mask = cached_mask(mask, n, n, None, b)?;
    // The Python side returns O, dQ, dK, dV in the input dtype: the plans hand them back in it.
    // Ulysses and hybrid hand the head-sharded Q, K, V and LSE from the forward to the backward
    // (autograd keeps them instead of the shards: as many values), so the backward's all-to-all
    // moves only dO and D.
    let opts = PlanOptions { ranks_per_node, narrow_outputs: true, keep_head_sharded: true, ..PlanOptions::default() };
    Ok((shape, mask, opts))
}

/// Every rank's tokens (runs of global positions) for `strategy` on `world` ranks over the
/// problem `(batch, seq, heads, kv_heads, head_dim)` under the mask `spec`.
#[pyfunction]
#[pyo3(signature = (strategy, world, shape, mask, ranks_per_node=None))]
pub fn cp_layout(
    strategy: &str,
    world: usize,
    shape: (usize, usize, usize, usize, usize),
    mask: &str,
    ranks_per_node: Option<usize>,
) -> PyResult<Vec<Vec<(usize, usize)>>> {
    let attn = rank_attention(strategy, world, 0, shape, mask, None, ranks_per_node).map_err(crate::to_py)?;
    Ok(attn.layout().q.iter().map(runs).collect())
}

/// What rank `rank`'s forward keeps for its backward for `strategy` on `world` ranks over the
/// problem `(batch, seq, heads, kv_heads, head_dim)` under the mask `spec`: `(name, shape)` of
/// `q`, `k`, `v` (the inputs' dtype `dtype`) and `lse` (f32), in the order `CpRank.forward`
/// writes them and `CpRank.backward` takes them instead of Q, K, V and LSE; none where the
/// strategy keeps nothing (it shards no heads).
#[pyfunction]
#[pyo3(signature = (strategy, world, rank, shape, mask, dtype, ranks_per_node=None))]
pub fn cp_kept(
    strategy: &str,
    world: usize,
    rank: usize,
    shape: (usize, usize, usize, usize, usize),
    mask: &str,
    dtype: &str,
    ranks_per_node: Option<usize>,
) -> PyResult<Vec<(String, Vec<usize>)>> {
    let kept = || -> Result<Vec<(Tensor, Vec<usize>)>> {
        let dtype: DType = dtype.parse().map_err(|_| Error::UnsupportedDType(dtype.to_string()))?;
        rank_attention(strategy, world, rank, shape, mask, None, ranks_per_node)?.kept(dtype)
    };
    Ok(kept().map_err(crate::to_py)?.into_iter().map(|(t, dims)| (kept_name(t).to_string(), dims)).collect())
}

fn runs(t: &TokenSet) -> Vec<(usize, usize)> {
    t.to_runs().into_iter().map(|r| (r.start, r.end)).collect()
}

fn rank_attention(
    strategy: &str,
    world: usize,
    rank: usize,
    shape: (usize, usize, usize, usize, usize),
    mask: &str,
    softmax_scale: Option<f64>,
    ranks_per_node: Option<usize>,
) -> Result<RankAttention> {
    let strategy: Strategy = strategy.parse()?;
    let (shape, mask, opts) = problem(shape, mask, ranks_per_node)?;
    RankAttention::with_options(shape, (*mask).clone(), strategy, world, rank, opts)?
        .scale(softmax_scale.map(|s| s as f32))
}

#[pymethods]
impl CpRank {
    /// Rank `rank` of `world` for the whole problem `(batch, seq, heads, kv_heads, head_dim)`
    /// under the mask spec, over `transport`.
    #[new]
    #[pyo3(signature = (strategy, world, rank, shape, mask, softmax_scale, transport, ranks_per_node=None))]
    #[allow(clippy::too_many_arguments)] // the problem, the group and its node structure
    fn new(
        strategy: &str,
        world: usize,
        rank: usize,
        shape: (usize, usize, usize, usize, usize),
        mask: &str,
        softmax_scale: Option<f64>,
        transport: &CpTransport,
        ranks_per_node: Option<usize>,
    ) -> PyResult<CpRank> {
        let attn =
            rank_attention(strategy, world, rank, shape, mask, softmax_scale, ranks_per_node).map_err(crate::to_py)?;
        check_transport(transport, rank, world)?;
        Ok(CpRank { attn, transport: transport.0.clone() })
    }

    /// Rank `rank` of one serving step over a KV cache spread over the group: `requests` as
    /// `(home, cached, new)`, the cache placed by `placement` (`contiguous[:N]`, `zigzag[:N]`
    /// or `pages:N`), the queries at their home (`prefill` false) or beside their keys, run by
    /// `strategy` (`pass-q`, `ring`, or `auto`: the one the planner's time model estimates
    /// faster). Returns the rank and the strategy used.
    #[staticmethod]
    #[pyo3(signature = (requests, placement, prefill, strategy, world, rank, heads, kv_heads, head_dim, softmax_scale, transport))]
    #[allow(clippy::too_many_arguments)] // the step, the group and the heads
    fn serving(
        requests: Vec<(usize, usize, usize)>,
        placement: &str,
        prefill: bool,
        strategy: &str,
        world: usize,
        rank: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        softmax_scale: Option<f64>,
        transport: &CpTransport,
    ) -> PyResult<(CpRank, String)> {
        let build = || -> Result<(RankAttention, Strategy)> {
            let reqs: Vec<StepRequest> =
                requests.iter().map(|&(home, cached, new)| StepRequest { home, cached, new }).collect();
            let capacity = reqs.iter().map(|r| r.cached + r.new).max().unwrap_or(0);
            let placement = KvPlacement::from_spec(placement, capacity, world)?;
            let queries = if prefill { Queries::WithKeys } else { Queries::AtHome };
            let step = ServingStep::new(&placement, &reqs, queries, heads, kv_heads, head_dim)?;
            // Each strategy is planned once: `auto` plans both candidates and keeps the chosen
            // plan, a named one is planned by `placed`; the forward's program reuses that plan.
            let attn = match strategy {
                "auto" => {
                    let opts = PlanOptions { layout: Some(step.layout.clone()), ..PlanOptions::default() };
                    let both = [Strategy::PassQ, Strategy::Ring];
                    let plan = fastest(&both, world, &step.shape, &step.mask, DType::BF16, &opts, &Default::default())?;
                    RankAttention::placed_plan(plan, step.mask, rank)?
                }
                s => RankAttention::placed(step.shape, step.mask, step.layout, s.parse()?, world, rank)?,
            }
            .scale(softmax_scale.map(|s| s as f32))?;
            let chosen = attn.strategy();
            Ok((attn, chosen))
        };
        let (attn, chosen) = build().map_err(crate::to_py)?;
        check_transport(transport, rank, world)?;
        Ok((CpRank { attn, transport: transport.0.clone() }, chosen.to_string()))
    }

    /// This rank's query rows (and, for a sequence sharded alike, key rows), as runs
    /// `(start, end)` of global positions.
    fn tokens(&self) -> Vec<(usize, usize)> {
        runs(self.attn.tokens())
    }

    /// Writes O (`[b, n_local, h, d]`, the inputs' dtype) and LSE (f32, `[b, h, n_local]`) of
    /// this rank's shards of Q, K, V, and into `kept` (shaped as `kept()` says, or empty: the
    /// caller needs no backward) what the backward takes instead of Q, K, V and LSE. `stream`
    /// is torch's current stream (CUDA tensors).
    #[pyo3(signature = (q, k, v, o, lse, kept, stream))]
    #[allow(clippy::too_many_arguments)] // one descriptor per tensor of the pass
    fn forward(
        &self,
        py: Python<'_>,
        q: TensorDesc,
        k: TensorDesc,
        v: TensorDesc,
        o: TensorDesc,
        lse: TensorDesc,
        kept: Vec<TensorDesc>,
        stream: u64,
    ) -> PyResult<()> {
        let run = || {
            let io = self.io(&q)?;
            io.check_shards(&[("q", &q, false), ("k", &k, true), ("v", &v, true), ("o", &o, false)])?;
            io.check_stat("lse", &lse)?;
            let keeps = self.attn.kept(io.dtype)?;
            if !kept.is_empty() {
                io.check_kept(&keeps, &kept.iter().collect::<Vec<_>>())?;
            }
            let kept_dtypes = keeps.iter().map(|&(t, _)| t.dtype(io.dtype));
            match &*self.transport {
                Transport::Host(comm) => {
                    let cpu = CpuBackend;
                    let [qb, kb, vb] = [&q, &k, &v].map(|t| host_buf(io.dtype, t));
                    let run = self.attn.forward_deferred(&cpu, comm, io.dtype, qb?, kb?, vb?)?;
                    run.completion.wait(&cpu, comm)?;
                    let [ob, lb] = run.outputs;
                    host_out(&cpu, &ob, io.dtype, &o)?;
                    host_out(&cpu, &lb, DType::F32, &lse)?;
                    for ((b, t), dtype) in run.saved.iter().zip(&kept).zip(kept_dtypes) {
                        host_out(&cpu, b, dtype, t)?;
                    }
                    Ok(())
                }
                Transport::Nccl { gpu, comm } => {
                    // The call returns once its work is queued (torch's stream waits for it), so
                    // the host prepares the next op meanwhile; the communicator watches the run.
                    let [qb, kb, vb] = gpu_inputs(gpu, stream, io.dtype, [&q, &k, &v])?;
                    let run = self.attn.forward_deferred(&**gpu, comm, io.dtype, qb, kb, vb)?;
                    gpu_outputs(gpu, stream, run.outputs, [(&o, io.dtype), (&lse, DType::F32)])?;
                    if kept.is_empty() {
                        run.saved.into_iter().for_each(|b| b.free_on(gpu.stream()));
                    } else {
                        let outs: Vec<_> = kept.iter().zip(kept_dtypes).collect();
                        gpu_outputs_dyn(gpu, stream, run.saved, &outs)?;
                    }
                    comm.watch(run.completion)
                }
            }
        };
        // CPU: the transport calls back into Python, so the GIL is released only around the
        // whole run (it is taken again for each transfer).
        crate::guarded(py, run)
    }

    /// Writes dQ, dK, dV (like this rank's shards, in their dtype) from its shards of Q, K, V,
    /// the forward's O and LSE, and dO; where the forward kept tensors (`kept()`), Q, K, V and
    /// LSE are those.
    #[pyo3(signature = (q, k, v, o, lse, d_o, dq, dk, dv, stream))]
    #[allow(clippy::too_many_arguments)] // one descriptor per tensor of the pass
    fn backward(
        &self,
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
        stream: u64,
    ) -> PyResult<()> {
        let run = || {
            let io = self.io(&q)?;
            let keeps = self.attn.kept(io.dtype)?;
            if keeps.is_empty() {
                io.check_shards(&[("q", &q, false), ("k", &k, true), ("v", &v, true)])?;
                io.check_stat("lse", &lse)?;
            } else {
                io.check_kept(&keeps, &[&q, &k, &v, &lse])?;
            }
            io.check_shards(&[("o", &o, false), ("d_o", &d_o, false), ("dq", &dq, false)])?;
            io.check_shards(&[("dk", &dk, true), ("dv", &dv, true)])?;
            let rows = io.local;
            match &*self.transport {
                Transport::Host(comm) => {
                    let cpu = CpuBackend;
                    let [qb, kb, vb, ob, gb] = [&q, &k, &v, &o, &d_o].map(|t| host_buf(io.dtype, t));
                    let (ob, gb) = (ob?, gb?);
                    let delta = cpu.row_delta(&ob, &gb, &rows)?;
                    let lb = host_buf(DType::F32, &lse)?;
                    let grads = self.attn.backward(&cpu, comm, io.dtype, qb?, kb?, vb?, gb, lb, delta)?;
                    for (g, t) in grads.iter().zip([&dq, &dk, &dv]) {
                        host_out(&cpu, g, io.dtype, t)?;
                    }
                    Ok(())
                }
                Transport::Nccl { gpu, comm } => {
                    let [qb, kb, vb, ob, gb] = gpu_inputs(gpu, stream, io.dtype, [&q, &k, &v, &o, &d_o])?;
                    let [lb] = gpu_inputs(gpu, stream, DType::F32, [&lse])?;
                    // D = rowsum(dO ∘ O) from torch's O, in the inputs' dtype, as the kernels'
                    // own backward computes it.
                    let delta = gpu.row_delta(&ob, &gb, &rows)?;
                    let run = self.attn.backward_deferred(&**gpu, comm, io.dtype, qb, kb, vb, gb, lb, delta)?;
                    let [gq, gk, gv] = [&dq, &dk, &dv].map(|t| (t, io.dtype));
                    gpu_outputs(gpu, stream, run.outputs, [gq, gk, gv])?;
                    comm.watch(run.completion)
                }
            }
        };
        crate::guarded(py, run)
    }
}

/// The transport serves rank `rank` of `world`.
fn check_transport(transport: &CpTransport, rank: usize, world: usize) -> PyResult<()> {
    let (r, w) = match &*transport.0 {
        Transport::Host(c) => (c.rank(), c.world()),
        Transport::Nccl { comm, .. } => (comm.rank(), comm.world()),
    };
    if (r, w) != (rank, world) {
        return Err(crate::to_py(Error::invalid(
            "transport",
            format!("rank {r} of {w}, for a problem of rank {rank} of {world}"),
        )));
    }
    Ok(())
}

/// What a call's tensors must be: the input dtype, the device and the local shape.
struct Io {
    dtype: DType,
    device: i64,
    local: AttnShape,
}

impl CpRank {
    fn io(&self, q: &TensorDesc) -> Result<Io> {
        let dtype = dtype_of("q", q)?;
        let device = match &*self.transport {
            Transport::Host(_) => -1,
            Transport::Nccl { gpu, .. } => gpu.context().ordinal() as i64,
        };
        if q.4 != device {
            return Err(Error::invalid(
                "q",
                format!("is on {}, and this context-parallel group runs on {}", where_is(q.4), where_is(device)),
            ));
        }
        Ok(Io { dtype, device, local: self.attn.local_shape() })
    }
}

impl Io {
    fn dims(&self, kv: bool) -> [usize; 4] {
        let s = &self.local;
        let (n, h) = if kv { (s.k_len, s.kv_heads) } else { (s.q_len, s.heads) };
        [s.batch, n, h, s.head_dim]
    }

    fn check(&self, name: &str, t: &TensorDesc, dims: &[usize], dtype: DType) -> Result<()> {
        expect(name, t, dims, dtype, self.device)
    }

    /// Tensors shaped like this rank's shards of Q (`kv` false) or K, V, in the inputs' dtype:
    /// the inputs, and the outputs written in it.
    fn check_shards(&self, ts: &[(&str, &TensorDesc, bool)]) -> Result<()> {
        ts.iter().try_for_each(|(name, t, kv)| self.check(name, t, &self.dims(*kv), self.dtype))
    }

    fn check_stat(&self, name: &str, t: &TensorDesc) -> Result<()> {
        let s = &self.local;
        self.check(name, t, &[s.batch, s.heads, s.q_len], DType::F32)
    }

    /// Tensors shaped as a forward keeps them (`keeps`, from `RankAttention::kept`), in order:
    /// Q, K, V in the inputs' dtype, LSE in f32.
    fn check_kept(&self, keeps: &[(Tensor, Vec<usize>)], ts: &[&TensorDesc]) -> Result<()> {
        if ts.len() != keeps.len() {
            return Err(Error::invalid(
                "kept",
                format!("{} tensors for the {} this strategy keeps from the forward", ts.len(), keeps.len()),
            ));
        }
        for ((t, dims), desc) in keeps.iter().zip(ts) {
            self.check(&format!("kept {}", kept_name(*t)), desc, dims, t.dtype(self.dtype))?;
        }
        Ok(())
    }
}

/// The Python name of a tensor a forward keeps.
fn kept_name(t: Tensor) -> &'static str {
    match t {
        Tensor::Q => "q",
        Tensor::K => "k",
        Tensor::V => "v",
        Tensor::Lse => "lse",
        _ => "other",
    }
}

/// A host buffer holding a copy of the CPU tensor `t` of `dtype` (checked).
fn host_buf(dtype: DType, t: &TensorDesc) -> Result<HostData> {
    // SAFETY: `t` was checked to be a contiguous CPU tensor of `dtype` of the expected shape,
    // which the Python caller keeps alive and unwritten for the call.
    unsafe {
        match dtype {
            DType::F32 => CpuBackend.upload(host::<f32>(t)),
            DType::BF16 => CpuBackend.upload(host::<bf16>(t)),
            DType::F16 => CpuBackend.upload(host::<f16>(t)),
        }
    }
}

/// Writes a host output (f32 values) into the CPU tensor `t` of `dtype` (checked, same size),
/// rounding to nearest even for 16-bit types.
fn host_out(cpu: &CpuBackend, buf: &HostData, dtype: DType, t: &TensorDesc) -> Result<()> {
    let data = HostData::from_f32(&cpu.download_f32(buf)?, dtype);
    let bytes = t.1.iter().product::<usize>() * dtype.size();
    if data.as_bytes().len() != bytes {
        return Err(Error::Internal(format!("an output of {} values for a tensor of shape {:?}", data.len(), t.1)));
    }
    // SAFETY: `t` is a contiguous CPU tensor of `dtype` (checked) of `bytes` bytes, which the
    // Python caller allocated for this call's output and nothing else touches during it.
    unsafe { std::slice::from_raw_parts_mut(t.0 as *mut u8, bytes) }.copy_from_slice(data.as_bytes());
    Ok(())
}

/// The CUDA tensors `ts` (checked, of `dtype`) as device buffers, read on the backend's compute
/// stream after the work enqueued so far on torch's `stream`: lent without a copy where
/// 16-byte aligned (the kernels' loads need it), else copied.
fn gpu_inputs<const N: usize>(
    gpu: &CudaBackend,
    stream: u64,
    dtype: DType,
    ts: [&TensorDesc; N],
) -> Result<[GpuBuf; N]> {
    // SAFETY: `stream` is torch's current stream of this device, alive for the call.
    let torch = unsafe { gpu.borrow_stream(stream) };
    let ready = torch.record_event(None).map_err(distattn_cuda::driver_err("recording an event"))?;
    gpu.stream().wait(&ready).map_err(distattn_cuda::driver_err("ordering the streams"))?;
    let mut out = Vec::with_capacity(N);
    for t in ts {
        let len = t.1.iter().product();
        // SAFETY: `t` is a contiguous CUDA tensor of `dtype` on this device with `len`
        // elements (checked). The call returns before the run ends, but torch's stream waits
        // for that end (`gpu_outputs`) before its next work, so the tensor's memory is neither
        // written nor reused by torch before the run has read it. Plans never write their
        // inputs (`Plan::validate`), so a lent tensor is only read.
        let buf = unsafe {
            if t.0.is_multiple_of(16) {
                GpuBuf::lent(gpu.stream(), dtype, t.0, len)
            } else {
                GpuBuf::copy_of(gpu.stream(), dtype, t.0, len)
            }
        };
        out.push(buf?);
    }
    out.try_into().map_err(|_| Error::Internal("input count".into()))
}

/// Writes the outputs (f32, or already in the tensors' dtypes: the plans narrow them) into the
/// CUDA tensors `ts` in their dtypes on the backend's compute stream, then releases them there
/// (a run may have allocated one on its comm lane, whose own order would not follow these
/// reads); torch's `stream` then waits for the writes.
fn gpu_outputs<const N: usize>(
    gpu: &CudaBackend,
    stream: u64,
    bufs: [GpuBuf; N],
    ts: [(&TensorDesc, DType); N],
) -> Result<()> {
    gpu_outputs_dyn(gpu, stream, bufs.into(), &ts)
}

/// [`gpu_outputs`] for as many buffers as tensors, however many.
fn gpu_outputs_dyn(gpu: &CudaBackend, stream: u64, bufs: Vec<GpuBuf>, ts: &[(&TensorDesc, DType)]) -> Result<()> {
    if bufs.len() != ts.len() {
        return Err(Error::Internal(format!("{} outputs for {} tensors", bufs.len(), ts.len())));
    }
    for (b, &(t, dtype)) in bufs.into_iter().zip(ts) {
        if b.len() != t.1.iter().product::<usize>() {
            return Err(Error::Internal(format!("an output of {} values for a tensor of shape {:?}", b.len(), t.1)));
        }
        // SAFETY: `t` is a contiguous CUDA tensor of `dtype` on this device with room for the
        // buffer's values (checked above and by the caller), allocated by the Python caller for
        // this call's output (torch aligns fresh allocations to 512 bytes).
        unsafe { gpu.store_external(&b, t.0, dtype) }?;
        b.free_on(gpu.stream());
    }
    // SAFETY: as in `gpu_inputs`.
    let torch = unsafe { gpu.borrow_stream(stream) };
    let done = gpu.stream().record_event(None).map_err(distattn_cuda::driver_err("recording an event"))?;
    torch.wait(&done).map_err(distattn_cuda::driver_err("ordering the streams"))
}

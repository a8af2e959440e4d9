//! The one way to call attention: [`Attention`], a problem (shape, mask, softmax scale) and
//! where it runs ([`Execution`]), with `forward` and `backward` taking the same arguments in
//! the same order whatever runs them.

use distattn_core::plan::Pass;
use distattn_core::planner::build;
use distattn_core::{
    AttnOptions, AttnShape, DType, Element, Error, Forward, Grads, Mask, Plan, PlanOptions, Result, Strategy,
};
use distattn_exec::{
    gather_forward, gather_grads, prepare_all, run_rank, BackwardTensors, ExecOptions, HostTensors, InjectedFailure,
    PreparedRank, Shard,
};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[cfg(feature = "cuda")]
use distattn_cuda::CudaBackend;

/// Where an attention call runs.
#[derive(Clone, Default)]
#[non_exhaustive]
// Built once per `Attention` and matched, never moved in bulk: boxing `Ranks` would only add an
// indirection to the variants callers write.
#[allow(clippy::large_enum_variant)]
pub enum Execution {
    /// One call of the CPU kernels (the default).
    #[default]
    Cpu,
    /// One call of the CUDA kernels on this GPU (bf16 and f16 inputs).
    #[cfg(feature = "cuda")]
    Cuda(Arc<CudaBackend>),
    /// In-process CPU ranks, one thread each, running the plan of a context-parallel strategy.
    CpuRanks(Ranks),
    /// Local GPUs, one thread each with NCCL between them, running the plan of a strategy
    /// (bf16 and f16 inputs).
    #[cfg(feature = "nccl")]
    GpuRanks(Ranks),
}

impl Execution {
    /// One call of the CUDA kernels on GPU `ordinal`.
    #[cfg(feature = "cuda")]
    pub fn cuda(ordinal: usize) -> Result<Execution> {
        Ok(Execution::Cuda(Arc::new(CudaBackend::new(ordinal)?)))
    }

    /// A short description for logs and reports.
    pub fn describe(&self) -> String {
        match self {
            Execution::Cpu => "cpu".into(),
            #[cfg(feature = "cuda")]
            Execution::Cuda(gpu) => format!("cuda, {}", gpu.device_name()),
            Execution::CpuRanks(r) => format!("cpu, {} on {} ranks", r.strategy, r.world),
            #[cfg(feature = "nccl")]
            Execution::GpuRanks(r) => format!("cuda, {} on {} GPUs", r.strategy, r.world),
        }
    }
}

/// A context-parallel run: `world` ranks running the plan of `strategy`.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranks {
    pub world: usize,
    pub strategy: Strategy,
    /// Planner options (the pass is set by each call).
    pub plan: PlanOptions,
    /// A rank waiting this long for a peer gives up with an error.
    pub timeout: Duration,
    /// GPU ranks: rank r uses GPU `first_gpu + r`.
    pub first_gpu: usize,
    /// Test hook: make a rank fail.
    pub fail: Option<InjectedFailure>,
}

impl Ranks {
    /// `world` ranks running `strategy` with default options (60 s timeout, GPUs from 0).
    pub fn new(world: usize, strategy: Strategy) -> Ranks {
        Ranks {
            world,
            strategy,
            plan: PlanOptions::default(),
            timeout: Duration::from_secs(60),
            first_gpu: 0,
            fail: None,
        }
    }
}

/// A plan of one pass and input dtype, with every rank's program prepared.
struct PreparedPlan {
    pass: Pass,
    dtype: DType,
    plan: Arc<Plan>,
    ranks: Arc<Vec<PreparedRank>>,
}

/// An attention problem and where it runs. `O` is the element type of the outputs (O, and the
/// gradients): f32 unless asked for with [`Attention::output`].
///
/// Layouts follow FlashAttention: Q `[batch, q_len, heads, head_dim]`, K and V
/// `[batch, k_len, kv_heads, head_dim]`, LSE `[batch, heads, q_len]` in f32, natural log.
///
/// ```
/// use distattn::{Attention, AttnShape, Execution, Mask, Ranks, Strategy};
///
/// // One sequence of 300 tokens, 4 query heads sharing 2 KV heads (GQA), head dim 64.
/// let shape = AttnShape::new(1, 300, 300, 4, 2, 64)?;
/// let (q, kv) = (vec![0.1f32; shape.q_elems()], vec![0.2f32; shape.kv_elems()]);
/// let attn = Attention::new(shape, Mask::causal(300, 300)?)?;
/// let fwd = attn.forward(&q, &kv, &kv)?;
/// let d_o = vec![1.0f32; shape.q_elems()];
/// let grads = attn.backward(&q, &kv, &kv, &fwd, &d_o)?;
///
/// // The same call split across 4 in-process ranks by the zig-zag ring.
/// let ranks = attn.clone().on(Execution::CpuRanks(Ranks::new(4, Strategy::Zigzag)));
/// assert!(ranks.forward(&q, &kv, &kv)?.o.iter().zip(&fwd.o).all(|(a, b)| (a - b).abs() < 1e-5));
/// # let _ = grads;
/// # Ok::<(), distattn::Error>(())
/// ```
pub struct Attention<O: Element = f32> {
    shape: AttnShape,
    mask: Mask,
    opts: AttnOptions,
    exec: Execution,
    plans: Mutex<Vec<Arc<PreparedPlan>>>,
    output: PhantomData<O>,
}

impl<O: Element> Clone for Attention<O> {
    fn clone(&self) -> Self {
        Attention {
            shape: self.shape,
            mask: self.mask.clone(),
            opts: self.opts,
            exec: self.exec.clone(),
            plans: Mutex::new(Vec::new()),
            output: PhantomData,
        }
    }
}

impl Attention<f32> {
    /// Attention of `shape` under `mask`, on the CPU, softmax scale `1/sqrt(head_dim)`, f32
    /// outputs.
    pub fn new(shape: AttnShape, mask: Mask) -> Result<Self> {
        shape.validate()?;
        mask.check_fits(&shape)?;
        Ok(Attention {
            shape,
            mask,
            opts: AttnOptions::default(),
            exec: Execution::Cpu,
            plans: Mutex::new(Vec::new()),
            output: PhantomData,
        })
    }
}

impl<O: Element> Attention<O> {
    /// Sets the softmax scale (`None`: `1/sqrt(head_dim)`); it must be positive and finite.
    pub fn scale(mut self, scale: Option<f32>) -> Result<Self> {
        AttnOptions { scale }.scale_for(self.shape.head_dim)?;
        self.opts.scale = scale;
        Ok(self)
    }

    /// Runs on `exec`.
    pub fn on(mut self, exec: Execution) -> Self {
        self.exec = exec;
        self.plans = Mutex::new(Vec::new());
        self
    }

    /// Returns O and the gradients as `U` (LSE stays f32).
    pub fn output<U: Element>(self) -> Attention<U> {
        Attention {
            shape: self.shape,
            mask: self.mask,
            opts: self.opts,
            exec: self.exec,
            plans: self.plans,
            output: PhantomData,
        }
    }

    pub fn shape(&self) -> &AttnShape {
        &self.shape
    }

    pub fn mask(&self) -> &Mask {
        &self.mask
    }

    pub fn options(&self) -> &AttnOptions {
        &self.opts
    }

    pub fn execution(&self) -> &Execution {
        &self.exec
    }

    /// The forward pass: O (as `O`) and the LSE.
    pub fn forward<T: Element>(&self, q: &[T], k: &[T], v: &[T]) -> Result<Forward<O>> {
        let full = HostTensors { q, k, v, backward: None };
        full.check(&self.shape, Pass::Forward)?;
        match &self.exec {
            Execution::Cpu => Ok(distattn_cpu::forward(q, k, v, &self.shape, &self.mask, &self.opts)?.into_dtype()),
            #[cfg(feature = "cuda")]
            Execution::Cuda(gpu) => crate::cuda::forward(gpu, &full, &self.shape, &self.mask, &self.opts),
            Execution::CpuRanks(_) => {
                Ok(gather_forward(&self.shape, self.run_ranks(Pass::Forward, &full)?).into_dtype())
            }
            #[cfg(feature = "nccl")]
            Execution::GpuRanks(_) => {
                Ok(gather_forward(&self.shape, self.run_ranks(Pass::Forward, &full)?).into_dtype())
            }
        }
    }

    /// The backward pass: dQ, dK, dV (as `O`) from the forward's result and the output
    /// gradient `d_o`.
    pub fn backward<T: Element>(&self, q: &[T], k: &[T], v: &[T], fwd: &Forward<O>, d_o: &[T]) -> Result<Grads<O>> {
        let o32 = distattn_core::outputs::convert_vec::<O, f32>(fwd.o.clone());
        let full = HostTensors { q, k, v, backward: Some(BackwardTensors { o: &o32, lse: &fwd.lse, d_o }) };
        full.check(&self.shape, Pass::Backward)?;
        match &self.exec {
            Execution::Cpu => {
                let delta = distattn_cpu::row_delta(&o32, d_o, &self.shape)?;
                let g = distattn_cpu::backward(q, k, v, d_o, &fwd.lse, &delta, &self.shape, &self.mask, &self.opts)?;
                Ok(g.into_dtype())
            }
            #[cfg(feature = "cuda")]
            Execution::Cuda(gpu) => crate::cuda::backward(gpu, &full, &self.shape, &self.mask, &self.opts),
            Execution::CpuRanks(_) => {
                Ok(gather_grads(&self.shape, self.run_ranks(Pass::Backward, &full)?).into_dtype())
            }
            #[cfg(feature = "nccl")]
            Execution::GpuRanks(_) => {
                Ok(gather_grads(&self.shape, self.run_ranks(Pass::Backward, &full)?).into_dtype())
            }
        }
    }

    /// The plan of `pass` for inputs of `dtype` (built once, then reused), when this runs on
    /// ranks.
    pub fn plan(&self, pass: Pass, dtype: DType) -> Result<Arc<Plan>> {
        Ok(self.prepared(pass, dtype)?.plan.clone())
    }

    fn ranks(&self) -> Result<&Ranks> {
        match &self.exec {
            Execution::CpuRanks(r) => Ok(r),
            #[cfg(feature = "nccl")]
            Execution::GpuRanks(r) => Ok(r),
            _ => Err(Error::invalid("execution", "a single-device execution has no plan")),
        }
    }

    fn prepared(&self, pass: Pass, dtype: DType) -> Result<Arc<PreparedPlan>> {
        let r = self.ranks()?;
        let mut cache = self.plans.lock().map_err(|_| Error::Internal("the plan cache was poisoned".into()))?;
        if let Some(p) = cache.iter().find(|p| p.pass == pass && p.dtype == dtype) {
            return Ok(p.clone());
        }
        let plan = build(r.strategy, r.world, &self.shape, &self.mask, dtype, &r.plan.with_pass(pass))?;
        let ranks = prepare_all(&plan, &self.mask)?;
        let p = Arc::new(PreparedPlan { pass, dtype, plan: Arc::new(plan), ranks: Arc::new(ranks) });
        cache.push(p.clone());
        Ok(p)
    }

    /// Runs the plan of `pass` on the ranks and returns every rank's output shards.
    fn run_ranks<T: Element>(&self, pass: Pass, full: &HostTensors<'_, T>) -> Result<Vec<Shard>> {
        let r = self.ranks()?;
        let p = self.prepared(pass, T::DTYPE)?;
        let ctl = ExecOptions { fail: r.fail, ..Default::default() };
        let per_rank = match &self.exec {
            #[cfg(feature = "nccl")]
            Execution::GpuRanks(_) => distattn_nccl::with_gpu_ranks(r.world, r.first_gpu, r.timeout, |g| {
                run_rank(&p.ranks[g.rank()], g.backend(), g.comm(), full, &self.opts, &ctl)
            })?,
            _ => distattn_exec::run_ranks(r.world, r.timeout, |comm| {
                use distattn_exec::Communicator;
                run_rank(&p.ranks[comm.rank()], &distattn_cpu::CpuBackend, comm, full, &self.opts, &ctl)
            })?,
        };
        Ok(per_rank.into_iter().flat_map(|r| r.shards).collect())
    }
}

impl<O: Element> std::fmt::Debug for Attention<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attention")
            .field("shape", &self.shape)
            .field("scale", &self.opts.scale_for(self.shape.head_dim).ok())
            .field("execution", &self.exec.describe())
            .finish()
    }
}

//! `distattn run`: attention on `.npy` files.

use crate::tensors;
use anyhow::{Context, Result};
use clap::Args;
use distattn::plan::RingBackward;
use distattn::tensor::infer_shape;
use distattn::{
    Attention, DType, Error, Execution, FailureKind, HostData, HostTensor, InjectedFailure, MaskSpec, PlanOptions,
    Ranks, Strategy,
};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
#[command(after_help = "\
Layouts: q is [batch, seq, heads, head_dim] (or packed [tokens, heads, head_dim]); k and v are
[batch, kv_seq, kv_heads, head_dim]; heads must be a multiple of kv_heads (GQA/MQA).
Outputs are f32: o like q, lse as [batch, heads, seq] (natural log; -inf for rows that see no
key), dq like q, dk and dv like k.

Masks (--mask):
  full | causal                       causal is aligned bottom-right when seq != kv_seq
  window:L,R                          L keys left and R right of the diagonal ('-' = unbounded)
  window-global:L,R,G                 sliding window plus G global leading tokens
  docs:A,B,... | docs-causal:A,B,...  packed documents (lengths add up to seq)
  prefix:P | prefix-docs:A/P,B/Q,...  prefix-LM (also per document)
  shared-question:Q,A1,A2,...         answers that each see one shared question
  block-causal:B | block-causal-docs:B:A,B,...
  blocks:BQ,BK:0110...                arbitrary block mask, row-major")]
pub struct RunArgs {
    /// Queries (.npy).
    #[arg(long)]
    q: PathBuf,
    /// Keys (.npy).
    #[arg(long)]
    k: PathBuf,
    /// Values (.npy).
    #[arg(long)]
    v: PathBuf,
    /// Attention mask (see below).
    #[arg(long, default_value = "full")]
    mask: MaskSpec,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long)]
    scale: Option<f32>,
    /// Convert inputs to this storage dtype before computing: f32, bf16 or f16 (default: the files' dtype).
    #[arg(long)]
    dtype: Option<DType>,
    /// Write the output O here (.npy, f32).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the log-sum-exp here (.npy, f32, [batch, heads, seq]).
    #[arg(long)]
    lse: Option<PathBuf>,
    /// Gradient of the output (.npy, like q): also compute dq, dk, dv.
    #[arg(long)]
    grad_out: Option<PathBuf>,
    /// Where to write dq (default: dq.npy beside --out, or ./dq.npy).
    #[arg(long)]
    dq: Option<PathBuf>,
    /// Where to write dk (default: dk.npy beside --out, or ./dk.npy).
    #[arg(long)]
    dk: Option<PathBuf>,
    /// Where to write dv (default: dv.npy beside --out, or ./dv.npy).
    #[arg(long)]
    dv: Option<PathBuf>,
    /// Fail if any input holds NaN or infinity.
    #[arg(long)]
    check_finite: bool,
    /// Kernels to use: auto (CUDA when a GPU is present and inputs are bf16/f16), cpu or cuda.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    #[command(flatten)]
    dist: DistArgs,
}

/// Options of a context-parallel run on in-process ranks.
#[derive(Args, Clone)]
pub struct DistArgs {
    /// Number of in-process CPU ranks the sequence is split across (1 = a single call).
    #[arg(long, default_value_t = 1)]
    pub world: usize,
    /// Split the sequence across this many local GPUs (a thread each, NCCL between them); bf16/f16 inputs.
    #[arg(long, conflicts_with = "world")]
    pub gpus: Option<usize>,
    /// Context-parallel strategy: ring, zigzag, striped, balanced, ulysses, hybrid, allgather, dispatch.
    #[arg(long, default_value = "zigzag")]
    pub strategy: Strategy,
    /// Ulysses group size of the hybrid strategy (default: the largest that divides heads and world).
    #[arg(long)]
    pub ulysses_degree: Option<usize>,
    /// Backward of ring strategies: kv (K/V and dK/dV circulate) or q (BurstAttention: Q, dO, LSE, D and dQ circulate).
    #[arg(long, default_value = "kv")]
    pub ring_backward: RingBackwardArg,
    /// Seconds a rank waits for a peer before giving up with an error.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// Testing aid: make this rank fail at the start of the plan's second step.
    #[arg(long)]
    pub fail_rank: Option<usize>,
}

#[derive(clap::ValueEnum, Clone, Copy)]
pub enum RingBackwardArg {
    Kv,
    Q,
}

/// Which kernels compute.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum BackendArg {
    /// CUDA when a GPU is present and the inputs are bf16 or f16, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

impl BackendArg {
    /// The execution for inputs of `dtype`: the CPU, or the first GPU.
    pub fn execution(self, dtype: DType) -> Result<Execution> {
        let gpu_dtype = matches!(dtype, DType::BF16 | DType::F16);
        let use_cuda = match self {
            BackendArg::Cpu => false,
            BackendArg::Cuda => true,
            BackendArg::Auto => gpu_dtype && distattn_cuda::cuda_available(),
        };
        if !use_cuda {
            return Ok(Execution::Cpu);
        }
        Ok(Execution::cuda(0)?)
    }
}

impl DistArgs {
    /// The strategy with the hybrid's Ulysses degree applied.
    pub fn strategy(&self) -> Strategy {
        match self.ulysses_degree {
            Some(u) => self.strategy.with_ulysses_degree(u),
            None => self.strategy,
        }
    }

    /// Planner options, with the document lengths of `mask` if it has any.
    pub fn plan_options(&self, mask: &MaskSpec, seq: usize) -> PlanOptions {
        PlanOptions {
            ring_backward: match self.ring_backward {
                RingBackwardArg::Kv => RingBackward::KvCirculate,
                RingBackwardArg::Q => RingBackward::QCirculate,
            },
            documents: mask.doc_lens(seq),
            ..PlanOptions::default()
        }
    }

    /// The ranks of a run on `world` of them.
    fn ranks(&self, world: usize, mask: &MaskSpec, seq: usize) -> Result<Ranks> {
        if let Some(rank) = self.fail_rank.filter(|&r| r >= world) {
            anyhow::bail!("--fail-rank {rank} is not a rank of a world of {world}");
        }
        Ok(Ranks {
            plan: self.plan_options(mask, seq),
            timeout: Duration::from_secs(self.timeout),
            fail: self.fail_rank.map(|rank| InjectedFailure { rank, step: 1, kind: FailureKind::Error }),
            ..Ranks::new(world, self.strategy())
        })
    }

    /// Local GPUs with `--gpus`, in-process ranks when `--world` > 1, else `single`.
    pub fn execution(&self, mask: &MaskSpec, seq: usize, single: Execution) -> Result<Execution> {
        if self.world == 0 || self.gpus == Some(0) {
            anyhow::bail!("--world and --gpus must be at least 1");
        }
        if let Some(world) = self.gpus {
            return Ok(Execution::GpuRanks(self.ranks(world, mask, seq)?));
        }
        if self.world == 1 {
            return Ok(single);
        }
        if matches!(single, Execution::Cuda(_)) {
            anyhow::bail!("--world > 1 runs on in-process CPU ranks; pass --backend cpu");
        }
        Ok(Execution::CpuRanks(self.ranks(self.world, mask, seq)?))
    }
}

/// Reads the `--{name}` file and converts it to `dtype`; with `check`, fails on NaN or infinity
/// in the values the kernels will see, i.e. after the conversion (70000 is finite in f32 but
/// infinite in f16).
fn load(path: &PathBuf, name: &str, dtype: Option<DType>, check: bool) -> Result<HostTensor> {
    let read = HostTensor::read_npy(path).with_context(|| format!("reading --{name}"))?;
    let cast = dtype.filter(|&d| d != read.dtype()).map(|d| read.cast(d));
    if check {
        if let Err(e) = cast.as_ref().unwrap_or(&read).check_finite(name) {
            let Error::NonFinite { index, .. } = &e else { return Err(e.into()) };
            let flat = index.iter().zip(&read.shape).fold(0, |acc, (&i, &dim)| acc * dim + i);
            let source = match &read.data {
                HostData::F32(v) => v.get(flat).copied(),
                HostData::BF16(v) => v.get(flat).map(|x| x.to_f32()),
                HostData::F16(v) => v.get(flat).map(|x| x.to_f32()),
            };
            if let (Some(d), Some(x)) = (dtype, source.filter(|x| x.is_finite())) {
                anyhow::bail!("{e}: the file's value {x} overflows {d} (--dtype {d})");
            }
            return Err(e.into());
        }
    }
    Ok(cast.unwrap_or(read))
}

pub fn run(args: RunArgs) -> Result<()> {
    let q = load(&args.q, "q", args.dtype, args.check_finite)?;
    let k = load(&args.k, "k", args.dtype, args.check_finite)?;
    let v = load(&args.v, "v", args.dtype, args.check_finite)?;
    let shape = infer_shape(&q, &k, &v)?;
    let mask = args.mask.build(shape.q_len, shape.k_len)?;
    let backend = if (args.dist.world > 1 || args.dist.gpus.is_some()) && args.backend == BackendArg::Auto {
        BackendArg::Cpu
    } else {
        args.backend
    };
    let exec = args.dist.execution(&args.mask, shape.q_len, backend.execution(q.dtype())?)?;
    let attn = Attention::new(shape, mask)?.scale(args.scale)?.on(exec);
    let started = std::time::Instant::now();
    let fwd = tensors::forward(&attn, &q, &k, &v)?;
    eprintln!(
        "forward: {shape}, mask {}, dtype {}, {}, {:.1} ms",
        args.mask,
        q.dtype(),
        attn.execution().describe(),
        started.elapsed().as_secs_f64() * 1e3
    );
    if let Some(path) = &args.out {
        HostTensor::write_npy_f32(path, &q.shape, &fwd.o)?;
    }
    if let Some(path) = &args.lse {
        HostTensor::write_npy_f32(path, &[shape.batch, shape.heads, shape.q_len], &fwd.lse)?;
    }
    if let Some(g) = &args.grad_out {
        let d_o = load(g, "grad-out", Some(q.dtype()), args.check_finite)?;
        if d_o.shape != q.shape {
            anyhow::bail!("--grad-out has shape {:?}, but q has shape {:?}", d_o.shape, q.shape);
        }
        let started = std::time::Instant::now();
        let grads = tensors::backward(&attn, &q, &k, &v, &fwd, &d_o)?;
        eprintln!("backward: {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
        let dir = args.out.as_ref().and_then(|p| p.parent()).map(|p| p.to_path_buf()).unwrap_or_default();
        let pick = |given: &Option<PathBuf>, name: &str| given.clone().unwrap_or_else(|| dir.join(name));
        HostTensor::write_npy_f32(pick(&args.dq, "dq.npy"), &q.shape, &grads.dq)?;
        HostTensor::write_npy_f32(pick(&args.dk, "dk.npy"), &k.shape, &grads.dk)?;
        HostTensor::write_npy_f32(pick(&args.dv, "dv.npy"), &k.shape, &grads.dv)?;
    }
    if args.out.is_none() && args.lse.is_none() && args.grad_out.is_none() {
        let n = fwd.o.len() as f64;
        let mean = fwd.o.iter().map(|&x| x as f64).sum::<f64>() / n;
        println!("o: {:?} f32, mean {mean:.6} (pass --out to save it)", q.shape);
    }
    Ok(())
}

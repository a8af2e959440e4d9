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
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args)]
#[command(after_help = "\
Layouts: q is [batch, seq, heads, head_dim] (or packed [tokens, heads, head_dim]); k and v are
[batch, kv_seq, kv_heads, head_dim]; heads must be a multiple of kv_heads (GQA/MQA).
Outputs are f32: o like q, lse as [batch, heads, seq] (natural log; -inf for rows that see no
key), dq like q, dk and dv like k. Gradients are written only where asked (--grad-dir, --dq,
--dk, --dv); else a one-line summary is printed. Output paths are checked before any work: each
directory must exist and be writable, and no two options may name the same file. Each output is
written to a temporary file beside it and renamed over it, so an existing file is only ever
replaced by a complete one.

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
    /// Gradient of the output (.npy, like q; converted to q's dtype): also compute dq, dk, dv
    /// (written where --grad-dir or --dq/--dk/--dv say, else summarized).
    #[arg(long)]
    grad_out: Option<PathBuf>,
    /// Write dq.npy, dk.npy and dv.npy into this directory (needs --grad-out).
    #[arg(long)]
    grad_dir: Option<PathBuf>,
    /// Where to write dq (default: dq.npy in --grad-dir, or not written).
    #[arg(long)]
    dq: Option<PathBuf>,
    /// Where to write dk (default: dk.npy in --grad-dir, or not written).
    #[arg(long)]
    dk: Option<PathBuf>,
    /// Where to write dv (default: dv.npy in --grad-dir, or not written).
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

/// The context-parallel strategy and its planner options, for running and for planning.
#[derive(Args, Clone)]
pub struct StrategyArgs {
    /// Context-parallel strategy: ring, zigzag, striped, balanced, ulysses, hybrid[:U], double-ring[:I], allgather,
    /// dispatch, pass-q.
    #[arg(long, default_value = "zigzag")]
    pub strategy: Strategy,
    /// Ulysses group size of the hybrid strategy (default: the largest that divides heads and world).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub ulysses_degree: Option<usize>,
    /// Backward of ring strategies: kv (K/V and dK/dV circulate) or q (BurstAttention: Q, dO, LSE, D and dQ circulate).
    #[arg(long, default_value = "kv")]
    pub ring_backward: RingBackwardArg,
    /// Ranks per node, consecutive ranks sharing one (default: LOCAL_WORLD_SIZE where a
    /// launcher set it): hybrid then keeps its all-to-alls inside nodes.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub ranks_per_node: Option<usize>,
}

/// Options of a context-parallel run on in-process ranks or local GPUs.
#[derive(Args, Clone)]
pub struct DistArgs {
    /// Number of in-process CPU ranks the sequence is split across (1 = a single call).
    #[arg(long, default_value_t = 1)]
    pub world: usize,
    /// Split the sequence across this many local GPUs (a thread each, NCCL between them); bf16/f16 inputs.
    #[arg(long, conflicts_with = "world")]
    pub gpus: Option<usize>,
    #[command(flatten)]
    pub plan: StrategyArgs,
    /// Seconds a rank waits for a peer's progress before giving up with an error (at least 1; a
    /// wait shorter than one block of work fails healthy runs).
    #[arg(long, default_value_t = 60, value_parser = crate::launch::seconds(1))]
    pub timeout: u64,
    /// Testing aid (hidden): make this rank fail at the start of the plan's second step (the
    /// last step of a single-step plan).
    #[arg(long, hide = true)]
    pub fail_rank: Option<usize>,
    /// Testing aid (hidden): how --fail-rank fails: error, panic, or hang (stop making
    /// progress; peers give up after --timeout).
    #[arg(long, value_enum, default_value_t = FailKindArg::Error, requires = "fail_rank", hide = true)]
    pub fail_kind: FailKindArg,
}

#[derive(clap::ValueEnum, Clone, Copy)]
pub enum FailKindArg {
    Error,
    Panic,
    Hang,
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

impl StrategyArgs {
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
            ranks_per_node: self
                .ranks_per_node
                .or_else(|| std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.trim().parse().ok())),
            ..PlanOptions::default()
        }
    }
}

impl DistArgs {
    /// The ranks of a run on `world` of them.
    fn ranks(&self, world: usize, mask: &MaskSpec, seq: usize) -> Result<Ranks> {
        if let Some(rank) = self.fail_rank.filter(|&r| r >= world) {
            anyhow::bail!("--fail-rank {rank} is not a rank of a world of {world}");
        }
        Ok(Ranks {
            plan: self.plan.plan_options(mask, seq),
            timeout: Duration::from_secs(self.timeout),
            fail: self.fail_rank.map(|rank| {
                let kind = match self.fail_kind {
                    FailKindArg::Error => FailureKind::Error,
                    FailKindArg::Panic => FailureKind::Panic,
                    FailKindArg::Hang => FailureKind::Hang,
                };
                InjectedFailure { rank, step: 1, kind }
            }),
            ..Ranks::new(world, self.plan.strategy())
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

/// Reads the `--{name}` file and converts it to `dtype` (as `why` says: `--dtype`, or q's dtype
/// for dO); with `check`, fails on NaN or infinity in the values the kernels will see, i.e.
/// after the conversion (70000 is finite in f32 but infinite in f16).
fn load(path: &PathBuf, name: &str, dtype: Option<DType>, why: &str, check: bool) -> Result<HostTensor> {
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
                anyhow::bail!("{e}: the file's value {x} overflows {d} ({why} {d})");
            }
            return Err(e.into());
        }
    }
    Ok(cast.unwrap_or(read))
}

/// A file named on the command line, with the option that names it.
struct NamedPath<'a> {
    option: &'static str,
    path: &'a Path,
}

/// What identifies the file `path` names, whether or not it exists yet: its canonical path when
/// it exists (links resolved), else its directory's canonical path joined with its file name.
fn file_identity(option: &str, path: &Path) -> Result<PathBuf> {
    if let Ok(canonical) = std::fs::canonicalize(path) {
        return Ok(canonical);
    }
    // A link to a file still to be made names that file (the write goes through the link).
    let target = distattn::tensor::write_target(path).with_context(|| format!("--{option} {}", path.display()))?;
    let path = target.as_path();
    // "out/" names a directory even where "out" does not exist yet.
    let names_dir = path.as_os_str().as_encoded_bytes().ends_with(b"/");
    let Some(name) = path.file_name().filter(|_| !names_dir) else {
        anyhow::bail!("--{option} {} does not name a file", path.display());
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let dir = std::fs::canonicalize(dir)
        .with_context(|| format!("--{option} {}: directory {} not found", path.display(), dir.display()))?;
    Ok(dir.join(name))
}

/// Checks, before any work, that each `(option, path)` can be written (as `run` checks its
/// outputs): for the benches' reports, which are written at the end of a long run.
pub(crate) fn check_report_paths(outputs: &[(&'static str, &Path)]) -> Result<()> {
    let named: Vec<NamedPath> = outputs.iter().map(|&(option, path)| NamedPath { option, path }).collect();
    check_outputs(&[], &named)
}

/// Checks, before any work, that every output can be written and harms nothing: each names a
/// file (not a directory) in an existing, writable directory, and none names the same file as
/// another output or as an input (inputs may share a file: q = k = v is self-attention).
fn check_outputs(inputs: &[NamedPath], outputs: &[NamedPath]) -> Result<()> {
    let mut seen: Vec<(&str, PathBuf)> = Vec::new();
    for input in inputs {
        // An input in no existing directory is no output's file; reading it will report it.
        if let Ok(identity) = file_identity(input.option, input.path) {
            seen.push((input.option, identity));
        }
    }
    let inputs_seen = seen.len();
    for output in outputs {
        let identity = file_identity(output.option, output.path)?;
        if let Some((other, _)) = seen.iter().find(|(_, id)| *id == identity) {
            anyhow::bail!("--{other} and --{} name the same file: {}", output.option, output.path.display());
        }
        if identity.is_dir() {
            anyhow::bail!("--{} {} is a directory, not a file", output.option, output.path.display());
        }
        if std::fs::metadata(&identity).is_ok_and(|m| m.permissions().readonly()) {
            anyhow::bail!("--{} {} is read-only; not replacing it", output.option, output.path.display());
        }
        // The one way to know a directory takes new files (permissions, read-only mounts, ACLs).
        let dir = identity.parent().unwrap_or(Path::new("/"));
        if !seen[inputs_seen..].iter().any(|(_, id)| id.parent() == Some(dir)) {
            if let Err(e) = tempfile::Builder::new().prefix(".distattn-check.").tempfile_in(dir) {
                // The kind alone: tempfile's message adds the probe's random name.
                let reason = std::io::Error::from(e.kind());
                anyhow::bail!(
                    "--{} {}: cannot create files in {}: {reason}",
                    output.option,
                    output.path.display(),
                    dir.display()
                );
            }
        }
        seen.push((output.option, identity));
    }
    Ok(())
}

/// One summary line for tensors not written: their shapes and means.
fn summary(tensors: &[(&str, &[usize], &[f32])]) -> String {
    let parts: Vec<String> = tensors
        .iter()
        .map(|(name, shape, values)| {
            let mean = values.iter().map(|&x| x as f64).sum::<f64>() / values.len().max(1) as f64;
            format!("{name}: {shape:?} f32, mean {mean:.6}")
        })
        .collect();
    parts.join("; ")
}

pub fn run(args: RunArgs) -> Result<()> {
    if args.grad_out.is_none() {
        let given = [("grad-dir", &args.grad_dir), ("dq", &args.dq), ("dk", &args.dk), ("dv", &args.dv)];
        if let Some((option, _)) = given.iter().find(|(_, path)| path.is_some()) {
            anyhow::bail!("--{option} needs --grad-out (the gradient of the output)");
        }
    }
    // Each gradient's path, with the option that gave it: its own, or --grad-dir.
    let gradient_path = |option: &'static str, given: &Option<PathBuf>, name: &str| match given {
        Some(path) => (option, Some(path.clone())),
        None => ("grad-dir", args.grad_dir.as_ref().map(|dir| dir.join(name))),
    };
    let ((dq_option, dq_path), (dk_option, dk_path), (dv_option, dv_path)) = (
        gradient_path("dq", &args.dq, "dq.npy"),
        gradient_path("dk", &args.dk, "dk.npy"),
        gradient_path("dv", &args.dv, "dv.npy"),
    );
    fn named<'a>(option: &'static str, path: Option<&'a Path>) -> Option<NamedPath<'a>> {
        path.map(|path| NamedPath { option, path })
    }
    let inputs: Vec<NamedPath> = [
        named("q", Some(&args.q)),
        named("k", Some(&args.k)),
        named("v", Some(&args.v)),
        named("grad-out", args.grad_out.as_deref()),
    ]
    .into_iter()
    .flatten()
    .collect();
    let outputs: Vec<NamedPath> = [
        named("out", args.out.as_deref()),
        named("lse", args.lse.as_deref()),
        named(dq_option, dq_path.as_deref()),
        named(dk_option, dk_path.as_deref()),
        named(dv_option, dv_path.as_deref()),
    ]
    .into_iter()
    .flatten()
    .collect();
    check_outputs(&inputs, &outputs)?;

    let q = load(&args.q, "q", args.dtype, "--dtype", args.check_finite)?;
    let k = load(&args.k, "k", args.dtype, "--dtype", args.check_finite)?;
    let v = load(&args.v, "v", args.dtype, "--dtype", args.check_finite)?;
    let shape = infer_shape(&q, &k, &v)?;
    // Every input is read before anything is written.
    let d_o = match &args.grad_out {
        Some(g) => {
            let d_o = load(g, "grad-out", Some(q.dtype()), "converted to q's dtype,", args.check_finite)?;
            if d_o.shape != q.shape {
                anyhow::bail!("--grad-out has shape {:?}, but q has shape {:?}", d_o.shape, q.shape);
            }
            Some(d_o)
        }
        None => None,
    };
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
    // The backward runs before any output is written, so a failure there leaves none half-updated.
    let grads = match &d_o {
        Some(d_o) => {
            let started = std::time::Instant::now();
            let grads = tensors::backward(&attn, &q, &k, &v, &fwd, d_o)?;
            eprintln!("backward: {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
            Some(grads)
        }
        None => None,
    };
    if let Some(path) = &args.out {
        HostTensor::write_npy_f32(path, &q.shape, &fwd.o)?;
    }
    if let Some(path) = &args.lse {
        HostTensor::write_npy_f32(path, &[shape.batch, shape.heads, shape.q_len], &fwd.lse)?;
    }
    if let Some(grads) = &grads {
        let mut unsaved: Vec<(&str, &[usize], &[f32])> = Vec::new();
        for (name, path, shape, values) in [
            ("dq", &dq_path, &q.shape, &grads.dq),
            ("dk", &dk_path, &k.shape, &grads.dk),
            ("dv", &dv_path, &k.shape, &grads.dv),
        ] {
            match path {
                Some(path) => HostTensor::write_npy_f32(path, shape, values)?,
                None => unsaved.push((name, shape, values)),
            }
        }
        if !unsaved.is_empty() {
            println!("{} (pass --grad-dir DIR or --dq/--dk/--dv to save them)", summary(&unsaved));
        }
    }
    if args.out.is_none() && args.lse.is_none() && args.grad_out.is_none() {
        println!("{} (pass --out to save it)", summary(&[("o", &q.shape, &fwd.o)]));
    }
    Ok(())
}

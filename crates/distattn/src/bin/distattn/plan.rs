//! `distattn plan`: a context-parallel plan's work and traffic per step and rank, without
//! running it.

use anyhow::Result;
use clap::Args;
use distattn::plan::Pass;
use distattn::planner::build;
use distattn::{AttnShape, DType, MaskSpec};

use crate::run::StrategyArgs;

#[derive(Args)]
#[command(after_help = "\
Work is in FLOPs (forward 4*area*head_dim per head, backward 2.5x), traffic in bytes sent.
Totals: imbalance = sum over steps of the slowest rank's work / sum over steps of the mean
rank's work (1.0 is perfect balance); bytes moved by all ranks; peak live bytes per rank.
--json prints one object with imbalance, bytes_moved, flops, peak_bytes_per_rank and the
per-step, per-rank breakdown.")]
pub struct PlanArgs {
    /// Total sequence length (queries = keys).
    #[arg(long)]
    seq: usize,
    /// Attention mask (any spec of `distattn run --help`, plus docs-random:SEED / docs-random-causal:SEED).
    #[arg(long, default_value = "causal")]
    mask: MaskSpec,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    heads: usize,
    /// Key/value heads (default: as many as query heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Storage dtype of the inputs (sets the bytes moved).
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// Plan the backward pass instead of the forward.
    #[arg(long)]
    backward: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Ranks (GPUs or processes) the sequence is split across.
    #[arg(long, alias = "gpus", default_value_t = 1)]
    world: usize,
    #[command(flatten)]
    strategy: StrategyArgs,
}

pub fn plan(args: PlanArgs) -> Result<()> {
    let shape =
        AttnShape::new(args.batch, args.seq, args.seq, args.heads, args.kv_heads.unwrap_or(args.heads), args.head_dim)?;
    let mask = args.mask.build(args.seq, args.seq)?;
    if args.world == 0 {
        anyhow::bail!("--world must be at least 1");
    }
    let mut opts = args.strategy.plan_options(&args.mask, args.seq);
    opts.pass = Some(if args.backward { Pass::Backward } else { Pass::Forward });
    let plan = build(args.strategy.strategy(), args.world, &shape, &mask, args.dtype, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan.summary())?);
    } else {
        print!("{plan}");
    }
    Ok(())
}

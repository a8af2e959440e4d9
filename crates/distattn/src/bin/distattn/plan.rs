//! `distattn plan`: a context-parallel plan's work and traffic per step and rank, without
//! running it.

use anyhow::Result;
use clap::Args;
use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
use distattn::plan::Pass;
use distattn::planner::{build, fastest, fastest_training, TRAINING_CANDIDATES};
use distattn::{AttnShape, DType, MaskSpec, PlanOptions, Strategy};

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
    #[arg(long, required_unless_present = "serve")]
    seq: Option<usize>,
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
    /// Estimate the forward and backward of every strategy `auto` chooses among (the Python
    /// package's ContextParallel(strategy="auto")) and name its pick, instead of one plan.
    #[arg(long, conflicts_with_all = ["json", "backward", "serve"])]
    choose: bool,
    /// Ranks (GPUs or processes) the sequence is split across.
    #[arg(long, alias = "gpus", default_value_t = 1)]
    world: usize,
    #[command(flatten)]
    strategy: StrategyArgs,
    /// A serving step over a KV cache spread over the ranks instead of --seq: requests as
    /// CACHED+NEW[@HOME], comma-separated (e.g. 1000000+1,4000+1@1). A forward of batch 1 with
    /// its own mask (each request causal over its cache) and strategy (--serve-strategy).
    #[arg(long, conflicts_with_all = ["seq", "mask", "batch", "backward", "strategy", "ulysses_degree", "ring_backward"])]
    serve: Option<String>,
    /// Where the serving cache lives: contiguous (each request's capacity split into one chunk
    /// per rank), zigzag (into two chunks per rank, an early and a late one: a prompt's causal
    /// work even) or pages:N (pages of N tokens dealt round-robin from the request's home);
    /// contiguous:N and zigzag:N for requests of up to N tokens.
    #[arg(long, default_value = "pages:16", requires = "serve")]
    placement: String,
    /// Serving: place each new token's query beside its K/V (prefill) instead of on the
    /// request's home rank (decode).
    #[arg(long, requires = "serve")]
    prefill: bool,
    /// Serving: pass-q (queries travel), ring (the cache travels) or auto (the one the
    /// planner's time model estimates faster).
    #[arg(long, default_value = "auto", requires = "serve")]
    serve_strategy: String,
}

pub fn plan(args: PlanArgs) -> Result<()> {
    if args.world == 0 {
        anyhow::bail!("--world must be at least 1");
    }
    if args.choose {
        let seq = args.seq.ok_or_else(|| anyhow::anyhow!("--choose needs --seq"))?;
        return choose(&args, seq);
    }
    let plan = match (&args.serve, args.seq) {
        (Some(requests), _) => serving_plan(&args, requests)?,
        (None, Some(seq)) => {
            let kv_heads = args.kv_heads.unwrap_or(args.heads);
            let shape = AttnShape::new(args.batch, seq, seq, args.heads, kv_heads, args.head_dim)?;
            let mask = args.mask.build(seq, seq)?;
            let mut opts = args.strategy.plan_options(&args.mask, seq);
            opts.pass = Some(if args.backward { Pass::Backward } else { Pass::Forward });
            build(args.strategy.strategy(), args.world, &shape, &mask, args.dtype, &opts)?
        }
        (None, None) => anyhow::bail!("give --seq, or --serve for a serving step"),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan.summary())?);
    } else {
        print!("{plan}");
        let rates = distattn::plan::Rates::default();
        let flops = if plan.pass == Pass::Backward { rates.backward_flops_per_s } else { rates.flops_per_s };
        println!(
            "estimate: {:.3} ms at {:.0} TFLOP/s and {:.0} GB/s links per device",
            plan.estimate(&rates).ms,
            flops / 1e12,
            rates.link_bytes_per_s / 1e9
        );
    }
    Ok(())
}

/// Every training candidate's estimated forward and backward time, and the one `auto` takes.
fn choose(args: &PlanArgs, seq: usize) -> Result<()> {
    let shape = AttnShape::new(args.batch, seq, seq, args.heads, args.kv_heads.unwrap_or(args.heads), args.head_dim)?;
    let mask = args.mask.build(seq, seq)?;
    // As the Python package plans: O and the gradients travel in the inputs' dtype, and the
    // backward gets the forward's head-sharded Q, K, V and LSE.
    let opts =
        PlanOptions { narrow_outputs: true, keep_head_sharded: true, ..args.strategy.plan_options(&args.mask, seq) };
    let rates = distattn::plan::Rates::default();
    let pick = fastest_training(&TRAINING_CANDIDATES, args.world, &shape, &mask, args.dtype, &opts, &rates)?;
    println!("{:<10} {:>10} {:>10} {:>10} {:>10}", "strategy", "fwd ms", "bwd ms", "total ms", "imbalance");
    for s in TRAINING_CANDIDATES {
        let plan = |pass| build(s, args.world, &shape, &mask, args.dtype, &opts.with_pass(pass));
        match (plan(Pass::Forward), plan(Pass::Backward)) {
            (Ok(f), Ok(b)) => {
                let (ef, eb) = (f.estimate(&rates).ms, b.estimate(&rates).ms);
                let mark = if s == pick { "  <- auto" } else { "" };
                let imbalance = f.summary().imbalance.max(b.summary().imbalance);
                println!("{:<10} {ef:>10.3} {eb:>10.3} {:>10.3} {imbalance:>10.3}{mark}", s.to_string(), ef + eb);
            }
            (Err(e), _) | (_, Err(e)) => println!("{:<10} cannot plan this problem: {e}", s.to_string()),
        }
    }
    let network = match opts.ranks_per_node_of(args.world) {
        Some(n) => format!(", {:.0} GB/s between nodes of {n} ranks", rates.network_bytes_per_s / 1e9),
        None => String::new(),
    };
    println!(
        "auto takes {pick} (estimates at {:.0} / {:.0} TFLOP/s forward / backward and {:.0} GB/s links per device{network})",
        rates.flops_per_s / 1e12,
        rates.backward_flops_per_s / 1e12,
        rates.link_bytes_per_s / 1e9
    );
    Ok(())
}

/// The forward plan of one serving step (`--serve`) over a cache placed on the ranks.
fn serving_plan(args: &PlanArgs, requests: &str) -> Result<distattn::Plan> {
    let world = args.world;
    let mut reqs = Vec::new();
    for (i, r) in requests.split(',').enumerate() {
        let bad = || anyhow::anyhow!("--serve request {i} ('{r}'): expected CACHED+NEW[@HOME], e.g. 4000+1@1");
        let (sizes, home) = match r.trim().split_once('@') {
            Some((s, h)) => (s, h.parse::<usize>().map_err(|_| bad())?),
            None => (r.trim(), i % world),
        };
        let (cached, new) = sizes.split_once('+').ok_or_else(bad)?;
        reqs.push(StepRequest {
            home,
            cached: cached.parse().map_err(|_| bad())?,
            new: new.parse().map_err(|_| bad())?,
        });
    }
    let capacity = reqs.iter().map(|r| r.cached.saturating_add(r.new)).max().unwrap_or(0);
    let placement = KvPlacement::from_spec(&args.placement, capacity, world)?;
    let (h, d) = (args.heads, args.head_dim);
    let hkv = args.kv_heads.unwrap_or(h);
    let queries = if args.prefill { Queries::WithKeys } else { Queries::AtHome };
    let step = ServingStep::new(&placement, &reqs, queries, h, hkv, d)?;
    let opts = PlanOptions { layout: Some(step.layout), ..Default::default() };
    let candidates: Vec<Strategy> = match args.serve_strategy.as_str() {
        "auto" => vec![Strategy::PassQ, Strategy::Ring],
        s => vec![s.parse::<Strategy>()?],
    };
    Ok(fastest(&candidates, world, &step.shape, &step.mask, args.dtype, &opts, &Default::default())?)
}

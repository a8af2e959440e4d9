//! `distattn`: exact attention from the command line.
//!
//! `distattn run` computes attention on `.npy` files (on one call or on in-process ranks),
//! `distattn bench` runs the benchmark table on the backend present, `distattn plan` shows a
//! context-parallel plan, `distattn timeline` shows and draws recorded multi-GPU timelines.
//! Errors print one line and exit with status 1 (bad arguments: 2; `launch` stopped by SIGINT
//! or SIGTERM: 130 or 143).

mod bench;
mod cached_prefill;
mod decode_bench;
mod launch;
mod plan;
mod run;
mod tensors;
mod timeline;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "distattn", version, about = "Exact, memory-efficient attention over long sequences", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compute attention on .npy inputs; optionally write O, LSE and gradients.
    Run(run::RunArgs),
    /// Benchmark forward and backward throughput on the backend present (CUDA, else the CPU).
    Bench(bench::BenchArgs),
    /// Show a context-parallel plan: work and bytes per step and rank, imbalance, peak memory.
    Plan(plan::PlanArgs),
    /// Start one process per GPU (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... set for each).
    Launch(launch::LaunchArgs),
    /// Show recorded multi-GPU timelines: hidden and exposed transfers per rank, SVG charts.
    Timeline(timeline::TimelineArgs),
}

fn main() -> ExitCode {
    // A bug must still end in one line, not a trace (RUST_BACKTRACE=1 restores the trace).
    let backtrace = std::env::var_os("RUST_BACKTRACE").is_some();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        // A reader that stopped reading (`distattn plan … | head`) ends the output, as for other
        // Unix tools: quietly, with the status of a SIGPIPE (SIGPIPE itself stays ignored, so
        // that a closed socket is an error the transports report).
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(128 + 13);
        }
        if backtrace {
            default_hook(info);
        } else {
            eprintln!(
                "error: internal error: {msg} (at {}); please report it",
                info.location().map_or(String::new(), |l| l.to_string())
            );
        }
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version.
            print!("{e}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // Usage errors in one line too. clap may spread the problem over several lines
            // (e.g. the missing arguments under "were not provided:"), so join those, and drop
            // the Usage/help tail that follows.
            let text = e.render().to_string();
            let problem: Vec<&str> = text
                .lines()
                .take_while(|line| !line.starts_with("Usage:"))
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .collect();
            let line = problem.join(" ");
            eprintln!("{}", if line.is_empty() { "error: bad arguments" } else { &line });
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Bench(args) => bench::bench(args),
        Command::Plan(args) => plan::plan(args),
        Command::Launch(args) => launch::launch(args),
        Command::Timeline(args) => timeline::timeline(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", chain.join(": "));
            // A launcher stopped by SIGINT or SIGTERM exits 130 or 143, as shells report it.
            e.downcast_ref::<launch::Interrupted>().map_or(ExitCode::FAILURE, |i| ExitCode::from(i.exit_status()))
        }
    }
}

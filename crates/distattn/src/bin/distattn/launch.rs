//! `distattn launch`: one process per GPU on this host, bootstrapped by NCCL itself.
//!
//! Starts `--nproc` copies of a command with `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and
//! `NCCL_COMM_ID=127.0.0.1:PORT` set (what `torchrun` or a cluster launcher would set), waits
//! for them, and when one fails gives the others `--timeout` seconds to notice (distattn's
//! NCCL ranks abort their communicator and exit naming the failed peer) before stopping them.

use anyhow::{bail, Result};
use clap::Args;
use distattn_nccl::LaunchEnv;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

#[derive(Args)]
#[command(after_help = "\
Example: distattn launch --nproc 4 -- distattn-multigpu-bench worker
Each process reads its rank with distattn_nccl::gpu_rank_from_env (library) and uses GPU
LOCAL_RANK. Several hosts: start one launcher per host with --node-rank and --master-addr,
or use any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK and NCCL_COMM_ID.")]
pub struct LaunchArgs {
    /// Processes to start on this host (one per GPU).
    #[arg(long)]
    nproc: usize,
    /// Hosts taking part (each runs one launcher).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This host's index among them.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of host 0, where NCCL's bootstrap root listens.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of NCCL's bootstrap root.
    #[arg(long, default_value_t = 29517)]
    master_port: u16,
    /// Seconds the other ranks get to exit on their own after one fails.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// The command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Kills a rank's whole process group and reaps it.
fn stop(child: &mut Child) {
    // SAFETY: killpg only sends a signal; it touches no memory. The group id is the child's pid
    // (it leads its group, set at spawn), and the child has not been reaped yet (reaped children
    // leave `children`), so that pid cannot have been reused.
    unsafe {
        libc::killpg(child.id() as libc::pid_t, libc::SIGKILL);
    }
    let _ = child.wait();
}

pub fn launch(args: LaunchArgs) -> Result<()> {
    if args.nproc == 0 || args.nnodes == 0 || args.node_rank >= args.nnodes {
        bail!("--nproc and --nnodes must be positive and --node-rank below --nnodes");
    }
    let world = args.nproc * args.nnodes;
    let comm_id = format!("{}:{}", args.master_addr, args.master_port);
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..args.nproc {
        let rank = args.node_rank * args.nproc + local;
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..])
            .envs(LaunchEnv::for_rank(rank, world, &comm_id))
            .env("LOCAL_RANK", local.to_string());
        // Each rank leads its own process group, so stopping it stops what it started too.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        match cmd.spawn() {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                for (_, c) in &mut children {
                    stop(c);
                }
                bail!("starting rank {rank} ({}): {e}", args.command[0]);
            }
        }
    }
    let mut first_failure: Option<(usize, String)> = None;
    let mut deadline: Option<Instant> = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
                Some(status) => {
                    let (rank, _) = children.remove(i);
                    if !status.success() && first_failure.is_none() {
                        first_failure = Some((rank, status.to_string()));
                        deadline = Some(Instant::now() + Duration::from_secs(args.timeout));
                    }
                }
                None => i += 1,
            }
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            for (rank, c) in &mut children {
                eprintln!("rank {rank} still running {}s after the failure: stopping it", args.timeout);
                stop(c);
            }
            children.clear();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match first_failure {
        Some((rank, status)) => bail!("rank {rank} failed ({status}); the run was stopped"),
        None => Ok(()),
    }
}

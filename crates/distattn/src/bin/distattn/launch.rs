//! `distattn launch`: one process per GPU on this host, bootstrapped by NCCL itself.
//!
//! Starts `--nproc` copies of a command with torchrun's variables set (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), so torch programs and
//! distattn's own ranks both start from them, and waits for them. Several hosts: one launcher
//! per host, the same `--nnodes`, `--master-addr` and `--master-port`, each its `--node-rank`. No rank outlives the launcher: when one fails the others get `--grace`
//! seconds to notice (distattn's NCCL ranks abort their communicator and exit naming the failed
//! peer); SIGINT and SIGTERM are passed on to every rank, and `--max-time` sends SIGTERM; ranks
//! still running `--grace` seconds after any of these are killed with SIGKILL.

use anyhow::{bail, Result};
use clap::Args;
use distattn_nccl::LaunchEnv;
use std::fmt;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
#[command(after_help = "\
Example: distattn launch --nproc 2 -- sh -c 'echo rank $RANK of $WORLD_SIZE on GPU $LOCAL_RANK'
Each process reads its rank with distattn_nccl::gpu_rank_from_env (library) and uses GPU
LOCAL_RANK. Several hosts: one launcher per host with the same --nnodes, --master-addr and
--master-port and its own --node-rank, e.g. on host 1 of 2:
  distattn launch --nproc 4 --nnodes 2 --node-rank 1 --master-addr host0 -- python train.py
torchrun and srun work as well (RANK.. or SLURM_PROCID.., with MASTER_ADDR/MASTER_PORT or
NCCL_COMM_ID).
SIGINT or SIGTERM to the launcher reaches every rank (a second one kills them at once); it then
exits with status 130 or 143. --grace was called --timeout before --max-time existed; the old
name still sets the grace period.")]
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
    /// Address of host 0 (MASTER_ADDR), where NCCL's bootstrap root listens.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// MASTER_PORT: a torch program's store listens there, NCCL's bootstrap root of distattn's
    /// own ranks on the next port.
    #[arg(long, default_value_t = 29517, value_parser = clap::value_parser!(u16).range(1..65535))]
    master_port: u16,
    /// Seconds the ranks get to exit on their own after one fails, or after SIGINT, SIGTERM or
    /// --max-time, before they are killed (formerly --timeout, which still works).
    #[arg(long, alias = "timeout", value_name = "SECS", default_value_t = 30, value_parser = seconds(0))]
    grace: u64,
    /// Seconds the whole run may take; then every rank gets SIGTERM. No limit if not given.
    #[arg(long, value_name = "SECS", value_parser = seconds(1))]
    max_time: Option<u64>,
    /// The command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// A number of seconds from `least` up to a year: durations past that are typos, and far larger
/// ones overflow a deadline (`Instant + Duration`).
pub(crate) fn seconds(least: u64) -> clap::builder::RangedU64ValueParser<u64> {
    clap::builder::RangedU64ValueParser::<u64>::new().range(least..=365 * 24 * 3600)
}

/// The launcher was stopped by a signal it passed on to the ranks; it exits with 128 + the
/// signal's number, as shells do.
#[derive(Debug)]
pub struct Interrupted {
    signal: libc::c_int,
    message: String,
}

impl Interrupted {
    pub fn exit_status(&self) -> u8 {
        (128 + self.signal) as u8
    }
}

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Interrupted {}

/// A rank still running: its group is signalled until it is reaped, never after (see `signal`).
struct Rank {
    rank: usize,
    child: Child,
}

impl Rank {
    /// Sends `signal` to the rank's whole process group, so what it started gets it too.
    fn signal(&self, signal: libc::c_int) {
        // SAFETY: killpg only sends a signal; it touches no memory. The group id is the child's
        // pid (it leads its group, set at spawn), and the child has not been reaped yet (reaped
        // children leave the list of running ranks), so that pid cannot have been reused.
        unsafe {
            libc::killpg(self.child.id() as libc::pid_t, signal);
        }
    }
}

/// Why the launcher is stopping the ranks.
enum Stop {
    RankFailed,
    Signal(libc::c_int),
    MaxTime,
}

fn signal_name(signal: libc::c_int) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// "; ranks 0, 2 were still running after the 30s grace period and were killed", or nothing.
fn killed_note(killed: &[usize], when: &str) -> String {
    match killed {
        [] => String::new(),
        [rank] => format!("; rank {rank} was still running {when} and was killed"),
        _ => {
            let ranks: Vec<String> = killed.iter().map(|r| r.to_string()).collect();
            format!("; ranks {} were still running {when} and were killed", ranks.join(", "))
        }
    }
}

pub fn launch(args: LaunchArgs) -> Result<()> {
    if args.nproc == 0 || args.nnodes == 0 || args.node_rank >= args.nnodes {
        bail!("--nproc and --nnodes must be positive and --node-rank below --nnodes");
    }
    // Caught before any rank starts, so no signal can end the launcher and leave ranks behind
    // (each rank leads its own process group, so nothing else passes a Ctrl-C on to it).
    let signals = [libc::SIGINT, libc::SIGTERM].map(|signal| (signal, Arc::new(AtomicBool::new(false))));
    for (signal, flag) in &signals {
        signal_hook::flag::register(*signal, Arc::clone(flag))?;
    }
    let started = Instant::now();
    let mut running: Vec<Rank> = Vec::new();
    for local in 0..args.nproc {
        let rank = args.node_rank * args.nproc + local;
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..]).envs(LaunchEnv::for_rank(
            args.node_rank,
            local,
            args.nproc,
            args.nnodes,
            &args.master_addr,
            args.master_port,
        ));
        // Each rank leads its own process group, so stopping it stops what it started too.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        match cmd.spawn() {
            Ok(child) => running.push(Rank { rank, child }),
            Err(e) => {
                for r in &mut running {
                    r.signal(libc::SIGKILL);
                    let _ = r.child.wait();
                }
                bail!("starting rank {rank} ({}): {e}", args.command[0]);
            }
        }
    }
    let grace = Duration::from_secs(args.grace);
    let mut stop: Option<Stop> = None;
    let mut first_failure: Option<(usize, String)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut kill_when = format!("after the {}s grace period", args.grace);
    let mut killed: Vec<usize> = Vec::new();
    while !running.is_empty() {
        let mut i = 0;
        while i < running.len() {
            match running[i].child.try_wait()? {
                Some(status) => {
                    let Rank { rank, .. } = running.remove(i);
                    if !status.success() && stop.is_none() {
                        first_failure = Some((rank, status.to_string()));
                        stop = Some(Stop::RankFailed);
                        kill_at = Some(Instant::now() + grace);
                    }
                }
                None => i += 1,
            }
        }
        for (signal, flag) in &signals {
            if !flag.swap(false, Ordering::Relaxed) {
                continue;
            }
            if matches!(stop, Some(Stop::Signal(_))) {
                // A second signal: the user does not want to wait out the grace period.
                kill_at = Some(Instant::now());
                kill_when = format!("after a second {}", signal_name(*signal));
            } else {
                for r in &running {
                    r.signal(*signal);
                }
                stop = Some(Stop::Signal(*signal));
                // After a failure or --max-time the grace period has already begun: not anew.
                kill_at = Some(kill_at.unwrap_or(Instant::now() + grace));
            }
        }
        let out_of_time = args.max_time.is_some_and(|secs| started.elapsed() >= Duration::from_secs(secs));
        if out_of_time && stop.is_none() {
            for r in &running {
                r.signal(libc::SIGTERM);
            }
            stop = Some(Stop::MaxTime);
            kill_at = Some(Instant::now() + grace);
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for r in &mut running {
                r.signal(libc::SIGKILL);
                let _ = r.child.wait();
                killed.push(r.rank);
            }
            running.clear();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = killed_note(&killed, &kill_when);
    // A signal after a rank failed still names the failure: it is why the run went wrong.
    let failure = match &first_failure {
        Some((rank, status)) => format!(" (rank {rank} had failed: {status})"),
        None => String::new(),
    };
    match stop {
        None => Ok(()),
        Some(Stop::RankFailed) => {
            let (rank, status) = first_failure.unwrap_or_default();
            bail!("rank {rank} failed ({status}); the run was stopped{killed}")
        }
        Some(Stop::Signal(signal)) => Err(Interrupted {
            signal,
            message: format!("{} received: passed on to every rank{failure}{killed}", signal_name(signal)),
        }
        .into()),
        Some(Stop::MaxTime) => {
            bail!("--max-time {}s reached: every rank was sent SIGTERM{killed}", args.max_time.unwrap_or_default())
        }
    }
}

//! `distattn launch` leaves no rank behind: signals reach every rank, ranks that ignore them are
//! killed after the grace period, `--max-time` ends a hung run, and a failed rank stops the rest.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A launched run; whatever is left of it is killed on drop, so a failing test leaks no process.
struct Launched {
    launcher: Child,
    pid_dir: tempfile::TempDir,
    nproc: usize,
}

impl Drop for Launched {
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
        // Only groups that still have live members: a rank group already gone is left alone.
        for pid in self.rank_pids_now().into_iter().filter(|pid| !live_group_members(*pid).is_empty()) {
            // SAFETY: killpg only sends a signal; it touches no memory. The group was a rank's
            // (its leader wrote this pid) and had live members just now.
            unsafe {
                libc::killpg(pid, libc::SIGKILL);
            }
        }
    }
}

impl Launched {
    /// Starts `distattn launch ARGS -- sh -c SCRIPT` where SCRIPT may use `$PIDS` (a directory
    /// for `pid.$RANK` files).
    fn start(args: &[&str], nproc: usize, script: &str) -> Launched {
        let pid_dir = tempfile::tempdir().unwrap();
        let launcher = Command::new(env!("CARGO_BIN_EXE_distattn"))
            .arg("launch")
            .args(["--nproc", &nproc.to_string()])
            .args(args)
            .args(["--", "sh", "-c", script])
            .env("PIDS", pid_dir.path())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Launched { launcher, pid_dir, nproc }
    }

    fn rank_pids_now(&self) -> Vec<libc::pid_t> {
        (0..self.nproc).filter_map(|rank| read_pid(&self.pid_dir.path().join(format!("pid.{rank}")))).collect()
    }

    /// The pids of every rank, once all have written them.
    fn rank_pids(&mut self) -> Vec<libc::pid_t> {
        let started = Instant::now();
        loop {
            let pids = self.rank_pids_now();
            if pids.len() == self.nproc {
                return pids;
            }
            if let Ok(Some(status)) = self.launcher.try_wait() {
                panic!("the launcher ended ({status}) before all ranks started: {}", self.stderr());
            }
            assert!(started.elapsed() < Duration::from_secs(5), "ranks did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill only sends a signal, to the launcher we started and have not reaped.
        unsafe {
            libc::kill(self.launcher.id() as libc::pid_t, signal);
        }
    }

    /// Waits for the launcher to end, at most `limit`.
    fn wait(&mut self, limit: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.launcher.try_wait().unwrap() {
                return status;
            }
            assert!(started.elapsed() < limit, "the launcher still runs after {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(mut err) = self.launcher.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
        }
        text
    }
}

fn read_pid(path: &Path) -> Option<libc::pid_t> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Processes of process group `pgid` that still run (zombies count as gone: they run nothing).
fn live_group_members(pgid: libc::pid_t) -> Vec<PathBuf> {
    let mut members = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // The command name may hold spaces and parentheses: fields start after the last ')'.
        let Some((_, fields)) = stat.rsplit_once(')') else { continue };
        let fields: Vec<&str> = fields.split_whitespace().collect();
        // Fields after the name: state, ppid, pgrp.
        if fields.len() > 2 && fields[2] == pgid.to_string() && fields[0] != "Z" {
            members.push(entry.path());
        }
    }
    members
}

fn assert_no_rank_left(pids: &[libc::pid_t]) {
    // The ranks themselves are reaped by the launcher before it exits; a rank's own children
    // die of the same SIGKILL but may take a moment to do so.
    for pid in pids {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "rank process {pid} was not reaped");
        let started = Instant::now();
        while !live_group_members(*pid).is_empty() {
            assert!(started.elapsed() < Duration::from_secs(1), "processes of rank group {pid} still run");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn assert_one_line(err: &str, needle: &str) {
    assert_eq!(err.trim().lines().count(), 1, "one line expected, got: {err}");
    assert!(err.starts_with("error: ") && err.contains(needle), "'{needle}' not in: {err}");
}

const SLEEPER: &str = "echo $$ > $PIDS/pid.$RANK; exec sleep 100";

fn signal_reaches_every_rank(signal: libc::c_int, name: &str, exit_code: i32) {
    let mut run = Launched::start(&[], 3, SLEEPER);
    let pids = run.rank_pids();
    run.signal(signal);
    let status = run.wait(Duration::from_secs(5));
    assert_eq!(status.code(), Some(exit_code), "{status}");
    let err = run.stderr();
    assert_one_line(&err, &format!("{name} received"));
    assert_no_rank_left(&pids);
}

#[test]
fn sigterm_reaches_every_rank() {
    signal_reaches_every_rank(libc::SIGTERM, "SIGTERM", 143);
}

#[test]
fn sigint_reaches_every_rank() {
    signal_reaches_every_rank(libc::SIGINT, "SIGINT", 130);
}

#[test]
fn ranks_ignoring_sigterm_are_killed_after_the_grace_period() {
    // The sleep is a child of the shell here, in the rank's group: killing the group ends both.
    let script = "trap '' TERM; echo $$ > $PIDS/pid.$RANK; sleep 100; true";
    let mut run = Launched::start(&["--grace", "1"], 2, script);
    let pids = run.rank_pids();
    let signalled = Instant::now();
    run.signal(libc::SIGTERM);
    let status = run.wait(Duration::from_secs(5));
    assert!(signalled.elapsed() >= Duration::from_millis(900), "killed before the grace period ended");
    assert_eq!(status.code(), Some(143), "{status}");
    let err = run.stderr();
    assert_one_line(&err, "ranks 0, 1 were still running after the 1s grace period and were killed");
    assert_no_rank_left(&pids);
}

#[test]
fn max_time_ends_a_run_that_never_finishes() {
    let mut run = Launched::start(&["--max-time", "1", "--grace", "1"], 2, SLEEPER);
    let started = Instant::now();
    let pids = run.rank_pids();
    let status = run.wait(Duration::from_secs(6));
    assert!(started.elapsed() >= Duration::from_millis(900), "stopped before --max-time");
    assert!(!status.success() && status.code().is_some(), "{status}");
    let err = run.stderr();
    assert_one_line(&err, "--max-time 1s reached");
    assert_no_rank_left(&pids);
}

#[test]
fn a_failed_rank_stops_the_others_after_the_grace_period() {
    // --timeout is the grace period's old name and must keep meaning it.
    for grace_option in ["--grace", "--timeout"] {
        let script = "echo $$ > $PIDS/pid.$RANK; if [ $RANK = 1 ]; then exit 3; fi; exec sleep 100";
        let mut run = Launched::start(&[grace_option, "1"], 3, script);
        let pids = run.rank_pids();
        let status = run.wait(Duration::from_secs(6));
        assert_eq!(status.code(), Some(1), "{status}");
        let err = run.stderr();
        assert_one_line(&err, "rank 1 failed (exit status: 3)");
        assert!(err.contains("ranks 0, 2 were still running after the 1s grace period"), "{err}");
        assert_no_rank_left(&pids);
    }
}

#[test]
fn a_second_signal_kills_the_ranks_at_once() {
    let script = "trap '' TERM; echo $$ > $PIDS/pid.$RANK; exec sleep 100";
    let mut run = Launched::start(&["--grace", "30"], 2, script);
    let pids = run.rank_pids();
    run.signal(libc::SIGTERM);
    // The launcher polls its flags every 50 ms: let it see the first signal on its own.
    std::thread::sleep(Duration::from_millis(300));
    run.signal(libc::SIGTERM);
    let status = run.wait(Duration::from_secs(5));
    assert_eq!(status.code(), Some(143), "{status}");
    let err = run.stderr();
    assert_one_line(&err, "ranks 0, 1 were still running after a second SIGTERM and were killed");
    assert_no_rank_left(&pids);
}

//! Crafted sizes on the command line: a one-line error at once, never a panic, an abort, an
//! endless loop or a huge allocation.

use std::process::Command;
use std::time::{Duration, Instant};

/// Runs `distattn plan` with `args` and returns (exit code, stderr), checking it took under a
/// second.
fn plan(args: &[&str]) -> (Option<i32>, String) {
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_distattn")).arg("plan").args(args).output().expect("binary runs");
    assert!(t0.elapsed() < Duration::from_secs(1), "{args:?} took {:?}", t0.elapsed());
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn crafted_sizes_are_one_line_errors() {
    let max = usize::MAX.to_string();
    let docs = format!("docs:{max},17");
    let prefix_docs = format!("prefix-docs:{max}/0,17/0");
    let seq_2_40 = (1u64 << 40).to_string();
    let head_dim_2_62 = (1u64 << 62).to_string();
    for (args, says) in [
        (vec!["--seq", "16", "--mask", docs.as_str()], "document lengths"),
        (vec!["--seq", "16", "--mask", prefix_docs.as_str()], "document lengths"),
        (vec!["--seq", seq_2_40.as_str()], "query length"),
        (vec!["--seq", "64", "--head-dim", head_dim_2_62.as_str()], "would not fit in memory"),
        (vec!["--seq", "64", "--world", "1024"], "1024 ranks for 64 tokens"),
        (vec!["--seq", "1000000", "--world", "100000"], "at most 1024"),
        (vec!["--seq", "64", "--world", "4", "--strategy", "hybrid", "--ulysses-degree", "0"], "--ulysses-degree"),
    ] {
        let (code, err) = plan(&args);
        assert!(matches!(code, Some(1) | Some(2)), "{args:?}: exit {code:?}, {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("internal error"), "{args:?}: {err}");
    }
}

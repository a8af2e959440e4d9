//! Crafted sizes on the command line: a one-line error at once, never a panic, an abort, an
//! endless loop or a huge allocation.

use std::process::Command;
use std::time::{Duration, Instant};

/// Runs `distattn plan` with `args` and returns (exit code, stderr), checking it took under a
/// second.
fn plan(args: &[&str]) -> (Option<i32>, String) {
    distattn("plan", args)
}

/// Runs `distattn command` with `args`, as [`plan`].
fn distattn(command: &str, args: &[&str]) -> (Option<i32>, String) {
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_distattn")).arg(command).args(args).output().expect("binary runs");
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

#[test]
fn crafted_serving_and_bench_sizes_are_one_line_errors() {
    let max = usize::MAX.to_string();
    let wraps = format!("{max}+2,10+1");
    let page = (1u64 << 32).to_string();
    for (command, args, says) in [
        // A sum that wrapped planned another request; a huge one allocated its positions first.
        ("plan", vec!["--serve", wraps.as_str(), "--world", "2"], "past 2147483647 keys"),
        ("plan", vec!["--serve", "100000000000+2", "--world", "2"], "past 2147483647 keys"),
        ("bench", vec!["--decode", "--seqs", "17", "--page-size", max.as_str()], "--page-size"),
        ("bench", vec!["--decode", "--seqs", "17", "--page-size", page.as_str()], "--page-size"),
        ("bench", vec!["--decode", "--seqs", "17", "--batch", max.as_str()], "too large to hold"),
        ("bench", vec!["--decode", "--seqs", "17", "--head-dims", max.as_str()], "too large to hold"),
        ("bench", vec!["--decode", "--seqs", "3000000000"], "longer than 2147483647"),
        ("bench", vec!["--repeats", max.as_str()], "--repeats"),
    ] {
        let (code, err) = distattn(command, &args);
        assert!(matches!(code, Some(1) | Some(2)), "{command} {args:?}: exit {code:?}, {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{command} {args:?}: {err}");
        assert!(err.contains(says), "{command} {args:?}: {err}");
    }
    // A step of fewer keys than ranks plans (the other ranks hold none of the cache).
    let out =
        Command::new(env!("CARGO_BIN_EXE_distattn")).args(["plan", "--serve", "2+1", "--world", "4"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

//! The multi-GPU benchmark parses its arguments with clap: subcommands, help and usage errors.

use std::process::Command;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_distattn-multigpu-bench")).args(args).output().expect("the tool runs")
}

#[test]
fn multigpu_bench_takes_help_and_refuses_unknown_options() {
    let help = String::from_utf8(run(&["--help"]).stdout).unwrap();
    for sub in ["bench", "probe", "kill-test", "worker"] {
        assert!(help.contains(sub), "--help lacks {sub}: {help}");
    }
    let bench = String::from_utf8(run(&["bench", "--help"]).stdout).unwrap();
    for option in ["--gpus", "--seqs", "--strategies", "--mask", "--timelines", "--no-single"] {
        assert!(bench.contains(option), "bench --help lacks {option}");
    }
    for bad in [&["bench", "--seqs", "lots"][..], &["bench", "--strategies", "sideways"], &["frobnicate"]] {
        let out = run(bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

//! The crate's tools parse their arguments with clap: help, defaults, and one-line usage errors.

use std::process::Command;

fn run(bin: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin).args(args).output().expect("the tool runs")
}

#[test]
fn tools_take_help_and_refuse_unknown_options() {
    for (bin, sub) in
        [(env!("CARGO_BIN_EXE_nvrtc-check"), None), (env!("CARGO_BIN_EXE_distattn-cuda-bench"), Some("bench"))]
    {
        let help_args: &[&str] = match sub {
            Some(sub) => &[sub, "--help"],
            None => &["--help"],
        };
        let help = run(bin, help_args);
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(help.status.success() && text.contains("Usage:"), "{bin}: {text}");
        let bad = run(bin, &[sub.unwrap_or("sm_90a"), "--no-such-option"]);
        assert_eq!(bad.status.code(), Some(2), "{bin}");
        assert!(String::from_utf8_lossy(&bad.stderr).contains("unexpected argument"), "{bin}");
    }
    let help = String::from_utf8(run(env!("CARGO_BIN_EXE_distattn-cuda-bench"), &["bench", "--help"]).stdout).unwrap();
    for option in ["--dims", "--seqs", "--sustain", "--quick", "--out"] {
        assert!(help.contains(option), "distattn-cuda-bench bench --help lacks {option}");
    }
}

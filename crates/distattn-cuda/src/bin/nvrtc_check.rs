//! CI compile check: compiles every module with NVRTC for sm_90a and sm_80 (no GPU needed) —
//! every attention kernel variant and the auxiliary kernels of each dtype — prints ptxas'
//! resource report and fails on any compile error, register spill, stack frame or serialised
//! warpgroup MMA.
//!
//! Without NVRTC it skips (exit 0) unless `DISTATTN_REQUIRE_NVRTC=1`, which makes it fail.
//! Extra architectures: `nvrtc-check sm_89 sm_120 ...` (replaces the default list).

use clap::Parser;
use distattn_core::DType;
use distattn_cuda::compile::{self, KernelConfig, ModuleKind};

/// Compiles every kernel module with NVRTC (no GPU needed) and fails on compile errors, register
/// spills, stack frames or serialised warpgroup MMAs. Without NVRTC it skips (exit 0) unless
/// DISTATTN_REQUIRE_NVRTC=1; DISTATTN_CHECK_DIMS=64,128 limits the head dims.
#[derive(Parser)]
#[command(name = "nvrtc-check", version)]
struct Cli {
    /// Target architectures.
    #[arg(default_values_t = ["sm_90a".to_string(), "sm_80".to_string()])]
    archs: Vec<String>,
}

fn main() {
    let archs = Cli::parse().archs;
    if !compile::nvrtc_available() {
        let require = std::env::var("DISTATTN_REQUIRE_NVRTC").map(|v| v == "1").unwrap_or(false);
        eprintln!("nvrtc-check: NVRTC library not found (LD_LIBRARY_PATH={:?})", std::env::var("LD_LIBRARY_PATH").ok());
        std::process::exit(if require { 1 } else { 0 });
    }
    match compile::nvrtc_version() {
        Ok(v) => println!("NVRTC {}.{}", v.0, v.1),
        Err(e) => {
            eprintln!("nvrtc-check: {e}");
            std::process::exit(1);
        }
    }
    match compile::find_cuda_includes() {
        Ok(v) => println!("CUDA include dirs: {v:?}"),
        Err(e) => println!("note: {e} (the kernels include no header)"),
    }
    let mut failures = 0;
    println!(
        "{:<8} {:<5} {:>4} {:<16} {:>5} {:>6} {:>6} {:>6}",
        "arch", "dtype", "d", "kernel", "regs", "stack", "spillS", "spillL"
    );
    let dims = std::env::var("DISTATTN_CHECK_DIMS").unwrap_or_default();
    for arch in &archs {
        let flash = KernelConfig::all()
            .into_iter()
            .filter(|cfg| dims.is_empty() || dims.split(',').any(|d| d == cfg.head_dim.to_string()))
            .map(|cfg| ModuleKind::Flash(cfg.for_arch(arch)));
        for kind in flash.chain([ModuleKind::Aux(DType::BF16), ModuleKind::Aux(DType::F16)]) {
            let dim = match kind {
                ModuleKind::Flash(cfg) => cfg.head_dim.to_string(),
                ModuleKind::Aux(_) => "-".to_string(),
            };
            let label = kind.label();
            match compile::compile_module(&kind, arch, true) {
                Err(e) => {
                    failures += 1;
                    println!("FAIL {arch} {label}: {e}");
                }
                Ok(c) => {
                    // ptxas serialises warpgroup MMAs it cannot keep in flight (warning C7510):
                    // correct, but the kernel loses the point of being asynchronous.
                    for line in c.log.lines().filter(|l| l.contains("wgmma")) {
                        failures += 1;
                        println!("FAIL {arch} {label}: {line}");
                    }
                    let res = compile::parse_ptxas(&c.log);
                    if res.is_empty() {
                        failures += 1;
                        println!("FAIL {arch} {label}: no ptxas report in the NVRTC log:\n{}", c.log);
                    }
                    for r in res {
                        let bad = r.spill_stores > 0 || r.spill_loads > 0 || r.stack_frame > 0;
                        if bad {
                            failures += 1;
                        }
                        println!(
                            "{:<8} {:<5} {:>4} {:<16} {:>5} {:>6} {:>6} {:>6}{}",
                            arch,
                            kind.dtype().to_string(),
                            dim,
                            r.name,
                            r.registers,
                            r.stack_frame,
                            r.spill_stores,
                            r.spill_loads,
                            if bad { "  <-- SPILL" } else { "" }
                        );
                    }
                }
            }
        }
    }
    if failures > 0 {
        println!("nvrtc-check: {failures} failure(s)");
        std::process::exit(1);
    }
    println!("nvrtc-check: all modules compiled with no spills");
}

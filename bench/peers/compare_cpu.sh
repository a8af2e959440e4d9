#!/usr/bin/env bash
# Side-by-side CPU benchmark, distattn-cpu vs PyTorch SDPA, in one run: torch_cpu.py drives
# the distattn example binary as a server and alternates the two rep by rep (ABBA) on the
# same shapes, so load from other processes falls on both alike.
# Writes OUT_DIR/distattn_cpu.jsonl, OUT_DIR/torch_cpu.jsonl and OUT_DIR/summary.md.
# Usage: bench/peers/compare_cpu.sh OUT_DIR ; env SEQS, DIMS, DTYPES, HEADS, REPS, CAUSAL
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$(mkdir -p "$1" && cd "$1" && pwd)"
seqs="${SEQS:-2048,4096,8192}"
dims="${DIMS:-64,128}"
dtypes="${DTYPES:-f32,bf16}"
heads="${HEADS:-2}"
reps="${REPS:-6}"
causal="${CAUSAL:-both}"
(cd "$root" && cargo build --release -q -p distattn-cpu --example cpu_bench)
rm -f "$out/torch_cpu.jsonl" "$out/distattn_cpu.jsonl"
"$here/run_torch_cpu.sh" "$out" --distattn "$root/target/release/examples/cpu_bench" \
  --seq "$seqs" --dim "$dims" --dtype "$dtypes" --heads "$heads" --reps "$reps" --causal "$causal"
python3 "$here/summarize_cpu.py" "$out" | tee "$out/summary.md"

#!/usr/bin/env bash
# Side-by-side CPU benchmark: distattn-cpu vs PyTorch SDPA, interleaved case by case (ours,
# then torch, same shapes) for ROUNDS rounds, so background load hits both alike.
# Writes OUT_DIR/distattn_cpu.jsonl, OUT_DIR/torch_cpu.jsonl and OUT_DIR/summary.md.
# Usage: bench/peers/compare_cpu.sh OUT_DIR [ROUNDS] ; env SEQS, DIMS, DTYPES, HEADS, REPS
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$(mkdir -p "$1" && cd "$1" && pwd)"
rounds="${2:-2}"
seqs="${SEQS:-2048 4096 8192}"
dims="${DIMS:-64 128}"
dtypes="${DTYPES:-f32 bf16}"
heads="${HEADS:-2}"
reps="${REPS:-3}"
(cd "$root" && cargo build --release -q -p distattn-cpu --example cpu_bench)
bin="$root/target/release/examples/cpu_bench"
"$here/run_torch_cpu.sh" "$out" --seq 64 --dim 64 --dtype f32 --causal no --reps 1 > /dev/null # venv + warm import
rm -f "$out/torch_cpu.jsonl"
for r in $(seq "$rounds"); do
  for n in $seqs; do
    for d in $dims; do
      for c in no yes; do
        for dt in $dtypes; do
          "$bin" --seq "$n" --dim "$d" --causal "$c" --dtype "$dt" --heads "$heads" --reps "$reps" | tee -a "$out/distattn_cpu.jsonl"
          "$here/run_torch_cpu.sh" "$out" --seq "$n" --dim "$d" --causal "$c" --dtype "$dt" --heads "$heads" --reps "$reps"
        done
      done
    done
  done
done
python3 "$here/summarize_cpu.py" "$out" | tee "$out/summary.md"

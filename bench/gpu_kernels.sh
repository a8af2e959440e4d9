#!/usr/bin/env bash
# Accuracy against PyTorch flash and benchmark of the distattn CUDA kernels, on a machine with a
# GPU (their correctness against f64 is the GPU tests': bench/gpu_tests.sh).
#   bench/gpu_kernels.sh OUTDIR
# Env: DISTATTN_CUDA_BIN (default target/release/distattn-cuda-bench, built beforehand with
# `cargo build --release -p distattn-cuda --features cli`), BENCH_DIMS (default 128,64), BENCH_QUICK=1 (no 64k/128k),
# SKIP_CHECK=1 (no accuracy comparison), SKIP_BENCH=1, DISTATTN_COMMIT (recorded in the JSON).
# Writes OUTDIR/check.log, accuracy.json, bench.log and kernels.json ({device, date, commit, rows}).
set -uo pipefail
OUT=${1:?usage: gpu_kernels.sh OUTDIR}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${DISTATTN_CUDA_BIN:-target/release/distattn-cuda-bench}
DIMS=${BENCH_DIMS:-128,64}
QUICK=${BENCH_QUICK:+--quick}
COMMIT=${DISTATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SCRATCH=$(mktemp -d)
export DISTATTN_CACHE_DIR=${DISTATTN_CACHE_DIR:-$SCRATCH/cache}
export PYTHONUNBUFFERED=1
source "$HERE/gpu_env.sh"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
rc=0
if [ -z "${SKIP_CHECK:-}" ]; then
  mkdir -p "$SCRATCH/dump"
  "$BIN" dump "$SCRATCH/dump" 2>&1 | tee "$OUT/check.log" || rc=1
  python3 "$HERE/torch_peer.py" accuracy "$SCRATCH/dump" "$OUT/accuracy.json" 2>&1 | tee -a "$OUT/check.log" || rc=1
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  "$BIN" bench --out "$SCRATCH/distattn_bench.json" --dims "$DIMS" $QUICK 2>&1 | tee "$OUT/bench.log" || rc=1
  python3 "$HERE/torch_peer.py" bench "$SCRATCH/torch_bench.json" --dims "$DIMS" $QUICK 2>&1 | tee -a "$OUT/bench.log" || rc=1
  python3 "$HERE/torch_peer.py" merge "$OUT/kernels.json" "$SCRATCH/distattn_bench.json" "$SCRATCH/torch_bench.json" --commit "$COMMIT" 2>&1 | tee -a "$OUT/bench.log" || rc=1
fi
exit $rc

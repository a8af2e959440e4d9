#!/usr/bin/env bash
# Kernel times of two builds side by side on one GPU, in one call: the same grid cells timed by
# each build's kernel benchmark (CUDA events, one warm-up, median of 10), alternating A and B
# REPEATS times, then each build once under Nsight Compute (every kernel's duration,
# --clock-control none). Prints a table of B against A and writes OUTDIR/ab.json.
#   A_BIN=path/to/old-bench B_BIN=path/to/new-bench bench/gpu_ab.sh OUTDIR
# A_BIN and B_BIN are kernel benchmark binaries taking `bench --out FILE --dims D --seqs S`
# (distattn-cuda-bench, or distattn-cuda-gpu of older commits); they may be the same binary
# with A_ENV / B_ENV setting a side's environment (e.g. B_ENV=DISTATTN_KCFG=bwd_stages=4).
# Env: DIMS (128), SEQS (16384), REPEATS (3), NCU (Nsight Compute; default
# /usr/local/cuda/bin/ncu if present, empty: skip).
set -uo pipefail
OUT=${1:?usage: A_BIN=... B_BIN=... gpu_ab.sh OUTDIR}
: "${A_BIN:?set A_BIN}" "${B_BIN:?set B_BIN}"
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
DIMS=${DIMS:-128}
SEQS=${SEQS:-16384}
REPEATS=${REPEATS:-3}
NCU=${NCU-$( [ -x /usr/local/cuda/bin/ncu ] && echo /usr/local/cuda/bin/ncu )}
source "$HERE/gpu_env.sh"
rc=0
side_env() { if [ "$1" = b ]; then echo "${B_ENV:-}"; else echo "${A_ENV:-}"; fi; }
for i in $(seq 1 "$REPEATS"); do
  for side in a b; do
    bin=$A_BIN; [ "$side" = b ] && bin=$B_BIN
    env $(side_env $side) "$bin" bench --out "$OUT/$side-$i.json" --dims "$DIMS" --seqs "$SEQS" > "$OUT/$side-$i.log" 2>&1 || { rc=1; tail -5 "$OUT/$side-$i.log"; }
  done
done
if [ -n "$NCU" ]; then
  for side in a b; do
    bin=$A_BIN; [ "$side" = b ] && bin=$B_BIN
    env $(side_env $side) "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      "$bin" bench --out "$OUT/$side-ncu-run.json" --dims "$DIMS" --seqs "$SEQS" > "$OUT/$side-ncu.csv" 2> "$OUT/$side-ncu.err" || { rc=1; tail -5 "$OUT/$side-ncu.err"; }
  done
fi
python3 "$HERE/ab_table.py" "$OUT" "$REPEATS" || rc=1
exit $rc

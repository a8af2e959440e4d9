#!/usr/bin/env bash
# Kernel time of two sides (two package builds, or one build under two settings) on the same
# cells: each round runs `prefill_bench.py --kernel-pass` under Nsight Compute (every kernel's
# duration, --clock-control none) once per side, each in its own process, A then B; then the
# table of B against A (kernel_pass_ab.py: OUTDIR/A-vs-B.md).
#   CASES=d128-16/16-full-4k,d128-16/16-causal-16k [PASSES=fwd] [IMPLS=distattn] [ROUNDS=2] \
#   [A=old B=new] A_ENV="PYTHONPATH=old/build DISTATTN_CACHE_DIR=old/cache" \
#   B_ENV="DISTATTN_KCFG=fwd_short=1" bench/gpu_kernel_ab.sh OUTDIR
# A_ENV / B_ENV are a side's environment (KEY=VALUE words): the package it imports
# (PYTHONPATH), its kernel settings (DISTATTN_KCFG), and its own kernel cache
# (DISTATTN_CACHE_DIR; default OUTDIR/cache-<side>, removed at the end). Env: NCU (default
# /usr/local/cuda/bin/ncu), TIMEOUT (seconds per run, 150).
set -uo pipefail
OUT=${1:?usage: CASES=... [A_ENV=...] [B_ENV=...] gpu_kernel_ab.sh OUTDIR}
: "${CASES:?set CASES (prefill_bench.py case names or prefixes)}"
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
A=${A:-a} B=${B:-b}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
export PYTHONUNBUFFERED=1
rc=0
for r in $(seq 1 "${ROUNDS:-2}"); do
  for side in "$A" "$B"; do
    envs=${A_ENV:-}; [ "$side" = "$B" ] && envs=${B_ENV:-}
    o="$OUT/$side-r$r"; mkdir -p "$o"
    # shellcheck disable=SC2086 # the side's environment is a list of KEY=VALUE words
    env DISTATTN_CACHE_DIR="$OUT/cache-$side" $envs timeout "${TIMEOUT:-150}" \
      "$NCU" --clock-control none --csv --metrics gpu__time_duration.sum \
      python3 "$HERE/prefill_bench.py" "$o" --kernel-pass --cases "$CASES" --impls "${IMPLS:-distattn}" \
      ${PASSES:+--passes "$PASSES"} > "$o/ncu.csv" 2> "$o/ncu.log" || { rc=1; tail -5 "$o/ncu.log"; }
    gzip -9f "$o/ncu.csv"
    echo "$side round $r: ${SECONDS} s"
  done
done
rm -rf "$OUT/cache-$A" "$OUT/cache-$B"
python3 "$HERE/kernel_pass_ab.py" "$OUT" "$A" "$B" || rc=1
exit $rc

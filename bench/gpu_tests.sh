#!/usr/bin/env bash
# The GPU tests (the ignored ones) from prebuilt test executables, on a machine with a GPU and
# no Rust toolchain: build them beforehand with `cargo test --release --no-run -p distattn-cuda`
# (and -p distattn-nccl on several GPUs) and pass their folder.
#   TEST_BIN_DIR=folder bench/gpu_tests.sh OUTDIR
# Runs every executable of TEST_BIN_DIR with `--ignored --nocapture --test-threads 1`, each for
# at most TEST_TIMEOUT seconds (default 300); writes OUTDIR/<name>.log; exit status 1 if any
# fails.
set -uo pipefail
OUT=${1:?usage: TEST_BIN_DIR=... gpu_tests.sh OUTDIR}
: "${TEST_BIN_DIR:?set TEST_BIN_DIR}"
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
export PYTHONUNBUFFERED=1
rc=0
for t in "$TEST_BIN_DIR"/*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  start=$(date +%s)
  if timeout "${TEST_TIMEOUT:-300}" "$t" --ignored --nocapture --test-threads 1 > "$OUT/$name.log" 2>&1; then verdict=pass; else verdict=FAIL; rc=1; fi
  echo "$name: $verdict in $(( $(date +%s) - start )) s; $(grep -E '^test result' "$OUT/$name.log" | tail -1)"
  [ "$verdict" = FAIL ] && grep -E "FAIL|panicked|error" "$OUT/$name.log" | head -20
done
exit $rc

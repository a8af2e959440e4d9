#!/usr/bin/env bash
# Prefill kernels on one GPU, in one call: the kernel tests (prebuilt test executables of
# TEST_BIN_DIR, as gpu_tests.sh runs them; none if unset), the Python package's FP8 and CUDA
# tests, then prefill_bench.py's accuracy check, CUDA-event timings, its Nsight Compute kernel
# pass and the tables from both.
#   TEST_BIN_DIR=folder bench/gpu_prefill.sh OUTDIR [--quick | --cases a,b]
# The distattn Python package must be importable (PYTHONPATH or installed); NCU names Nsight
# Compute (default: ncu on PATH, else /usr/local/cuda/bin/ncu); SKIP_TESTS=1 skips the tests.
set -uo pipefail
OUT=${1:?usage: TEST_BIN_DIR=... gpu_prefill.sh OUTDIR [--quick | --cases a,b]}
shift
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
export PYTHONUNBUFFERED=1
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  if [ -n "${TEST_BIN_DIR:-}" ]; then
    "$HERE/gpu_tests.sh" "$OUT/tests" || rc=1
  fi
  python3 -m pytest -q -s "$HERE/../python/tests/test_fp8.py" "$HERE/../python/tests/test_gpu.py" \
    > "$OUT/pytest.log" 2>&1 || rc=1
  grep -E "fp8 O|passed|failed|Error" "$OUT/pytest.log" | tail -30
fi
python3 "$HERE/prefill_bench.py" "$OUT" --accuracy 2> "$OUT/accuracy.log" || { rc=1; tail -20 "$OUT/accuracy.log"; }
cat "$OUT/accuracy.log"
python3 "$HERE/prefill_bench.py" "$OUT" "$@" 2> "$OUT/timings.log" || { rc=1; tail -20 "$OUT/timings.log"; }
"$NCU" --clock-control none --csv --metrics gpu__time_duration.sum \
  python3 "$HERE/prefill_bench.py" "$OUT" --kernel-pass "$@" > "$OUT/ncu.csv" 2> "$OUT/ncu.log" || { rc=1; tail -20 "$OUT/ncu.log"; }
python3 "$HERE/prefill_bench.py" "$OUT" --table "$OUT/ncu.csv" || rc=1
exit $rc

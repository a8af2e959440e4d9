#!/usr/bin/env bash
# Decode on one GPU, in one call: the decode tests (prebuilt test executables of TEST_BIN_DIR,
# as gpu_tests.sh runs them), the Python package's decode tests on CUDA, then decode_bench.py's
# timings, its Nsight Compute kernel pass and the table from both.
#   TEST_BIN_DIR=folder bench/gpu_decode.sh OUTDIR [--quick]
# The distattn Python package must be importable (PYTHONPATH or installed); NCU names Nsight
# Compute (default: ncu on PATH, else /usr/local/cuda/bin/ncu).
set -uo pipefail
OUT=${1:?usage: TEST_BIN_DIR=... gpu_decode.sh OUTDIR [--quick]}
shift
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
export PYTHONUNBUFFERED=1
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
rc=0
if [ -n "${TEST_BIN_DIR:-}" ]; then
  "$HERE/gpu_tests.sh" "$OUT/tests" || rc=1
fi
python3 -m pytest -q "$HERE/../python/tests/test_kvcache.py" > "$OUT/pytest_kvcache.log" 2>&1 || rc=1
tail -3 "$OUT/pytest_kvcache.log"
python3 "$HERE/decode_bench.py" "$OUT" "$@" 2> "$OUT/timings.log" || { rc=1; tail -20 "$OUT/timings.log"; }
"$NCU" --clock-control none --csv --metrics gpu__time_duration.sum \
  python3 "$HERE/decode_bench.py" "$OUT" --kernel-pass "$@" > "$OUT/ncu.csv" 2> "$OUT/ncu.log" || { rc=1; tail -20 "$OUT/ncu.log"; }
python3 "$HERE/decode_bench.py" "$OUT" --table "$OUT/ncu.csv" || rc=1
exit $rc

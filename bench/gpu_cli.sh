#!/usr/bin/env bash
# The command line's GPU paths on a GPU machine, with the release binary built beforehand
# (`cargo build --release -p distattn --features cli`; DISTATTN_BIN points at it):
#   1. `distattn bench` on the GPU (self-check against the f64 reference, then the table);
#   2. `distattn run --backend cuda` and `distattn run --gpus N --strategy S` on the same bf16
#      inputs, compared with the CPU backend's result on those inputs.
# Usage: bench/gpu_cli.sh OUTDIR
set -euo pipefail
OUT=${1:?usage: gpu_cli.sh OUTDIR}
BIN=${DISTATTN_BIN:-target/release/distattn}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
GPUS=$(nvidia-smi -L | wc -l)

echo "== distattn bench on the GPU"
"$BIN" bench --seqs 4096,16384 --mask causal --mask full --mask docs --head-dims 128 --json "$OUT/cli-bench-cuda.json"

echo "== distattn run: cuda and --gpus $GPUS vs the CPU backend (bf16 inputs)"
T=$(mktemp -d)
python3 - "$T" <<'PY'
import sys, numpy as np, torch
t = sys.argv[1]
g = torch.Generator().manual_seed(0)
for name, heads in (("q", 32), ("k", 8), ("v", 8), ("do", 32)):
    x = torch.randn(1, 4099, heads, 128, generator=g).to(torch.bfloat16)
    np.save(f"{t}/{name}.npy", x.view(torch.int16).numpy())   # bf16 bits, as distattn reads them
PY
run() { "$BIN" run --q "$T/q.npy" --k "$T/k.npy" --v "$T/v.npy" --grad-out "$T/do.npy" --mask causal "$@"; }
mkdir -p "$T/cpu" "$T/cuda" && run --backend cpu --out "$T/cpu/o.npy"
run --backend cuda --out "$T/cuda/o.npy"
for s in zigzag balanced ulysses dispatch; do mkdir -p "$T/$s"; run --gpus "$GPUS" --strategy "$s" --out "$T/$s/o.npy"; done
python3 - "$T" zigzag balanced ulysses dispatch <<'PY' | tee "$OUT/cli-run-check.txt"
import sys, numpy as np
t, strategies = sys.argv[1], sys.argv[2:]
passed = failed = 0
for where in ["cuda"] + strategies:
    errs = {}
    for n in ("o", "dq", "dk", "dv"):
        ref = np.load(f"{t}/cpu/{n}.npy").astype(np.float64)
        got = np.load(f"{t}/{where}/{n}.npy").astype(np.float64)
        errs[n] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    ok = max(errs.values()) <= 1e-2
    passed += ok; failed += not ok
    print(("ok  " if ok else "FAIL"), where, " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY

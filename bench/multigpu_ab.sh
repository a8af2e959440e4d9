#!/usr/bin/env bash
# Multi-GPU times of two builds side by side on one machine, in one call: each build's
# multi-GPU benchmark on the same cases, alternating A and B REPEATS times. Prints B against A
# per (strategy, seq, pass) and writes OUTDIR/ab.json.
#   A_BIN=path/to/old B_BIN=path/to/new bench/multigpu_ab.sh OUTDIR
# A_BIN and B_BIN are distattn-multigpu-bench binaries. Env: GPUS (all), SEQS (32768,131072),
# STRATEGIES (zigzag,ulysses), PASSES (fwdbwd), MASK (causal), KV_HEADS (8), ITERS (4),
# REPEATS (2).
set -uo pipefail
OUT=${1:?usage: A_BIN=... B_BIN=... multigpu_ab.sh OUTDIR}
: "${A_BIN:?set A_BIN}" "${B_BIN:?set B_BIN}"
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
REPEATS=${REPEATS:-2}
rc=0
for i in $(seq 1 "$REPEATS"); do
  for side in a b; do
    bin=$A_BIN; [ "$side" = b ] && bin=$B_BIN
    "$bin" bench --gpus "$GPUS" --seqs "${SEQS:-32768,131072}" --strategies "${STRATEGIES:-zigzag,ulysses}" \
      --passes "${PASSES:-fwdbwd}" --heads 32 --kv-heads "${KV_HEADS:-8}" --mask "${MASK:-causal}" --iters "${ITERS:-4}" \
      --no-single --out "$OUT/$side-$i.json" > "$OUT/$side-$i.log" 2>&1 || { rc=1; tail -5 "$OUT/$side-$i.log"; }
  done
done
python3 - "$OUT" "$REPEATS" <<'PY' || rc=1
import json, os, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
def cells(side):
    c = {}
    for i in range(1, repeats + 1):
        p = os.path.join(out, f"{side}-{i}.json")
        if os.path.exists(p):
            for r in json.load(open(p))["rows"]:
                if r["impl"] == "distattn":
                    c.setdefault((r["strategy"], r["seq"], r["pass"]), []).extend(r.get("iters_ms") or [r["ms"]])
    return c
a, b = cells("a"), cells("b")
rows = []
print(f"{'strategy':10s} {'seq':>7s} {'pass':8s} | {'A ms':>9s} {'B ms':>9s} | {'B/A':>6s} | A and B, every iteration")
for k in sorted(a):
    if k in b:
        ma, mb = statistics.median(a[k]), statistics.median(b[k])
        print(f"{k[0]:10s} {k[1]:>7d} {k[2]:8s} | {ma:9.2f} {mb:9.2f} | {mb / ma:6.3f} | {[round(x, 2) for x in a[k]]} {[round(x, 2) for x in b[k]]}")
        rows.append({"strategy": k[0], "seq": k[1], "pass": k[2], "a_ms": a[k], "b_ms": b[k], "b_over_a": mb / ma})
json.dump({"rows": rows}, open(os.path.join(out, "ab.json"), "w"), indent=1)
PY
exit $rc

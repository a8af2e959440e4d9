#!/usr/bin/env bash
# Multi-GPU check + benchmark of distattn against PyTorch context parallel and an all-to-all
# (Ulysses) SDPA baseline, all in one call on one machine:
#   bench/multigpu.sh OUTDIR
# Env: DISTATTN_MULTIGPU_BIN (default target/release/distattn-multigpu-bench, built with
# `cargo build --release -p distattn-nccl --features cli`), DISTATTN_GPU_TESTS (a folder of GPU test
# executables, `cargo test --release --no-run -p distattn-nccl -p distattn-cuda`: the check
# stage runs them), GPUS (default: all), SEQS (default 32768,131072),
# STRATEGIES (default zigzag,balanced,ulysses,allgather), BUDGET_S (default 400: later stages are
# skipped or shortened to end within it), PROBE_SEQS (default 524288; empty = no probe),
# MASKS (';'-separated, default causal: the distattn benchmark runs each; the PyTorch peers run
# causal and full, and packed documents (docs*, lengths from `doc-lens`) through varlen and flex
# attention), KV_HEADS (default 8), STAGES (default check,bench,kill,torch,probe),
# TORCH_CONFIGS (default: every flash/cuDNN rotation and the Ulysses baseline on both backends;
# add distattn-STRATEGY to time distattn's Python package in the same harness), ITERS (timed
# iterations of each side, default 4 for distattn and 3 for torch), DISTATTN_COMMIT.
# Writes OUTDIR/check/ (the GPU tests' logs), distattn.json, timelines.json, torch.json, probe.json,
# multigpu.json ({device, date, commit, rows}: distattn + torch rows) and prints a summary last.
set -uo pipefail
OUT=${1:?usage: multigpu.sh OUTDIR}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${DISTATTN_MULTIGPU_BIN:-target/release/distattn-multigpu-bench}
SEQS=${SEQS:-32768,131072}
STRATEGIES=${STRATEGIES:-zigzag,balanced,ulysses,allgather}
BUDGET=${BUDGET_S:-400}
PROBE_SEQS=${PROBE_SEQS-524288}
MASKS=${MASKS:-causal}
KV_HEADS=${KV_HEADS:-8}
STAGES=${STAGES:-check,bench,kill,torch,probe}
want() { [[ ",$STAGES," == *",$1,"* ]]; }
export DISTATTN_COMMIT=${DISTATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DISTATTN_CACHE_DIR=${DISTATTN_CACHE_DIR:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
left() { echo $((BUDGET - SECONDS)); }
stage() { echo; echo "=== [$SECONDS s] $*"; }

source "$(dirname "$0")/gpu_env.sh"
echo "$(date -u) GPUs: $GPUS; NCCL: ${NCCL_LIB:-not found}; commit $DISTATTN_COMMIT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -8
nvidia-smi topo -m 2>/dev/null | head -8
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())'

rc=0
if want check; then
  stage "exactness: every strategy on $GPUS GPUs (NCCL) and on ranks sharing them, vs f64"
  if [ -n "${DISTATTN_GPU_TESTS:-}" ]; then
    TEST_BIN_DIR="$DISTATTN_GPU_TESTS" timeout 200 bash "$HERE/gpu_tests.sh" "$OUT/check" || rc=1
  else
    echo "DISTATTN_GPU_TESTS not set: no exactness check"; rc=1
  fi
fi

if want bench; then
  IFS=';' read -ra MASK_LIST <<< "$MASKS"
  for m in "${MASK_LIST[@]}"; do
    stage "distattn benchmark, mask $m, $KV_HEADS kv heads"
    tag=$(echo "$m" | tr -c 'a-zA-Z0-9\n' '-')
    timeout $(( $(left) > 300 ? 150 : 100 )) "$BIN" bench --gpus "$GPUS" --seqs "$SEQS" --strategies "$STRATEGIES" \
      --passes fwd,fwdbwd --heads 32 --kv-heads "$KV_HEADS" --mask "$m" --iters "${ITERS:-4}" \
      --out "$OUT/distattn-$tag.json" --timelines "$OUT/timelines-$tag.json" || rc=1
  done
fi

if want kill; then
  stage "kill one rank (process mode, launcher-variable bootstrap)"
  timeout 60 "$BIN" kill-test --gpus "$GPUS" --timeout-s 10 --kill-after-s 6 || rc=1
fi

if want torch && [ "$(left)" -gt 60 ]; then
  stage "PyTorch context parallel + Ulysses (budget $(left) s)"
  CONFIGS=${TORCH_CONFIGS:-allgather-flash,alltoall-flash,allgather-cudnn,alltoall-cudnn,ulysses-flash,ulysses-cudnn,ulysses-varlen,ulysses-flex}
  [ "$(left)" -lt 150 ] && CONFIGS="alltoall-cudnn,ulysses-cudnn,ulysses-varlen"
  DOCS=""
  for m in $(echo "$MASKS" | tr ';' '\n' | grep -E '^docs'); do
    f="$OUT/doclens-$(echo "$m" | tr -c 'a-zA-Z0-9\n' '-').json"
    "$BIN" doc-lens --mask "$m" --seqs "$SEQS" > "$f" && DOCS="$DOCS${DOCS:+,}$f"
  done
  [ -n "$DOCS" ] && { python3 "$HERE/torch_cp.py" --check-docs || rc=1; }
  TPROBE=""
  [ "$(left)" -gt 200 ] && TPROBE="$PROBE_SEQS"
  # Own process group, so that the spawned ranks end with it (killed by its id on overrun).
  TMASKS=$(echo "$MASKS" | tr ';' '\n' | grep -xE 'causal|full' | paste -sd, -)
  setsid python3 "$HERE/torch_cp.py" --world "$GPUS" --seqs "$SEQS" --passes fwd,fwdbwd --masks "$TMASKS" \
    --doc-lens "$DOCS" --heads 32 --kv-heads "$KV_HEADS" --iters "${ITERS:-3}" --configs "$CONFIGS" --probe-seqs "$TPROBE" --out "$OUT/torch.json" &
  TP=$!; TEND=$(( SECONDS + $(left) - 25 ))
  while kill -0 $TP 2>/dev/null && [ $SECONDS -lt $TEND ]; do sleep 1; done
  if kill -0 $TP 2>/dev/null; then echo "torch stage over budget: ending its process group $TP"; kill -- -$TP 2>/dev/null; sleep 2; kill -9 -- -$TP 2>/dev/null; rc=1; fi
  wait $TP || rc=1
fi

if want probe && [ -n "$PROBE_SEQS" ] && [ "$(left)" -gt 45 ]; then
  stage "longest sequence probe (distattn, fwd+bwd, one cold iteration)"
  timeout $(( $(left) - 15 )) "$BIN" probe --gpus "$GPUS" --seqs "$PROBE_SEQS" --strategy zigzag --out "$OUT/probe.json" || true
fi

stage "summary"
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception:
        return None
import glob
parts = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "distattn-*.json")))]
d = parts[0] if parts else None
t, p = load("torch.json"), load("probe.json")
rows = [r for part in parts for r in part.get("rows", [])] + [r for r in (t or {}).get("rows", []) if r.get("tflops")]
merged = {"device": (d or t or {}).get("device"), "date": (d or t or {}).get("date"), "commit": (d or {}).get("commit"),
          "torch": (t or {}).get("torch"), "rows": rows, "torch_errors": [r for r in (t or {}).get("rows", []) if not r.get("tflops")],
          "probe": p}
json.dump(merged, open(os.path.join(out, "multigpu.json"), "w"), indent=1)
print(f"{'impl':15s} {'strategy':17s} {'mask':22s} {'kv':>3s} {'seq':>7s} {'pass':8s} {'TFLOP/s/GPU':>11s} {'ms':>9s} {'GB/GPU':>7s} {'eff':>5s} {'hidden':>6s}")
for r in sorted(rows, key=lambda r: (r["pass"], r["seq"], -(r.get("tflops_per_gpu") or 0))):
    eff = r.get("scaling_eff"); hid = r.get("comm_hidden_frac"); mem = r.get("mem_gb_per_gpu")
    print(f"{r['impl']:15s} {r['strategy']:17s} {str(r.get('mask', 'causal')):22s} {r.get('kv_heads', 8):>3} {r['seq']:>7d} {r['pass']:8s} {r['tflops_per_gpu']:11.1f} {r['ms']:9.2f} "
          f"{(f'{mem:.1f}' if mem is not None else '-'):>7s} {(f'{100*eff:.0f}%' if eff else '-'):>5s} {(f'{100*hid:.0f}%' if hid is not None else '-'):>6s}")
for mask, seq in sorted({(r.get("mask", "causal"), r["seq"]) for r in rows}):
    for ps in ("fwd", "fwd+bwd"):
        same = lambda r, impl: r["impl"] == impl and r["seq"] == seq and r["pass"] == ps and r.get("mask", "causal") == mask
        dd = [r for r in rows if same(r, "distattn")]
        tt = [r for r in rows if same(r, "torch-cp")]
        uu = [r for r in rows if same(r, "torch-ulysses")]
        pp = [r for r in rows if same(r, "distattn-py")]
        if pp and (tt or uu):
            bpy = max(pp, key=lambda r: r["tflops"]); bp = max(tt + uu, key=lambda r: r["tflops"])
            s = f"{mask:6s} seq {seq:>7d} {ps:8s}: best distattn-py {bpy['strategy']} {bpy['tflops_per_gpu']:.1f}/GPU | best peer {bp['impl']} {bp['strategy']}: {bpy['tflops']/bp['tflops']:.2f}x"
            for r in pp:
                rust = [x for x in dd if "distattn-" + x["strategy"] == r["strategy"]]
                if rust:
                    s += f" | {r['strategy']} from Python / from Rust {r['tflops']/rust[0]['tflops']:.2f}x"
            print(s)
        if dd and (tt or uu):
            bd = max(dd, key=lambda r: r["tflops"])
            s = f"{mask:6s} seq {seq:>7d} {ps:8s}: best distattn {bd['strategy']} {bd['tflops_per_gpu']:.1f}/GPU"
            if tt:
                bt = max(tt, key=lambda r: r["tflops"]); s += f" | best torch-cp {bt['strategy']} {bt['tflops_per_gpu']:.1f}/GPU ratio {bd['tflops']/bt['tflops']:.2f}x"
            if uu:
                bu = max(uu, key=lambda r: r["tflops"]); s += f" | best torch-ulysses {bu['strategy']} {bu['tflops_per_gpu']:.1f}/GPU ratio {bd['tflops']/bu['tflops']:.2f}x"
                du = [r for r in dd if r["strategy"] == "ulysses"]
                if du:
                    s += f" | distattn ulysses / best torch-ulysses {du[0]['tflops']/bu['tflops']:.2f}x"
            bp = max(tt + uu, key=lambda r: r["tflops"])
            s += f" | best peer {bp['impl']} {bp['strategy']}: {bd['tflops']/bp['tflops']:.2f}x"
            if bd.get("scaling_eff"):
                s += f" | distattn vs own 1-GPU kernel {100*bd['scaling_eff']:.0f}%"
            print(s)
for e in merged["torch_errors"]:
    print(f"torch {e['strategy']} seq {e['seq']} {e['pass']}: {e.get('error')}")
if p:
    for r in p:
        print(f"probe distattn {r['strategy']} seq {r['seq']}: " + (f"ok {r['ms']:.0f} ms, {r['mem_gb_per_gpu']:.1f} GB/GPU" if r.get("ok") else f"failed: {r.get('error')}"))
EOF
echo "done in $SECONDS s, rc=$rc"
exit $rc

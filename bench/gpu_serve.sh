#!/usr/bin/env bash
# Decode over a KV cache spread over this machine's GPUs (DistAttention, issue "serving beyond
# one GPU"): `distattn bench --decode --gpus P` for P = 2 and 4 (those present), batch 1 and 16,
# 32/8 heads, d 128, bf16, contiguous and interleaved (16-token pages) placements, each step
# against one GPU's paged decode kernel in the same run (contexts that do not fit one GPU say so
# and are timed spread only). Writes OUT/decode-P<gpus>-b<batch>-<placement>.json and a log.
# Then prompts onto a spread cache (`distattn bench --cached-prefill`): NEW_TOKENS (default
# 1,256,4096,32768,262144) onto PREFILL_CACHED (default 262144) cached tokens, pass-q against
# pass-KV and the planner's pick, and a fresh 1M-token prompt on contiguous and zig-zag chunks
# (OUT/prefill-P<gpus>-*.json).
#   bench/gpu_serve.sh OUT [CONTEXTS]      (default 1048576,4194304)
# Env: DISTATTN_BIN (default target/release/distattn, built with
# `cargo build --release -p distattn --features cli`); PARTS (default decode,prefill);
# GPU_COUNTS (default "2 4"); PLACEMENTS (default "contiguous pages:16"); LONGEST (contexts,
# comma-separated, timed at batch 1 on the most GPUs present after the rest: the longest that
# fits one GPU and the longest the spread cache holds; none by default).
set -uo pipefail
OUT=${1:?usage: bench/gpu_serve.sh OUT [CONTEXTS]}
CONTEXTS=${2:-1048576,4194304}
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
BIN=${DISTATTN_BIN:-target/release/distattn}
mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.txt"
PARTS=${PARTS:-decode,prefill}
rc=0
GPU_COUNTS=${GPU_COUNTS:-2 4}
for P in $GPU_COUNTS; do
  [[ ",$PARTS," == *",decode,"* ]] || break
  [ "$P" -le "$NGPU" ] || { echo "== $P GPUs: only $NGPU here, skipped"; continue; }
  for B in 1 16; do
    for PL in ${PLACEMENTS:-contiguous pages:16}; do
      name="decode-P$P-b$B-${PL/:/}"
      echo "== $name"
      "$BIN" bench --decode --gpus "$P" --batch "$B" --seqs "$CONTEXTS" --head-dims 128 --heads 32 --kv-heads 8 \
        --placement "$PL" --repeats 5 --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" || rc=1
    done
  done
done
if [ -n "${LONGEST:-}" ] && [[ ",$PARTS," == *",decode,"* ]]; then
  echo "== the longest contexts, batch 1, $NGPU GPUs: $LONGEST"
  "$BIN" bench --decode --gpus "$NGPU" --batch 1 --seqs "$LONGEST" --head-dims 128 --heads 32 --kv-heads 8 \
    --placement contiguous --repeats 3 --json "$OUT/decode-P$NGPU-b1-longest.json" 2>&1 | tee "$OUT/decode-P$NGPU-b1-longest.log" || rc=1
fi
for P in $GPU_COUNTS; do
  [[ ",$PARTS," == *",prefill,"* ]] || break
  [ "$P" -le "$NGPU" ] || continue
  # One process per point: on 2 H200s a process that had timed four points aborted in the fifth
  # (glibc "double free or corruption", 2026-11-26, first session); each point alone ran clean,
  # and so did the same five points in one process under cuda-gdb later that day.
  for N in $(echo "${NEW_TOKENS:-1,256,4096,32768,262144}" | tr , ' '); do
    echo "== $N new tokens onto ${PREFILL_CACHED:-262144} cached, spread over $P GPUs"
    "$BIN" bench --cached-prefill --gpus "$P" --seqs "${PREFILL_CACHED:-262144}" --new-tokens "$N" \
      --heads 32 --kv-heads 8 --head-dims 128 --repeats 3 --json "$OUT/prefill-P$P-new$N.json" 2>&1 \
      | tee "$OUT/prefill-P$P-new$N.log" || rc=1
  done
  for PL in contiguous zigzag; do
    echo "== a fresh 1M-token prompt, $P GPUs, $PL placement"
    "$BIN" bench --cached-prefill --gpus "$P" --seqs 0 --new-tokens 1048576 --heads 32 --kv-heads 8 --head-dims 128 \
      --placement $PL --repeats 1 --json "$OUT/prefill-P$P-1m-$PL.json" 2>&1 | tee "$OUT/prefill-P$P-1m-$PL.log" || rc=1
  done
done
exit $rc

#!/usr/bin/env bash
# The training example on this machine's GPUs: exactness of the checkpoint policies (and of
# context parallelism where there are several GPUs) against SDPA, then seconds per step,
# tokens/s, peak memory and attention forwards per step for distattn (remat, layer, none) and
# SDPA / PyTorch context parallel (layer, selective checkpointing of the SDPA op, none), same
# model, same call. Needs torch and the distattn package importable.
#   bench/gpu_train.sh OUT [SEQS]      (SEQS: whole-sequence lengths, default 65536,131072)
# Environment: STAGES (default tests,exact,speed), LAYERS (2), STEPS (6, of which 2 warm up),
# POLICIES (remat,layer,none), STRATEGY (zigzag, several GPUs).
set -uo pipefail
OUT=${1:?usage: bench/gpu_train.sh OUT [SEQS]}
SEQS=${2:-65536,131072}
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
mkdir -p "$OUT/runs"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
EX=python/examples/train_llama.py
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.txt"

STAGES=${STAGES:-tests,exact,speed}
POLICIES=${POLICIES:-remat,layer,none}
stage() { [[ ",$STAGES," == *",$1,"* ]]; }

stage tests && {
echo "== tests on CUDA: context parallel through NCCL, checkpoint policies, transformers, the example"
python3 -m pytest -q python/tests/test_distributed.py -k cuda 2>&1 | tail -2
python3 -m pytest -q python/tests/test_checkpoint.py python/tests/test_transformers.py 2>&1 | tail -2
}

run() {  # run NAME PROCS ARGS...: one training run, its summary line and JSON
  local name=$1 procs=$2; shift 2
  if [ "$procs" -gt 1 ]; then
    timeout 900 torchrun --nproc-per-node "$procs" $EX --json "$OUT/runs/$name.json" "$@" > "$OUT/runs/$name.log" 2>&1
  else
    timeout 900 python3 $EX --json "$OUT/runs/$name.json" "$@" > "$OUT/runs/$name.log" 2>&1
  fi
  echo "$name: rc=$? $(tail -1 "$OUT/runs/$name.log")"
}

stage exact && {
echo "== exactness: 20 steps, 2 layers of hidden 1024 (8/2 heads), 16k tokens; losses and first-step gradients"
SMALL=(--layers 2 --hidden 1024 --heads 8 --kv-heads 2 --ffn 2816 --seq 16384 --steps 20)
run exact-sdpa 1 "${SMALL[@]}" --attn sdpa --policy none --grads "$OUT/runs/exact-sdpa.pt"
for p in none layer remat; do
  run "exact-distattn-$p" 1 "${SMALL[@]}" --policy "$p" --grads "$OUT/runs/exact-distattn-$p.pt"
done
if [ "$NGPU" -ge 2 ]; then
  for P in 2 4; do
    [ "$NGPU" -ge "$P" ] || continue
    for s in ring zigzag striped balanced ulysses hybrid allgather dispatch; do
      run "exact-cp$P-$s" "$P" "${SMALL[@]}" --strategy "$s" --policy remat --grads "$OUT/runs/exact-cp$P-$s.pt"
    done
  done
fi
}

stage speed && {
echo "== speed: the 8B per-layer shapes, ${LAYERS:=2} layers"
BIG=(--layers "$LAYERS" --steps "${STEPS:-6}")
P=$NGPU
for seq in ${SEQS//,/ }; do
  for p in ${POLICIES//,/ }; do
    run "speed-$seq-distattn-$p" "$P" "${BIG[@]}" --seq "$seq" --policy "$p" --strategy "${STRATEGY:-zigzag}"
  done
  if [ "$P" -eq 1 ]; then
    for b in ${SDPA_BACKENDS:-cudnn flash}; do
      for p in ${POLICIES//,/ }; do
        run "speed-$seq-sdpa-$b-$p" 1 "${BIG[@]}" --seq "$seq" --attn sdpa --sdpa-backend "$b" --policy "$p"
      done
    done
  else
    for p in ${POLICIES//,/ }; do
      run "speed-$seq-torchcp-cudnn-$p" "$P" "${BIG[@]}" --seq "$seq" --attn torch-cp --sdpa-backend cudnn --policy "$p"
    done
  fi
done
}

python3 bench/train_table.py "$OUT" | tee "$OUT/table.md"

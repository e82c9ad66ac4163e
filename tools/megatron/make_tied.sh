#!/bin/bash
# Make the tied-embedding GPT-2-like fixture ("B": MHA, GeLU, LayerNorm + biases, learned
# positions, tied input/output embeddings, vocab 250+1 padded to 256) with Megatron-LM itself
# (CPU/gloo, tools/megatron/setup.sh environment; the .pth hook of the fixture README is needed
# because the torch_dist writer spawns processes):
#   1. OUT/ref_tp1pp1/torch_dist : iterations 1..3 at TP1/PP1 (as make_ckpts.sh does)
#   2. OUT/<layout>/torch_dist   : Megatron loads (1) at <layout> (its own resharding), trains 4..5
#   3. OUT/<layout>/torch        : Megatron's --ckpt-convert-format torch of (2) (legacy layout)
# Usage: [MODEL=A|B] tools/megatron/make_tied.sh OUT [layouts...]   (default: tp1pp1 tp1pp2;
#        a layout may add vppN for N virtual stages per pipeline rank, e.g. tp1pp2vpp2)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:?out dir}; shift; LAYOUTS=("${@:-tp1pp1 tp1pp2}"); [ $# -eq 0 ] && LAYOUTS=(tp1pp1 tp1pp2)
PY=${MEGATRON_PYTHON:-$ROOT/.megatron/venv/bin/python}
export MEGATRON_CPU_SHIM=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore

ARGS="import sys; sys.path.insert(0, '$HERE'); import verify_loss as v; print(' '.join(getattr(v, sys.argv[1])))"
MODEL_B=($("$PY" -c "$ARGS" "MODEL_${MODEL:-B}")); COMMON=($("$PY" -c "$ARGS" COMMON))
PORT=29801
run() { local np=$1; shift; PORT=$((PORT+1))
  "$PY" -m torch.distributed.run --nproc_per_node "$np" --master_addr 127.0.0.1 --master_port $PORT \
    "$HERE/run_pretrain.py" "${MODEL_B[@]}" "${COMMON[@]}" --data-cache-path "$OUT/cache" "$@"; }
mkdir -p "$OUT/logs"
run 1 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --train-iters 5 --exit-interval 3 \
  --save-interval 3 --ckpt-format torch_dist --save "$OUT/ref_tp1pp1/torch_dist" > "$OUT/logs/ref_tp1pp1.log" 2>&1
for l in "${LAYOUTS[@]}"; do
  tp=$(sed -E 's/^tp([0-9]+).*/\1/' <<<"$l"); pp=$(sed -E 's/^tp[0-9]+pp([0-9]+).*/\1/' <<<"$l")
  VPP=(); [[ $l =~ vpp([0-9]+) ]] && VPP=(--num-virtual-stages-per-pipeline-rank "${BASH_REMATCH[1]}")
  run $((tp*pp)) --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" "${VPP[@]}" --train-iters 5 \
    --save-interval 5 --load "$OUT/ref_tp1pp1/torch_dist" --ckpt-format torch_dist \
    --save "$OUT/$l/torch_dist" > "$OUT/logs/$l.log" 2>&1
  # Megatron's own converter (as make_ckpts.sh): torch_dist -> legacy OUT/<layout>/torch
  run $((tp*pp)) --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" "${VPP[@]}" --train-iters 5 \
    --save-interval 5 --load "$OUT/$l/torch_dist" --ckpt-format torch_dist --ckpt-convert-format torch \
    --ckpt-convert-save "$OUT/$l" --save "$OUT/$l/unused" > "$OUT/logs/${l}_convert.log" 2>&1
  rm -rf "$OUT/$l/unused"
done
rm -rf "$OUT/cache"
echo "done: $OUT"

#!/bin/bash
# Real mixture-of-experts checkpoints from Megatron-LM's own training loop (pretrain_gpt.py, tag
# core_v0.16.1, megatron-core 0.16.1, CPU/gloo through tools/megatron/cpu_shim.py), small enough to
# commit as tests/fixtures/megatron_moe (tests/test_megatron_moe.py reads them; CI has no Megatron-LM).
#
# Needs: bash tools/megatron/setup.sh (or MEGATRON_VENV=.venv bash tools/megatron/setup.sh to reuse
# the project's venv: it has megatron-core 0.16.1, torch 2.13 CPU and the training deps).
#
# Per family:
#   1. <fam>/ref_tp1ep1/torch_dist : TP1/EP1, train iterations 1..3 (of 5), save (torch_dist)
#   2. <fam>/<layout>/torch_dist   : Megatron loads the ref at <layout> (resharding experts over EP/ETP
#                                    itself; the shim mends its EP1 -> EP>1 optimizer reshard),
#                                    trains iterations 4..5, saves
#   3. <fam>/<layout>/torch        : Megatron's own --ckpt-convert-format torch of (2): the legacy
#                                    per-rank files iter_0000005/mp_rank_TT[_PPP]_EEE/model_optim_rng.pt
# Families:
#   M : fp32, SequentialMLP (experts.local_experts.K), 4 experts top-2, a shared expert, the router's
#       expert bias (sigmoid scores, aux-loss-free balancing), torch Adam (ChainedOptimizer at EP>1:
#       dense + expert optimizers); layouts ep2 (TP1 DP2 EP2), tp2ep2etp1 (TP2 EP2 ETP1, 2 ranks),
#       tp2ep2 (TP2 DP2 EP2 ETP2, 4 ranks)
#   D : as M without shared expert / expert bias, with the distributed optimizer
#       (--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable: expert parameters' buffers in
#       their expert-data-parallel groups); layout tp1ep2dp4 (4 ranks: DP 4, EP 2, expert-DP 2), trained
#       there from scratch (iterations 1..5)
#   G : bf16, legacy GroupedMLP (--moe-grouped-gemm: experts.weight1/weight2, the shim's pure-torch
#       grouped GEMM), Float16 optimizer (fp32 master copies); layouts ep2, tp2ep2etp1
# Usage: tools/megatron/make_moe_ckpts.sh OUT [M|D|G|all]
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:?usage: make_moe_ckpts.sh OUT [M|D|G|all]}
ONLY=${2:-all}
PY=${MEGATRON_VENV:-$ROOT/.megatron/venv}/bin
export MEGATRON_CPU_SHIM=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
mkdir -p "$OUT/logs"
PORT=${PORT:-29700}

# tiny (a few hundred KB per layout with Adam state): 2 MoE layers, hidden 16, GQA, SwiGLU experts of
# width 16, vocab 60 (+1 eod) padded to 64
MODEL=(--num-layers 2 --hidden-size 16 --num-attention-heads 4 --group-query-attention --num-query-groups 2
  --ffn-hidden-size 32 --swiglu --normalization RMSNorm --disable-bias-linear
  --position-embedding-type rope --untie-embeddings-and-output-weights
  --max-position-embeddings 32 --vocab-size 60 --make-vocab-size-divisible-by 32
  --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-token-dispatcher-type alltoall
  --moe-aux-loss-coeff 0.01)
COMMON=(--seq-length 32 --micro-batch-size 2 --global-batch-size 4
  --tokenizer-type NullTokenizer --mock-data --seed 1234
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 10
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --transformer-impl local --distributed-backend gloo --use-cpu-initialization
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --no-bias-gelu-fusion --no-rope-fusion --no-persist-layer-norm --no-bias-dropout-fusion
  --attention-dropout 0 --hidden-dropout 0 --no-save-rng
  --log-interval 1 --eval-iters 0 --eval-interval 100000 --exit-on-missing-checkpoint)
M_X=(--moe-shared-expert-intermediate-size 16 --moe-router-score-function sigmoid --moe-router-enable-expert-bias)
G_X=(--bf16 --moe-grouped-gemm)
D_X=(--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable)

run() {  # run NAME NPROC ARGS...
  local name=$1 np=$2; shift 2
  PORT=$((PORT + 1))
  nice "$PY/torchrun" --nproc_per_node "$np" --master_addr 127.0.0.1 --master_port "$PORT" \
      "$ROOT/tools/megatron/run_pretrain.py" "$@" --data-cache-path "$OUT/cache" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name (np=$np): rc=$rc"
  return $rc
}

layout_args() {  # tpXepY[etpZ][dpW] -> LARGS, NP (world = TP x DP; DP = EP x ETP / TP rounded up to 1 unless dpW)
  local l=$1 tp ep etp
  tp=$(sed -E 's/^tp([0-9]+).*/\1/' <<<"$l"); ep=$(sed -E 's/^tp[0-9]+ep([0-9]+).*/\1/' <<<"$l")
  etp=$tp; [[ $l =~ etp([0-9]+) ]] && etp=${BASH_REMATCH[1]}
  LARGS=(--tensor-model-parallel-size "$tp" --expert-model-parallel-size "$ep" --expert-tensor-parallel-size "$etp")
  [ "$tp" -gt 1 ] && LARGS+=(--sequence-parallel)
  NP=$((ep * etp > tp ? ep * etp : tp))
  # an explicit DP of 4: micro-batch 1 (the global batch of 4 stays)
  [[ $l =~ dp([0-9]+) ]] && NP=$((tp * BASH_REMATCH[1])) && LARGS+=(--micro-batch-size 1)
  return 0
}

make_family() {  # make_family TAG EXTRA_ARRAY_NAME [GG] LAYOUTS...
  local tag=$1; local -n xargs=$2; shift 2
  local base=$OUT/$tag
  rm -rf "$base"; mkdir -p "$base"
  run "${tag}_ref" 1 "${MODEL[@]}" "${COMMON[@]}" "${xargs[@]}" --tensor-model-parallel-size 1 \
      --train-iters 5 --exit-interval 3 --save-interval 3 --ckpt-format torch_dist --save "$base/ref_tp1ep1/torch_dist" || return 1
  for l in "$@"; do
    layout_args "$l"
    run "${tag}_${l}_train" "$NP" "${MODEL[@]}" "${COMMON[@]}" "${xargs[@]}" "${LARGS[@]}" --no-load-rng \
        --load "$base/ref_tp1ep1/torch_dist" --train-iters 5 --save-interval 5 \
        --ckpt-format torch_dist --save "$base/$l/torch_dist" || continue
    run "${tag}_${l}_convert" "$NP" "${MODEL[@]}" "${COMMON[@]}" "${xargs[@]}" "${LARGS[@]}" --no-load-rng \
        --load "$base/$l/torch_dist" --train-iters 5 --save-interval 5 --ckpt-format torch_dist \
        --ckpt-convert-format torch --ckpt-convert-save "$base/$l" --save "$base/$l/unused" || continue
  done
}

if [[ $ONLY == all || $ONLY == M ]]; then make_family M M_X tp1ep2 tp2ep2etp1 tp2ep2; fi
make_scratch() {  # make_scratch TAG EXTRA_ARRAY_NAME LAYOUT: train 1..5 at LAYOUT from scratch, save, convert
  local tag=$1; local -n sargs=$2; local l=$3 base=$OUT/$1
  rm -rf "$base"; mkdir -p "$base"
  layout_args "$l"
  run "${tag}_${l}_train" "$NP" "${MODEL[@]}" "${COMMON[@]}" "${sargs[@]}" "${LARGS[@]}" --train-iters 5 \
      --save-interval 5 --ckpt-format torch_dist --save "$base/$l/torch_dist" || return 1
  run "${tag}_${l}_convert" "$NP" "${MODEL[@]}" "${COMMON[@]}" "${sargs[@]}" "${LARGS[@]}" --no-load-rng \
      --load "$base/$l/torch_dist" --train-iters 5 --save-interval 5 --ckpt-format torch_dist \
      --ckpt-convert-format torch --ckpt-convert-save "$base/$l" --save "$base/$l/unused"
}

# D trains at its layout from scratch: the shim's EP1 -> EP>1 optimizer mend covers torch Adam only,
# not the distributed optimizer's state dict (KeyError: 'state' in ChainedOptimizer.load_state_dict)
if [[ $ONLY == all || $ONLY == D ]]; then make_scratch D D_X tp1ep2dp4; fi
if [[ $ONLY == all || $ONLY == G ]]; then MEGATRON_CPU_SHIM_GG=1 make_family G G_X tp1ep2 tp2ep2etp1; fi
rm -rf "$OUT/cache"
find "$OUT" -type d -name unused -prune -exec rm -rf {} +
echo done

#!/bin/bash
# Put Megatron-LM's source at tag core_v0.16.1 into third_party/mlm (git-ignored; never committed):
# the files the Megatron benchmark runs (pretrain_gpt.py and its training code, tools/checkpoint).
#   bash bench/megatron_source.sh /path/to/Megatron-LM/.git    # from a local clone or mirror
#   bash bench/megatron_source.sh                               # git clone from GitHub (needs network)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MLM=${MEGATRON_LM_DIR:-$ROOT/third_party/mlm}
TAG=core_v0.16.1
PATHS=(pretrain_gpt.py gpt_builders.py model_provider.py megatron/training megatron/legacy megatron/rl
       megatron/post_training tools/checkpoint)
if [ -f "$MLM/pretrain_gpt.py" ] && [ -f "$MLM/tools/checkpoint/convert.py" ]; then echo "ok: $MLM"; exit 0; fi
mkdir -p "$MLM"
if [ $# -ge 1 ]; then
  git --git-dir="$1" archive "$TAG" "${PATHS[@]}" | tar -x -C "$MLM"
else
  tmp=$(mktemp -d)
  git clone -q --depth 1 --branch "$TAG" https://github.com/NVIDIA/Megatron-LM.git "$tmp/mlm"
  git --git-dir="$tmp/mlm/.git" archive HEAD "${PATHS[@]}" | tar -x -C "$MLM"
  rm -rf "$tmp"
fi
echo "ok: $MLM"

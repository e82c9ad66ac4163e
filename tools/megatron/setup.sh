#!/bin/bash
# Prepare what tools/megatron/verify_loss.py needs (all git-ignored); used by the opt-in
# `make test-megatron-lm` only (it needs network for the git clone; CI runs
# tests/test_megatron_core_e2e.py, which needs only the `megatron` extra from PyPI):
#   .megatron/venv   : torch 2.13.0 (CPU) + megatron-core 0.16.1 from PyPI (+ deps of megatron/training)
#   third_party/mlm  : Megatron-LM training code at tag core_v0.16.1 (pretrain_gpt.py, megatron/training ...)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${MEGATRON_VENV:-$ROOT/.megatron/venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu || "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q megatron-core==0.16.1 "torch==2.13.0" numpy packaging six regex pyyaml pydantic psutil
fi
MLM=${MEGATRON_LM_DIR:-$ROOT/third_party/mlm}
if [ ! -f "$MLM/pretrain_gpt.py" ]; then
  tmp=$(mktemp -d)
  git clone -q --depth 1 --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM.git "$tmp/mlm"
  mkdir -p "$MLM"
  (cd "$tmp/mlm" && cp -r pretrain_gpt.py gpt_builders.py model_provider.py "$MLM/" && mkdir -p "$MLM/megatron" \
     && cp -r megatron/training megatron/legacy megatron/rl megatron/post_training "$MLM/megatron/")
  rm -rf "$tmp"
fi
# dist_checkpointing's writer spawns processes that re-import __main__: patch every process (make_tied.sh)
SP=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import os, sys; os.environ.get('MEGATRON_CPU_SHIM') == '1' and (sys.path.insert(0, '$ROOT/tools/megatron') or __import__('cpu_shim').install())" \
  > "$SP/megatron_cpu_shim.pth"
echo "ok: $VENV $MLM"

#!/usr/bin/env bash
# Build a second venv with an old Orbax release (0.4.2, before _METADATA / _CHECKPOINT_METADATA
# existed) and write the tests/fixtures/orbax_old checkpoints with it (tools/make_old_orbax_ckpt.py).
#   bash tools/make_old_orbax_ckpt.sh [OUT=tests/fixtures/orbax_old] [VENV=.venv-orbax-0.4]
# Needs python3.11 (the old jaxlib has no wheels for newer Pythons) and the package registry.
set -euo pipefail
OUT=${1:-tests/fixtures/orbax_old}
VENV=${2:-.venv-orbax-0.4}
PY=${PYTHON:-python3.11}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    # versions of late 2023 that work together: numpy 1.x, scipy with linalg.tril, ml_dtypes 0.3
    "$VENV/bin/python" -m pip install -q "orbax-checkpoint==0.4.2" "jax[cpu]==0.4.18" "jaxlib==0.4.18" \
        "tensorstore==0.1.45" "optax==0.1.7" "numpy==1.26.4" "scipy==1.11.4" "ml_dtypes==0.3.1"
fi
rm -rf "$OUT"
"$VENV/bin/python" "$(dirname "$0")/make_old_orbax_ckpt.py" "$OUT"

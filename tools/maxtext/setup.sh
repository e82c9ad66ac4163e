#!/usr/bin/env bash
# Build .maxtext/venv: Python 3.12 + maxtext==0.2.5 (--no-deps) + tools/maxtext/requirements.txt
# (--no-deps, pinned) + ckptbridge itself (editable, --no-deps), for tools/maxtext/harness.py.
# Idempotent: returns at once when the stamp is newer than its inputs and maxtext imports.
# `make maxtext-venv` runs it; `make test` depends on it (CI builds it from a clean clone).
#
# Python 3.12 is found as: $PY312, then pyenv's 3.12 (`pyenv root`/versions/3.12*), then
# python3.12 / python3 on PATH if they are 3.12. MAXTEXT_VENV overrides the venv's place.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${MAXTEXT_VENV:-$ROOT/.maxtext/venv}
REQ=$ROOT/tools/maxtext/requirements.txt
STAMP=$VENV/.installed-stamp
MAXTEXT_VERSION=0.2.5
export DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu PIP_DISABLE_PIP_VERSION_CHECK=1

smoke() {
  "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import maxtext.models.models, maxtext.checkpoint_conversion.to_maxtext  # noqa: F401
import ckptbridge.adapters.jax  # noqa: F401
assert md.version("maxtext") == "0.2.5", md.version("maxtext")
EOF
}

newer() { [ -f "$STAMP" ] && [ "$STAMP" -nt "$REQ" ] && [ "$STAMP" -nt "$0" ] && [ "$STAMP" -nt "$ROOT/pyproject.toml" ]; }
quick() { "$VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("maxtext") == "0.2.5"' 2>/dev/null; }
if newer && quick; then
  echo "maxtext venv up to date: $VENV"
  exit 0
fi

is312() { [ -n "$1" ] && [ -x "$1" ] && "$1" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
find_py312() {
  local c
  if is312 "${PY312:-}"; then echo "$PY312"; return; fi
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
  roots+=("${PYENV_ROOT:-}" "$HOME/.pyenv")
  for r in "${roots[@]}"; do
    [ -n "$r" ] || continue
    for c in $(ls -d "$r"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
      if is312 "$c"; then echo "$c"; return; fi
    done
  done
  for c in "$(command -v python3.12 || true)" "$(command -v python3 || true)"; do
    if is312 "$c"; then echo "$c"; return; fi
  done
  return 1
}

if ! is312 "$VENV/bin/python"; then
  PY=$(find_py312) || { echo "setup.sh: no Python 3.12 found (set PY312=/path/to/python3.12)" >&2; exit 1; }
  echo "creating $VENV with $PY"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP"
# --no-compile: the harness imports a fraction of the venv's ~11k files (Python compiles those on first import)
"$VENV/bin/python" -m pip install -q --no-deps --no-compile -r "$REQ" "maxtext==$MAXTEXT_VERSION"
"$VENV/bin/python" -m pip install -q --no-deps --no-compile -e "$ROOT"
smoke
touch "$STAMP"
echo "maxtext venv ready: $VENV"

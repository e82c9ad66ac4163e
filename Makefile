# Two commands set up everything on a fresh machine:
#   make demo   -- builds .venv, makes a small real checkpoint, inspects / converts / reshards it
#   make test   -- builds .venv, runs ruff and the whole test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

# DeepSpeed builds no C++ ops on these CPU machines.
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu
export DS_SKIP_CUDA_CHECK := 1
export OMP_NUM_THREADS ?= 1

.PHONY: venv maxtext-venv test test-fast test-megatron-lm demo lint bench bench-quick fuzz clean

# Python caches the bytecode it compiles, whatever the caller's environment says: with
# PYTHONDONTWRITEBYTECODE=1 (these machines set it) every process of the suite, hundreds of torchrun
# ranks among them, compiled torch, DeepSpeed, JAX ... from source again, twice the CPU of an
# import (a DeepSpeed resume test: 62 -> 22 CPU seconds). The caches land in the git-ignored venvs
# and __pycache__ folders.
unexport PYTHONDONTWRITEBYTECODE

# constraints.txt pins what CI tests (torch's CPU wheel, deepspeed, megatron-core); pyproject's
# extras give users ranges. --no-compile: pip would byte-compile all ~21k files of the venv (about
# 90 s of CPU); Python compiles the few thousand a run imports, once, when it first imports them.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[dev,torch,jax,deepspeed,megatron,remote,bench]'
	touch $(STAMP)

venv: $(STAMP)

# MaxText 0.2.5 in its own Python 3.12 venv, for tools/maxtext/harness.py (tests/test_maxtext_harness.py)
MAXTEXT_STAMP := .maxtext/venv/.installed-stamp
$(MAXTEXT_STAMP): tools/maxtext/requirements.txt tools/maxtext/setup.sh pyproject.toml
	bash tools/maxtext/setup.sh

maxtext-venv: $(MAXTEXT_STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(PY) tools/check_architecture.py
	$(PY) tools/typecheck.py
	$(PY) bench/readme.py --check

# The suite runs on TEST_WORKERS processes (pytest-xdist, a test file per worker at a time), then
# the `serial` tests alone: the fault detector's, whose claims are latencies of a few step periods
# that a second test file loading the same cores would stretch.
TEST_WORKERS ?= 2
test: venv maxtext-venv lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial and not megatron_lm"
	$(PY) -m pytest -q -m "serial and not megatron_lm"

test-fast: venv maxtext-venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not heavy and not serial and not megatron_lm"
	$(PY) -m pytest -q -m "not heavy and serial and not megatron_lm"

demo: venv
	$(PY) examples/demo.py demo_out

# Megatron-LM's own training loop resumes checkpoints ckptbridge wrote (tests/test_megatron_e2e.py).
# Not part of `make test`/CI: tools/megatron/setup.sh git-clones Megatron-LM (core_v0.16.1) into
# third_party/mlm and builds .megatron/venv. CI runs tests/test_megatron_core_e2e.py instead.
test-megatron-lm: venv
	bash tools/megatron/setup.sh
	$(PY) -m pytest -q -m megatron_lm tests/test_megatron_e2e.py

# a longer fuzzing campaign than CI's (FUZZ_CASES per reader)
fuzz: venv
	FUZZ_CASES=$${FUZZ_CASES:-20000} $(PY) -m pytest -q tests/test_fuzz.py tests/test_fuzz_adapters.py

# Every harness suite (bench/README.md), then every standalone benchmark: results -> bench/results/,
# then the README's tables regenerated from them. The Megatron rows need Megatron-LM's source
# (bench/megatron_source.sh: a git clone of tag core_v0.16.1, or from a local mirror given to it);
# bench_recipes runs in MaxText's venv. About 4 hours on a 2-core VM, ~60 GB of disk.
bench: venv maxtext-venv
	bash bench/megatron_source.sh
	$(PY) bench/run.py
	$(PY) bench/run.py --standalone
	$(PY) bench/readme.py

# the same at a tiny size (CI smoke; results in bench/out/results-quick, README untouched)
bench-quick: venv
	$(PY) bench/run.py --quick

clean:
	rm -rf $(VENV) .maxtext demo_out bench/out .pytest_cache .ruff_cache

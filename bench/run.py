#!/usr/bin/env python
"""Run every benchmark suite on the one harness (``make bench``); see bench/README.md.

    python bench/run.py [SUITE ...] [--quick | --size 1g|8g|full] [--reps N] [--only GLOB]
    python bench/run.py --list
    python bench/run.py --standalone [NAME ...]     # the standalone benchmarks (their own method)

The standalone benchmarks (``STANDALONE``) keep their own method and result files
(``bench/results/<stem>.json``); ``--standalone`` runs every one, at its default (full) size, one
after the other, each with the commands bench/README.md gives: ``bench_recipes`` in MaxText's
venv (``make maxtext-venv``), ``big_state`` makes its ~30 GB state in ``bench/out/big`` first (kept
for the next run, as the harness keeps its inputs). Every standalone result file in
``bench/results`` is one of theirs (``RESULT_STEMS``), but ``gpu_check`` (``tools/gpu_check.py``,
on a GPU).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _harness import main  # noqa: E402

MODULES = ("bench_core", "bench_deepspeed_convert", "bench_torch_load", "jax_load_vs_orbax", "bench_megatron",
           "bench_moe_ep")

PY, MAXTEXT_PY = "{py}", "{maxtext-py}"  # this interpreter; MaxText's venv's (Python >= 3.12)
BIG = os.path.join(HERE, "out", "big")

# name -> the commands it runs (scripts under bench/) and the result stems they write
STANDALONE: dict[str, tuple[list[list[str]], tuple[str, ...]]] = {
    "bench_async": ([[PY, "bench_async.py"]], ("bench_async",)),
    "orbax_inplace": ([[PY, "bench_orbax_inplace.py"]], ("orbax_inplace",)),
    "ds_resume": ([[PY, "bench_ds_resume.py"]], ("ds_resume",)),
    "ds_resume_4g": ([[PY, "bench_ds_resume.py", "--d-model", "2048", "--n-layer", "6", "--reps", "2", "--name",
                       "ds_resume_4g", "--workdir", "/tmp/ckptbridge_bench_ds_resume_4g"]], ("ds_resume_4g",)),
    "bench_lora": ([[PY, "bench_lora.py"]], ("bench_lora",)),
    "bench_quant": ([[PY, "bench_quant.py"]], ("bench_quant",)),
    "bench_recipes": ([[MAXTEXT_PY, "bench_recipes.py"]], ("bench_recipes",)),
    "convert_mp": ([[PY, "bench_convert_mp.py"]], ("convert_mp",)),
    "remote": ([[PY, "bench_remote.py"]], ("remote",)),
    "bench_elastic": ([[PY, "bench_elastic.py"]], ("bench_elastic",)),
    "big_state": ([[PY, "make_big_state.py", BIG], [PY, "bench_big_state.py", BIG],
                   [PY, "bench_ds_resume.py", "--big", BIG, "--dst-ws", "1"]], ("big_state", "ds_resume_big")),
}
RESULT_STEMS = {stem for _, stems in STANDALONE.values() for stem in stems}


def suites() -> list:
    return [importlib.import_module(m).SUITE for m in MODULES]


def run_standalone(names: list[str]) -> int:
    """Run the named standalone benchmarks (all of ``STANDALONE`` when none); the first failure's code.
    A benchmark whose command fails runs no further command."""
    unknown = sorted(set(names) - set(STANDALONE))
    if unknown:
        print(f"unknown standalone benchmark(s) {unknown}; known: {sorted(STANDALONE)}", file=sys.stderr)
        return 2
    interpreters = {PY: sys.executable, MAXTEXT_PY: os.path.join(os.path.dirname(HERE), ".maxtext", "venv", "bin",
                                                                  "python")}
    rc = 0
    for name in names or STANDALONE:
        for py, script, *args in STANDALONE[name][0]:
            cmd = [interpreters[py], os.path.join(HERE, script), *args]
            print("+", " ".join(cmd), flush=True)
            r = subprocess.run(cmd, check=False).returncode
            if r:
                print(f"{name}: exit {r}", file=sys.stderr)
                rc = rc or r
                break
    return rc


if __name__ == "__main__":
    if "--standalone" in sys.argv[1:]:
        sys.exit(run_standalone([a for a in sys.argv[1:] if a != "--standalone"]))
    sys.exit(main(suites()))

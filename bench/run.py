#!/usr/bin/env python
"""Run every benchmark suite on the one harness (``make bench``); see bench/README.md.

    python bench/run.py [SUITE ...] [--quick | --size 1g|8g|full] [--reps N] [--only GLOB]
    python bench/run.py --list
    python bench/run.py --standalone [NAME ...]     # the standalone benchmarks (their own method)

The standalone benchmarks (``STANDALONE``) keep their own method and result files
(``bench/results/<stem>.json``); ``--standalone`` runs those that need nothing beyond the
project venv, at their default (full) sizes, one after the other. The others need inputs or a
venv of their own (their commands are in bench/README.md).
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

# name -> script arguments; each writes bench/results/<its stem>.json (and bench_async also .md)
STANDALONE = {
    "bench_async": ["bench_async.py"],
    "orbax_inplace": ["bench_orbax_inplace.py"],
    "ds_resume": ["bench_ds_resume.py"],
    "bench_lora": ["bench_lora.py"],
}


def suites() -> list:
    return [importlib.import_module(m).SUITE for m in MODULES]


def run_standalone(names: list[str]) -> int:
    """Run the named standalone benchmarks (all of ``STANDALONE`` when none); the first failure's code."""
    unknown = sorted(set(names) - set(STANDALONE))
    if unknown:
        print(f"unknown standalone benchmark(s) {unknown}; known: {sorted(STANDALONE)}", file=sys.stderr)
        return 2
    rc = 0
    for name in names or STANDALONE:
        cmd = [sys.executable, os.path.join(HERE, STANDALONE[name][0]), *STANDALONE[name][1:]]
        print("+", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, check=False).returncode
        if r and not rc:
            print(f"{name}: exit {r}", file=sys.stderr)
            rc = r
    return rc


if __name__ == "__main__":
    if "--standalone" in sys.argv[1:]:
        sys.exit(run_standalone([a for a in sys.argv[1:] if a != "--standalone"]))
    sys.exit(main(suites()))

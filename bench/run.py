#!/usr/bin/env python
"""Run every benchmark suite on the one harness (``make bench``); see bench/README.md.

    python bench/run.py [SUITE ...] [--quick | --size 1g|8g|full] [--reps N] [--only GLOB]
    python bench/run.py --list
"""

from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import main

MODULES = ("bench_core", "bench_deepspeed_convert", "bench_torch_load", "jax_load_vs_orbax", "bench_megatron",
           "bench_async")


def suites() -> list:
    return [importlib.import_module(m).SUITE for m in MODULES]


if __name__ == "__main__":
    sys.exit(main(suites()))

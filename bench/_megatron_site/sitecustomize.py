"""Installs tools/megatron/cpu_shim.py in every Python process started with MEGATRON_CPU_SHIM=1
and this folder on PYTHONPATH (the benchmark's Megatron-LM runs; dist_checkpointing's writer
spawns processes that re-import __main__, so each needs the patches). Does nothing otherwise."""

import os
import sys

if os.environ.get("MEGATRON_CPU_SHIM") == "1":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools", "megatron"))
    __import__("cpu_shim").install()

"""Megatron checkpoints: ckptbridge in place vs. plain torch loading and merging.

Make a checkpoint with Megatron-LM itself first (22M params, vocab 32000, TP2/PP2, Adam state):

    MODEL=BENCH tools/megatron/make_tied.sh /tmp/megaBig tp2pp2
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_megatron.py /tmp/megaBig/tp2pp2 [--reps 3]

Each measurement runs in a fresh process (peak RSS is per measurement), warm page cache,
median of ``--reps``:

* ``open``: build the lazy view (metadata only) of the legacy and the torch_dist checkpoint;
* ``read_all``: every consolidated tensor and optimizer state as numpy arrays, vs the torch
  baseline (run with the Megatron venv's python, torch 2.13.0 too: ``torch.load`` of every rank file + ``torch.cat`` merge with Megatron's TP rules, as
  tests/fixtures/megatron/tools/inspect_ckpts.py does; ``dcp.load(no_dist=True)`` for torch_dist);
* ``slice``: 16 rows of the output layer: bytes read;
* ``reshard``: write the legacy layout at TP1/PP1 (ckptbridge ``megatron.write``).

Writes bench/out/megatron.json.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOOLS = os.path.join(ROOT, "tests", "fixtures", "megatron", "tools")


def one(mode: str, path: str) -> dict:
    if mode.startswith("ckptbridge_"):
        import ckptbridge as O
        from ckptbridge.adapters import megatron
    else:
        sys.path.insert(0, TOOLS)
        import torch  # noqa: F401  (imported before the clock starts, like ckptbridge)
        from inspect_ckpts import read_legacy, read_torch_dist
    t0 = time.perf_counter()
    out: dict = {}
    if mode.startswith("ckptbridge_"):
        kind = mode.split("_", 2)[2]
        c = O.open(os.path.join(path, kind))
        out["open_s"] = time.perf_counter() - t0
        if mode.startswith("ckptbridge_read"):
            arrays = {(name, s): c[name].state(s).read() for name in c for s in c[name].states}
            out["bytes"] = sum(a.nbytes for a in arrays.values())
            out["bytes_read"] = c.stats.bytes_read
        elif mode.startswith("ckptbridge_slice"):
            c["output_layer.weight"][:16]
            out["bytes_read"] = c.stats.bytes_read
        elif mode.startswith("ckptbridge_reshard"):
            dst = tempfile.mkdtemp(prefix="bench_meg_")
            shutil.rmtree(dst)
            megatron.write(c, dst, tp=1, pp=1)
            out["bytes_written"] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(dst) for f in fs)
            shutil.rmtree(dst)
    elif mode == "torch_read_torch":
        full, full_opt, _ = read_legacy(os.path.join(path, "torch"))
        out["bytes"] = sum(t.numel() * t.element_size() for t in [*full.values(), *full_opt.values()])
    elif mode == "torch_read_torch_dist":
        sd, _, _ = read_torch_dist(os.path.join(path, "torch_dist"))
        out["bytes"] = sum(t.numel() * t.element_size() for t in sd.values())
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    if sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], sys.argv[3])))
        return
    path = sys.argv[1]
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 3
    modes = ["ckptbridge_open_torch", "ckptbridge_open_torch_dist", "ckptbridge_read_torch",
             "torch_read_torch", "ckptbridge_read_torch_dist", "torch_read_torch_dist",
             "ckptbridge_slice_torch", "ckptbridge_reshard_torch", "ckptbridge_reshard_torch_dist"]
    size = {k: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(path, k)) for f in fs)
            for k in ("torch", "torch_dist")}
    results = {"checkpoint": path, "files_bytes": size}
    for mode in modes:
        runs = []
        for _ in range(reps):
            # torch.load of Megatron files needs megatron importable (enums in the args): its venv
            py = sys.executable if mode.startswith("ckptbridge") else os.environ.get(
                "MEGATRON_PYTHON", os.path.join(ROOT, ".megatron", "venv", "bin", "python"))
            p = subprocess.run([py, __file__, "--one", mode, path], capture_output=True, text=True,
                               check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results[mode] = med
        print(f"{mode:32s} " + "  ".join(f"{k}={v:.4g}" for k, v in med.items()), flush=True)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "megatron.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()

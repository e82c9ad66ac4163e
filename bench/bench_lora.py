"""Benchmark: merging a rank-64 LoRA adapter into Llama-3-8B-shaped bf16 weights (issue 30).

::

    .venv/bin/python bench/bench_lora.py [--work /tmp/ckptbridge-bench-lora] [--layers 4] [--reps 1]

The base is a transformers ``LlamaForCausalLM`` at Llama-3-8B's shapes (hidden 4096, MLP 14336,
32 heads, 8 KV heads, vocabulary 128256, untied) but ``--layers`` decoder layers (default 4 of 32:
the machine these run on has 24 GiB shared with other work; 4 layers are 3.9 GB in bf16, the
embedding and the output layer 1.05 GB each, the largest tensors), random, bf16, written by its own
``save_pretrained``. The adapter is PEFT's: ``get_peft_model`` with ``r=64``, ``lora_alpha=128``, on
every attention and MLP projection (``init_lora_weights=False``: random A and B), ``save_pretrained``.
Each method runs in a fresh process on the same files (page cache warm: the base is read once
before each run), writing a new safetensors checkpoint; wall time (process start included) and
the peak RSS of its process tree are measured from outside:

* ``ckptbridge``: ``ckptbridge merge BASE ADAPTER OUT/model.safetensors --to safetensors``;
* ``peft``: ``LlamaForCausalLM.from_pretrained(BASE, dtype=bfloat16)``,
  ``PeftModel.from_pretrained``, ``merge_and_unload()``, ``save_pretrained(OUT)``
  (what PEFT's documentation does to export a merged model).

Goals (issue 30): ckptbridge >= 2x faster than PEFT, its peak memory <= 2x the largest tensor. The
two outputs are compared outside the clock, every element: the share bitwise equal, the largest
distance in bf16 ulps and how many elements differ by more than one. They are not expected to be
bitwise equal everywhere: PEFT's ``merge_and_unload`` on a bf16 model rounds the float32 delta to
bf16 before adding it to the bf16 weight (two roundings), ckptbridge adds in float32 and rounds once.

Prints the result and writes ``bench/results/bench_lora.json``. Numbers are noisy on a shared
machine: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _proc import last_json, measure, save_result

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HIDDEN, MLP, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 128256


def make_inputs(work: Path, layers: int) -> dict[str, Any]:
    """The base (transformers' own save_pretrained) and the adapter (PEFT's own save_pretrained)."""
    import peft
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, num_hidden_layers=layers, vocab_size=VOCAB,
                                      rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(work / "base")
    cfg = peft.LoraConfig(r=64, lora_alpha=128, target_modules=TARGETS, init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    pm.save_pretrained(work / "adapter")
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return {"layers": layers, "largest_tensor_bytes": largest,
            "base_bytes": sum(f.stat().st_size for f in (work / "base").glob("*.safetensors")),
            "adapter_bytes": (work / "adapter" / "adapter_model.safetensors").stat().st_size}


# ------------------------------------------------------------------ workers (one fresh process each)


def work_peft(base: str, adapter: str, out: str) -> dict[str, Any]:
    import peft
    import torch
    import transformers

    t = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    return {"s": time.perf_counter() - t}


def warm(path: Path) -> None:
    """Read every file under ``path`` once (the same page-cache state for every method)."""
    buf = bytearray(64 << 20)
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def run(method: str, work: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    warm(work / "base")
    base, adapter = str(work / "base"), str(work / "adapter")
    if method == "ckptbridge":
        cmd = [sys.executable, "-m", "ckptbridge", "merge", base, adapter, str(out / "model.safetensors"),
               "--to", "safetensors"]
    else:
        cmd = [sys.executable, __file__, "--worker", base, adapter, str(out)]
    t = time.perf_counter()
    r = measure(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    inner = last_json(r["stdout"]).get("s") if method == "peft" else None
    return {"wall_s": r["wall_s"], "peak_mb": r["peak_tree_rss_mb"], "inner_s": inner,
            "clock_s": time.perf_counter() - t}


def compare(ours: Path, theirs: Path) -> dict[str, Any]:
    """Every tensor of the two merged checkpoints: the largest distance in bf16 ulps (bit patterns),
    the share of elements bitwise equal and the number more than one ulp apart."""
    import numpy as np

    import ckptbridge

    a, b = ckptbridge.open(ours), ckptbridge.open(theirs)
    worst, equal, total, far = 0, 0, 0, 0
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        x, y = a[name].read().view(np.int16).astype(np.int32), b[name].read().view(np.int16).astype(np.int32)
        worst = max(worst, int(np.abs(x - y).max()))
        equal += int((x == y).sum())
        far += int((np.abs(x - y) > 1).sum())
        total += x.size
    return {"max_ulp": worst, "bitwise_share": equal / total, "elements_over_1_ulp": far, "elements": total,
            "tensors": len(a)}


def machine() -> dict[str, Any]:
    with open("/proc/meminfo") as fh:
        mem = {line.split(":")[0]: int(line.split()[1]) for line in fh}
    return {"cpus": os.cpu_count(), "mem_total_gib": mem["MemTotal"] / 2**20,
            "mem_available_gib_at_start": mem["MemAvailable"] / 2**20, "load_avg_at_start": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/ckptbridge-bench-lora")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--worker", nargs=3)
    p.add_argument("--make", nargs=2)
    args = p.parse_args()
    if args.worker or args.make:
        print(json.dumps(work_peft(*args.worker) if args.worker else make_inputs(Path(args.make[0]), int(args.make[1]))))
        return
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    facts = machine()  # the inputs are made in a child process: this one stays small while the methods run
    made = last_json(measure([sys.executable, __file__, "--make", str(work), str(args.layers)])["stdout"])
    results: dict[str, Any] = {"machine_at_start": facts, **made, "methods": {}}
    for method in ("ckptbridge", "peft"):
        reps = [run(method, work, work / "out" / method) for _ in range(args.reps)]
        results["methods"][method] = {"wall_s": statistics.median(r["wall_s"] for r in reps),
                                      "peak_mb": max(r["peak_mb"] for r in reps), "runs": reps}
    results["outputs"] = compare(work / "out" / "ckptbridge" / "model.safetensors", work / "out" / "peft")
    m = results["methods"]
    results["speedup"] = m["peft"]["wall_s"] / m["ckptbridge"]["wall_s"]
    results["ckptbridge_peak_over_largest_tensor"] = m["ckptbridge"]["peak_mb"] * 2**20 / results["largest_tensor_bytes"]
    results["goals"] = {"ckptbridge >= 2x faster than peft": results["speedup"] >= 2,
                        "memory <= 2x the largest tensor": results["ckptbridge_peak_over_largest_tensor"] <= 2}
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=1))
    print(f"results: {save_result('bench_lora', results)}")


if __name__ == "__main__":
    main()

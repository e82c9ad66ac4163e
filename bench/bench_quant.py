"""Benchmark: block-fp8 DeepSeek-V3 checkpoints, dequantized by ckptbridge against the references.

::

    .venv/bin/python bench/bench_quant.py [--work /tmp/ckptbridge-bench-quant] [--experts 8] [--reps 1] [--only open]

**Dequantize** (real-size DeepSeek-V3 matrices, real bytes): one layer's attention (``q_a_proj``
1536x7168, ``q_b_proj`` 24576x1536, ``kv_a_proj_with_mqa`` 576x7168, ``kv_b_proj`` 32768x512,
``o_proj`` 7168x16384) and ``--experts`` routed experts (``gate/up_proj`` 2048x7168, ``down_proj``
7168x2048), fp8 e4m3 with float32 ``weight_scale_inv`` of 128x128 blocks, in the release's names
and layout (2 shards + index + ``config.json``; 0.54 GB at 8 experts). Each method runs in a fresh
process on the same files (page cache warm), writing bf16 safetensors; wall time and the peak RSS
of the process are measured from outside:

* ``cb-reshard``: ``ckptbridge.reshard(src, "out/model.safetensors", to="safetensors")``;
* ``cb-convert``: ``ckptbridge.convert(src, "out/universal")``;
* ``deepseek``: DeepSeek-V3's ``inference/fp8_cast_bf16.py`` as it is written: per shard,
  ``load_file`` the shard, dequantize each weight with its scale (its ``weight_dequant`` is a
  Triton kernel; here the same arithmetic in torch on the CPU: float32 product, one rounding to
  bf16), ``save_file`` the shard;
* ``transformers``: the same loop with transformers' own ``Fp8Dequantize._dequantize_one`` (the
  loader's ``dequantize=True`` path); it refuses shapes that are not multiples of the block
  (``kv_a_proj_with_mqa``'s 576 rows): those are counted and left out of its bytes;
* ``floor``: the disk floor of the same job in the same run: read every input byte, write as many
  bytes as the bf16 output with ``O_DIRECT`` (the fastest write here, as ckptbridge's).

Every tool's time includes the ``fsync`` of what it wrote (the same durability for all: the peers
and the floor write through the page cache, ckptbridge with direct I/O).

Throughput is bf16 output bytes per second. The outputs of ``cb-reshard`` and ``deepseek`` are
checked bitwise equal.

**Open at DeepSeek-V3-671B shapes**: 163 sparse shards (no disk used) holding every tensor of the
release (names, shapes, dtypes: 61 layers, the first 3 dense, 256 routed + 1 shared expert, the MTP
layer 61, fp8 weights with their scales), ``ckptbridge.open`` in a fresh process: seconds and peak
RSS (goal <= 1 s and <= 1 GiB), then one expert's 128-row slice read, with the bytes it read
(its blocks: 128 x 7168 fp8 bytes + one row of 56 float32 scales); then, in the same process,
``open`` + the ``deepseek_v3`` recipe onto MaxText's tree (``recipes.rules(..., scan=True|False)``
with the release's ``config.json``): every rule applied, the MTP layer dropped, no byte read
(goal <= 2 s each).

``--only open`` runs the 671B open and recipe part only and keeps the dequantize figures of the
result file's last full run (the JSON says which run each part comes from). The open worker runs
``--reps`` times, each in a fresh process: every figure is the median of the runs (``runs`` keeps each
one, with the load average when it ended). ckptbridge is byte-compiled first, as pip does when it
installs a wheel: an editable install under ``PYTHONDONTWRITEBYTECODE=1`` (this machine's setting)
would otherwise recompile ~80 modules in every fresh worker (0.3 s of CPU counted as open's). Seconds are wall time;
``cpu_s`` the measured region's CPU time in the worker (``time.process_time``), ``child_cpu_s`` the
whole worker's (``import ckptbridge`` included; its ``import_s`` / ``import_cpu_s`` are measured apart
and are not in ``open``'s figures): the shared machine's load makes wall time noisy, CPU time less so.

Prints a table and writes ``bench/results/bench_quant.json``. Numbers are noisy on a shared
machine: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness.child import fsync_tree
from _proc import RESULTS, last_json, measure, save_result

BLOCK = 128
ATTN = {"q_a_proj": (1536, 7168), "q_b_proj": (24576, 1536), "kv_a_proj_with_mqa": (576, 7168),
        "kv_b_proj": (32768, 512), "o_proj": (7168, 16384)}
EXPERT = {"gate_proj": (2048, 7168), "up_proj": (2048, 7168), "down_proj": (7168, 2048)}
HIDDEN, VOCAB, LAYERS, DENSE, EXPERTS, DENSE_FFN = 7168, 129280, 61, 3, 256, 18432


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def qconfig() -> dict[str, Any]:
    return {"model_type": "deepseek_v3", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}}


def v3_config() -> dict[str, Any]:
    """DeepSeek-V3's ``config.json`` (the release's values that the recipe reads, and the quantization)."""
    return {**qconfig(), "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": HIDDEN,
            "intermediate_size": DENSE_FFN, "moe_intermediate_size": 2048, "num_attention_heads": 128,
            "num_key_value_heads": 128, "num_hidden_layers": LAYERS, "first_k_dense_replace": DENSE,
            "moe_layer_freq": 1, "n_routed_experts": EXPERTS, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1, "vocab_size": VOCAB,
            "rms_norm_eps": 1e-06, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "norm_topk_prob": True, "tie_word_embeddings": False, "max_position_embeddings": 163840,
            "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                  "type": "yarn"}}


# ------------------------------------------------------------------ the dequantize checkpoint


def make_dequant(root: Path, experts: int) -> int:
    """Write the real-size matrices (2 shards: attention, experts); return the bf16 output bytes."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    out_bytes = 0

    def add(k: int, name: str, shape: tuple[int, int]) -> None:
        nonlocal out_bytes
        codes = rng.integers(0, 0x7E, size=shape, dtype=np.uint8)  # no NaN codes
        codes |= rng.integers(0, 2, size=shape, dtype=np.uint8) << 7  # signs
        shards[k][name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
        shards[k][name + "_scale_inv"] = torch.from_numpy(rng.uniform(1e-4, 1e-2, size=scale_shape(shape))).float()
        out_bytes += 2 * shape[0] * shape[1]

    for proj, shape in ATTN.items():
        add(0, f"model.layers.3.self_attn.{proj}.weight", shape)
    for e in range(experts):
        for proj, shape in EXPERT.items():
            add(1, f"model.layers.3.mlp.experts.{e}.{proj}.weight", shape)
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, tensors in enumerate(shards, 1):
        name = f"model-{k:05d}-of-00002.safetensors"
        save_file(tensors, str(root / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(qconfig()))
    return out_bytes


# ------------------------------------------------------------------ the 671B sparse checkpoint


def v3_tensors() -> list[tuple[str, str, tuple[int, ...]]]:
    """Every tensor of the DeepSeek-V3 release: (name, safetensors dtype, shape), in layer order."""
    out: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN))]

    def fp8(name: str, shape: tuple[int, int]) -> None:
        out.append((name, "F8_E4M3", shape))
        out.append((name + "_scale_inv", "F32", scale_shape(shape)))

    for layer in range(LAYERS + 1):  # layer 61: the MTP module
        pre = f"model.layers.{layer}."
        if layer == LAYERS:
            out += [(pre + "embed_tokens.weight", "BF16", (VOCAB, HIDDEN)), (pre + "enorm.weight", "BF16", (HIDDEN,)),
                    (pre + "hnorm.weight", "BF16", (HIDDEN,)), (pre + "eh_proj.weight", "BF16", (HIDDEN, 2 * HIDDEN)),
                    (pre + "shared_head.norm.weight", "BF16", (HIDDEN,)),
                    (pre + "shared_head.head.weight", "BF16", (VOCAB, HIDDEN))]
        out += [(pre + "input_layernorm.weight", "BF16", (HIDDEN,)),
                (pre + "post_attention_layernorm.weight", "BF16", (HIDDEN,)),
                (pre + "self_attn.q_a_layernorm.weight", "BF16", (1536,)),
                (pre + "self_attn.kv_a_layernorm.weight", "BF16", (512,))]
        for proj, shape in ATTN.items():
            fp8(pre + f"self_attn.{proj}.weight", shape)
        if layer < DENSE:
            for proj, shape in {"gate_proj": (DENSE_FFN, HIDDEN), "up_proj": (DENSE_FFN, HIDDEN),
                                "down_proj": (HIDDEN, DENSE_FFN)}.items():
                fp8(pre + f"mlp.{proj}.weight", shape)
            continue
        out += [(pre + "mlp.gate.weight", "BF16", (EXPERTS, HIDDEN)),
                (pre + "mlp.gate.e_score_correction_bias", "F32", (EXPERTS,))]
        for e in range(EXPERTS):
            for proj, shape in EXPERT.items():
                fp8(pre + f"mlp.experts.{e}.{proj}.weight", shape)
        for proj, shape in EXPERT.items():
            fp8(pre + f"mlp.shared_experts.{proj}.weight", shape)
    out += [("model.norm.weight", "BF16", (HIDDEN,)), ("lm_head.weight", "BF16", (VOCAB, HIDDEN))]
    return out


def make_sparse(root: Path, shards: int = 163) -> dict[str, Any]:
    """163 safetensors shards of holes (headers real, data never written) + index + config."""
    sizes = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    tensors = v3_tensors()
    nbytes = [sizes[d] * math.prod(s) for _, d, s in tensors]
    per = sum(nbytes) / shards
    root.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    i = 0
    for k in range(1, shards + 1):
        name = f"model-{k:05d}-of-{shards:06d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        at = 0
        while i < len(tensors) and (at < per or k == shards):
            tname, dtype, shape = tensors[i]
            header[tname] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes[i]]}
            weight_map[tname] = name
            at += nbytes[i]
            i += 1
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(root / name, "wb") as fh:
            fh.write(len(text).to_bytes(8, "little") + text)
            fh.truncate(8 + len(text) + at)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(v3_config()))
    return {"tensors": len(tensors), "logical_gb": sum(nbytes) / 1e9, "shards": shards}


# ------------------------------------------------------------------ workers (one fresh process each)


def work_cb(src: str, out: str, how: str) -> dict[str, Any]:
    import ckptbridge

    t = time.perf_counter()
    if how == "reshard":
        ckptbridge.reshard(src, os.path.join(out, "model.safetensors"), to="safetensors")
    else:
        ckptbridge.convert(src, os.path.join(out, "universal"))
    return {"s": time.perf_counter() - t}


def work_reference(src: str, out: str, how: str) -> dict[str, Any]:
    """fp8_cast_bf16.py's loop (per shard: load, dequantize each weight, save), with DeepSeek's
    arithmetic or transformers' dequantizer."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.set_default_dtype(torch.bfloat16)
    if how == "transformers":
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        dq = Fp8Dequantize(None)
    refused, done = [], 0
    t = time.perf_counter()
    weight_map = json.loads(Path(src, "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        state = load_file(os.path.join(src, shard), device="cpu")
        new = {}
        for name, w in state.items():
            if name.endswith("_scale_inv"):
                continue
            s = state.get(name + "_scale_inv")
            if s is None:
                new[name] = w
            elif how == "deepseek":
                m, n = w.shape  # weight_dequant: fp32(x) * s per 128x128 block, stored as bf16
                full = s.repeat_interleave(BLOCK, 0)[:m].repeat_interleave(BLOCK, 1)[:, :n]
                new[name] = (w.to(torch.float32) * full).to(torch.get_default_dtype())
            else:
                try:
                    new[name] = dq._dequantize_one(w, s, output_dtype=torch.bfloat16)
                except ValueError:
                    refused.append(name)
                    continue
            done += 2 * w.numel()
        save_file(new, os.path.join(out, shard))
        del state, new
    return {"s": time.perf_counter() - t, "refused": refused, "out_bytes": done}


def work_floor(src: str, out: str, out_bytes: int) -> dict[str, Any]:
    """Read every input byte, then write ``out_bytes`` with ``O_DIRECT`` from a page-aligned buffer
    (the fastest write on these VMs, as ckptbridge writes; buffered writes where the file system
    refuses it); the worker fsyncs it like every tool's output."""
    import mmap

    t = time.perf_counter()
    chunk = mmap.mmap(-1, 64 << 20)  # anonymous maps are page-aligned, as O_DIRECT needs
    view = memoryview(chunk)
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb", buffering=0) as fh:
                while fh.readinto(view):
                    pass
    path = os.path.join(out, "floor.bin")
    try:
        fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644), True
    except OSError:
        fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), False
    try:
        left = -(-out_bytes // 4096) * 4096 if direct else out_bytes  # O_DIRECT writes whole blocks
        while left:
            left -= os.write(fd, view[: min(left, len(view))])
        os.ftruncate(fd, out_bytes)
    finally:
        os.close(fd)
    view.release()
    chunk.close()
    return {"s": time.perf_counter() - t, "direct": direct}


def work_open(src: str) -> dict[str, Any]:
    t, cpu = time.perf_counter(), time.process_time()
    import ckptbridge

    imported = {"import_s": time.perf_counter() - t, "import_cpu_s": time.process_time() - cpu}

    def hwm_mb() -> float:  # this process's peak RSS (VmHWM; ru_maxrss would count the parent's too)
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024

    base = hwm_mb()
    t, cpu = time.perf_counter(), time.process_time()
    ckpt = ckptbridge.open(src)
    n = len(ckpt)
    s, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak = hwm_mb()
    name = "model.layers.10.mlp.experts.7.up_proj.weight"
    ckpt.stats.reset()
    rows = ckpt[name][128:256]
    out = {"s": s, "cpu_s": cpu, **imported, "listed": n, "hwm_mb": peak, "hwm_before_open_mb": base,
           "slice_shape": list(rows.shape), "slice_bytes": dict(ckpt.stats.per_file), "dtype": ckpt[name].dtype,
           "listed_scales": sum(k.endswith("_scale_inv") for k in ckpt)}
    out["recipe"] = {f"scan={scan}": recipe_to_maxtext(src, scan) for scan in (True, False)}
    return out


def recipe_to_maxtext(src: str, scan: bool) -> dict[str, Any]:
    """open + the deepseek_v3 recipe onto MaxText's tree (scanned or not): every rule applied, no byte read."""
    import warnings

    import ckptbridge
    from ckptbridge import recipes

    t, cpu = time.perf_counter(), time.process_time()
    config = recipes.config_from_hf(os.path.join(src, "config.json"))
    with warnings.catch_warnings(record=True) as dropped:  # the MTP layer: MaxText's decoder has none
        warnings.simplefilter("always")
        tree = ckptbridge.open(src, rules=recipes.rules("deepseek_v3", src="hf", dst="maxtext", scan=scan, **config))
    s, cpu = time.perf_counter() - t, time.process_time() - cpu
    experts = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_1" if scan else \
        "decoder/moe_layers_0/DeepSeekMoeBlock_0/MoeBlock_0/wi_1"
    return {"s": s, "cpu_s": cpu, "leaves": len(tree), "read_bytes": tree.stats.bytes_read,
            "experts_leaf": [experts, list(tree[experts].shape)] if experts in tree else None,
            "dropped": [str(w.message)[:80] for w in dropped]}


# ------------------------------------------------------------------ driver


def run(args: argparse.Namespace, method: str, src: Path, out: Path, extra: str = "") -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--worker", method, "--src", str(src), "--out", str(out), "--arg", extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = measure(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {**last_json(r["stdout"]), "wall_s": r["wall_s"], "peak_mb": r["peak_tree_rss_mb"], "child_cpu_s": cpu}


def run_open(args: argparse.Namespace, src: Path, out: Path) -> dict[str, Any]:
    """The open worker ``--reps`` times (fresh processes, ckptbridge byte-compiled first): the median of
    each figure, and every run's figures and load average in ``runs``."""
    import compileall

    import ckptbridge.adapters

    for folder in {*ckptbridge.__path__, *ckptbridge.adapters.__path__}:
        compileall.compile_dir(folder, quiet=1)
    runs = []
    for _ in range(max(args.reps, 1)):
        runs.append({**run(args, "open", src, out), "load_avg": os.getloadavg()})
    median = {k: statistics.median(r[k] for r in runs) for k in ("s", "cpu_s", "wall_s", "child_cpu_s")}
    recipe = {k: {**v, **{f: statistics.median(r["recipe"][k][f] for r in runs) for f in ("s", "cpu_s")}}
              for k, v in runs[0]["recipe"].items()}
    return {**runs[0], **median, "recipe": recipe, "peak_mb": max(r["peak_mb"] for r in runs),
            "hwm_mb": max(r["hwm_mb"] for r in runs), "reps": len(runs),
            "runs": [{"s": r["s"], "cpu_s": r["cpu_s"], "load_avg_1min": r["load_avg"][0],
                      "recipe": {k: [v["s"], v["cpu_s"]] for k, v in r["recipe"].items()}} for r in runs]}


def same_bytes(a: Path, b: Path) -> bool:
    import numpy as np
    from safetensors.numpy import load_file

    import ckptbridge

    ours = ckptbridge.open(a / "model.safetensors")
    for f in sorted(b.glob("*.safetensors")):
        for name, ref in load_file(str(f)).items():
            if not np.array_equal(ours[name].read().view(np.uint16), ref.view(np.uint16)):
                return False
    return True


def goals(r: dict[str, Any]) -> dict[str, bool]:
    """The issue's goals, judged from one run's results."""
    m, o = r["methods"], r["open_671b"]
    flat = 2 * r["largest_tensor_bf16_bytes"] / 2**20
    blocks = 128 * 7168 + 56 * 4  # one expert's 128 rows of fp8 and their row of 128x128-block scales
    return {"reshard >= 2x deepseek": r["ratios"]["deepseek"] >= 2,
            "reshard >= 2x transformers": r["ratios"]["transformers"] >= 2,
            "convert >= 2x deepseek": r["ratios_convert"]["deepseek"] >= 2,
            "convert >= 2x transformers": r["ratios_convert"]["transformers"] >= 2,
            "memory <= 2x largest tensor": max(m["cb-reshard"]["peak_mb"], m["cb-convert"]["peak_mb"]) <= flat,
            "convert at the disk floor (>= 0.9x)": r["ratios_convert"]["floor"] >= 0.9,
            "bitwise equal to deepseek": bool(r.get("equal_bitwise_cb_vs_deepseek")),
            "open <= 1 s": o["s"] <= 1, "open <= 1 GiB": o["peak_mb"] <= 1024,
            "recipe to MaxText's tree <= 2 s": all(r["s"] <= 2 for r in o["recipe"].values()),
            "slice reads its blocks only": sum(o["slice_bytes"].values()) == blocks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/ckptbridge-bench-quant")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--worker")
    p.add_argument("--src")
    p.add_argument("--out")
    p.add_argument("--arg", default="")
    p.add_argument("--only", choices=["open"], help="run the 671B open + recipe part only")
    args = p.parse_args()
    if args.worker:
        fn = {"cb": lambda: work_cb(args.src, args.out, args.arg),
              "ref": lambda: work_reference(args.src, args.out, args.arg),
              "floor": lambda: work_floor(args.src, args.out, int(args.arg)),
              "open": lambda: work_open(args.src)}[args.worker]
        r = fn()
        if args.worker != "open":  # the same durability for every tool: what it wrote is on disk
            t = time.perf_counter()
            fsync_tree(args.out)
            r["fsync_s"] = time.perf_counter() - t
            r["s"] += r["fsync_s"]
        print(json.dumps(r))
        return
    work = Path(args.work)
    src, out = work / "fp8", work / "out"
    shutil.rmtree(work, ignore_errors=True)
    if args.only == "open":
        results = json.loads(Path(RESULTS, "bench_quant.json").read_text())
        for key in ("commit", "finished", "machine"):  # this run's provenance replaces the file's
            results.pop(key, None)
        results["open_671b"] = {**make_sparse(work / "v3"), **run_open(args, work / "v3", out / "open"),
                                "run": "--only open"}
        finish(results, work)
        return
    out_bytes = make_dequant(src, args.experts)
    in_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    largest = 2 * 7168 * 16384
    results: dict[str, Any] = {"experts": args.experts, "input_bytes": in_bytes, "output_bytes": out_bytes,
                               "largest_tensor_bf16_bytes": largest, "methods": {}}
    plan = [("floor", "floor", str(out_bytes)), ("cb-reshard", "cb", "reshard"), ("cb-convert", "cb", "convert"),
            ("deepseek", "ref", "deepseek"), ("transformers", "ref", "transformers")]
    run(args, "floor", src, out, str(out_bytes))  # warm the page cache
    for label, method, extra in plan:
        reps = [run(args, method, src, out / label, extra) for _ in range(args.reps)]
        if label == "cb-reshard":
            keep = out / label
        elif label == "deepseek":
            results["equal_bitwise_cb_vs_deepseek"] = same_bytes(keep, out / label)
        best = min(reps, key=lambda r: r["s"])
        r = {"s": statistics.median(x["s"] for x in reps), "peak_mb": max(x["peak_mb"] for x in reps),
             "wall_s": best["wall_s"]}
        done = best.get("out_bytes", out_bytes)
        r["gb_per_s"] = done / r["s"] / 1e9
        if best.get("refused"):
            r["refused"] = best["refused"]
        results["methods"][label] = r
        if label != "cb-reshard":
            shutil.rmtree(out / label, ignore_errors=True)
    shutil.rmtree(keep, ignore_errors=True)
    m = results["methods"]
    results["ratios"] = {k: m["cb-reshard"]["gb_per_s"] / m[k]["gb_per_s"] for k in m if k != "cb-reshard"}
    results["ratios_convert"] = {k: m["cb-convert"]["gb_per_s"] / m[k]["gb_per_s"]
                                 for k in ("deepseek", "transformers", "floor")}
    shutil.rmtree(src, ignore_errors=True)
    results["open_671b"] = make_sparse(work / "v3")
    results["open_671b"].update(run_open(args, work / "v3", out / "open"))
    finish(results, work)


def finish(results: dict[str, Any], work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    results["goals"] = goals(results)
    print(json.dumps(results, indent=1))
    path = save_result("bench_quant", results)
    Path(path).with_suffix(".md").write_text(markdown(results))
    print(f"results: {path}")


def markdown(r: dict[str, Any]) -> str:
    """The README table: dequantize throughput ratios, then open and open + recipe at 671B shapes
    (wall and CPU seconds: the machine is shared), then the goals."""
    o = r["open_671b"]
    rows = [f"| dequantize: reshard vs {k} | {v:.2f}x |" for k, v in r["ratios"].items()]
    rows += [f"| dequantize: convert vs {k} | {v:.2f}x |" for k, v in r["ratios_convert"].items()]
    rows += [f"| open 671B ({o['shards']} shards, {o['tensors']} tensors -> {o['listed']}): wall / CPU s"
             f"{' (median of ' + str(o['reps']) + ' fresh processes)' if o.get('reps') else ''} | "
             f"{o['s']:.2f} / {o['cpu_s']:.2f} |",
             *([f"| open 671B: wall s of each run, lowest / highest | "
                f"{min(x['s'] for x in o['runs']):.2f} / {max(x['s'] for x in o['runs']):.2f} |"] if o.get("runs") else []),
             f"| open: peak RSS MiB (process, before open) | {o['hwm_mb']:.0f} ({o['hwm_before_open_mb']:.0f}) |"]
    rows += [f"| open + recipe to MaxText ({k}): wall / CPU s | {v['s']:.2f} / {v['cpu_s']:.2f} |"
             for k, v in o["recipe"].items()]
    if o.get("runs"):
        loads = [x["load_avg_1min"] for x in o["runs"]]
        rows.append(f"| load average during the open runs (1 min; 2 CPUs) | {min(loads):.1f} to {max(loads):.1f} |")
    rows += [f"| open worker, whole process CPU s (imports included) | {o.get('child_cpu_s', float('nan')):.2f} |",
             f"| load average at the end (1 min; 2 CPUs) | {r.get('machine', {}).get('load_avg_at_end', os.getloadavg())[0]:.1f} |"]
    if o.get("run"):
        rows.append(f"| runs | open: `{o['run']}`; dequantize: the file's last full run |")
    rows += [f"| goal: {k} | {'yes' if v else 'no'} |" for k, v in r["goals"].items()]
    return "| figure | value |\n|---|---|\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()

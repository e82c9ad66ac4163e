"""Benchmark: an HF Llama at Llama-3-8B shapes into MaxText's tree, through the hf -> maxtext recipe.

Runs in MaxText's venv (it needs MaxText's model for its shardings and MaxText's converter)::

    make maxtext-venv
    .maxtext/venv/bin/python bench/bench_recipes.py [--work /tmp/ckptbridge-bench-recipes] [--reps 3]

The checkpoint: the real Llama-3-8B dimensions (hidden 4096, 32 query heads, 8 KV heads,
head_dim 128, MLP 14336, vocabulary 128256; untied) with 2 layers, bfloat16, random values,
written by ``safetensors`` with HF names in 4 shards + ``model.safetensors.index.json`` + an HF
``config.json`` (Llama-3 rope scaling: MaxText ``rope_type=llama3.1``, interleaved rotary). 3.1 GB.

Compared in one process, on the same files (warm page cache), each a median of ``--reps``:

* **open**: ``ckptbridge.open(dir, rules=recipes.rules("llama", src="hf", dst="maxtext", rope="llama3.1",
  scan=True, ...))``: the mapped tree (interleave, transposes, heads split, query scale, layers
  stacked on axis 1) without reading. Goal <= 0.1 s.
* **load**: ``ckptbridge.adapters.flax.load`` onto MaxText's own abstract boxed tree on a 2 x 2 mesh
  (fsdp 2 x tensor 2, 4 CPU devices) with MaxText's logical-axis shardings, until every array is
  ready. Goal <= 1.2x **plain**.
* **plain**: what MaxText's converter does, by hand: ``safetensors.numpy.load_file`` of every shard,
  then numpy (transpose, reshape, the rotary permutation per head, the fp32 query scale, layers
  stacked on axis 1) and ``jax.device_put`` onto the same shardings.
* **maxtext**: MaxText's own conversion (``to_maxtext``'s ``PARAM_MAPPING``/``HOOK_FNS``, loading,
  stacking and shape checks, run by ``tools/maxtext/harness.py convert-hf``) on the same files, then
  ``jax.device_put`` onto the same shardings (its script would write an Orbax checkpoint instead);
  its host arrays alone are reported too (some are still views: a transposed ``lm_head`` is copied
  only when placed or saved). Run once (``--no-maxtext`` skips it).

Every leaf of load and plain is checked equal (bitwise) once. Prints the times and ratios and
writes ``bench/results/bench_recipes.json``. The numbers are noisy on a shared machine: compare
the ratios of one run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
E, H, K, D, F, V, L = 4096, 32, 8, 128, 14336, 128256, 2
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": E, "intermediate_size": F,
    "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": K, "head_dim": D, "vocab_size": V,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False, "dtype": "bfloat16",
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def _hf_shapes() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,),
                                       "lm_head.weight": (V, E)}
    for i in range(L):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (H * D, E), p + "self_attn.k_proj.weight": (K * D, E),
                p + "self_attn.v_proj.weight": (K * D, E), p + "self_attn.o_proj.weight": (E, H * D),
                p + "mlp.gate_proj.weight": (F, E), p + "mlp.up_proj.weight": (F, E),
                p + "mlp.down_proj.weight": (E, F), p + "input_layernorm.weight": (E,),
                p + "post_attention_layernorm.weight": (E,)}
    return out


def write_checkpoint(work: Path) -> Path:
    """The HF directory (once): random bf16 values of magnitude ~0.01, shards of whole tensors."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    d = work / "llama3-8b-2layers"
    if (d / "config.json").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shapes = _hf_shapes()
    shards = [["model.embed_tokens.weight"], [n for n in shapes if n.startswith("model.layers.0.")],
              [n for n in shapes if n.startswith("model.layers.1.")], ["model.norm.weight", "lm_head.weight"]]
    weight_map = {}
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n in names:
            bits = rng.integers(0, 1 << 16, size=shapes[n], dtype=np.uint16)
            bits = (bits & np.uint16(0x807F)) | np.uint16(0x3C00)  # random sign and mantissa, |x| in [2^-7, 2^-6)
            tensors[n] = bits.view(ml_dtypes.bfloat16)
            weight_map[n] = fname
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        del tensors
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(HF_CONFIG, indent=1))
    return d


def maxtext_spec() -> Any:
    sys.path.insert(0, str(ROOT / "tools" / "maxtext"))
    import harness

    return harness, harness.Spec.from_json({
        "family": "llama", "emb": E, "layers": L, "heads": H, "kv_heads": K, "head_dim": D, "mlp": F, "vocab": V,
        "scan": True, "rope_type": "llama3.1", "rope_theta": 500000.0, "norm_eps": 1e-5,
        "mesh": {"fsdp": 2, "tensor": 2}, "batch": 4, "seq": 16, "weight_dtype": "bfloat16"})


def recipe(hf_dir: Path) -> tuple:
    from ckptbridge import recipes

    return recipes.rules("llama", src="hf", dst="maxtext", scan=True, **recipes.config_from_hf(hf_dir / "config.json"))


def run_open(hf_dir: Path, rules: tuple) -> tuple[float, Any]:
    import ckptbridge

    t0 = time.perf_counter()
    ckpt = ckptbridge.open(hf_dir, rules=rules)
    return time.perf_counter() - t0, ckpt


def run_load(built: Any, hf_dir: Path, rules: tuple) -> tuple[float, float, dict[str, Any]]:
    """(open seconds, open + load seconds, {name: jax.Array})."""
    import flax.linen as nn
    import jax

    from ckptbridge.adapters import flax as cbflax

    t0 = time.perf_counter()
    opened, ckpt = run_open(hf_dir, rules)
    boxed = cbflax.load(ckpt, built.abstract, mesh=built.mesh, axis_rules=built.config.logical_axis_rules)
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    arrays = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda b: b.value, boxed, is_leaf=is_box))[0]
    jax.block_until_ready([a for _, a in arrays])
    total = time.perf_counter() - t0
    ckpt.close()
    return opened, total, {"/".join(str(getattr(k, "key", k)) for k in p[1:]): a for p, a in arrays}


def run_plain(built: Any, hf_dir: Path) -> tuple[float, float, dict[str, Any]]:
    """(read seconds, read + numpy + device_put seconds, {name: jax.Array}): MaxText's converter's math."""
    import jax
    import numpy as np
    from safetensors.numpy import load_file

    t0 = time.perf_counter()
    w: dict[str, Any] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        w |= load_file(str(f))
    read = time.perf_counter() - t0
    perm = np.array([d // 2 + (d % 2) * (D // 2) for d in range(D)])  # rotate-half -> interleaved pairs
    scale = np.float32(1 / np.sqrt(D))

    def per_layer(i: int) -> dict[str, Any]:
        p = f"model.layers.{i}."
        q = w[p + "self_attn.q_proj.weight"].T.reshape(E, H, D)[..., perm]
        return {
            "self_attention/query/kernel": (q.astype(np.float32) * scale).astype(q.dtype),
            "self_attention/key/kernel": w[p + "self_attn.k_proj.weight"].T.reshape(E, K, D)[..., perm],
            "self_attention/value/kernel": w[p + "self_attn.v_proj.weight"].T.reshape(E, K, D),
            "self_attention/out/kernel": w[p + "self_attn.o_proj.weight"].T.reshape(H, D, E),
            "mlp/wi_0/kernel": w[p + "mlp.gate_proj.weight"].T, "mlp/wi_1/kernel": w[p + "mlp.up_proj.weight"].T,
            "mlp/wo/kernel": w[p + "mlp.down_proj.weight"].T,
            "pre_self_attention_layer_norm/scale": w[p + "input_layernorm.weight"],
            "post_self_attention_layer_norm/scale": w[p + "post_attention_layernorm.weight"],
        }

    layers = [per_layer(i) for i in range(L)]
    host = {f"decoder/layers/{k}": np.stack([lay[k] for lay in layers], axis=1) for k in layers[0]}
    host |= {"token_embedder/embedding": w["model.embed_tokens.weight"],
             "decoder/decoder_norm/scale": w["model.norm.weight"],
             "decoder/logits_dense/kernel": w["lm_head.weight"].T}
    del layers
    w.clear()  # host holds what it still needs
    arrays = {n: jax.device_put(a, built.shardings[n]) for n, a in host.items()}
    jax.block_until_ready(list(arrays.values()))
    return read, time.perf_counter() - t0, arrays


def run_maxtext(harness: Any, built: Any, spec: Any, hf_dir: Path) -> tuple[float, float]:
    """(MaxText's conversion, the same + ``jax.device_put`` of its arrays onto the same shardings):
    its host arrays can be views (a transposed ``lm_head``) whose copy happens when they are placed
    or saved."""
    import jax

    t0 = time.perf_counter()
    out, report = harness.convert_hf(built, spec, hf_dir, save_dtype="bfloat16")
    converted = time.perf_counter() - t0
    if report["errors"] or len(out) != len(built.leaves):
        raise SystemExit(f"MaxText's conversion failed: {report['errors']}")
    arrays = [jax.device_put(a, built.shardings[n]) for n, a in out.items()]
    jax.block_until_ready(arrays)
    return converted, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/ckptbridge-bench-recipes", help="where the HF checkpoint is written")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-maxtext", action="store_true", help="skip MaxText's own conversion (slow, memory hungry)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_recipes.json"))
    args = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=4"])
    import numpy as np

    hf_dir = write_checkpoint(Path(args.work))
    size = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    harness, spec = maxtext_spec()
    built = harness.build(spec)
    rules = recipe(hf_dir)
    _, ckpt = run_open(hf_dir, rules)
    frags = {n: len(ckpt[n].fragments) for n in ckpt}
    ckpt.close()
    times: dict[str, list[float]] = {"open": [], "load": [], "plain_read": [], "plain": [], "maxtext": [],
                                     "maxtext_placed": []}
    for rep in range(args.reps):
        for _ in range(20):
            times["open"].append(run_open(hf_dir, rules)[0])
        _, total, mine = run_load(built, hf_dir, rules)
        times["load"].append(total)
        if rep == 0:  # what each leaf holds and where (compared with plain's below; one copy in memory at a time)
            digest = {n: (hashlib.sha1(np.asarray(a).tobytes()).hexdigest(), a.sharding) for n, a in mine.items()}
        del mine
        gc.collect()
        read, total, ref = run_plain(built, hf_dir)
        times["plain_read"].append(read)
        times["plain"].append(total)
        if rep == 0:  # the same bytes on the same devices
            assert sorted(digest) == sorted(ref), (sorted(digest), sorted(ref))
            for n, a in ref.items():
                assert a.sharding.is_equivalent_to(digest[n][1], a.ndim), n
                assert hashlib.sha1(np.asarray(a).tobytes()).hexdigest() == digest[n][0], n
        del ref
        gc.collect()
    if not args.no_maxtext:
        converted, placed = run_maxtext(harness, built, spec, hf_dir)
        times["maxtext"].append(converted)
        times["maxtext_placed"].append(placed)
        gc.collect()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    result = {
        "checkpoint": {"dir": str(hf_dir), "bytes": size, "tensors": len(frags), "layers": L, "dtype": "bfloat16",
                       "shapes": "Llama-3-8B (E 4096, H 32, K 8, D 128, F 14336, V 128256)"},
        "mesh": {"fsdp": 2, "tensor": 2}, "reps": args.reps, "seconds": med, "all": times,
        "fragments_after_rules": frags,
        "ratios": {"load / plain": med["load"] / med["plain"], "load / plain read only": med["load"] / med["plain_read"]}
        | ({"maxtext placed / load": med["maxtext_placed"] / med["load"],
            "maxtext host only / load": med["maxtext"] / med["load"]} if "maxtext" in med else {}),
        "goals": {"open <= 0.1 s": med["open"] <= 0.1, "load <= 1.2x plain": med["load"] <= 1.2 * med["plain"]},
    }
    from _proc import save_result_at

    save_result_at(args.out, result)
    gb = size / 1e9
    print(f"HF Llama-3-8B shapes, {L} layers, bf16, {gb:.2f} GB -> MaxText scanned tree on fsdp 2 x tensor 2 "
          f"(medians of {args.reps}; open: of {20 * args.reps})")
    print(f"  open through the recipe         {med['open'] * 1e3:8.1f} ms   (goal <= 100 ms; "
          f"{max(frags.values())} fragments at most per tensor)")
    print(f"  ckptbridge load (flax.load)     {med['load']:8.2f} s   {gb / med['load']:.2f} GB/s")
    print(f"  plain read + numpy + device_put {med['plain']:8.2f} s   (the read alone {med['plain_read']:.2f} s)")
    if "maxtext" in med:
        print(f"  MaxText's own conversion        {med['maxtext_placed']:8.2f} s   (placed on the devices; "
              f"its host arrays alone {med['maxtext']:.2f} s)")
    for k, v in result["ratios"].items():
        print(f"  {k:32s}{v:8.2f}x")
    print(f"  goals: {result['goals']}\n  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

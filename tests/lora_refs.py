"""The outside references the LoRA tests compare against: PEFT's ``merge_and_unload``,
Megatron-Bridge's merge formula and megatron-core's own ``GPTModel`` filled with merged weights::

    from lora_refs import adam_step, bits, bridge_merge, core_module, peft_merged, with_moments
    merged = bridge_merge(megatron_weights, carried.state_dict(), alpha, dim)
    got = core_module(tmp_path, hf_dir / "config.json", merged_file, ["good", "bad"], tokens)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
CORE_MODULE = HERE.parent / "tools" / "megatron" / "core_module.py"
MEGATRON_A = HERE / "fixtures" / "megatron" / "A" / "tp2pp2" / "torch"  # its Megatron args: the template
MOMENTS = ("exp_avg", "exp_avg_sq")


def adam_step(model: Any, batch: np.ndarray, root: Path, betas: tuple[float, float] = (0.9, 0.999)) -> None:
    """One torch Adam step on a trainable PEFT model (mean next-token cross-entropy of ``batch``
    ``[b, s+1]``); its ``exp_avg`` / ``exp_avg_sq`` saved under the adapter's tensor names as
    ``root/<moment>.safetensors`` (what :func:`with_moments` opens)."""
    import torch
    from safetensors.torch import save_file

    params = {n.replace(".default.", "."): p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam(params.values(), lr=1e-3, betas=betas)
    x, y = (torch.as_tensor(batch[:, :-1], dtype=torch.long), torch.as_tensor(batch[:, 1:], dtype=torch.long))
    logits = model(input_ids=x, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    opt.step()
    for kind in MOMENTS:
        save_file({n: opt.state[p][kind].contiguous() for n, p in params.items()}, root / f"{kind}.safetensors")


def with_moments(adapter: Path, root: Path) -> Any:
    """PEFT's adapter opened with its Adam moments (:func:`adam_step`'s files) as states of each factor."""
    import ckptbridge
    from ckptbridge.plugin import Checkpoint, CheckpointIndex, LogicalTensor

    weights = ckptbridge.open(adapter)
    moments = {k: ckptbridge.open(root / f"{k}.safetensors") for k in MOMENTS}
    tensors = {n: LogicalTensor(n, {"param": t.state(), **{k: m.tensors[n].state() for k, m in moments.items()}})
               for n, t in weights.tensors.items()}
    return Checkpoint(CheckpointIndex("lora", weights.path, tensors), weights.files)


def bits(a: Any) -> np.ndarray:
    """The bit patterns of a torch tensor or numpy array (bfloat16 / float16 as int16, float32 as int32)."""
    if hasattr(a, "detach"):
        import torch

        a = a.detach().contiguous()
        return a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32).numpy()
    a = np.ascontiguousarray(a)
    return a.view(np.int16 if a.dtype.itemsize == 2 else np.int32)


def peft_merged(model: Callable[[], Any], adapter: Path) -> dict[str, np.ndarray]:
    """PEFT's own ``merge_and_unload`` of ``adapter`` onto ``model()`` (the base): its state dict."""
    import peft

    merged = peft.PeftModel.from_pretrained(model(), adapter).merge_and_unload()
    return {n: t.detach().numpy() for n, t in merged.state_dict().items()}


def bridge_merge(weights: dict, factors: dict, alpha: float, dim: int) -> dict:
    """Megatron-Bridge's merge (``LoRAMerge.merge`` at TP 1: ``base_weight + alpha / dim *
    (linear_out @ linear_in)``, torch fp32) of every adapted weight."""
    import torch

    out = dict(weights)
    for name, b in factors.items():
        if name.endswith(".adapter.linear_out.weight"):
            w = name.replace(".adapter.linear_out.weight", ".weight")
            a = torch.as_tensor(factors[name.replace("linear_out", "linear_in")])
            out[w] = (torch.as_tensor(weights[w]) + alpha / dim * (torch.as_tensor(b) @ a)).numpy()
    return out


def core_module(work: Path, cfg_file: Path, source: Path, labels: list[str], tokens: np.ndarray) -> dict:
    """megatron-core's GPTModel (``tools/megatron/core_module.py``, one process) filled strictly from
    ``source``'s ``<label>.`` tensors, per label: its logits and the tensors it had no place for."""
    import ckptbridge
    from ckptbridge import recipes
    from ckptbridge.rules import Rename

    template = {**ckptbridge.open(MEGATRON_A).extra["megatron"]["args"], "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1}
    (work / "args.json").write_text(json.dumps(recipes.megatron_args(cfg_file, template=template)))
    np.save(work / "tokens.npy", tokens)
    items = []
    for label in labels:
        rules = ckptbridge.rules_to_json([Rename(rf"^{label}\.(?P<rest>.*)$", r"\g<rest>")])
        (work / f"{label}.rules.json").write_text(json.dumps(rules))
        items.append(f"{work / 'args.json'},{work / f'{label}.rules.json'}={work / f'{label}.npy'}")
    out = subprocess.run([sys.executable, str(CORE_MODULE), "--source", str(source), "--tokens",
                          str(work / "tokens.npy"), *items], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    recs = [json.loads(line[len("CORE_MODULE "):]) for line in out.stdout.splitlines()
            if line.startswith("CORE_MODULE ")]
    assert out.returncode == 0 and len(recs) == len(labels), out.stdout[-3000:] + out.stderr[-5000:]
    return {label: {**rec, "logits": np.load(work / f"{label}.npy")} for label, rec in zip(labels, recs)}

"""HF PEFT LoRA adapters: read with the weight each pair adapts, and merged lazily onto a base.

An adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, as PEFT's
``save_pretrained`` writes it) opens as its stored ``lora_A`` / ``lora_B`` tensors; the checkpoint's
``extra["lora"]`` names, per tensor, the base weight it adapts, its rank and scaling
(``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` and
``alpha_pattern`` matched as PEFT matches them), and ``inspect`` prints it beside each tensor::

    ckpt = ckptbridge.open("my_adapter/")
    ckpt.extra["lora"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    # {'base': 'model.layers.0.self_attn.q_proj.weight', 'part': 'A', 'rank': 8, 'scaling': 2.0}

Opened with ``adapters=[...]`` (HF safetensors bases), each adapted weight is the derived tensor
(``ckptbridge.plugin.derived_state``) ``W + sum_i weight_i * s_i * (B_i @ A_i)``, computed per slice in
float32 and rounded once to the base dtype; a row slice reads only those rows of ``W`` and of each
``B`` (and the columns of ``A`` it covers). A quantized base is dequantized first (its derived
tensor is the ``W`` source). ``modules_to_save`` tensors replace the base weight::

    merged = ckptbridge.open("llama/", adapters=["my_adapter/"], adapter_weights=[0.5])
    ckptbridge.reshard(merged, "merged.safetensors", to="safetensors")

DoRA, LoRA biases and ``fan_in_fan_out`` adapters fail when opened, naming the option.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    FormatError,
    LogicalTensor,
    ShapeMismatchError,
    derived_state,
    storage,
)

__all__ = ["CONFIG", "WEIGHTS", "Adapter", "LoraMerge", "LoraPair", "adapter_notes", "is_adapter", "merge", "read"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_REFUSED = (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out"), ("lora_bias", "LoRA biases"))


@dataclass(frozen=True)
class LoraPair:
    """One adapted weight: ``base`` gets ``scaling * (B @ A)`` (``a``/``b``: the adapter's tensor names)."""

    base: str
    a: str
    b: str
    rank: int
    scaling: float


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter: its file, stored tensors, pairs and ``modules_to_save`` replacements
    (base weight name -> the adapter's tensor name)."""

    file: str
    tensors: Mapping[str, LogicalTensor]
    pairs: tuple[LoraPair, ...]
    replaces: Mapping[str, str]


@dataclass(frozen=True)
class LoraMerge:
    """``W + sum_i scales[i] * (B_i @ A_i)`` in float32; sources ``(W, B_1, A_1, B_2, A_2 ...)``."""

    scales: tuple[float, ...]
    ranks: tuple[int, ...]

    def describe(self) -> str:
        return f"lora merge x{len(self.scales)}"

    def source_boxes(self, box: Box) -> tuple[Box, ...]:
        (r0, c0), (nr, nc) = box.offset, box.shape
        out = [box]
        for rank in self.ranks:
            out += [Box((r0, 0), (nr, rank)), Box((0, c0), (rank, nc))]
        return tuple(out)

    def compute(self, box: Box, sources: Sequence[np.ndarray], out: np.ndarray) -> None:
        acc = sources[0].astype(np.float32)
        for scale, b, a in zip(self.scales, sources[1::2], sources[2::2]):
            # as PEFT's get_delta_weight: (B @ A) * scaling in float32, then added to the weight
            delta = b.astype(np.float32, copy=False) @ a.astype(np.float32, copy=False)
            delta *= np.float32(scale)
            acc += delta
        np.copyto(out, acc, casting="unsafe")


def is_adapter(path: str) -> bool:
    """Whether ``path`` is a PEFT adapter folder (or its ``adapter_model.safetensors``)."""
    root = path if storage.isdir(path) else storage.dirname(path)
    return storage.isfile(storage.join(root, CONFIG)) and storage.isfile(storage.join(root, WEIGHTS))


def weights_file(path: str) -> str:
    """The ``adapter_model.safetensors`` of the adapter folder (or file) ``path``."""
    return storage.join(path, WEIGHTS) if storage.isdir(path) else path


def _config(file: str) -> dict[str, Any]:
    cfg = storage.join(storage.dirname(file), CONFIG)
    try:
        config = json.loads(storage.read_text(cfg))
    except (OSError, ValueError) as err:
        raise FormatError(f"{cfg}: not a readable adapter config ({err})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise FormatError(f"{cfg}: peft_type {config.get('peft_type') if isinstance(config, dict) else config!r} "
                          "is not supported (only LORA)")
    for key, what in _REFUSED:
        if config.get(key):
            raise FormatError(f"{cfg}: {what} ({key}) adapters are not supported")
    if config.get("bias", "none") != "none":
        raise FormatError(f"{cfg}: bias {config['bias']!r} is not supported (only 'none')")
    return config


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """The value of the first pattern matching ``module`` (PEFT's ``get_pattern_key``), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read(path: str, tensors: Mapping[str, LogicalTensor]) -> Adapter:
    """The adapter at ``path`` (folder or file) whose stored tensors are ``tensors``."""
    file = weights_file(path)
    config = _config(file)
    saved = [str(m) for m in config.get("modules_to_save") or ()]
    pairs, replaces = [], {}
    for name in tensors:
        module = name.removeprefix(_PREFIX)
        if module.endswith(".lora_B.weight"):
            continue
        if not module.endswith(".lora_A.weight"):
            if any(module.removesuffix(".weight").removesuffix(".bias").endswith(m) for m in saved):
                replaces[module] = name
                continue
            raise FormatError(f"{file}: tensor {name!r} is neither a lora_A/lora_B weight nor in modules_to_save")
        module = module.removesuffix(".lora_A.weight")
        b = name.removesuffix(".lora_A.weight") + ".lora_B.weight"
        if b not in tensors:
            raise FormatError(f"{file}: tensor {name!r} has no partner {b!r}")
        rank, rank_b = tensors[name].shape[0], tensors[b].shape[-1]
        want = int(_pattern(config.get("rank_pattern") or {}, module, config.get("r", 8)))
        if rank != rank_b or rank != want or len(tensors[name].shape) != 2 or len(tensors[b].shape) != 2:
            raise ShapeMismatchError(f"{file}: {name!r} {tensors[name].shape} and {b!r} {tensors[b].shape} "
                                     f"do not have the configured rank {want}")
        alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        pairs.append(LoraPair(module + ".weight", name, b, rank, scaling))
    orphans = sorted(n for n in tensors if n.endswith(".lora_B.weight")
                     and n.removesuffix(".lora_B.weight") + ".lora_A.weight" not in tensors)
    if orphans:
        raise FormatError(f"{file}: tensor {orphans[0]!r} has no lora_A partner")
    return Adapter(file, tensors, tuple(pairs), replaces)


def adapter_notes(adapter: Adapter) -> dict[str, dict[str, Any]]:
    """Per stored tensor: the base weight it adapts (``extra["lora"]`` of an opened adapter)."""
    out: dict[str, dict[str, Any]] = {}
    for p in adapter.pairs:
        for part, name in (("A", p.a), ("B", p.b)):
            out[name] = {"base": p.base, "part": part, "rank": p.rank, "scaling": p.scaling}
    for base, name in adapter.replaces.items():
        out[name] = {"base": base, "part": "modules_to_save"}
    return out


def merge(tensors: Mapping[str, LogicalTensor], adapters: Sequence[Adapter], weights: Sequence[float],
          path: str) -> tuple[dict[str, LogicalTensor], dict[str, dict[str, Any]]]:
    """``tensors`` (the base at ``path``) with every adapted weight merged (a derived tensor of the
    base dtype) and ``modules_to_save`` replaced; and per merged tensor what was applied."""
    out = dict(tensors)
    parts: dict[str, list[tuple[LoraPair, Adapter, float]]] = {}
    notes: dict[str, dict[str, Any]] = {}
    for adapter, weight in zip(adapters, weights):
        for base, name in adapter.replaces.items():
            _base_of(tensors, base, adapter, name, path, adapter.tensors[name].shape)
            out[base] = LogicalTensor(base, {"param": adapter.tensors[name].state()})
            notes[base] = {"replaced_by": f"{adapter.file}: {name}"}
        for p in adapter.pairs:
            parts.setdefault(p.base, []).append((p, adapter, weight))
    for base, applied in parts.items():
        w = _base_of(tensors, base, applied[0][1], applied[0][0].a, path, None)
        sources, names = [w.state()], [f"{path}: {base}"]
        for p, adapter, _ in applied:
            (rows, cols), b_rows, a_cols = w.shape, adapter.tensors[p.b].shape[0], adapter.tensors[p.a].shape[1]
            if (b_rows, a_cols) != (rows, cols):
                raise ShapeMismatchError(f"{adapter.file}: {p.b!r} x {p.a!r} is {b_rows} x {a_cols}, "
                                         f"but {path}: {base!r} is {rows} x {cols}")
            sources += [adapter.tensors[p.b].state(), adapter.tensors[p.a].state()]
            names += [f"{adapter.file}: {p.b}", f"{adapter.file}: {p.a}"]
        derivation = LoraMerge(tuple(p.scaling * wt for p, _, wt in applied), tuple(p.rank for p, _, _ in applied))
        out[base] = LogicalTensor(base, {"param": derived_state(derivation, sources, w.shape, w.state().dtype, names)})
        notes[base] = {"merged": [{"adapter": a.file, "A": p.a, "B": p.b, "rank": p.rank, "scaling": p.scaling,
                                   "weight": wt} for p, a, wt in applied]}
    return out, notes


def _base_of(tensors: Mapping[str, LogicalTensor], base: str, adapter: Adapter, name: str, path: str,
             shape: tuple[int, ...] | None) -> LogicalTensor:
    """The base weight ``base`` that ``adapter``'s tensor ``name`` adapts (2-D, or of ``shape``)."""
    w = tensors.get(base)
    if w is None:
        raise FormatError(f"{adapter.file}: {name!r} adapts {base!r}, which {path} does not have")
    if (shape is None and len(w.shape) != 2) or (shape is not None and tuple(w.shape) != tuple(shape)):
        raise ShapeMismatchError(f"{adapter.file}: {name!r} does not fit {path}: {base!r} of shape {w.shape}")
    return w

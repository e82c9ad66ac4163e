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

PEFT's ``target_parameters`` adapt a parameter itself, e.g. a MoE layer's experts stored as one
3-D ``[experts, out, in]`` tensor (transformers' ``mlp.experts.gate_up_proj`` / ``down_proj``), through
its ``lora.ParamWrapper``: ``A`` is ``[r * E, in]`` and ``B`` is ``[out, r * E]``, and expert ``e``'s
delta is ``B[:, e::E] @ A[e*r:(e+1)*r]`` (``get_delta_weight``: ``A`` reshaped ``(E, r, in)``, ``B``
reshaped ``(out, r, E)``). Several parameters of one module nest their wrappers (the last
parameter outermost: ``experts.lora_A.weight`` adapts ``down_proj``, ``experts.base_layer.lora_A.weight``
``gate_up_proj``). The merged 3-D weight is computed per expert slice (an expert reads only its rows
of ``A`` and its columns of ``B``); a base stored per expert (``experts.<e>.gate_proj.weight``,
``up_proj``, ``down_proj``, as transformers saves Qwen3-MoE) is merged as transformers fuses it
(gate and up rows concatenated, experts stacked) and keeps its own names::

    ckpt = ckptbridge.open("qwen3_moe/", adapters=["experts_adapter/"])
    ckpt.extra["lora"]["model.layers.0.mlp.experts.3.up_proj.weight"]["of"]
    # 'model.layers.0.mlp.experts.gate_up_proj[3, 64:128]'

DoRA, LoRA biases and ``fan_in_fan_out`` adapters fail when opened, naming the option.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    FormatError,
    LogicalTensor,
    ShapeMismatchError,
    TensorState,
    concat,
    crop,
    derived_state,
    regex,
    reshape,
    storage,
    transpose,
)

from .._hf import PEFT_CONFIG as CONFIG
from .._hf import PEFT_WEIGHTS as WEIGHTS
from .._hf import hf_config, peft_weights_file
from .._hf import is_peft_adapter as is_adapter

__all__ = ["CONFIG", "PARAM_ORDER", "WEIGHTS", "Adapter", "LoraMerge", "LoraPair", "adapted", "adapter_notes", "is_adapter",
           "merge", "read"]

_PREFIX = "base_model.model."
_REFUSED = (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out"), ("lora_bias", "LoRA biases"))
# the order transformers' fused experts register their parameters (PEFT nests the wrappers in it)
PARAM_ORDER = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
# models whose 3-D experts transformers stores [E, in, out] (``@use_experts_implementation(is_transposed=True)``
# in transformers 5.23); PEFT's ParamWrapper follows the same flag. Others store [E, out, in].
TRANSPOSED_EXPERTS = frozenset({"gpt_oss", "aria", "openai_privacy_filter"})
# a fused parameter's parts as transformers saves them per expert (rows concatenated)
_PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LoraPair:
    """One adapted weight: ``base`` gets ``scaling * (B @ A)`` (``a``/``b``: the adapter's tensor names);
    ``experts`` > 1: a 3-D ``base`` whose expert ``e`` gets ``B[:, e::experts] @ A[e*rank:(e+1)*rank]``."""

    base: str
    a: str
    b: str
    rank: int
    scaling: float
    experts: int = 1


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
    """``W + sum_i scales[i] * (B_i @ A_i)`` in float32; sources ``(W, B_1, A_1, B_2, A_2 ...)``.

    2-D: ``W [out, in]``, ``B [out, r]``, ``A [r, in]``. 3-D (experts): ``W [E, out, in]``,
    ``B [out, r, E]`` and ``A [E, r, in]`` (PEFT's ``[out, r*E]`` and ``[r*E, in]`` reshaped)."""

    scales: tuple[float, ...]
    ranks: tuple[int, ...]

    def describe(self) -> str:
        return f"lora merge x{len(self.scales)}"

    def source_boxes(self, box: Box) -> tuple[Box, ...]:
        *e, r0, c0 = box.offset
        *ne, nr, nc = box.shape
        out = [box]
        for rank in self.ranks:
            out += [Box((r0, 0, *e), (nr, rank, *ne)), Box((*e, 0, c0), (*ne, rank, nc))]
        return tuple(out)

    def compute(self, box: Box, sources: Sequence[np.ndarray], out: np.ndarray) -> None:
        acc = sources[0].astype(np.float32)
        for scale, b, a in zip(self.scales, sources[1::2], sources[2::2]):
            # as PEFT's get_delta_weight: (B @ A) * scaling in float32 (per expert), then added to the weight
            b = b.transpose(2, 0, 1) if b.ndim == 3 else b
            delta = b.astype(np.float32, copy=False) @ a.astype(np.float32, copy=False)
            delta *= np.float32(scale)
            acc += delta
        np.copyto(out, acc, casting="unsafe")


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


def _pattern(patterns: Mapping[str, Any], key: str, default: Any) -> Any:
    """The value of the first pattern matching ``key`` (PEFT's ``get_pattern_key``), else ``default``."""
    for pattern, value in patterns.items():
        if regex(rf"(.*\.)?({pattern})$").match(key):
            return value
    return default


def adapted(module: str, targets: Sequence[str], file: str, name: str) -> tuple[str, bool]:
    """The weight a pair on ``module`` adapts and whether it is a ``target_parameters`` parameter:
    ``module.weight``, or (PEFT's ``lora.ParamWrapper``, nested once per targeted parameter of the
    module, the last registered outermost) the parameter its ``.base_layer`` depth names."""
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module.removesuffix(".base_layer"), depth + 1
    params = []
    for target in targets:  # PEFT's _inject_parameters: the key equals the target or ends with "." + it
        short = target.rpartition(".")[2]
        key = f"{module}.{short}"
        if (key == target or key.endswith("." + target)) and short not in params:
            params.append(short)
    if not params and not depth:
        return module + ".weight", False
    if len(params) > 1 and not set(params) <= set(PARAM_ORDER):
        raise FormatError(f"{file}: {name!r}: cannot tell which of the parameters {params} of {module!r} it adapts "
                          f"(known nesting order: {', '.join(PARAM_ORDER)})")
    params.sort(key=lambda p: PARAM_ORDER.index(p) if p in PARAM_ORDER else 0)
    if depth >= len(params):
        raise FormatError(f"{file}: {name!r} is nested {depth} deep, but target_parameters name "
                          f"{len(params)} parameters of {module!r}")
    return f"{module}.{params[len(params) - 1 - depth]}", True


def read(path: str, tensors: Mapping[str, LogicalTensor]) -> Adapter:
    """The adapter at ``path`` (folder or file) whose stored tensors are ``tensors``."""
    file = peft_weights_file(path)
    config = _config(file)
    saved = [str(m) for m in config.get("modules_to_save") or ()]
    targets = [str(t) for t in config.get("target_parameters") or ()]
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
        base, param = adapted(module.removesuffix(".lora_A.weight"), targets, file, name)
        key = base if param else base.removesuffix(".weight")  # what PEFT matches the patterns against
        b = name.removesuffix(".lora_A.weight") + ".lora_B.weight"
        if b not in tensors:
            raise FormatError(f"{file}: tensor {name!r} has no partner {b!r}")
        rank = int(_pattern(config.get("rank_pattern") or {}, key, config.get("r", 8)))
        rows, experts = tensors[name].shape[0], tensors[name].shape[0] // rank if param else 1
        if (rows != rank * experts or tensors[b].shape[-1] != rows or len(tensors[name].shape) != 2
                or len(tensors[b].shape) != 2):
            raise ShapeMismatchError(f"{file}: {name!r} {tensors[name].shape} and {b!r} {tensors[b].shape} "
                                     f"do not have the configured rank {rank}")
        alpha = float(_pattern(config.get("alpha_pattern") or {}, key, config.get("lora_alpha", 8)))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        pairs.append(LoraPair(base, name, b, rank, scaling, experts))
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
            out[name] = {"base": p.base, "part": part, "rank": p.rank, "scaling": p.scaling,
                         **({"experts": p.experts} if p.experts > 1 else {})}
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
        first, adapter = applied[0][0], applied[0][1]
        views: dict[str, tuple[int, int, int]] = {}
        if first.experts == 1:
            w = _base_of(tensors, base, adapter, first.a, path, None).state()
        else:  # views: the base's own per-expert tensors, where it stores the experts so
            w, views = _experts_of(tensors, base, first, adapter, path)
        flip = len(w.shape) == 3 and _transposed(w.shape, adapter.tensors[first.b].shape[0],
                                                 adapter.tensors[first.a].shape[1],
                                                 None if views else functools.partial(_model_type, path),
                                                 f"{path}: {base}")
        w = transpose(w, (0, 2, 1)) if flip else w
        sources, names = [w], [f"{path}: {base}"]
        for p, adapter, _ in applied:
            sources += _factors(p, adapter, w.shape, path, base)
            names += [f"{adapter.file}: {p.b}", f"{adapter.file}: {p.a}"]
        derivation = LoraMerge(tuple(p.scaling * wt for p, _, wt in applied), tuple(p.rank for p, _, _ in applied))
        merged = derived_state(derivation, sources, w.shape, w.dtype, names)
        merged = transpose(merged, (0, 2, 1)) if flip else merged
        note = {"merged": [{"adapter": a.file, "A": p.a, "B": p.b, "rank": p.rank, "scaling": p.scaling,
                            "weight": wt, **({"experts": p.experts} if p.experts > 1 else {})}
                           for p, a, wt in applied]}
        if not views:
            out[base] = LogicalTensor(base, {"param": merged})
            notes[base] = note
        for name, (e, r0, rows) in views.items():  # each a view of the merged 3-D weight
            state = reshape(crop(merged, Box((e, r0, 0), (1, rows, merged.shape[2]))), (rows, merged.shape[2]))
            out[name] = LogicalTensor(name, {"param": state})
            notes[name] = {**note, "of": f"{base}[{e}, {r0}:{r0 + rows}]"}
    return out, notes


def _transposed(shape: Sequence[int], out: int, inp: int, model_type: Callable[[], str | None] | None,
                where: str) -> bool:
    """Whether a 3-D ``[E, d1, d2]`` weight adapted by ``B [out, .]`` and ``A [., in]`` stores
    ``[E, in, out]`` (PEFT's ``is_transposed`` experts). The shape says so unless the weight is
    square (gpt-oss: hidden = intermediate = 2880); then the base's ``model_type`` does
    (``model_type`` None: the base's own per-expert tensors, ``[E, out, in]`` by construction), and
    without one it is refused rather than guessed."""
    if out != inp:
        return tuple(shape[1:]) == (inp, out)
    if model_type is None:
        return False
    kind = model_type()
    if kind is None:
        raise FormatError(f"{where}: square experts {tuple(shape)}: whether they are stored [E, out, in] or "
                          "[E, in, out] is not in the files (no config.json with a model_type beside the base)")
    return kind in TRANSPOSED_EXPERTS


def _model_type(path: str) -> str | None:
    """The ``model_type`` of the HF ``config.json`` beside the checkpoint at ``path``, if any."""
    found = hf_config(path)
    kind = found[1].get("model_type") if found else None
    return kind if isinstance(kind, str) else None


def _factors(p: LoraPair, adapter: Adapter, shape: Sequence[int], path: str, base: str) -> list[TensorState]:
    """``B`` and ``A`` of ``p`` as :class:`LoraMerge` reads them for a weight of ``shape`` (``[out, in]``
    or ``[E, out, in]``), checked against it."""
    b, a = adapter.tensors[p.b].state(), adapter.tensors[p.a].state()
    fits = (b.shape[0], a.shape[1]) == tuple(shape[-2:]) and (len(shape) == 2) == (p.experts == 1) and (
        len(shape) == 2 or shape[0] == p.experts)
    if not fits:
        raise ShapeMismatchError(f"{adapter.file}: {p.b!r} x {p.a!r} is {b.shape[0]} x {a.shape[1]}"
                                 f"{f' for {p.experts} experts' if p.experts > 1 else ''}, but {path}: {base!r} "
                                 f"is {' x '.join(map(str, shape))}")
    if p.experts == 1:
        return [b, a]
    return [reshape(b, (b.shape[0], p.rank, p.experts)), reshape(a, (p.experts, p.rank, a.shape[1]))]


def _experts_of(tensors: Mapping[str, LogicalTensor], base: str, p: LoraPair, adapter: Adapter,
                path: str) -> tuple[TensorState, dict[str, tuple[int, int, int]]]:
    """The 3-D weight ``base`` (``[E, d1, d2]``): stored as one tensor, or (transformers' per-expert
    checkpoints) ``<module>.<e>.<part>.weight`` stacked, the parts of a fused parameter (gate, up)
    concatenated; with, per stored per-expert tensor, ``(expert, first row, rows)`` in it."""
    if base in tensors:
        w = tensors[base]
        if len(w.shape) != 3:
            raise ShapeMismatchError(f"{adapter.file}: {p.a!r} adapts {p.experts} experts, but {path}: {base!r} "
                                     f"has shape {w.shape}")
        return w.state(), {}
    module, _, param = base.rpartition(".")
    names = [[f"{module}.{e}.{part}.weight" for part in _PER_EXPERT.get(param, (param,))]
             for e in range(p.experts)]
    missing = [n for row in names for n in row if n not in tensors]
    if missing:
        raise FormatError(f"{adapter.file}: {p.a!r} adapts {base!r}, which {path} does not have "
                          f"(nor per expert: no {missing[0]!r})")
    stacked, views = [], {}
    for e, row in enumerate(names):
        states = [tensors[n].state() for n in row]
        if any(len(s.shape) != 2 for s in states):
            raise ShapeMismatchError(f"{path}: {row[0]!r} is not 2-D: not an expert's weight")
        fused = concat(states, 0)
        stacked.append(reshape(fused, (1, *fused.shape)))
        r0 = 0
        for n, s in zip(row, states):
            views[n] = (e, r0, s.shape[0])
            r0 += s.shape[0]
    return concat(stacked, 0), views


def _base_of(tensors: Mapping[str, LogicalTensor], base: str, adapter: Adapter, name: str, path: str,
             shape: tuple[int, ...] | None) -> LogicalTensor:
    """The base weight ``base`` that ``adapter``'s tensor ``name`` adapts (2-D, or of ``shape``)."""
    w = tensors.get(base)
    if w is None:
        raise FormatError(f"{adapter.file}: {name!r} adapts {base!r}, which {path} does not have")
    if (shape is None and len(w.shape) != 2) or (shape is not None and tuple(w.shape) != tuple(shape)):
        raise ShapeMismatchError(f"{adapter.file}: {name!r} does not fit {path}: {base!r} of shape {w.shape}")
    return w

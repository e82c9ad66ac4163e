"""LoRA adapters carried alone between frameworks, through the base model's recipe rules.

An adapted weight ``W`` (HF ``[out, in]``) is ``s * B @ A``; the recipe that maps ``W`` to another
framework (a MaxText kernel ``[in, ..., out ...]``) permutes, reshapes and scales its axes. Each
axis of ``W`` belongs to one factor: output axes to ``B``, input axes to ``A``, and an axis the
recipe stacks (MaxText's scanned layers) to both. :func:`plan` follows the rules on ``W`` and
writes each one for the factor that holds its axis: a query kernel scaled by ``c`` scales ``B``
by ``c`` (and its Adam moments as ``Scale`` says), the rotary interleave permutes ``B``'s rows,
the heads split ``B``'s columns, the transpose turns ``A [r, in]`` into ``A [in, r]``::

    config = ckptbridge.recipes.config_from_hf("llama/config.json")
    base = ckptbridge.recipes.rules("llama", src="hf", dst="maxtext", scan=False, **config)
    mt = carry(ckptbridge.open("peft_adapter/"), base)   # PEFT's save_pretrained folder
    sorted(mt)[:2]  # ['decoder/layers_0/mlp/wi_0/lora_a.kernel', 'decoder/layers_0/mlp/wi_0/lora_b.kernel']

The MaxText names and shapes are MaxText 0.2.5's adapter tree (``utils/lora_utils.py``
``get_lora_abstract_state_nnx``: ``<module>/lora_a.kernel [in..., r]``, ``<module>/lora_b.kernel
[r, out...]``; its merge ``W + einsum("er,rnd->end", a, b) * lora_alpha / r``); HF names are
PEFT's (``base_model.model.<module>.lora_A.weight [r, in]``, ``lora_B.weight [out, r]``). A
pair whose PEFT scaling is not the destination's single ``lora_alpha / r`` (rsLoRA, a rank or
alpha pattern) has the ratio folded into ``B``. Megatron-Bridge's ``adapter.linear_in`` /
``linear_out`` pairs carry too: a fused QKV or gate/up ``Split`` splits ``B`` like the weight's rows
and gives every part the same ``A`` (:class:`Copy`); a ``Join`` (parts fused into one weight) is
refused, since the parts' ``A`` differ. Nothing is read: the result is lazy, like any
view through rules.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from ckptbridge.plugin import (
    LAYOUT_RULES,
    Cast,
    Checkpoint,
    CheckpointIndex,
    Crop,
    Deinterleave,
    Expect,
    FormatError,
    Interleave,
    Join,
    LogicalTensor,
    MergeDims,
    Pad,
    Rename,
    Rule,
    Scale,
    Split,
    SplitDim,
    Stack,
    Transpose,
    apply_rules,
    regex,
)

from . import _read

__all__ = ["Copy", "Plan", "carry", "factor_name", "factor_of", "plan", "save_peft"]

_PER_AXIS = (SplitDim, MergeDims, Interleave, Deinterleave, Pad, Crop)
_PEFT = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_MAXTEXT = re.compile(r"^(?P<module>.+)/lora_(?P<part>[ab])\.kernel$")
_MEGATRON = re.compile(r"^(?P<module>.+)\.adapter\.linear_(?P<part>in|out)\.weight$")  # Megatron-Bridge's LoRA
_MEGATRON_BASE = re.compile(r"^(decoder|embedding|output_layer)\.")


def factor_of(name: str) -> tuple[str, str, str] | None:
    """``(base weight name, "A"|"B", style)`` of an adapter tensor name, or ``None``::

        factor_of("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
        # ('model.layers.0.self_attn.q_proj.weight', 'B', 'hf')
        factor_of("decoder/layers_0/self_attention/query/lora_a.kernel")
        # ('decoder/layers_0/self_attention/query/kernel', 'A', 'maxtext')
        factor_of("decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight")
        # ('decoder.layers.0.self_attention.linear_qkv.weight', 'B', 'megatron')

    Megatron-Bridge's ``LoRA`` (``peft/lora.py``) wraps a linear layer with an adapter whose
    ``linear_in`` is ``A [r, in]`` and ``linear_out`` is ``B [out, r]``, scaled by ``alpha / dim``.
    """
    if m := _PEFT.match(name):
        return m["module"] + ".weight", m["part"], "hf"
    if m := _MAXTEXT.match(name):
        return m["module"] + "/kernel", m["part"].upper(), "maxtext"
    if m := _MEGATRON.match(name):
        return m["module"] + ".weight", "A" if m["part"] == "in" else "B", "megatron"
    return None


def factor_name(base: str, part: str) -> str:
    """The adapter tensor name of factor ``part`` of base weight ``base`` (its style from the name)."""
    if base.endswith("/kernel"):
        return f"{base.removesuffix('/kernel')}/lora_{part.lower()}.kernel"
    if base.endswith(".weight") and _MEGATRON_BASE.match(base):
        return f"{base.removesuffix('.weight')}.adapter.linear_{'in' if part == 'A' else 'out'}.weight"
    if base.endswith(".weight"):
        return f"base_model.model.{base.removesuffix('.weight')}.lora_{part}.weight"
    raise FormatError(f"{base!r}: no LoRA naming for a weight that ends neither in '.weight' nor '/kernel'")


@dataclass(frozen=True)
class _Layout:
    """The axes of ``W``: ``(id, side)`` in order, side ``"i"`` (input, in ``A``), ``"o"`` (output,
    in ``B``) or ``"b"`` (stacked: in both)."""

    axes: tuple[tuple[int, str], ...]

    def factor(self, part: str) -> list[int]:
        """The factor's axes (ids; ``-1`` is the rank): its own and stacked axes in ``W``'s order,
        the rank where the two factors meet (``A [r, in]`` for ``W [out, in]``, ``A [in, r]`` for
        ``W [in, out]``)."""
        own = "i" if part == "A" else "o"
        ids = [i for i, s in self.axes if s in (own, "b")]
        sides = [s for _, s in self.axes]
        in_first = sides.index("i") < sides.index("o")
        rank_last = in_first == (part == "A")
        return [*ids, -1] if rank_last else [-1, *ids]

    def side(self, dim: int) -> str:
        return self.axes[dim][1]


@dataclass(frozen=True)
class Copy(Rule):
    """The other factor of a :class:`Split` weight: the same tensor under each part's name (a
    fused QKV's ``A`` is every part's ``A``)."""

    to: str = ""
    parts: tuple[str, ...] = ()

    def names(self, name: str) -> list[str]:
        return Split(self.pattern, self.to, parts=self.parts).part_names(name)


@dataclass(frozen=True)
class Plan:
    """The rules for each factor (``A``, ``B``): the base rules written for the factor's axes."""

    a: tuple[Rule, ...]
    b: tuple[Rule, ...]


def _start(shape_a: Sequence[int], shape_b: Sequence[int], style: str) -> _Layout:
    """``W``'s axes from a stored pair: PEFT and Megatron ``A [r, in]``, ``B [out, r]``; MaxText
    (unscanned) ``A [in..., r]``, ``B [r, out...]``."""
    if style != "maxtext":
        return _Layout(((0, "o"), (1, "i")))
    n_in, n_out = len(shape_a) - 1, len(shape_b) - 1
    return _Layout(tuple((k, "i" if k < n_in else "o") for k in range(n_in + n_out)))


def plan(rules: Sequence[Rule], layouts: Mapping[str, _Layout]) -> Plan:
    """The rules for ``A`` and for ``B`` of the adapted weights ``layouts`` (base name -> axes);
    each rule that touches one of them, written for each factor that holds the axes it moves."""
    layouts, next_id = dict(layouts), 1000
    out: dict[str, list[Rule]] = {"A": [], "B": []}
    for rule in rules:
        if isinstance(rule, Join) and any(regex(rule.pattern.replace("{part}", re.escape(p))).search(n)
                                          for p in rule.parts for n in layouts):
            raise FormatError(f"Join({rule.pattern!r}): the parts' LoRA factors cannot fuse into one pair "
                              "(each part has its own A); carry the parts unfused")
        hit = {n: lay for n, lay in layouts.items() if rule.matches(n)}
        if not hit:
            continue
        if isinstance(rule, Expect):  # checks on W's shape: the factors have other shapes
            continue
        if isinstance(rule, (Rename, Cast, *LAYOUT_RULES)):  # names, dtypes, layouts: the same for both
            for part in "AB":
                out[part].append(rule)
            if isinstance(rule, Rename):
                layouts = {(regex(rule.pattern).sub(rule.to, n) if n in hit else n): lay for n, lay in layouts.items()}
            continue
        if isinstance(rule, Scale):  # W = s * B @ A: the scale goes to B (its moments by Scale's meaning)
            out["B"].append(rule)
            continue
        if isinstance(rule, Split):  # a fused weight: the factor of the split axis splits, the other is shared
            sides = {lay.side(rule.dim % len(lay.axes)) for lay in hit.values()}
            if len(sides) != 1 or "b" in sides:
                raise FormatError(f"Split({rule.pattern!r}) splits {sorted(sides)} axes: not a LoRA factor's")
            split = "B" if sides == {"o"} else "A"
            for lay in hit.values():
                d = lay.factor(split).index(lay.axes[rule.dim % len(lay.axes)][0])
            out[split].append(replace(rule, dim=d))
            out["A" if split == "B" else "B"].append(Copy(rule.pattern, rule.to, rule.parts))
            layouts = {n: lay for n, lay in layouts.items() if n not in hit} | {
                p: lay for n, lay in hit.items() for p in Copy(rule.pattern, rule.to, rule.parts).names(n)}
            continue
        new: dict[str, _Layout] = {}
        for part in "AB":
            made = {_for_factor(rule, lay, part, next_id) for lay in hit.values()}
            if len(made) != 1:
                raise FormatError(f"{type(rule).__name__}({rule.pattern!r}) moves the axes of "
                                  f"{sorted(hit)} differently; carry them with one rule each")
            factor_rule = made.pop()
            if factor_rule is not None:
                out[part].append(factor_rule)
        for name, lay in hit.items():
            target = regex(rule.pattern).sub(rule.to, name) if isinstance(rule, Stack) else name
            new[target] = _moved(rule, lay, next_id)
        layouts = {n: lay for n, lay in layouts.items() if n not in hit} | new
        next_id += 100
    return Plan(tuple(out["A"]), tuple(out["B"]))


def _moved(rule: Rule, lay: _Layout, next_id: int) -> _Layout:
    """``W``'s axes after ``rule``."""
    axes = list(lay.axes)
    if isinstance(rule, Transpose):
        return _Layout(tuple(axes[p] for p in rule.perm))
    if isinstance(rule, SplitDim):
        d = rule.dim % len(axes)
        side = axes[d][1]
        return _Layout((*axes[:d], *((next_id + k, side) for k in range(len(rule.sizes))), *axes[d + 1:]))
    if isinstance(rule, MergeDims):
        d = rule.dim % len(axes)
        return _Layout((*axes[:d], (next_id, axes[d][1]), *axes[d + rule.count:]))
    if isinstance(rule, Stack):
        d = rule.dim % (len(axes) + 1)
        return _Layout((*axes[:d], (next_id, "b"), *axes[d:]))
    return lay  # per-axis permutations, pads and crops keep the axes


def _for_factor(rule: Rule, lay: _Layout, part: str, next_id: int) -> Rule | None:
    """``rule`` (on ``W`` with axes ``lay``) written for factor ``part``; ``None`` when it moves
    none of the factor's axes."""
    own = "i" if part == "A" else "o"
    before = lay.factor(part)
    if isinstance(rule, Transpose):
        after = _moved(rule, lay, next_id).factor(part)
        perm = tuple(before.index(a) for a in after)
        return None if perm == tuple(range(len(perm))) else replace(rule, perm=perm)
    if isinstance(rule, Stack):
        after = _moved(rule, lay, next_id).factor(part)
        return replace(rule, dim=after.index(next_id))
    if isinstance(rule, _PER_AXIS):
        d = rule.dim % len(lay.axes)
        if isinstance(rule, MergeDims) and len({s for _, s in lay.axes[d:d + rule.count]}) != 1:
            raise FormatError(f"MergeDims({rule.pattern!r}) merges input and output axes: not a LoRA factor's")
        side = lay.side(d)
        if side == "b":
            raise FormatError(f"{type(rule).__name__}({rule.pattern!r}) moves a stacked axis: not supported for LoRA")
        return replace(rule, dim=before.index(lay.axes[d][0])) if side == own else None
    raise FormatError(f"{type(rule).__name__}({rule.pattern!r}) has no LoRA counterpart (a LoRA factor "
                      "cannot be offset, split or joined like its base weight)")


def carry(adapter: Checkpoint, rules: Sequence[Rule], *, alpha: float | None = None,
          path: str = "") -> Checkpoint:
    """``adapter`` (PEFT's folder opened, MaxText's adapter leaves or Megatron-Bridge's) seen through the base
    model's ``rules`` (e.g. ``ckptbridge.recipes.rules(family, src=..., dst=...)``): a checkpoint of
    the destination's ``lora_A``/``lora_B`` tensors (every state: Adam moments move as the rules
    say), lazily. ``extra["lora"]`` holds ``r`` and ``lora_alpha`` (one scaling ``lora_alpha / r``:
    a PEFT pair scaled otherwise has the ratio folded into ``B``; ``alpha`` picks ``lora_alpha``,
    default the adapter's)."""
    pairs: dict[str, dict[str, LogicalTensor]] = {}
    styles = set()
    for name, t in adapter.tensors.items():
        found = factor_of(name)
        if found is None:
            raise FormatError(f"{adapter.path}: tensor {name!r} is not a LoRA factor (lora_A/lora_B)")
        base, part, style = found
        styles.add(style)
        pairs.setdefault(base, {})[part] = LogicalTensor(base, dict(t.states), dict(t.scalars))
    if len(styles) != 1:
        raise FormatError(f"{adapter.path}: LoRA tensors of several namings {sorted(styles)}")
    style = styles.pop()
    for base, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise FormatError(f"{adapter.path}: {factor_name(base, next(iter(ab)))!r} has no partner")
    ranks = {p["A"].shape[-1 if style == "maxtext" else 0] for p in pairs.values()}
    if len(ranks) != 1:
        raise FormatError(f"{adapter.path}: ranks {sorted(ranks)}: a carried adapter has one rank "
                          "(MaxText's adapter config has a single r)")
    config = _config_of(adapter, style)
    r = ranks.pop()
    lora_alpha = float(alpha if alpha is not None else config.get("lora_alpha", r))
    folded = _folded(adapter, style, r, lora_alpha)
    layouts = {b: _start(p["A"].shape, p["B"].shape, style) for b, p in pairs.items()}
    steps = plan(rules, layouts)
    out: dict[str, LogicalTensor] = {}
    for part, part_rules in (("A", steps.a), ("B", steps.b)):
        prefix = [Scale(f"^{re.escape(b)}$", f) for b, f in folded.items()] if part == "B" else []
        moved = _apply({b: p[part] for b, p in pairs.items()}, [*prefix, *part_rules])
        for name, t in moved.items():
            new = factor_name(name, part)
            out[new] = LogicalTensor(new, dict(t.states), dict(t.scalars))
    extra = {"lora": {"r": r, "lora_alpha": lora_alpha, "from": adapter.path}}
    index = CheckpointIndex("lora", path or adapter.path, out, adapter.step, extra)
    return Checkpoint(index, adapter.files)


def _apply(tensors: dict[str, LogicalTensor], rules: Sequence[Rule]) -> dict[str, LogicalTensor]:
    """:func:`apply_rules`, with :class:`Copy` run here (the same states under each part's name)."""
    for rule in rules:
        if isinstance(rule, Copy):
            tensors = {new: LogicalTensor(new, dict(t.states), dict(t.scalars))
                       for n, t in tensors.items() for new in (rule.names(n) if rule.matches(n) else [n])}
        else:
            tensors = apply_rules(tensors, [rule])
    return tensors


def _config_of(adapter: Checkpoint, style: str) -> dict[str, Any]:
    if style == "hf":
        return _read._config(_read.weights_file(adapter.path))
    cfg = adapter.extra.get("lora")
    return dict(cfg) if isinstance(cfg, Mapping) else {}


def _folded(adapter: Checkpoint, style: str, r: int, lora_alpha: float) -> dict[str, float]:
    """Per base weight of a PEFT adapter: its scaling over ``lora_alpha / r`` where not 1."""
    if style != "hf":
        return {}
    pairs = _read.read(adapter.path, adapter.tensors).pairs
    return {p.base: p.scaling / (lora_alpha / r) for p in pairs if p.scaling != lora_alpha / r}


def save_peft(lora: Checkpoint, out: str | os.PathLike[str], *, task_type: str = "CAUSAL_LM") -> str:
    """Write ``lora`` (HF-named factors, e.g. :func:`carry` to HF) as a PEFT adapter folder
    (``adapter_model.safetensors`` + ``adapter_config.json`` with its ``r``, ``lora_alpha`` and the
    modules it targets), which ``peft.PeftModel.from_pretrained`` loads::

        save_peft(carry(ckptbridge.open("mt_lora.safetensors"), back_rules, alpha=8.0), "adapter/")
    """
    import ckptbridge

    names = [factor_of(n) for n in lora.tensors]
    if not names or any(f is None or f[2] != "hf" for f in names):
        raise FormatError(f"{lora.path}: only PEFT-named LoRA factors can be saved as a PEFT adapter")
    cfg = lora.extra.get("lora") or {}
    if "r" not in cfg or "lora_alpha" not in cfg:
        raise FormatError(f"{lora.path}: no r / lora_alpha in extra['lora'] (carry() records them)")
    modules = sorted({PurePosixPath(f[0].replace(".", "/")).parent.name for f in names if f})
    Path(out).mkdir(parents=True, exist_ok=True)
    ckptbridge.reshard(lora, str(Path(out) / _read.WEIGHTS), to="safetensors")
    config = {"peft_type": "LORA", "task_type": task_type, "r": int(cfg["r"]), "lora_alpha": cfg["lora_alpha"],
              "target_modules": modules, "bias": "none", "lora_dropout": 0.0, "use_rslora": False}
    (Path(out) / _read.CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return str(out)

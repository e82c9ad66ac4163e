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
    OptionError,
    Pad,
    Rename,
    Rule,
    Scale,
    Split,
    SplitDim,
    Stack,
    TensorState,
    Transpose,
    Unstack,
    apply_rules,
    concat,
    pad,
)

from . import _lora

__all__ = ["Copy", "Place", "Plan", "carry", "factor_name", "factor_of", "plan", "save_peft"]

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
    in ``B``) or ``"b"`` (stacked: in both); the pair's ``rank``; ``stacked``: ``(id, size)`` of the
    stacked axes the stored factors show (what an :class:`Unstack` of them makes)."""

    axes: tuple[tuple[int, str], ...]
    rank: int
    stacked: tuple[tuple[int, int], ...] = ()

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

    def axis(self, dim: int) -> int:
        return self.axes[dim][0]


@dataclass(frozen=True)
class Copy(Rule):
    """The other factor of a :class:`Split` weight: the same tensor under each part's name (a
    fused QKV's ``A`` is every part's ``A``)."""

    to: str = ""
    parts: tuple[str, ...] = ()

    def names(self, name: str) -> list[str]:
        return [re.sub(self.pattern, self.to, name).replace("{part}", p) for p in self.parts]


@dataclass(frozen=True)
class Place(Rule):
    """A part's factor put in its block of a fused pair's rank: zeros along ``dim`` (the rank axis)
    but for entries ``[offset, offset + rank)``, ``total`` in all (every state: the zeros' Adam
    moments are zeros). The ``B`` of a :class:`Join`'s parts, placed so, join into the fused pair's
    block-diagonal ``B``."""

    dim: int = 0
    offset: int = 0
    total: int = 0

    def place(self, state: TensorState) -> TensorState:
        d = self.dim % len(state.shape)
        empty = TensorState(state.dtype, tuple(0 if k == d else n for k, n in enumerate(state.shape)), ())
        return pad(concat([pad(empty, d, self.offset), state], d), d, self.total)


@dataclass(frozen=True)
class Plan:
    """The rules for each factor (``A``, ``B``): the base rules written for the factor's axes; and
    the carried adapter's one ``rank`` (pairs of a smaller rank padded with zeros to it)."""

    a: tuple[Rule, ...]
    b: tuple[Rule, ...]
    rank: int


def _start(shape_a: Sequence[int], shape_b: Sequence[int], style: str, scan: int | None = None) -> _Layout:
    """``W``'s axes from a stored pair: PEFT and Megatron ``A [r, in]``, ``B [out, r]``; MaxText
    ``A [in..., r]``, ``B [r, out...]``, or scanned (``scan``: the stacked axis of ``W [in..., out...]``,
    the axis its :class:`Unstack` takes) ``A [in..., layers, r]``, ``B [r, layers, out...]``."""
    if style != "maxtext":
        return _Layout(((0, "o"), (1, "i")), shape_a[0])
    n_in, n_out = len(shape_a) - 1, len(shape_b) - 1
    if scan is None:
        return _Layout(tuple((k, "i" if k < n_in else "o") for k in range(n_in + n_out)), shape_a[-1])
    axes = [(k, "i" if k < n_in - 1 else "o") for k in range(n_in + n_out - 2)]
    axes.insert(scan % (len(axes) + 1), (-2, "b"))
    lay = _Layout(tuple(axes), shape_a[-1])
    size = shape_a[lay.factor("A").index(-2)]
    if shape_b[lay.factor("B").index(-2)] != size:
        raise FormatError(f"stacked LoRA factors {list(shape_a)} and {list(shape_b)}: their stacked axes differ")
    return replace(lay, stacked=((-2, size),))


def _scan_dim(rules: Sequence[Rule], base: str) -> int | None:
    """The axis of ``base`` that ``rules`` unstack (a scanned MaxText weight), if any."""
    return next((r.dim for r in rules if isinstance(r, Unstack) and r.matches(base)), None)


def plan(rules: Sequence[Rule], layouts: Mapping[str, _Layout]) -> Plan:
    """The rules for ``A`` and for ``B`` of the adapted weights ``layouts`` (base name -> axes);
    each rule that touches one of them, written for each factor that holds the axes it moves; and
    zeros that pad every pair to the largest rank."""
    layouts, next_id = dict(layouts), 1000
    out: dict[str, list[Rule]] = {"A": [], "B": []}
    for rule in rules:
        if isinstance(rule, Join):
            joined = _join(rule, layouts)
            if joined is not None:
                fused, layouts = joined
                out["A"] += fused["A"]
                out["B"] += fused["B"]
            continue
        hit = {n: lay for n, lay in layouts.items() if rule.matches(n)}
        if not hit:
            continue
        if isinstance(rule, Expect):  # checks on W's shape: the factors have other shapes
            continue
        if isinstance(rule, (Rename, Cast, *LAYOUT_RULES)):  # names, dtypes, layouts: the same for both
            for part in "AB":
                out[part].append(rule)
            if isinstance(rule, Rename):
                layouts = {(re.sub(rule.pattern, rule.to, n) if n in hit else n): lay for n, lay in layouts.items()}
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
        if isinstance(rule, Stack):  # stacked pairs share one shape: a smaller rank is padded first
            top = max(lay.rank for lay in hit.values())
            for part in "AB":
                out[part] += [_pad_rank(n, lay, part, top) for n, lay in hit.items() if lay.rank < top]
            hit = {n: replace(lay, rank=top) for n, lay in hit.items()}
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
            new |= dict.fromkeys(_targets(rule, name, lay), _moved(rule, lay, next_id))
        layouts = {n: lay for n, lay in layouts.items() if n not in hit} | new
        next_id += 100
    rank = max((lay.rank for lay in layouts.values()), default=0)
    for part in "AB":
        out[part] += [_pad_rank(n, lay, part, rank) for n, lay in layouts.items() if lay.rank < rank]
    return Plan(tuple(out["A"]), tuple(out["B"]), rank)


def _pad_rank(name: str, lay: _Layout, part: str, rank: int) -> Pad:
    """Zeros that pad factor ``part`` of ``name`` from its rank to ``rank`` (``B @ A`` unchanged)."""
    return Pad(f"^{re.escape(name)}$", lay.factor(part).index(-1), lay.rank, rank)


def _join(rule: Join, layouts: Mapping[str, _Layout]) -> tuple[dict[str, list[Rule]], dict[str, _Layout]] | None:
    """A :class:`Join` (parts fused into one weight, e.g. PEFT's q/k/v into Megatron's ``linear_qkv``)
    written for the factors, exactly: the factor of the joined axis (``B`` for rows) of each part
    :class:`Place`-d in its block of the summed rank and joined like the weight (``B``'s rows are
    the weight's rows: a GQA QKV interleaves them per query group), the other factor's parts stacked
    on the rank axis. ``B_fused @ A_fused`` is then the parts' ``B_i @ A_i`` in the weight's rows.
    ``None`` when no adapted weight is a part."""
    patterns = [rule.pattern.replace("{part}", re.escape(p)) for p in rule.parts]
    groups: dict[str, dict[int, str]] = {}
    for name in layouts:
        k = next((k for k, pat in enumerate(patterns) if re.search(pat, name)), None)
        if k is not None:
            groups.setdefault(re.sub(patterns[k], rule.to, name), {})[k] = name
    if not groups:
        return None
    made: dict[str, list[Rule]] = {"A": [], "B": []}
    fused: dict[str, _Layout] = {}
    dims = set()
    for target, members in groups.items():
        if sorted(members) != list(range(len(rule.parts))):
            missing = [p for k, p in enumerate(rule.parts) if k not in members]
            raise FormatError(f"Join {target!r}: the adapter has no pair for part(s) {missing}; a fused "
                              f"weight's adapter needs all of {list(rule.parts)} adapted")
        parts = [layouts[members[k]] for k in range(len(rule.parts))]
        first, total = parts[0], sum(lay.rank for lay in parts)
        side = first.side(rule.dim)
        if side == "b" or len({tuple(s for _, s in lay.axes) for lay in parts}) != 1:
            raise FormatError(f"Join({rule.pattern!r}) joins {side!r} axes of {target!r}: not a LoRA factor's")
        split = "B" if side == "o" else "A"
        at = 0
        for k, lay in enumerate(parts):
            made[split].append(Place(f"^{re.escape(members[k])}$", lay.factor(split).index(-1), at, total))
            at += lay.rank
        fused[target] = replace(first, rank=total)
        dims.add((split, first.factor(split).index(first.axis(rule.dim)),
                  first.factor("A" if split == "B" else "B").index(-1)))
    if len(dims) != 1:
        raise FormatError(f"Join({rule.pattern!r}) moves the axes of {sorted(groups)} differently")
    split, d_joined, d_rank = dims.pop()
    made[split].append(replace(rule, dim=d_joined))
    made["A" if split == "B" else "B"].append(Join(rule.pattern, rule.to, d_rank, rule.parts))
    gone = {n for members in groups.values() for n in members.values()}
    return made, {n: lay for n, lay in layouts.items() if n not in gone} | fused


def _targets(rule: Rule, name: str, lay: _Layout) -> list[str]:
    """The names ``name`` has after ``rule`` (a Stack's target; an Unstack's one per index)."""
    if isinstance(rule, Stack):
        return [re.sub(rule.pattern, rule.to, name)]
    if isinstance(rule, Unstack):
        size = dict(lay.stacked).get(lay.axis(rule.dim % len(lay.axes)))
        if size is None:
            raise FormatError(f"Unstack({rule.pattern!r}) of {name!r}: the axis it unstacks is not a stacked one")
        hole = "{" + rule.index + "}"
        return [re.sub(rule.pattern, rule.to, name).replace(hole, str(i)) for i in range(size)]
    return [name]


def _moved(rule: Rule, lay: _Layout, next_id: int) -> _Layout:
    """``W``'s axes after ``rule``."""
    axes = list(lay.axes)
    if isinstance(rule, Transpose):
        return replace(lay, axes=tuple(axes[p] for p in rule.perm))
    if isinstance(rule, SplitDim):
        d = rule.dim % len(axes)
        side = axes[d][1]
        return replace(lay, axes=(*axes[:d], *((next_id + k, side) for k in range(len(rule.sizes))), *axes[d + 1:]))
    if isinstance(rule, MergeDims):
        d = rule.dim % len(axes)
        return replace(lay, axes=(*axes[:d], (next_id, axes[d][1]), *axes[d + rule.count:]))
    if isinstance(rule, Stack):
        d = rule.dim % (len(axes) + 1)
        return replace(lay, axes=(*axes[:d], (next_id, "b"), *axes[d:]))
    if isinstance(rule, Unstack):
        d = rule.dim % len(axes)
        return replace(lay, axes=(*axes[:d], *axes[d + 1:]))
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
    if isinstance(rule, Unstack):
        d = rule.dim % len(lay.axes)
        if lay.side(d) != "b":
            raise FormatError(f"Unstack({rule.pattern!r}) takes a {lay.side(d)!r} axis: not a stacked LoRA factor's")
        return replace(rule, dim=before.index(lay.axis(d)))
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
    """``adapter`` (PEFT's folder opened, MaxText's adapter leaves, unscanned or scanned, or
    Megatron-Bridge's) seen through the base model's ``rules`` (e.g.
    ``ckptbridge.recipes.rules(family, src=..., dst=...)``): a checkpoint of the destination's
    ``lora_A``/``lora_B`` tensors (every state: Adam moments move as the rules say), lazily.

    The result has one rank ``r`` and one scaling ``lora_alpha / r``, recorded in ``extra["lora"]``
    (what PEFT's ``LoraConfig``, MaxText's adapter config and Megatron-Bridge's ``LoRA(dim=r,
    alpha=lora_alpha)`` take): a pair scaled otherwise (rsLoRA, a rank or alpha pattern) has the
    ratio folded into ``B``; a pair of a smaller rank is padded with zeros (``B @ A`` unchanged). A
    weight fused from parts (PEFT's q/k/v into Megatron's ``linear_qkv``, gate/up into
    ``linear_fc1``) gets one pair whose rank is the sum of the parts' ranks: ``A`` the parts' ``A``
    stacked, ``B`` block-diagonal (each part's ``B`` in its rank columns, its rows where the weight's
    rows go), so ``B @ A`` is exactly the parts' deltas. Its Adam moments: ``A``'s stack, ``B``'s
    blocks with zeros beside them. At the carried point the gradients of ``A`` and of ``B``'s blocks
    are the parts' own (so their moments are exact), but the zero blocks get a gradient too (a
    fused pair trains as one adapter of the summed rank): their zero moments are a fresh start, not a
    history, so training on is not the parts' training continued.

    ``alpha``: the source's ``lora_alpha`` where its files record none (MaxText's and
    Megatron-Bridge's factors; default ``r``, a scaling of 1); a PEFT folder's is its
    ``adapter_config.json``'s. The result's ``lora_alpha`` keeps the source's scaling."""
    pairs, style = _pairs(adapter)
    lora_alpha, r, scalings = _scalings(adapter, style, pairs, alpha)
    scale = lora_alpha / r
    folded = {b: s / scale for b, s in scalings.items() if s != scale}
    layouts = {b: _start(p["A"].shape, p["B"].shape, style, _scan_dim(rules, b) if style == "maxtext" else None)
               for b, p in pairs.items()}
    steps = plan(rules, layouts)
    out: dict[str, LogicalTensor] = {}
    for part, part_rules in (("A", steps.a), ("B", steps.b)):
        prefix = [Scale(f"^{re.escape(b)}$", f) for b, f in folded.items()] if part == "B" else []
        moved = _apply({b: p[part] for b, p in pairs.items()}, [*prefix, *part_rules])
        for name, t in moved.items():
            new = factor_name(name, part)
            out[new] = LogicalTensor(new, dict(t.states), dict(t.scalars))
    extra = {"lora": {"r": steps.rank, "lora_alpha": scale * steps.rank, "from": adapter.path}}
    index = CheckpointIndex("lora", path or adapter.path, out, adapter.step, extra)
    return Checkpoint(index, adapter.files)


def _pairs(adapter: Checkpoint) -> tuple[dict[str, dict[str, LogicalTensor]], str]:
    """``adapter``'s factors by base weight (``{"A": ..., "B": ...}``) and their naming style."""
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
    for base, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise FormatError(f"{adapter.path}: {factor_name(base, next(iter(ab)))!r} has no partner")
    return pairs, styles.pop()


def _scalings(adapter: Checkpoint, style: str, pairs: Mapping[str, Mapping[str, LogicalTensor]],
              alpha: float | None) -> tuple[float, int, dict[str, float]]:
    """The source's ``lora_alpha`` and ``r`` (its nominal scaling ``lora_alpha / r``) and each pair's
    own scaling: PEFT's as ``adapter_config.json`` gives it (rsLoRA, patterns), others ``lora_alpha``
    over the pair's rank (Megatron-Bridge's ``alpha / dim``)."""
    if style == "hf":
        if alpha is not None:
            raise OptionError(f"{adapter.path}: a PEFT adapter's lora_alpha is its {_lora.CONFIG}'s; "
                              "alpha= is for factors that record none (MaxText's, Megatron-Bridge's)")
        config = _lora._config(_lora.weights_file(adapter.path))
        read = _lora.read(adapter.path, adapter.tensors)
        return float(config.get("lora_alpha", 8)), int(config.get("r", 8)), {p.base: p.scaling for p in read.pairs}
    ranks = {b: p["A"].shape[-1 if style == "maxtext" else 0] for b, p in pairs.items()}
    given = adapter.extra.get("lora")
    config = dict(given) if isinstance(given, Mapping) else {}
    r = int(config.get("r", max(ranks.values())))
    lora_alpha = float(alpha if alpha is not None else config.get("lora_alpha", r))
    return lora_alpha, r, {b: lora_alpha / rank for b, rank in ranks.items()}


def _apply(tensors: dict[str, LogicalTensor], rules: Sequence[Rule]) -> dict[str, LogicalTensor]:
    """:func:`apply_rules`, with :class:`Copy` and :class:`Place` run here."""
    for rule in rules:
        if isinstance(rule, Copy):
            tensors = {new: LogicalTensor(new, dict(t.states), dict(t.scalars))
                       for n, t in tensors.items() for new in (rule.names(n) if rule.matches(n) else [n])}
        elif isinstance(rule, Place):
            tensors = {n: LogicalTensor(n, {s: rule.place(st) for s, st in t.states.items()}, dict(t.scalars))
                       if rule.matches(n) else t for n, t in tensors.items()}
        else:
            tensors = apply_rules(tensors, [rule])
    return tensors


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
    ckptbridge.reshard(lora, str(Path(out) / _lora.WEIGHTS), to="safetensors")
    config = {"peft_type": "LORA", "task_type": task_type, "r": int(cfg["r"]), "lora_alpha": cfg["lora_alpha"],
              "target_modules": modules, "bias": "none", "lora_dropout": 0.0, "use_rslora": False}
    (Path(out) / _lora.CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return str(out)

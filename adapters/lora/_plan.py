"""How each rule a base weight ``W`` gets is written for its LoRA factors (``W = s * B @ A``).

Each axis of ``W`` belongs to one factor: output axes to ``B``, input axes to ``A``, an axis the
recipe stacks (MaxText's scanned layers) to both. :func:`plan` follows the rules on ``W``'s axes
(:class:`Layout`) and writes each one for the factor that holds the axes it moves: a ``Scale`` goes
to ``B``, a transpose or head split reshapes each factor, a ``Stack`` / ``Unstack`` takes the layer
axis of both, a ``Split`` of fused rows splits ``B`` and gives every part the same ``A``
(:class:`Copy`), a ``Join`` of parts stacks their ``A`` and places their ``B`` block-diagonally
(:class:`Place`)::

    lay = layout_of((4, 64), (96, 4), "hf")         # A [r, in], B [out, r] of an HF weight [out, in]
    steps = plan(rules, {"model.layers.0.self_attn.q_proj.weight": lay})
    steps.a, steps.b, steps.rank                     # the rules for A, for B; the one carried rank
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ckptbridge.plugin import (
    LAYOUT_RULES,
    Cast,
    Crop,
    Deinterleave,
    Expect,
    FormatError,
    Interleave,
    Join,
    MergeDims,
    Pad,
    Rename,
    Reshape,
    Rule,
    Scale,
    Split,
    SplitDim,
    Stack,
    TensorState,
    Transpose,
    Unstack,
    concat,
    pad,
    regex,
)

__all__ = ["Copy", "Layout", "Place", "Plan", "layout_of", "plan", "qwix_folds", "qwix_splits", "scan_axis"]

_PER_AXIS = (SplitDim, MergeDims, Interleave, Deinterleave, Pad, Crop)
# the layout such a refusal meets first: megatron-core's legacy GroupedMLP (the qwen3_moe recipe's grouped form)
_GROUPED = (" (megatron-core's legacy GroupedMLP buffers, mlp.experts.weight1 / weight2, are such: Megatron-Bridge's "
            "LoRA wraps linear modules, SequentialMLP's local_experts.N.linear_fc1 / linear_fc2: "
            "megatron_experts='sequential')")


@dataclass(frozen=True)
class Layout:
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
        return Split(self.pattern, self.to, parts=self.parts).part_names(name)


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
    """The rules for each factor (``A``, ``B``): the base rules written for the factor's axes; the
    carried adapter's one ``rank`` (pairs of a smaller rank padded with zeros to it); and
    ``layouts``, the axes of each carried weight at the destination (by its name there)."""

    a: tuple[Rule, ...]
    b: tuple[Rule, ...]
    rank: int
    layouts: Mapping[str, Layout] = field(default_factory=dict)


def layout_of(shape_a: Sequence[int], shape_b: Sequence[int], style: str, scan: int | None = None) -> Layout:
    """``W``'s axes from a stored pair: PEFT and Megatron ``A [r, in]``, ``B [out, r]``; MaxText
    ``A [in..., r]``, ``B [r, out...]``, or scanned (``scan``: the stacked axis of ``W [in..., out...]``,
    the axis its :class:`Unstack` takes) ``A [in..., layers, r]``, ``B [r, layers, out...]``."""
    if style != "maxtext":
        return Layout(((0, "o"), (1, "i")), shape_a[0])
    n_in, n_out = len(shape_a) - 1, len(shape_b) - 1
    if scan is None:
        return Layout(tuple((k, "i" if k < n_in else "o") for k in range(n_in + n_out)), shape_a[-1])
    axes = [(k, "i" if k < n_in - 1 else "o") for k in range(n_in + n_out - 2)]
    axes.insert(scan % (len(axes) + 1), (-2, "b"))
    lay = Layout(tuple(axes), shape_a[-1])
    size = shape_a[lay.factor("A").index(-2)]
    if shape_b[lay.factor("B").index(-2)] != size:
        raise FormatError(f"stacked LoRA factors {list(shape_a)} and {list(shape_b)}: their stacked axes differ")
    return replace(lay, stacked=((-2, size),))


def qwix_splits(rules: Sequence[Rule], base: str, shape_a: Sequence[int], shape_b: Sequence[int]
                ) -> dict[str, tuple[Rule, ...]]:
    """The rules (for ``"A"``, for ``"B"``) that unflatten qwix's LoRA factors of ``base`` into MaxText's served layout.

    qwix 0.1.8 (``providers/lora.py``, the ``dot_general`` MaxText's ``DenseGeneral`` calls) keeps
    ``A [prod(contracting), r]`` and ``B [r, prod(remaining)]`` for a kernel ``W [in..., out...]``;
    a scanned decoder stacks them like every parameter, at MaxText's ``param_scan_axis`` (1):
    ``A [prod(in), layers, r]``, ``B [r, layers, prod(out)]``. The served layout is ``A [in..., r]``,
    ``B [r, out...]`` (scanned: ``layers`` where ``W`` has it, :func:`layout_of`); this is
    :func:`qwix_folds` inverted. ``W``'s axes come from the recipe's ``Expect`` of ``base``
    (``[embed, n_heads, head_dim]``: ``B [r, H*D]`` becomes ``[r, H, D]``); a base with no ``Expect``
    of more axes than its stored factors flatten needs none::

        qwix_splits(rules, "decoder/layers_0/self_attention/out/kernel", (64, 4), (4, 64))
        # {'A': (SplitDim('^decoder/layers_0/self_attention/out/kernel$', dim=0, sizes=(4, 16)),), 'B': ()}
    """
    scan = scan_axis(rules, base)
    if len(shape_a) != len(shape_b) or len(shape_a) != (2 if scan is None else 3):
        raise FormatError(f"qwix LoRA factors of {base!r} are {list(shape_a)} and {list(shape_b)}: expected "
                          + ("A [in, r], B [r, out]" if scan is None else "A [in, layers, r], B [r, layers, out] (scanned)"))
    layers = () if scan is None else (shape_a[1],)
    shape = next((r.shape for r in rules if isinstance(r, Expect) and r.matches(base)
                  and len(r.shape) > 2 + len(layers)), None)
    if shape is None:
        return {"A": (), "B": ()}
    axes = [n for k, n in enumerate(shape) if k != scan]  # W's axes but the stacked one
    cuts = [k for k in range(1, len(axes)) if _fits(axes[:k], shape_a[0]) and _fits(axes[k:], shape_b[-1])]
    if len(cuts) != 1:
        raise FormatError(f"qwix LoRA factors {list(shape_a)}, {list(shape_b)} of {base!r} do not split "
                          f"its axes {list(shape)} into contracting and remaining ones")
    k, r = cuts[0], shape_a[-1]
    ins, outs = _sizes(axes[:k], shape_a[0]), _sizes(axes[k:], shape_b[-1])
    at_a, at_b = (0, 0) if scan is None else (min(scan, k), max(scan - k, 0))  # where W has the layer axis
    served_a = (*ins[:at_a], *layers, *ins[at_a:], r)
    served_b = (r, *outs[:at_b], *layers, *outs[at_b:])
    lay = layout_of(served_a, served_b, "maxtext", scan)
    return {part: tuple(rule.inverse() for rule in reversed(qwix_folds(base, lay, part, served)))
            for part, served in (("A", served_a), ("B", served_b))}


def qwix_folds(base: str, lay: Layout, part: str, shape: Sequence[int]) -> tuple[Rule, ...]:
    """The rules that flatten MaxText's served factor ``part`` (shape ``shape``) of ``base`` (axes
    ``lay``, :func:`layout_of`) into qwix's: ``A [prod(in), (layers,) r]``, ``B [r, (layers,)
    prod(out)]`` (the layer axis moved next to the rank, the input or output axes merged)::

        lay = layout_of((4, 16, 8), (8, 64), "maxtext")      # out/kernel [H, D, E], rank 8
        qwix_folds(base, lay, "A", (4, 16, 8))               # (MergeDims(..., dim=0, count=2, sizes=(4, 16)),)
    """
    pattern = f"^{re.escape(base)}$"
    own = [i for i, s in lay.axes if s == ("i" if part == "A" else "o")]
    stacked = [i for i, s in lay.axes if s == "b"]
    order = [*own, *stacked, -1] if part == "A" else [-1, *stacked, *own]
    perm = tuple(lay.factor(part).index(i) for i in order)
    rules: list[Rule] = [] if perm == tuple(range(len(perm))) else [Transpose(pattern, perm)]
    if len(own) > 1:
        at = order.index(own[0])
        rules.append(MergeDims(pattern, at, len(own), tuple(shape[perm[at + j]] for j in range(len(own)))))
    return tuple(rules)


def _sizes(dims: Sequence[int | None], size: int) -> tuple[int, ...]:
    """``dims`` with its unknown (``None``) entry resolved so that they flatten to ``size`` (:func:`_fits`)."""
    known = math.prod(n for n in dims if n is not None)
    return tuple(size // known if n is None else n for n in dims)


def _fits(dims: Sequence[int | None], size: int) -> bool:
    """``dims`` (``None``: unknown, at most one) can flatten to ``size``."""
    known = math.prod(n for n in dims if n is not None)
    unknown = sum(n is None for n in dims)
    return size == known if unknown == 0 else unknown == 1 and size % known == 0


def scan_axis(rules: Sequence[Rule], base: str) -> int | None:
    """The axis of ``base`` that ``rules`` unstack (a scanned MaxText weight), if any."""
    return next((r.dim for r in rules if isinstance(r, Unstack) and r.matches(base)), None)


def plan(rules: Sequence[Rule], layouts: Mapping[str, Layout]) -> Plan:
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
        if isinstance(rule, Stack):  # stacked pairs share one shape: a smaller rank is padded first
            top = max(lay.rank for lay in hit.values())
            for part in "AB":
                out[part] += [_pad_rank(n, lay, part, top) for n, lay in hit.items() if lay.rank < top]
            hit = {n: replace(lay, rank=top) for n, lay in hit.items()}
        new: dict[str, Layout] = {}
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
    return Plan(tuple(out["A"]), tuple(out["B"]), rank, {n: replace(lay, rank=rank) for n, lay in layouts.items()})


def _pad_rank(name: str, lay: Layout, part: str, rank: int) -> Pad:
    """Zeros that pad factor ``part`` of ``name`` from its rank to ``rank`` (``B @ A`` unchanged)."""
    return Pad(f"^{re.escape(name)}$", lay.factor(part).index(-1), lay.rank, rank)


def _join(rule: Join, layouts: Mapping[str, Layout]) -> tuple[dict[str, list[Rule]], dict[str, Layout]] | None:
    """A :class:`Join` (parts fused into one weight, e.g. PEFT's q/k/v into Megatron's ``linear_qkv``)
    written for the factors, exactly: the factor of the joined axis (``B`` for rows) of each part
    :class:`Place`-d in its block of the summed rank and joined like the weight (``B``'s rows are
    the weight's rows: a GQA QKV interleaves them per query group), the other factor's parts stacked
    on the rank axis. ``B_fused @ A_fused`` is then the parts' ``B_i @ A_i`` in the weight's rows.
    ``None`` when no adapted weight is a part."""
    patterns = [rule.pattern.replace("{part}", re.escape(p)) for p in rule.parts]
    groups: dict[str, dict[int, str]] = {}
    for name in layouts:
        k = next((k for k, pat in enumerate(patterns) if regex(pat).search(name)), None)
        if k is not None:
            groups.setdefault(regex(patterns[k]).sub(rule.to, name), {})[k] = name
    if not groups:
        return None
    made: dict[str, list[Rule]] = {"A": [], "B": []}
    fused: dict[str, Layout] = {}
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


def _targets(rule: Rule, name: str, lay: Layout) -> list[str]:
    """The names ``name`` has after ``rule`` (a Stack's target; an Unstack's one per index)."""
    if isinstance(rule, Stack):
        return [regex(rule.pattern).sub(rule.to, name)]
    if isinstance(rule, Unstack):
        size = dict(lay.stacked).get(lay.axis(rule.dim % len(lay.axes)))
        if size is None:
            raise FormatError(f"Unstack({rule.pattern!r}) of {name!r}: the axis it unstacks is not a stacked one")
        hole = "{" + rule.index + "}"
        return [regex(rule.pattern).sub(rule.to, name).replace(hole, str(i)) for i in range(size)]
    return [name]


def _moved(rule: Rule, lay: Layout, next_id: int) -> Layout:
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


def _for_factor(rule: Rule, lay: Layout, part: str, next_id: int) -> Rule | None:
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
        sides = {s for _, s in lay.axes[d:d + (rule.count if isinstance(rule, MergeDims) else 1)]}
        if "b" in sides:
            raise FormatError(f"{type(rule).__name__}({rule.pattern!r}) moves a stacked axis: no LoRA factor has that "
                              f"layout{_GROUPED}")
        if len(sides) != 1:
            raise FormatError(f"MergeDims({rule.pattern!r}) merges input and output axes: not a LoRA factor's")
        return replace(rule, dim=before.index(lay.axes[d][0])) if sides == {own} else None
    if isinstance(rule, Reshape):
        raise FormatError(f"Reshape({rule.pattern!r}) reinterprets the weight's bytes: no LoRA factor has that layout"
                          f"{_GROUPED}")
    raise FormatError(f"{type(rule).__name__}({rule.pattern!r}) has no LoRA counterpart (a LoRA factor "
                      "cannot be offset, split or joined like its base weight)")

"""The Universal Checkpoint Language: how native pieces map to logical tensors.

Rules are data (frozen dataclasses that print and serialise to JSON) and
are stored in every manifest. Two kinds:

*Layout rules* say how a native format laid a logical tensor over its
parallel ranks; adapters use them to assemble fragments and to write a new
layout (:class:`Shard`, :class:`Replicate`, :class:`Fuse`, :class:`Pad`,
:class:`Renumber`).

*Mapping rules* rename and reshape logical tensors between model
definitions (torch <-> Flax, per-layer <-> scanned); :func:`apply_rules`
runs them over a checkpoint's tensors without reading any data, by moving
fragment boxes and strides (:class:`Rename`, :class:`Transpose`,
:class:`Stack`, :class:`Unstack`, :class:`Split`)::

    rules = (
        Rename(r"^blocks\\.(\\d+)\\.fc\\.weight$", r"layers_\\1/fc/kernel"),
        Transpose(r"/kernel$", (1, 0)),
        Stack(r"^layers_(\\d+)/(.*)$", r"layers/\\2", dim=0),
    )
    flax_tensors = apply_rules(ckpt.tensors, rules)
    print(rules_to_json(rules))

The fragment-level transforms below (:func:`concat`, :func:`crop`,
:func:`transpose`, :func:`stack`, :func:`unstack`, :func:`split`) are the
vocabulary adapters build on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from ._errors import FormatError, ShapeMismatchError
from ._model import Box, Fragment, LogicalTensor, TensorState

# ------------------------------------------------------------ fragment transforms


def concat(parts: Sequence[TensorState], dim: int) -> TensorState:
    """Join states along ``dim`` (e.g. tensor-parallel shards into the full tensor)."""
    if not parts:
        raise ShapeMismatchError("concat of no parts")
    first = parts[0]
    frags: list[Fragment] = []
    at = 0
    for p in parts:
        if p.dtype != first.dtype or len(p.shape) != len(first.shape) or any(
            a != b for d, (a, b) in enumerate(zip(p.shape, first.shape)) if d != dim
        ):
            raise ShapeMismatchError(f"cannot concat {p.shape}/{p.dtype} with {first.shape}/{first.dtype} on dim {dim}")
        for f in p.fragments:
            off = list(f.box.offset)
            off[dim] += at
            frags.append(Fragment(Box(tuple(off), f.box.shape), f.location, f.checksum))
        at += p.shape[dim]
    shape = list(first.shape)
    shape[dim] = at
    return TensorState(first.dtype, tuple(shape), tuple(frags))


def crop(state: TensorState, box: Box) -> TensorState:
    """The part ``box`` of a state, as a state of shape ``box.shape`` (e.g. strip vocab padding)."""
    frags = []
    for f in state.fragments:
        common = f.box.intersect(box)
        if common is None or common.size == 0:
            continue
        same = common == f.box
        loc = f.location if same else f.location.narrow(common.shift(f.box.offset))
        frags.append(Fragment(common.shift(box.offset), loc, f.checksum if same else None))
    return TensorState(state.dtype, box.shape, tuple(frags))


def transpose(state: TensorState, perm: Sequence[int]) -> TensorState:
    """Reorder dims: result dim ``i`` is input dim ``perm[i]`` (no data moves)."""
    perm = tuple(perm)
    if sorted(perm) != list(range(len(state.shape))):
        raise ShapeMismatchError(f"permutation {perm} does not fit shape {state.shape}")
    frags = tuple(
        Fragment(
            Box(tuple(f.box.offset[p] for p in perm), tuple(f.box.shape[p] for p in perm)),
            f.location.permute(perm),
        )
        for f in state.fragments
    )
    return TensorState(state.dtype, tuple(state.shape[p] for p in perm), frags)


def stack(parts: Sequence[TensorState], dim: int = 0) -> TensorState:
    """Stack equal-shaped states along a new dim (per-layer tensors -> one scanned tensor)."""
    if not parts:
        raise ShapeMismatchError("stack of no parts")
    first = parts[0]
    frags = []
    for i, p in enumerate(parts):
        if p.shape != first.shape or p.dtype != first.dtype:
            raise ShapeMismatchError(f"cannot stack {p.shape}/{p.dtype} with {first.shape}/{first.dtype}")
        for f in p.fragments:
            off = (*f.box.offset[:dim], i, *f.box.offset[dim:])
            shp = (*f.box.shape[:dim], 1, *f.box.shape[dim:])
            frags.append(Fragment(Box(off, shp), f.location.insert_dim(dim)))
    shape = (*first.shape[:dim], len(parts), *first.shape[dim:])
    return TensorState(first.dtype, shape, tuple(frags))


def unstack(state: TensorState, dim: int = 0) -> list[TensorState]:
    """The inverse of :func:`stack`: one state per index of ``dim``."""
    out = []
    for i in range(state.shape[dim]):
        off = tuple(i if d == dim else 0 for d in range(len(state.shape)))
        shp = tuple(1 if d == dim else s for d, s in enumerate(state.shape))
        part = crop(state, Box(off, shp))
        frags = tuple(
            Fragment(
                Box(f.box.offset[:dim] + f.box.offset[dim + 1 :], f.box.shape[:dim] + f.box.shape[dim + 1 :]),
                f.location.drop_dim(dim),
            )
            for f in part.fragments
        )
        out.append(TensorState(state.dtype, shp[:dim] + shp[dim + 1 :], frags))
    return out


def split(state: TensorState, dim: int, widths: Sequence[int], groups: int = 1) -> list[TensorState]:
    """Split a fused tensor into its parts.

    Along ``dim`` the tensor is ``groups`` repetitions of the parts, each part
    ``widths[k]`` wide (QKV with grouped-query attention: groups = query groups,
    widths = (heads_per_group * head_dim, head_dim, head_dim); SwiGLU: groups=1,
    widths = (ffn, ffn)). Part ``k`` gathers its slice from every group.
    """
    group = sum(widths)
    if group * groups != state.shape[dim]:
        raise ShapeMismatchError(
            f"fused dim {dim} has {state.shape[dim]} entries, expected {groups} x {group}"
        )
    out = []
    start = 0
    for w in widths:
        pieces = []
        for g in range(groups):
            off = tuple(g * group + start if d == dim else 0 for d in range(len(state.shape)))
            shp = tuple(w if d == dim else s for d, s in enumerate(state.shape))
            pieces.append(crop(state, Box(off, shp)))
        out.append(concat(pieces, dim))
        start += w
    return out


def fuse(parts: Sequence[TensorState], dim: int, groups: int = 1) -> TensorState:
    """The inverse of :func:`split`: interleave parts group by group along ``dim``."""
    pieces = []
    for g in range(groups):
        for p in parts:
            if p.shape[dim] % groups:
                raise ShapeMismatchError(f"part of {p.shape[dim]} entries does not split into {groups} groups")
            w = p.shape[dim] // groups
            off = tuple(g * w if d == dim else 0 for d in range(len(p.shape)))
            shp = tuple(w if d == dim else s for d, s in enumerate(p.shape))
            pieces.append(crop(p, Box(off, shp)))
    return concat(pieces, dim)


# ------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class Rule:
    """Base of all rules; ``pattern`` is a regular expression over logical names."""

    pattern: str

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None

    def to_json(self) -> dict[str, Any]:
        return {"rule": type(self).__name__, **{k: _jsonable(v) for k, v in asdict(self).items()}}


def _jsonable(v: Any) -> Any:
    return list(_jsonable(x) for x in v) if isinstance(v, tuple) else v


@dataclass(frozen=True)
class Shard(Rule):
    """Layout: split along ``dim`` over parallel ``axis`` (``"tp"``, ``"pp"``, ``"dp"``...)."""

    axis: str = "tp"
    dim: int = 0


@dataclass(frozen=True)
class Replicate(Rule):
    """Layout: the same on every rank of ``axis``; ``check`` is ``"equal"``, ``"mean"`` or ``"first"``."""

    axis: str = "tp"
    check: str = "equal"


@dataclass(frozen=True)
class Fuse(Rule):
    """Layout: sub-parameters ``parts`` fused along ``dim``, repeated per group (QKV, SwiGLU)."""

    dim: int = 0
    parts: tuple[str, ...] = ()
    widths: tuple[int, ...] = ()
    groups: int = 1


@dataclass(frozen=True)
class Pad(Rule):
    """Layout: ``dim`` padded from ``size`` up to ``padded`` (vocabulary padding)."""

    dim: int = 0
    size: int = 0
    padded: int = 0


@dataclass(frozen=True)
class Renumber(Rule):
    """Layout: layer numbers local to a pipeline stage; the global number adds ``offset``."""

    axis: str = "pp"
    offset: int = 0


@dataclass(frozen=True)
class FlatPartition(Rule):
    """Layout: flattened, concatenated and split into equal slices over ``axis`` (ZeRO)."""

    axis: str = "dp"
    alignment: int = 1


@dataclass(frozen=True)
class Rename(Rule):
    """Mapping: ``re.sub(pattern, to, name)``."""

    to: str = ""


@dataclass(frozen=True)
class Transpose(Rule):
    """Mapping: permute dims (torch ``Linear.weight`` [out,in] <-> Flax ``kernel`` [in,out])."""

    perm: tuple[int, ...] = (1, 0)


@dataclass(frozen=True)
class Stack(Rule):
    """Mapping: tensors whose names match (with a layer-number group) stack into ``to`` along ``dim``.

    ``Stack(r"^layers\\.(\\d+)\\.(.*)$", r"layers.\\2")``: the first group is
    the index, the replacement names the stacked tensor.
    """

    to: str = ""
    dim: int = 0


@dataclass(frozen=True)
class Unstack(Rule):
    """Mapping: the inverse of :class:`Stack`; ``to`` uses ``{i}`` for the index."""

    to: str = ""
    dim: int = 0


@dataclass(frozen=True)
class Split(Rule):
    """Mapping: split a fused tensor into named parts (``to`` uses ``{part}``)."""

    to: str = ""
    dim: int = 0
    parts: tuple[str, ...] = ()
    widths: tuple[int, ...] = ()
    groups: int = 1


@dataclass(frozen=True)
class Join(Rule):
    """Mapping: the inverse of :class:`Split`: fuse the named parts into one tensor.

    ``pattern`` holds ``{part}`` where each part's name goes; ``to`` names the fused tensor::

        Join(r"^blocks\\.(\\d+)\\.{part}\\.weight$", r"blocks.\\1.qkv.weight", parts=("q", "k", "v"))
    """

    to: str = ""
    dim: int = 0
    parts: tuple[str, ...] = ()
    groups: int = 1


@dataclass(frozen=True)
class State(Rule):
    """Layout: native tensors matching ``pattern`` are state ``state`` of the logical tensor
    ``re.sub(pattern, to, name)`` (optax ``opt_state/0/mu/...`` -> ``exp_avg``); descriptive."""

    to: str = ""
    state: str = "fp32"


RULES: dict[str, type[Rule]] = {
    c.__name__: c
    for c in (Shard, Replicate, Fuse, Pad, Renumber, FlatPartition, Rename, Transpose, Stack, Unstack, Split,
              State, Join)
}


def rules_to_json(rules: Sequence[Rule | Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [r.to_json() if isinstance(r, Rule) else dict(r) for r in rules]


def rule_from_json(data: Mapping[str, Any]) -> Rule:
    kind = data.get("rule")
    cls = RULES.get(str(kind))
    if cls is None:
        raise FormatError(f"unknown rule {kind!r}; known: {sorted(RULES)}")
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            v = data[f.name]
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


def _map_states(t: LogicalTensor, fn: Any, name: str | None = None) -> LogicalTensor:
    return LogicalTensor(name or t.name, {k: fn(s) for k, s in t.states.items()}, dict(t.scalars))


def apply_rules(
    tensors: Mapping[str, LogicalTensor], rules: Sequence[Rule]
) -> dict[str, LogicalTensor]:
    """Run mapping rules in order over logical tensors (metadata only; no data is read).

    Layout rules are descriptive and pass through unchanged.
    """
    out = dict(tensors)
    for rule in rules:
        if isinstance(rule, Rename):
            renamed: dict[str, LogicalTensor] = {}
            for name, t in out.items():
                new = re.sub(rule.pattern, rule.to, name)
                if new in renamed:
                    raise FormatError(f"rename {rule.pattern!r} maps two tensors onto {new!r}")
                renamed[new] = LogicalTensor(new, t.states, t.scalars)
            out = renamed
        elif isinstance(rule, Transpose):
            out = {
                n: _map_states(t, lambda s, r=rule: transpose(s, r.perm)) if rule.matches(n) else t
                for n, t in out.items()
            }
        elif isinstance(rule, Stack):
            out = _apply_stack(out, rule)
        elif isinstance(rule, Unstack):
            out = _apply_unstack(out, rule)
        elif isinstance(rule, Split):
            out = _apply_split(out, rule)
        elif isinstance(rule, Join):
            out = _apply_join(out, rule)
    return out


def _apply_stack(tensors: dict[str, LogicalTensor], rule: Stack) -> dict[str, LogicalTensor]:
    groups: dict[str, dict[int, LogicalTensor]] = {}
    out: dict[str, LogicalTensor] = {}
    for name, t in tensors.items():
        m = re.search(rule.pattern, name)
        if m is None:
            out[name] = t
            continue
        target = re.sub(rule.pattern, rule.to, name)
        groups.setdefault(target, {})[int(m.group(1))] = t
    for target, members in groups.items():
        idx = sorted(members)
        if idx != list(range(len(idx))):
            raise FormatError(f"stack {target!r}: layer indices {idx} are not 0..{len(idx) - 1}")
        items = [members[i] for i in idx]
        states = {
            s: stack([it.states[s] for it in items], rule.dim)
            for s in items[0].states
            if all(s in it.states for it in items)
        }
        out[target] = LogicalTensor(target, states, dict(items[0].scalars))
    return out


def _fan_out(
    tensors: dict[str, LogicalTensor], rule: Rule, parts: Any, names: Any
) -> dict[str, LogicalTensor]:
    """One tensor matching ``rule`` -> several: ``parts(state)`` gives each state's pieces,
    ``names(name)`` the new names in the same order."""
    out: dict[str, LogicalTensor] = {}
    for name, t in tensors.items():
        if not rule.matches(name):
            out[name] = t
            continue
        per_state = {s: parts(st) for s, st in t.states.items()}
        for k, new in enumerate(names(name, len(next(iter(per_state.values()))))):
            out[new] = LogicalTensor(new, {s: ps[k] for s, ps in per_state.items()}, dict(t.scalars))
    return out


def _apply_unstack(tensors: dict[str, LogicalTensor], rule: Unstack) -> dict[str, LogicalTensor]:
    return _fan_out(tensors, rule, lambda st: unstack(st, rule.dim),
                    lambda name, n: [re.sub(rule.pattern, rule.to, name).replace("{i}", str(i)) for i in range(n)])


def _apply_split(tensors: dict[str, LogicalTensor], rule: Split) -> dict[str, LogicalTensor]:
    return _fan_out(tensors, rule, lambda st: split(st, rule.dim, rule.widths, rule.groups),
                    lambda name, _n: [re.sub(rule.pattern, rule.to, name).replace("{part}", p) for p in rule.parts])


def _apply_join(tensors: dict[str, LogicalTensor], rule: Join) -> dict[str, LogicalTensor]:
    out: dict[str, LogicalTensor] = {}
    found: dict[str, dict[int, LogicalTensor]] = {}
    patterns = [rule.pattern.replace("{part}", re.escape(p)) for p in rule.parts]
    for name, t in tensors.items():
        for k, pat in enumerate(patterns):
            if re.search(pat, name):
                found.setdefault(re.sub(pat, rule.to, name), {})[k] = t
                break
        else:
            out[name] = t
    for target, members in found.items():
        if sorted(members) != list(range(len(rule.parts))):
            have = [rule.parts[k] for k in sorted(members)]
            raise FormatError(f"join {target!r}: found parts {have} of {list(rule.parts)}")
        items = [members[k] for k in range(len(rule.parts))]
        states = {
            s: fuse([it.states[s] for it in items], rule.dim, rule.groups)
            for s in items[0].states
            if all(s in it.states for it in items)
        }
        out[target] = LogicalTensor(target, states, dict(items[0].scalars))
    return out

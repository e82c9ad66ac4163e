"""Running mapping rules over logical tensors: :func:`apply_rules` and one handler per rule kind
(metadata only: boxes, strides and value transforms move, no byte is read)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import FormatError, ShapeMismatchError, TensorNotFoundError
from .._read.model import WEIGHT_STATES, Box, LogicalTensor, TensorState, no_gc
from . import _transforms as T
from ._language import (
    Cast,
    Crop,
    Deinterleave,
    Drop,
    DroppedTensorsWarning,
    Expect,
    Interleave,
    Join,
    MergeDims,
    Offset,
    Pad,
    Rename,
    Reshape,
    Rule,
    Scale,
    Split,
    SplitDim,
    Stack,
    Transpose,
    Unstack,
    regex,
)


def apply_rules(tensors: Mapping[str, LogicalTensor], rules: Sequence[Rule]) -> dict[str, LogicalTensor]:
    """Run mapping rules in order over logical tensors (metadata only; no data is read).

    Layout rules are descriptive and pass through. A rule that does not fit a
    tensor (a shape that does not divide, parts missing) raises before anything
    is read, naming the rule, the tensor, and the expected and found shapes.
    """
    with no_gc():  # millions of acyclic objects for a 671B MoE: see no_gc
        out = dict(tensors)
        for rule in rules:
            handler = _HANDLERS.get(type(rule))
            if handler is not None:
                out = handler(out, rule)
    return out


def _per_state(rule: Rule, fn: Callable[[TensorState, str, str], TensorState]
               ) -> Callable[[dict[str, LogicalTensor], Rule], dict[str, LogicalTensor]]:
    def run(tensors: dict[str, LogicalTensor], _rule: Rule) -> dict[str, LogicalTensor]:
        hits = set(_hits(tensors, rule))
        if not hits:
            return tensors
        out = {}
        for name, t in tensors.items():
            if name not in hits:
                out[name] = t
                continue
            states = {}
            for s, st in t.states.items():
                where = f"{type(rule).__name__}({rule.pattern!r}) on tensor {name!r} state {s!r}"
                try:
                    states[s] = fn(st, s, where)
                except ShapeMismatchError as err:
                    raise ShapeMismatchError(f"{where}: {err}") from None
            out[name] = LogicalTensor(name, states, dict(t.scalars))
        return out

    return run


def _state_fn(rule: Rule) -> Callable[[TensorState, str, str], TensorState]:
    if isinstance(rule, Transpose):
        return lambda st, s, w: T.transpose(st, rule.perm)
    if isinstance(rule, Reshape):
        def reshape(st: TensorState, s: str, w: str) -> TensorState:
            if rule.from_shape and tuple(st.shape) != tuple(T._infer(st.shape, rule.from_shape)):
                raise ShapeMismatchError(f"expected shape {rule.from_shape}, found {st.shape}")
            return T.reshape(st, rule.shape)
        return reshape
    if isinstance(rule, SplitDim):
        return lambda st, s, w: T.split_dim(st, rule.dim, rule.sizes)
    if isinstance(rule, MergeDims):
        return lambda st, s, w: T.merge_dims(st, rule.dim, rule.count)
    if isinstance(rule, Interleave):
        return lambda st, s, w: T.interleave(st, rule.dim, rule.block, rule.ways)
    if isinstance(rule, Deinterleave):
        return lambda st, s, w: T.deinterleave(st, rule.dim, rule.block, rule.ways)
    if isinstance(rule, Pad):
        def pad(st: TensorState, s: str, w: str) -> TensorState:
            d = T._axis(rule.dim, len(st.shape))
            if st.shape[d] != rule.size:
                raise ShapeMismatchError(f"expected {rule.size} entries along dim {rule.dim}, found {st.shape[d]} "
                                         f"(shape {st.shape})")
            return T.pad(st, d, rule.padded)
        return pad
    if isinstance(rule, Crop):
        def crop(st: TensorState, s: str, w: str) -> TensorState:
            d = T._axis(rule.dim, len(st.shape))
            if rule.padded and st.shape[d] != rule.padded:
                raise ShapeMismatchError(f"expected {rule.padded} entries along dim {rule.dim}, found {st.shape[d]}")
            if rule.start + rule.size > st.shape[d]:
                raise ShapeMismatchError(f"cannot keep {rule.size} entries from {rule.start} of {st.shape[d]}")
            off = tuple(rule.start if k == d else 0 for k in range(len(st.shape)))
            shp = tuple(rule.size if k == d else n for k, n in enumerate(st.shape))
            return T.crop(st, Box(off, shp))
        return crop
    if isinstance(rule, Scale):
        return lambda st, s, w: T.scale(st, rule.factor ** rule.power(s, w))
    if isinstance(rule, Offset):
        return lambda st, s, w: T.offset(st, rule.offset) if rule.shifts(s, w) else st
    if isinstance(rule, Cast):
        return lambda st, s, w: T.cast(st, rule.dtype) if s in rule.states else st
    raise FormatError(f"no state transform for {type(rule).__name__}")


def _hits(tensors: Mapping[str, Any], rule: Rule) -> list[str]:
    """The names ``rule`` matches, in order (one C loop: rules run over every name, 92k for DeepSeek-V3)."""
    return list(filter(regex(rule.pattern).search, tensors))


def _apply_rename(tensors: dict[str, LogicalTensor], rule: Rename) -> dict[str, LogicalTensor]:
    hits = _hits(tensors, rule)
    if not hits:
        return tensors
    sub = regex(rule.pattern).sub
    new = {name: sub(rule.to, name) for name in hits}
    renamed = dict(zip(map(new.get, tensors, tensors), tensors.values()))  # C loops, in order
    if len(renamed) != len(tensors):  # two tensors mapped onto one name: which
        seen: set[str] = set()
        for name in tensors:
            to = new.get(name, name)
            if to in seen:
                raise FormatError(f"Rename({rule.pattern!r} -> {rule.to!r}) maps two tensors onto {to!r}")
            seen.add(to)
    for to in new.values():
        t = renamed[to]
        if t.name != to:
            renamed[to] = LogicalTensor(to, t.states, t.scalars)
    return renamed


def _apply_expect(tensors: dict[str, LogicalTensor], rule: Expect) -> dict[str, LogicalTensor]:
    want = tuple(rule.shape)
    shown = "(" + ", ".join("*" if w is None else str(w) for w in want) + ("," if len(want) == 1 else "") + ")"
    for name in _hits(tensors, rule):
        for s, st in tensors[name].states.items():
            found = tuple(st.shape)
            if len(found) != len(want) or any(w is not None and w != f for w, f in zip(want, found)):
                why = f" ({rule.why})" if rule.why else ""
                state = "" if s in WEIGHT_STATES else f" state {s!r}"
                raise ShapeMismatchError(f"tensor {name!r}{state}: expected shape {shown}{why}, found {found}")
    return tensors


def _apply_drop(tensors: dict[str, LogicalTensor], rule: Drop) -> dict[str, LogicalTensor]:
    gone = dict.fromkeys(_hits(tensors, rule))  # a dict: ordered, O(1) membership
    if gone:
        why = f" ({rule.why})" if rule.why else ""
        warnings.warn(f"dropped {len(gone)} tensors{why}: {', '.join(gone)}", DroppedTensorsWarning, stacklevel=2)
    return {name: t for name, t in tensors.items() if name not in gone}


def _stack_index(m: re.Match[str], index: int | str, rule: Rule, name: str) -> int:
    try:
        return int(m.group(index))
    except (IndexError, TypeError, ValueError):
        raise FormatError(f"Stack({rule.pattern!r}): group {index!r} of {name!r} is not an index") from None


def _apply_stack(tensors: dict[str, LogicalTensor], rule: Stack) -> dict[str, LogicalTensor]:
    groups: dict[str, dict[int, LogicalTensor]] = {}
    spans: dict[str, tuple[str, int, int]] = {}  # target -> (a member's name, span of its index)
    pattern = regex(rule.pattern)
    out: dict[str, LogicalTensor] = {}
    for name, t in tensors.items():
        m = pattern.search(name)
        if m is None:
            out[name] = t
            continue
        target = pattern.sub(rule.to, name)
        groups.setdefault(target, {})[_stack_index(m, rule.index, rule, name)] = t
        spans.setdefault(target, (name, m.start(rule.index), m.end(rule.index)))
    every = sorted(set().union(*(set(g) for g in groups.values()))) if groups else []
    for target, members in groups.items():
        idx = sorted(members)
        if idx != every or idx != list(range(len(idx))):  # one rule stacks every group over the same indices
            gone = [i for i in range(max(every) + 1) if i not in members]
            name, a, b = spans[target]
            shape = next(iter(members.values())).state().shape
            raise TensorNotFoundError(
                f"Stack {target!r}: no tensor {name[:a] + str(gone[0]) + name[b:]!r} (expected shape {shape}, "
                f"like {name!r}); found indices {idx}, the other stacked tensors have 0..{max(every)}")
        items = [members[i] for i in idx]
        common = [s for s in items[0].states if all(s in it.states for it in items)]
        states = {}
        for s in common:
            parts = [it.states[s] for it in items]
            bad = next((it.name for it, p in zip(items, parts) if p.shape != parts[0].shape), None)
            if bad is not None:
                raise ShapeMismatchError(f"Stack {target!r}: {bad!r} state {s!r} has shape "
                                         f"{items[[it.name for it in items].index(bad)].states[s].shape}, "
                                         f"{items[0].name!r} has {parts[0].shape}")
            states[s] = T.stack(parts, T._axis(rule.dim, len(parts[0].shape) + 1))
        out[target] = LogicalTensor(target, states, dict(items[0].scalars))
    return out


def _fan_out(tensors: dict[str, LogicalTensor], rule: Rule, parts: Callable[[TensorState], list[TensorState]],
             names: Callable[[str, int], list[str]]) -> dict[str, LogicalTensor]:
    """One tensor matching ``rule`` -> several: ``parts(state)`` gives each state's pieces,
    ``names(name, n)`` the new names in the same order."""
    out: dict[str, LogicalTensor] = {}
    for name, t in tensors.items():
        if not rule.matches(name):
            out[name] = t
            continue
        try:
            per_state = {s: parts(st) for s, st in t.states.items()}
        except ShapeMismatchError as err:
            raise ShapeMismatchError(f"{type(rule).__name__}({rule.pattern!r}) on tensor {name!r}: {err}") from None
        for k, new in enumerate(names(name, len(next(iter(per_state.values()))))):
            out[new] = LogicalTensor(new, {s: ps[k] for s, ps in per_state.items()}, dict(t.scalars))
    return out


def _apply_unstack(tensors: dict[str, LogicalTensor], rule: Unstack) -> dict[str, LogicalTensor]:
    hole = "{" + rule.index + "}"
    return _fan_out(tensors, rule, lambda st: T.unstack(st, T._axis(rule.dim, len(st.shape))),
                    lambda name, n: [regex(rule.pattern).sub(rule.to, name).replace(hole, str(i)) for i in range(n)])


def _apply_split(tensors: dict[str, LogicalTensor], rule: Split) -> dict[str, LogicalTensor]:
    def parts(st: TensorState) -> list[TensorState]:
        dim = T._axis(rule.dim, len(st.shape))
        widths = rule.widths
        if not widths:  # equal parts
            n, k = st.shape[dim], rule.groups * len(rule.parts)
            if not k or n % k:
                raise ShapeMismatchError(f"dim {dim} of {n} entries does not split into {k} equal parts")
            widths = (n // k,) * len(rule.parts)
        return T.split(st, dim, widths, rule.groups)

    return _fan_out(tensors, rule, parts, lambda name, _n: rule.part_names(name))


def _apply_join(tensors: dict[str, LogicalTensor], rule: Join) -> dict[str, LogicalTensor]:
    out: dict[str, LogicalTensor] = {}
    found: dict[str, dict[int, LogicalTensor]] = {}
    patterns = [rule.pattern.replace("{part}", re.escape(p)) for p in rule.parts]
    for name, t in tensors.items():
        for k, pat in enumerate(patterns):
            if regex(pat).search(name):
                found.setdefault(regex(pat).sub(rule.to, name), {})[k] = t
                break
        else:
            out[name] = t
    for target, members in found.items():
        if sorted(members) != list(range(len(rule.parts))):
            have = [rule.parts[k] for k in sorted(members)]
            raise FormatError(f"Join {target!r}: found parts {have} of {list(rule.parts)}")
        items = [members[k] for k in range(len(rule.parts))]
        states = {}
        for s in items[0].states:
            if all(s in it.states for it in items):
                try:
                    states[s] = T.fuse([it.states[s] for it in items],
                                       T._axis(rule.dim, len(items[0].states[s].shape)), rule.groups)
                except ShapeMismatchError as err:
                    raise ShapeMismatchError(f"Join {target!r} state {s!r}: {err}") from None
        out[target] = LogicalTensor(target, states, dict(items[0].scalars))
    return out


def _shape_rule(tensors: dict[str, LogicalTensor], rule: Rule) -> dict[str, LogicalTensor]:
    return _per_state(rule, _state_fn(rule))(tensors, rule)


_HANDLERS: dict[type[Rule], Callable[[dict[str, LogicalTensor], Any], dict[str, LogicalTensor]]] = {
    Rename: _apply_rename,
    Expect: _apply_expect,
    Drop: _apply_drop,
    Stack: _apply_stack,
    Unstack: _apply_unstack,
    Split: _apply_split,
    Join: _apply_join,
    **{cls: _shape_rule for cls in (Transpose, Reshape, SplitDim, MergeDims, Interleave, Deinterleave, Pad, Crop,
                                    Scale, Offset, Cast)},
}


# ------------------------------------------------------------------ inverting renames

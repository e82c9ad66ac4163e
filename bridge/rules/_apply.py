"""Running mapping rules over logical tensors: :func:`apply_rules` (and its lazy twin :func:`map_rules`)
and one handler per rule kind (metadata only: boxes, strides and value transforms move, no byte is read).

Rules run over *nodes*, not built tensors: a node knows each state's dtype and shape (its layout) and how
to build its states (a closure over the nodes it came from). Every check a rule makes (shapes that divide,
parts and indices present, states a value transform knows) runs on the layouts while the rules are applied,
so a rule set that does not fit fails there, naming the rule, the tensor and the shapes; the fragments of a
tensor (boxes, strides, views) are built when it is first used. A recipe onto DeepSeek-V3's 46k tensors
so costs one pass of small tuples per rule, and reading one leaf builds that leaf only::

    view = map_rules(ckpt.tensors, rules)       # names, shapes, checks: now
    view["decoder/logits_dense/kernel"]         # its fragments: now, once
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .. import _dtypes
from .._errors import FormatError, ShapeMismatchError, TensorNotFoundError
from .._gc import no_gc
from .._read.model import (
    WEIGHT_STATES,
    Box,
    LazyTensors,
    LogicalTensor,
    TensorSpec,
    TensorState,
)
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
from ._names import Names, substitute_all

Shape = tuple[int, ...]
Layout = Mapping[str, tuple[str, Shape]]  # state -> (dtype, shape)
Built = tuple[Mapping[str, TensorState], Mapping[str, float | int]]  # states, scalars


class Node(NamedTuple):
    """A tensor while rules run: its states' dtypes and shapes, and how to build the states."""

    layout: Layout
    build: Callable[[], Built]


def apply_rules(tensors: Mapping[str, LogicalTensor], rules: Sequence[Rule]) -> dict[str, LogicalTensor]:
    """Run mapping rules in order over logical tensors (metadata only; no data is read).

    Layout rules are descriptive and pass through. A rule that does not fit a
    tensor (a shape that does not divide, parts missing) raises before anything
    is read, naming the rule, the tensor, and the expected and found shapes.
    Every tensor is built here; :func:`map_rules` builds each when it is used.
    """
    with no_gc():  # millions of acyclic objects for a 671B MoE: see no_gc
        return dict(map_rules(tensors, rules))


def map_rules(tensors: Mapping[str, LogicalTensor], rules: Sequence[Rule]) -> LazyTensors[TensorSpec]:
    """:func:`apply_rules` with every check made now and each tensor built when first used."""
    with no_gc():
        order = list(tensors)
        builds = map(functools.partial, itertools.repeat(_stored), itertools.repeat(tensors), order)
        nodes = Names(dict(zip(order, map(tuple.__new__, itertools.repeat(Node), zip(_layouts(tensors, order), builds)))))
        for rule in rules:
            handler = _HANDLERS.get(type(rule))
            if handler is not None:
                nodes = handler(nodes, rule)
        specs = {name: TensorSpec(*_weights(node.layout), node) for name, node in nodes.items()}
    return LazyTensors(specs, _build, layout=_layout)


def _layouts(tensors: Mapping[str, LogicalTensor], names: list[str]) -> list[Layout]:
    """The layouts of the input tensors ``names``; equal layouts are one object, so that a rule maps each once."""
    if isinstance(tensors, LazyTensors):
        return tensors.layouts(names)
    shared: dict[Any, Layout] = {}
    layouts = ({s: (st.dtype, st.shape) for s, st in tensors[name].states.items()} for name in names)
    return [shared.setdefault(tuple(layout.items()), layout) for layout in layouts]


def _stored(tensors: Mapping[str, LogicalTensor], name: str) -> Built:
    t = tensors[name]
    return t.states, t.scalars


def _weights(layout: Layout) -> tuple[str, Shape]:
    """The dtype and shape of the weight state of ``layout`` (as :attr:`LogicalTensor.weight_state`)."""
    state = next((s for s in WEIGHT_STATES if s in layout), next(iter(layout), None))
    return layout[state] if state is not None else ("", ())


def _build(name: str, spec: TensorSpec) -> LogicalTensor:
    states, scalars = spec.source.build()
    return LogicalTensor(name, dict(states), dict(scalars))


def _layout(spec: TensorSpec) -> Layout:
    return spec.source.layout  # type: ignore[no-any-return]


def _hits(nodes: Names[Node], rule: Rule) -> list[str]:
    """The names ``rule`` matches, in order (through the index of :class:`Names`: a recipe runs a hundred
    rules over every name, 92k for DeepSeek-V3)."""
    return nodes.hits(rule.pattern)


# ------------------------------------------------------------------ one state at a time


def _apply_states(nodes: Names[Node], rule: Rule) -> Names[Node]:
    hits = _hits(nodes, rule)
    if not hits:
        return nodes
    shape_of, state_of = _state_fns(rule)
    old = list(map(nodes.values.__getitem__, hits))
    layouts = list(map(operator.itemgetter(0), old))
    ids = list(map(id, layouts))  # tensors share layouts (see map_rules): each is mapped once
    first = dict(zip(reversed(ids), reversed(hits)))  # a tensor of each layout, for the messages
    mapped: dict[int, Layout] = {}
    for key, layout in zip(ids, layouts):
        if key in mapped:
            continue
        mapped[key] = new = {}
        for s, (dtype, shape) in layout.items():
            where = f"{type(rule).__name__}({rule.pattern!r}) on tensor {first[key]!r} state {s!r}"
            try:
                new[s] = shape_of(dtype, shape, s, where)
            except ShapeMismatchError as err:
                raise ShapeMismatchError(f"{where}: {err}") from None
    builds = map(functools.partial, itertools.repeat(_map_states), map(operator.itemgetter(1), old),
                 itertools.repeat(state_of))
    nodes.values.update(zip(hits, map(tuple.__new__, itertools.repeat(Node), zip(map(mapped.__getitem__, ids), builds))))
    return nodes


def _map_states(build: Callable[[], Built], fn: Callable[[TensorState, str], TensorState]) -> Built:
    states, scalars = build()
    return {s: fn(st, s) for s, st in states.items()}, scalars


ShapeFn = Callable[[str, Shape, str, str], tuple[str, Shape]]  # (dtype, shape, state, where) -> (dtype, shape)
StateFn = Callable[[TensorState, str], TensorState]


def _state_fns(rule: Rule) -> tuple[ShapeFn, StateFn]:
    """How ``rule`` maps one state: its dtype and shape (every check made here), and its fragments."""
    if isinstance(rule, Transpose):
        return (lambda dt, shp, s, w: (dt, T.permuted_shape(shp, rule.perm)),
                lambda st, s: T.transpose(st, rule.perm))
    if isinstance(rule, Reshape):
        def reshape(dt: str, shp: Shape, s: str, w: str) -> tuple[str, Shape]:
            if rule.from_shape and shp != T._infer(shp, rule.from_shape):
                raise ShapeMismatchError(f"expected shape {rule.from_shape}, found {shp}")
            return dt, T._infer(shp, rule.shape)
        return reshape, lambda st, s: T.reshape(st, rule.shape)
    if isinstance(rule, SplitDim):
        return (lambda dt, shp, s, w: (dt, T.split_dim_shape(shp, rule.dim, rule.sizes)),
                lambda st, s: T.split_dim(st, rule.dim, rule.sizes))
    if isinstance(rule, MergeDims):
        return (lambda dt, shp, s, w: (dt, T.merged_shape(shp, rule.dim, rule.count)),
                lambda st, s: T.merge_dims(st, rule.dim, rule.count))
    if isinstance(rule, (Interleave, Deinterleave)):
        fn = T.interleave if isinstance(rule, Interleave) else T.deinterleave
        def blocks(dt: str, shp: Shape, s: str, w: str) -> tuple[str, Shape]:
            T.check_blocks(shp, rule.dim, rule.block, rule.ways)
            return dt, shp
        return blocks, lambda st, s: fn(st, rule.dim, rule.block, rule.ways)
    if isinstance(rule, Pad):
        def pad(dt: str, shp: Shape, s: str, w: str) -> tuple[str, Shape]:
            d = T._axis(rule.dim, len(shp))
            if shp[d] != rule.size:
                raise ShapeMismatchError(f"expected {rule.size} entries along dim {rule.dim}, found {shp[d]} "
                                         f"(shape {shp})")
            return dt, T.padded_shape(shp, d, rule.padded)
        return pad, lambda st, s: T.pad(st, T._axis(rule.dim, len(st.shape)), rule.padded)
    if isinstance(rule, Crop):
        def crop_box(shp: Shape) -> Box:
            d = T._axis(rule.dim, len(shp))
            if rule.padded and shp[d] != rule.padded:
                raise ShapeMismatchError(f"expected {rule.padded} entries along dim {rule.dim}, found {shp[d]}")
            if rule.start + rule.size > shp[d]:
                raise ShapeMismatchError(f"cannot keep {rule.size} entries from {rule.start} of {shp[d]}")
            return Box(tuple(rule.start if k == d else 0 for k in range(len(shp))),
                       tuple(rule.size if k == d else n for k, n in enumerate(shp)))
        return (lambda dt, shp, s, w: (dt, crop_box(shp).shape), lambda st, s: T.crop(st, crop_box(st.shape)))
    if isinstance(rule, (Scale, Offset)):
        known = rule.power if isinstance(rule, Scale) else rule.shifts

        def values(dt: str, shp: Shape, s: str, w: str) -> tuple[str, Shape]:
            known(s, w)  # a state of unknown meaning fails here, naming it
            return dt, shp
        if isinstance(rule, Scale):
            return values, lambda st, s: T.scale(st, rule.factor ** rule.power(s, ""))
        return values, lambda st, s: T.offset(st, rule.offset) if rule.shifts(s, "") else st
    if isinstance(rule, Cast):
        def cast(dt: str, shp: Shape, s: str, w: str) -> tuple[str, Shape]:
            if s not in rule.states:
                return dt, shp
            _dtypes.to_numpy(rule.dtype)  # a dtype ckptbridge does not know fails here
            return rule.dtype, shp
        return cast, lambda st, s: T.cast(st, rule.dtype) if s in rule.states else st
    raise FormatError(f"no state transform for {type(rule).__name__}")


# ------------------------------------------------------------------ names


def _apply_rename(nodes: Names[Node], rule: Rename) -> Names[Node]:
    hits, matches = nodes.matches(rule.pattern)
    if not hits:
        return nodes
    new = dict(zip(hits, substitute_all(rule.pattern, rule.to, hits, matches)))
    targets = set(new.values())
    if len(targets) != len(new) or not all(map(new.__contains__, filter(nodes.pos.__contains__, targets))):
        seen: set[str] = set()  # two tensors mapped onto one name: which (the first in order)
        for name in nodes:
            to = new.get(name, name)
            if to in seen:
                raise FormatError(f"Rename({rule.pattern!r} -> {rule.to!r}) maps two tensors onto {to!r}")
            seen.add(to)
    nodes.rename(new)
    return nodes


def _apply_expect(nodes: Names[Node], rule: Expect) -> Names[Node]:
    want = tuple(rule.shape)
    shown = "(" + ", ".join("*" if w is None else str(w) for w in want) + ("," if len(want) == 1 else "") + ")"
    for name in _hits(nodes, rule):
        for s, (_, found) in nodes.values[name].layout.items():
            if len(found) != len(want) or any(w is not None and w != f for w, f in zip(want, found)):
                why = f" ({rule.why})" if rule.why else ""
                state = "" if s in WEIGHT_STATES else f" state {s!r}"
                raise ShapeMismatchError(f"tensor {name!r}{state}: expected shape {shown}{why}, found {found}")
    return nodes


def _apply_drop(nodes: Names[Node], rule: Drop) -> Names[Node]:
    gone = dict.fromkeys(_hits(nodes, rule))  # a dict: ordered, O(1) membership
    if not gone:
        return nodes
    why = f" ({rule.why})" if rule.why else ""
    warnings.warn(f"dropped {len(gone)} tensors{why}: {', '.join(gone)}", DroppedTensorsWarning, stacklevel=4)
    return nodes.rebuilt(nodes.kept(gone))


# ------------------------------------------------------------------ several tensors into one


def _stack_index(m: re.Match[str] | None, index: int | str, rule: Stack, name: str) -> int:
    try:
        return int(m.group(index))  # type: ignore[union-attr]
    except (AttributeError, IndexError, TypeError, ValueError):
        raise FormatError(f"Stack({rule.pattern!r}): group {rule.index!r} of {name!r} is not an index") from None


def _apply_stack(nodes: Names[Node], rule: Stack) -> Names[Node]:
    hits, matches = nodes.matches(rule.pattern)
    if not hits:
        return nodes
    pattern = regex(rule.pattern)
    try:
        indices = list(map(int, map(operator.methodcaller("group", rule.index), matches)))
    except (AttributeError, IndexError, TypeError, ValueError):
        indices = [_stack_index(m, rule.index, rule, name) for name, m in zip(hits, matches)]  # names the bad one
    groups: dict[str, dict[int, str]] = {}  # target -> {index: member}
    for target, index, name in zip(substitute_all(rule.pattern, rule.to, hits, matches), indices, hits):
        groups.setdefault(target, {})[index] = name
    out = nodes.kept(set(hits))
    every = sorted(set().union(*groups.values()))
    for target, members in groups.items():
        idx = sorted(members)
        if idx != every or idx != list(range(len(idx))):  # one rule stacks every group over the same indices
            missing = [i for i in range(max(every) + 1) if i not in members]
            name = members[idx[0]]
            m = pattern.search(name)
            a, b = (m.start(rule.index), m.end(rule.index)) if m is not None else (0, 0)
            shape = _weights(nodes.values[name].layout)[1]
            raise TensorNotFoundError(
                f"Stack {target!r}: no tensor {name[:a] + str(missing[0]) + name[b:]!r} (expected shape {shape}, "
                f"like {name!r}); found indices {idx}, the other stacked tensors have 0..{max(every)}")
        items = [(members[i], nodes.values[members[i]]) for i in idx]
        layouts = [node.layout for _, node in items]
        first_name, first = items[0][0], layouts[0]
        same = layouts.count(first) == len(layouts)  # shared layouts (see map_rules): one comparison each
        layout = {}
        for s in [s for s in first if same or all(s in lay for lay in layouts)]:
            dtype, shape = first[s]
            for (name, _), lay in zip(items, [] if same else layouts):
                if lay[s][1] != shape:
                    raise ShapeMismatchError(f"Stack {target!r}: {name!r} state {s!r} has shape {lay[s][1]}, "
                                             f"{first_name!r} has {shape}")
                if lay[s][0] != dtype:
                    raise ShapeMismatchError(f"cannot stack {shape}/{lay[s][0]} with {shape}/{dtype}")
            axis = T._axis(rule.dim, len(shape) + 1)
            layout[s] = (dtype, (*shape[:axis], len(items), *shape[axis:]))
        out[target] = Node(layout, functools.partial(_stacked, tuple(node.build for _, node in items), rule.dim))
    return nodes.rebuilt(out)


def _stacked(builds: Sequence[Callable[[], Built]], dim: int) -> Built:
    built = [b() for b in builds]
    common = [s for s in built[0][0] if all(s in states for states, _ in built)]
    return {s: T.stack([states[s] for states, _ in built], T._axis(dim, len(built[0][0][s].shape) + 1))
            for s in common}, built[0][1]


def _apply_join(nodes: Names[Node], rule: Join) -> Names[Node]:
    out: dict[str, Node] = {}
    found: dict[str, dict[int, Node]] = {}
    patterns = [regex(rule.pattern.replace("{part}", re.escape(p))) for p in rule.parts]
    for name, node in nodes.items():
        for k, pat in enumerate(patterns):
            if pat.search(name):
                found.setdefault(pat.sub(rule.to, name), {})[k] = node
                break
        else:
            out[name] = node
    for target, members in found.items():
        if sorted(members) != list(range(len(rule.parts))):
            have = [rule.parts[k] for k in sorted(members)]
            raise FormatError(f"Join {target!r}: found parts {have} of {list(rule.parts)}")
        layouts = [members[k].layout for k in range(len(rule.parts))]
        layout = {}
        for s in [s for s in layouts[0] if all(s in lay for lay in layouts)]:
            try:
                layout[s] = T.fused_layout([lay[s] for lay in layouts], T._axis(rule.dim, len(layouts[0][s][1])),
                                           rule.groups)
            except ShapeMismatchError as err:
                raise ShapeMismatchError(f"Join {target!r} state {s!r}: {err}") from None
        builds = tuple(members[k].build for k in range(len(rule.parts)))
        out[target] = Node(layout, functools.partial(_joined, builds, rule.dim, rule.groups))
    return nodes.rebuilt(out)


def _joined(builds: Sequence[Callable[[], Built]], dim: int, groups: int) -> Built:
    built = [b() for b in builds]
    common = [s for s in built[0][0] if all(s in states for states, _ in built)]
    return {s: T.fuse([states[s] for states, _ in built], T._axis(dim, len(built[0][0][s].shape)), groups)
            for s in common}, built[0][1]


# ------------------------------------------------------------------ one tensor into several


def _fan_out(nodes: Names[Node], rule: Rule, count: Callable[[str, Shape], list[tuple[str, Shape]]],
             part: Callable[[TensorState, int], TensorState], names: Callable[[str, int], list[str]]
             ) -> Names[Node]:
    """One tensor matching ``rule`` -> several: ``count(dtype, shape)`` gives each part's dtype and shape
    (checking the shape), ``part(state, k)`` builds part ``k``, ``names(name, n)`` the new names in order."""
    hits = set(_hits(nodes, rule))
    if not hits:
        return nodes
    out: dict[str, Node] = {}
    for name, node in nodes.items():
        if name not in hits:
            out[name] = node
            continue
        try:
            per_state = {s: count(*dt_shape) for s, dt_shape in node.layout.items()}
        except ShapeMismatchError as err:
            raise ShapeMismatchError(f"{type(rule).__name__}({rule.pattern!r}) on tensor {name!r}: {err}") from None
        shared = functools.cache(node.build)  # the parts of one tensor build it once
        for k, new in enumerate(names(name, len(next(iter(per_state.values()))))):
            out[new] = Node({s: ps[k] for s, ps in per_state.items()}, functools.partial(_part, shared, part, k))
    return nodes.rebuilt(out)


def _part(build: Callable[[], Built], part: Callable[[TensorState, int], TensorState], k: int) -> Built:
    states, scalars = build()
    return {s: part(st, k) for s, st in states.items()}, scalars


def _apply_unstack(nodes: Names[Node], rule: Unstack) -> Names[Node]:
    hole = "{" + rule.index + "}"

    def count(dtype: str, shape: Shape) -> list[tuple[str, Shape]]:
        d = T._axis(rule.dim, len(shape))
        return [(dtype, shape[:d] + shape[d + 1 :])] * shape[d]

    return _fan_out(nodes, rule, count, lambda st, k: T.unstack_part(st, T._axis(rule.dim, len(st.shape)), k),
                    lambda name, n: [regex(rule.pattern).sub(rule.to, name).replace(hole, str(i)) for i in range(n)])


def _split_widths(rule: Split, shape: Shape) -> tuple[int, tuple[int, ...]]:
    """The dim ``rule`` splits and each part's width (equal parts unless given), checked."""
    dim = T._axis(rule.dim, len(shape))
    widths = tuple(rule.widths)
    if not widths:  # equal parts
        n, k = shape[dim], rule.groups * len(rule.parts)
        if not k or n % k:
            raise ShapeMismatchError(f"dim {dim} of {n} entries does not split into {k} equal parts")
        widths = (n // k,) * len(rule.parts)
    return dim, widths


def _apply_split(nodes: Names[Node], rule: Split) -> Names[Node]:
    def count(dtype: str, shape: Shape) -> list[tuple[str, Shape]]:
        dim, widths = _split_widths(rule, shape)
        return [(dtype, s) for s in T.split_shapes(shape, dim, widths, rule.groups)]

    def part(st: TensorState, k: int) -> TensorState:
        return T.split_part(st, *_split_widths(rule, st.shape), rule.groups, k)

    return _fan_out(nodes, rule, count, part, lambda name, _n: rule.part_names(name))


_HANDLERS: dict[type[Rule], Callable[[Names[Node], Any], Names[Node]]] = {
    Rename: _apply_rename,
    Expect: _apply_expect,
    Drop: _apply_drop,
    Stack: _apply_stack,
    Unstack: _apply_unstack,
    Split: _apply_split,
    Join: _apply_join,
    **{cls: _apply_states for cls in (Transpose, Reshape, SplitDim, MergeDims, Interleave, Deinterleave, Pad, Crop,
                                      Scale, Offset, Cast)},
}

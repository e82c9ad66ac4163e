"""The Universal Checkpoint Language: how native pieces map to logical tensors, as data.

Rules are frozen dataclasses that print, round-trip through JSON
(:func:`rules_to_json` / :func:`rule_from_json`) and are recorded in every
manifest. Two kinds:

*Layout rules* describe how a native format laid a logical tensor over its
parallel ranks (:class:`Shard`, :class:`Replicate`, :class:`Fuse`,
:class:`Renumber`, :class:`FlatPartition`, :class:`State`); adapters use them
to assemble fragments and to write new layouts; :func:`apply_rules` passes them by.

*Mapping rules* rename and reshape logical tensors between model definitions;
:func:`apply_rules` runs them in order over a checkpoint's tensors, for every
state, without reading any data (boxes, strides and value transforms move,
bytes stay):

* names: :class:`Rename`;
* shapes: :class:`Transpose`, :class:`Reshape`, :class:`SplitDim`,
  :class:`MergeDims`, :class:`Interleave` / :class:`Deinterleave` (rotary
  layouts), :class:`Pad` / :class:`Crop` (vocabulary padding);
* several tensors: :class:`Split` / :class:`Join` (fused QKV, gate/up),
  :class:`Stack` / :class:`Unstack` (scanned layers, stacked experts; a named
  regex group picks the index, so layers and experts stack one after the other);
* values: :class:`Scale` (with each state's meaning: a weight scaled by ``c``
  has Adam moments ``exp_avg / c`` and ``exp_avg_sq / c**2``), :class:`Cast`;
* checks: :class:`Expect` (shapes a rule set assumes, tested before anything else);
* leaving out: :class:`Drop` (tensors the target has no place for, named in a warning).

Every mapping rule has an :meth:`~Rule.inverse`; :func:`invert` reverses a list::

    rules = (
        Rename(r"^model\\.layers\\.(\\d+)\\.self_attn\\.q_proj\\.weight$", r"layers/\\1/query/kernel"),
        Interleave(r"/query/kernel$", dim=0, block=128),        # rotate-half -> interleaved
        Transpose(r"/kernel$", (1, 0)),
        SplitDim(r"/query/kernel$", dim=1, sizes=(32, 128)),    # [E, H*D] -> [E, H, D]
        Scale(r"/query/kernel$", 128 ** -0.5),                  # fold 1/sqrt(head_dim)
        Stack(r"^layers/(?P<layer>\\d+)/(.*)$", r"layers/\\2", dim=1, index="layer"),
    )
    mapped = apply_rules(ckpt.tensors, rules)
    back = apply_rules(mapped, invert(rules))                   # the original names and layout

Adam is not invariant to a reparametrisation ``w' = c w``: the moments map
exactly (``m' = m / c``, ``v' = v / c**2``), but Adam's update of ``w'`` is
``c`` times the update of ``w`` (its normalisation cancels the gradient's
``1/c``), so training with the same learning rate continues a different
trajectory unless ``c`` is a power of the learning-rate scale. Checkpoints
mapped through :class:`Scale` hold the right values; how to continue is the
user's choice (MaxText's own converter makes the same trade).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from .._errors import FormatError, ShapeMismatchError, TensorNotFoundError
from .._model import WEIGHT_STATES, Box, LogicalTensor, TensorState
from . import transforms as T

# ------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class Rule:
    """Base of all rules; ``pattern`` is a regular expression over logical names."""

    pattern: str

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None

    def to_json(self) -> dict[str, Any]:
        return {"rule": type(self).__name__, **{k: _jsonable(v) for k, v in asdict(self).items()}}

    def inverse(self) -> Rule:
        """The rule that undoes this one (mapping rules; layout rules are their own description)."""
        raise FormatError(f"{type(self).__name__} has no inverse")


def _jsonable(v: Any) -> Any:
    return [_jsonable(x) for x in v] if isinstance(v, tuple) else v


# -- layout rules (descriptive) ---------------------------------------------------------------


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
class State(Rule):
    """Layout: native tensors matching ``pattern`` are state ``state`` of the logical tensor
    ``re.sub(pattern, to, name)`` (optax ``opt_state/0/mu/...`` -> ``exp_avg``); descriptive."""

    to: str = ""
    state: str = "fp32"


# -- mapping rules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rename(Rule):
    """Mapping: ``re.sub(pattern, to, name)``; two tensors mapped onto one name is an error."""

    to: str = ""

    def inverse(self) -> Rename:
        return Rename(*_invert_rename(self.pattern, self.to))


@dataclass(frozen=True)
class Transpose(Rule):
    """Mapping: permute dims (torch ``Linear.weight`` [out,in] <-> Flax ``kernel`` [in,out])."""

    perm: tuple[int, ...] = (1, 0)

    def inverse(self) -> Transpose:
        inv = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inv[p] = i
        return Transpose(self.pattern, tuple(inv))


@dataclass(frozen=True)
class Reshape(Rule):
    """Mapping: the same elements (row-major) with ``shape`` (one ``-1`` inferred); ``from_shape``
    records the original shape so the rule can be inverted."""

    shape: tuple[int, ...] = ()
    from_shape: tuple[int, ...] = ()

    def inverse(self) -> Reshape:
        if not self.from_shape:
            raise FormatError(f"Reshape({self.pattern!r}) needs from_shape to be inverted")
        return Reshape(self.pattern, self.from_shape, self.shape)


@dataclass(frozen=True)
class SplitDim(Rule):
    """Mapping: split ``dim`` (negative counts from the end) into ``sizes`` (one ``-1`` inferred):
    ``[H*D, E] -> [H, D, E]``."""

    dim: int = 0
    sizes: tuple[int, ...] = ()

    def inverse(self) -> MergeDims:
        return MergeDims(self.pattern, self.dim if self.dim >= 0 else self.dim - len(self.sizes) + 1,
                         len(self.sizes), tuple(self.sizes))


@dataclass(frozen=True)
class MergeDims(Rule):
    """Mapping: merge ``count`` dims from ``dim`` on into one: ``[E, H, D] -> [E, H*D]``; ``sizes``
    (optional) records the merged dims' sizes so the rule can be inverted."""

    dim: int = 0
    count: int = 2
    sizes: tuple[int, ...] = ()

    def inverse(self) -> SplitDim:
        if not self.sizes:
            raise FormatError(f"MergeDims({self.pattern!r}) cannot know the sizes it merged; give sizes= "
                              "or write the SplitDim")
        return SplitDim(self.pattern, self.dim, tuple(self.sizes))


@dataclass(frozen=True)
class Interleave(Rule):
    """Mapping: per ``block`` entries of ``dim``, interleave the ``ways`` contiguous parts
    (rotary rotate-half rows -> interleaved pairs, ``block`` = head_dim)."""

    dim: int = 0
    block: int = 0
    ways: int = 2

    def inverse(self) -> Deinterleave:
        return Deinterleave(self.pattern, self.dim, self.block, self.ways)


@dataclass(frozen=True)
class Deinterleave(Rule):
    """Mapping: the inverse of :class:`Interleave` (interleaved pairs -> rotate-half)."""

    dim: int = 0
    block: int = 0
    ways: int = 2

    def inverse(self) -> Interleave:
        return Interleave(self.pattern, self.dim, self.block, self.ways)


@dataclass(frozen=True)
class Pad(Rule):
    """Layout (in a manifest) and mapping: ``dim`` padded with zeros from ``size`` up to ``padded``
    entries (re-pad a vocabulary for a target)."""

    dim: int = 0
    size: int = 0
    padded: int = 0

    def inverse(self) -> Crop:
        return Crop(self.pattern, self.dim, self.size, 0, self.padded)


@dataclass(frozen=True)
class Crop(Rule):
    """Mapping: keep ``size`` entries of ``dim`` from ``start`` (strip vocabulary padding);
    ``padded`` records the original size so the rule can be inverted."""

    dim: int = 0
    size: int = 0
    start: int = 0
    padded: int = 0

    def inverse(self) -> Pad:
        if self.start or not self.padded:
            raise FormatError(f"Crop({self.pattern!r}) is invertible only from start 0 with padded given")
        return Pad(self.pattern, self.dim, self.size, self.padded)


@dataclass(frozen=True)
class Stack(Rule):
    """Mapping: tensors whose names match stack into ``to`` along a new dim ``dim``.

    ``index`` is the regex group holding each tensor's position (a number or a
    name: ``(?P<expert>\\d+)``), so several indices stack one rule at a time::

        Stack(r"^layers\\.(?P<l>\\d+)\\.experts\\.(?P<e>\\d+)\\.w1$", r"layers.\\g<l>.w1", dim=0, index="e")
        Stack(r"^layers\\.(?P<l>\\d+)\\.w1$", "w1", dim=0, index="l")
    """

    to: str = ""
    dim: int = 0
    index: int | str = 1

    def inverse(self) -> Unstack:
        pattern, to = _invert_rename(self.pattern, self.to, hole=self.index)
        index = self.index if isinstance(self.index, str) else "i"
        return Unstack(pattern, to.replace("\x00", "{" + index + "}"), self.dim, index)


@dataclass(frozen=True)
class Unstack(Rule):
    """Mapping: the inverse of :class:`Stack`: one tensor per index of ``dim``; ``to`` holds
    ``{i}`` (or ``{<index>}``) where the index goes."""

    to: str = ""
    dim: int = 0
    index: str = "i"

    def inverse(self) -> Stack:
        placeholder = "{" + self.index + "}"
        group = f"(?P<{self.index}>\\d+)" if self.index.isidentifier() else r"(\d+)"
        head, _, tail = self.to.partition(placeholder)
        pattern, to = _invert_rename(self.pattern, head + "\x00" + tail)
        return Stack(pattern.replace(re.escape("\x00"), group).replace("\x00", group), to, self.dim,
                     self.index if self.index.isidentifier() else 1)


@dataclass(frozen=True)
class Split(Rule):
    """Mapping: split a fused tensor into named parts (``to`` uses ``{part}``); ``widths`` per part
    (default: equal parts), repeated ``groups`` times along ``dim`` (grouped-query QKV)."""

    to: str = ""
    dim: int = 0
    parts: tuple[str, ...] = ()
    widths: tuple[int, ...] = ()
    groups: int = 1

    def inverse(self) -> Join:
        head, _, tail = self.to.partition("{part}")
        pattern, to = _invert_rename(self.pattern, head + "\x00" + tail)
        return Join(pattern.replace(re.escape("\x00"), "{part}").replace("\x00", "{part}"), to, self.dim,
                    self.parts, self.groups, tuple(self.widths))


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
    widths: tuple[int, ...] = ()  # per part and group (optional; default equal): what inverts it

    def inverse(self) -> Split:
        if "{part}" not in self.pattern:
            raise FormatError(f"Join({self.pattern!r}) has no {{part}} in its pattern")
        pattern, to = _invert_rename(self.pattern.replace("{part}", "\x00"), self.to)
        return Split(pattern, to.replace("\x00", "{part}"), self.dim, tuple(self.parts), tuple(self.widths),
                     self.groups)


# states that move with the weights, the first moment (1/c) and the second moment (1/c^2)
_FIRST_MOMENTS = ("exp_avg", "momentum_buffer", "mu")
_SECOND_MOMENTS = ("exp_avg_sq", "nu")


@dataclass(frozen=True)
class Scale(Rule):
    """Mapping: weights times ``factor``, with each state's meaning: weight states (``fp32``,
    ``param``) by ``factor``, first moments (``exp_avg``) by ``1/factor``, second moments
    (``exp_avg_sq``) by ``1/factor**2``. Applied while bytes are copied (float32 arithmetic,
    one rounding). A state of unknown meaning is an error naming it."""

    factor: float = 1.0

    def inverse(self) -> Scale:
        return Scale(self.pattern, 1.0 / self.factor)

    def power(self, state: str, where: str) -> int:
        if state in WEIGHT_STATES:
            return 1
        if state in _FIRST_MOMENTS:
            return -1
        if state in _SECOND_MOMENTS:
            return -2
        raise FormatError(f"{where}: Scale does not know how state {state!r} transforms when the weights "
                          f"are scaled (known: weights {WEIGHT_STATES}, first moments {_FIRST_MOMENTS}, "
                          f"second moments {_SECOND_MOMENTS})")


@dataclass(frozen=True)
class Cast(Rule):
    """Mapping: read states ``states`` (default: the weight states) as ``dtype``; ``from_dtype``
    records the original so the rule can be inverted."""

    dtype: str = "float32"
    states: tuple[str, ...] = WEIGHT_STATES
    from_dtype: str = ""

    def inverse(self) -> Cast:
        if not self.from_dtype:
            raise FormatError(f"Cast({self.pattern!r}) needs from_dtype to be inverted")
        return Cast(self.pattern, self.from_dtype, self.states, self.dtype)


@dataclass(frozen=True)
class Expect(Rule):
    """Check (a mapping rule that changes nothing): every state of every tensor matching
    ``pattern`` has ``shape`` (``None``: any size in that dim); ``why`` (printed with the error)
    says where the expected sizes come from. Recipes begin with these, so a checkpoint that does
    not fit the config fails first, naming the tensor and the expected and found shapes, before
    any data is read::

        Expect(r"\\.self_attn\\.q_proj\\.weight$", (4096, None), "n_heads x head_dim = 32 x 128 rows")

    Its inverse is itself."""

    shape: tuple[int | None, ...] = ()
    why: str = ""

    def inverse(self) -> Expect:
        return self


class DroppedTensorsWarning(UserWarning):
    """Tensors a :class:`Drop` rule left out (one line naming them)."""


@dataclass(frozen=True)
class Drop(Rule):
    """Mapping: leave out the tensors matching ``pattern`` (what the target model has no place
    for: DeepSeek-V3's multi-token-prediction layers in a decoder without them), never silently:
    applying it warns (:class:`DroppedTensorsWarning`) with one line naming every dropped tensor
    and ``why``. Its inverse is itself (nothing comes back)::

        Drop(r"^model\\.layers\\.61\\.", "MTP layer: MaxText's decoder has none")
    """

    why: str = ""

    def inverse(self) -> Drop:
        return self


RULES: dict[str, type[Rule]] = {
    c.__name__: c
    for c in (Shard, Replicate, Fuse, Pad, Renumber, FlatPartition, State, Rename, Transpose, Reshape, SplitDim,
              MergeDims, Interleave, Deinterleave, Crop, Stack, Unstack, Split, Join, Scale, Cast, Expect, Drop)
}
LAYOUT_RULES = (Shard, Replicate, Fuse, Renumber, FlatPartition, State)


def rules_to_json(rules: Sequence[Rule | Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [r.to_json() if isinstance(r, Rule) else dict(r) for r in rules]


def rule_from_json(data: Mapping[str, Any]) -> Rule:
    kind = data.get("rule") if isinstance(data, Mapping) else None
    cls = RULES.get(str(kind))
    if cls is None:
        raise FormatError(f"unknown rule {kind!r}; known: {sorted(RULES)}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names - {"rule"})
    if unknown:
        raise FormatError(f"rule {kind}: unknown fields {unknown} (fields: {sorted(names)})")
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise FormatError(f"rule {kind}: {err}") from None


def invert(rules: Sequence[Rule]) -> list[Rule]:
    """The rules that undo ``rules`` (each mapping rule's inverse, in reverse order)."""
    return [r.inverse() for r in reversed(rules) if not isinstance(r, LAYOUT_RULES)]


# ------------------------------------------------------------------ applying mapping rules


def apply_rules(tensors: Mapping[str, LogicalTensor], rules: Sequence[Rule]) -> dict[str, LogicalTensor]:
    """Run mapping rules in order over logical tensors (metadata only; no data is read).

    Layout rules are descriptive and pass through. A rule that does not fit a
    tensor (a shape that does not divide, parts missing) raises before anything
    is read, naming the rule, the tensor, and the expected and found shapes.
    """
    out = dict(tensors)
    for rule in rules:
        handler = _HANDLERS.get(type(rule))
        if handler is not None:
            out = handler(out, rule)
    return out


def _per_state(rule: Rule, fn: Callable[[TensorState, str, str], TensorState]) -> Callable[..., Any]:
    def run(tensors: dict[str, LogicalTensor], _rule: Rule) -> dict[str, LogicalTensor]:
        out = {}
        for name, t in tensors.items():
            if not rule.matches(name):
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
    if isinstance(rule, Cast):
        return lambda st, s, w: T.cast(st, rule.dtype) if s in rule.states else st
    raise FormatError(f"no state transform for {type(rule).__name__}")


def _apply_rename(tensors: dict[str, LogicalTensor], rule: Rename) -> dict[str, LogicalTensor]:
    renamed: dict[str, LogicalTensor] = {}
    for name, t in tensors.items():
        new = re.sub(rule.pattern, rule.to, name)
        if new in renamed:
            raise FormatError(f"Rename({rule.pattern!r} -> {rule.to!r}) maps two tensors onto {new!r}")
        renamed[new] = LogicalTensor(new, t.states, t.scalars)
    return renamed


def _apply_expect(tensors: dict[str, LogicalTensor], rule: Expect) -> dict[str, LogicalTensor]:
    want = tuple(rule.shape)
    shown = "(" + ", ".join("*" if w is None else str(w) for w in want) + ("," if len(want) == 1 else "") + ")"
    for name, t in tensors.items():
        if not rule.matches(name):
            continue
        for s, st in t.states.items():
            found = tuple(st.shape)
            if len(found) != len(want) or any(w is not None and w != f for w, f in zip(want, found)):
                why = f" ({rule.why})" if rule.why else ""
                state = "" if s in WEIGHT_STATES else f" state {s!r}"
                raise ShapeMismatchError(f"tensor {name!r}{state}: expected shape {shown}{why}, found {found}")
    return tensors


def _apply_drop(tensors: dict[str, LogicalTensor], rule: Drop) -> dict[str, LogicalTensor]:
    gone = [name for name in tensors if rule.matches(name)]
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
    out: dict[str, LogicalTensor] = {}
    for name, t in tensors.items():
        m = re.search(rule.pattern, name)
        if m is None:
            out[name] = t
            continue
        target = re.sub(rule.pattern, rule.to, name)
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
                    lambda name, n: [re.sub(rule.pattern, rule.to, name).replace(hole, str(i)) for i in range(n)])


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

    return _fan_out(tensors, rule, parts,
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
                                    Scale, Cast)},
}


# ------------------------------------------------------------------ inverting renames


_GROUP = re.compile(r"\((\?P<(?P<name>\w+)>|\?:)?(?P<body>(?:[^()\\]|\\.)*)\)")


def _invert_rename(pattern: str, to: str, hole: int | str | None = None) -> tuple[str, str]:
    """The reverse ``(pattern, to)`` of a literal-with-groups rename such as
    ``^model\\.layers\\.(\\d+)\\.mlp$ -> layers/\\1/mlp``: each group of ``pattern`` that ``to``
    uses comes back as a group of the reverse pattern. ``hole`` (a group ``to`` does not use,
    e.g. a stacked index) becomes a ``\\x00`` marker in the reverse replacement."""
    body = pattern
    anchored_start, anchored_end = body.startswith("^"), body.endswith("$") and not body.endswith("\\$")
    body = body[1 if anchored_start else 0 : len(body) - (1 if anchored_end else 0)]
    literal: list[tuple[str, Any]] = []  # ("lit", text) or ("group", (number, name, regex))
    pos, number = 0, 0
    for m in _GROUP.finditer(body):
        literal.append(("lit", _unescape(body[pos : m.start()], pattern)))
        capturing = m.group(1) != "?:"
        if capturing:
            number += 1
            literal.append(("group", (number, m.group("name"), m.group("body"))))
        else:
            raise FormatError(f"cannot invert rename {pattern!r}: non-capturing groups")
        pos = m.end()
    literal.append(("lit", _unescape(body[pos:], pattern)))
    groups = {v[0]: v for k, v in literal if k == "group"}
    by_name = {v[1]: v[0] for v in groups.values() if v[1]}
    # the reverse pattern: ``to`` with its group references replaced by the groups' regexes
    rev_pattern, used, names = "", [], []  # a reverse group keeps the name of the group it came from
    for piece in re.split(r"(\\\d+|\\g<\w+>)", to):
        ref = re.fullmatch(r"\\(\d+)|\\g<(\w+)>", piece)
        if ref:
            n = int(ref.group(1)) if ref.group(1) else by_name[ref.group(2)]
            if n not in groups:
                raise FormatError(f"cannot invert rename {pattern!r} -> {to!r}: no group {n}")
            used.append(n)
            own = groups[n][1]
            names.append(own if own and own not in names else f"g{len(used)}")
            rev_pattern += f"(?P<{names[-1]}>{groups[n][2]})"
        else:
            rev_pattern += re.escape(piece)
    hole_n = by_name.get(hole) if isinstance(hole, str) else hole
    rev_to = ""
    for kind, v in literal:
        if kind == "lit":
            rev_to += v.replace("\\", "\\\\")
        elif v[0] == hole_n:
            rev_to += "\x00"
        elif v[0] in used:
            rev_to += f"\\g<{names[used.index(v[0])]}>"
        else:
            raise FormatError(f"cannot invert rename {pattern!r} -> {to!r}: group {v[0]} is dropped")
    return ("^" if anchored_start else "") + rev_pattern + ("$" if anchored_end else ""), rev_to


def _unescape(text: str, pattern: str) -> str:
    """A regex fragment that matches one literal string, as that string."""
    out, i = "", 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and not text[i + 1].isalnum():
            out += text[i + 1]
            i += 2
            continue
        if c in ".^$*+?{}[]|\\":
            raise FormatError(f"cannot invert rename {pattern!r}: {text!r} is not a literal")
        out += c
        i += 1
    return out

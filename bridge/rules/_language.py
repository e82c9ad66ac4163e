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
  has Adam moments ``exp_avg / c`` and ``exp_avg_sq / c**2``), :class:`Offset` (a weight
  shifted by ``b``: the moments stay), :class:`Cast`;
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

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from .._errors import FormatError
from .._read.model import WEIGHT_STATES
from ._inverse import invert_rename as _invert_rename

# ------------------------------------------------------------------ the rules

regex = functools.lru_cache(maxsize=4096)(re.compile)
"""A rule pattern compiled once: rules run over every tensor name (92k for DeepSeek-V3), and
``re.search(pattern, name)`` looks its pattern up in ``re``'s cache on every call."""



@dataclass(frozen=True)
class Rule:
    """Base of all rules; ``pattern`` is a regular expression over logical names."""

    pattern: str

    def matches(self, name: str) -> bool:
        return regex(self.pattern).search(name) is not None

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
    """Layout: numbers local to a rank (pipeline stage layers, an expert-parallel rank's experts);
    the global number adds ``offset``. The pattern's first group is the number::

        Renumber(r"\\.local_experts\\.(\\d+)\\.", axis="ep=1", offset=2).apply("l.local_experts.1.w")
        # -> 'l.local_experts.3.w'
    """

    axis: str = "pp"
    offset: int = 0

    def apply(self, name: str, count: int | None = None) -> str:
        """``name`` with its local number made global; ``count``: how many a rank holds (checked)."""
        m = regex(self.pattern).search(name)
        if m is None:
            return name
        local = int(m.group(1))
        if count is not None and local >= count:
            raise FormatError(f"{name}: local number {local} but each rank of {self.axis} holds {count}")
        return f"{name[:m.start(1)]}{local + self.offset}{name[m.end(1):]}"


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

    def part_names(self, name: str) -> list[str]:
        """The name of each part of the fused tensor ``name`` (``to`` with ``{part}`` filled)::

            Split(r"^(.*)\\.qkv$", r"\\1.{part}", parts=("q", "k", "v")).part_names("l0.qkv")
            # ['l0.q', 'l0.k', 'l0.v']
        """
        fused = regex(self.pattern).sub(self.to, name)
        return [fused.replace("{part}", p) for p in self.parts]

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
class Offset(Rule):
    """Mapping: weights plus ``offset`` (Gemma's RMSNorm stores ``w`` in HF and ``1 + w`` in MaxText:
    ``Offset(r"norm/scale$", 1.0)``), with each state's meaning: the weight states shift, the
    moments do not (``d(w + b) = dw``: the gradient, so Adam's ``exp_avg`` and ``exp_avg_sq``, is the
    same). Applied while bytes are copied, in float32: ``w + b`` rounded once, as numpy computes it;
    the inverse ``Offset(-b)`` rounds again, so ``(w + 1) - 1`` is what MaxText's own export gives,
    not always ``w``. A state of unknown meaning is an error naming it."""

    offset: float = 0.0

    def inverse(self) -> Offset:
        return Offset(self.pattern, -self.offset)

    def shifts(self, state: str, where: str) -> bool:
        if state in WEIGHT_STATES:
            return True
        if state in _FIRST_MOMENTS or state in _SECOND_MOMENTS:
            return False
        raise FormatError(f"{where}: Offset does not know how state {state!r} transforms when the weights "
                          f"are shifted (known: weights {WEIGHT_STATES}, moments {_FIRST_MOMENTS + _SECOND_MOMENTS})")


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
              MergeDims, Interleave, Deinterleave, Crop, Stack, Unstack, Split, Join, Scale, Offset, Cast, Expect, Drop)
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

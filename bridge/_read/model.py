"""The data model: logical tensors made of fragments.

A *logical tensor* is one consolidated tensor (a model weight, or one of its
optimizer states) with a global shape. Its bytes live in *fragments*: boxes
of the global index space (offset + shape) together with the place their
bytes are stored. Every format is described this way:

* a consolidated tensor in a file is one fragment;
* a tensor-parallel shard is one fragment;
* a ZeRO flat partition slice of a row-major tensor is a few boxes
  (partial row, full rows, partial row), see :func:`flat_range_fragments`;
* a transposed or stacked view is a fragment with permuted strides.

Everything here is an immutable value; reading happens in ``_read``::

    >>> w = LogicalTensor.single("w", {"fp32": TensorState("float32", (4, 6), (
    ...     Fragment(Box((0, 0), (4, 6)), FileRegion("/tmp/w.bin", 0, "float32", (6, 1))),))})
    >>> w.state("fp32").shape
    (4, 6)
"""

from __future__ import annotations

import itertools
import math
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

from .. import _dtypes
from .._errors import FormatError, ShapeMismatchError, TensorNotFoundError

if TYPE_CHECKING:
    import numpy as np

# States with these names hold the weights themselves; the first present is the default.
WEIGHT_STATES = ("fp32", "param")


def weight_state_for(dtype: str) -> str:
    """The state name weights of ``dtype`` take: ``param`` for 16-bit floats (the model's own
    low-precision copy), ``fp32`` otherwise (the weights are their own master copy)."""
    return "param" if dtype in ("bfloat16", "float16") else "fp32"


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a tensor's index space: ``offset`` and ``shape`` per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ShapeMismatchError(f"box offset {self.offset} and shape {self.shape} differ in rank")
        if self.shape and (min(self.shape) < 0 or min(self.offset) < 0):  # min: cheap for 100k tensors
            raise ShapeMismatchError(f"box {self.offset}+{self.shape} has a negative extent")

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(map(int, shape)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or ``None`` when they do not overlap."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(h <= a for a, h in zip(lo, hi)) and self.ndim:
            return None
        return Box(lo, tuple(h - a for a, h in zip(lo, hi)))

    def shift(self, origin: Sequence[int]) -> Box:
        """This box in coordinates whose zero is at ``origin``."""
        return Box(tuple(o - z for o, z in zip(self.offset, origin)), self.shape)

    def contains(self, other: Box) -> bool:
        return all(a <= b for a, b in zip(self.offset, other.offset)) and all(
            a >= b for a, b in zip(self.stop, other.stop)
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


class Reader(Protocol):
    """What a location reads through (``ckptbridge._read.executor.FileCache`` is the one implementation):
    open files shared by the reads of one checkpoint, and byte accounting."""

    def copy_region(self, region: FileRegion, box: Box, out: np.ndarray) -> int: ...


class Location(Protocol):
    """Where a fragment's bytes are. Implementations are frozen dataclasses."""

    dtype: str

    def read_into(self, box: Box, out: np.ndarray, files: Reader) -> int:
        """Copy the part ``box`` (relative to the fragment) into ``out``; return bytes read."""
        ...

    def describe(self) -> str:
        """Short human text: file and offset."""
        ...

    def narrow(self, box: Box) -> Location:
        """The location of sub-box ``box`` (relative to this fragment)."""
        ...

    def permute(self, perm: Sequence[int]) -> Location:
        """The location of this fragment with its dims reordered (a transpose)."""
        ...

    def insert_dim(self, dim: int) -> Location:
        """The same bytes seen with a new size-1 dim at ``dim`` (for stacking)."""
        ...

    def drop_dim(self, dim: int) -> Location:
        """The same bytes without size-1 dim ``dim`` (for unstacking)."""
        ...


@dataclass(frozen=True)
class FileRegion:
    """Bytes in a local file: element ``idx`` of the fragment is at
    ``offset + sum(idx[d] * strides[d]) * itemsize``.

    ``strides`` are in elements and may be any permutation (a transposed view)
    or the strides of a larger tensor (a box cut out of a flat buffer).
    """

    file: str
    offset: int
    dtype: str
    strides: tuple[int, ...]

    def read_into(self, box: Box, out: np.ndarray, files: Reader) -> int:
        return files.copy_region(self, box, out)

    def describe(self) -> str:
        return f"{self.file}@{self.offset}"

    def narrow(self, box: Box) -> FileRegion:
        shift = sum(o * s for o, s in zip(box.offset, self.strides)) * _dtypes.itemsize(self.dtype)
        return FileRegion(self.file, self.offset + shift, self.dtype, self.strides)

    def permute(self, perm: Sequence[int]) -> FileRegion:
        return FileRegion(self.file, self.offset, self.dtype, tuple(self.strides[p] for p in perm))

    def insert_dim(self, dim: int) -> FileRegion:
        return FileRegion(self.file, self.offset, self.dtype, (*self.strides[:dim], 0, *self.strides[dim:]))

    def drop_dim(self, dim: int) -> FileRegion:
        return FileRegion(self.file, self.offset, self.dtype, self.strides[:dim] + self.strides[dim + 1 :])

    def extent(self, shape: Sequence[int]) -> int:
        """Bytes from ``offset`` to one past the last element of a fragment of ``shape``."""
        if any(s == 0 for s in shape):
            return 0
        last = sum((s - 1) * st for s, st in zip(shape, self.strides))
        return (last + 1) * _dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class Fragment:
    """A box of a logical tensor and where its bytes are.

    ``checksum`` (``"crc32:xxxxxxxx"``) covers the fragment's elements in
    row-major order as stored, when the writer recorded one.
    """

    box: Box
    location: Any  # a Location
    checksum: str | None = None


@dataclass(frozen=True)
class TensorState:
    """One state of a logical tensor (``fp32``, ``exp_avg``, ...): its dtype, shape and fragments.

    The fragments partition ``shape``: no overlaps, no holes.
    """

    dtype: str
    shape: tuple[int, ...]
    fragments: tuple[Fragment, ...]

    def __post_init__(self) -> None:
        _dtypes.to_numpy(self.dtype)
        if len(self.fragments) == 1 and self.fragments[0].box.shape == self.shape and not any(
                self.fragments[0].box.offset):  # one whole fragment (most tensors): nothing else to check
            return
        full = Box.full(self.shape)
        for f in self.fragments:
            if f.box.ndim != len(self.shape) or not full.contains(f.box):
                raise ShapeMismatchError(
                    f"fragment {f.box.offset}+{f.box.shape} lies outside shape {self.shape}"
                )
        covered = sum(f.box.size for f in self.fragments)
        if covered != full.size:
            raise ShapeMismatchError(
                f"fragments cover {covered} of {full.size} elements of shape {self.shape}"
            )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class LogicalTensor:
    """A named tensor of the consolidated model with its states.

    ``scalars`` holds per-tensor numbers such as the Adam ``step``.
    """

    name: str
    states: Mapping[str, TensorState]
    scalars: Mapping[str, float | int] = field(default_factory=dict)

    @staticmethod
    def single(name: str, states: Mapping[str, TensorState], **scalars: float | int) -> LogicalTensor:
        return LogicalTensor(name, dict(states), dict(scalars))

    @property
    def weight_state(self) -> str:
        """The state that holds the weights: ``fp32`` if present, else ``param``, else the first."""
        for s in WEIGHT_STATES:
            if s in self.states:
                return s
        return next(iter(self.states))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.states[self.weight_state].shape

    def state(self, name: str | None = None) -> TensorState:
        key = self.weight_state if name is None else name
        try:
            return self.states[key]
        except KeyError:
            raise TensorNotFoundError(
                f"tensor {self.name!r} has no state {key!r}; it has {sorted(self.states)}"
            ) from None


class TensorSpec(NamedTuple):
    """What a :class:`LazyTensors` knows of a tensor before building it: the dtype and shape of its
    weights (checked when the checkpoint is opened) and what its builder needs (``source``)."""

    dtype: str
    shape: tuple[int, ...]
    source: Any


def tensor_specs(names: Iterable[str], dtypes: Iterable[str], shapes: Iterable[tuple[int, ...]],
                 sources: Iterable[Any]) -> dict[str, TensorSpec]:
    """``{name: TensorSpec(dtype, shape, source)}`` from columns, in C loops (no Python frame per tensor:
    ``TensorSpec._make`` has one; DeepSeek-V3 opens 92k of them)::

        tensor_specs(["w"], ["float32"], [(4, 6)], [("/tmp/w.safetensors", 80)])["w"].shape   # (4, 6)
    """
    return dict(zip(names, map(tuple.__new__, itertools.repeat(TensorSpec), zip(dtypes, shapes, sources))))


S = TypeVar("S", bound=TensorSpec)
Layout = Mapping[str, tuple[str, tuple[int, ...]]]
"""Each state of a tensor with its dtype and shape: what rules check before a tensor is built."""


def param_layout(spec: TensorSpec) -> Layout:
    """The layout of a tensor stored as its weights only: one ``param`` state of the spec's dtype and shape."""
    return {"param": (spec.dtype, spec.shape)}


class LazyTensors(Mapping[str, LogicalTensor], Generic[S]):
    """Logical tensors built on first access, from one validated :class:`TensorSpec` per name.

    Opening DeepSeek-V3 (92k stored tensors, 46k after dequantization) checks every header entry,
    name, dtype and shape, but builds the fragments and states of a tensor only when it is used;
    names, ``len``, ``meta`` and ``layout`` need no building. Built tensors are kept (they are immutable).
    ``layout`` gives each state's dtype and shape from a spec (default :func:`param_layout`: the builder
    makes one ``param`` state)::

        specs = {"w": TensorSpec("float32", (4, 6), ("/tmp/w.safetensors", 80))}
        tensors = LazyTensors(specs, lambda name, spec: LogicalTensor(name, {"param": ...}))
        tensors.meta("w").shape, len(tensors), tensors.layout("w"), tensors["w"].state()
    """

    def __init__(self, specs: Mapping[str, S], build: Callable[[str, S], LogicalTensor],
                 layout: Callable[[S], Layout] = param_layout) -> None:
        self._specs = specs
        self._build = build
        self._layout = layout
        self._built: dict[str, LogicalTensor] = {}

    def meta(self, name: str) -> S:
        """The spec of ``name`` (dtype, shape, source), without building it."""
        return self._specs[name]

    @property
    def specs(self) -> types.MappingProxyType[str, S]:
        """Every spec by name, read-only (bulk passes: ``map(tensors.specs.__getitem__, names)`` is a C loop)."""
        return types.MappingProxyType(self._specs)

    def layout(self, name: str) -> Layout:
        """Each state of ``name`` with its dtype and shape, without building it."""
        return self._layout(self._specs[name])

    def layouts(self, names: Iterable[str]) -> list[Layout]:
        """``[self.layout(name) for name in names]`` with equal layouts one object (rules map each once);
        C loops for the default :func:`param_layout` (92k tensors for DeepSeek-V3)."""
        if self._layout is param_layout:
            keys = list(map(operator.itemgetter(0, 1), map(self._specs.__getitem__, names)))
            shared = {key: {"param": key} for key in set(keys)}
            return list(map(shared.__getitem__, keys))
        seen: dict[tuple[Any, ...], Layout] = {}
        return [seen.setdefault(tuple(layout.items()), layout) for layout in map(self.layout, names)]

    def __getitem__(self, name: str) -> LogicalTensor:
        t = self._built.get(name)
        if t is None:
            t = self._built[name] = self._build(name, self._specs[name])
        return t

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def spec_of(tensors: Mapping[str, LogicalTensor], name: str) -> TensorSpec:
    """The dtype and shape of ``name``'s weights (its spec when ``tensors`` is lazy: nothing is built)."""
    if isinstance(tensors, LazyTensors):
        spec: TensorSpec = tensors.meta(name)
        return spec
    state = tensors[name].state()
    return TensorSpec(state.dtype, state.shape, None)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[Box]:
    """Decompose the flat row-major range ``[start, stop)`` of ``shape`` into boxes.

    Each box is contiguous in row-major order (leading dims 1, one partial dim,
    trailing dims full), so a ZeRO partition slice becomes at most
    ``2 * ndim - 1`` boxes::

        >>> [b.shape for b in flat_range_boxes((4, 6), 3, 17)]
        [(1, 3), (1, 6), (1, 5)]
    """
    shape = tuple(map(int, shape))
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ShapeMismatchError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return
    if not shape:
        yield Box((), ())
        return
    inner = math.prod(shape[1:])
    if inner == 0:
        return
    first, rem_a = divmod(start, inner)
    last, rem_b = divmod(stop, inner)
    if first == last:  # inside one slab of the leading dim
        for b in flat_range_boxes(shape[1:], rem_a, rem_b):
            yield Box((first, *b.offset), (1, *b.shape))
        return
    if rem_a:
        for b in flat_range_boxes(shape[1:], rem_a, inner):
            yield Box((first, *b.offset), (1, *b.shape))
        first += 1
    if last > first:
        yield Box((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]))
    if rem_b:
        for b in flat_range_boxes(shape[1:], 0, rem_b):
            yield Box((last, *b.offset), (1, *b.shape))


def flat_range_fragments(
    shape: Sequence[int], start: int, stop: int, file: str, byte_offset: int, dtype: str
) -> tuple[Fragment, ...]:
    """Fragments for elements ``[start, stop)`` of a row-major tensor of ``shape``
    stored contiguously in ``file`` from ``byte_offset`` on (element ``start`` first)."""
    strides = c_strides(shape)
    size = _dtypes.itemsize(dtype)
    out = []
    for box in flat_range_boxes(shape, start, stop):
        flat = sum(o * s for o, s in zip(box.offset, strides))
        out.append(Fragment(box, FileRegion(file, byte_offset + (flat - start) * size, dtype, strides)))
    return tuple(out)


def contiguous_fragment(shape: Sequence[int], file: str, byte_offset: int, dtype: str) -> Fragment:
    """A whole tensor stored row-major at ``byte_offset`` of ``file``."""
    shape = tuple(map(int, shape))
    return Fragment(Box.full(shape), FileRegion(file, byte_offset, dtype, c_strides(shape)))


def check_name(name: str, where: str) -> str:
    """Reject tensor names that cannot be stored (empty, NUL bytes, absurd length)."""
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 4096:
        raise FormatError(f"{where}: invalid tensor name {name!r}")
    return name

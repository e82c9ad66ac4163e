"""Derived tensors: a logical tensor whose bytes are computed, per slice, from several stored ones.

A quantized weight and its block scales give one dequantized tensor (block fp8, MXFP4); a base
weight and a LoRA pair give the merged weight. The core knows no format: a :class:`Derivation`
(written by an adapter) says which box of each source a requested box needs
(``source_boxes``, a pure function) and how to compute the requested values from them
(``compute``). :class:`DerivedRegion` is the location of such a tensor: it reads only those
source boxes, through the same reader and byte accounting as every other location, and computes
the request. It is one fragment of an ordinary :class:`~ckptbridge.plugin.TensorState` of the
output dtype, so slicing, ``read``, ``convert``, ``reshard``, ``diff``, the device loaders and the
rules (renames, transposes, stacks, reshapes: views of it) all see an ordinary tensor::

    @dataclass(frozen=True)
    class Doubled:                                     # a derivation: value = 2 * source
        def source_boxes(self, box): return (box,)
        def compute(self, box, sources, out): np.multiply(sources[0], 2, out=out)
        def describe(self): return "x2"

    state = derived_state(Doubled(), (stored,), stored.shape, "float32", ("w",))
    read_state(state, Box((0, 0), (2, 3)), files)      # reads rows 0..1 of ``stored`` only

Values are computed in ``compute``'s own precision into an array of the derived dtype, then cast
to the reader's dtype: a derived bfloat16 tensor read as float32 gives its bfloat16 values widened,
as any bfloat16 tensor does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from .. import _dtypes
from .copyto import copyto
from .executor import FileCache, execute
from .model import Box, Fragment, Reader, TensorState
from .plan import plan
from .views import ViewRegion, as_view, canonical


class Derivation(Protocol):
    """How a derived tensor is computed from its sources (implementations: frozen dataclasses)."""

    def source_boxes(self, box: Box) -> tuple[Box, ...]:
        """The box of each source that the derived box ``box`` needs (pure; no I/O)."""
        ...

    def compute(self, box: Box, sources: Sequence[np.ndarray], out: np.ndarray) -> None:
        """Fill ``out`` (``box``'s shape, the derived dtype) from the source boxes' values."""
        ...

    def describe(self) -> str:
        """Short human text (``"fp8 block 128x128"``)."""
        ...


@dataclass(frozen=True)
class DerivedRegion:
    """The whole of a derived tensor of ``shape``/``dtype``: ``derivation`` over ``sources``
    (stored tensor states, read through their own fragments), ``names`` labelling each source
    in errors. Narrowed, permuted or stacked, it becomes a :class:`ViewRegion` over itself."""

    derivation: Any  # a Derivation
    sources: tuple[TensorState, ...]
    shape: tuple[int, ...]
    dtype: str
    names: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.derivation.describe()} of {', '.join(self.names)}"

    def read_into(self, box: Box, out: np.ndarray, files: Reader) -> int:
        if box.size == 0:
            return 0
        boxes = self.derivation.source_boxes(box)  # the reader is a FileCache (the one Reader)
        total = 0
        arrays = []
        for src, sbox, label in zip(self.sources, boxes, self.names):
            arr = np.empty(sbox.shape, dtype=_dtypes.to_numpy(src.dtype))
            total += execute(plan(src.fragments, sbox, label), arr, cast(FileCache, files), label)
            arrays.append(arr)
        own = _dtypes.to_numpy(self.dtype)
        dst = out if out.dtype == own and out.flags.writeable else np.empty(box.shape, dtype=own)
        self.derivation.compute(box, arrays, dst)
        if dst is not out:
            copyto(out, dst)
        return total

    def narrow(self, box: Box) -> ViewRegion:
        return ViewRegion(self, box.offset, tuple(canonical(((n, d, 1),)) for d, n in enumerate(box.shape)))

    def permute(self, perm: Sequence[int]) -> ViewRegion:
        return as_view(self, self.shape).permute(perm)

    def insert_dim(self, dim: int) -> ViewRegion:
        return as_view(self, self.shape).insert_dim(dim)

    def drop_dim(self, dim: int) -> Any:
        return as_view(self, self.shape).drop_dim(dim)


def derived_state(derivation: Any, sources: Sequence[TensorState], shape: Sequence[int], dtype: str,
                  names: Sequence[str]) -> TensorState:
    """A tensor state of ``shape``/``dtype`` computed by ``derivation`` from ``sources`` (one fragment)."""
    shape = tuple(map(int, shape))
    region = DerivedRegion(derivation, tuple(sources), shape, dtype, tuple(names))
    return TensorState(dtype, shape, (Fragment(Box.full(shape), region),))

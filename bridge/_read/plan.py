"""Planning: which fragment bytes land where. Pure functions, no I/O.

``plan(fragments, request)`` intersects the request box with every fragment
and returns one :class:`CopyOp` per overlap; the executor in ``_read``
performs them. The same function serves every target layout: a JAX device's
index box, a DTensor's local shard, a Megatron TP slice or a ZeRO partition::

    >>> from ckptbridge._read.model import Box
    >>> ops = plan(state.fragments, Box((0, 8), (4, 8)))   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import ShapeMismatchError
from .model import Box, Fragment


@dataclass(frozen=True)
class CopyOp:
    """Copy ``src`` (relative to ``fragment.box``) into ``dst`` (relative to the request)."""

    fragment: Fragment
    src: Box
    dst: Box


def plan(fragments: Sequence[Fragment], request: Box, name: str = "tensor") -> tuple[CopyOp, ...]:
    """Copy operations that fill ``request`` from ``fragments``.

    Raises ``ShapeMismatchError`` naming ``name`` when the fragments do not
    cover the request (a missing shard, or a request outside the tensor).
    """
    ops = []
    covered = 0
    for frag in fragments:
        if frag.box.ndim != request.ndim:
            raise ShapeMismatchError(
                f"{name}: request of rank {request.ndim} against a fragment of rank {frag.box.ndim}"
            )
        common = frag.box.intersect(request)
        if common is None or common.size == 0:
            continue
        ops.append(CopyOp(frag, common.shift(frag.box.offset), common.shift(request.offset)))
        covered += common.size
    if covered != request.size:
        raise ShapeMismatchError(
            f"{name}: fragments cover {covered} of the {request.size} elements requested "
            f"at {request.offset}+{request.shape}"
        )
    return tuple(ops)


def normalize_index(index: object, shape: Sequence[int]) -> tuple[Box, tuple[Any, ...]]:
    """Turn a numpy-style index into (covering box, index to apply to the box's array).

    Integers and unit-step slices are read exactly; strided slices read their
    covering box and are stepped afterwards.
    """
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * fill + index[at + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for a tensor of shape {tuple(shape)}")
    index = index + (slice(None),) * (len(shape) - len(index))
    offset: list[int] = []
    extent: list[int] = []
    post: list[slice | int] = []
    for i, n in zip(index, shape):
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step < 0:
                raise IndexError("negative slice steps are not supported; read and flip instead")
            length = max(0, (stop - start + step - 1) // step)
            span = (length - 1) * step + 1 if length else 0
            offset.append(start if length else 0)
            extent.append(span)
            post.append(slice(None, None, step) if step != 1 else slice(None))
        elif isinstance(i, int) or hasattr(i, "__index__"):
            k = int(i)
            if not -n <= k < n:
                raise IndexError(f"index {k} out of range for a dimension of size {n}")
            offset.append(k % n)
            extent.append(1)
            post.append(0)
        else:
            raise IndexError(f"unsupported index {i!r}: use integers and slices")
    return Box(tuple(offset), tuple(extent)), tuple(post)

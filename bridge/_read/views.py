"""Locations that are views of other locations: reshaped / permuted, scaled, or zeros.

The rule language reshapes and permutes tensors without reading them, so a
fragment's bytes must stay where they are while the fragment is seen with
other dims. :class:`ViewRegion` does this for any location: each of its dims
is a list of *factors* ``(extent, base_dim, step)`` in mixed radix, outer
first, so view index ``i`` of that dim is ``sum(digit_k * step_k)`` added to
base dim ``base_dim_k``. Splitting a dim splits its factor list, merging
dims concatenates them, so a rotary interleave (``[H*D] -> [H, 2, D/2] ->
[H, D/2, 2] -> [H*D]``) stays one fragment per source fragment instead of
one per row. A view over a :class:`~ckptbridge._read.model.FileRegion` reads
straight from the file through expanded strides (no temporary copy); over
other locations (TensorStore) it reads the covering box and views it.

:class:`ScaledRegion` multiplies values (and adds an offset) while they are copied (the
value transforms of the rules); :class:`ZeroRegion` is padding that was never stored::

    v = as_view(frag.location, frag.box.shape)      # identity view
    v = split_dim(v, 0, (32, 128))                   # [4096, E] -> [32, 128, E]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes
from .._errors import ShapeMismatchError
from .copyto import copyto
from .model import Box, FileRegion, Reader

Factor = tuple[int, int, int]  # (extent, base dim, step in base indices)
Dim = tuple[Factor, ...]


# ------------------------------------------------------------------ factor algebra (pure)


def dim_extent(dim: Dim) -> int:
    return math.prod(e for e, _, _ in dim)


def canonical(dim: Sequence[Factor]) -> Dim:
    """Drop extent-1 factors and join neighbours that walk one base dim contiguously."""
    out: list[Factor] = []
    for e, b, s in dim:
        if e == 1:
            continue
        if out:
            e0, b0, s0 = out[-1]
            if b0 == b and s0 == e * s:
                out[-1] = (e0 * e, b, s)
                continue
        out.append((e, b, s))
    return tuple(out)


def range_pieces(dim: Dim, start: int, length: int) -> list[tuple[int, int, dict[int, int], Dim]]:
    """Split ``[start, start + length)`` of a dim into pieces that are each one strided walk.

    Returns ``(offset in the range, length, base-index shift per base dim, factors)`` per piece,
    in order (at most ``2 * len(dim) - 1`` pieces, like a flat range cut into rows)::

        >>> range_pieces(((4, 0, 10), (3, 0, 1)), 2, 6)   # rows of 3: [2], [3..5], [6, 7]
        [(0, 1, {0: 2}, ()), (1, 3, {0: 10}, ((3, 0, 1),)), (4, 2, {0: 20}, ((2, 0, 1),))]
    """
    if length <= 0:
        return []
    if not dim:
        return [(0, length, {}, ())]
    _, b0, s0 = dim[0]
    inner = dim[1:]
    p = dim_extent(inner)
    q0, r0 = divmod(start, p)
    q1, r1 = divmod(start + length, p)

    def shifted(q: int, pieces: list[tuple[int, int, dict[int, int], Dim]], at: int) -> list[Any]:
        out = []
        for st, ln, off, f in pieces:
            off = dict(off)
            off[b0] = off.get(b0, 0) + q * s0
            out.append((at + st, ln, off, f))
        return out

    if r0 == 0 and r1 == 0:
        return [(0, length, {b0: q0 * s0}, canonical(((q1 - q0, b0, s0), *inner)))]
    if q0 == q1:
        return shifted(q0, range_pieces(inner, r0, length), 0)
    out: list[tuple[int, int, dict[int, int], Dim]] = []
    at = 0
    if r0:
        out += shifted(q0, range_pieces(inner, r0, p - r0), 0)
        at, q0 = p - r0, q0 + 1
    if q1 > q0:
        out.append((at, (q1 - q0) * p, {b0: q0 * s0}, canonical(((q1 - q0, b0, s0), *inner))))
        at += (q1 - q0) * p
    if r1:
        out += shifted(q1, range_pieces(inner, 0, r1), at)
    return out


def split_factors(dim: Dim, sizes: Sequence[int]) -> list[Dim] | None:
    """The factor lists of ``sizes`` (outer first) whose row-major product is ``dim``, or None
    when a factor cannot be cut at a size boundary (then the caller cuts the fragment instead)."""
    if math.prod(sizes) != dim_extent(dim):
        raise ShapeMismatchError(f"cannot split a dim of {dim_extent(dim)} into {tuple(sizes)}")
    rest = list(dim)
    out: list[Dim] = []
    for size in reversed(sizes[1:]):
        take: list[Factor] = []
        need = size
        while need > 1:
            if not rest:
                return None
            e, b, s = rest.pop()
            if need % e == 0:
                take.insert(0, (e, b, s))
                need //= e
            elif e % need == 0:
                rest.append((e // need, b, s * need))
                take.insert(0, (need, b, s))
                need = 1
            else:
                return None
        out.insert(0, canonical(take))
    out.insert(0, canonical(rest))
    return out


# ------------------------------------------------------------------ locations


@dataclass(frozen=True)
class ViewRegion:
    """Another location's bytes seen through reshaped, permuted dims (see the module doc).

    ``base`` is the location of a fragment whose box is ``[0, base_shape)``; ``origin`` is the base
    index of this view's element 0; ``dims`` the factors of each view dim.
    """

    base: Any
    origin: tuple[int, ...]
    dims: tuple[Dim, ...]

    @property
    def dtype(self) -> str:
        return str(self.base.dtype)

    def describe(self) -> str:
        return f"{self.base.describe()} (view)"

    def pieces(self, box: Box) -> list[tuple[Box, ViewRegion]]:
        """``box`` (relative to this fragment) cut into sub-boxes that are each one strided view."""
        per_dim = [range_pieces(d, o, n) for d, o, n in zip(self.dims, box.offset, box.shape)]
        out = []
        for combo in itertools.product(*per_dim):
            origin = list(self.origin)
            for _, _, shift, _ in combo:
                for b, v in shift.items():
                    origin[b] += v
            sub = Box(tuple(o + st for o, (st, _, _, _) in zip(box.offset, combo)),
                      tuple(ln for _, ln, _, _ in combo))
            out.append((sub, ViewRegion(self.base, tuple(origin), tuple(f for _, _, _, f in combo))))
        return out

    def narrow(self, box: Box) -> Any:
        parts = self.pieces(box)
        if len(parts) != 1:
            raise ShapeMismatchError(f"{self.describe()}: box {box.offset}+{box.shape} is not one strided view")
        return simplify(parts[0][1])

    def permute(self, perm: Sequence[int]) -> ViewRegion:
        return ViewRegion(self.base, self.origin, tuple(self.dims[p] for p in perm))

    def insert_dim(self, dim: int) -> ViewRegion:
        return ViewRegion(self.base, self.origin, (*self.dims[:dim], (), *self.dims[dim:]))

    def drop_dim(self, dim: int) -> Any:
        if dim_extent(self.dims[dim]) != 1:
            raise ShapeMismatchError(f"{self.describe()}: dim {dim} has extent {dim_extent(self.dims[dim])}, not 1")
        return simplify(ViewRegion(self.base, self.origin, self.dims[:dim] + self.dims[dim + 1 :]))

    def read_into(self, box: Box, out: np.ndarray, files: Reader) -> int:
        total = 0
        for sub, view in self.pieces(box):
            dst = out[tuple(slice(o - b, o - b + n) for o, b, n in zip(sub.offset, box.offset, sub.shape))]
            total += view._read_whole(dst, files)
        return total

    def _expanded(self) -> tuple[tuple[int, ...], list[Factor]]:
        shape, factors = [], []
        for d in self.dims:
            for f in d or ((1, 0, 0),):
                shape.append(f[0])
                factors.append(f)
        return tuple(shape), factors

    def _read_whole(self, out: np.ndarray, files: Reader) -> int:
        """Read this whole view (its dims' factors cover ``out`` exactly) into ``out``."""
        shape, factors = self._expanded()
        dst = out.view()
        dst.shape = shape  # splitting dims of a view never copies (raises otherwise)
        if isinstance(self.base, FileRegion):
            base = self.base
            size = _dtypes.itemsize(base.dtype)
            offset = base.offset + sum(o * s for o, s in zip(self.origin, base.strides)) * size
            region = FileRegion(base.file, offset, base.dtype, tuple(s * base.strides[b] for _, b, s in factors))
            return int(files.copy_region(region, Box.full(shape), dst))
        hi = list(self.origin)
        for e, b, s in factors:
            hi[b] += (e - 1) * s
        cover = Box(self.origin, tuple(h - o + 1 for h, o in zip(hi, self.origin)))
        tmp = np.empty(cover.shape, dtype=_dtypes.to_numpy(self.dtype))
        n = int(self.base.read_into(cover, tmp, files))
        src = np.lib.stride_tricks.as_strided(tmp, shape, tuple(s * tmp.strides[b] for _, b, s in factors),
                                              writeable=False)
        copyto(dst, src)
        return n


def as_view(loc: Any, shape: Sequence[int]) -> ViewRegion:
    """The identity view of a fragment of ``shape`` stored at ``loc``.

    A file region becomes a view over its whole file as one flat array of its dtype, so
    that walks over the same file compare, join and simplify by their element strides."""
    if isinstance(loc, ViewRegion):
        return loc
    if isinstance(loc, FileRegion):
        size = _dtypes.itemsize(loc.dtype)
        base_offset, start = (0, loc.offset // size) if loc.offset % size == 0 else (loc.offset, 0)
        flat = FileRegion(loc.file, base_offset, loc.dtype, (1,))
        return ViewRegion(flat, (start,), tuple(canonical(((int(n), 0, st),)) for n, st in zip(shape, loc.strides)))
    return ViewRegion(loc, (0,) * len(shape), tuple(canonical(((int(n), d, 1),)) for d, n in enumerate(shape)))


def simplify(view: ViewRegion) -> Any:
    """A plain :class:`FileRegion` when every dim of a view over one is a single stride."""
    if isinstance(view.base, FileRegion) and all(len(d) <= 1 for d in view.dims):
        base = view.base
        size = _dtypes.itemsize(base.dtype)
        offset = base.offset + sum(o * s for o, s in zip(view.origin, base.strides)) * size
        return FileRegion(base.file, offset, base.dtype,
                          tuple(d[0][2] * base.strides[d[0][1]] if d else 0 for d in view.dims))
    return view


def split_dim(loc: Any, shape: Sequence[int], dim: int, sizes: Sequence[int]) -> Any | None:
    """``loc`` (of a fragment of ``shape``) with ``dim`` split into ``sizes``, or None if not strided."""
    view = as_view(loc, shape)
    parts = split_factors(view.dims[dim], sizes)
    if parts is None:
        return None
    return simplify(ViewRegion(view.base, view.origin, (*view.dims[:dim], *parts, *view.dims[dim + 1 :])))


def merge_dims(loc: Any, shape: Sequence[int], dim: int, count: int) -> Any:
    """``loc`` with dims ``dim .. dim + count - 1`` merged into one (row-major); the fragment must
    cover those dims fully except the first (which a row-major flattening requires)."""
    view = as_view(loc, shape)
    merged = canonical(tuple(f for d in view.dims[dim : dim + count] for f in d))
    return simplify(ViewRegion(view.base, view.origin, (*view.dims[:dim], merged, *view.dims[dim + count :])))


def pieces(loc: Any, box: Box) -> list[tuple[Box, Any]]:
    """``box`` of a location cut into sub-boxes each of which narrows to one location."""
    if isinstance(loc, ViewRegion):
        return [(b, simplify(v)) for b, v in loc.pieces(box)]
    if isinstance(loc, ScaledRegion):
        return [(b, loc._on(p)) for b, p in pieces(loc.base, box)]
    return [(box, loc.narrow(box))]


@dataclass(frozen=True)
class ScaledRegion:
    """``base``'s values times ``scale`` plus ``offset``, computed in float32 (float64 for float64
    data) and then cast to the reader's dtype: for float32 data one rounding per operation, as
    ``w * c`` or ``w + b`` in numpy/torch/JAX (a scale and an offset both set: ``w * c + b``)."""

    base: Any
    scale: float
    offset: float = 0.0

    @property
    def dtype(self) -> str:
        return str(self.base.dtype)

    def describe(self) -> str:
        return f"{self.base.describe()} x {self.scale!r}" + (f" + {self.offset!r}" if self.offset else "")

    def read_into(self, box: Box, out: np.ndarray, files: Reader) -> int:
        work = np.float64 if self.dtype == "float64" else np.float32
        tmp = out if out.dtype == work else np.empty(box.shape, dtype=work)
        n = int(self.base.read_into(box, tmp, files))
        if self.scale != 1.0:
            np.multiply(tmp, work(self.scale), out=tmp)
        if self.offset:
            np.add(tmp, work(self.offset), out=tmp)
        if tmp is not out:
            np.copyto(out, tmp, casting="unsafe")
        return n

    def _on(self, base: Any) -> ScaledRegion:
        return ScaledRegion(base, self.scale, self.offset)

    def narrow(self, box: Box) -> ScaledRegion:
        return self._on(self.base.narrow(box))

    def permute(self, perm: Sequence[int]) -> ScaledRegion:
        return self._on(self.base.permute(perm))

    def insert_dim(self, dim: int) -> ScaledRegion:
        return self._on(self.base.insert_dim(dim))

    def drop_dim(self, dim: int) -> ScaledRegion:
        return self._on(self.base.drop_dim(dim))


@dataclass(frozen=True)
class ZeroRegion:
    """Elements that hold zero and are stored nowhere (padding added by a rule)."""

    dtype: str

    def describe(self) -> str:
        return "zeros"

    def read_into(self, box: Box, out: np.ndarray, files: Reader) -> int:
        out[...] = 0
        return 0

    def narrow(self, box: Box) -> ZeroRegion:
        return self

    def permute(self, perm: Sequence[int]) -> ZeroRegion:
        return self

    def insert_dim(self, dim: int) -> ZeroRegion:
        return self

    def drop_dim(self, dim: int) -> ZeroRegion:
        return self


def reshape_location(loc: Any, shape: Sequence[int], dim: int, sizes: Sequence[int]) -> Any | None:
    """Split for value-transform wrappers too (a scaled view splits its base)."""
    if isinstance(loc, ScaledRegion):
        inner = reshape_location(loc.base, shape, dim, sizes)
        return None if inner is None else loc._on(inner)
    if isinstance(loc, ZeroRegion):
        return loc
    return split_dim(loc, shape, dim, sizes)


def merge_location(loc: Any, shape: Sequence[int], dim: int, count: int) -> Any:
    if isinstance(loc, ScaledRegion):
        return loc._on(merge_location(loc.base, shape, dim, count))
    if isinstance(loc, ZeroRegion):
        return loc
    return merge_dims(loc, shape, dim, count)


def join(a: Any, b: Any, shape_a: Sequence[int], dim: int) -> Any | None:
    """One location for two fragments adjacent along ``dim`` (``b`` right after ``a``, whose box has
    ``shape_a``), when their bytes continue the same strided walk; else None."""
    n = shape_a[dim]
    if isinstance(a, FileRegion) and isinstance(b, FileRegion):
        if (a.file == b.file and a.dtype == b.dtype and a.strides == b.strides
                and b.offset == a.offset + n * a.strides[dim] * _dtypes.itemsize(a.dtype)):
            return a
        return None
    if isinstance(a, ZeroRegion) and isinstance(b, ZeroRegion):
        return a if a.dtype == b.dtype else None
    if isinstance(a, ScaledRegion) and isinstance(b, ScaledRegion):
        if (a.scale, a.offset) != (b.scale, b.offset):
            return None
        inner = join(a.base, b.base, shape_a, dim)
        return None if inner is None else a._on(inner)
    if isinstance(a, ViewRegion) and isinstance(b, ViewRegion):
        if a.base != b.base or len(a.dims) != len(b.dims):
            return None
        if any(x != y for d, (x, y) in enumerate(zip(a.dims, b.dims)) if d != dim):
            return None
        da, db = a.dims[dim], b.dims[dim]
        if not da or not db or da[1:] != db[1:] or da[0][1:] != db[0][1:]:
            return None
        e, base_dim, step = da[0]
        shift = [0] * len(a.origin)
        shift[base_dim] = e * step
        if tuple(o + s for o, s in zip(a.origin, shift)) != b.origin:
            return None
        dims = list(a.dims)
        dims[dim] = ((e + db[0][0], base_dim, step), *da[1:])
        return ViewRegion(a.base, a.origin, tuple(dims))
    return None

"""Fragment-level transforms: the vocabulary rules and adapters build on.

Each takes tensor states (shape, dtype, fragments) and returns new ones
without reading any data: fragments keep pointing at the same bytes and only
their boxes and locations change. Reshapes and permutations become strided
views (:mod:`ckptbridge._read.views`), value transforms wrap locations that
multiply while copying, and :func:`coalesce` merges fragments that continue
one another, so a chain of transforms (and its inverse) never multiplies the
fragment count::

    q = reshape(q, (32, 2, 64, 4096))          # [H*D, E] -> [H, 2, D/2, E]
    q = transpose(q, (0, 2, 1, 3))              # rotate-half -> interleaved pairs
    q = reshape(q, (4096, 4096))                # still one fragment per source fragment
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._errors import ShapeMismatchError
from .._read.model import Box, Fragment, TensorState, flat_range_boxes
from .._read.views import ScaledRegion, ZeroRegion, join, merge_location, pieces, reshape_location


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
        if common == f.box:
            frags.append(Fragment(common.shift(box.offset), f.location, f.checksum))
            continue
        for sub, loc in pieces(f.location, common.shift(f.box.offset)):
            frags.append(Fragment(sub.shift(tuple(-o for o in f.box.offset)).shift(box.offset), loc))
    return TensorState(state.dtype, box.shape, tuple(frags))


def permuted_shape(shape: Sequence[int], perm: Sequence[int]) -> tuple[int, ...]:
    """The shape :func:`transpose` gives (``perm`` checked against ``shape``)."""
    if sorted(perm) != list(range(len(shape))):
        raise ShapeMismatchError(f"permutation {tuple(perm)} does not fit shape {tuple(shape)}")
    return tuple(shape[p] for p in perm)


def transpose(state: TensorState, perm: Sequence[int]) -> TensorState:
    """Reorder dims: result dim ``i`` is input dim ``perm[i]`` (no data moves)."""
    perm = tuple(perm)
    shape = permuted_shape(state.shape, perm)
    frags = tuple(
        Fragment(
            Box(tuple(f.box.offset[p] for p in perm), tuple(f.box.shape[p] for p in perm)),
            f.location.permute(perm),
        )
        for f in state.fragments
    )
    return TensorState(state.dtype, shape, frags)


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
    return [unstack_part(state, dim, i) for i in range(state.shape[dim])]


def unstack_part(state: TensorState, dim: int, i: int) -> TensorState:
    """Index ``i`` of ``dim`` of a state, without that dim (part ``i`` of :func:`unstack`)."""
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
    return TensorState(state.dtype, shp[:dim] + shp[dim + 1 :], frags)


def split(state: TensorState, dim: int, widths: Sequence[int], groups: int = 1) -> list[TensorState]:
    """Split a fused tensor into its parts.

    Along ``dim`` the tensor is ``groups`` repetitions of the parts, each part
    ``widths[k]`` wide (QKV with grouped-query attention: groups = query groups,
    widths = (heads_per_group * head_dim, head_dim, head_dim); SwiGLU: groups=1,
    widths = (ffn, ffn)). Part ``k`` gathers its slice from every group.
    """
    return [split_part(state, dim, widths, groups, k) for k in range(len(widths))]


def split_shapes(shape: Sequence[int], dim: int, widths: Sequence[int], groups: int = 1) -> list[tuple[int, ...]]:
    """The shapes of the parts :func:`split` gives (the fused dim checked)."""
    group = sum(widths)
    if group * groups != shape[dim]:
        raise ShapeMismatchError(f"fused dim {dim} has {shape[dim]} entries, expected {groups} x {group}")
    return [tuple(w * groups if d == dim else s for d, s in enumerate(shape)) for w in widths]


def split_part(state: TensorState, dim: int, widths: Sequence[int], groups: int, k: int) -> TensorState:
    """Part ``k`` of :func:`split`."""
    split_shapes(state.shape, dim, widths, groups)
    group, start, w = sum(widths), sum(widths[:k]), widths[k]
    pieces_ = []
    for g in range(groups):
        off = tuple(g * group + start if d == dim else 0 for d in range(len(state.shape)))
        shp = tuple(w if d == dim else s for d, s in enumerate(state.shape))
        pieces_.append(crop(state, Box(off, shp)))
    return coalesce(concat(pieces_, dim))


def fuse(parts: Sequence[TensorState], dim: int, groups: int = 1) -> TensorState:
    """The inverse of :func:`split`: interleave parts group by group along ``dim``."""
    fused_layout([(p.dtype, p.shape) for p in parts], dim, groups)
    pieces_ = []
    for g in range(groups):
        for p in parts:
            w = p.shape[dim] // groups
            off = tuple(g * w if d == dim else 0 for d in range(len(p.shape)))
            shp = tuple(w if d == dim else s for d, s in enumerate(p.shape))
            pieces_.append(crop(p, Box(off, shp)))
    return coalesce(concat(pieces_, dim))


def fused_layout(parts: Sequence[tuple[str, Sequence[int]]], dim: int, groups: int = 1) -> tuple[str, tuple[int, ...]]:
    """The dtype and shape :func:`fuse` gives parts of these dtypes and shapes (checked as it checks them)."""
    (dtype, first), *_ = parts
    for pdtype, shape in parts:
        if shape[dim] % groups:
            raise ShapeMismatchError(f"part of {shape[dim]} entries does not split into {groups} groups")
        if pdtype != dtype or len(shape) != len(first) or any(
                a != b for d, (a, b) in enumerate(zip(shape, first)) if d != dim):
            piece = tuple(n // groups if d == dim else n for d, n in enumerate(shape))
            head = tuple(n // groups if d == dim else n for d, n in enumerate(first))
            raise ShapeMismatchError(f"cannot concat {piece}/{pdtype} with {head}/{dtype} on dim {dim}")
    return dtype, tuple(sum(s[dim] for _, s in parts) if d == dim else n for d, n in enumerate(first))


# ------------------------------------------------------------------ reshapes


def reshape(state: TensorState, shape: Sequence[int]) -> TensorState:
    """The same elements in row-major order seen with ``shape`` (one ``-1`` may be inferred).

    Each fragment stays a strided view of its bytes; a fragment is cut only where its box
    is not row-major contiguous within the merged dims (e.g. a column shard merged with
    its rows), at most into the rows that makes."""
    shape = _infer(state.shape, shape)
    if shape == tuple(state.shape):
        return state
    if math.prod(shape) == 0:
        return TensorState(state.dtype, shape, ())
    frags: list[Fragment] = list(state.fragments)
    cur = tuple(state.shape)
    for (i0, i1), (k0, k1) in reversed(_groups(cur, shape)):
        new_sizes = shape[k0:k1]
        frags = [g for f in frags for g in _reshape_group(f, cur, i0, i1, new_sizes)]
        cur = cur[:i0] + new_sizes + cur[i1:]
    return coalesce(TensorState(state.dtype, shape, tuple(frags)))


def split_dim(state: TensorState, dim: int, sizes: Sequence[int]) -> TensorState:
    """Split ``dim`` into ``sizes`` (row-major; one ``-1`` inferred): ``[H*D, E] -> [H, D, E]``."""
    return reshape(state, split_dim_shape(state.shape, dim, sizes))


def split_dim_shape(shape: Sequence[int], dim: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """The shape :func:`split_dim` gives (checked)."""
    dim = _axis(dim, len(shape))
    return (*shape[:dim], *_infer((shape[dim],), sizes), *shape[dim + 1 :])


def merge_dims(state: TensorState, dim: int, count: int) -> TensorState:
    """Merge ``count`` dims from ``dim`` on into one (row-major): ``[E, H, D] -> [E, H*D]``."""
    return reshape(state, merged_shape(state.shape, dim, count))


def merged_shape(shape: Sequence[int], dim: int, count: int) -> tuple[int, ...]:
    """The shape :func:`merge_dims` gives (checked)."""
    dim = _axis(dim, len(shape))
    if count < 1 or dim + count > len(shape):
        raise ShapeMismatchError(f"cannot merge {count} dims from dim {dim} of shape {tuple(shape)}")
    return (*shape[:dim], math.prod(shape[dim : dim + count]), *shape[dim + count :])


def interleave(state: TensorState, dim: int, block: int, ways: int = 2) -> TensorState:
    """Within every ``block`` entries of ``dim``, take the ``ways`` contiguous parts and
    interleave them: ``[a0 a1 .. b0 b1 ..] -> [a0 b0 a1 b1 ..]`` (rotate-half rotary rows
    -> interleaved pairs, per head with ``block = head_dim``). A strided view, no data moves."""
    dim = check_blocks(state.shape, dim, block, ways)
    n, s = state.shape[dim], state.shape
    v = split_dim(state, dim, (n // block, ways, block // ways))
    v = transpose(v, (*range(dim + 1), dim + 2, dim + 1, *range(dim + 3, len(s) + 2)))
    return merge_dims(v, dim, 3)


def deinterleave(state: TensorState, dim: int, block: int, ways: int = 2) -> TensorState:
    """The inverse of :func:`interleave`: ``[a0 b0 a1 b1 ..] -> [a0 a1 .. b0 b1 ..]`` per block."""
    dim = check_blocks(state.shape, dim, block, ways)
    n, s = state.shape[dim], state.shape
    v = split_dim(state, dim, (n // block, block // ways, ways))
    v = transpose(v, (*range(dim + 1), dim + 2, dim + 1, *range(dim + 3, len(s) + 2)))
    return merge_dims(v, dim, 3)


def check_blocks(shape: Sequence[int], dim: int, block: int, ways: int) -> int:
    """The axis :func:`interleave` / :func:`deinterleave` work on, its blocks checked."""
    dim = _axis(dim, len(shape))
    n = shape[dim]
    if block <= 0 or n % block or block % ways:
        raise ShapeMismatchError(f"dim {dim} of {n} entries does not split into blocks of {block} in {ways} parts")
    return dim


def _axis(dim: int, ndim: int) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise ShapeMismatchError(f"dim {dim} out of range for {ndim} dims")
    return d


def _infer(old: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    shape = [int(s) for s in shape]
    total = math.prod(old)
    if shape.count(-1) > 1:
        raise ShapeMismatchError(f"reshape to {tuple(shape)}: at most one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or total % known:
            raise ShapeMismatchError(f"cannot reshape {tuple(old)} to {tuple(shape)}")
        shape[shape.index(-1)] = total // known
    if math.prod(shape) != total or any(s < 0 for s in shape):
        raise ShapeMismatchError(f"cannot reshape {tuple(old)} ({total} elements) to {tuple(shape)}")
    return tuple(shape)


def _groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Runs of old and new dims with equal products (size-1 dims ride with a neighbour)."""
    out = []
    i = k = 0
    while i < len(old) or k < len(new):
        i0, k0 = i, k
        po = pn = 1
        if i < len(old):
            po, i = old[i], i + 1
        if k < len(new):
            pn, k = new[k], k + 1
        while po != pn:
            if po < pn and i < len(old):
                po, i = po * old[i], i + 1
            elif k < len(new):
                pn, k = pn * new[k], k + 1
            else:
                po, i = po * old[i], i + 1
        while i < len(old) and old[i] == 1 and (k >= len(new) or new[k] != 1):
            i += 1
        while k < len(new) and new[k] == 1 and (i >= len(old) or old[i] != 1):
            k += 1
        out.append(((i0, i), (k0, k)))
    return out


def _reshape_group(f: Fragment, cur: tuple[int, ...], i0: int, i1: int,
                   new_sizes: tuple[int, ...]) -> list[Fragment]:
    box, loc = f.box, f.location
    if i0 == i1:  # new unit dims where there were none
        for _ in new_sizes:
            loc = loc.insert_dim(i0)
        return [Fragment(Box((*box.offset[:i0], *(0,) * len(new_sizes), *box.offset[i0:]),
                             (*box.shape[:i0], *new_sizes, *box.shape[i0:])), loc)]
    if not new_sizes:  # unit dims that go away
        for _ in range(i1 - i0):
            loc = loc.drop_dim(i0)
        return [Fragment(Box(box.offset[:i0] + box.offset[i1:], box.shape[:i0] + box.shape[i1:]), loc)]
    old_sizes = cur[i0:i1]
    out = []
    for box, loc in _contiguous(f.box, f.location, i0, i1, old_sizes):
        if i1 - i0 > 1:
            loc = merge_location(loc, box.shape, i0, i1 - i0)
        start = _flat_index(box.offset[i0:i1], old_sizes)
        n = math.prod(box.shape[i0:i1])
        flat_shape = (*box.shape[:i0], n, *box.shape[i1:])
        for nb, nloc in _place(loc, flat_shape, i0, start, n, 0, new_sizes):
            out.append(Fragment(Box((*box.offset[:i0], *nb.offset, *box.offset[i1:]),
                                    (*box.shape[:i0], *nb.shape, *box.shape[i1:])), nloc))
    return out


def _contiguous(box: Box, loc: Any, i0: int, i1: int, sizes: Sequence[int]) -> list[tuple[Box, Any]]:
    """Cut a fragment so that within dims ``i0..i1`` each piece is one row-major run."""
    dims = list(range(i0, i1))
    for j, d in enumerate(dims):
        if box.shape[d] > 1 and any(box.shape[e] != sizes[e - i0] for e in dims[j + 1 :]):
            out = []
            for k in range(box.shape[d]):
                off = list(box.offset)
                off[d] += k
                shp = list(box.shape)
                shp[d] = 1
                sub = Box(tuple(off), tuple(shp))
                for sb, sl in pieces(loc, sub.shift(box.offset)):
                    out += _contiguous(sb.shift(tuple(-o for o in box.offset)), sl, i0, i1, sizes)
            return out
    return [(box, loc)]


def _flat_index(index: Sequence[int], sizes: Sequence[int]) -> int:
    flat = 0
    for i, s in zip(index, sizes):
        flat = flat * s + i
    return flat


def _place(loc: Any, shape: tuple[int, ...], dim: int, start: int, n: int, at: int,
           new_sizes: tuple[int, ...]) -> list[tuple[Box, Any]]:
    """Split the flat run ``[start, start + n)`` (stored along ``dim`` of ``loc`` from offset ``at``)
    into boxes of ``new_sizes``, each with its location."""
    boxes = list(flat_range_boxes(new_sizes, start, start + n))
    if len(boxes) > 1:
        out, pos = [], 0
        for b in boxes:
            out += _narrow_place(loc, shape, dim, start + pos, b.size, at + pos, new_sizes)
            pos += b.size
        return out
    if not boxes:
        return []
    nb = boxes[0]
    sub_shape = (*shape[:dim], n, *shape[dim + 1 :])
    got = reshape_location(loc, sub_shape, dim, nb.shape)
    if got is not None:
        return [(nb, got)]
    lead = next(k for k, s in enumerate(nb.shape) if s > 1)  # cut along the first non-unit dim
    step = math.prod(nb.shape[lead + 1 :])
    out = []
    for k in range(nb.shape[lead]):
        out += _narrow_place(loc, shape, dim, start + k * step, step, at + k * step, new_sizes)
    return out


def _narrow_place(loc: Any, shape: tuple[int, ...], dim: int, start: int, n: int, at: int,
                  new_sizes: tuple[int, ...]) -> list[tuple[Box, Any]]:
    off = [0] * len(shape)
    off[dim] = at
    shp = list(shape)
    shp[dim] = n
    full_n = shape[dim]
    out = []
    for sub, sloc in pieces(loc, Box(tuple(off), tuple(shp))):
        piece_shape = (*shape[:dim], sub.shape[dim], *shape[dim + 1 :])
        delta = sub.offset[dim] - at
        if sub.shape[dim] == n and delta == 0 and n == full_n:
            raise ShapeMismatchError("internal: a reshape piece did not shrink")  # never loops forever
        out += _place(sloc, piece_shape, dim, start + delta, sub.shape[dim], 0, new_sizes)
    return out


# ------------------------------------------------------------------ values


def scale(state: TensorState, factor: float) -> TensorState:
    """Every value times ``factor`` (applied while bytes are copied; scales compose)."""
    frags = []
    for f in state.fragments:
        loc = f.location
        if isinstance(loc, ZeroRegion):
            frags.append(f)
            continue
        if isinstance(loc, ScaledRegion) and not loc.offset:
            loc = ScaledRegion(loc.base, loc.scale * factor)
        else:  # after an offset: (w + b) * c, in that order
            loc = ScaledRegion(loc, float(factor))
        frags.append(Fragment(f.box, loc, f.checksum))
    return TensorState(state.dtype, state.shape, tuple(frags))


def offset(state: TensorState, value: float) -> TensorState:
    """Every value plus ``value`` (applied while bytes are copied, after any scale already on the
    fragment: ``w * c + value``; offsets do not merge, so ``(w + 1) - 1`` rounds twice, as numpy
    would). Padding zeros get the offset too."""
    frags = []
    for f in state.fragments:
        loc = f.location
        if isinstance(loc, ScaledRegion) and not loc.offset:
            loc = ScaledRegion(loc.base, loc.scale, float(value))
        else:
            loc = ScaledRegion(loc, 1.0, float(value))
        frags.append(Fragment(f.box, loc, f.checksum))
    return TensorState(state.dtype, state.shape, tuple(frags))


def cast(state: TensorState, dtype: str) -> TensorState:
    """The same values read as ``dtype`` (rounded to nearest even when narrowing)."""
    return TensorState(dtype, state.shape, state.fragments)


def pad(state: TensorState, dim: int, padded: int) -> TensorState:
    """Zeros appended along ``dim`` up to ``padded`` entries (a vocabulary re-padded for a target)."""
    dim = _axis(dim, len(state.shape))
    size = state.shape[dim]
    shape = padded_shape(state.shape, dim, padded)
    if padded == size:
        return state
    off = tuple(size if d == dim else 0 for d in range(len(state.shape)))
    shp = tuple(padded - size if d == dim else s for d, s in enumerate(state.shape))
    return TensorState(state.dtype, shape, (*state.fragments, Fragment(Box(off, shp), ZeroRegion(state.dtype))))


def padded_shape(shape: Sequence[int], dim: int, padded: int) -> tuple[int, ...]:
    """The shape :func:`pad` gives (checked)."""
    dim = _axis(dim, len(shape))
    if padded < shape[dim]:
        raise ShapeMismatchError(f"cannot pad dim {dim} of {shape[dim]} entries down to {padded}")
    return tuple(padded if d == dim else s for d, s in enumerate(shape))


# ------------------------------------------------------------------ coalescing


def coalesce(state: TensorState) -> TensorState:
    """Merge fragments that continue one another along a dim (same bytes' strided walk),
    so that transforms and their inverses do not leave a state cut into more pieces."""
    frags = list(state.fragments)
    if len(frags) < 2:
        return state
    changed = True
    while changed:
        changed = False
        for d in range(len(state.shape)):
            frags.sort(key=lambda f: (tuple(o for k, o in enumerate(f.box.offset) if k != d),
                                      tuple(s for k, s in enumerate(f.box.shape) if k != d), f.box.offset[d]))
            out: list[Fragment] = []
            for f in frags:
                prev = out[-1] if out else None
                if prev is not None and _adjacent(prev.box, f.box, d) and prev.checksum is None and f.checksum is None:
                    loc = join(prev.location, f.location, prev.box.shape, d)
                    if loc is not None:
                        shp = list(prev.box.shape)
                        shp[d] += f.box.shape[d]
                        out[-1] = Fragment(Box(prev.box.offset, tuple(shp)), loc)
                        changed = True
                        continue
                out.append(f)
            frags = out
    if len(frags) == len(state.fragments):
        return state
    frags.sort(key=lambda f: f.box.offset)
    return TensorState(state.dtype, state.shape, tuple(frags))


def _adjacent(a: Box, b: Box, dim: int) -> bool:
    return (b.offset[dim] == a.offset[dim] + a.shape[dim]
            and all(a.offset[k] == b.offset[k] and a.shape[k] == b.shape[k]
                    for k in range(a.ndim) if k != dim))

"""Strided copies that stay fast when source and destination run along different axes.

Reading a transposed view (a torch ``Linear.weight`` ``[out, in]`` seen as a Flax ``kernel``
``[in, out]``) is a copy whose source is contiguous along one axis and whose destination along
another. ``np.copyto`` walks such a copy in the destination's order, so every element comes from
another source row: for a large matrix each access misses the caches and the TLB (measured: a
1 GB bf16 ``lm_head.weight.T`` took 65 s under ``np.ascontiguousarray``). :func:`copyto` cuts the
two axes into tiles small enough for the rows a tile touches to stay in cache, which makes the
same copy run at memory speed::

    copyto(out, view)     # = np.copyto(out, view, casting="unsafe"), tiled when that helps
"""

from __future__ import annotations

import itertools
import math

import numpy as np

TILE = 256  # elements per tiled axis: a tile's source rows (TILE lines) stay in L1/L2
_MIN_BYTES = 1 << 20  # below this a plain copy is as fast


def _fastest(a: np.ndarray) -> int | None:
    """The axis along which ``a`` is most nearly contiguous (smallest non-zero stride, extent > 1)."""
    axes = [k for k in range(a.ndim) if a.shape[k] > 1 and a.strides[k] != 0]
    return min(axes, key=lambda k: abs(a.strides[k])) if axes else None


def copyto(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src, casting="unsafe")`` (same shapes), in ``TILE x TILE`` tiles of the
    source's and the destination's contiguous axes when those differ. Same-dtype copies of dtypes
    numpy does not know natively (``bfloat16``, ``float8``: ml_dtypes) move as unsigned integers of
    their size (numpy's own strided loops, 1.5x faster than the dtype's)."""
    if src.dtype == dst.dtype and src.dtype.kind == "V" and src.dtype.itemsize in (1, 2, 4, 8):
        bits = np.dtype(f"u{src.dtype.itemsize}")
        dst, src = dst.view(bits), src.view(bits)
    if dst.ndim < 2 or dst.nbytes < _MIN_BYTES or src.shape != dst.shape:
        np.copyto(dst, src, casting="unsafe")
        return
    s, d = _fastest(src), _fastest(dst)
    if s is None or d is None or s == d:
        np.copyto(dst, src, casting="unsafe")
        return
    starts = [range(0, dst.shape[s], TILE), range(0, dst.shape[d], TILE)]
    if math.prod(len(r) for r in starts) < 2:
        np.copyto(dst, src, casting="unsafe")
        return
    index: list[slice] = [slice(None)] * dst.ndim
    for i, j in itertools.product(*starts):
        index[s] = slice(i, i + TILE)
        index[d] = slice(j, j + TILE)
        at = tuple(index)
        np.copyto(dst[at], src[at], casting="unsafe")

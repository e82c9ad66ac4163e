"""Tiled strided copies (``ckptbridge._read.copyto.copyto``) equal ``np.copyto`` for every layout they tile."""

from __future__ import annotations

import numpy as np
import pytest

from ckptbridge._dtypes import to_numpy
from ckptbridge._read import copyto as _copy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("perm", [(1, 0), (2, 1, 0), (1, 2, 0), (0, 2, 1)])
def test_tiled_copy_equals_numpy(dtype, perm, monkeypatch):
    monkeypatch.setattr(_copy, "TILE", 7)  # tiles that do not divide the shapes
    monkeypatch.setattr(_copy, "_MIN_BYTES", 0)
    shape = (37, 23, 11)[: len(perm)]
    base = np.random.default_rng(0).standard_normal(shape).astype(np.float32).astype(to_numpy(dtype))
    src = base.transpose(perm)
    want = np.empty(src.shape, dtype=np.float64)
    np.copyto(want, src, casting="unsafe")
    got = np.empty(src.shape, dtype=np.float64)  # with a cast, as the reader does
    _copy.copyto(got, src)
    assert np.array_equal(got, want)
    out = np.zeros((src.shape[0] + 3, *src.shape[1:]), dtype=src.dtype)[2:-1]  # a strided destination
    _copy.copyto(out, src)
    assert np.array_equal(out.astype(np.float64), want)


def test_tiles_only_transposed_copies(monkeypatch):
    calls = []
    real = np.copyto
    monkeypatch.setattr(_copy.np, "copyto", lambda d, s, casting="same_kind": calls.append(d.shape) or real(d, s, casting=casting))
    a = np.arange(600 * 700, dtype=np.float32).reshape(600, 700)
    out = np.empty((700, 600), dtype=np.float32)
    _copy.copyto(out, a.T)
    assert np.array_equal(out, a.T) and len(calls) == 3 * 3  # 256-element tiles of both axes
    calls.clear()
    out2 = np.empty_like(a)
    _copy.copyto(out2, a)
    assert np.array_equal(out2, a) and calls == [(600, 700)]  # same order: one plain copy

"""Planner + reader properties: any fragmentation, any request -> numpy's slice, minimal bytes."""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptbridge import ShapeMismatchError, TruncatedError
from ckptbridge._read.plan import normalize_index, plan
from ckptbridge.plugin import (
    Box,
    FileCache,
    FileRegion,
    Fragment,
    TensorState,
    c_strides,
    flat_range_boxes,
    flat_range_fragments,
    read_state,
)
from ckptbridge.plugin import dtypes as _dtypes

DTYPES = ["float32", "float16", "bfloat16", "int32", "int64", "uint8"]


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(_dtypes.to_numpy(dtype)) if "int" not in dtype else rng.integers(
        0, 100, shape).astype(_dtypes.to_numpy(dtype))


@st.composite
def shapes(draw):
    return tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))


@st.composite
def grid_cuts(draw, shape):
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3, unique=True)) if n > 1 else []
        cuts.append(sorted({0, n, *inner}))
    return cuts


@st.composite
def boxes_in(draw, shape):
    off, ext = [], []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        off.append(a)
        ext.append(b - a)
    return Box(tuple(off), tuple(ext))


def _write_grid(tmp_path, arr, cuts, dtype, transposed):
    """Store each grid cell in its own region of one file (optionally column-major)."""
    path = str(tmp_path / f"grid-{np.random.default_rng().integers(1 << 30)}.bin")
    frags, blobs, at = [], [], 0
    for idx in itertools.product(*[range(len(c) - 1) for c in cuts]):
        off = tuple(cuts[d][i] for d, i in enumerate(idx))
        shp = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(idx))
        cell = arr[tuple(slice(o, o + s) for o, s in zip(off, shp))]
        if transposed:  # store column-major: strides are reversed C-strides of the reversed shape
            raw = np.ascontiguousarray(cell.T).tobytes()
            strides = tuple(reversed(c_strides(tuple(reversed(shp)))))
        else:
            raw = np.ascontiguousarray(cell).tobytes()
            strides = c_strides(shp)
        frags.append(Fragment(Box(off, shp), FileRegion(path, at, dtype, strides)))
        blobs.append(raw)
        at += len(raw)
        pad = (-at) % 7 or 3  # gaps between fragments, so over-reads would show in bytes_read
        blobs.append(b"\xff" * pad)
        at += pad
    with open(path, "wb") as fh:
        fh.write(b"".join(blobs))
    return frags


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), dtype=st.sampled_from(DTYPES), transposed=st.booleans())
def test_grid_fragments_read_exact_slice(tmp_path, data, dtype, transposed):
    shape = data.draw(shapes())
    arr = _data(shape, dtype)
    cuts = data.draw(grid_cuts(shape))
    frags = _write_grid(tmp_path, arr, cuts, dtype, transposed)
    state = TensorState(dtype, shape, tuple(frags))
    req = data.draw(boxes_in(shape))
    with FileCache() as files:
        got = read_state(state, req, files)
        np.testing.assert_array_equal(got.view(np.uint8), arr[req.slices()].view(np.uint8))
        itemsize = arr.dtype.itemsize
        overlapping = sum(f.box.size for f in frags if f.box.intersect(req) is not None) * itemsize
        assert files.stats.bytes_read == req.size * itemsize
        assert files.stats.bytes_read <= overlapping


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_flat_range_fragments_read_exact_slice(tmp_path, data, dtype):
    """ZeRO-style: the flattened tensor cut into contiguous partitions, each in its own file."""
    shape = data.draw(shapes())
    arr = _data(shape, dtype, seed=1)
    n = arr.size
    cuts = sorted({0, n, *data.draw(st.lists(st.integers(0, n), max_size=4))})
    flat = arr.reshape(-1)
    frags = []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        path = str(tmp_path / f"rank{i}-{np.random.default_rng().integers(1 << 30)}.bin")
        header = b"\x00" * 13  # data does not start at 0, like a real rank file
        with open(path, "wb") as fh:
            fh.write(header + flat[a:b].tobytes() + b"\xee" * 5)
        frags.extend(flat_range_fragments(shape, a, b, path, len(header), dtype))
    assert len(frags) <= (len(cuts) - 1) * (2 * len(shape) - 1)
    state = TensorState(dtype, shape, tuple(frags))
    req = data.draw(boxes_in(shape))
    with FileCache() as files:
        got = read_state(state, req, files)
        np.testing.assert_array_equal(got.view(np.uint8), arr[req.slices()].view(np.uint8))
        assert files.stats.bytes_read == req.size * arr.dtype.itemsize


@given(shape=shapes(), data=st.data())
def test_flat_range_boxes_partition_the_range(shape, data):
    n = math.prod(shape)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    boxes = list(flat_range_boxes(shape, a, b))
    idx = np.arange(n).reshape(shape)
    got = sorted(int(x) for bx in boxes for x in idx[bx.slices()].reshape(-1))
    assert got == list(range(a, b))
    for bx in boxes:  # each box is contiguous in row-major order
        flat = idx[bx.slices()].reshape(-1)
        assert (np.diff(flat) == 1).all()


def test_dtype_cast_on_read(tmp_path):
    arr = _data((4, 5), "bfloat16")
    p = tmp_path / "x.bin"
    p.write_bytes(arr.tobytes())
    state = TensorState("bfloat16", (4, 5), (Fragment(Box.full((4, 5)), FileRegion(str(p), 0, "bfloat16", (5, 1))),))
    with FileCache() as files:
        got = read_state(state, None, files, dtype="float32")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, arr.astype(np.float32))


def test_missing_coverage_names_the_tensor(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(np.zeros(6, np.float32).tobytes())
    with pytest.raises(ShapeMismatchError, match="cover"):
        TensorState("float32", (4, 3), (Fragment(Box((0, 0), (2, 3)), FileRegion(str(p), 0, "float32", (3, 1))),))
    frags = (Fragment(Box((0, 0), (2, 3)), FileRegion(str(p), 0, "float32", (3, 1))),)
    with pytest.raises(ShapeMismatchError, match="my.weight"):
        plan(frags, Box((0, 0), (4, 3)), "my.weight")


def test_truncated_file_is_reported(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(np.zeros(5, np.float32).tobytes())
    state = TensorState("float32", (2, 3), (Fragment(Box.full((2, 3)), FileRegion(str(p), 0, "float32", (3, 1))),))
    with FileCache() as files, pytest.raises(TruncatedError, match="short.bin"):
        read_state(state, None, files)


def test_normalize_index_matches_numpy():
    arr = np.arange(5 * 6 * 7).reshape(5, 6, 7)
    for index in [(1,), (slice(1, 4), 2), (Ellipsis, slice(None, None, 2)), (-1, slice(2, 2)), (slice(None),)]:
        box, post = normalize_index(index, arr.shape)
        np.testing.assert_array_equal(arr[box.slices()][post], arr[index])


def test_reads_hold_no_file_descriptors_after_the_checkpoint_is_dropped(tmp_path):
    """Large contiguous reads go through preadv on a cached descriptor; dropping a checkpoint
    without close() must not leak it (notebooks open many)."""
    import gc

    import torch

    import ckptbridge

    torch.save({"w": torch.randn(512, 1024)}, tmp_path / "a.pt")
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        c = ckptbridge.open(tmp_path / "a.pt")
        assert c["w"].read().shape == (512, 1024)
        del c
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds + 1

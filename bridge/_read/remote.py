"""The executor's path for fragments stored behind URLs: fetch only the byte runs a plan needs.

A copy op's source box, in a fragment stored at some strides, is a set of
contiguous byte *runs* (rows of a row-major slice; the innermost dims that
are contiguous form one run). The runs of every op of one ``execute`` call
are fetched per object in one round (``FsspecStorage.fetch``: coalesced
within a waste budget, concurrent, retried) and copied into the destination:
straight from the fetched buffer when one part holds the whole box (a
strided view, as from a memory map), part by part for a contiguous run, or
gathered run by run otherwise. Whole fragments with a recorded checksum
are verified from the fetched bytes::

    runs, run_bytes = byte_runs(region, box)     # pure
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _dtypes, _storage
from .._errors import CorruptionError, TruncatedError
from .._storage.crc import crc32
from .model import Box, FileRegion, c_strides
from .plan import CopyOp

_MAX_RUNS = 1 << 16  # more runs than this (e.g. a transposed view): fetch the box's whole extent


def byte_runs(region: FileRegion, box: Box) -> tuple[np.ndarray, int]:
    """Start offsets (C order of the outer dims) and the common length of the contiguous byte
    runs holding ``box`` of the fragment stored at ``region``::

        >>> starts, n = byte_runs(FileRegion("f", 0, "float32", (8, 1)), Box((0, 2), (3, 2)))
        >>> starts.tolist(), n
        ([8, 40, 72], 8)
    """
    item = _dtypes.itemsize(region.dtype)
    shape, strides = box.shape, region.strides
    base = region.offset + sum(o * s for o, s in zip(box.offset, strides)) * item
    k, expect = len(shape), 1
    while k > 0:
        d = k - 1
        if shape[d] != 1:
            if strides[d] != expect:
                break
            expect *= shape[d]
        k -= 1
    run = math.prod(shape[k:]) * item
    starts = np.array([base], dtype=np.int64)
    for n, s in zip(shape[:k], strides[:k]):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * (s * item)).reshape(-1)
    return starts, run


class _Op:
    __slots__ = ("dst", "end", "frag", "label", "region", "run", "spans", "src", "start", "verify")

    def __init__(self, op: CopyOp, dst: np.ndarray, files: Any, size: int, label: str) -> None:
        frag = op.fragment
        region: FileRegion = frag.location
        self.frag, self.region, self.src, self.label = frag, region, op.src, label
        self.dst = dst
        item = _dtypes.itemsize(region.dtype)
        self.start = region.offset + sum(o * s for o, s in zip(op.src.offset, region.strides)) * item
        self.end = self.start + region.extent(op.src.shape)
        if self.start < 0 or self.end > size:
            raise TruncatedError(f"{region.file}: needs bytes up to {self.end} but the object has {size} "
                                 "(truncated or still being written)")
        self.verify = bool(files.verify and frag.checksum and op.src.shape == frag.box.shape
                           and region.strides == c_strides(frag.box.shape))
        starts, run = byte_runs(region, op.src)
        if len(starts) > _MAX_RUNS:
            self.spans, self.run = [(self.start, self.end)], -1  # strided view over the whole extent
        else:
            self.spans, self.run = [(int(s), int(s) + run) for s in starts], run

    def copy(self, got: _storage.Fetched) -> int:
        dtype = _dtypes.to_numpy(self.region.dtype)
        shape = self.src.shape
        whole = got.view(self.start, self.end)
        if whole is not None or self.run < 0:
            buf = whole if whole is not None else got.gather([(self.start, self.end)])
            if self.verify:
                self._check(crc32(buf))
            view = np.ndarray(shape, dtype=dtype, buffer=buf,
                              strides=tuple(s * dtype.itemsize for s in self.region.strides))
            np.copyto(self.dst, view, casting="unsafe")
        elif len(self.spans) == 1:  # one contiguous run across several fetched parts
            flat = self.dst.reshape(-1) if self.dst.flags.c_contiguous and self.dst.dtype == dtype else None
            raw = flat.view(np.uint8) if flat is not None else np.empty(self.end - self.start, np.uint8)
            pos, crc = 0, 0
            for piece in got.pieces(self.start, self.end):
                raw[pos : pos + len(piece)] = np.frombuffer(piece, np.uint8)
                if self.verify:
                    crc = crc32(piece, crc)
                pos += len(piece)
            if self.verify:
                self._check(crc)
            if flat is None:
                np.copyto(self.dst, raw.view(dtype).reshape(shape), casting="unsafe")
        else:
            data = got.gather(self.spans)
            if self.verify:
                self._check(crc32(data))
            np.copyto(self.dst, np.frombuffer(data, dtype).reshape(shape), casting="unsafe")
        return self.src.size * dtype.itemsize

    def _check(self, crc: int) -> None:
        got = f"crc32:{crc:08x}"
        if got != self.frag.checksum:
            raise CorruptionError(
                f"{self.region.file}: {self.label} at {self.frag.box.offset}: checksum {got} != recorded "
                f"{self.frag.checksum}; the data is corrupted (restore the object, or open with verify=False "
                "to read it anyway)")


def is_remote(op: CopyOp) -> bool:
    loc = op.fragment.location
    return isinstance(loc, FileRegion) and "://" in loc.file


def execute_remote(items: Sequence[tuple[CopyOp, np.ndarray, str]], files: Any,
                   one: Callable[[tuple[CopyOp, np.ndarray, str]], int]) -> int:
    """Run ``(op, dst, label)`` triples, fetching the remote ones' runs per object in one round
    (objects concurrently); ``dst`` is the op's destination view, ``label`` names its tensor."""
    by_file: dict[str, list[tuple[CopyOp, np.ndarray, str]]] = {}
    total = 0
    for op, dst, label in items:
        if op.src.size == 0:
            continue
        if is_remote(op):
            by_file.setdefault(op.fragment.location.file, []).append((op, dst, label))
        else:
            total += one((op, dst, label))

    def run_file(item: tuple[str, list[tuple[CopyOp, np.ndarray, str]]]) -> int:
        file, fops = item
        store = _storage.remote(file)
        size = files.remote_size(file)
        plans = [_Op(op, dst, files, size, label) for op, dst, label in fops]
        got = store.fetch(file, [s for p in plans for s in p.spans], stats=files.stats)
        n = 0
        for p in plans:
            nbytes = p.copy(got)
            files.stats.add(file, nbytes)
            n += nbytes
        return n

    groups: list[tuple[str, list[tuple[CopyOp, np.ndarray, str]]]] = list(by_file.items())
    if len(groups) <= 1:
        return total + sum(run_file(g) for g in groups)
    with ThreadPoolExecutor(min(files.max_workers, len(groups))) as pool:
        return total + sum(pool.map(run_file, groups))

"""The host level: buffers reused from save to save, laid out as images of the data files.

Fresh memory is expensive on virtual machines (the host backs each page on first touch:
~1.5 s per GiB here, several memcpys' worth), so a set is touched once and reused; the
spare sets are pre-faulted in the background (:meth:`BufferSet.prefault`) as soon as the
layout is known, instead of by the snapshot of the save that first uses them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from .. import _dtypes
from .._formats.safetensors import FileSpec, file_layout
from .._formats.universal import Piece
from .._storage.hostmem import aligned_buffer
from .leaves import Leaf, buffer_key
from .policy import sets_that_fit

log = logging.getLogger("ckptbridge.checkpointer")


class BufferSet:
    """Host buffers reused from save to save (allocated on first use per shape/dtype)."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.images: dict[str, mmap.mmap] = {}  # data files' bytes, by relative path: flushed without a copy
        self.layout: tuple[Any, ...] | None = None
        self.unpin: list[Callable[[], None]] = []  # undo page-locking of the images, if pinned
        self.busy = threading.Event()
        self.ready = threading.Event()  # cleared while a background pre-fault lays it out
        self.ready.set()
        self.step: int | None = None  # the snapshot these buffers hold, for the host tier
        self.leaves: list[Leaf] = []
        self.extra: dict[str, Any] = {}
        self.tree: Any = None  # the skeleton of the state held (see .tree)

    def lay_out(self, plan: list[tuple[str, list[Piece], FileSpec]],
                pin: Callable[[mmap.mmap], Callable[[], None]] | None = None) -> bool:
        """Place the written leaves' buffers inside page-aligned images of their data files
        (kept while the layout holds), so the flush writes them with no copy. ``pin``
        page-locks each image (device-to-host copies of CUDA tensors then run at DMA speed).
        Returns True when the layout is new (fresh, untouched images)."""
        layout = tuple((rel, tuple((p.tensor, p.box, p.dtype) for p in group)) for rel, group, _ in plan)
        fresh = layout != self.layout
        if fresh:
            self.release()
            self.images, self.arrays = {}, {}  # drop the old layout's buffers
            for rel, group, spec in plan:
                _, offsets, size = file_layout(spec.entries, spec.metadata)
                image = self.images[rel] = aligned_buffer(size)
                for p, at in zip(group, offsets):
                    arr = np.frombuffer(image, _dtypes.to_numpy(p.dtype), count=p.box.size, offset=at)
                    self.arrays[buffer_key(p.tensor, p.box)] = arr.reshape(p.box.shape)
            self.layout = layout
        if pin is not None and not self.unpin:
            self.unpin = [pin(image) for image in self.images.values()]
        return fresh

    def prefault(self) -> None:
        """Back every page of the images now (``MADV_POPULATE_WRITE``, else one write per page)."""
        for image in self.images.values():
            try:
                image.madvise(_MADV_POPULATE_WRITE)
            except (OSError, ValueError, AttributeError):  # kernels before 5.14, other systems
                with contextlib.suppress(ValueError):
                    np.frombuffer(image, np.uint8)[:: mmap.PAGESIZE] = 0

    def nbytes(self) -> int:
        """Bytes of the images of the current layout."""
        return sum(len(image) for image in self.images.values())

    def release(self) -> None:
        """Unpin the images (before they are dropped or the checkpointer closes)."""
        for undo in self.unpin:
            undo()
        self.unpin = []

    def get(self, leaf: Leaf) -> np.ndarray:
        arr = self.arrays.get(leaf.buffer_key)
        want = _dtypes.to_numpy(leaf.dtype)
        if arr is None or arr.shape != leaf.box.shape or arr.dtype != want:
            arr = np.empty(leaf.box.shape, dtype=want)
            self.arrays[leaf.buffer_key] = arr
        return arr

    def held(self) -> dict[str, Any]:
        """The snapshot these buffers hold, as whole arrays (single process), plus its plain values."""
        out: dict[str, Any] = {}
        for leaf in self.leaves:
            full = out.setdefault(leaf.name, np.empty(leaf.global_shape, _dtypes.to_numpy(leaf.dtype)))
            full[leaf.box.slices()] = self.arrays[leaf.buffer_key]
        return out | dict(self.extra)


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (not among Python's mmap constants before 3.13)


def copy_all(leaves: list[Leaf], buffers: BufferSet, pool: Executor, threads: int) -> None:
    """Copy leaves into their host buffers: every transfer started first, then the copies
    on ``threads`` threads of ``pool``, largest first."""
    for leaf in leaves:
        if leaf.start is not None:
            leaf.start()
    if len(leaves) < 2 or threads == 1:
        for leaf in leaves:
            leaf.copy(buffers.get(leaf))
        return
    order = sorted(leaves, key=lambda leaf: -leaf.box.size * _dtypes.itemsize(leaf.dtype))
    futures = [pool.submit(leaf.copy, buffers.get(leaf)) for leaf in order]
    for f in futures:
        f.result()


def fit_sets(buffers: list[BufferSet], lock: threading.Lock, set_bytes: int, wanted: int) -> None:
    """Keep only the host buffer sets the available memory holds (idle, never-used ones go)."""
    keep = sets_that_fit(available_memory(), set_bytes, len(buffers))
    with lock:
        extra = len(buffers) - keep
        spare = [b for b in buffers if not b.busy.is_set() and b.ready.is_set() and b.step is None][:extra]
        if not spare:
            return
        for b in spare:
            buffers.remove(b)
            b.release()
    log.warning("host memory holds %d set(s) of host buffers of %.2f GiB: keeping %d of "
                "SavePolicy.host_buffers=%d; saves that find them busy wait, skip or coalesce as the policy says",
                keep, set_bytes / (1 << 30), len(buffers), wanted)


def warm_spares(buffers: list[BufferSet], lock: threading.Lock, laid: BufferSet,
                plan: list[tuple[str, list[Piece], FileSpec]], pin: Callable[[Any], Callable[[], None]] | None,
                pool: Executor) -> None:
    """Lay out and pre-fault the idle buffer sets for a layout just seen (``laid``'s), on
    ``pool``, so that the saves using them next do not pay for fresh memory."""
    with lock:
        spares = [b for b in buffers
                  if b is not laid and not b.busy.is_set() and b.ready.is_set() and b.layout != laid.layout]
        for b in spares:
            b.ready.clear()
            b.step = None

    def warm(b: BufferSet) -> None:
        try:
            b.lay_out(plan, pin)
            b.prefault()
        except Exception as err:  # the save that uses this set lays it out again
            log.warning("pre-faulting a host buffer set failed: %s", err)
        finally:
            b.ready.set()

    for b in spares:
        pool.submit(warm, b)

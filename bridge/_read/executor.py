"""The executor: performs planned copies, reading only the bytes they need.

Local files are memory-mapped once per :class:`FileCache`; each copy is a
strided numpy copy out of the mapping, so only the pages holding requested
elements are touched. Fragments behind URLs (``s3://``, ``gs://`` ...) are
fetched as the byte runs the copies need (``ckptbridge._read.remote``).
Many fragments are copied in parallel on a thread pool (numpy releases the
GIL while copying). ``ReadStats`` counts the bytes
taken from each file, so tests and benchmarks can assert them::

    cache = FileCache()
    arr = read_state(state, Box((0, 0), (2, 3)), cache)
    cache.stats.bytes_read        # bytes the copies needed
    cache.stats.bytes_fetched     # bytes fetched from object stores for them (URLs only)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _dtypes
from .._errors import CorruptionError, MissingShardError, TruncatedError
from .._storage.crc import crc32
from .._storage.hostmem import fresh_array
from .copyto import copyto
from .model import Box, FileRegion, Fragment, TensorState, c_strides
from .plan import CopyOp, plan

_RELEASE_BYTES = 4 << 20
_CHUNK_BYTES = 1 << 20  # verified copies go by chunks this big: the checksum reads each from the CPU cache
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if os.uname().sysname == "Linux" else None)
_PREAD_BYTES = 1 << 16  # contiguous copies at least this big use preadv instead of the map
# The kernel maps a whole page-cache folio (up to a 2 MiB huge page) on a fault, so even a small
# copy out of a map can leave megabytes mapped; such copies are counted at that size, and once
# this much is mapped every map of the cache is dropped from the process (the pages stay cached).
_FOLIO_BYTES = 2 << 20
_MAPPED_BUDGET = 32 << 20


class ReadStats:
    """Bytes read per file, updated from worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.per_file: Counter[str] = Counter()
        self.fetched: Counter[str] = Counter()  # bytes fetched per object (URLs)
        self.requests = 0
        self.retries = 0

    def add(self, file: str, nbytes: int) -> None:
        with self._lock:
            self.per_file[file] += nbytes

    def add_fetched(self, file: str, nbytes: int, requests: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.fetched[file] += nbytes
            self.requests += requests
            self.retries += retries

    @property
    def bytes_read(self) -> int:
        return sum(self.per_file.values())

    @property
    def bytes_fetched(self) -> int:
        """Bytes that came over the network for these reads (what a slice really cost)."""
        return sum(self.fetched.values())

    def reset(self) -> None:
        with self._lock:
            self.per_file.clear()
            self.fetched.clear()
            self.requests = self.retries = 0


class FileCache:
    """Open read-only memory maps, keyed by path; closed together.

    With ``verify`` (the default), reading a whole fragment that carries a
    checksum (universal checkpoints) checks it and raises
    :class:`CorruptionError` on a mismatch; partial reads cannot be checked
    without reading the whole fragment (``ckptbridge verify`` does that).
    """

    def __init__(self, max_workers: int | None = None, verify: bool = True) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap | bytes] = {}
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._mapped = 0  # bytes small copies may have left mapped since the maps were last dropped
        weakref.finalize(self, _close_all, self._fds)  # a cache dropped without close() leaks no fds
        self.stats = ReadStats()
        self.verify = verify
        self.max_workers = max_workers or min(8, (os.cpu_count() or 1) * 2)

    def buffer(self, path: str) -> mmap.mmap | bytes:
        with self._lock:
            buf = self._maps.get(path)
            if buf is None:
                try:
                    with open(path, "rb") as fh:
                        size = os.fstat(fh.fileno()).st_size
                        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
                except FileNotFoundError:
                    raise MissingShardError(f"{path}: file not found (a shard of this checkpoint is missing)") from None
                self._maps[path] = buf
            return buf

    def remote_size(self, url: str) -> int:
        """Size of an object behind a URL (looked up once per cache)."""
        with self._lock:
            size = self._sizes.get(url)
        if size is None:
            from .. import _storage

            size = _storage.get(url).size(url)
            with self._lock:
                self._sizes[url] = size
        return size

    def copy_region(self, region: FileRegion, box: Box, out: np.ndarray) -> int:
        """Copy ``box`` of the fragment stored at ``region`` into ``out`` (cast to out.dtype)."""
        if box.size == 0:
            return 0
        if "://" in region.file:
            from .remote import execute_remote

            op = CopyOp(Fragment(Box.full(box.stop), region), box, Box.full(box.shape))
            return execute_remote([(op, out, region.file)], self, lambda _item: 0)
        dtype = _dtypes.to_numpy(region.dtype)
        buf = self.buffer(region.file)
        start = region.offset + sum(o * s for o, s in zip(box.offset, region.strides)) * dtype.itemsize
        sub = FileRegion(region.file, start, region.dtype, region.strides)
        end = start + sub.extent(box.shape)
        if start < 0 or end > len(buf):
            raise TruncatedError(
                f"{region.file}: needs bytes up to {end} but the file has {len(buf)} "
                "(truncated or still being written)"
            )
        view = np.ndarray(
            box.shape, dtype=dtype, buffer=buf, offset=start,
            strides=tuple(s * dtype.itemsize for s in region.strides),
        )
        nbytes = box.size * dtype.itemsize
        if nbytes >= _PREAD_BYTES and view.flags.c_contiguous and out.flags.c_contiguous and out.dtype == dtype:
            self._pread(region.file, out, start)  # no page faults, nothing mapped into this process
        else:
            if nbytes >= _RELEASE_BYTES:
                self._populate(buf, start, end)
            copyto(out, view)  # tiled when the view is transposed
            self._release(buf, start, end)
        self.stats.add(region.file, nbytes)
        return nbytes

    def copy_verified(self, frag: Fragment, out: np.ndarray, label: str) -> int:
        """Copy a whole contiguous fragment into ``out`` while checking its recorded checksum,
        in one pass over the bytes (chunk by chunk, each chunk checksummed then copied)."""
        loc = frag.location
        dtype = _dtypes.to_numpy(loc.dtype)
        buf = self.buffer(loc.file)
        end = loc.offset + loc.extent(frag.box.shape)
        if end > len(buf):
            raise TruncatedError(f"{loc.file}: needs bytes up to {end} but the file has {len(buf)}")
        src = np.frombuffer(buf, dtype=np.uint8, count=end - loc.offset, offset=loc.offset)
        # a view into a larger request can be strided: fill a contiguous buffer, then place it
        flat = out.reshape(-1) if out.flags.c_contiguous else np.empty(out.size, out.dtype)
        same = flat.dtype == dtype
        dst: np.ndarray | None = flat.view(np.uint8) if same else None
        crc, step = 0, _CHUNK_BYTES - _CHUNK_BYTES % dtype.itemsize
        read = dst is not None and src.size >= _PREAD_BYTES  # no page faults, nothing mapped
        for lo in range(0, src.size, step):
            piece = src[lo : lo + step]
            if read and dst is not None:
                into = dst[lo : lo + piece.size]
                self._pread(loc.file, into, loc.offset + lo)
                crc = crc32(into, crc)  # still in the CPU cache
            elif dst is not None:
                crc = crc32(piece, crc)
                dst[lo : lo + piece.size] = piece
            else:
                crc = crc32(piece, crc)
                i = lo // dtype.itemsize
                np.copyto(flat[i : i + piece.size // dtype.itemsize], piece.view(dtype), casting="unsafe")
        if not out.flags.c_contiguous:
            np.copyto(out, flat.reshape(out.shape))
        got = f"crc32:{crc:08x}"
        if got != frag.checksum:
            raise CorruptionError(
                f"{loc.file}: {label} at {frag.box.offset}: checksum {got} != recorded {frag.checksum}; "
                "the data is corrupted (restore the file, or open with verify=False to read it anyway)"
            )
        if not read:
            self._release(buf, loc.offset, end)
        self.stats.add(loc.file, src.size)
        return src.size

    def _pread(self, path: str, out: np.ndarray, start: int) -> None:
        """Fill the contiguous ``out`` with the file's bytes from ``start`` (read calls)."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        dst = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        while len(dst):
            n = os.preadv(fd, [dst], start)
            if n <= 0:
                raise TruncatedError(f"{path}: ended at byte {start} while reading (truncated while open?)")
            dst, start = dst[n:], start + n

    @staticmethod
    def _populate(buf: mmap.mmap | bytes, start: int, end: int) -> None:
        """Map the pages of ``[start, end)`` in one call (``MADV_POPULATE_READ``, Linux 5.14+) instead
        of one page fault per page while a strided copy walks them (on virtual machines each fault
        costs microseconds; a transposed gigabyte faults a quarter million times)."""
        if not isinstance(buf, mmap.mmap) or _MADV_POPULATE_READ is None:
            return
        lo = start - start % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):  # an older kernel: the faults happen as before
            buf.madvise(_MADV_POPULATE_READ, lo, end - lo)

    def _release(self, buf: mmap.mmap | bytes, start: int, end: int) -> None:
        """Drop what a copy out of the map ``[start, end)`` left mapped in this process: a big
        range at once, small ones counted (:meth:`_count_mapped`). The pages stay in the page
        cache; dropping them from this process keeps RSS near the size of what the caller holds,
        so streaming a model never looks like loading it."""
        if not isinstance(buf, mmap.mmap):
            return
        if end - start < _RELEASE_BYTES:
            self._count_mapped(start, end)
            return
        lo = start - start % mmap.PAGESIZE
        buf.madvise(mmap.MADV_DONTNEED, lo, min(end, len(buf)) - lo)

    def _count_mapped(self, start: int, end: int) -> None:
        """Count what a small copy out of a map may have left mapped (whole folios); past
        ``_MAPPED_BUDGET``, drop every map's pages from this process, so that many small tensors
        read one by one (biases, norms) never add up to a mapped checkpoint."""
        span = -(-end // _FOLIO_BYTES) * _FOLIO_BYTES - start // _FOLIO_BYTES * _FOLIO_BYTES
        with self._lock:
            self._mapped += span
            if self._mapped < _MAPPED_BUDGET:
                return
            self._mapped = 0
            maps = [b for b in self._maps.values() if isinstance(b, mmap.mmap) and len(b)]
        for buf in maps:  # another thread copying from one of them faults its pages back in
            with contextlib.suppress(OSError, ValueError):
                buf.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            for buf in self._maps.values():
                if isinstance(buf, mmap.mmap):
                    try:
                        buf.close()
                    except BufferError:  # an array still views it; the GC will close it
                        pass
            self._maps.clear()
            _close_all(self._fds)

    def __enter__(self) -> FileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def execute(ops: Sequence[CopyOp], out: np.ndarray, files: FileCache, label: str = "tensor") -> int:
    """Run copy ops into ``out`` (whose box is the request); return bytes read."""
    return execute_many([(op, out) for op in ops], files, label)


def execute_many(items: Sequence[tuple[CopyOp, np.ndarray]], files: FileCache, label: str = "tensor") -> int:
    """Run ``(op, out)`` pairs (each op into its request's ``out``) together; return bytes read.

    Locations whose class has a ``read_many(items, files)`` static method
    (``items``: ``(location, box, dst)`` triples; TensorStore's batches its
    reads and runs them concurrently itself, so a chunk that several
    requests share is fetched and decoded once) get all their ops in one
    call; the others are copied here, on a thread pool when there are several.
    """
    return _execute([(op, out, label) for op, out in items], files)


def _execute(items: Sequence[tuple[CopyOp, np.ndarray, str]], files: FileCache) -> int:
    """:func:`execute_many` with a label (the tensor named in errors) per op."""
    many: dict[Any, list[tuple[Any, Box, np.ndarray]]] = {}
    rest = []
    for op, out, label in items:
        where: tuple[Any, ...] = (*op.dst.slices(), Ellipsis)
        dst = out[where]
        cls = type(op.fragment.location)
        if hasattr(cls, "read_many"):
            many.setdefault(cls, []).append((op.fragment.location, op.src, dst))
        else:
            rest.append((op, dst, label))
    total: int = sum(cls.read_many(group, files) for cls, group in many.items())
    return total + _execute_each(rest, files)


def _execute_each(items: Sequence[tuple[CopyOp, np.ndarray, str]], files: FileCache) -> int:
    def one(item: tuple[CopyOp, np.ndarray, str]) -> int:
        op, dst, label = item
        frag = op.fragment
        loc = frag.location
        if (files.verify and frag.checksum and op.src.shape == frag.box.shape and isinstance(loc, FileRegion)
                and loc.strides == c_strides(frag.box.shape)):
            return files.copy_verified(frag, dst, label)
        return int(loc.read_into(op.src, dst, files))

    if any("://" in getattr(op.fragment.location, "file", "") for op, _, _ in items):
        from .remote import execute_remote

        return execute_remote(items, files, one)
    if len(items) <= 1 or sum(op.src.size for op, _, _ in items) < (1 << 16):
        return sum(one(item) for item in items)
    from concurrent.futures import ThreadPoolExecutor  # (not imported by open: it reads nothing)

    with ThreadPoolExecutor(min(files.max_workers, len(items))) as pool:
        return sum(pool.map(one, items))


def read_boxes(
    state: TensorState,
    boxes: Sequence[Box],
    files: FileCache,
    dtype: str | None = None,
    name: str = "tensor",
    out: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Read several boxes of one tensor state at once (e.g. every device's shard), cast to ``dtype``.

    All copies are planned first and run together, so storage that batches
    (TensorStore) reads a chunk shared by several boxes once. ``out`` gives
    the destination arrays (one per box, of its shape) instead of new ones::

        a, b = read_boxes(state, [Box((0, 0), (4, 8)), Box((4, 0), (4, 8))], files)
    """
    np_dtype = _dtypes.to_numpy(dtype or state.dtype)
    if out is None:
        outs = [fresh_array(b.shape, np_dtype) for b in boxes]
    else:
        outs = list(out)
        bad = [(o.shape, b.shape) for o, b in zip(outs, boxes) if o.shape != b.shape]
        if len(outs) != len(boxes) or bad:
            raise ValueError(f"{name}: {len(outs)} out arrays for {len(boxes)} boxes, shapes {bad[:3]}")
    items = [(op, out) for b, out in zip(boxes, outs) for op in plan(state.fragments, b, name)]
    execute_many(items, files, name)
    return outs


def read_state(
    state: TensorState,
    box: Box | None,
    files: FileCache,
    dtype: str | None = None,
    name: str = "tensor",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Read ``box`` (default: everything) of one tensor state, cast to ``dtype``."""
    box = Box.full(state.shape) if box is None else box
    np_dtype = _dtypes.to_numpy(dtype or state.dtype)
    if out is None:
        out = fresh_array(box.shape, np_dtype)
    elif out.shape != box.shape:
        raise ValueError(f"{name}: out has shape {out.shape}, request is {box.shape}")
    execute(plan(state.fragments, box, name), out, files, name)
    return out


def read_states(states: Sequence[tuple[TensorState, str]], files: FileCache, dtype: str | None = None,
                batch_bytes: int = 256 << 20) -> list[np.ndarray]:
    """Several tensor states read whole, in rounds of about ``batch_bytes`` of output: each
    round's copies run together (one concurrent fetch per object behind a URL, one thread pool
    locally), so many small tensors cost one round trip, not one each. ``states`` pairs each
    state with the label its errors name::

        w, m = read_states([(w_state, "ckpt: w"), (m_state, "ckpt: w.exp_avg")], files)
    """
    outs = [fresh_array(st.shape, _dtypes.to_numpy(dtype or st.dtype)) for st, _ in states]
    batch: list[tuple[CopyOp, np.ndarray, str]] = []
    size = 0
    for (st, label), out in zip(states, outs):
        batch.extend((op, out, label) for op in plan(st.fragments, Box.full(st.shape), label))
        size += out.nbytes
        if size >= batch_bytes:
            _execute(batch, files)
            batch, size = [], 0
    if batch:
        _execute(batch, files)
    return outs

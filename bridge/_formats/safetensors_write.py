"""The streaming safetensors writer of the universal layout: many files, chunked, checksummed,
written with ``O_DIRECT`` from reused page-aligned buffers while the next chunks are produced::

    write_files([FileSpec("out.safetensors", [Entry("w", "float32", (4, 6), arr)])])

The same pipeline writes files of other layouts, given as a :class:`StreamFile`: a run of
known bytes, tensor entries, and :class:`Late` bytes that depend on the CRC32s of the
entries before them (a zip record's data descriptor, a central directory)::

    tail = Late(4, lambda crcs: struct.pack("<I", crcs[0]))
    write_files([StreamFile("out.bin", [b"head", Entry("w", "float32", (4, 6), arr), tail])])
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes, _storage
from .._errors import FormatError, WriteError
from .._storage.crc import crc32, crc32_combine
from .._storage.hostmem import aligned_buffer
from .safetensors import Entry, FileSpec, Written, file_layout


@dataclass(frozen=True)
class Late:
    """``nbytes`` bytes of a :class:`StreamFile` known only once the entries before them are
    produced: ``make(crcs)`` gets the CRC32 of each entry of the file so far, in file order."""

    nbytes: int
    make: Callable[[Sequence[int]], bytes]


@dataclass(frozen=True)
class StreamFile:
    """A new file of any layout for :func:`write_files`: ``parts`` in file order (bytes,
    entries whose data is produced in chunks and checksummed, :class:`Late` bytes)."""

    path: str
    parts: Sequence[bytes | Entry | Late]
    image: None = None  # written from parts only (the field FileSpec's images use)
    reuse: None = None


def write_file(path: str, entries: list[Entry], metadata: Mapping[str, str] | None = None,
               on_entry: Callable[[Entry], None] | None = None) -> list[Written]:
    """Stream ``entries`` into a new safetensors file at ``path`` and fsync it (see :func:`write_files`)."""
    return write_files([FileSpec(path, entries, metadata)], on_entry)[0]


def write_files(files: Sequence[FileSpec | StreamFile], on_entry: Callable[[Entry], None] | None = None,
                background: bool = False, producers: int | None = None) -> list[list[Written]]:
    """Stream several new safetensors files, one after the other, and fsync each.

    Headers are computed from shapes first, so data is produced in chunks of at
    most ``_CHUNK_BYTES`` (callables lazily; arrays and fillers by rows)
    straight into reused page-aligned buffers, at the position the bytes take
    in their disk block: background threads write them from there with
    ``O_DIRECT`` while the next chunks are read and checksummed, with no
    staging copy and no pipeline drain between files. Peak memory is
    ``_SLOTS`` chunks, not the files. ``background`` (checkpoints flushed while
    training computes): one checksum thread, and all threads at a lower CPU
    priority, so the training's threads keep the cores. ``files`` may mix safetensors files
    (:class:`FileSpec`) and files of other layouts (:class:`StreamFile`). ``producers``:
    threads reading and checksumming chunks (default ``_PRODUCERS``; 1 when ``background``).
    """
    tasks = plan_chunks(files)
    copied = [k for k, t in enumerate(tasks) if files[t.file].image is None]
    if not tasks:
        return []
    n_slots = min(_SLOTS, len(copied))
    slots = [_POOL.take(max(tasks[k].nbytes for k in copied) + _ALIGN) for _ in range(n_slots)]
    slot_of = {k: i % n_slots for i, k in enumerate(copied)}
    reuse = {k: copied[i - n_slots] for i, k in enumerate(copied) if i >= n_slots}  # previous user of the slot
    written = [threading.Event() for _ in tasks]  # chunk k is on disk (its slot may be reused)
    stop = threading.Event()

    def produce(k: int) -> tuple[mmap.mmap, int, int]:
        if k in reuse:
            written[reuse[k]].wait()
        if stop.is_set():
            raise RuntimeError("aborted")
        spec = files[tasks[k].file]
        if spec.image is not None:
            return spec.image, tasks[k].at, _from_image(spec.image, tasks[k])
        return slots[slot_of[k]], tasks[k].at % _ALIGN, _produce(spec.path, tasks[k], slots[slot_of[k]])

    first: dict[int, int] = {}
    for k, t in enumerate(tasks):
        first.setdefault(t.file, k)
    last = {t.file: k for k, t in enumerate(tasks)}
    outs: dict[int, _NewFile] = {}
    results: list[list[Written]] = [[] for _ in files]
    init = lower_priority if background else None
    writer = _Writer(_WRITERS, init)
    producer = ThreadPoolExecutor(1 if background else producers or _PRODUCERS, initializer=init)
    crc = 0
    crcs: list[int] = []  # of the current file's entries so far (what Late parts are made from)
    try:
        futures = [producer.submit(produce, k) for k in range(len(tasks))]
        for k, t in enumerate(tasks):
            buf, start, part = futures[k].result()
            writer.check()
            if first[t.file] == k:
                crcs = []
            if isinstance(t.item, Late):
                _fill_late(files[t.file].path, t.item, crcs, buf, start)
            if t.file not in outs:
                outs[t.file] = _new_file(files[t.file].path, files[t.file].reuse)
            writer.put(outs[t.file].chunk(buf, start, t.nbytes), written[k])
            if isinstance(t.item, Entry):
                crc = part if t.first else crc32_combine(crc, part, t.nbytes)
                if t.last:
                    crcs.append(crc)
                    results[t.file].append(Written(t.item.key, t.entry_at, t.item.nbytes, f"crc32:{crc:08x}"))
                    if on_entry:
                        on_entry(t.item)
            if last[t.file] == k:
                writer.put(outs.pop(t.file).finish_after(written[first[t.file] : k + 1]))
        writer.close()
    except BaseException:
        stop.set()
        for ev in written:
            ev.set()
        writer.close(abort=True)
        for out in outs.values():
            out.abort()
        raise
    finally:
        producer.shutdown(wait=True, cancel_futures=True)
        for m in slots:
            _POOL.give(m)
    return results


@dataclass(frozen=True)
class _Task:
    """A run of a file's bytes to produce: known bytes, late bytes, or rows ``[lo, hi)`` of an entry."""

    file: int
    item: bytes | Entry | Late
    at: int  # file offset of the run's first byte
    nbytes: int
    entry_at: int = 0  # file offset of the entry's first byte
    rows: tuple[int, int] | None = None  # None: the whole item
    first: bool = True
    last: bool = True


def _parts(spec: FileSpec | StreamFile) -> list[bytes | Entry | Late]:
    if isinstance(spec, StreamFile):
        return list(spec.parts)
    head, _, size = file_layout(spec.entries, spec.metadata)
    if spec.image is not None and len(spec.image) < size:
        raise ValueError(f"{spec.path}: image of {len(spec.image)} bytes for a {size}-byte file")
    return [head, *spec.entries]


def plan_chunks(files: Sequence[FileSpec | StreamFile], chunk_bytes: int | None = None) -> list[_Task]:
    """The runs of bytes :func:`write_files` produces, in file order (pure)."""
    chunk_bytes = chunk_bytes or _CHUNK_BYTES
    tasks: list[_Task] = []
    for i, spec in enumerate(files):
        parts = _parts(spec)
        keys = [e.key for e in parts if isinstance(e, Entry)]
        if len(set(keys)) != len(keys):
            raise FormatError(f"{spec.path}: duplicate keys in one file")
        at = 0
        for e in parts:
            nbytes = len(e) if isinstance(e, bytes) else e.nbytes
            if not isinstance(e, Entry):
                tasks.append(_Task(i, e, at, nbytes))
            elif spec.image is not None:  # bytes already in place: checksum and write by byte ranges
                for lo in range(0, max(e.nbytes, 1), chunk_bytes):
                    hi = min(lo + chunk_bytes, e.nbytes)
                    tasks.append(_Task(i, e, at + lo, hi - lo, at, None, lo == 0, hi == e.nbytes))
            elif not (_by_rows(e) and e.shape and e.shape[0] > 1 and e.nbytes > chunk_bytes):
                tasks.append(_Task(i, e, at, e.nbytes, at))
            else:
                row = e.nbytes // e.shape[0]
                step = max(1, chunk_bytes // max(row, 1))
                for lo in range(0, e.shape[0], step):
                    hi = min(lo + step, e.shape[0])
                    tasks.append(_Task(i, e, at + lo * row, (hi - lo) * row, at, (lo, hi), lo == 0, hi == e.shape[0]))
            at += nbytes
    return tasks


def _by_rows(e: Entry) -> bool:
    return isinstance(e.data, np.ndarray) or bool(getattr(e.data, "fills", False))


def _fill_late(path: str, late: Late, crcs: Sequence[int], buf: mmap.mmap, start: int) -> None:
    data = late.make(crcs)
    if len(data) != late.nbytes:
        raise FormatError(f"{path}: {len(data)} late bytes where {late.nbytes} were planned")
    buf[start : start + late.nbytes] = data


def _from_image(image: mmap.mmap, t: _Task) -> int:
    """An image task: fill in the header, or checksum bytes already in place."""
    if isinstance(t.item, bytes):
        image[: t.nbytes] = t.item
        return 0
    with memoryview(image) as mv:
        return crc32(mv[t.at : t.at + t.nbytes])


def _produce(path: str, t: _Task, buf: mmap.mmap) -> int:
    """Put one task's bytes into ``buf`` at their in-block position; their CRC32."""
    head = t.at % _ALIGN
    if isinstance(t.item, bytes):
        buf[head : head + t.nbytes] = t.item
        return 0
    if isinstance(t.item, Late):  # filled in file order, once the CRCs before it are known
        return 0
    e = t.item
    shape = e.shape if t.rows is None else (t.rows[1] - t.rows[0], *e.shape[1:])
    out = np.frombuffer(buf, np.uint8, count=t.nbytes, offset=head).view(_dtypes.to_numpy(e.dtype)).reshape(shape)
    data: Any = e.data
    if getattr(data, "fills", False):
        arr = data(out=out, rows=t.rows)
    elif callable(e.data):
        arr = e.data()
    else:
        arr = e.data if t.rows is None else e.data[t.rows[0] : t.rows[1]]
    arr = np.asarray(arr)
    if tuple(arr.shape) != shape:
        raise FormatError(f"{path}: tensor {e.key!r} has shape {arr.shape}, declared {shape}")
    if arr is not out:
        np.copyto(out, arr, casting="unsafe")
    del arr, out
    with memoryview(buf) as mv:
        return crc32(mv[head : head + t.nbytes])


_ALIGN = 4096
_CHUNK_BYTES = 16 << 20  # entries bigger than this are produced and written by rows
_SLOTS = 6  # chunk buffers in flight: some being written while the others are filled
_PRODUCERS = 2  # chunks read and checksummed at once
_WRITERS = 3  # writes in flight (virtual disks take more than one at a time faster)


class _Pool:
    """Page-aligned buffers kept for reuse (up to ``limit`` bytes): on virtual machines
    that hand freed memory back to the host, touching fresh pages costs more than the
    disk, so staging and read buffers are recycled from file to file and save to save."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.lock = threading.Lock()
        self.kept: list[mmap.mmap] = []
        self.limit = limit

    def take(self, nbytes: int) -> mmap.mmap:
        with self.lock:
            fits = [m for m in self.kept if len(m) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self.kept.remove(best)
                return best
        return aligned_buffer(nbytes)

    def give(self, buf: mmap.mmap) -> None:
        with self.lock:
            self.kept.append(buf)
            self.kept.sort(key=len, reverse=True)
            while sum(len(m) for m in self.kept) > self.limit:
                extra = self.kept.pop(0)
                with contextlib.suppress(BufferError):  # still viewed somewhere: the GC frees it
                    extra.close()


_POOL = _Pool()


class _Writer:
    """Background threads running write jobs (in order of start); the first failure is kept
    and reported by :meth:`check` / :meth:`close`, and later jobs are skipped."""

    def __init__(self, threads: int = 1, init: Callable[[], None] | None = None) -> None:
        self.init = init
        self.jobs: queue.SimpleQueue[tuple[Callable[[], None] | None, threading.Event] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._run, name="ckptbridge-write", daemon=True)
                        for _ in range(threads)]
        for th in self.threads:
            th.start()

    def _run(self) -> None:
        if self.init:
            self.init()
        while (item := self.jobs.get()) is not None:
            job, done = item
            try:
                if job is not None and self.error is None:
                    job()
            except BaseException as err:
                self.error = err
            done.set()

    def put(self, job: Callable[[], None] | None, done: threading.Event | None = None) -> threading.Event:
        """Queue ``job`` (None: nothing to do); ``done`` (returned) is set once it ran or was skipped."""
        done = done or threading.Event()
        self.jobs.put((job, done))
        return done

    def check(self) -> None:
        if self.error is not None:
            raise WriteError(f"write failed: {self.error}", getattr(self.error, "errno", None)) from self.error

    def close(self, abort: bool = False) -> None:
        if abort and self.error is None:
            self.error = RuntimeError("aborted")
        for _ in self.threads:
            self.jobs.put(None)
        for th in self.threads:
            th.join()
        if not abort:
            self.check()


_BACKGROUND_NICE = 10


def lower_priority() -> None:
    """Give the calling thread a CPU priority ``_BACKGROUND_NICE`` steps below the one it inherited
    from the thread that started it (Linux only: there nice values are per thread; elsewhere the id
    would name a process). Relative, so it stays below the training threads when the whole process
    runs under an outer ``nice`` (an absolute value would raise it back, or be refused); capped at 19::

        ThreadPoolExecutor(2, initializer=lower_priority)  # workers below the caller's threads
    """
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + _BACKGROUND_NICE, 19))


def _pwrite_all(fd: int, buf: mmap.mmap, lo: int, hi: int, at: int, path: str = "") -> None:
    try:
        with memoryview(buf) as mv:
            while lo < hi:
                n = os.pwrite(fd, mv[lo:hi], at)
                lo, at = lo + n, at + n
    except OSError as err:
        raise WriteError(f"{path}: writing bytes {at}-{at + hi - lo}: {err.strerror}", err.errno) from err


def _new_file(path: str, reuse: str | None = None) -> Any:
    """A new local file (O_DIRECT where possible; ``reuse``: see :class:`FileSpec`), or a
    streamed upload for a URL."""
    return _storage.remote(path).writer(path) if _storage.is_url(path) else _NewFile(path, reuse)


class _NewFile:
    """A new file written front to back from page-aligned buffers, then fsync'd.

    Each chunk's bytes sit in its buffer at their offset within a disk block
    (``head`` = file position mod 4096), with the bytes before them free: the
    previous chunk's unfinished block is copied there, so every write is whole
    aligned blocks straight from the buffer (``O_DIRECT``, where the file
    system allows; on virtual machines the page cache's fresh pages cost more
    than the disk). Elsewhere it falls back to ordinary buffered writes.

    ``reuse``: an old file renamed to ``path`` and overwritten, then cut to the new length
    (when it is gone, a new file is created as usual).
    """

    def __init__(self, path: str, reuse: str | None = None) -> None:
        self.path, self.pos, self.carry = path, 0, b""
        self.reused = False
        if reuse is not None:
            try:
                os.rename(reuse, path)
                self.reused = True
            except OSError:  # taken by another writer, or removed: a new file
                pass
        flags = os.O_WRONLY | (0 if self.reused else os.O_CREAT | os.O_EXCL) | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        self.fd = -1
        if direct:
            try:
                self.fd = os.open(path, flags | direct, 0o644)
            except OSError:  # no O_DIRECT here (tmpfs, some network file systems)
                self.fd = -1
        self.direct = self.fd >= 0
        if not self.direct:
            try:
                self.fd = os.open(path, flags, 0o644)
            except OSError as err:
                raise WriteError(f"{path}: cannot create the file ({err.strerror})", err.errno) from None

    def chunk(self, buf: mmap.mmap, start: int, n: int) -> Callable[[], None] | None:
        """The write job for ``buf[start:start + n]``, the file's next ``n`` bytes (call in file order).

        With ``O_DIRECT``, ``buf[start - head:start]`` (``head`` = file position mod
        4096) must be free or hold the previous bytes, and ``buf[start - head]``
        be page-aligned."""
        fd, at = self.fd, self.pos
        self.pos += n
        if not self.direct:
            return lambda: _pwrite_all(fd, buf, start, start + n, at, self.path)
        head = at % _ALIGN
        lo = start - head
        if head != len(self.carry) or lo < 0:
            raise AssertionError(f"{self.path}: chunk at block offset {head}, carrying {len(self.carry)}")
        if head and buf[lo:start] != self.carry:
            buf[lo:start] = self.carry
        end = start + n
        whole = lo + (end - lo) // _ALIGN * _ALIGN
        self.carry = buf[whole:end]
        return (lambda: _pwrite_all(fd, buf, lo, whole, at - head, self.path)) if whole > lo else None

    def finish_after(self, writes: Sequence[threading.Event]) -> Callable[[], None]:
        """The job that, once ``writes`` are done, writes the last partial block, trims the
        padding, fsyncs and closes the file."""

        def job() -> None:
            for w in writes:
                w.wait()
            self._finish()

        return job

    def _finish(self) -> None:
        try:
            if self.direct and self.carry:
                block = _POOL.take(_ALIGN)
                try:
                    block[: len(self.carry)] = self.carry
                    block[len(self.carry) : _ALIGN] = bytes(_ALIGN - len(self.carry))
                    _pwrite_all(self.fd, block, 0, _ALIGN, self.pos - len(self.carry), self.path)
                finally:
                    _POOL.give(block)
            if self.direct or self.reused:
                os.ftruncate(self.fd, self.pos)
            os.fsync(self.fd)
        finally:
            self.abort()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

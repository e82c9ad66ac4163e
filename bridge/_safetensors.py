"""safetensors files: read in place (also HF sharded ``*.safetensors.index.json``) and stream-write.

Format: 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data; offsets are relative to byte ``8 + N``::

    header, base = read_header("model.safetensors")
    ckpt = ckptbridge.open("model.safetensors")   # via index()
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _dtypes
from ._checkpoint import CheckpointIndex
from ._errors import FormatError, MissingShardError, TruncatedError
from ._model import LogicalTensor, TensorState, check_name, contiguous_fragment

_MAX_HEADER = 100 << 20


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """The parsed JSON header of a safetensors file and the byte offset its data starts at.

    Validates every entry against the file size, so a lying header never
    leads to a huge allocation or a read past the end.
    """
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise TruncatedError(f"{path}: too short for a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise TruncatedError(f"{path}: header claims {n} bytes but the file has {size}")
            raw = fh.read(n)
    except FileNotFoundError:
        raise MissingShardError(f"{path}: file not found") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"{path}: safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _dtypes.from_safetensors(info["dtype"])
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError(f"{path}: tensor {name!r} has a malformed header entry ({err})") from None
        if any(s < 0 for s in shape) or begin < 0 or end < begin:
            raise FormatError(f"{path}: tensor {name!r} has a negative shape or offsets")
        if (end - begin) != math.prod(shape) * _dtypes.itemsize(dtype):
            raise FormatError(f"{path}: tensor {name!r} byte range {end - begin} does not match shape {shape} {dtype}")
        if base + end > size:
            raise TruncatedError(f"{path}: tensor {name!r} ends at byte {base + end} but the file has {size}")
    return header, base


def _single_file_tensors(path: str) -> dict[str, LogicalTensor]:
    header, base = read_header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        check_name(name, path)
        dtype = _dtypes.from_safetensors(info["dtype"])
        frag = contiguous_fragment(info["shape"], path, base + int(info["data_offsets"][0]), dtype)
        out[name] = LogicalTensor(name, {"param": TensorState(dtype, frag.box.shape, (frag,))})
    return out


def shard_files(index_json: str) -> list[str]:
    """The shard files an HF ``*.index.json`` (``{"weight_map": {name: file}}``) lists, in order,
    refusing any that would lie outside its directory."""
    try:
        with open(index_json) as fh:
            weight_map = json.load(fh)["weight_map"]
        names = list(dict.fromkeys(str(f) for f in weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise FormatError(f"{index_json}: not a shard index ({err})") from None
    root = os.path.normpath(os.path.dirname(index_json))
    files = []
    for f in names:
        full = os.path.normpath(os.path.join(root, f))
        if os.path.dirname(full) != root:
            raise FormatError(f"{index_json}: shard name {f!r} points outside the checkpoint directory")
        files.append(full)
    return files


def _index_files(path: str) -> list[str]:
    if os.path.isdir(path):
        idx = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors.index.json")]
        if idx:
            return shard_files(os.path.join(path, idx[0]))
        return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    return shard_files(path) if path.endswith(".index.json") else [path]


def detect(path: str) -> bool:
    if os.path.isfile(path):
        return path.endswith((".safetensors", ".safetensors.index.json"))
    if os.path.isdir(path):
        return any(f.endswith((".safetensors", ".safetensors.index.json")) for f in os.listdir(path))
    return False


def index(path: str) -> CheckpointIndex:
    """Open a safetensors file, an HF ``*.safetensors.index.json`` or a folder of shards."""
    tensors: dict[str, LogicalTensor] = {}
    files = _index_files(path)
    for f in files:
        if not os.path.exists(f):
            raise MissingShardError(f"{f}: shard listed by {path} is missing")
        for name, t in _single_file_tensors(f).items():
            if name in tensors:
                raise FormatError(f"{f}: tensor {name!r} appears in two shards")
            tensors[name] = t
    meta = {}
    if len(files) == 1:
        meta = read_header(files[0])[0].get("__metadata__") or {}
    return CheckpointIndex("safetensors", path, tensors, extra={"metadata": meta} if meta else {})


# ------------------------------------------------------------------ writing


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its key, dtype, shape and how to get its data (array or callable)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray | Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class Written:
    """Where an entry landed: absolute byte offset in the file and its CRC32."""

    key: str
    offset: int
    nbytes: int
    checksum: str


def _header_bytes(entries: Iterable[Entry], metadata: Mapping[str, str] | None) -> tuple[bytes, list[int]]:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets, at = [], 0
    for e in entries:
        header[e.key] = {"dtype": _dtypes.to_safetensors(e.dtype), "shape": list(e.shape),
                         "data_offsets": [at, at + e.nbytes]}
        offsets.append(at)
        at += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, offsets


def as_bytes(arr: np.ndarray) -> memoryview:
    """The bytes of an array in row-major order (no copy when already contiguous)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def write_file(path: str, entries: list[Entry], metadata: Mapping[str, str] | None = None,
               on_entry: Callable[[Entry], None] | None = None) -> list[Written]:
    """Stream ``entries`` into a new safetensors file at ``path`` and fsync it.

    The header is computed from shapes first, so data is produced one entry at
    a time (callables are called lazily, the next one while the previous is
    written): peak memory is about two entries, not the file.
    """
    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys):
        raise FormatError(f"{path}: duplicate keys in one safetensors file")
    raw, offsets = _header_bytes(entries, metadata)
    base = 8 + len(raw)

    # Producers that can fill a given array (``data.fills``) get one of two reused buffers: one
    # is being written while the other is filled. Fresh memory is slow to touch on many VMs.
    biggest = max((e.nbytes for e in entries if getattr(e.data, "fills", False)), default=0)
    maps = [_POOL.take(biggest), _POOL.take(biggest)] if biggest else []
    ring = [np.frombuffer(m, np.uint8, count=biggest) for m in maps]
    slot = {id(e): i % 2 for i, e in enumerate(entries)}

    def produce(e: Entry) -> tuple[memoryview, str]:
        if ring and getattr(e.data, "fills", False):
            out = ring[slot[id(e)]][: e.nbytes].view(_dtypes.to_numpy(e.dtype)).reshape(e.shape)
            arr = e.data(out=out)
        else:
            arr = e.data() if callable(e.data) else e.data
        arr = np.asarray(arr)
        if tuple(arr.shape) != tuple(e.shape):
            raise FormatError(f"{path}: tensor {e.key!r} has shape {arr.shape}, declared {e.shape}")
        want = _dtypes.to_numpy(e.dtype)
        buf = as_bytes(arr if arr.dtype == want else arr.astype(want))
        return buf, f"crc32:{zlib.crc32(buf):08x}"  # checksummed here, overlapping the previous write

    out: list[Written] = []
    try:
        _write_entries(path, entries, raw, offsets, base, produce, on_entry, out)
    finally:
        ring.clear()  # drop our views before the buffers go back
        for m in maps:
            _POOL.give(m)
    return out


def _write_entries(path: str, entries: list[Entry], raw: bytes, offsets: list[int], base: int,
                   produce: Callable[[Entry], tuple[memoryview, str]],
                   on_entry: Callable[[Entry], None] | None, out: list[Written]) -> None:
    with _SequentialWriter(path) as fh, ThreadPoolExecutor(1) as pool:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        pending = pool.submit(produce, entries[0]) if entries else None
        for i, e in enumerate(entries):
            buf, crc = pending.result()
            pending = pool.submit(produce, entries[i + 1]) if i + 1 < len(entries) else None
            fh.write(buf)
            out.append(Written(e.key, base + offsets[i], e.nbytes, crc))
            del buf
            if on_entry:
                on_entry(e)


_ALIGN = 4096
_STAGE_BYTES = 16 << 20


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
        return mmap.mmap(-1, max(nbytes, 1))

    def give(self, buf: mmap.mmap) -> None:
        with self.lock:
            self.kept.append(buf)
            self.kept.sort(key=len, reverse=True)
            while sum(len(m) for m in self.kept) > self.limit:
                extra = self.kept.pop(0)
                with contextlib.suppress(BufferError):  # still viewed somewhere: the GC frees it
                    extra.close()


_POOL = _Pool()


class _SequentialWriter:
    """Write a new file front to back, then fsync it.

    Where the file system allows, the file is opened with ``O_DIRECT`` and data
    goes through reused, page-aligned staging buffers straight to the disk (a
    background thread writes one while the caller fills the next): on virtual
    machines the page cache's fresh pages cost more than the disk itself
    (``bench/``). Elsewhere it falls back to ordinary buffered writes.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self.fill = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        self.fd = -1
        if direct:
            try:
                self.fd = os.open(path, flags | direct, 0o644)
            except OSError:  # no O_DIRECT here (tmpfs, some network file systems)
                self.fd = -1
        self.direct = self.fd >= 0
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
            return
        self.free: queue.Queue[mmap.mmap] = queue.Queue()
        self.stages = [_POOL.take(_STAGE_BYTES), _POOL.take(_STAGE_BYTES)]
        for m in self.stages:
            self.free.put(m)
        self.full: queue.Queue[tuple[mmap.mmap, int] | None] = queue.Queue()
        self.error: BaseException | None = None
        self.stage = self.free.get()
        self.thread = threading.Thread(target=self._drain, name="ckptbridge-write", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while (item := self.full.get()) is not None:
            buf, n = item
            try:
                if self.error is None:
                    self._write_all(memoryview(buf)[:n])
            except BaseException as err:  # reported by the caller's next write/close
                self.error = err
            self.free.put(buf)

    def write(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        self.size += len(mv)
        if not self.direct:
            self._write_all(mv)
            return
        while len(mv):
            n = min(len(mv), _STAGE_BYTES - self.fill)
            self.stage[self.fill : self.fill + n] = mv[:n]
            self.fill += n
            mv = mv[n:]
            if self.fill == _STAGE_BYTES:
                self._hand_over(_STAGE_BYTES)

    def _hand_over(self, n: int) -> None:
        if self.error is not None:
            raise OSError(f"{self.path}: write failed ({self.error})") from self.error
        self.full.put((self.stage, n))
        self.stage = self.free.get()
        self.fill = 0

    def _write_all(self, mv: memoryview) -> None:
        while len(mv):
            mv = mv[os.write(self.fd, mv) :]

    def close(self, ok: bool = True) -> None:
        try:
            if self.direct:
                if ok and self.fill:
                    padded = -(-self.fill // _ALIGN) * _ALIGN  # O_DIRECT writes whole blocks; trim after
                    self.stage[self.fill : padded] = bytes(padded - self.fill)
                    self._hand_over(padded)
                self.full.put(None)
                self.thread.join()
                if ok and self.error is not None:
                    raise OSError(f"{self.path}: write failed ({self.error})") from self.error
                if ok:
                    os.ftruncate(self.fd, self.size)
            if ok:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            for m in getattr(self, "stages", ()):
                _POOL.give(m)

    def __enter__(self) -> _SequentialWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(ok=exc_type is None)

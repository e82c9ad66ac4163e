"""Orbax arrays read straight from their files: no TensorStore on the data path.

An uncompressed Zarr chunk is the chunk's elements, row-major, little-endian:
zarr v2 with ``"compressor": null`` (no filters, C order), zarr v3 with only the
``bytes`` codec, or zarr v3 ``sharding_indexed`` whose inner chunks are ``bytes``
(Orbax's ``use_compression=False``). Such a chunk is a
:class:`~ckptbridge.plugin.FileRegion`: the core executor then reads a device's
box with ``preadv`` straight into its buffer (or copies just the needed
elements out of a memory map), no decoding, no staging copy.

A zstd-compressed chunk (Orbax's default: zarr v2 ``{"id": "zstd"}``, zarr v3
``bytes`` + ``zstd`` inside ``sharding_indexed``) is a :class:`ZstdChunk`. Its
``read_many`` decodes every chunk a batch of requests touches exactly once, on
a thread pool (``zstandard`` releases the GIL), ``preadv`` into a per-thread
buffer: straight into the destination when one request is the whole chunk,
else into a per-thread temporary from which each request copies its elements.
That is about twice as fast as the same reads through TensorStore's chunk
cache machinery (measured: 64 MiB of zstd chunks in 0.06 s CPU vs 0.11 s).

Where the chunk bytes live:

* plain directories (``use_ocdbt=False``): ``<item>/<param>/<chunk key>`` files;
* OCDBT (Orbax's default): the database's B+tree maps each chunk key to
  ``(data file, offset, length)``; :func:`ocdbt_values` reads it once per item
  with ``tensorstore.ocdbt.dump`` (metadata only).

Behind a URL (``s3://``, ``gs://``, any fsspec protocol) the same regions are fetched by the
storage layer (ranged, concurrent; zstd chunks one round per object per batch), and the OCDBT
B+tree is read by TensorStore's own kvstore driver for the URL (:mod:`._kvstore`).

Anything else (compression, filters, missing chunks, big-endian data, an
unexpected codec or index) returns ``None`` and the array is read through
TensorStore instead (:mod:`._tensorstore`)::

    values = ocdbt_values(item_dir)                        # {b"w/0.0": (file, offset, length)}
    frags = raw_fragments(item_dir, "w", meta, "zarr", shape, "float32", chunks, lambda: values)
"""

from __future__ import annotations

import importlib.util
import os
import struct
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    FileRegion,
    FormatError,
    Fragment,
    MissingShardError,
    TruncatedError,
    c_strides,
    require,
    storage,
)
from ckptbridge.plugin import dtypes as _dtypes

from ._kvstore import kvstore

_MISSING = (1 << 64) - 1
_HAVE_ZSTD = importlib.util.find_spec("zstandard") is not None
_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="ckptbridge-zstd"))
        return _POOL[0]


# ------------------------------------------------------------------ zstd chunks


@dataclass(frozen=True)
class ZstdChunk:
    """A fragment inside a zstd-compressed chunk.

    ``length`` bytes at ``offset`` of ``file`` are one zstd frame that decodes to a C-order
    array of shape ``chunk`` (``dtype``, little-endian); element ``idx`` of this fragment is
    element ``start + sum(idx[d] * strides[d])`` of it (``narrow``/``permute``/``insert_dim``/
    ``drop_dim`` move ``start`` and ``strides`` as for a file region)::

        ZstdChunk.read_many([(loc_a, box_a, out_a), (loc_b, box_b, out_b)], files)  # one decode per chunk
    """

    file: str
    offset: int
    length: int
    dtype: str
    chunk: tuple[int, ...]
    start: int
    strides: tuple[int, ...]

    def read_into(self, box: Box, out: np.ndarray, files: Any) -> int:
        return ZstdChunk.read_many([(self, box, out)], files)

    @staticmethod
    def read_many(items: Sequence[tuple[ZstdChunk, Box, np.ndarray]], files: Any) -> int:
        """Copy each ``(location, box, out)``; every chunk is decoded once. Bytes read (compressed)."""
        groups: dict[tuple[str, int], list[tuple[ZstdChunk, Box, np.ndarray]]] = {}
        for item in items:
            if item[1].size:
                groups.setdefault((item[0].file, item[0].offset), []).append(item)
        fetched = _fetch_remote([g[0][0] for g in groups.values()])
        if len(groups) <= 1:
            return sum(_decode_group(g, files, fetched) for g in groups.values())
        return sum(_pool().map(lambda g: _decode_group(g, files, fetched), list(groups.values())))

    def describe(self) -> str:
        return f"{self.file}@{self.offset} (zstd, {self.length} bytes)"

    def narrow(self, box: Box) -> ZstdChunk:
        shift = sum(o * s for o, s in zip(box.offset, self.strides, strict=True))
        return ZstdChunk(self.file, self.offset, self.length, self.dtype, self.chunk, self.start + shift, self.strides)

    def permute(self, perm: Sequence[int]) -> ZstdChunk:
        return ZstdChunk(self.file, self.offset, self.length, self.dtype, self.chunk, self.start,
                         tuple(self.strides[p] for p in perm))

    def insert_dim(self, dim: int) -> ZstdChunk:
        return ZstdChunk(self.file, self.offset, self.length, self.dtype, self.chunk, self.start,
                         (*self.strides[:dim], 0, *self.strides[dim:]))

    def drop_dim(self, dim: int) -> ZstdChunk:
        return ZstdChunk(self.file, self.offset, self.length, self.dtype, self.chunk, self.start,
                         self.strides[:dim] + self.strides[dim + 1 :])


_LOCAL = threading.local()
_FDS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_FDS_LOCK = threading.Lock()


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer of at least ``nbytes`` (its pages are faulted in once)."""
    buf = getattr(_LOCAL, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_LOCAL, name, buf)
    return buf[:nbytes]


def _fd(files: Any, path: str) -> int:
    """A read descriptor of ``path``, one per file per FileCache (closed when the cache goes)."""
    with _FDS_LOCK:
        fds = _FDS.get(files)
        if fds is None:
            fds = _FDS[files] = {}
            weakref.finalize(files, _close, fds)
        fd = fds.get(path)
        if fd is None:
            try:
                fd = fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise MissingShardError(f"{path}: file not found (a shard of this checkpoint is missing)") from None
        return fd


def _close(fds: dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _fetch_remote(chunks: Sequence[ZstdChunk]) -> dict[tuple[str, int], bytes]:
    """The compressed bytes of the chunks stored behind URLs: one concurrent round per object."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for c in chunks:
        if storage.is_url(c.file):
            spans.setdefault(c.file, []).append((c.offset, c.length))
    out: dict[tuple[str, int], bytes] = {}
    for url, want in spans.items():
        for (start, _), data in zip(want, storage.read_ranges(url, want), strict=True):
            out[(url, start)] = data
    return out


def _decode_group(group: Sequence[tuple[ZstdChunk, Box, np.ndarray]], files: Any,
                  fetched: Mapping[tuple[str, int], bytes]) -> int:
    import zstandard

    loc = group[0][0]
    dt = _dtypes.to_numpy(loc.dtype)
    n = int(np.prod(loc.chunk))
    data = fetched.get((loc.file, loc.offset))
    if data is not None:
        if len(data) != loc.length:
            raise TruncatedError(f"{loc.file}: needs bytes up to {loc.offset + loc.length} but the object ends "
                                 f"at {loc.offset + len(data)} (truncated or still being written)")
        view = memoryview(data)
    else:
        src = _scratch("src", loc.length)
        view, pos = memoryview(src), 0  # type: ignore[arg-type]
        fd = _fd(files, loc.file)
        while pos < loc.length:
            got = os.preadv(fd, [view[pos:]], loc.offset + pos)
            if got <= 0:
                raise TruncatedError(f"{loc.file}: needs bytes up to {loc.offset + loc.length} but the file ends "
                                     f"at {loc.offset + pos} (truncated or still being written)")
            pos += got
    first, box, out = group[0]
    whole = (len(group) == 1 and box.shape == loc.chunk and first.start == 0 and first.strides == c_strides(loc.chunk)
             and out.dtype == dt and out.flags.c_contiguous)
    target = out.reshape(-1).view(np.uint8) if whole else _scratch("dst", n * dt.itemsize)
    try:
        with zstandard.ZstdDecompressor().stream_reader(view) as reader:
            got = reader.readinto(memoryview(target))  # type: ignore[arg-type]
            extra = reader.read(1)
    except zstandard.ZstdError as err:
        raise FormatError(f"{loc.file}@{loc.offset}: zstd chunk does not decode ({err})") from None
    finally:
        view.release()
    if got != n * dt.itemsize or extra:
        raise FormatError(f"{loc.file}@{loc.offset}: zstd chunk decodes to {got}{'+' if extra else ''} bytes, "
                          f"the chunk {loc.chunk} holds {n * dt.itemsize}")
    if not whole:
        flat = target.view(dt)
        for zloc, zbox, zout in group:
            first_el = zloc.start + sum(o * s for o, s in zip(zbox.offset, zloc.strides, strict=True))
            part = np.ndarray(zbox.shape, dtype=dt, buffer=flat, offset=first_el * dt.itemsize,
                              strides=tuple(s * dt.itemsize for s in zloc.strides))
            np.copyto(zout, part, casting="unsafe")
    files.stats.add(loc.file, loc.length)
    return loc.length


# ------------------------------------------------------------------ OCDBT value locations


def ocdbt_values(item: str) -> dict[bytes, tuple[str, int, int]] | None:
    """Every indirect value of the OCDBT database at ``item``: key -> (absolute file, offset, length).

    ``None`` when the database cannot be walked this way (no single latest version
    in the manifest, an unknown reference form); inline values are not listed.
    """
    ts = require("tensorstore", "jax", "Orbax checkpoints")
    from tensorstore import ocdbt

    base = ts.KvStore.open(kvstore(item)).result()
    try:
        manifest = ocdbt.dump(base).result()
    except (ValueError, RuntimeError):
        return None
    versions = manifest.get("versions") or []
    if not versions or manifest.get("version_tree_nodes"):
        return None
    root = (versions[-1].get("root") or {}).get("location")
    out: dict[bytes, tuple[str, int, int]] = {}
    if root is None:  # an empty database
        return out
    todo = [root]
    while todo:
        node = ocdbt.dump(base, todo.pop()).result()
        for entry in node.get("entries") or []:
            ref = entry.get("indirect_value")
            if ref is not None:
                loc = _location(item, ref)
                if loc is None:
                    return None
                out[bytes(entry["key"])] = loc
                continue
            if "inline_value" in entry:
                continue
            child = next((v for v in entry.values() if isinstance(v, str) and v.startswith("btreenode:")), None)
            if child is None:
                return None
            todo.append(child)
    return out


def _location(item: str, ref: str) -> tuple[str, int, int] | None:
    """``value:<base path>:<file>:<offset>:<length>`` -> (absolute file, offset, length)."""
    parts = ref.split(":")
    if len(parts) != 5 or parts[0] != "value":
        return None
    _, prefix, rel, off, length = parts
    path = storage.inside(storage.abspath(item), prefix + rel)
    if path is None:
        return None  # a reference out of the checkpoint: leave it to TensorStore
    return path, int(off), int(length)


# ------------------------------------------------------------------ chunk layouts


@dataclass(frozen=True)
class _Layout:
    """How an array's chunk values hold its elements: whole (``inner`` None) or as a zarr3 shard
    of ``inner``-shaped chunks with an index of (offset, length) pairs at the end or the start;
    ``codec``: ``None`` (raw bytes) or ``"zstd"`` (each chunk one zstd frame)."""

    inner: tuple[int, ...] | None = None
    index_at_end: bool = True
    crc: bool = False
    codec: str | None = None


def _little(codec: Mapping[str, Any]) -> bool:
    cfg = codec.get("configuration") or {}
    return codec.get("name") == "bytes" and cfg.get("endian", "little") == "little"


def _zstd(codec: Mapping[str, Any] | None) -> bool:
    return isinstance(codec, Mapping) and codec.get("name", codec.get("id")) == "zstd"


def _zarr2_layout(meta: Mapping[str, Any]) -> _Layout | None:
    dt = meta.get("dtype")
    if meta.get("filters") or meta.get("order", "C") != "C" or not isinstance(dt, str) or dt.startswith(">"):
        return None
    comp = meta.get("compressor")
    if comp is None:
        return _Layout()
    return _Layout(codec="zstd") if _zstd(comp) and _HAVE_ZSTD else None


def _chunk_key(meta: Mapping[str, Any], driver: str, idx: Sequence[int]) -> str:
    if driver == "zarr":
        sep = meta.get("dimension_separator", ".")
        return sep.join(str(i) for i in idx) if idx else "0"
    enc = meta.get("chunk_key_encoding") or {"name": "default"}
    sep = (enc.get("configuration") or {}).get("separator", "/" if enc.get("name") == "default" else ".")
    if enc.get("name") == "v2":
        return sep.join(str(i) for i in idx) if idx else "0"
    return sep.join(["c", *(str(i) for i in idx)])


def _codec_of(codecs: Sequence[Mapping[str, Any]]) -> str | bool | None:
    """zarr3 chunk codecs: ``None`` for raw little-endian bytes, ``"zstd"`` for bytes + zstd,
    ``False`` for anything else."""
    if len(codecs) == 1 and _little(codecs[0]):
        return None
    if len(codecs) == 2 and _little(codecs[0]) and _zstd(codecs[1]) and _HAVE_ZSTD:
        return "zstd"
    return False


def _zarr3_layout(meta: Mapping[str, Any]) -> _Layout | None:
    """The layout of a zarr3 array whose chunks we read ourselves, else ``None``."""
    codecs = meta.get("codecs") or []
    plain = _codec_of(codecs)
    if plain is not False:
        return _Layout(codec=plain if isinstance(plain, str) else None)
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
        return None
    cfg = codecs[0].get("configuration") or {}
    inner = _codec_of(cfg.get("codecs") or [])
    index = cfg.get("index_codecs") or []
    if inner is False or not index or not _little(index[0]):
        return None
    if [c.get("name") for c in index[1:]] not in ([], ["crc32c"]):
        return None
    return _Layout(tuple(int(c) for c in cfg.get("chunk_shape") or ()), cfg.get("index_location", "end") == "end",
                   len(index) == 2, inner if isinstance(inner, str) else None)


def raw_fragments(
    item: str,
    param: str,
    meta: Mapping[str, Any],
    driver: str,
    shape: tuple[int, ...],
    dtype: str,
    chunks: tuple[int, ...],
    values: Callable[[], Mapping[bytes, tuple[str, int, int]] | None],
) -> tuple[Fragment, ...] | None:
    """The fragments of an array as file regions (uncompressed chunks) or :class:`ZstdChunk` s
    (zstd-compressed ones), or ``None``: read it through TensorStore.

    ``values()`` gives :func:`ocdbt_values` of the item (OCDBT, called only for an array
    read this way) or ``None`` (plain directories).
    """
    if not shape or any(s == 0 for s in shape) or len(chunks) != len(shape):
        return None
    itemsize = _dtypes.itemsize(dtype)
    layout = _zarr2_layout(meta) if driver == "zarr" else _zarr3_layout(meta)
    if layout is None:
        return None
    where_values = values()
    counts = [-(-s // c) for s, c in zip(shape, chunks, strict=True)]
    files: dict[str, int] = {}
    frags: list[Fragment] = []
    try:
        for idx in np.ndindex(*counts):
            origin = tuple(i * c for i, c in zip(idx, chunks, strict=True))
            where = _value(item, param, _chunk_key(meta, driver, idx), where_values)
            if where is None:
                return None
            path, off, length = where
            if layout.inner is None:
                if layout.codec is None and length != int(np.prod(chunks)) * itemsize:
                    return None
                frags.append(_fragment(origin, chunks, shape, path, off, length, dtype, layout.codec))
                continue
            got = _inner_fragments(path, off, length, origin, chunks, layout, shape, dtype, itemsize, files)
            if got is None:
                return None
            frags.extend(got)
    finally:
        for fd in files.values():
            os.close(fd)
    return tuple(frags)


def _value(item: str, param: str, key: str, values: Mapping[bytes, tuple[str, int, int]] | None
           ) -> tuple[str, int, int] | None:
    if values is not None:
        return values.get(f"{param}/{key}".encode())
    path = storage.join(item, param, *key.split("/"))
    try:
        return path, 0, storage.getsize(path)
    except OSError:
        return None


def _fragment(origin: Sequence[int], chunk: Sequence[int], shape: Sequence[int], path: str, off: int,
              length: int, dtype: str, codec: str | None) -> Fragment:
    box = Box(tuple(origin), tuple(min(c, s - o) for c, s, o in zip(chunk, shape, origin, strict=True)))
    if codec is None:
        return Fragment(box, FileRegion(path, off, dtype, c_strides(chunk)))
    return Fragment(box, ZstdChunk(path, off, length, dtype, tuple(int(c) for c in chunk), 0, c_strides(chunk)))


def _inner_fragments(path: str, off: int, length: int, origin: Sequence[int], chunks: Sequence[int],
                     layout: _Layout, shape: Sequence[int], dtype: str, itemsize: int,
                     files: dict[str, int]) -> list[Fragment] | None:
    """The inner chunks of one zarr3 shard, from its index (read here: ``16 * n (+4)`` bytes)."""
    inner = layout.inner or ()
    if len(inner) != len(chunks) or any(c % i for c, i in zip(chunks, inner, strict=True)):
        return None
    grid = [c // i for c, i in zip(chunks, inner, strict=True)]
    n = int(np.prod(grid))
    index_bytes = 16 * n + (4 if layout.crc else 0)
    if length < index_bytes:
        return None
    at = off + (length - index_bytes if layout.index_at_end else 0)
    if storage.is_url(path):
        raw = storage.read_bytes(path, at, 16 * n)
    else:
        fd = files.get(path)
        if fd is None:
            fd = files[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        raw = os.pread(fd, 16 * n, at)
    if len(raw) != 16 * n:
        return None
    entries = struct.unpack(f"<{2 * n}Q", raw)
    out = []
    nbytes = int(np.prod(inner)) * itemsize
    for k, sub in enumerate(np.ndindex(*grid)):
        start, size = entries[2 * k], entries[2 * k + 1]
        if start == _MISSING or start + size > length or (layout.codec is None and size != nbytes):
            return None
        o = tuple(a + b * i for a, b, i in zip(origin, sub, inner, strict=True))
        if any(x >= s for x, s in zip(o, shape, strict=True)):
            continue  # an inner chunk wholly past the array's end (written as padding)
        out.append(_fragment(o, inner, shape, path, off + start, size, dtype, layout.codec))
    return out

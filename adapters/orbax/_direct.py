"""Orbax arrays stored uncompressed, read straight from their files (no TensorStore on the data path).

An uncompressed Zarr chunk is the chunk's elements, row-major, little-endian:
zarr v2 with ``"compressor": null`` (no filters, C order), zarr v3 with only the
``bytes`` codec, or zarr v3 ``sharding_indexed`` whose inner chunks are ``bytes``
(Orbax's ``use_zarr3=True, use_compression=False``). Such a chunk is a
:class:`~ckptbridge.plugin.FileRegion`: the core executor then reads a device's
box with ``preadv`` straight into its buffer (or copies just the needed
elements out of a memory map), no decoding, no staging copy.

Where the chunk bytes live:

* plain directories (``use_ocdbt=False``): ``<item>/<param>/<chunk key>`` files;
* OCDBT (Orbax's default): the database's B+tree maps each chunk key to
  ``(data file, offset, length)``; :func:`ocdbt_values` reads it once per item
  with ``tensorstore.ocdbt.dump`` (metadata only).

Anything else (compression, filters, missing chunks, big-endian data, an
unexpected codec or index) returns ``None`` and the array is read through
TensorStore instead (:mod:`._tensorstore`)::

    values = ocdbt_values(item_dir)                        # {b"w/0.0": (file, offset, length)}
    frags = raw_fragments(item_dir, "w", meta, "zarr", shape, "float32", chunks, lambda: values)
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import Box, FileRegion, Fragment, c_strides, require
from ckptbridge.plugin import dtypes as _dtypes

_MISSING = (1 << 64) - 1


# ------------------------------------------------------------------ OCDBT value locations


def ocdbt_values(item: str) -> dict[bytes, tuple[str, int, int]] | None:
    """Every indirect value of the OCDBT database at ``item``: key -> (absolute file, offset, length).

    ``None`` when the database cannot be walked this way (no single latest version
    in the manifest, an unknown reference form); inline values are not listed.
    """
    ts = require("tensorstore", "jax", "Orbax checkpoints")
    from tensorstore import ocdbt

    base = ts.KvStore.open(f"file://{os.path.abspath(item)}/").result()
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
    path = os.path.normpath(os.path.join(item, prefix + rel))
    if not path.startswith(os.path.abspath(item) + os.sep):
        return None  # a reference out of the checkpoint: leave it to TensorStore
    return path, int(off), int(length)


# ------------------------------------------------------------------ chunk layouts


def _little(codec: Mapping[str, Any]) -> bool:
    cfg = codec.get("configuration") or {}
    return codec.get("name") == "bytes" and cfg.get("endian", "little") == "little"


def _raw_zarr2(meta: Mapping[str, Any]) -> bool:
    dt = meta.get("dtype")
    return (meta.get("compressor") is None and not meta.get("filters") and meta.get("order", "C") == "C"
            and isinstance(dt, str) and not dt.startswith(">"))


def _chunk_key(meta: Mapping[str, Any], driver: str, idx: Sequence[int]) -> str:
    if driver == "zarr":
        sep = meta.get("dimension_separator", ".")
        return sep.join(str(i) for i in idx) if idx else "0"
    enc = meta.get("chunk_key_encoding") or {"name": "default"}
    sep = (enc.get("configuration") or {}).get("separator", "/" if enc.get("name") == "default" else ".")
    if enc.get("name") == "v2":
        return sep.join(str(i) for i in idx) if idx else "0"
    return sep.join(["c", *(str(i) for i in idx)])


@dataclass(frozen=True)
class _Layout:
    """How a raw array's chunk values hold its elements: whole (``inner`` None) or as a zarr3 shard
    of ``inner``-shaped chunks with an index of (offset, length) pairs at the end or the start."""

    inner: tuple[int, ...] | None = None
    index_at_end: bool = True
    crc: bool = False


def _zarr3_layout(meta: Mapping[str, Any]) -> _Layout | None:
    """The layout of a zarr3 array stored raw, else ``None``."""
    codecs = meta.get("codecs") or []
    if len(codecs) == 1 and _little(codecs[0]):
        return _Layout()
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
        return None
    cfg = codecs[0].get("configuration") or {}
    inner = cfg.get("codecs") or []
    index = cfg.get("index_codecs") or []
    if len(inner) != 1 or not _little(inner[0]) or not index or not _little(index[0]):
        return None
    if [c.get("name") for c in index[1:]] not in ([], ["crc32c"]):
        return None
    return _Layout(tuple(int(c) for c in cfg.get("chunk_shape") or ()), cfg.get("index_location", "end") == "end",
                   len(index) == 2)


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
    """The fragments of an uncompressed array as file regions, or ``None`` (read it through TensorStore).

    ``values()`` gives :func:`ocdbt_values` of the item (OCDBT, called only for a raw array)
    or ``None`` (plain directories).
    """
    if not shape or any(s == 0 for s in shape) or len(chunks) != len(shape):
        return None
    itemsize = _dtypes.itemsize(dtype)
    layout = (_Layout() if _raw_zarr2(meta) else None) if driver == "zarr" else _zarr3_layout(meta)
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
                if length != int(np.prod(chunks)) * itemsize:
                    return None
                frags.append(_fragment(origin, chunks, shape, path, off, dtype))
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
    path = os.path.join(item, param, *key.split("/"))
    try:
        return path, 0, os.path.getsize(path)
    except OSError:
        return None


def _fragment(origin: Sequence[int], chunk: Sequence[int], shape: Sequence[int], path: str, off: int,
              dtype: str) -> Fragment:
    box = Box(tuple(origin), tuple(min(c, s - o) for c, s, o in zip(chunk, shape, origin, strict=True)))
    return Fragment(box, FileRegion(path, off, dtype, c_strides(chunk)))


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
    fd = files.get(path)
    if fd is None:
        fd = files[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    raw = os.pread(fd, 16 * n, off + (length - index_bytes if layout.index_at_end else 0))
    if len(raw) != 16 * n:
        return None
    entries = struct.unpack(f"<{2 * n}Q", raw)
    out = []
    nbytes = int(np.prod(inner)) * itemsize
    for k, sub in enumerate(np.ndindex(*grid)):
        start, size = entries[2 * k], entries[2 * k + 1]
        if start == _MISSING or size != nbytes or start + size > length:
            return None
        o = tuple(a + b * i for a, b, i in zip(origin, sub, inner, strict=True))
        if any(x >= s for x, s in zip(o, shape, strict=True)):
            continue  # an inner chunk wholly past the array's end (written as padding)
        out.append(_fragment(o, inner, shape, path, off + start, dtype))
    return out

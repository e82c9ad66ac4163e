"""safetensors files, the storage of the universal layout: validated headers, entries and file layouts
(the streaming writer is :mod:`ckptbridge._formats.safetensors_write`).

Format: 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data; offsets are relative to byte ``8 + N``::

    header, base = read_header("model.safetensors")
    names, dtypes, shapes, offsets = read_entries("model.safetensors")   # the same, column-wise
    file_layout([Entry("w", "float32", (4, 6), arr)])   # (header bytes, offsets, total size)

(Opening safetensors files and HF shard indexes as checkpoints is the
``safetensors`` format plug-in, ``ckptbridge.adapters.safetensors``.)
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import operator
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import _dtypes, _storage
from .._errors import FormatError, MissingShardError, TruncatedError
from .._read.model import check_name

_MAX_HEADER = 100 << 20


class Entries(NamedTuple):
    """A safetensors header's tensors, column-wise in file order: names, dtype names, shapes and the
    absolute byte offset of each one's data (see :func:`read_entries`)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """The parsed JSON header of a safetensors file and the byte offset its data starts at.

    Validates every entry against the file size, so a lying header never
    leads to a huge allocation or a read past the end.
    """
    header, base, size = _load(path)
    _validate(path, header, base, size)
    return header, base


def read_entries(path: str) -> Entries:
    """Every tensor entry of a safetensors file, validated as :func:`read_header` does, and its names
    as ``check_name`` does (in bulk: columns, sets and numpy; a file with a bad entry is checked entry
    by entry, naming it)::

        names, dtypes, shapes, offsets = read_entries("model.safetensors")
    """
    header, base, size = _load(path)
    entries = _validate(path, header, base, size)
    names = entries.names
    if names and (min(map(len, names)) == 0 or max(map(len, names)) > 4096 or "\x00" in "".join(names)):
        for name in names:
            check_name(name, path)
    return entries


def _load(path: str) -> tuple[dict[str, Any], int, int]:
    try:
        with _storage.open_read(path) as fh:
            size = os.fstat(fh.fileno()).st_size if not _storage.is_url(path) else _storage.getsize(path)
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
    return header, 8 + n, size


def _validate(path: str, header: dict[str, Any], base: int, size: int) -> Entries:
    names = [k for k in header if k != "__metadata__"]
    infos = [header[k] for k in names]
    fast = _columns(infos, base, size)
    if fast is not None:
        return Entries(names, *fast)
    columns: tuple[list[Any], ...] = ([], [], [])
    for name, info in zip(names, infos):
        for col, value in zip(columns, _entry(path, name, info, base, size)):
            col.append(value)
    return Entries(names, *columns)


def _columns(infos: list[Any], base: int, size: int) -> tuple[list[str], list[tuple[int, ...]], list[int]] | None:
    """Dtypes, shapes and absolute offsets of well-formed entries, checked in bulk; None when any entry
    is not plainly well-formed (then :func:`_entry` checks each one and names the bad one). Each pass is a
    C loop; what is not a dict, list or int fails one of them (a ``KeyError``, a ``TypeError``, a count)."""
    try:
        rows = list(map(operator.itemgetter("dtype", "shape", "data_offsets"), infos))
        codes, raw_shapes, spans = zip(*rows) if rows else ((), (), ())
        known = {code: _dtypes.from_safetensors(code) for code in set(codes)}  # a few distinct codes
        dtypes = list(map(known.__getitem__, codes))
        shapes = list(map(tuple, raw_shapes))  # a string or object here gives items that are not ints
        if set(map(len, spans)) - {2}:
            return None
    except (KeyError, TypeError, FormatError):
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    offsets = list(itertools.chain.from_iterable(spans))
    if set(map(type, dims)) - {int} or set(map(type, offsets)) - {int}:
        return None  # floats, strings, booleans: the slow path decides what int() makes of them
    if dims and min(dims) < 0:
        return None
    try:
        counts = np.fromiter(map(math.prod, shapes), np.int64, len(shapes))
        at = np.array(offsets, np.int64).reshape(len(spans), 2)
    except OverflowError:
        return None
    sizes = {name: _dtypes.itemsize(name) for name in known.values()}
    items = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, len(dtypes))
    begin, end = at[:, 0], at[:, 1]
    if not ((begin >= 0).all() and (end >= begin).all() and (end <= size - base).all() and (counts <= size).all()
            and (end - begin == counts * items).all()):
        return None
    return dtypes, shapes, (begin + base).tolist()


def _entry(path: str, name: str, info: Any, base: int, size: int) -> tuple[str, tuple[int, ...], int]:
    """One header entry checked: its dtype name, shape and absolute data offset."""
    try:
        dtype = _dtypes.from_safetensors(info["dtype"])
        shape = tuple(map(int, info["shape"]))  # map, min: C loops
        begin, end = map(int, info["data_offsets"])
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{path}: tensor {name!r} has a malformed header entry ({err})") from None
    if min(shape, default=0) < 0 or begin < 0 or end < begin:
        raise FormatError(f"{path}: tensor {name!r} has a negative shape or offsets")
    if (end - begin) != math.prod(shape) * _dtypes.itemsize(dtype):
        raise FormatError(f"{path}: tensor {name!r} byte range {end - begin} does not match shape {list(shape)} {dtype}")
    if base + end > size:
        raise TruncatedError(f"{path}: tensor {name!r} ends at byte {base + end} but the file has {size}")
    return dtype, shape, base + begin


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


@dataclass(frozen=True)
class FileSpec:
    """One safetensors file to write: its path, entries (in file order) and ``__metadata__``.

    ``image``: a page-aligned buffer already holding the entries' bytes where the
    file keeps them (see :func:`file_layout`); the file is then written straight
    from it (its header filled in), and the entries' ``data`` is not used.
    ``reuse``: an old local file, no longer wanted, to move to ``path`` and overwrite
    in place (its blocks are already allocated: no allocation, and no discard of freed
    blocks, on the disk's side); a fresh file when it is gone.
    """

    path: str
    entries: list[Entry]
    metadata: Mapping[str, str] | None = None
    image: mmap.mmap | None = None
    reuse: str | None = None


def file_layout(entries: Sequence[Entry], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[int], int]:
    """Header bytes (length prefix included), each entry's file offset, and the file size."""
    raw, offsets = _header_bytes(entries, metadata)
    head = struct.pack("<Q", len(raw)) + raw
    size = len(head) + (offsets[-1] + entries[-1].nbytes if entries else 0)
    return head, [len(head) + off for off in offsets], size

"""safetensors files, the storage of the universal layout: validated headers, entries and file layouts
(the streaming writer is :mod:`ckptbridge._formats.safetensors_write`).

Format: 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data; offsets are relative to byte ``8 + N``::

    header, base = read_header("model.safetensors")
    file_layout([Entry("w", "float32", (4, 6), arr)])   # (header bytes, offsets, total size)

(Opening safetensors files and HF shard indexes as checkpoints is the
``safetensors`` format plug-in, ``ckptbridge.adapters.safetensors``.)
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes, _storage
from .._errors import FormatError, MissingShardError, TruncatedError

_MAX_HEADER = 100 << 20


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """The parsed JSON header of a safetensors file and the byte offset its data starts at.

    Validates every entry against the file size, so a lying header never
    leads to a huge allocation or a read past the end.
    """
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
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _dtypes.from_safetensors(info["dtype"])
            shape = list(map(int, info["shape"]))  # map, min: C loops over 92k entries (DeepSeek-V3)
            begin, end = map(int, info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError(f"{path}: tensor {name!r} has a malformed header entry ({err})") from None
        if min(shape, default=0) < 0 or begin < 0 or end < begin:
            raise FormatError(f"{path}: tensor {name!r} has a negative shape or offsets")
        if (end - begin) != math.prod(shape) * _dtypes.itemsize(dtype):
            raise FormatError(f"{path}: tensor {name!r} byte range {end - begin} does not match shape {shape} {dtype}")
        if base + end > size:
            raise TruncatedError(f"{path}: tensor {name!r} ends at byte {base + end} but the file has {size}")
    return header, base


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

"""Read ``torch.save`` files in place, without torch and without running code.

A torch zip archive stores the pickled object tree in ``<prefix>/data.pkl``
and every storage uncompressed in ``<prefix>/data/<key>``. We unpickle the
tree with the safe loader (tensors become :class:`TensorRef`) and compute
each storage's byte offset in the archive, so a tensor becomes a
:class:`~ckptbridge._read.model.Fragment` whose slices read only their bytes::

    archive = TorchArchive.open("model.pt")
    for name, ref in iter_tensors(archive.obj):
        frag = archive.fragment(ref)
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    CheckpointError,
    FileRegion,
    FormatError,
    Fragment,
    MissingShardError,
    TruncatedError,
    storage,
)
from ckptbridge.plugin import dtypes as _dtypes

from ._format import is_torch_zip
from ._unpickle import Opaque, StorageRef, StorageType, TensorRef, safe_loads

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_MAX_PICKLE = 1 << 31


class _Window(io.RawIOBase):
    """Bytes ``[base, base + length)`` of an open file, seen by zipfile as a file of their own."""

    def __init__(self, fh: Any, base: int, length: int) -> None:
        self._fh, self._base, self._length, self._pos = fh, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        anchor = (0, self._pos, self._length)[whence]
        self._pos = max(0, min(anchor + pos, self._length))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        self._fh.seek(self._base + self._pos)
        data = self._fh.read(n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _read_archive(
    zf: zipfile.ZipFile, raw: Any, base: int, size: int, label: str
) -> tuple[dict[str, tuple[int, int]], bytes]:
    """Absolute (offset, length) of every storage record, and the pickle's bytes."""
    infos = zf.infolist()
    pkl = [i for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
    if not pkl:
        raise FormatError(f"{label}: torch archive without data.pkl")
    prefix = pkl[0].filename[: -len("data.pkl")]
    offsets: dict[str, tuple[int, int]] = {}
    records = [i for i in infos if i.filename.startswith(prefix + "data/")]
    batch = getattr(raw, "raw", raw)
    heads: list[bytes] | None = None
    if hasattr(batch, "read_ranges") and len(records) > 1:  # behind a URL: every local header in one round
        heads = batch.read_ranges([(base + i.header_offset, _LOCAL_HEADER.size) for i in records])
    for k, info in enumerate(records):
        if info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(f"{label}: storage {info.filename} is compressed")
        if heads is not None:
            head = heads[k]
        else:
            raw.seek(base + info.header_offset)
            head = raw.read(_LOCAL_HEADER.size)
        if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
            raise TruncatedError(f"{label}: broken zip entry {info.filename}")
        fields = _LOCAL_HEADER.unpack(head)
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if start + info.file_size > size:
            raise TruncatedError(
                f"{label}: storage {info.filename} ends at byte {base + start + info.file_size} "
                f"but the archive ends at {base + size} (truncated copy?)"
            )
        offsets[info.filename[len(prefix) + 5 :]] = (base + start, info.file_size)
    if pkl[0].file_size > _MAX_PICKLE:
        raise FormatError(f"{label}: data.pkl claims {pkl[0].file_size} bytes")
    return offsets, zf.read(pkl[0])


@dataclass(frozen=True)
class TorchArchive:
    """A ``torch.save`` archive: its object tree and where each storage's bytes are."""

    path: str
    obj: Any
    storage_offsets: Mapping[str, tuple[int, int]]  # key -> (byte offset, byte length)

    @staticmethod
    def open(path: str, offset: int = 0, length: int | None = None, what: str = "") -> TorchArchive:
        """Open the archive in ``path``, or the one embedded at bytes ``[offset, offset+length)``
        of it (torch DCP appends one ``torch.save`` archive per item to its ``.distcp`` files).
        Storage offsets are absolute file offsets either way."""
        path = os.fspath(path)
        label = f"{path}@{offset}" + (f" ({what})" if what else "") if offset or what else path
        if not storage.exists(path):
            raise MissingShardError(f"{path}: file not found" + (f" (needed for {what})" if what else ""))
        if not is_torch_zip(path, offset):
            raise FormatError(
                f"{label}: not a torch zip archive (legacy pre-1.6 torch.save files and plain "
                "pickles are not read; re-save with a current torch)"
            )
        try:
            with storage.open_read(path) as raw:
                total = storage.getsize(path)
                length = total - offset if length is None else length
                if offset < 0 or length < 0 or offset + length > total:
                    raise TruncatedError(f"{label}: needs bytes up to {offset + length}, the file has {total}")
                with zipfile.ZipFile(_Window(raw, offset, length)) as zf:
                    offsets, data = _read_archive(zf, raw, offset, length, label)
        except CheckpointError:
            raise
        except zipfile.BadZipFile as err:
            raise TruncatedError(f"{label}: damaged zip archive ({err})") from None
        except Exception as err:  # zipfile raises many kinds on damaged input
            raise TruncatedError(f"{label}: unreadable archive ({type(err).__name__}: {err})") from None

        def persistent_load(pid: Any) -> StorageRef:
            if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
                raise FormatError(f"unknown persistent id {pid!r}")
            stype, key, numel = pid[1], str(pid[2]), pid[4]
            dtype = stype.dtype if isinstance(stype, StorageType) else None
            if dtype is None:
                raise FormatError(f"storage {key} has unknown type {stype!r}")
            if key not in offsets:
                raise TruncatedError(f"storage record data/{key} is missing from the archive")
            return StorageRef(key, dtype, int(numel))

        obj = safe_loads(data, persistent_load, source=label)
        return TorchArchive(path, obj, offsets)

    def fragment(self, ref: TensorRef, name: str = "tensor") -> Fragment:
        """The fragment of a whole tensor (any strides) in this archive."""
        start, length = self.storage_offsets[ref.storage.key]
        size = _dtypes.itemsize(ref.dtype)
        region = FileRegion(self.path, start + ref.offset * size, ref.dtype, ref.stride)
        if ref.offset < 0 or any(s < 0 for s in ref.stride) or (
            ref.offset * size + region.extent(ref.shape) > length
        ):
            raise FormatError(
                f"{self.path}: tensor {name!r} (shape {ref.shape}, offset {ref.offset}) "
                f"reaches past its storage of {length} bytes"
            )
        return Fragment(Box.full(ref.shape), region)


# A pickle can reference one object many times (memo), so a small file can describe a tree
# whose walk is exponential, or a cycle. Walks count nodes and refuse to go on past this.
MAX_NODES = 5_000_000


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_NODES
        self.path: set[int] = set()

    def enter(self, obj: Any) -> None:
        self.left -= 1
        if self.left < 0:
            raise FormatError(f"object tree has more than {MAX_NODES} nodes (a pickle bomb?)")
        if id(obj) in self.path:
            raise FormatError("object tree contains a cycle")
        self.path.add(id(obj))


def iter_tensors(obj: Any, prefix: str = "", _budget: _Budget | None = None) -> Iterator[tuple[str, TensorRef]]:
    """All tensors in a nested dict/list tree, with dotted names (``model.layers.0.weight``)."""
    budget = _budget or _Budget()
    if isinstance(obj, TensorRef):
        yield prefix, obj
    elif isinstance(obj, (Mapping, list, tuple)):
        budget.enter(obj)
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for k, v in items:
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k), budget)
        budget.path.discard(id(obj))


def strip_tensors(obj: Any, _budget: _Budget | None = None) -> Any:
    """The tree with tensors replaced by short descriptions, as JSON-able as possible."""
    budget = _budget or _Budget()
    if isinstance(obj, TensorRef):
        return {"tensor": list(obj.shape), "dtype": obj.dtype}
    if isinstance(obj, (Mapping, list, tuple)):
        budget.enter(obj)
        if isinstance(obj, Mapping):
            out: Any = {str(k): strip_tensors(v, budget) for k, v in obj.items()}
        else:
            out = [strip_tensors(v, budget) for v in obj]
        budget.path.discard(id(obj))
        return out
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    text = repr(obj)
    return text if len(text) <= 10_000 else text[:10_000] + "..."


def read_scalar(archive: TorchArchive, ref: Any) -> float | int:
    """The value of a 0-d (or 1-element) tensor, read from its few bytes; numbers pass through."""
    if not isinstance(ref, TensorRef):
        if isinstance(ref, (int, float, np.number)):
            return ref.item() if isinstance(ref, np.number) else ref
        raise FormatError(f"{archive.path}: expected a number or a 0-d tensor, found {type(ref).__name__}")
    if math.prod(ref.shape) != 1:
        raise FormatError(f"{archive.path}: expected a scalar tensor, found shape {ref.shape}")
    loc = archive.fragment(ref).location
    dtype = _dtypes.to_numpy(ref.dtype)
    raw = storage.read_bytes(archive.path, loc.offset, dtype.itemsize)
    if len(raw) != dtype.itemsize:
        raise TruncatedError(f"{archive.path}: scalar at byte {loc.offset} is past the end of the file")
    value = np.frombuffer(raw, dtype=dtype)[0].item()
    return int(value) if float(value).is_integer() else value


def unpickled_to_json(v: Any) -> Any:
    """A value from a safely unpickled file as plain JSON (inert class records as dicts naming their class)."""
    if isinstance(v, Opaque):
        inner = v.fields or {"args": list(v.__dict__["args_"])}
        return {"__class__": f"{v._module}.{v._qualname}", **{str(k): unpickled_to_json(x) for k, x in inner.items()}}
    if isinstance(v, Mapping):
        return {str(k): unpickled_to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [unpickled_to_json(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return strip_tensors(v)

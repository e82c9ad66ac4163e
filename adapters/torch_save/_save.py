"""Write ``torch.save``-compatible files without torch (for DeepSpeed's universal layout).

A torch zip archive is a stored (uncompressed) zip with ``<name>/data.pkl`` (a
protocol-2 pickle whose tensors are ``torch._utils._rebuild_tensor_v2`` calls on
persistent storage ids), one ``<name>/data/<key>`` record per storage, aligned to
64 bytes as torch aligns them, and ``version``/``byteorder`` records. We emit the
pickle opcodes directly (only dict/list/tuple/str/int/float/bool/None, tensors,
``torch.Size``, ``OrderedDict``, and the named classes of :class:`Global`,
:class:`Reduce` and :class:`Object`), so nothing is imported and tensor bytes are
streamed from numpy arrays into the zip without extra copies; a tensor given as a
callable is read only when its record is written (one tensor in memory at a time),
or piece by piece when the callable yields pieces::

    save_torch({"param": Tensor(np_array, "float32"), "cat_dim": 0}, "fp32.pt")
    torch.load("fp32.pt", weights_only=True)   # -> {'param': tensor(...), 'cat_dim': 0}
    save_torch({"args": Object(Global("argparse", "Namespace"), {"dtype": Global("torch", "bfloat16")})}, "a.pt")

:func:`torch_stream` lays out the same archive as ``torch.save`` itself does (records with
data descriptors, CRCs after the data, a zip64 end record) for the core's direct-I/O
writer, which produces every tensor in chunks straight into page-aligned buffers and
writes them with ``O_DIRECT`` (many files in one pipeline; each fsynced)::

    write_files([torch_stream({"param": Tensor(filler, "float32", shape), "cat_dim": 0}, "fp32.pt")])
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import Entry, FormatError, Late, StreamFile, dtypes

_STORAGE = {
    "float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
}
_ALIGN = 64


@dataclass(frozen=True)
class Tensor:
    """A numpy array to be pickled as a contiguous torch tensor (``dtype`` names the torch dtype).

    ``array`` may also be a zero-argument callable, with ``shape`` given: it is called only
    when the bytes are written, and returns the array (one tensor in memory at a time) or an
    iterable of arrays whose elements, one after another in C order, are the tensor's (a
    tensor larger than memory, written piece by piece).
    """

    array: Any
    dtype: str
    shape: tuple[int, ...] | None = None

    def dims(self) -> tuple[int, ...]:
        return tuple(int(s) for s in (self.shape if self.shape is not None else self.array.shape))


@dataclass(frozen=True)
class Size:
    """A ``torch.Size``."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class Global:
    """A module-level name, pickled by reference: ``Global("torch", "bfloat16")`` is ``torch.bfloat16``."""

    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    """``func(*args)`` at load time, as pickle writes an enum member:
    ``Reduce(Global("signal", "Signals"), (15,))`` is ``signal.SIGTERM``."""

    func: Global
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Object:
    """An instance of a plain class with ``state`` as its ``__dict__``, as pickle protocol 2 writes
    one (``cls.__new__(cls)``, then BUILD): ``Object(Global("argparse", "Namespace"), {"lr": 0.1})``."""

    cls: Global
    state: dict[str, Any]


class _Pickler:
    def __init__(self) -> None:
        self.out: list[bytes] = [b"\x80\x02"]
        self.storages: list[Tensor] = []

    def glob(self, module: str, name: str) -> None:
        self.out.append(b"c" + module.encode() + b"\n" + name.encode() + b"\n")

    def dump(self, obj: Any) -> None:
        o = self.out
        if obj is None:
            o.append(b"N")
        elif obj is True:
            o.append(b"\x88")
        elif obj is False:
            o.append(b"\x89")
        elif isinstance(obj, int):
            if 0 <= obj < 256:
                o.append(b"K" + bytes([obj]))
            elif -(2**31) <= obj < 2**31:
                o.append(b"J" + struct.pack("<i", obj))
            else:
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                o.append(b"\x8a" + bytes([len(raw)]) + raw)
        elif isinstance(obj, float):
            o.append(b"G" + struct.pack(">d", obj))
        elif isinstance(obj, str):
            raw = obj.encode("utf-8")
            o.append(b"X" + struct.pack("<I", len(raw)) + raw)
        elif isinstance(obj, Tensor):
            self.tensor(obj)
        elif isinstance(obj, Size):
            self.glob("torch", "Size")
            self.dump(tuple(obj.dims))
            o.append(b"\x85R")  # TUPLE1, REDUCE
        elif isinstance(obj, Global):
            self.glob(obj.module, obj.name)
        elif isinstance(obj, Reduce):
            self.glob(obj.func.module, obj.func.name)
            self.dump(tuple(obj.args))
            o.append(b"R")
        elif isinstance(obj, Object):
            self.glob(obj.cls.module, obj.cls.name)
            o.append(b")\x81")  # EMPTY_TUPLE, NEWOBJ
            self.dump(dict(obj.state))
            o.append(b"b")  # BUILD
        elif isinstance(obj, (tuple, list)):
            o.append(b"(" if isinstance(obj, tuple) else b"]")
            if isinstance(obj, list) and obj:
                o.append(b"(")
            for v in obj:
                self.dump(v)
            o.append(b"t" if isinstance(obj, tuple) else (b"e" if obj else b""))
        elif isinstance(obj, (dict, OrderedDict)):
            if isinstance(obj, OrderedDict):
                self.glob("collections", "OrderedDict")
                o.append(b")R")
            else:
                o.append(b"}")
            if obj:
                o.append(b"(")
                for k, v in obj.items():
                    self.dump(k)
                    self.dump(v)
                o.append(b"u")
        else:
            raise FormatError(f"cannot write a {type(obj).__name__} into a torch file")

    def tensor(self, t: Tensor) -> None:
        dims = t.dims()
        if t.dtype not in _STORAGE:
            raise FormatError(f"no torch storage for dtype {t.dtype}")
        key = str(len(self.storages))
        self.storages.append(t)
        self.glob("torch._utils", "_rebuild_tensor_v2")
        self.out.append(b"(")
        self.out.append(b"(")
        self.dump("storage")
        self.glob("torch", _STORAGE[t.dtype])
        self.dump(key)
        self.dump("cpu")
        self.dump(int(np.prod(dims, dtype=np.int64)))
        self.out.append(b"tQ")  # TUPLE, BINPERSID
        self.dump(0)
        self.dump(dims)
        strides, acc = [], 1
        for s in reversed(dims):
            strides.append(acc)
            acc *= max(int(s), 1)
        self.dump(tuple(reversed(strides)))
        self.dump(False)
        self.glob("collections", "OrderedDict")
        self.out.append(b")R")
        self.out.append(b"tR")


def _pickle(obj: Any) -> _Pickler:
    p = _Pickler()
    p.dump(obj)
    p.out.append(b".")
    return p


def save_torch(obj: Any, path: str) -> int:
    """Write ``obj`` (see module doc) as a torch zip archive at ``path``; return bytes of tensor data."""
    p = _pickle(obj)
    prefix = os.path.splitext(os.path.basename(path))[0] or "archive"
    nbytes = 0
    with open(path, "wb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        _record(zf, raw, f"{prefix}/data.pkl", [b"".join(p.out)])
        _record(zf, raw, f"{prefix}/.format_version", [b"1"])
        _record(zf, raw, f"{prefix}/.storage_alignment", [b"64"])
        _record(zf, raw, f"{prefix}/byteorder", [b"little"])
        for i, t in enumerate(p.storages):
            got = t.array() if callable(t.array) else t.array
            if isinstance(got, np.ndarray) or not callable(t.array):  # one array: the tensor's shape
                got = np.asarray(got)
                if tuple(got.shape) != t.dims():
                    raise FormatError(f"{path}: tensor {i} has shape {got.shape}, expected {t.dims()}")
                got = [got]
            size = int(np.prod(t.dims(), dtype=np.int64)) * dtypes.itemsize(t.dtype)
            _record(zf, raw, f"{prefix}/data/{i}", _raw_bytes(got), size)
            nbytes += size
        _record(zf, raw, f"{prefix}/version", [b"3\n"])
        _record(zf, raw, f"{prefix}/.data/serialization_id", [b"0" * 40])
    return nbytes


def _raw_bytes(arrays: Iterable[Any]) -> Iterator[memoryview]:
    """The bytes of each array in turn, C order, without copying a contiguous one."""
    for a in arrays:
        arr = np.ascontiguousarray(a)
        if arr.size:
            yield memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _record(zf: zipfile.ZipFile, raw: Any, name: str, pieces: Any, size: int | None = None) -> None:
    """One stored record, its data 64-byte aligned, written piece by piece (``size``: its bytes,
    given when the pieces come from a generator; checked)."""
    if size is None:
        pieces = list(pieces)
        size = sum(len(x) for x in pieces)
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule: its header then holds 20 more bytes
    start = raw.tell() + 30 + len(name.encode()) + 4 + (20 if zip64 else 0)  # header, our "FB" field
    pad = (-start) % _ALIGN
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    wrote = 0
    with zf.open(info, "w", force_zip64=zip64) as dest:
        for piece in pieces:
            dest.write(piece)
            wrote += len(piece)
    if wrote != size:
        raise FormatError(f"{zf.filename}: record {name} got {wrote} bytes, expected {size}")


_ZIP64 = 0xFFFFFFFF  # sizes and offsets from here on take zip64 fields
_UTF8, _DESCRIBED = 0x0800, 0x0008  # general-purpose flags: UTF-8 names; a data descriptor follows the data


@dataclass(frozen=True)
class _Member:
    """One record of the archive: its name, where its local header starts, its size, and
    its CRC (``crc``; for a tensor, ``None`` and ``entry`` = its index among the file's entries)."""

    name: bytes
    at: int
    size: int
    crc: int | None
    entry: int = -1

    def crc_of(self, crcs: Sequence[int]) -> int:
        return crcs[self.entry] if self.crc is None else self.crc

    @property
    def flags(self) -> int:
        """As torch.save sets them: a data descriptor after every record that has data."""
        return _UTF8 | (_DESCRIBED if self.size else 0)

    @property
    def descriptor_size(self) -> int:
        return 0 if not self.size else 24 if self.size >= _ZIP64 else 16

    def descriptor(self, crcs: Sequence[int] = ()) -> bytes:
        """The data descriptor that follows the record's data (zip64 sizes for a big record)."""
        if not self.size:
            return b""
        fmt = "<4sIQQ" if self.size >= _ZIP64 else "<4sIII"
        return struct.pack(fmt, b"PK\x07\x08", self.crc_of(crcs), self.size, self.size)


def torch_stream(obj: Any, path: str) -> StreamFile:
    """The ``torch.save`` archive of ``obj`` at ``path``, as parts for the core's ``write_files``.

    Tensors are given as arrays, callables returning the whole array, or fillers (``fills``:
    filled in row blocks straight into the writer's buffers); pieces (iterables) only with
    :func:`save_torch`. The layout is torch's: each record's local header has no CRC or sizes
    (flag bit 3), its data starts 64-byte aligned, a data descriptor with its CRC follows it,
    and the central directory ends with zip64 records."""
    p = _pickle(obj)
    prefix = os.path.splitext(os.path.basename(path))[0] or "archive"
    records: list[tuple[str, bytes | Entry]] = [
        ("data.pkl", b"".join(p.out)), (".format_version", b"1"), (".storage_alignment", b"64"),
        ("byteorder", b"little"),
        *((f"data/{i}", Entry(f"data/{i}", t.dtype, t.dims(), _entry_data(t))) for i, t in enumerate(p.storages)),
        ("version", b"3\n"), (".data/serialization_id", b"0" * 40),
    ]
    parts: list[bytes | Entry | Late] = []
    members: list[_Member] = []
    at = n_entries = 0
    for name, data in records:
        full = f"{prefix}/{name}".encode()
        if isinstance(data, Entry):
            m = _Member(full, at, data.nbytes, None, n_entries)
            n_entries += 1
        else:
            m = _Member(full, at, len(data), zlib.crc32(data))
        members.append(m)
        head = _local_header(m)
        late = m.crc is None and m.size
        parts += [head, data, Late(m.descriptor_size, m.descriptor) if late else m.descriptor()]
        at += len(head) + m.size + m.descriptor_size
    n_central = len(_central(members, at, [0] * len(p.storages)))
    parts.append(Late(n_central, lambda crcs: _central(members, at, crcs)))
    return StreamFile(path, _merge(parts))


def _entry_data(t: Tensor) -> Any:
    """A tensor's data for the core's writer: fillers as they are; arrays (or what a callable
    returns) taken as the tensor's bytes, as :func:`save_torch` takes them (bfloat16 as int16)."""
    dt = dtypes.to_numpy(t.dtype)
    if getattr(t.array, "fills", False):
        return t.array
    if callable(t.array):
        read = t.array
        return lambda: _as_bytes_of(np.asarray(read()), dt)
    return _as_bytes_of(np.asarray(t.array), dt)


def _as_bytes_of(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    same = a.dtype == dt or a.dtype.itemsize != dt.itemsize
    return a if same else np.ascontiguousarray(a).view(dt)


def _local_header(m: _Member) -> bytes:
    """A local header without CRC or sizes (they follow the data), padded so the data starts
    64-byte aligned (torch's ``FB`` extra field), with an empty zip64 field for a big record."""
    zip64 = struct.pack("<HH", 1, 16) + bytes(16) if m.size >= _ZIP64 else b""
    pad = (-(m.at + 30 + len(m.name) + len(zip64) + 4)) % _ALIGN
    extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, m.flags, 0, 0, 0, 0, 0, 0,
                       len(m.name), len(extra)) + m.name + extra


def _central(members: Sequence[_Member], at: int, crcs: Sequence[int]) -> bytes:
    """The central directory at ``at``, then the zip64 end record, its locator and the end record."""
    out = []
    for m in members:
        big = [v for v in (m.size, m.size, m.at) if v >= _ZIP64]
        extra = struct.pack("<HH", 1, 8 * len(big)) + struct.pack(f"<{len(big)}Q", *big) if big else b""
        size32, at32 = _u32(m.size), _u32(m.at)
        out.append(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, m.flags, 0, 0, 0, m.crc_of(crcs),
                               size32, size32, len(m.name), len(extra), 0, 0, 0, 0, at32) + m.name + extra)
    cd = b"".join(out)
    end64 = at + len(cd)
    n = len(members)
    return cd + b"".join((
        struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, n, n, len(cd), at),
        struct.pack("<4sIQI", b"PK\x06\x07", 0, end64, 1),
        struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), _u32(len(cd)),
                    _u32(at), 0),
    ))


def _u32(v: int) -> int:
    """A 32-bit size or offset field: the value, or 0xFFFFFFFF where a zip64 field holds it."""
    return 0xFFFFFFFF if v >= _ZIP64 else v


def _merge(parts: list[bytes | Entry | Late]) -> list[bytes | Entry | Late]:
    """Adjacent byte runs joined (known ones into bytes, any late one into one late run)."""
    out: list[bytes | Entry | Late] = []
    run: list[bytes | Late] = []

    def flush() -> None:
        if run and all(isinstance(x, bytes) for x in run):
            out.append(b"".join(x for x in run if isinstance(x, bytes)))
        elif run:
            group = tuple(run)

            def make(crcs: Sequence[int]) -> bytes:
                return b"".join(x if isinstance(x, bytes) else x.make(crcs) for x in group)

            out.append(Late(sum(len(x) if isinstance(x, bytes) else x.nbytes for x in group), make))
        run.clear()

    for x in parts:
        if isinstance(x, Entry):
            flush()
            out.append(x)
        else:
            run.append(x)
    flush()
    return out

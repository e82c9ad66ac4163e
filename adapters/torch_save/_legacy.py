"""Legacy (pre-zip) ``torch.save`` files, read in place without torch and without running code.

``torch.save(obj, f, _use_new_zipfile_serialization=False)`` (and every torch before
1.6) writes five pickles one after the other, then the storages::

    pickle(MAGIC_NUMBER) pickle(PROTOCOL_VERSION) pickle(sys_info) pickle(obj) pickle(storage keys)
    for each key, in that order: int64 little-endian numel, then numel * itemsize bytes

Every pickle goes through the safe unpickler; the object's storages are
persistent ids ``("storage", type, key, location, numel, view_metadata)``, so
each storage's byte offset follows from the keys' order and sizes, checked
against the file's size::

    archive = open_legacy("old.pt")          # a TorchArchive, like a zip file's
"""

from __future__ import annotations

import os
import struct
from typing import Any

from ckptbridge.plugin import FormatError, TruncatedError, UnsafePickleError
from ckptbridge.plugin import dtypes as _dtypes

from ._archive import TorchArchive
from ._format import MAGIC_NUMBER
from ._unpickle import SafeUnpickler, StorageRef, StorageType

PROTOCOL_VERSION = 1001


def open_legacy(path: str) -> TorchArchive:
    """The object tree of a legacy ``torch.save`` file and where each storage's bytes are."""
    storages: dict[str, StorageRef] = {}

    def persistent_load(pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise FormatError(f"unknown persistent id {pid!r}")
        stype, key, numel, view = pid[1], str(pid[2]), pid[4], pid[5]
        if not isinstance(stype, StorageType) or stype.dtype is None:
            raise FormatError(f"storage {key} has unknown type {stype!r}")
        if view is not None:
            raise FormatError(f"storage {key} is a view of another storage (torch < 1.0), which is not read")
        if not isinstance(numel, int) or numel < 0:
            raise FormatError(f"storage {key} has a bad size {numel!r}")
        ref = storages.setdefault(key, StorageRef(key, stype.dtype, numel))
        if ref.dtype != stype.dtype:
            raise FormatError(f"storage {key} is used with two dtypes ({ref.dtype}, {stype.dtype})")
        return ref

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size

        def load(what: str, pl: Any = None) -> Any:
            try:
                return SafeUnpickler(fh, pl).load()
            except (UnsafePickleError, FormatError) as err:
                raise type(err)(f"{path}: {what}: {err}") from None
            except Exception as err:  # a damaged stream ends here, never deeper
                raise FormatError(f"{path}: legacy torch.save file, unreadable {what} "
                                  f"({type(err).__name__}: {err})") from None

        if load("magic number") != MAGIC_NUMBER:
            raise FormatError(f"{path}: not a legacy torch.save file (wrong magic number)")
        if load("protocol version") != PROTOCOL_VERSION:
            raise FormatError(f"{path}: legacy torch.save protocol other than {PROTOCOL_VERSION}")
        info = load("system info")
        if not isinstance(info, dict) or info.get("little_endian") is not True:
            raise FormatError(f"{path}: legacy torch.save file from a big-endian machine (not read)")
        obj = load("object", persistent_load)
        keys = load("storage keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise FormatError(f"{path}: legacy torch.save file without a list of storage keys")
        pos = fh.tell()
        offsets: dict[str, tuple[int, int]] = {}
        for key in keys:
            if key not in storages:
                raise FormatError(f"{path}: storage {key} is stored but not used")
            fh.seek(pos)
            head = fh.read(8)
            if len(head) != 8:
                raise TruncatedError(f"{path}: storage {key} starts past the end of the file ({size} bytes)")
            (numel,) = struct.unpack("<q", head)
            ref = storages[key]
            if numel != ref.numel:
                raise FormatError(f"{path}: storage {key} holds {numel} elements, the object uses {ref.numel}")
            nbytes = numel * _dtypes.itemsize(ref.dtype)
            if pos + 8 + nbytes > size:
                raise TruncatedError(f"{path}: storage {key} ends at byte {pos + 8 + nbytes}, "
                                     f"the file has {size} (truncated copy?)")
            offsets[key] = (pos + 8, nbytes)
            pos += 8 + nbytes
    missing = sorted(set(storages) - set(offsets))
    if missing:
        raise TruncatedError(f"{path}: storages {missing[:5]} are used but not stored")
    return TorchArchive(path, obj, offsets)

"""What format detection needs of ``torch.save`` files, cheap to import: :func:`detect` and the
tests it makes (a zip archive, a legacy pickle's magic number); the reader is imported on first
use (see the package)."""

from __future__ import annotations

from ckptbridge.plugin import CheckpointError, storage

NAME = "torch-save"
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
# how pickle (protocol 2+) writes MAGIC_NUMBER: LONG1, 10 bytes, little-endian
_MAGIC_BYTES = b"\x8a\x0a" + MAGIC_NUMBER.to_bytes(10, "little")


def is_torch_zip(path: str, offset: int = 0) -> bool:
    try:
        return storage.read_bytes(path, offset, 4) == b"PK\x03\x04"
    except (OSError, CheckpointError):
        return False


def is_legacy_torch(path: str) -> bool:
    """True when ``path`` starts like a legacy ``torch.save`` file (cheap: 16 bytes)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return False
    return head[:1] == b"\x80" and _MAGIC_BYTES in head


def detect(path: str) -> bool:
    if storage.isfile(path):
        return path.endswith(".bin.index.json") or is_torch_zip(path) or is_legacy_torch(path)
    if storage.isdir(path):
        return any(f.endswith(".bin.index.json") for f in storage.listdir(path))
    return False

"""The storage interface adapters get (``ckptbridge.plugin.storage``): a small typed protocol
over the path API, not the storage package itself.

Every name is a local path or a URL (``s3://``, ``gs://``, ``hf://``, any fsspec protocol;
``file://`` is a local path); each call dispatches on it, so an adapter reads checkpoints behind
URLs exactly as local ones::

    from ckptbridge.plugin import storage
    if storage.isdir(path) and storage.isfile(storage.join(path, "index.json")):
        text = storage.read_text(storage.join(path, "index.json"))
    header = storage.read_bytes(shard, 0, 8)                 # one range
    parts = storage.read_ranges(shard, [(8, 100), (4096, 64)])  # several, in one concurrent round
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, BinaryIO, Protocol

from .. import _storage


class Storage(Protocol):
    """What an adapter may do with checkpoint files: names, listings, reads. (Writers commit
    through ``staged_dir`` / ``staged_file``; fetch policy and credentials are the user's, set with
    ``ckptbridge.configure_storage``.)"""

    def is_url(self, path: str) -> bool: ...
    def protocol(self, url: str) -> str: ...
    def join(self, base: str, *parts: str) -> str: ...
    def normpath(self, path: str) -> str: ...
    def abspath(self, path: str) -> str: ...
    def basename(self, path: str) -> str: ...
    def dirname(self, path: str) -> str: ...
    def inside(self, root: str, rel: str) -> str | None: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def isfile(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def getsize(self, path: str) -> int: ...
    def open_read(self, path: str) -> BinaryIO: ...
    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes: ...
    def read_text(self, path: str, limit: int | None = None, errors: str = "strict") -> str: ...
    def read_ranges(self, path: str, spans: Sequence[tuple[int, int]]) -> list[bytes]: ...
    def options(self, url: str) -> dict[str, Any]: ...


class _PathAPI:
    """:class:`Storage` over the storage package's functions."""

    is_url = staticmethod(_storage.is_url)
    protocol = staticmethod(_storage.protocol)
    join = staticmethod(_storage.join)
    normpath = staticmethod(_storage.normpath)
    abspath = staticmethod(_storage.abspath)
    basename = staticmethod(_storage.basename)
    dirname = staticmethod(_storage.dirname)
    inside = staticmethod(_storage.inside)
    exists = staticmethod(_storage.exists)
    isdir = staticmethod(_storage.isdir)
    isfile = staticmethod(_storage.isfile)
    listdir = staticmethod(_storage.listdir)
    getsize = staticmethod(_storage.getsize)
    open_read = staticmethod(_storage.open_read)
    read_bytes = staticmethod(_storage.read_bytes)
    read_text = staticmethod(_storage.read_text)
    read_ranges = staticmethod(_storage.read_ranges)
    options = staticmethod(_storage.options)

    def __repr__(self) -> str:
        return "<ckptbridge storage: local paths and fsspec URLs>"


STORAGE: Storage = _PathAPI()

"""Local files behind the storage API (the executor reads them with mmap/preadv itself)."""


from __future__ import annotations

import contextlib
import os
from typing import BinaryIO

from .._errors import (
    MissingShardError,
)
from .policy import FetchStats, RemotePolicy


class LocalStorage:
    """Plain files (the executor reads them with mmap/preadv itself)."""

    remote = False

    def __init__(self) -> None:
        self.stats = FetchStats()
        self.policy = RemotePolicy()

    def size(self, path: str) -> int:
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            raise MissingShardError(f"{path}: file not found") from None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                return fh.read(length)
        except FileNotFoundError:
            raise MissingShardError(f"{path}: file not found") from None

    def open_read(self, path: str) -> BinaryIO:
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise MissingShardError(f"{path}: file not found") from None

    def write_bytes(self, path: str, data: bytes) -> None:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def invalidate(self, path: str = "") -> None:
        pass

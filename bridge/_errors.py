"""One exception tree for everything ckptbridge raises on bad input.

Every class subclasses a built-in as well, so callers that already catch
``ValueError`` / ``FileNotFoundError`` / ``KeyError`` keep working::

    try:
        ckpt = ckptbridge.open("run/ckpt")
    except ckptbridge.CheckpointError as err:
        print(err)  # names the file and tensor and says what to do
"""

from __future__ import annotations

import importlib
from typing import Any


class CheckpointError(Exception):
    """Base class of every error ckptbridge raises about a checkpoint."""


class FormatError(CheckpointError, ValueError):
    """A file is not in the format it claims, or its metadata is inconsistent."""


class UnknownFormatError(FormatError):
    """``open`` found nothing it can read at a path."""


class MissingShardError(CheckpointError, FileNotFoundError):
    """A file that the checkpoint's own metadata names is absent (e.g. a rank file)."""


class TruncatedError(FormatError):
    """A file is shorter than its metadata says: a copy was cut off or is still being written."""


class CorruptionError(CheckpointError, ValueError):
    """Stored bytes do not match the checksum recorded when they were written."""


class UnsafePickleError(CheckpointError, ValueError):
    """A pickle asked to run code that ckptbridge will not run (e.g. ``os.system``)."""


class TensorNotFoundError(CheckpointError, KeyError):
    """A tensor or state name is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointError, ValueError):
    """Shapes or dtypes disagree (between fragments, or with what a caller asked for)."""


class IncompleteCheckpointError(CheckpointError, ValueError):
    """A universal directory without its commit marker: it was never finished."""


class WatchdogError(CheckpointError, RuntimeError):
    """The fault detector cannot run: no job store to report through, or a bad setting."""
class OptionError(CheckpointError, ValueError):
    """An option a format does not have, or a value that does not fit the option."""


class MissingExtraError(CheckpointError, ImportError):
    """A format or feature needs an optional dependency that is not installed (names the extra)."""


class WriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (read-only or full destination ...); names the path, keeps ``errno``.

    ``WriteError(message, errno.ENOSPC)``; ``str(err)`` is the message alone.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        if code is None:
            super().__init__(message)
        else:
            super().__init__(code, message)

    def __str__(self) -> str:
        return str(self.strerror if self.strerror is not None else self.args[0] if self.args else "")


class StorageError(CheckpointError, OSError):
    """An object store (a URL's file system) was unreachable, or kept failing after the retries;
    the message names the object. ``str(err)`` is the message alone."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class AccessDeniedError(StorageError, PermissionError):
    """The object store refused the credentials (or the permission) for an object; names it."""


def require(module: str, extra: str, what: str) -> Any:
    """Import ``module`` or raise :class:`MissingExtraError` with the ``pip install`` hint."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f"{what} needs {module!r}, which is not installed ({err}); "
            f"install it with: pip install 'ckptbridge[{extra}]'"
        ) from None

"""Paths and URLs given by users: ``file://`` URLs are local paths; other schemes say so plainly.

::

    local_path("file:///data/run/ckpt")   # -> "/data/run/ckpt"
    local_path("run/ckpt")                # -> "run/ckpt"
    local_path("gs://bucket/run")         # UnknownFormatError naming the URL and what is supported

A URL is never taken for a relative file name (which would end in "no such
file", or worse, in a local directory called ``gs:`` when writing).
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

from ._errors import UnknownFormatError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def scheme_of(path: str | os.PathLike[str]) -> str | None:
    """The URL scheme of ``path`` in lower case (``"gs"``), or ``None`` for a plain path."""
    m = _SCHEME.match(os.fspath(path))
    return m.group(1).lower() if m else None


def local_path(path: str | os.PathLike[str], *, writing: bool = False) -> str:
    """``path`` as a local file name: ``file://`` stripped (``file://localhost/x`` too; percent
    escapes decoded as ``Path.as_uri()`` writes them); a URL of another scheme is an
    :class:`~ckptbridge.UnknownFormatError` naming it."""
    text = os.fspath(path)
    scheme = scheme_of(text)
    if scheme is None:
        return text
    if scheme == "file":
        rest = text[len("file://"):]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest:
            raise UnknownFormatError(f"{text}: a file:// URL without a path")
        return rest if os.path.exists(rest) else unquote(rest)
    verb, hint = ("write to", "write to a local directory") if writing else (
        "read", "copy the checkpoint to a local directory first")
    raise UnknownFormatError(
        f"{text}: ckptbridge cannot {verb} {scheme}:// URLs yet (local paths and file:// URLs only); {hint}")

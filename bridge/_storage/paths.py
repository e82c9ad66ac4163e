"""``file://`` URLs as local file names (every other URL goes to ``ckptbridge._storage``).

::

    file_url_path("file:///data/run/ckpt")            # -> "/data/run/ckpt"
    file_url_path("file://localhost/data/run%20a")    # -> "/data/run a" (as Path.as_uri() writes it)
"""

from __future__ import annotations

import os
import posixpath
from urllib.parse import unquote

from .._errors import UnknownFormatError


def file_url_path(url: str) -> str:
    """The local path of a ``file://`` URL (``file://localhost/x`` too; percent escapes decoded
    unless the undecoded name exists)."""
    rest = url[len("file://"):]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    if not rest:
        raise UnknownFormatError(f"{url}: a file:// URL without a path")
    return rest if os.path.exists(rest) else unquote(rest)


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``proto://...`` other than ``file://`` (those are local paths)."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def local(path: str | os.PathLike[str]) -> str:
    """``file:///x`` -> ``/x`` (``file://localhost/x`` and percent escapes too, see
    :func:`ckptbridge._storage.paths.file_url_path`); any other path or URL unchanged."""
    p = os.fspath(path)
    return file_url_path(p) if p[:7].lower() == "file://" else p


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join(base: str, *parts: str) -> str:
    """``os.path.join`` for local paths, ``/``-joining for URLs."""
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def normpath(path: str) -> str:
    """``os.path.normpath`` that keeps a URL's ``scheme://``."""
    if not is_url(path):
        return os.path.normpath(path)
    scheme, rest = path.split("://", 1)
    lead = "/" if rest.startswith("/") else ""
    return f"{scheme}://{lead}{posixpath.normpath(rest).lstrip('/')}"


def abspath(path: str) -> str:
    return path if is_url(path) else os.path.abspath(path)


def dirname(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(os.path.abspath(path))


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(os.path.normpath(path))


def inside(root: str, rel: str) -> str | None:
    """``root/rel`` normalised, or ``None`` when ``rel`` is absolute or climbs out of ``root``."""
    if not isinstance(rel, str) or "\x00" in rel or rel.startswith("/") or os.path.isabs(rel):
        return None
    full = normpath(join(root, rel))
    base = normpath(root).rstrip("/")
    sep = "/" if is_url(root) else os.sep
    return full if full.startswith(base + sep) else None

"""``file://`` URLs as local file names (every other URL goes to ``ckptbridge._storage``).

::

    file_url_path("file:///data/run/ckpt")            # -> "/data/run/ckpt"
    file_url_path("file://localhost/data/run%20a")    # -> "/data/run a" (as Path.as_uri() writes it)
"""

from __future__ import annotations

import os
from urllib.parse import unquote

from ._errors import UnknownFormatError


def file_url_path(url: str) -> str:
    """The local path of a ``file://`` URL (``file://localhost/x`` too; percent escapes decoded
    unless the undecoded name exists)."""
    rest = url[len("file://"):]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    if not rest:
        raise UnknownFormatError(f"{url}: a file:// URL without a path")
    return rest if os.path.exists(rest) else unquote(rest)

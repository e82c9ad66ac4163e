"""``reshard``: write a checkpoint in any registered format, for a given layout.

The format's typed write options are checked before anything is read or written:
an option the format does not have, or a value that does not fit, is an
:class:`~ckptbridge.OptionError` naming both::

    ckptbridge.reshard("run/global_step3", "out/mega", to="megatron", tp=2, pp=1)
    ckptbridge.reshard("run/global_step3", "out/w", to="safetensors", state="fp32")   # -> out/w.safetensors
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import _storage
from .._errors import UnknownFormatError
from .._formats.registry import get_format, make_options, writable_formats
from .open import Source, as_checkpoint

if TYPE_CHECKING:
    from .checkpoint import RuleLike


def destination(dst: str | os.PathLike[str], to: str) -> str:
    """Where ``reshard`` writes: ``dst``, with the format's file extension added when it has none."""
    fmt = get_format(to)
    dst = _storage.local(os.fspath(dst))  # URLs too: writers stage locally and upload, marker last
    if fmt.suffix and not os.path.splitext(os.path.basename(dst))[1]:
        dst += fmt.suffix
    return dst


def reshard(src: Source, dst: str | os.PathLike[str], to: str, *, rules: Sequence[RuleLike] | None = None,
            **options: Any) -> str:
    """Write ``src`` (a path or :class:`~ckptbridge.Checkpoint`, seen through ``rules`` if given) as
    format ``to`` at ``dst`` with the format's write ``options``; returns the path written."""
    fmt = get_format(to)
    if fmt.write is None:
        raise UnknownFormatError(
            f"format {to!r} can be read but not written; writable: {', '.join(f.name for f in writable_formats())}")
    opts = make_options(fmt.write_options, {k: v for k, v in options.items() if v is not None},
                        what=f"format {to!r} (write)")
    return fmt.write(as_checkpoint(src, rules), destination(dst, to), opts)

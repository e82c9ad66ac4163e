"""``reshard``: write a checkpoint in a given format for a given layout.

Writers register here as ``format name -> "module:function"``; each is
``write(ckpt, dst, **options)`` and is imported only when asked for::

    ckptbridge.reshard("run/global_step3", "out/mega", to="megatron", tp=2, pp=1)
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ._convert import as_checkpoint
from ._errors import FormatError

WRITERS: dict[str, str] = {
    "universal": "ckptbridge._reshard:write_universal",
    "safetensors": "ckptbridge._reshard:write_safetensors",
    "dcp": "ckptbridge.adapters.dcp:write",
    "deepspeed-universal": "ckptbridge.adapters.deepspeed_universal:write",
    "orbax": "ckptbridge.adapters.orbax:write",
    "megatron": "ckptbridge.adapters.megatron:write",
}


def write_universal(ckpt: Any, dst: str, **options: Any) -> str:
    from ._convert import convert

    return convert(ckpt, dst, overwrite=bool(options.pop("overwrite", False)))


def write_safetensors(ckpt: Any, dst: str, **options: Any) -> str:
    from ._convert import export

    return export(ckpt, dst, state=options.pop("state", None), dtype=options.pop("dtype", None),
                  overwrite=bool(options.pop("overwrite", False)))


def reshard(src: Any, dst: str | os.PathLike[str], to: str, **options: Any) -> Any:
    """Write ``src`` (path or Checkpoint) as format ``to`` at ``dst`` with layout ``options``."""
    ref = WRITERS.get(to)
    if ref is None:
        raise FormatError(f"no writer for format {to!r}; available: {sorted(WRITERS)}")
    module, _, fn = ref.partition(":")
    writer = getattr(importlib.import_module(module), fn)
    return writer(as_checkpoint(src), os.fspath(dst), **{k: v for k, v in options.items() if v is not None})

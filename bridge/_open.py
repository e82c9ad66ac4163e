"""Format detection: which adapter reads a path.

Each format registers ``(name, "module:detect", "module:index")``; modules
are imported only when their turn comes, so opening a safetensors file never
imports the DeepSpeed adapter (and no adapter imports torch or jax)::

    ckpt = ckptbridge.open("model.safetensors")
    ckptbridge.open("run/", format="deepspeed")
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from ._checkpoint import Checkpoint, CheckpointIndex
from ._errors import CheckpointError, MissingShardError, UnknownFormatError
from ._read import FileCache

# Order matters: the most specific detectors first.
FORMATS: tuple[tuple[str, str, str], ...] = (
    ("universal", "ckptbridge._universal:detect", "ckptbridge._universal:index"),
    ("deepspeed", "ckptbridge.adapters.deepspeed:detect", "ckptbridge.adapters.deepspeed:index"),
    ("megatron", "ckptbridge.adapters.megatron:detect", "ckptbridge.adapters.megatron:index"),
    ("dcp", "ckptbridge.adapters.dcp:detect", "ckptbridge.adapters.dcp:index"),
    ("orbax", "ckptbridge.adapters.orbax:detect", "ckptbridge.adapters.orbax:index"),
    ("safetensors", "ckptbridge._safetensors:detect", "ckptbridge._safetensors:index"),
    ("torch", "ckptbridge._torchfile:detect", "ckptbridge._torchfile:index"),
)


def _load(ref: str) -> Callable[..., Any] | None:
    module, _, attr = ref.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):  # the adapter itself is not written yet
            return None
        raise
    return getattr(mod, attr)


def detect_format(path: str) -> str:
    """Name of the format at ``path``; raises ``UnknownFormatError`` naming the path."""
    if not os.path.exists(path):
        raise MissingShardError(f"{path}: no such file or directory")
    broken = []
    for name, detect_ref, _ in FORMATS:
        try:
            detect = _load(detect_ref)
        except ImportError as err:  # one broken adapter must not stop the others
            broken.append(f"{name} ({err})")
            continue
        if detect is not None and detect(path):
            return name
    hint = f"; adapters that failed to import: {', '.join(broken)}" if broken else ""
    raise UnknownFormatError(
        f"{path}: not a checkpoint ckptbridge can read (looked for: "
        f"{', '.join(n for n, _, _ in FORMATS)}){hint}"
    )


def open_index(path: str | os.PathLike[str], format: str | None = None, **options: Any) -> CheckpointIndex:
    path = os.fspath(path)
    name = format or detect_format(path)
    for fmt, _, index_ref in FORMATS:
        if fmt == name:
            index = _load(index_ref)
            if index is None:
                break
            try:
                return index(path, **options)
            except CheckpointError as err:  # every error names the checkpoint it is about
                if path not in str(err):
                    raise type(err)(f"{path}: {err}") from err
                raise
    raise UnknownFormatError(f"{path}: unknown format {name!r}")


def open(
    path: str | os.PathLike[str], format: str | None = None, *, verify: bool = True, **options: Any
) -> Checkpoint:
    """Open any supported checkpoint as a lazy :class:`Checkpoint` (reads metadata only).

    ``format`` skips detection (``"universal"``, ``"deepspeed"``, ``"megatron"``,
    ``"dcp"``, ``"orbax"``, ``"safetensors"``, ``"torch"``); ``options`` go to
    the format's reader. ``verify`` checks recorded checksums whenever a whole
    fragment is read (universal checkpoints record them), refusing corrupted
    data with :class:`~ckptbridge.CorruptionError`.
    """
    return Checkpoint(open_index(path, format, **options), FileCache(verify=verify))

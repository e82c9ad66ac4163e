"""Opening a checkpoint: which registered format reads a path, and the lazy view it gives.

Formats are plug-ins (see ``ckptbridge._formats.registry``): detection asks each one,
most specific first; ``format=`` skips detection; ``options`` are the format's
typed open options (an option the format does not have is an error naming it);
``rules`` give the checkpoint as seen through mapping rules (names, shapes and
states after the rules; nothing is read)::

    ckpt = ckptbridge.open("model.safetensors")
    ckptbridge.open("run/", format="megatron", split_fused=True)
    ckptbridge.open("hf_llama/", rules=ckptbridge.recipes.rules("llama", src="hf", dst="maxtext", ...))

Paths may be URLs of any fsspec file system (``s3://``, ``gs://``, ``hf://``,
``memory://`` ...; ``file://`` is a local path): detection is a few listings,
and reads fetch only the byte ranges they need (``ckptbridge._storage``)::

    ckptbridge.open("s3://bucket/run/ckpt", storage_options={"endpoint_url": "http://127.0.0.1:9000"})
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import _storage
from .._errors import CheckpointError, MissingShardError, UnknownFormatError
from .._formats.registry import Format, broken_hint, formats, get_format, make_options
from .._gc import no_gc
from .checkpoint import Checkpoint, CheckpointIndex
from .executor import FileCache

if TYPE_CHECKING:
    from .checkpoint import RuleLike

Source = str | os.PathLike[str] | Checkpoint
"""What ``reshard``, ``convert`` and ``diff`` read: a path or URL, or a :class:`Checkpoint` already open."""


def detect_format(path: str | os.PathLike[str]) -> str:
    """Name of the format at ``path``; raises ``UnknownFormatError`` naming the path."""
    path = _storage.local(os.fspath(path))
    _storage.prime(path)
    if not _storage.exists(path):
        raise MissingShardError(f"{path}: no such file or directory")
    fmts = [f for f in formats() if f.detect is not None and f.readable]
    for fmt in fmts:
        if fmt.detect is not None and fmt.detect(path):
            return fmt.name
    hint = f"; adapters that failed to import: {broken_hint()}" if broken_hint() else ""
    raise UnknownFormatError(
        f"{path}: not a checkpoint ckptbridge can read (looked for: {', '.join(f.name for f in fmts)}; "
        f"name the format with format=... or --format if it is one of them){hint}")


def open_index(path: str | os.PathLike[str], format: str | None = None, **options: Any) -> CheckpointIndex:
    """The metadata of the checkpoint at ``path`` (see :func:`open`)."""
    path = _storage.local(os.fspath(path))
    _storage.prime(path)  # a fresh view: another process may have written or deleted objects since
    if format is None and not _storage.exists(path):
        raise MissingShardError(f"{path}: no such file or directory")
    # a 92k-tensor index is millions of acyclic objects, and the first open imports the format plug-ins
    # (modules, classes: nothing to collect either): see no_gc
    with no_gc():
        fmt: Format = get_format(format or detect_format(path))
        if fmt.index is None:
            raise UnknownFormatError(f"{path}: format {fmt.name!r} can be written but not read")
        opts = make_options(fmt.open_options, options, what=f"format {fmt.name!r} (open)")
        try:
            return fmt.index(path, opts)
        except CheckpointError as err:  # every error names the checkpoint it is about
            if path not in str(err):
                raise type(err)(f"{path}: {err}") from err
            raise


def open(
    path: str | os.PathLike[str],
    format: str | None = None,
    *,
    rules: Sequence[RuleLike] | None = None,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> Checkpoint:
    """Open any supported checkpoint as a lazy :class:`Checkpoint` (reads metadata only).

    ``path`` is a file or directory (or a ``file://`` URL). ``format`` skips
    detection (``ckptbridge.formats()`` lists them); ``options``
    go to the format's reader and are checked against its typed options.
    ``rules`` (mapping rules or their JSON form, e.g. a recipe) give the
    checkpoint as seen through them. ``verify`` checks recorded checksums
    whenever a whole fragment is read (universal checkpoints record them),
    refusing corrupted data with :class:`~ckptbridge.CorruptionError`.
    ``storage_options`` (for a URL): fsspec options (``endpoint_url``, ``key`` ...) and fetch
    policy (``retries``, ``concurrency`` ...) for every URL under ``path``, see
    ``ckptbridge.configure_storage``.
    """
    if storage_options:
        _storage.configure(os.fspath(path), **storage_options)
    ckpt = Checkpoint(open_index(path, format, **options), FileCache(verify=verify))
    return ckpt.with_rules(rules) if rules else ckpt


def as_checkpoint(src: Source, rules: Sequence[RuleLike] | None = None, **options: Any) -> Checkpoint:
    """``src`` if it is a :class:`Checkpoint` already, else :func:`open` it (with the format's
    ``options``); then seen through mapping ``rules`` (:meth:`Checkpoint.with_rules`: errors name
    the checkpoint). The one way every verb and adapter takes "a path or a Checkpoint"::

        ckpt = as_checkpoint(source, rules)
        owned = not isinstance(source, Checkpoint)   # opened here: the caller closes it
    """
    ckpt = src if isinstance(src, Checkpoint) else open(src, **options)
    return ckpt.with_rules(rules) if rules else ckpt


open_checkpoint = open

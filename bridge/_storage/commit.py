"""Crash-safe publication of a written checkpoint: the one place every writer commits through.

A checkpoint is built beside its destination (``DST.partial[.token]``), its
files are fsynced, an optional marker is written last, the staging directory
is fsynced and renamed onto ``DST`` in one atomic step, and the parent
directory is fsynced. A crash at any moment leaves either the previous ``DST``
or the new one, never a mixture; an existing ``DST`` is never modified: with
``overwrite`` it is swapped out only once the new one is complete::

    with staged_dir("out/ckpt", overwrite=False) as stage:
        write_everything_into(stage)          # raise to abandon: the stage is removed
    # out/ckpt now exists, complete

Multi-process writers build one stage from several ranks: each rank writes into
:func:`staging_path` (same ``token`` everywhere) and one rank calls :func:`publish`.

Destinations behind URLs (``s3://``, ``gs://`` ..., see ``ckptbridge._storage``)
follow the same rule with what object stores have, which is no rename: a
directory checkpoint's objects are written under the destination prefix
itself and the marker ``COMMITTED`` is written last; readers ignore a prefix
without it, and writers refuse a prefix that has it unless ``overwrite``
(which first deletes the old marker, so a crash while replacing leaves no
complete checkpoint rather than a mixed one). Writers that build their files
locally (``staged_dir``/``staged_file`` yield a local spool directory or file)
are uploaded by :func:`publish`, the marker last; the universal writer streams
its objects straight into the prefix (its stage *is* the destination).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator

from .. import _storage
from .._errors import WriteError

PARTIAL = ".partial"
MARKER = "COMMITTED"  # the commit marker of directory checkpoints at URLs (and of the universal layout)


def staging_path(dst: str, token: str = "") -> str:
    """Where ``dst`` is built before it is published: ``dst.partial[.token]``.

    ``token`` names one writing job (all its ranks share it), so two jobs writing
    the same destination never mix their files. At a URL the stage is ``dst`` itself
    (object stores have no rename; the marker written last commits it)."""
    if _storage.is_url(dst):
        return os.fspath(dst)
    return os.fspath(dst) + PARTIAL + (f".{token}" if token else "")


def is_staging(path: str) -> bool:
    return PARTIAL in os.path.basename(os.path.normpath(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str, files: bool = True) -> None:
    """fsync every file and directory below ``path`` (for writers whose files are not fsynced yet;
    ``files=False``: the directories only, for writers that fsynced each file they wrote)."""
    for root, dirs, names in os.walk(path):
        for name in names if files else ():
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for name in dirs:
            fsync_dir(os.path.join(root, name))
    fsync_dir(path)


def check_destination(dst: str, overwrite: bool) -> None:
    """Refuse an existing ``dst`` unless ``overwrite`` (before any work is done).

    At a URL, a directory checkpoint exists once its ``COMMITTED`` marker does (a prefix
    without it is an unfinished or abandoned write, replaced freely), a file once its object does.
    """
    if overwrite:
        return
    if _storage.is_url(dst):
        if _storage.isfile(dst) or _storage.exists(_storage.join(dst, MARKER)):
            raise FileExistsError(f"{dst}: already exists; pass overwrite=True (--overwrite) to replace it")
        return
    if os.path.lexists(dst):
        raise FileExistsError(f"{dst}: already exists; pass overwrite=True (--overwrite) to replace it")


def prepare_destination(dst: str, overwrite: bool) -> None:
    """Before writing a directory checkpoint in place at a URL with ``overwrite``: delete the
    old ``COMMITTED`` marker, so readers stop taking the prefix for a complete checkpoint
    while its objects are being replaced. Nothing to do for local paths (they are swapped)."""
    if overwrite and _storage.is_url(dst):
        _storage.remove(_storage.join(dst, MARKER))


def write_marker(stage: str, name: str, text: str) -> None:
    """Write the commit marker ``name`` into ``stage`` and fsync it (call last)."""
    if _storage.is_url(stage):
        _storage.write_bytes(_storage.join(stage, name), text.encode())
        return
    with open(os.path.join(stage, name), "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def publish(stage: str, dst: str, *, overwrite: bool = False) -> str:
    """Move a complete ``stage`` onto ``dst`` atomically (see the module doc); returns ``dst``.

    If another writer published ``dst`` first (and ``overwrite`` is off), raises
    ``FileExistsError`` and leaves theirs intact.
    """
    dst = os.fspath(dst)
    if _storage.is_url(dst):
        if stage != dst:
            upload_dir(stage, dst, overwrite=overwrite)
            shutil.rmtree(stage, ignore_errors=True)
        return dst
    fsync_dir(stage)
    if os.path.lexists(dst):
        if not overwrite:
            raise FileExistsError(f"{dst}: another writer committed this checkpoint first")
        old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(stage, dst)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
    else:
        try:
            os.rename(stage, dst)  # atomic; fails if a concurrent writer's directory appeared
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"{dst}: another writer committed this checkpoint first") from None
            raise
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    return dst


def upload_dir(src: str, dst: str, *, overwrite: bool = False, marker: str = MARKER) -> str:
    """Copy the local directory ``src`` to the URL prefix ``dst``: every object first, then the
    marker (``src``'s own ``marker`` file if it has one, else an empty one), so a reader never
    takes a half-copied prefix for a checkpoint. An existing committed ``dst`` is refused unless
    ``overwrite``; then its marker goes first and its objects are replaced."""
    check_destination(dst, overwrite)
    if overwrite and _storage.exists(_storage.join(dst, marker)):
        prepare_destination(dst, overwrite)
        old = _storage.find(dst)
        store = _storage.remote(dst)
        store.remove_many([_storage.join(dst, r) for r in old])
    _storage.upload_tree(src, dst, skip=(marker,))
    mfile = os.path.join(src, marker)
    if os.path.isfile(mfile):
        _storage.remote(dst).put_file(mfile, _storage.join(dst, marker))
    else:
        _storage.write_bytes(_storage.join(dst, marker), b"")
    return dst


@contextlib.contextmanager
def staged_dir(
    dst: str, *, overwrite: bool = False, token: str | None = None, fsync: bool = True,
    marker: tuple[str, str] | None = None,
) -> Iterator[str]:
    """Build a directory checkpoint in a private stage and publish it on success.

    ``fsync``: fsync every file written into the stage before publishing (turn
    off only when the writer already fsynced its files: then only the directories are, each
    fsync costing a disk cache flush). ``marker``: ``(file
    name, text)`` written last, after everything else is durable. On an
    exception the stage is removed and ``dst`` is untouched.
    """
    dst = os.fspath(dst)
    check_destination(dst, overwrite)
    if _storage.is_url(dst):  # build locally, upload on success (publish writes the marker last)
        stage = _storage.spool_dir()
    else:
        stage = staging_path(dst, uuid.uuid4().hex[:12] if token is None else token)
        _make_stage(stage, dst)
    try:
        yield stage
        if not _storage.is_url(dst):
            fsync_tree(stage, files=fsync)
        if marker is not None:
            write_marker(stage, *marker)
        publish(stage, dst, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged_file(dst: str, *, overwrite: bool = False) -> Iterator[str]:
    """The single-file twin of :func:`staged_dir`: write to the yielded path, published on success."""
    dst = os.fspath(dst)
    check_destination(dst, overwrite)
    if _storage.is_url(dst):  # an object appears whole once its upload completes
        spool = _storage.spool_dir()
        try:
            yield os.path.join(spool, _storage.basename(dst))
            _storage.remote(dst).put_file(os.path.join(spool, _storage.basename(dst)), dst)
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        return
    tmp = staging_path(dst, uuid.uuid4().hex[:12])
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        _make_parent(parent, dst)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if os.path.lexists(dst) and not overwrite:
            raise FileExistsError(f"{dst}: another writer wrote this file first")
        os.replace(tmp, dst)
        fsync_dir(parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _make_parent(parent: str, dst: str) -> None:
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise WriteError(f"{dst}: cannot create the parent directory ({err.strerror})", err.errno) from None


def _make_stage(stage: str, dst: str) -> None:
    _make_parent(os.path.dirname(os.path.abspath(stage)), dst)
    try:
        os.makedirs(stage)
    except FileExistsError:
        raise FileExistsError(f"{stage}: a staging directory of this name exists (another writer?)") from None
    except OSError as err:
        raise WriteError(f"{dst}: cannot write here ({err.strerror})", err.errno) from None

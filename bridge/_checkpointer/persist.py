"""The persistent level: a committed step copied to a directory or an fsspec URL, marker last."""

from __future__ import annotations

import os
import shutil

from .. import _storage
from .._errors import require
from .._formats.universal import MARKER
from .._storage.commit import fsync_tree, publish, staging_path, upload_dir
from .steps import remove_checkpoint


def check_target(dest_root: str) -> None:
    """Fail now, not in a background thread, when a URL target needs fsspec and it is missing."""
    if "://" in dest_root:
        require("fsspec", "remote", f"a persistent checkpoint level at a URL ({dest_root})")


def persist(src: str, dest_root: str) -> None:
    """Copy the committed step directory ``src`` under ``dest_root`` (same name), marker last.

    A local destination (``file://`` included) is built in a staging directory and renamed
    into place; at a URL (``s3://``, ``gs://`` ... through fsspec) the commit rule of
    ``ckptbridge._storage.commit`` applies: every object first, the ``COMMITTED`` marker last (an earlier
    copy of the same step loses its marker before its objects are replaced), so readers never
    take a half-copied step for a complete one.
    """
    name = os.path.basename(src)
    dest_root = _storage.local(dest_root)
    if _storage.is_url(dest_root):
        upload_dir(src, _storage.join(dest_root, name), overwrite=True, marker=MARKER)
        return
    files = []
    for dirpath, _, names in os.walk(src):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), src)
            if rel != MARKER:
                files.append(rel)
    target = os.path.join(dest_root, name)
    stage = staging_path(target)
    shutil.rmtree(stage, ignore_errors=True)
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(stage, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(src, rel), os.path.join(stage, rel))
    shutil.copyfile(os.path.join(src, MARKER), os.path.join(stage, MARKER))
    fsync_tree(stage)
    if os.path.exists(target):
        remove_checkpoint(target)
    publish(stage, target, overwrite=False)

"""Hugging Face shard indexes (``*.safetensors.index.json``, ``pytorch_model.bin.index.json``)."""

from __future__ import annotations

import json
import os
import posixpath

from ckptbridge.plugin import FormatError, storage


def shard_files(index_json: str) -> list[str]:
    """The shard files an HF ``*.index.json`` (``{"weight_map": {name: file}}``) lists, in order,
    refusing any that would lie outside its directory."""
    try:
        weight_map = json.loads(storage.read_text(index_json))["weight_map"]
        names = list(dict.fromkeys(str(f) for f in weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise FormatError(f"{index_json}: not a shard index ({err})") from None
    paths = posixpath if storage.is_url(index_json) else os.path
    root = storage.normpath(paths.dirname(index_json))
    files = []
    for f in names:
        full = storage.normpath(paths.join(root, f))
        if paths.dirname(full) != root:
            raise FormatError(f"{index_json}: shard name {f!r} points outside the checkpoint directory")
        files.append(full)
    return files

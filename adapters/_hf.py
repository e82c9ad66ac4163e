"""Hugging Face shard indexes (``*.safetensors.index.json``, ``pytorch_model.bin.index.json``)."""

from __future__ import annotations

import json
import os

from ckptbridge.plugin import FormatError


def shard_files(index_json: str) -> list[str]:
    """The shard files an HF ``*.index.json`` (``{"weight_map": {name: file}}``) lists, in order,
    refusing any that would lie outside its directory."""
    try:
        with open(index_json) as fh:
            weight_map = json.load(fh)["weight_map"]
        names = list(dict.fromkeys(str(f) for f in weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise FormatError(f"{index_json}: not a shard index ({err})") from None
    root = os.path.normpath(os.path.dirname(index_json))
    files = []
    for f in names:
        full = os.path.normpath(os.path.join(root, f))
        if os.path.dirname(full) != root:
            raise FormatError(f"{index_json}: shard name {f!r} points outside the checkpoint directory")
        files.append(full)
    return files

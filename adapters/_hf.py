"""Hugging Face shard indexes (``*.safetensors.index.json``, ``pytorch_model.bin.index.json``), the
``config.json`` beside a checkpoint, and PEFT adapter folders (what they are; reading them is
``ckptbridge.adapters.lora._read``)."""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping
from typing import Any

from ckptbridge.plugin import FormatError, MissingShardError, storage


def shard_files(index_json: str) -> list[str]:
    """The shard files an HF ``*.index.json`` (``{"weight_map": {name: file}}``) lists, in order,
    refusing any that would lie outside its directory."""
    return read_index(index_json)[0]


def read_index(index_json: str) -> tuple[list[str], dict[str, Any]]:
    """:func:`shard_files` and the index's ``weight_map`` (parsed once: DeepSeek-V3's names 92k tensors),
    for :func:`check_weight_map`."""
    try:
        weight_map = json.loads(storage.read_text(index_json))["weight_map"]
        names = list(dict.fromkeys(map(str, weight_map.values())))
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
    return files, weight_map


def index_json_of(path: str, suffix: str) -> str | None:
    """The HF ``*<suffix>`` index file ``path`` is or holds (the first by name), else None."""
    if os.path.isdir(path):
        idx = [f for f in sorted(os.listdir(path)) if f.endswith(suffix)]
        return os.path.join(path, idx[0]) if idx else None
    return path if path.endswith(".index.json") else None


def check_weight_map(index_json: str | None, found: Mapping[str, str], weight_map: Mapping[str, Any] | None = None
                     ) -> None:
    """The tensors an HF index's ``weight_map`` names are exactly those ``found`` (name -> file),
    each in the shard the index names: shards mixed from two saves or an index out of date fail.
    ``weight_map``: the index's, when :func:`read_index` has parsed it already."""
    if index_json is None:
        return
    if weight_map is None:
        with open(index_json) as fh:
            weight_map = json.load(fh)["weight_map"]  # shard_files() checked it
    root = os.path.dirname(index_json)
    listed = {str(f): os.path.normpath(os.path.join(root, str(f))) for f in set(weight_map.values())}  # per shard
    holders = {f: os.path.normpath(f) for f in set(found.values())}  # once per shard, not per tensor
    # in bulk (C loops over 92k names): each tensor's shard as the index spells it, compared with the index
    spelled = {full: f for f, full in listed.items()}
    if len(spelled) == len(listed):  # else two spellings of one shard: the loop below decides
        as_listed = {f: spelled.get(full) for f, full in holders.items()}
        if weight_map == dict(zip(found, map(as_listed.__getitem__, found.values()))):
            return
    for name, f in weight_map.items():  # which tensor is wrong
        got = found.get(name)
        if got is None:
            raise MissingShardError(f"{index_json}: tensor {name!r} is listed in {f} but no shard holds it")
        if listed[str(f)] != holders[got]:
            raise FormatError(f"{index_json}: tensor {name!r} is listed in {f} but {got} holds it")
    unlisted = sorted(set(found) - set(weight_map))
    if unlisted:
        raise FormatError(f"{found[unlisted[0]]}: tensor {unlisted[0]!r} is not in {index_json}'s weight_map "
                          f"({len(unlisted)} such)")


def hf_config(path: str) -> tuple[str, Mapping[str, Any]] | None:
    """``(its path, the parsed object)`` of the ``config.json`` beside the HF checkpoint at ``path`` (a
    folder, or a file in one); None when there is none or it is not an object."""
    root = path if storage.isdir(path) else storage.dirname(path)
    cfg = storage.join(root, "config.json")
    if not storage.isfile(cfg):
        return None
    try:
        config = json.loads(storage.read_text(cfg))
    except ValueError as err:
        raise FormatError(f"{cfg}: not valid JSON ({err})") from None
    return (cfg, config) if isinstance(config, dict) else None


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def is_peft_adapter(path: str) -> bool:
    """Whether ``path`` is a PEFT adapter folder (or its ``adapter_model.safetensors``)."""
    root = path if storage.isdir(path) else storage.dirname(path)
    return storage.isfile(storage.join(root, PEFT_CONFIG)) and storage.isfile(storage.join(root, PEFT_WEIGHTS))


def peft_weights_file(path: str) -> str:
    """The ``adapter_model.safetensors`` of the adapter folder (or file) ``path``."""
    return storage.join(path, PEFT_WEIGHTS) if storage.isdir(path) else path

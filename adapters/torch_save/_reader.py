"""Index ``torch.save`` files and HF ``pytorch_model.bin.index.json`` folders in place (see the package)."""

from __future__ import annotations

from typing import Any

from ckptbridge.plugin import (
    CheckpointIndex,
    FormatError,
    LogicalTensor,
    MissingShardError,
    OpenOptions,
    TensorState,
    check_name,
    storage,
)

from .._hf import check_weight_map, index_json_of, shard_files
from ._archive import MAX_NODES, TorchArchive, iter_tensors, strip_tensors
from ._format import NAME, is_legacy_torch, is_torch_zip
from ._legacy import open_legacy
from ._unpickle import Opaque, TensorRef

_STEP_KEYS = ("step", "iteration", "global_step", "global_steps", "epoch_step")


def _files(path: str) -> list[str]:
    if storage.isdir(path):
        names = storage.listdir(path)
        idx = [f for f in names if f.endswith(".bin.index.json")]
        if not idx:
            return [storage.join(path, f) for f in sorted(names)
                    if f.endswith((".pt", ".bin", ".pth")) and is_torch_zip(storage.join(path, f))]
        path = storage.join(path, sorted(idx)[0])
    return shard_files(path) if path.endswith(".index.json") else [path]


def _find_step(obj: Any) -> int | None:
    if isinstance(obj, dict):
        for k in _STEP_KEYS:
            v = obj.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def index(path: str, options: OpenOptions | None = None) -> CheckpointIndex:
    """Open a ``torch.save`` file or an HF ``pytorch_model.bin.index.json`` folder (metadata only)."""
    tensors: dict[str, LogicalTensor] = {}
    extra: dict[str, Any] = {}
    step = None
    found: dict[str, str] = {}
    for f in _files(path):
        if not storage.exists(f):
            raise MissingShardError(f"{f}: shard listed by {path} is missing")
        archive = open_legacy(f) if is_legacy_torch(f) else TorchArchive.open(f)
        _refuse_pickled_objects(f, archive.obj)
        for name, ref in iter_tensors(archive.obj):
            check_name(name or "<root>", f)
            if name in tensors:
                raise FormatError(f"{f}: tensor {name!r} appears twice")
            frag = archive.fragment(ref, name)
            tensors[name or "tensor"] = LogicalTensor(
                name or "tensor", {"param": TensorState(ref.dtype, ref.shape, (frag,))}
            )
            found[name or "tensor"] = f
        step = step if step is not None else _find_step(archive.obj)
        if isinstance(archive.obj, dict):
            rest = {k: strip_tensors(v) for k, v in archive.obj.items() if not _all_tensors(v)}
            extra.update(rest)
    check_weight_map(index_json_of(path, ".bin.index.json"), found)
    return CheckpointIndex(NAME, path, tensors, step, extra)


def _refuse_pickled_objects(path: str, obj: Any) -> None:
    """A whole pickled object (``torch.save(model)``) holds its tensors where no state dict
    reader looks; saying "0 tensors" would be a lie, so name it and say what to save instead."""
    found = _pickled_object(obj, "")
    if found is not None:
        where, cls = found
        at = f" at {where!r}" if where else ""
        raise FormatError(
            f"{path}: holds a pickled {cls} object{at}, not a state dict; its tensors are not read "
            f"(unpickling it would run its code): save model.state_dict() instead of the model")


def _pickled_object(obj: Any, where: str = "") -> tuple[str, str] | None:
    """(key path, class) of the first pickled object (an inert record) holding tensors, if any.

    Each container is visited once (a pickle can share one object many times: no blow-up)."""
    seen: set[int] = set()
    clean: set[int] = set()  # inside records: explored, no tensor below (shared by every search)
    todo: list[tuple[Any, str]] = [(obj, where)]
    while todo:
        node, at = todo.pop()
        if not isinstance(node, (Opaque, dict, list, tuple)) or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > MAX_NODES:
            raise FormatError(f"object tree has more than {MAX_NODES} nodes (a pickle bomb?)")
        if isinstance(node, Opaque):
            if _holds_tensor(_record_items(node), clean):
                return at, f"{node._module}.{node._qualname}"
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node)
        todo.extend((v, f"{at}.{k}" if at else str(k)) for k, v in reversed(list(items)))
    return None


def _record_items(record: Opaque) -> dict[Any, Any]:
    return {**record.__dict__.get("items_", {}), **(record.fields or {})}


def _holds_tensor(obj: Any, seen: set[int]) -> bool:
    """Whether a tensor is reachable from ``obj`` through containers and inert records, skipping
    ``seen`` (nodes an earlier search explored in full without finding one)."""
    todo = [obj]
    while todo:
        node = todo.pop()
        if isinstance(node, TensorRef):
            return True
        if not isinstance(node, (Opaque, dict, list, tuple)) or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > MAX_NODES:
            return False
        if isinstance(node, Opaque):
            node = _record_items(node)
        todo.extend(node.values() if isinstance(node, dict) else node)
    return False


def _all_tensors(v: Any) -> bool:
    if isinstance(v, TensorRef):
        return True
    if isinstance(v, dict):
        return bool(v) and all(_all_tensors(x) for x in v.values())
    return False

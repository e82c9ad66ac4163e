"""The ``torch`` format: plain ``torch.save`` files (``.pt``/``.bin``/``.pth``), read in place without torch.

Nested dicts are flattened with dots (``{"model": {"w": t}}`` -> ``model.w``);
non-tensor values go to ``extra``. HF sharded ``pytorch_model.bin.index.json``
folders are read too::

    ckpt = ckptbridge.open("model.pt")

The package also holds what every torch-based format needs, without torch: the
safe unpickler (``safe_loads``: no code runs, unknown classes become inert
``Opaque`` records), the zip archive reader that finds each storage's bytes in
place (``TorchArchive``), and a ``torch.save``-compatible writer (``save_torch``).
"""

from __future__ import annotations

from typing import Any

from ckptbridge.plugin import (
    CheckpointIndex,
    Format,
    FormatError,
    LogicalTensor,
    MissingShardError,
    OpenOptions,
    TensorState,
    check_name,
    storage,
)

from .._hf import shard_files
from ._archive import (
    TorchArchive,
    is_torch_zip,
    iter_tensors,
    read_scalar,
    strip_tensors,
    unpickled_to_json,
)
from ._save import Size, Tensor, save_torch
from ._unpickle import (
    Opaque,
    SafeUnpickler,
    StorageRef,
    StorageType,
    TensorRef,
    TorchDtype,
    safe_loads,
)

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


def detect(path: str) -> bool:
    if storage.isfile(path):
        return path.endswith(".bin.index.json") or is_torch_zip(path)
    if storage.isdir(path):
        return any(f.endswith(".bin.index.json") for f in storage.listdir(path))
    return False


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
    for f in _files(path):
        if not storage.exists(f):
            raise MissingShardError(f"{f}: shard listed by {path} is missing")
        archive = TorchArchive.open(f)
        for name, ref in iter_tensors(archive.obj):
            check_name(name or "<root>", f)
            if name in tensors:
                raise FormatError(f"{f}: tensor {name!r} appears twice")
            frag = archive.fragment(ref, name)
            tensors[name or "tensor"] = LogicalTensor(
                name or "tensor", {"param": TensorState(ref.dtype, ref.shape, (frag,))}
            )
        step = step if step is not None else _find_step(archive.obj)
        if isinstance(archive.obj, dict):
            rest = {k: strip_tensors(v) for k, v in archive.obj.items() if not _all_tensors(v)}
            extra.update(rest)
    return CheckpointIndex("torch", path, tensors, step, extra)


def _all_tensors(v: Any) -> bool:
    if isinstance(v, TensorRef):
        return True
    if isinstance(v, dict):
        return bool(v) and all(_all_tensors(x) for x in v.values())
    return False


FORMAT = Format("torch", detect=detect, index=index, priority=90,
                description="plain torch.save files and HF pytorch_model.bin indexes (read without torch)")

__all__ = [
    "FORMAT",
    "Opaque",
    "SafeUnpickler",
    "Size",
    "StorageRef",
    "StorageType",
    "Tensor",
    "TensorRef",
    "TorchArchive",
    "TorchDtype",
    "detect",
    "index",
    "is_torch_zip",
    "iter_tensors",
    "read_scalar",
    "safe_loads",
    "save_torch",
    "strip_tensors",
    "unpickled_to_json",
]

"""Small helpers every DeepSpeed reader shares (tag folders of ZeRO runs and universal layouts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptbridge.adapters.torch_save import Opaque, TensorRef, TorchArchive, strip_tensors
from ckptbridge.plugin import CheckpointError, FormatError

FORMAT = "deepspeed"


def open_archive(path: str, what: str) -> TorchArchive:
    try:
        return TorchArchive.open(path)
    except CheckpointError as err:
        raise type(err)(f"{err} [{what}]") from None


def get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    if isinstance(obj, Opaque):
        return obj.fields.get(key, default)
    return default


def as_int(v: Any) -> int:
    if isinstance(v, Opaque):  # an Enum such as ZeroStageEnum
        v = v.value
    return int(v)


def shape_of(v: Any) -> tuple[int, ...]:
    if isinstance(v, TensorRef):
        return v.shape
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    raise FormatError(f"unreadable parameter shape {v!r}")


def hyper(group: Any) -> dict[str, Any]:
    """A torch param group without its ``params`` list, JSON-able."""
    if not isinstance(group, Mapping):
        return {}
    return {str(k): strip_tensors(v) for k, v in group.items() if k != "params"}



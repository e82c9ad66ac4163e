"""Small helpers shared by the Megatron readers and writer: paths, args, scalars."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptbridge.adapters.torch_save import Opaque, TensorRef, TorchDtype
from ckptbridge.plugin import FormatError, MissingShardError, storage

from ._format import ITER_RE, TRACKER


def resolve_iter_dir(path: str) -> tuple[str, int | None]:
    """A run dir (with the tracker file), an ``iter_*``/``release`` dir -> (iteration dir, iteration)."""
    path = storage.abspath(os.fspath(path))
    if storage.isfile(storage.join(path, TRACKER)):
        text = storage.read_text(storage.join(path, TRACKER), 4096, errors="replace").strip()
        if text == "release":
            return storage.join(path, "release"), None
        if not re.fullmatch(r"[0-9]{1,12}", text):
            raise FormatError(f"{path}/{TRACKER}: expected an iteration number or 'release', got {text!r}")
        it_dir = storage.join(path, f"iter_{int(text):07d}")
        if not storage.isdir(it_dir):
            raise MissingShardError(
                f"{it_dir}: {TRACKER} names iteration {int(text)} but its directory is missing"
            )
        return it_dir, int(text)
    m = ITER_RE.match(storage.basename(path))
    return path, (int(m.group(1)) if m else None)


def rank_dir_name(tp: int, pp: int, pp_size: int, ep: int | None = None) -> str:
    """Megatron-LM's ``get_checkpoint_name``: ``mp_rank_TT[_PPP][_EEE]`` (EEE only when EP > 1)."""
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return name if ep is None else f"{name}_{ep:03d}"


def plain(obj: Any) -> Any:
    """A JSON-able copy of an unpickled tree (Opaque records -> dicts, dtypes -> names)."""
    if isinstance(obj, TorchDtype):
        return f"torch.{obj.name}"
    if isinstance(obj, Opaque):
        fields = obj.fields
        if fields:
            return {k: plain(v) for k, v in fields.items()}
        args = obj.__dict__["args_"]
        return {"__class__": f"{obj._module}.{obj._qualname}", "value": plain(args[0]) if args else None}
    if isinstance(obj, TensorRef):
        return {"tensor": list(obj.shape), "dtype": obj.dtype}
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (np.generic,)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist() if obj.size <= 16 else {"ndarray": list(obj.shape), "dtype": str(obj.dtype)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def args_dict(args: Any, where: str) -> dict[str, Any]:
    if isinstance(args, Opaque) and args.fields:
        return dict(args.fields)
    if isinstance(args, Mapping):
        return dict(args)
    raise FormatError(f"{where}: no Megatron 'args' namespace in the checkpoint (saved without args?)")

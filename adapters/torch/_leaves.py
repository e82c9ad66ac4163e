"""torch pieces of the asynchronous checkpointer: leaves of tensors and DTensors, guards, restore.

Registered as the ``torch`` leaf provider (entry point ``ckptbridge.leaf_providers``); the
checkpointer loads it only when a torch value is saved.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckptbridge.plugin import Box, FormatError, Leaf, LeafProvider

from ._restore import after_restore, state_of

_DTYPES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}


def dtype_name(t: torch.Tensor) -> str:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise FormatError(f"torch dtype {t.dtype} is not supported by the checkpointer") from None


def as_torch(out: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch view of a host buffer (bfloat16 goes through an int16 view)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(out)


def pin_host(buf: mmap.mmap) -> Callable[[], None]:
    """Page-lock a host buffer for CUDA (``cudaHostRegister``, as torch's own DCP stager does), so
    device-to-host snapshot copies are DMA transfers; returns the undo."""
    from torch.cuda import _pin_memory_utils

    view = np.frombuffer(buf, np.uint8)
    addr = int(view.ctypes.data)
    del view
    _pin_memory_utils.pin_memory(addr, len(buf))
    return lambda: _pin_memory_utils.unpin_memory(addr)


def _pin_for(t: torch.Tensor) -> Callable[[mmap.mmap], Callable[[], None]] | None:
    return pin_host if t.is_cuda and torch.cuda.is_available() else None


def _copier(t: torch.Tensor) -> Any:
    src = t.detach()

    def copy(out: np.ndarray) -> None:
        as_torch(out, src.dtype).copy_(src)

    return copy


def dtensor_box(t: Any) -> tuple[Box, bool]:
    """This rank's box of a DTensor and whether this rank writes it (replica 0 on every replicated dim)."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    writes = True
    for dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise FormatError("a DTensor with Partial placement must be reduced before saving")
        if isinstance(p, Replicate) and coords[dim] != 0:
            writes = False
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape)), writes


def torch_leaves(name: str, value: Any, lazy_keys: Any) -> list[Leaf]:
    if not isinstance(value, torch.Tensor):
        raise FormatError(f"{name}: cannot checkpoint a {type(value).__name__}")
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        box, writes = dtensor_box(value)
        local = value.to_local()
        return [Leaf(name, dtype_name(local), tuple(value.shape), box, _copier(local),
                     lazy=local.data_ptr() in lazy_keys, write=writes, key=local.data_ptr(), pin=_pin_for(local))]
    shape = tuple(value.shape)
    return [Leaf(name, dtype_name(value), shape, Box.full(shape), _copier(value),
                 lazy=value.data_ptr() in lazy_keys, key=value.data_ptr(), per_process=True, pin=_pin_for(value))]


def optimizer_tensor_keys(optimizer: torch.optim.Optimizer) -> set[int]:
    """Identities of every tensor ``optimizer.step()`` mutates: parameters and state."""
    keys: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            keys.add(_local(p).data_ptr())
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    keys.add(_local(v).data_ptr())
    return keys


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def copy_into(t: torch.Tensor, arr: np.ndarray) -> None:
    """Restore a saved global array into a live tensor or DTensor, in place (cast to its dtype)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            box, _ = dtensor_box(t)
            t.to_local().copy_(_from_numpy(np.ascontiguousarray(arr[box.slices()])))
        else:
            t.copy_(_from_numpy(np.ascontiguousarray(arr)).reshape(t.shape))


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a saved array in its own dtype (bfloat16 through an int16 view)."""
    if arr.dtype.name == "bfloat16":
        return as_torch(arr, torch.bfloat16)
    return torch.from_numpy(arr)


PROVIDER = LeafProvider(
    "torch", ("torch",),
    leaves=lambda name, value, capture: torch_leaves(name, value, capture.keys),
    copy_into=copy_into,
    guard_keys=optimizer_tensor_keys,
    state_of=state_of,
    after_restore=after_restore,
)

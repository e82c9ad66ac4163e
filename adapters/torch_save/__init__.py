"""The ``torch-save`` format: plain ``torch.save`` files (``.pt``/``.bin``/``.pth``), read in place without torch.

Named after what writes these files, so that it cannot be taken for ``ckptbridge.adapters.torch``
(the runtime: loading onto torch devices, Checkpointer leaves). Its old name ``"torch"`` still
works as a format name (``format="torch"``, ``--format torch``) with a ``DeprecationWarning``.

Nested dicts are flattened with dots (``{"model": {"w": t}}`` -> ``model.w``);
non-tensor values go to ``extra``. HF sharded ``pytorch_model.bin.index.json``
folders are read too::

    ckpt = ckptbridge.open("model.pt")

The package also holds what every torch-based format needs, without torch: the
safe unpickler (``safe_loads``: no code runs, unknown classes become inert
``Opaque`` records), the zip archive reader that finds each storage's bytes in
place (``TorchArchive``), and a ``torch.save``-compatible writer (``save_torch``; ``torch_stream``
lays out the same archive for the core's direct-I/O writer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptbridge.plugin import Format, LazyNames

from ._format import NAME, detect, is_legacy_torch, is_torch_zip

if TYPE_CHECKING:  # the reader's and writer's names, imported on first use (see LazyNames)
    from ._archive import TorchArchive as TorchArchive
    from ._archive import iter_tensors as iter_tensors
    from ._archive import read_scalar as read_scalar
    from ._archive import strip_tensors as strip_tensors
    from ._archive import unpickled_to_json as unpickled_to_json
    from ._legacy import open_legacy as open_legacy
    from ._reader import index as index
    from ._save import Global as Global
    from ._save import Object as Object
    from ._save import Reduce as Reduce
    from ._save import Size as Size
    from ._save import Tensor as Tensor
    from ._save import save_torch as save_torch
    from ._save import torch_stream as torch_stream
    from ._unpickle import TORCH_DTYPE_NAMES as TORCH_DTYPE_NAMES
    from ._unpickle import Opaque as Opaque
    from ._unpickle import SafeUnpickler as SafeUnpickler
    from ._unpickle import StorageRef as StorageRef
    from ._unpickle import StorageType as StorageType
    from ._unpickle import TensorRef as TensorRef
    from ._unpickle import TorchDtype as TorchDtype
    from ._unpickle import safe_loads as safe_loads


FORMAT = Format(NAME, detect=detect, index=LazyNames.deferred(__name__, "index"), priority=90,
                deprecated_aliases=("torch",),
                description="plain torch.save files and HF pytorch_model.bin indexes (read without torch; "
                            "formerly named 'torch')")
__getattr__ = LazyNames(__name__, FORMAT.extra)

__all__ = [
    "FORMAT",
    "TORCH_DTYPE_NAMES",
    "Global",
    "Object",
    "Opaque",
    "Reduce",
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
    "is_legacy_torch",
    "is_torch_zip",
    "iter_tensors",
    "open_legacy",
    "read_scalar",
    "safe_loads",
    "save_torch",
    "strip_tensors",
    "torch_stream",
    "unpickled_to_json",
]

"""The launcher's store for scale-out conversion: torch.distributed's TCP store (found by the core
through the ``ckptbridge.stores`` entry point; torch is imported only when it is used).

Under ``torchrun`` (or any launcher setting ``MASTER_ADDR``/``MASTER_PORT`` with ``RANK``/``WORLD_SIZE``)
the ranks of ``ckptbridge convert`` agree through the same ``env://`` rendezvous store that
``init_process_group`` would use (torchrun's agent store, else one hosted by rank 0); no process
group and no collective is created::

    store = store(rank, world_size, timeout=3600)   # None when not launched that way
    store.set("k", "v"); store.get("k", timeout=10)
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any


class TorchStore:
    """``ckptbridge._formats.scaleout.Store`` over a ``torch.distributed.Store``."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float) -> str:
        try:
            self._store.wait([key], timedelta(seconds=max(timeout, 0.001)))
        except Exception as err:  # DistStoreError / RuntimeError on timeout; anything else too
            if "timeout" in str(err).lower() or "timed out" in str(err).lower():
                raise TimeoutError(key) from None
            raise
        value = self._store.get(key)
        return value.decode() if isinstance(value, bytes) else str(value)

    def close(self) -> None:
        pass


def store(rank: int, world_size: int, timeout: float) -> TorchStore | None:
    """The rendezvous store of this launch, or None without torch or ``MASTER_ADDR``/``MASTER_PORT``."""
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    st, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout)))
    return TorchStore(st)

"""torch.distributed's ranks for the core's rank helper (entry point ``ckptbridge.rank_providers``).
torch is never imported here: a process that has not imported it runs no torch job."""

from __future__ import annotations

import sys

from ckptbridge.plugin import RankProvider


def ranks() -> tuple[int, int] | None:
    """``(rank, world size)`` of the initialised default process group, else ``None``."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


PROVIDER = RankProvider("torch", ranks, priority=10)

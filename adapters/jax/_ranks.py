"""jax.distributed's ranks for the core's rank helper (entry point ``ckptbridge.rank_providers``).
jax is never imported here: a process that has not imported it runs no JAX job."""

from __future__ import annotations

import sys

from ckptbridge.plugin import RankProvider


def ranks() -> tuple[int, int] | None:
    """``(process index, process count)`` once ``jax.distributed.initialize`` ran, else ``None``."""
    if "jax" not in sys.modules:
        return None
    import jax

    if jax.distributed.is_initialized():
        return jax.process_index(), jax.process_count()
    return None


PROVIDER = RankProvider("jax", ranks, priority=20)

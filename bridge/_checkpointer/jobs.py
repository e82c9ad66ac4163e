"""What the checkpointer's threads pass along: one save in flight (:class:`Job`) and the
timing of a finished one (:class:`SaveStats`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from .host import BufferSet
from .leaves import Leaf


@dataclass(frozen=True)
class SaveStats:
    """Timing of one save. ``stall_seconds`` is what training waited (in ``save`` and in guards)."""

    step: int
    bytes: int
    stall_seconds: float
    snapshot_seconds: float
    flush_seconds: float
    persist_seconds: float | None
    committed: bool

    @property
    def flush_gbps(self) -> float:
        return self.bytes / self.flush_seconds / 1e9 if self.flush_seconds > 0 else float("inf")


@dataclass
class Job:
    step: int
    leaves: list[Leaf]
    extra: dict[str, Any]
    buffers: BufferSet
    tree: Any = None  # the skeleton of the saved state (see .tree)
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    flushed: threading.Event = field(default_factory=threading.Event)
    stall: float = 0.0
    snapshot_seconds: float = 0.0
    error: BaseException | None = None
    pending_lazy: list[Leaf] = field(default_factory=list)
    copying: bool = False  # its background snapshot started
    flushing: bool = False  # its flush started (it can no longer be coalesced)
    superseded: bool = False  # dropped by a newer save (policy "coalesce"); its buffers went to that save
    released: bool = False  # its buffers were handed back (a later save may own them now)

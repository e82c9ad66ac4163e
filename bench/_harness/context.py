"""The child-side view of a run: what a case function gets, and the one clock.

A case function receives a :class:`Ctx` and times its work with ``ctx.region()``; any
process of the case's process tree (e.g. rank 0 of a spawned job) may call
:func:`region` instead. The harness process outside the tree takes every measurement
(wall time between the region's start and end, peak RSS of the whole tree, bytes read)
when the region's start and end messages arrive::

    def read_torch(ctx):
        import torch                      # start-up: outside the clock (reported by a probe)
        with ctx.region():
            sd = torch.load(ctx.input("src.pt"), weights_only=True)
            touch(sd.values())            # every byte, before the clock stops
        ctx.metrics["checksum"] = ...     # after the clock: checks, never inside it
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

EVENTS_ENV = "CB_BENCH_EVENTS"


class Skip(Exception):
    """Raise from a case (before its region) when it cannot run here; the reason is recorded."""


def _send(kind: str, t: float | None = None) -> float:
    """Tell the harness; wait until it has taken its snapshot (so none of the work escapes it)."""
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(f"\0cbbench-{os.getpid()}-{uuid.uuid4().hex}")  # abstract address: the harness replies here
        s.settimeout(60)
        s.sendto(json.dumps({"ev": kind, "t": t, "pid": os.getpid()}).encode(), path)
        s.recv(64)
    return time.monotonic()


@contextlib.contextmanager
def region() -> Iterator[None]:
    """The timed region; use once per case run, from any process of the case's tree.

    The clock starts once the harness has its start snapshot and stops before the end one."""
    _send("start")
    t0 = time.monotonic()
    try:
        yield
    finally:
        _send("end", time.monotonic() - t0)


@dataclasses.dataclass
class Ctx:
    """What a case (or ``prepare``) function gets in its fresh process."""

    suite: str
    case: str
    size: str
    gib: float
    params: Mapping[str, Any]
    inputs: str          # the prepared inputs (shared by every case of the suite and size)
    work: str            # scratch for this run's outputs (empty at the start of every run)
    root: str            # the repository
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    entered: int = 0

    def input(self, *parts: str) -> str:
        return os.path.join(self.inputs, *parts)

    def out(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        self.entered += 1
        with region():
            yield

    def param(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

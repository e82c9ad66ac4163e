"""What a rank does once a fault is judged: record the verdict, drain the checkpointer, isolate
the faulty rank's processes on this host, announce its exit and leave at once; and how the
watchdog thread learns of SIGTERM while the main thread is blocked in a collective.

Each step is a function of what it needs (no watchdog state), so :class:`~ckptbridge.Watchdog`
reads as the sequence: ``record`` -> ``drain`` -> ``isolate`` -> ``leave`` -> ``exit_now``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

from . import _procs
from ._verdicts import Peer, Verdict

log = logging.getLogger("ckptbridge.watchdog")


def record(root: str | None, verdicts: list[Verdict], world_size: int) -> None:
    """Append the verdicts to ``<root>/faults.jsonl`` (the checkpointer's root; nothing if none)."""
    if root is None:
        return
    with contextlib.suppress(OSError), open(os.path.join(root, "faults.jsonl"), "a") as fh:
        for v in verdicts:
            fh.write(json.dumps({**json.loads(v.encode()), "world_size": world_size}) + "\n")


def drain(checkpointer: Any, faulty: set[int], rank: int, timeout: float) -> None:
    """Commit every save whose pieces all exist; abandon those that need ``faulty`` ranks
    (waits at most ``timeout`` seconds for the flushes)."""
    if checkpointer is None:
        return
    if faulty and hasattr(checkpointer, "abandon"):
        checkpointer.abandon(faulty)
    done = threading.Event()

    def wait() -> None:
        try:
            checkpointer.wait()
        except Exception as err:
            log.info("ckptbridge.watchdog: rank %d: %s", rank, err)
        finally:
            done.set()

    threading.Thread(target=wait, name="ckptbridge-drain", daemon=True).start()
    if not done.wait(timeout):
        log.warning("ckptbridge.watchdog: rank %d: checkpoint flushes still running after %.0fs", rank, timeout)


def isolate(kv: Any, peers: dict[int, Peer], verdicts: list[Verdict], rank: int, store_lost: bool, *,
            isolator: bool) -> None:
    """Stop faulty ranks that run on this host, and their torchrun agents (so the next
    rendezvous goes on without them). One rank isolates (``isolator``); the others wait for it
    through the store ``kv``. A rank that reported its own failure exits by itself: only its
    agent is stopped."""
    host = socket.gethostname()
    if isolator:
        for v in verdicts:
            peer = peers.get(v.rank)
            if peer is None or peer.host != host or v.rank == rank:
                continue
            log.debug("ckptbridge.watchdog: isolating rank %d: pid %d (start %s), agent %s (start %s)",
                      v.rank, peer.pid, peer.start, peer.agent_pid, peer.agent_start)
            if v.kind != "failed":
                _procs.stop(peer.pid, peer.start, signal.SIGKILL, timeout=5.0)
            if peer.agent_pid:  # SIGTERM, then SIGKILL: a torch agent can lose a SIGTERM that
                # lands while it logs (logging swallows the exception its handler raises)
                gone = _procs.stop(peer.agent_pid, peer.agent_start, signal.SIGTERM, timeout=0.5)
                log.info("ckptbridge.watchdog: isolated rank %d: stopped pid %d and its agent %d (%s)",
                         v.rank, peer.pid, peer.agent_pid, "gone" if gone else "still there")
        with contextlib.suppress(Exception):
            kv.set("isolated", "1")
        return
    if not store_lost:
        with contextlib.suppress(Exception):
            kv.wait(["isolated"], 20.0, stop_on_error=True)


def leave(kv: Any, rank: int, world_size: int, faulty: set[int]) -> None:
    """Announce this rank's exit in the store ``kv`` (``None``: unreachable, say nothing); a rank
    serving the store leaves last."""
    if kv is None:
        return
    with contextlib.suppress(Exception):
        kv.set(f"left/{rank}", "1")
        if getattr(kv, "host_rank", None) == rank:
            others = [f"left/{r}" for r in range(world_size) if r != rank and r not in faulty]
            kv.wait(others, 10.0, stop_on_error=True)


def exit_now(code: int) -> None:
    """Leave now, whatever the main thread is doing (it may be blocked in a collective)."""
    for h in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            h.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def whoami(rank: int) -> Peer:
    """This process as its peers see it (host, pid and start time; under torchrun, its agent)."""
    pid = os.getpid()
    agent = agent_start = None
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchelastic worker: the parent is its agent
        agent = os.getppid()
        agent_start = _procs.start_time(agent)
    return Peer(rank, socket.gethostname(), pid, _procs.start_time(pid), agent, agent_start)


class SigtermPipe:
    """Learn of SIGTERM even while the main thread is blocked in a collective: a no-op Python
    handler plus ``signal.set_wakeup_fd`` on a pipe the watchdog thread selects on::

        pipe = SigtermPipe(); pipe.install()      # main thread
        if pipe.wait(0.1): ...                    # watchdog thread: True once SIGTERM arrived
        pipe.restore()
    """

    def __init__(self) -> None:
        self._r = self._w = -1
        self._old: Any = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        inherited = getattr(current, "__module__", "").startswith("torch.distributed.elastic")
        if current not in (signal.SIG_DFL, None) and not inherited:
            return  # the program handles SIGTERM itself (a torch agent's handler, inherited by a
            # forked worker, is not the program's: it would end the rank mid-drain)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return
        if old != -1:  # someone (asyncio) uses it: leave theirs
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._r, self._w = r, w
        self._old = signal.signal(signal.SIGTERM, _ignore)

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, or less if SIGTERM arrives: True if it did."""
        if self._r < 0:
            time.sleep(seconds)
            return False
        ready, _, _ = select.select([self._r], [], [], seconds)
        return bool(ready) and signal.SIGTERM in _drain_pipe(self._r)

    def restore(self) -> None:
        if self._r < 0 or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, self._old or signal.SIG_DFL)
        os.close(self._r)
        os.close(self._w)
        self._r = self._w = -1


def _ignore(signum: int, frame: Any) -> None:
    """SIGTERM is handled by the watchdog thread (it woke through the wakeup fd)."""


def _drain_pipe(fd: int) -> bytes:
    out = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 512):
            out += chunk
    return out

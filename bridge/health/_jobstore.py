"""The job's own key-value store, as the fault detector reaches it: framework-free parts.

Runtimes (``ckptbridge.adapters.torch``: torch.distributed's TCPStore;
``ckptbridge.adapters.jax``: the ``jax.distributed`` key-value store) register a
:class:`JobStore` through the ``ckptbridge.job_stores`` entry-point group (or
:func:`register_job_store`); :func:`store_for` asks them, in ``priority`` order,
for a client of the running job's store. No server of our own. A client offers::

    kv = store_for(rank, world)          # the first runtime whose job is up answers
    kv.set("beat/0", "...")
    beats, verdict = kv.snapshot(world)  # every rank's beat and the verdict, in one round trip
    kv.claim("verdict", text)            # the first writer wins; returns the winning value
    kv.get(key); kv.wait(keys, timeout); kv.init_verdict(); kv.host_rank

Every call is bounded in time (a client of a stopped server can block in ``recv``
forever, whatever its own timeout says): clients run calls through a
:class:`BoundedCaller`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import WatchdogError
from .._plugins import PluginGroup

ENTRY_POINT_GROUP = "ckptbridge.job_stores"


class StoreTimeout(WatchdogError, TimeoutError):
    """A store call did not return in time (its server may be stopped or gone)."""


@dataclass(frozen=True)
class JobStore:
    """How the fault detector reaches one runtime's job store.

    ``open(rank, world, store, job, timeout)``: a client (see the module docstring) of
    ``store`` when it is this runtime's kind, or, with ``store=None``, of the running
    job's store when this runtime's distributed job is up; ``None`` otherwise. ``job``
    names the job (keys of other jobs are never read); ``timeout``: seconds one call may
    take before it counts as failed. Lower ``priority`` is asked first.
    """

    name: str
    open: Callable[[int, int, Any, str, float], Any]
    priority: int = 100


_GROUP = PluginGroup(ENTRY_POINT_GROUP)
_STORES: list[JobStore] = []


def register_job_store(store: JobStore) -> JobStore:
    """Add (or replace, by name) a runtime's :class:`JobStore`."""
    with _GROUP.lock:
        _STORES[:] = [s for s in _STORES if s.name != store.name]
        _STORES.append(store)
    return store


def job_stores() -> list[JobStore]:
    """Registered job stores (entry points loaded on first use), in ``priority`` order."""
    with _GROUP.lock:
        known = {s.name for s in _STORES}
        for s in _GROUP.load():  # a runtime that is not installed is skipped
            if s.name not in known:
                register_job_store(s)
        return sorted(_STORES, key=lambda s: s.priority)


def store_for(rank: int, world: int, store: Any = None, job: str | None = None, timeout: float = 1.0) -> Any:
    """A client of the running job's store (``store`` if given): the first registered
    runtime that recognises it answers."""
    run = job or os.environ.get("TORCHELASTIC_RUN_ID", "job")
    for s in job_stores():
        kv = s.open(rank, world, store, run, timeout)
        if kv is not None:
            return kv
    if store is not None:
        raise WatchdogError(f"store=: no installed runtime serves a {type(store).__module__}."
                            f"{type(store).__name__} (known: {[s.name for s in job_stores()]})")
    raise WatchdogError("no job store to report through: initialise torch.distributed (e.g. under "
                        "torchrun) or jax.distributed first, or pass store=")


class _Worker:
    """One helper thread; ``request``/``reply`` are locks used as binary semaphores (the
    cheapest hand-off there is: every wakeup costs CPU on a virtual machine)."""

    def __init__(self) -> None:
        self.request, self.reply = threading.Lock(), threading.Lock()
        self.request.acquire()
        self.reply.acquire()
        self.fn: Callable[[], Any] | None = None
        self.result: tuple[bool, Any] = (False, None)
        self.busy, self.since, self.late = False, 0.0, False
        threading.Thread(target=self._run, name="ckptbridge-kv", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.request.acquire()
            fn = self.fn
            if fn is None:
                return
            try:
                self.result = (True, fn())
            except BaseException as err:
                self.result = (False, err)
            self.reply.release()
            self.busy = False  # after the release: a caller that sees it idle can take the reply


class BoundedCaller:
    """Runs calls on a helper thread, each bounded by ``timeout`` (:class:`StoreTimeout`).
    A late call is not abandoned at once: until it returns, later calls fail at once (no new
    connection, no reply read out of turn); one stuck for ``retire_after`` seconds retires
    the thread and, through ``on_stuck``, its connection::

        call = BoundedCaller(0.5)
        value = call(lambda: client.get(key))
    """

    def __init__(self, timeout: float, on_stuck: Callable[[], None] | None = None,
                 retire_after: float = 5.0) -> None:
        self.timeout, self.on_stuck, self.retire_after = timeout, on_stuck, retire_after
        self._lock = threading.Lock()
        self._worker: _Worker | None = None

    def __call__(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        with self._lock:  # one call at a time per connection, from any thread
            w = self._worker
            if w is not None and w.busy:
                if time.monotonic() - w.since < self.retire_after:
                    raise StoreTimeout("an earlier store call has not returned yet")
                self._worker = w = None
                if self.on_stuck is not None:
                    self.on_stuck()
            if w is None:
                w = self._worker = _Worker()
            elif w.late:  # the late call returned since: consume its reply
                w.reply.acquire()
            w.busy, w.since, w.late, w.fn = True, time.monotonic(), False, fn
            w.request.release()
            if not w.reply.acquire(timeout=self.timeout if timeout is None else timeout):
                w.late = True
                raise StoreTimeout(f"a store call did not return within {self.timeout:.2f}s")
            ok, value = w.result
        if not ok:
            raise value
        return value


def poll_keys(keys: list[str], present: Callable[[str], bool], timeout: float,
              stop_on_error: bool = False) -> list[str]:
    """The keys still missing after ``timeout`` seconds; a call that fails counts as missing
    (and ends the wait if ``stop_on_error``)."""
    deadline = time.monotonic() + timeout
    missing = list(keys)
    while missing:
        still = []
        for k in missing:
            try:
                found = present(k)
            except Exception:
                if stop_on_error:
                    return missing
                found = False
            if not found:
                still.append(k)
        missing = still
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return missing


def retry(call: Callable[[], Any], seconds: float) -> Any:
    """``call()`` until it succeeds or ``seconds`` pass (then its last error is raised)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

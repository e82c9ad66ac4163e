"""The job's own key-value store, as the fault detector uses it: torch.distributed's
TCPStore (the one torchrun's rendezvous or ``init_process_group`` set up) or the
``jax.distributed`` coordination service's key-value store. No server of our own.

Every store offers the same few calls, namespaced under one prefix, each bounded in
time (a client of a stopped server can block in ``recv`` forever, whatever its own
timeout says, so calls run on a helper thread and a late one abandons its connection)::

    kv = store_for(rank, world)          # torch (MASTER_ADDR/PORT) or jax.distributed, whichever runs
    kv.set("beat/0", "...")
    beats, verdict = kv.snapshot(world)  # every rank's beat and the verdict, in one round trip
    kv.claim("verdict", text)            # the first writer wins; returns the winning value
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptbridge._errors import WatchdogError


class StoreTimeout(WatchdogError, TimeoutError):
    """A store call did not return in time (its server may be stopped or gone)."""


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


class _Caller:
    """Runs calls on a helper thread, each bounded by ``timeout``. A late call is not
    abandoned at once: until it returns, later calls fail at once (no new connection, no
    reply read out of turn); one stuck for ``retire_after`` seconds retires the thread and,
    through ``on_stuck``, its connection."""

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


class TorchKV:
    """A torch.distributed ``Store`` (normally a TCPStore client of its own, connected to the
    job's store server), keys under ``prefix``."""

    def __init__(self, store: Any, prefix: str, host_rank: int | None,
                 address: tuple[str, int] | None = None, timeout: float = 5.0) -> None:
        import torch.distributed as dist

        self.prefix, self.address = prefix, address
        self.store = dist.PrefixStore(prefix, store)
        self.host_rank = host_rank  # the rank whose process serves the store (None: a launcher)
        self._call = _Caller(timeout, self._retire)
        self._fresh = False

    def _retire(self) -> None:
        self._fresh = self.address is not None  # reconnect before the next call

    def _store(self) -> Any:
        if self._fresh and self.address is not None:
            import torch.distributed as dist

            host, port = self.address
            self.store = dist.PrefixStore(self.prefix, _client(host, port))
            self._fresh = False
        return self.store

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self._store().set(key, value))

    def init_verdict(self) -> None:
        self._call(lambda: self._store().compare_set("verdict", "", ""))  # exists (empty) from now on

    def snapshot(self, world: int, beat: tuple[str, str] | None = None) -> tuple[dict[int, str], str]:
        """Every rank's beat and the verdict (after writing ``beat`` = (key, value), in the same call)."""
        keys = [f"beat/{r}" for r in range(world)] + ["verdict"]

        def call() -> list[bytes]:
            store = self._store()
            if beat is not None:
                store.set(*beat)
            return store.multi_get(keys)

        text = [v.decode("utf-8", "replace") for v in self._call(call)]
        return dict(enumerate(text[:-1])), text[-1]

    def claim(self, key: str, value: str) -> str:
        return self._call(lambda: self._store().compare_set(key, "", value)).decode("utf-8", "replace")

    def get(self, key: str) -> str | None:
        def read() -> str | None:
            store = self._store()
            return store.get(key).decode("utf-8", "replace") if store.check([key]) else None

        return self._call(read)

    def wait(self, keys: list[str], timeout: float, stop_on_error: bool = False) -> list[str]:
        """Keys still missing after ``timeout`` seconds (polling, so a short timeout is cheap)."""
        return _poll(keys, lambda k: self._call(lambda: self._store().check([k])), timeout, stop_on_error)


class JaxKV:
    """The ``jax.distributed`` key-value store (served by the coordinator, process 0)."""

    def __init__(self, client: Any, prefix: str, timeout: float = 5.0) -> None:
        self.client = client
        self.prefix = prefix
        self.host_rank = 0
        self._call = _Caller(timeout)

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self.client.key_value_set(self.prefix + key, value, allow_overwrite=True))

    def init_verdict(self) -> None:
        pass  # absent until claimed; snapshot lists a directory

    def snapshot(self, world: int, beat: tuple[str, str] | None = None) -> tuple[dict[int, str], str]:
        def call() -> list[tuple[str, str]]:
            if beat is not None:
                self.client.key_value_set(self.prefix + beat[0], beat[1], allow_overwrite=True)
            return self.client.key_value_dir_get(self.prefix)

        beats: dict[int, str] = {}
        verdict = ""
        for key, value in self._call(call):
            rel = key[len(self.prefix):] if key.startswith(self.prefix) else key
            if rel.startswith("beat/"):
                beats[int(rel[5:])] = value
            elif rel == "verdict":
                verdict = value
        return beats, verdict

    def claim(self, key: str, value: str) -> str:
        def claim() -> str:
            try:
                self.client.key_value_set(self.prefix + key, value, allow_overwrite=False)
                return value
            except Exception:  # ALREADY_EXISTS: someone claimed first
                return self.client.blocking_key_value_get(self.prefix + key, 2_000)

        return self._call(claim)

    def get(self, key: str) -> str | None:
        def read() -> str | None:
            try:
                return self.client.key_value_try_get(self.prefix + key)
            except Exception:  # NOT_FOUND
                return None

        return self._call(read)

    def wait(self, keys: list[str], timeout: float, stop_on_error: bool = False) -> list[str]:
        return _poll(keys, lambda k: self.get(k) is not None, timeout, stop_on_error)


def _poll(keys: list[str], present: Callable[[str], bool], timeout: float, stop_on_error: bool) -> list[str]:
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


def _client(host: str, port: int) -> Any:
    import torch.distributed as dist

    # the client's own timeout only bounds connecting; calls are bounded by _Caller
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _agreed_token(rank: int) -> str:
    """A token every rank of this attempt shares (rank 0's, broadcast over the process
    group), so keys of an earlier attempt on a long-lived store are never read."""
    import uuid

    import torch.distributed as dist

    box = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def store_for(rank: int, world: int, store: Any = None, job: str | None = None,
              timeout: float = 1.0) -> TorchKV | JaxKV:
    """The store of the running job: ``store`` if given (a torch Store or a jax.distributed
    client), else torch.distributed's (when initialised: a new TCPStore client of the
    MASTER_ADDR/MASTER_PORT server that torchrun or ``init_process_group`` set up), else
    jax.distributed's. ``timeout``: seconds one call may take before it counts as failed."""
    import sys

    dist = sys.modules.get("torch.distributed")
    torch_up = dist is not None and dist.is_available() and dist.is_initialized()
    jax_dist = sys.modules.get("jax._src.distributed")
    client = getattr(getattr(jax_dist, "global_state", None), "client", None)
    run = job or os.environ.get("TORCHELASTIC_RUN_ID", "job")
    if store is not None and type(store).__module__.startswith("torch"):
        token = _agreed_token(rank) if torch_up else "0"
        return TorchKV(store, f"ckptbridge/watchdog/{run}/{token}/", None, timeout=timeout)
    # jax.distributed's store answers over gRPC (milliseconds, more under load) and a stopped
    # coordinator aborts the whole job anyway (JAX's design): its calls get a longer bound
    jax_timeout = max(timeout, 0.5)
    if store is not None:
        return JaxKV(store, f"ckptbridge/watchdog/{run}/", timeout=jax_timeout)
    if torch_up:
        prefix = f"ckptbridge/watchdog/{run}/{_agreed_token(rank)}/"
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port:
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            return TorchKV(_client(addr, int(port)), prefix, None if agent else 0, (addr, int(port)),
                           timeout=timeout)
        from torch.distributed import distributed_c10d

        return TorchKV(distributed_c10d._get_default_store(), prefix, 0, timeout=timeout)
    if client is not None:
        return JaxKV(client, f"ckptbridge/watchdog/{run}/", timeout=jax_timeout)
    raise WatchdogError("no job store to report through: initialise torch.distributed (e.g. under "
                        "torchrun) or jax.distributed first, or pass store=")

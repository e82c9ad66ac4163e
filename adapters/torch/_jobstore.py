"""torch.distributed's store as the fault detector's job store (``ckptbridge.job_stores``).

The TCPStore that torchrun's rendezvous or ``init_process_group`` set up: the watchdog
opens a client of its own (MASTER_ADDR/MASTER_PORT), so its calls never queue behind the
process group's. torch is imported only when a torch job is running.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

from ckptbridge.plugin import BoundedCaller, JobStore, poll_keys


class TorchKV:
    """A torch.distributed ``Store`` (normally a TCPStore client of its own, connected to the
    job's store server), keys under ``prefix``."""

    def __init__(self, store: Any, prefix: str, host_rank: int | None,
                 address: tuple[str, int] | None = None, timeout: float = 5.0) -> None:
        import torch.distributed as dist

        self.prefix, self.address = prefix, address
        self.store = dist.PrefixStore(prefix, store)
        self.host_rank = host_rank  # the rank whose process serves the store (None: a launcher)
        self._call = BoundedCaller(timeout, self._retire)
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
        return poll_keys(keys, lambda k: self._call(lambda: self._store().check([k])), timeout, stop_on_error)


def _client(host: str, port: int) -> Any:
    import torch.distributed as dist

    # the client's own timeout only bounds connecting; calls are bounded by BoundedCaller
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


def open_job_store(rank: int, world: int, store: Any, run: str, timeout: float) -> TorchKV | None:
    """A client of ``store`` (a torch ``Store``) or of the running torch.distributed job's
    store; ``None`` when neither is torch's."""
    dist = sys.modules.get("torch.distributed")  # never imports torch for a job that does not use it
    torch_up = dist is not None and dist.is_available() and dist.is_initialized()
    if store is not None:
        if not type(store).__module__.startswith("torch"):
            return None
        token = _agreed_token(rank) if torch_up else "0"
        return TorchKV(store, f"ckptbridge/watchdog/{run}/{token}/", None, timeout=timeout)
    if not torch_up:
        return None
    prefix = f"ckptbridge/watchdog/{run}/{_agreed_token(rank)}/"
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return TorchKV(_client(addr, int(port)), prefix, None if agent else 0, (addr, int(port)), timeout=timeout)
    from torch.distributed import distributed_c10d

    return TorchKV(distributed_c10d._get_default_store(), prefix, 0, timeout=timeout)


JOB_STORE = JobStore("torch", open_job_store, priority=10)

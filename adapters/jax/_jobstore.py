"""The ``jax.distributed`` key-value store as the fault detector's job store
(``ckptbridge.job_stores``): served by the coordinator, process 0. jax is never
imported here: a job that has not started ``jax.distributed`` is simply not a JAX job.
"""

from __future__ import annotations

import sys
from typing import Any

from ckptbridge.plugin import BoundedCaller, JobStore, poll_keys


class JaxKV:
    """The ``jax.distributed`` key-value store (served by the coordinator, process 0)."""

    def __init__(self, client: Any, prefix: str, timeout: float = 5.0) -> None:
        self.client = client
        self.prefix = prefix
        self.host_rank = 0
        self._call = BoundedCaller(timeout)

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
        return poll_keys(keys, lambda k: self.get(k) is not None, timeout, stop_on_error)


def open_job_store(rank: int, world: int, store: Any, run: str, timeout: float) -> JaxKV | None:
    """A client of ``store`` (a ``jax.distributed`` client) or of the running
    ``jax.distributed`` job's store; ``None`` when neither is JAX's."""
    # jax.distributed's store answers over gRPC (milliseconds, more under load) and a stopped
    # coordinator aborts the whole job anyway (JAX's design): its calls get a longer bound
    timeout = max(timeout, 0.5)
    if store is not None:
        if not hasattr(store, "key_value_dir_get"):
            return None
        return JaxKV(store, f"ckptbridge/watchdog/{run}/", timeout=timeout)
    jax_dist = sys.modules.get("jax._src.distributed")
    client = getattr(getattr(jax_dist, "global_state", None), "client", None)
    if client is None:
        return None
    return JaxKV(client, f"ckptbridge/watchdog/{run}/", timeout=timeout)


JOB_STORE = JobStore("jax", open_job_store, priority=20)

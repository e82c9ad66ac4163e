"""Scale-out conversion: ``convert`` run as N processes of the launcher the user already has.

Under ``torchrun --nproc-per-node N -m ckptbridge convert SRC DST`` (or any
launcher that sets ``RANK``/``WORLD_SIZE``: ``srun``, ``mpirun`` ...) every
process opens the source (metadata only), plans the same pieces, and writes
a balanced share of the bytes (whole tensor states, largest first onto the
least loaded rank, so the result is the one-process result with other file
names) with its ``manifest.r<rank>.json``; rank 0 then merges and commits
(``write_rank`` / ``commit_universal``, the universal format's rule 10).

Ranks agree through a small key-value store. For a local (or mounted) ``DST``
with a job id from the launcher (``CKPTBRIDGE_JOB_ID``, ``SLURM_JOB_ID`` + step +
restart count, ``TORCHELASTIC_RUN_ID`` + restart count, as ``torchrun
--standalone`` or ``--rdzv-id`` sets it ...) that is files in a coordination
directory beside the stage (``DST.partial.<job>.coord``): every rank writes
under ``DST``, so the directory is shared by all of them, and a poll is one
``open``. Otherwise (a URL, where each poll is a request, or no job id) the
launcher's own store: ``torch.distributed``'s TCP store, found through the
``ckptbridge.stores`` entry-point group, when torch is installed and
``MASTER_ADDR``/``MASTER_PORT`` are set; failing that, files under
``DST/.coord/<job>/``. There are no collectives; the core never imports torch.
The protocol::

    rank 0: check DST, publish  start = ok:<token> | fail:<why>
    all:    write my share into the stage, publish wrote/<rank> = ok | fail:<why>
    rank 0: wait for every wrote/<rank>; commit only if all ok; publish result
    others: wait for result, acknowledge; rank 0 removes the coordination files

A killed rank never reports: rank 0 commits nothing (the launcher usually tears
the job down at once; otherwise rank 0 gives up after ``timeout`` naming the
rank), so no ``COMMITTED`` marker appears and a rerun starts afresh::

    world = world_from_env("out/universal")      # None outside a launcher (or with one process)
    ckptbridge.convert("run/global_step3", "out/universal", world=world)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _storage
from .._errors import CheckpointError, OptionError, WriteError
from .._ranks import find_ranks
from .._storage.commit import check_destination, prepare_destination, staging_path

STORE_GROUP = "ckptbridge.stores"
DEFAULT_TIMEOUT = 6 * 3600.0


class Store(Protocol):
    """A key-value store shared by the ranks: ``set`` publishes, ``get`` waits for a key."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str, timeout: float) -> str:
        """The value of ``key``; raises ``TimeoutError`` if it does not appear within ``timeout`` s."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class World:
    """This process's place in a launched job: ``rank`` of ``size``, the ``store`` the ranks share,
    and the ``job`` id used when files coordinate (and as the staging token)."""

    rank: int
    size: int
    store: Store
    job: str = ""
    timeout: float = DEFAULT_TIMEOUT


# ------------------------------------------------------------------ the launcher's environment

def job_id(env: Mapping[str, str] | None = None) -> str:
    """An id all ranks of one launch share and a relaunch does not (for file coordination)."""
    env = os.environ if env is None else env
    if env.get("CKPTBRIDGE_JOB_ID"):
        job = env["CKPTBRIDGE_JOB_ID"]
    elif env.get("SLURM_JOB_ID"):
        job = f"slurm{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}.{env.get('SLURM_RESTART_COUNT', '0')}"
    elif env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none"):
        job = f"te{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    elif env.get("OMPI_MCA_ess_base_jobid"):
        job = f"ompi{env['OMPI_MCA_ess_base_jobid']}"
    else:
        return ""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64]


def world_from_env(dst: str, timeout: float = DEFAULT_TIMEOUT,
                   env: Mapping[str, str] | None = None) -> World | None:
    """The :class:`World` of this process for writing ``dst``, or None with one process."""
    env = os.environ if env is None else env
    found = find_ranks(env)
    rank, size = (found.rank, found.world) if found else (0, 1)
    if size <= 1:
        return None
    job = job_id(env)
    if job and not _storage.is_url(dst):
        # every rank writes its share under dst, so files beside it are shared by all of them: no
        # launcher store needed (torch's costs each rank an import of torch, ~1 s of a conversion)
        return World(rank, size, FileStore(coordination_dir(dst, job)), job, timeout)
    for ep in importlib.metadata.entry_points(group=STORE_GROUP):
        try:
            make = ep.load()
        except ImportError:
            continue
        store = make(rank, size, timeout)
        if store is not None:
            return World(rank, size, store, job, timeout)
    if not job:
        raise OptionError(
            f"{dst}: {size} ranks but no shared store (torch.distributed with MASTER_ADDR/MASTER_PORT) and "
            "no job id to coordinate through files: set CKPTBRIDGE_JOB_ID to a value unique to this launch")
    return World(rank, size, FileStore(coordination_dir(dst, job)), job, timeout)


def coordination_dir(dst: str, job: str) -> str:
    """Where file coordination keeps its keys: beside the stage (locally) or under the prefix (URL)."""
    if _storage.is_url(dst):
        return _storage.join(dst, ".coord", job)
    return staging_path(dst, f"job-{job}") + ".coord"


class FileStore:
    """A :class:`Store` over files in a directory (local or URL): ``set`` writes a file whole
    (rename / single PUT), ``get`` polls for it."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.remote = _storage.is_url(root)
        if not self.remote:
            os.makedirs(root, exist_ok=True)

    def _path(self, key: str) -> str:
        return _storage.join(self.root, key.replace("/", "__"))

    def set(self, key: str, value: str) -> None:
        path = self._path(key)
        if self.remote:
            _storage.write_bytes(path, value.encode())
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as fh:
            fh.write(value)
        os.replace(tmp, path)

    def get(self, key: str, timeout: float) -> str:
        path = self._path(key)
        deadline, delay = time.monotonic() + timeout, 0.01
        while True:
            if self.remote:
                store = _storage.get(path)
                store.invalidate(path)
                if store.isfile(path):
                    return _storage.read_bytes(path).decode()
            else:
                with contextlib.suppress(FileNotFoundError), open(path) as fh:
                    return fh.read()
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5 if self.remote else 0.05)  # a local poll is one stat call

    def close(self) -> None:
        pass

    def remove_all(self) -> None:
        if self.remote:
            store = _storage.remote(self.root)
            store.remove_many([_storage.join(self.root, r) for r in _storage.find(self.root)])
        else:
            shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------ planning (pure)


def balance(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` split into ``n`` shares of nearly equal sums (largest first onto the
    least loaded share; deterministic), each share in index order::

        >>> balance([5, 1, 4, 2], 2)
        [[0, 1], [2, 3]]
    """
    loads = [0] * n
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += sizes[i]
    return [sorted(s) for s in shares]


# ------------------------------------------------------------------ the protocol

_CALLS = threading.local()


def _fail_text(err: BaseException) -> str:
    return " ".join((str(err) or type(err).__name__).split())


def _poll(store: Store, key: str, timeout: float, missing: str) -> str:
    """``store.get(key)`` in slices of a second, so that signals are handled while waiting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return store.get(key, max(0.001, min(1.0, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                return missing


class _Terminated(SystemExit):
    """SIGTERM (the launcher tears the job down because another rank died)."""


@contextlib.contextmanager
def _exit_on_sigterm() -> Any:
    """Turn SIGTERM into an exception in the main thread, so a torn-down rank 0 removes its stage."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_(signum: int, frame: Any) -> None:
        raise _Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(world: World, dst: str, overwrite: bool,
        write: Callable[[str], Any], commit: Callable[[str], str]) -> str:
    """Drive one distributed write of ``dst`` (see the module doc): ``write(token)`` writes this
    rank's share into the stage, ``commit(token)`` (rank 0, once every rank wrote) merges and
    publishes. Every rank returns ``dst`` or raises the error, naming the rank that failed.
    A rank 0 terminated by the launcher (SIGTERM) removes the local stage before it exits."""
    seen: dict[str, str] = {}  # the stage's token, once known
    with _exit_on_sigterm():
        try:
            return _run(world, dst, overwrite, write, commit, seen)
        except _Terminated:
            if world.rank == 0 and not _storage.is_url(dst):
                if "token" in seen:
                    shutil.rmtree(staging_path(dst, seen["token"]), ignore_errors=True)
                if isinstance(world.store, FileStore):
                    world.store.remove_all()
            raise


def _run(world: World, dst: str, overwrite: bool,
         write: Callable[[str], Any], commit: Callable[[str], str], seen: dict[str, str]) -> str:
    n = getattr(_CALLS, "n", 0)
    _CALLS.n = n + 1
    key = f"ckptbridge/{world.job or 'job'}/{n}"
    store, rank, size = world.store, world.rank, world.size
    # 1. rank 0 checks the destination and picks the stage's token
    if rank == 0:
        try:
            check_destination(dst, overwrite)
            prepare_destination(dst, overwrite)
            token = f"job-{world.job}" if isinstance(store, FileStore) else uuid.uuid4().hex[:12]
            store.set(f"{key}/start", f"ok:{token}")
        except BaseException as err:
            store.set(f"{key}/start", f"fail:{_fail_text(err)}")
            raise
    else:
        status = _wait(store, f"{key}/start", world.timeout, f"{dst}: rank 0 did not start the write")
        if status.startswith("fail:"):
            raise WriteError(f"{dst}: not written: rank 0 refused ({status[5:]})")
        token = status[3:]
    seen["token"] = token
    # 2. every rank writes its share
    try:
        write(token)
    except _Terminated:
        raise  # the launcher is tearing the job down: no goodbyes (run() removes the stage)
    except BaseException as err:
        store.set(f"{key}/wrote/{rank}", f"fail:{_fail_text(err)}")
        if rank == 0:
            _abandon(world, dst, token, key, f"rank 0 failed: {_fail_text(err)}")
        raise
    store.set(f"{key}/wrote/{rank}", "ok")
    # 3. rank 0 commits when every rank wrote
    if rank == 0:
        failed = []
        for r in range(size):
            status = _poll(store, f"{key}/wrote/{r}", world.timeout,
                           f"fail:rank {r} did not finish within {world.timeout:.0f} s (killed or hung?)")
            if status != "ok":
                failed.append((r, status[5:]))
        if failed:
            why = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            _abandon(world, dst, token, key, why)
            raise WriteError(f"{dst}: not committed: {why}")
        try:
            out = commit(token)
        except BaseException as err:
            _abandon(world, dst, token, key, f"commit failed: {_fail_text(err)}")
            raise
        store.set(f"{key}/result", "ok")
        _finish(world, key)
        return out
    status = _wait(store, f"{key}/result", world.timeout, f"{dst}: rank 0 did not commit")
    store.set(f"{key}/ack/{rank}", "ok")
    if status != "ok":
        raise WriteError(f"{dst}: not committed: {status[5:]}")
    return dst


def _wait(store: Store, key: str, timeout: float, what: str) -> str:
    try:
        return store.get(key, timeout)
    except TimeoutError:
        raise WriteError(f"{what} within {timeout:.0f} s (killed or hung?); nothing was committed") from None


def _abandon(world: World, dst: str, token: str, key: str, why: str) -> None:
    """Rank 0 after a failure: tell the others, then remove the stage (nothing was committed)."""
    if not _storage.is_url(dst):  # first: a launcher tearing the job down may not wait for the rest
        shutil.rmtree(staging_path(dst, token), ignore_errors=True)
    world.store.set(f"{key}/result", f"fail:{why}")
    _finish(world, key)


def _finish(world: World, key: str, ack_timeout: float = 60.0) -> None:
    """Wait (briefly) until every other rank read the result, then drop file coordination's files."""
    deadline = time.monotonic() + min(ack_timeout, world.timeout)
    for r in range(1, world.size):
        with contextlib.suppress(TimeoutError, CheckpointError, OSError):
            world.store.get(f"{key}/ack/{r}", max(0.0, deadline - time.monotonic()))
    if isinstance(world.store, FileStore):
        world.store.remove_all()

"""Lazy, asynchronous, multi-level checkpointing straight into the universal layout.

Training state does not change between optimizer steps, so a checkpoint can
be copied to host memory while forward/backward runs (DataStates-LLM), then
written to local disk, then copied to a persistent place, all in the
background. Training waits only when the next optimizer step would change a
tensor that is not copied yet::

    ckpt = Checkpointer("ckpts", keep_last=3, persistent="s3://bucket/run1")
    for step in range(steps):
        loss = train_step()                      # torch: forward, backward
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()},
                  optimizer=opt)                  # returns at once; opt.step() waits if needed
        opt.step()
    ckpt.wait()
    state = ckpt.restore()                        # latest complete step, as numpy
    ckpt.restore_into(model.state_dict())         # or in place into live tensors

Levels: (1) host buffers, allocated once and reused (two sets, so one can
flush while the next snapshot fills the other); (2) a universal directory
``root/step_<N>`` on local disk, committed by a marker written last only once
every rank finished; (3) optionally a copy under ``persistent`` (a directory
or any fsspec URL), its marker copied last too.

Multi-process: sharded values (DTensors, JAX arrays) are written by the
rank holding replica 0 of each shard; a plain tensor or array is taken to be
replicated (as under DDP) and written by rank 0 only; state that differs per
rank (RNG, data position) goes in ``save(..., local={...})`` and is stored by
every rank under ``rank<r>.<name>``.

Capture rules: a tensor the caller registered a guard for (the optimizer's
parameters and state, via ``optimizer=``; JAX arrays when the train step is
wrapped with :meth:`Checkpointer.guard`) is copied lazily in the background;
every other tensor is copied before ``save`` returns, so the caller may
change it in place the moment ``save`` returns. A restored step is always
bitwise the state at the moment ``save`` was called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import queue
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _dtypes
from ._errors import CheckpointError, IncompleteCheckpointError, MissingShardError
from ._model import Box
from ._safetensors import FileSpec, file_layout
from ._universal import MARKER, PARTIAL, Piece, commit, plan_rank, staging, write_rank

log = logging.getLogger("ckptbridge.checkpointer")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


@dataclass(frozen=True)
class Leaf:
    """One tensor (or this rank's shard of one) to capture.

    ``copy(out)`` writes the tensor's current value into the host buffer
    ``out``; ``lazy`` says a guard protects it, so the copy may run later in
    the background. ``write`` is False for replicas another rank writes.
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    copy: Callable[[np.ndarray], None]
    lazy: bool = False
    write: bool = True
    key: Any = None  # identity of the live tensor, for guards
    per_process: bool = False  # a plain tensor every process holds: treated as replicated, rank 0 writes
    pin: Callable[[mmap.mmap], Callable[[], None]] | None = None  # page-locks host buffers (CUDA tensors)

    @property
    def buffer_key(self) -> str:
        return buffer_key(self.name, self.box)


def buffer_key(name: str, box: Box) -> str:
    """The host buffer of one leaf (a tensor, or this rank's box of it)."""
    return f"{name}@{','.join(map(str, box.offset))}"


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


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def committed_steps(root: str) -> list[int]:
    """Steps under ``root`` whose checkpoint is complete (marker present), ascending."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, MARKER)):
            out.append(int(m.group(1)))
    return sorted(out)


def flatten(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of nested dicts/lists/tuples/NamedTuples with dotted names
    (``{"opt": (ScaleByAdamState(count, mu, nu),)}`` -> ``opt.0.mu.w`` ...)."""
    if isinstance(state, Mapping):
        for k, v in state.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, tuple) and hasattr(state, "_fields"):  # NamedTuple (optax states)
        for k in state._fields:
            yield from flatten(getattr(state, k), f"{prefix}.{k}" if prefix else k)
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, state


def _numpy_leaf(name: str, value: np.ndarray) -> Leaf:
    arr = np.asarray(value)
    shape = tuple(arr.shape)
    return Leaf(name, _dtypes.name_of(arr.dtype), shape, Box.full(shape),
                lambda out, a=arr: np.copyto(out, a), per_process=True)


def leaves_of(
    state: Any, lazy_keys: set[int] | frozenset[int] = frozenset(), jax_lazy: bool = False
) -> tuple[list[Leaf], dict[str, Any]]:
    """Split a state into tensor leaves and JSON-able non-tensor values.

    ``lazy_keys``: identities (data pointers) of torch tensors a guard protects;
    ``jax_lazy``: JAX arrays are protected (the train step is guarded). torch
    and JAX values are handled by their adapters, imported only when such a
    value is present.
    """
    leaves: list[Leaf] = []
    extra: dict[str, Any] = {}
    for name, value in flatten(state):
        module = type(value).__module__
        if isinstance(value, np.ndarray):
            leaves.append(_numpy_leaf(name, value))
        elif module.startswith("torch"):
            from .adapters._async_torch import torch_leaves

            leaves.extend(torch_leaves(name, value, lazy_keys))
        elif module.startswith(("jax", "jaxlib")):
            from .adapters._async_jax import jax_leaves

            leaves.extend(jax_leaves(name, value, jax_lazy))
        elif isinstance(value, np.generic):
            extra[name] = value.item()
        elif value is None or isinstance(value, (bool, int, float, str)):
            extra[name] = value
        else:
            extra[name] = repr(value)
    return leaves, extra


def _pinner(leaves: list[Leaf]) -> Callable[[mmap.mmap], Callable[[], None]] | None:
    """How to page-lock host buffers for these leaves (set by adapters for device tensors), if at all."""
    return next((leaf.pin for leaf in leaves if leaf.pin is not None), None)


class _BufferSet:
    """Host buffers reused from save to save (allocated on first use per shape/dtype)."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.images: dict[str, mmap.mmap] = {}  # data files' bytes, by relative path: flushed without a copy
        self.layout: tuple[Any, ...] | None = None
        self.unpin: list[Callable[[], None]] = []  # undo page-locking of the images, if pinned
        self.busy = threading.Event()
        self.step: int | None = None  # the snapshot these buffers hold, for the host tier
        self.leaves: list[Leaf] = []
        self.extra: dict[str, Any] = {}

    def lay_out(self, plan: list[tuple[str, list[Piece], FileSpec]],
                pin: Callable[[mmap.mmap], Callable[[], None]] | None = None) -> None:
        """Place the written leaves' buffers inside page-aligned images of their data files
        (kept while the layout holds), so the flush writes them with no copy. ``pin``
        page-locks each image (device-to-host copies of CUDA tensors then run at DMA speed)."""
        layout = tuple((rel, tuple((p.tensor, p.box, p.dtype) for p in group)) for rel, group, _ in plan)
        if layout != self.layout:
            self.release()
            self.images, self.arrays = {}, {}  # drop the old layout's buffers
            for rel, group, spec in plan:
                _, offsets, size = file_layout(spec.entries, spec.metadata)
                image = self.images[rel] = mmap.mmap(-1, max(size, 1))
                for p, at in zip(group, offsets):
                    arr = np.frombuffer(image, _dtypes.to_numpy(p.dtype), count=p.box.size, offset=at)
                    self.arrays[buffer_key(p.tensor, p.box)] = arr.reshape(p.box.shape)
            self.layout = layout
        if pin is not None and not self.unpin:
            self.unpin = [pin(image) for image in self.images.values()]

    def release(self) -> None:
        """Unpin the images (before they are dropped or the checkpointer closes)."""
        for undo in self.unpin:
            undo()
        self.unpin = []

    def get(self, leaf: Leaf) -> np.ndarray:
        arr = self.arrays.get(leaf.buffer_key)
        want = _dtypes.to_numpy(leaf.dtype)
        if arr is None or arr.shape != leaf.box.shape or arr.dtype != want:
            arr = np.empty(leaf.box.shape, dtype=want)
            self.arrays[leaf.buffer_key] = arr
        return arr


@dataclass
class _Job:
    step: int
    leaves: list[Leaf]
    extra: dict[str, Any]
    buffers: _BufferSet
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    flushed: threading.Event = field(default_factory=threading.Event)
    stall: float = 0.0
    snapshot_seconds: float = 0.0
    error: BaseException | None = None
    pending_lazy: list[Leaf] = field(default_factory=list)


class Checkpointer:
    """Asynchronous multi-level checkpointing into universal directories (see module docs).

    ``rank``/``world_size`` default to torch.distributed's when it is
    initialised, else 0/1. Every rank calls ``save`` with its own shards; rank
    0 commits a step once all ranks' pieces are on disk (it polls for them,
    up to ``commit_timeout`` seconds, so no collective runs in a background
    thread).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        persistent: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        commit_timeout: float = 600.0,
        host_tier: bool = True,
        job_id: str | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.persistent = persistent
        self.rank, self.world_size = _dist_info(rank, world_size)
        self.commit_timeout = commit_timeout
        self.host_tier = host_tier
        # every rank of one job must agree on the token; separate jobs must not
        self.token = job_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or (
            uuid.uuid4().hex[:12] if self.world_size == 1 else "job")
        self.stats: list[SaveStats] = []
        self._buffers = [_BufferSet(), _BufferSet()]
        self._next_buffer = 0
        self._snapshots: queue.Queue[_Job | None] = queue.Queue()
        self._flushes: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[_Job] = []
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._hooks: list[Any] = []
        self._jax_guarded = False
        self._failed: frozenset[int] = frozenset()  # ranks given up on (abandon): their pieces never come
        os.makedirs(self.root, exist_ok=True)
        if self.rank == 0:
            self._clean_incomplete(before=None)
        self._threads = [
            threading.Thread(target=self._snapshot_loop, name="ckptbridge-snapshot", daemon=True),
            threading.Thread(target=self._flush_loop, name="ckptbridge-flush", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- saving

    def save(self, step: int, state: Any, *, optimizer: Any = None, extra: Mapping[str, Any] | None = None,
             local: Any = None) -> None:
        """Checkpoint ``state`` (nested dicts of torch/JAX/numpy tensors and plain values) as ``step``.

        Returns as soon as every unguarded tensor is copied to host memory.
        ``local`` holds this rank's own state (saved by every rank as ``rank<r>.*``).
        With ``optimizer`` (a torch optimizer), its parameters and state are
        copied lazily and its ``step()`` waits for that copy.
        """
        self._raise_background_error()
        t0 = time.perf_counter()
        lazy_keys = self._guard_optimizer(optimizer) if optimizer is not None else set()
        leaves, found_extra = leaves_of(state, lazy_keys, self._jax_guarded)
        if local is not None:  # numbers become 0-d arrays so that every rank's values are stored
            numeric = {k: np.asarray(v) if isinstance(v, (bool, int, float)) else v for k, v in flatten(local)}
            own, own_extra = leaves_of({f"rank{self.rank}": numeric})
            if own_extra:
                raise CheckpointError(f"local state must be tensors or numbers: {sorted(own_extra)}")
            leaves += [dataclasses.replace(leaf, per_process=False) for leaf in own]
        buffers = self._acquire_buffers()
        buffers.lay_out(self._plan(leaves), _pinner(leaves))
        job = _Job(step, leaves, {**found_extra, **dict(extra or {})}, buffers)
        eager = [leaf for leaf in leaves if not leaf.lazy]
        job.pending_lazy = [leaf for leaf in leaves if leaf.lazy]
        for leaf in eager:
            leaf.copy(buffers.get(leaf))
        with self._lock:
            self._pending.append(job)
        job.stall = time.perf_counter() - t0
        self._snapshots.put(job)

    def reserve(self, state: Any) -> None:
        """Allocate and touch the host buffers for ``state`` now, outside the training loop.

        Optional: without it the first two saves pay for fresh memory (slow
        on virtual machines that return freed memory to the host).
        """
        leaves, _ = leaves_of(state)
        for b in self._buffers:
            b.lay_out(self._plan(leaves), _pinner(leaves))
            for leaf in leaves:
                leaf.copy(b.get(leaf))

    def guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap a JAX train step (e.g. one with ``donate_argnums``): each call first waits
        for pending snapshots, so donated buffers are never read after donation, and
        JAX arrays passed to ``save`` are captured lazily meanwhile."""
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.wait_snapshots()
            return fn(*args, **kwargs)

        guarded.__wrapped__ = fn  # type: ignore[attr-defined]
        self._jax_guarded = True
        return guarded

    def wait_snapshots(self) -> float:
        """Block until every pending snapshot is in host memory; return seconds waited."""
        t0 = time.perf_counter()
        with self._lock:
            jobs = list(self._pending)
        for job in jobs:
            job.snapshot_done.wait()
        waited = time.perf_counter() - t0
        if jobs and waited > 0:
            jobs[-1].stall += waited
        self._raise_background_error()
        return waited

    def _wait_quietly(self) -> None:
        self.wait_snapshots()

    def wait(self) -> None:
        """Block until every save so far is flushed, committed and persisted."""
        with self._lock:
            jobs = list(self._pending)
        for job in jobs:
            job.flushed.wait()
        self._raise_background_error()

    def abandon(self, ranks: Any) -> None:
        """Give up on saves that still need pieces from ``ranks`` (failed peers): they are
        never committed and fail at once instead of after ``commit_timeout``; every save whose
        pieces all arrive still commits. Used by :class:`ckptbridge.Watchdog` on a fault."""
        self._failed = self._failed | frozenset(int(r) for r in ranks)

    def close(self) -> None:
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._snapshots.put(None)
        for t in self._threads:
            t.join(timeout=60)
        for b in self._buffers:
            b.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- reading

    def latest(self) -> int | None:
        """The newest complete step under ``root`` (or ``persistent`` if root has none)."""
        steps = committed_steps(self.root)
        if not steps and self.persistent and "://" not in self.persistent:
            steps = committed_steps(self.persistent)
        return steps[-1] if steps else None

    def path_of(self, step: int) -> str:
        local = step_dir(self.root, step)
        if os.path.exists(os.path.join(local, MARKER)):
            return local
        if self.persistent and "://" not in self.persistent:
            remote = step_dir(self.persistent, step)
            if os.path.exists(os.path.join(remote, MARKER)):
                return remote
        raise IncompleteCheckpointError(f"{local}: step {step} has no complete checkpoint")

    def restore(self, step: int | None = None) -> dict[str, Any]:
        """The saved state of ``step`` (default latest) as a flat dict name -> numpy array
        (plus its non-tensor values). Served from the host tier when it still holds that step."""
        step = self.latest() if step is None else step
        if step is None:
            raise MissingShardError(f"{self.root}: no complete checkpoint to restore")
        held = self._host_tier(step)
        if held is not None:
            return held
        from ._open import open as open_checkpoint

        with open_checkpoint(self.path_of(step)) as ckpt:
            out: dict[str, Any] = {name: ckpt[name].read() for name in ckpt}
            out.update(ckpt.extra.get("values", {}))
        return out

    def restore_into(self, state: Any, step: int | None = None) -> int:
        """Copy a saved step into live tensors of the same structure (torch in place; numpy in place).
        Returns the step restored."""
        step = self.latest() if step is None else step
        flat = self.restore(step)
        for name, value in flatten(state):
            if name not in flat:
                continue
            if type(value).__module__.startswith("torch"):
                from .adapters._async_torch import copy_into

                copy_into(value, flat[name])
            elif isinstance(value, np.ndarray):
                np.copyto(value, flat[name])
        return int(step) if step is not None else -1

    def _host_tier(self, step: int) -> dict[str, Any] | None:
        if not self.host_tier or self.world_size != 1:
            return None
        for b in self._buffers:
            if b.step == step and not b.busy.is_set():
                out: dict[str, Any] = {}
                for leaf in b.leaves:
                    full = out.setdefault(leaf.name, np.empty(leaf.global_shape, _dtypes.to_numpy(leaf.dtype)))
                    full[leaf.box.slices()] = b.arrays[leaf.buffer_key]
                return out | dict(b.extra)
        return None

    # ---------------------------------------------------------------- internals

    def _guard_optimizer(self, optimizer: Any) -> set[int]:
        from .adapters._async_torch import optimizer_tensor_keys

        if not any(getattr(h, "_ckptbridge_opt", None) is optimizer for h in self._hooks):
            handle = optimizer.register_step_pre_hook(lambda *_: self._wait_quietly())
            handle._ckptbridge_opt = optimizer
            self._hooks.append(handle)
        return optimizer_tensor_keys(optimizer)

    def _pieces(self, leaves: list[Leaf], arrays: Mapping[str, np.ndarray] | None = None) -> list[Piece]:
        """The pieces this rank writes (replicated plain tensors only on rank 0)."""
        return [Piece(leaf.name, "param", leaf.dtype, leaf.global_shape, leaf.box,
                      arrays[leaf.buffer_key] if arrays is not None else np.empty(0))
                for leaf in leaves if leaf.write and (self.rank == 0 or not leaf.per_process)]

    def _plan(self, leaves: list[Leaf]) -> list[tuple[str, list[Piece], FileSpec]]:
        return plan_rank(self.root, self._pieces(leaves), self.rank)

    def _acquire_buffers(self) -> _BufferSet:
        b = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % len(self._buffers)
        t0 = time.perf_counter()
        while b.busy.is_set():  # both sets in flight: wait for the older flush
            with self._lock:
                older = [j for j in self._pending if j.buffers is b]
            for j in older:
                j.flushed.wait()
            if not older:
                break
        waited = time.perf_counter() - t0
        if waited > 0.001:
            log.info("save waited %.3fs for a buffer set (flushes are slower than saves)", waited)
        b.busy.set()
        b.step = None
        return b

    def _snapshot_loop(self) -> None:
        while True:
            job = self._snapshots.get()
            if job is None:
                self._flushes.put(None)
                return
            t0 = time.perf_counter()
            try:
                for leaf in job.pending_lazy:
                    leaf.copy(job.buffers.get(leaf))
            except BaseException as err:  # surfaced on the next save/wait
                job.error = err
            job.snapshot_seconds = time.perf_counter() - t0
            job.snapshot_done.set()
            self._flushes.put(job)

    def _flush_loop(self) -> None:
        while True:
            job = self._flushes.get()
            if job is None:
                return
            try:
                if job.error is not None:
                    raise job.error
                self._flush(job)
            except BaseException as err:
                log.error("checkpoint of step %s failed: %s", job.step, err)
                with self._lock:
                    self._errors.append(err)
                job.buffers.busy.clear()
                job.flushed.set()
                with self._lock:
                    self._pending.remove(job)

    def _flush(self, job: _Job) -> None:
        t0 = time.perf_counter()
        dst = step_dir(self.root, job.step)
        pieces = self._pieces(job.leaves, job.buffers.arrays)
        nbytes = sum(p.box.size * _dtypes.itemsize(p.dtype) for p in pieces)
        stage = staging(dst, self.token)
        os.makedirs(stage, exist_ok=True)
        with open(os.path.join(stage, f"owner.r{self.rank:05d}.json"), "w") as fh:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, fh)
        write_rank(dst, pieces, self.rank, token=self.token, images=job.buffers.images, background=True)
        committed = False
        if self.rank == 0:
            self._await_ranks(staging(dst, self.token))
            try:
                commit(dst, self.world_size, step=job.step, extra={"values": job.extra},
                       provenance={"writer": "ckptbridge.Checkpointer", "world_size": self.world_size},
                       token=self.token)
                committed = True
            except FileExistsError:  # another job committed this step first: theirs stays
                log.warning("step %d was committed by another writer; discarding ours", job.step)
                shutil.rmtree(staging(dst, self.token), ignore_errors=True)
        flush_s = time.perf_counter() - t0
        job.buffers.step, job.buffers.leaves, job.buffers.extra = job.step, job.leaves, job.extra
        job.buffers.busy.clear()
        persist_s = None
        if committed:
            if self.persistent:
                t1 = time.perf_counter()
                _persist(dst, self.persistent, job.step)
                persist_s = time.perf_counter() - t1
            self._retain()
        stats = SaveStats(job.step, nbytes, job.stall, job.snapshot_seconds, flush_s, persist_s, committed)
        self.stats.append(stats)
        log.info("step %d: %.1f MB, stall %.4fs, snapshot %.3fs, flush %.3fs (%.2f GB/s)%s",
                 job.step, nbytes / 1e6, stats.stall_seconds, stats.snapshot_seconds, flush_s,
                 stats.flush_gbps, f", persist {persist_s:.3f}s" if persist_s is not None else "")
        job.flushed.set()
        with self._lock:
            self._pending.remove(job)

    def _await_ranks(self, stage: str) -> None:
        deadline = time.monotonic() + self.commit_timeout
        want = [os.path.join(stage, f"manifest.r{r:05d}.json") for r in range(self.world_size)]
        while not all(os.path.exists(w) for w in want):
            lost = sorted(r for r in self._failed if r < len(want) and not os.path.exists(want[r]))
            if lost:
                raise CheckpointError(f"{stage}: not committed, ranks {lost} failed before writing their pieces")
            if time.monotonic() > deadline:
                missing = [r for r, w in enumerate(want) if not os.path.exists(w)]
                raise CheckpointError(f"{stage}: ranks {missing} did not finish within {self.commit_timeout}s")
            time.sleep(0.01)

    def _retain(self) -> None:
        steps = committed_steps(self.root)
        if not steps:
            return
        self._clean_incomplete(before=steps[-1])
        if self.keep_last is None:
            return
        keep = set(steps[-self.keep_last:]) if self.keep_last > 0 else set()
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                _remove_checkpoint(step_dir(self.root, s))

    def _clean_incomplete(self, before: int | None) -> None:
        """Remove abandoned staging directories: those whose writers (recorded in
        ``owner.r*.json``) are dead processes of this host, and those of steps older than
        ``before`` untouched for longer than the commit timeout. A live writer's staging
        directory (another job sharing the root) stays."""
        for name in os.listdir(self.root):
            if PARTIAL not in name:
                continue
            m = _STEP_DIR.match(name.split(PARTIAL, 1)[0])
            full = os.path.join(self.root, name)
            stale = before is not None and int(m.group(1)) < before and _age(full) > self.commit_timeout if m else False
            if m and (stale or _abandoned(full)):
                shutil.rmtree(full, ignore_errors=True)
        for name in os.listdir(self.root):  # committed-less step dirs left by a crash mid-rename
            m = _STEP_DIR.match(name)
            full = os.path.join(self.root, name)
            if m and not os.path.exists(os.path.join(full, MARKER)) and (before is None or int(m.group(1)) < before):
                shutil.rmtree(full, ignore_errors=True)

    def _raise_background_error(self) -> None:
        with self._lock:
            if self._errors:
                err = self._errors.pop(0)
                raise CheckpointError(f"a background checkpoint failed: {err}") from err


def _age(path: str) -> float:
    """Seconds since anything in a directory last changed."""
    try:
        newest = max((e.stat().st_mtime for e in os.scandir(path)), default=os.stat(path).st_mtime)
    except OSError:
        return 0.0
    return time.time() - newest


def _abandoned(stage: str) -> bool:
    """True when every writer of a staging directory was a process of this host that is gone."""
    owners = [n for n in os.listdir(stage) if n.startswith("owner.r")] if os.path.isdir(stage) else []
    if not owners:
        return False
    for name in owners:
        try:
            with open(os.path.join(stage, name)) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            return False
        if rec.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(rec["pid"]), 0)
            return False  # still running
        except ProcessLookupError:
            continue
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
    return True


def _remove_checkpoint(path: str) -> None:
    """Delete a committed checkpoint: marker first, so a crash midway never leaves a 'complete' one."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, MARKER))
    shutil.rmtree(path, ignore_errors=True)


def _persist(src: str, dest_root: str, step: int) -> None:
    """Copy a committed step to ``dest_root`` (directory or fsspec URL), marker last."""
    name = os.path.basename(src)
    files = []
    for dirpath, _, names in os.walk(src):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), src)
            if rel != MARKER:
                files.append(rel)
    if "://" in dest_root:
        import fsspec

        fs, base = fsspec.core.url_to_fs(dest_root)
        target = f"{base.rstrip('/')}/{name}"
        for rel in files:
            fs.makedirs(os.path.dirname(f"{target}/{rel}"), exist_ok=True)
            fs.put_file(os.path.join(src, rel), f"{target}/{rel}")
        fs.put_file(os.path.join(src, MARKER), f"{target}/{MARKER}")
        return
    target = os.path.join(dest_root, name)
    stage = target + PARTIAL
    shutil.rmtree(stage, ignore_errors=True)
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(stage, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(src, rel), os.path.join(stage, rel))
    shutil.copyfile(os.path.join(src, MARKER), os.path.join(stage, MARKER))
    if os.path.exists(target):
        _remove_checkpoint(target)
    os.rename(stage, target)


def _dist_info(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank,
                dist.get_world_size() if world_size is None else world_size)
    return (rank or 0, world_size or 1)


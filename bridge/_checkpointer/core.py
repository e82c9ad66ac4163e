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
    state = ckpt.restore()                        # latest complete step: the saved tree, as numpy
    ckpt.restore_into({"model": model, "optim": opt})   # or in place (strict: names must match)

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

Under load (a save while every host buffer set is still in use) the
:class:`~ckptbridge.SavePolicy` decides: wait for the disk (default), skip the
save, or coalesce it with the one waiting for the disk (``policy=``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _dtypes
from .._errors import CheckpointError, MissingShardError
from .._formats.safetensors import FileSpec
from .._formats.safetensors_write import lower_priority
from .._formats.universal import Piece, commit_universal, plan_rank, write_rank
from .._ranks import rank_world
from .._storage.commit import staging_path
from .host import BufferSet, copy_all, fit_sets, warm_spares
from .jobs import Job, SaveStats
from .leaves import Capture, Leaf, flatten, leaves_of, pinner, provider_for, providers
from .persist import check_target, persist
from .policy import SavePolicy, admit, flush_in_background
from .restore import RestoreResult, load_step, restore_into
from .steps import (
    await_ranks,
    clean_incomplete,
    complete_step_dir,
    latest_step,
    record_owner,
    retain,
    retire_newest_dropped,
    reuse_dir,
    reuse_paths,
    step_dir,
)
from .tree import build, leaf_names, walk

log = logging.getLogger("ckptbridge.checkpointer")


class Checkpointer:
    """Asynchronous multi-level checkpointing into universal directories (see module docs).

    ``rank``/``world_size`` default to the running job's (``ckptbridge._ranks``: torch.distributed,
    jax.distributed's process index and count, then the launcher's RANK/WORLD_SIZE, SLURM ...
    variables), else 0/1. Every rank calls ``save`` with its own shards; rank 0 commits a step
    once all ranks' pieces are on disk (it polls for them, up to ``commit_timeout`` seconds, so
    no collective runs in a background thread).
    ``policy`` (:class:`SavePolicy`): back-pressure, host buffer sets, flush priority,
    snapshot threads. Steps that were not written (skipped or coalesced) are listed
    in ``dropped``.
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
        policy: SavePolicy | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.persistent = persistent
        if persistent:
            check_target(persistent)
        self.rank, self.world_size = rank_world(rank, world_size)
        self.commit_timeout = commit_timeout
        self.host_tier = host_tier
        # every rank of one job must agree on the token; separate jobs must not
        self.token = job_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or (
            uuid.uuid4().hex[:12] if self.world_size == 1 else "job")
        self.policy = SavePolicy() if policy is None else policy
        if not isinstance(self.policy, SavePolicy):
            raise CheckpointError(f"policy=: expected a ckptbridge.SavePolicy, got {type(policy).__name__}")
        self.stats: list[SaveStats] = []
        self.dropped: list[int] = []
        self._buffers = [BufferSet() for _ in range(self.policy.host_buffers)]
        self._blocked = 0  # threads waiting for the disk (in save or wait): the flush is the bottleneck
        self._copiers = ThreadPoolExecutor(self.policy.snapshot_threads, thread_name_prefix="ckptbridge-copy")
        # off every save's path, at the lower priority: retention, pre-faulting spare buffer sets
        self._chores = ThreadPoolExecutor(1, thread_name_prefix="ckptbridge-chores", initializer=lower_priority)
        self._snapshots: queue.Queue[Job | None] = queue.Queue()
        self._flushes: queue.Queue[Job | None] = queue.Queue()
        self._pending: list[Job] = []
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a buffer set became free
        self._errors: list[BaseException] = []
        self._hooks: list[Any] = []
        self._jax_guarded = False
        self._failed: frozenset[int] = frozenset()  # ranks given up on (abandon): their pieces never come
        os.makedirs(self.root, exist_ok=True)
        if self.rank == 0:
            clean_incomplete(self.root, None, self.commit_timeout)
        self._threads = [
            threading.Thread(target=self._snapshot_loop, name="ckptbridge-snapshot", daemon=True),
            threading.Thread(target=self._flush_loop, name="ckptbridge-flush", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- saving

    def save(self, step: int, state: Any, *, optimizer: Any = None, extra: Mapping[str, Any] | None = None,
             local: Any = None) -> bool:
        """Checkpoint ``state`` (nested dicts of torch/JAX/numpy tensors and plain values) as ``step``.

        Returns as soon as every unguarded tensor is copied to host memory:
        True, or False when the policy skipped this save (``on_busy="skip"``).
        ``local`` holds this rank's own state (saved by every rank as ``rank<r>.*``).
        With ``optimizer`` (a torch optimizer), its parameters and state are
        copied lazily and its ``step()`` waits for that copy.
        """
        self._raise_background_error()
        t0 = time.perf_counter()
        buffers = self._acquire_buffers(step)
        if buffers is None:
            return False
        try:
            lazy_keys = self._guard_optimizer(optimizer) if optimizer is not None else set()
            flat, tree = walk(state)
            leaves, found_extra = leaves_of(state, Capture(frozenset(lazy_keys), self._jax_guarded), flat)
            if local is not None:  # numbers become 0-d arrays so that every rank's values are stored
                numeric = {k: np.asarray(v) if isinstance(v, (bool, int, float)) else v for k, v in flatten(local)}
                own, own_extra = leaves_of({f"rank{self.rank}": numeric})
                if own_extra:
                    raise CheckpointError(f"local state must be tensors or numbers: {sorted(own_extra)}")
                leaves += [dataclasses.replace(leaf, per_process=False) for leaf in own]
            plan, pin = self._plan(leaves), pinner(leaves)
            fresh = buffers.lay_out(plan, pin)
            job = Job(step, leaves, {**found_extra, **dict(extra or {})}, buffers, tree)
            job.pending_lazy = [leaf for leaf in leaves if leaf.lazy]
            copy_all([leaf for leaf in leaves if not leaf.lazy], buffers, self._copiers, self.policy.snapshot_threads)
        except BaseException:
            self._free(buffers)
            raise
        with self._lock:
            self._pending.append(job)
        job.stall = time.perf_counter() - t0
        self._snapshots.put(job)
        if fresh:
            self._fit_sets(buffers.nbytes())
            warm_spares(self._buffers, self._lock, buffers, plan, pin, self._chores)
        return True

    def reserve(self, state: Any) -> None:
        """Allocate and touch the host buffers for ``state`` now, outside the training loop.

        Optional: without it the first two saves pay for fresh memory (slow
        on virtual machines that return freed memory to the host).
        """
        leaves, _ = leaves_of(state)
        plan = self._plan(leaves)
        self._fit_sets(sum(p.box.size * _dtypes.itemsize(p.dtype) for _, group, _ in plan for p in group))
        for i, b in enumerate(list(self._buffers)):
            if i:  # a leaf copies once (a JAX shard's data is released after its copy)
                leaves, _ = leaves_of(state)
            b.lay_out(plan, pinner(leaves))
            for leaf in leaves:
                leaf.copy(b.get(leaf))

    def guard(self, fn: Callable[..., Any], *, donates: bool | None = None) -> Callable[..., Any]:
        """Wrap a JAX train step so that JAX arrays passed to ``save`` are captured lazily
        (copied to host in the background, no device copy). A call waits for pending
        snapshots only when it donates an array not yet copied, so a donated buffer is
        never read after donation; a step that donates nothing never waits.

        ``donates``: None (default) reads the donated arguments of a ``jax.jit`` function
        (any other callable is taken to donate everything); True: every call waits for
        pending snapshots; False: ``fn`` never donates, no call waits.
        """
        provider = provider_for(fn) if donates is None else None
        donated = provider.donated if provider is not None else None

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if donates is not False:
                pending = self._pending_snapshot_keys()
                if pending:
                    keys = donated(fn, args, kwargs) if donated is not None and not donates else None
                    if keys is None or not keys.isdisjoint(pending):
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

    def _before_optimizer_step(self, *_: Any) -> None:
        """The optimizer pre-hook: its step may change tensors still being copied (returns None,
        as torch requires of a pre-hook that leaves the step's arguments alone)."""
        self.wait_snapshots()

    def wait(self) -> None:
        """Block until every save so far is flushed, committed and persisted."""
        with self._lock:
            jobs = list(self._pending)
            self._blocked += 1
        try:
            for job in jobs:
                job.flushed.wait()
        finally:
            with self._lock:
                self._blocked -= 1
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
        self._copiers.shutdown(wait=True)
        self._chores.shutdown(wait=True)
        if self.rank == 0:  # the files kept for the next save to overwrite: there is none
            shutil.rmtree(reuse_dir(self.root), ignore_errors=True)
        for b in self._buffers:
            b.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- reading

    def latest(self) -> int | None:
        """The newest complete step under ``root`` (or ``persistent`` if root has none)."""
        return latest_step(self.root, self.persistent)

    def path_of(self, step: int) -> str:
        return complete_step_dir(self.root, self.persistent, step)

    def restore(self, step: int | None = None, *, flat: bool = False) -> Any:
        """The state saved as ``step`` (default: the latest), tensors as numpy arrays.

        Returns the tree given to ``save`` (nested dicts, lists, tuples; NamedTuples as
        namedtuples of the same name and fields; an ``nn.Module`` or optimizer as its
        state dict). ``flat=True`` gives one dict of dotted names instead (``model.0.weight``),
        with the values of ``save(extra=...)`` and every rank's ``local`` state
        (``rank<r>.<name>``) too. Served from the host tier when it still holds that step.
        """
        step, values, tree = self._load(step)
        return values if flat or tree is None else build(tree, values.__getitem__)

    def restore_into(self, state: Any, step: int | None = None, *, strict: bool = True) -> RestoreResult:
        """Copy a saved step into live state, in place; returns a :class:`RestoreResult`.

        ``state`` has the structure given to ``save``: dicts and lists of tensors,
        numpy arrays and plain values, where an ``nn.Module`` or optimizer may stand for
        its state dict (``{"model": model, "optim": opt}``); a fresh optimizer with no
        state yet gets its state created, then filled. Tensors are filled in place
        (cast to their dtype; DTensors take their own shard), plain values are written
        back into their dicts and lists. ``strict`` (the default): names in ``state``
        the step lacks (missing) or saved names ``state`` lacks (unexpected) raise
        :class:`~ckptbridge.TensorNotFoundError` listing them, before anything is
        copied; ``strict=False`` restores the names both have and returns the rest::

            missing, unexpected = ck.restore_into({"model": model}, strict=False)
        """
        step, values, tree = self._load(step)
        names = list(leaf_names(tree)) if tree is not None else list(values)
        return restore_into(state, values, names, step=step, strict=strict,
                            where=f"{self.root} step {step}")

    def _load(self, step: int | None) -> tuple[int, dict[str, Any], Any]:
        """(step, flat name -> array or value, the saved tree's skeleton if recorded)."""
        step = self.latest() if step is None else step
        if step is None:
            raise MissingShardError(f"{self.root}: no complete checkpoint to restore")
        held = self._host_tier(step)
        if held is not None:
            return step, held[0], held[1]
        return (step, *load_step(self.path_of(step)))

    def _host_tier(self, step: int) -> tuple[dict[str, Any], Any] | None:
        if not self.host_tier or self.world_size != 1:
            return None
        for b in self._buffers:
            if b.step == step and not b.busy.is_set():
                return b.held(), b.tree
        return None

    # ---------------------------------------------------------------- internals

    def _guard_optimizer(self, optimizer: Any) -> set[int]:
        provider = provider_for(optimizer)
        if provider is None or provider.guard_keys is None:
            names = ", ".join(p.name for p in providers()) or "none installed"
            raise CheckpointError(f"optimizer=: no runtime knows a {type(optimizer).__module__}."
                                  f"{type(optimizer).__qualname__} (runtimes: {names})")
        if not any(getattr(h, "_ckptbridge_opt", None) is optimizer for h in self._hooks):
            handle = optimizer.register_step_pre_hook(self._before_optimizer_step)
            handle._ckptbridge_opt = optimizer
            self._hooks.append(handle)
        return provider.guard_keys(optimizer)

    def _pieces(self, leaves: list[Leaf], arrays: Mapping[str, np.ndarray] | None = None) -> list[Piece]:
        """The pieces this rank writes (replicated plain tensors only on rank 0)."""
        return [Piece(leaf.name, "param", leaf.dtype, leaf.global_shape, leaf.box,
                      arrays[leaf.buffer_key] if arrays is not None else np.empty(0))
                for leaf in leaves if leaf.write and (self.rank == 0 or not leaf.per_process)]

    def _plan(self, leaves: list[Leaf]) -> list[tuple[str, list[Piece], FileSpec]]:
        return plan_rank(self.root, self._pieces(leaves), self.rank)

    def _acquire_buffers(self, step: int) -> BufferSet | None:
        """A free host buffer set for a new save, as the policy says (None: the save is skipped)."""
        t0 = time.perf_counter()
        with self._lock:
            while True:
                idle = [b for b in self._buffers if not b.busy.is_set()]
                free = next((b for b in idle if b.ready.is_set()), idle[0] if idle else None)
                queued = [j for j in self._pending if not j.flushing and not j.superseded]
                action = admit(self.policy, free is not None, bool(queued))
                if action == "take" and free is not None:
                    free.busy.set()
                    free.step = None
                    break
                if action == "skip":
                    self.dropped.append(step)
                    log.info("step %d skipped: every host buffer set is still being flushed", step)
                    return None
                if action == "replace":  # under the lock, so neither thread starts it now
                    victim = queued[-1]
                    victim.superseded = True
                    copying = victim.copying
                    break
                self._blocked += 1  # wait for a flush to free a set
                try:
                    self._freed.wait(timeout=1.0)
                finally:
                    self._blocked -= 1
        if action == "replace":
            if copying:  # let its copies into the buffers end (else the snapshot thread skips it)
                victim.snapshot_done.wait()
            with self._lock:
                self._pending.remove(victim)
                self.dropped.append(victim.step)
            victim.flushed.set()
            log.info("step %d replaced by step %d before its flush started", victim.step, step)
            free = victim.buffers
            free.step = None
        assert free is not None  # "take" and "replace" both hold a set here
        free.ready.wait()  # a background pre-fault of this set is ending
        waited = time.perf_counter() - t0
        if waited > 0.001:
            log.info("save waited %.3fs for a buffer set (flushes are slower than saves)", waited)
        return free

    def _free(self, buffers: BufferSet) -> None:
        with self._lock:
            buffers.busy.clear()
            self._freed.notify_all()

    def _fit_sets(self, set_bytes: int) -> None:
        fit_sets(self._buffers, self._lock, set_bytes, self.policy.host_buffers)

    def _pending_snapshot_keys(self) -> set[Any]:
        """Identities of the lazily captured values whose copy to host is not done."""
        with self._lock:
            return {leaf.key for job in self._pending if not job.snapshot_done.is_set()
                    for leaf in job.pending_lazy}

    def _snapshot_loop(self) -> None:
        while True:
            job = self._snapshots.get()
            if job is None:
                self._flushes.put(None)
                return
            t0 = time.perf_counter()
            with self._lock:
                job.copying = not job.superseded
            try:
                if job.copying:
                    copy_all(job.pending_lazy, job.buffers, self._copiers, self.policy.snapshot_threads)
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
            with self._lock:
                if job.superseded:  # a newer save took its buffers (and finished it)
                    continue
                job.flushing = True
                backlog = self._blocked > 0 or any(j is not job and not j.superseded for j in self._pending)
            try:
                if job.error is not None:
                    raise job.error
                self._flush(job, background=flush_in_background(self.policy, backlog))
            except BaseException as err:
                log.error("checkpoint of step %s failed: %s", job.step, err)
                with self._lock:
                    self._errors.append(err)
                if not job.released:
                    self._free(job.buffers)
                job.flushed.set()
                with self._lock:
                    self._pending.remove(job)

    def _flush(self, job: Job, background: bool = True) -> None:
        t0 = time.perf_counter()
        dst = step_dir(self.root, job.step)
        pieces = self._pieces(job.leaves, job.buffers.arrays)
        nbytes = sum(p.box.size * _dtypes.itemsize(p.dtype) for p in pieces)
        stage = staging_path(dst, self.token)
        os.makedirs(stage, exist_ok=True)
        record_owner(stage, self.rank)
        reuse = reuse_paths(reuse_dir(self.root), list(job.buffers.images)) if self.policy.reuse_files else None
        write_rank(dst, pieces, self.rank, token=self.token, images=job.buffers.images, background=background,
                   reuse=reuse)
        committed = False
        if self.rank == 0:
            await_ranks(stage, self.world_size, lambda: self._failed, self.commit_timeout)
            try:
                commit_universal(dst, self.world_size, step=job.step, extra={"values": job.extra, "tree": job.tree},
                       provenance={"writer": "ckptbridge.Checkpointer", "world_size": self.world_size},
                       token=self.token)
                committed = True
            except FileExistsError:  # another job committed this step first: theirs stays
                log.warning("step %d was committed by another writer; discarding ours", job.step)
                shutil.rmtree(stage, ignore_errors=True)
        flush_s = time.perf_counter() - t0
        job.buffers.step, job.buffers.leaves, job.buffers.extra = job.step, job.leaves, job.extra
        job.buffers.tree = job.tree
        job.released = True
        self._free(job.buffers)
        persist_s = None
        if committed:
            if self.persistent:
                t1 = time.perf_counter()
                persist(dst, self.persistent)
                persist_s = time.perf_counter() - t1
            retired = retire_newest_dropped(self.root, self.keep_last, self.keep_every) if self.policy.reuse_files else []
            self._chores.submit(retain, self.root, retired, self.keep_last, self.keep_every, self.commit_timeout)  # deleting old steps must not hold up the next flush
        stats = SaveStats(job.step, nbytes, job.stall, job.snapshot_seconds, flush_s, persist_s, committed)
        self.stats.append(stats)
        log.info("step %d: %.1f MB, stall %.4fs, snapshot %.3fs, flush %.3fs (%.2f GB/s)%s",
                 job.step, nbytes / 1e6, stats.stall_seconds, stats.snapshot_seconds, flush_s,
                 stats.flush_gbps, f", persist {persist_s:.3f}s" if persist_s is not None else "")
        job.flushed.set()
        with self._lock:
            self._pending.remove(job)

    def _raise_background_error(self) -> None:
        with self._lock:
            if self._errors:
                err = self._errors.pop(0)
                raise CheckpointError(f"a background checkpoint failed: {err}") from err


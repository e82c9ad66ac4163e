"""Find the faulty rank, keep the last complete checkpoint, and exit so the launcher restarts.

Collective training is periodic and homogeneous: every rank steps at the same
pace and waits for the others in the same collectives. A rank that breaks the
pattern (dies, stops, hangs, or computes much longer than the others) points
at the faulty component. The :class:`Watchdog` watches the pattern through the
job's own store (torchrun's / ``init_process_group``'s TCPStore, or the
``jax.distributed`` key-value store) from one background thread per rank::

    ck = ckptbridge.Checkpointer("ckpts")
    with ckptbridge.Watchdog(ck) as wd:          # after init_process_group / jax.distributed
        for step in range(start, steps):
            train_step(step)
            ck.save(step, state, optimizer=opt)
            wd.step(step)                         # no I/O, no lock: a few microseconds

Each rank publishes a heartbeat several times per step period, with its
recent step time and how much of it was spent outside collectives (sampled
from the main thread's stack: time inside ``torch.distributed`` is waiting on
peers; ``with wd.waiting():`` marks other waits). Every rank judges the others:

- a rank silent for ``hang_periods`` step periods (its process killed, stopped
  or unable to run) is named, within ``3 * max(P, min_period)`` of the fault
  (``P``: the job's median step time; same-host processes seen gone: at once);
- a rank that beats but whose main thread stays outside collectives while every
  other rank waits in one, for ``hung_periods``, is ``hung``;
- a rank computing ``straggler_factor`` times the others' median, consistently,
  is flagged as a straggler (logged, ``on_straggler`` called; not fatal).

The first rank to judge a fault claims the verdict in the store and logs one
line naming the rank, its host and pid. Then every healthy rank makes sure the
last complete checkpoint is committed (never a partial one: saves that needed
the faulty rank's pieces are abandoned, see :meth:`Checkpointer.abandon`),
isolates the faulty rank if it runs on this host (kills it and, under
torchrun, its elastic agent, so that the agent does not bring it back into the
next rendezvous; the lowest healthy rank does it), and exits with
:data:`EXIT_RESTART` (75). A rank that is
itself named exits with :data:`EXIT_FAULTY` (69); success is 0. Under
``torchrun --nnodes=MIN:MAX --max-restarts K`` the agents then restart the
group on the remaining nodes, and training resumes from
``Checkpointer.latest()`` at the new world size.

A rank whose training raises inside ``with Watchdog(...)`` first waits (up to
the detection bound) for a verdict on a peer (a collective that failed because
a peer died); if none comes, it names itself (``failed``). When torchrun's agent
stops the workers (SIGTERM) the watchdog judges at once and drains the
checkpointer before exiting.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import OptionError, WatchdogError
from .._ranks import rank_world
from . import _procs
from ._leaving import SigtermPipe, drain, exit_now, isolate, leave, record, whoami
from ._verdicts import (
    EXIT_FAULTY,
    EXIT_RESTART,
    Beat,
    Peer,
    PeerSeen,
    StragglerTracker,
    Verdict,
    WatchdogPolicy,
    assess,
    busy_per_step,
    hung,
    job_period,
    observe,
    stragglers,
)

log = logging.getLogger("ckptbridge.watchdog")

__all__ = ["EXIT_FAULTY", "EXIT_RESTART", "Verdict", "Watchdog", "WatchdogPolicy"]

_WAIT_FRAMES = (f"torch{os.sep}distributed{os.sep}", "torch/distributed/")


def _encode_all(verdicts: list[Verdict]) -> str:
    return json.dumps([json.loads(v.encode()) for v in verdicts])


def _decode_all(text: str) -> list[Verdict]:
    return [Verdict(**d) for d in json.loads(text)] if text else []


class Watchdog:
    """The fault detector of one rank (see the module documentation).

    ``checkpointer``: the job's :class:`ckptbridge.Checkpointer`, drained on a fault
    and where verdicts are recorded (``<root>/faults.jsonl``). ``store``: the job's
    store (default: found from torch.distributed or jax.distributed). ``rank`` /
    ``world_size``: default from the running job (``ckptbridge._ranks``: torch.distributed,
    jax.distributed, then the launcher's variables). ``policy``: thresholds
    (:class:`WatchdogPolicy`). ``isolate``: stop a faulty rank's process and its torchrun agent
    when they run on this host. ``exit_on_fault``: exit (75 / 69) once a fault is
    judged; if False the verdicts are only recorded (``wd.verdicts``) and
    ``on_fault`` is called. ``wait_frames``: path fragments of code in which the
    main thread counts as waiting on peers.
    """

    def __init__(
        self,
        checkpointer: Any = None,
        *,
        store: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        policy: WatchdogPolicy | None = None,
        isolate: bool = True,
        exit_on_fault: bool = True,
        on_fault: Callable[[list[Verdict]], None] | None = None,
        on_straggler: Callable[[Verdict], None] | None = None,
        job: str | None = None,
        startup_timeout: float = 120.0,
        drain_timeout: float = 60.0,
        wait_frames: tuple[str, ...] = _WAIT_FRAMES,
    ) -> None:
        self.checkpointer = checkpointer
        self.policy = policy or WatchdogPolicy()
        self.isolate, self.exit_on_fault = isolate, exit_on_fault
        self.on_fault, self.on_straggler = on_fault, on_straggler
        self.startup_timeout, self.drain_timeout = startup_timeout, drain_timeout
        self.wait_frames = wait_frames
        self._store_arg, self._job = store, job
        self._rank, self._world = rank, world_size
        self.verdicts: list[Verdict] = []  # the fatal verdict this job acted on (empty while healthy)
        self.stragglers: list[Verdict] = []  # stragglers flagged so far
        self.peers: dict[int, Peer] = {}
        self._kv: Any = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._resolving = threading.Lock()
        self._resolved = threading.Event()
        # main thread bookkeeping (written by step(), read by the watchdog thread)
        self._step = -1
        self._last_t: float | None = None
        self._hist: deque[tuple[float, int, int]] = deque(maxlen=32)
        self._n0 = self._w0 = 0
        # sampler counters (written by the watchdog thread)
        self._samples = self._waits = 0
        self._marked = 0
        self._code_waits: dict[Any, bool] = {}  # code object -> inside a wait_frames file
        self._waiting = False  # main thread's state at the last sample, and since when (monotonic)
        self._state_since = time.monotonic()
        self._main: int = threading.main_thread().ident or 0
        # observer state (watchdog thread only)
        self._seq = 0
        self._my_beats = 0
        self._seen: dict[int, PeerSeen] = {}
        self._tracker = StragglerTracker()
        self._flagged: set[int] = set()
        self._store_ok = time.monotonic()
        self._store_lost = False  # judged unreachable: nothing more is said through it
        self._cpu_at_exit = 0.0
        self._sigterm = SigtermPipe()

    # ---------------------------------------------------------------- public

    @property
    def rank(self) -> int:
        return int(self._rank if self._rank is not None else 0)

    @property
    def world_size(self) -> int:
        return int(self._world if self._world is not None else 1)

    @property
    def period(self) -> float:
        """The effective step period ``P`` the bounds use (seconds)."""
        return self.policy.period(job_period({r: s.beat for r, s in self._seen.items()}))

    @property
    def bound(self) -> float:
        """The detection bound for a silent rank right now (seconds): ``bound_periods * P``."""
        return self.policy.bound(self.period)

    @property
    def cpu_seconds(self) -> float:
        """CPU time the watchdog thread has used so far (Linux; 0.0 where unknown)."""
        t = self._thread
        if t is None or t.ident is None or not t.is_alive() or not hasattr(time, "pthread_getcpuclockid"):
            return self._cpu_at_exit
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, ValueError):
            return self._cpu_at_exit

    def start(self) -> Watchdog:
        """Register this rank in the store, wait for every rank to register, start watching."""
        if self._thread is not None:
            return self
        try:
            self._rank, self._world = rank_world(self._rank, self._world, default=None)
        except OptionError as err:
            raise WatchdogError(f"Watchdog: {err}") from None
        from ._jobstore import retry, store_for

        # a call slower than a beat interval counts as failed (the store is then judged after
        # hang_periods of failures); a healthy store answers in well under a millisecond
        self._kv = store_for(self.rank, self.world_size, self._store_arg, self._job,
                             timeout=max(0.05, self.policy.interval))
        me = whoami(self.rank)
        kv = self._kv
        retry(lambda: kv.set(f"peer/{self.rank}", me.encode()), self.startup_timeout)
        retry(lambda: kv.set(f"beat/{self.rank}", Beat(0, -1).encode()), self.startup_timeout)
        retry(kv.init_verdict, self.startup_timeout)
        missing = kv.wait([f"peer/{r}" for r in range(self.world_size)], self.startup_timeout)
        for r in range(self.world_size):
            if f"peer/{r}" not in missing:
                self.peers[r] = Peer.decode(retry(functools.partial(kv.get, f"peer/{r}"), self.startup_timeout) or "{}")
        self._sigterm.install()
        self._store_ok = time.monotonic()
        now = time.monotonic()
        self._seen = {r: PeerSeen(Beat(0, -1), now, 0) for r in range(self.world_size)}
        self._thread = threading.Thread(target=self._run, name="ckptbridge-watchdog", daemon=True)
        self._thread.start()
        if missing:
            ranks = sorted(int(k.split("/")[1]) for k in missing)
            self._judged([Verdict("unresponsive", r, "?", -1, -1, self.startup_timeout, self.period,
                                  "never registered with the job's store", self.rank, time.time())
                          for r in ranks])
        return self

    def step(self, step: int | None = None) -> None:
        """Mark the end of a training step (cheap: no I/O, no lock)."""
        now = time.perf_counter()
        n, w = self._samples, self._waits
        if self._last_t is not None:
            self._hist.append((now - self._last_t, n - self._n0, w - self._w0))
        self._last_t, self._n0, self._w0 = now, n, w
        self._step = self._step + 1 if step is None else int(step)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark the main thread as waiting on peers (for waits outside ``torch.distributed``)."""
        self._marked += 1
        try:
            yield
        finally:
            self._marked -= 1

    def fail(self, reason: str) -> None:
        """Name this rank faulty (its own error) and exit with :data:`EXIT_FAULTY`, after its
        pending checkpoint pieces are written; if a verdict on a peer came first, this rank
        is healthy and exits with :data:`EXIT_RESTART` instead. Does not return (with
        ``exit_on_fault=False`` it returns once the verdict is recorded)."""
        self._self_report(reason)
        if not self.exit_on_fault:
            return
        self._resolved.wait(self.drain_timeout + 60.0)
        exit_now(EXIT_FAULTY)

    def stop(self) -> None:
        """Stop watching (the end of training). Call on every rank."""
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._sigterm.restore()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or not isinstance(exc, Exception) or self._thread is None or not self.exit_on_fault:
            self.stop()
            return
        # a collective may have failed because a peer died: give the detector its bound first
        if not self._await_verdict():
            self._self_report(f"{type(exc).__name__}: {exc}")
            self._await_verdict()
        if self.verdicts:
            self._resolved.wait(self.drain_timeout + 60.0)
        self.stop()  # no verdict at all: the error is raised as it is

    def _await_verdict(self) -> bool:
        deadline = time.monotonic() + self.bound + 4 * self.policy.interval
        while time.monotonic() < deadline and not self.verdicts:
            time.sleep(self.policy.interval / 2)
        return bool(self.verdicts)

    def _self_report(self, reason: str) -> None:
        """Claim a verdict naming this rank (``failed``). If the store cannot be reached the
        claim is dropped: the detector judges the store itself within the bound."""
        self._judged([Verdict("failed", self.rank, socket.gethostname(), os.getpid(), self._step, 0.0,
                              self.period, reason, self.rank, time.time())], own=True)

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._cpu_at_exit = time.thread_time()

    def _loop(self) -> None:
        # one wakeup per beat interval (jittered) samples the main thread and, when due, beats:
        # on virtual machines every wakeup costs tens of microseconds of CPU
        interval = self.policy.interval
        next_beat = time.monotonic()
        while not self._halt.is_set():
            self._sample()
            now = time.monotonic()
            if now >= next_beat - interval / 2:
                next_beat = now + interval
                try:
                    self._beat(now)
                except Exception as err:  # never let the detector kill the rank
                    log.exception("watchdog on rank %d: %s", self.rank, err)
            wait = interval * random.uniform(0.5, 1.5)  # jitter: no aliasing with the step period
            if self._sigterm.wait(wait):
                self._terminated()

    def _sample(self) -> None:
        waiting = self._marked > 0
        if not waiting:
            frame = sys._current_frames().get(self._main) if hasattr(sys, "_current_frames") else None
            depth, known = 0, self._code_waits
            while frame is not None and depth < 48:
                code = frame.f_code
                hit = known.get(code)
                if hit is None:
                    hit = known[code] = any(m in code.co_filename for m in self.wait_frames)
                if hit:
                    waiting = True
                    break
                frame, depth = frame.f_back, depth + 1
        self._samples += 1
        self._waits += waiting
        if waiting != self._waiting:
            self._waiting, self._state_since = waiting, time.monotonic()

    def _beat(self, now: float) -> None:
        hist = tuple(self._hist)
        durations = [d for d, _, _ in hist]
        period = None
        if len(durations) >= self.policy.history:
            period = sorted(durations)[len(durations) // 2]
        busy = busy_per_step(durations, [(n, w) for _, n, w in hist]) if period is not None else None
        self._seq += 1
        try:
            held = now - self._state_since
            state = held if self._waiting else -held
            beat = (f"beat/{self.rank}", Beat(self._seq, self._step, period, busy, state).encode())
            raw, verdict = self._kv.snapshot(self.world_size, beat)
        except Exception as err:
            self._store_failed(now, err)
            return
        self._store_ok = now
        self._my_beats += 1
        if verdict:
            self._judged(_decode_all(verdict), claimed=True)
            return
        beats = {r: b for r, b in ((r, Beat.decode(v)) for r, v in raw.items()) if b is not None}
        self._seen = observe(self._seen, beats, now, self._my_beats)
        procs = self._procs(now)
        found = assess(self._seen, self.peers, now=now, wall=time.time(), my_beats=self._my_beats,
                       me=self.rank, policy=self.policy, procs=procs)
        found = found or hung(self._seen, self.peers, wall=time.time(), me=self.rank, policy=self.policy)
        if found:
            self._judged(found)
            return
        self._check_stragglers(beats)

    def _procs(self, now: float) -> dict[int, str]:
        """States of same-host peers that have been silent for two beat intervals."""
        host = socket.gethostname()
        out = {}
        for r, s in self._seen.items():
            peer = self.peers.get(r)
            if r == self.rank or peer is None or peer.host != host:
                continue
            if now - s.since >= 2 * self.policy.interval:
                state = _procs.state(peer.pid, peer.start)
                if state is not None:
                    out[r] = state
        return out

    def _check_stragglers(self, beats: dict[int, Beat]) -> None:
        flagged = stragglers(beats, self.policy)
        self._tracker, crossed = self._tracker.update(flagged, self.policy)
        self._flagged &= set(flagged)
        for r in crossed:
            if r in self._flagged:
                continue
            self._flagged.add(r)
            peer = self.peers.get(r, Peer(r, "?", -1))
            v = Verdict("straggler", r, peer.host, peer.pid, beats[r].step, 0.0, self.period, flagged[r],
                        self.rank, time.time())
            self.stragglers.append(v)
            n = sum(1 for s in self.stragglers if s.rank == r)
            if self._kv.claim(f"straggler/{r}/{n}", v.encode()) == v.encode():
                log.warning("ckptbridge.watchdog: %s", v.line())
            if self.on_straggler is not None:
                self.on_straggler(v)

    def _store_failed(self, now: float, err: Exception) -> None:
        """The store does not answer. If its server runs in a rank (rank 0 of a plain
        ``init_process_group`` or of torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
        process 0 of jax.distributed), that rank is the faulty one; no verdict can be
        claimed, so the lowest healthy rank speaks and isolates."""
        host_rank = getattr(self._kv, "host_rank", None)
        silent = now - self._store_ok
        if host_rank in self._seen and host_rank != self.rank:  # its beats stopped even earlier
            silent = max(silent, now - self._seen[host_rank].since)
        peer = self.peers.get(host_rank, Peer(-1, "?", -1)) if host_rank is not None else Peer(-1, "?", -1)
        state = _procs.state(peer.pid, peer.start) if peer.host == socket.gethostname() else None
        gone = state == "gone" and silent >= 2 * self.policy.interval
        if silent < self.policy.hang_periods * self.period and not gone:
            return
        self._store_lost = True
        if host_rank == self.rank:
            return  # the server runs in this very process: slow for everyone, not dead
        if host_rank is None:
            self._judged([Verdict("unreachable", -1, "?", -1, self._step, silent, self.period,
                                  f"the job's store does not answer ({type(err).__name__}: {err})",
                                  self.rank, time.time())], claimed=True)
            return
        kind = {"gone": "dead", "stopped": "stopped"}.get(state or "", "unreachable")
        speaker = min(r for r in range(self.world_size) if r != host_rank)
        step = self._seen[host_rank].beat.step if host_rank in self._seen else -1
        self._judged([Verdict(kind, host_rank, peer.host, peer.pid, step, silent, self.period,
                              f"it serves the job's store, which does not answer ({type(err).__name__})",
                              speaker, time.time())], claimed=True)

    def _terminated(self) -> None:
        """The launcher stops this worker (torchrun restarts the group after a failure):
        name the faulty rank if there is one (same-host processes at once, others within
        the bound), drain the checkpointer, exit."""
        deadline = time.monotonic() + self.bound
        while time.monotonic() < deadline and not self._resolved.is_set():
            self._beat(time.monotonic())
            time.sleep(self.policy.interval)
        if self._resolved.is_set():
            return
        log.warning("ckptbridge.watchdog: rank %d terminated by its launcher; no faulty rank found; "
                    "draining checkpoints", self.rank)
        drain(self.checkpointer, set(), self.rank, self.drain_timeout)
        exit_now(EXIT_RESTART)

    # ---------------------------------------------------------------- acting on a verdict

    def _judged(self, verdicts: list[Verdict], claimed: bool = False, own: bool = False) -> None:
        fatal = [v for v in verdicts if v.fatal]
        if not fatal or not self._resolving.acquire(blocking=False):
            return
        winner = False
        if not claimed and self._kv is not None:
            try:
                text = self._kv.claim("verdict", _encode_all(fatal))
                winner = text == _encode_all(fatal)
                fatal = _decode_all(text) or fatal
            except Exception:
                if own:  # no store to tell the others: the detector will judge the store itself
                    self._resolving.release()
                    return
                winner = True  # store gone: act on our own judgement
        elif claimed:
            winner = all(v.by == self.rank for v in fatal)
        self.verdicts = fatal
        faulty = {v.rank for v in fatal if v.rank >= 0}
        if winner:
            for v in fatal:
                log.error("ckptbridge.watchdog: %s", v.line())
            record(getattr(self.checkpointer, "root", None), fatal, self.world_size)
        else:
            log.info("ckptbridge.watchdog: rank %d acts on the verdict of rank %d: faulty %s",
                     self.rank, fatal[0].by, sorted(faulty))
        if self.on_fault is not None:
            with contextlib.suppress(Exception):
                self.on_fault(fatal)
        if not self.exit_on_fault:
            self._resolved.set()
            return
        if self.rank in faulty:
            drain(self.checkpointer, set(), self.rank, min(self.drain_timeout, 10.0))
            self._resolved.set()
            exit_now(EXIT_FAULTY)
        t0 = time.monotonic()
        drain(self.checkpointer, faulty, self.rank, self.drain_timeout)
        t1 = time.monotonic()
        log.debug("ckptbridge.watchdog: rank %d drained (%.2fs)", self.rank, t1 - t0)
        if self.isolate:  # the lowest healthy rank isolates (a self-reported rank cannot)
            isolate(self._kv, self.peers, fatal, self.rank, self._store_lost,
                    isolator=self.rank == min(r for r in range(self.world_size) if r not in faulty))
        t2 = time.monotonic()
        leave(None if self._store_lost else self._kv, self.rank, self.world_size, faulty)
        log.info("ckptbridge.watchdog: rank %d exits for a restart (drain %.2fs, isolation %.2fs, leave %.2fs)",
                 self.rank, t1 - t0, t2 - t1, time.monotonic() - t2)
        self._resolved.set()
        exit_now(EXIT_RESTART)



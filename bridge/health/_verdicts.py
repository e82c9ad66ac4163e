"""The fault detector's pure part: what each rank publishes, the policy, and the judgement.

Every rank publishes a :class:`Beat` through the job's store several times per
step period. An observer keeps, per peer, when it last saw that peer's beat
change (:class:`PeerSeen`) and how many beats of its own it has made since;
:func:`assess` turns that, with what the observer knows about same-host
processes, into :class:`Verdict` s. Nothing here does I/O or reads a clock::

    policy = WatchdogPolicy()
    p = policy.period(job_period)                   # max(median step time, min_period)
    verdicts = assess(seen, beats, peers, now=t, my_beats=n, me=0, policy=policy, procs={})

The bound: a rank that stops beating (killed, stopped, its process hung) is
named once it has been silent for ``hang_periods`` effective periods while the
observer kept beating, so within ``hang_periods * P + 2 * interval`` of the
fault, below ``bound_periods * P`` (3 P by default), where ``P`` is the job's
median step time, floored at ``min_period``. A rank whose process is seen to
be gone (same host) is named after two beat intervals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass


def _median(values: Iterable[float]) -> float:
    """``statistics.median``, imported when first needed (it pulls in ``fractions``: ~10 ms at
    the import of every adapter, through ``ckptbridge.plugin``)."""
    import statistics

    return statistics.median(values)


EXIT_RESTART = 75  # EX_TEMPFAIL: a peer failed; this rank is healthy, restart it
EXIT_FAULTY = 69  # EX_UNAVAILABLE: this rank was named faulty; do not bring it back

FATAL_KINDS = ("dead", "stopped", "unresponsive", "hung", "failed", "unreachable")


@dataclass(frozen=True)
class Beat:
    """What a rank publishes each beat. ``seq`` counts beats (liveness); ``step`` is the
    last finished step; ``period``/``busy`` are its median seconds per step and its
    seconds per step spent outside collectives (None until known)."""

    seq: int
    step: int
    period: float | None = None
    busy: float | None = None
    state: float = 0.0  # seconds the main thread has been waiting in a collective (> 0) or outside one (< 0)

    def encode(self) -> str:
        return f"{self.seq} {self.step} {_num(self.period)} {_num(self.busy)} {self.state:.3f}"

    @staticmethod
    def decode(text: str | bytes) -> Beat | None:
        """``None`` for an empty or malformed value (a peer that has not beaten yet)."""
        if isinstance(text, bytes):
            text = text.decode("ascii", "replace")
        parts = text.split()
        if len(parts) != 5:
            return None
        try:
            return Beat(int(parts[0]), int(parts[1]), _opt(parts[2]), _opt(parts[3]), float(parts[4]))
        except ValueError:
            return None


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"


def _opt(s: str) -> float | None:
    return None if s == "-" else float(s)


@dataclass(frozen=True)
class Peer:
    """Where a rank runs: host, pid, process start time (guards against pid reuse) and,
    under torchrun, the pid and start time of its elastic agent (what isolation stops)."""

    rank: int
    host: str
    pid: int
    start: int | None = None
    agent_pid: int | None = None
    agent_start: int | None = None

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def decode(text: str | bytes) -> Peer:
        return Peer(**json.loads(text))


@dataclass(frozen=True)
class Verdict:
    """One finding. ``kind``: ``dead`` (process gone), ``stopped`` (SIGSTOP), ``unresponsive``
    (silent; dead or hung where the process cannot be seen), ``hung`` (it beats, but its main
    thread has been stuck outside collectives while every other rank waits in one),
    ``failed`` (it reported its own error), ``unreachable`` (the store's own host is silent)
    or ``straggler`` (not fatal).
    ``silent``: seconds without a beat when judged; ``period``: the effective step period."""

    kind: str  # see FATAL_KINDS; "straggler" is not fatal
    rank: int
    host: str
    pid: int
    step: int
    silent: float
    period: float
    detail: str
    by: int
    time: float

    @property
    def fatal(self) -> bool:
        return self.kind in FATAL_KINDS

    def line(self) -> str:
        """The one log line naming the rank."""
        if self.kind == "straggler":
            return (f"rank {self.rank} on host {self.host} (pid {self.pid}) is a straggler: {self.detail} "
                    f"(at step {self.step}, judged by rank {self.by})")
        periods = self.silent / self.period if self.period > 0 else float("inf")
        return (f"rank {self.rank} on host {self.host} (pid {self.pid}) is {self.kind}: {self.detail}; "
                f"silent {self.silent:.2f}s = {periods:.1f} periods of {self.period:.3f}s after step "
                f"{self.step} (judged by rank {self.by}); the healthy ranks commit the last complete "
                f"checkpoint and exit for a restart")

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def decode(text: str | bytes) -> Verdict:
        return Verdict(**json.loads(text))


@dataclass(frozen=True)
class WatchdogPolicy:
    """Thresholds. ``min_period`` floors the step period used for timing (beats every
    ``min_period / beats_per_period`` seconds); ``startup_period`` stands in for it until
    the job has ``history`` steps. It is long (5 s: a silent rank is named after 10 s) because a
    starting rank imports and compiles, and a C extension's import or init can hold the GIL for
    seconds, silencing its beat thread without any fault; a same-host rank whose process is gone
    or stopped is still named after two beat intervals. A straggler spends ``straggler_factor`` times the other
    ranks' median compute time per step (and at least ``straggler_floor`` of a period more)
    for ``straggler_beats`` consecutive beats. A rank that still beats but whose main thread
    has been outside collectives for ``hung_periods`` periods while all the others have been
    waiting in one at least half that long is ``hung`` (set it above the longest stretch one
    rank legitimately works alone, e.g. an evaluation on rank 0)."""

    min_period: float = 0.25
    startup_period: float = 5.0
    beats_per_period: int = 5
    hang_periods: float = 2.0
    hung_periods: float = 20.0
    bound_periods: float = 3.0
    history: int = 3
    straggler_factor: float = 2.0
    straggler_floor: float = 0.05
    straggler_beats: int = 40

    def period(self, job_period: float | None) -> float:
        """The effective period ``P``: the job's median step time, floored at ``min_period``."""
        return max(self.startup_period if job_period is None else job_period, self.min_period)

    @property
    def interval(self) -> float:
        """Seconds between beats."""
        return self.min_period / self.beats_per_period

    def bound(self, period: float) -> float:
        """The stated detection bound for a silent rank, in seconds."""
        return self.bound_periods * period


@dataclass(frozen=True)
class PeerSeen:
    """What an observer knows of one peer: the last beat it saw, when it first saw it
    (observer's monotonic clock) and how many beats the observer had made by then."""

    beat: Beat
    since: float
    my_beats: int


def observe(prev: Mapping[int, PeerSeen], beats: Mapping[int, Beat], now: float,
            my_beats: int) -> dict[int, PeerSeen]:
    """Update the observer's view with freshly read beats (a peer's clock restarts
    only when its ``seq`` changes)."""
    out = dict(prev)
    for rank, beat in beats.items():
        old = prev.get(rank)
        if old is None or old.beat.seq != beat.seq:
            out[rank] = PeerSeen(beat, now, my_beats)
        elif old.beat != beat:
            out[rank] = PeerSeen(beat, old.since, old.my_beats)
    return out


def job_period(beats: Mapping[int, Beat]) -> float | None:
    """The median of the ranks' own median step times (None before any is known)."""
    periods = [b.period for b in beats.values() if b.period is not None]
    return _median(periods) if periods else None


def assess(seen: Mapping[int, PeerSeen], peers: Mapping[int, Peer], *, now: float, wall: float,
           my_beats: int, me: int, policy: WatchdogPolicy, procs: Mapping[int, str]) -> list[Verdict]:
    """Fatal verdicts on silent peers.

    ``procs``: what the observer sees of same-host peers' processes (``"gone"``,
    ``"stopped"``, ``"running"``). A peer is named when it has been silent for
    ``hang_periods`` effective periods while the observer made at least half the beats
    it should have in that time (so an observer that was itself starved, or a store
    that stalled everyone, names nobody); a same-host peer whose process is gone is
    named after two beat intervals.
    """
    period = policy.period(job_period({r: s.beat for r, s in seen.items()}))
    hang = policy.hang_periods * period
    out = []
    for rank, s in sorted(seen.items()):
        if rank == me:
            continue
        silent = now - s.since
        mine = my_beats - s.my_beats
        state = procs.get(rank)
        gone = state == "gone" and silent >= 2 * policy.interval and mine >= 2
        if not gone and not (silent >= hang and mine >= 0.5 * hang / policy.interval):
            continue
        kind = {"gone": "dead", "stopped": "stopped"}.get(state or "", "unresponsive")
        detail = {"dead": "its process is gone", "stopped": "its process is stopped (SIGSTOP)"}.get(
            kind, "no heartbeat (dead, stopped or hung; its process is not visible from here)"
            if state is None else "no heartbeat although its process runs (hung)")
        peer = peers.get(rank, Peer(rank, "?", -1))
        out.append(Verdict(kind, rank, peer.host, peer.pid, s.beat.step, silent, period, detail, me, wall))
    return out


def hung(seen: Mapping[int, PeerSeen], peers: Mapping[int, Peer], *, wall: float, me: int,
         policy: WatchdogPolicy) -> list[Verdict]:
    """Ranks that beat but whose main thread is stuck outside collectives while every other rank
    waits in one (the pattern of a deadlocked or spinning rank), from the ranks' own reports."""
    if len(seen) < 2:
        return []
    period = policy.period(job_period({r: s.beat for r, s in seen.items()}))
    limit = policy.hung_periods * period
    out = []
    for rank, s in sorted(seen.items()):
        if rank == me or s.beat.state > -limit:
            continue
        if all(o.beat.state >= limit / 2 for r, o in seen.items() if r != rank):
            peer = peers.get(rank, Peer(rank, "?", -1))
            out.append(Verdict("hung", rank, peer.host, peer.pid, s.beat.step, -s.beat.state, period,
                               "its main thread has made no progress outside collectives while every "
                               "other rank waits for it", me, wall))
    return out


def stragglers(beats: Mapping[int, Beat], policy: WatchdogPolicy) -> dict[int, str]:
    """Ranks whose compute time per step is ``straggler_factor`` times the others' median
    (and at least ``straggler_floor`` of a period more), with a description. A pure
    snapshot test; :class:`StragglerTracker` requires it to hold for consecutive beats."""
    busy = {r: b.busy for r, b in beats.items() if b.busy is not None}
    if len(busy) < 2:
        return {}
    period = policy.period(job_period(beats))
    out = {}
    for rank, mine in busy.items():
        others = _median(v for r, v in busy.items() if r != rank)
        if mine >= policy.straggler_factor * others and mine - others >= policy.straggler_floor * period:
            ratio = mine / others if others > 0 else float("inf")
            out[rank] = (f"computes {mine * 1e3:.1f} ms per step outside collectives, {ratio:.1f}x the "
                         f"median of the others ({others * 1e3:.1f} ms; step period {period * 1e3:.1f} ms)")
    return out


@dataclass(frozen=True)
class StragglerTracker:
    """Consecutive-beat streaks of the straggler test, per rank (immutable; ``update``
    returns the next tracker and the ranks that just crossed ``straggler_beats``)."""

    streaks: tuple[tuple[int, int], ...] = ()

    def update(self, flagged: Mapping[int, str], policy: WatchdogPolicy) -> tuple[StragglerTracker, list[int]]:
        old = dict(self.streaks)
        new = {r: old.get(r, 0) + 1 for r in flagged}
        crossed = sorted(r for r, n in new.items() if n == policy.straggler_beats)
        return StragglerTracker(tuple(sorted(new.items()))), crossed


def busy_per_step(durations: Sequence[float], samples: Sequence[tuple[int, int]]) -> float | None:
    """Seconds per step spent outside collectives: the median step time times the
    fraction of main-thread samples that were not waiting in a collective."""
    total = sum(n for n, _ in samples)
    if not durations or total == 0:
        return None
    waiting = sum(w for _, w in samples)
    return _median(durations) * (1.0 - waiting / total)

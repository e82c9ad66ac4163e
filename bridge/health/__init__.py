"""The fault detector's rules as pure functions (public): replay beat histories, tune a
:class:`~ckptbridge.WatchdogPolicy` offline, or judge beats gathered by other means.
:class:`ckptbridge.Watchdog` applies exactly these rules to what it reads from the
job's store; nothing here does I/O or reads a clock::

    from ckptbridge.health import Beat, Peer, PeerSeen, assess, observe

    seen = observe({}, {0: Beat(1, 0), 1: Beat(1, 0)}, now=10.0, my_beats=3)
    ...                                           # later beats: observe(seen, beats, now, n)
    verdicts = assess(seen, {0: Peer(0, "h", 100), 1: Peer(1, "h", 101)}, now=t, wall=0.0,
                      my_beats=n, me=0, policy=ckptbridge.WatchdogPolicy(), procs={})
"""

from ._verdicts import (
    EXIT_FAULTY,
    EXIT_RESTART,
    FATAL_KINDS,
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

__all__ = [
    "EXIT_FAULTY",
    "EXIT_RESTART",
    "FATAL_KINDS",
    "Beat",
    "Peer",
    "PeerSeen",
    "StragglerTracker",
    "Verdict",
    "WatchdogPolicy",
    "assess",
    "busy_per_step",
    "hung",
    "job_period",
    "observe",
    "stragglers",
]

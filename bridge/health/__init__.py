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

from __future__ import annotations

from ._verdicts import EXIT_FAULTY as EXIT_FAULTY
from ._verdicts import EXIT_RESTART as EXIT_RESTART
from ._verdicts import FATAL_KINDS as FATAL_KINDS
from ._verdicts import Beat as Beat
from ._verdicts import Peer as Peer
from ._verdicts import PeerSeen as PeerSeen
from ._verdicts import StragglerTracker as StragglerTracker
from ._verdicts import Verdict as Verdict
from ._verdicts import WatchdogPolicy as WatchdogPolicy
from ._verdicts import assess as assess
from ._verdicts import busy_per_step as busy_per_step
from ._verdicts import hung as hung
from ._verdicts import job_period as job_period
from ._verdicts import observe as observe
from ._verdicts import stragglers as stragglers

__all__ = sorted(n for n in dict(globals()) if not n.startswith("_") and n != "annotations")

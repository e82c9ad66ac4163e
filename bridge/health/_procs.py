"""What one process can see and do to another process of the same host (Linux ``/proc``).

Used by the fault detector to tell a dead peer from a stopped one and to isolate a
faulty rank (stop its process and its launcher agent). Every action checks the
process's start time first, so a recycled pid is never signalled::

    start = start_time(pid)               # clock ticks since boot, or None
    state(pid, start)                     # "gone" | "stopped" | "running" | None (cannot tell)
    stop(pid, start, signal.SIGKILL)      # True if it was that process and it is gone now
"""

from __future__ import annotations

import contextlib
import os
import signal
import time


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return []
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may contain spaces
    close = raw.rfind(")")
    return raw[close + 2:].split() if close > 0 else None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None where /proc is unavailable
    or the process is gone)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def state(pid: int, start: int | None) -> str | None:
    """``"gone"`` (exited, a zombie, or the pid now names another process), ``"stopped"``
    (SIGSTOP / traced), ``"running"`` (any other state), or None when this host cannot tell."""
    fields = _stat(pid)
    if fields is None:
        return None
    if not fields:
        return "gone"
    if start is not None and int(fields[19]) != start:
        return "gone"
    code = fields[0]
    if code in ("Z", "X", "x"):
        return "gone"
    return "stopped" if code in ("T", "t") else "running"


def signal_process(pid: int, start: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it is still the process that started at ``start``."""
    if pid <= 0 or state(pid, start) in ("gone", None):
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
        return True
    return False


def stop(pid: int, start: int | None, sig: int = signal.SIGKILL, timeout: float = 10.0) -> bool:
    """Signal the process and wait until it is gone (escalating to SIGKILL after
    ``timeout``). True when it is gone (or already was)."""
    if state(pid, start) in ("gone", None):
        return state(pid, start) == "gone"
    signal_process(pid, start, sig)
    deadline = time.monotonic() + timeout
    while state(pid, start) not in ("gone", None):
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                return False
            signal_process(pid, start, signal.SIGKILL)
            sig, deadline = signal.SIGKILL, time.monotonic() + timeout
        time.sleep(0.01)
    return True

"""The one measurement, taken from outside the measured process tree, the same for every tool.

:func:`measure` starts a command (a fresh process), follows its whole process tree and
records, between the region's start and end messages (:func:`_harness.context.region`):

* ``wall_s``: wall-clock time from start to end (``time.monotonic`` in the process that opened
  the region, started after the harness took its start snapshot and stopped before the end one:
  the region's ``start``/``end`` messages wait for the harness's reply);
* ``pss_peak`` / ``pss_base`` / ``pss_above_base``: the memory of the whole tree, ``Pss`` of
  ``/proc/<pid>/smaps_rollup`` summed over its processes (pages shared by forked workers count
  once), sampled every ``5 * interval`` s and at the region's start and end; ``rss_*``: the same
  with ``VmRSS`` (an upper bound: shared pages count in every process), every ``interval`` s;
  ``maxrss``: the largest single process's peak (``wait4`` rusage: exact, unsampled);
* ``rchar``, ``wchar``, ``read_bytes``, ``write_bytes``: ``/proc/<pid>/io`` summed over the tree
  at the end minus at the start. The kernel folds a reaped child's counts into its parent,
  so work done by short-lived children counts too. ``rchar`` is what read system calls
  returned (page cache or not); ``read_bytes`` what came from the storage device;
* ``mapped``: growth of the tree's resident file-backed pages (``RssFile``) over the region: the bytes brought in by page faults on memory maps (``mmap`` reads do
  not show in ``rchar``). A lower bound where a tool maps and unmaps faster than the
  sampling interval;
* ``bytes_read = rchar + mapped``;
* ``majflt``, ``minflt``: page faults of the whole run (``wait4`` rusage).

The harness process itself is outside the tree: its own reads of ``/proc`` never count.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

IO_KEYS = ("rchar", "wchar", "read_bytes", "write_bytes")


@dataclasses.dataclass(frozen=True)
class Measurement:
    returncode: int
    wall_s: float | None
    outer_s: float
    rss_base: int
    rss_peak: int
    rss_above_base: int
    pss_base: int
    pss_peak: int
    pss_above_base: int
    maxrss: int
    mapped: int
    rchar: int
    wchar: int
    read_bytes: int
    write_bytes: int
    bytes_read: int
    majflt: int
    minflt: int
    samples: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (via ``/proc/<pid>/task/<tid>/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for f in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(f) as fh:
                    todo.extend(int(x) for x in fh.read().split())
            except (OSError, ValueError):
                pass
    return out


def _status(pid: int) -> tuple[int, int]:
    """(VmRSS, RssFile) of one process, in bytes."""
    rss = rfile = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    rfile = int(line.split()[1]) * 1024
                    break
    except (OSError, IndexError, ValueError):
        pass
    return rss, rfile


def _io(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/io") as fh:
            kv = dict(line.split(":", 1) for line in fh if ":" in line)
        return {k: int(kv[k]) for k in IO_KEYS}
    except (OSError, KeyError, ValueError):
        return dict.fromkeys(IO_KEYS, 0)


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def tree_pss(pid: int) -> int:
    return sum(_pss(p) for p in tree(pid))


def tree_memory(pid: int) -> tuple[int, int]:
    rss = shared = 0
    for p in tree(pid):
        r, s = _status(p)
        rss += r
        shared += s
    return rss, shared


def tree_io(pid: int) -> dict[str, int]:
    tot = dict.fromkeys(IO_KEYS, 0)
    for p in tree(pid):
        for k, v in _io(p).items():
            tot[k] += v
    return tot


class _Watch:
    """Samples the tree and handles the region messages while the command runs."""

    def __init__(self, pid: int, sock: socket.socket, interval: float, pss_every: int = 5) -> None:
        self.pid, self.sock, self.interval, self.pss_every = pid, sock, interval, pss_every
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.t_start = self.t_end = self.wall = None
        self.io_start: dict[str, int] | None = None
        self.io_end: dict[str, int] | None = None
        self.base = (0, 0)
        self.peak = [0, 0]
        self.pss_base = self.pss_peak = 0
        self.samples = 0
        self.in_region = False
        self.errors: list[str] = []

    def sample(self) -> None:
        n = 0
        while not self.done.is_set():
            rss, shared = tree_memory(self.pid)
            pss = tree_pss(self.pid) if n % self.pss_every == 0 else 0
            n += 1
            with self.lock:
                if self.in_region:
                    self.peak[0] = max(self.peak[0], rss)
                    self.peak[1] = max(self.peak[1], shared)
                    self.pss_peak = max(self.pss_peak, pss)
                    self.samples += 1
            self.done.wait(self.interval)

    def events(self) -> None:
        self.sock.settimeout(0.05)
        while not self.done.is_set():
            try:
                data, sender = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self._handle(json.loads(data))
            finally:
                if sender:  # the region waits for this reply: our snapshot is taken before its work
                    try:
                        self.sock.sendto(b"ok", sender)
                    except OSError:
                        pass

    def _handle(self, msg: dict) -> None:
        if msg["ev"] == "start":
            io = tree_io(self.pid)
            mem = tree_memory(self.pid)
            pss = tree_pss(self.pid)
            with self.lock:
                if self.t_start is not None:
                    self.errors.append("region started twice")
                self.t_start, self.io_start, self.base = time.monotonic(), io, mem
                self.peak = list(mem)
                self.pss_base = self.pss_peak = pss
                self.in_region = True
        elif msg["ev"] == "end":
            mem = tree_memory(self.pid)
            pss = tree_pss(self.pid)
            io = tree_io(self.pid)
            with self.lock:
                self.pss_peak = max(self.pss_peak, pss)
                self.peak[0] = max(self.peak[0], mem[0])
                self.peak[1] = max(self.peak[1], mem[1])
                self.wall, self.io_end, self.t_end = msg["t"], io, time.monotonic()
                self.in_region = False


def measure(argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None, timeout: float = 3600.0,
            interval: float = 0.02, stdout: str | None = None) -> Measurement:
    """Run ``argv`` (a fresh process) and measure its region (see the module docs)."""
    tmp = tempfile.mkdtemp(prefix="cbbench-")
    path = os.path.join(tmp, "events")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    out = open(stdout or os.devnull, "w")  # noqa: SIM115
    try:
        t0 = time.monotonic()
        proc = subprocess.Popen(list(argv), env={**env, "CB_BENCH_EVENTS": path}, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT)
        w = _Watch(proc.pid, sock, interval)
        threads = [threading.Thread(target=w.sample, daemon=True), threading.Thread(target=w.events, daemon=True)]
        for t in threads:
            t.start()
        timer = threading.Timer(timeout, lambda: _kill_tree(proc.pid))
        timer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        outer = time.monotonic() - t0
        time.sleep(0.1)  # let a last message arrive
        w.done.set()
        for t in threads:
            t.join()
    finally:
        out.close()
        sock.close()
        os.unlink(path)
        os.rmdir(tmp)
    ok = w.t_start is not None and w.t_end is not None and not w.errors
    io0 = w.io_start or dict.fromkeys(IO_KEYS, 0)
    io1 = w.io_end or io0
    dio = {k: max(0, io1[k] - io0[k]) for k in IO_KEYS}
    mapped = max(0, w.peak[1] - w.base[1])
    return Measurement(
        returncode=proc.returncode if ok or proc.returncode else -1,
        wall_s=w.wall if ok else None, outer_s=outer,
        rss_base=w.base[0], rss_peak=w.peak[0], rss_above_base=max(0, w.peak[0] - w.base[0]),
        pss_base=w.pss_base, pss_peak=w.pss_peak, pss_above_base=max(0, w.pss_peak - w.pss_base),
        maxrss=ru.ru_maxrss * 1024, mapped=mapped, bytes_read=dio["rchar"] + mapped,
        majflt=ru.ru_majflt, minflt=ru.ru_minflt, samples=w.samples, **dio)


def _kill_tree(pid: int) -> None:
    import signal

    for p in reversed(tree(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass

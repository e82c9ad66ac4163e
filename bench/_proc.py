"""Helpers of the scale benchmarks (imported as ``_proc``; scripts run as ``python bench/X.py``).

``measure(cmd)`` runs a command as a child process and returns its wall time and the
peak RSS of its whole process tree (psutil, sampled every 20 ms: torchrun's ranks and
DeepSpeed's worker pools count in full), and its stdout; ``save_result`` writes a
result to ``bench/results/<name>.json`` with its ``provenance()`` (the commit and the harness's
machine facts, measured when the result is saved)::

    r = measure([sys.executable, "-c", "print(1)"])
    r["wall_s"], r["peak_tree_rss_mb"], r["stdout"]
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.environ.get("CB_BENCH_RESULTS") or os.path.join(HERE, "results")  # tests send smoke runs elsewhere


def measure(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float | None = None,
            cwd: str | None = None) -> dict[str, Any]:
    """Run ``cmd``; wall seconds, peak RSS of the process tree (MiB), stdout. Raises on failure."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            peak = max(peak, total)
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"{' '.join(cmd[:4])} timed out after {timeout}s:\n{err[-3000:]}") from None
    finally:
        stop.set()
        th.join()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} failed (rc {proc.returncode}):\n{err[-4000:]}")
    return {"wall_s": wall, "peak_tree_rss_mb": peak / 2**20, "stdout": out}


def last_json(stdout: str) -> dict[str, Any]:
    """The last line of ``stdout`` that is a JSON object."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in output: {stdout[-500:]!r}")


def provenance(mib: int | None = None) -> dict[str, Any]:
    """``{"commit", "finished", "machine"}`` for a result file: the checkout's commit (``+dirty`` when a
    tracked file differs), the UTC time, and the harness's machine facts (cores, memory, load, memcpy
    and disk speeds over ``mib`` MiB written in a temporary directory under ``bench/out``, package
    versions; ``bench/_harness/machine.py``) plus the platform and the load average now. ``mib``
    defaults to ``$CB_BENCH_PROBE_MIB`` or 256 (tests' smoke runs probe less)."""
    mib = mib or int(os.environ.get("CB_BENCH_PROBE_MIB", "256"))
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from _harness.machine import facts, git_commit, versions

    scratch = os.path.join(HERE, "out")
    os.makedirs(scratch, exist_ok=True)
    load = os.getloadavg()  # before the probe's own work
    with tempfile.TemporaryDirectory(dir=scratch, prefix="machine-") as work:
        machine = {**facts(work, mib), "versions": versions()}
    return {"commit": git_commit(), "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "load_avg_at_end": load, **machine}}


def save_result(name: str, data: Mapping[str, Any]) -> str:
    """Write ``data`` and its :func:`provenance` to ``bench/results/<name>.json`` (``$CB_BENCH_RESULTS/``
    when set); return the path."""
    path = os.path.join(RESULTS, f"{name}.json")
    save_result_at(path, data)
    return path


def save_result_at(path: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``data`` and its :func:`provenance` to ``path`` (a script's own ``--out``); return what
    was written::

        doc = save_result_at("bench/results/remote.json", {"median": med})
    """
    full = {**provenance(), **data}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(full, fh, indent=1, default=str)
    return full

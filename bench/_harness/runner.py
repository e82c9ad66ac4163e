"""Run a suite at one size: prepare inputs, run every case (fresh process per run), keep everything.

Reps are interleaved (rep 1 of every case, then rep 2 ...) so that drift on a shared machine
hits every tool alike. A case that does not fit in the memory available now is skipped and
says why; a case that fails is recorded with its error (the others still run).
"""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .machine import git_commit
from .measure import measure
from .spec import Case, Suite

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
CHILD = os.path.join(HERE, "child.py")
SCHEMA = "ckptbridge-bench/1"
# memory left to everything else on the machine when deciding whether a case fits
MEM_MARGIN = int(float(os.environ.get("CB_BENCH_MEM_MARGIN_GIB", "3")) * 2**30)


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_facts(work: str, mib: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.join(HERE, "machine.py"), work, str(mib)], capture_output=True,
                         text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env(suite: Suite) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(suite.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH, env.get("PYTHONPATH")) if p)
    return env


def _inputs_key(suite: Suite, size_name: str) -> str:
    import importlib

    mod = importlib.import_module(suite.module)
    src = inspect.getsource(getattr(mod, suite.prepare)) if suite.prepare else ""
    size = suite.sizes[size_name]
    blob = json.dumps([suite.name, size.name, size.gib, dict(size.params), src], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _ctx(suite: Suite, case: str, size_name: str, inputs: str, work: str) -> dict[str, Any]:
    size = suite.sizes[size_name]
    return {"suite": suite.name, "case": case, "size": size.name, "gib": size.gib, "params": dict(size.params),
            "inputs": inputs, "work": work, "root": ROOT}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _inputs_ready(suite: Suite, size_name: str, work_root: str) -> bool:
    stamp = os.path.join(work_root, suite.name, size_name, "inputs", ".ready")
    if suite.prepare is None:
        return True
    try:
        with open(stamp) as fh:
            return fh.read().strip() == _inputs_key(suite, size_name)
    except OSError:
        return False


def prepare(suite: Suite, size_name: str, work_root: str, log: Callable[[str], None]) -> tuple[str, float | None]:
    """Make (once; kept while its code and size are unchanged) the inputs every case reads."""
    inputs = os.path.join(work_root, suite.name, size_name, "inputs")
    if suite.prepare is None:
        os.makedirs(inputs, exist_ok=True)
        return inputs, None
    key = _inputs_key(suite, size_name)
    stamp = os.path.join(inputs, ".ready")
    if _inputs_ready(suite, size_name, work_root):
        return inputs, None
    shutil.rmtree(inputs, ignore_errors=True)
    os.makedirs(inputs)
    spec = os.path.join(work_root, suite.name, size_name, "prepare.json")
    result = spec + ".result"
    with open(spec, "w") as fh:
        json.dump({"module": suite.module, "function": suite.prepare, "kind": "prepare", "result": result,
                   "ctx": _ctx(suite, "prepare", size_name, inputs, inputs)}, fh)
    log(f"[{suite.name}/{size_name}] preparing inputs in {inputs} ...")
    t0 = time.monotonic()
    logf = os.path.join(work_root, suite.name, size_name, "prepare.log")
    with open(logf, "w") as out:
        rc = subprocess.run([sys.executable, CHILD, spec], env=_env(suite), cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, timeout=suite.timeout_s * 4).returncode
    with open(result) as fh:
        status = json.load(fh)
    if rc or not status.get("ok"):
        raise RuntimeError(f"{suite.name}: prepare failed: {status.get('error')}\n{status.get('traceback', '')}"
                           f"\n(log: {logf})")
    with open(stamp, "w") as fh:
        fh.write(key)
    return inputs, time.monotonic() - t0


def evict(path: str) -> int:
    """Drop every file under ``path`` from the page cache (``posix_fadvise(DONTNEED)``: this
    process's own files only, no root, nobody else's cache); return the bytes evicted."""
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return n


def cache(inputs: str, rels: Sequence[str]) -> int:
    """Read every file of ``rels`` (files or directories under ``inputs``) once, so that the page
    cache holds them when the case starts; return the bytes read."""
    n = 0
    for rel in rels:
        top = os.path.join(inputs, rel)
        paths = [top] if os.path.isfile(top) else [os.path.join(r, f) for r, _, fs in os.walk(top) for f in fs]
        for p in paths:
            with open(p, "rb", buffering=0) as fh:
                while chunk := fh.read(8 << 20):
                    n += len(chunk)
    return n


def run_once(suite: Suite, case: Case, size_name: str, inputs: str, scratch: str) -> dict[str, Any]:
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    spec = os.path.join(os.path.dirname(scratch), "spec.json")
    result = spec + ".result"
    if os.path.exists(result):
        os.remove(result)
    with open(spec, "w") as fh:
        json.dump({"module": suite.module, "function": case.fn or case.cmd, "kind": "fn" if case.fn else "cmd",
                   "check": case.check, "result": result, "ctx": _ctx(suite, case.name, size_name, inputs, scratch)}, fh)
    logf = os.path.join(os.path.dirname(scratch), "last.log")
    m = measure([sys.executable, CHILD, spec], _env(suite), cwd=ROOT, timeout=suite.timeout_s, stdout=logf)
    try:
        with open(result) as fh:
            status = json.load(fh)
    except (OSError, ValueError):
        with open(logf, errors="replace") as fh:
            tail = fh.read()[-3000:]
        status = {"ok": False, "error": f"no result (exit code {m.returncode}); log tail:\n{tail}"}
    run = m.as_dict()
    run["metrics"] = status.get("metrics", {})
    if status.get("skip"):
        run["skip"] = status["skip"]
        return run
    if not status.get("ok") or m.returncode != 0 or m.wall_s is None:
        run["error"] = status.get("error") or f"exit code {m.returncode}, region not completed"
        run["traceback"] = status.get("traceback")
    shutil.rmtree(scratch, ignore_errors=True)
    return run


def select(suite: Suite, size_name: str, only: Sequence[str] | None) -> list[Case]:
    cases = [c for c in suite.cases if c.sizes is None or size_name in c.sizes]
    if only:
        cases = [c for c in cases if any(fnmatch.fnmatch(c.name, pat) or c.group == pat for pat in only)]
    probes = {c.startup for c in cases if c.startup}
    return cases + [suite.startups[p] for p in sorted(probes)]


def run_suite(suite: Suite, size_name: str, *, work_root: str, reps: int | None = None,
              only: Sequence[str] | None = None, machine: dict[str, Any] | None = None, cold: bool = True,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``suite`` at ``size_name``; return the result document (see report.validate)."""
    if size_name not in suite.sizes:
        raise KeyError(f"suite {suite.name} has no size {size_name!r} (sizes: {', '.join(suite.sizes)})")
    size = suite.sizes[size_name]
    reps = reps or size.reps
    started = datetime.datetime.now(datetime.timezone.utc)
    cases = select(suite, size_name, only)
    need = int(suite.prepare_memory_needed(size.gib) * 2**30)
    ready = _inputs_ready(suite, size_name, work_root)
    skip_all = None
    os.makedirs(work_root, exist_ok=True)
    disk = int(suite.disk_needed(size.gib) * 2**30)
    free = shutil.disk_usage(work_root).free
    have = free + (_dir_bytes(os.path.join(work_root, suite.name, size_name, "inputs")) if ready else 0)
    if disk and disk + (4 << 30) > have:
        skip_all = f"needs ~{disk / 2**30:.0f} GiB of disk in {work_root}; {free / 2**30:.0f} GiB free"
        inputs, prep_s = "", None
        log(f"[{suite.name}/{size_name}] skipped: {skip_all}")
    elif need and not ready and need + MEM_MARGIN > mem_available():
        skip_all = (f"making the inputs needs ~{need / 2**30:.1f} GiB of memory; "
                    f"{mem_available() / 2**30:.1f} GiB available")
        inputs, prep_s = "", None
        log(f"[{suite.name}/{size_name}] skipped: {skip_all}")
    else:
        inputs, prep_s = prepare(suite, size_name, work_root, log)
    scratch = os.path.join(work_root, suite.name, size_name, "run")
    records: dict[str, dict[str, Any]] = {}
    for c in cases:
        records[c.name] = {
            "name": c.name, "group": c.group, "tool": c.tool, "settings": c.settings, "role": c.role,
            "ref": c.ref, "vs": c.vs, "kind": "fn" if c.fn else "cmd", "startup": c.startup, "note": c.note,
            "is_startup_probe": c in suite.startups.values(),
            "mem_needed_bytes": int(c.memory_needed(size.gib) * 2**30),
            "status": "skipped" if skip_all else "ok", "reason": skip_all, "runs": []}
    for rep in range(reps):
        for c in cases:
            rec = records[c.name]
            if rec["status"] != "ok":
                continue
            need, avail = rec["mem_needed_bytes"], mem_available()
            if need and need + MEM_MARGIN > avail:
                why = (f"needs ~{need / 2**30:.1f} GiB of memory; {avail / 2**30:.1f} GiB available "
                       f"(keeping {MEM_MARGIN / 2**30:.0f} GiB spare)")
                if rec["runs"]:  # it ran before: keep those reps, skip this one
                    rec.setdefault("reps_skipped", []).append(why)
                else:
                    rec["status"], rec["reason"] = "skipped", why
                log(f"[{suite.name}/{size_name}] {c.name}: skipped: {why}")
                continue
            cached = cache(inputs, c.reads) if inputs else 0
            run = run_once(suite, c, size_name, inputs, scratch)
            run["inputs_cached_bytes"] = cached
            if "skip" in run:
                rec["status"], rec["reason"] = "skipped", run["skip"]
                log(f"[{suite.name}/{size_name}] {c.name}: skipped: {run['skip']}")
                continue
            rec["runs"].append(run)
            if "error" in run:
                rec["status"] = "error"
                rec["reason"] = run["error"]
                log(f"[{suite.name}/{size_name}] {c.name}: ERROR {run['error'][:2000]}")
            else:
                log(f"[{suite.name}/{size_name}] rep {rep + 1}/{reps} {c.name:44s} {run['wall_s']:8.3f} s  "
                    f"tree PSS +{run['pss_above_base'] / 2**20:7.0f} MiB  rchar {run['rchar'] / 2**20:8.0f} MiB")
    # one more run per case with the inputs evicted from the page cache: "read_bytes" then counts
    # what the storage delivered, whether by read calls or by page faults of memory maps
    for c in cases if cold and suite.prepare else ():
        rec = records[c.name]
        if rec["status"] != "ok" or not inputs or rec["is_startup_probe"]:
            continue
        evicted = evict(inputs)
        run = run_once(suite, c, size_name, inputs, scratch)
        run["evicted_bytes"] = evicted
        if "error" in run:
            rec["status"], rec["reason"] = "error", f"cold-inputs run: {run['error']}"
            log(f"[{suite.name}/{size_name}] {c.name}: cold-inputs run ERROR {run['error'][:2000]}")
            continue
        rec["cold"] = run
        log(f"[{suite.name}/{size_name}] cold inputs {c.name:44s} {run['wall_s']:8.3f} s  "
            f"read from storage {run['read_bytes'] / 2**20:8.0f} MiB")
    from .report import summarize

    doc = {
        "schema": SCHEMA, "suite": suite.name, "title": suite.title, "description": suite.description,
        "size": size.name, "gib": size.gib, "params": dict(size.params), "reps": reps,
        "cold_inputs_run": bool(cold and suite.prepare),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "prepare_s": prep_s, "machine": machine or {},
        "columns": [{"key": c.key, "header": c.header, "fmt": c.fmt} for c in suite.columns],
        "cases": list(records.values()),
    }
    doc = summarize(doc)
    if suite.derive:
        import importlib

        getattr(importlib.import_module(suite.module), suite.derive)(doc)
    return doc

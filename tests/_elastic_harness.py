"""Fault trials of examples/elastic_restart.py on torch's elastic agent.

One trial = one independent job: a fresh c10d rendezvous store on 127.0.0.1, four
fresh elastic agents (``LocalElasticAgent``, the engine ``torchrun`` runs: same
rendezvous, restarts and ``--max-restarts`` accounting) with ``--nnodes=3:4``, one
rank each, a fresh checkpoint root; a fault (SIGKILL / SIGSTOP) injected into one
rank at a seeded step and moment. The agents are forked from one process that has
imported torch once, and fork their workers (``start_method="fork"``), so a trial
costs seconds instead of a dozen Python start-ups; nothing else is shared between
trials. ``torchrun`` itself is exercised by tests/test_elastic.py's CLI case::

    trial = run_trial(tmp_path, steps=14, fault=Fault(rank=2, step=6, signal="stop", delay=0.03))
    trial.verdicts, trial.losses, trial.resumed, trial.committed
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.device_mesh
import torch.distributed.fsdp
import torch.distributed.tensor  # noqa: F401
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import ckptbridge
import ckptbridge.adapters.torch  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic_restart.py"
_spec = importlib.util.spec_from_file_location("elastic_restart_example", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
sys.modules["elastic_restart_example"] = example
_spec.loader.exec_module(example)
Fault = example.Fault


def _train(root: str, steps: int, fault: Fault | None, events: str, keep_all: bool, broken: str | None) -> None:
    example.train(root, steps, fault=fault, events=events, keep_all=keep_all, broken=broken)


def agent(port: int, job: str, root: str, steps: int, fault: Fault | None, events: str, log: str,
          keep_all: bool, broken: str | None) -> None:
    """One node: an elastic agent with one worker (what ``torchrun --nnodes=3:4 --nproc-per-node=1
    --max-restarts=3 --rdzv-backend=c10d`` runs)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_trial's dump of a hung job (its workers inherit it)
    # torch's agent and rendezvous steps (each round, each agent's group_world_size) in the agent's log
    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.INFO)
    os.environ.update(example.AGENT_ENV)
    os.environ["OMP_NUM_THREADS"] = "1"
    conf = dict(item.split("=") for item in example.RDZV_CONF.split(","))
    config = LaunchConfig(min_nodes=3, max_nodes=4, nproc_per_node=1, run_id=job, rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"is_host": False, **conf},
                          max_restarts=3, monitor_interval=example.MONITOR_INTERVAL, start_method="fork", local_addr="127.0.0.1")
    elastic_launch(config, _train)(root, steps, fault, events, keep_all, broken)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the agent is done; multiprocessing's exit handling would add ~15 s of teardown


HUNG = "=== run_trial: the job hung; the stacks of its live processes (faulthandler) ==="
# Seconds the agents get to exit once every rank of the last attempt has finished: an agent sees
# its worker's success within MONITOR_INTERVAL, then passes torch's exit barrier at once
EXIT_GRACE = 30.0


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def finished(events: list[dict]) -> bool:
    """Every rank of the job's last world recorded ``done`` (the training ended)."""
    done = [e for e in events if e["ev"] == "done"]
    return bool(done) and len({e["rank"] for e in done}) == done[-1]["world"]


def _all_done(path: Path) -> bool:
    """:func:`finished`, from the events file of a running job."""
    try:
        return finished(_events(path))
    except ValueError:  # a line being written
        return False


@dataclass
class Trial:
    root: Path
    fault: Fault | None
    agent_codes: list[int | None]
    events: list[dict] = field(default_factory=list)
    verdicts: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    logs: str = ""
    agent_seconds: list[float | None] = field(default_factory=list)  # when each agent ended
    stacks: str = ""  # a job that hung at the timeout: where each of its live processes was

    @property
    def finished(self) -> bool:
        """Every rank of the job's last world recorded ``done``."""
        return finished(self.events)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == kind]

    def log_lines(self, needle: str) -> list[str]:
        """Lines of the agents' and workers' output that contain ``needle``."""
        return [line for line in self.logs.splitlines() if needle in line]

    @property
    def losses(self) -> dict[int, tuple[float, int]]:
        """step -> (loss, world size); a step run twice (before and after a restart) keeps the last."""
        return {e["step"]: (e["loss"], e["world"]) for e in self.of("loss")}

    @property
    def committed(self) -> list[int]:
        """Steps with a complete checkpoint (commit marker present)."""
        return _committed(self.root)


def _committed(root: Path) -> list[int]:
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith("step_") and "." not in name and (root / name / "COMMITTED").exists():
            out.append(int(name[5:]))
    return out


_CTX: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    """The fork server, with torch and this module imported once. (Python 3.11's fork server
    ignores the parent's sys.path, so this directory goes in through PYTHONPATH.)"""
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["_elastic_harness", "pytest"])
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), old) if p)
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _CTX = ctx
    return _CTX


def run_trial(workdir: Path, *, steps: int, fault: Fault | None, nodes: int = 4, timeout: float = 150.0,
              keep_all: bool = True, broken: str | None = None) -> Trial:
    """Run one job to its end (or ``timeout``); every process it started is gone afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    root, events = workdir / "ckpt", workdir / "events.jsonl"
    root.mkdir(exist_ok=True)
    ctx = _context()
    store, port = example.rendezvous_store()
    job = uuid.uuid4().hex[:8]
    t0 = time.monotonic()
    agents = [ctx.Process(target=agent, args=(port, job, str(root), steps, fault, str(events),
                                              str(workdir / f"agent{i}.log"), keep_all, broken))
              for i in range(nodes)]
    for a in agents:
        a.start()
    deadline = t0 + timeout
    ended: dict[int, float] = {}
    finished: float | None = None  # when every rank of the job's last attempt had recorded "done"
    look = t0  # the events are read twice a second
    while len(ended) < len(agents) and time.monotonic() < deadline:
        now = time.monotonic()
        for i, a in enumerate(agents):
            if i not in ended and not a.is_alive():
                ended[i] = now - t0
        if finished is None and now >= look:
            look = now + 0.5
            finished = now if _all_done(events) else None
        if finished is not None and now - finished > EXIT_GRACE:
            break  # the training ended; agents that have not exited by now hang in their own exit
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    evs = _events(events)
    stacks = _dump_stacks(agents, evs, workdir, nodes)
    for a in agents:  # a job that hung: leave nothing behind
        if a.is_alive():
            a.kill()
            a.join(5)
    for e in evs:  # a worker the job left behind (pids of this trial, seconds old: not reused)
        if e["ev"] == "start":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(e["pid"], signal.SIGKILL)
    del store
    faults = root / "faults.jsonl"
    verdicts = [json.loads(line) for line in faults.read_text().splitlines()] if faults.exists() else []
    logs = "\n".join((workdir / f"agent{i}.log").read_text(errors="replace") for i in range(nodes)
                     if (workdir / f"agent{i}.log").exists())
    return Trial(root, fault, [a.exitcode for a in agents], evs, verdicts, seconds, logs,
                 [ended.get(i) for i in range(nodes)], stacks)


def _dump_stacks(agents: list, evs: list[dict], workdir: Path, nodes: int) -> str:
    """A job still running at the timeout: every live agent and worker of it writes its threads'
    stacks into its agent's log (SIGUSR1, ``faulthandler``), after a :data:`HUNG` line; returns them
    (each agent's whole dump: a tail cut would drop the thread headers of deep stacks), else ""."""
    if not any(a.is_alive() for a in agents):
        return ""
    for i in range(nodes):
        with open(workdir / f"agent{i}.log", "a") as fh:
            fh.write(f"\n{HUNG}\n")
    pids = [a.pid for a in agents if a.is_alive()] + [e["pid"] for e in evs if e["ev"] == "start"]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)
    logs = [(workdir / f"agent{i}.log").read_text(errors="replace").split(HUNG, 1)[-1] for i in range(nodes)]
    return "".join(f"\n--- agent {i} and its workers:{text}" for i, text in enumerate(logs))


def _group_entry(target: object, rank: int, world: int, port: int, args: tuple, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    target(rank, world, *args)  # type: ignore[operator]


def run_group(target: object, world: int, args: tuple, workdir: Path, timeout: float = 180.0) -> list[int | None]:
    """``target(rank, world, *args)`` on ``world`` processes forked from the preloaded server, with
    MASTER_ADDR/PORT set for ``init_process_group`` (rank 0 serves the store). Returns exit codes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = _context()
    procs = [ctx.Process(target=_group_entry, args=(target, r, world, port, args, str(workdir / f"rank{r}.log")))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    return [p.exitcode for p in procs]

"""Elastic restart on torchrun: find the faulty rank, restart on the healthy ones, resume.

    python examples/elastic_restart.py demo ROOT --fault kill     # or --fault stop; one command

starts a c10d rendezvous store on 127.0.0.1 and four torchrun agents on this
machine (four "nodes", one rank each), kills (SIGKILL) or stops (SIGSTOP) one
rank at a random moment of a random step, and prints what happened: the
watchdog names the faulty rank in one log line, the healthy ranks commit the
last complete checkpoint and exit with status 75, the faulty node's agent is
isolated, torchrun restarts the group on the three remaining nodes, and
training resumes from ``Checkpointer.latest()`` at world size 3, each rank
reading only the bytes of its own (uneven) FSDP2 shards. The losses
(``LOSS step value``) continue those of an uninterrupted run: the global batch
is fixed, so the math is the same on any world size up to reduction order.

Each node runs the stock launcher; ``demo`` runs, per node::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=3:4 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=JOB --local-addr=127.0.0.1 \\
        --rdzv-conf=is_host=0,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5 \\
        examples/elastic_restart.py train ROOT --steps 16

(``is_host=0``: the rendezvous store runs in the demo process, like an etcd
server, so that isolating any node never takes the store with it;
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: see ``AGENT_ENV``; the keep-alive: see
``RDZV_CONF``.) The training
loop is ``train()``: a small MLP under FSDP2 on gloo, checkpointed every step
with ``ckptbridge.Checkpointer`` and watched by ``ckptbridge.Watchdog``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

GLOBAL_BATCH, D_IN, HIDDEN, D_OUT = 24, 16, 30, 10
# The rendezvous drops a node whose heartbeat is keep_alive_interval x keep_alive_max_attempt old:
# the isolated node 5 s after its agent was stopped (the restart waits for that). Not shorter: a
# healthy but busy agent that misses that many beats is dropped too, and when that happens between
# the round's completion and another agent's last look at it, that agent takes a smaller world
# size (torch 2.13's DynamicRendezvousHandler counts the participants it sees); the job runs, but
# torch's exit barrier then waits 300 s for a member that never comes. (With 1 s x 2, CI's 2-core
# runner once had three agents in _exit_barrier after every rank had finished; the cause is read
# from torch's _sanitize and _get_world, not observed directly.)
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=120"
# How often an agent checks its worker. Not faster than the watchdog isolates a dead rank's node
# (detection + isolation ~0.6 s): an agent that sees its SIGKILLed worker first rejoins the next
# rendezvous round at once, often as its group rank 0, and when the watchdog then stops it the
# round's rank assignment is never written (the others wait 60 s in torch's
# _assign_worker_ranks, DistStoreError).
MONITOR_INTERVAL = 2.0
# Each round's rank-0 worker serves the workers' store: with torch's shared agent store (the
# default), agents keep the address of the first round's rank-0 node, so a restart without that
# node waits for a store that is gone (torch 2.13). Gloo talks over loopback.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo"}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, D_IN)).astype(np.float32)
    return x, np.tanh(x @ np.ones((D_IN, D_OUT), np.float32) / 4).astype(np.float32)


@dataclass(frozen=True)
class Fault:
    """Inject a signal into global rank ``rank`` (of the first attempt), ``delay`` seconds
    into step ``step``."""

    rank: int
    step: int
    signal: str = "kill"  # kill (SIGKILL) | stop (SIGSTOP)
    delay: float = 0.0


def emit(path: str | None, **event: object) -> None:
    """Append one JSON line (one write: lines of concurrent processes never interleave)."""
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(event) + "\n").encode())
        finally:
            os.close(fd)


def _inject(fault: Fault, root: str, events: str | None, step: int) -> None:
    """Arm the fault once per job (a marker file), on a timer: it lands mid-step."""
    try:
        os.close(os.open(os.path.join(root, "fault-injected"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    sig = signal.SIGKILL if fault.signal == "kill" else signal.SIGSTOP

    def fire() -> None:
        emit(events, ev="fault", rank=fault.rank, step=step, signal=fault.signal, pid=os.getpid(),
             host=socket.gethostname(), time=time.time())
        os.kill(os.getpid(), sig)

    threading.Timer(fault.delay, fire).start()


def _break_shards(ckpt: object, model: object, mesh: object) -> None:
    """Negative control: every rank takes the next rank's shard where the shapes agree."""
    import torch

    from ckptbridge.adapters import torch as cbt

    other = (mesh.get_coordinate()[0] + 1) % mesh.size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            shape, pairs = cbt.local_boxes(p.shape, mesh.shape, [other], p.placements)
            if tuple(shape) == tuple(local.shape) and len(pairs) == 1:
                local.copy_(torch.from_numpy(ckpt[f"model.{name}"].read(pairs[0][0])))


def train(root: str, steps: int, *, fault: Fault | None = None, events: str | None = None,
          timeout: float = 60.0, keep_all: bool = False, broken: str | None = None, watchdog: bool = True) -> None:
    """One rank of the job (run by torchrun; ``torch.distributed`` is set up from its env)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptbridge
    from ckptbridge.adapters import torch as cbt

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints every stack
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("ckptbridge.watchdog").setLevel(logging.INFO)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    emit(events, ev="start", rank=rank, world=world, pid=os.getpid(), attempt=attempt, time=time.time())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # one token per attempt, the same on every rank (agents count restarts separately), so that
    # pieces of an abandoned attempt never mix with this one's in a staging directory
    token = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    job = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}-{token[0]}"
    ck = ckptbridge.Checkpointer(root, keep_last=None if keep_all else 3, commit_timeout=timeout, job_id=job)
    start = 0
    latest = ck.latest()
    if latest is not None:  # resume: each rank reads only its own boxes
        t0 = time.perf_counter()
        ckpt = ckptbridge.open(ck.path_of(latest))
        cbt.load_train_state(ckpt, model, None if broken == "no-optimizer" else opt)
        if broken == "wrong-shard":
            _break_shards(ckpt, model, mesh)
        start = latest + 1
        emit(events, ev="resumed", rank=rank, world=world, step=latest, bytes=ckpt.stats.bytes_read,
             seconds=time.perf_counter() - t0, time=time.time())
        if rank == 0:
            print(f"RESUMED from step {latest} on {world} ranks, read {ckpt.stats.bytes_read} bytes on rank 0",
                  flush=True)
    per_rank = GLOBAL_BATCH // world
    def on_fault(verdicts: list) -> None:  # what this rank is about to do (for the tests)
        faulty = sorted(v.rank for v in verdicts)
        emit(events, ev="verdict", rank=rank, faulty=faulty, time=time.time(),
             code=ckptbridge.EXIT_FAULTY if rank in faulty else ckptbridge.EXIT_RESTART)

    # watchdog=False: the stock behaviour (bench/bench_elastic.py's peer): a lost peer surfaces as
    # a failed collective, or a gloo timeout for a stopped one, and torchrun restarts every node
    with ckptbridge.Watchdog(ck, on_fault=on_fault) if watchdog else _NoWatchdog() as wd:
        emit(events, ev="ready", rank=rank, world=world, time=time.time())
        for step in range(start, steps):
            if fault is not None and step == fault.step and rank == fault.rank and attempt == "0":
                _inject(fault, root, events, step)
            x, y = batch(step)
            lo = rank * per_rank
            xb, yb = torch.from_numpy(x[lo: lo + per_rank]), torch.from_numpy(y[lo: lo + per_rank])
            loss = (model(xb) - yb).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = loss.detach().clone() / world
            dist.all_reduce(total)
            if rank == 0:
                print(f"LOSS {step} {total.item():.9g}", flush=True)
                emit(events, ev="loss", step=step, loss=total.item(), world=world, time=time.time())
            ck.save(step, cbt.train_state(model, opt), optimizer=opt)
            wd.step(step)
        ck.wait()
    ck.close()
    emit(events, ev="done", rank=rank, world=world, time=time.time())
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


class _NoWatchdog(contextlib.nullcontext):
    def __enter__(self) -> _NoWatchdog:
        return self

    def step(self, step: int) -> None:
        pass


# ------------------------------------------------------------------ launching (the demo)


def rendezvous_store() -> tuple[object, int]:
    """The c10d rendezvous store, served from this process on 127.0.0.1 only."""
    import torch.distributed as dist

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          master_listen_fd=sock.fileno())
    return (store, sock), port


def agent_command(port: int, job: str, root: str, steps: int, *, nodes: int = 4, fault: Fault | None = None,
                  events: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """The torchrun command of one node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes - 1}:{nodes}", "--nproc-per-node=1",
           "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
           "--local-addr=127.0.0.1", f"--rdzv-conf=is_host=0,{RDZV_CONF}", f"--monitor-interval={MONITOR_INTERVAL}",
           os.path.abspath(__file__), "train", root, "--steps", str(steps)]
    if fault is not None:
        cmd += ["--fault-rank", str(fault.rank), "--fault-step", str(fault.step), "--fault-signal", fault.signal,
                "--fault-delay", str(fault.delay)]
    if events:
        cmd += ["--events", events]
    return cmd + list(extra)


_TOGETHER = """
import os, sys, time
import torch.distributed.run as run
go, i = sys.argv[1], sys.argv[2]
open(f"{go}.{i}", "w").close()
while not os.path.exists(go):
    time.sleep(0.05)
sys.argv = ["torchrun", *sys.argv[3:]]
sys.exit(run.main())
"""


def demo(root: str, steps: int, fault: Fault | None, nodes: int = 4, timeout: float = 300.0,
         extra: tuple[str, ...] = ()) -> int:
    os.makedirs(root, exist_ok=True)
    events = os.path.join(root, "events.jsonl")
    _store, port = rendezvous_store()  # kept alive until the agents are done
    env = {**os.environ, **AGENT_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = uuid.uuid4().hex[:8]
    # the nodes start together: each imports torchrun's module, then waits for the others before
    # calling torchrun's main (`torchrun` is torch.distributed.run:main), so that the first
    # rendezvous round does not close on three nodes while a slow fourth is still importing torch
    go = os.path.join(root, f".go-{job}")
    agents = []
    for i in range(nodes):
        cmd = agent_command(port, job, root, steps, nodes=nodes, fault=fault, events=events, extra=extra)
        agents.append(subprocess.Popen([sys.executable, "-c", _TOGETHER, go, str(i), *cmd[3:]], env=env))
    while len([n for n in os.listdir(root) if n.startswith(f".go-{job}.")]) < nodes:
        time.sleep(0.1)
    with open(go, "w"):
        pass
    deadline = time.monotonic() + timeout
    codes = []
    for a in agents:
        try:
            codes.append(a.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            a.kill()
            codes.append(a.wait())
    print(f"AGENTS exited {codes}", flush=True)
    for name in os.listdir(root):
        if name.startswith(".go-"):
            os.remove(os.path.join(root, name))
    faults = os.path.join(root, "faults.jsonl")
    if os.path.exists(faults):
        with open(faults) as fh:
            for line in fh:
                v = json.loads(line)
                print(f"FAULT rank {v['rank']} ({v['kind']}) on {v['host']}, judged after "
                      f"{v['silent']:.2f}s of silence", flush=True)
    with open(events) as fh:
        evs = [json.loads(line) for line in fh]
    for e in evs:
        if e["ev"] == "fault":
            print(f"INJECTED {e['signal']} into rank {e['rank']} at step {e['step']}", flush=True)
    worlds = sorted({e["world"] for e in evs if e["ev"] == "done"})
    print(f"FINISHED on world size {worlds}", flush=True)
    with contextlib.suppress(Exception):  # a stopped rank that nothing isolated: do not leave it behind
        for e in evs:
            if e["ev"] == "fault":
                os.kill(e["pid"], signal.SIGKILL)
    return 0 if worlds else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("train", "demo"):
        p = sub.add_parser(name)
        p.add_argument("root")
        p.add_argument("--steps", type=int, default=16)
        p.add_argument("--fault-rank", type=int, default=-1)
        p.add_argument("--fault-step", type=int, default=-1)
        p.add_argument("--fault-signal", choices=("kill", "stop"), default="kill")
        p.add_argument("--fault-delay", type=float, default=0.02)
        p.add_argument("--events", default=None)
    sub.choices["train"].add_argument("--timeout", type=float, default=60.0)
    sub.choices["train"].add_argument("--keep-all", action="store_true")
    sub.choices["train"].add_argument("--no-watchdog", action="store_true", help="the stock behaviour, for comparison")
    sub.choices["train"].add_argument("--broken", choices=("no-optimizer", "wrong-shard"), default=None,
                                      help="negative controls for the tests: a deliberately wrong resume")
    sub.choices["demo"].add_argument("--fault", choices=("kill", "stop", "none"), default="kill")
    sub.choices["demo"].add_argument("--no-watchdog", action="store_true", help="stock torchrun, for comparison")
    sub.choices["demo"].add_argument("--timeout", type=float, default=60.0, help="gloo timeout of the workers")
    args = ap.parse_args(argv)
    if args.mode == "train":
        fault = Fault(args.fault_rank, args.fault_step, args.fault_signal, args.fault_delay) \
            if args.fault_rank >= 0 else None
        train(args.root, args.steps, fault=fault, events=args.events, timeout=args.timeout,
              keep_all=args.keep_all, broken=args.broken, watchdog=not args.no_watchdog)
        return 0
    rng = np.random.default_rng()
    fault = None if args.fault == "none" else Fault(
        int(rng.integers(4)) if args.fault_rank < 0 else args.fault_rank,
        int(rng.integers(3, args.steps - 4)) if args.fault_step < 0 else args.fault_step,
        args.fault, float(rng.uniform(0, 0.05)))
    extra = ("--timeout", str(args.timeout), *(("--no-watchdog",) if args.no_watchdog else ()))
    return demo(args.root, args.steps, fault, extra=extra)


if __name__ == "__main__":
    sys.exit(main())

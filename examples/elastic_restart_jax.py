"""Elastic restart in JAX: four processes (``jax.distributed``, CPU, two devices each) lose one;
the watchdog names it and the job resumes on the three others (six devices).

    python examples/elastic_restart_jax.py ROOT --fault-signal stop --fault-rank 2 --fault-step 5
    python examples/elastic_restart_jax.py REF                              # uninterrupted

An MLP whose weights and AdamW moments are sharded over a 1-D mesh of every device of every
process is trained with optax; the jitted step runs cross-process collectives (gloo). Each
process checkpoints its own shards every step (``ckptbridge.Checkpointer``) and runs a
``ckptbridge.Watchdog`` that reports through the ``jax.distributed`` key-value store. When a
process is killed (SIGKILL) or stopped (SIGSTOP), the others name it within the bound, commit
the last complete step and exit with status 75; the launcher below (JAX has no elastic agent,
so this script is its own) relaunches the processes that exited with 75, and they resume from
``Checkpointer.latest()`` on fewer devices, each device reading only its own box. Losses print
as ``LOSS step value``.

Process 0 runs JAX's coordination service (and with it the key-value store); when it dies, JAX
itself aborts every process (its design), so faults are injected into processes 1..N-1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

D_IN, HIDDEN, D_OUT, BATCH, DEVICES = 16, 48, 8, 24, 2


def emit(path: str | None, **event: object) -> None:
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(event) + "\n").encode())
        finally:
            os.close(fd)


def batch(step: int) -> tuple:
    import numpy as np

    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    return x, np.tanh(x[:, :D_OUT]).astype(np.float32)


def build(mesh: object) -> tuple:
    """Weights and AdamW state sharded by rows over ``mesh``, and the jitted train step."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    rows = NamedSharding(mesh, PartitionSpec("data", None))
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.device_put(jax.random.normal(k1, (HIDDEN, D_IN)) * 0.3, rows),
              "w2": jax.device_put(jax.random.normal(k2, (HIDDEN, D_OUT)) * 0.3, rows)}
    tx = optax.adamw(1e-2, weight_decay=0.1)

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"].T) @ p["w2"] - y) ** 2)

    def train_step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return params, tx.init(params), jax.jit(train_step)


def reference_losses(steps: int, mesh: object) -> list[float]:
    """The uninterrupted run in this process (no jax.distributed), on ``mesh``."""
    params, opt_state, step_fn = build(mesh)
    out = []
    for step in range(steps):
        params, opt_state, loss = step_fn(params, opt_state, *batch(step))
        out.append(float(loss))
    return out


def worker(args: argparse.Namespace) -> int:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.nproc, process_id=args.pid,
                               initialization_timeout=120)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import ckptbridge
    from ckptbridge.adapters import jax as cbjax

    rank, world = jax.process_index(), jax.process_count()
    emit(args.events, ev="start", rank=rank, world=world, pid=os.getpid(), time=time.time())
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data", None))  # 48 rows: 6 per device on 8, 8 on 6
    replicated = NamedSharding(mesh, PartitionSpec())
    params, opt_state, step_fn = build(mesh)
    ck = ckptbridge.Checkpointer(args.root, keep_last=None, rank=rank, world_size=world, job_id=args.job)
    start = 0
    latest = ck.latest()
    if latest is not None:  # resume: each device reads only its own box
        t0 = time.perf_counter()
        ckpt = ckptbridge.open(ck.path_of(latest))
        adam = opt_state[0]
        names = {**{f"params.{k}": rows for k in params}, **{f"mu.{k}": rows for k in params},
                 **{f"nu.{k}": rows for k in params}, "count": replicated}
        got = cbjax.load(ckpt, names)
        params = {k: got[f"params.{k}"] for k in params}
        adam = adam._replace(mu={k: got[f"mu.{k}"] for k in params}, nu={k: got[f"nu.{k}"] for k in params},
                             count=got["count"].astype(adam.count.dtype))
        opt_state = (adam, *opt_state[1:])
        start = latest + 1
        emit(args.events, ev="resumed", rank=rank, world=world, step=latest, bytes=ckpt.stats.bytes_read,
             seconds=time.perf_counter() - t0, time=time.time())

    def on_fault(verdicts: list) -> None:
        faulty = sorted(v.rank for v in verdicts)
        emit(args.events, ev="verdict", rank=rank, faulty=faulty, time=time.time(),
             code=ckptbridge.EXIT_FAULTY if rank in faulty else ckptbridge.EXIT_RESTART)

    now = [start]  # the step the loop is in: where the fault lands (a late timer lands in a later one)
    with ckptbridge.Watchdog(ck, on_fault=on_fault) as wd:
        for step in range(start, args.steps):
            now[0] = step
            if step == args.fault_step and rank == args.fault_rank and latest is None:
                sig = signal.SIGKILL if args.fault_signal == "kill" else signal.SIGSTOP

                def fire(step: int = step, sig: int = sig) -> None:
                    emit(args.events, ev="fault", rank=rank, step=step, at=now[0], signal=args.fault_signal,
                         pid=os.getpid(), time=time.time())
                    os.kill(os.getpid(), sig)

                threading.Timer(args.fault_delay, fire).start()
            params, opt_state, loss = step_fn(params, opt_state, *batch(step))
            loss = float(loss)
            if rank == 0:
                print(f"LOSS {step} {loss:.9g}", flush=True)
                emit(args.events, ev="loss", step=step, loss=loss, world=world, time=time.time())
            adam = opt_state[0]
            ck.save(step, {"params": params, "mu": adam.mu, "nu": adam.nu, "count": adam.count})
            wd.step(step)
        ck.wait()
    ck.close()
    emit(args.events, ev="done", rank=rank, world=world, time=time.time())
    jax.distributed.shutdown()
    return 0


def launch(args: argparse.Namespace) -> int:
    """JAX's missing elastic agent: relaunch the processes that exited with 75 (healthy), at the
    smaller size, until the job succeeds (at most ``--max-restarts`` times)."""
    os.makedirs(args.root, exist_ok=True)
    events = args.events or os.path.join(args.root, "events.jsonl")
    nproc = args.nproc
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for attempt in range(args.max_restarts + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        job = uuid.uuid4().hex[:8]
        fault = ["--fault-rank", str(args.fault_rank), "--fault-step", str(args.fault_step), "--fault-signal",
                 args.fault_signal, "--fault-delay", str(args.fault_delay)] if attempt == 0 else []
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), args.root, "--worker", "--pid", str(i),
                                   "--nproc", str(nproc), "--port", str(port), "--job", job, "--steps",
                                   str(args.steps), "--events", events, *fault], env=env) for i in range(nproc)]
        codes = [p.wait() for p in procs]
        print(f"ATTEMPT {attempt} on {nproc} processes exited {codes}", flush=True)
        if all(c == 0 for c in codes):
            return 0
        nproc = sum(c == 75 for c in codes)  # the healthy ones; the faulty one stays out
        if nproc == 0:
            return 1
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fault-rank", type=int, default=-1)
    ap.add_argument("--fault-step", type=int, default=-1)
    ap.add_argument("--fault-signal", choices=("kill", "stop"), default="kill")
    ap.add_argument("--fault-delay", type=float, default=0.01)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--events", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--job", default="job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fault_rank == 0:
        raise SystemExit("process 0 runs JAX's coordination service; inject faults into 1..N-1")
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    sys.exit(main())

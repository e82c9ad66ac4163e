"""Elastic restart after a fault: 4 ranks -> one dies -> resume on 3 ranks (uneven shards).

    python examples/elastic_restart.py ROOT --world 4 --steps 8 --kill-rank 3 --kill-step 5
    python examples/elastic_restart.py ROOT --world 3 --steps 8          # resumes from ROOT
    python examples/elastic_restart.py REF  --world 4 --steps 8          # an uninterrupted run

A small MLP is trained with FSDP2 (``fully_shard``) on CPU/gloo ranks. Every
step, each rank checkpoints its own shards of the parameters and of the Adam
moments asynchronously (``ckptbridge.Checkpointer``, lazily copied, guarded
by the optimizer hook); rank 0 commits a step once every rank's pieces are
on disk. When a rank dies, the others notice at their next collective (a
short gloo timeout), report it and exit with status 3, without hanging; the
step in flight is never committed. A relaunch with any number of ranks reads
the newest complete step, each rank reading only the bytes of its own shards
(30 rows over 3 ranks: 10/10/10; 10 outputs: 4/4/2), and training continues:
the losses printed (``LOSS step value``) continue those of an uninterrupted
run. The global batch is fixed, so the math is the same on any world size
(up to floating-point reduction order).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

GLOBAL_BATCH, D_IN, HIDDEN, D_OUT = 24, 16, 30, 10


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, D_IN)).astype(np.float32)
    return x, np.tanh(x @ np.ones((D_IN, D_OUT), np.float32) / 4).astype(np.float32)


def worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import ckptbridge
    from ckptbridge.adapters.torch._leaves import dtensor_box

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    names = {p: n for n, p in model.named_parameters()}
    ck = ckptbridge.Checkpointer(args.root, keep_last=3, commit_timeout=args.timeout)

    def state() -> dict:
        out = {"model": {n: p for p, n in names.items()}}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = {names[p]: s[key] for p, s in opt.state.items()}
        out["adam_step"] = {names[p]: s["step"] for p, s in opt.state.items()}
        return out

    start = 0
    latest = ck.latest()
    if latest is not None:  # resume: each rank reads only its own boxes
        ckpt = ckptbridge.open(ck.path_of(latest))
        with torch.no_grad():
            for p, n in names.items():
                box, _ = dtensor_box(p)
                p.to_local().copy_(torch.from_numpy(ckpt[f"model.{n}"].read(box)))
                opt.state[p] = {
                    "step": torch.tensor(float(ckpt[f"adam_step.{n}"].read())),
                    **{k: DTensor.from_local(torch.from_numpy(ckpt[f"{k}.{n}"].read(box)), p.device_mesh,
                                             p.placements, run_check=False, shape=p.shape, stride=p.stride())
                       for k in ("exp_avg", "exp_avg_sq")},
                }
        start = latest + 1
        if rank == 0:
            print(f"RESUMED from step {latest} on {world} ranks, read {ckpt.stats.bytes_read} bytes on rank 0",
                  flush=True)
    per_rank = GLOBAL_BATCH // world
    try:
        for step in range(start, args.steps):
            if step == args.kill_step and rank == args.kill_rank:
                print(f"rank {rank} dies at step {step}", flush=True)
                os._exit(1)
            x, y = batch(step)
            lo = rank * per_rank
            xb, yb = torch.from_numpy(x[lo : lo + per_rank]), torch.from_numpy(y[lo : lo + per_rank])
            loss = (model(xb) - yb).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = loss.detach().clone() / world
            dist.all_reduce(total)
            if rank == 0:
                print(f"LOSS {step} {total.item():.9g}", flush=True)
            ck.save(step, state(), optimizer=opt)
        ck.wait()
    except RuntimeError as err:  # a peer is gone: collectives time out
        print(f"rank {rank}: lost a peer at step {step} ({type(err).__name__}); exiting for a restart",
              flush=True)
        os._exit(3)
    ck.close()
    dist.barrier()  # no rank tears gloo down while a peer still talks to it (that aborts the peer)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds before a lost peer is noticed")
    args = ap.parse_args(argv)
    if GLOBAL_BATCH % args.world:
        raise SystemExit(f"--world must divide the global batch {GLOBAL_BATCH}")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(worker, args=(args.world, args, port), nprocs=args.world, join=False,
                             start_method="spawn")
    codes = []
    for proc in ctx.processes:
        proc.join()
        codes.append(proc.exitcode)
    print(f"EXIT codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 3


if __name__ == "__main__":
    sys.exit(main())

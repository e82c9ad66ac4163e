#!/usr/bin/env python
"""torch DCP: load a checkpoint onto a changed placement; ckptbridge vs ``dcp.load``.

    python bench/bench_torch_load.py [--quick | --size 1g | --size 8g]

A real ``torch.distributed.checkpoint.save`` of standard-normal fp32 tensors (4096 x 4096
each, ``gib`` in all), saved as ``Shard(0)`` on a 2-rank gloo mesh, is loaded back as
``Shard(1)`` on 2 ranks (every saved chunk overlaps every new shard). Each case spawns its
2 ranks in a fresh process tree; rank 0 opens the timed region after a barrier and closes it
after the barrier that follows the load, so the time is the slowest rank's. Start-up (spawn,
imports, gloo) is the start-up probe's, reported on its own. Peak memory and bytes read are
the whole tree's (both ranks), measured the same way for both tools.

* ``dcp.load`` into ``Shard(1)`` DTensors (its only setting: ``FileSystemReader`` takes no
  tuning options), with the destination allocated before the clock and inside it;
* ckptbridge ``adapters.torch.load_into`` the same DTensors from the same directory
  (opened in place), and ``adapters.torch.load`` (allocation inside the clock).

After the clock each rank sums what it loaded; the sums are compared across tools
(``checksum`` column: the same values loaded).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Case, Column, Size, Suite, main, region, warm

ROWS = COLS = 4096
WORLD = 2


def _n(ctx) -> int:
    return max(1, round(ctx.gib * (1 << 30) / (ROWS * COLS * 4)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn_name: str, port: int, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=1800))
    try:
        globals()[fn_name](rank, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(fn_name: str, *args: object) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_entry, args=(fn_name, _port(), args), nprocs=WORLD, start_method="spawn")


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _make(rank: int, path: str, n: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh()
    g = torch.Generator().manual_seed(rank)
    rows = ROWS // WORLD
    sd = {f"layers.{i}.weight": DTensor.from_local(torch.randn(rows, COLS, generator=g), mesh, [Shard(0)],
                                                   run_check=False, shape=torch.Size((ROWS, COLS)),
                                                   stride=(COLS, 1)) for i in range(n)}
    dcp.save({"model": sd}, checkpoint_id=path)


def prepare(ctx) -> None:
    _spawn("_make", ctx.input("dcp"), _n(ctx))
    os.sync()


def _target(n: int, mesh) -> dict:
    """``Shard(1)`` DTensors to load into, allocated and touched."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    cols = -(-COLS // WORLD)
    out = {f"layers.{i}.weight": DTensor.from_local(torch.empty(ROWS, cols), mesh, [Shard(1)], run_check=False,
                                                    shape=torch.Size((ROWS, COLS)), stride=(COLS, 1))
           for i in range(n)}
    for t in out.values():
        t.to_local().zero_()
    return out


def _checksum(rank: int, out: dict, result: str) -> None:
    s = sum(float(t.to_local().double().sum()) for t in out.values())
    with open(result if result == os.devnull else f"{result}.r{rank}", "w") as fh:
        fh.write(repr(s))


def _load(rank: int, method: str, path: str, n: int, result: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard

    if method.startswith("cb"):
        warm.ckptbridge(torch=True)
    import ckptbridge
    from ckptbridge.adapters import torch as cbt

    mesh = _mesh()
    out = _target(n, mesh) if method in ("dcp", "cb_into") else None
    if out is None:  # DTensor's first use costs seconds of lazy set-up in torch: not the load's time
        _checksum(rank, _target(1, mesh), os.devnull)
    dist.barrier()
    with region() if rank == 0 else _null():
        if method == "dcp":
            dcp.load({"model": out}, checkpoint_id=path)
        elif method == "dcp_alloc":
            out = _target(n, mesh)
            dcp.load({"model": out}, checkpoint_id=path)
        elif method == "cb_into":
            with ckptbridge.open(path) as ck:
                cbt.load_into(out, ck)
        else:
            with ckptbridge.open(path) as ck:
                out = cbt.load(ck, mesh, [Shard(1)])
        dist.barrier()
    _checksum(rank, out, result)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _case(ctx, method: str) -> None:
    result = ctx.out("checksum")
    _spawn("_load", method, ctx.input("dcp"), _n(ctx), result)
    total = 0.0
    for r in range(WORLD):
        with open(f"{result}.r{r}") as fh:
            total += float(fh.read())
    ctx.metrics["checksum"] = total
    ctx.metrics["_region_elsewhere"] = True


def load_dcp(ctx):
    _case(ctx, "dcp")


def load_dcp_alloc(ctx):
    _case(ctx, "dcp_alloc")


def load_cb_into(ctx):
    _case(ctx, "cb_into")


def load_cb(ctx):
    _case(ctx, "cb_alloc")


def _startup(rank: int) -> None:
    import torch.distributed.checkpoint  # noqa: F401

    import ckptbridge.adapters.torch  # noqa: F401

    _mesh()


def startup(ctx):
    """Spawn the 2 ranks, import torch (DCP) and ckptbridge, init gloo and the mesh: timed whole."""
    with ctx.region():
        _spawn("_startup")


G = "load a 2-rank Shard(0) DCP checkpoint as Shard(1) on 2 ranks"
SUITE = Suite(
    name="dcp", module="bench_torch_load",
    title="torch DCP: load onto a changed placement (ckptbridge vs dcp.load)",
    description=__doc__.split("\n\n", 2)[2].strip(),
    prepare="prepare",
    prepare_mem_gib=lambda g: g + 1.5,
    disk_gib=lambda g: 1.2 * g,
    sizes={"quick": Size("quick", 1 / 16, reps=1), "1g": Size("1g", 1.0, reps=3), "8g": Size("8g", 8.0, reps=2)},
    cases=(
        Case("dcp/prealloc", G, "torch DCP", "default (dcp.load; destination allocated before the clock)",
             fn="load_dcp", startup="ranks", mem_gib=lambda g: 2 * g + 1.5),
        Case("dcp/alloc", G, "torch DCP", "default, destination allocated inside the clock", fn="load_dcp_alloc",
             startup="ranks", mem_gib=lambda g: 2 * g + 1.5),
        Case("cb/into", G, "ckptbridge", "adapters.torch.load_into (destination allocated before the clock)",
             "ours", fn="load_cb_into", startup="ranks", ref=True, mem_gib=lambda g: g + 1.5),
        Case("cb/alloc", G, "ckptbridge", "adapters.torch.load (allocates inside the clock)", "ours",
             fn="load_cb", startup="ranks", mem_gib=lambda g: g + 1.5),
    ),
    startups={"ranks": Case("startup/ranks", "start-up", "2 ranks", "spawn, import torch + DCP + ckptbridge, gloo",
                            fn="startup")},
    columns=(Column("checksum", "sum of the values loaded", "{:.6g}"),),
)


if __name__ == "__main__":
    sys.exit(main([SUITE]))

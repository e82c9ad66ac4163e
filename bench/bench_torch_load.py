"""Load a DCP checkpoint onto a changed placement: ckptbridge vs ``dcp.load``.

A real ``torch.distributed.checkpoint.save`` of ~1 GiB of fp32 standard-normal
tensors, saved as ``Shard(0)`` on a 2-rank gloo mesh, is loaded back as
``Shard(1)`` on the same mesh (every saved chunk overlaps every new shard):

* ``dcp``: ``dcp.load`` into DTensors with ``Shard(1)`` placements;
* ``ckptbridge``: ``ckptbridge.adapters.torch.load_into`` the same DTensors from
  the same directory (opened in place: metadata, then only each rank's columns).

Both fill destination DTensors allocated (and touched) before the clock starts;
``--alloc`` adds both with the allocation inside the clock (``dcp-alloc``, and
``cb-alloc`` = ``ckptbridge.adapters.torch.load``, which returns new DTensors).

Per method, fresh processes (so peak RSS is per method), ranks synchronised
with a barrier before and after; reported: wall time (slowest rank), bytes
read per rank (ckptbridge: its read counter; DCP: ``rchar`` from
``/proc/self/io``, i.e. bytes returned by read syscalls), peak RSS per rank
(``ru_maxrss``; for ckptbridge it includes the page-cache pages its memory
maps touched), and a checksum showing both loaded the same values.
Warm page cache by default (the checkpoint was just written); ``--cold`` drops
the page cache before each load (needs root). Methods alternate over ``--reps``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_torch_load.py --size-gib 1 --reps 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time

from _common import drop_caches

ROWS = 4096  # each tensor is ROWS x COLS fp32 (64 MiB)
COLS = 4096


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn_name: str, world: int, port: int, out: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    result = globals()[fn_name](rank, world, *args)
    with open(os.path.join(out, f"r{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn_name: str, world: int, *args: object) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(fn_name, world, _port(), out, args), nprocs=world, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(out, f"r{r}.pkl"), "rb") as fh:
                results.append(pickle.load(fh))
        return results


def _io_rchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def make(rank: int, world: int, path: str, n: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh(world)
    g = torch.Generator().manual_seed(rank)
    rows = ROWS // world
    sd = {f"layers.{i}.weight": DTensor.from_local(torch.randn(rows, COLS, generator=g), mesh, [Shard(0)],
                                                   run_check=False, shape=torch.Size((ROWS, COLS)),
                                                   stride=(COLS, 1)) for i in range(n)}
    t0 = time.perf_counter()
    dcp.save({"model": sd}, checkpoint_id=path)
    return {"save_s": time.perf_counter() - t0}


def _finish(rank: int, t0: float, rchar0: int, out: dict, extra: dict) -> dict:
    import torch.distributed as dist

    dist.barrier()
    seconds = time.perf_counter() - t0
    checksum = sum(float(t.to_local().double().sum()) for t in out.values())
    return {"seconds": seconds, "rchar": _io_rchar() - rchar0, "checksum": checksum,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **extra}


def load_dcp(rank: int, world: int, path: str, n: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    target = _target(world, n)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    rchar0, t0 = _io_rchar(), time.perf_counter()
    dcp.load({"model": target}, checkpoint_id=path)
    return _finish(rank, t0, rchar0, target, {"rss_before": base})


def _target(world: int, n: int) -> dict:
    """The DTensors (Shard(1)) to load into, allocated and touched before the clock starts."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh(world)
    cols = -(-COLS // world)
    target = {f"layers.{i}.weight": DTensor.from_local(torch.empty(ROWS, cols), mesh, [Shard(1)], run_check=False,
                                                       shape=torch.Size((ROWS, COLS)), stride=(COLS, 1))
              for i in range(n)}
    for t in target.values():
        t.to_local().zero_()
    return target


def load_ckptbridge(rank: int, world: int, path: str, n: int) -> dict:
    import torch.distributed as dist

    import ckptbridge as cb_open
    from ckptbridge.adapters import torch as cbt

    out = _target(world, n)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    rchar0, t0 = _io_rchar(), time.perf_counter()
    ckpt = cb_open.open(path)
    t_open = time.perf_counter() - t0
    cbt.load_into(out, ckpt)
    res = _finish(rank, t0, rchar0, out, {"rss_before": base, "bytes_read": ckpt.stats.bytes_read,
                                          "open_s": t_open})
    ckpt.close()
    return res


def load_dcp_alloc(rank: int, world: int, path: str, n: int) -> dict:
    """``dcp.load`` with the allocation of its destination DTensors inside the clock."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    _mesh(world)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    rchar0, t0 = _io_rchar(), time.perf_counter()
    target = _target(world, n)
    dcp.load({"model": target}, checkpoint_id=path)
    return _finish(rank, t0, rchar0, target, {"rss_before": base})


def load_ckptbridge_alloc(rank: int, world: int, path: str, n: int) -> dict:
    """``ckptbridge.adapters.torch.load``: returns new DTensors (allocation inside the clock)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import ckptbridge as cb_open
    from ckptbridge.adapters import torch as cbt

    mesh = _mesh(world)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    rchar0, t0 = _io_rchar(), time.perf_counter()
    ckpt = cb_open.open(path)
    t_open = time.perf_counter() - t0
    out = cbt.load(ckpt, mesh, [Shard(1)])
    res = _finish(rank, t0, rchar0, out, {"rss_before": base, "bytes_read": ckpt.stats.bytes_read,
                                          "open_s": t_open})
    ckpt.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument("--alloc", action="store_true",
                    help="also time both with the destination allocated inside the clock")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    n = max(1, round(a.size_gib * (1 << 30) / (ROWS * COLS * 4)))
    work = a.dir or tempfile.mkdtemp(prefix="bench_torch_load_")
    path = os.path.join(work, "dcp")
    shutil.rmtree(path, ignore_errors=True)
    try:
        made = spawn("make", a.world, path, n)
        total = n * ROWS * COLS * 4
        print(f"checkpoint: {n} tensors of {ROWS}x{COLS} fp32 = {total / 2**30:.2f} GiB, DCP save on "
              f"{a.world} ranks as Shard(0): {max(m['save_s'] for m in made):.2f} s")
        methods = [("dcp", "load_dcp"), ("ckptbridge", "load_ckptbridge")]
        if a.alloc:
            methods += [("dcp-alloc", "load_dcp_alloc"), ("cb-alloc", "load_ckptbridge_alloc")]
        runs: dict[str, list[list[dict]]] = {m: [] for m, _ in methods}
        cold_ok = True
        for _ in range(a.reps):
            for method, fn in methods:
                if a.cold:
                    cold_ok = drop_caches() and cold_ok
                runs[method].append(spawn(fn, a.world, path, n))
        regime = "cold" if a.cold and cold_ok else "warm"
        summary = {}
        for method, reps in runs.items():
            secs = [max(r["seconds"] for r in rep) for rep in reps]
            summary[method] = {
                "seconds_median": statistics.median(secs), "seconds": secs,
                "bytes_read_per_rank": [r.get("bytes_read", r["rchar"]) for r in reps[-1]],
                "peak_rss_per_rank": [r["peak_rss"] for r in reps[-1]],
                "rss_before_per_rank": [r["rss_before"] for r in reps[-1]],
                "checksum_per_rank": [round(r["checksum"], 3) for r in reps[-1]],
            }
        same = summary["dcp"]["checksum_per_rank"] == summary["ckptbridge"]["checksum_per_rank"]
        ratio = summary["dcp"]["seconds_median"] / summary["ckptbridge"]["seconds_median"]
        print(f"load as Shard(1) on {a.world} ranks ({regime} page cache, {a.reps} rep(s), median):")
        for method, s in summary.items():
            print(f"  {method:10s} {s['seconds_median']:7.2f} s  (reps {', '.join(f'{x:.2f}' for x in s['seconds'])})"
                  f"  read/rank {', '.join(f'{b / 2**20:.0f}' for b in s['bytes_read_per_rank'])} MiB"
                  f"  peak RSS/rank {', '.join(f'{b / 2**20:.0f}' for b in s['peak_rss_per_rank'])} MiB"
                  f" (before load {', '.join(f'{b / 2**20:.0f}' for b in s['rss_before_per_rank'])})")
        print("  ckptbridge open (metadata) s per rank:", [round(r["open_s"], 3) for r in runs["ckptbridge"][-1]])
        print(f"  ckptbridge is {ratio:.2f}x faster than dcp.load; same values loaded: {same}")
        if a.alloc:
            r2 = summary["dcp-alloc"]["seconds_median"] / summary["cb-alloc"]["seconds_median"]
            print(f"  with allocation inside the clock: {r2:.2f}x")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"regime": regime, "gib": total / 2**30, "world": a.world, "ratio": ratio,
                           "same_values": same, **summary}, fh, indent=1)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Training-loop cost of asynchronous checkpointing, one clock for every tool.

    python bench/bench_async.py [--gib 1.0] [--steps 12] [--every 2] [--regimes compute,disk]
                                [--reps 3] [--warmup 1] [--no-donate] [--policy k=v,...]
                                [--out bench/results] [--name bench_async]

A torch loop (AdamW) and a JAX/optax loop, each holding ``gib`` GiB of
parameters + Adam moments, save every ``every`` steps with each tool:

- torch: none, ``torch.save`` (synchronous, fsync'd), DCP ``async_save``, ``ckptbridge.Checkpointer``;
- JAX: none, Orbax ``CheckpointManager`` (async) at its default zstd compression and with
  compression off, ``ckptbridge.Checkpointer`` (a guarded train step). The jitted step donates
  its state (``donate_argnums``, as real loops do; ``--no-donate`` for one that does not).

In the disk regime ckptbridge also runs with the other back-pressure policies
(``SavePolicy(on_busy="coalesce")`` and, for JAX, ``"skip"``): they write fewer checkpoints,
so their rows are not comparable with the others' and show what the policy buys.

Two regimes: ``compute`` (steps of ~2 s: the disk keeps up with a save every two steps) and
``disk`` (steps of ~0.3 s: the disk cannot keep up, so the loop is bound by bytes / disk
speed). The number of matmuls standing in for forward/backward is calibrated once per
framework (the same for every tool).

The same clock for every tool, each case in a fresh process:

- **loop time**: wall time of the whole loop, from the first step to the last save on disk
  (``wait_until_finished`` / the last future / ``ck.wait()``);
- **the same loop without checkpoints**, run first in the same process (``--steps`` steps):
  the baseline of that case. Step times differ by 10-20% from one process to the next on a
  shared VM (the ``none`` rows' range shows it), more than the 5% the loop bound allows, so
  every loop is compared with its own process's loop without checkpoints; the ``none`` case
  (a second loop without checkpoints) shows what that ratio reads when nothing is saved;
- **stall per save**: wall time around the save call, plus the next train step's time minus
  the median step of the loop without checkpoints (this is where a wait in an optimizer hook
  or a guarded step shows up, and background work competing for the cores too). Not clipped
  at zero: a step a little faster than the median counts as such, so that step noise averages
  out in the median instead of adding up (the steps' median absolute deviation is printed).
  ckptbridge's stall is split into the time training waited for its snapshot (in ``save`` and
  in guards, the checkpointer's own ``SaveStats.stall_seconds``) and the rest, the next step
  slowed while the flush runs; beside it, what a bare ``O_DIRECT`` write of the same bytes in
  the checkpointer's pattern costs the steps it overlaps (measured with the loaded disk);
- **bytes written**: ``/proc/self/io`` ``write_bytes`` over the loop.

Warm-up: every tool (or none, ``--warmup 0``) saves the state ``--warmup`` times and waits
for it to finish before the clock starts; no tool gets anything else outside the clock.
Machine facts measured in the same run: cores, memory, one host memcpy of the state, the
disk's raw write speed (best of a buffered fsync'd write and O_DIRECT with 1 and 3 streams of
8 MiB writes and 3 of 16 MiB, the checkpointer's pattern, each write from its own pages, into a
new file and over a file already written: the checkpointer overwrites the files of the step its
retention drops, and on this VM's disk, mounted with ``discard``, that is ~1.7x faster).
The bounds the issue sets are printed beside each ckptbridge figure: stall / memcpy, loop
time / the peer's, loop time / max(the same process's loop without checkpoints, bytes written
/ raw disk). Each case process also measures the raw disk the same way while its own train step
runs (``loaded_disk_gbps``): on a VM the virtual disk's I/O shares the CPUs the step keeps busy,
so the disk a loop can have may differ from the idle figure; the loop is printed against that
bound too.
Results: ``bench/results/bench_async.json`` and ``.md`` (``--name`` for another stem; ratios are
what to compare). Each case runs ``--reps`` times, interleaved with the others, and medians are
reported (stalls pooled over every save of every run), with each run kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

CASES = {"torch": ["none", "torch_save", "dcp_async", "ckptbridge"],
         "jax": ["none", "orbax", "orbax_nozstd", "ckptbridge"]}
EXTRA_CASES = {"torch": ["ckptbridge_coalesce"], "jax": ["ckptbridge_coalesce", "ckptbridge_skip"]}
N_TENSORS = 8
COLS = 4096


def _rows(gib: float) -> int:
    return max(1, int(gib * (1 << 30) / 3 / 4 / N_TENSORS / COLS))  # params + exp_avg + exp_avg_sq


def _write_bytes() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("write_bytes")).split()[1])


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------ the loops (run in a fresh process)

def _torch_loop(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    import torch

    torch.set_num_threads(1)  # on a shared 2-core VM two OpenMP threads are slower than one
    torch.manual_seed(0)
    rows = _rows(spec["gib"])
    params = [torch.nn.Parameter(torch.randn(rows, COLS)) for _ in range(N_TENSORS)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randn(1024, 1024) / 32

    def train_step() -> None:
        y = x
        for _ in range(spec["units"]):  # stands in for forward/backward
            y = torch.tanh(y @ x)
        for p in params:
            p.grad = p.detach() * 1e-3 + y[0, 0] * 1e-9  # moments as incompressible as real ones
        opt.step()

    def state() -> dict[str, Any]:
        return {"model": {f"w{i}": p for i, p in enumerate(params)},
                "optim": {str(i): s for i, s in enumerate(opt.state_dict()["state"].values())}}

    train_step()  # materialise the moments
    return train_step, state, opt


def _jax_loop(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    rows = _rows(spec["gib"])
    holder: dict[str, Any] = {"p": {f"w{i}": jax.random.normal(jax.random.key(i), (rows, COLS))
                                    for i in range(N_TENSORS)}}
    tx = optax.adamw(1e-3)
    holder["s"] = tx.init(holder["p"])
    x = jax.random.normal(jax.random.key(99), (1024, 1024)) / 32
    units = spec["units"]

    def step(p: Any, s: Any) -> Any:
        y = jax.lax.fori_loop(0, units, lambda _, y: jnp.tanh(y @ x), x)  # stands in for forward/backward
        g = jax.tree.map(lambda w: w * 1e-3 + y[0, 0] * 1e-9, p)  # moments as incompressible as real ones
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    jitted = jax.jit(step, donate_argnums=(0, 1) if spec["donate"] else ())
    box: dict[str, Any] = {"fn": jitted}

    def train_step() -> None:
        holder["p"], holder["s"] = box["fn"](holder["p"], holder["s"])
        jax.block_until_ready(holder["p"])

    def state() -> dict[str, Any]:
        return {"params": holder["p"], "opt": holder["s"]}

    train_step()  # compile
    return train_step, state, box


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """One (framework, tool) loop; returns its measurements."""
    fw, tool, root = spec["framework"], spec["tool"], spec["root"]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    train_step, state, handle = (_torch_loop if fw == "torch" else _jax_loop)(spec)
    out: dict[str, Any] = {"framework": fw, "tool": tool}

    plain = []
    t_plain = time.perf_counter()
    for _ in range(spec["steps"]):  # the same loop without checkpoints, in this process: the baseline
        t = time.perf_counter()
        train_step()
        plain.append(time.perf_counter() - t)
    out["plain_loop_seconds"] = time.perf_counter() - t_plain
    step_base = statistics.median(plain)
    out["step_seconds"] = step_base
    out["loaded_disk_gbps"], out["raw_write_step_cost"] = _loaded_disk(root, state(), train_step, step_base)
    out["step_mad"] = statistics.median(abs(p - step_base) for p in plain)  # the step-to-step noise

    save, finish, ck = _saver(spec, state, handle)
    for w in range(spec["warmup"] if save is not None else 0):  # given to every tool alike
        save(w)
        finish()
    stalls, saves_made = [], 0
    w0 = _write_bytes()
    t_loop = time.perf_counter()
    pending = 0.0
    for i in range(spec["steps"]):
        if save is not None and i % spec["every"] == 0:
            t = time.perf_counter()
            save(spec["warmup"] + i)
            pending = time.perf_counter() - t
            saves_made += 1
        t = time.perf_counter()
        train_step()
        took = time.perf_counter() - t
        if save is not None and i % spec["every"] == 0:
            stalls.append(pending + took - step_base)  # unclipped: step noise averages out in the median
    if finish is not None:
        finish()
    out["loop_seconds"] = time.perf_counter() - t_loop
    out["bytes_written"] = _write_bytes() - w0
    out["saves"] = saves_made
    out["stalls"] = stalls
    out["stall_median"] = statistics.median(stalls) if stalls else 0.0
    if ck is not None:
        timed = [s for s in ck.stats if s.step >= spec["warmup"]]
        out["flush_gbps"] = statistics.median(s.flush_gbps for s in timed) if timed else None
        out["dropped"] = [s for s in ck.dropped if s >= spec["warmup"]]
        out["waits"] = [s.stall_seconds for s in timed]  # in save and in guards: training waiting for its snapshot
        out["saves_written"] = len(timed)
        ck.close()
    last = max((e.path for e in os.scandir(root)), key=os.path.getmtime, default=None)  # the newest save
    out["checkpoint_bytes"] = (_tree_bytes(last) if os.path.isdir(last) else os.path.getsize(last)) if last else 0
    return out


def _saver(spec: dict[str, Any], state: Any, handle: Any) -> tuple[Any, Any, Any]:
    """(save(step), finish(), the Checkpointer or None) for one tool; Nones for the loop without checkpoints."""
    tool, root = spec["tool"], spec["root"]
    if tool == "none":
        return None, None, None
    if tool == "torch_save":
        import torch

        def save_pt(step: int) -> None:
            path = os.path.join(root, f"step{step:08d}.pt")
            torch.save(state(), path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            for old in sorted(os.listdir(root))[:-2]:
                os.remove(os.path.join(root, old))

        return save_pt, lambda: None, None
    if tool == "dcp_async":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        fut: list[Any] = []

        def save_dcp(step: int) -> None:
            if fut:
                fut.pop().result()
            for old in sorted(os.listdir(root))[:-1]:
                shutil.rmtree(os.path.join(root, old))
            fut.append(dcp.async_save(state(), checkpoint_id=os.path.join(root, f"step{step:08d}")))

        return save_dcp, lambda: fut.pop().result() if fut else None, None
    if tool.startswith("orbax"):
        import orbax.checkpoint as ocp

        compress = tool == "orbax"
        mgr = ocp.CheckpointManager(
            root, options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True),
            item_handlers=ocp.PyTreeCheckpointHandler(use_compression=compress))

        def save_orbax(step: int) -> None:
            mgr.save(step, args=ocp.args.PyTreeSave(state()))

        return save_orbax, mgr.wait_until_finished, None
    from ckptbridge import Checkpointer, SavePolicy

    policy = SavePolicy(**{"on_busy": tool.split("_", 1)[1] if "_" in tool else "wait", **spec["policy"]})
    ck = Checkpointer(root, keep_last=2, policy=policy)
    if spec["framework"] == "torch":
        opt = handle

        def save_ours(step: int) -> None:
            ck.save(step, state(), optimizer=opt)  # opt.step() waits for the snapshot if needed
    else:
        handle["fn"] = ck.guard(handle["fn"])  # the step waits only for snapshots of what it donates

        def save_ours(step: int) -> None:
            ck.save(step, state())
    return save_ours, ck.wait, ck


# O_DIRECT write patterns tried for the raw disk speed: (streams, MiB per write, into a file whose
# blocks are already written); the checkpointer writes 16 MiB pieces, 3 at a time, and overwrites
# the files of the step its retention drops (a new file on a disk mounted with ``discard``, as
# here, is blocks the virtual disk must allocate again)
_DIRECT_MODES = {"direct1": (1, 8, False), "direct3": (3, 8, False), "direct3x16": (3, 16, False),
                 "rewrite3x16": (3, 16, True)}


def _raw_pool(arrays: Any) -> Any:
    """A page-aligned copy of ``arrays``' bytes (numpy-convertible leaves of a state tree), the
    source of the raw disk writes: the data a checkpoint writes, never a block written over and
    over (this VM's virtual disk takes a repeated 1 MiB pattern up to ~1.25x faster than
    non-repeating random data, so a repeated block overstates the disk). The checkpointer's own
    kind of buffer (huge pages): shared anonymous memory writes up to 1.7x slower here, which
    would understate the disk."""
    import numpy as np

    from ckptbridge._storage.hostmem import aligned_buffer

    leaves = [np.asarray(a.detach() if hasattr(a, "detach") else a).reshape(-1).view(np.uint8)
              for a in _leaves(arrays)]
    pool = aligned_buffer(sum(a.size for a in leaves))
    out, at = np.frombuffer(pool, np.uint8), 0
    for a in leaves:
        out[at : at + a.size] = a
        at += a.size
    return pool


def _leaves(tree: Any) -> list[Any]:
    if hasattr(tree, "items"):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree] if getattr(tree, "ndim", 0) else []


def _modes_for(nbytes: int) -> list[str]:
    """The ``_DIRECT_MODES`` that write at least one whole piece of ``nbytes``."""
    return [m for m, (_, mib, _) in _DIRECT_MODES.items() if mib << 20 <= nbytes]


def _direct_write(path: str, nbytes: int, mode: str, pool: Any) -> float:
    """Write ``nbytes`` (rounded down to whole writes) from ``pool`` (:func:`_raw_pool`, cycled if
    smaller) in the ``_DIRECT_MODES`` pattern ``mode`` with ``O_DIRECT``, fsync, delete; returns
    GB/s: the disk's raw speed, no page cache. A rewrite mode first writes the file, untimed."""
    streams, mib, rewrite = _DIRECT_MODES[mode]
    offs = list(range(0, nbytes - nbytes % (mib << 20), mib << 20))
    if rewrite:
        _direct_pass(path, offs, mib << 20, streams, pool, os.O_CREAT | os.O_TRUNC)
    t = time.perf_counter()
    _direct_pass(path, offs, mib << 20, streams, pool, 0 if rewrite else os.O_CREAT | os.O_TRUNC)
    seconds = time.perf_counter() - t
    os.remove(path)
    return len(offs) * (mib << 20) / seconds / 1e9


def _direct_pass(path: str, offs: list[int], chunk: int, streams: int, pool: Any, flags: int) -> None:
    import threading

    fd = os.open(path, os.O_WRONLY | os.O_DIRECT | flags, 0o644)
    view = memoryview(pool)

    def run(k: int) -> None:
        for i in range(k, len(offs), streams):
            at = i * chunk % (len(pool) - len(pool) % chunk)
            os.pwrite(fd, view[at : at + chunk], offs[i])

    ths = [threading.Thread(target=run, args=(k,)) for k in range(streams)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    os.fsync(fd)
    os.close(fd)


def _loaded_disk(root: str, state: Any, train_step: Any, step_base: float) -> tuple[float, float | None]:
    """The raw disk speed (best of the ``O_DIRECT`` patterns, as in :func:`_facts`) writing this
    process's ``state`` while its train step runs (on a VM the virtual disk shares the CPUs the
    step keeps busy), and what the checkpointer's pattern (``direct3x16``) costs the steps it
    overlaps: the sum of their times minus ``step_base`` each (None: the state is smaller)."""
    from concurrent.futures import ThreadPoolExecutor

    pool, best, cost = _raw_pool(state), 0.0, None
    nbytes = len(pool)
    with ThreadPoolExecutor(1) as ex:
        for mode in _modes_for(nbytes):
            fut = ex.submit(_direct_write, os.path.join(root, "raw-loaded"), nbytes, mode, pool)
            steps = []
            while not fut.done():
                steps.append(_timed(train_step))
            best = max(best, fut.result())
            if mode == "direct3x16":
                cost = sum(steps) - step_base * len(steps)
    pool.close()
    return best, cost


def _facts(spec: dict[str, Any]) -> dict[str, Any]:
    """One host memcpy of the state and the disk's raw write speed, in this run."""
    import numpy as np

    root = spec["root"]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    nbytes = 3 * N_TENSORS * _rows(spec["gib"]) * COLS * 4
    src = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in once
    times = []
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    raw = memoryview(src).cast("B")
    pool = _raw_pool(src)
    best: dict[str, float] = {}
    for i in range(2):
        for mode in ("buffered", *_modes_for(nbytes)):
            path = os.path.join(root, f"raw{i}{mode}")
            if mode == "buffered":
                t = time.perf_counter()
                with open(path, "wb") as fh:
                    fh.write(raw)
                    fh.flush()
                    os.fsync(fh.fileno())
                gbps = nbytes / (time.perf_counter() - t) / 1e9
                os.remove(path)
            else:
                gbps = _direct_write(path, nbytes, mode, pool)
            best[mode] = max(best.get(mode, 0.0), gbps)
    return {"state_bytes": nbytes, "memcpy_seconds": min(times), "disk_modes_gbps": best,
            "disk_gbps": max(best.values()), "cores": os.cpu_count(),
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)}


def _calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds of one step without compute units, and per unit (for this framework)."""
    spec = dict(spec, units=0)
    train_step, _, _ = (_torch_loop if spec["framework"] == "torch" else _jax_loop)(spec)
    t0 = statistics.median(_timed(train_step) for _ in range(3))
    spec["units"] = 16  # the torch step reads it at each call; JAX compiles a new step
    if spec["framework"] == "jax":
        del train_step
        train_step, _, _ = _jax_loop(spec)
    t16 = statistics.median(_timed(train_step) for _ in range(3))
    return {"base": t0, "unit": max(1e-4, (t16 - t0) / 16)}


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------ the driver

def _child(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, json.dumps(spec)],
                         capture_output=True, text=True, env=env)
    shutil.rmtree(spec["root"], ignore_errors=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case over its repetitions: medians (stalls pooled over every save), with the raw runs."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    for key in ("loop_seconds", "plain_loop_seconds", "bytes_written", "step_seconds", "step_mad", "flush_gbps",
                "saves_written", "checkpoint_bytes", "loaded_disk_gbps"):
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    stalls = [s for r in ok for s in r["stalls"]]
    out["stall_median"] = statistics.median(stalls) if stalls else 0.0
    waits = [s for r in ok for s in r.get("waits", [])]
    if waits:
        out["wait_median"] = statistics.median(waits)
    costs = [r["raw_write_step_cost"] for r in ok if r.get("raw_write_step_cost") is not None]
    if costs:
        out["raw_write_step_cost"] = statistics.median(costs)
    out["loop_range"] = [min(r["loop_seconds"] for r in ok), max(r["loop_seconds"] for r in ok)]
    out["reps"] = runs
    return out


def _aggregate_facts(facts: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(facts[0])
    for key in ("memcpy_seconds", "disk_gbps"):
        out[key] = statistics.median(f[key] for f in facts)
        out[key + "_range"] = [min(f[key] for f in facts), max(f[key] for f in facts)]
    out["disk_modes_gbps"] = {m: statistics.median(f["disk_modes_gbps"][m] for f in facts)
                              for m in facts[0]["disk_modes_gbps"]}
    out["reps"] = facts
    return out


def _bound_ratio(r: dict[str, Any], disk: float | None) -> float:
    """Median over runs of loop time / max(the same process's loop without checkpoints, bytes / raw disk);
    ``disk`` None: each run's raw disk speed under its own loop's compute (``loaded_disk_gbps``)."""
    runs = [x for x in r.get("reps", [r]) if "loop_seconds" in x]
    return statistics.median(x["loop_seconds"] / max(x["plain_loop_seconds"],
                                                     x["bytes_written"] / 1e9 / (disk or x["loaded_disk_gbps"]))
                             for x in runs)


def _table(res: dict[str, Any], args: argparse.Namespace) -> str:
    facts = res["facts"]
    memcpy, disk = facts["memcpy_seconds"], facts["disk_gbps"]
    lo, hi = facts["disk_gbps_range"]
    lines = [f"# bench_async: {args.gib} GiB state, {args.steps} steps, a save every {args.every}, "
             f"warm-up {args.warmup} save(s) per tool, JAX step {'donates' if args.donate else 'does not donate'}"
             f" its state; medians of {args.reps} interleaved runs", "",
             f"{facts['cores']} cores, {facts['memory_gib']:.0f} GiB; one host memcpy of the state "
             f"({facts['state_bytes'] / (1 << 30):.2f} GiB): {memcpy:.3f} s; raw disk write {disk:.2f} GB/s "
             f"({lo:.2f}-{hi:.2f} across runs; best of "
             + ", ".join(f"{k} {v:.2f}" for k, v in facts["disk_modes_gbps"].items()) + ")", ""]
    for regime, per_fw in res["regimes"].items():
        lines += [f"## regime `{regime}`", "",
                  "| loop | checkpointing | step (s) ± MAD | median stall per save (s) | stall / memcpy | saves written "
                  "| GB written | loop time (s), median (range) | same loop without checkpoints (s) "
                  "| loop / max(no ckpt, GB written / raw disk) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for fw, cases in per_fw.items():
            for tool, r in cases.items():
                if "error" in r:
                    lines.append(f"| {fw} | {tool} | error: {r['error']} | | | | | | | |")
                    continue
                written = r.get("saves_written", r["saves"])
                stall = "—" if tool == "none" else f"{r['stall_median']:.3f}"
                ratio = "—" if tool == "none" else f"{r['stall_median'] / memcpy:.2f}x"
                lines.append(f"| {fw} | {tool} | {r['step_seconds']:.2f} ± {r['step_mad']:.2f} | {stall} | {ratio} "
                             f"| {written} | {r['bytes_written'] / 1e9:.2f} | {r['loop_seconds']:.2f} "
                             f"({r['loop_range'][0]:.1f}-{r['loop_range'][1]:.1f}) | {r['plain_loop_seconds']:.2f} | "
                             f"{_bound_ratio(r, disk):.2f}x |")
        lines.append("")
        for fw, cases in per_fw.items():
            ours = cases.get("ckptbridge", {})
            if "loop_seconds" not in ours:
                continue
            noise = cases.get("none", {})
            bits = [f"stall {ours['stall_median'] / memcpy:.2f}x one memcpy (target <= 1.5x)"
                    + (f" = {ours['wait_median']:.3f} s waiting for the snapshot ({ours['wait_median'] / memcpy:.2f}x)"
                       f" + {ours['stall_median'] - ours['wait_median']:.3f} s the next step slowed while the flush "
                       "runs" if "wait_median" in ours else "")
                    + (f" (a raw O_DIRECT write of the same bytes, 3 x 16 MiB, costs the steps it overlaps "
                       f"{ours['raw_write_step_cost']:.3f} s in all)" if "raw_write_step_cost" in ours else ""),
                    f"loop {_bound_ratio(ours, disk):.2f}x max(same loop without checkpoints "
                    f"{ours['plain_loop_seconds']:.2f} s, {ours['bytes_written'] / 1e9:.2f} GB / raw disk = "
                    f"{ours['bytes_written'] / 1e9 / disk:.2f} s) (target <= 1.05x"
                    + (f"; the same ratio for a second loop without checkpoints: {_bound_ratio(noise, disk):.2f}x)"
                       if "loop_seconds" in noise else ")")]
            for peer in ("orbax", "orbax_nozstd"):
                if "loop_seconds" in cases.get(peer, {}):
                    bits.append(f"loop / {peer}'s {ours['loop_seconds'] / cases[peer]['loop_seconds']:.2f}x "
                                "(target <= 1.0x)")
            loaded = ours["loaded_disk_gbps"]
            if loaded > 0:  # 0: a state smaller than one raw write
                bits.append(f"the raw disk while this loop computes: {loaded:.2f} GB/s ({loaded / disk:.2f}x idle); "
                            f"loop {_bound_ratio(ours, None):.2f}x max(same loop without checkpoints, "
                            f"{ours['bytes_written'] / 1e9:.2f} GB / that speed = "
                            f"{ours['bytes_written'] / 1e9 / loaded:.2f} s)")
            if ours.get("flush_gbps"):
                bits.append(f"flush {ours['flush_gbps']:.2f} GB/s = {ours['flush_gbps'] / disk:.2f}x raw disk"
                            + (f", {ours['flush_gbps'] / loaded:.2f}x under the loop's compute" if loaded > 0 else ""))
            lines.append(f"- {fw} ckptbridge: " + "; ".join(bits))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[3])
        fn = {"case": run_case, "facts": _facts, "calibrate": _calibrate}[sys.argv[2]]
        print(json.dumps(fn(spec)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="saves (waited for) before the clock, for every tool")
    ap.add_argument("--reps", type=int, default=3, help="runs of every case, interleaved; medians reported")
    ap.add_argument("--regimes", default="compute,disk", help="compute (steps ~2 s), disk (steps ~0.3 s)")
    ap.add_argument("--step-seconds", default="compute=2.0,disk=0.3")
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--cases", default="", help="comma-separated tools to run (default: all, plus the extra "
                    "back-pressure policies in the disk regime)")
    ap.add_argument("--policy", default="", help="SavePolicy fields for the ckptbridge cases, e.g. "
                    "flush_priority=background,snapshot_threads=1 (default: the defaults)")
    ap.add_argument("--no-donate", dest="donate", action="store_false", help="JAX step without donate_argnums")
    ap.add_argument("--scratch", default="bench/out", help="where checkpoints are written (the disk measured)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="bench_async", help="results file stem (OUT/NAME.json and .md)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    targets = dict(kv.split("=") for kv in args.step_seconds.split(","))
    common = {"gib": args.gib, "steps": args.steps, "every": args.every, "warmup": args.warmup,
              "donate": args.donate,
              "policy": {k: int(v) if v.isdigit() else v
                         for k, v in (kv.split("=") for kv in filter(None, args.policy.split(",")))}}
    frameworks = args.frameworks.split(",")
    res: dict[str, Any] = {"args": vars(args), "calibration": [], "regimes": {}}
    wanted = set(filter(None, args.cases.split(",")))
    facts: list[dict[str, Any]] = []
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):  # cases interleaved, so that a noisy minute hits every tool alike
        facts.append(_child("facts", {**common, "root": os.path.abspath(os.path.join(args.scratch, "facts"))}))
        print(f"rep {rep}:", json.dumps(facts[-1]), flush=True)
        for regime in args.regimes.split(","):
            for fw in frameworks:  # per run: the machine's load drifts; every tool of a run gets the same step
                cal = _child("calibrate", {**common, "framework": fw, "units": 0,
                                           "root": os.path.abspath(os.path.join(args.scratch, "cal"))})
                res["calibration"].append({"rep": rep, "regime": regime, "framework": fw, **cal})
                units = max(0, round((float(targets[regime]) - cal["base"]) / cal["unit"]))
                for tool in CASES[fw] + (EXTRA_CASES[fw] if regime == "disk" else []):
                    if wanted and tool not in wanted and tool != "none":
                        continue
                    spec = {**common, "framework": fw, "tool": tool, "units": units,
                            "root": os.path.abspath(os.path.join(args.scratch, f"async_{fw}_{tool}"))}
                    r = _child("case", spec)
                    runs.setdefault((regime, fw, tool), []).append(r)
                    print(rep, regime, fw, tool, json.dumps({k: v for k, v in r.items() if k != "stalls"}), flush=True)
    res["facts"] = _aggregate_facts(facts)
    from _proc import provenance

    res.update(provenance())
    for (regime, fw, tool), rs in runs.items():
        res["regimes"].setdefault(regime, {}).setdefault(fw, {})[tool] = _aggregate(rs)
    text = _table(res, args)
    print(text)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Checkpointing inside a training loop: what it costs the loop, measured the same way for every tool.

    python bench/bench_async.py [--quick | --size 1g]

A torch loop (AdamW) and a JAX/optax loop, parameters + both Adam moments = ``gib`` GiB
(``rows x 4096`` fp32 tensors), each step ``compute`` 1024^3 matmuls standing in for
forward/backward, then the optimizer step. Each case runs in a fresh process: warm-up steps
(no checkpoint) give the loop's own step time, then the timed region runs ``steps`` steps,
checkpointing every ``every`` steps, and ends when the last checkpoint is durable (every
tool's own wait). Nothing is prepared outside the clock for any tool (no ``reserve()``, no
pre-allocated staging): first saves pay for their memory. Per save, the loop code (the same
for every tool) records:

* ``save call s``: wall time around the tool's save call;
* ``stall s``: the save call plus what the step after it took beyond the loop's own step
  time (waits the loop pays later: ckptbridge's optimizer hook or ``guard``, DCP's staging
  wait, CPU the background writer takes from training). The first save (which pays for
  every tool's set-up: buffers, staging memory, DCP's checkpoint process) is reported on
  its own; the medians are of the later saves;
* ``loop overhead per save s``: (region time - the same loop without checkpoints) / saves;
* ``stall / one memcpy``: the stall over one host memcpy of the state, memcpy speed
  measured in the same run (machine facts).

Tools: ``torch.save`` (synchronous, fsync'd); DCP ``async_save`` at its defaults (thread,
staging in the call) and with its recommended options (a persistent ``DefaultStager`` with
shared memory and background staging, the checkpoint process executor; the loop waits for
staging before the optimizer step, for the upload before the next save); Orbax
``CheckpointManager`` (async) at its defaults (zstd) and without compression; ckptbridge
``Checkpointer`` (torch: ``save(..., optimizer=opt)``; JAX: ``guard(train_step)``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Case, Column, Size, Suite, main, warm

N = 8
COLS = 4096
WARM_STEPS = 3


def _rows(gib: float) -> int:
    return max(1, int(gib * (1 << 30) / 3 / 4 / N / COLS))  # params + exp_avg + exp_avg_sq


def _loop(ctx, save, step_fn, finish, block=lambda: None) -> None:
    """The one loop every case runs: warm-up steps, then the timed region (see module docs)."""
    steps, every = ctx.param("steps"), ctx.param("every")
    warm_times = []
    for _ in range(WARM_STEPS):
        t = time.perf_counter()
        step_fn()
        block()
        warm_times.append(time.perf_counter() - t)
    base = statistics.median(warm_times)
    calls, stalls, saves = [], [], 0
    with ctx.region():
        for step in range(steps):
            t0 = time.perf_counter()
            saved = save is not None and step % every == 0
            if saved:
                save(step)
                saves += 1
            t1 = time.perf_counter()
            step_fn()
            block()
            t2 = time.perf_counter()
            if saved:
                calls.append(t1 - t0)
                stalls.append((t1 - t0) + max(0.0, (t2 - t1) - base))
        finish()
    ctx.metrics.update(base_step_s=base, saves=saves, state_bytes=int(3 * N * _rows(ctx.gib) * COLS * 4))
    if saves:
        later = stalls[1:] or stalls
        ctx.metrics.update(save_call_s=statistics.median(calls[1:] or calls), stall_s=statistics.median(later),
                           first_stall_s=stalls[0], stalls=stalls, save_calls=calls)


def _retire(paths: list[str], keep: int = 2) -> None:
    while len(paths) > keep:
        shutil.rmtree(paths.pop(0), ignore_errors=True)


# ------------------------------------------------------------------------------------ torch

def _torch_setup(ctx):
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(_rows(ctx.gib), COLS)) for _ in range(N)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randn(1024, 1024)
    compute = ctx.param("compute")

    def step_fn():
        y = x
        for _ in range(compute):
            y = torch.tanh(y @ x)
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt.step()

    def state():
        return {"model": {f"w{i}": p for i, p in enumerate(params)},
                "optim": {str(i): s for i, s in enumerate(opt.state_dict()["state"].values())}}

    return opt, step_fn, state


def torch_none(ctx):
    _, step_fn, _ = _torch_setup(ctx)
    _loop(ctx, None, step_fn, lambda: None)


def torch_save(ctx):
    import torch

    _, step_fn, state = _torch_setup(ctx)
    done: list[str] = []

    def save(step):
        p = ctx.out(f"step{step}.pt")
        torch.save(state(), p)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        done.append(p)
        _retire(done)

    _loop(ctx, save, step_fn, lambda: None)


def _dcp_init():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)


def torch_dcp(ctx):
    import torch.distributed.checkpoint as dcp

    _, step_fn, state = _torch_setup(ctx)
    _dcp_init()
    pending = {"fut": None}
    done: list[str] = []

    def save(step):
        if pending["fut"] is not None:
            pending["fut"].result()
            _retire(done)
        p = ctx.out(f"step{step}")
        pending["fut"] = dcp.async_save(state(), checkpoint_id=p)
        done.append(p)

    def finish():
        if pending["fut"] is not None:
            pending["fut"].result()

    _loop(ctx, save, step_fn, finish)


def torch_dcp_tuned(ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    opt, step_fn, state = _torch_setup(ctx)
    _dcp_init()
    pending = {"resp": None, "stager": None}
    done: list[str] = []

    def save(step):
        if pending["resp"] is not None:
            pending["resp"].upload_completion.result()
            _retire(done)
        if pending["stager"] is None:  # created on the first save, inside the clock like everyone's set-up
            pending["stager"] = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                             use_async_staging=True, use_non_blocking_copy=False))
        p = ctx.out(f"step{step}")
        pending["resp"] = dcp.async_save(state(), checkpoint_id=p, async_stager=pending["stager"],
                                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        done.append(p)

    def wait_staged(*_):  # the optimizer must not change the tensors while DCP still copies them
        if pending["resp"] is not None:
            pending["resp"].staging_completion.result()

    opt.register_step_pre_hook(wait_staged)

    def finish():
        if pending["resp"] is not None:
            pending["resp"].upload_completion.result()
        if pending["stager"] is not None:
            pending["stager"].close()

    _loop(ctx, save, step_fn, finish)


def torch_ckptbridge(ctx):
    import ckptbridge

    warm.ckptbridge(torch=True)
    opt, step_fn, state = _torch_setup(ctx)
    box = {}

    def save(step):
        if "ck" not in box:
            box["ck"] = ckptbridge.Checkpointer(ctx.out("ck"), keep_last=2)
        box["ck"].save(step, state(), optimizer=opt)

    def finish():
        if "ck" in box:
            box["ck"].close()  # waits for every save to be flushed and committed

    _loop(ctx, save, step_fn, finish)


# ------------------------------------------------------------------------------------ JAX

def _jax_setup(ctx):
    import jax
    import jax.numpy as jnp
    import optax

    params = {f"w{i}": jax.random.normal(jax.random.key(i), (_rows(ctx.gib), COLS)) for i in range(N)}
    tx = optax.adamw(1e-3)
    box = {"params": params, "opt": tx.init(params)}
    x = jax.random.normal(jax.random.key(99), (1024, 1024))
    compute = ctx.param("compute")

    @jax.jit
    def train_step(p, s):
        y = x
        for _ in range(compute):
            y = jnp.tanh(y @ x)
        g = jax.tree.map(lambda w: jnp.full_like(w, 1e-3) + 0 * y[0, 0], p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    box["step"] = train_step

    def step_fn():
        box["params"], box["opt"] = box["step"](box["params"], box["opt"])

    def block():
        jax.block_until_ready(box["params"])

    return box, step_fn, block


def jax_none(ctx):
    _, step_fn, block = _jax_setup(ctx)
    _loop(ctx, None, step_fn, lambda: None, block)


def _orbax(ctx, compress: bool) -> None:
    import orbax.checkpoint as ocp

    box, step_fn, block = _jax_setup(ctx)
    mgr = {}

    def save(step):
        if "m" not in mgr:
            opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
            kw = {} if compress else {"item_handlers": ocp.PyTreeCheckpointHandler(use_compression=False)}
            mgr["m"] = ocp.CheckpointManager(ctx.out("orbax"), options=opts, **kw)
        tree = {"params": box["params"], "opt": box["opt"]}
        mgr["m"].save(step, args=ocp.args.StandardSave(tree) if compress else ocp.args.PyTreeSave(tree))

    def finish():
        if "m" in mgr:
            mgr["m"].wait_until_finished()
            mgr["m"].close()

    _loop(ctx, save, step_fn, finish, block)


def jax_orbax(ctx):
    _orbax(ctx, True)


def jax_orbax_nozstd(ctx):
    _orbax(ctx, False)


def jax_ckptbridge(ctx):
    import ckptbridge

    warm.ckptbridge()
    box, step_fn, block = _jax_setup(ctx)
    ck = {}

    def save(step):
        if "ck" not in ck:
            ck["ck"] = ckptbridge.Checkpointer(ctx.out("ck"), keep_last=2)
            box["step"] = ck["ck"].guard(box["step"])  # each step first waits for pending snapshots
        ck["ck"].save(step, {"params": box["params"], "opt": box["opt"]})

    def finish():
        if "ck" in ck:
            ck["ck"].close()

    _loop(ctx, save, step_fn, finish, block)


def derive(doc: dict) -> None:
    """Loop overhead per save (vs the group's no-checkpoint row) and stall / one memcpy."""
    memcpy = (doc.get("machine") or {}).get("memcpy_gbps")
    for g in doc["groups"]:
        cases = [c for c in doc["cases"] if c["group"] == g["group"] and c["status"] == "ok" and c["median"]]
        base = next((c for c in cases if c["role"] == "baseline"), None)
        for c in cases:
            med = c["median"]
            saves = med.get("m.saves")
            if base is not None and saves:
                med["m.overhead_per_save_s"] = (med["wall_s"] - base["median"]["wall_s"]) / saves
            if memcpy and med.get("m.stall_s") is not None and med.get("m.state_bytes"):
                med["m.stall_over_memcpy"] = med["m.stall_s"] / (med["m.state_bytes"] / memcpy / 1e9)


T = "torch loop (AdamW)"
J = "JAX loop (optax adamw)"
SUITE = Suite(
    name="async", module="bench_async",
    title="Checkpointing in a training loop (ckptbridge.Checkpointer vs torch.save, DCP async_save, Orbax)",
    description=__doc__.split("\n\n", 2)[2].strip(),
    sizes={
        "quick": Size("quick", 1 / 32, reps=1, params={"steps": 4, "every": 2, "compute": 2}),
        "1g": Size("1g", 1.0, reps=3, params={"steps": 12, "every": 2, "compute": 40}),
        "8g": Size("8g", 8.0, reps=2, params={"steps": 8, "every": 2, "compute": 40}),
    },
    cases=(
        Case("torch/none", T, "no checkpoints", "the loop alone", "baseline", fn="torch_none",
             mem_gib=lambda g: 1.2 * g + 1),
        Case("torch/torch.save", T, "torch.save", "default, synchronous, fsync'd", fn="torch_save",
             mem_gib=lambda g: 1.5 * g + 1),
        Case("torch/dcp", T, "torch DCP async_save", "default (thread, staging in the call)", fn="torch_dcp",
             mem_gib=lambda g: 3.2 * g + 1),
        Case("torch/dcp-tuned", T, "torch DCP async_save",
             "recommended: persistent DefaultStager (shared memory, background staging), process executor",
             fn="torch_dcp_tuned", mem_gib=lambda g: 3.2 * g + 1.5),
        Case("torch/ckptbridge", T, "ckptbridge", "Checkpointer.save(..., optimizer=opt)", "ours",
             fn="torch_ckptbridge", mem_gib=lambda g: 3.2 * g + 1),
        Case("jax/none", J, "no checkpoints", "the loop alone", "baseline", fn="jax_none",
             mem_gib=lambda g: 2.2 * g + 1),
        Case("jax/orbax", J, "Orbax CheckpointManager", "default (async, zstd)", fn="jax_orbax",
             mem_gib=lambda g: 4.5 * g + 1),
        Case("jax/orbax-nozstd", J, "Orbax CheckpointManager", "async, use_compression=False",
             fn="jax_orbax_nozstd", mem_gib=lambda g: 4.5 * g + 1),
        Case("jax/ckptbridge", J, "ckptbridge", "Checkpointer.save + guard(train_step)", "ours",
             fn="jax_ckptbridge", mem_gib=lambda g: 4.2 * g + 1),
    ),
    columns=(
        Column("first_stall_s", "first save's stall s", "{:.3f}"),
        Column("save_call_s", "later saves: median save call s", "{:.4f}"),
        Column("stall_s", "later saves: median stall s", "{:.4f}"),
        Column("stall_over_memcpy", "stall / one memcpy", "{:.2f}"),
        Column("overhead_per_save_s", "loop overhead per save s", "{:.3f}"),
    ),
    derive="derive",
    disk_gib=lambda g: 3 * g,  # every tool keeps its last 2 checkpoints
    env={"JAX_PLATFORMS": "cpu"},
)


if __name__ == "__main__":
    sys.exit(main([SUITE]))

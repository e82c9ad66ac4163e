#!/usr/bin/env python
"""Train the tiny GPT in JAX on a 2x4 mesh, save with ckptbridge, continue it as an FSDP2 model.

JAX side: the Flax NNX GPT (``examples/models/flax_gpt.py``), batch sharded
over ``data`` (2), parameters over ``model`` (4), optax AdamW; the train
state is saved with ``ckptbridge.adapters.flax.save`` (universal directory:
weights, ``exp_avg`` = ``mu``, ``exp_avg_sq`` = ``nu``, ``step`` = ``count``)
and JAX then continues itself for reference. torch side: the torch GPT
(``examples/models/torch_gpt.py``) wrapped with FSDP2 ``fully_shard`` on 2
gloo ranks; ``ckptbridge.adapters.torch.load_module`` / ``load_optimizer``
fill it through the rule set ``gpt_rules.flax_to_torch()`` (layers unstacked,
kernels transposed, q/k/v fused back into ``qkv``), each rank reading only
its shards, and torch AdamW trains on::

    python examples/migrate_jax_to_torch.py /tmp/jax_run --steps 3 --more 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import socket
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

OPTIMIZER_MODES = ("full", "none", "reset_step")


def train_in_jax(out: str, steps: int = 3, more: int = 3, seed: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps on a 2x4 mesh, save ``out/ckpt``, then continue ``more`` steps.

    Returns (and writes to ``out/losses.json``) the losses and JAX's own continuation losses.
    """
    from ckptbridge.adapters import flax as cbflax
    from examples.migrate_deepspeed_to_jax import init_state, mesh_of, train

    mesh = mesh_of(8, ("data", "model"), (2, 4))
    graphdef, params, tx, opt_state = init_state(mesh, "model", scan=True, seed=seed)
    first, params, opt_state = train(graphdef, params, opt_state, tx, range(steps), mesh, "data")
    ckpt = os.path.join(out, "ckpt")
    cbflax.save(ckpt, params, opt_state, step=steps)
    cont, _, _ = train(graphdef, params, opt_state, tx, range(steps, steps + more), mesh, "data")
    result = {"mesh": {"data": 2, "model": 4}, "steps": steps, "losses": first,
              "continuation_losses": cont, "ckpt": ckpt}
    with open(os.path.join(out, "losses.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


def _rank_job(rank: int, world: int, port: int, ckpt_path: str, steps: int, modes: tuple[str, ...],
              result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result: Any = ("ok", {m: _continue(rank, world, ckpt_path, steps, m) for m in modes})
    except BaseException as err:  # report it to the parent
        import traceback

        result = ("error", f"{err!r}\n{traceback.format_exc()}")
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    if result[0] == "ok":
        dist.barrier()  # no rank tears gloo down while a peer still talks to it (that aborts the peer)
    dist.destroy_process_group()


def _continue(rank: int, world: int, ckpt_path: str, steps: int, optimizer: str) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptbridge
    from ckptbridge.adapters import torch as cbt
    from examples.models import gpt_rules
    from examples.models import torch_gpt as T

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)  # any init: everything comes from the checkpoint
    model = T.TinyGPT()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(T.param_groups(model), lr=T.LR, betas=T.BETAS, eps=T.EPS)
    rules = gpt_rules.flax_to_torch(scan=True)
    with ckptbridge.open(ckpt_path) as ckpt:
        cbt.load_module(model, ckpt, rules=rules)
        if optimizer != "none":
            cbt.load_optimizer(opt, model, ckpt, rules=rules)
        if optimizer == "reset_step":
            for st in opt.state.values():
                st["step"].zero_()
        start = int(ckpt.step)
    micro = T.GLOBAL_BATCH // world
    losses = []
    for step in range(start, start + steps):
        x, y = T.make_batch(step)
        loss = model(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), T.CLIP)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def continue_in_torch(ckpt_path: str, steps: int = 3, world: int = 2,
                      optimizer: str | tuple[str, ...] = "full") -> Any:
    """Continue the saved JAX run as an FSDP2 model on ``world`` gloo ranks; the losses.

    ``optimizer``: ``"full"``, or a negative control: ``"none"`` (no Adam
    state loaded) or ``"reset_step"`` (moments loaded, step 0). A tuple of
    modes runs each in the same processes and returns ``{mode: losses}``.
    """
    import torch.multiprocessing as mp

    modes = (optimizer,) if isinstance(optimizer, str) else tuple(optimizer)
    for m in modes:
        if m not in OPTIMIZER_MODES:
            raise ValueError(f"optimizer mode {m!r} is not one of {OPTIMIZER_MODES}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        for attempt in range(3):  # another job may grab the free port before rank 0 binds it
            try:
                mp.start_processes(_rank_job, args=(world, _free_port(), ckpt_path, steps, modes, out),
                                   nprocs=world, start_method="spawn")
                break
            except mp.ProcessRaisedException as err:
                if "address already in use" not in str(err).lower() or attempt == 2:
                    raise
        results = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.pkl"), "rb") as fh:
                status, value = pickle.load(fh)
            if status != "ok":
                raise RuntimeError(f"rank {r} failed: {value}")
            results.append(value)
    return results[0][optimizer] if isinstance(optimizer, str) else results[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="a new directory for the JAX run and its checkpoint")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ref = train_in_jax(args.out, args.steps, args.more)
    ours = continue_in_torch(ref["ckpt"], args.more)
    for i, (a, b) in enumerate(zip(ours, ref["continuation_losses"])):
        print(f"step {args.steps + i}: torch FSDP2 {a:.6f}   jax {b:.6f}   diff {abs(a - b):.2e}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Continue a DeepSpeed ZeRO run in JAX/optax, straight from the DeepSpeed checkpoint.

The torch tiny GPT (``examples/models/torch_gpt.py``) was trained with
DeepSpeed ZeRO-2 on 2 ranks; this script opens that checkpoint with
ckptbridge (no conversion step), maps it onto the Flax NNX model
(``examples/models/flax_gpt.py``) with the rule set of
``ckptbridge.adapters.gpt_rules`` (fused QKV split, transposes, layers
stacked for ``nnx.scan``), loads weights *and* the AdamW state (``exp_avg``
-> ``mu``, ``exp_avg_sq`` -> ``nu``, ``step`` -> ``count``) sharded over a
4-device mesh, and trains on with optax AdamW using the hyper-parameters the
checkpoint recorded (lr, betas, eps, weight decay on matrices only, gradient
clipping)::

    python examples/migrate_deepspeed_to_jax.py tests/fixtures/migration/ds_zero2_w2/ckpt --steps 4

It prints JAX's losses next to DeepSpeed's own continuation (``losses.json``
next to the checkpoint, when there). Run on CPU with fake devices:
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

OPTIMIZER_MODES = ("full", "none", "reset_step", "swap_moments")
_TX: dict[Any, Any] = {}


def mesh_of(n: int = 4, axes: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None) -> Any:
    """A mesh over the first ``n`` devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:n]).reshape(shape or (n,)), axes)


def param_sharding(mesh: Any, axis: str) -> Any:
    """``(shape) -> NamedSharding``: the last dim sharded over ``axis`` when it divides, else replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    size = mesh.shape[axis]

    def pick(shape: tuple[int, ...]) -> Any:
        if shape and shape[-1] % size == 0:
            return NamedSharding(mesh, P(*([None] * (len(shape) - 1)), axis))
        return NamedSharding(mesh, P())

    return pick


def deepspeed_hyperparameters(ckpt: Any) -> dict[str, Any]:
    """The AdamW hyper-parameters a DeepSpeed checkpoint recorded (its optimizer's param groups
    and ``gradient_clipping``), as keyword arguments of ``flax_gpt.optimizer``.

    The groups must be the GPT's two: one decayed (the matrices) and one without decay.
    """
    groups = list(ckpt.extra.get("param_groups") or [])
    if not groups:
        raise ValueError(f"{ckpt.path}: no optimizer param groups recorded")
    first = groups[0]
    decays = sorted({float(g.get("weight_decay", 0.0)) for g in groups})
    if len(decays) > 2 or (len(decays) == 2 and decays[0] != 0.0):
        raise ValueError(f"{ckpt.path}: weight decays {decays}: expected one decayed group and one without")
    for g in groups[1:]:
        if (g["lr"], list(g["betas"]), g["eps"]) != (first["lr"], list(first["betas"]), first["eps"]):
            raise ValueError(f"{ckpt.path}: param groups differ in lr/betas/eps: {groups}")
    clip = (ckpt.extra.get("ds_config") or {}).get("gradient_clipping", 0.0)
    return {"lr": float(first["lr"]), "betas": tuple(float(b) for b in first["betas"]),
            "eps": float(first["eps"]), "weight_decay": decays[-1], "clip": float(clip) or float("inf")}


def init_state(mesh: Any, axis: str, scan: bool = True, seed: int | None = None,
               hparams: dict[str, Any] | None = None) -> tuple[Any, Any, Any, Any]:
    """Graph definition, params placed on ``mesh`` (sharded over ``axis``), the optax AdamW
    (``flax_gpt.optimizer(**hparams)``) and its fresh state. ``seed=None``: zero params (a target
    to load into), else a random init."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from examples.models import flax_gpt as F

    if seed is None:
        graphdef, state = nnx.split(nnx.eval_shape(lambda: F.GPT(nnx.Rngs(0), scan=scan)))
        make = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
    else:
        graphdef, state = nnx.split(F.GPT(nnx.Rngs(seed), scan=scan))
        make = lambda s: s  # noqa: E731
    pick = param_sharding(mesh, axis)
    params = jax.tree_util.tree_map(lambda s: jax.device_put(make(s), pick(s.shape)), nnx.to_pure_dict(state))
    key = (tuple(mesh.device_ids.flat), axis, scan, tuple(sorted((hparams or {}).items())))
    if key not in _TX:
        _TX[key] = F.optimizer(params, **(hparams or {}))
    tx = _TX[key]
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree_util.tree_map(  # the Adam count: replicated over the mesh too
        lambda x: x if len(x.sharding.device_set) > 1 else jax.device_put(x, replicated), tx.init(params))
    return graphdef, params, tx, opt_state


def load_from_deepspeed(ckpt: Any, params: Any, opt_state: Any, optimizer: str = "full",
                        scan: bool = True) -> tuple[Any, Any]:
    """Fill ``params`` / ``opt_state`` from a DeepSpeed checkpoint (path or Checkpoint).

    ``optimizer``: ``"full"`` (the migration), or a broken migration used as a
    negative control: ``"none"`` (fresh Adam state), ``"reset_step"`` (moments
    kept, count 0), ``"swap_moments"`` (``mu`` and ``nu`` exchanged).
    """
    import jax

    from ckptbridge.adapters import flax as cbflax
    from examples.models import gpt_rules

    rules = gpt_rules.torch_to_flax(60, scan=scan)
    if optimizer == "none":
        return cbflax.load(ckpt, params, rules=rules), opt_state
    params, opt_state = cbflax.load(ckpt, params, opt_state, rules=rules)
    if optimizer == "reset_step":
        opt_state = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.numpy.zeros_like(x) if getattr(p[-1], "name", None) == "count" else x, opt_state)
    elif optimizer == "swap_moments":
        adam = opt_state[1][0]
        opt_state = (opt_state[0], (adam._replace(mu=adam.nu, nu=adam.mu), *opt_state[1][1:]))
    elif optimizer != "full":
        raise ValueError(f"optimizer mode {optimizer!r} is not one of {OPTIMIZER_MODES}")
    return params, opt_state


_STEPS: dict[tuple[int, int], Any] = {}


def make_step(graphdef: Any, tx: Any) -> Any:
    """The jitted train step ``(params, opt_state, x, y) -> (params, opt_state, loss)`` (cached)."""
    import jax
    import optax

    from examples.models import flax_gpt as F

    key = (hash(graphdef), id(tx))
    if key not in _STEPS:
        @jax.jit
        def step_fn(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
            loss, grads = jax.value_and_grad(lambda p: F.loss_fn(graphdef, p, x, y))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        _STEPS[key] = step_fn
    return _STEPS[key]


def train(graphdef: Any, params: Any, opt_state: Any, tx: Any, steps: range, mesh: Any,
          axis: str = "data") -> tuple[list[float], Any, Any]:
    """Run ``steps`` of the torch model's batches (``torch_gpt.make_batch``) with the batch on ``axis``."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from examples.models import torch_gpt as T

    step_fn = make_step(graphdef, tx)
    batch = NamedSharding(mesh, P(axis))
    losses = []
    for s in steps:
        x, y = (jax.device_put(np.asarray(t.numpy(), np.int32), batch) for t in T.make_batch(s))
        params, opt_state, loss = step_fn(params, opt_state, x, y)
        losses.append(float(loss))
    return losses, params, opt_state


def continue_in_jax(ckpt_path: str, steps: int, optimizer: str = "full", n_devices: int = 4,
                    scan: bool = True, return_state: bool = False) -> Any:
    """Load the DeepSpeed checkpoint onto a ``n_devices`` mesh and train ``steps`` steps; the losses
    (and the final ``params, opt_state`` with ``return_state``)."""
    import ckptbridge

    mesh = mesh_of(n_devices)
    with ckptbridge.open(ckpt_path) as ckpt:
        hparams = deepspeed_hyperparameters(ckpt)
        graphdef, params, tx, opt_state = init_state(mesh, "data", scan, hparams=hparams)
        params, opt_state = load_from_deepspeed(ckpt, params, opt_state, optimizer, scan)
        start = int(ckpt.step)
    losses, params, opt_state = train(graphdef, params, opt_state, tx, range(start, start + steps), mesh)
    return (losses, params, opt_state) if return_state else losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="DeepSpeed checkpoint directory (with 'latest' or a global_stepN tag)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--optimizer", choices=OPTIMIZER_MODES, default="full")
    args = ap.parse_args()
    losses = continue_in_jax(args.ckpt, args.steps, args.optimizer)
    ref_path = os.path.join(os.path.dirname(os.path.abspath(args.ckpt.rstrip("/"))), "losses.json")
    ref = None
    if os.path.exists(ref_path):
        with open(ref_path) as fh:
            ref = json.load(fh)["continuation_losses"]
    for i, lo in enumerate(losses):
        line = f"step +{i}: jax {lo:.6f}"
        if ref and i < len(ref):
            line += f"   deepspeed {ref[i]:.6f}   diff {abs(lo - ref[i]):.2e}"
        print(line)


if __name__ == "__main__":
    main()

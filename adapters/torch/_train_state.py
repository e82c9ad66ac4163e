"""A torch training state (module + optimizer) for the asynchronous Checkpointer, and back.

Public through :mod:`ckptbridge.adapters.torch`. Works with plain modules, DTensor
modules and FSDP2 (``fully_shard``): each rank saves its own shards and, at any
new world size, reads back only the bytes of its new shards::

    from ckptbridge.adapters import torch as cbt

    ck = ckptbridge.Checkpointer("ckpts")
    ck.save(step, cbt.train_state(model, opt), optimizer=opt)     # model.<name>, optim.<name>.<key>
    ...
    step = cbt.load_train_state(ck.path_of(ck.latest()), model, opt)   # after a restart
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ckptbridge.plugin import Checkpoint, TensorNotFoundError

if TYPE_CHECKING:
    import torch


def train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{"model": {name: tensor}, "optim": {name: {key: tensor}}}`` of live tensors (no copies):
    the module's state dict (parameters and buffers, DTensors under FSDP2) and each parameter's
    optimizer state (``exp_avg``, ``exp_avg_sq``, ``step`` for Adam), named like the module."""
    import torch

    state: dict[str, Any] = {"model": dict(module.state_dict(keep_vars=True))}
    if optimizer is None:
        return state
    state["optim"] = {name: {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
                      for name, st in named_optimizer_state(optimizer, module)}
    return state


def named_optimizer_state(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(parameter name in module, its optimizer state)`` for every parameter that has state;
    a parameter the module does not hold is a :class:`~ckptbridge.TensorNotFoundError`."""
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            name = names.get(id(p))
            if name is None:
                raise TensorNotFoundError(f"an optimizer parameter of shape {tuple(p.shape)} is not in the module")
            yield name, st


def load_train_state(source: str | os.PathLike[str] | Checkpoint, module: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None = None, strict: bool = True) -> int | None:
    """Fill ``module`` (and ``optimizer``'s per-parameter state) in place from a checkpoint
    saved from :func:`train_state`; each rank reads only its own shards, at any world size.
    Returns the checkpoint's step. ``strict``: every module entry must be in the checkpoint.
    """
    import torch

    from ckptbridge.adapters.torch import _step_tensor, load_into, open_source

    ckpt = open_source(source)
    sd = module.state_dict(keep_vars=True)
    load_into({f"model.{n}": t for n, t in sd.items()}, ckpt, strict=strict)
    if optimizer is None:
        return ckpt.step
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            prefix = f"optim.{name}."
            keys = [k[len(prefix):] for k in ckpt.tensors if k.startswith(prefix)]
            if not keys:
                if strict:
                    raise TensorNotFoundError(f"{ckpt.path}: no optimizer state for {name!r} "
                                              f"(expected tensors named {prefix}<key>)")
                continue
            new: dict[str, Any] = {}
            for key in keys:
                shape = ckpt.tensors[prefix + key].state(None).shape
                if tuple(shape) == tuple(p.shape):
                    with torch.no_grad():
                        buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    load_into({prefix + key: buf}, ckpt)
                    new[key] = buf
                elif key == "step":
                    new[key] = _step_tensor(optimizer, group, p, float(ckpt[prefix + key].read()))
                else:
                    new[key] = torch.from_numpy(ckpt[prefix + key].read().copy())
            optimizer.state[p] = new
    return ckpt.step

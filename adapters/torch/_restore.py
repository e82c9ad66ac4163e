"""torch objects in checkpointed state: an ``nn.Module`` or optimizer stands for its state dict.

``Checkpointer.save(step, {"model": model, "optim": opt})`` saves their state dicts;
``restore_into({"model": model, "optim": opt})`` fills them in place. A fresh
optimizer (no state yet, as right after construction) first creates its state
the way ``torch.distributed.checkpoint.state_dict.set_state_dict`` does: zero
gradients, one step at learning rate 0, gradients dropped; the saved values then
overwrite every entry, and the saved hyper-parameters (lr, betas, ...) are set
on its parameter groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def state_of(obj: Any, restoring: bool) -> Any:
    """The state dict an object stands for (``None`` for tensors and anything else)."""
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, torch.optim.Optimizer):
        if restoring:
            init_optimizer_state(obj)
        return obj.state_dict()
    return None


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has none yet (its values are then overwritten).

    As ``set_state_dict`` does: parameters that need gradients get zero gradients, one
    ``step()`` runs with every learning rate at 0 (parameters do not move), and the
    gradients are dropped again. Nothing happens when the optimizer has state already,
    or when some parameter holds a gradient (a live run: its step is not ours to take).
    """
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for g in opt.param_groups:
        lrs.append(g.get("lr"))
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        opt.zero_grad(set_to_none=True)


def after_restore(obj: Any, saved: Any) -> None:
    """An optimizer takes the saved hyper-parameters of its groups (``saved``: its state dict's
    structure holding the saved values); modules need nothing more."""
    if not isinstance(obj, torch.optim.Optimizer) or not isinstance(saved, Mapping):
        return
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(obj.param_groups):
        return
    for group, values in zip(obj.param_groups, groups):
        for key, value in values.items():
            if key == "params" or isinstance(value, (np.ndarray, torch.Tensor)):
                continue
            if isinstance(group.get(key), torch.Tensor):  # tensor hyper-parameters stay tensors
                group[key].fill_(value)
            else:
                group[key] = value

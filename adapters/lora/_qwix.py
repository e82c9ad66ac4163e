"""MaxText's training-time LoRA (qwix) written where MaxText 0.2.5 and Tunix read it back.

:func:`save_qwix` writes the qwix factors :func:`~._carry.carry` makes (``carry(..., qwix=True)``,
names ``<kernel>_lora_a/value``) as one Orbax ``CheckpointManager`` step ``<out>/<step>``:

* weights only: its item ``items``, the tree ``nnx.state(model, nnx.LoRAParam)`` saves, which
  ``lora_utils.restore_lora_from_path`` (``lora.lora_restore_path=<out>/<step>/items``, what
  ``train_sft.py`` calls after ``apply_lora_to_model``) restores into MaxText's LoRA model;
* with Adam moments (``exp_avg`` / ``exp_avg_sq`` states): Tunix's ``PeftTrainer`` checkpoint
  (``tunix/sft/checkpoint_manager.py``): items ``model_params`` (the same tree) and
  ``optimizer_state``, ``nnx.state(optimizer, nnx.optimizer.OptState)`` of an
  ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``: optax's ``ScaleByAdamState`` at ``adam``
  (``opt_state/0`` for ``optax.adam`` / ``adamw``) with ``mu``, ``nu`` and ``count``, other
  counters (``counts``) and the optimizer's ``step``, every counter the checkpoint's step::

    mt = carry(ckptbridge.open("peft_adapter/"), rules, qwix=True)   # rules: hf -> maxtext
    save_qwix(mt, "lora/")                           # 'lora/0/items': lora.lora_restore_path
    save_qwix(with_moments, "run/ckpts", step=100)   # 'run/ckpts/100': Tunix's maybe_restore

The step records ``{"lora": {"lora_rank", "lora_alpha"}}`` as its custom metadata, where
MaxText's ``sync_lora_metadata`` reads them (``checkpointing.load_checkpoint_metadata`` of the
restore path less its ``/items``); MaxText 0.2.5 builds the LoRA model before it syncs, so the run's
config must give ``lora.lora_rank`` / ``lora.lora_alpha`` all the same (``tools/maxtext/NOTES.md``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    Checkpoint,
    CheckpointIndex,
    FormatError,
    Fragment,
    LogicalTensor,
    TensorState,
    staged_dir,
)

__all__ = ["save_qwix"]

_ADAM = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class _Value:
    """A location holding one number (an optimizer's step counter), stored nowhere."""

    value: int

    def describe(self) -> str:
        return f"the value {self.value}"

    def read_into(self, box: Box, out: np.ndarray, files: Any) -> int:
        out[...] = self.value
        return 0

    def narrow(self, box: Box) -> _Value:
        return self

    def permute(self, perm: Any) -> _Value:
        return self

    def insert_dim(self, dim: int) -> _Value:
        return self

    def drop_dim(self, dim: int) -> _Value:
        return self


def _scalar(name: str, dtype: str, value: int) -> LogicalTensor:
    return LogicalTensor(name, {"param": TensorState(dtype, (), (Fragment(Box((), ()), _Value(value)),))})


def save_qwix(lora: Checkpoint, out: str | os.PathLike[str], *, step: int | None = None,
              adam: str = "opt_state/0", counts: Sequence[str] = (), overwrite: bool = False) -> str:
    """Write ``lora`` (qwix-named factors, ``carry(..., qwix=True)``) as MaxText's LoRA checkpoint
    step ``out/<step>`` (a local path or a URL; published whole, its ``commit_success.txt`` last,
    replacing one there only with ``overwrite``; ``step`` default: the checkpoint's, else 0; see the module doc): without
    Adam moments its one item ``items``, the path returned (``lora.lora_restore_path``); with them
    Tunix's ``model_params`` and ``optimizer_state``, the step's path returned.

    ``adam``: the path of optax's ``ScaleByAdamState`` in the optimizer state; ``counts``: the
    optimizer's other step counters (a learning-rate schedule's ``count``), set to the step too. An
    optimizer restores only the tree it has: MaxText's SFT optimizer (``get_optimizer``'s
    ``adamw`` with a schedule, behind ``clip_by_global_norm`` as ``train_sft.py`` chains it) is::

        save_qwix(mt, "run/ckpts", step=100, adam="opt_state/1/0", counts=("opt_state/1/2/count",))
    """
    import ckptbridge

    from ._carry import factor_of

    if not lora.tensors or any((f := factor_of(n)) is None or f[2] != "qwix" for n in lora.tensors):
        raise FormatError(f"{lora.path}: only qwix-named LoRA factors ('<kernel>_lora_a/value', carry(..., "
                          "qwix=True)) are written as MaxText's training LoRA")
    moments = [n for n, t in lora.tensors.items() if all(s in t.states for s in _ADAM)]
    if moments and len(moments) != len(lora.tensors):
        raise FormatError(f"{lora.path}: Adam moments for {len(moments)} of {len(lora.tensors)} factors; "
                          f"e.g. {sorted(set(lora.tensors) - set(moments))[0]!r} has none")
    number = int(step if step is not None else lora.step or 0)
    weights = {n: LogicalTensor(n, {t.weight_state: t.state()}) for n, t in lora.tensors.items()}
    items = {"model_params" if moments else "items": weights}
    if moments:
        opt = {f"{adam}/{key}/{n}": LogicalTensor(f"{adam}/{key}/{n}", {"param": t.state(s)})
               for n, t in lora.tensors.items() for key, s in zip(("mu", "nu"), _ADAM, strict=True)}
        for count in (f"{adam}/count", *counts):
            opt[f"{count}/value"] = _scalar(f"{count}/value", "int32", number)
        items["optimizer_state"] = {**opt, "step/value": _scalar("step/value", "uint32", number)}
    cfg = lora.extra.get("lora")
    meta = {"lora": {"lora_rank": int(cfg["r"]), "lora_alpha": float(cfg["lora_alpha"])}} \
        if isinstance(cfg, Mapping) and "r" in cfg and "lora_alpha" in cfg else {}
    handler = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
    where = os.path.join(os.fspath(out), str(number))
    with staged_dir(where, overwrite=overwrite, marker=("commit_success.txt", f"Checkpoint commit was successful to {where}")) as stage:
        for item, tensors in items.items():
            ckptbridge.reshard(Checkpoint(CheckpointIndex("lora", lora.path, tensors, number), lora.files),
                               os.path.join(stage, item), to="orbax", layout="flat")
        now = time.time_ns()
        Path(stage, "_CHECKPOINT_METADATA").write_text(json.dumps({
            "item_handlers": dict.fromkeys(items, handler), "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": meta}))
    return where if moments else os.path.join(where, "items")

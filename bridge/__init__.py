"""ckptbridge: portable distributed-training checkpoints.

Open any checkpoint lazily, convert it to the universal layout, export or
reshard it, and compare two of them, across formats::

    import ckptbridge

    ckpt = ckptbridge.open("run/checkpoints/global_step1000")   # DeepSpeed, Megatron, DCP,
    ckpt.format, ckpt.step                                       # Orbax, torch, safetensors,
    w = ckpt["blocks.0.qkv.weight"]                              # or universal
    w.shape, w.dtype, w.states
    w[:128]                                   # reads only those rows' bytes
    w.state("exp_avg").read()

    ckptbridge.convert(ckpt, "out/universal")                     # pickle-free, checksummed
    ckptbridge.export("out/universal", "w.safetensors", state="fp32")
    ckptbridge.reshard("out/universal", "out/mega", to="megatron", tp=2, pp=2)
    ckptbridge.diff("a.pt", "out/universal")

    ck = ckptbridge.Checkpointer("ckpts", keep_last=3)            # asynchronous saves
    ck.save(step, {"model": model.state_dict()}, optimizer=opt)   # returns at once

Framework adapters live in ``ckptbridge.adapters`` (``.jax``, ``.torch``,
``.deepspeed``, ``.megatron``, ...) and import their framework lazily;
``import ckptbridge`` imports neither torch nor jax.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._async import Checkpointer, SaveStats
    from ._checkpoint import Checkpoint, CheckpointIndex, TensorView
    from ._convert import DiffRow, convert, diff, export
    from ._errors import (
        CheckpointError,
        CorruptionError,
        FormatError,
        IncompleteCheckpointError,
        MissingShardError,
        ShapeMismatchError,
        TensorNotFoundError,
        TruncatedError,
        UnknownFormatError,
        UnsafePickleError,
        WatchdogError,
    )
    from ._health import EXIT_FAULTY, EXIT_RESTART, Verdict, WatchdogPolicy
    from ._html import ReshardPlan
    from ._model import Box, FileRegion, Fragment, LogicalTensor, TensorState, flat_range_fragments
    from ._open import detect_format, open
    from ._plan import CopyOp, plan
    from ._reshard import reshard
    from ._rules import (
        Fuse,
        Pad,
        Rename,
        Renumber,
        Replicate,
        Rule,
        Shard,
        Split,
        Stack,
        Transpose,
        Unstack,
        apply_rules,
    )
    from ._universal import verify
    from ._watchdog import Watchdog

_LAZY = {  # public name -> module: imported on first use, so the CLI and core start fast
    "Checkpointer": "._async",
    "SaveStats": "._async",
    "Checkpoint": "._checkpoint",
    "CheckpointIndex": "._checkpoint",
    "TensorView": "._checkpoint",
    "DiffRow": "._convert",
    "convert": "._convert",
    "diff": "._convert",
    "export": "._convert",
    "CheckpointError": "._errors",
    "CorruptionError": "._errors",
    "FormatError": "._errors",
    "IncompleteCheckpointError": "._errors",
    "MissingShardError": "._errors",
    "ShapeMismatchError": "._errors",
    "TensorNotFoundError": "._errors",
    "TruncatedError": "._errors",
    "UnknownFormatError": "._errors",
    "UnsafePickleError": "._errors",
    "WatchdogError": "._errors",
    "EXIT_FAULTY": "._health",
    "EXIT_RESTART": "._health",
    "Verdict": "._health",
    "WatchdogPolicy": "._health",
    "ReshardPlan": "._html",
    "Box": "._model",
    "FileRegion": "._model",
    "Fragment": "._model",
    "LogicalTensor": "._model",
    "TensorState": "._model",
    "flat_range_fragments": "._model",
    "detect_format": "._open",
    "open": "._open",
    "CopyOp": "._plan",
    "plan": "._plan",
    "reshard": "._reshard",
    "Fuse": "._rules",
    "Pad": "._rules",
    "Rename": "._rules",
    "Renumber": "._rules",
    "Replicate": "._rules",
    "Rule": "._rules",
    "Shard": "._rules",
    "Split": "._rules",
    "Stack": "._rules",
    "Transpose": "._rules",
    "Unstack": "._rules",
    "apply_rules": "._rules",
    "verify": "._universal",
    "Watchdog": "._watchdog",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "EXIT_FAULTY",
    "EXIT_RESTART",
    "Box",
    "Checkpoint",
    "CheckpointError",
    "CheckpointIndex",
    "Checkpointer",
    "CopyOp",
    "CorruptionError",
    "DiffRow",
    "FileRegion",
    "FormatError",
    "Fragment",
    "Fuse",
    "IncompleteCheckpointError",
    "LogicalTensor",
    "MissingShardError",
    "Pad",
    "Rename",
    "Renumber",
    "Replicate",
    "ReshardPlan",
    "Rule",
    "SaveStats",
    "ShapeMismatchError",
    "Shard",
    "Split",
    "Stack",
    "TensorNotFoundError",
    "TensorState",
    "TensorView",
    "Transpose",
    "TruncatedError",
    "UnknownFormatError",
    "UnsafePickleError",
    "Unstack",
    "Verdict",
    "Watchdog",
    "WatchdogError",
    "WatchdogPolicy",
    "__version__",
    "apply_rules",
    "convert",
    "detect_format",
    "diff",
    "export",
    "flat_range_fragments",
    "open",
    "plan",
    "reshard",
    "verify",
]

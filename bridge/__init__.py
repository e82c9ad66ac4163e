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

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint, CheckpointIndex, TensorView
    from ._checkpointer import Checkpointer, RestoreResult, SavePolicy, SaveStats
    from ._convert import DiffRow, convert, diff, export, trace
    from ._errors import (
        AccessDeniedError,
        CheckpointError,
        CorruptionError,
        FormatError,
        IncompleteCheckpointError,
        MissingExtraError,
        MissingShardError,
        OptionError,
        ShapeMismatchError,
        StorageError,
        TensorNotFoundError,
        TruncatedError,
        UnknownFormatError,
        UnsafePickleError,
        WatchdogError,
        WriteError,
    )
    from ._formats import Format, formats
    from ._health import EXIT_FAULTY, EXIT_RESTART, Verdict, WatchdogPolicy
    from ._html import ReshardPlan
    from ._model import Box, FileRegion, Fragment, LogicalTensor, TensorState, flat_range_fragments
    from ._open import detect_format, open
    from ._plan import CopyOp, plan
    from ._reshard import reshard
    from ._rules import (
        Cast,
        Crop,
        Deinterleave,
        Drop,
        DroppedTensorsWarning,
        Expect,
        FlatPartition,
        Fuse,
        Interleave,
        Join,
        MergeDims,
        Pad,
        Rename,
        Renumber,
        Replicate,
        Reshape,
        Rule,
        Scale,
        Shard,
        Split,
        SplitDim,
        Stack,
        State,
        Transpose,
        Unstack,
        apply_rules,
        invert,
        rule_from_json,
        rules_to_json,
    )
    from ._scaleout import World, world_from_env
    from ._storage import RemotePolicy
    from ._storage import configure as configure_storage
    from ._universal import verify
    from ._watchdog import Watchdog

_LAZY = {  # public name -> module: imported on first use, so the CLI and core start fast
    "Checkpointer": "._checkpointer",
    "SavePolicy": "._checkpointer",
    "SaveStats": "._checkpointer",
    "RestoreResult": "._checkpointer",
    "Checkpoint": "._checkpoint",
    "CheckpointIndex": "._checkpoint",
    "TensorView": "._checkpoint",
    "DiffRow": "._convert",
    "convert": "._convert",
    "diff": "._convert",
    "export": "._convert",
    "trace": "._convert",
    "CheckpointError": "._errors",
    "CorruptionError": "._errors",
    "FormatError": "._errors",
    "IncompleteCheckpointError": "._errors",
    "MissingExtraError": "._errors",
    "MissingShardError": "._errors",
    "OptionError": "._errors",
    "ShapeMismatchError": "._errors",
    "TensorNotFoundError": "._errors",
    "TruncatedError": "._errors",
    "UnknownFormatError": "._errors",
    "UnsafePickleError": "._errors",
    "WatchdogError": "._errors",
    "WriteError": "._errors",
    "EXIT_FAULTY": "._health",
    "EXIT_RESTART": "._health",
    "Verdict": "._health",
    "WatchdogPolicy": "._health",
    "StorageError": "._errors",
    "AccessDeniedError": "._errors",
    "RemotePolicy": "._storage",
    "configure_storage": "._storage",
    "World": "._scaleout",
    "world_from_env": "._scaleout",
    "Format": "._formats",
    "formats": "._formats",
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
    "FlatPartition": "._rules",
    "Fuse": "._rules",
    "Join": "._rules",
    "Pad": "._rules",
    "Rename": "._rules",
    "Renumber": "._rules",
    "Replicate": "._rules",
    "Rule": "._rules",
    "Shard": "._rules",
    "Split": "._rules",
    "Stack": "._rules",
    "State": "._rules",
    "Transpose": "._rules",
    "Unstack": "._rules",
    "apply_rules": "._rules",
    "rule_from_json": "._rules",
    "rules_to_json": "._rules",
    "Cast": "._rules",
    "Crop": "._rules",
    "Deinterleave": "._rules",
    "Expect": "._rules",
    "Drop": "._rules",
    "DroppedTensorsWarning": "._rules",
    "Interleave": "._rules",
    "MergeDims": "._rules",
    "Reshape": "._rules",
    "Scale": "._rules",
    "SplitDim": "._rules",
    "invert": "._rules",
    "verify": "._universal",
    "Watchdog": "._watchdog",
}


_RENAMED = {"configure_storage": "configure"}  # public name -> name in its module


def __getattr__(name: str) -> Any:
    if name in ("recipes", "plugin"):  # public submodules
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "EXIT_FAULTY",
    "EXIT_RESTART",
    "AccessDeniedError",
    "Box",
    "Cast",
    "Checkpoint",
    "CheckpointError",
    "CheckpointIndex",
    "Checkpointer",
    "CopyOp",
    "CorruptionError",
    "Crop",
    "Deinterleave",
    "DiffRow",
    "Drop",
    "DroppedTensorsWarning",
    "Expect",
    "FileRegion",
    "FlatPartition",
    "Format",
    "FormatError",
    "Fragment",
    "Fuse",
    "IncompleteCheckpointError",
    "Interleave",
    "Join",
    "LogicalTensor",
    "MergeDims",
    "MissingExtraError",
    "MissingShardError",
    "OptionError",
    "Pad",
    "RemotePolicy",
    "Rename",
    "Renumber",
    "Replicate",
    "Reshape",
    "ReshardPlan",
    "RestoreResult",
    "Rule",
    "SavePolicy",
    "SaveStats",
    "Scale",
    "ShapeMismatchError",
    "Shard",
    "Split",
    "SplitDim",
    "Stack",
    "State",
    "StorageError",
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
    "World",
    "WriteError",
    "__version__",
    "apply_rules",
    "configure_storage",
    "convert",
    "detect_format",
    "diff",
    "export",
    "flat_range_fragments",
    "formats",
    "invert",
    "open",
    "plan",
    "reshard",
    "rule_from_json",
    "rules_to_json",
    "trace",
    "verify",
    "world_from_env",
]

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

The rule language is ``ckptbridge.rules`` (``from ckptbridge.rules import Rename``; the rule
classes are also here), model-family rule sets ``ckptbridge.recipes``, the fault detector's pure
rules ``ckptbridge.health``, the interface for format and runtime plug-ins ``ckptbridge.plugin``.
Framework adapters live in ``ckptbridge.adapters`` (``.jax``, ``.torch``,
``.deepspeed``, ``.megatron``, ...) and import their framework lazily;
``import ckptbridge`` imports neither torch nor jax.
"""

import importlib as _importlib
import typing as _typing

from ._gc import no_gc as _no_gc
from ._lazy import type_checking_names as _type_checking_names
from ._version import __version__ as __version__

if _typing.TYPE_CHECKING:  # THE list of public names: mypy reads it, and _LAZY (the lazy map) and __all__ come from it
    from ._checkpointer.core import Checkpointer as Checkpointer
    from ._checkpointer.jobs import SaveStats as SaveStats
    from ._checkpointer.policy import SavePolicy as SavePolicy
    from ._checkpointer.restore import RestoreResult as RestoreResult
    from ._errors import AccessDeniedError as AccessDeniedError
    from ._errors import CheckpointError as CheckpointError
    from ._errors import CorruptionError as CorruptionError
    from ._errors import FormatError as FormatError
    from ._errors import IncompleteCheckpointError as IncompleteCheckpointError
    from ._errors import MissingExtraError as MissingExtraError
    from ._errors import MissingShardError as MissingShardError
    from ._errors import OptionError as OptionError
    from ._errors import ShapeMismatchError as ShapeMismatchError
    from ._errors import StorageError as StorageError
    from ._errors import TensorNotFoundError as TensorNotFoundError
    from ._errors import TruncatedError as TruncatedError
    from ._errors import UnknownFormatError as UnknownFormatError
    from ._errors import UnsafePickleError as UnsafePickleError
    from ._errors import WatchdogError as WatchdogError
    from ._errors import WriteError as WriteError
    from ._formats.convert import DiffRow as DiffRow
    from ._formats.convert import convert as convert
    from ._formats.convert import diff as diff
    from ._formats.convert import export as export
    from ._formats.convert import trace as trace
    from ._formats.registry import Format as Format
    from ._formats.registry import formats as formats
    from ._formats.scaleout import World as World
    from ._formats.scaleout import world_from_env as world_from_env
    from ._formats.universal import verify as verify
    from ._read.checkpoint import Checkpoint as Checkpoint
    from ._read.checkpoint import CheckpointIndex as CheckpointIndex
    from ._read.checkpoint import TensorView as TensorView
    from ._read.html import ReshardPlan as ReshardPlan
    from ._read.model import Box as Box
    from ._read.model import FileRegion as FileRegion
    from ._read.model import Fragment as Fragment
    from ._read.model import LogicalTensor as LogicalTensor
    from ._read.model import TensorState as TensorState
    from ._read.model import flat_range_fragments as flat_range_fragments
    from ._read.open import detect_format as detect_format
    from ._read.open import open as open
    from ._read.plan import CopyOp as CopyOp
    from ._read.plan import plan as plan
    from ._read.reshard import reshard as reshard
    from ._storage import RemotePolicy as RemotePolicy
    from ._storage import configure as configure_storage  # noqa: F401 (listed in __all__, derived)
    from .health import EXIT_FAULTY as EXIT_FAULTY
    from .health import EXIT_RESTART as EXIT_RESTART
    from .health import Verdict as Verdict
    from .health import WatchdogPolicy as WatchdogPolicy
    from .health._watchdog import Watchdog as Watchdog
    from .rules import Cast as Cast  # the rules live in ckptbridge.rules; these are aliases
    from .rules import Crop as Crop
    from .rules import Deinterleave as Deinterleave
    from .rules import Drop as Drop
    from .rules import DroppedTensorsWarning as DroppedTensorsWarning
    from .rules import Expect as Expect
    from .rules import FlatPartition as FlatPartition
    from .rules import Fuse as Fuse
    from .rules import Interleave as Interleave
    from .rules import Join as Join
    from .rules import MergeDims as MergeDims
    from .rules import Offset as Offset
    from .rules import Pad as Pad
    from .rules import Rename as Rename
    from .rules import Renumber as Renumber
    from .rules import Replicate as Replicate
    from .rules import Reshape as Reshape
    from .rules import Rule as Rule
    from .rules import Scale as Scale
    from .rules import Shard as Shard
    from .rules import Split as Split
    from .rules import SplitDim as SplitDim
    from .rules import Stack as Stack
    from .rules import State as State
    from .rules import Transpose as Transpose
    from .rules import Unstack as Unstack
    from .rules import apply_rules as apply_rules
    from .rules import invert as invert
    from .rules import rule_from_json as rule_from_json
    from .rules import rules_to_json as rules_to_json

_SUBMODULES = ("health", "plugin", "recipes", "rules")  # public subpackages, imported on first use


# Public name -> (module, name there), read from the ``TYPE_CHECKING`` block above (the one place a
# public name is written; its modules are imported on first use, so the CLI starts fast)
_LAZY = _type_checking_names(__file__)
__all__ = sorted([*_LAZY, "__version__"])


def _import(module: str) -> object:
    with _no_gc():  # a first use imports numpy and most of ckptbridge: modules, classes, nothing to collect
        return _importlib.import_module(module, __name__)


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return _import(f".{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'ckptbridge' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(_import(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES])

"""The interface for adapter authors: what a format or runtime plug-in uses from the core.

This module is public and stable: an adapter (built-in ones in ``ckptbridge.adapters``
included) imports the core only from here and from ``ckptbridge``, never from a private
``ckptbridge._*`` module. It holds what the adapters use, and nothing else (checked by
``tests/test_layout.py``), each name written once, in the import list below (``__all__`` is
derived from it; the names are imported on first use):

* the data model: :class:`Box`, :class:`Fragment`, :class:`FileRegion`, :class:`TensorState`,
  :class:`LogicalTensor`, and helpers that build fragments (``contiguous_fragment``,
  ``flat_range_fragments`` for ZeRO-style flat slices, ``flat_range_boxes``, ``c_strides``);
* derived tensors: :class:`Derivation` (source boxes of a request, compute), :class:`DerivedRegion`
  and :func:`derived_state` (a tensor computed per slice from stored ones: dequantization);
* what an adapter returns and gets: :class:`CheckpointIndex`, :class:`Checkpoint`,
  :class:`TensorView`; :func:`open_checkpoint`, and :func:`as_checkpoint` (a path or a
  Checkpoint, seen through rules: the one helper for "source" arguments);
* the rules adapters lay out or map with (``Shard``, ``Replicate``, ``Fuse``, ``Rename`` ...,
  :func:`apply_rules`, ``regex``: their cached ``re.compile``) and the fragment transforms they
  build views with (``concat``, ``crop``, ``fuse``, ``pad``, ``reshape``, ``transpose``,
  ``unstack``); the whole language is :mod:`ckptbridge.rules`;
* reading: :class:`FileCache`, :func:`read_state`, :func:`read_boxes`, :func:`fresh_array`;
* storage: ``storage``, a :class:`Storage` (a small typed protocol: names, listings, reads,
  ``read_ranges``), through which checkpoints behind URLs (``s3://``, ``gs://``, ``hf://`` ...)
  read like local ones; ``dtypes`` (dtype names <-> numpy);
* the registry: :class:`Format`, :class:`OpenOptions`, :class:`WriteOptions`,
  :func:`register_format`, :func:`require` (import an optional dependency or name the extra
  to install), :class:`LazyNames` (a format package's ``__getattr__``: its reader and writer
  imported on first use, so that format detection stays cheap);
* writing: :func:`staged_dir` / :func:`staging_path` / :func:`check_destination` (the commit
  rule), the universal layout's writer (:class:`Piece`, :func:`write_universal`,
  :func:`write_rank`, :func:`commit_universal`), :func:`read_header` and :func:`read_entries`
  (safetensors); the
  direct-I/O file writer for other layouts (:func:`write_files` of :class:`StreamFile` parts:
  bytes, :class:`Entry` tensors produced in chunks, :class:`Late` bytes made from their CRCs)
  and :class:`Filler` (an entry's data read from a :class:`TensorView` in row blocks);
* runtimes: :class:`RankProvider` and :func:`find_ranks` (which rank am I, how many ranks),
  :class:`Leaf` / :class:`LeafProvider` / :func:`register_leaf_provider` (what the
  Checkpointer captures), :class:`JobStore` / :func:`register_job_store` with
  :class:`BoundedCaller` and :func:`poll_keys` (the Watchdog's job store);
* the errors adapters raise.

A minimal read-only format::

    from ckptbridge.plugin import (CheckpointIndex, Format, LogicalTensor, TensorState,
                                   contiguous_fragment, register_format, storage)

    def detect(path): return path.endswith(".raw32")
    def index(path, options):
        n = storage.getsize(path) // 4
        frag = contiguous_fragment((n,), path, 0, "float32")
        return CheckpointIndex("raw32", path, {"w": LogicalTensor("w", {"fp32": TensorState(
            "float32", (n,), (frag,))})})

    register_format(Format("raw32", detect=detect, index=index, priority=60))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _dtypes
from ._lazy import LazyNames as LazyNames
from ._storage.interface import STORAGE as _STORAGE
from ._storage.interface import Storage as Storage

if TYPE_CHECKING:  # imported on first use (LazyNames): format detection imports this module, and a
    # format's detect and options need only the registry
    from ._checkpointer.leaves import Leaf as Leaf
    from ._checkpointer.leaves import LeafProvider as LeafProvider
    from ._checkpointer.leaves import register_leaf_provider as register_leaf_provider
    from ._errors import CheckpointError as CheckpointError
    from ._errors import CorruptionError as CorruptionError
    from ._errors import FormatError as FormatError
    from ._errors import MissingShardError as MissingShardError
    from ._errors import OptionError as OptionError
    from ._errors import ShapeMismatchError as ShapeMismatchError
    from ._errors import StorageError as StorageError
    from ._errors import TensorNotFoundError as TensorNotFoundError
    from ._errors import TruncatedError as TruncatedError
    from ._errors import UnsafePickleError as UnsafePickleError
    from ._formats.convert import Filler as Filler
    from ._formats.registry import Format as Format
    from ._formats.registry import OpenOptions as OpenOptions
    from ._formats.registry import WriteOptions as WriteOptions
    from ._formats.registry import register_format as register_format
    from ._formats.registry import require as require
    from ._formats.safetensors import Entries as Entries
    from ._formats.safetensors import Entry as Entry
    from ._formats.safetensors import read_entries as read_entries
    from ._formats.safetensors import read_header as read_header
    from ._formats.safetensors_write import Late as Late
    from ._formats.safetensors_write import StreamFile as StreamFile
    from ._formats.safetensors_write import write_files as write_files
    from ._formats.universal import Piece as Piece
    from ._formats.universal import commit_universal as commit_universal
    from ._formats.universal import write_rank as write_rank
    from ._formats.universal import write_universal as write_universal
    from ._ranks import RankProvider as RankProvider
    from ._ranks import find_ranks as find_ranks
    from ._read.checkpoint import Checkpoint as Checkpoint
    from ._read.checkpoint import CheckpointIndex as CheckpointIndex
    from ._read.checkpoint import TensorView as TensorView
    from ._read.derived import Derivation as Derivation
    from ._read.derived import DerivedRegion as DerivedRegion
    from ._read.derived import derived_state as derived_state
    from ._read.executor import FileCache as FileCache
    from ._read.executor import read_boxes as read_boxes
    from ._read.executor import read_state as read_state
    from ._read.model import WEIGHT_STATES as WEIGHT_STATES
    from ._read.model import Box as Box
    from ._read.model import FileRegion as FileRegion
    from ._read.model import Fragment as Fragment
    from ._read.model import LazyTensors as LazyTensors
    from ._read.model import LogicalTensor as LogicalTensor
    from ._read.model import TensorSpec as TensorSpec
    from ._read.model import TensorState as TensorState
    from ._read.model import c_strides as c_strides
    from ._read.model import check_name as check_name
    from ._read.model import contiguous_fragment as contiguous_fragment
    from ._read.model import flat_range_boxes as flat_range_boxes
    from ._read.model import flat_range_fragments as flat_range_fragments
    from ._read.model import spec_of as spec_of
    from ._read.model import tensor_specs as tensor_specs
    from ._read.model import weight_state_for as weight_state_for
    from ._read.open import as_checkpoint as as_checkpoint
    from ._read.open import open_checkpoint as open_checkpoint
    from ._storage.commit import check_destination as check_destination
    from ._storage.commit import staged_dir as staged_dir
    from ._storage.commit import staging_path as staging_path
    from ._storage.hostmem import fresh_array as fresh_array
    from .health._jobstore import BoundedCaller as BoundedCaller
    from .health._jobstore import JobStore as JobStore
    from .health._jobstore import poll_keys as poll_keys
    from .health._jobstore import register_job_store as register_job_store
    from .rules import LAYOUT_RULES as LAYOUT_RULES
    from .rules import Cast as Cast
    from .rules import Crop as Crop
    from .rules import Deinterleave as Deinterleave
    from .rules import Expect as Expect
    from .rules import FlatPartition as FlatPartition
    from .rules import Fuse as Fuse
    from .rules import Interleave as Interleave
    from .rules import Join as Join
    from .rules import MergeDims as MergeDims
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
    from .rules import concat as concat
    from .rules import crop as crop
    from .rules import fuse as fuse
    from .rules import pad as pad
    from .rules import regex as regex
    from .rules import reshape as reshape
    from .rules import rules_to_json as rules_to_json
    from .rules import transpose as transpose
    from .rules import unstack as unstack

dtypes = _dtypes  # dtype names <-> numpy (a module)
storage: Storage = _STORAGE  # the path API every adapter reads through

__getattr__ = LazyNames(__name__)
_EAGER = [n for n in dict(globals()) if not n.startswith("_") and n not in ("annotations", "TYPE_CHECKING")]
__all__ = sorted([*__getattr__.names(), *_EAGER])

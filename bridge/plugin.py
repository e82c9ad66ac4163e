"""The interface for adapter authors: everything a format or runtime plug-in may use from the core.

This module is public and stable: an adapter (built-in ones in
``ckptbridge.adapters`` included) imports the core only from here, never from a
private ``ckptbridge._*`` module. It holds

* the data model: :class:`Box`, :class:`Fragment`, :class:`FileRegion` (and the
  :class:`Location` protocol for other storage), :class:`TensorState`,
  :class:`LogicalTensor`, helpers that build fragments (``flat_range_fragments``
  for ZeRO-style flat slices, ``contiguous_fragment``);
* the view an adapter returns: :class:`CheckpointIndex` (``Checkpoint`` adds the reader);
* the rule language and its fragment transforms (``concat``, ``crop``, ``split`` ...);
* reading: :class:`FileCache`, :func:`read_state`, :func:`read_boxes`, and :func:`fresh_array`
  (a destination array for data written once);
* storage: ``storage`` (``ckptbridge._storage``), the path API every adapter opens files
  through, so that checkpoints behind URLs (``s3://``, ``gs://``, ``hf://`` ... through fsspec)
  read like local ones: ``storage.isfile``, ``isdir``, ``listdir``, ``getsize``, ``open_read``,
  ``read_bytes``, ``join``, ``normpath``, ``inside`` ...;
* the registry: :class:`Format`, :class:`OpenOptions`, :class:`WriteOptions`,
  :func:`register_format`, :func:`require` (import an optional dependency or
  name the extra to install);
* writing: :func:`staged_dir` / :func:`staged_file` (the one commit rule), the
  universal layout's writer (:class:`Piece`, :func:`write_universal`,
  :func:`write_rank`, :func:`commit_universal`) and the safetensors primitives;
* scale-out writes: :class:`World`, :func:`world_from_env` (this process among the launcher's),
  :class:`Store` / :class:`FileStore` (how ranks agree; runtimes register stores through the
  ``ckptbridge.stores`` entry-point group), :func:`balance`;
* the asynchronous checkpointer's hook for runtimes: :class:`Leaf` and
  :func:`register_leaf_provider`;
* the fault detector's hook for runtimes: :class:`JobStore` and :func:`register_job_store`
  (the job's key-value store), with :class:`BoundedCaller`, :func:`poll_keys`,
  :func:`retry` and :class:`StoreTimeout` to bound and repeat the clients' calls;
* the error tree.

A minimal read-only format::

    from ckptbridge.plugin import (CheckpointIndex, Format, LogicalTensor, TensorState,
                                   contiguous_fragment, register_format)

    def detect(path): return path.endswith(".raw32")
    def index(path, options):
        n = os.path.getsize(path) // 4
        frag = contiguous_fragment((n,), path, 0, "float32")
        return CheckpointIndex("raw32", path, {"w": LogicalTensor("w", {"fp32": TensorState(
            "float32", (n,), (frag,))})})

    register_format(Format("raw32", detect=detect, index=index, priority=60))
"""

from __future__ import annotations

from . import _dtypes as dtypes
from . import _storage as storage
from ._checkpoint import Checkpoint, CheckpointIndex, TensorView
from ._checkpointer.leaves import Capture, Leaf, LeafProvider, leaves_of, register_leaf_provider
from ._commit import check_destination, fsync_tree, publish, staged_dir, staged_file, staging_path
from ._crc import crc32
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
    WriteError,
)
from ._formats import Format, OpenOptions, WriteOptions, get_format, register_format, require
from ._hostmem import fresh_array
from ._jobstore import BoundedCaller, JobStore, StoreTimeout, poll_keys, register_job_store, retry
from ._jsonable import jsonable
from ._model import (
    WEIGHT_STATES,
    Box,
    FileRegion,
    Fragment,
    Location,
    LogicalTensor,
    TensorState,
    c_strides,
    check_name,
    contiguous_fragment,
    flat_range_boxes,
    flat_range_fragments,
    weight_state_for,
)
from ._open import as_checkpoint, open_checkpoint
from ._read import FileCache, ReadStats, read_boxes, read_state
from ._rules import (
    Cast,
    Crop,
    Deinterleave,
    Expect,
    FlatPartition,
    Fuse,
    Interleave,
    Join,
    MergeDims,
    Offset,
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
    cast,
    coalesce,
    concat,
    crop,
    deinterleave,
    fuse,
    interleave,
    invert,
    merge_dims,
    pad,
    reshape,
    rule_from_json,
    rules_to_json,
    scale,
    split,
    split_dim,
    stack,
    transpose,
    unstack,
)
from ._safetensors import Entry, FileSpec, read_header, write_file, write_files
from ._scaleout import FileStore, Store, World, balance, rank_from_env, world_from_env
from ._universal import Piece, commit_universal, write_rank, write_universal
from ._views import ScaledRegion, ViewRegion, ZeroRegion

__all__ = [
    "WEIGHT_STATES",
    "AccessDeniedError",
    "BoundedCaller",
    "Box",
    "Capture",
    "Cast",
    "Checkpoint",
    "CheckpointError",
    "CheckpointIndex",
    "CorruptionError",
    "Crop",
    "Deinterleave",
    "Entry",
    "Expect",
    "FileCache",
    "FileRegion",
    "FileSpec",
    "FileStore",
    "FlatPartition",
    "Format",
    "FormatError",
    "Fragment",
    "Fuse",
    "IncompleteCheckpointError",
    "Interleave",
    "JobStore",
    "Join",
    "Leaf",
    "LeafProvider",
    "Location",
    "LogicalTensor",
    "MergeDims",
    "MissingExtraError",
    "MissingShardError",
    "Offset",
    "OpenOptions",
    "OptionError",
    "Pad",
    "Piece",
    "ReadStats",
    "Rename",
    "Renumber",
    "Replicate",
    "Reshape",
    "Rule",
    "Scale",
    "ScaledRegion",
    "ShapeMismatchError",
    "Shard",
    "Split",
    "SplitDim",
    "Stack",
    "State",
    "StorageError",
    "Store",
    "StoreTimeout",
    "TensorNotFoundError",
    "TensorState",
    "TensorView",
    "Transpose",
    "TruncatedError",
    "UnknownFormatError",
    "UnsafePickleError",
    "Unstack",
    "ViewRegion",
    "World",
    "WriteError",
    "WriteOptions",
    "ZeroRegion",
    "apply_rules",
    "as_checkpoint",
    "balance",
    "c_strides",
    "cast",
    "check_destination",
    "check_name",
    "coalesce",
    "commit_universal",
    "concat",
    "contiguous_fragment",
    "crc32",
    "crop",
    "deinterleave",
    "dtypes",
    "flat_range_boxes",
    "flat_range_fragments",
    "fresh_array",
    "fsync_tree",
    "fuse",
    "get_format",
    "interleave",
    "invert",
    "jsonable",
    "leaves_of",
    "merge_dims",
    "open_checkpoint",
    "pad",
    "poll_keys",
    "publish",
    "rank_from_env",
    "read_boxes",
    "read_header",
    "read_state",
    "register_format",
    "register_job_store",
    "register_leaf_provider",
    "require",
    "reshape",
    "retry",
    "rule_from_json",
    "rules_to_json",
    "scale",
    "split",
    "split_dim",
    "stack",
    "staged_dir",
    "staged_file",
    "staging_path",
    "storage",
    "transpose",
    "unstack",
    "weight_state_for",
    "world_from_env",
    "write_file",
    "write_files",
    "write_rank",
    "write_universal",
]

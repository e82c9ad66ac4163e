"""The Universal Checkpoint Language (public: ``ckptbridge.rules``): rules that say, as data, how
native pieces map to logical tensors, and the fragment transforms they are made of::

    from ckptbridge.rules import Rename, Transpose, apply_rules, invert, rules_to_json

    rules = [Rename(r"^model\\.", ""), Transpose(r"\\.weight$", (1, 0))]
    mapped = apply_rules(ckpt.tensors, rules)            # metadata only: no byte is read
    back = apply_rules(mapped, invert(rules))
    rules_to_json(rules)                                 # what manifests record

Rule classes and JSON live in ``_language``, running them in ``_apply``, inverting renames in
``_inverse``, the fragment transforms (``concat``, ``crop``, ``split`` ...) in ``_transforms``.
The rule classes are also importable from ``ckptbridge`` itself. Every name below is written once.
"""

from __future__ import annotations

from ._apply import apply_rules as apply_rules
from ._language import LAYOUT_RULES as LAYOUT_RULES
from ._language import RULES as RULES
from ._language import Cast as Cast
from ._language import Crop as Crop
from ._language import Deinterleave as Deinterleave
from ._language import Drop as Drop
from ._language import DroppedTensorsWarning as DroppedTensorsWarning
from ._language import Expect as Expect
from ._language import FlatPartition as FlatPartition
from ._language import Fuse as Fuse
from ._language import Interleave as Interleave
from ._language import Join as Join
from ._language import MergeDims as MergeDims
from ._language import Offset as Offset
from ._language import Pad as Pad
from ._language import Rename as Rename
from ._language import Renumber as Renumber
from ._language import Replicate as Replicate
from ._language import Reshape as Reshape
from ._language import Rule as Rule
from ._language import Scale as Scale
from ._language import Shard as Shard
from ._language import Split as Split
from ._language import SplitDim as SplitDim
from ._language import Stack as Stack
from ._language import State as State
from ._language import Transpose as Transpose
from ._language import Unstack as Unstack
from ._language import invert as invert
from ._language import regex as regex
from ._language import rule_from_json as rule_from_json
from ._language import rules_to_json as rules_to_json
from ._transforms import cast as cast
from ._transforms import coalesce as coalesce
from ._transforms import concat as concat
from ._transforms import crop as crop
from ._transforms import deinterleave as deinterleave
from ._transforms import fuse as fuse
from ._transforms import interleave as interleave
from ._transforms import merge_dims as merge_dims
from ._transforms import offset as offset
from ._transforms import pad as pad
from ._transforms import reshape as reshape
from ._transforms import scale as scale
from ._transforms import split as split
from ._transforms import split_dim as split_dim
from ._transforms import stack as stack
from ._transforms import transpose as transpose
from ._transforms import unstack as unstack

__all__ = sorted(n for n in dict(globals()) if not n.startswith("_") and n != "annotations")

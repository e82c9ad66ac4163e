"""What format detection needs of Megatron checkpoints, cheap to import: :func:`detect` (and the
layout names it looks for) and the options classes (the reader and writer are imported on first
use, see the package)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ckptbridge.plugin import OpenOptions, OptionError, WriteOptions, storage

TRACKER = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7,})$")
RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def detect(path: str) -> bool:
    """A Megatron run dir, iteration dir, or Megatron dist-checkpoint dir (cheap; never raises)."""
    try:
        path = os.fspath(path)
        if not storage.isdir(path):
            return False
        if storage.isfile(storage.join(path, TRACKER)):
            return True
        if is_dist_dir(path) and storage.isfile(storage.join(path, "common.pt")):
            return True
        return bool(rank_dirs(path)) and (ITER_RE.match(storage.basename(path)) is not None
                                          or storage.basename(path) == "release"
                                          or any(storage.isfile(storage.join(d, "model_optim_rng.pt"))
                                                 for d in rank_dirs(path).values()))
    except Exception:  # detection must never raise on foreign input
        return False


def is_dist_dir(path: str) -> bool:
    meta = storage.join(path, "metadata.json")
    if not storage.isfile(meta):
        return False
    try:
        return json.loads(storage.read_text(meta)).get("sharded_backend") in ("torch_dist", "zarr", "fsdp_dtensor")
    except (OSError, ValueError, AttributeError):
        return False


def rank_dirs(it_dir: str) -> dict[tuple[int, ...], str]:
    """``mp_rank_TT[_PPP][_EEE]`` directories of a legacy iteration dir: the numbers in the name -> path.

    ``(tp, pp)`` for dense runs (``pp`` 0 without pipelining); with expert parallelism the EP rank
    follows (``mp_rank_TT_EEE`` without pipelining reads as ``(tp, ep)``: only the args can tell)."""
    out: dict[tuple[int, ...], str] = {}
    try:
        names = storage.listdir(it_dir)
    except OSError:
        return {}
    for n in names:
        m = RANK_RE.match(n)
        if m and storage.isdir(storage.join(it_dir, n)):
            nums = tuple(int(g) for g in m.groups() if g is not None)
            out[nums if len(nums) > 1 else (nums[0], 0)] = storage.join(it_dir, n)
    return out


@dataclass(frozen=True)
class MegatronOpenOptions(OpenOptions):
    """Opening a Megatron checkpoint.

    ``split_fused``: expose ``...linear_qkv.{q,k,v}.weight`` and ``...linear_fc1.{gate,up}.weight``.
    ``strip_padding``: strip the vocabulary padding rows.
    ``vocab_size``: the tokenizer's size when the args do not record it (Megatron-LM stores only ``padded_vocab_size``).
    ``check_replicas``: read replicated tensors on every TP rank and require them equal.
    """

    split_fused: bool = False
    strip_padding: bool = True
    vocab_size: int | None = None
    check_replicas: bool = False


@dataclass(frozen=True)
class MegatronWriteOptions(WriteOptions):
    """Writing a legacy Megatron-LM checkpoint for a new layout (uniform stages, no virtual pipeline).

    ``tp``: tensor-parallel size (default: the source's).
    ``pp``: pipeline-parallel size (default: the source's).
    ``dp``: data-parallel size recorded in the args (default: the source's where it fits the new layout,
    else the smallest that does).
    ``ep``, ``etp``: expert-parallel and expert-tensor-parallel sizes of a mixture-of-experts model
    (default: the source's EP; ETP: the source's where EP and TP are kept, else TP).
    ``distributed_optimizer``: write ``distrib_optim.pt`` (default: as the source).
    ``iteration``: the iteration number (default: the source's step).
    ``args``: a JSON file of Megatron args for a source that has none (an HF model), or overrides.
    ``optimizer``: ``False`` writes the model weights only (no ``optimizer`` entry, no
    ``distrib_optim.pt``), as Megatron-LM's ``tools/checkpoint/convert.py`` writes them.
    """

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    ep: int | None = None
    etp: int | None = None
    distributed_optimizer: bool | None = None
    iteration: int | None = None
    args: str | None = None
    optimizer: bool = True

    def validate(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "etp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise OptionError(f"format 'megatron' (write): {name} must be >= 1, got {v}")

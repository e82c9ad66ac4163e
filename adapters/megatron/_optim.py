"""Which optimizer slot belongs to which parameter, in Megatron's optimizers (pure functions).

* Non-distributed optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``)
  save a torch ``Adam`` ``state_dict``: slots are numbered through the param
  groups that mcore's ``_get_param_groups`` built: parameters are keyed by
  their overrides (the standard one: ``wd_mult=0`` for biases and 1-D params;
  ``max_lr=decoupled_lr`` for embedding/output params when set), groups sorted
  with the no-override group first, each group in ``named_parameters()`` order.
  :func:`group_order` rebuilds that from the names and shapes and checks it
  against the saved groups.
* The distributed optimizer keeps one flat fp32 buffer per grad buffer:
  parameters in *reverse* ``named_parameters()`` order, each starting at a
  multiple of 64 elements, buckets padded at their end (the padding is
  dropped in checkpoints: "coalesced"). :func:`buffer_layout` follows
  ``_ParamAndGradBuffer.__init__`` (megatron/core/distributed/param_and_grad_buffer.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptbridge.plugin import FormatError


def _no_wd(name: str, shape: Sequence[int], args: Mapping[str, Any]) -> bool:
    if args.get("apply_wd_to_qk_layernorm"):
        return (len(shape) == 1 or name.endswith(".bias")) and not (
            "q_layernorm." in name or "k_layernorm." in name)
    return len(shape) == 1 or name.endswith(".bias")


def _is_embedding_or_output(name: str) -> bool:
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def group_order(params: Sequence[tuple[str, tuple[int, ...]]], groups: Sequence[Mapping[str, Any]],
                args: Mapping[str, Any], where: str) -> list[list[str]]:
    """Names of the params in each saved param group, in slot order.

    ``params`` are (local name, shape) in ``named_parameters()`` order; ``groups``
    the saved param groups (with ``wd_mult``, ``max_lr`` and, in torch state
    dicts, ``params`` index lists whose lengths are checked).
    """
    decoupled = args.get("decoupled_lr")
    out: list[list[str]] = [[] for _ in groups]
    for name, shape in params:
        wd = 0.0 if _no_wd(name, shape, args) else 1.0
        want_lr = decoupled if decoupled is not None and _is_embedding_or_output(name) else None
        hits = [i for i, g in enumerate(groups) if float(g.get("wd_mult", 1.0)) == wd]
        if decoupled is not None and len(hits) > 1:
            is_dec = [i for i in hits if math.isclose(float(groups[i].get("max_lr", -1)), float(decoupled))]
            hits = is_dec if want_lr is not None else [i for i in hits if i not in is_dec]
        if len(hits) != 1:
            raise FormatError(
                f"{where}: cannot tell which optimizer param group holds {name!r} "
                f"(wd_mult={wd}; candidates {hits} of {len(groups)} groups)"
            )
        out[hits[0]].append(name)
    for g, names in zip(groups, out):
        if "params" in g and len(g["params"]) != len(names):
            raise FormatError(
                f"{where}: an optimizer param group has {len(g['params'])} params but the model "
                f"assigns {len(names)} to it ({names[:3]}...); non-standard param-group overrides?"
            )
    return out


@dataclass(frozen=True)
class BufferSlot:
    """Where a parameter lives in a coalesced distributed-optimizer buffer."""

    name: str
    shape: tuple[int, ...]
    start: int  # element offset in the coalesced (bucket-padding-free) buffer
    bucket: int
    bucket_start: int  # element offset of the param inside its bucket's unpadded tensor


def buffer_layout(params: Sequence[tuple[str, tuple[int, ...]]], bucket_size: int | None,
                  shared_embedding: Sequence[str] = (), align: int = 64) -> tuple[list[BufferSlot], list[int]]:
    """Slots of ``params`` (named_parameters order) in the coalesced buffer, and each bucket's
    unpadded size. ``shared_embedding`` names params that get a bucket of their own."""
    slots: list[BufferSlot] = []
    bucket_sizes: list[int] = []
    param_start = bucket_start = 0
    coalesced_base = 0
    n_in_bucket = 0
    end = 0

    def pad(n: int, d: int) -> int:
        return int(math.ceil(n / d) * d) if d > 1 else n

    def close_bucket(param_end: int) -> None:
        nonlocal bucket_start, coalesced_base, n_in_bucket
        size = param_end - bucket_start
        bucket_sizes.append(size)
        coalesced_base += size
        bucket_start = param_end  # end padding is dropped in the coalesced buffer
        n_in_bucket = 0

    for name, shape in reversed(list(params)):
        numel = math.prod(shape)
        param_start = pad(param_start, align)
        own = name in shared_embedding
        if own and n_in_bucket:
            close_bucket(param_start)
            param_start = bucket_start
        end = param_start + numel
        slots.append(BufferSlot(name, tuple(shape), coalesced_base + param_start - bucket_start,
                                len(bucket_sizes), param_start - bucket_start))
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own:
            close_bucket(end)
            param_start = bucket_start
        else:
            param_start = end
    if n_in_bucket:
        close_bucket(end)
    return slots, bucket_sizes


def ddp_bucket_size(args: Mapping[str, Any], pp_rank: int, chunk: int, num_params: int) -> int | None:
    """The bucket size Megatron-LM's ``get_model`` gave DDP on this rank (None: one bucket)."""
    if not args.get("overlap_grad_reduce") or pp_rank > 0 or chunk > 0:
        return None
    if args.get("ddp_num_buckets"):
        return num_params // int(args["ddp_num_buckets"])
    if args.get("ddp_bucket_size"):
        return int(args["ddp_bucket_size"])
    return max(40000000, 1000000 * int(args.get("data_parallel_size") or 1))


_EMBEDDING_AND_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def grad_buffer(params: Sequence[tuple[str, tuple[int, ...]]], args: Mapping[str, Any], pp_rank: int,
                own_embedding_bucket: bool, align: int = 64) -> tuple[list[BufferSlot], list[int]]:
    """One optimizer's coalesced buffer on a pipeline stage, as megatron-core's DDP lays its grad buffer out:
    the slots of ``params`` (``named_parameters()`` order) and each bucket's unpadded size. A
    ``ChainedOptimizer``'s dense and expert optimizers (EP > 1) each have one; ``own_embedding_bucket``
    (the dense one, tied embeddings with PP > 1): the word embedding / output weight in a bucket of its own::

        slots, sizes = grad_buffer([("decoder.final_layernorm.weight", (32,))], args, 0, False)
    """
    num = sum(math.prod(s) for _, s in params)
    shared = _EMBEDDING_AND_OUTPUT if own_embedding_bucket else ()
    return buffer_layout(params, ddp_bucket_size(args, pp_rank, 0, num), shared, align)


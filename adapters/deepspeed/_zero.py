"""ZeRO flat-partition layouts as fragments (pure functions, no I/O).

ZeRO-1/2 and ``BF16_Optimizer`` (``runtime/zero/stage_1_and_2.py``,
``runtime/bf16_optimizer.py``): per param group the parameters are flattened
in ``param_shapes[g]`` order, each followed by
``param_alignment_paddings[g][i]`` zeros, the group is zero-padded at the end,
and split into ``dp`` equal partitions of ``P`` elements. Rank ``r`` holds flat
elements ``[r*P, r*P + P - group_paddings[g])`` at the start of each of its
flat state tensors (fp32 master, exp_avg, exp_avg_sq)::

    frags = zero12_fragments(shapes, pads, ranks, partition=P)

ZeRO-3 (``runtime/zero/stage3.py``): every parameter is partitioned on its
own: ``p = ceil(numel / dp)``, rank ``r`` holds elements ``[r*p, (r+1)*p)``
(the tail zero-padded); a rank's sub-group tensor is its partitions
concatenated in ``param_shapes[sg]`` order::

    frags = zero3_fragments(shapes, ranks)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptbridge.plugin import FormatError, Fragment, flat_range_fragments
from ckptbridge.plugin import dtypes as _dtypes


@dataclass(frozen=True)
class FlatBuffer:
    """One rank's flat tensor of one state: where it starts in which file, and its usable length."""

    file: str
    byte_offset: int
    dtype: str
    numel: int  # elements stored (may include end padding)


@dataclass(frozen=True)
class RankPartition:
    """A rank's slice of one flat group: ``[start, start + real)`` of the group, per state."""

    rank: int
    start: int
    real: int
    buffers: Mapping[str, FlatBuffer]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def zero12_fragments(
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    alignment_paddings: Sequence[int],
    ranks: Sequence[RankPartition],
    where: str = "group",
) -> dict[str, dict[str, tuple[Fragment, ...]]]:
    """Fragments of every parameter of one ZeRO-1/2 flat group, per state.

    ``shapes`` in flat order; ``alignment_paddings[i]`` zeros follow parameter ``i``.
    """
    if len(alignment_paddings) != len(shapes):
        raise FormatError(
            f"{where}: {len(alignment_paddings)} alignment paddings for {len(shapes)} parameters"
        )
    total_real = max((r.start + r.real for r in ranks), default=0)
    out: dict[str, dict[str, tuple[Fragment, ...]]] = {}
    off = 0
    for (name, shape), pad in zip(shapes, alignment_paddings):
        n = _numel(shape)
        if off + n > total_real:
            raise FormatError(
                f"{where}: parameter {name!r} needs flat elements [{off}, {off + n}) but the ranks "
                f"hold only {total_real} (param_shapes and partitions disagree)"
            )
        states: dict[str, list[Fragment]] = {}
        for r in ranks:
            a, b = max(off, r.start), min(off + n, r.start + r.real)
            if a >= b:
                continue
            for state, buf in r.buffers.items():
                if r.real > buf.numel:
                    raise FormatError(
                        f"{buf.file}: {state} partition holds {buf.numel} elements, "
                        f"the layout needs {r.real} (rank {r.rank}, {where})"
                    )
                size = _dtypes.itemsize(buf.dtype)
                states.setdefault(state, []).extend(
                    flat_range_fragments(
                        shape, a - off, b - off, buf.file,
                        buf.byte_offset + (a - r.start) * size, buf.dtype,
                    )
                )
        out[name] = {k: tuple(v) for k, v in states.items()}
        off += n + int(pad)
    return out


def zero3_fragments(
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    ranks: Sequence[Mapping[str, FlatBuffer]],
    where: str = "sub-group",
) -> dict[str, dict[str, tuple[Fragment, ...]]]:
    """Fragments of every parameter of one ZeRO-3 sub-group; ``ranks[r]`` = rank r's buffers per state."""
    world = len(ranks)
    out: dict[str, dict[str, tuple[Fragment, ...]]] = {}
    off = 0
    for name, shape in shapes:
        n = _numel(shape)
        p = math.ceil(n / world) if world else 0
        states: dict[str, list[Fragment]] = {}
        for r, bufs in enumerate(ranks):
            a, b = r * p, min(n, (r + 1) * p)
            for state, buf in bufs.items():
                if off + p > buf.numel:
                    raise FormatError(
                        f"{buf.file}: {state} of {where} holds {buf.numel} elements; parameter "
                        f"{name!r} needs [{off}, {off + p}) (rank {r})"
                    )
                if a >= b:
                    continue
                size = _dtypes.itemsize(buf.dtype)
                states.setdefault(state, []).extend(
                    flat_range_fragments(shape, a, b, buf.file, buf.byte_offset + off * size, buf.dtype)
                )
        out[name] = {k: tuple(v) for k, v in states.items()}
        off += p
    return out

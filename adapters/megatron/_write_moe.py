"""Where the writer puts each parameter at a target layout with expert parallelism (pure functions).

megatron-core 0.16.1 (``megatron/core/transformer/moe/experts.py``, ``parallel_state.py``,
``megatron/core/optimizer/__init__.py``, Megatron-LM ``training/checkpointing.py``):

* the legacy per-rank files are written by the ranks whose expert-data-parallel rank is 0, one
  ``mp_rank_TT[_PPP][_EEE]`` each (TT: the rank's dense TP rank, EEE: its EP rank, only when EP > 1);
  which (TP, EP, ETP) ranks those are follows the ``tp-cp-ep-dp-pp`` rank order of both grids
  (:func:`file_ranks`);
* EP rank ``e`` holds global experts ``e * E_l ... e * E_l + E_l - 1`` as ``local_experts.0 ... E_l - 1``
  (``SequentialMLP``: ``local_expert_indices_offset + local_idx``), split over the expert-TP group
  (``ETP``) as dense layers are over TP (SwiGLU ``[gate_r ; up_r]`` rows, ``linear_fc2`` columns);
* a MoE layer registers ``router``, ``experts`` (``local_experts.K``), ``shared_experts`` in that
  order (``MoELayer.__init__``): the order of ``named_parameters()`` and so of the optimizer slots
  (``_layout._param_sort_key``);
* at EP > 1 every expert parameter has ``allreduce=False`` and ``get_megatron_optimizer`` builds a
  ``ChainedOptimizer`` of a dense and an expert optimizer (expert params in their own param groups,
  ``is_expert_parallel=True``): the legacy ``optimizer`` entry is the list of their two state dicts;
  at EP 1 experts are ordinary params of the one optimizer;
* router buffers (``router.expert_bias``) are in the model state dict, in no optimizer.
* legacy ``GroupedMLP`` keeps a layer's local experts in ``experts.weight1`` / ``weight2``
  (:func:`grouped`); the distributed optimizer's ``distrib_optim.pt`` is ``[dense, expert]`` at EP > 1
  (``ChainedOptimizer.save_parameter_state``), the dense part only from dense-DP rank 0.

Usage::

    file_ranks(tp=2, ep=2, etp=1)  # [RankFile(tp=0, ep=0, etp=0, dp=0), RankFile(1, 1, 0, 0)]: mp_rank_00_000, _01_001
    rank_params(cfg, args, names, shapes, RankFile(1, 1, 0), pp=0)  # dense at TP 1, experts 2, 3
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptbridge.plugin import Box, FormatError

from ._layout import LAYER_RE, MegatronConfig, local_params, shard_box, stage_layers, tp_layout
from ._moe import EXPERT_RE, is_buffer, rank_grid

P = TypeVar("P")


@dataclass(frozen=True)
class RankFile:
    """One legacy rank file: the writing rank's dense TP rank, EP rank, expert-TP rank and dense DP rank."""

    tp: int
    ep: int
    etp: int
    dp: int = 0


@dataclass(frozen=True)
class RankParam:
    """A parameter (or router buffer) of one rank file: its global and local names, local shape,
    the boxes of the full tensor it holds (stacked on dim 0) and whether it is a routed expert's."""

    name: str
    local_name: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    expert: bool
    buffer: bool
    parts: tuple[RankParam, ...] = ()  # a GroupedMLP buffer: its local experts' shards, in order


def grouped(params: Sequence[RankParam], hidden: int) -> list[RankParam]:
    """Legacy ``GroupedMLP`` (``--moe-grouped-gemm``, local spec): each layer's local experts become
    ``experts.weight1`` ``[hidden, E_l * fc1_local]`` (megatron-core views it as ``[E_l, hidden, fc1_local]``:
    expert K's fc1 shard transposed) and ``experts.weight2`` ``[E_l * ffn_local, hidden]`` (``[E_l,
    ffn_local, hidden]``: expert K's fc2 shard transposed), registered in that order where the experts were."""
    out: list[RankParam] = []
    seen: set[str] = set()
    for p in params:
        m = EXPERT_RE.match(p.local_name)
        if m is None:
            out.append(p)
            continue
        if m.group(3) not in ("linear_fc1.weight", "linear_fc2.weight"):
            raise FormatError(f"{p.name}: GroupedMLP experts have no {m.group(3)!r} (biases are not supported)")
        if m.group(1) in seen:
            continue
        seen.add(m.group(1))
        for leaf, buf in (("linear_fc1.weight", "weight1"), ("linear_fc2.weight", "weight2")):
            parts = tuple(q for q in params if (n := EXPERT_RE.match(q.local_name)) and n.group(1) == m.group(1)
                          and n.group(3) == leaf)
            width = sum(q.shape[0] if buf == "weight1" else q.shape[1] for q in parts)
            shape = (hidden, width) if buf == "weight1" else (width, hidden)
            glob = EXPERT_RE.match(parts[0].name)
            assert glob is not None
            out.append(RankParam(f"{glob.group(1)}.{buf}", f"{m.group(1)}.{buf}", shape, (), True, False, parts))
    return out


def file_ranks(tp: int, ep: int, etp: int) -> list[RankFile]:
    """The (TP, EP, ETP) ranks of one pipeline stage that write a legacy file (expert-DP rank 0)."""
    world = math.lcm(tp, ep * etp)
    out = [RankFile(c.tp, c.ep, c.etp, c.dp) for c in rank_grid(tp, 1, ep, etp, world) if c.edp == 0]
    if len({(f.tp, f.ep) for f in out}) != len(out):
        raise FormatError(f"TP={tp} EP={ep} ETP={etp}: Megatron-LM's legacy format names a rank file by its TP and EP "
                          "ranks only; with ETP > TP several ranks would write one file (use ETP <= TP)")
    if {f.tp for f in out} != set(range(tp)):
        raise FormatError(f"TP={tp} EP={ep} ETP={etp}: Megatron-LM's legacy format saves from the expert-data-"
                          f"parallel rank 0 ranks only, which hold TP ranks {sorted({f.tp for f in out})}: the other "
                          "dense TP shards would be lost (use EP x ETP >= TP)")
    return out


def rank_params(cfg: MegatronConfig, args: Mapping[str, Any], names: Sequence[str],
                shapes: Mapping[str, tuple[int, ...]], rank: RankFile, pp: int) -> list[RankParam]:
    """A rank file's parameters in ``named_parameters()`` order (buffers where the state dict has them).

    ``names`` are global names (every expert under its global id), ``shapes`` full shapes. Dense
    parameters are cut for TP rank ``rank.tp``, experts of EP rank ``rank.ep`` for expert-TP rank
    ``rank.etp``; layer numbers become stage-local, expert ids EP-local."""
    num_local = cfg.num_experts // cfg.ep if cfg.num_experts else 0
    mine = range(rank.ep * num_local, (rank.ep + 1) * num_local)
    picked = [n for n in names if not (m := EXPERT_RE.match(n)) or int(m.group(2)) in mine]
    offset = stage_layers(cfg, args)[pp].start
    out = []
    for name, local, boxes in local_params(cfg, args, picked, shapes, rank.tp, pp):
        m = EXPERT_RE.match(name)
        if m:
            shape = tuple(shapes[name])
            boxes = shard_box(shape, tp_layout(name, cfg, len(shape)), cfg.etp, rank.etp)
            local = (sum(b.shape[0] for b in boxes), *boxes[0].shape[1:])
            name_here = f"{m.group(1)}.local_experts.{int(m.group(2)) - rank.ep * num_local}.{m.group(3)}"
        else:
            name_here = name
        lm = LAYER_RE.match(name_here)
        local_name = f"decoder.layers.{int(lm.group(1)) - offset}.{lm.group(2)}" if lm else name_here
        out.append(RankParam(name, local_name, tuple(local), tuple(boxes), m is not None, is_buffer(name)))
    return grouped(out, cfg.hidden) if cfg.grouped_gemm else out


def optimizer_split(params: Sequence[P], ep: int, expert: Callable[[P], bool]) -> list[list[P]]:
    """The parameters (no buffers) of each of megatron-core's optimizers on this rank, in order: one (EP 1:
    experts are ordinary params) or dense + expert (EP > 1: a ``ChainedOptimizer``; ``expert(p)``: a
    routed expert's). The writer and both readers of the distributed optimizer's buffers split so."""
    if ep == 1:
        return [list(params)]
    return [[p for p in params if not expert(p)], [p for p in params if expert(p)]]


def expert_groups(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The expert optimizer's param groups: the dense groups' hyper-parameters with
    ``is_expert_parallel=True`` (megatron-core keys groups by (overrides, is_expert_parallel))."""
    return [{**g, "is_expert_parallel": True} for g in groups]


__all__ = ["RankFile", "RankParam", "expert_groups", "file_ranks", "grouped", "optimizer_split", "rank_params"]

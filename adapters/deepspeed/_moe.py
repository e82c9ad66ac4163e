"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``) under ZeRO-1/2: which ranks hold which experts (pure functions).

DeepSpeed (``utils/groups.py``, ``_create_expert_and_data_parallel``, the default E + D topology)
puts ranks ``[i * EP, (i + 1) * EP)`` in one expert-parallel group and ranks ``e, e + EP, ...`` in
expert-data-parallel group ``e``: rank ``r`` is EP rank ``r % EP`` and EDP rank ``r // EP``. An MoE
param group of the ZeRO optimizer (``'moe': True``, named ``ep_size_<EP>`` by
``split_params_into_different_moe_groups_for_optimizer``) holds the rank's *local* experts
(``deepspeed_experts.K``), flattened and partitioned over its EDP group only; local expert ``K``
of EP rank ``e`` is global expert ``e * num_local + K`` (``engine._save_moe_checkpoint``), which is
also the id in ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``::

    moe_group_ep({"moe": True, "name": "ep_size_2"})       # -> 2
    edp_members(dp=4, ep=2)                                 # -> {0: [0, 2], 1: [1, 3]}
    global_expert("moe.deepspeed_moe.experts.deepspeed_experts.1.fc.weight", ep_rank=1, num_local=2)
    # -> 'moe.deepspeed_moe.experts.deepspeed_experts.3.fc.weight'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ckptbridge.plugin import FormatError, Renumber

EXPERTS = ".deepspeed_experts."


def moe_group_ep(group: Mapping[str, Any]) -> int | None:
    """The expert-parallel size of an MoE param group (None for a dense group)."""
    if not group.get("moe"):
        return None
    m = re.fullmatch(r"ep_size_(\d+)", str(group.get("name", "")))
    if m is None:
        raise FormatError(f"MoE param group named {group.get('name')!r}; expected 'ep_size_<N>'")
    return int(m.group(1))


def edp_members(dp: int, ep: int) -> dict[int, list[int]]:
    """EP rank -> the ranks of its expert-data-parallel group, in EDP-rank order."""
    if dp % ep:
        raise FormatError(f"data-parallel world {dp} does not split into expert-parallel groups of {ep}")
    return {e: list(range(e, dp, ep)) for e in range(ep)}


def global_expert(name: str, ep_rank: int, num_local: int) -> str:
    """Local expert ``K`` of EP rank ``ep_rank`` -> global expert ``ep_rank * num_local + K``."""
    rule = Renumber(re.escape(EXPERTS[:-1]) + r"\.(\d+)\.", axis=f"ep={ep_rank}", offset=ep_rank * num_local)
    return rule.apply(name, num_local)


def engine_expert_names(engine: Any) -> dict[int, str]:
    """``id(param)`` -> the checkpoint name (global expert id) of every expert parameter of a live engine
    whose modules include ``deepspeed.moe.layer.MoE``; the EP rank from DeepSpeed's own groups."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    out: dict[int, str] = {}
    for prefix, mod in engine.module.named_modules():
        if not isinstance(mod, MoE):
            continue
        ep_rank = groups._get_expert_parallel_rank(mod.expert_group_name)
        for name, p in mod.named_parameters():
            full = f"{prefix}.{name}" if prefix else name
            if EXPERTS in full:
                out[id(p)] = global_expert(full, ep_rank, mod.num_local_experts)
    return out


__all__ = ["edp_members", "engine_expert_names", "global_expert", "moe_group_ep"]

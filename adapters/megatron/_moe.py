"""Megatron-core mixture-of-experts layouts (expert parallelism), as pure functions over fragments.

Every routed expert is one logical tensor under its *global* id::

    decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight   # [2 * moe_ffn, hidden] (SwiGLU)
    decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight   # [hidden, moe_ffn]

whatever the layout that wrote it. How megatron-core 0.16.1 lays experts out
(``megatron/core/transformer/moe/experts.py``, ``parallel_state.py``):

* expert parallelism: EP rank ``r`` holds ``num_experts / EP`` local experts;
  local expert ``K`` is global expert ``r * num_local + K`` (``SequentialMLP`` and
  ``GroupedMLP.sharded_state_dict``: ``local_expert_indices_offset + local_idx``);
* experts are split over the *expert* tensor-parallel group (``ETP``,
  ``--expert-tensor-parallel-size``, default TP) as dense layers are over TP:
  ``linear_fc1`` column-parallel with SwiGLU's ``[gate_r ; up_r]`` per rank,
  ``linear_fc2`` row-parallel;
* the global ranks: the dense grid orders ``tp-cp-ep-dp-pp`` with EP 1, the
  expert grid the same with ``tp=ETP, ep=EP, dp=EDP`` (``RankGenerator``);
* legacy ``--ckpt-format torch`` files are written by the ranks whose
  expert-data-parallel rank is 0, into ``mp_rank_TT[_PPP]_EEE`` (TT the dense
  TP rank, EEE the EP rank): dense parameters are repeated in every EP rank's file;
* legacy ``GroupedMLP`` (``--moe-grouped-gemm``, local spec) keeps all local experts
  of a layer in two buffers: ``weight1`` ``[hidden, E_l * fc1_local]`` used as
  ``view(E_l, hidden, fc1_local)`` and ``weight2`` ``[E_l * ffn_local, hidden]`` used as
  ``view(E_l, ffn_local, hidden)``; expert ``K``'s ``linear_fc1.weight`` shard is
  ``weight1.view(E_l, hidden, -1)[K].T`` (a strided view, no copy), its
  ``linear_fc2.weight`` shard ``weight2.view(E_l, -1, hidden)[K].T``;
* ``torch_dist`` stores ``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight``
  ``[layers, experts, ...]`` (both MLP kinds), already global; a block of mixed dense and MoE layers
  per layer, ``decoder.layers.<L>.mlp.experts.experts...`` ``[experts, ...]``;
* which layers are MoE: ``moe_layer_freq`` (:func:`moe_layer_pattern`, global layer numbers); a dense
  layer's MLP is a dense parameter (TP, repeated in every EP rank's file); a multi-token-prediction
  layer's MoE (``mtp.layers.K.transformer_layer.mlp.experts``) is laid out as a decoder layer's.

Usage::

    grid = rank_grid(cfg, world=4)                  # global rank -> (tp, pp, dp, etp, ep, edp)
    [c for c in grid if c.edp == 0]                  # the ranks that wrote legacy files
    global_expert_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", ep_rank=1, num_local=2)
    # -> 'decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight'
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptbridge.plugin import (
    Box,
    FormatError,
    Renumber,
    Rule,
    Shard,
    Split,
    TensorState,
    crop,
    reshape,
    transpose,
    unstack,
)

# a MoE layer's experts: a decoder layer's, or the transformer layer of a multi-token-prediction layer
MLP_AT = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp"
EXPERTS_AT = MLP_AT + r"\.experts"
EXPERT_RE = re.compile(rf"^({EXPERTS_AT})\.local_experts\.(\d+)\.(.*)$")
GROUPED_RE = re.compile(rf"^({EXPERTS_AT})\.(weight1|weight2)$")
_LAYER_MLP = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(router|experts|shared_experts|linear_fc1|linear_fc2)\.")
DIST_EXPERTS = ".mlp.experts.experts."
# Router buffers in the model state dict that no optimizer holds.
BUFFERS = (".mlp.router.expert_bias", ".mlp.router.local_tokens_per_expert")


def moe_fields(args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The MoE fields of ``MegatronConfig`` from Megatron's args (empty for a dense model)."""
    experts = int(args.get("num_experts") or 0)
    ep = int(args.get("expert_model_parallel_size") or 1)
    if not experts:
        if ep != 1:
            raise FormatError(f"{where}: expert_model_parallel_size={ep} without num_experts")
        return {}
    tp = int(args.get("tensor_model_parallel_size") or 1)
    moe_layer_pattern(args, where)  # (dense layers between MoE layers lay out as dense layers: TP only)
    if args.get("moe_grouped_gemm") and str(args.get("transformer_impl")) != "local":
        raise FormatError(f"{where}: Transformer Engine's TEGroupedMLP (experts.linear_fc1.weightK) is not "
                          "supported yet (only the local spec's SequentialMLP and legacy GroupedMLP)")
    if experts % ep:
        raise FormatError(f"{where}: {experts} experts do not split over expert_model_parallel_size={ep}")
    return {"num_experts": experts, "ep": ep, "etp": int(args.get("expert_tensor_parallel_size") or tp),
            "moe_ffn": int(args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size") or 0),
            "grouped_gemm": bool(args.get("moe_grouped_gemm")),
            "shared_ffn": int(args.get("moe_shared_expert_intermediate_size") or 0)}


def moe_layer_pattern(args: Mapping[str, Any], where: str) -> list[bool]:
    """Which decoder layers are MoE layers: megatron-core 0.16.1's ``get_gpt_decoder_layer_specs``
    reading of ``moe_layer_freq`` (an int N: every N-th layer from layer 0; a list: one 0/1 per layer;
    Megatron-LM's ``--moe-layer-freq "([0]*1+[1]*3)"`` is saved as that list). Layer numbers are
    global: which stage holds a layer (``get_transformer_layer_offset``) does not change its kind."""
    layers = int(args.get("num_layers") or 0)
    freq = args.get("moe_layer_freq", 1)
    freq = 1 if freq is None else freq
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return [i % freq == 0 for i in range(layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == layers and all(f in (0, 1) for f in freq):
        return [bool(f) for f in freq]
    raise FormatError(f"{where}: moe_layer_freq={freq!r} is neither a positive int nor a 0/1 list of the "
                      f"{layers} layers")


def check_moe_layers(names: Iterable[str], args: Mapping[str, Any], where: str) -> None:
    """Fail, naming the tensor, where a layer's MLP tensors are not the kind the args make it (a MoE
    layer's router / experts, a dense layer's ``linear_fc1`` / ``linear_fc2``)."""
    pattern = moe_layer_pattern(args, where)
    for name in names:
        m = _LAYER_MLP.match(name)
        if m is None or int(m.group(1)) >= len(pattern):
            continue
        moe = m.group(2) not in ("linear_fc1", "linear_fc2")
        if moe != pattern[int(m.group(1))]:
            kind = "a MoE" if pattern[int(m.group(1))] else "a dense"
            raise FormatError(f"{where}: tensor {name!r} does not belong in layer {m.group(1)}, which "
                              f"moe_layer_freq={args.get('moe_layer_freq', 1)!r} makes {kind} layer")


def is_expert(name: str) -> bool:
    """A routed expert's parameter (local or global name; the legacy GroupedMLP buffers too)."""
    return EXPERT_RE.match(name) is not None or GROUPED_RE.match(name) is not None


def is_buffer(name: str) -> bool:
    return name.endswith(BUFFERS)


def expert_renumber(ep_rank: int, num_local: int) -> Renumber:
    """The rule that gives EP rank ``ep_rank``'s local experts their global ids."""
    return Renumber(rf"^{EXPERTS_AT}\.local_experts\.(\d+)\.", axis=f"ep={ep_rank}",
                    offset=ep_rank * num_local)


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """Local expert ``K`` of EP rank ``ep_rank`` -> global expert ``ep_rank * num_local + K``."""
    return expert_renumber(ep_rank, num_local).apply(name, num_local)


@dataclass(frozen=True)
class RankCoord:
    """One global rank's place in the dense and the expert grids."""

    rank: int
    tp: int
    pp: int
    dp: int
    etp: int
    ep: int
    edp: int


def rank_grid(tp: int, pp: int, ep: int, etp: int, world: int) -> list[RankCoord]:
    """megatron-core's ``RankGenerator`` (order ``tp-cp-ep-dp-pp``, CP 1) for both grids."""
    if world % (tp * pp) or world % (etp * ep * pp):
        raise FormatError(f"world size {world} does not fit TP={tp} PP={pp} EP={ep} ETP={etp}")
    dp, edp = world // (tp * pp), world // (etp * ep * pp)
    out = []
    for r in range(world):
        out.append(RankCoord(r, r % tp, r // (tp * dp), (r // tp) % dp, r % etp, (r // etp) % ep,
                             (r // (etp * ep)) % edp))
    return out


def grouped_experts(name: str, w: TensorState, hidden: int, num_local: int, ep_rank: int) -> list[tuple[str, TensorState]]:
    """A legacy GroupedMLP buffer (one ETP shard) -> each local expert's shard under its global name.

    ``weight1`` ``[hidden, E_l * X]`` is ``view(E_l, hidden, X)``: expert K's fc1 shard is
    ``[K].T`` (``[X, hidden]``); ``weight2`` ``[E_l * Y, hidden]`` is ``view(E_l, Y, hidden)``: its
    fc2 shard is ``[K].T`` (``[hidden, Y]``) -- megatron-core's ``sh_ten_build_fn``."""
    m = GROUPED_RE.match(name)
    if m is None:
        raise FormatError(f"{name}: not a GroupedMLP buffer")
    total = w.shape[0] * w.shape[1]
    if len(w.shape) != 2 or total % (num_local * hidden):
        raise FormatError(f"{name}: shape {w.shape} is not {num_local} experts x hidden {hidden}")
    per = total // (num_local * hidden)
    first = m.group(2) == "weight1"
    view = reshape(w, (num_local, hidden, per) if first else (num_local, per, hidden))
    out = []
    for k, piece in enumerate(unstack(view, 0)):
        leaf = "linear_fc1.weight" if first else "linear_fc2.weight"
        out.append((f"{m.group(1)}.local_experts.{ep_rank * num_local + k}.{leaf}", transpose(piece, (1, 0))))
    return out


def dist_experts(name: str, state: TensorState) -> list[tuple[str, TensorState]]:
    """A torch_dist layer's ``...mlp.experts.experts.X`` ``[experts, ...]`` -> one state per global expert."""
    head, _, leaf = name.partition(DIST_EXPERTS)
    return [(f"{head}.mlp.experts.local_experts.{e}.{leaf}", part) for e, part in enumerate(unstack(state, 0))]


def expert_crop(state: TensorState, expert: int) -> TensorState:
    """Global expert ``expert`` of a stacked ``[experts, ...]`` state (e.g. megatron-core's own)."""
    box = Box((expert,) + (0,) * (len(state.shape) - 1), (1, *state.shape[1:]))
    return unstack(crop(state, box), 0)[0]


def moe_rules(num_experts: int, ep: int) -> list[Rule]:
    """The layout rules of the routed experts (shown in ``ckpt.rules``)."""
    local = num_experts // ep
    rules: list[Rule] = [
        Shard(r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.(weight|bias)$", axis="etp", dim=0),
        Shard(r"\.mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight$", axis="etp", dim=1),
    ]
    if ep > 1:
        rules += [expert_renumber(r, local) for r in range(ep)]
    return rules


def moe_split_rules(moe_ffn: int, shared_ffn: int) -> list[Split]:
    """SwiGLU ``linear_fc1`` of every routed expert (and of the shared expert) as gate/up."""
    rules = [Split(r"^(.*\.mlp\.experts\.local_experts\.\d+\.linear_fc1)\.(weight|bias)$", to=r"\1.{part}.\2",
                   dim=0, parts=("gate", "up"), widths=(moe_ffn, moe_ffn), groups=1)]
    if shared_ffn:
        rules.append(Split(r"^(.*\.mlp\.shared_experts\.linear_fc1)\.(weight|bias)$", to=r"\1.{part}.\2",
                           dim=0, parts=("gate", "up"), widths=(shared_ffn, shared_ffn), groups=1))
    return rules


__all__ = ["RankCoord", "check_moe_layers", "dist_experts", "expert_crop", "global_expert_name", "grouped_experts", "is_buffer",
           "is_expert", "moe_fields", "moe_layer_pattern", "moe_rules", "moe_split_rules", "rank_grid"]

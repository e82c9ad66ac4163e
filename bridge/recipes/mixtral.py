"""Mixtral: the Llama decoder with a mixture-of-experts MLP in every layer, between HF, MaxText and
megatron-core.

HF (``save_pretrained``'s names): the router ``block_sparse_moe.gate.weight`` ``[X, E]`` and experts
``block_sparse_moe.experts.N.w1`` (gate) / ``w3`` (up) / ``w2`` (down). MaxText (``decoder_block=mixtral``):
``MoeBlock_0/gate/kernel`` ``[E, X]`` and ``MoeBlock_0/wi_0`` / ``wi_1`` / ``wo`` stacked over experts on
axis 0 (scanned: ``[X, L, in, out]``), the query kernel holding the folded ``1/sqrt(head_dim)``.
megatron-core: Qwen3-MoE's names without the q/k norms (``qwen3_moe.megatron_to_hf``, whose HF names
are then renamed to Mixtral's): the router ``mlp.router.weight``, SequentialMLP's
``mlp.experts.local_experts.N.linear_fc1`` (``[gate; up]``) / ``linear_fc2`` (as ckptbridge's Megatron
reader gives them at any EP: global expert ids), or GroupedMLP's buffers (``megatron_experts="grouped"``).
Megatron <-> MaxText is the composition through the HF names (with the Adam moments: the query's
``Scale`` carries ``exp_avg`` / ``exp_avg_sq`` by ``1/c`` / ``1/c**2``).

Routing: HF's ``MixtralTopKRouter`` takes the softmax over all experts, its top k, and renormalises them
to sum 1, which is the softmax over the top-k logits; megatron-core's ``TopKRouter`` computes that with
``moe_router_score_function="softmax"`` and ``moe_router_pre_softmax=False`` (top-k, then softmax:
``topk_routing_with_score_function``), and MaxText's ``RoutedMoE.get_topk`` for ``decoder_block=mixtral``
too (``lax.top_k`` of the logits, then softmax). ``pre_softmax=True`` (softmax, top-k, no
renormalisation) has no Mixtral config, and ``hf_config`` refuses it. HF's load-balancing loss pools
every layer's tokens and does not divide by top-k, Megatron's sums per-layer switch losses: no
coefficient makes them equal, so none is carried (``moe_aux_loss_coeff=0`` / ``router_aux_loss_coef=0``).

    recipes.rules("mixtral", src="hf", dst="maxtext", n_heads=32, n_kv_heads=8, head_dim=128)
    recipes.rules("mixtral", src="megatron", dst="maxtext", **recipes.config_from_hf("Mixtral-8x7B/config.json"))
    recipes.megatron_args("Mixtral-8x7B/config.json")["moe_router_pre_softmax"]   # False
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._errors import OptionError
from ..rules import Rename, Rule
from . import _gpt, qwen3_moe
from ._family import Family
from ._gpt import L, hf_to_maxtext
from .qwen3 import megatron_qk_norm_names
from .qwen3_moe import MoeConfig

# Qwen3-MoE's HF names (after ``model.layers.N.``) -> Mixtral's
QWEN3_MOE_TO_MIXTRAL = (
    (r"mlp\.gate\.weight", "block_sparse_moe.gate.weight"),
    *((rf"mlp\.experts\.(?P<expert>\d+)\.{qwen}_proj\.weight", rf"block_sparse_moe.experts.\g<expert>.{w}.weight")
      for qwen, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))),
)


@dataclass(frozen=True)
class MixtralConfig(MoeConfig):
    """:class:`MoeConfig` for Mixtral: its HF experts are ``save_pretrained``'s (``hf_experts="split"``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hf_experts != "split":
            raise OptionError("recipe 'mixtral': the HF experts are save_pretrained's block_sparse_moe.experts.N.w1/w2/w3 "
                              f"(hf_experts='split'), got {self.hf_experts!r}")


def megatron_to_hf(c: MixtralConfig) -> list[Rule]:
    """megatron-core -> HF: Qwen3-MoE's rules without its q/k norms, then Mixtral's HF names; the HF
    attention checks last (where the composition with HF -> MaxText, which begins with them, keeps
    them once)."""
    checks = _gpt.hf_expects(c)
    skip = [*megatron_qk_norm_names(), *checks]
    rules = [r for r in qwen3_moe.megatron_to_hf(c) if r not in skip]
    return [*rules, *(Rename(r"^model\.layers\." + L + r"\." + qwen + "$", r"model.layers.\g<layer>." + mixtral)
                      for qwen, mixtral in QWEN3_MOE_TO_MIXTRAL), *checks]


def config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Llama config plus ``n_experts`` and ``moe_mlp`` (Mixtral's ``intermediate_size``: the experts' width)."""
    return {**_gpt.config_from_hf(hf), "n_experts": int(hf["num_local_experts"]),
            "moe_mlp": int(hf["intermediate_size"])}


def megatron_args(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Megatron args of Mixtral's experts (see the module doc for the router): every layer MoE."""
    if hf.get("sliding_window"):
        raise OptionError(f"megatron_args: Mixtral's sliding_window={hf['sliding_window']} has no megatron-core "
                          "GPT equivalent here")
    return {"num_experts": int(hf["num_local_experts"]), "moe_ffn_hidden_size": int(hf["intermediate_size"]),
            "moe_router_topk": int(hf["num_experts_per_tok"]), "moe_router_pre_softmax": False,
            "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0, "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall",
            "moe_layer_freq": [1] * int(hf["num_hidden_layers"])}


def hf_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """The HF ``MixtralForCausalLM`` config keys of a Megatron run; args Mixtral cannot express fail."""
    if not args.get("num_experts"):
        raise OptionError("hf_config: these Megatron args have no num_experts (not a mixture of experts)")
    freq = args.get("moe_layer_freq", 1)
    off = {k: args.get(k) for k in ("moe_router_pre_softmax", "qk_layernorm", "moe_shared_expert_intermediate_size",
                                    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                                    "moe_router_num_groups") if args.get(k)}
    if args.get("moe_router_score_function", "softmax") != "softmax":
        off["moe_router_score_function"] = args["moe_router_score_function"]
    if freq not in (1, None) and not (isinstance(freq, (list, tuple)) and all(freq)):
        off["moe_layer_freq"] = freq
    if off:
        raise OptionError(f"hf_config: Mixtral (top-k softmax router renormalised, experts in every layer, no "
                          f"shared expert, no q/k norms) cannot express these Megatron args: {off}")
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "num_local_experts": int(args["num_experts"]), "num_experts_per_tok": int(args["moe_router_topk"]),
            "intermediate_size": int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]),
            "router_aux_loss_coef": 0.0, "sliding_window": None}


FAMILY = Family(name="mixtral", model_types=("mixtral",), config=MixtralConfig, from_hf=config_from_hf,
                megatron_args=megatron_args, hf_config=hf_config,
                base={("hf", "maxtext"): partial(hf_to_maxtext, moe=True), ("megatron", "hf"): megatron_to_hf})

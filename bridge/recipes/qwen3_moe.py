"""Qwen3-MoE: Qwen3's attention (q/k norms, no QKV bias) with a mixture-of-experts MLP: router
``mlp.gate`` ``[X, E]`` and experts ``mlp.experts.N.{gate,up,down}_proj`` as ``save_pretrained``
writes them (``hf_experts="split"``), or as transformers 5's module holds them (a torch
``state_dict`` / optimizer: ``mlp.experts.gate_up_proj`` ``[X, 2F, E]`` and ``mlp.experts.down_proj``
``[X, E, F]``, ``hf_experts="fused"``). ``n_experts`` (``config_from_hf`` reads it) is checked against
the router and the experts before any byte is read; left out, the expert count is not checked.

MaxText (``decoder_block=qwen3_moe``, ``moe_block`` in every layer): the router kernel ``[E, X]``,
``wi_0`` / ``wi_1`` ``[X, E, F]`` and ``wo`` ``[X, F, E]``, experts on axis 0, the layers of a
scanned tree on axis 1 (``[X, L, ...]``), as MaxText's converter stacks them
(``QWEN_MAXTEXT_TO_HF_PARAM_MAPPING``: experts outer, layers inner). megatron-core: the router
``mlp.router.weight`` ``[X, E]``, experts ``mlp.experts.local_experts.N.linear_fc1`` (``[gate; up]``)
and ``linear_fc2`` (the local spec's ``SequentialMLP``; from either HF layout: ``hf_experts="fused"``
stacks them into ``gate_up_proj`` / ``down_proj``, the layout PEFT's expert LoRA adapts), or with
``megatron_experts="grouped"`` the legacy ``GroupedMLP`` module's two buffers per layer (``moe_grouped_gemm=True``, local spec):
``mlp.experts.weight1`` ``[E, X * 2F]`` and ``mlp.experts.weight2`` ``[X * F, E]``, which megatron-core
reads as ``weight1.view(X, E, 2F)`` and ``weight2.view(X, F, E)`` (expert N's ``linear_fc1`` is
``[N].T``); it needs ``n_experts`` and ``moe_mlp`` (F, ``config_from_hf`` reads both). That is the
names of the module's ``state_dict`` (``ckptbridge.adapters.torch.load_module`` into a built
``GPTModel``); a Megatron *checkpoint* of a GroupedMLP run is read with per-expert names already (the
Megatron adapter splits the buffers), so it takes the default ``"sequential"``. A layer without
experts (HF ``mlp_only_layers``) keeps the dense names; MaxText's Qwen3-MoE decoder has none.

    recipes.rules("qwen3_moe", src="hf", dst="maxtext", n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128)
    recipes.rules("qwen3_moe", src="hf", dst="megatron", **recipes.config_from_hf(cfg), megatron_experts="grouped")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import OptionError
from ..rules import Expect, Rename, Reshape, Rule, Split, SplitDim, Stack, Transpose, Unstack
from . import _gpt, qwen3
from ._family import Family
from ._gpt import HF_LAYER, MX_LAYER, L, RecipeConfig
from .qwen3 import megatron_qk_norm_names, qk_norm_names, spliced

EXPERTS = (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))  # HF expert weight -> MaxText leaf


@dataclass(frozen=True)
class MoeConfig(RecipeConfig):
    """:class:`RecipeConfig` plus the expert count, the experts' width and the HF and Megatron experts' layouts."""

    n_experts: int | None = None
    hf_experts: str = "split"  # "split" (save_pretrained's names) | "fused" (the module's parameters)
    moe_mlp: int | None = None  # the experts' width F (HF moe_intermediate_size); megatron_experts="grouped" needs it
    megatron_experts: str = "sequential"  # "sequential" (SequentialMLP's local_experts.N) | "grouped" (GroupedMLP)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts is not None and int(self.n_experts) < 1:
            raise OptionError(f"recipe config: n_experts must be a positive integer, got {self.n_experts!r}")
        if self.hf_experts not in ("split", "fused"):
            raise OptionError(f"recipe config: hf_experts must be 'split' or 'fused', got {self.hf_experts!r}")
        if self.megatron_experts not in ("sequential", "grouped"):
            raise OptionError("recipe config: megatron_experts must be 'sequential' or 'grouped', "
                              f"got {self.megatron_experts!r}")
        if self.megatron_experts == "grouped" and not (self.n_experts and self.moe_mlp and int(self.moe_mlp) > 0):
            raise OptionError("recipe config: megatron_experts='grouped' needs n_experts and moe_mlp (the experts' "
                              f"width), got n_experts={self.n_experts!r}, moe_mlp={self.moe_mlp!r}")


def hf_moe_expects(c: MoeConfig) -> list[Rule]:
    x, f = c.n_experts, c.moe_mlp
    out: list[Rule] = []
    if x is not None:
        out.append(Expect(HF_LAYER + r"mlp\.gate\.weight$", (x, None), f"n_experts = {x} router rows"))
        if c.hf_experts == "fused":
            out.append(Expect(HF_LAYER + r"mlp\.experts\.(gate_up|down)_proj$", (x, None, None), f"n_experts = {x}"))
    if f is not None and c.hf_experts == "split":
        expert = HF_LAYER + r"mlp\.experts\.\d+\."
        out += [Expect(expert + r"(gate|up)_proj\.weight$", (f, None), f"moe_mlp = {f} rows"),
                Expect(expert + r"down_proj\.weight$", (None, f), f"moe_mlp = {f} columns")]
    elif f is not None:
        out += [Expect(HF_LAYER + r"mlp\.experts\.gate_up_proj$", (None, 2 * f, None), f"2 x moe_mlp = {2 * f}"),
                Expect(HF_LAYER + r"mlp\.experts\.down_proj$", (None, None, f), f"moe_mlp = {f} columns")]
    return out


def maxtext_moe_expects(c: MoeConfig) -> list[Rule]:
    x, lay = c.n_experts, ((None,) if c.scan else ())
    if x is None:
        return []
    at = r"^decoder/layers/" if c.scan else r"^decoder/layers_\d+/"
    scanned = "layers, " if c.scan else ""
    return [Expect(at + r"moe_block/gate/kernel$", (None, *lay, x), f"[embed, {scanned}n_experts={x}]"),
            Expect(at + r"moe_block/(wi_0|wi_1|wo)$", (x, *lay, None, None), f"[n_experts={x}, {scanned}in, out]")]


def hf_to_maxtext(c: MoeConfig) -> list[Rule]:
    """HF -> MaxText: Qwen3's rules, the router named (its kernel transposed with the others), the
    experts named and transposed to ``[in, out]``, stacked on axis 0 before the layers are."""
    names: list[Rule] = [*hf_moe_expects(c), *qk_norm_names(),
                         Rename(HF_LAYER + r"mlp\.gate\.weight$", MX_LAYER + "moe_block/gate/kernel")]
    per_layer: list[Rule]
    if c.hf_experts == "split":
        names += [Rename(HF_LAYER + rf"mlp\.experts\.(?P<expert>\d+)\.{hf}\.weight$",
                         MX_LAYER + f"moe_block/{mx}/expert_\\g<expert>") for hf, mx in EXPERTS]
        per_layer = [Stack(r"^(?P<leaf>decoder/layers_\d+/moe_block/wi_[01]|decoder/layers_\d+/moe_block/wo)"
                           r"/expert_(?P<expert>\d+)$", r"\g<leaf>", dim=0, index="expert")]
    else:
        names += [Split(HF_LAYER + r"mlp\.experts\.gate_up_proj$", MX_LAYER + "moe_block/{part}", dim=1,
                        parts=("wi_0", "wi_1")),
                  Rename(HF_LAYER + r"mlp\.experts\.down_proj$", MX_LAYER + "moe_block/wo")]
        per_layer = [Transpose(r"/moe_block/(wi_0|wi_1|wo)$", (0, 2, 1))]
    return spliced(_gpt.hf_to_maxtext(c), c, names, per_layer) + maxtext_moe_expects(c)


def grouped_experts(x: int, f: int) -> list[Rule]:
    """megatron-core's legacy ``GroupedMLP`` buffers of ``x`` experts ``f`` wide -> ``SequentialMLP``'s
    per-expert weights, as its forward views them: ``weight1`` ``[E, X * 2F]`` is ``view(X, E, 2F)`` (a
    reinterpretation of the bytes, not a transpose), expert N's ``linear_fc1`` ``[2F, E]`` its ``[N].T``;
    ``weight2`` ``[X * F, E]`` is ``view(X, F, E)``, expert N's ``linear_fc2`` ``[E, F]`` its ``[N].T``
    (shared with the ``deepseek_v3`` recipe)."""
    at = r"^decoder\.layers\." + L + r"\.mlp\.experts\."
    to = r"decoder.layers.\g<layer>.mlp.experts.local_experts.{expert}."
    return [Reshape(at + r"weight1$", (x, -1, 2 * f), (-1, x * 2 * f)),
            Unstack(at + r"weight1$", to + "linear_fc1.weight", dim=0, index="expert"),
            SplitDim(at + r"weight2$", dim=0, sizes=(x, f)),
            Unstack(at + r"weight2$", to + "linear_fc2.weight", dim=0, index="expert"),
            Transpose(at + r"local_experts\.\d+\.linear_fc[12]\.weight$", (1, 0))]


def megatron_to_hf(c: MoeConfig) -> list[Rule]:
    """megatron-core -> HF: Qwen3's rules, the router renamed, each local expert's ``linear_fc1``
    split into gate and up (``megatron_experts="grouped"``: first out of GroupedMLP's buffers), or
    (``hf_experts="fused"``) the local experts stacked into transformers' ``gate_up_proj [X, 2F, E]``
    (``linear_fc1`` is ``[gate; up]``, as transformers chunks it) and ``down_proj [X, E, F]``."""
    layer = r"^decoder\.layers\." + L + r"\."
    expert = layer + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\."
    to = r"model.layers.\g<layer>.mlp.experts.\g<expert>."
    check = [] if c.n_experts is None else \
        [Expect(layer + r"mlp\.router\.weight$", (c.n_experts, None), f"n_experts = {c.n_experts} router rows")]
    experts: list[Rule] = [
        Split(expert + r"linear_fc1\.weight$",
              r"decoder.layers.\g<layer>.mlp.experts.local_experts.\g<expert>.linear_fc1.{part}.weight", dim=0,
              parts=("gate", "up")),
        Rename(expert + r"linear_fc1\.(?P<w>gate|up)\.weight$", to + r"\g<w>_proj.weight"),
        Rename(expert + r"linear_fc2\.weight$", to + "down_proj.weight")]
    if c.hf_experts == "fused":
        experts = [Stack(expert + rf"linear_fc{k}\.weight$", rf"model.layers.\g<layer>.mlp.experts.{hf}", dim=0,
                         index="expert") for k, hf in ((1, "gate_up_proj"), (2, "down_proj"))]
    return [
        *check,
        *(grouped_experts(int(c.n_experts or 0), int(c.moe_mlp or 0)) if c.megatron_experts == "grouped" else ()),
        *megatron_qk_norm_names(),
        Rename(layer + r"mlp\.router\.weight$", r"model.layers.\g<layer>.mlp.gate.weight"),
        *experts,
        *_gpt.megatron_to_hf(c),
        *hf_moe_expects(c),
    ]


def n_experts(hf: Mapping[str, Any]) -> int:
    """HF's expert count: ``num_experts`` (Qwen's releases) or ``num_local_experts`` (what transformers
    5 writes, its attribute map's name)."""
    return int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"])


def config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3's config plus ``n_experts`` and ``moe_mlp`` (the experts' width)."""
    return {**_gpt.config_from_hf(hf), "n_experts": n_experts(hf), "moe_mlp": int(hf["moe_intermediate_size"])}


def megatron_args(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Megatron args of Qwen3-MoE's attention and experts (megatron-core's softmax top-k router:
    ``pre_softmax=False`` is softmax over the top k, HF's ``norm_topk_prob=True``; no aux loss)."""
    dense = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step") or 1)
    layers = int(hf["num_hidden_layers"])
    return {"qk_layernorm": True, "num_experts": n_experts(hf),
            "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            "moe_router_topk": int(hf["num_experts_per_tok"]),
            "moe_router_pre_softmax": not bool(hf.get("norm_topk_prob", False)),
            "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0, "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall",
            "moe_layer_freq": [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]}


def hf_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config keys of a Qwen3-MoE Megatron run: Qwen3's, and the experts from the MoE args."""
    if not args.get("num_experts"):
        raise OptionError("hf_config: these Megatron args have no num_experts (not a mixture of experts)")
    freq = args.get("moe_layer_freq", 1)
    layers = int(args["num_layers"])
    moe = list(freq) if isinstance(freq, (list, tuple)) else [int(i % int(freq) == 0) for i in range(layers)]
    return {**qwen3.hf_config(args), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": int(args["num_experts"]), "num_experts_per_tok": int(args["moe_router_topk"]),
            "moe_intermediate_size": int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]),
            "norm_topk_prob": not bool(args.get("moe_router_pre_softmax")), "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, m in enumerate(moe) if not m], "router_aux_loss_coef": 0.0}


FAMILY = Family(name="qwen3_moe", model_types=("qwen3_moe",), config=MoeConfig, from_hf=config_from_hf,
                megatron_args=megatron_args, hf_config=hf_config, defaults={"query_scale": False},
                base={("hf", "maxtext"): hf_to_maxtext, ("megatron", "hf"): megatron_to_hf})

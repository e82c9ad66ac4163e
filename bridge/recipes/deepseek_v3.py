"""DeepSeek-V3 / R1 (HF ``DeepseekV3ForCausalLM``): multi-head latent attention, ``first_dense`` dense
layers, then mixture-of-experts layers with routed experts, shared experts and a sigmoid router
with its score-correction bias.

    recipes.rules("deepseek_v3", src="hf", dst="maxtext", **recipes.config_from_hf("DeepSeek-V3/config.json"))

HF <-> MaxText follows MaxText 0.2.5's decoder (``models/deepseek.py``): dense and MoE layers are
two stacks (``decoder/dense_layers_N`` and ``decoder/moe_layers_M``, M counted from the first MoE
layer; scanned: ``decoder/dense_layers`` / ``decoder/moe_layers`` with the layer on axis 1), MLA
kernels ``wq_a`` / ``q_norm`` / ``wq_b`` (``query`` without a query LoRA), ``wkv_a`` / ``kv_norm`` /
``wkv_b`` / ``out`` with the heads split out, routed experts stacked on axis 0 of
``DeepSeekMoeBlock_0/MoeBlock_0/wi_0|wi_1|wo``, shared experts in
``DeepSeekMoeBlock_0/shared_experts``. The router's correction bias lives in MaxText's second
variable collection, ``MoEBiasVar`` (``MoEBiasVar/decoder/moe_layers_M/.../gate/bias``; scanned:
the layer on axis 0). MaxText's converter hooks only transpose and reshape (no rotary permutation:
both keep DeepSeek's interleaved rope rows, no query scale: MLA scales at run time). MaxText has
no MTP layers in its decoder here: HF layers ``num_hidden_layers ..`` (the release's MTP layer) are
dropped with a warning naming them. See ``tools/maxtext/NOTES.md`` for the converter's own bugs.

HF <-> megatron-core: MLA's ``linear_q_down_proj`` / ``linear_q_up_proj`` (norm
``q_layernorm``, or TE's ``linear_q_up_proj.layer_norm_weight``), ``linear_kv_down_proj`` /
``linear_kv_up_proj`` (``kv_layernorm`` or TE's fused norm), ``linear_proj``; the router
``mlp.router.weight`` and ``mlp.router.expert_bias``; routed experts
``mlp.experts.local_experts.N.linear_fc1`` ([gate; up]) / ``linear_fc2``; ``mlp.shared_experts``.
The release's MTP layers (HF ``model.layers.<num_hidden_layers + K>``, ``mtp_layers`` of them) are
megatron-core's ``mtp.layers.K``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` as
``final_layernorm`` and the decoder layer as ``transformer_layer`` (same names as a decoder layer's);
HF's copies of the embedding and output layer in the MTP layer (``embed_tokens``,
``shared_head.head``) are dropped with a warning naming them: megatron-core's MTP shares the main
model's (``megatron_args`` gives ``mtp_num_layers``). Megatron MTP layers beyond ``mtp_layers`` are
dropped with a warning. ``megatron_experts="grouped"`` names the routed experts as megatron-core's
legacy ``GroupedMLP`` module holds them (``mlp.experts.weight1`` / ``weight2``, as in the ``qwen3_moe``
recipe; it needs ``n_experts`` and ``moe_mlp``, which ``config_from_hf`` gives). The Megatron
checkpoint adapter lays out MLA at any TP (``reshard --to megatron --tp 2``: the down projections split
over TP under megatron-core's local spec, replicated under Transformer Engine's) and the experts at any EP / ETP (``-o ep=2``: the dense first layers' MLP in every EP rank's file);
:func:`megatron_args` gives the args (``-o args=...``; given the checkpoint directory, ``mtp_num_layers``
counts the MTP layers its tensors have).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import OptionError
from ..rules import Drop, Expect, Rename, Rule, Split, SplitDim, Stack, Transpose
from ._family import Family
from .qwen3_moe import grouped_experts


@dataclass(frozen=True)
class DeepseekConfig:
    """The shape facts the DeepSeek-V3 recipes need (``config_from_hf`` reads them)."""

    n_heads: int
    n_layers: int
    first_dense: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: no query LoRA (``q_proj``)
    mtp_layers: int = 0  # HF layers n_layers .. n_layers + mtp_layers - 1 (megatron's mtp.layers; MaxText: dropped)
    scan: bool = True
    megatron_norms: str = "local"  # "local" | "te" (MLA's norms fused into the up projections)
    n_experts: int | None = None  # routed experts (megatron_experts="grouped" needs them and moe_mlp)
    moe_mlp: int | None = None  # the routed experts' width
    megatron_experts: str = "sequential"  # "sequential" (SequentialMLP's local_experts.N) | "grouped" (GroupedMLP)

    def __post_init__(self) -> None:
        for key in ("n_heads", "n_layers", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(getattr(self, key)) < 1:
                raise OptionError(f"recipe config: {key} must be a positive integer, got {getattr(self, key)!r}")
        if not 0 <= self.first_dense <= self.n_layers:
            raise OptionError(f"recipe config: first_dense={self.first_dense} is not in 0..n_layers={self.n_layers}")
        if self.megatron_norms not in ("local", "te"):
            raise OptionError(f"recipe config: megatron_norms must be 'local' or 'te', got {self.megatron_norms!r}")
        if self.megatron_experts not in ("sequential", "grouped"):
            raise OptionError("recipe config: megatron_experts must be 'sequential' or 'grouped', "
                              f"got {self.megatron_experts!r}")
        if self.megatron_experts == "grouped" and not (self.n_experts and self.moe_mlp):
            raise OptionError("recipe config: megatron_experts='grouped' needs n_experts and moe_mlp, "
                              f"got n_experts={self.n_experts!r}, moe_mlp={self.moe_mlp!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# HF leaf (after ``model.layers.N.``) -> MaxText leaf (after ``decoder/<dense|moe>_layers_M/``)
ATTENTION = (
    ("input_layernorm.weight", "pre_self_attention_layer_norm/scale"),
    ("post_attention_layernorm.weight", "post_self_attention_layer_norm/scale"),
    ("self_attn.q_proj.weight", "self_attention/query/kernel"),
    ("self_attn.q_a_proj.weight", "self_attention/wq_a/kernel"),
    ("self_attn.q_a_layernorm.weight", "self_attention/q_norm/scale"),
    ("self_attn.q_b_proj.weight", "self_attention/wq_b/kernel"),
    ("self_attn.kv_a_proj_with_mqa.weight", "self_attention/wkv_a/kernel"),
    ("self_attn.kv_a_layernorm.weight", "self_attention/kv_norm/scale"),
    ("self_attn.kv_b_proj.weight", "self_attention/wkv_b/kernel"),
    ("self_attn.o_proj.weight", "self_attention/out/kernel"),
)
MLP = (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))
DENSE = tuple((f"mlp.{hf}.weight", f"mlp/{mx}/kernel") for hf, mx in MLP)
MOE = (*((f"mlp.shared_experts.{hf}.weight", f"DeepSeekMoeBlock_0/shared_experts/{mx}/kernel") for hf, mx in MLP),
       ("mlp.gate.weight", "DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel"))
EXPERT = r"mlp\.experts\.(?P<expert>\d+)\."
BIAS = "DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"
GLOBAL = (
    (r"^model\.embed_tokens\.weight$", "token_embedder/embedding"),
    (r"^model\.norm\.weight$", "decoder/decoder_norm/scale"),
    (r"^lm_head\.weight$", "decoder/logits_dense/kernel"),
)
AT = r"^decoder/(?P<at>[a-z]+_layers_\d+)/"


def _esc(name: str) -> str:
    return name.replace(".", r"\.")


def drop_mtp(c: DeepseekConfig) -> list[Rule]:
    """HF's MTP layers (``model.layers.<n_layers + k>.``), left out with a warning."""
    if not c.mtp_layers:
        return []
    layers = "|".join(str(c.n_layers + k) for k in range(c.mtp_layers))
    return [Drop(rf"^model\.layers\.(?:{layers})\.", "DeepSeek MTP layers: the target decoder has none")]


def hf_expects(c: DeepseekConfig) -> list[Rule]:
    h, layer = c.n_heads, r"^model\.layers\.\d+\.self_attn\."
    return [
        Expect(layer + r"q_b_proj\.weight$", (h * c.qk_head_dim, c.q_lora_rank or None),
               f"n_heads x (qk_nope_head_dim + qk_rope_head_dim) = {h} x {c.qk_head_dim} rows, q_lora_rank columns"),
        Expect(layer + r"q_proj\.weight$", (h * c.qk_head_dim, None),
               f"n_heads x (qk_nope_head_dim + qk_rope_head_dim) = {h} x {c.qk_head_dim} rows"),
        Expect(layer + r"kv_a_proj_with_mqa\.weight$", (c.kv_lora_rank + c.qk_rope_head_dim, None),
               f"kv_lora_rank + qk_rope_head_dim = {c.kv_lora_rank} + {c.qk_rope_head_dim} rows"),
        Expect(layer + r"kv_b_proj\.weight$", (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
               f"n_heads x (qk_nope_head_dim + v_head_dim) = {h} x {c.qk_nope_head_dim + c.v_head_dim} rows, "
               f"kv_lora_rank = {c.kv_lora_rank} columns"),
        Expect(layer + r"o_proj\.weight$", (None, h * c.v_head_dim), f"n_heads x v_head_dim = {h} x {c.v_head_dim} columns"),
    ]


def hf_to_maxtext(c: DeepseekConfig) -> list[Rule]:
    """HF -> MaxText (every rule invertible; see the module doc)."""
    h = c.n_heads
    out: list[Rule] = [*hf_expects(c), *drop_mtp(c)]  # hf_expects: what megatron_to_hf ends with (routes compose)
    for i in range(c.n_layers):  # renumber: dense layers 0.., MoE layers 0.. from the first MoE layer
        at = f"dense_layers_{i}" if i < c.first_dense else f"moe_layers_{i - c.first_dense}"
        out.append(Rename(rf"^model\.layers\.{i}\.(?P<leaf>.+)$", f"decoder/{at}/\\g<leaf>"))
    out += [Rename(AT + _esc(hf) + "$", r"decoder/\g<at>/" + mx) for hf, mx in (*ATTENTION, *DENSE, *MOE)]
    out += [Rename(AT + EXPERT + _esc(hf) + r"\.weight$", r"decoder/\g<at>/DeepSeekMoeBlock_0/MoeBlock_0/"
                   + mx + r"/expert_\g<expert>") for hf, mx in MLP]
    out.append(Rename(AT + r"mlp\.gate\.e_score_correction_bias$", r"MoEBiasVar/decoder/\g<at>/" + BIAS))
    out += [Rename(hf, mx) for hf, mx in GLOBAL]
    out += [
        Transpose(r"(/kernel|/expert_\d+)$", (1, 0)),
        SplitDim(r"/self_attention/(wq_b|query)/kernel$", dim=1, sizes=(h, c.qk_head_dim)),
        SplitDim(r"/self_attention/wkv_b/kernel$", dim=1, sizes=(h, c.qk_nope_head_dim + c.v_head_dim)),
        SplitDim(r"/self_attention/out/kernel$", dim=0, sizes=(h, c.v_head_dim)),
        Stack(r"^(?P<leaf>decoder/moe_layers_\d+/DeepSeekMoeBlock_0/MoeBlock_0/w\w+)/expert_(?P<expert>\d+)$",
              r"\g<leaf>", dim=0, index="expert"),
    ]
    if c.scan:  # parameters: the layer on axis 1 (param_scan_axis); the MoEBiasVar collection: axis 0
        out += [Stack(rf"^decoder/{kind}_layers_(?P<layer>\d+)/(?P<leaf>.*)$", f"decoder/{kind}_layers/\\g<leaf>",
                      dim=1, index="layer") for kind in ("dense", "moe")]
        out.append(Stack(r"^MoEBiasVar/decoder/moe_layers_(?P<layer>\d+)/(?P<leaf>.*)$",
                         r"MoEBiasVar/decoder/moe_layers/\g<leaf>", dim=0, index="layer"))
    return out


# megatron-core name (after ``decoder.layers.N.``) -> HF name (after ``model.layers.N.``)
MEGATRON_LAYER = (
    (r"self_attention\.linear_q_proj\.weight", "self_attn.q_proj.weight"),
    (r"self_attention\.linear_q_down_proj\.weight", "self_attn.q_a_proj.weight"),
    (r"self_attention\.linear_q_up_proj\.weight", "self_attn.q_b_proj.weight"),
    (r"self_attention\.linear_kv_down_proj\.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    (r"self_attention\.linear_kv_up_proj\.weight", "self_attn.kv_b_proj.weight"),
    (r"self_attention\.linear_proj\.weight", "self_attn.o_proj.weight"),
    (r"mlp\.router\.weight", "mlp.gate.weight"),
    (r"mlp\.router\.expert_bias", "mlp.gate.e_score_correction_bias"),
    (r"pre_mlp_layernorm\.weight", "post_attention_layernorm.weight"),
    (r"input_layernorm\.weight", "input_layernorm.weight"),
)
MEGATRON_NORMS = {  # (q norm, kv norm) per megatron-core layer spec; TE also fuses dense layers' pre-MLP norm
    "local": (r"self_attention\.q_layernorm\.weight", r"self_attention\.kv_layernorm\.weight"),
    "te": (r"self_attention\.linear_q_up_proj\.layer_norm_weight", r"self_attention\.linear_kv_up_proj\.layer_norm_weight"),
}
MEGATRON_MLPS = (  # megatron-core MLP prefix -> HF MLP prefix
    (r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.", r"mlp.experts.\g<expert>."),
    (r"mlp\.shared_experts\.", "mlp.shared_experts."),
    (r"mlp\.", "mlp."),
)
MEGATRON_MTP = (  # megatron-core MTP layer leaf -> HF MTP layer leaf (besides its transformer_layer)
    ("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
    ("final_layernorm.weight", "shared_head.norm.weight"),
)
MEGATRON_GLOBAL = (
    (r"^embedding\.word_embeddings\.weight$", "model.embed_tokens.weight"),
    (r"^decoder\.final_layernorm\.weight$", "model.norm.weight"),
    (r"^output_layer\.weight$", "lm_head.weight"),
)


def megatron_mtp(c: DeepseekConfig) -> list[Rule]:
    """megatron-core's MTP layers -> HF's: ``mtp.layers.K.transformer_layer.`` becomes decoder layer
    ``n_layers + K`` (the decoder's rules name it), its own leaves HF's; MTP layers beyond ``mtp_layers``
    are dropped (in both directions: the pattern matches no layer that is mapped)."""
    keep = "|".join(str(k) for k in range(c.mtp_layers))
    out: list[Rule] = [Drop(rf"^mtp\.layers\.(?!(?:{keep})\.)" if keep else r"^mtp\.",
                            f"megatron-core MTP layers beyond mtp_layers={c.mtp_layers}: not mapped to HF")]
    for k in range(c.mtp_layers):
        n = c.n_layers + k
        out.append(Rename(rf"^mtp\.layers\.{k}\.transformer_layer\.(?P<leaf>.+)$", f"decoder.layers.{n}.\\g<leaf>"))
        out += [Rename(rf"^mtp\.layers\.{k}\.{_esc(mg)}$", f"model.layers.{n}.{hf}") for mg, hf in MEGATRON_MTP]
    return out


def drop_mtp_copies(c: DeepseekConfig) -> list[Rule]:
    """HF's MTP layers' copies of the embedding and output layer (megatron-core's MTP shares the main ones)."""
    if not c.mtp_layers:
        return []
    layers = "|".join(str(c.n_layers + k) for k in range(c.mtp_layers))
    return [Drop(rf"^model\.layers\.(?:{layers})\.(embed_tokens|shared_head\.head)\.weight$",
                 "DeepSeek MTP layers' embedding and output copies: megatron-core's MTP shares the main model's")]


def megatron_to_hf(c: DeepseekConfig) -> list[Rule]:
    """megatron-core -> HF (every rule invertible): the MTP layers as decoder layers, SwiGLU
    ``linear_fc1`` split into gate and up (dense, shared and routed experts), then names."""
    layer = r"^decoder\.layers\.(?P<layer>\d+)\."
    to = r"model.layers.\g<layer>."
    out: list[Rule] = megatron_mtp(c)
    if c.megatron_experts == "grouped":  # after the MTP layer became a decoder layer
        out += grouped_experts(int(c.n_experts or 0), int(c.moe_mlp or 0))
    q_norm, kv_norm = MEGATRON_NORMS[c.megatron_norms]
    table = [*MEGATRON_LAYER, (q_norm, "self_attn.q_a_layernorm.weight"), (kv_norm, "self_attn.kv_a_layernorm.weight")]
    for mg, hf in MEGATRON_MLPS:
        out.append(Split(layer + mg + r"linear_fc1\.weight$", to + hf + "{part}.weight", dim=0,
                         parts=("gate_proj", "up_proj")))
        table.append((mg + r"linear_fc2\.weight", hf + "down_proj.weight"))
    out += [Rename(layer + mg + "$", to + hf) for mg, hf in table]
    if c.megatron_norms == "te":  # dense layers' pre-MLP norm is fused into linear_fc1 (MoE layers keep theirs):
        # per dense layer, after the MoE layers' rename, so that HF -> megatron renames these first
        out += [Rename(rf"^decoder\.layers\.{i}\.mlp\.linear_fc1\.layer_norm_weight$",
                       f"model.layers.{i}.post_attention_layernorm.weight") for i in range(c.first_dense)]
    out += [Rename(mg, hf) for mg, hf in MEGATRON_GLOBAL]
    return out + drop_mtp_copies(c) + hf_expects(c)  # hf_to_maxtext starts with hf_expects: routes compose


def config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe config of an HF DeepSeek-V3 ``config.json`` (MTP layers from ``num_nextn_predict_layers``)."""
    return {"n_heads": int(hf["num_attention_heads"]), "n_layers": int(hf["num_hidden_layers"]),
            "first_dense": int(hf.get("first_k_dense_replace") or 0), "q_lora_rank": int(hf.get("q_lora_rank") or 0),
            "kv_lora_rank": int(hf["kv_lora_rank"]), "qk_nope_head_dim": int(hf["qk_nope_head_dim"]),
            "qk_rope_head_dim": int(hf["qk_rope_head_dim"]), "v_head_dim": int(hf["v_head_dim"]),
            "mtp_layers": int(hf.get("num_nextn_predict_layers") or 0), "n_experts": int(hf["n_routed_experts"]),
            "moe_mlp": int(hf["moe_intermediate_size"])}


def megatron_args(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Megatron args of an HF DeepSeek-V3 ``config.json`` over the Llama-like ones that
    :func:`ckptbridge.recipes.megatron_args` writes: MLA (``multi_latent_attention``, the LoRA ranks,
    the head widths, YaRN) and MoE (experts, shared experts, sigmoid grouped routing with the expert
    bias, ``moe_layer_freq``: the first ``first_k_dense_replace`` layers dense; ``mtp_num_layers`` from
    ``num_nextn_predict_layers``, which ``recipes.megatron_args`` given the checkpoint directory corrects to
    the MTP layers its tensors have). megatron-core ranks
    expert groups by their top ``topk / group_topk`` scores, DeepSeek by their top 2: the same routing
    only when ``num_experts_per_tok = 2 x topk_group`` (DeepSeek-V3: 8 = 2 x 4); other values fail here."""
    topk, groups = int(hf["num_experts_per_tok"]), int(hf.get("topk_group") or 0)
    if groups and topk != 2 * groups:
        raise OptionError(f"megatron_args: num_experts_per_tok={topk} is not 2 x topk_group={groups}: megatron-core "
                          "would rank the expert groups differently from DeepSeek")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    dense = int(hf.get("first_k_dense_replace") or 0)
    args: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank") or None, kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_head_dim=int(hf["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]), kv_channels=int(hf["v_head_dim"]), qk_layernorm=True,
        group_query_attention=False, num_query_groups=int(hf["num_attention_heads"]),
        num_experts=int(hf["n_routed_experts"]), moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_shared_expert_intermediate_size=int(hf["moe_intermediate_size"]) * int(hf.get("n_shared_experts") or 0)
        or None, moe_router_topk=topk, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=int(hf.get("n_group") or 0) or None, moe_router_group_topk=groups or None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0), moe_router_pre_softmax=False,
        moe_layer_freq=[0] * dense + [1] * (int(hf["num_hidden_layers"]) - dense), moe_grouped_gemm=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32", mtp_num_layers=int(hf.get("num_nextn_predict_layers") or 0) or None)
    if rope.get("rope_type") == "yarn":
        args.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                    beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                    mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    else:
        args.update(rope_type="rope")
    return args


FAMILY = Family(name="deepseek_v3", model_types=("deepseek_v3",), config=DeepseekConfig, from_hf=config_from_hf,
                megatron_args=megatron_args,
                required=("n_heads", "n_layers", "first_dense", "kv_lora_rank", "qk_nope_head_dim",
                          "qk_rope_head_dim", "v_head_dim"),
                base={("hf", "maxtext"): hf_to_maxtext, ("megatron", "hf"): megatron_to_hf})

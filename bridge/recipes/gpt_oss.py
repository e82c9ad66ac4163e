"""gpt-oss (HF ``GptOssForCausalLM``, ``model_type`` ``gpt_oss``) <-> MaxText, in bf16/fp32.

What MaxText 0.2.5's own converter hooks do (``GPT_OSS_MAXTEXT_TO_HF_PARAM_MAPPING`` /
``GPT_OSS_TO_HF_PARAM_HOOK_FN``), as rules:

* attention (``GptOssAttention``): q/k/v kernels transposed with heads split out, their biases
  split into ``[heads, head_dim]``, ``o_proj`` and its bias, the per-head ``sinks`` as they are;
  no query scale folded in (MaxText scales the query at run time);
* MoE (``GptOssMlp``): the router ``gate/kernel`` transposed and its ``gate/bias``; the experts
  are stored ``[experts, in, out]`` on both sides: ``down_proj`` -> ``wo``, and the fused
  ``gate_up_proj`` (and its bias) whose gate and up columns interleave (``gate_up[..., ::2]``,
  ``[..., 1::2]``) de-interleaved and split into ``wi_0`` / ``wi_1`` (and ``wi_0_bias`` / ``wi_1_bias``);
* scanned, MaxText repeats the (sliding, full) pair: HF layer ``i`` goes to
  ``decoder/layers/layers_{i % 2}/...`` stacked on axis 1 at ``i // 2`` (every leaf, the router and
  the experts too).

MXFP4 release checkpoints are dequantized when opened (another path); this recipe maps the
dequantized tensors::

    recipes.rules("gpt_oss", src="hf", dst="maxtext", n_heads=64, n_kv_heads=8, head_dim=64,
                  n_layers=24, moe_mlp=2880)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .._errors import OptionError
from ..rules import Deinterleave, Expect, Rename, Rule, Split
from ._family import Family
from ._gpt import (
    HF_LAYER,
    HF_MAXTEXT_LAYER,
    RecipeConfig,
    block_scan,
    config_from_hf,
    hf_to_maxtext,
    maxtext_expects,
)

PERIOD = 2  # MaxText's inhomogeneous_layer_cycle_interval for gpt-oss: sliding, full

# HF name (per layer, after ``model.layers.N.``) -> MaxText name (per layer, unscanned; the attention
# under the Llama-like ``self_attention/`` until the last rule names it ``GptOssAttention/``)
HF_MAXTEXT_LAYER_GPT_OSS = (
    *HF_MAXTEXT_LAYER[:7],  # q/k/v/o kernels, q/k/v biases
    (r"self_attn\.o_proj\.bias", "self_attention/out/bias"),
    (r"self_attn\.sinks", "self_attention/sinks"),
    (r"input_layernorm\.weight", "pre_self_attention_layer_norm/scale"),
    (r"post_attention_layernorm\.weight", "post_self_attention_layer_norm/scale"),
    (r"mlp\.router\.weight", "GptOssMlp/gate/kernel"),
    (r"mlp\.router\.bias", "GptOssMlp/gate/bias"),
    (r"mlp\.experts\.gate_up_proj", "GptOssMlp/wi_fused"),
    (r"mlp\.experts\.gate_up_proj_bias", "GptOssMlp/wi_fused_bias"),
    (r"mlp\.experts\.down_proj", "GptOssMlp/wo"),
    (r"mlp\.experts\.down_proj_bias", "GptOssMlp/wo_bias"),
)


@dataclass(frozen=True)
class GptOssConfig(RecipeConfig):
    """The Llama-like keys plus ``n_layers`` (the scanned pairs) and ``moe_mlp`` (each expert's
    intermediate size: the fused gate/up holds ``2 * moe_mlp`` interleaved columns)."""

    n_layers: int = 0
    moe_mlp: int = 0
    positive: ClassVar[tuple[str, ...]] = (*RecipeConfig.positive, "n_layers", "moe_mlp")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scan and self.n_layers % PERIOD:
            raise OptionError(f"recipe config: MaxText scans gpt-oss in (sliding, full) pairs; n_layers="
                              f"{self.n_layers} is odd")


def hf_to_maxtext_gpt_oss(c: GptOssConfig) -> list[Rule]:
    """HF -> MaxText: the Llama-like relayout with gpt-oss's names and scan, the experts' gate/up
    de-interleaved and split, then the attention module's name."""
    fused = 2 * c.moe_mlp
    why = f"2 x moe_mlp = 2 x {c.moe_mlp} interleaved gate/up columns"
    out: list[Rule] = [Expect(HF_LAYER + r"mlp\.experts\.gate_up_proj$", (None, None, fused), why),
                       Expect(HF_LAYER + r"mlp\.experts\.gate_up_proj_bias$", (None, fused), why)]
    out += hf_to_maxtext(c, table=HF_MAXTEXT_LAYER_GPT_OSS, scan=block_scan(c.n_layers, PERIOD), expects=[])
    out += maxtext_expects(c, r"^decoder/layers/layers_\d+/" if c.scan else "")
    for suffix in ("", "_bias"):
        out += [Deinterleave(rf"/GptOssMlp/wi_fused{suffix}$", dim=-1, block=fused),
                Split(rf"^(?P<at>decoder/.*)/GptOssMlp/wi_fused{suffix}$", rf"\g<at>/GptOssMlp/{{part}}{suffix}",
                      dim=-1, parts=("wi_0", "wi_1"))]
    out.append(Rename(r"^(?P<at>decoder/.*)/self_attention/(?P<leaf>.*)$", r"\g<at>/GptOssAttention/\g<leaf>"))
    return out


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe config of a ``gpt_oss`` config.json."""
    return {**config_from_hf(hf), "n_layers": int(hf["num_hidden_layers"]), "moe_mlp": int(hf["intermediate_size"])}


FAMILY = Family(name="gpt_oss", model_types=("gpt_oss",), config=GptOssConfig, from_hf=from_hf,
                defaults={"query_scale": False, "qkv_bias": True},
                required=("n_heads", "n_kv_heads", "head_dim", "n_layers", "moe_mlp"),
                base={("hf", "maxtext"): hf_to_maxtext_gpt_oss})

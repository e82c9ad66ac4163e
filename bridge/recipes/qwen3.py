"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on the query and the key (HF
``self_attn.q_norm`` / ``k_norm``, ``[head_dim]`` each), no QKV bias, and a ``head_dim`` that
need not be ``hidden / heads``. MaxText's Qwen3 decoder scales the query at run time
(``query_pre_attn_scalar = head_dim**-0.5``, models/qwen3.py), so no ``1/sqrt(head_dim)`` is folded
into its kernel; its norms are ``self_attention/query_norm/scale`` and ``key_norm/scale``
(MaxText's converter: ``QWEN_MAXTEXT_TO_HF_PARAM_MAPPING``, no hook on them). megatron-core names
them ``self_attention.q_layernorm`` / ``k_layernorm`` (``qk_layernorm=True``).

    recipes.rules("qwen3", src="hf", dst="maxtext", n_heads=16, n_kv_heads=8, head_dim=128)
    recipes.megatron_args("Qwen3-0.6B/config.json")["qk_layernorm"]    # True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import OptionError
from ..rules import Rename, Rule
from . import _gpt
from ._family import Family
from ._gpt import HF_LAYER, MX_LAYER, L, RecipeConfig, config_from_hf

# HF name (after ``model.layers.N.``) -> MaxText name (after ``decoder/layers_N/``) -> megatron-core name
QK_NORMS = (
    (r"self_attn\.q_norm\.weight", "self_attention/query_norm/scale", r"self_attention\.q_layernorm\.weight"),
    (r"self_attn\.k_norm\.weight", "self_attention/key_norm/scale", r"self_attention\.k_layernorm\.weight"),
)


def spliced(base: list[Rule], c: RecipeConfig, names: Sequence[Rule], per_layer: Sequence[Rule] = ()) -> list[Rule]:
    """``_gpt.hf_to_maxtext(c)`` (``base``) with a family's extra HF -> MaxText ``names`` put right
    after its HF shape checks (so the kernels among them are transposed with the others) and its
    ``per_layer`` rules (on unscanned MaxText names) right before the layers are stacked."""
    head = len(_gpt.hf_expects(c))
    tail = len(_gpt.maxtext_expects(c)) + (1 if c.scan else 0)
    return [*base[:head], *names, *base[head:len(base) - tail], *per_layer, *base[len(base) - tail:]]


def qk_norm_names() -> list[Rule]:
    """HF ``q_norm`` / ``k_norm`` -> MaxText ``query_norm`` / ``key_norm`` (unscanned names)."""
    return [Rename(HF_LAYER + hf + "$", MX_LAYER + mx) for hf, mx, _ in QK_NORMS]


def megatron_qk_norm_names() -> list[Rule]:
    """megatron-core ``q_layernorm`` / ``k_layernorm`` -> HF ``q_norm`` / ``k_norm``."""
    layer = r"^decoder\.layers\." + L + r"\."
    return [Rename(layer + mg + "$", r"model.layers.\g<layer>." + hf.replace("\\", "")) for hf, _, mg in QK_NORMS]


def hf_to_maxtext(c: RecipeConfig) -> list[Rule]:
    """HF -> MaxText: the Llama decoder's rules with the q/k norms named."""
    return spliced(_gpt.hf_to_maxtext(c), c, qk_norm_names())


def megatron_to_hf(c: RecipeConfig) -> list[Rule]:
    """megatron-core -> HF: the Llama decoder's rules with the q/k norms named."""
    return [*megatron_qk_norm_names(), *_gpt.megatron_to_hf(c)]


def megatron_args(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Megatron args a Qwen3 adds to the Llama ones: the per-head q/k RMSNorm."""
    del hf
    return {"qk_layernorm": True}


def hf_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config keys of a Qwen3 Megatron run (over the Llama ones ``recipes.hf_config`` writes)."""
    if not args.get("qk_layernorm"):
        raise OptionError("hf_config: a Qwen3 has q/k norms; these Megatron args have no qk_layernorm")
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False}


FAMILY = Family(name="qwen3", model_types=("qwen3",), from_hf=config_from_hf, megatron_args=megatron_args,
                hf_config=hf_config, defaults={"query_scale": False},
                base={("hf", "maxtext"): hf_to_maxtext, ("megatron", "hf"): megatron_to_hf})

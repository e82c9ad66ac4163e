"""Qwen2 / Qwen2.5: the Llama decoder with QKV biases; MaxText's Qwen2 scales the query at run time,
so no ``1/sqrt(head_dim)`` is folded into its kernel.

    recipes.rules("qwen2", src="hf", dst="megatron", n_heads=28, n_kv_heads=4, head_dim=128)
"""

from ._family import Family
from ._gpt import config_from_hf, hf_to_maxtext, megatron_to_hf

FAMILY = Family(name="qwen2", model_types=("qwen2",), from_hf=config_from_hf,
                defaults={"qkv_bias": True, "query_scale": False},
                base={("hf", "maxtext"): hf_to_maxtext, ("megatron", "hf"): megatron_to_hf})

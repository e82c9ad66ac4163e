"""Llama 2/3 and Mistral: the plain decoder (``qkv_bias=True`` for a Llama with QKV biases).

    recipes.rules("llama", src="hf", dst="maxtext", n_heads=32, n_kv_heads=8, head_dim=128,
                  scan=True, rope="llama3.1")
"""

from ._family import Family
from ._gpt import config_from_hf, hf_to_maxtext, megatron_to_hf

FAMILY = Family(name="llama", model_types=("llama", "mistral"), from_hf=config_from_hf,
                base={("hf", "maxtext"): hf_to_maxtext, ("megatron", "hf"): megatron_to_hf})

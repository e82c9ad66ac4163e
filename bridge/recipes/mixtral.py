"""Mixtral: the Llama decoder with a mixture-of-experts MLP (router ``block_sparse_moe.gate`` and
experts ``block_sparse_moe.experts.N.w1/w3/w2``, stacked over experts on axis 0 in MaxText's
``MoeBlock_0``). HF <-> MaxText only: megatron-core's MoE names are not mapped.

    recipes.rules("mixtral", src="hf", dst="maxtext", n_heads=32, n_kv_heads=8, head_dim=128)
"""

from functools import partial

from ._family import Family
from ._gpt import config_from_hf, hf_to_maxtext

FAMILY = Family(name="mixtral", model_types=("mixtral",), from_hf=config_from_hf,
                base={("hf", "maxtext"): partial(hf_to_maxtext, moe=True)})

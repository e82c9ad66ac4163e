"""Gemma 3's text decoder (HF ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) <-> MaxText.

What MaxText 0.2.5's own converter hooks do (``GEMMA3_MAXTEXT_TO_HF_PARAM_HOOK_FN``), as rules:

* every RMSNorm (input, post-attention, pre/post feed-forward, the q/k norms, the final norm)
  stores ``1 + w`` in MaxText, ``w`` in HF: :class:`~ckptbridge.Offset` ``+1`` (the moments stay);
* the embedding stores ``w * sqrt(hidden)`` with the factor rounded to bfloat16 first (the hook's
  ``np.dtype("bfloat16").type(hidden ** 0.5)``): :class:`~ckptbridge.Scale`; embeddings are tied;
* kernels transposed and heads split out (no query scale folded in: MaxText's Gemma 3 scales the
  query at run time), names per ``GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING``;
* scanned, MaxText repeats Gemma 3's 6-layer pattern (5 sliding, 1 global): HF layer ``i`` of the
  first ``6 * (n_layers // 6)`` goes to ``decoder/layers/layers_{i % 6}/...`` stacked on axis 1 at
  ``i // 6``; the rest, unstacked, to ``decoder/layers_remainder/layers_{i - 6 * (n_layers // 6)}/``.

The inverse subtracts 1 in float32, as MaxText's export does, so ``(w + 1) - 1`` comes back, not
always ``w`` (see ``tools/maxtext/NOTES.md``)::

    recipes.rules("gemma3", src="hf", dst="maxtext", n_heads=8, n_kv_heads=4, head_dim=256,
                  n_layers=34, hidden=2560)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from .._dtypes import to_numpy
from ..rules import Offset, Rule, Scale
from ._family import Family
from ._gpt import RecipeConfig, block_scan, config_from_hf, hf_to_maxtext, maxtext_expects

PATTERN = 6  # MaxText's GEMMA3_ATTENTION_PATTERN: 5 sliding + 1 global, the scanned block

# HF name (per layer, after ``model.layers.N.``) -> MaxText name (per layer, unscanned)
HF_MAXTEXT_LAYER = (
    (r"self_attn\.q_proj\.weight", "self_attention/query/kernel"),
    (r"self_attn\.k_proj\.weight", "self_attention/key/kernel"),
    (r"self_attn\.v_proj\.weight", "self_attention/value/kernel"),
    (r"self_attn\.o_proj\.weight", "self_attention/out/kernel"),
    (r"self_attn\.q_norm\.weight", "self_attention/query_norm/scale"),
    (r"self_attn\.k_norm\.weight", "self_attention/key_norm/scale"),
    (r"mlp\.gate_proj\.weight", "mlp/wi_0/kernel"),
    (r"mlp\.up_proj\.weight", "mlp/wi_1/kernel"),
    (r"mlp\.down_proj\.weight", "mlp/wo/kernel"),
    (r"input_layernorm\.weight", "pre_self_attention_norm/scale"),
    (r"post_attention_layernorm\.weight", "post_self_attention_norm/scale"),
    (r"pre_feedforward_layernorm\.weight", "pre_ffw_norm/scale"),
    (r"post_feedforward_layernorm\.weight", "post_ffw_norm/scale"),
)


@dataclass(frozen=True)
class Gemma3Config(RecipeConfig):
    """The Llama-like keys plus ``n_layers`` (which layers are scanned, which left over) and
    ``hidden`` (the embedding's ``sqrt(hidden)``)."""

    n_layers: int = 0
    hidden: int = 0
    positive: ClassVar[tuple[str, ...]] = (*RecipeConfig.positive, "n_layers", "hidden")


def embed_scale(hidden: int) -> float:
    """MaxText's Gemma 3 embedding factor: ``sqrt(hidden)`` rounded to bfloat16 (its hook's)."""
    return float(to_numpy("bfloat16").type(math.sqrt(hidden)))


def hf_to_maxtext_gemma3(c: Gemma3Config) -> list[Rule]:
    """HF -> MaxText: the Llama-like relayout with Gemma 3's names and scan, then the values."""
    expects = maxtext_expects(c, r"^decoder/layers/layers_\d+/") if c.scan else maxtext_expects(c)
    if c.scan and c.n_layers % PATTERN:
        expects += maxtext_expects(replace(c, scan=False), r"^decoder/layers_remainder/layers_\d+/")
    out = hf_to_maxtext(c, table=HF_MAXTEXT_LAYER, scan=block_scan(c.n_layers, PATTERN), expects=[])
    out += [Offset(r"norm/scale$", 1.0), Scale(r"^token_embedder/embedding$", embed_scale(c.hidden))]
    return out + expects


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe config of a ``gemma3_text`` config.json."""
    return {**config_from_hf(hf), "n_layers": int(hf["num_hidden_layers"]), "hidden": int(hf["hidden_size"])}


FAMILY = Family(name="gemma3", model_types=("gemma3_text",), config=Gemma3Config, from_hf=from_hf,
                defaults={"query_scale": False, "tie_embeddings": True},
                required=("n_heads", "n_kv_heads", "head_dim", "n_layers", "hidden"),
                base={("hf", "maxtext"): hf_to_maxtext_gemma3})

"""The harness's Gemma 3 text decoder (``registry.FAMILIES``): MaxText overrides, the converter.

MaxText 0.2.5 builds Gemma 3 from ``decoder_block=gemma3`` with ``model_name`` one of its Gemma 3
sizes: ``models/gemma3.py`` ``get_query_pre_attn_scalar`` raises for any other name, and
``gemma3-4b`` / ``gemma3-12b`` scale the query by ``head_dim**-0.5`` (HF's
``query_pre_attn_scalar = head_dim``). The model keys of ``configs/models/gemma3-4b.yml`` are
overridden by the spec (``override_model_config``). Its converter (``GEMMA3`` in
``checkpoint_conversion/utils/param_mapping.py``) reads the multimodal ``Gemma3ForConditionalGeneration``
layout: a ``text_config`` and a ``vision_config``, tensors under ``model.language_model.``; a
``Gemma3ForCausalLM`` checkpoint has the text config at the top and its tensors under ``model.``.
"""

from __future__ import annotations

from typing import Any

from registry import MaxTextFamily


def overrides(spec: Any) -> dict[str, Any]:
    """MaxText keys of a Gemma 3 text decoder (the spec's ``extra`` adds the window and rotary keys)."""
    return {
        "model_name": "gemma3-4b",
        "override_model_config": True,
        "decoder_block": "gemma3",
        "mlp_activations": "['gelu','linear']",
        "logits_via_embedding": True,
        "normalize_embedding_logits": True,
        "use_post_attn_norm": True,
        "use_post_ffw_norm": True,
        "use_multimodal": False,
    }


def converter_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A ``Gemma3ForCausalLM`` config.json as MaxText's Gemma 3 converter reads it: no vision layers
    (the vision sizes, which its ``hf_shape`` reads, map no tensor of the text decoder)."""
    vision = {"num_hidden_layers": 0, "hidden_size": 1, "intermediate_size": 1, "patch_size": 1, "num_channels": 1,
              "image_size": 1}
    return {**hf, "text_config": hf, "vision_config": vision}


def hf_name(name: str) -> str:
    """The converter's ``model.language_model.`` tensor names as a ``Gemma3ForCausalLM`` spells them."""
    prefix = "model.language_model."
    return "model." + name[len(prefix):] if name.startswith(prefix) else name


FAMILIES = (MaxTextFamily("gemma3", overrides, "gemma3-4b", converter_config=converter_config, hf_name=hf_name),)

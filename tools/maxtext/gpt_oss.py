"""The harness's gpt-oss (``registry.FAMILIES``): MaxText overrides and its converter.

MaxText 0.2.5 builds gpt-oss from ``decoder_block=gpt_oss`` (``models/gpt_oss.py``: sliding and full
attention alternating, ``inhomogeneous_layer_cycle_interval=2``, attention biases and sinks, a routed
MoE with router and expert biases and the clamped ``gate * sigmoid(1.702 gate) * (up + 1)``), the keys
of ``configs/models/gpt-oss-20b.yml`` but for the sizes and the rotary (the spec's); the experts as
the harness sets them for any MoE spec (dense, no token dropping: XLA:CPU). Its converter is
``GPT_OSS`` in ``param_mapping.py``, reading HF's names as ``GptOssForCausalLM`` writes them.
"""

from __future__ import annotations

from typing import Any

from registry import MaxTextFamily


def overrides(spec: Any) -> dict[str, Any]:
    """MaxText keys of a gpt-oss decoder (the spec's ``extra`` adds the window)."""
    return {
        "decoder_block": "gpt_oss",
        "attention_bias": True,
        "attention_sink": True,
        "mlp_activations": "['sigmoid','linear']",
        "mlp_activations_limit": 7.0,
        "routed_bias": True,
        "mlp_bias": True,
        "inhomogeneous_layer_cycle_interval": 2,
    }


FAMILIES = (MaxTextFamily("gpt_oss", overrides, "gpt-oss-20b", moe=True),)

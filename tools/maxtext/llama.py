"""The harness's Llama-like families (``registry.FAMILIES``): llama, mistral, qwen2 and mixtral.

MaxText 0.2.5 ships HF->MaxText hooks for ``llama3.1-*`` (interleaved rotary, always permutes q/k),
``qwen2.5-*`` and ``mixtral-*``; none for a rotate-half Llama or for Mistral (``mistral-7b`` has an
HF id but no mapping; its only HF path is the torch standalone script, bf16 only). Those use the
llama3.1 hooks without ``adjust_rope``::

    registry.family("llama").converter_key(Spec("llama"))   # ("llama3.1-8b", True)
"""

from __future__ import annotations

from typing import Any

from registry import MaxTextFamily


def _llama_hooks(spec: Any) -> tuple[str, bool]:
    return "llama3.1-8b", spec.rope_type == "default"


def _mixtral_hooks(spec: Any) -> tuple[str, bool]:
    if spec.rope_type != "default":
        raise SystemExit("mixtral: MaxText's converter has no rotary permutation; use rope_type=default")
    return "mixtral-8x7b", False


FAMILIES = (
    MaxTextFamily("llama", lambda spec: {"decoder_block": "llama2"}, _llama_hooks),
    MaxTextFamily("mistral", lambda spec: {"decoder_block": "mistral"}, _llama_hooks),
    MaxTextFamily("qwen2", lambda spec: {"decoder_block": "qwen2", "attention_bias": True, "use_qk_norm": False},
                  "qwen2.5-7b"),
    MaxTextFamily("mixtral", lambda spec: {"decoder_block": "mixtral"}, _mixtral_hooks, moe=True),
)

"""The harness's Qwen3 and Qwen3-MoE models (``registry.FAMILIES``; MaxText 0.2.5's venv).

MaxText's ``decoder_block=qwen3`` / ``qwen3_moe`` (``models/qwen3.py``: ``Qwen3DecoderLayer``,
``Qwen3MoeDecoderLayer``): per-head RMSNorm on query and key (``use_qk_norm``), the query scaled
at run time by ``head_dim**-0.5``, no QKV bias; the MoE layer is ``RoutedMoE`` (``moe_block``) in
every layer, its top-k weights renormalised when ``norm_topk_prob``. The converter's tables are
``QWEN_MAXTEXT_TO_HF_PARAM_MAPPING`` / ``..._HOOK_FN`` under ``qwen3-0.6b`` and ``qwen3-30b-a3b``.
"""

from __future__ import annotations

from typing import Any

from registry import MaxTextFamily


def overrides(spec: Any) -> dict[str, Any]:
    """MaxText config keys of a Qwen3 / Qwen3-MoE ``spec`` (on top of the harness's common ones)."""
    out: dict[str, Any] = {"decoder_block": spec.family, "use_qk_norm": True, "attention_bias": False}
    if spec.family == "qwen3_moe":  # the experts' common keys come from the harness (spec.experts)
        out["norm_topk_prob"] = spec.norm_topk_prob
    return out


FAMILIES = (
    MaxTextFamily("qwen3", overrides, "qwen3-0.6b"),
    MaxTextFamily("qwen3_moe", overrides, "qwen3-30b-a3b", moe=True),
)

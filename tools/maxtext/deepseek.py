"""DeepSeek-V3 in MaxText 0.2.5 for the harness (``registry.FAMILIES``: ``family="deepseek_v3"``).

MaxText builds DeepSeek-V3 from ``decoder_block=deepseek`` (``models/deepseek.py``: MLA attention,
``first_num_dense_layers`` dense layers then MoE layers with shared experts); its router keeps the
correction bias in the ``MoEBiasVar`` collection only when ``model_name`` starts with
``deepseek3`` (``layers/moe.py`` ``GateLogit``), so the spec names ``deepseek3-tiny`` and overrides
every shape (``override_model_config``). The shapes come in ``spec.extra`` (keys of MaxText's
``base.yml``), written by ``tests/maxtext_client.py``'s ``spec_from_hf`` (``spec_from_hf_deepseek``)::

    spec = Spec(family="deepseek_v3", experts=8, experts_per_tok=2, extra={"q_lora_rank": 24, ...})
"""

from __future__ import annotations

from typing import Any

from registry import MaxTextFamily

# MaxText keys a DeepSeek spec must give (the rest of base.yml's defaults are DeepSeek-V3's or unused)
KEYS = ("first_num_dense_layers", "base_moe_mlp_dim", "shared_experts", "routed_scaling_factor",
        "n_routing_groups", "topk_routing_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "original_max_position_embeddings",
        "rope_factor", "beta_fast", "beta_slow", "mscale", "rope_type")


def overrides(spec: Any) -> dict[str, Any]:
    """MaxText overrides for a DeepSeek-V3 spec (on top of the harness's common ones; its ``extra`` after)."""
    missing = [k for k in KEYS if k not in spec.extra]
    if missing:
        raise SystemExit(f"spec: deepseek_v3 needs maxtext keys {missing}")
    return {
        "model_name": "deepseek3-tiny",
        "override_model_config": True,
        "decoder_block": "deepseek",
        "attention_type": "mla",
        "num_experts": spec.experts,
        "num_experts_per_tok": spec.experts_per_tok,
        "routed_score_func": "sigmoid",
        "routed_bias": True,
        "capacity_factor": -1,
        "sparse_matmul": False,
        "megablox": False,
        "rope_interleave": True,
        "rope_truncate": True,
        "rope_attention_scaling": False,
    }


FAMILIES = (MaxTextFamily("deepseek_v3", overrides, "deepseek3-671b", moe=True),)

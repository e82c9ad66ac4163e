"""megatron-core's multi-latent attention on CPU: a core attention that takes MLA's key and value widths.

megatron-core 0.16.1's local ``DotProductAttention`` (the only core attention without Transformer
Engine, whose attention kernels are CUDA-only) takes no ``k_channels`` / ``v_channels``, so
``MLASelfAttention`` cannot be built from the local layer spec (``TypeError: DotProductAttention.
__init__() got an unexpected keyword argument 'k_channels'``). :class:`CoreAttention` is the plain
computation MLA asks of its core attention (causal softmax attention with MLA's ``softmax_scale``,
queries and keys of ``k_channels``, values of ``v_channels``), in torch; :func:`mla_local_spec`
puts it in megatron-core's own decoder block spec, every other module unchanged (and, where
megatron-core imported its Transformer Engine extension without TE, leaving ``TELinear`` None,
tells ``multi_latent_attention`` that TE is absent: its ``isinstance(..., TELinear)`` raises; and
defines ``moe_utils.te_general_gemm = None``, which megatron-core leaves undefined without TE, so
the MoE router's ``RouterGatingLinearFunction`` takes its torch path instead of a ``NameError``)::

    spec = mla_local_spec(config)     # get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, ...)
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule


class CoreAttention(MegatronModule):
    """Causal attention ``softmax(q k^T * softmax_scale) v`` over ``[s, b, heads, dim]`` inputs
    (``k_channels`` for queries and keys, ``v_channels`` for values), out ``[s, b, heads * v_channels]``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 softmax_scale: float | None = None, k_channels: int | None = None, v_channels: int | None = None,
                 **_: Any) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("CoreAttention: no packed sequences, no attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def mla_local_spec(config: Any) -> Any:
    """megatron-core's decoder block spec without Transformer Engine (dense and MoE layers as
    ``config.moe_layer_freq`` says) with :class:`CoreAttention` as MLA's core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):  # TE's extension module imported, TE absent
        mla.HAVE_TE = False  # (its isinstance(linear_proj, TELinear) check would raise TypeError)
    if not hasattr(moe_utils, "te_general_gemm"):  # defined only when TE imports: the router's gemm
        moe_utils.te_general_gemm = None  # raised NameError; None takes its own torch path
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = CoreAttention
    return block

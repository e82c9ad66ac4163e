"""The decoder shared by the Llama-like families (Llama, Qwen2, Mixtral, ...): its config, the
name tables between HF, megatron-core and MaxText, the shape checks a config implies, and the
two base builders (HF -> MaxText, megatron-core -> HF). A family module picks these with its
defaults; a family whose layers differ writes its own builders beside them.

The facts each table encodes, with the MaxText 0.2.5 source they come from, are in
``tools/maxtext/NOTES.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .._errors import OptionError
from ..rules import Expect, Interleave, Rename, Rule, Scale, Split, SplitDim, Stack, Transpose


@dataclass(frozen=True)
class RecipeConfig:
    """The model facts a recipe needs (see the module doc for each key)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scan: bool = True
    rope: str = "default"
    tie_embeddings: bool = False
    qkv_bias: bool = False
    query_scale: bool = True
    megatron_norms: str = "local"
    positive: ClassVar[tuple[str, ...]] = ("n_heads", "n_kv_heads", "head_dim")  # keys that must be >= 1

    def __post_init__(self) -> None:
        for key in self.positive:
            if int(getattr(self, key)) < 1:
                raise OptionError(f"recipe config: {key} must be a positive integer, got {getattr(self, key)!r}")
        if self.n_heads % self.n_kv_heads:
            raise OptionError(f"recipe config: n_heads={self.n_heads} is not a multiple of "
                              f"n_kv_heads={self.n_kv_heads} (grouped-query attention needs whole groups)")
        if self.rope not in ("default", "llama3.1"):
            raise OptionError(f"recipe config: rope must be 'default' or 'llama3.1', got {self.rope!r}")
        if self.rope == "llama3.1" and self.head_dim % 2:
            raise OptionError(f"recipe config: rope 'llama3.1' needs an even head_dim, got {self.head_dim}")
        if self.megatron_norms not in ("local", "te"):
            raise OptionError(f"recipe config: megatron_norms must be 'local' or 'te', got {self.megatron_norms!r}")


# ------------------------------------------------------------------ the tables

L = r"(?P<layer>\d+)"  # a layer number in a pattern
HF_LAYER = r"^model\.layers\." + L + r"\."
MX_LAYER = "decoder/layers_\\g<layer>/"

# HF name (per layer, after ``model.layers.N.``) -> MaxText name (per layer, unscanned)
HF_MAXTEXT_LAYER = (
    (r"self_attn\.q_proj\.weight", "self_attention/query/kernel"),
    (r"self_attn\.k_proj\.weight", "self_attention/key/kernel"),
    (r"self_attn\.v_proj\.weight", "self_attention/value/kernel"),
    (r"self_attn\.o_proj\.weight", "self_attention/out/kernel"),
    (r"self_attn\.q_proj\.bias", "self_attention/query/bias"),
    (r"self_attn\.k_proj\.bias", "self_attention/key/bias"),
    (r"self_attn\.v_proj\.bias", "self_attention/value/bias"),
    (r"mlp\.gate_proj\.weight", "mlp/wi_0/kernel"),
    (r"mlp\.up_proj\.weight", "mlp/wi_1/kernel"),
    (r"mlp\.down_proj\.weight", "mlp/wo/kernel"),
    (r"input_layernorm\.weight", "pre_self_attention_layer_norm/scale"),
    (r"post_attention_layernorm\.weight", "post_self_attention_layer_norm/scale"),
    (r"block_sparse_moe\.gate\.weight", "MoeBlock_0/gate/kernel"),
)
HF_MAXTEXT_MOE = (  # HF expert weight -> MaxText MoE leaf (stacked over experts on axis 0)
    ("w1", "wi_0"),
    ("w3", "wi_1"),
    ("w2", "wo"),
)
HF_MAXTEXT_GLOBAL = (
    (r"^model\.embed_tokens\.weight$", "token_embedder/embedding"),
    (r"^model\.norm\.weight$", "decoder/decoder_norm/scale"),
    (r"^lm_head\.weight$", "decoder/logits_dense/kernel"),
)

# megatron-core name (per layer, after ``decoder.layers.N.``) -> HF name (per layer)
MEGATRON_HF_LAYER = (
    (r"self_attention\.linear_qkv\.q\.(?P<kind>weight|bias)", r"self_attn.q_proj.\g<kind>"),
    (r"self_attention\.linear_qkv\.k\.(?P<kind>weight|bias)", r"self_attn.k_proj.\g<kind>"),
    (r"self_attention\.linear_qkv\.v\.(?P<kind>weight|bias)", r"self_attn.v_proj.\g<kind>"),
    (r"self_attention\.linear_proj\.weight", "self_attn.o_proj.weight"),
    (r"mlp\.linear_fc1\.gate\.weight", "mlp.gate_proj.weight"),
    (r"mlp\.linear_fc1\.up\.weight", "mlp.up_proj.weight"),
    (r"mlp\.linear_fc2\.weight", "mlp.down_proj.weight"),
)
MEGATRON_NORMS = {  # (input norm, pre-MLP norm) names per megatron-core layer spec
    "local": (r"input_layernorm\.weight", r"pre_mlp_layernorm\.weight"),
    "te": (r"self_attention\.linear_qkv\.layer_norm_weight", r"mlp\.linear_fc1\.layer_norm_weight"),
}
MEGATRON_HF_GLOBAL = (
    (r"^embedding\.word_embeddings\.weight$", "model.embed_tokens.weight"),
    (r"^decoder\.final_layernorm\.weight$", "model.norm.weight"),
    (r"^output_layer\.weight$", "lm_head.weight"),
)


# ------------------------------------------------------------------ the shapes a config implies


def hf_expects(c: RecipeConfig) -> list[Rule]:
    """Checks on HF tensors (before anything else in hf -> *, last in * -> hf)."""
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    q, kv = f"n_heads x head_dim = {h} x {d}", f"n_kv_heads x head_dim = {k} x {d}"
    out: list[Rule] = [
        Expect(HF_LAYER + r"self_attn\.q_proj\.weight$", (h * d, None), q + " rows"),
        Expect(HF_LAYER + r"self_attn\.(k|v)_proj\.weight$", (k * d, None), kv + " rows"),
        Expect(HF_LAYER + r"self_attn\.o_proj\.weight$", (None, h * d), q + " columns"),
    ]
    if c.qkv_bias:
        out += [Expect(HF_LAYER + r"self_attn\.q_proj\.bias$", (h * d,), q),
                Expect(HF_LAYER + r"self_attn\.(k|v)_proj\.bias$", (k * d,), kv)]
    return out


def maxtext_expects(c: RecipeConfig, at: str = "") -> list[Rule]:
    """Checks on MaxText tensors (last in * -> maxtext, before anything else in maxtext -> *);
    ``at``: the layers' path prefix (default ``decoder/layers/`` scanned, ``decoder/layers_N/`` not)."""
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    lay = (None,) if c.scan else ()  # the layer axis (MaxText's axis 1) when scanned
    at = at or (r"^decoder/layers/" if c.scan else r"^decoder/layers_\d+/")
    q, kv = f"[embed, {'layers, ' if c.scan else ''}n_heads={h}, head_dim={d}]", \
        f"[embed, {'layers, ' if c.scan else ''}n_kv_heads={k}, head_dim={d}]"
    out: list[Rule] = [
        Expect(at + r"self_attention/query/kernel$", (None, *lay, h, d), q),
        Expect(at + r"self_attention/(key|value)/kernel$", (None, *lay, k, d), kv),
        Expect(at + r"self_attention/out/kernel$", (h, *lay, d, None),
               f"[n_heads={h}, {'layers, ' if c.scan else ''}head_dim={d}, embed]"),
    ]
    if c.qkv_bias:
        out += [Expect(at + r"self_attention/query/bias$", (h, *lay, d), f"n_heads={h}, head_dim={d}"),
                Expect(at + r"self_attention/(key|value)/bias$", (k, *lay, d), f"n_kv_heads={k}, head_dim={d}")]
    return out


def megatron_expects(c: RecipeConfig) -> list[Rule]:
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    rows = k * (h // k + 2) * d
    why = f"n_kv_heads x (n_heads / n_kv_heads + 2) x head_dim = {k} x {h // k + 2} x {d} rows: q, k, v per group"
    layer = r"^decoder\.layers\.\d+\."
    return [Expect(layer + r"self_attention\.linear_qkv\.weight$", (rows, None), why),
            Expect(layer + r"self_attention\.linear_qkv\.bias$", (rows,), why),
            Expect(layer + r"self_attention\.linear_proj\.weight$", (None, h * d),
                   f"n_heads x head_dim = {h} x {d} columns")]


# ------------------------------------------------------------------ recipes, one direction each


def hf_to_maxtext(c: RecipeConfig, moe: bool = False, table: tuple[tuple[str, str], ...] = HF_MAXTEXT_LAYER,
                  scan: list[Rule] | None = None, expects: list[Rule] | None = None) -> list[Rule]:
    """HF -> MaxText (every rule invertible). The order: names per layer (experts apart), the
    rotary interleave on HF's ``[H*D, E]`` rows, kernels transposed to ``[in, out]``, heads split
    out as an axis, the query scale folded in, experts stacked, layers stacked on axis 1.

    A family whose decoder differs passes its per-layer name ``table``, the rules that stack its
    ``decoder/layers_N/`` leaves when ``c.scan`` (``scan``; default: all layers on axis 1 into
    ``decoder/layers/``) and its MaxText shape checks (``expects``)."""
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    out: list[Rule] = hf_expects(c)
    out += [Rename(HF_LAYER + hf + "$", MX_LAYER + mx) for hf, mx in table]
    if moe:
        out += [Rename(HF_LAYER + rf"block_sparse_moe\.experts\.(?P<expert>\d+)\.{w}\.weight$",
                       MX_LAYER + f"MoeBlock_0/{mx}/expert_\\g<expert>") for w, mx in HF_MAXTEXT_MOE]
    out += [Rename(hf, mx) for hf, mx in HF_MAXTEXT_GLOBAL]
    if c.rope == "llama3.1":
        out.append(Interleave(r"/self_attention/(query|key)/kernel$", dim=0, block=d))
    out.append(Transpose(r"(/kernel|/expert_\d+)$", (1, 0)))
    out += [
        SplitDim(r"/self_attention/query/kernel$", dim=1, sizes=(h, d)),
        SplitDim(r"/self_attention/(key|value)/kernel$", dim=1, sizes=(k, d)),
        SplitDim(r"/self_attention/out/kernel$", dim=0, sizes=(h, d)),
    ]
    if c.qkv_bias:
        out += [SplitDim(r"/self_attention/query/bias$", dim=0, sizes=(h, d)),
                SplitDim(r"/self_attention/(key|value)/bias$", dim=0, sizes=(k, d))]
    if c.query_scale:
        out.append(Scale(r"/self_attention/query/kernel$", 1.0 / math.sqrt(d)))
    if moe:
        out.append(Stack(r"^(?P<leaf>decoder/layers_\d+/MoeBlock_0/wi_[01]|decoder/layers_\d+/MoeBlock_0/wo)"
                         r"/expert_(?P<expert>\d+)$", r"\g<leaf>", dim=0, index="expert"))
    if c.scan:
        out += scan if scan is not None else [
            Stack(r"^decoder/layers_(?P<layer>\d+)/(?P<leaf>.*)$", r"decoder/layers/\g<leaf>", dim=1, index="layer")]
    return out + (expects if expects is not None else maxtext_expects(c))


def block_scan(n_layers: int, period: int) -> list[Rule]:
    """MaxText's scan of a decoder that repeats a block of ``period`` different layers (Gemma 3's
    5 sliding + 1 global, gpt-oss's sliding + full): layer ``i`` of the first ``period * (n_layers //
    period)`` goes to ``decoder/layers/layers_{i % period}/...``, stacked on axis 1 at ``i // period``;
    the rest, unstacked, to ``decoder/layers_remainder/layers_{r}/...``."""
    full = n_layers - n_layers % period
    out: list[Rule] = [
        Rename(f"^decoder/layers_{i}/(?P<leaf>.*)$",
               f"decoder/layers/layers_{i % period}/repeat_{i // period}/\\g<leaf>" if i < full
               else f"decoder/layers_remainder/layers_{i - full}/\\g<leaf>")
        for i in range(n_layers)
    ]
    out.append(Stack(r"^decoder/layers/layers_(?P<block>\d+)/repeat_(?P<repeat>\d+)/(?P<leaf>.*)$",
                     r"decoder/layers/layers_\g<block>/\g<leaf>", dim=1, index="repeat"))
    return out


def megatron_to_hf(c: RecipeConfig) -> list[Rule]:
    """megatron-core -> HF (every rule invertible): fused QKV split per query group, SwiGLU
    ``linear_fc1`` split into gate and up, then names."""
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    layer = r"^decoder\.layers\." + L + r"\."
    out: list[Rule] = [
        *megatron_expects(c),
        Split(layer + r"self_attention\.linear_qkv\.(?P<kind>weight|bias)$",
              r"decoder.layers.\g<layer>.self_attention.linear_qkv.{part}.\g<kind>", dim=0, parts=("q", "k", "v"),
              widths=(h // k * d, d, d), groups=k),
        Split(layer + r"mlp\.linear_fc1\.weight$", r"decoder.layers.\g<layer>.mlp.linear_fc1.{part}.weight",
              dim=0, parts=("gate", "up")),
    ]
    norm_in, norm_mlp = MEGATRON_NORMS[c.megatron_norms]
    table = (*MEGATRON_HF_LAYER, (norm_in, "input_layernorm.weight"), (norm_mlp, "post_attention_layernorm.weight"))
    out += [Rename(layer + mg + "$", r"model.layers.\g<layer>." + hf) for mg, hf in table]
    out += [Rename(mg, hf) for mg, hf in MEGATRON_HF_GLOBAL]
    return out + hf_expects(c)


def rope_theta(hf: Mapping[str, Any]) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Recipe config of a Llama-like decoder (``n_heads``, ``n_kv_heads``, ``head_dim``, ``tie_embeddings``, ``qkv_bias``,
    ``rope``) read from an HF ``config.json`` (path, dict or ``PretrainedConfig``). ``rope`` is the
    MaxText ``rope_type`` that computes HF's rotary: ``"llama3.1"`` for Llama-3 frequency scaling
    (MaxText hard-codes Llama 3.1's constants; check yours match), else ``"default"``."""
    heads = int(hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return {"n_heads": heads, "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
            "rope": "llama3.1" if rope.get("rope_type", rope.get("type")) == "llama3" else "default"}

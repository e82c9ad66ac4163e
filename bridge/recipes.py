"""Recipes: the rule sets that map whole model families between frameworks, as data.

A recipe is a short list of rules (the Universal Checkpoint Language) for one
model family between two naming schemes:

* ``"hf"``: Hugging Face transformers names, as ``save_pretrained`` writes them
  (``model.layers.0.self_attn.q_proj.weight``, Mixtral's
  ``block_sparse_moe.experts.N.w1``);
* ``"megatron"``: megatron-core ``GPTModel`` names as ckptbridge's Megatron reader
  gives them (fused QKV per query group, SwiGLU ``linear_fc1`` = [gate; up],
  global layer numbers);
* ``"maxtext"``: MaxText's Linen parameter paths joined by ``/`` without the leading
  ``params`` (``decoder/layers/self_attention/query/kernel``), scanned (layers
  stacked on axis 1) or not (``decoder/layers_N/...``).

Every recipe is written once, in the direction whose rules are all invertible, and
the other direction is its :func:`~ckptbridge.invert`; Megatron <-> MaxText is the
composition through the HF names. The rules apply to every state, so the Adam
moments move with the weights (the MaxText query's folded ``1/sqrt(head_dim)``
scales ``exp_avg`` by its inverse and ``exp_avg_sq`` by its inverse squared)::

    from ckptbridge import recipes

    recipes.available()              # [("llama", "hf", "maxtext"), ...]
    rules = recipes.rules("llama", src="hf", dst="maxtext", n_heads=32, n_kv_heads=8, head_dim=128,
                          scan=True, rope="llama3.1")
    ckpt = ckptbridge.open("Meta-Llama-3-8B/", rules=rules)
    ckpt["decoder/layers/self_attention/query/kernel"].shape    # (4096, 32, 32, 128)
    print(recipes.show(rules))

Families: ``llama`` (Llama 2/3, Mistral; ``qkv_bias=True`` for Qwen2's biases),
``qwen2`` (``llama`` with QKV biases and MaxText's run-time query scaling) and
``mixtral`` (MoE: router and stacked experts). Config keys: ``n_heads``,
``n_kv_heads``, ``head_dim`` (required), ``scan`` (MaxText layers stacked,
default True), ``rope`` (MaxText's ``rope_type``: ``"default"`` = HF's rotate-half,
``"llama3.1"`` = interleaved pairs), ``tie_embeddings`` (informational: a tied model
simply has no ``lm_head``/``logits_dense``), ``qkv_bias``, ``query_scale`` (fold
``1/sqrt(head_dim)`` into MaxText's query kernel, as MaxText's Llama/Mistral/Mixtral
decoders expect; default True, False for ``qwen2``), ``megatron_norms`` (``"local"``
or ``"te"``: where Transformer Engine keeps the norm weights).

The facts each recipe encodes, with the MaxText 0.2.5 source they come from, are in
``tools/maxtext/NOTES.md``; tests prove them with transformers', megatron-core's and
MaxText's own model code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ._errors import OptionError
from ._rules import (
    Expect,
    Interleave,
    Rename,
    Rule,
    Scale,
    Split,
    SplitDim,
    Stack,
    Transpose,
    invert,
    rules_to_json,
)

__all__ = ["RecipeConfig", "available", "config_from_hf", "families", "family_from_hf", "hf_config", "megatron_args", "rules", "show"]

SCHEMES = ("hf", "megatron", "maxtext")


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

    def __post_init__(self) -> None:
        for key in ("n_heads", "n_kv_heads", "head_dim"):
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


def _hf_expects(c: RecipeConfig) -> list[Rule]:
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


def _maxtext_expects(c: RecipeConfig) -> list[Rule]:
    """Checks on MaxText tensors (last in * -> maxtext, before anything else in maxtext -> *)."""
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    lay = (None,) if c.scan else ()  # the layer axis (MaxText's axis 1) when scanned
    at = r"^decoder/layers/" if c.scan else r"^decoder/layers_\d+/"
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


def _megatron_expects(c: RecipeConfig) -> list[Rule]:
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    rows = k * (h // k + 2) * d
    why = f"n_kv_heads x (n_heads / n_kv_heads + 2) x head_dim = {k} x {h // k + 2} x {d} rows: q, k, v per group"
    layer = r"^decoder\.layers\.\d+\."
    return [Expect(layer + r"self_attention\.linear_qkv\.weight$", (rows, None), why),
            Expect(layer + r"self_attention\.linear_qkv\.bias$", (rows,), why),
            Expect(layer + r"self_attention\.linear_proj\.weight$", (None, h * d),
                   f"n_heads x head_dim = {h} x {d} columns")]


# ------------------------------------------------------------------ recipes, one direction each


def _hf_to_maxtext(c: RecipeConfig, moe: bool) -> list[Rule]:
    """HF -> MaxText (every rule invertible). The order: names per layer (experts apart), the
    rotary interleave on HF's ``[H*D, E]`` rows, kernels transposed to ``[in, out]``, heads split
    out as an axis, the query scale folded in, experts stacked, layers stacked on axis 1."""
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    out: list[Rule] = _hf_expects(c)
    out += [Rename(HF_LAYER + hf + "$", MX_LAYER + mx) for hf, mx in HF_MAXTEXT_LAYER]
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
        out.append(Stack(r"^decoder/layers_(?P<layer>\d+)/(?P<leaf>.*)$", r"decoder/layers/\g<leaf>", dim=1,
                         index="layer"))
    return out + _maxtext_expects(c)


def _megatron_to_hf(c: RecipeConfig, moe: bool) -> list[Rule]:
    """megatron-core -> HF (every rule invertible): fused QKV split per query group, SwiGLU
    ``linear_fc1`` split into gate and up, then names."""
    if moe:
        raise OptionError("recipe mixtral: megatron-core MoE names are not mapped yet (the Megatron reader "
                          "refuses MoE checkpoints); use hf <-> maxtext")
    h, k, d = c.n_heads, c.n_kv_heads, c.head_dim
    layer = r"^decoder\.layers\." + L + r"\."
    out: list[Rule] = [
        *_megatron_expects(c),
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
    return out + _hf_expects(c)


_BASE: dict[tuple[str, str], Callable[[RecipeConfig, bool], list[Rule]]] = {
    ("hf", "maxtext"): _hf_to_maxtext,
    ("megatron", "hf"): _megatron_to_hf,
}
_FAMILIES: dict[str, dict[str, Any]] = {  # family -> its config defaults, and whether it is MoE
    "llama": {"moe": False, "defaults": {}},
    "qwen2": {"moe": False, "defaults": {"qkv_bias": True, "query_scale": False}},
    "mixtral": {"moe": True, "defaults": {}},
}
_ROUTES: dict[tuple[str, str], tuple[tuple[str, str, bool], ...]] = {  # (base pair, inverted?) steps
    ("hf", "maxtext"): (("hf", "maxtext", False),),
    ("maxtext", "hf"): (("hf", "maxtext", True),),
    ("megatron", "hf"): (("megatron", "hf", False),),
    ("hf", "megatron"): (("megatron", "hf", True),),
    ("megatron", "maxtext"): (("megatron", "hf", False), ("hf", "maxtext", False)),
    ("maxtext", "megatron"): (("hf", "maxtext", True), ("megatron", "hf", True)),
}


def families() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def available() -> list[tuple[str, str, str]]:
    """Every ``(family, src, dst)`` a recipe exists for."""
    out = []
    for fam, spec in _FAMILIES.items():
        for src, dst in _ROUTES:
            if spec["moe"] and "megatron" in (src, dst):
                continue
            out.append((fam, src, dst))
    return out


def rules(family: str, *, src: str, dst: str, **config: Any) -> tuple[Rule, ...]:
    """The rule list mapping ``family`` from naming scheme ``src`` to ``dst`` (see the module doc).

    Unknown families, pairs or config keys, and config that cannot fit (head counts that do
    not divide), fail here, before any checkpoint is read; a checkpoint that does not fit the
    config fails when the rules are applied (``ckptbridge.open(path, rules=...)``), still
    before any data is read, naming the tensor and the expected and found shapes.
    """
    spec = _FAMILIES.get(family)
    if spec is None:
        raise OptionError(f"no recipe family {family!r}; families: {', '.join(_FAMILIES)}")
    route = _ROUTES.get((src, dst))
    if route is None or (family, src, dst) not in available():
        pairs = ", ".join(f"{s}->{d}" for f, s, d in available() if f == family)
        raise OptionError(f"recipe {family!r} has no {src!r} -> {dst!r} mapping; it maps {pairs}")
    known = {f.name for f in fields(RecipeConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise OptionError(f"recipe {family!r}: unknown config {unknown}; known: {sorted(known)}")
    missing = [k for k in ("n_heads", "n_kv_heads", "head_dim") if k not in config]
    if missing:
        raise OptionError(f"recipe {family!r}: config needs {missing} (the model's attention shape)")
    cfg = RecipeConfig(**{**spec["defaults"], **config})
    out: list[Rule] = []
    for a, b, inverted in route:
        step = _BASE[(a, b)](cfg, spec["moe"])
        out += [r for r in (invert(step) if inverted else step) if r not in out or not isinstance(r, Expect)]
    return tuple(out)


def show(rules_: Sequence[Rule]) -> str:
    """One rule per line, as JSON (what a manifest records)."""
    return "\n".join(json.dumps(r) for r in rules_to_json(rules_))


# ------------------------------------------------------------------ model configs between schemes


def _load(config: Any) -> dict[str, Any]:
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        with open(config) as fh:
            return dict(json.load(fh))
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(config)


def _rope_theta(hf: Mapping[str, Any]) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def config_from_hf(config: Any) -> dict[str, Any]:
    """Recipe config (``n_heads``, ``n_kv_heads``, ``head_dim``, ``tie_embeddings``, ``qkv_bias``,
    ``rope``) read from an HF ``config.json`` (path, dict or ``PretrainedConfig``). ``rope`` is the
    MaxText ``rope_type`` that computes HF's rotary: ``"llama3.1"`` for Llama-3 frequency scaling
    (MaxText hard-codes Llama 3.1's constants; check yours match), else ``"default"``."""
    hf = _load(config)
    heads = int(hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return {"n_heads": heads, "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
            "rope": "llama3.1" if rope.get("rope_type", rope.get("type")) == "llama3" else "default"}


def family_from_hf(config: Any) -> str:
    """The recipe family of an HF ``config.json``: ``llama`` (Llama, Mistral), ``qwen2``, ``mixtral``."""
    kind = str(_load(config).get("model_type"))
    family = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "mixtral": "mixtral"}.get(kind)
    if family is None:
        raise OptionError(f"no recipe family for HF model_type {kind!r}; families: {', '.join(_FAMILIES)}")
    return family


def megatron_args(config: Any, template: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Megatron args for an HF Llama-family ``config.json``: the model-shape keys (layers, sizes,
    heads and query groups, SwiGLU, RMSNorm, RoPE base, biases, tied embeddings, vocabulary) over
    ``template`` (the args of the Megatron run that will load it; Megatron-LM needs its full
    args). Write them to JSON and pass ``-o args=FILE`` to ``reshard --to megatron``."""
    hf = _load(config)
    heads = int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    args = dict(template or {})
    vocab = int(hf["vocab_size"])
    divisible = int(args.get("make_vocab_size_divisible_by") or 1) * int(args.get("tensor_model_parallel_size") or 1)
    args.update(
        num_layers=int(hf["num_hidden_layers"]), hidden_size=int(hf["hidden_size"]),
        ffn_hidden_size=int(hf["intermediate_size"]), num_attention_heads=heads,
        group_query_attention=kv != heads, num_query_groups=kv,
        kv_channels=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        swiglu=True, normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-5)),
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-5)), position_embedding_type="rope",
        rotary_base=_rope_theta(hf), rotary_percent=1.0, rotary_interleaved=False, add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
        untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", False)),
        # Megatron-LM's NullTokenizer(vocab_size) has vocab_size + 1 tokens (its EOD): the HF vocabulary
        vocab_size=vocab - 1 if args.get("tokenizer_type") == "NullTokenizer" else vocab,
        padded_vocab_size=-(-vocab // divisible) * divisible,
        make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by") or 1),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
        bf16=dtype == "bfloat16", fp16=dtype == "float16")
    return args


def hf_config(args: Mapping[str, Any], vocab_size: int | None = None, family: str = "llama") -> dict[str, Any]:
    """An HF ``config.json`` (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``) for Megatron ``args``
    (as ``ckptbridge.open(megatron_run).extra["megatron"]["args"]`` gives them); ``vocab_size``:
    the vocabulary without Megatron's padding (the Megatron reader strips it)."""
    if args.get("normalization") != "RMSNorm" or not args.get("swiglu") or args.get("position_embedding_type") != "rope":
        raise OptionError("hf_config: only Llama-family Megatron models (RMSNorm, SwiGLU, RoPE) map to HF Llama")
    heads = int(args["num_attention_heads"])
    kv = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    model_type = "qwen2" if family == "qwen2" else "llama"
    out = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type, "hidden_size": int(args["hidden_size"]),
        "intermediate_size": int(args.get("ffn_hidden_size") or 4 * int(args["hidden_size"])),
        "num_hidden_layers": int(args["num_layers"]), "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": int(args.get("kv_channels") or int(args["hidden_size"]) // heads),
        "rms_norm_eps": float(args.get("norm_epsilon") or args.get("layernorm_epsilon") or 1e-5),
        "vocab_size": int(vocab_size if vocab_size is not None else args["padded_vocab_size"]),
        "max_position_embeddings": int(args.get("max_position_embeddings") or 4096),
        "tie_word_embeddings": not bool(args.get("untie_embeddings_and_output_weights")),
        "rope_theta": float(args.get("rotary_base") or 10000.0), "hidden_act": "silu",
        "attention_bias": bool(args.get("add_qkv_bias")), "mlp_bias": False,
        "torch_dtype": "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32",
    }
    if args.get("rotary_interleaved"):
        raise OptionError("hf_config: Megatron's interleaved rotary layout has no HF Llama equivalent")
    return out

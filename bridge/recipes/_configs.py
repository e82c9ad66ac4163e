"""Model configs between schemes: Megatron args for an HF config, an HF config for Megatron args."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._errors import OptionError
from ._family import load_config, registry
from ._gpt import rope_theta


def megatron_args(config: Any, template: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Megatron args for an HF Llama-family ``config.json``: the model-shape keys (layers, sizes,
    heads and query groups, SwiGLU, RMSNorm, RoPE base, biases, tied embeddings, vocabulary) over
    ``template`` (the args of the Megatron run that will load it; Megatron-LM needs its full
    args). Write them to JSON and pass ``-o args=FILE`` to ``reshard --to megatron``.

    ``config`` may be the HF checkpoint directory, or its ``config.json`` beside the weights: then the
    tensors decide what the config cannot, ``mtp_num_layers`` counts the multi-token-prediction layers
    whose tensors are there (``model.layers.<num_hidden_layers + k>.*``; transformers' ``save_pretrained``
    writes none even where ``num_nextn_predict_layers`` says 1, and megatron-core's strict load would
    miss them)::

        megatron_args("DeepSeek-V3/")["mtp_num_layers"]              # 1: the release has model.layers.61.*
        megatron_args("saved_by_transformers/")["mtp_num_layers"]    # None: no MTP tensors"""
    ckpt_dir = _checkpoint_dir(config)
    given_dir = ckpt_dir is not None and os.path.isdir(os.fspath(config))
    hf = load_config(os.path.join(ckpt_dir, "config.json") if given_dir and ckpt_dir else config)
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
        rotary_base=rope_theta(hf), rotary_percent=1.0, rotary_interleaved=False, add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
        untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", False)),
        # Megatron-LM's NullTokenizer(vocab_size) has vocab_size + 1 tokens (its EOD): the HF vocabulary
        vocab_size=vocab - 1 if args.get("tokenizer_type") == "NullTokenizer" else vocab,
        padded_vocab_size=-(-vocab // divisible) * divisible,
        make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by") or 1),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
        bf16=dtype == "bfloat16", fp16=dtype == "float16")
    extra = next((f.megatron_args for f in registry().values() if hf.get("model_type") in f.model_types), None)
    if extra is not None:  # a family's own keys (q/k norms, MoE)
        args.update(extra(hf))
    if ckpt_dir is not None and args.get("mtp_num_layers"):
        args["mtp_num_layers"] = _mtp_layers_present(ckpt_dir, int(hf["num_hidden_layers"]),
                                                     int(args["mtp_num_layers"])) or None
    return args


def _checkpoint_dir(config: Any) -> str | None:
    """The checkpoint directory ``config`` names (itself, or the directory its config file sits in
    beside ``*.safetensors`` weights); None for a dict, a ``PretrainedConfig`` or a lone config file."""
    if not isinstance(config, str) and not hasattr(config, "__fspath__"):
        return None
    path = str(os.fspath(config))
    if os.path.isdir(path):
        return path
    folder = os.path.dirname(os.path.abspath(path))
    return folder if any(f.endswith(".safetensors") for f in os.listdir(folder)) else None


def _mtp_layers_present(path: str, layers: int, configured: int) -> int:
    """How many of the ``configured`` MTP layers (HF ``model.layers.<layers + k>``) have tensors in ``path``
    (only the index is read: names, no bytes)."""
    from .._read.open import open_index

    names = open_index(path).tensors
    k = 0
    while k < configured and any(n.startswith(f"model.layers.{layers + k}.") for n in names):
        k += 1
    return k


def hf_config(args: Mapping[str, Any], vocab_size: int | None = None, family: str = "llama") -> dict[str, Any]:
    """An HF ``config.json`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, or a family's own, e.g.
    ``family="qwen3_moe"``) for Megatron ``args``
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
    own = registry().get(family)
    if own is not None and own.hf_config is not None:  # a family's own keys (model_type, q/k norms, MoE)
        out.update(own.hf_config(args))
    elif args.get("multi_latent_attention") or args.get("num_experts"):  # a Llama config would drop them silently
        raise OptionError(f"hf_config: family {family!r} writes no HF config for multi-latent attention or "
                          "mixture-of-experts Megatron args; pass the family whose config it is (e.g. 'qwen3_moe')")
    return out

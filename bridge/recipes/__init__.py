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

Families: one module of this package each (``llama``, ``qwen2``, ``mixtral``, ...; their
docstrings say what each maps); adding a family adds its module (see ``_family.py``). The
Llama-like families' config keys: ``n_heads``,
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
from collections.abc import Sequence
from typing import Any

from .._errors import OptionError
from ..rules import Rule, rules_to_json
from ._configs import hf_config, megatron_args
from ._family import Family, family, load_config, registry
from ._gpt import RecipeConfig

__all__ = ["Family", "RecipeConfig", "available", "config_from_hf", "config_type", "families", "family_from_hf",
           "hf_config", "megatron_args", "rules", "show"]

def families() -> tuple[str, ...]:
    """The family names, sorted."""
    return tuple(registry())


def available() -> list[tuple[str, str, str]]:
    """Every ``(family, src, dst)`` a recipe exists for."""
    return [(name, src, dst) for name, fam in registry().items() for src, dst in fam.pairs()]


def config_type(family_: str) -> type:
    """The config dataclass of a family (its fields are the config keys ``rules`` takes)."""
    return family(family_).config


def rules(family_: str, *, src: str, dst: str, **config: Any) -> tuple[Rule, ...]:
    """The rule list mapping ``family_`` from naming scheme ``src`` to ``dst`` (see the module doc).

    Unknown families, pairs or config keys, and config that cannot fit (head counts that do
    not divide), fail here, before any checkpoint is read; a checkpoint that does not fit the
    config fails when the rules are applied (``ckptbridge.open(path, rules=...)``), still
    before any data is read, naming the tensor and the expected and found shapes.
    """
    return family(family_).rules(src, dst, config)


def show(rules_: Sequence[Rule]) -> str:
    """One rule per line, as JSON (what a manifest records)."""
    return "\n".join(json.dumps(r) for r in rules_to_json(rules_))


def family_from_hf(config: Any) -> str:
    """The recipe family of an HF ``config.json`` (path, dict or ``PretrainedConfig``), by its
    ``model_type`` (``llama`` and ``mistral`` -> ``llama``, ...)."""
    kind = str(load_config(config).get("model_type"))
    for name, fam in registry().items():
        if kind in fam.model_types:
            return name
    raise OptionError(f"no recipe family for HF model_type {kind!r}; families: {', '.join(registry())}")


def config_from_hf(config: Any) -> dict[str, Any]:
    """The recipe config its family reads from an HF ``config.json`` (path, dict or
    ``PretrainedConfig``): for the Llama-like families ``n_heads``, ``n_kv_heads``, ``head_dim``,
    ``tie_embeddings``, ``qkv_bias`` and ``rope`` (the MaxText ``rope_type`` that computes HF's
    rotary: ``"llama3.1"`` for Llama-3 frequency scaling, else ``"default"``)."""
    hf = load_config(config)
    fam = family(family_from_hf(hf))
    if fam.from_hf is None:
        raise OptionError(f"recipe {fam.name!r} reads no HF config; pass its config keys to rules()")
    return fam.from_hf(hf)

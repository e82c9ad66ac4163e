"""PEFT's LoRA on 3-D expert parameters (``target_parameters``, ``lora.ParamWrapper``) in the factor
layout the recipes' rules move, and back.

PEFT 0.21 keeps the experts of ``W [E, out, in]`` (transformers' ``mlp.experts.gate_up_proj`` /
``down_proj``) in one pair: ``A [E*r, in]``, ``B [out, r*E]``, expert ``e``'s delta ``B[:, e::E] @
A[e*r:(e+1)*r]``. :func:`to_stacked` writes the rules that reshape them into the factors of a weight
with a stacked axis (:class:`~._plan.Layout`: ``A [r, E, in]``, ``B [E, out, r]``), which a recipe's
``Unstack`` of the experts (Megatron's ``local_experts.N.linear_fc1``) turns into each expert's own
``[r, in]``, ``[out, r]`` pair, exactly (same rank, no zeros). :func:`to_peft` is the way back (a
recipe's ``Stack`` of the experts gives the stacked layout) and :func:`peft_names` names the pairs as
PEFT nests the wrappers of one module's parameters::

    rules = to_stacked("model.layers.0.mlp.experts.down_proj", experts=4, rank=8)
    rules["A"]  # (SplitDim(..., dim=0, sizes=(4, 8)), Transpose(..., perm=(1, 0, 2)))
    peft_names(["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"])
    # {'model.layers.0.mlp.experts.gate_up_proj': 'base_model.model.model.layers.0.mlp.experts.base_layer',
    #  'model.layers.0.mlp.experts.down_proj': 'base_model.model.model.layers.0.mlp.experts'}

Only ``[E, out, in]`` experts: transformers' ``is_transposed`` ones (gpt-oss, ``[E, in, out]``) are not carried.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ckptbridge.plugin import MergeDims, Rule, SplitDim, Transpose

from ._plan import Layout
from ._read import PARAM_ORDER

__all__ = ["is_expert_param", "layout", "peft_names", "target_parameter", "to_peft", "to_stacked"]

_STACKED = -2  # the experts' axis id in a Layout (-1 is the rank)


def layout(experts: int, rank: int) -> Layout:
    """The axes of ``W [E, out, in]`` whose factors are stacked on the experts (``A [r, E, in]``, ``B [E, out, r]``)."""
    return Layout(((_STACKED, "b"), (0, "o"), (1, "i")), rank, ((_STACKED, experts),))


def to_stacked(base: str, experts: int, rank: int) -> dict[str, tuple[Rule, ...]]:
    """The rules (for ``"A"``, for ``"B"``) from PEFT's ``A [E*r, in]``, ``B [out, r*E]`` of ``base``
    to ``A [r, E, in]``, ``B [E, out, r]``."""
    at = f"^{re.escape(base)}$"
    return {"A": (SplitDim(at, 0, (experts, rank)), Transpose(at, (1, 0, 2))),
            "B": (SplitDim(at, 1, (rank, experts)), Transpose(at, (2, 0, 1)))}


def to_peft(base: str) -> dict[str, tuple[Rule, ...]]:
    """The rules (for ``"A"``, for ``"B"``) from ``A [r, E, in]``, ``B [E, out, r]`` of ``base`` to PEFT's
    ``A [E*r, in]``, ``B [out, r*E]``."""
    at = f"^{re.escape(base)}$"
    return {"A": (Transpose(at, (1, 0, 2)), MergeDims(at, 0, 2)),
            "B": (Transpose(at, (1, 2, 0)), MergeDims(at, 1, 2))}


def is_expert_param(name: str, ndim: int) -> bool:
    """Whether the carried factor of ``name`` (``ndim`` dims) is an HF expert parameter's (``...experts.down_proj``)."""
    return ndim == 3 and "." in name and "/" not in name and not name.endswith(".weight")


def target_parameter(base: str) -> str:
    """PEFT's ``target_parameters`` entry of ``base``: its module's last name and the parameter
    (``model.layers.0.mlp.experts.down_proj`` -> ``experts.down_proj``)."""
    return ".".join(base.split(".")[-2:])


def peft_names(bases: Iterable[str]) -> dict[str, str]:
    """PEFT's module name of each expert parameter's wrapper: the parameters of one module nest in
    transformers' registration order, the last outermost (``.base_layer`` once per parameter after it)."""
    modules: dict[str, list[str]] = {}
    for base in bases:
        module, _, param = base.rpartition(".")
        modules.setdefault(module, []).append(param)
    out = {}
    for module, params in modules.items():
        params.sort(key=lambda p: PARAM_ORDER.index(p) if p in PARAM_ORDER else 0)
        for k, param in enumerate(params):
            out[f"{module}.{param}"] = f"base_model.model.{module}" + ".base_layer" * (len(params) - 1 - k)
    return out

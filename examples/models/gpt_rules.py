"""A rule set, as data, that maps a torch GPT checkpoint onto a Flax NNX GPT and back.

The torch side is ``examples/models/torch_gpt.py`` (the DeepSpeed fixtures' tiny
GPT, names like ``blocks.0.qkv.weight``); the Flax side is
``examples/models/flax_gpt.py`` (``blocks/q/kernel`` stacked over layers). The
differences the rules bridge, in order:

1. the fused ``qkv`` projection ``[3D, D]`` splits into ``q``, ``k``, ``v``
   (:class:`Split`; back with :class:`Join`);
2. ``Linear.weight`` ``[out, in]`` becomes ``kernel`` ``[in, out]`` (:class:`Transpose`);
3. ``Embedding.weight`` -> ``embedding``, ``LayerNorm.weight`` -> ``scale``,
   other ``.weight`` -> ``kernel``, ``.`` -> ``/`` (:class:`Rename`);
4. per-layer ``blocks/N/...`` stack into one ``blocks/...`` tensor on a
   leading layer axis for ``nnx.scan`` (:class:`Stack`; back with :class:`Unstack`).

Every rule moves fragment boxes and strides only; no data is read until a
framework loads the tensors, and each device then reads only its own box.
The rules apply to every state (weights, ``exp_avg``, ``exp_avg_sq``), so
the optimizer state migrates with the weights::

    from ckptbridge.adapters import flax as cbflax
from examples.models import gpt_rules

    rules = gpt_rules.torch_to_flax(d_model=60)
    print(gpt_rules.show(rules))                       # the rule set, one line each
    params, opt_state = cbflax.load("run/ckpt", params, opt_state, rules=rules)

    cbt.load_module(model, "jax_ckpt", rules=gpt_rules.flax_to_torch())   # and back

**Writing a rule set for your own model.** Print both name lists
(``list(ckptbridge.open(path))`` and the Flax params' ``/``-joined key paths),
then write the list of rules that turns one into the other, in the order
above: split fused tensors first (while the names are still the source's),
transpose the matrices, rename, and stack layers last. Give the inverse too
(unstack first, fuse last). Check with :func:`check` against the target's
shapes. The rules are plain dataclasses: they print, serialise to JSON
(``rules_to_json``) and are stored in the manifests of checkpoints written
through them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckptbridge import (
    Checkpoint,
    Join,
    Rename,
    Rule,
    ShapeMismatchError,
    Split,
    Stack,
    Transpose,
    Unstack,
    apply_rules,
    rules_to_json,
)

__all__ = ["check", "flax_to_torch", "show", "torch_to_flax"]

_LINEARS = r"^(blocks\.\d+\.(q|k|v|proj|fc|fc_out)|lm_head)\.weight$"


def torch_to_flax(
    d_model: int = 60,
    *,
    scan: bool = True,
    layers: str = "blocks",
    qkv: str = "qkv",
    embeddings: Sequence[str] = ("wte", "wpe"),
    norms: Sequence[str] = ("ln1", "ln2", "ln_f"),
) -> tuple[Rule, ...]:
    """Rules from torch GPT names (``blocks.0.qkv.weight``) to Flax NNX names
    (``blocks/q/kernel`` stacked, or ``blocks/0/q/kernel`` with ``scan=False``).

    ``d_model`` is the width of each of q, k, v in the fused ``qkv`` weight.
    """
    emb = "|".join(embeddings)
    nrm = "|".join(norms)
    rules: list[Rule] = [
        Split(rf"^{layers}\.(\d+)\.{qkv}\.weight$", rf"{layers}.\1.{{part}}.weight", dim=0,
              parts=("q", "k", "v"), widths=(d_model, d_model, d_model)),
        Transpose(_LINEARS.replace("blocks", layers), (1, 0)),
        Rename(rf"^({emb})\.weight$", r"\1.embedding"),
        Rename(rf"(^|\.)({nrm})\.weight$", r"\1\2.scale"),
        Rename(r"\.weight$", ".kernel"),
        Rename(r"\.", "/"),
    ]
    if scan:
        rules.append(Stack(rf"^{layers}/(\d+)/(.*)$", rf"{layers}/\2", 0))
    return tuple(rules)


def flax_to_torch(
    *,
    scan: bool = True,
    layers: str = "blocks",
    qkv: str = "qkv",
    embeddings: Sequence[str] = ("wte", "wpe"),
    norms: Sequence[str] = ("ln1", "ln2", "ln_f"),
) -> tuple[Rule, ...]:
    """The inverse of :func:`torch_to_flax`: Flax NNX names back to the torch GPT's."""
    del embeddings, norms  # embedding / scale / kernel all become .weight
    rules: list[Rule] = []
    if scan:
        rules.append(Unstack(rf"^{layers}/(.*)$", rf"{layers}/{{i}}/\1", 0))
    rules += [
        Rename(r"/", "."),
        Rename(r"\.(embedding|scale|kernel)$", ".weight"),
        Transpose(_LINEARS.replace("blocks", layers), (1, 0)),
        Join(rf"^{layers}\.(\d+)\.{{part}}\.weight$", rf"{layers}.\1.{qkv}.weight", dim=0,
             parts=("q", "k", "v")),
    ]
    return tuple(rules)


def show(rules: Sequence[Rule]) -> str:
    """The rule set as text, one rule a line (what the manifests store as JSON)."""
    lines = []
    for r in rules_to_json(rules):
        kind = r.pop("rule")
        lines.append(f"{kind:<9} " + "  ".join(f"{k}={v!r}" for k, v in r.items()))
    return "\n".join(lines)


def check(source: Checkpoint | Mapping[str, Any], rules: Sequence[Rule],
          target: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Apply ``rules`` to ``source``'s tensors and compare names and shapes with
    ``target`` (``{name: shape}``); raises ``ShapeMismatchError`` listing every
    difference, else returns the mapped ``{name: shape}``."""
    tensors = source.tensors if isinstance(source, Checkpoint) else source
    mapped = {n: t.shape for n, t in apply_rules(tensors, list(rules)).items()}
    want = {n: tuple(int(s) for s in shp) for n, shp in target.items()}
    problems = [f"missing {n} {s}" for n, s in want.items() if n not in mapped]
    problems += [f"extra {n} {s}" for n, s in mapped.items() if n not in want]
    problems += [f"{n}: {mapped[n]} != {s}" for n, s in want.items() if n in mapped and mapped[n] != s]
    if problems:
        raise ShapeMismatchError("rule set does not produce the target: " + "; ".join(problems[:10]))
    return mapped

"""LoRA adapters carried alone between frameworks, through the base model's recipe rules.

An adapted weight ``W`` (HF ``[out, in]``) is ``s * B @ A``; the recipe that maps ``W`` to another
framework (a MaxText kernel ``[in, ..., out ...]``, a fused Megatron ``linear_qkv``) permutes,
reshapes, scales, splits and joins its axes. ``_plan`` writes each rule for the factor that holds
the axes it moves: a query kernel scaled by ``c`` scales ``B`` by ``c`` (and its Adam moments as
``Scale`` says), the rotary interleave permutes ``B``'s rows, the heads split ``B``'s columns, the
transpose turns ``A [r, in]`` into ``A [in, r]``, MaxText's layer stack goes into both (and out of
both, from a scanned MaxText tree)::

    config = ckptbridge.recipes.config_from_hf("llama/config.json")
    base = ckptbridge.recipes.rules("llama", src="hf", dst="maxtext", scan=False, **config)
    mt = carry(ckptbridge.open("peft_adapter/"), base)   # PEFT's save_pretrained folder
    sorted(mt)[:2]  # ['decoder/layers_0/mlp/wi_0/lora_a.kernel', 'decoder/layers_0/mlp/wi_0/lora_b.kernel']

MaxText's training-time LoRA (qwix, ``<kernel>_lora_a`` / ``_lora_b``, flattened) is read through
:func:`qwix_splits` and written with ``carry(..., qwix=True)`` (:func:`qwix_folds`; ``save_qwix``
writes it where MaxText and Tunix restore it). The MaxText names and shapes are MaxText 0.2.5's
adapter tree (``utils/lora_utils.py`` ``get_lora_abstract_state_nnx``: ``<module>/lora_a.kernel [in..., r]``, ``<module>/lora_b.kernel
[r, out...]``, scanned ``[in..., layers, r]`` / ``[r, layers, out...]``; its merge ``W +
einsum("er,rnd->end", a, b) * lora_alpha / r``); HF names are PEFT's
(``base_model.model.<module>.lora_A.weight [r, in]``, ``lora_B.weight [out, r]``); Megatron-Bridge's
are ``<linear>.adapter.linear_in.weight`` (``A``) and ``.linear_out.weight`` (``B``), merged as ``W +
alpha / dim * linear_out @ linear_in``. A fused QKV or gate/up ``Split`` (Megatron -> PEFT) splits
``B`` like the weight's rows and gives every part the same ``A`` (:class:`Copy`); a ``Join`` (PEFT ->
Megatron) fuses the parts' pairs into one of the summed rank (:class:`Place`; see :func:`carry`).
Nothing is read: the result is lazy, like any view through rules.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from ckptbridge.plugin import (
    Checkpoint,
    CheckpointIndex,
    FormatError,
    LogicalTensor,
    OptionError,
    Rule,
    Scale,
    apply_rules,
)

from .._hf import peft_weights_file
from . import _experts, _read
from ._plan import Copy, Layout, Place, layout_of, plan, qwix_folds, qwix_splits, scan_axis

__all__ = ["carry", "factor_name", "factor_of", "save_peft"]

_PEFT = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_MAXTEXT = re.compile(r"^(?P<module>.+)/lora_(?P<part>[ab])\.kernel$")
_QWIX = re.compile(r"^(?P<module>.+)/(?P<param>[^/]+)_lora_(?P<part>[ab])(?:/value)?$")  # qwix (MaxText training)
_MEGATRON = re.compile(r"^(?P<module>.+)\.adapter\.linear_(?P<part>in|out)\.weight$")  # Megatron-Bridge's LoRA
_COUNTER = re.compile(r"(^|/)(count|step)(/value)?$")
_MEGATRON_BASE = re.compile(r"^(decoder|embedding|output_layer)\.")


def factor_of(name: str) -> tuple[str, str, str] | None:
    """``(base weight name, "A"|"B", style)`` of an adapter tensor name, or ``None``::

        factor_of("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
        # ('model.layers.0.self_attn.q_proj.weight', 'B', 'hf')
        factor_of("decoder/layers_0/self_attention/query/lora_a.kernel")
        # ('decoder/layers_0/self_attention/query/kernel', 'A', 'maxtext')
        factor_of("decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight")
        # ('decoder.layers.0.self_attention.linear_qkv.weight', 'B', 'megatron')
        factor_of("decoder/layers_0/self_attention/query/kernel_lora_b/value")
        # ('decoder/layers_0/self_attention/query/kernel', 'B', 'qwix')

    qwix's names are MaxText's training-time LoRA (``lora_utils.apply_lora_to_model``: an
    ``nnx.LoRAParam`` ``<param>_lora_a`` / ``_lora_b`` beside each adapted parameter; ``/value``
    where an ``nnx.State`` is saved as is, as ``restore_lora_from_path`` reads it).

    Megatron-Bridge's ``LoRA`` (``peft/lora.py``) wraps a linear layer with an adapter whose
    ``linear_in`` is ``A [r, in]`` and ``linear_out`` is ``B [out, r]``, scaled by ``alpha / dim``.
    """
    if m := _PEFT.match(name):
        return m["module"] + ".weight", m["part"], "hf"
    if m := _MAXTEXT.match(name):
        return m["module"] + "/kernel", m["part"].upper(), "maxtext"
    if m := _MEGATRON.match(name):
        return m["module"] + ".weight", "A" if m["part"] == "in" else "B", "megatron"
    if m := _QWIX.match(name):
        return f"{m['module']}/{m['param']}", m["part"].upper(), "qwix"
    return None


def factor_name(base: str, part: str, *, qwix: bool = False) -> str:
    """The adapter tensor name of factor ``part`` of base weight ``base`` (its style from the name;
    ``qwix``: MaxText's training-time LoRA, ``<param>_lora_a/value``, the leaf ``nnx.state`` saves)::

        factor_name("decoder/layers_0/mlp/wo/kernel", "B", qwix=True)  # 'decoder/layers_0/mlp/wo/kernel_lora_b/value'
    """
    if qwix:
        if "/" not in base:
            raise FormatError(f"{base!r}: qwix LoRA factors sit beside a MaxText parameter ('.../kernel')")
        return f"{base}_lora_{part.lower()}/value"
    if base.endswith("/kernel"):
        return f"{base.removesuffix('/kernel')}/lora_{part.lower()}.kernel"
    if base.endswith(".weight") and _MEGATRON_BASE.match(base):
        return f"{base.removesuffix('.weight')}.adapter.linear_{'in' if part == 'A' else 'out'}.weight"
    if base.endswith(".weight"):
        return f"base_model.model.{base.removesuffix('.weight')}.lora_{part}.weight"
    if "/moe_block/" in base:
        raise FormatError(f"{base!r}: MaxText 0.2.5 has no LoRA form for its MoE expert kernels (its adapter tree, "
                          "utils/lora_utils.py, has LoRA kernels beside DenseGeneral kernels only; qwix's LoRA on "
                          "the experts' einsum shares one A across experts, and none on the sparse_matmul path)")
    raise FormatError(f"{base!r}: no LoRA naming for a weight that ends neither in '.weight' nor '/kernel'")


def carry(adapter: Checkpoint, rules: Sequence[Rule], *, alpha: float | None = None,
          path: str = "", qwix: bool = False) -> Checkpoint:
    """``adapter`` (PEFT's folder opened, MaxText's adapter leaves, unscanned or scanned, or
    Megatron-Bridge's) seen through the base model's ``rules`` (e.g.
    ``ckptbridge.recipes.rules(family, src=..., dst=...)``): a checkpoint of the destination's
    ``lora_A``/``lora_B`` tensors (every state: Adam moments move as the rules say), lazily.

    The result has one rank ``r`` and one scaling ``lora_alpha / r``, recorded in ``extra["lora"]``
    (what PEFT's ``LoraConfig``, MaxText's adapter config and Megatron-Bridge's ``LoRA(dim=r,
    alpha=lora_alpha)`` take): a pair scaled otherwise (rsLoRA, a rank or alpha pattern) has the
    ratio folded into ``B``; a pair of a smaller rank is padded with zeros (``B @ A`` unchanged). A
    weight fused from parts (PEFT's q/k/v into Megatron's ``linear_qkv``, gate/up into
    ``linear_fc1``) gets one pair whose rank is the sum of the parts' ranks: ``A`` the parts' ``A``
    stacked, ``B`` block-diagonal (each part's ``B`` in its rank columns, its rows where the weight's
    rows go), so ``B @ A`` is exactly the parts' deltas. Its Adam moments: ``A``'s stack, ``B``'s
    blocks with zeros beside them. At the carried point the gradients of ``A`` and of ``B``'s blocks
    are the parts' own (so their moments are exact), but the zero blocks get a gradient too (a
    fused pair trains as one adapter of the summed rank): their zero moments are a fresh start, not a
    history, so training on is not the parts' training continued.

    PEFT's pairs on 3-D expert parameters (``target_parameters``: ``A [E*r, in]``, ``B [out, r*E]``)
    move as a weight ``[E, out, in]`` whose experts both factors stack (``_experts``): a recipe that
    unstacks the experts (``qwen3_moe`` with ``hf_experts="fused"`` to Megatron's
    ``local_experts.N``) gives each expert its own pair, exactly (its zero padding to the carried rank
    gets no gradient: its moments stay exact); carried back to HF they are PEFT's layout and nesting
    again, listed in ``extra["lora"]["target_parameters"]`` for :func:`save_peft`.

    ``alpha``: the source's ``lora_alpha`` where its files record none (MaxText's and
    Megatron-Bridge's factors; default ``r``, a scaling of 1); a PEFT folder's is its
    ``adapter_config.json``'s. The result's ``lora_alpha`` keeps the source's scaling.

    ``qwix`` (rules to MaxText): the factors as MaxText TRAINS them (``lora.enable_lora``: qwix's
    ``<kernel>_lora_a/value [prod(in), r]``, ``_lora_b/value [r, prod(out)]``, scanned ``[prod(in),
    layers, r]`` / ``[r, layers, prod(out)]``) instead of its served adapter tree; :func:`save_qwix`
    writes them where ``restore_lora_from_path`` (``lora.lora_restore_path``) reads them, with their
    Adam moments as Tunix's ``PeftTrainer`` checkpoint::

        mt = carry(ckptbridge.open("peft_adapter/"), rules, qwix=True)   # rules: hf -> maxtext
        save_qwix(mt, "lora_ckpt/")   # MaxText: lora.enable_lora=True lora.lora_restore_path=lora_ckpt/
    """
    pairs, style = _pairs(adapter)
    if style == "qwix":  # flattened factors: MaxText's served layout first
        pairs, style = _unflatten(pairs, rules), "maxtext"
    peft = _read.read(adapter.path, adapter.tensors) if style == "hf" else None
    experts = {}
    if peft is not None:  # PEFT's own pairing: a target_parameters pair adapts the parameter its nesting names
        pairs = {p.base: {"A": _renamed(adapter.tensors[p.a], p.base), "B": _renamed(adapter.tensors[p.b], p.base)}
                 for p in peft.pairs}
        experts = {p.base: _experts.to_stacked(p.base, p.experts, p.rank) for p in peft.pairs if p.experts > 1}
    lora_alpha, r, scalings = _scalings(adapter, style, peft, pairs, alpha)
    scale = lora_alpha / r
    folded = {b: s / scale for b, s in scalings.items() if s != scale}
    layouts = {b: layout_of(p["A"].shape, p["B"].shape, style, scan_axis(rules, b) if style == "maxtext" else None)
               for b, p in pairs.items()}
    layouts |= {p.base: _experts.layout(p.experts, p.rank) for p in (peft.pairs if peft else ()) if p.experts > 1}
    steps = plan(rules, layouts)
    out: dict[str, LogicalTensor] = {}
    params: set[str] = set()
    for part, part_rules in (("A", steps.a), ("B", steps.b)):
        prefix: list[Rule] = [Scale(f"^{re.escape(b)}$", f) for b, f in folded.items()] if part == "B" else []
        prefix += [rule for stacked in experts.values() for rule in stacked[part]]
        moved = _apply({b: p[part] for b, p in pairs.items()}, [*prefix, *part_rules])
        params |= {n for n, t in moved.items() if _experts.is_expert_param(n, len(t.shape))}
        moved = _apply(moved, [rule for n in params for rule in _experts.to_peft(n)[part]])
        wrappers = _experts.peft_names(params)
        if qwix:
            moved = _flatten(moved, steps.layouts, part)
        for name, t in moved.items():
            new = f"{wrappers[name]}.lora_{part}.weight" if name in wrappers else factor_name(name, part, qwix=qwix)
            out[new] = _renamed(t, new)
    mixed = sorted(n for n in out if (factor_of(n) or ("", "", ""))[2] != "hf")
    if params and mixed:
        raise FormatError(f"{adapter.path}: the rules leave PEFT's expert parameter {sorted(params)[0]!r} in its HF "
                          f"form while they map other weights (e.g. to {mixed[0]!r}): rules for transformers' "
                          "fused experts are needed (qwen3_moe: hf_experts='fused')")
    extra: dict[str, Any] = {"lora": {"r": steps.rank, "lora_alpha": scale * steps.rank, "from": adapter.path}}
    if params:  # PEFT's target_parameters (save_peft writes them)
        extra["lora"]["target_parameters"] = sorted({_experts.target_parameter(n) for n in params})
    index = CheckpointIndex("lora", path or adapter.path, out, adapter.step, extra)
    return Checkpoint(index, adapter.files)


def _renamed(t: LogicalTensor, name: str) -> LogicalTensor:
    return LogicalTensor(name, dict(t.states), dict(t.scalars))


def _pairs(adapter: Checkpoint) -> tuple[dict[str, dict[str, LogicalTensor]], str]:
    """``adapter``'s factors by base weight (``{"A": ..., "B": ...}``) and their naming style; an
    optimizer's step counters (0-d ``.../count``, ``.../step``: a Tunix checkpoint's
    ``optimizer_state``) are not factors and are left out."""
    pairs: dict[str, dict[str, LogicalTensor]] = {}
    styles = set()
    for name, t in adapter.tensors.items():
        if not t.shape and _COUNTER.search(name):
            continue
        found = factor_of(name)
        if found is None:
            raise FormatError(f"{adapter.path}: tensor {name!r} is not a LoRA factor (lora_A/lora_B)")
        base, part, style = found
        styles.add(style)
        pairs.setdefault(base, {})[part] = _renamed(t, base)
    if len(styles) != 1:
        raise FormatError(f"{adapter.path}: LoRA tensors of several namings {sorted(styles)}")
    for base, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise FormatError(f"{adapter.path}: {factor_name(base, next(iter(ab)))!r} has no partner")
    return pairs, styles.pop()


def _unflatten(pairs: Mapping[str, Mapping[str, LogicalTensor]], rules: Sequence[Rule]
               ) -> dict[str, dict[str, LogicalTensor]]:
    """qwix's flattened factors reshaped to MaxText's served layout (:func:`qwix_splits`)."""
    out: dict[str, dict[str, LogicalTensor]] = {}
    for base, ab in pairs.items():
        splits = qwix_splits(rules, base, ab["A"].shape, ab["B"].shape)
        out[base] = {part: _apply({base: t}, splits[part])[base] for part, t in ab.items()}
    return out


def _flatten(factors: Mapping[str, LogicalTensor], layouts: Mapping[str, Layout], part: str) -> dict[str, LogicalTensor]:
    """MaxText's served factors ``part`` flattened to qwix's (:func:`qwix_folds`), by base weight name."""
    out: dict[str, LogicalTensor] = {}
    for base, t in factors.items():
        if not base.endswith("/kernel"):
            raise OptionError(f"{base!r}: qwix=True carries to MaxText kernels (rules with dst='maxtext')")
        out[base] = _apply({base: t}, qwix_folds(base, layouts[base], part, t.shape))[base]
    return out


def _scalings(adapter: Checkpoint, style: str, peft: _read.Adapter | None, pairs: Mapping[str, Mapping[str, LogicalTensor]],
              alpha: float | None) -> tuple[float, int, dict[str, float]]:
    """The source's ``lora_alpha`` and ``r`` (its nominal scaling ``lora_alpha / r``) and each pair's
    own scaling: PEFT's (``peft``) as ``adapter_config.json`` gives it (rsLoRA, patterns), others
    ``lora_alpha`` over the pair's rank (Megatron-Bridge's ``alpha / dim``)."""
    if peft is not None:
        if alpha is not None:
            raise OptionError(f"{adapter.path}: a PEFT adapter's lora_alpha is its {_read.CONFIG}'s; "
                              "alpha= is for factors that record none (MaxText's, Megatron-Bridge's)")
        config = _read._config(peft_weights_file(adapter.path))
        return float(config.get("lora_alpha", 8)), int(config.get("r", 8)), {p.base: p.scaling for p in peft.pairs}
    ranks = {b: p["A"].shape[-1 if style == "maxtext" else 0] for b, p in pairs.items()}
    given = adapter.extra.get("lora")
    config = dict(given) if isinstance(given, Mapping) else {}
    r = int(config.get("r", max(ranks.values())))
    lora_alpha = float(alpha if alpha is not None else config.get("lora_alpha", r))
    return lora_alpha, r, {b: lora_alpha / rank for b, rank in ranks.items()}


def _apply(tensors: dict[str, LogicalTensor], rules: Sequence[Rule]) -> dict[str, LogicalTensor]:
    """:func:`apply_rules`, with :class:`Copy` and :class:`Place` run here."""
    for rule in rules:
        if isinstance(rule, Copy):
            tensors = {new: LogicalTensor(new, dict(t.states), dict(t.scalars))
                       for n, t in tensors.items() for new in (rule.names(n) if rule.matches(n) else [n])}
        elif isinstance(rule, Place):
            tensors = {n: LogicalTensor(n, {s: rule.place(st) for s, st in t.states.items()}, dict(t.scalars))
                       if rule.matches(n) else t for n, t in tensors.items()}
        else:
            tensors = apply_rules(tensors, [rule])
    return tensors


def save_peft(lora: Checkpoint, out: str | os.PathLike[str], *, task_type: str = "CAUSAL_LM",
              target_parameters: Sequence[str] = ()) -> str:
    """Write ``lora`` (HF-named factors, e.g. :func:`carry` to HF) as a PEFT adapter folder
    (``adapter_model.safetensors`` + ``adapter_config.json`` with its ``r``, ``lora_alpha``, the
    modules it targets and the parameters: 3-D experts, as :func:`carry` records them, and
    ``target_parameters``, those of 2-D parameters that are no ``nn.Linear``'s weight, e.g. Qwen3-MoE's
    router ``mlp.gate.weight``), which ``peft.PeftModel.from_pretrained`` loads::

        save_peft(carry(ckptbridge.open("mt_read.safetensors"), back_rules, alpha=8.0), "adapter/")
        save_peft(carry(megatron_lora, to_hf_fused), "adapter/", target_parameters=["mlp.gate.weight"])
    """
    import ckptbridge

    names = [factor_of(n) for n in lora.tensors]
    if not names or any(f is None or f[2] != "hf" for f in names):
        raise FormatError(f"{lora.path}: only PEFT-named LoRA factors can be saved as a PEFT adapter")
    cfg = lora.extra.get("lora") or {}
    if "r" not in cfg or "lora_alpha" not in cfg:
        raise FormatError(f"{lora.path}: no r / lora_alpha in extra['lora'] (carry() records them)")
    params = sorted({*cfg.get("target_parameters", ()), *target_parameters})
    modules = sorted({PurePosixPath(f[0].replace(".", "/")).parent.name for f in names
                      if f and not _read.adapted(f[0].removesuffix(".weight"), params, lora.path, f[0])[1]})
    Path(out).mkdir(parents=True, exist_ok=True)
    ckptbridge.reshard(lora, str(Path(out) / _read.WEIGHTS), to="safetensors")
    config = {"peft_type": "LORA", "task_type": task_type, "r": int(cfg["r"]), "lora_alpha": cfg["lora_alpha"],
              "target_modules": modules or None, "bias": "none", "lora_dropout": 0.0, "use_rslora": False,
              **({"target_parameters": params} if params else {})}
    (Path(out) / _read.CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return str(out)

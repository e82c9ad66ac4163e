"""Index a Megatron iteration (legacy per-rank files or torch_dist) as one consolidated view."""

from __future__ import annotations

import os

import numpy as np

from ckptbridge.plugin import (
    Box,
    CheckpointIndex,
    CorruptionError,
    FileCache,
    FormatError,
    LogicalTensor,
    Split,
    TensorState,
    apply_rules,
    crop,
    read_state,
    rules_to_json,
    storage,
)

from ._common import plain, resolve_iter_dir
from ._dist import read_dist
from ._format import is_dist_dir, rank_dirs
from ._layout import MegatronConfig, consolidate, layout_rules, tp_layout
from ._legacy import read_legacy
from ._moe import check_moe_layers, is_expert, moe_split_rules


def split_rules(cfg: MegatronConfig) -> list[Split]:
    """Mapping rules that expose fused QKV as q/k/v and SwiGLU fc1 as gate/up."""
    d = cfg.kv_channels
    rules = [Split(r"^(.*\.self_attention\.linear_qkv)\.(weight|bias)$", to=r"\1.{part}.\2", dim=0,
                   parts=("q", "k", "v"), widths=(cfg.heads // cfg.groups * d, d, d), groups=cfg.groups)]
    if cfg.swiglu:
        rules.append(Split(r"^(.*\.mlp\.linear_fc1)\.(weight|bias)$", to=r"\1.{part}.\2", dim=0,
                           parts=("gate", "up"), widths=(cfg.ffn, cfg.ffn), groups=1))
        if cfg.num_experts:
            rules += moe_split_rules(cfg.moe_ffn, cfg.shared_ffn)
    return rules


def index(path: str, *, split_fused: bool = False, strip_padding: bool = True, vocab_size: int | None = None,
          check_replicas: bool = False) -> CheckpointIndex:
    """The lazy universal view of a Megatron checkpoint (see the module doc)."""
    it_dir, iteration = resolve_iter_dir(path)
    if is_dist_dir(it_dir):
        raw = read_dist(it_dir, iteration)
        fmt = "torch_dist"
    elif rank_dirs(it_dir):
        raw = read_legacy(it_dir, iteration)
        fmt = "torch"
    else:
        raise FormatError(
            f"{it_dir}: neither a legacy Megatron iteration (mp_rank_* dirs) nor a torch_dist "
            "checkpoint (metadata.json + .metadata)"
        )
    cfg = MegatronConfig.from_args(raw.args, vocab_size, where=it_dir)
    if cfg.num_experts:
        check_moe_layers(raw.pieces, raw.args, it_dir)
    global_pieces = fmt == "torch_dist"
    mixed = cfg.bf16 or cfg.fp16
    tensors: dict[str, LogicalTensor] = {}
    for name, states in raw.pieces.items():
        if name == "output_layer.weight" and cfg.tied:
            continue  # the last stage's copy of the tied word embeddings
        model = states.get("model")
        if not model:
            continue
        ndim = len(next(iter(model.values())).shape)
        lay = tp_layout(name, cfg, ndim)
        tp_size = cfg.etp if is_expert(name) else cfg.tp  # experts are split over expert-TP
        full: dict[str, TensorState] = {}
        for state, parts in states.items():
            if global_pieces:
                st = parts[0]
            else:
                if sorted(parts) != list(range(tp_size)):
                    raise FormatError(f"{it_dir}: {name!r} state {state!r} present on TP ranks {sorted(parts)} only")
                ordered = [parts[t] for t in range(tp_size)]
                if check_replicas and lay.kind == "replicated":
                    _check_equal(name, state, ordered)
                st = consolidate(name, ordered, lay, cfg)
            if lay.kind == "vocab" and strip_padding and cfg.vocab is not None:
                if st.shape[0] != cfg.padded_vocab:
                    raise FormatError(f"{it_dir}: {name!r} has {st.shape[0]} rows, padded_vocab_size is {cfg.padded_vocab}")
                st = crop(st, Box((0,) * len(st.shape), (cfg.vocab, *st.shape[1:])))
            full[state] = st
        out: dict[str, TensorState] = {}
        if mixed:
            out["param"] = full.pop("model")
            if "fp32_master" in full:
                out["fp32"] = full.pop("fp32_master")
        else:
            out["fp32"] = full.pop("model")
            full.pop("fp32_master", None)
        out.update(full)
        tensors[name] = LogicalTensor(name, out, dict(raw.scalars.get(name, {})))
    rules = layout_rules(cfg, raw.offsets, strip_padding)
    if split_fused:
        srules = split_rules(cfg)
        tensors = apply_rules(tensors, srules)
        rules = [*rules, *srules]
    extra = {
        "megatron": {
            "format": fmt,
            "iteration": raw.iteration,
            "args": plain(raw.args),
            "vocab_size": cfg.vocab,
            "padded_vocab_size": cfg.padded_vocab,
            "padding_stripped": bool(strip_padding and cfg.vocab is not None),
            "split_fused": split_fused,
            **{k: plain(v) for k, v in raw.extra.items()},
        }
    }
    if cfg.num_experts:
        extra["megatron"]["moe"] = {"num_experts": cfg.num_experts, "ep": cfg.ep, "etp": cfg.etp,
                                    "moe_ffn_hidden_size": cfg.moe_ffn, "grouped_gemm": cfg.grouped_gemm,
                                    "shared_expert_ffn": cfg.shared_ffn}
    prov = {"source_format": f"megatron/{fmt}", "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp,
            "path": storage.abspath(os.fspath(path)), "files": len(raw.files)}
    return CheckpointIndex("megatron", storage.abspath(os.fspath(path)), tensors, raw.iteration, extra,
                           tuple(rules_to_json(rules)), prov)


def _check_equal(name: str, state: str, parts: list[TensorState]) -> None:
    with FileCache() as files:
        first = read_state(parts[0], None, files)
        for t, p in enumerate(parts[1:], 1):
            if not np.array_equal(first, read_state(p, None, files)):
                raise CorruptionError(
                    f"{name!r} ({state}) is replicated over TP ranks but rank {t} differs from rank 0 "
                    f"({p.fragments[0].location.describe()})"
                )


__all__ = ["index", "split_rules"]

"""Read a Megatron-Core ``torch_dist`` dist-checkpoint directory in place.

``iter_XXXXXXX/{.metadata, __R_K.distcp, common.pt, metadata.json}``: keys
are layout-independent (global shapes); per-layer tensors are stacked on a
leading layer axis (``decoder.layers.self_attention.linear_qkv.weight``
``[L, ...]``), the local spec's norms are stored under the TE names
(``...linear_qkv.layer_norm_weight``). We unstack and rename back to the
legacy per-layer names, so both formats open to the same logical tensors.

Optimizer state: ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param,param}.<key>``
(non-distributed optimizer, and the distributed optimizer with
``--dist-ckpt-optim-fully-reshardable``). The default ``dp_reshardable``
distributed-optimizer format stores flat per-(TP,PP)-rank buffers without
parameter names (with MoE at EP > 1 also per-(expert-TP, EP, PP)-rank buffers of the
expert optimizer, ``chained_1.``); those are mapped by rebuilding each rank's parameter
list from the args, as the writer does (see :func:`_dp_reshardable`).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right
from typing import Any

from ckptbridge.adapters.torch_save import TorchArchive, read_scalar
from ckptbridge.plugin import (
    Box,
    FileRegion,
    FormatError,
    Fragment,
    MissingShardError,
    TensorState,
    crop,
    flat_range_fragments,
    storage,
    unstack,
)

from ..dcp import (
    DcpMetadata,
    chunk_fragment,
    object_archive,
    read_metadata,
    tensor_state,
)
from ._common import args_dict
from ._layout import MegatronConfig, consolidate, from_dist_key, tp_layout
from ._legacy import RawCheckpoint
from ._moe import DIST_EXPERTS, dist_experts, grouped_experts, is_expert
from ._optim import grad_buffer
from ._write_moe import RankFile, RankParam, optimizer_split, rank_params

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")  # a non-homogeneous block's per-layer key
_OPT_RE = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.*)$")
_BUCKET_RE = re.compile(  # chained_I.: optimizer I of a ChainedOptimizer (EP > 1: 0 dense, 1 expert)
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.*)\.bucket_idx_(\d+)"
    r"\.(param|exp_avg|exp_avg_sq)$"
)


def read_dist(it_dir: str, iteration: int | None) -> RawCheckpoint:
    common_path = storage.join(it_dir, "common.pt")
    if not storage.isfile(common_path):
        raise MissingShardError(f"{common_path}: torch_dist checkpoint without common.pt")
    common = TorchArchive.open(common_path).obj
    args = args_dict(common.get("args"), common_path)
    cfg = MegatronConfig.from_args(args, where=common_path)
    meta = read_metadata(it_dir)
    local_spec = cfg.transformer_impl == "local"
    raw = RawCheckpoint(args, iteration if iteration is not None else common.get("iteration"))
    raw.files = sorted({c.file for t in meta.tensors.values() for c in t.chunks})
    for f in raw.files:
        if not storage.isfile(f):
            raise MissingShardError(f"{f}: data file named by {it_dir}/.metadata is missing")
    fp16 = cfg.bf16 or cfg.fp16
    for key, _t in meta.tensors.items():
        if key.startswith(("optimizer.", "chained_", "rng_state")):  # (chained_I.: a ChainedOptimizer's)
            m = _OPT_RE.match(key)
            if m is None:
                continue
            kind, model_key = m.groups()
            state = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "fp32_master",
                     "param": "fp32_master"}[kind]
            if kind == "param" and not fp16:
                continue  # fp32 run: the optimizer's main param is the model weight itself
            _add(raw, model_key, state, tensor_state(meta, key), local_spec)
        else:
            _add(raw, key, "model", tensor_state(meta, key), local_spec)
    opt = common.get("optimizer") or {}
    if isinstance(opt, dict) and 0 in opt:  # a ChainedOptimizer (EP > 1: dense + expert optimizers)
        opt = opt[0]
    inner = opt.get("optimizer", opt) if isinstance(opt, dict) else {}
    groups = inner.get("param_groups") or []
    step = next((g["step"] for g in groups if "step" in g), None)
    cs = (inner.get("state") or {}).get("common_step")
    if cs is not None:
        step = read_scalar(TorchArchive.open(common_path), cs)
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if sharding == "dp_reshardable" or any(_BUCKET_RE.match(k) for k in meta.tensors):
        groups, step = _dp_reshardable(raw, cfg, meta)
        raw.extra["optimizer_kind"] = "distributed"
    elif any("exp_avg" in s for p in raw.pieces.values() for s in p):
        raw.extra["optimizer_kind"] = "distributed" if cfg.distributed_optimizer else ("float16" if fp16 else "fp32")
    if step is not None:
        for name, states in raw.pieces.items():
            if "exp_avg" in states:
                raw.scalars.setdefault(name, {})["step"] = int(step) if float(step).is_integer() else step
    raw.extra["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    raw.extra["dist_optim_sharding"] = sharding
    for key in ("opt_param_scheduler", "num_floating_point_operations_so_far", "checkpoint_version"):
        if key in common:
            raw.extra[key] = common[key]
    return raw


def _add(raw: RawCheckpoint, key: str, state: str, full: TensorState, local_spec: bool) -> None:
    """One stored tensor -> its pieces under the legacy names. Homogeneous blocks stack a key's layers on
    axis 0 (``decoder.layers.X``); with dense and MoE layers mixed (``moe_layer_freq`` a list or > 1)
    megatron-core's ``TransformerBlock.sharded_state_dict`` keys each layer on its own
    (``decoder.layers.<global layer>.X``, ``non_homogeneous_layers``): no layer axis."""
    if "._extra_state" in key:
        return
    m = _LAYER_KEY.match(key)
    if m:
        layers = [(from_dist_key(f"decoder.layers.{m.group(2)}", int(m.group(1)), local_spec), full)]
    elif key.startswith("decoder.layers."):
        layers = [(from_dist_key(key, i, local_spec), part) for i, part in enumerate(unstack(full, 0))]
    else:
        layers = [(key, full)]
    for name, part in layers:
        for n, p in dist_experts(name, part) if DIST_EXPERTS in name else [(name, part)]:
            raw.pieces.setdefault(n, {}).setdefault(state, {})[0] = p


def _dp_reshardable(raw: RawCheckpoint, cfg: MegatronConfig, meta: DcpMetadata) -> tuple[list[Any], Any]:
    """Map ``[chained_O.]optimizer.distributed.dp_group_idx_I...bucket_idx_B.{param,exp_avg,exp_avg_sq}`` onto params.

    Each bucket tensor is the coalesced buffer of that bucket (``_optim.grad_buffer``) of one optimizer on the
    ranks of one data-parallel group. ``I`` is the rank's index in the group of ranks that hold different
    parameters: for the dense optimizer (``O`` 0, or no prefix: the only one, EP 1) ``tp + TP * pp``, for the
    expert optimizer of a ``ChainedOptimizer`` (``O`` 1, EP > 1: experts have ``allreduce`` False)
    ``etp + ETP * (ep + EP * pp)`` (megatron-core's ``tp-ep-pp`` expert group). Each buffer's parameters are
    the writer's (``_write_moe.rank_params`` split by ``optimizer_split``); router buffers hold no state."""
    shapes = {n: raw.pieces[n]["model"][0].shape for n in raw.pieces}
    chained = 2 if cfg.num_experts and cfg.ep > 1 else 1
    if chained == 1 and cfg.num_experts and cfg.etp != cfg.tp:
        why = ("the data-parallel ranks sharing a buffer hold different expert-TP shards and each keeps the state of "
               "its own range only: no rank has the whole state of any shard" if cfg.etp > cfg.tp else
               "TP ranks with the same expert-TP rank hold diverging copies of each expert")
        raise FormatError(f"{meta.path}: MoE at EP 1 with expert TP {cfg.etp} != TP {cfg.tp} in the dp_reshardable "
                          f"format is not read: megatron-core keeps the experts in the dense optimizer's buffers, and "
                          f"{why} (measured with megatron-core 0.16.1)")
    buckets: dict[tuple[int, int, int], dict[str, str]] = {}
    for key in meta.tensors:
        m = _BUCKET_RE.match(key)
        if m:
            opt, idx, gbuf, _, b, kind = m.groups()
            if int(gbuf) != 0:
                raise FormatError(f"{meta.path}: several grad buffers per rank are not supported yet")
            if (opt is not None) != (chained > 1) or int(opt or 0) >= chained:
                raise FormatError(f"{meta.path}: {key}: EP={cfg.ep} gives megatron-core {chained} optimizer(s)")
            buckets.setdefault((int(opt or 0), int(idx), int(b)), {})[kind] = key
    groups: list[Any] = []
    step = None
    gathered: dict[str, dict[str, dict[int, TensorState]]] = {}  # name -> state -> TP (expert: ETP) rank -> piece
    for opt, idx in sorted({k[:2] for k in buckets}):
        rank, pp = _buffer_rank(cfg, opt, idx)
        params = optimizer_split([rp for rp in rank_params(cfg, raw.args, list(shapes), shapes, rank, pp)
                                  if not rp.buffer], cfg.ep, lambda rp: rp.expert)[opt]
        slots, sizes = grad_buffer([(rp.name, rp.shape) for rp in params], raw.args, pp,
                                   opt == 0 and cfg.tied and cfg.pp > 1)
        by_name = {rp.name: rp for rp in params}
        prefix = f"chained_{opt}." if chained > 1 else ""
        objkey = f"{prefix}optimizer.distributed.dp_group_idx_{idx}.optimizer/shard_0_1"
        if opt == 0 and objkey in meta.objects:
            obj = object_archive(meta, objkey)[0]
            pg = (obj[0] if isinstance(obj, list) else obj).get("param_groups") or []
            groups = groups or pg
            step = next((g["step"] for g in pg if "step" in g), step)
        for b, size in enumerate(sizes):
            keys = buckets.get((opt, idx, b))
            if keys is None:
                raise FormatError(f"{meta.path}: bucket {b} of {prefix}dp_group_idx_{idx} is missing")
            for kind, state in (("param", "fp32_master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                t = meta.tensors[keys[kind]]
                if t.size != (size,):
                    raise FormatError(
                        f"{meta.path}: {keys[kind]} has {t.size[0]} elements, Megatron's buffer layout for "
                        f"{rank} PP rank {pp} gives {size}; unknown megatron-core version?"
                    )
                frags = sorted((chunk_fragment(t, c) for c in t.chunks), key=lambda f: f.box.offset[0])
                starts = [f.box.offset[0] for f in frags]
                if state == "fp32_master" and not (cfg.bf16 or cfg.fp16):
                    continue  # fp32 run: the main param is the model weight (its chunks checked all the same)
                for s in slots:
                    if s.bucket != b or (s.name == "output_layer.weight" and cfg.tied):
                        continue  # (the last stage's copy of the tied embedding)
                    rp = by_name[s.name]
                    piece = _reshape(_slot(frags, starts, s.bucket_start, _numel(s.shape), t.dtype), s.shape)
                    at = rank.etp if rp.expert else rank.tp
                    for name, part in _grouped(rp, piece, cfg, rank.ep):
                        gathered.setdefault(name, {}).setdefault(state, {})[at] = part
    for name, per_state in gathered.items():
        shape = raw.pieces[name]["model"][0].shape
        lay = tp_layout(name, cfg, len(shape))
        n = cfg.etp if is_expert(name) else cfg.tp
        for state, parts in per_state.items():
            if sorted(parts) != list(range(n)):
                raise FormatError(f"{meta.path}: optimizer state {state!r} of {name!r} lacks TP ranks")
            raw.pieces[name][state] = {0: consolidate(name, [parts[t] for t in range(n)], lay, cfg)}
    return groups, step


def _buffer_rank(cfg: MegatronConfig, opt: int, idx: int) -> tuple[RankFile, int]:
    """The ranks whose parameters buffer ``dp_group_idx_<idx>`` of optimizer ``opt`` holds, and its PP rank."""
    if opt == 0:  # dense (at EP 1 with the experts, split over TP as the dense layers: ETP = TP)
        return RankFile(idx % cfg.tp, 0, idx % cfg.tp), idx // cfg.tp
    return RankFile(0, (idx // cfg.etp) % cfg.ep, idx % cfg.etp), idx // (cfg.etp * cfg.ep)


def _grouped(rp: RankParam, piece: TensorState, cfg: MegatronConfig, ep: int) -> list[tuple[str, TensorState]]:
    """A buffer slot's piece under its parameter's name; a GroupedMLP ``weight1`` / ``weight2`` per expert."""
    if not rp.parts:
        return [(rp.name, piece)]
    return grouped_experts(rp.name, piece, cfg.hidden, cfg.num_experts // cfg.ep, ep)


def _slot(frags: list[Fragment], starts: list[int], start: int, n: int, dtype: str) -> TensorState:
    """Elements ``[start, start + n)`` of a bucket tensor whose chunks ``frags`` (``starts``: their offsets) are
    sorted, as a 1-D state (no copy); only the chunks it overlaps are cut (megatron-core saves one per param)."""
    near = frags[max(bisect_right(starts, start) - 1, 0):bisect_left(starts, start + n)]
    lo = near[0].box.offset[0]
    hi = near[-1].box.offset[0] + near[-1].box.shape[0]
    span = TensorState(dtype, (hi - lo,), tuple(Fragment(f.box.shift((lo,)), f.location, f.checksum) for f in near))
    return crop(span, Box((start - lo,), (n,)))


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _reshape(piece: TensorState, shape: tuple[int, ...]) -> TensorState:
    """A 1-D piece of contiguous file runs seen as a row-major tensor of ``shape`` (no copy)."""
    out: list[Fragment] = []
    for f in sorted(piece.fragments, key=lambda f: f.box.offset[0]):
        loc = f.location
        if not isinstance(loc, FileRegion) or loc.strides != (1,):
            raise FormatError("distributed-optimizer buffer chunk is not a contiguous 1-D region")
        start, n = f.box.offset[0], f.box.shape[0]
        out += flat_range_fragments(shape, start, start + n, loc.file, loc.offset, loc.dtype)
    return TensorState(piece.dtype, shape, tuple(out))

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
parameter names; those are mapped by rebuilding each rank's parameter list
from the args (see :func:`_dp_reshardable`).
"""

from __future__ import annotations

import math
import re
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
from ._layout import MegatronConfig, consolidate, from_dist_key, local_params, tp_layout
from ._legacy import RawCheckpoint
from ._moe import DIST_EXPERTS, dist_experts, is_buffer
from ._optim import buffer_layout, ddp_bucket_size

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")  # a non-homogeneous block's per-layer key
_OPT_RE = re.compile(r"^optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.*)$")
_BUCKET_RE = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.*)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$"
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
        if key.startswith(("optimizer.", "rng_state")):
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
        if cfg.num_experts and (cfg.ep > 1 or cfg.etp != cfg.tp):
            raise FormatError(f"{it_dir}: MoE at expert parallelism {cfg.ep}, expert TP {cfg.etp} (TP {cfg.tp}) with "
                              "the dp_reshardable distributed-optimizer format is not supported yet (EP 1 with the "
                              "experts split as the dense layers is; save with --dist-ckpt-optim-fully-reshardable)")
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
    """Map ``optimizer.distributed.dp_group_idx_I...bucket_idx_B.{param,exp_avg,exp_avg_sq}`` onto params.

    ``I`` is the rank in the model-parallel group (tp + TP * pp); each bucket tensor is the
    coalesced buffer of that bucket (see ``_optim.buffer_layout``). MoE at EP 1: the experts are ordinary
    parameters of the one grad buffer (``allreduce`` is False only at EP > 1); router buffers hold no state."""
    names = [n for n in raw.pieces if not is_buffer(n)]
    shapes = {n: raw.pieces[n]["model"][0].shape for n in names}
    buckets: dict[tuple[int, int, int], dict[str, str]] = {}
    for key in meta.tensors:
        m = _BUCKET_RE.match(key)
        if m:
            idx, gbuf, _, b, kind = m.groups()
            if int(gbuf) != 0:
                raise FormatError(f"{meta.path}: several grad buffers per rank are not supported yet")
            buckets.setdefault((int(idx), int(b), 0), {})[kind] = key
    groups: list[Any] = []
    step = None
    per_rank: dict[tuple[int, int], dict[str, dict[str, TensorState]]] = {}
    for mp_idx in sorted({k[0] for k in buckets}):
        tp, pp = mp_idx % cfg.tp, mp_idx // cfg.tp
        params = [(n, shp) for n, shp, _ in local_params(cfg, raw.args, names, shapes, tp, pp)]
        num = sum(_numel(s) for _, s in params)
        shared = ("embedding.word_embeddings.weight", "output_layer.weight") if cfg.tied and cfg.pp > 1 else ()
        bucket = ddp_bucket_size(raw.args, pp, 0, num)
        slots, sizes = buffer_layout(params, bucket, shared)
        objkey = f"optimizer.distributed.dp_group_idx_{mp_idx}.optimizer/shard_0_1"
        if objkey in meta.objects:
            obj = object_archive(meta, objkey)[0]
            pg = (obj[0] if isinstance(obj, list) else obj).get("param_groups") or []
            groups = groups or pg
            step = next((g["step"] for g in pg if "step" in g), step)
        for b, size in enumerate(sizes):
            keys = buckets.get((mp_idx, b, 0))
            if keys is None:
                raise FormatError(f"{meta.path}: bucket {b} of model-parallel rank {mp_idx} is missing")
            for kind, state in (("param", "fp32_master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                t = meta.tensors[keys[kind]]
                if t.size != (size,):
                    raise FormatError(
                        f"{meta.path}: {keys[kind]} has {t.size[0]} elements, Megatron's buffer layout for "
                        f"TP rank {tp} PP rank {pp} gives {size}; unknown megatron-core version?"
                    )
                flat = TensorState(t.dtype, t.size, tuple(chunk_fragment(t, c) for c in t.chunks))
                for s in slots:
                    if s.bucket != b:
                        continue
                    n = _numel(s.shape)
                    piece = crop(flat, Box((s.bucket_start,), (n,)))
                    per_rank.setdefault((tp, pp), {}).setdefault(s.name, {})[state] = _reshape(piece, s.shape)
    fp16 = cfg.bf16 or cfg.fp16
    gathered: dict[str, dict[str, dict[int, TensorState]]] = {}
    for (tp, _pp), by_name in per_rank.items():
        for name, states in by_name.items():
            if name == "output_layer.weight" and cfg.tied:
                continue  # the last stage's copy of the tied embedding
            for state, piece in states.items():
                if state == "fp32_master" and not fp16:
                    continue  # fp32 run: the main param is the model weight
                gathered.setdefault(name, {}).setdefault(state, {})[tp] = piece
    for name, per_state in gathered.items():
        shape = raw.pieces[name]["model"][0].shape
        lay = tp_layout(name, cfg, len(shape))
        for state, parts in per_state.items():
            if sorted(parts) != list(range(cfg.tp)):
                raise FormatError(f"{meta.path}: optimizer state {state!r} of {name!r} lacks TP ranks")
            raw.pieces[name][state] = {0: consolidate(name, [parts[t] for t in range(cfg.tp)], lay, cfg)}
    return groups, step


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

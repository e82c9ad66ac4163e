"""Writing DCP directories that ``dcp.load`` reads onto any mesh (see the package docs)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from ckptbridge.adapters.torch import to_torch
from ckptbridge.plugin import (
    WEIGHT_STATES,
    Box,
    Checkpoint,
    TensorState,
    read_state,
    require,
    staged_dir,
)

from ._format import DcpWriteOptions
from ._reader import OPTIM_STATE


def _shard0_box(shape: tuple[int, ...], n: int, r: int) -> Box:
    """Rank ``r``'s box of ``shape`` cut along dim 0 into ``n`` like ``torch.chunk`` (DTensor ``Shard(0)``)."""
    if not shape:
        return Box((), ())
    full = shape[0]
    size = -(-full // n) if full else 0
    start = min(full, size * r)
    stop = min(full, start + size)
    return Box((start,) + (0,) * (len(shape) - 1), (stop - start, *shape[1:]))


def _param_groups(ckpt: Checkpoint, names: list[str]) -> list[dict[str, Any]]:
    """Optimizer hyper-parameter groups as ``get_optimizer_state_dict`` has them, from ``extra``
    (a DCP source's ``optim.param_groups``, ``ckptbridge.adapters.torch.save``'s
    ``optimizer.param_groups``, or a top-level ``param_groups``). A group without
    ``params`` gets every tensor with optimizer state when it is the only group;
    several groups without membership are not written (load them with
    ``ckptbridge.adapters.torch.load_optimizer`` instead)."""
    groups: Any = ckpt.extra.get("param_groups")  # e.g. the DeepSpeed reader's
    for key in ("optim", "optimizer"):
        node = ckpt.extra.get(key)
        if isinstance(node, Mapping) and node.get("param_groups"):
            groups = node["param_groups"]
            break
    if isinstance(groups, Mapping):  # nested from DCP keys: {"0": {...}, "1": {...}}
        groups = [groups[k] for k in sorted(groups, key=lambda k: int(k) if str(k).isdigit() else 0)]
    if not isinstance(groups, list) or not groups:
        return []
    out = []
    for g in groups:
        if not isinstance(g, Mapping):
            return []
        group = {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in g.items()}
        if "params" not in group:
            if len(groups) != 1:
                return []  # which parameter belongs to which group is unknown
            group["params"] = list(names)
        out.append(group)
    return out


def write(ckpt: Checkpoint, dst: str, options: DcpWriteOptions | None = None) -> str:
    """Write ``ckpt`` as a DCP directory at ``dst`` (see :class:`DcpWriteOptions`).

    Load it with ``dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=dst)``.
    """
    require("torch", "torch", "writing DCP checkpoints")
    o = options or DcpWriteOptions()
    world = o.world_size
    weight_state = o.state
    has_optim = any(s not in WEIGHT_STATES for t in ckpt.tensors.values() for s in t.states)
    with_optim = has_optim if o.optimizer is None else o.optimizer
    model_key = o.model_key if o.model_key is not None else ("model" if with_optim else "")
    optim_key = o.optim_key
    with staged_dir(os.fspath(dst), overwrite=o.overwrite) as stage:
        _write_dcp(ckpt, dst, stage, world, weight_state, with_optim, model_key, optim_key)
    return dst


def _write_dcp(ckpt: Checkpoint, dst: str, stage: str, world: int, weight_state: str | None, with_optim: bool,
               model_key: str, optim_key: str) -> None:
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )


    # (fqn, key path, state to read or a scalar value, logical tensor name)
    entries: list[tuple[str, tuple[Any, ...], Any, str]] = []
    for name, t in ckpt.tensors.items():
        ws = weight_state if weight_state is not None and weight_state in t.states else t.weight_state
        if ws in WEIGHT_STATES or not with_optim:
            path: tuple[Any, ...] = (model_key, name) if model_key else (name,)
            entries.append((".".join(path), path, t.states[ws], name))
        if not with_optim:
            continue
        for sname, st in t.states.items():
            if sname in WEIGHT_STATES:
                continue
            path = (optim_key, OPTIM_STATE, name, sname)
            entries.append((".".join(path), path, st, name))
        step = t.scalars.get("step", ckpt.step if any(s not in WEIGHT_STATES for s in t.states) else None)
        if step is not None:
            path = (optim_key, OPTIM_STATE, name, "step")
            entries.append((".".join(path), path, float(step), name))

    optim_names = [n for n, t in ckpt.tensors.items() if any(s not in WEIGHT_STATES for s in t.states)]
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    for r in range(world):
        rel = f"__{r}_0.distcp"
        with open(os.path.join(stage, rel), "wb") as fh:
            for fqn, path, src, name in entries:
                if isinstance(src, TensorState):
                    shape, dtype = src.shape, src.dtype
                    box = _shard0_box(shape, world, r)
                    # one rank writes 0-dim tensors; empty chunks only keep an empty tensor listed
                    keep = r == 0 if not shape or box.size == 0 else True
                    data = to_torch(read_state(src, box, ckpt.files, name=f"{ckpt.path}: {name}")) if keep else None
                else:
                    shape, dtype, box = (), "float32", Box((), ())
                    data = torch.tensor(src, dtype=torch.float32) if r == 0 else None
                if fqn not in sd_meta:
                    planner[fqn] = path
                    sd_meta[fqn] = TensorStorageMetadata(
                        TensorProperties(dtype=getattr(torch, dtype)), torch.Size(shape), [])
                if data is None:
                    continue
                idx = len(sd_meta[fqn].chunks)
                sd_meta[fqn].chunks.append(ChunkStorageMetadata(torch.Size(box.offset), torch.Size(box.shape)))
                start = fh.tell()
                torch.save(data.contiguous(), fh)
                storage[MetadataIndex(fqn, box.offset, idx)] = _StorageInfo(rel, start, fh.tell() - start)
                del data
            if r == 0 and with_optim:
                for i, group in enumerate(_param_groups(ckpt, optim_names)):
                    for key, value in group.items():
                        path = (optim_key, "param_groups", i, key)
                        fqn = ".".join(str(p) for p in path)
                        start = fh.tell()
                        torch.save(value, fh)
                        planner[fqn] = path
                        sd_meta[fqn] = BytesStorageMetadata()
                        storage[MetadataIndex(fqn)] = _StorageInfo(rel, start, fh.tell() - start)
            fh.flush()
            os.fsync(fh.fileno())
    meta = Metadata(sd_meta, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=dst, save_id=str(uuid.uuid4())),
                    version="1.0.0")
    with open(os.path.join(stage, ".metadata"), "wb") as fh:
        pickle.dump(meta, fh)
        fh.flush()
        os.fsync(fh.fileno())

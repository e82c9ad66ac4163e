"""Write Orbax ``StandardCheckpointer`` directories that Orbax restores onto any mesh."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    Checkpoint,
    FormatError,
    read_state,
    require,
    staged_dir,
)
from ckptbridge.plugin import dtypes as _dtypes

from ._format import CHECKPOINT_METADATA, PYTREE_METADATA, OrbaxWriteOptions
from ._reader import _chunk_boxes


def _write_spec(stage: str, param: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str,
                ocdbt: bool, zarr3: bool, compression: bool) -> dict[str, Any]:
    """TensorStore spec creating one array the way Orbax lays it out."""
    if ocdbt:
        kv: dict[str, Any] = {"driver": "ocdbt", "base": f"file://{stage}/", "path": f"{param}/",
                              "config": {"compression": {"id": "zstd"}}}
    else:
        kv = {"driver": "file", "path": os.path.join(stage, param) + "/"}
    if zarr3:
        codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if compression:
            codecs.append({"name": "zstd", "configuration": {"level": 3}})
        meta: dict[str, Any] = {
            "shape": list(shape), "data_type": dtype, "codecs": codecs,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        }
        driver = "zarr3"
    else:
        meta = {"shape": list(shape), "chunks": list(chunks), "dtype": _zarr2_dtype(dtype),
                "compressor": {"id": "zstd", "level": 1} if compression else None}
        driver = "zarr"
    return {"driver": driver, "kvstore": kv, "metadata": meta, "create": True, "open": True}


def _zarr2_dtype(dtype: str) -> str:
    if dtype == "bfloat16":
        return "bfloat16"
    return _dtypes.to_numpy(dtype).str


def _chunk_shape(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """Whole array if small; else split the leading dims so a chunk is at most ``chunk_bytes``."""
    chunks = list(shape)
    d = 0
    while d < len(chunks) and int(np.prod(chunks, dtype=np.int64)) * itemsize > chunk_bytes:
        rest = int(np.prod(chunks[d + 1 :], dtype=np.int64)) * itemsize
        chunks[d] = max(1, chunk_bytes // max(rest, 1))
        if chunks[d] > 1 or rest <= chunk_bytes:
            break
        d += 1
    return tuple(max(1, c) for c in chunks)


def _nest(flat: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        keys = name.split(sep)
        node = out
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise FormatError(f"cannot nest {name!r}: {k!r} is both a tensor and a subtree")
            node = child
        if keys[-1] in node:
            raise FormatError(f"cannot nest {name!r}: the name is also a subtree")
        node[keys[-1]] = value
    return out


def _flat_leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out.extend(_flat_leaves(v, (*prefix, k)))
        else:
            out.append(((*prefix, k), v))
    return out


def write(ckpt: Checkpoint, dst: str, options: OrbaxWriteOptions | None = None) -> str:
    """Write ``ckpt`` as an Orbax ``StandardCheckpointer`` directory at ``dst`` (see
    :class:`OrbaxWriteOptions`); built in a staging directory and published when complete."""
    o = options or OrbaxWriteOptions()
    dst = os.path.abspath(os.fspath(dst))
    with staged_dir(dst, overwrite=o.overwrite) as stage:
        _write(ckpt, dst, stage, o)
    return dst


def _write(ckpt: Checkpoint, dst: str, stage: str, o: OrbaxWriteOptions) -> None:
    ts = require("tensorstore", "jax", "Orbax checkpoints")


    layout, state, compression, ocdbt, zarr3 = o.layout, o.state, o.compression, o.ocdbt, o.zarr3
    chunk_bytes = o.chunk_bytes
    weights: dict[str, tuple[str, str]] = {}
    mu: dict[str, tuple[str, str]] = {}
    nu: dict[str, tuple[str, str]] = {}
    counts: list[int] = []
    for name, t in ckpt.index.tensors.items():
        weights[name] = (name, state if state is not None and state in t.states else t.weight_state)
        if "exp_avg" in t.states and "exp_avg_sq" in t.states:
            mu[name] = (name, "exp_avg")
            nu[name] = (name, "exp_avg_sq")
            if "step" in t.scalars:
                counts.append(int(t.scalars["step"]))
    if layout == "flat":
        tree: dict[str, Any] = _nest(weights)
    elif layout == "train_state":
        tree = {"params": _nest(weights)}
        if mu:
            tree["opt_state"] = {"count": np.asarray(max(counts) if counts else 0, np.int32),
                                 "mu": _nest(mu), "nu": _nest(nu)}
        if ckpt.step is not None:
            tree["step"] = np.asarray(int(ckpt.step), np.int64)
    by_path: dict[tuple[str, ...], Any] = dict(_flat_leaves(tree))

    ctx = ts.Context({"file_io_concurrency": {"limit": 64}, "cache_pool": {"total_bytes_limit": 0}})
    tree_meta: dict[str, Any] = {}
    array_metas = []
    for keys, leaf in by_path.items():
        param = ".".join(keys)
        if isinstance(leaf, tuple):
            tname, sname = leaf
            src = ckpt.index.tensors[tname].state(sname)
            shape, dtype = src.shape, src.dtype
        else:
            arr = np.asarray(leaf)
            src, shape, dtype = None, arr.shape, _dtypes.name_of(arr.dtype)
        chunks = _chunk_shape(shape, _dtypes.itemsize(dtype), chunk_bytes) if shape else ()
        store = ts.open(_write_spec(stage, param, shape, chunks, dtype, ocdbt, zarr3, compression),
                        context=ctx).result()
        pending = []
        for box in _chunk_boxes(shape, chunks) if shape else [Box((), ())]:
            data = read_state(src, box, ckpt.files) if src is not None else arr
            pending.append(store[box.slices()].write(data) if shape else store.write(data))
            if len(pending) >= 4:
                pending.pop(0).result()
        for fut in pending:
            fut.result()
        vtype = "jax.Array" if src is not None else "np.ndarray"
        tree_meta[str(tuple(keys))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in keys],
            "value_metadata": {"value_type": vtype, "skip_deserialize": False, "write_shape": list(chunks)},
        }
        array_metas.append({"array_metadata": {"param_name": param, "write_shape": list(chunks),
                                               "chunk_shape": list(chunks), "ext_metadata": None}})
    now = time.time_ns()
    meta = {"tree_metadata": tree_meta, "use_ocdbt": ocdbt, "use_zarr3": zarr3,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    with open(os.path.join(stage, PYTREE_METADATA), "w") as fh:
        json.dump(meta, fh)
    os.makedirs(os.path.join(stage, "array_metadatas"), exist_ok=True)
    with open(os.path.join(stage, "array_metadatas", "process_0"), "w") as fh:
        json.dump({"array_metadatas": array_metas}, fh)
    with open(os.path.join(stage, CHECKPOINT_METADATA), "w") as fh:
        json.dump({"item_handlers": "orbax.checkpoint._src.handlers.standard_checkpoint_handler."
                   "StandardCheckpointHandler", "metrics": {}, "performance_metrics": {},
                   "init_timestamp_nsecs": now, "commit_timestamp_nsecs": time.time_ns(),
                   "custom_metadata": {"writer": "ckptbridge", "source_format": ckpt.format}}, fh)
    with open(os.path.join(stage, "commit_success.txt"), "w") as fh:
        fh.write(f"Checkpoint commit was successful to {dst}")

"""Index Orbax checkpoints (PyTree items, CheckpointManager steps and roots) in place."""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    CheckpointError,
    CheckpointIndex,
    FileCache,
    FormatError,
    Fragment,
    LogicalTensor,
    MissingShardError,
    TensorState,
    read_state,
    require,
    storage,
    weight_state_for,
)
from ckptbridge.plugin import dtypes as _dtypes

from ..flax import group_train_state
from ._direct import ocdbt_values, raw_fragments
from ._format import (
    OCDBT_MANIFEST,
    PYTREE_METADATA,
    _is_item_dir,
    _is_step_dir,
    _item_dirs,
    _step_number,
    _steps,
)
from ._kvstore import kvstore
from ._tensorstore import OCDBT_CACHE, TensorStoreRegion

STRINGS = "_strings.json"
MAX_FRAGMENTS = 1024  # more chunks than this: one fragment for the whole array
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


# ------------------------------------------------------------------ reading one PyTree item


def _read_json(path: str) -> Any:
    try:
        return json.loads(storage.read_text(path))
    except FileNotFoundError:
        raise MissingShardError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise FormatError(f"{path}: not valid JSON ({err})") from None


def _tree_entries(item: str) -> tuple[list[tuple[tuple[str, ...], str, bool]], dict[str, Any]]:
    """(key path, value type, skip) per leaf from ``_METADATA``, and its top-level options."""
    meta_path = storage.join(item, PYTREE_METADATA)
    if not storage.exists(meta_path):
        return _listed_entries(item), {}
    meta = _read_json(meta_path)
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise FormatError(f"{meta_path}: no tree_metadata (not an Orbax PyTree checkpoint, or a very old one)")
    out = []
    for key, entry in tree.items():
        try:
            keys = tuple(str(k["key"]) for k in entry["key_metadata"])
            value = entry.get("value_metadata") or {}
        except (KeyError, TypeError):
            try:
                keys = tuple(str(k) for k in ast.literal_eval(key))
            except (ValueError, SyntaxError):
                raise FormatError(f"{meta_path}: malformed tree entry {key!r}") from None
            value = entry if isinstance(entry, dict) else {}
        out.append((keys, str(value.get("value_type", "jax.Array")), bool(value.get("skip_deserialize", False))))
    return out, meta


def _listed_entries(item: str) -> list[tuple[tuple[str, ...], str, bool]]:
    """Arrays of an item without ``_METADATA`` (old Orbax): every Zarr array found, named by
    its parameter name split on ``.`` (Orbax joins key paths with ``.``)."""
    params: list[str] = []
    if storage.isfile(storage.join(item, OCDBT_MANIFEST)):
        ts = require("tensorstore", "jax", "Orbax checkpoints")

        kv = ts.KvStore.open({"driver": "ocdbt", "base": kvstore(item)}).result()
        for key in kv.list().result():
            k = key.decode(errors="replace")
            for suffix in ("/.zarray", "/zarr.json"):
                if k.endswith(suffix):
                    params.append(k[: -len(suffix)])
    else:
        for name in sorted(storage.listdir(item)):
            if any(storage.isfile(storage.join(item, name, m)) for m in (".zarray", "zarr.json")):
                params.append(name)
    if not params:
        raise FormatError(f"{item}: no {PYTREE_METADATA} and no Zarr arrays (not an Orbax PyTree checkpoint)")
    return [(tuple(p.split(".")), "jax.Array", False) for p in sorted(params)]


def _zarr_dtype(meta: Mapping[str, Any], where: str) -> str:
    raw = meta.get("data_type", meta.get("dtype"))
    if isinstance(raw, str):
        for conv in (lambda r: r, np.dtype):
            try:
                return _dtypes.name_of(conv(raw))
            except (TypeError, FormatError):
                continue
    raise FormatError(f"{where}: unsupported Zarr dtype {raw!r}")


def _zarr_chunks(meta: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, ...]:
    if "chunks" in meta:  # zarr v2
        return tuple(int(c) for c in meta["chunks"])
    grid = meta.get("chunk_grid") or {}
    cfg = grid.get("configuration") or {}
    if "chunk_shape" in cfg:
        return tuple(int(c) for c in cfg["chunk_shape"])
    return shape


def _chunk_boxes(shape: tuple[int, ...], chunks: tuple[int, ...]) -> list[Box]:
    if not shape or len(chunks) != len(shape) or any(c <= 0 for c in chunks):
        return [Box.full(shape)]
    counts = [-(-s // c) if s else 1 for s, c in zip(shape, chunks, strict=True)]
    if int(np.prod(counts)) > MAX_FRAGMENTS:
        return [Box.full(shape)]
    boxes = []
    for idx in np.ndindex(*counts):
        off = tuple(i * c for i, c in zip(idx, chunks, strict=True))
        boxes.append(Box(off, tuple(min(c, s - o) for c, s, o in zip(chunks, shape, off, strict=True))))
    return boxes


class _ItemReader:
    """Metadata of the arrays of one PyTree item directory."""

    def __init__(self, item: str) -> None:
        self.item = storage.abspath(item)
        self.ocdbt = storage.isfile(storage.join(self.item, OCDBT_MANIFEST))
        self._kv: Any = None
        self._keys: set[str] | None = None
        self._values: Any = False  # OCDBT value locations, read on first need (None: not walkable)

    def _kvstore(self) -> Any:
        ts = require("tensorstore", "jax", "Orbax checkpoints")

        if self._kv is None:
            self._kv = ts.KvStore.open({"driver": "ocdbt", "base": kvstore(self.item)}).result()
        return self._kv

    def kv_spec(self, param: str) -> dict[str, Any]:
        if self.ocdbt:
            return {"driver": "ocdbt", "base": kvstore(self.item), "path": f"{param}/", "cache_pool": OCDBT_CACHE}
        return kvstore(storage.join(self.item, param))

    def zarr_meta(self, param: str) -> tuple[dict[str, Any], str]:
        """(Zarr metadata, driver) of array ``param``."""
        for key, driver in ((".zarray", "zarr"), ("zarr.json", "zarr3")):
            if self.ocdbt:
                got = self._kvstore().read(f"{param}/{key}".encode()).result()
                raw = got.value if got.state == "value" else None
            else:
                p = storage.join(self.item, param, key)
                raw = storage.read_bytes(p) if storage.isfile(p) else None
            if raw is not None:
                try:
                    return json.loads(raw), driver
                except ValueError:
                    raise FormatError(f"{self.item}: array {param!r} has unreadable {key}") from None
        raise MissingShardError(
            f"{self.item}: array {param!r} is listed in {PYTREE_METADATA} but has no Zarr metadata "
            "(an incomplete copy? copy checkpoints whole)"
        )

    def state(self, name: str, param: str) -> TensorState:
        meta, driver = self.zarr_meta(param)
        where = f"{self.item}: array {param!r}"
        try:
            shape = tuple(int(s) for s in meta["shape"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{where}: Zarr metadata without a shape") from None
        dtype = _zarr_dtype(meta, where)
        chunks = _zarr_chunks(meta, shape)
        boxes = _chunk_boxes(shape, chunks)
        if len(boxes) > 1 or boxes[0].shape == chunks:  # uncompressed chunks: straight from the files
            raw = raw_fragments(self.item, param, meta, driver, shape, dtype, chunks, self._ocdbt_values)
            if raw is not None:
                return TensorState(dtype, shape, raw)
        spec = {"driver": driver, "kvstore": self.kv_spec(param),
                "recheck_cached_data": False, "recheck_cached_metadata": False}
        whole = TensorStoreRegion.whole(spec, dtype, shape, f"{self.item}/{param}")
        frags = []
        for box in boxes:
            loc = whole if box.shape == shape else whole.narrow(box)
            frags.append(Fragment(box, loc))
        return TensorState(dtype, shape, tuple(frags))

    def _ocdbt_values(self) -> Any:
        if not self.ocdbt:
            return None
        if self._values is False:
            self._values = ocdbt_values(self.item)
        return self._values if self._values is not None else {}


def _read_item(item: str, prefix: str) -> tuple[dict[str, TensorState], dict[str, Any], dict[str, Any]]:
    """Raw tensors (``/``-joined key paths) of one PyTree item, its non-array values and options."""
    entries, meta = _tree_entries(item)
    reader = _ItemReader(item)
    tensors: dict[str, TensorState] = {}
    other: dict[str, Any] = {}
    strings = None
    for keys, vtype, skip in entries:
        name = prefix + "/".join(keys)
        param = ".".join(keys)
        if skip:
            continue
        if vtype in _ARRAY_TYPES:
            tensors[name] = reader.state(name, param)
        elif vtype == "string":
            if strings is None:
                sp = storage.join(item, STRINGS)
                strings = _read_json(sp) if storage.exists(sp) else {}
            other[name] = strings.get(param)
    opts: dict[str, Any] = {k: meta.get(k) for k in ("use_ocdbt", "use_zarr3") if k in meta}
    layout = _saved_shardings(item, prefix, {".".join(k): "/".join(k) for k, _, _ in entries})
    if layout:
        opts["layout"] = layout
    return tensors, other, opts


def _saved_shardings(item: str, prefix: str, names: Mapping[str, str]) -> dict[str, Any]:
    """The mesh and PartitionSpec each array was saved with (Orbax's ``_sharding`` file), for inspection."""
    import base64

    path = storage.join(item, "_sharding")
    if not storage.isfile(path) or storage.getsize(path) > (64 << 20):
        return {}
    try:
        data = _read_json(path)
        out = {}
        for key, value in data.items():
            param = base64.urlsafe_b64decode(key.encode()).decode()
            info = json.loads(value) if isinstance(value, str) else value
            entry: dict[str, Any] = {"sharding": info.get("sharding_type")}
            if "shape" in info and "axis_names" in info:
                entry["mesh"] = dict(zip(info["axis_names"], info["shape"], strict=False))
                entry["spec"] = info.get("partition_spec")
            out[prefix + names.get(param, param.replace(".", "/"))] = entry
        return out
    except (FormatError, MissingShardError, ValueError, TypeError, AttributeError):
        return {}  # inspection detail only: never fail the open over it


# ------------------------------------------------------------------ index


def _resolve(path: str, step: int | None) -> tuple[str, int | None]:
    """The step directory (or item directory) to read, and its step number."""
    if _is_item_dir(path) or _is_step_dir(path):
        if step is not None:
            raise FormatError(f"{path}: step={step} given, but this is a single checkpoint, not a manager root")
        return path, _step_number(storage.basename(path))
    steps = _steps(path)
    if not steps:
        raise FormatError(f"{path}: not an Orbax checkpoint (no {PYTREE_METADATA}, no step directories)")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise MissingShardError(f"{path}: no step {step}; steps present: {sorted(steps)}")
    return steps[step], step


def index(path: str, step: int | None = None, layout: str = "auto") -> CheckpointIndex:
    """Open an Orbax checkpoint (metadata only); see :func:`_index`.

    TensorStore reports damaged files (OCDBT manifests, b-tree nodes, Zarr
    metadata) as ``ValueError``/``RuntimeError``; they become ``FormatError``
    naming the checkpoint.
    """
    try:
        return _index(path, step, layout)
    except CheckpointError:
        raise
    except (ValueError, RuntimeError, TypeError, KeyError, IndexError, OverflowError) as err:
        raise FormatError(f"{os.fspath(path)}: damaged Orbax checkpoint ({type(err).__name__}: {err})") from None


def _index(path: str, step: int | None = None, layout: str = "auto") -> CheckpointIndex:
    """Open an Orbax checkpoint (metadata only).

    ``step`` picks a step of a CheckpointManager root (default: the latest);
    ``layout="raw"`` keeps Orbax's tree names, ``"auto"`` groups a Flax/optax
    train state onto the universal states (see :mod:`ckptbridge.adapters.flax`).
    """
    path = os.fspath(path)
    target, step_no = _resolve(path, None if step is None else int(step))
    items = [""] if _is_item_dir(target) else _item_dirs(target)
    raw: dict[str, TensorState] = {}
    extra: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for item in items:
        item_dir = storage.join(target, item) if item else target
        prefix = "" if len(items) == 1 else f"{item}/"
        item_tensors, other, opts = _read_item(item_dir, prefix)
        raw.update(item_tensors)
        extra.update(other)
        options[item or "."] = opts
    for name in sorted(storage.listdir(target)) if not _is_item_dir(target) else ():
        full = storage.join(target, name)
        if name not in items and storage.isdir(full):  # JSON items (metrics, config ...)
            for fn in sorted(storage.listdir(full)):
                fp = storage.join(full, fn)
                if fn != "commit_success.txt" and storage.isfile(fp) and storage.getsize(fp) < (1 << 20):
                    try:
                        extra.setdefault(name, {})[fn] = _read_json(fp)
                    except (FormatError, MissingShardError):
                        pass
    step_leaf = raw.get("step")
    if step_leaf is not None and not step_leaf.shape and step_leaf.dtype.startswith(("int", "uint")):
        if step_no is None:
            with FileCache() as fc:  # a train state's own step counter
                step_no = int(read_state(step_leaf, None, fc).reshape(()))
        if layout == "auto":  # the checkpoint's step, not a tensor of the model (layout="raw" keeps it)
            del raw["step"]
    rules: list[dict[str, Any]] = []
    if layout == "auto":
        tensors, rules = group_train_state(raw)
    elif layout == "raw":
        tensors = {n: LogicalTensor(n, {weight_state_for(s.dtype): s}) for n, s in raw.items()}
    else:
        raise FormatError(f"{path}: unknown layout {layout!r} (use 'auto' or 'raw')")
    return CheckpointIndex(
        "orbax", path, tensors, step_no, extra, tuple(rules),
        {"source_format": "orbax", "directory": target, "items": items, "options": options},
    )



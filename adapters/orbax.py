"""Orbax: open Orbax checkpoints as a lazy universal view, and write Orbax checkpoints.

Reading (``detect`` / ``index``) understands what ``orbax.checkpoint`` writes:

* a PyTree item directory (``StandardCheckpointer`` / ``PyTreeCheckpointer``):
  ``_METADATA`` (the tree: key paths and value types), the arrays in Zarr
  (v2 ``.zarray`` or v3 ``zarr.json``), either inside one OCDBT database
  (``manifest.ocdbt``, the default) or as plain per-array directories;
* a ``CheckpointManager`` step directory (``<step>/<item>/``, each item a
  PyTree directory; JSON items go into ``extra``) and the manager's root
  directory (the latest finished step, or ``step=N``).

Every array is a logical tensor named by its key path joined with ``/``;
its fragments are the Zarr write chunks (the shards the saving mesh wrote).
Bytes are read through TensorStore by :class:`TensorStoreRegion`, which asks
TensorStore for exactly the requested box (a compressed chunk is decoded
whole by TensorStore, never more than the chunks the box touches).
A Flax/optax train state (``params`` + ``ScaleByAdamState`` ``mu``/``nu``/
``count``) is grouped onto the universal states (``fp32``, ``exp_avg``,
``exp_avg_sq``, scalar ``step``) by :mod:`ckptbridge.adapters.flax`
(``layout="raw"`` keeps Orbax's own tree names)::

    ckpt = ckptbridge.open("ckpts/1000/state")        # or the manager root
    ckpt["Dense_0/kernel"].state("exp_avg")[:, :8]

Writing (:func:`write`, registered as ``reshard --to orbax``) produces a
``StandardCheckpointer`` directory (OCDBT + Zarr, streamed chunk by chunk)
that ``orbax.checkpoint`` restores onto any mesh::

    ckptbridge.reshard("run/global_step3", "out/orbax", to="orbax")
    ocp.StandardCheckpointer().restore("out/orbax", abstract_target)

Tree written: ``{"params": weights, "opt_state": {"count", "mu", "nu"}, "step"}``
(optimizer part only when Adam moments exist); ``-o layout=flat`` writes
just the weights. Names are split on ``/`` into nested dicts.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes
from .._checkpoint import Checkpoint, CheckpointIndex
from .._errors import CheckpointError, FormatError, MissingShardError
from .._model import Box, Fragment, LogicalTensor, TensorState

PYTREE_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
STRINGS = "_strings.json"
MAX_FRAGMENTS = 1024  # more chunks than this: one fragment for the whole array
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
_TMP_MARK = ".orbax-checkpoint-tmp"


# ------------------------------------------------------------------ TensorStore location


_STORES: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def _context() -> Any:
    import tensorstore as ts

    # decoded chunks are cached (LRU, 256 MiB) so that device boxes sharing a compressed
    # chunk decode it once; the B-tree of an OCDBT database likewise
    return ts.Context({"cache_pool": {"total_bytes_limit": 256 << 20},
                       "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
                       "file_io_concurrency": {"limit": 64}})


def _open_store(spec: str, files: Any) -> Any:
    """The TensorStore for ``spec`` (JSON text), opened once per FileCache."""
    import tensorstore as ts

    with _STORES_LOCK:
        stores = _STORES.setdefault(files, {})
        store = stores.get(spec)
        if store is None:
            ctx = stores.get("__context__")
            if ctx is None:
                ctx = stores["__context__"] = _context()
            try:
                store = ts.open(json.loads(spec), read=True, context=ctx).result()
            except ValueError as err:
                raise MissingShardError(f"cannot open Orbax array {spec}: {err}") from None
            stores[spec] = store
        return store


@functools.lru_cache(maxsize=4096)
def _parse_transform(text: str) -> Any:
    import tensorstore as ts

    return ts.IndexTransform(json=json.loads(text))


@dataclass(frozen=True)
class TensorStoreRegion:
    """A box of an array stored by TensorStore (Zarr v2/v3, OCDBT or plain files).

    ``spec`` is the TensorStore JSON spec of the whole stored array;
    ``transform`` is a TensorStore ``IndexTransform`` (JSON text) from this
    fragment's coordinates (domain ``[0, shape)``) to the stored array's;
    ``narrow``/``permute``/``insert_dim``/``drop_dim`` compose onto it, so
    transposed, stacked or cropped views still read only their box.
    """

    spec: str
    dtype: str
    transform: str
    label: str = ""

    @staticmethod
    def whole(spec: Mapping[str, Any], dtype: str, shape: Sequence[int], label: str = "") -> TensorStoreRegion:
        import tensorstore as ts

        tr = ts.IndexTransform(input_shape=[int(s) for s in shape])
        return TensorStoreRegion(json.dumps(spec, sort_keys=True), dtype, json.dumps(tr.to_json()), label)

    def _tr(self) -> Any:
        return _parse_transform(self.transform)

    def _with(self, tr: Any) -> TensorStoreRegion:
        import tensorstore as ts

        tr = tr[ts.d[:].translate_to[0]] if tr.input_rank else tr
        return TensorStoreRegion(self.spec, self.dtype, json.dumps(tr.to_json()), self.label)

    def read_into(self, box: Box, out: np.ndarray, files: Any) -> int:
        if box.size == 0:
            return 0
        try:
            store = _open_store(self.spec, files)
            view = store[self._tr()]
            if box.ndim:
                view = view[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape, strict=True))]
            data = view.read().result()
        except CheckpointError:
            raise
        except (ValueError, RuntimeError, IndexError, TypeError) as err:  # TensorStore's damage reports
            raise FormatError(f"{self.label or self.spec}: read failed ({err})") from None
        np.copyto(out, np.asarray(data).reshape(box.shape), casting="unsafe")
        nbytes = box.size * _dtypes.itemsize(self.dtype)
        files.stats.add(self.label or self.spec, nbytes)
        return nbytes

    def describe(self) -> str:
        return self.label or self.spec

    def narrow(self, box: Box) -> TensorStoreRegion:
        tr = self._tr()
        if not box.ndim:
            return self
        return self._with(tr[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape, strict=True))])

    def permute(self, perm: Sequence[int]) -> TensorStoreRegion:
        import tensorstore as ts

        if not perm:
            return self
        return self._with(self._tr()[ts.d[tuple(int(p) for p in perm)].transpose[:]])

    def insert_dim(self, dim: int) -> TensorStoreRegion:
        import tensorstore as ts

        tr = self._tr()
        return self._with(tr[(slice(None),) * dim + (ts.newaxis, ...)])

    def drop_dim(self, dim: int) -> TensorStoreRegion:
        tr = self._tr()
        return self._with(tr[(slice(None),) * dim + (0, ...)])


# ------------------------------------------------------------------ layout detection


def _is_item_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, PYTREE_METADATA)):
        return True
    if os.path.exists(os.path.join(path, "manifest.json")):
        return False
    if os.path.isfile(os.path.join(path, OCDBT_MANIFEST)):
        return True
    try:  # an old Orbax item without _METADATA: per-array Zarr directories
        names = sorted(os.listdir(path))[:256]
    except OSError:
        return False
    return any(os.path.isfile(os.path.join(path, n, m)) for n in names for m in (".zarray", "zarr.json"))


def _item_dirs(step_dir: str) -> list[str]:
    try:
        names = sorted(os.listdir(step_dir))
    except OSError:
        return []
    return [n for n in names if not n.startswith(".") and _is_item_dir(os.path.join(step_dir, n))]


def _is_step_dir(path: str) -> bool:
    """A CheckpointManager step directory: item directories inside, and ``_CHECKPOINT_METADATA``
    or (Orbax before 0.4.3 wrote none) a step number as its name."""
    named = os.path.isfile(os.path.join(path, CHECKPOINT_METADATA)) or \
        _step_number(os.path.basename(os.path.normpath(path))) is not None
    return named and bool(_item_dirs(path))


def _step_number(name: str) -> int | None:
    m = re.fullmatch(r"(?:.*?_)?(\d+)", name)
    return int(m.group(1)) if m and _TMP_MARK not in name else None


def _steps(root: str) -> dict[int, str]:
    out = {}
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    for n in names:
        step = _step_number(n)
        full = os.path.join(root, n)
        if step is not None and os.path.isdir(full) and (
            os.path.isfile(os.path.join(full, CHECKPOINT_METADATA)) or _is_item_dir(full) or _item_dirs(full)
        ):
            out[step] = full
    return out


def detect(path: str) -> bool:
    """True for an Orbax PyTree directory, a CheckpointManager step directory or its root."""
    try:
        if not os.path.isdir(path):
            return False
        if os.path.exists(os.path.join(path, "manifest.json")) or os.path.exists(os.path.join(path, ".metadata")):
            return False  # universal / DCP
        if _is_item_dir(path):
            return True
        if _is_step_dir(path):
            return True
        return bool(_steps(path))
    except OSError:
        return False


# ------------------------------------------------------------------ reading one PyTree item


def _read_json(path: str) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise MissingShardError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise FormatError(f"{path}: not valid JSON ({err})") from None


def _tree_entries(item: str) -> tuple[list[tuple[tuple[str, ...], str, bool]], dict[str, Any]]:
    """(key path, value type, skip) per leaf from ``_METADATA``, and its top-level options."""
    meta_path = os.path.join(item, PYTREE_METADATA)
    if not os.path.exists(meta_path):
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
    if os.path.isfile(os.path.join(item, OCDBT_MANIFEST)):
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(item)}/"}).result()
        for key in kv.list().result():
            k = key.decode(errors="replace")
            for suffix in ("/.zarray", "/zarr.json"):
                if k.endswith(suffix):
                    params.append(k[: -len(suffix)])
    else:
        for name in sorted(os.listdir(item)):
            if any(os.path.isfile(os.path.join(item, name, m)) for m in (".zarray", "zarr.json")):
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
        self.item = os.path.abspath(item)
        self.ocdbt = os.path.isfile(os.path.join(self.item, OCDBT_MANIFEST))
        self._kv: Any = None
        self._keys: set[str] | None = None

    def _kvstore(self) -> Any:
        import tensorstore as ts

        if self._kv is None:
            self._kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{self.item}/"}).result()
        return self._kv

    def kv_spec(self, param: str) -> dict[str, Any]:
        if self.ocdbt:
            return {"driver": "ocdbt", "base": f"file://{self.item}/", "path": f"{param}/"}
        return {"driver": "file", "path": os.path.join(self.item, param) + "/"}

    def zarr_meta(self, param: str) -> tuple[dict[str, Any], str]:
        """(Zarr metadata, driver) of array ``param``."""
        for key, driver in ((".zarray", "zarr"), ("zarr.json", "zarr3")):
            if self.ocdbt:
                got = self._kvstore().read(f"{param}/{key}".encode()).result()
                raw = got.value if got.state == "value" else None
            else:
                p = os.path.join(self.item, param, key)
                raw = open(p, "rb").read() if os.path.isfile(p) else None  # noqa: SIM115
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
        spec = {"driver": driver, "kvstore": self.kv_spec(param),
                "recheck_cached_data": False, "recheck_cached_metadata": False}
        whole = TensorStoreRegion.whole(spec, dtype, shape, f"{self.item}/{param}")
        frags = []
        for box in _chunk_boxes(shape, _zarr_chunks(meta, shape)):
            loc = whole if box.shape == shape else whole.narrow(box)
            frags.append(Fragment(box, loc))
        return TensorState(dtype, shape, tuple(frags))


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
                sp = os.path.join(item, STRINGS)
                strings = _read_json(sp) if os.path.exists(sp) else {}
            other[name] = strings.get(param)
    opts = {k: meta.get(k) for k in ("use_ocdbt", "use_zarr3") if k in meta}
    layout = _saved_shardings(item, prefix, {".".join(k): "/".join(k) for k, _, _ in entries})
    if layout:
        opts["layout"] = layout
    return tensors, other, opts


def _saved_shardings(item: str, prefix: str, names: Mapping[str, str]) -> dict[str, Any]:
    """The mesh and PartitionSpec each array was saved with (Orbax's ``_sharding`` file), for inspection."""
    import base64

    path = os.path.join(item, "_sharding")
    if not os.path.isfile(path) or os.path.getsize(path) > (64 << 20):
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
        return path, _step_number(os.path.basename(os.path.normpath(path)))
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
        item_dir = os.path.join(target, item) if item else target
        prefix = "" if len(items) == 1 else f"{item}/"
        tensors, other, opts = _read_item(item_dir, prefix)
        raw.update(tensors)
        extra.update(other)
        options[item or "."] = opts
    for name in sorted(os.listdir(target)) if not _is_item_dir(target) else ():
        full = os.path.join(target, name)
        if name not in items and os.path.isdir(full):  # JSON items (metrics, config ...)
            for fn in sorted(os.listdir(full)):
                fp = os.path.join(full, fn)
                if fn != "commit_success.txt" and os.path.isfile(fp) and os.path.getsize(fp) < (1 << 20):
                    try:
                        extra.setdefault(name, {})[fn] = _read_json(fp)
                    except (FormatError, MissingShardError):
                        pass
    if step_no is None and "step" in raw and not raw["step"].shape and raw["step"].dtype.startswith(("int", "uint")):
        from .._read import FileCache, read_state

        with FileCache() as fc:  # a train state's own step counter
            step_no = int(read_state(raw["step"], None, fc).reshape(()))
    rules: list[dict[str, Any]] = []
    if layout == "auto":
        from . import flax as cbflax

        tensors, rules = cbflax.group_train_state(raw)
    elif layout == "raw":
        tensors = {n: LogicalTensor(n, {_weight_state(s.dtype): s}) for n, s in raw.items()}
    else:
        raise FormatError(f"{path}: unknown layout {layout!r} (use 'auto' or 'raw')")
    return CheckpointIndex(
        "orbax", path, tensors, step_no, extra, tuple(rules),
        {"source_format": "orbax", "directory": target, "items": items, "options": options},
    )


def _weight_state(dtype: str) -> str:
    return "param" if dtype in ("bfloat16", "float16") else "fp32"


# ------------------------------------------------------------------ writing


def _flag(value: Any) -> bool:
    return str(value).strip().lower() not in ("false", "0", "no", "none", "off", "")


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


def write(
    ckpt: Checkpoint,
    dst: str,
    *,
    layout: str = "train_state",
    state: str | None = None,
    compression: Any = True,
    ocdbt: Any = True,
    zarr3: Any = False,
    chunk_bytes: int = 64 << 20,
    overwrite: Any = False,
    **options: Any,
) -> str:
    """Write ``ckpt`` as an Orbax ``StandardCheckpointer`` directory at ``dst``.

    Defaults are Orbax's: one OCDBT database, Zarr v2 arrays, zstd
    (``ocdbt=false``, ``zarr3=true``, ``compression=false`` change that).
    Streams chunk by chunk (chunks of at most ``chunk_bytes``, a few in
    flight); writes into ``dst + ".partial"`` and renames when complete;
    refuses an existing ``dst`` unless ``overwrite``.
    ``layout="train_state"`` (default) writes ``{"params", "opt_state":
    {"count", "mu", "nu"}, "step"}`` (the optimizer part when Adam moments
    exist), ``layout="flat"`` only the weights, nested by ``/``; ``state``
    picks the weights' state (default ``fp32``, else ``param``).
    """
    import tensorstore as ts

    from .._read import read_state

    if options:
        raise FormatError(f"orbax writer: unknown options {sorted(options)} (known: layout, state, "
                          "compression, ocdbt, zarr3, chunk_bytes, overwrite)")
    compression, ocdbt, zarr3, overwrite = (_flag(v) for v in (compression, ocdbt, zarr3, overwrite))
    chunk_bytes = int(chunk_bytes)
    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"{dst}: already exists; choose a new destination (or overwrite=true)")
    stage = dst + ".partial"
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)

    # leaf name -> (tensor name, state) or a scalar value
    flat: dict[str, Any] = {}
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
    else:
        raise FormatError(f"orbax writer: unknown layout {layout!r} (use train_state or flat)")
    flat = dict(_flat_leaves(tree))

    ctx = ts.Context({"file_io_concurrency": {"limit": 64}, "cache_pool": {"total_bytes_limit": 0}})
    tree_meta: dict[str, Any] = {}
    array_metas = []
    try:
        for keys, leaf in flat.items():
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
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
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
    if os.path.exists(dst):
        old = f"{dst}.old-{now}"
        os.rename(dst, old)
        os.rename(stage, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(stage, dst)
    return dst

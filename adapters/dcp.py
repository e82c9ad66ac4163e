"""torch.distributed.checkpoint (DCP) directories: read in place, and write.

**Reading.** ``torch.distributed.checkpoint.save`` writes ``.metadata``
(a pickle: every tensor's global size and saved chunks, and where each chunk
is) and ``__<rank>_<n>.distcp`` files. With the default ``torch_save``
serialization every chunk is a complete ``torch.save`` archive appended to
the file, its storage bytes uncompressed inside; with ``safetensors``
serialization each file is a safetensors file. Either way a chunk becomes a
:class:`~ckptbridge._model.Fragment` pointing at its bytes in the
``.distcp`` file, so loading any box reads only that box. The metadata
pickle goes through the safe loader (see :mod:`ckptbridge.adapters._dcp_metadata`,
shared with the Megatron ``torch_dist`` reader).

Names: DCP flattens nested state dicts (``{"model": ..., "optim": ...}``)
into dotted keys and records each key's path (``planner_data``). The
weights become logical tensors named like the model's state dict (a leading
``model``/``module``/``state_dict`` container key is dropped, recorded as a
``Rename`` rule; ``prefix=""`` keeps full keys, ``prefix="net"`` drops
another one). Optimizer entries (``optim.state.<param>.<state>``, as
``get_optimizer_state_dict`` produces) become states of ``<param>``
(``exp_avg``, ``exp_avg_sq``, ...) and 0-dim entries such as Adam's
``step`` become scalars. Small non-tensor items (``param_groups``) land in
``extra``::

    ckpt = ckptbridge.open("dcp_ckpt")                # detected by .metadata
    ckpt["layers.0.w"].state("exp_avg")[:4]           # reads 4 rows from the .distcp
    ckpt["layers.0.w"].scalars                        # {"step": 10}

**Writing.** :func:`write` produces a DCP directory (``--to dcp``) that
``dcp.load`` reads onto any mesh: each tensor is saved as ``world_size``
chunks along dim 0, as a ``Shard(0)`` save on that many ranks would be::

    ckptbridge.reshard("run/global_step3", "out/dcp", to="dcp", world_size=4)
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ckptbridge import _dtypes
from ckptbridge._checkpoint import Checkpoint, CheckpointIndex
from ckptbridge._errors import FormatError, ShapeMismatchError, TruncatedError
from ckptbridge._model import (
    WEIGHT_STATES,
    Box,
    FileRegion,
    Fragment,
    LogicalTensor,
    TensorState,
    c_strides,
)
from ckptbridge._read import FileCache, read_state
from ckptbridge._rules import Rename, rules_to_json
from ckptbridge._torchzip import strip_tensors

from ._dcp_metadata import (
    DcpChunk,
    DcpMetadata,
    DcpTensor,
    chunk_fragment,
    is_dcp_dir,
    read_metadata,
    read_object,
)

# Keys under which people nest a model's state dict before dcp.save.
MODEL_KEYS = ("model", "module", "model_state_dict", "state_dict")
OPTIM_STATE = "state"
_MAX_BYTE_ITEM = 1 << 20


def detect(path: str) -> bool:
    """A directory with DCP's ``.metadata`` or per-rank ``__0.metadata`` (never raises)."""
    return is_dcp_dir(path)


# ------------------------------------------------------------------ reading


def _fragment(t: DcpTensor, chunk: DcpChunk, st_headers: dict[tuple[str, int], Any]) -> Fragment:
    """A chunk in place: inside its ``torch.save`` archive, or in a safetensors-serialized file."""
    with open(chunk.file, "rb") as fh:
        fh.seek(chunk.offset)
        magic = fh.read(4)
    if magic == b"PK\x03\x04":
        return chunk_fragment(t, chunk)
    key = (chunk.file, chunk.offset)
    if key not in st_headers:
        st_headers[key] = _safetensors_header(chunk.file, chunk.offset)
    header, base = st_headers[key]
    entry = header.get(t.fqn)
    if not isinstance(entry, Mapping):
        raise FormatError(f"{chunk.file}@{chunk.offset}: item {t.fqn!r} is neither a torch.save "
                          "archive nor a safetensors entry")
    try:
        dtype = _dtypes.from_safetensors(entry["dtype"])
        shape = tuple(int(s) for s in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{chunk.file}: malformed safetensors entry for {t.fqn!r} ({err})") from None
    if shape != chunk.sizes or dtype != t.dtype or end - begin != Box.full(shape).size * _dtypes.itemsize(dtype):
        raise ShapeMismatchError(f"{chunk.file}: item {t.fqn!r} is {shape} {dtype}, "
                                 f"metadata says {chunk.sizes} {t.dtype}")
    if base + end > os.path.getsize(chunk.file):
        raise TruncatedError(f"{chunk.file}: item {t.fqn!r} ends past the end of the file")
    return Fragment(Box(chunk.offsets, chunk.sizes), FileRegion(chunk.file, base + begin, dtype, c_strides(shape)))


def _byte_item(meta: DcpMetadata, fqn: str) -> Any:
    length = meta.objects[fqn][2]
    if length > _MAX_BYTE_ITEM:
        return f"<{length} bytes, not loaded>"
    try:
        return strip_tensors(read_object(meta, fqn))
    except FormatError as err:
        return f"<unreadable: {err}>"


def _safetensors_header(file: str, offset: int) -> tuple[dict[str, Any], int]:
    with open(file, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(offset)
        head = fh.read(8)
        if len(head) < 8:
            raise TruncatedError(f"{file}@{offset}: item cut off")
        (n,) = struct.unpack("<Q", head)
        if offset + 8 + n > size or n > (100 << 20):
            raise FormatError(f"{file}@{offset}: not a torch.save archive nor a safetensors header")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError):
            raise FormatError(f"{file}@{offset}: not a torch.save archive nor a safetensors header") from None
    if not isinstance(header, dict):
        raise FormatError(f"{file}@{offset}: safetensors header is not an object")
    return header, offset + 8 + n


def _key_paths(meta: DcpMetadata) -> dict[str, tuple[Any, ...]]:
    return {str(k): tuple(v) for k, v in meta.planner_data.items() if isinstance(v, (tuple, list)) and v}


def _key_path(paths: Mapping[str, tuple[Any, ...]], fqn: str) -> tuple[Any, ...]:
    return paths.get(fqn) or tuple(fqn.split("."))


def _optim_target(path: tuple[Any, ...]) -> tuple[str, str] | None:
    """``(..., "state", param, state_name)`` -> ``(param, state_name)``."""
    if len(path) >= 3 and path[-3] == OPTIM_STATE and isinstance(path[-1], str):
        return str(path[-2]), path[-1]
    return None


def _nest(tree: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    for p in path[:-1]:
        node = tree.setdefault(str(p), {})
        if not isinstance(node, dict):
            return
        tree = node
    tree[str(path[-1])] = value


def index(path: str, prefix: str | None = None, read_bytes: bool = True) -> CheckpointIndex:
    """Open a DCP directory as logical tensors (see the module docs for naming).

    ``prefix``: the state-dict container key to drop from weight names
    (default: auto among ``model``, ``module``, ``model_state_dict``,
    ``state_dict``; ``""`` keeps full keys). ``read_bytes``: load small
    non-tensor items (hyper-parameters) into ``extra``.
    """
    path = os.fspath(path)
    meta = read_metadata(path)
    paths = _key_paths(meta)
    st_headers: dict[tuple[str, int], Any] = {}
    states: dict[str, dict[str, TensorState]] = {}
    scalar_items: dict[str, dict[str, TensorState]] = {}
    stripped: set[str] = set()
    for fqn, tm in meta.tensors.items():
        key_path = _key_path(paths, fqn)
        frags: dict[tuple[int, ...], Fragment] = {}
        for chunk in tm.chunks:
            if len(chunk.offsets) != len(tm.size) or len(chunk.sizes) != len(tm.size):
                raise FormatError(f"{path}/.metadata: chunk of {fqn!r} has the wrong rank")
            if Box(chunk.offsets, chunk.sizes).size == 0 or chunk.offsets in frags:
                continue
            frags[chunk.offsets] = _fragment(tm, chunk, st_headers)
        try:
            state = TensorState(tm.dtype, tm.size, tuple(frags.values()))
        except ShapeMismatchError as err:
            raise ShapeMismatchError(f"{path}: tensor {fqn!r}: saved chunks do not tile it ({err})") from None
        target = _optim_target(key_path)
        if target is not None:
            name, sname = target
            if tm.size == ():
                scalar_items.setdefault(name, {})[sname] = state
            else:
                states.setdefault(name, {})[sname] = state
            continue
        name = fqn
        first = str(key_path[0])
        container = first in MODEL_KEYS if prefix is None else (first == prefix and prefix != "")
        if len(key_path) > 1 and container:
            name = ".".join(str(p) for p in key_path[1:])
            stripped.add(first)
        wstate = WEIGHT_STATES[0] if tm.dtype == "float32" else WEIGHT_STATES[1]
        if name in states and wstate in states[name]:
            raise FormatError(f"{path}: two entries map onto tensor {name!r}; pass prefix='' to keep full keys")
        states.setdefault(name, {})[wstate] = state

    scalars: dict[str, dict[str, float | int]] = {}
    with FileCache() as files:
        for name, sts in scalar_items.items():
            for sname, st in sts.items():
                value = read_state(st, None, files, name=f"{path}: {name}.{sname}").item()
                scalars.setdefault(name, {})[sname] = int(value) if float(value).is_integer() else value
    tensors: dict[str, LogicalTensor] = {}
    for name, sts in states.items():
        tensors[name] = LogicalTensor(name, sts, scalars.get(name, {}))
    for name, sc in scalars.items():
        if name not in tensors:  # a 0-dim state without tensor states: keep it visible
            tensors[name] = LogicalTensor(name, scalar_items[name], sc)
    steps = {sc.get("step") for sc in scalars.values() if "step" in sc}
    step = int(next(iter(steps))) if len(steps) == 1 else None

    extra: dict[str, Any] = {}
    if read_bytes:
        for fqn in meta.objects:
            _nest(extra, _key_path(paths, fqn), _byte_item(meta, fqn))
    if step is None and isinstance(extra.get("step"), int) and not isinstance(extra.get("step"), bool):
        step = extra["step"]  # a top-level ``"step": n`` next to the model, as many training loops save
    rules = tuple(rules_to_json([Rename(rf"^{k}\.(.*)$", r"\1") for k in sorted(stripped)]))
    return CheckpointIndex(
        "dcp", path, tensors, step, extra, rules,
        {"format": "torch.distributed.checkpoint", "version": meta.raw.fields.get("version"),
         "files": sorted({os.path.basename(c.file) for t in meta.tensors.values() for c in t.chunks})},
    )


# ------------------------------------------------------------------ writing


def _option_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


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


def write(ckpt: Checkpoint, dst: str, **options: Any) -> str:
    """Write ``ckpt`` as a DCP directory at ``dst`` (refuses an existing ``dst``).

    Options: ``world_size`` (or ``dp``; default 1): number of ``.distcp``
    files, each tensor cut along dim 0 into that many chunks;
    ``state``: which weight state to write (default fp32, else param);
    ``optimizer`` (default: when the checkpoint has optimizer states): also
    write them as ``get_optimizer_state_dict`` lays them out;
    ``model_key`` / ``optim_key``: container keys (defaults ``model`` /
    ``optim`` with optimizer states, the model's names at top level without).
    Load it with ``dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=dst)``.
    """
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

    from .torch import to_torch

    opts = dict(options)
    world = int(opts.pop("world_size", None) or opts.pop("dp", None) or 1)
    opts.pop("dp", None)
    weight_state = opts.pop("state", None)
    has_optim = any(s not in WEIGHT_STATES for t in ckpt.tensors.values() for s in t.states)
    with_optim = _option_bool(opts.pop("optimizer", has_optim))
    model_key = str(opts.pop("model_key", "model" if with_optim else ""))
    optim_key = str(opts.pop("optim_key", "optim"))
    overwrite = _option_bool(opts.pop("overwrite", False))
    # DCP has no tensor/pipeline-parallel layout of its own: tp = pp = 1 is the only meaningful value
    unknown = {k: v for k, v in opts.items() if v is not None and not (k in ("tp", "pp") and int(v) == 1)}
    if unknown:
        raise FormatError(f"dcp writer: unknown or unsupported options {sorted(unknown)}; it takes "
                          "world_size, state, optimizer, model_key, optim_key (a DCP checkpoint loads onto "
                          "any mesh, so no tp/pp/zero_stage)")
    if world < 1:
        raise FormatError(f"dcp writer: world_size must be >= 1, got {world}")
    dst = os.fspath(dst)
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"{dst}: already exists; choose a new destination")
    stage = dst + ".partial"
    if os.path.exists(stage):
        shutil.rmtree(stage)
    os.makedirs(stage)

    # (fqn, key path, state to read or a scalar value, logical tensor name)
    entries: list[tuple[str, tuple[Any, ...], Any, str]] = []
    for name, t in ckpt.tensors.items():
        ws = weight_state if weight_state in t.states else t.weight_state
        if ws in WEIGHT_STATES or not with_optim:
            path = (model_key, name) if model_key else (name,)
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
    try:
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
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.rename(stage, dst)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return dst

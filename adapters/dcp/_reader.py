"""Reading DCP directories in place (see the package docs)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from ckptbridge.adapters.torch_save import strip_tensors
from ckptbridge.plugin import (
    WEIGHT_STATES,
    Box,
    CheckpointIndex,
    FileCache,
    FileRegion,
    FormatError,
    Fragment,
    LogicalTensor,
    Rename,
    ShapeMismatchError,
    TensorState,
    TruncatedError,
    c_strides,
    read_state,
    rules_to_json,
    storage,
)
from ckptbridge.plugin import dtypes as _dtypes

from ._metadata import (
    DcpChunk,
    DcpMetadata,
    DcpTensor,
    chunk_fragment,
    read_metadata,
    read_object,
)

# Keys under which people nest a model's state dict before dcp.save.
MODEL_KEYS = ("model", "module", "model_state_dict", "state_dict")
OPTIM_STATE = "state"
_MAX_BYTE_ITEM = 1 << 20


# ------------------------------------------------------------------ reading


def _fragment(t: DcpTensor, chunk: DcpChunk, st_headers: dict[tuple[str, int], Any]) -> Fragment:
    """A chunk in place: inside its ``torch.save`` archive, or in a safetensors-serialized file."""
    magic = storage.read_bytes(chunk.file, chunk.offset, 4)
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
    if base + end > storage.getsize(chunk.file):
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
    with storage.open_read(file) as fh:
        size = storage.getsize(file)
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
    steps = {sc["step"] for sc in scalars.values() if sc.get("step") is not None}
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
         "files": sorted({storage.basename(c.file) for t in meta.tensors.values() for c in t.chunks})},
    )



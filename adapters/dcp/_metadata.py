"""torch.distributed.checkpoint (DCP) directories, read without torch and without running code.

A DCP directory (``FileSystemWriter``) holds ``.metadata`` (a pickle of
torch dataclasses: ``Metadata(state_dict_metadata, storage_data, ...)``) and
``__{rank}_{k}.distcp`` data files. ``state_dict_metadata`` maps each key to
``TensorStorageMetadata(properties, size, chunks)`` (global shape, one
``ChunkStorageMetadata(offsets, sizes)`` per saved box) or
``BytesStorageMetadata``; ``storage_data`` maps ``MetadataIndex(fqn, offset)``
to ``_StorageInfo(relative_path, offset, length)``. Each tensor item is itself
a small ``torch.save`` zip archive stored at that byte range (the default
``SerializationFormat.TORCH_SAVE``), so a chunk is found in place: parse the
embedded zip's headers, unpickle its ``data.pkl`` with the safe loader and
point a :class:`~ckptbridge._read.model.FileRegion` at its storage bytes::

    meta = read_metadata("ckpt/iter_0000005")
    t = meta.tensors["embedding.word_embeddings.weight"]
    state = tensor_state(meta, "embedding.word_embeddings.weight")   # zero copy
    obj = read_object(meta, "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1")

Generic (any DCP checkpoint, not only Megatron's), so the torch/DCP adapter can reuse it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptbridge.adapters.torch_save import Opaque, TensorRef, TorchArchive, TorchDtype, safe_loads
from ckptbridge.plugin import (
    Box,
    FileRegion,
    FormatError,
    Fragment,
    MissingShardError,
    TensorState,
    storage,
)
from ckptbridge.plugin import dtypes as _dtypes

_MAX_METADATA = 1 << 31


@dataclass(frozen=True)
class DcpChunk:
    """One saved box of a tensor and the byte range of its item in a data file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # absolute path
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpMetadata:
    """What a DCP ``.metadata`` says: tensors (with chunk locations) and byte objects."""

    path: str
    tensors: Mapping[str, DcpTensor]
    objects: Mapping[str, tuple[str, int, int]]  # fqn -> (file, offset, length)
    raw: Any  # the Opaque Metadata record (planner_data, storage_meta ...); rank 0's if per rank
    planner_data: Mapping[str, Any] = field(default_factory=dict)  # fqn -> key path, all files


_RANK_METADATA = re.compile(r"__(\d+)\.metadata")


def metadata_files(path: str) -> list[str]:
    """The metadata pickles of a DCP directory: ``.metadata``, else every rank's ``__<rank>.metadata``
    (written without rank coordination; ranks must run 0..N-1 without a gap)."""
    main = storage.join(path, ".metadata")
    if storage.isfile(main):
        return [main]
    ranks = sorted(int(m.group(1)) for f in storage.listdir(path) if (m := _RANK_METADATA.fullmatch(f)))
    if not ranks:
        raise MissingShardError(f"{main}: DCP metadata file not found (not a finished checkpoint?)")
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        raise MissingShardError(
            f"{path}: per-rank DCP metadata found for ranks {ranks} but __{missing[0]}.metadata "
            f"(rank(s) {missing}) is missing"
        )
    return [storage.join(path, f"__{r}.metadata") for r in ranks]


def _fields(obj: Any) -> dict[str, Any]:
    return obj.fields if isinstance(obj, Opaque) else {}


def _dtype_of(props: Any, where: str) -> str:
    """``TensorProperties`` pickles its state as a tuple (dtype, layout, requires_grad, ...)."""
    if isinstance(props, Opaque):
        state = props.__dict__["state_"]
        if isinstance(state, tuple) and state and isinstance(state[0], TorchDtype):
            return state[0].name
        dt = props.fields.get("dtype")
        if isinstance(dt, TorchDtype):
            return dt.name
    raise FormatError(f"{where}: tensor properties without a dtype ({props!r})")


def read_metadata(path: str) -> DcpMetadata:
    """Parse ``path/.metadata`` with the safe unpickler (no torch, no code execution).

    A checkpoint saved without rank coordination has one ``__<rank>.metadata`` per rank
    instead, each describing that rank's own chunks: they are merged into one global view
    (a chunk several ranks saved, e.g. a replicated tensor, is taken from the lowest rank, as
    DCP's own deduplication would), which torch itself can only load back rank by rank.
    """
    path = os.fspath(path)
    parts = [_read_one(path, f) for f in metadata_files(path)]
    if len(parts) == 1:
        return parts[0]
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, tuple[str, int, int]] = {}
    planner: dict[str, Any] = {}
    for part in parts:
        for fqn, t in part.tensors.items():
            have = tensors.get(fqn)
            if have is None:
                tensors[fqn] = t
                continue
            if (have.dtype, have.size) != (t.dtype, t.size):
                raise FormatError(f"{path}: tensor {fqn!r} is {have.size} {have.dtype} in one rank's metadata "
                                  f"and {t.size} {t.dtype} in another's")
            seen = {c.offsets for c in have.chunks}
            tensors[fqn] = dataclasses.replace(have, chunks=have.chunks + tuple(
                c for c in t.chunks if c.offsets not in seen))
        for fqn, loc in part.objects.items():
            objects.setdefault(fqn, loc)
        for fqn, key in part.planner_data.items():
            planner.setdefault(fqn, key)
    return DcpMetadata(path, tensors, objects, parts[0].raw, planner)


def _read_one(path: str, meta_file: str) -> DcpMetadata:
    if storage.getsize(meta_file) > _MAX_METADATA:
        raise FormatError(f"{meta_file}: implausibly large metadata file")
    raw = safe_loads(storage.read_bytes(meta_file), source=meta_file)
    f = _fields(raw)
    sdm, items = f.get("state_dict_metadata"), f.get("storage_data")
    if not isinstance(sdm, Mapping) or not isinstance(items, Mapping):
        raise FormatError(f"{meta_file}: not a torch.distributed.checkpoint Metadata pickle")
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for idx, info in items.items():
        fi, ii = _fields(idx), _fields(info)
        if ii.get("transform_descriptors"):
            raise FormatError(
                f"{meta_file}: item {fi.get('fqn')!r} is stored with transforms "
                f"{ii['transform_descriptors']!r} (compressed?); not readable in place"
            )
        off = fi.get("offset")
        key = (str(fi.get("fqn")), tuple(int(x) for x in off) if off is not None else None)
        rel = str(ii.get("relative_path"))
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise FormatError(f"{meta_file}: data file {rel!r} escapes the checkpoint directory")
        where[key] = (storage.join(path, rel), int(ii.get("offset", 0)), int(ii.get("length", -1)))
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, tuple[str, int, int]] = {}
    for fqn, md in sdm.items():
        fqn = str(fqn)
        kind = getattr(md, "_qualname", "")
        mf = _fields(md)
        if kind == "TensorStorageMetadata":
            dtype = _dtype_of(mf.get("properties"), f"{meta_file}: {fqn}")
            chunks = []
            for c in mf.get("chunks") or ():
                cf = _fields(c)
                offs = tuple(int(x) for x in cf["offsets"])
                sizes = tuple(int(x) for x in cf["sizes"])
                loc = where.get((fqn, offs))
                if loc is None:
                    raise FormatError(f"{meta_file}: no storage entry for {fqn!r} chunk at {offs}")
                chunks.append(DcpChunk(offs, sizes, *loc))
            tensors[fqn] = DcpTensor(fqn, dtype, tuple(int(x) for x in mf["size"]), tuple(chunks))
        elif kind == "BytesStorageMetadata":
            loc = where.get((fqn, None)) or where.get((fqn, ()))
            if loc is None:
                loc = next((v for (k, _), v in where.items() if k == fqn), None)
            if loc is not None:
                objects[fqn] = loc
        else:
            raise FormatError(f"{meta_file}: unknown storage metadata {kind!r} for {fqn!r}")
    planner = f.get("planner_data")
    return DcpMetadata(path, tensors, objects, raw, dict(planner) if isinstance(planner, Mapping) else {})


def _embedded_archive(file: str, start: int, length: int, what: str) -> tuple[Any, dict[str, tuple[int, int]]]:
    """Unpickle the ``torch.save`` zip at ``file[start:start+length]``; storage key -> absolute (offset, size)."""
    archive = TorchArchive.open(file, start, length, what)
    return archive.obj, dict(archive.storage_offsets)


def chunk_fragment(tensor: DcpTensor, chunk: DcpChunk) -> Fragment:
    """The in-place fragment of one saved chunk (box = the chunk's global offsets/sizes)."""
    what = f"tensor {tensor.fqn!r} chunk {chunk.offsets}"
    obj, offsets = _embedded_archive(chunk.file, chunk.offset, chunk.length, what)
    if not isinstance(obj, TensorRef):
        raise FormatError(f"{chunk.file}@{chunk.offset}: {what} holds {type(obj).__name__}, not a tensor")
    if obj.shape != chunk.sizes or obj.dtype != tensor.dtype:
        raise FormatError(
            f"{chunk.file}: {what}: stored {obj.shape}/{obj.dtype}, metadata says {chunk.sizes}/{tensor.dtype}"
        )
    start, length = offsets[obj.storage.key]
    region = FileRegion(chunk.file, start + obj.offset * _itemsize(obj.dtype), obj.dtype, obj.stride)
    if obj.offset * _itemsize(obj.dtype) + region.extent(obj.shape) > length:
        raise FormatError(f"{chunk.file}: {what} reaches past its storage")
    return Fragment(Box(chunk.offsets, chunk.sizes), region)


def _itemsize(dtype: str) -> int:
    return _dtypes.itemsize(dtype)


def tensor_state(meta: DcpMetadata, fqn: str) -> TensorState:
    """All chunks of ``fqn`` as one :class:`TensorState` over the global shape (no data read)."""
    t = meta.tensors.get(fqn)
    if t is None:
        raise FormatError(f"{meta.path}: no tensor {fqn!r} in the DCP metadata")
    return TensorState(t.dtype, t.size, tuple(chunk_fragment(t, c) for c in t.chunks))


def read_object(meta: DcpMetadata, fqn: str) -> Any:
    """A bytes entry (``torch.save`` of a Python object, e.g. a Megatron ShardedObject), safely unpickled.

    Tensors inside come back as :class:`~ckptbridge.adapters.torchfile.TensorRef`; use :func:`object_archive`
    when their bytes are needed.
    """
    return object_archive(meta, fqn)[0]


def object_archive(meta: DcpMetadata, fqn: str) -> tuple[Any, dict[str, tuple[int, int]]]:
    loc = meta.objects.get(fqn)
    if loc is None:
        raise FormatError(f"{meta.path}: no object {fqn!r} in the DCP metadata")
    return _embedded_archive(loc[0], loc[1], loc[2], f"object {fqn!r}")

"""The universal directory: ckptbridge's own pickle-free checkpoint format.

Layout (format version 1; the README has the full spec)::

    DIR/
      manifest.json         logical tensors, states, fragments, checksums, rules, provenance, step
      extra.json            non-tensor state (optimizer hyper-parameters, scheduler, RNG, data position)
      data/<state>-r<rank>-<part>.safetensors   one state per file: weights open with any safetensors tool
      COMMITTED             written last; a directory without it is not a checkpoint

Writing is two steps so that many processes can write one checkpoint:
every rank calls :func:`write_rank` with the pieces it owns (into
``DIR.partial/``), then one rank calls :func:`commit_universal`, which merges the
per-rank manifests, writes the marker and renames ``DIR.partial`` to
``DIR``. :func:`write_universal` does both for a single process::

    write_universal("out/ckpt", [Piece("w", "fp32", "float32", (4, 6), Box.full((4, 6)), arr)], step=3)
    ckpt = ckptbridge.open("out/ckpt")
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes, _storage
from .._errors import (
    CheckpointError,
    FormatError,
    IncompleteCheckpointError,
    MissingShardError,
    TruncatedError,
)
from .._read.checkpoint import CheckpointIndex
from .._read.model import (
    Box,
    FileRegion,
    Fragment,
    LogicalTensor,
    TensorState,
    c_strides,
    check_name,
)
from .._storage.commit import (
    check_destination,
    is_staging,
    prepare_destination,
    publish,
    staging_path,
    write_marker,
)
from .._storage.crc import crc32
from .safetensors import Entry, FileSpec, read_header
from .safetensors_write import write_files

FORMAT = "ckptbridge-universal"
VERSION = 1
MANIFEST = "manifest.json"
EXTRA = "extra.json"
MARKER = "COMMITTED"
DEFAULT_FILE_BYTES = 4 << 30


@dataclass(frozen=True)
class Piece:
    """A box of one state of one logical tensor, to be written.

    ``data`` is the array for ``box`` or a callable producing it (called
    lazily, once, while writing, so conversion streams).
    """

    tensor: str
    state: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    data: np.ndarray | Callable[[], np.ndarray]
    sources: tuple[Mapping[str, Any], ...] = ()  # where the bytes came from (lineage, for audits)


def _write_json(path: str, obj: Any) -> None:
    if _storage.is_url(path):  # one PUT: an object appears whole
        _storage.write_bytes(path, json.dumps(obj, separators=(",", ":"), default=_json_default).encode())
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(obj, separators=(",", ":"), default=_json_default))  # one shot: the C encoder
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return repr(obj)


def _safe_component(text: str) -> str:
    """A file-name-safe spelling of a state name; names that had to change get a hash
    suffix, so two states never share a file (``a/b`` and ``a_b`` stay apart)."""
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in text)[:64] or "x"
    return safe if safe == text else f"{safe}-{zlib.crc32(text.encode('utf-8', 'replace')):08x}"


def _key(piece: Piece) -> str:
    if piece.box.shape == piece.global_shape:
        return piece.tensor
    return f"{piece.tensor}@{','.join(str(o) for o in piece.box.offset)}"


def plan_rank(
    path: str, pieces: Iterable[Piece], rank: int = 0, max_file_bytes: int = DEFAULT_FILE_BYTES, token: str = ""
) -> list[tuple[str, list[Piece], FileSpec]]:
    """Which data file each piece goes to (pure): ``(relative path, pieces, FileSpec)`` per file."""
    stage = staging_path(path, token)
    by_state: dict[str, list[Piece]] = {}
    for p in pieces:
        check_name(p.tensor, path)
        _dtypes.to_numpy(p.dtype)
        by_state.setdefault(p.state, []).append(p)
    out: list[tuple[str, list[Piece], FileSpec]] = []
    for state, plist in by_state.items():
        files: list[list[Piece]] = [[]]
        size = 0
        for p in plist:
            nb = p.box.size * _dtypes.itemsize(p.dtype)
            if files[-1] and size + nb > max_file_bytes:
                files.append([])
                size = 0
            files[-1].append(p)
            size += nb
        for part, group in enumerate(files):
            rel = f"data/{_safe_component(state)}-r{rank:05d}-{part:05d}.safetensors"
            entries = [Entry(_key(p), p.dtype, p.box.shape, p.data) for p in group]
            out.append((rel, group, FileSpec(_storage.join(stage, rel), entries, {"format": FORMAT, "state": state})))
    return out


def write_rank(
    path: str,
    pieces: Iterable[Piece],
    rank: int = 0,
    scalars: Mapping[str, Mapping[str, float | int]] | None = None,
    max_file_bytes: int = DEFAULT_FILE_BYTES,
    on_piece: Callable[[Piece], None] | None = None,
    token: str = "",
    images: Mapping[str, Any] | None = None,
    background: bool = False,
    reuse: Mapping[str, str] | None = None,
) -> str:
    """Write this rank's pieces into the staging dir and its partial manifest; returns the staging dir.

    ``images``: page-aligned buffers, by relative file path, that already hold
    those files' bytes as :func:`plan_rank` and ``file_layout`` place them
    (the Checkpointer snapshots into them); such files are written without a copy.
    ``background``: write at a lower CPU priority (see ``write_files``). ``reuse``: old files
    to overwrite in place, by relative file path (see ``FileSpec.reuse``).
    """
    stage = staging_path(path, token)
    _storage.makedirs(_storage.join(stage, "data"))
    plan = plan_rank(path, pieces, rank, max_file_bytes, token)
    specs = [dataclasses.replace(spec, image=(images or {}).get(rel), reuse=(reuse or {}).get(rel))
             for rel, _, spec in plan]
    piece_of = {id(e): p for _, group, spec in plan for e, p in zip(spec.entries, group)}
    written = write_files(specs, on_entry=(lambda e: on_piece(piece_of[id(e)])) if on_piece else None,
                          background=background)
    frags: list[dict[str, Any]] = []
    for (rel, group, _), ws in zip(plan, written):
        for w, p in zip(ws, group):
            frags.append({
                "tensor": p.tensor, "state": p.state, "dtype": p.dtype,
                "global_shape": list(p.global_shape), "offset": list(p.box.offset),
                "shape": list(p.box.shape), "file": rel, "key": w.key,
                "byte_offset": w.offset, "checksum": w.checksum,
                **({"sources": list(p.sources)} if p.sources else {}),
            })
    _write_json(_storage.join(stage, f"manifest.r{rank:05d}.json"),
                {"rank": rank, "token": token, "fragments": frags, "scalars": dict(scalars or {})})
    return stage


def commit_universal(
    path: str,
    world_size: int = 1,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rules: Sequence[Mapping[str, Any]] = (),
    provenance: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    token: str = "",
) -> str:
    """Merge the ranks' manifests, write the commit marker last and move the directory into place.

    Call on one rank after every rank's :func:`write_rank` returned. An
    existing ``path`` is kept unless ``overwrite``; even then it is replaced
    only after the new checkpoint is complete. If another writer commits
    ``path`` first, this raises ``FileExistsError`` and leaves theirs intact.
    """
    path = os.fspath(path)
    stage = staging_path(path, token)
    check_destination(path, overwrite)
    tensors: dict[str, dict[str, Any]] = {}
    remote = _storage.is_url(path)
    if remote:
        _storage.get(path).invalidate(path)
    for rank in range(world_size):
        part = _storage.join(stage, f"manifest.r{rank:05d}.json")
        if not _storage.exists(part):
            raise MissingShardError(f"{part}: rank {rank} did not finish writing; not committing")
        data = json.loads(_storage.read_text(part))
        if data.get("token", token) != token:  # left by an earlier, killed attempt at this prefix
            raise MissingShardError(f"{part}: rank {rank} did not finish writing in this attempt; not committing")
        for name, sc in data.get("scalars", {}).items():
            tensors.setdefault(name, {"states": {}, "scalars": {}})["scalars"].update(sc)
        for f in data["fragments"]:
            t = tensors.setdefault(f["tensor"], {"states": {}, "scalars": {}})
            st = t["states"].setdefault(
                f["state"], {"dtype": f["dtype"], "shape": f["global_shape"], "fragments": []}
            )
            st["fragments"].append({k: f[k] for k in ("offset", "shape", "file", "key", "byte_offset", "checksum",
                                                      "sources") if k in f})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "provenance": {"writer": "ckptbridge", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       **dict(provenance or {})},
        "rules": list(rules),
        "tensors": tensors,
    }
    _parse_tensors(manifest, stage)  # validates coverage before anything is committed
    _write_json(_storage.join(stage, EXTRA), dict(extra or {}))
    _write_json(_storage.join(stage, MANIFEST), manifest)
    if remote:  # the stage is the destination prefix: drop everything the manifest does not name
        keep = {MANIFEST, EXTRA} | {f["file"] for t in tensors.values() for st in t["states"].values()
                                    for f in st["fragments"]}
        _storage.remote(path).remove_many([_storage.join(stage, r) for r in _storage.find(stage)
                                        if r not in keep and _OURS.match(r)])
    else:
        for rank in range(world_size):
            os.remove(os.path.join(stage, f"manifest.r{rank:05d}.json"))
        for name in os.listdir(stage):  # writers' liveness records (see ckptbridge._checkpointer.steps)
            if name.startswith("owner.r") or name == ".coord":
                _remove_any(os.path.join(stage, name))
    write_marker(stage, MARKER, json.dumps({"format": FORMAT, "version": VERSION, "tensors": len(tensors)}))
    return publish(stage, path, overwrite=overwrite)


# objects a writer of this layout leaves under a prefix (an earlier, abandoned attempt's included);
# committing at a URL deletes those the manifest does not name, and nothing else
_OURS = re.compile(r"^(data/[^/]+-r\d{5}-\d{5}\.safetensors|manifest\.r\d{5}\.json|owner\.r[^/]*|\.coord/.*)$")


def _remove_any(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


def write_universal(path: str, pieces: Iterable[Piece], *, step: int | None = None,
         extra: Mapping[str, Any] | None = None, rules: Sequence[Mapping[str, Any]] = (),
         provenance: Mapping[str, Any] | None = None,
         scalars: Mapping[str, Mapping[str, float | int]] | None = None,
         overwrite: bool = False, on_piece: Callable[[Piece], None] | None = None,
         max_file_bytes: int = DEFAULT_FILE_BYTES) -> str:
    """Write a complete universal directory from one process."""
    path = os.fspath(path)
    check_destination(path, overwrite)
    prepare_destination(path, overwrite)
    token = uuid.uuid4().hex[:12]  # private staging: a concurrent writer of the same path cannot interfere
    stage = staging_path(path, token)
    try:
        write_rank(path, pieces, 0, scalars, max_file_bytes, on_piece, token)
        return commit_universal(path, 1, step, extra, rules, provenance, overwrite, token)
    except BaseException:
        if not _storage.is_url(path):  # at a URL the objects stay, invisible without the marker
            shutil.rmtree(stage, ignore_errors=True)
        raise


# ------------------------------------------------------------------ reading


_RANK_FILE = re.compile(r"^(manifest\.r\d{5}\.json|[^/]+-r\d{5}-\d{5}\.safetensors)$")


def detect(path: str) -> bool:
    if not _storage.isdir(path):
        return False
    if _storage.exists(_storage.join(path, MANIFEST)) or is_staging(path):
        return True
    if not _storage.is_url(path):
        return False
    # at a URL the staging prefix is the destination: a write that died left rank files or data
    # objects but no manifest; it is ours, and opening it says it was never finished
    names = _storage.listdir(path)
    if any(_RANK_FILE.match(n) for n in names):
        return True
    data = _storage.join(path, "data")
    return "data" in names and _storage.isdir(data) and any(_RANK_FILE.match(n) for n in _storage.listdir(data))


def _load_manifest(path: str) -> dict[str, Any]:
    mpath = _storage.join(path, MANIFEST)
    if not _storage.exists(_storage.join(path, MARKER)):
        raise IncompleteCheckpointError(
            f"{path}: no {MARKER} marker, so this checkpoint was never finished (crashed or still "
            "being written); use the previous checkpoint"
        )
    try:
        manifest = json.loads(_storage.read_text(mpath))
    except FileNotFoundError:
        raise MissingShardError(f"{mpath}: manifest missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise FormatError(f"{mpath}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FormatError(f"{mpath}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise FormatError(f"{mpath}: format version {manifest.get('version')!r}; this ckptbridge reads {VERSION}")
    return manifest


def _resolve(root: str, rel: str, where: str) -> str:
    if not isinstance(rel, str) or "\x00" in rel or os.path.isabs(rel):
        raise FormatError(f"{where}: bad data file name {rel!r}")
    full = _storage.inside(root, rel)
    if full is None:
        raise FormatError(f"{where}: data file {rel!r} points outside the checkpoint")
    return full


def _parse_tensors(manifest: Mapping[str, Any], root: str) -> dict[str, LogicalTensor]:
    out: dict[str, LogicalTensor] = {}
    sizes: dict[str, int] = {}
    mpath = _storage.join(root, MANIFEST)
    if _storage.is_url(root):  # one listing gives every data object's size
        with contextlib.suppress(CheckpointError):
            _storage.listdir(_storage.join(root, "data"))
    try:
        items = manifest["tensors"].items()
    except (KeyError, AttributeError):
        raise FormatError(f"{mpath}: no tensors table") from None
    for name, t in items:
        check_name(name, mpath)
        states = {}
        try:
            for sname, st in t["states"].items():
                dtype, shape = st["dtype"], tuple(int(s) for s in st["shape"])
                frags = []
                for f in st["fragments"]:
                    file = _resolve(root, f["file"], f"{mpath}: tensor {name!r}")
                    box = Box(tuple(int(x) for x in f["offset"]), tuple(int(x) for x in f["shape"]))
                    region = FileRegion(file, int(f["byte_offset"]), dtype, c_strides(box.shape))
                    if file not in sizes:
                        try:
                            sizes[file] = _storage.getsize(file)
                        except OSError:
                            raise MissingShardError(f"{file}: data file of tensor {name!r} is missing") from None
                    if region.offset + region.extent(box.shape) > sizes[file]:
                        raise TruncatedError(
                            f"{file}: tensor {name!r} state {sname!r} needs bytes up to "
                            f"{region.offset + region.extent(box.shape)} but the file has {sizes[file]}"
                        )
                    frags.append(Fragment(box, region, f.get("checksum")))
                states[sname] = TensorState(dtype, shape, tuple(frags))
            scalars = dict(t.get("scalars", {}))
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, FormatError):
                raise
            raise FormatError(f"{mpath}: tensor {name!r} has a malformed entry ({err})") from None
        out[name] = LogicalTensor(name, states, scalars)
    return out


def index(path: str) -> CheckpointIndex:
    """Open a committed universal directory (metadata only)."""
    path = os.fspath(path)
    if is_staging(path):
        raise IncompleteCheckpointError(f"{path}: a checkpoint still being written (or abandoned)")
    manifest = _load_manifest(path)
    tensors = _parse_tensors(manifest, path)
    extra: dict[str, Any] = {}
    epath = _storage.join(path, EXTRA)
    if _storage.exists(epath):
        try:
            extra = json.loads(_storage.read_text(epath))
        except ValueError as err:
            raise FormatError(f"{epath}: not valid JSON ({err})") from None
    return CheckpointIndex(
        "universal", path, tensors, manifest.get("step"), extra,
        tuple(manifest.get("rules") or ()), manifest.get("provenance") or {},
    )


def fragment_checksum(frag: Fragment, stats: Any = None, chunk: int = 64 << 20) -> str:
    """``crc32:xxxxxxxx`` of a contiguous fragment's stored bytes, read in chunks (never whole);
    ``stats`` (a ``ReadStats``) counts the bytes read."""
    loc = frag.location
    left = loc.extent(frag.box.shape)
    crc = 0
    if _storage.is_url(loc.file):
        store = _storage.remote(loc.file)
        for lo in range(loc.offset, loc.offset + left, chunk):
            got = store.fetch(loc.file, [(lo, min(lo + chunk, loc.offset + left))], stats=stats)
            for piece in got.pieces(lo, min(lo + chunk, loc.offset + left)):
                crc = crc32(piece, crc)
            if stats is not None:
                stats.add(loc.file, min(chunk, loc.offset + left - lo))
        return f"crc32:{crc:08x}"
    with open(loc.file, "rb") as fh:
        fh.seek(loc.offset)
        while left > 0:
            data = fh.read(min(chunk, left))
            if not data:
                raise TruncatedError(f"{loc.file}: ends {left} bytes before fragment at {frag.box.offset} does")
            crc = crc32(data, crc)
            left -= len(data)
            if stats is not None:
                stats.add(loc.file, len(data))
    return f"crc32:{crc:08x}"


def verify(path: str, files: Any = None) -> list[str]:
    """Every problem found in a universal directory: missing marker or files, bad
    headers, checksum mismatches (naming file, tensor and state). Empty = good.
    ``files`` (a ``FileCache``): count the bytes read in its stats (progress)."""
    problems: list[str] = []
    try:
        idx = index(path)
    except (FormatError, MissingShardError, IncompleteCheckpointError) as err:
        return [str(err)]
    stats = getattr(files, "stats", None)
    headers: dict[str, dict[str, Any]] = {}
    for name, t in idx.tensors.items():
        for sname, st in t.states.items():
            for frag in st.fragments:
                loc = frag.location
                try:
                    if loc.file not in headers:
                        header, _ = read_header(loc.file)
                        headers[loc.file] = header
                except (FormatError, MissingShardError) as err:
                    problems.append(str(err))
                    headers[loc.file] = {}
                    continue
                if frag.checksum is None:
                    problems.append(f"{loc.file}: tensor {name!r} state {sname!r} has no checksum")
                    continue
                try:
                    got = fragment_checksum(frag, stats)
                except (OSError, TruncatedError) as err:
                    problems.append(f"{loc.file}: tensor {name!r} state {sname!r}: {err}")
                    continue
                if got != frag.checksum:
                    problems.append(
                        f"{loc.file}: tensor {name!r} state {sname!r} at {frag.box.offset}: "
                        f"checksum {got} != recorded {frag.checksum} (corrupted data)"
                    )
    return problems

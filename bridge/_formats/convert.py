"""Whole-checkpoint operations: convert to universal, export to safetensors, diff.

All of them stream tensor by tensor (peak memory ~ the largest tensor)::

    ckptbridge.convert("ds_run/global_step3", "out/universal")
    ckptbridge.export("out/universal", "weights.safetensors", state="fp32")
    rows = ckptbridge.diff("a.pt", "out/universal")
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _storage
from .._dtypes import to_numpy
from .._errors import TensorNotFoundError
from .._jsonable import jsonable
from .._read.checkpoint import Checkpoint, CheckpointIndex, TensorView
from .._read.model import Box, Fragment
from .._read.open import Source, as_checkpoint
from .._storage.commit import check_destination, staged_file
from .._version import __version__
from .registry import Format, WriteOptions
from .safetensors import Entry
from .safetensors_write import write_file
from .universal import Piece, commit_universal, detect, index, write_rank, write_universal

if TYPE_CHECKING:
    from ..rules import Rule
    from .scaleout import World


class Filler:
    """Reads a tensor, or rows ``[lo, hi)`` of it, into a buffer the writer lends (``fills``),
    cast to ``dtype`` when given (so big tensors stream in row blocks, never whole)."""

    fills = True

    def __init__(self, view: TensorView, dtype: str | None = None) -> None:
        self.view = view
        self.dtype = dtype

    def __call__(self, out: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        if rows is None:
            return self.view.read(dtype=self.dtype, out=out)
        shape = self.view.shape
        box = Box((rows[0], *(0 for _ in shape[1:])), (rows[1] - rows[0], *shape[1:]))
        return self.view.read(box, dtype=self.dtype, out=out)


def _pieces(ckpt: Checkpoint, states: Sequence[str] | None) -> list[Piece]:
    out = []
    for name, t in ckpt.tensors.items():
        for sname, st in t.states.items():
            if states is not None and sname not in states:
                continue
            view = TensorView(ckpt, t, sname)
            out.append(Piece(name, sname, st.dtype, st.shape, Box.full(st.shape), Filler(view),
                             tuple(lineage(f) for f in st.fragments)))
    return out


def lineage(frag: Fragment) -> dict[str, Any]:
    """Where a source fragment's bytes were: its box, location and checksum (for manifests)."""
    entry = {"offset": list(frag.box.offset), "shape": list(frag.box.shape),
             "location": frag.location.describe(), "dtype": frag.location.dtype}
    if frag.checksum:
        entry["checksum"] = frag.checksum
    return entry


def trace(ckpt: Source, name: str, index: tuple[int, ...], state: str | None = None) -> dict[str, Any]:
    """Which stored fragment holds element ``index`` of a tensor, and where that came from.

    For a universal checkpoint written by ``convert`` the answer includes the
    source fragment (file and offset in the original checkpoint) and its checksum.
    """
    ckpt = as_checkpoint(ckpt)
    view = ckpt[name] if state is None else ckpt[name].state(state)
    for frag in view.fragments:
        if all(o <= i < o + s for i, o, s in zip(index, frag.box.offset, frag.box.shape)):
            out: dict[str, Any] = {"fragment": lineage(frag)}
            entry = _manifest_fragment(ckpt, name, view.state_name, frag)
            for src in (entry or {}).get("sources", []):
                if all(o <= i < o + s for i, o, s in zip(index, src["offset"], src["shape"])):
                    out["source"] = src
            return out
    raise TensorNotFoundError(f"{ckpt.path}: tensor {name!r} has no element {index}")


def _manifest_fragment(ckpt: Checkpoint, name: str, state: str, frag: Fragment) -> dict[str, Any] | None:
    if ckpt.format != "universal":
        return None
    import json

    manifest = json.loads(_storage.read_text(_storage.join(ckpt.path, "manifest.json")))
    frags: list[dict[str, Any]] = manifest["tensors"][name]["states"][state]["fragments"]
    for f in frags:
        if f["offset"] == list(frag.box.offset):
            return f
    return None


def convert(
    src: Source,
    dst: str | os.PathLike[str],
    *,
    states: Sequence[str] | None = None,
    rules: Sequence[Rule] = (),
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    world: World | None = None,
) -> str:
    """Write a universal directory from any supported checkpoint.

    ``dst`` may be a URL (``s3://bucket/ckpt`` ...): the objects stream into the prefix and
    the ``COMMITTED`` marker is written last. ``world`` (a ``ckptbridge._formats.scaleout.World``,
    e.g. ``world_from_env(dst)`` under torchrun/srun): this process is one of ``world.size``
    that all call ``convert`` with the same arguments; each writes a balanced share of the
    bytes and rank 0 commits (see ``ckptbridge._formats.scaleout``). Same result as one process,
    up to data file names and offsets.

    ``states`` keeps only those states (e.g. ``["fp32", "exp_avg", "exp_avg_sq"]``; a name no
    tensor has is an error). ``rules`` are mapping rules applied on the way (rename, transpose, stack...);
    they are recorded in the manifest with the source's own layout rules.
    ``progress(done_bytes, total_bytes)`` is called after each tensor.
    """
    from ..rules import (  # not imported by open: the universal format's entry point is here
        apply_rules,
        rules_to_json,
    )

    ckpt = as_checkpoint(src)
    tensors = apply_rules(ckpt.tensors, rules) if rules else ckpt.tensors
    have = {s for t in tensors.values() for s in t.states}
    unknown = set(states or ()) - have
    if unknown:
        raise TensorNotFoundError(
            f"{ckpt.path}: no tensor has state(s) {sorted(unknown)}; states here: {sorted(have)}")
    view = Checkpoint(type(ckpt.index)(
        ckpt.format, ckpt.path, tensors, ckpt.step, ckpt.extra, ckpt.rules, ckpt.provenance
    ), ckpt.files)
    pieces = _pieces(view, states)
    dst = _storage.local(os.fspath(dst))
    if world is not None and world.size > 1:
        from .scaleout import balance

        sizes = [p.box.size * np.dtype(_np(p.dtype)).itemsize for p in pieces]
        pieces = [pieces[i] for i in balance(sizes, world.size)[world.rank]]
    total = sum(p.box.size * np.dtype(_np(p.dtype)).itemsize for p in pieces)
    done = [0]

    def tick(p: Piece) -> None:
        done[0] += p.box.size * np.dtype(_np(p.dtype)).itemsize
        if progress:
            progress(done[0], total)

    meta = {"step": ckpt.step, "extra": jsonable(ckpt.extra), "rules": [*ckpt.rules, *rules_to_json(rules)],
            "provenance": {"source_format": ckpt.format, "source_path": _storage.abspath(ckpt.path),
                           "ckptbridge_version": __version__, **_provenance(ckpt)}}
    scalars = {n: dict(t.scalars) for n, t in tensors.items() if t.scalars}
    if world is not None and world.size > 1:
        from .scaleout import run

        def write(token: str) -> None:
            write_rank(dst, pieces, world.rank, scalars if world.rank == 0 else None, on_piece=tick, token=token)

        def commit(token: str) -> str:
            return commit_universal(dst, world.size, overwrite=overwrite, token=token, **meta)

        return run(world, dst, overwrite, write, commit)
    return write_universal(dst, pieces, **meta, scalars=scalars, overwrite=overwrite, on_piece=tick)


def _np(dtype: str) -> Any:
    return to_numpy(dtype)


def _provenance(ckpt: Checkpoint) -> dict[str, Any]:
    return {"source_provenance": dict(ckpt.provenance)} if ckpt.provenance else {}


def export(
    src: Source,
    out: str | os.PathLike[str],
    *,
    state: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> str:
    """One safetensors file of consolidated tensors of one state (keys = logical names).

    ``state=None`` exports each tensor's weights (``fp32`` if present, else
    ``param``); tensors without the requested state are left out. Streams like
    :func:`convert`: big tensors are read and written in row blocks, so memory
    stays near the writer's buffers whatever the size of the tensors.
    """
    ckpt = as_checkpoint(src)
    out = _storage.local(os.fspath(out))
    check_destination(out, overwrite)
    entries = []
    for name, t in ckpt.tensors.items():
        if state is not None and state not in t.states:
            continue
        view = TensorView(ckpt, t, state)
        entries.append(Entry(name, dtype or view.dtype, view.shape, Filler(view, dtype)))
    if not entries:
        raise TensorNotFoundError(f"{ckpt.path}: no tensor has state {state!r}; states: {ckpt.states()}")
    meta = {"format": "pt", "source_format": ckpt.format}
    if ckpt.step is not None:
        meta["step"] = str(ckpt.step)
    with staged_file(out, overwrite=overwrite) as tmp:
        write_file(tmp, entries, meta)
    return out


@dataclass(frozen=True)
class DiffRow:
    """How one tensor compares between two checkpoints.

    ``close``: every element satisfies ``|a - b| <= atol + rtol * |b|`` (NaN where both are NaN)
    at the tolerances :func:`diff` was given (``None`` when the values were not compared).
    """

    name: str
    in_a: bool
    in_b: bool
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    dtype_a: str | None
    dtype_b: str | None
    max_abs_diff: float | None
    close: bool | None = None

    @property
    def equal(self) -> bool:
        """Present in both, same shape, and equal (within the tolerances given to ``diff``)."""
        return self.in_a and self.in_b and self.shape_a == self.shape_b and bool(self.close)


def _compare(a: TensorView, b: TensorView, atol: float, rtol: float,
             chunk_bytes: int = 64 << 20) -> tuple[float, bool]:
    """(max |a - b|, all close) streaming row blocks of both tensors as float64."""
    shape = a.shape
    boxes = [None] if not shape else [
        Box((start,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - start), *shape[1:]))
        for rows in [max(1, chunk_bytes // max(1, 8 * math.prod(shape[1:])))]
        for start in range(0, shape[0], rows)]
    worst, close = 0.0, True
    for box in boxes:
        x = a.read(box, "float64")
        y = b.read(box, "float64")
        both_nan = np.isnan(x) & np.isnan(y)
        d = np.abs(x - y)
        d[both_nan] = 0.0
        if d.size:
            worst = max(worst, float(np.nanmax(np.where(np.isnan(d), np.inf, d))))
            close = close and bool(np.all(d <= atol + rtol * np.abs(y)))
    return worst, close


def diff(a: Source, b: Source, *, state: str | None = None, atol: float = 0.0, rtol: float = 0.0) -> list[DiffRow]:
    """Compare two checkpoints of any formats, tensor by tensor (streaming).

    ``state`` compares that state (default: each tensor's weights); a state neither
    checkpoint has is an error. ``atol``/``rtol`` (default 0: bitwise) decide ``equal``.
    """
    ca, cb = as_checkpoint(a), as_checkpoint(b)
    if state is not None and state not in set(ca.states()) | set(cb.states()):
        raise TensorNotFoundError(f"{ca.path}, {cb.path}: no tensor has state {state!r} "
                                  f"(A: {list(ca.states())}, B: {list(cb.states())})")
    rows = []
    for name in list(dict.fromkeys([*ca.tensors, *cb.tensors])):
        ta, tb = ca.tensors.get(name), cb.tensors.get(name)
        va = TensorView(ca, ta, state) if ta is not None and (state is None or state in ta.states) else None
        vb = TensorView(cb, tb, state) if tb is not None and (state is None or state in tb.states) else None
        mad, close = None, None
        if va is not None and vb is not None and va.shape == vb.shape:
            mad, close = _compare(va, vb, atol, rtol)
        rows.append(DiffRow(name, va is not None, vb is not None,
                            va.shape if va else None, vb.shape if vb else None,
                            va.dtype if va else None, vb.dtype if vb else None, mad, close))
    return rows


@dataclass(frozen=True)
class UniversalWriteOptions(WriteOptions):
    """Writing ckptbridge's universal layout.

    ``states``: only these states (e.g. ``fp32,exp_avg,exp_avg_sq``); default all.
    ``distributed``: this process is one rank of a launched job (torchrun, srun: ``RANK``/``WORLD_SIZE``) whose ranks all run the same command; each writes a share, rank 0 commits.
    """

    states: tuple[str, ...] | None = None
    distributed: bool = False


def _write_universal(ckpt: Checkpoint, dst: str, options: UniversalWriteOptions) -> str:
    world = None
    if options.distributed:
        from .scaleout import world_from_env

        world = world_from_env(dst)
    return convert(ckpt, dst, states=options.states, overwrite=options.overwrite, world=world)


def _open_universal(path: str, _options: object) -> CheckpointIndex:
    return index(path)


UNIVERSAL = Format("universal", detect=detect, index=_open_universal, write=_write_universal,
                   write_options=UniversalWriteOptions, priority=0,
                   description="ckptbridge's own pickle-free, checksummed layout")

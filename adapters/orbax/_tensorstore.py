"""Reading Orbax arrays through TensorStore: a fragment location that reads exactly its box.

One :class:`_Stores` per open checkpoint (per ``FileCache``) holds one
TensorStore context and every array opened through it. Reads are issued
the way Orbax's own restore issues them, minus its copies:

* all the reads of a request are issued at once inside one ``ts.Batch``
  (:meth:`TensorStoreRegion.read_many`, called by the core executor), so
  TensorStore coalesces the byte ranges of one OCDBT data file or one zarr3
  shard and decodes concurrently on its own thread pools; Python only waits;
* each read lands straight in the caller's buffer (``ts.array(dst).write(view)``
  on a writable view of the destination, casting inside TensorStore):
  no intermediate array, no second copy;
* decoded chunks are not kept (``cache_pool`` 0): a chunk is decoded into
  the destination buffers that need it; the OCDBT B-tree (small) is cached
  in its own pool, as Orbax does (``cache_pool#ocdbt``);
* arrays are opened concurrently (the open futures are shared; no lock is
  held while one is opened).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    CheckpointError,
    FormatError,
    MissingShardError,
    require,
)
from ckptbridge.plugin import dtypes as _dtypes

OCDBT_CACHE = "cache_pool#ocdbt"  # named in an OCDBT kvstore spec: its B-tree nodes are cached there

_STORES: weakref.WeakKeyDictionary[Any, _Stores] = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def _ts() -> Any:
    return require("tensorstore", "jax", "Orbax checkpoints")


def context_spec() -> dict[str, Any]:
    """The TensorStore context of a checkpoint's reads (JSON)."""
    return {
        "cache_pool": {"total_bytes_limit": 0},           # decoded chunks go straight to the destinations
        OCDBT_CACHE: {"total_bytes_limit": 100_000_000},  # B-tree nodes: read once per checkpoint
        "file_io_concurrency": {"limit": 64},
        "data_copy_concurrency": {"limit": max(1, os.cpu_count() or 1)},
    }


class _Stores:
    """One TensorStore context and the arrays opened through it (for one FileCache)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context: Any = None
        self._opening: dict[str, Any] = {}  # spec -> Future[TensorStore] (or the store once opened)

    def get(self, spec: str, label: str) -> Any:
        ts = _ts()
        with self._lock:
            if self._context is None:
                self._context = ts.Context(context_spec())
            fut = self._opening.get(spec)
            if fut is None:
                fut = self._opening[spec] = ts.open(json.loads(spec), read=True, context=self._context)
        if not isinstance(fut, ts.Future):
            return fut
        try:
            store = fut.result()
        except ValueError as err:
            raise MissingShardError(f"cannot open Orbax array {label or spec}: {err}") from None
        with self._lock:
            self._opening[spec] = store
        return store


def _stores(files: Any) -> _Stores:
    with _STORES_LOCK:
        got = _STORES.get(files)
        if got is None:
            got = _STORES[files] = _Stores()
        return got


@functools.lru_cache(maxsize=4096)
def _parse_transform(text: str) -> Any:
    return _ts().IndexTransform(json=json.loads(text))


def _target(out: np.ndarray) -> Any:
    """A TensorStore writing into ``out`` itself (never a copy of it), or None where TensorStore
    cannot reference it (a dtype it does not know)."""
    try:
        return _ts().array(out, copy=False, write=True)
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class TensorStoreRegion:
    """A box of an array stored by TensorStore (Zarr v2/v3, OCDBT or plain files).

    ``spec`` is the TensorStore JSON spec of the whole stored array;
    ``transform`` is a TensorStore ``IndexTransform`` (JSON text) from this
    fragment's coordinates (domain ``[0, shape)``) to the stored array's;
    ``narrow``/``permute``/``insert_dim``/``drop_dim`` compose onto it, so
    transposed, stacked or cropped views still read only their box::

        region.read_into(Box((0, 0), (2, 8)), out, files)       # one read
        TensorStoreRegion.read_many([(region, box, out), ...], files)  # one batch
    """

    spec: str
    dtype: str
    transform: str
    label: str = ""

    @staticmethod
    def whole(spec: Mapping[str, Any], dtype: str, shape: Sequence[int], label: str = "") -> TensorStoreRegion:
        tr = _ts().IndexTransform(input_shape=[int(s) for s in shape])
        return TensorStoreRegion(json.dumps(spec, sort_keys=True), dtype, json.dumps(tr.to_json()), label)

    def _tr(self) -> Any:
        return _parse_transform(self.transform)

    def _with(self, tr: Any) -> TensorStoreRegion:
        ts = _ts()
        tr = tr[ts.d[:].translate_to[0]] if tr.input_rank else tr
        return TensorStoreRegion(self.spec, self.dtype, json.dumps(tr.to_json()), self.label)

    def _view(self, box: Box, files: Any) -> Any:
        view = _stores(files).get(self.spec, self.label)[self._tr()]
        if box.ndim:
            view = view[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape, strict=True))]
        return view

    def _issue(self, box: Box, out: np.ndarray, files: Any, batch: Any) -> tuple[Any, np.ndarray | None]:
        """Start reading ``box`` into ``out``: (future, None), or (future, temporary) where the
        bytes must go through a temporary array (a cast TensorStore refuses, an odd buffer)."""
        ts = _ts()
        view = self._view(box, files)
        target = _target(out) if out.shape == box.shape else None
        if target is not None and out.dtype != view.dtype.numpy_dtype:
            try:
                view = ts.cast(view, ts.dtype(_dtypes.name_of(out.dtype)))
            except (ValueError, TypeError, CheckpointError):
                target = None
        if target is not None:
            return target.write(view, batch=batch), None
        tmp = np.empty(box.shape, dtype=view.dtype.numpy_dtype)
        return _target(tmp).write(view, batch=batch), tmp

    def read_into(self, box: Box, out: np.ndarray, files: Any) -> int:
        return TensorStoreRegion.read_many([(self, box, out)], files)

    @staticmethod
    def read_many(items: Sequence[tuple[TensorStoreRegion, Box, np.ndarray]], files: Any) -> int:
        """Read each ``(region, box, out)`` into its ``out``, all in one ``ts.Batch``; bytes read."""
        ts = _ts()
        pending = []
        with ts.Batch() as batch:
            for region, box, out in items:
                if box.size == 0:
                    continue
                try:
                    pending.append((region, box, out, *region._issue(box, out, files, batch)))
                except CheckpointError:
                    raise
                except (ValueError, RuntimeError, IndexError, TypeError) as err:
                    raise FormatError(f"{region.label or region.spec}: read failed ({err})") from None
        total = 0
        for region, box, out, fut, tmp in pending:
            try:
                fut.result()
            except (ValueError, RuntimeError, IndexError, TypeError) as err:  # TensorStore's damage reports
                raise FormatError(f"{region.label or region.spec}: read failed ({err})") from None
            if tmp is not None:
                np.copyto(out, tmp.reshape(out.shape), casting="unsafe")
            nbytes = box.size * _dtypes.itemsize(region.dtype)
            files.stats.add(region.label or region.spec, nbytes)
            total += nbytes
        return total

    def describe(self) -> str:
        return self.label or self.spec

    def narrow(self, box: Box) -> TensorStoreRegion:
        tr = self._tr()
        if not box.ndim:
            return self
        return self._with(tr[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape, strict=True))])

    def permute(self, perm: Sequence[int]) -> TensorStoreRegion:
        ts = _ts()
        if not perm:
            return self
        return self._with(self._tr()[ts.d[tuple(int(p) for p in perm)].transpose[:]])

    def insert_dim(self, dim: int) -> TensorStoreRegion:
        ts = _ts()
        tr = self._tr()
        return self._with(tr[(slice(None),) * dim + (ts.newaxis, ...)])

    def drop_dim(self, dim: int) -> TensorStoreRegion:
        tr = self._tr()
        return self._with(tr[(slice(None),) * dim + (0, ...)])

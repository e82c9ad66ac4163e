"""Reading Orbax arrays through TensorStore: a fragment location that reads exactly its box."""

from __future__ import annotations

import functools
import json
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

_STORES: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def _context() -> Any:
    ts = require("tensorstore", "jax", "Orbax checkpoints")

    # decoded chunks are cached (LRU, 256 MiB) so that device boxes sharing a compressed
    # chunk decode it once; the B-tree of an OCDBT database likewise
    return ts.Context({"cache_pool": {"total_bytes_limit": 256 << 20},
                       "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
                       "file_io_concurrency": {"limit": 64}})


def _open_store(spec: str, files: Any) -> Any:
    """The TensorStore for ``spec`` (JSON text), opened once per FileCache."""
    ts = require("tensorstore", "jax", "Orbax checkpoints")

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
    ts = require("tensorstore", "jax", "Orbax checkpoints")

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
        ts = require("tensorstore", "jax", "Orbax checkpoints")

        tr = ts.IndexTransform(input_shape=[int(s) for s in shape])
        return TensorStoreRegion(json.dumps(spec, sort_keys=True), dtype, json.dumps(tr.to_json()), label)

    def _tr(self) -> Any:
        return _parse_transform(self.transform)

    def _with(self, tr: Any) -> TensorStoreRegion:
        ts = require("tensorstore", "jax", "Orbax checkpoints")

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
        ts = require("tensorstore", "jax", "Orbax checkpoints")

        if not perm:
            return self
        return self._with(self._tr()[ts.d[tuple(int(p) for p in perm)].transpose[:]])

    def insert_dim(self, dim: int) -> TensorStoreRegion:
        ts = require("tensorstore", "jax", "Orbax checkpoints")

        tr = self._tr()
        return self._with(tr[(slice(None),) * dim + (ts.newaxis, ...)])

    def drop_dim(self, dim: int) -> TensorStoreRegion:
        tr = self._tr()
        return self._with(tr[(slice(None),) * dim + (0, ...)])



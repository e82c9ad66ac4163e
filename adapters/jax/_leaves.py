"""JAX pieces of the asynchronous checkpointer: one leaf per addressable shard with replica id 0.

JAX arrays are immutable, but a train step with ``donate_argnums`` deletes
their buffers. By default ``save`` therefore dispatches a device-side copy of
each shard (asynchronous: it returns at once) and moves the copies to host in
the background; with ``Checkpointer.guard`` (for memory-tight devices) no device
copy is made and the guarded train step waits for the transfer instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptbridge.plugin import Box, Leaf, LeafProvider
from ckptbridge.plugin import dtypes as _dtypes


def index_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """The box of a shard's ``index`` (a tuple of slices) in an array of ``shape``."""
    offset, extent = [], []
    for sl, n in zip(index, shape):
        start, stop, _ = sl.indices(n)
        offset.append(start)
        extent.append(stop - start)
    return Box(tuple(offset), tuple(extent))


def jax_leaves(name: str, value: Any, lazy: bool) -> list[Leaf]:
    import jax

    if not isinstance(value, jax.Array):
        return [Leaf(name, _dtypes.name_of(np.asarray(value).dtype), tuple(np.shape(value)),
                     Box.full(tuple(np.shape(value))), lambda out, v=value: np.copyto(out, np.asarray(v)))]
    shape = tuple(value.shape)
    dtype = _dtypes.name_of(value.dtype)
    leaves = []
    for shard in value.addressable_shards:
        if shard.replica_id != 0:
            continue
        box = index_box(shard.index, shape)
        # Unguarded: copy on the device now (dispatched asynchronously, so save() does not wait),
        # which a later donation cannot touch; the host transfer happens in the background.
        # Guarded (Checkpointer.guard): no device copy; the train step waits for the transfer.
        data = shard.data if lazy else jax.numpy.array(shard.data, copy=True)
        leaves.append(Leaf(name, dtype, shape, box, lambda out, d=data: np.copyto(out, np.asarray(d)), lazy=True))
    return leaves


PROVIDER = LeafProvider("jax", ("jax", "jaxlib"),
                        leaves=lambda name, value, capture: jax_leaves(name, value, capture.guarded))

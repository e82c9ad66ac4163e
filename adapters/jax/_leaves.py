"""JAX pieces of the asynchronous checkpointer: one leaf per addressable shard with replica id 0.

Each process captures only its addressable shards (replica 0 of each), so under
``jax.distributed`` every process writes its own part and process 0 commits.

JAX arrays are immutable, but a train step with ``donate_argnums`` deletes
their buffers. With ``Checkpointer.guard`` (the fast path) no copy is made on the
device: shards are copied to host in the background, and a guarded call waits
only if it donates an array whose copy is still pending (``donated`` reads the
donated arguments of a ``jax.jit`` function; a step that donates nothing never
waits). Without a guard, ``save`` dispatches a device-side copy of each shard
(asynchronous, so ``save`` does not wait), which a later donation cannot touch.

A shard's data is released as soon as it is on the host, so a finished
snapshot holds no device memory and no reference that would turn a later
donation into a copy. On accelerators every shard's device-to-host transfer
is started (``copy_to_host_async``) before the first one is waited for.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptbridge.plugin import Box, CheckpointError, Leaf, LeafProvider
from ckptbridge.plugin import dtypes as _dtypes


def index_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """The box of a shard's ``index`` (a tuple of slices) in an array of ``shape``."""
    offset, extent = [], []
    for sl, n in zip(index, shape):
        start, stop, _ = sl.indices(n)
        offset.append(start)
        extent.append(stop - start)
    return Box(tuple(offset), tuple(extent))


class _Shard:
    """One shard's device data until it is copied to a host buffer, then released."""

    __slots__ = ("data", "name")

    def __init__(self, name: str, data: Any) -> None:
        self.name, self.data = name, data

    def start(self) -> None:
        if self.data is not None:
            self.data.copy_to_host_async()

    def copy(self, out: np.ndarray) -> None:
        data, self.data = self.data, None
        if data is None:
            raise CheckpointError(f"{self.name}: this snapshot of the shard was already taken")
        np.copyto(out, np.asarray(data))


def jax_leaves(name: str, value: Any, lazy: bool) -> list[Leaf]:
    import jax

    if not isinstance(value, jax.Array):
        return [Leaf(name, _dtypes.name_of(np.asarray(value).dtype), tuple(np.shape(value)),
                     Box.full(tuple(np.shape(value))), functools.partial(np.copyto, src=np.asarray(value)))]
    shape = tuple(value.shape)
    dtype = _dtypes.name_of(value.dtype)
    leaves = []
    for shard in value.addressable_shards:
        if shard.replica_id != 0:
            continue
        box = index_box(shard.index, shape)
        # Guarded (Checkpointer.guard): no device copy; a donating step waits for the transfer.
        # Unguarded: copy on the device now (dispatched asynchronously, so save() does not wait),
        # which a later donation cannot touch; the host transfer happens in the background.
        src = _Shard(name, shard.data if lazy else jax.numpy.array(shard.data, copy=True))
        on_host = shard.device.platform == "cpu"  # its "transfer" is a view: nothing to start
        leaves.append(Leaf(name, dtype, shape, box, src.copy, lazy=True, key=id(value),
                           start=None if on_host else src.start))
    return leaves


def donated_keys(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> frozenset[int] | None:
    """Identities of the arrays a call ``fn(*args, **kwargs)`` donates (``fn`` a ``jax.jit``
    function), or None when that cannot be told (then the guard waits for every snapshot)."""
    info = getattr(fn, "_jit_info", None)  # jax.jit's record of its options (no public accessor)
    nums, names = getattr(info, "donate_argnums", None), getattr(info, "donate_argnames", None)
    if nums is None or names is None:
        return None
    import jax

    given = [args[i] for i in nums if i < len(args)] + [v for k, v in kwargs.items() if k in names]
    return frozenset(id(x) for x in jax.tree_util.tree_leaves(given) if isinstance(x, jax.Array))


PROVIDER = LeafProvider("jax", ("jax", "jaxlib"),
                        leaves=lambda name, value, capture: jax_leaves(name, value, capture.guarded),
                        donated=donated_keys)

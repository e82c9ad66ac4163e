"""JAX: load any checkpoint onto any device mesh, and save sharded ``jax.Array`` trees.

``load`` builds each array with ``jax.make_array_from_callback``; every
device's callback is served from a read of exactly that device's index box
(through the core planner), and identical boxes (replicas) are read once::

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ckptbridge.adapters import jax as cbjax

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    arrays = cbjax.load("run/global_step3", {"wte.weight": NamedSharding(mesh, P(None, "model"))})
    state = cbjax.load(ckpt, NamedSharding(mesh, P()), dtype="bfloat16")      # every tensor
    params = cbjax.load(ckpt, abstract_params)   # a pytree of ShapeDtypeStruct / Array / Sharding

``save`` writes the universal directory from a pytree of (sharded) arrays:
each process writes only the shards it owns with ``replica_id == 0``, so
the distributed representation is stored as is, and process 0 commits
after a barrier. Every leaf is one logical tensor named by its key path
joined with ``/``::

    cbjax.save("ckpt/step_100", {"params": params}, step=100)

jax is imported lazily, inside the functions, as everywhere in ckptbridge.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    Checkpoint,
    Piece,
    ShapeMismatchError,
    TensorNotFoundError,
    TensorState,
    as_checkpoint,
    check_destination,
    commit_universal,
    fresh_array,
    read_boxes,
    rules_to_json,
    staging_path,
    write_rank,
    write_universal,
)
from ckptbridge.plugin import dtypes as _dtypes
from ckptbridge.plugin import open_checkpoint as open_checkpoint

__all__ = ["box_of_index", "flatten", "host_buffer", "load", "load_arrays", "save", "tree_pieces"]



# ------------------------------------------------------------------ helpers


def _host_data(shard: Any) -> np.ndarray:
    return np.asarray(shard.data)


def box_of_index(index: Sequence[Any] | None, shape: Sequence[int]) -> Box:
    """The :class:`Box` selected by a jax shard index (a tuple of slices) of an array of ``shape``."""
    shape = tuple(int(s) for s in shape)
    index = tuple(index or ())
    index = index + (slice(None),) * (len(shape) - len(index))
    offset, extent = [], []
    for sl, n in zip(index, shape, strict=True):
        if not isinstance(sl, slice):
            raise ShapeMismatchError(f"unsupported shard index {sl!r} for shape {shape}")
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ShapeMismatchError(f"strided shard index {sl!r} for shape {shape}")
        offset.append(start)
        extent.append(max(0, stop - start))
    return Box(tuple(offset), tuple(extent))


def host_buffer(shape: Sequence[int], dtype: str) -> np.ndarray:
    """An uninitialised page-aligned host array. JAX's CPU client adopts 64-byte-aligned
    numpy arrays as device buffers without copying, so data read into one lands in the
    device array itself; on accelerators it is the staging buffer of the transfer
    (``ckptbridge.plugin.fresh_array``: no huge pages where their first touch is slow)."""
    return fresh_array(shape, _dtypes.to_numpy(dtype))


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: Sequence[Any]) -> str:
    """``('params', 'Dense_0', 'kernel')`` key path -> ``"params/Dense_0/kernel"``."""
    return "/".join(_key_str(k) for k in path)


def _is_target_leaf(x: Any) -> bool:
    import jax

    return x is None or isinstance(x, jax.sharding.Sharding) or (
        hasattr(x, "shape") and hasattr(x, "dtype")
    )


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[tuple[str, Any]], Any]:
    """Leaves of ``tree`` with their ``/``-joined key-path names, and the treedef."""
    import jax

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_name(p), leaf) for p, leaf in flat], treedef


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _tensor_state(ckpt: Checkpoint, name: str, state: str | None) -> TensorState:
    tensor = ckpt.index.tensors.get(name)
    if tensor is None:
        near = [n for n in ckpt.index.tensors if n.split("/")[-1] == name.split("/")[-1]][:5]
        hint = f"; similar names: {near}" if near else f"; it has {len(ckpt.index.tensors)} tensors"
        raise TensorNotFoundError(f"{ckpt.path}: no tensor {name!r} to load{hint}")
    return tensor.state(state)


# ------------------------------------------------------------------ load


@dataclass(frozen=True)
class _Planned:
    name: str
    state: TensorState
    sharding: Any
    dtype: str
    boxes: tuple[Box, ...]  # distinct boxes of the addressable devices

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.boxes) * _dtypes.itemsize(self.dtype)


def _plan_request(ckpt: Checkpoint, req: Sequence[Any], state: str | None) -> _Planned:
    name, sharding, dtype, expected = req[:4]
    tstate = _tensor_state(ckpt, name, req[4] if len(req) > 4 else state)
    shape = tstate.shape
    label = f"{ckpt.path}: tensor {name!r}"
    if expected is not None and tuple(expected) != shape:
        raise ShapeMismatchError(f"{label} has shape {shape}, the target expects {tuple(expected)}")
    dt_name = tstate.dtype
    if dtype is not None and (len(req) > 4 or expected is not None or _is_float(tstate.dtype)):
        dt_name = _dtypes.name_of(np.dtype(dtype))  # a bare cast leaves integer tensors alone
    try:
        indices = sharding.addressable_devices_indices_map(shape)
    except ValueError as err:  # e.g. jax's IndivisibleError for uneven NamedShardings
        raise ShapeMismatchError(f"{label}: shape {shape} does not fit sharding {sharding}: {err}") from None
    boxes = tuple(dict.fromkeys(box_of_index(index, shape) for index in indices.values()))
    return _Planned(name, tstate, sharding, dt_name, boxes)


def load_arrays(
    ckpt: Checkpoint,
    requests: Sequence[tuple[Any, ...]],
    state: str | None = None,
    max_workers: int | None = None,
    window_bytes: int = 512 << 20,
) -> list[Any]:
    """Build one ``jax.Array`` per ``(name, sharding, dtype, expected_shape[, state])`` request.

    Every request is planned (and checked) before anything is read. The
    distinct index boxes of each array's addressable devices are then read
    together (replicas share one read; storage that batches, such as Orbax's
    TensorStore, fetches a chunk several boxes share once), one tensor per
    task of a thread pool, into page-aligned host buffers that JAX's CPU
    client adopts as the device buffers (:func:`host_buffer`); tensors ahead of the one being
    assembled are prefetched up to ``window_bytes``, and each array is built
    with ``jax.make_array_from_callback`` from its boxes.
    """
    import jax

    plans = [_plan_request(ckpt, req, state) for req in requests]
    workers = max_workers or min(8, (os.cpu_count() or 1) * 2)
    out = []
    with ThreadPoolExecutor(workers) as pool:
        futures: dict[int, Any] = {}
        ahead, in_flight = 0, 0

        def submit_more() -> None:
            nonlocal ahead, in_flight
            while ahead < len(plans) and (not futures or in_flight + plans[ahead].nbytes <= window_bytes):
                p = plans[ahead]
                label = f"{ckpt.path}: tensor {p.name!r}"
                bufs = [host_buffer(b.shape, p.dtype) for b in p.boxes]
                futures[ahead] = pool.submit(read_boxes, p.state, p.boxes, ckpt.files, p.dtype, label, bufs)
                in_flight += p.nbytes
                ahead += 1

        for i, p in enumerate(plans):
            submit_more()
            chunks = dict(zip(p.boxes, futures.pop(i).result(), strict=True))
            shape = p.state.shape
            given: set[Box] = set()

            def callback(index: Any, shape: tuple[int, ...] = shape, chunks: dict[Box, np.ndarray] = chunks,
                         given: set[Box] = given, p_dtype: str = p.dtype) -> np.ndarray:
                box = box_of_index(index, shape)
                if box in given:  # a replica: its own copy (devices never share one host buffer)
                    dup = host_buffer(box.shape, p_dtype)
                    np.copyto(dup, chunks[box])
                    return dup
                given.add(box)
                return chunks[box]

            out.append(jax.make_array_from_callback(shape, p.sharding, callback,
                                                    dtype=_dtypes.to_numpy(p.dtype)))
            chunks.clear()
            in_flight -= p.nbytes
    return out


def load(
    source: Any,
    shardings: Any,
    state: str | None = None,
    dtype: Any = None,
    *,
    names: Sequence[str] | None = None,
    max_workers: int | None = None,
) -> Any:
    """Load tensors of ``source`` (a path or an open Checkpoint, any format) as sharded ``jax.Array``s.

    ``shardings`` is one of:

    * a single ``jax.sharding.Sharding``: used for every tensor (or for ``names``),
      the result is ``{name: Array}``;
    * a callable ``(name, shape) -> Sharding | None`` applied to every tensor
      (``None`` skips it), the result is ``{name: Array}``;
    * a pytree (flat ``{name: ...}`` dicts included) whose leaves are
      ``Sharding``s, ``jax.ShapeDtypeStruct``s or ``jax.Array``s (their
      ``.sharding``, and their dtype unless ``dtype`` is given) or ``None``
      (left as ``None``); each leaf loads the tensor named by its key path
      joined with ``/``. The result has the same structure.

    ``state`` picks the tensor state (default: the weights, ``fp32`` else
    ``param``; or ``exp_avg`` ...); ``dtype`` casts on the host before the
    transfer (e.g. fp32 master -> ``"bfloat16"`` on device).
    """
    import jax

    ckpt, owned = as_checkpoint(source), not isinstance(source, Checkpoint)
    try:
        if isinstance(shardings, jax.sharding.Sharding) or (
            callable(shardings) and not isinstance(shardings, Mapping) and not hasattr(shardings, "sharding")
        ):
            wanted = list(names) if names is not None else [
                n for n, t in ckpt.index.tensors.items() if state is None or state in t.states
            ]
            reqs: list[tuple[str, Any, Any, tuple[int, ...] | None]] = []
            for n in wanted:
                if isinstance(shardings, jax.sharding.Sharding):
                    sh = shardings
                else:
                    sh = shardings(n, _tensor_state(ckpt, n, state).shape)
                if sh is not None:
                    reqs.append((n, sh, dtype, None))
            arrays = load_arrays(ckpt, reqs, state, max_workers)
            return {r[0]: a for r, a in zip(reqs, arrays, strict=True)}
        flat, treedef = flatten(shardings, is_leaf=_is_target_leaf)
        reqs, where = [], []
        for i, (name, leaf) in enumerate(flat):
            if leaf is None:
                continue
            if isinstance(leaf, jax.sharding.Sharding):
                reqs.append((name, leaf, dtype, None))
            else:
                sharding = getattr(leaf, "sharding", None)
                if sharding is None:
                    raise TypeError(
                        f"target leaf {name!r} has no sharding; give a Sharding, a jax.Array or a "
                        "jax.ShapeDtypeStruct(shape, dtype, sharding=...)"
                    )
                reqs.append((name, sharding, dtype if dtype is not None else leaf.dtype, tuple(leaf.shape)))
            where.append(i)
        arrays = load_arrays(ckpt, reqs, state, max_workers)
        leaves: list[Any] = [leaf if leaf is None else None for _, leaf in flat]
        for i, a in zip(where, arrays, strict=True):
            leaves[i] = a
        return jax.tree_util.tree_unflatten(treedef, leaves)
    finally:
        if owned:
            ckpt.close()


# ------------------------------------------------------------------ save


def _default_state(dtype: str) -> str:
    if dtype in ("float32", "float64") or not dtype.startswith(("float", "bfloat")):
        return "fp32"
    return "param"


def tree_pieces(
    tree: Any, state: str | None = None, names: Callable[[str], str] | None = None,
    process_index: int | None = None,
) -> tuple[list[Piece], dict[str, Any]]:
    """This process's :class:`Piece`s for every array leaf of ``tree`` (replica 0 of each shard only).

    Host values (numpy arrays, Python numbers) are written by process 0.
    Returns the pieces and a ``{name: layout}`` description (mesh, spec) for the provenance.
    """
    import jax

    pid = jax.process_index() if process_index is None else process_index
    flat, _ = flatten(tree)
    pieces: list[Piece] = []
    layout: dict[str, Any] = {}
    for raw, leaf in flat:
        name = names(raw) if names else raw
        if isinstance(leaf, jax.Array):
            shape = tuple(int(s) for s in leaf.shape)
            dt = _dtypes.name_of(leaf.dtype)
            st = state or _default_state(dt)
            for shard in leaf.addressable_shards:
                if shard.replica_id != 0:
                    continue
                box = box_of_index(shard.index, shape)
                pieces.append(Piece(name, st, dt, shape, box,
                                               functools.partial(_host_data, shard)))
            sh = leaf.sharding
            layout[name] = {"sharding": type(sh).__name__}
            if isinstance(sh, jax.sharding.NamedSharding):
                layout[name].update(mesh=dict(sh.mesh.shape), spec=[
                    list(p) if isinstance(p, tuple) else p for p in sh.spec
                ])
        elif isinstance(leaf, (np.ndarray, np.generic, int, float, bool)):
            arr = np.asarray(leaf)
            dt = _dtypes.name_of(arr.dtype)
            if pid == 0:
                pieces.append(Piece(name, state or _default_state(dt), dt, arr.shape,
                                               Box.full(arr.shape), arr))
            layout[name] = {"sharding": "host"}
        else:
            raise TypeError(f"cannot save leaf {name!r} of type {type(leaf).__name__}: "
                            "expected jax.Array, numpy array or number (put other state in extra=)")
    return pieces, layout


def _barrier(tag: str) -> None:
    import jax

    if jax.process_count() > 1:
        try:  # the coordination service's barrier needs no device collectives (as Orbax does)
            from jax._src import distributed

            client = distributed.global_state.client
        except (ImportError, AttributeError):
            client = None
        if client is not None:
            client.wait_at_barrier(tag.replace("/", "_")[-200:], timeout_in_ms=30 * 60 * 1000)
        else:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(tag)


def save_pieces(
    path: str | os.PathLike[str],
    pieces: Sequence[Piece],
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rules: Sequence[Any] = (),
    provenance: Mapping[str, Any] | None = None,
    scalars: Mapping[str, Mapping[str, float | int]] | None = None,
    overwrite: bool = False,
) -> str:
    """Write this process's pieces and commit on process 0 (all processes must call it)."""
    import jax


    path = os.fspath(path)
    rank, world = jax.process_index(), jax.process_count()
    rules_json = rules_to_json(rules)
    if world == 1:
        return write_universal(path, pieces, step=step, extra=extra, rules=rules_json,
                               provenance=provenance, scalars=scalars, overwrite=overwrite)
    if rank == 0:
        check_destination(path, overwrite)
        shutil.rmtree(staging_path(path), ignore_errors=True)
    _barrier(f"ckptbridge-save-start:{path}")
    write_rank(path, pieces, rank, scalars if rank == 0 else None)
    _barrier(f"ckptbridge-save-written:{path}")
    if rank == 0:
        commit_universal(path, world, step, extra, rules_json, provenance, overwrite)
    _barrier(f"ckptbridge-save-committed:{path}")
    return path


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rules: Sequence[Any] = (),
    state: str | None = None,
    names: Callable[[str], str] | None = None,
    scalars: Mapping[str, Mapping[str, float | int]] | None = None,
    overwrite: bool = False,
) -> str:
    """Save a pytree of (sharded) arrays as a universal directory; call on every process.

    Each leaf becomes one logical tensor named by its ``/``-joined key path
    (or ``names(path)``), in state ``state`` (default ``fp32`` for float32
    and non-float leaves, ``param`` for other float dtypes such as bf16).
    Each process writes the shards it holds with ``replica_id == 0``;
    process 0 commits after all have written.
    """
    import jax

    pieces, layout = tree_pieces(tree, state, names)
    provenance = {"source_format": "jax", "processes": jax.process_count(), "layout": layout}
    return save_pieces(path, pieces, step=step, extra=extra, rules=rules, provenance=provenance,
                       scalars=scalars, overwrite=overwrite)

"""torch runtime: load any checkpoint onto a ``DeviceMesh`` as DTensors, fill models
and optimizers, and save DTensor state dicts as universal checkpoints.

Every rank computes its own local shard of each tensor exactly as torch does
(``Shard(d)`` with ``torch.chunk`` sizes, uneven and empty shards included,
``Replicate()``, ``_StridedShard`` of FSDP2 + TP, on meshes of any rank),
asks the core planner for those boxes and reads only their bytes, straight
into the local tensor's memory. Any format ckptbridge opens is a source::

    from torch.distributed.tensor import Shard, Replicate
    from ckptbridge.adapters import torch as cbt

    mesh = init_device_mesh("cpu", (2, 2))
    sd = cbt.load("run/global_step3", mesh, {"w": [Shard(0), Shard(1)], "b": [Replicate(), Replicate()]})
    sd = cbt.load(ckpt, mesh, [Shard(0), Replicate()])       # one placement list for every tensor

    cbt.load_into(dtensor_state_dict, "run/global_step3")     # fill existing (D)Tensors, like dcp.load
    cbt.load_module(fsdp_model, "run/global_step3")           # fill an (FSDP2) model in place
    cbt.load_optimizer(adamw, fsdp_model, "run/global_step3") # exp_avg, exp_avg_sq, step
    cbt.save("out/ckpt", fsdp_model.state_dict(), optimizer=adamw, module=fsdp_model, step=100)
    ck.save(step, cbt.train_state(fsdp_model, adamw), optimizer=adamw)   # asynchronous Checkpointer
    cbt.load_train_state(ck.path_of(ck.latest()), fsdp_model, adamw)     # resume at any world size

Names that differ between checkpoint and model are mapped with rules
(``rules=[Rename(r"^module\\.", "")]``, see :mod:`ckptbridge.rules`).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptbridge.plugin import (
    WEIGHT_STATES,
    Box,
    Checkpoint,
    FormatError,
    LogicalTensor,
    Piece,
    Rule,
    ShapeMismatchError,
    TensorNotFoundError,
    as_checkpoint,
    c_strides,
    check_destination,
    commit_universal,
    find_ranks,
    read_state,
    staging_path,
    write_rank,
    write_universal,
)
from ckptbridge.plugin import dtypes as _dtypes

if TYPE_CHECKING:
    import torch

# ---------------------------------------------------------------- numpy <-> torch


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return _dtypes.name_of(str(dtype).removeprefix("torch."))


_VIEW_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _host_view(t: torch.Tensor) -> np.ndarray:
    return numpy_view(t.cpu())


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (CPU), also for bfloat16 / float8."""
    import torch

    name = dtype_name(t.dtype)
    try:
        return t.numpy()
    except TypeError:
        raw = t.view(getattr(torch, _VIEW_INT[t.element_size()])).numpy()
        return raw.view(_dtypes.to_numpy(name))


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``arr``'s memory (bfloat16 / float8 included)."""
    import torch

    arr = np.ascontiguousarray(arr)
    name = _dtypes.name_of(arr.dtype)
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        raw = torch.from_numpy(arr.view(_VIEW_INT[arr.dtype.itemsize]))
        return raw.view(getattr(torch, name))
    return torch.from_numpy(arr)


# ---------------------------------------------------------------- placements -> boxes


def _runs(index: Sequence[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of global indices as ``(local start, global start, length)``."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(index):
        if runs and runs[-1][1] + runs[-1][2] == g:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local, g, 1))
    return runs


def local_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
    placements: Sequence[Any],
) -> tuple[tuple[int, ...], list[tuple[Box, Box]]]:
    """The local shard of a DTensor at mesh ``coordinate``: its shape and
    ``(global box, local box)`` pairs that tile it.

    Follows ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``
    (shards applied left to right over mesh dims, ``torch.chunk`` sizes, so
    uneven and empty shards match torch); a plain ``Shard`` layout is one box,
    ``_StridedShard`` (FSDP2 over TP) gives several::

        >>> local_boxes((5, 4), (2,), (1,), [Shard(0)])
        ((2, 4), [(Box((3, 0), (2, 4)), Box((0, 0), (2, 4)))])
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shape = tuple(int(s) for s in global_shape)
    if len(placements) != len(mesh_shape):
        raise ShapeMismatchError(f"{len(placements)} placements for a mesh of {len(mesh_shape)} dims")
    index: list[list[int] | None] = [None] * len(shape)  # None: the whole dim
    local = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise ShapeMismatchError(f"placement {p} (a pending reduction) cannot be loaded from a checkpoint")
        if not isinstance(p, (Shard, _StridedShard)):
            raise ShapeMismatchError(f"unsupported placement {p!r}")
        d = p.dim if p.dim >= 0 else p.dim + len(shape)
        if not 0 <= d < len(shape):
            raise ShapeMismatchError(f"placement {p} on a tensor of shape {shape}")
        n, rank = int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim])
        if isinstance(p, _StridedShard):
            from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

            size, offs = p._local_shard_size_and_offset(local[d], n, rank, _StridedShardOffsetMode.ALL)
            picked = list(offs or [])[:size]  # type: ignore[arg-type]
        else:
            size, start = Shard.local_shard_size_and_offset(local[d], n, rank)
            picked = list(range(int(start), int(start) + int(size))) if size else []
        prev = index[d]
        index[d] = [(prev[i] if prev is not None else i) for i in picked]
        local[d] = int(size)
    if any(s == 0 for s in local):
        return tuple(local), []
    per_dim = [
        [(0, 0, shape[d])] if ix is None else _runs(ix) for d, ix in enumerate(index)
    ]
    pairs: list[tuple[Box, Box]] = []

    def walk(d: int, g: list[int], loc: list[int], ext: list[int]) -> None:
        if d == len(shape):
            pairs.append((Box(tuple(g), tuple(ext)), Box(tuple(loc), tuple(ext))))
            return
        for lo, go, n in per_dim[d]:
            walk(d + 1, [*g, go], [*loc, lo], [*ext, n])

    walk(0, [], [], [])
    return tuple(local), pairs


def _coordinate(mesh: Any) -> list[int] | None:
    coord = mesh.get_coordinate()
    return None if coord is None else [int(c) for c in coord]


# ---------------------------------------------------------------- sources and rules


def open_source(source: str | os.PathLike[str] | Checkpoint,
                rules: Iterable[Rule | Mapping[str, Any]] = ()) -> Checkpoint:
    """``source`` as a :class:`Checkpoint` (opened if a path), seen through mapping ``rules``.

    The result shares the source's file cache, so ``source.stats`` counts its reads.
    """
    return as_checkpoint(source, list(rules))


def _tensor(ckpt: Checkpoint, name: str) -> LogicalTensor:
    try:
        return ckpt.tensors[name]
    except KeyError:
        close = [n for n in ckpt.tensors if n.endswith(name.rsplit(".", 1)[-1])][:5]
        raise TensorNotFoundError(
            f"{ckpt.path}: no tensor {name!r} (similar: {close}); map names with rules=[Rename(...)]"
        ) from None


def read_local(ckpt: Checkpoint, tensor: LogicalTensor, state: str | None, mesh: Any,
               placements: Sequence[Any], dtype: Any = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """This rank's local shard of one state of ``tensor``, read into ``out`` (or a new CPU tensor)."""
    import torch

    st = tensor.state(state)
    coord = _coordinate(mesh)
    if coord is None:
        raise ShapeMismatchError(f"this rank is not part of mesh {mesh}")
    local_shape, pairs = local_boxes(st.shape, mesh.shape, coord, placements)
    want = dtype_name(dtype) if dtype is not None else st.dtype
    if out is None:
        out = torch.empty(local_shape, dtype=torch_dtype(want))
    elif tuple(out.shape) != local_shape:
        raise ShapeMismatchError(
            f"{ckpt.path}: tensor {tensor.name!r}: local shard {local_shape} of {st.shape} "
            f"but the target has {tuple(out.shape)}"
        )
    target = out if out.device.type == "cpu" else torch.empty(local_shape, dtype=out.dtype)
    view = numpy_view(target)
    label = f"{ckpt.path}: tensor {tensor.name!r} state {state or tensor.weight_state!r}"
    for gbox, lbox in pairs:
        read_state(st, gbox, ckpt.files, name=label, out=view[lbox.slices()])
    if target is not out:
        out.copy_(target)
    return out


def _placements_for(placements: Any, name: str) -> Sequence[Any] | None:
    if isinstance(placements, Mapping):
        return placements.get(name)
    return placements


def load(
    source: str | os.PathLike[str] | Checkpoint,
    device_mesh: Any,
    placements: Mapping[str, Sequence[Any]] | Sequence[Any],
    state: str | None = None,
    dtype: Any = None,
    as_dtensor: bool = True,
    rules: Iterable[Rule | Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Load tensors as DTensors on ``device_mesh``; each rank reads only its local shard.

    ``placements``: ``{name: [Shard(0), Replicate()]}`` (loads those tensors)
    or one list used for every tensor of the checkpoint. ``state``: which
    state (default the weights: ``fp32``, else ``param``; ``"exp_avg"`` ...).
    ``dtype``: cast on read (torch dtype or name). ``as_dtensor=False``
    returns the plain local tensors. Call on every rank of the mesh.
    """
    import torch
    from torch.distributed.tensor import DTensor

    ckpt = open_source(source, rules)
    names = list(placements) if isinstance(placements, Mapping) else list(ckpt.tensors)
    device = torch.device(device_mesh.device_type)
    out: dict[str, Any] = {}
    for name in names:
        tensor = _tensor(ckpt, name)
        if state is not None and state not in tensor.states and not isinstance(placements, Mapping):
            continue
        pl = list(_placements_for(placements, name) or ())
        local = read_local(ckpt, tensor, state, device_mesh, pl, dtype)
        if device.type != "cpu":
            local = local.to(device)
        if not as_dtensor:
            out[name] = local
            continue
        shape = tensor.state(state).shape
        out[name] = DTensor.from_local(local, device_mesh, pl, run_check=False,
                                       shape=torch.Size(shape), stride=c_strides(shape))
    return out


# ---------------------------------------------------------------- whole models


def _fill(ckpt: Checkpoint, tensor: LogicalTensor, state: str | None, target: Any) -> None:
    """Read ``state`` of ``tensor`` into ``target`` (a DTensor or a plain tensor) in place."""
    import torch
    from torch.distributed.tensor import DTensor

    st = tensor.state(state)
    if tuple(target.shape) != st.shape:
        raise ShapeMismatchError(
            f"{ckpt.path}: tensor {tensor.name!r} is {st.shape} in the checkpoint but "
            f"{tuple(target.shape)} in the model"
        )
    with torch.no_grad():
        if isinstance(target, DTensor):
            read_local(ckpt, tensor, state, target.device_mesh, target.placements,
                       target.dtype, target.to_local())
        else:
            mesh = _SingleMesh()
            read_local(ckpt, tensor, state, mesh, [], target.dtype, target)


class _SingleMesh:
    """A stand-in mesh of no dims for plain (unsharded) tensors."""

    shape = ()

    @staticmethod
    def get_coordinate() -> list[int]:
        return []


def load_into(
    targets: Mapping[str, Any],
    source: str | os.PathLike[str] | Checkpoint,
    rules: Iterable[Rule | Mapping[str, Any]] = (),
    state: str | None = None,
    strict: bool = True,
) -> list[str]:
    """Fill existing tensors in place, like ``dcp.load``: ``targets`` maps names to
    DTensors (each rank reads its local shard, whatever the placements) or plain tensors
    (read whole), cast to their dtypes. Returns the checkpoint tensors not asked for.
    ``strict``: every target must be in the checkpoint.
    """
    ckpt = open_source(source, rules)
    missing = [n for n in targets if n not in ckpt.tensors]
    if missing and strict:
        raise TensorNotFoundError(
            f"{ckpt.path}: {len(missing)} requested tensors are not in the checkpoint, e.g. "
            f"{missing[:5]}; checkpoint names look like {list(ckpt.tensors)[:5]} (map with rules=)"
        )
    for name, target in targets.items():
        if name in ckpt.tensors:
            tensor = ckpt.tensors[name]
            _fill(ckpt, tensor, state if state is not None else _weight_state(tensor), target)
    return [n for n in ckpt.tensors if n not in targets]


def load_module(
    module: torch.nn.Module,
    source: str | os.PathLike[str] | Checkpoint,
    rules: Iterable[Rule | Mapping[str, Any]] = (),
    state: str | None = None,
    strict: bool = True,
) -> list[str]:
    """Fill ``module``'s parameters and buffers in place (plain, DTensor or FSDP2 ``fully_shard``).

    Each rank reads only its shards, cast to the module's dtypes. Returns the
    checkpoint tensors the module has no place for. ``strict``: every entry
    of the module's state dict must be in the checkpoint.
    """
    return load_into(module.state_dict(keep_vars=True), source, rules, state, strict)


def _weight_state(tensor: LogicalTensor) -> str:
    for s in WEIGHT_STATES:
        if s in tensor.states:
            return s
    return tensor.weight_state


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    module: torch.nn.Module,
    source: str | os.PathLike[str] | Checkpoint,
    rules: Iterable[Rule | Mapping[str, Any]] = (),
    states: Sequence[str] | None = None,
    strict: bool = True,
) -> None:
    """Set ``optimizer``'s per-parameter state from the checkpoint (Adam/AdamW:
    ``exp_avg``, ``exp_avg_sq``, ``step``), sharded like each parameter.

    Parameters are named by ``module.named_parameters()``. ``states``: the
    state names to load (default: every non-weight state the checkpoint has
    for that tensor). The Adam ``step`` comes from the tensor's ``step``
    scalar (else the checkpoint's step).
    """
    import torch

    ckpt = open_source(source, rules)
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise TensorNotFoundError(f"an optimizer parameter of shape {tuple(p.shape)} is not in the module")
            if name not in ckpt.tensors:
                if strict:
                    raise TensorNotFoundError(f"{ckpt.path}: no optimizer state for {name!r}")
                continue
            tensor = ckpt.tensors[name]
            wanted = [s for s in tensor.states if s not in WEIGHT_STATES] if states is None else list(states)
            if strict and not wanted:
                raise TensorNotFoundError(f"{ckpt.path}: tensor {name!r} has no optimizer states "
                                          f"(only {sorted(tensor.states)})")
            new: dict[str, Any] = {}
            for s in wanted:
                with torch.no_grad():
                    buf = torch.empty_like(p, memory_format=torch.contiguous_format)
                _fill(ckpt, tensor, s, buf)
                new[s] = buf
            step = tensor.scalars.get("step", ckpt.step)
            if step is not None:
                new["step"] = _step_tensor(optimizer, group, p, float(step))
            elif strict and wanted:
                raise TensorNotFoundError(f"{ckpt.path}: no Adam step for {name!r} (no 'step' scalar)")
            optimizer.state[p] = new


def _step_tensor(optimizer: Any, group: Mapping[str, Any], p: Any, step: float) -> Any:
    import torch

    try:
        from torch.optim.optimizer import _get_scalar_dtype

        fused = bool(group.get("fused"))
        dtype = _get_scalar_dtype(is_fused=fused)
    except (ImportError, TypeError):
        fused, dtype = False, torch.float32
    if fused or group.get("capturable"):
        return torch.tensor(step, dtype=dtype, device=p.device)
    return torch.tensor(step, dtype=dtype)


# ---------------------------------------------------------------- saving


def optimizer_states(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """``{param name: {"exp_avg": t, "exp_avg_sq": t, "step": n}}`` from a torch optimizer."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name, st in named_optimizer_state(optimizer, module):
        entry: dict[str, Any] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                entry[k] = v
            elif isinstance(v, torch.Tensor):
                entry[k] = v.item()
            elif isinstance(v, (int, float)):
                entry[k] = v
        out[name] = entry
    return out


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                       if k != "params" and (v is None or isinstance(v, (int, float, str, bool, tuple)))})
    return groups


def _pieces(name: str, state: str, t: Any, rank: int) -> list[Any]:
    """The universal pieces of ``t`` that this rank writes (one copy of every replica)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate


    dtype = dtype_name(t.dtype)
    shape = tuple(int(s) for s in t.shape)
    if not isinstance(t, DTensor):
        if rank != 0:
            return []
        local = t.detach()
        return [Piece(name, state, dtype, shape, Box.full(shape), functools.partial(_host_view, local))]
    if any(isinstance(p, Partial) for p in t.placements):
        t = t.redistribute(t.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in t.placements])
    mesh = t.device_mesh
    coord = _coordinate(mesh)
    if coord is None:
        return []
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coord)):
        return []
    local = t.to_local().detach()
    local_shape, pairs = local_boxes(shape, mesh.shape, coord, t.placements)
    if tuple(local.shape) != local_shape:
        raise ShapeMismatchError(f"tensor {name!r}: local shard {tuple(local.shape)}, torch's layout says {local_shape}")
    out = []
    for gbox, lbox in pairs:
        def data(x: torch.Tensor = local, b: Box = lbox) -> np.ndarray:
            return numpy_view(x.cpu())[b.slices()]
        out.append(Piece(name, state, dtype, shape, gbox, data))
    return out


def save(
    path: str | os.PathLike[str],
    state_dict: Mapping[str, Any],
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    module: torch.nn.Module | None = None,
    overwrite: bool = False,
) -> str:
    """Save a (DTensor) state dict as a universal checkpoint, one logical tensor per entry.

    Call on every rank: each writes the shards it owns (of replicas, only the
    copy at coordinate 0 of the replicated mesh dims), then rank 0 commits.
    Values are tensors (stored as ``fp32`` when float32, else ``param``) or
    mappings of state name -> tensor / number (numbers become scalars).
    ``optimizer`` + ``module`` add each parameter's optimizer state
    (``exp_avg``, ``exp_avg_sq``) and its ``step`` scalar.
    """
    import torch


    path = os.fspath(path)
    found = find_ranks()
    distributed = found is not None and found.source == "torch"  # ranks write together through torch.distributed
    rank, world = (found.rank, found.world) if found is not None and distributed else (0, 1)
    entries: dict[str, dict[str, Any]] = {}
    for name, v in state_dict.items():
        if isinstance(v, torch.Tensor):
            entries.setdefault(name, {})["fp32" if v.dtype == torch.float32 else "param"] = v
        elif isinstance(v, Mapping):
            entries.setdefault(name, {}).update(v)
        else:
            raise FormatError(f"state dict entry {name!r} is {type(v).__name__}; put non-tensors in extra=")
    if optimizer is not None:
        if module is None:
            raise FormatError("save(optimizer=...) needs module= to name the parameters")
        for name, st in optimizer_states(optimizer, module).items():
            entries.setdefault(name, {}).update(st)
        extra = {**dict(extra or {}), "optimizer": {"class": type(optimizer).__name__,
                                                    "param_groups": _hyperparameters(optimizer)}}
    pieces: list[Any] = []
    scalars: dict[str, dict[str, float | int]] = {}
    for name, states in entries.items():
        for sname, v in states.items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                pieces += _pieces(name, sname, v, rank)
            elif isinstance(v, torch.Tensor):
                scalars.setdefault(name, {})[sname] = v.item()
            elif isinstance(v, (int, float)):
                scalars.setdefault(name, {})[sname] = v
            else:
                raise FormatError(f"state {sname!r} of {name!r} is {type(v).__name__}, not a tensor or number")
    check_destination(path, overwrite)
    if not distributed:
        return write_universal(path, pieces, step=step, extra=extra, scalars=scalars, overwrite=overwrite,
                               provenance={"source": "torch", "world_size": 1})
    import torch.distributed as dist

    stage = staging_path(path)
    if rank == 0 and os.path.exists(stage):
        shutil.rmtree(stage)
    dist.barrier()
    write_rank(path, pieces, rank, scalars if rank == 0 else None)
    dist.barrier()
    status: list[str | None] = [None]
    if rank == 0:
        try:
            commit_universal(path, world, step, extra, (), {"source": "torch", "world_size": world},
                              overwrite=overwrite)
        except Exception as err:  # every rank must learn that the commit failed
            status = [f"{type(err).__name__}: {err}"]
    dist.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise FormatError(f"{path}: commit on rank 0 failed: {status[0]}")
    return path


# ---------------------------------------------------------------- training state for the Checkpointer

from ._train_state import load_train_state as load_train_state  # noqa: E402
from ._train_state import named_optimizer_state  # noqa: E402
from ._train_state import train_state as train_state  # noqa: E402

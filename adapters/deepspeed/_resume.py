"""Resume a live DeepSpeed engine straight from a checkpoint of another world size or ZeRO stage.

DeepSpeed resumes at a new data-parallel degree only through its universal
layout: ``ds_to_universal`` rewrites the whole checkpoint as one file per
parameter and state, then every rank of the new run loads *whole* parameters
and keeps its slice (``checkpoint/universal_checkpoint.py``). Here nothing is
converted: every rank reads, from the native checkpoint's own rank files, only
the elements of its new partition, straight into the engine's buffers::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    loaded = load_engine(engine, "run/ckpt")   # native ZeRO-1/2/3 (any world size), on every rank
    for step in range(engine.global_steps, total): ...

It fills what DeepSpeed 0.19.8's universal load fills, from the same places
(``base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir``,
``stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``,
``engine.load_checkpoint``):

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: each parameter's
  fragment of the rank's flat fp32 partition (the engine's own ``_hp_mapping``
  says which elements), the Adam moments in flat buffers of the partition's
  shape (zero where the partition is padding), the Adam ``step``; then the
  low-precision weights from the fp32 master (``update_lp_params``, an all-gather);
* ZeRO-3: each parameter's ``ceil(numel / dp)`` slice of every sub-group's flat
  fp32 partition and moments (zero-padded at the tail), the step, and the
  partitioned low-precision weights from the fp32 master;
* the optimizer hyper-parameters of every param group, gradient clipping and
  the loss scale, ``global_steps``/``global_samples``/``skipped_steps`` and the
  learning-rate scheduler; frozen parameters and module buffers (which
  DeepSpeed's universal load leaves as initialised) from the checkpoint too.

The source is any checkpoint ckptbridge opens whose tensors carry ``fp32``
weights (or ``param``) and, for the optimizer, ``exp_avg``/``exp_avg_sq`` and
a ``step``: a native DeepSpeed checkpoint of any stage and world size, a
universal directory, ``ds_to_universal`` output.

Tensor-parallel engines (Megatron-DeepSpeed, an ``mpu`` with TP > 1) load from
a checkpoint of any TP degree: each parameter's slice for this TP rank is a view
of the logical tensor, cut as DeepSpeed's universal load cuts it
(``universal_checkpoint.load_hp_checkpoint_state``): whole where the shapes
agree (replicated parameters), vocabulary parameters re-padded with zeros to
the engine's ``rows x TP``, parameters with two sub-parameters cut half by
half, the rest chunked along dimension 1 (row-parallel) or 0. Which is which
comes from ``universal_checkpoint_info`` (the engine module's, else the
checkpoint's), as Megatron-DeepSpeed records it; without it, from the one
dimension the shapes differ in. Pipeline engines (``PipelineModule``, also in
Megatron-DeepSpeed's TP x PP x DP layout) load the same way: each stage's engine
names its parameters as the checkpoint does (``<layer>.<name>``) and fills only
its own. MoE engines (``deepspeed.moe.layer.MoE``, ZeRO-1/2) load at any EP/DP: each expert
parameter reads the checkpoint tensor of its global expert id. Not supported: NVMe offload, ZeRO-3 MoE (DeepSpeed
itself refuses its MoE layer under stage 3; AutoEP engines are refused here), and the
``parameter_with_sub_params`` (``sub_param_shape``) and averaged layouts. Call it
on every rank (the ZeRO-1/2 weight update is a collective).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    Checkpoint,
    FormatError,
    LogicalTensor,
    OptionError,
    ShapeMismatchError,
    TensorNotFoundError,
    TensorState,
    as_checkpoint,
    concat,
    crop,
    flat_range_boxes,
    pad,
    read_state,
)

from ._moe import engine_expert_names

ADAM_STATES = ("exp_avg", "exp_avg_sq")
WEIGHTS = ("fp32", "param")


@dataclass(frozen=True)
class EngineLoad:
    """What :func:`load_engine` did on this rank.

    ``path``: the checkpoint read; ``step``: ``engine.global_steps`` after loading;
    ``client_state``: the checkpoint's non-DeepSpeed entries (as ``engine.load_checkpoint``
    returns them); ``bytes_read``: tensor bytes this rank read; ``seconds``: wall time.
    """

    path: str
    step: int | None
    client_state: Mapping[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Fill:
    """Flat elements ``[start, start + numel)`` of ``src`` (state ``state`` of tensor ``name``, as
    this rank holds it: a tensor-parallel slice in a TP engine) -> a 1-D destination."""

    name: str
    state: str
    src: TensorState
    start: int
    numel: int
    dst: Any  # a 1-D torch tensor of numel elements (float32)


@dataclass(frozen=True)
class _TP:
    """This rank's place in the engine's tensor parallelism and the patterns that say how each
    parameter is cut (``universal_checkpoint_info``: row-parallel, vocabulary, two sub-parameters)."""

    rank: int = 0
    size: int = 1
    info: Mapping[str, Any] = field(default_factory=dict)

    def matches(self, key: str, name: str) -> bool:
        return any(re.match(p, name) for p in self.info.get(key) or ())


def load_engine(
    engine: Any,
    source: str | os.PathLike[str] | Checkpoint,
    *,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    hyperparameters: str = "checkpoint",
    workers: int | None = None,
) -> EngineLoad:
    """Fill ``engine`` (a ``deepspeed.DeepSpeedEngine`` after ``deepspeed.initialize``) from ``source``.

    ``source``: a checkpoint path (a DeepSpeed root with ``latest``, a tag folder,
    or any format ckptbridge reads) or an open :class:`~ckptbridge.Checkpoint`;
    ``tag`` picks a tag under a DeepSpeed root. ``hyperparameters``:
    ``"checkpoint"`` sets each param group's hyper-parameters (lr, betas,
    weight decay ...) from the checkpoint, ``"config"`` keeps those the engine
    was built with. Every rank must call it. Returns an :class:`EngineLoad`.
    """
    if hyperparameters not in ("checkpoint", "config"):
        raise OptionError(f"load_engine: hyperparameters must be 'checkpoint' or 'config', got {hyperparameters!r}")
    t0 = time.perf_counter()
    ckpt, owned = as_checkpoint(source, None, **({"tag": tag} if tag else {})), not isinstance(source, Checkpoint)
    try:
        opt = engine.optimizer
        _check_supported(engine, opt, ckpt)
        tp = _tp_of(engine, ckpt)
        if hasattr(engine, "_optimizer_has_ckpt_event_prologue") and engine._optimizer_has_ckpt_event_prologue():
            opt.checkpoint_event_prologue()
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            _load_stage3(engine, opt, ckpt, tp, load_optimizer_states, workers)
        else:
            experts = engine_expert_names(engine) if getattr(engine, "has_moe_layers", False) else {}
            _load_stage12(opt, ckpt, tp, load_optimizer_states, workers, experts)
        _load_frozen_and_buffers(engine, ckpt, tp, workers)
        if load_optimizer_states:
            _load_hyperparameters(opt, ckpt, hyperparameters)
            _load_global_state(opt, ckpt)
        if hasattr(engine, "_optimizer_has_ckpt_event_epilogue") and engine._optimizer_has_ckpt_event_epilogue():
            opt.checkpoint_event_epilogue()
        if not hasattr(opt, "fp32_partitioned_groups_flat"):
            opt.update_lp_params()  # fp32 master -> bit16 partitions, all-gathered (as DeepSpeed's universal load)
        client = _load_engine_state(engine, ckpt, load_lr_scheduler_states)
        return EngineLoad(str(ckpt.path), getattr(engine, "global_steps", None), client,
                          ckpt.stats.bytes_read, time.perf_counter() - t0)
    finally:
        if owned:
            ckpt.close()


# ------------------------------------------------------------------ checks


def _check_supported(engine: Any, opt: Any, ckpt: Checkpoint) -> None:
    where = f"{ckpt.path}: load_engine"
    if opt is None:
        raise OptionError(f"{where}: the engine has no optimizer (build it with an optimizer config)")
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "optimizer_swapper", None) is not None:
        raise OptionError(f"{where}: NVMe-offloaded optimizer state is not supported")
    if getattr(engine, "has_moe_layers", False) and hasattr(opt, "fp32_partitioned_groups_flat"):
        raise OptionError(f"{where}: ZeRO-3 engines with MoE (expert-parallel) layers are not supported")
    known = hasattr(opt, "fp32_partitioned_groups_flat") or _lp_groups(opt) is not None
    if not known:
        raise OptionError(
            f"{where}: optimizer wrapper {type(opt).__name__} is not a ZeRO-1/2/3 or BF16_Optimizer "
            "(ZeRO stage 0 engines load with ckptbridge.adapters.torch.load_module / load_optimizer)")


def _tp_of(engine: Any, ckpt: Checkpoint) -> _TP:
    """The engine's tensor-parallel rank and degree (from its ``mpu``: a Megatron mpu or a pipeline
    engine's grid, asked as DeepSpeed's universal load asks it) and the patterns of its model's
    ``universal_checkpoint_info`` (else the checkpoint's)."""
    from deepspeed.utils.bwc import (
        bwc_tensor_model_parallel_rank,
        bwc_tensor_model_parallel_world_size,
    )

    mpu = getattr(engine, "mpu", None)
    rank, size = int(bwc_tensor_model_parallel_rank(mpu)), int(bwc_tensor_model_parallel_world_size(mpu))
    info = getattr(engine.module, "universal_checkpoint_info", None)
    if not isinstance(info, Mapping):
        extra = ckpt.index.extra if isinstance(ckpt.index.extra, Mapping) else {}
        info = extra.get("universal_checkpoint_info")
    info = dict(info) if isinstance(info, Mapping) else {}
    unsupported = [k for k in ("parameter_to_average_patterns", "parameter_with_sub_params") if info.get(k)]
    if size > 1 and unsupported:
        raise OptionError(f"{ckpt.path}: load_engine: universal_checkpoint_info uses {unsupported}; "
                          "cutting such tensor-parallel layouts is not supported")
    return _TP(rank, size, info)


def _local(ckpt: Checkpoint, name: str, key: str, shape: Sequence[int], tp: _TP) -> TensorState:
    """State ``key`` of tensor ``name`` as the engine's parameter of ``shape`` holds it on this
    tensor-parallel rank (a view; nothing is read), cut as DeepSpeed's universal load cuts it."""
    full = _tensor(ckpt, name).state(key)
    shape = tuple(int(s) for s in shape)
    where = f"{ckpt.path}: tensor {name!r}"
    if len(full.shape) == len(shape) and tp.matches("vocabulary_parameter_patterns", name):
        rows = shape[0] * tp.size  # re-padded with zero rows to the engine's vocabulary (rows x TP)
        if rows < full.shape[0]:
            raise ShapeMismatchError(f"{where} has {full.shape[0]} vocabulary rows; the engine's parameter "
                                     f"{shape} holds {rows} at tensor-parallel degree {tp.size}")
        full = pad(full, 0, rows)
    if tuple(full.shape) == shape:
        return full
    if tp.size == 1 or len(full.shape) != len(shape):
        raise ShapeMismatchError(f"{where} has shape {tuple(full.shape)}, the engine's parameter {shape}")
    two_sub = tp.matches("parameter_with_2_sub_params_cat_dim_0", name)
    if tp.info:  # as ds_to_universal's cat_dim: 1 for row-parallel parameters, else 0
        dims = [1 if tp.matches("parameter_with_row_parallelism_patterns", name) and not two_sub else 0]
    else:  # no patterns: the one dimension the shapes differ in
        dims = [k for k in range(len(shape)) if full.shape[k] != shape[k]]
    d = dims[0]
    if len(dims) != 1 or tuple(full.shape) != tuple(s * tp.size if k == d else s for k, s in enumerate(shape)):
        raise ShapeMismatchError(
            f"{where} has shape {tuple(full.shape)}; the engine's parameter {shape} is not its slice "
            f"for tensor-parallel rank {tp.rank} of {tp.size}")

    def chunk(state: TensorState, n: int, i: int) -> TensorState:
        size = state.shape[d] // n
        off = tuple(i * size if k == d else 0 for k in range(len(shape)))
        return crop(state, Box(off, tuple(size if k == d else s for k, s in enumerate(state.shape))))

    if two_sub:  # [a_0 .. a_tp-1, b_0 .. b_tp-1] (ds_to_universal's merge): this rank's a, then its b
        if full.shape[0] % (2 * tp.size):
            raise ShapeMismatchError(f"{where}: {full.shape[0]} rows are not two sub-parameters cut {tp.size} ways")
        return concat([chunk(chunk(full, 2, h), tp.size, tp.rank) for h in (0, 1)], 0)
    return chunk(full, tp.size, tp.rank)


def _lp_groups(opt: Any) -> list[list[Any]] | None:
    for attr in ("bit16_groups", "bf16_groups"):  # DeepSpeedZeroOptimizer, BF16_Optimizer
        if hasattr(opt, attr) and hasattr(opt, "optimizer"):
            return getattr(opt, attr)
    return None


def _tensor(ckpt: Checkpoint, name: str) -> LogicalTensor:
    t = ckpt.index.tensors.get(name)
    if t is None:
        near = [n for n in ckpt.index.tensors if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:4]
        raise TensorNotFoundError(
            f"{ckpt.path}: the engine's parameter {name!r} is not in the checkpoint "
            f"({len(ckpt.index.tensors)} tensors{'; similar: ' + str(near) if near else ''})")
    return t


def _weights(ckpt: Checkpoint, name: str) -> str:
    t = _tensor(ckpt, name)
    for s in WEIGHTS:
        if s in t.states:
            return s
    raise FormatError(f"{ckpt.path}: tensor {name!r} has no weights (states {sorted(t.states)})")


# ------------------------------------------------------------------ reading


def _numpy_out(dst: Any) -> tuple[np.ndarray, bool]:
    """A float32 numpy array to read into: ``dst``'s own memory on CPU, else a host buffer."""
    if dst.device.type == "cpu" and dst.is_contiguous():
        return dst.detach().numpy(), True
    return np.empty(dst.numel(), dtype=np.float32), False


def _read_fill(ckpt: Checkpoint, job: _Fill) -> int:
    """Read flat elements ``[start, start + numel)`` of a state into ``job.dst`` (row-major order)."""
    import torch

    tstate = job.src
    out, direct = _numpy_out(job.dst)
    label = f"{ckpt.path}: tensor {job.name!r} ({job.state})"
    off = 0
    for box in flat_range_boxes(tstate.shape, job.start, job.start + job.numel):
        read_state(tstate, box, ckpt.files, "float32", label, out=out[off:off + box.size].reshape(box.shape))
        off += box.size
    if not direct:
        job.dst.copy_(torch.from_numpy(out))
    return job.numel * 4


def _run(ckpt: Checkpoint, jobs: Sequence[_Fill], workers: int | None) -> None:
    if not jobs:
        return
    n = workers or ckpt.files.max_workers
    if n <= 1 or len(jobs) == 1:
        for j in jobs:
            _read_fill(ckpt, j)
        return
    with ThreadPoolExecutor(min(n, len(jobs))) as pool:
        list(pool.map(lambda j: _read_fill(ckpt, j), jobs))


def _state_for(ckpt: Checkpoint, name: str, key: str) -> str | None:
    t = _tensor(ckpt, name)
    if key == "fp32":
        return _weights(ckpt, name)
    return key if key in t.states else None


def _step_of(ckpt: Checkpoint, names: Sequence[str], where: str) -> float | None:
    steps = {float(ckpt.index.tensors[n].scalars["step"]) for n in names if "step" in ckpt.index.tensors[n].scalars}
    if len(steps) > 1:
        raise FormatError(f"{ckpt.path}: the parameters of {where} have different Adam steps {sorted(steps)}")
    return steps.pop() if steps else None


def _state_buffer(state: Mapping[str, Any], key: str, like: Any) -> Any:
    """The optimizer's ``key`` buffer for flat partition ``like`` (reused when it fits), not
    cleared: the reads overwrite it, and the caller zeroes what no read covers (padding). Zeroing
    it whole first cost a pass over fresh memory as long as the reads themselves (10 s of 22 s
    for the 6 GB of Adam moments of a 760 M-parameter model on a 2-core VM)."""
    import torch

    cur = state.get(key)
    if isinstance(cur, torch.Tensor) and cur.shape == like.shape and cur.dtype == like.dtype and cur.device == like.device:
        return cur.detach()
    return torch.empty_like(like, memory_format=torch.contiguous_format).detach()


def _zero_gaps(buf: Any, filled: Sequence[tuple[int, int]]) -> None:
    """Zero the elements of the 1-D ``buf`` outside the ``(start, numel)`` ranges the reads fill."""
    at = 0
    for start, numel in sorted(filled):
        if start > at:
            buf.narrow(0, at, start - at).zero_()
        at = max(at, start + numel)
    if buf.numel() > at:
        buf.narrow(0, at, buf.numel() - at).zero_()


def _step_value(opt: Any, hp: Any, step: float) -> Any:
    import torch

    cur = opt.optimizer.state.get(hp, {}).get("step") if hasattr(opt, "optimizer") else None
    if isinstance(cur, torch.Tensor):
        return torch.tensor(step, dtype=cur.dtype, device=cur.device)
    return torch.tensor(step, dtype=torch.float32)


# ------------------------------------------------------------------ ZeRO-1/2, BF16_Optimizer


def _load_stage12(opt: Any, ckpt: Checkpoint, tp: _TP, with_optimizer: bool, workers: int | None,
                  experts: Mapping[int, str]) -> None:
    """``experts``: the checkpoint name (global expert id) of each MoE expert parameter, by ``id``."""
    lp_groups = _lp_groups(opt) or []
    inner = opt.optimizer
    jobs: list[_Fill] = []
    links: list[tuple[Any, str, Any]] = []  # (lp mapping, key, view) to link after the reads
    for gi, group in enumerate(inner.param_groups):
        hp = group["params"][0]  # the rank's flat fp32 partition
        names = []
        buffers: dict[str, Any] = {}
        filled: dict[str, list[tuple[int, int]]] = {}
        for lp in lp_groups[gi]:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            name = experts.get(id(lp)) or opt.param_names[lp]
            names.append(name)
            lp_a, hp_a = mapping.lp_fragment_address, mapping.hp_fragment_address
            weights = _weights(ckpt, name)
            jobs.append(_Fill(name, weights, _local(ckpt, name, weights, lp.shape, tp), lp_a.start, lp_a.numel,
                              hp.detach().narrow(0, hp_a.start, hp_a.numel)))
            if not with_optimizer:
                continue
            for key in ADAM_STATES:
                src = _state_for(ckpt, name, key)
                if src is None:
                    continue
                if key not in buffers:
                    buffers[key] = _state_buffer(inner.state[hp], key, hp)
                view = buffers[key].narrow(0, hp_a.start, hp_a.numel)
                filled.setdefault(key, []).append((hp_a.start, hp_a.numel))
                jobs.append(_Fill(name, src, _local(ckpt, name, src, lp.shape, tp), lp_a.start, lp_a.numel, view))
                links.append((mapping, key, view))
        if with_optimizer:
            for key, buf in buffers.items():
                _zero_gaps(buf, filled.get(key, ()))  # the partition's padding
                inner.state[hp][key] = buf
            step = _step_of(ckpt, names, f"param group {gi}")
            if step is not None:
                inner.state[hp]["step"] = _step_value(opt, hp, step)
    _run(ckpt, jobs, workers)
    for mapping, key, view in links:  # what map_to_flat_opt_states links (safe_get_full_optimizer_state)
        if mapping.optim_fragment is None:
            mapping.optim_fragment = {}
        mapping.optim_fragment[key] = view
    if with_optimizer and hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = True


# ------------------------------------------------------------------ ZeRO-3


def _load_stage3(engine: Any, opt: Any, ckpt: Checkpoint, tp: _TP, with_optimizer: bool,
                 workers: int | None) -> None:
    from deepspeed import comm as dist

    inner = opt.optimizer
    jobs: list[_Fill] = []
    zero_tails: list[Any] = []
    for sg, params in enumerate(opt.fp16_groups):
        fp32 = opt.fp32_partitioned_groups_flat[sg]
        state = inner.state.get(fp32, {})
        targets = {"fp32": fp32.detach()}
        if with_optimizer:
            for key in ADAM_STATES:
                if all(_state_for(ckpt, opt.param_names[p], key) for p in params):
                    targets[key] = _state_buffer(state, key, fp32)
        offset = 0
        names = []
        for p in params:
            name = opt.param_names[p]
            names.append(name)
            group = opt._get_param_partition_group(p)
            rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
            numel = int(p.ds_numel)
            part = math.ceil(numel / world)
            a, b = min(numel, rank * part), min(numel, (rank + 1) * part)
            for key, buf in targets.items():
                src = str(_state_for(ckpt, name, key))
                view = _local(ckpt, name, src, p.ds_shape, tp)
                if b > a:
                    jobs.append(_Fill(name, src, view, a, b - a, buf.narrow(0, offset, b - a)))
                if part > b - a:
                    zero_tails.append(buf.narrow(0, offset + (b - a), part - (b - a)))
            offset += part
        if offset != fp32.numel():
            raise FormatError(
                f"{ckpt.path}: ZeRO-3 sub-group {sg} holds {fp32.numel()} elements, its parameters' "
                f"partitions {offset} (an unsupported ZeRO-3 partitioning)")
        if with_optimizer:
            for key in ADAM_STATES:
                if key in targets:
                    inner.state[fp32][key] = targets[key]
            step = _step_of(ckpt, names, f"sub-group {sg}")
            if step is not None:
                inner.state[fp32]["step"] = _step_value(opt, fp32, step)
    for t in zero_tails:
        t.zero_()
    _run(ckpt, jobs, workers)
    # as stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3: fp32 master -> partitioned weights
    for sg, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        if fp32.numel() > 0:
            opt.fp16_partitioned_groups_flat[sg].data.copy_(fp32.data)
    for sg in range(len(opt.fp16_partitioned_groups_flat)):
        updated = opt.unflatten(opt.fp16_partitioned_groups_flat[sg], opt.fp16_partitioned_groups[sg])
        for partitioned, q in zip(opt.fp16_partitioned_groups[sg], updated):
            partitioned.data = q.data


# ------------------------------------------------------------------ the rest of the state


def _load_frozen_and_buffers(engine: Any, ckpt: Checkpoint, tp: _TP, workers: int | None) -> None:
    """Parameters outside the optimizer (frozen) and module buffers, where the checkpoint has them."""
    from deepspeed import comm as dist

    jobs: list[_Fill] = []
    casts: list[Callable[[], None]] = []
    for name, p in engine.module.named_parameters():
        if p.requires_grad or name not in ckpt.index.tensors:
            continue
        if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's slice of the partitioned weight
            shape = p.ds_shape
            group = getattr(p, "ds_process_group", None)
            rank = dist.get_rank(group=group)
            numel, part = int(p.ds_numel), int(p.ds_tensor.ds_numel)
            a, b = min(numel, rank * part), min(numel, (rank + 1) * part)
            dst = p.ds_tensor.data.view(-1)
        else:
            shape, a, b, dst = p.shape, 0, p.numel(), p.data.view(-1)
        view = _local(ckpt, name, _weights(ckpt, name), shape, tp)
        if b > a:
            _fill_cast(ckpt, name, view, a, b, dst.narrow(0, 0, b - a), jobs, casts)
    for name, buf in engine.module.named_buffers():
        if name in ckpt.index.tensors and buf is not None and buf.is_floating_point():
            view = _local(ckpt, name, _weights(ckpt, name), buf.shape, tp)
            _fill_cast(ckpt, name, view, 0, buf.numel(), buf.data.view(-1), jobs, casts)
    _run(ckpt, jobs, workers)
    for c in casts:
        c()


def _fill_cast(ckpt: Checkpoint, name: str, src: TensorState, a: int, b: int, dst: Any, jobs: list[_Fill],
               casts: list[Callable[[], None]]) -> None:
    import torch

    state = _weights(ckpt, name)
    if dst.dtype == torch.float32:
        jobs.append(_Fill(name, state, src, a, b - a, dst))
        return
    tmp = torch.empty(b - a, dtype=torch.float32)
    jobs.append(_Fill(name, state, src, a, b - a, tmp))
    casts.append(lambda: dst.copy_(tmp))


def _load_hyperparameters(opt: Any, ckpt: Checkpoint, how: str) -> None:
    groups = ckpt.index.extra.get("param_groups") if isinstance(ckpt.index.extra, Mapping) else None
    if how == "config" or not groups:
        return
    live = opt.optimizer.param_groups
    if len(groups) != len(live):
        raise OptionError(
            f"{ckpt.path}: the checkpoint has {len(groups)} param groups, the engine {len(live)}; "
            "pass hyperparameters='config' to keep the engine's own")
    for group, saved in zip(live, groups):
        for k, v in (saved or {}).items():
            if k in ("params", "step", "name", "moe") or k not in group:  # name/moe: the engine's EP groups
                continue
            group[k] = tuple(v) if isinstance(group[k], tuple) and isinstance(v, list) else v


def _load_global_state(opt: Any, ckpt: Checkpoint) -> None:
    """Gradient clipping and the loss scale, as ``_load_global_state`` takes them from the checkpoint."""
    saved = ckpt.index.extra.get("optimizer") if isinstance(ckpt.index.extra, Mapping) else None
    if not isinstance(saved, Mapping):
        return
    clip = saved.get("clip_grad")
    if isinstance(clip, (int, float)) and hasattr(opt, "clip_grad") and not hasattr(opt, "fp32_partitioned_groups_flat"):
        opt.clip_grad = float(clip)
    for k in ("dynamic_loss_scale", "overflow"):
        if isinstance(saved.get(k), bool) and hasattr(opt, k):
            setattr(opt, k, saved[k])
    scaler = saved.get("loss_scaler")
    live = getattr(opt, "loss_scaler", None)
    if isinstance(scaler, Mapping) and live is not None:
        for k, v in scaler.items():
            if not k.startswith("__") and isinstance(v, (int, float, bool)) and hasattr(live, k):
                setattr(live, k, v)


def _load_engine_state(engine: Any, ckpt: Checkpoint, with_scheduler: bool) -> dict[str, Any]:
    extra = ckpt.index.extra if isinstance(ckpt.index.extra, Mapping) else {}
    steps = extra.get("global_steps", ckpt.step)
    if steps is not None:
        engine.global_steps = int(steps)
        batch = engine.train_batch_size() if hasattr(engine, "train_batch_size") else 0
        engine.global_samples = int(extra.get("global_samples") or engine.global_steps * batch)
    if extra.get("skipped_steps") is not None:
        engine.skipped_steps = int(extra["skipped_steps"])
    if extra.get("dp_world_size") is not None:
        engine.loaded_checkpoint_dp_world_size = int(extra["dp_world_size"])
    if extra.get("mp_world_size") is not None:
        engine.loaded_checkpoint_mp_world_size = int(extra["mp_world_size"])
    sched = extra.get("lr_scheduler")
    if with_scheduler and getattr(engine, "lr_scheduler", None) is not None and isinstance(sched, Mapping):
        engine.lr_scheduler.load_state_dict(dict(sched))
    return dict(extra.get("client_state") or {})

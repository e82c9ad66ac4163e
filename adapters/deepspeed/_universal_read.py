"""Read DeepSpeed's universal layout (``ds_to_universal`` output) in place.

A universal tag folder holds ``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``
(ZeRO-1/2 converter: ``{'param': full tensor, 'cat_dim': 0, ...}``; ZeRO-3
converter: a plain flat tensor), ``zero/<param>/step.pt`` (a 0-d tensor,
absent for ZeRO-3), ``zero/optimizer_state.pt`` and the model-states
file(s) copied from the source. Each state file is one contiguous tensor,
so every state is a single fragment::

    ckpt = ckptbridge.open("run/ckpt/global_step3_universal")
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckptbridge.adapters.torch_save import TensorRef, read_scalar, unpickled_to_json
from ckptbridge.plugin import (
    CheckpointIndex,
    FormatError,
    LogicalTensor,
    TensorState,
    check_name,
    contiguous_fragment,
    storage,
)

from ._common import FORMAT, get, hyper, open_archive, shape_of
from ._files import TagFiles

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def index_universal(files: TagFiles) -> CheckpointIndex:
    zero = storage.join(files.tag_dir, "zero")
    model_path = files.model.get(0) or files.zero3_model.get((0, 0))
    shapes: dict[str, tuple[int, ...]] = {}
    m0: Mapping[str, Any] = {}
    if model_path:
        m0 = open_archive(model_path, "model states").obj or {}
        for group in get(m0, "param_shapes") or []:
            for k, v in group.items():
                shapes[str(k)] = shape_of(v)
    opt = open_archive(storage.join(zero, "optimizer_state.pt"), "universal optimizer state")
    osd = opt.obj if isinstance(opt.obj, Mapping) else {}
    inner = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), Mapping) else None
    default_step = None
    if inner is not None:  # ZeRO-3 converter output: no step.pt, the step is in the optimizer state
        st0 = (inner.get("state") or {}).get(0) or {}
        if "step" in st0:
            default_step = read_scalar(opt, st0["step"])
    tensors: dict[str, LogicalTensor] = {}
    for name in sorted(storage.listdir(zero)):
        pdir = storage.join(zero, name)
        if not storage.isdir(pdir):
            continue
        check_name(name, pdir)
        states = {}
        for key in STATES:
            f = storage.join(pdir, f"{key}.pt")
            if not storage.exists(f):
                continue
            arch = open_archive(f, f"{name}/{key}")
            obj = arch.obj
            ref = obj.get("param") if isinstance(obj, Mapping) else obj
            if not isinstance(ref, TensorRef):
                raise FormatError(f"{f}: expected a tensor or {{'param': tensor}}")
            shape = shapes.get(name, ref.shape)
            if len(ref.shape) != 1 or math.prod(shape) != math.prod(ref.shape):
                shape = ref.shape  # a full tensor (param_shapes are per tensor-parallel shard)
            frag = arch.fragment(ref, name)
            if tuple(shape) != ref.shape:  # ZeRO-3 converter stores the flat tensor
                frag = contiguous_fragment(shape, arch.path, frag.location.offset, ref.dtype)
            states[key] = TensorState(ref.dtype, tuple(shape), (frag,))
        if not states:
            continue
        scalars = {}
        sfile = storage.join(pdir, "step.pt")
        if storage.exists(sfile):
            sarch = open_archive(sfile, f"{name}/step")
            scalars["step"] = read_scalar(sarch, sarch.obj)
        elif default_step is not None:
            scalars["step"] = default_step
        tensors[name] = LogicalTensor(name, states, scalars)
    pgs = osd.get("param_groups") or (inner or {}).get("param_groups") or []
    extra = {
        "param_groups": [hyper(g) for g in pgs] or None,
        "optimizer": unpickled_to_json({k: v for k, v in osd.items() if k not in (
            "param_groups", "optimizer_state_dict", "fp32_flat_groups")}),
    }
    for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_config", "ds_version",
              "dp_world_size"):
        if k in m0:
            extra[k] = unpickled_to_json(m0[k])
    step = get(m0, "global_steps")
    return CheckpointIndex(
        format=FORMAT, path=files.tag_dir, tensors=tensors,
        step=int(step) if step is not None else None, extra=extra,
        provenance={"source_format": FORMAT, "tag": files.tag, "layout": "universal"},
    )

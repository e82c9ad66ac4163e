"""Write DeepSpeed's universal checkpoint layout, which any DP degree / ZeRO stage resumes from.

``ckptbridge reshard SRC DST --to deepspeed-universal`` (or
:func:`write`) turns any checkpoint with ``fp32`` (or ``param``) weights
and, ideally, ``exp_avg``/``exp_avg_sq`` Adam moments into the folder that
DeepSpeed loads with ``{"checkpoint": {"load_universal": true}}``::

    <dst>/latest_universal                              the tag name
    <dst>/<tag>/zero/<param>/fp32.pt                    {'param': fp32 tensor, 'cat_dim': 0}
    <dst>/<tag>/zero/<param>/exp_avg.pt, exp_avg_sq.pt  the same for the Adam moments
    <dst>/<tag>/zero/<param>/step.pt                    0-d tensor (the Adam step)
    <dst>/<tag>/zero/optimizer_state.pt                 global optimizer state + param_groups
    <dst>/<tag>/mp_rank_00_model_states.pt              what ZeRO-0/1/2 engines look for
    <dst>/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same file for ZeRO-3 engines

then, in the training script::

    engine.load_checkpoint("<dst>")   # config: "checkpoint": {"load_universal": true}

What DeepSpeed 0.19.8 reads (``base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir``,
``checkpoint/universal_checkpoint.py:load_hp_checkpoint_state``,
``stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``, ``engine._load_checkpoint``):
the per-parameter files (full, unpartitioned; ZeRO-1/2 and ZeRO-3 both accept the
``{'param': ...}`` dict), ``optimizer_state.pt`` (ZeRO-1/2: ``ds_version``,
``param_groups`` hyper-parameters, optional ``clip_grad``; ZeRO-3:
``optimizer_state_dict.state[0].step`` and ``optimizer_state_dict.param_groups``),
and one model-states file whose name depends on the *target* stage; writing both
names (one hard link) is what lets a ZeRO-1/2 checkpoint resume under ZeRO-3 and
back, which DeepSpeed's own ``ds_to_universal`` output cannot.

The ``.pt`` files are written without torch (``ckptbridge.adapters.torch_save`` lays out the
``torch.save`` zip archive itself, as torch does), so this writer needs neither torch nor
DeepSpeed. All of them go through the core's direct-I/O pipeline
(``ckptbridge.plugin.write_files``, as ``convert`` writes its own layout): each tensor is
read from the source's fragments in row blocks straight into page-aligned buffers and written with ``O_DIRECT`` while the next blocks are read, one
file after another with no drain between them, each fsynced; memory stays at the
pipeline's few buffers whatever the tensor sizes. The destination is built in a staging
directory and published atomically (``ckptbridge.plugin.staged_dir``); an existing ``dst``
is replaced (``overwrite``) only once the new one is complete, and kept when writing fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptbridge.adapters.torch_save import Size, Tensor, torch_stream
from ckptbridge.plugin import (
    Checkpoint,
    Filler,
    FormatError,
    StreamFile,
    TensorView,
    staged_dir,
    write_files,
)

from ._format import DeepSpeedUniversalWriteOptions

FORMAT = "deepspeed-universal"
OPTIM_STATES = ("exp_avg", "exp_avg_sq")


def _weights(ckpt: Checkpoint, name: str) -> TensorView | None:
    t = ckpt.tensors[name]
    for s in ("fp32", "param"):
        if s in t.states:
            return TensorView(ckpt, t, s)
    return None


def _fp32(view: TensorView) -> Tensor:
    """The state as float32, read (in row blocks) only when its bytes are written."""
    return Tensor(Filler(view, "float32"), "float32", tuple(view.shape))


def _native(view: TensorView) -> Tensor:
    """The state in its own dtype, read (in row blocks) only when its bytes are written."""
    return Tensor(Filler(view), view.dtype, tuple(view.shape))


def _step_value(ckpt: Checkpoint) -> float | None:
    steps = {t.scalars["step"] for t in ckpt.tensors.values() if "step" in t.scalars}
    return float(max(steps)) if steps else None


def write(ckpt: Checkpoint, dst: str, options: DeepSpeedUniversalWriteOptions | None = None) -> str:
    """Write ``ckpt`` as a DeepSpeed universal checkpoint root at ``dst``; return ``dst``."""
    o = options or DeepSpeedUniversalWriteOptions()
    step = ckpt.step
    tag = o.tag or f"global_step{step if step is not None else 0}"
    with staged_dir(os.fspath(dst), overwrite=o.overwrite, fsync=False) as stage:  # each file fsynced as written
        _write(ckpt, stage, tag, o.workers)
    return os.fspath(dst)


def _write(ckpt: Checkpoint, tmp: str, tag: str, workers: int | None) -> None:
    zero = os.path.join(tmp, tag, "zero")
    os.makedirs(zero)

    names = [n for n in ckpt.tensors if _weights(ckpt, n) is not None]
    if not names:
        raise FormatError(f"{ckpt.path}: no tensor has fp32 or param weights to write")
    adam_step = _step_value(ckpt)

    layout = _tp_layout(ckpt)
    files: list[StreamFile] = []
    for name in names:
        t = ckpt.tensors[name]
        if "/" in name or name.startswith("."):
            raise FormatError(f"{ckpt.path}: tensor name {name!r} cannot be a DeepSpeed universal folder")
        pdir = os.path.join(zero, name)
        os.makedirs(pdir, exist_ok=True)
        meta = layout(name)
        w = _weights(ckpt, name)
        views = {"fp32": w, **{s: TensorView(ckpt, t, s) for s in OPTIM_STATES if s in t.states}}
        for s, view in views.items():
            if view is not None:  # names holds only tensors with weights
                files.append(torch_stream({"param": _fp32(view), **meta}, os.path.join(pdir, f"{s}.pt")))
        if "step" in t.scalars and len(views) > 1:
            step_t = Tensor(np.array(float(t.scalars["step"]), dtype=np.float32), "float32")
            files.append(torch_stream(step_t, os.path.join(pdir, "step.pt")))
    tag_dir = os.path.join(tmp, tag)
    files.append(_optimizer_state(ckpt, zero, adam_step))
    files.append(_model_states(ckpt, os.path.join(tag_dir, _MODEL_STATES), names))
    write_files(files, producers=workers)
    _link_model_states(tag_dir)
    with open(os.path.join(tmp, "latest_universal"), "w", encoding="utf-8") as fh:
        fh.write(tag)
        fh.flush()
        os.fsync(fh.fileno())


def _tp_layout(ckpt: Checkpoint) -> Any:
    """Per tensor, the keys DeepSpeed's loader uses to re-split for tensor parallelism.

    From the source's layout rules: ``cat_dim`` (1 for row-parallel ``Shard(dim=1)``),
    ``vocab_tensor`` for vocabulary padding (``Pad``), so a Megatron-DeepSpeed target with
    TP > 1 cuts and re-pads each tensor as ``ds_to_universal`` output would tell it to.
    """
    import re

    rules = [r for r in ckpt.rules if isinstance(r, Mapping)]

    def layout(name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"cat_dim": 0}
        for r in rules:
            tp_rule = r.get("axis") == "tp" and r.get("rule") in ("Shard", "Replicate")
            if tp_rule and re.search(str(r.get("pattern")), name):
                out["cat_dim"] = int(r.get("dim", 0)) if r["rule"] == "Shard" else 0
                break
        for r in rules:
            if r.get("rule") == "Pad" and re.search(str(r.get("pattern")), name):
                out["vocab_tensor"] = True
        return out

    return layout


def _param_groups(ckpt: Checkpoint) -> list[dict[str, Any]]:
    groups = ckpt.extra.get("param_groups") if isinstance(ckpt.extra, Mapping) else None
    out = []
    for g in groups or []:
        if isinstance(g, Mapping):
            h = {k: v for k, v in g.items() if k != "params"}
            if isinstance(h.get("betas"), list):
                h["betas"] = tuple(h["betas"])
            out.append(h)
    return out


def _ds_version(ckpt: Checkpoint) -> str:
    v = ckpt.extra.get("ds_version") if isinstance(ckpt.extra, Mapping) else None
    if isinstance(v, str) and v:
        return v
    try:
        import deepspeed

        return str(deepspeed.__version__)
    except Exception:  # DeepSpeed is not needed to write; any version >= 0.3.17 loads
        return "0.19.8"


def _optimizer_state(ckpt: Checkpoint, zero: str, step: float | None) -> StreamFile:
    groups = _param_groups(ckpt)
    opt = (ckpt.extra.get("optimizer") if isinstance(ckpt.extra, Mapping) else None) or {}
    sd: dict[str, Any] = {"ds_version": _ds_version(ckpt), "param_groups": groups}
    for k in ("clip_grad", "overflow"):
        if isinstance(opt, Mapping) and isinstance(opt.get(k), (int, float, bool)):
            sd[k] = opt[k]
    # ZeRO-3 engines read the step and hyper-parameters from a torch-style optimizer state dict,
    # and copy param_groups[0] into *every* group (stage3.py, DeepSpeed 0.19.8). Giving them only
    # the hyper-parameters all groups share keeps per-group ones (weight_decay 0 for the no-decay
    # group) as the resuming script configured them instead of overwriting them with group 0's.
    common = {k: v for k, v in (groups[0] if groups else {}).items()
              if all(k in g and g[k] == v for g in groups[1:])}
    inner_state = {} if step is None else {0: {"step": Tensor(np.array(step, dtype=np.float32), "float32")}}
    sd["optimizer_state_dict"] = {"state": inner_state, "param_groups": [common]}
    return torch_stream(sd, os.path.join(zero, "optimizer_state.pt"))


_MODEL_STATES = "mp_rank_00_model_states.pt"  # what ZeRO-0/1/2 engines load; ZeRO-3 engines: the link


def _model_states(ckpt: Checkpoint, path: str, names: list[str]) -> StreamFile:
    extra = ckpt.extra if isinstance(ckpt.extra, Mapping) else {}
    module = {}
    for n in names:
        t = ckpt.tensors[n]
        w = _weights(ckpt, n)
        state = "param" if "param" in t.states or w is None else w.state_name
        view = TensorView(ckpt, t, state)
        module[n] = _native(view)
    steps = ckpt.step if ckpt.step is not None else 0
    sd: dict[str, Any] = {
        "module": module,
        "buffer_names": list(extra.get("buffer_names") or []),
        "optimizer": None,
        "param_shapes": [{n: Size(ckpt.tensors[n].shape) for n in names}],
        "frozen_param_shapes": {},
        "frozen_param_fragments": {},
        "shared_params": dict(extra.get("shared_params") or {}),
        "lr_scheduler": extra.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(extra.get("skipped_steps") or 0),
        "global_steps": int(steps),
        "global_samples": int(extra.get("global_samples") or 0),
        "dp_world_size": int(extra.get("dp_world_size") or 1),
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": extra.get("ds_config"),
        "ds_version": _ds_version(ckpt),
        "ckptbridge_source": {"path": str(ckpt.path), "format": str(ckpt.format)},
    }
    for k, v in (extra.get("client_state") or {}).items():
        sd.setdefault(k, v)
    return torch_stream(sd, path)


def _link_model_states(tag_dir: str) -> None:
    """The same model-states file under the name ZeRO-3 engines load (a hard link where possible)."""
    first = os.path.join(tag_dir, _MODEL_STATES)
    second = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    try:
        os.link(first, second)
    except OSError:
        shutil.copyfile(first, second)
        fd = os.open(second, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

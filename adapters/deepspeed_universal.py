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

torch is imported lazily (only ``torch.save`` is used, for the format DeepSpeed expects).
The destination is written to ``<dst>.partial`` and renamed at the end; an existing
``dst`` is never touched.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptbridge._checkpoint import Checkpoint, TensorView
from ckptbridge._errors import CheckpointError, FormatError

FORMAT = "deepspeed-universal"
OPTIM_STATES = ("exp_avg", "exp_avg_sq")


def _torch() -> Any:
    try:
        import torch
    except ModuleNotFoundError:  # pragma: no cover - depends on the environment
        raise CheckpointError(
            "writing DeepSpeed's universal layout needs torch (pip install 'ckptbridge[torch]')"
        ) from None
    return torch


def _weights(ckpt: Checkpoint, name: str) -> TensorView | None:
    t = ckpt.tensors[name]
    for s in ("fp32", "param"):
        if s in t.states:
            return TensorView(ckpt, t, s)
    return None


def _tensor(torch: Any, view: TensorView) -> Any:
    arr = view.read(dtype="float32")
    return torch.from_numpy(arr)


def _step_value(ckpt: Checkpoint) -> float | None:
    steps = {t.scalars.get("step") for t in ckpt.tensors.values() if "step" in t.scalars}
    steps.discard(None)
    return float(max(steps)) if steps else None


def write(ckpt: Checkpoint, dst: str, *, tag: str | None = None, workers: int | None = None,
          overwrite: bool = False, **options: Any) -> str:
    """Write ``ckpt`` as a DeepSpeed universal checkpoint root at ``dst``; return ``dst``.

    ``tag`` defaults to ``global_step<step>``. Layout options (``dp``, ``world_size``,
    ``zero_stage``...) are accepted and ignored: the universal layout is the same for
    every target; DeepSpeed partitions it when it loads.
    """
    torch = _torch()
    dst = os.fspath(dst)
    if os.path.lexists(dst):
        if not overwrite:
            raise FileExistsError(f"{dst} already exists; choose a new destination (or pass overwrite)")
    step = ckpt.step
    tag = tag or f"global_step{step if step is not None else 0}"
    if os.sep in tag or tag in ("", ".", ".."):
        raise ValueError(f"invalid tag {tag!r}")
    tmp = dst + ".partial"
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    zero = os.path.join(tmp, tag, "zero")
    os.makedirs(zero)

    names = [n for n in ckpt.tensors if _weights(ckpt, n) is not None]
    if not names:
        raise FormatError(f"{ckpt.path}: no tensor has fp32 or param weights to write")
    adam_step = _step_value(ckpt)

    def one(name: str) -> int:
        t = ckpt.tensors[name]
        if "/" in name or name.startswith("."):
            raise FormatError(f"{ckpt.path}: tensor name {name!r} cannot be a DeepSpeed universal folder")
        pdir = os.path.join(zero, name)
        os.makedirs(pdir, exist_ok=True)
        w = _weights(ckpt, name)
        assert w is not None
        nbytes = 0
        torch.save({"param": _tensor(torch, w), "cat_dim": 0}, os.path.join(pdir, "fp32.pt"))
        nbytes += math.prod(w.shape) * 4
        for s in OPTIM_STATES:
            if s in t.states:
                torch.save({"param": _tensor(torch, TensorView(ckpt, t, s)), "cat_dim": 0},
                           os.path.join(pdir, f"{s}.pt"))
                nbytes += math.prod(w.shape) * 4
        if "step" in t.scalars and any(s in t.states for s in OPTIM_STATES):
            torch.save(torch.tensor(float(t.scalars["step"])), os.path.join(pdir, "step.pt"))
        return nbytes

    try:
        with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1)) as pool:
            list(pool.map(one, names))
        _write_optimizer_state(torch, ckpt, zero, adam_step)
        _write_model_states(torch, ckpt, os.path.join(tmp, tag), names)
        with open(os.path.join(tmp, "latest_universal"), "w", encoding="utf-8") as fh:
            fh.write(tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(dst):  # overwrite=True
        shutil.rmtree(dst)
    os.rename(tmp, dst)
    return dst


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
        import deepspeed  # noqa: F401  (only for its version string)

        return str(deepspeed.__version__)
    except Exception:  # DeepSpeed is not needed to write; any version >= 0.3.17 loads
        return "0.19.8"


def _write_optimizer_state(torch: Any, ckpt: Checkpoint, zero: str, step: float | None) -> None:
    groups = _param_groups(ckpt)
    opt = (ckpt.extra.get("optimizer") if isinstance(ckpt.extra, Mapping) else None) or {}
    sd: dict[str, Any] = {"ds_version": _ds_version(ckpt), "param_groups": groups}
    for k in ("clip_grad", "overflow"):
        if isinstance(opt, Mapping) and isinstance(opt.get(k), (int, float, bool)):
            sd[k] = opt[k]
    # ZeRO-3 engines read the step and hyper-parameters from a torch-style optimizer state dict.
    inner_state = {} if step is None else {0: {"step": torch.tensor(step)}}
    sd["optimizer_state_dict"] = {"state": inner_state, "param_groups": groups or [{}]}
    torch.save(sd, os.path.join(zero, "optimizer_state.pt"))


def _write_model_states(torch: Any, ckpt: Checkpoint, tag_dir: str, names: list[str]) -> None:
    extra = ckpt.extra if isinstance(ckpt.extra, Mapping) else {}
    module = {}
    for n in names:
        t = ckpt.tensors[n]
        view = TensorView(ckpt, t, "param" if "param" in t.states else _weights(ckpt, n).state_name)
        arr = view.read()
        module[n] = torch.from_numpy(arr) if arr.dtype.kind in "fiub" and arr.dtype.name != "bfloat16" \
            else torch.from_numpy(view.read(dtype="float32")).to(torch.bfloat16)
    steps = ckpt.step if ckpt.step is not None else 0
    sd: dict[str, Any] = {
        "module": module,
        "buffer_names": list(extra.get("buffer_names") or []),
        "optimizer": None,
        "param_shapes": [{n: torch.Size(ckpt.tensors[n].shape) for n in names}],
        "frozen_param_shapes": {},
        "frozen_param_fragments": {},
        "shared_params": dict(extra.get("shared_params") or {}),
        "lr_scheduler": extra.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
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
    first = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    torch.save(sd, first)
    second = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    try:
        os.link(first, second)
    except OSError:
        shutil.copyfile(first, second)

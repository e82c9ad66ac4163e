"""Where a DeepSpeed checkpoint keeps its files (DeepSpeed 0.19 naming).

A checkpoint *root* holds ``latest`` (the tag name) and one folder per tag;
a *tag folder* (``global_step3``) holds, following ``runtime/engine.py``
(``_get_ckpt_name``, ``_get_rank_zero_ckpt_name``) and
``checkpoint/reshape_utils.py`` (``sort_zero_files``)::

    mp_rank_{mp:02d}_model_states.pt                        ZeRO-0/1/2: module, param_shapes, ...
    zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt      ZeRO-3: one per dp rank
    [bf16_|fp16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   one per dp rank
    layer_{idx:02d}[-model_{tp:02d}]-model_states.pt        pipeline engine: weights per layer (the
                                                            ``-model_XX`` part only with tensor parallelism)

``mp`` enumerates the model-parallel slots pipeline-major, ``mp = pp * tp_degree + tp``
(``meg_2d_parallel_map.simple_init``); ``dp`` is the data-parallel (ZeRO) rank.

DeepSpeed's universal layout (``ds_to_universal`` output, ``load_universal: true``)
is a tag folder with ``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`` and
``zero/optimizer_state.pt``; its root names it in ``latest_universal``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ckptbridge.plugin import FormatError, MissingShardError, storage

OPTIM_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")


@dataclass(frozen=True)
class TagFiles:
    """The files of one tag folder, keyed by rank numbers parsed from their names."""

    tag_dir: str
    tag: str
    optim: dict[tuple[int, int], str]  # (mp, dp) -> path
    optim_prefix: str  # "", "bf16_" or "fp16_"
    model: dict[int, str]  # mp -> mp_rank_XX_model_states.pt
    zero3_model: dict[tuple[int, int], str]  # (mp, dp) -> zero_pp_rank_..._model_states.pt
    layers: dict[tuple[int, int], str]  # (layer, tp) -> layer file
    universal: bool  # a ds_to_universal-style folder (zero/<param>/...)


def _read_text(path: str) -> str:
    return storage.read_text(path).strip()


def resolve_tag_dir(path: str, tag: str | None = None) -> str:
    """The tag folder for ``path``: itself, or ``path/<tag>`` / ``path/<latest>``.

    Raises :class:`MissingShardError` when ``latest`` names a folder that is absent.
    """
    path = os.fspath(path)
    if tag is not None:
        cand = storage.join(path, tag)
        if not storage.isdir(cand):
            raise MissingShardError(f"{path}: no tag folder {tag!r}")
        return cand
    if _is_tag_dir(path):
        return path
    for marker in ("latest", "latest_universal"):
        mfile = storage.join(path, marker)
        if storage.isfile(mfile):
            name = _read_text(mfile)
            cand = storage.join(path, name)
            if not storage.isdir(cand):
                raise MissingShardError(
                    f"{mfile} names tag {name!r} but {cand} does not exist (pass tag=... or the tag folder)"
                )
            return cand
    raise FormatError(f"{path}: not a DeepSpeed checkpoint (no 'latest' file and no rank files)")


def _is_tag_dir(path: str) -> bool:
    try:
        names = storage.listdir(path)
    except OSError:
        return False
    if any(OPTIM_RE.match(n) or MODEL_RE.match(n) or ZERO3_MODEL_RE.match(n) for n in names):
        return True
    return storage.isfile(storage.join(path, "zero", "optimizer_state.pt"))


def looks_like_deepspeed(path: str) -> bool:
    """Cheap test used by ``detect``: never raises."""
    try:
        if storage.isfile(path):
            return False
        if _is_tag_dir(path):
            return True
        for marker in ("latest", "latest_universal"):
            mfile = storage.join(path, marker)
            if storage.isfile(mfile) and storage.getsize(mfile) < 4096:
                name = _read_text(mfile)
                target = storage.join(path, name)
                if _is_tag_dir(target):
                    return True
                # 'latest' naming a tag that is gone: claim it so that index() can say which
                if name and "\n" not in name and os.sep not in name and not storage.exists(target):
                    return True
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return False


def list_tag_files(tag_dir: str) -> TagFiles:
    names = sorted(storage.listdir(tag_dir))
    optim: dict[tuple[int, int], str] = {}
    prefixes = set()
    model: dict[int, str] = {}
    zero3_model: dict[tuple[int, int], str] = {}
    layers: dict[tuple[int, int], str] = {}
    for n in names:
        full = storage.join(tag_dir, n)
        if m := OPTIM_RE.match(n):
            prefixes.add(m.group(1) or "")
            optim[(int(m.group(3)), int(m.group(2)))] = full
        elif m := ZERO3_MODEL_RE.match(n):
            zero3_model[(int(m.group(2)), int(m.group(1)))] = full
        elif m := MODEL_RE.match(n):
            model[int(m.group(1))] = full
        elif m := LAYER_RE.match(n):
            layers[(int(m.group(1)), int(m.group(2) or 0))] = full
    if len(prefixes) > 1:
        raise FormatError(f"{tag_dir}: optimizer files with mixed prefixes {sorted(prefixes)}")
    universal = not optim and storage.isfile(storage.join(tag_dir, "zero", "optimizer_state.pt"))
    return TagFiles(
        tag_dir=tag_dir,
        tag=storage.basename(tag_dir),
        optim=optim,
        optim_prefix=next(iter(prefixes), ""),
        model=model,
        zero3_model=zero3_model,
        layers=layers,
        universal=universal,
    )


def optim_file_name(prefix: str, dp: int, mp: int) -> str:
    return f"{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


def require_grid(files: TagFiles, mp_degree: int, dp_degree: int) -> None:
    """Every (mp, dp) optimizer file must exist; the error names each missing rank file."""
    missing = [
        (mp, dp, optim_file_name(files.optim_prefix, dp, mp))
        for mp in range(mp_degree)
        for dp in range(dp_degree)
        if (mp, dp) not in files.optim
    ]
    if missing:
        listed = ", ".join(f"{name} (dp rank {dp}, mp rank {mp})" for mp, dp, name in missing)
        raise MissingShardError(
            f"{files.tag_dir}: {len(missing)} of {mp_degree * dp_degree} ZeRO rank files are missing: "
            f"{listed}. The checkpoint was saved with dp={dp_degree}, mp={mp_degree}; copy the missing "
            "file(s) from the training job's storage."
        )

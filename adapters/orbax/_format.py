"""What format detection needs of Orbax checkpoints, cheap to import: :func:`detect` (and the
layout it looks for: PyTree items, CheckpointManager steps and roots) and the options classes
(the reader and writer are imported on first use, see the package)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptbridge.plugin import OpenOptions, OptionError, WriteOptions, storage

PYTREE_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
_TMP_MARK = ".orbax-checkpoint-tmp"


def _is_item_dir(path: str) -> bool:
    if not storage.isdir(path):
        return False
    if storage.isfile(storage.join(path, PYTREE_METADATA)):
        return True
    if storage.isfile(storage.join(path, OCDBT_MANIFEST)):
        return True
    try:  # an old Orbax item without _METADATA: per-array Zarr directories
        names = sorted(storage.listdir(path))[:256]
    except OSError:
        return False
    return any(storage.isfile(storage.join(path, n, m)) for n in names for m in (".zarray", "zarr.json"))


def _item_dirs(step_dir: str) -> list[str]:
    try:
        names = sorted(storage.listdir(step_dir))
    except OSError:
        return []
    return [n for n in names if not n.startswith(".") and _is_item_dir(storage.join(step_dir, n))]


def _is_step_dir(path: str) -> bool:
    """A CheckpointManager step directory: item directories inside, and ``_CHECKPOINT_METADATA``
    or (Orbax before 0.4.3 wrote none) a step number as its name."""
    named = storage.isfile(storage.join(path, CHECKPOINT_METADATA)) or \
        _step_number(storage.basename(path)) is not None
    return named and bool(_item_dirs(path))


def _step_number(name: str) -> int | None:
    m = re.fullmatch(r"(?:.*?_)?(\d+)", name)
    return int(m.group(1)) if m and _TMP_MARK not in name else None


def _steps(root: str) -> dict[int, str]:
    out = {}
    try:
        names = storage.listdir(root)
    except OSError:
        return {}
    for n in names:
        step = _step_number(n)
        full = storage.join(root, n)
        if step is not None and storage.isdir(full) and (
            storage.isfile(storage.join(full, CHECKPOINT_METADATA)) or _is_item_dir(full) or _item_dirs(full)
        ):
            out[step] = full
    return out


def detect(path: str) -> bool:
    """True for an Orbax PyTree directory, a CheckpointManager step directory or its root."""
    try:
        if not storage.isdir(path):
            return False
        if _is_item_dir(path):
            return True
        if _is_step_dir(path):
            return True
        return bool(_steps(path))
    except OSError:
        return False


@dataclass(frozen=True)
class OrbaxOpenOptions(OpenOptions):
    """Opening an Orbax checkpoint.

    ``step``: the step of a CheckpointManager root (default: the latest).
    ``layout``: ``auto`` groups a Flax/optax train state onto the universal states; ``raw`` keeps Orbax's tree names.
    """

    step: int | None = None
    layout: str = "auto"


@dataclass(frozen=True)
class OrbaxWriteOptions(WriteOptions):
    """Writing an Orbax ``StandardCheckpointer`` directory (defaults are Orbax's own).

    ``layout``: ``train_state`` writes ``{"params", "opt_state": {"count", "mu", "nu"}, "step"}`` (the optimizer part when Adam moments exist); ``flat`` only the weights, nested by ``/``.
    ``state``: the weights' state (default ``fp32``, else ``param``).
    ``compression``: zstd-compress the chunks (Orbax's default).
    ``ocdbt``: one OCDBT database instead of a directory per array.
    ``zarr3``: Zarr v3 arrays instead of v2.
    ``chunk_bytes``: the largest chunk written (chunks stream, a few in flight).
    """

    layout: str = "train_state"
    state: str | None = None
    compression: bool = True
    ocdbt: bool = True
    zarr3: bool = False
    chunk_bytes: int = 64 << 20

    def validate(self) -> None:
        if self.layout not in ("train_state", "flat"):
            raise OptionError(f"format 'orbax' (write): layout must be train_state or flat, got {self.layout!r}")
        if self.chunk_bytes < 1:
            raise OptionError(f"format 'orbax' (write): chunk_bytes must be positive, got {self.chunk_bytes}")

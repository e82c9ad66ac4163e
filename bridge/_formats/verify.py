"""``verify``: is every byte of a checkpoint there (and intact, where checksums were recorded)?

Universal directories are checked against their commit marker, safetensors
headers and per-fragment checksums (:func:`ckptbridge._formats.universal.verify`). Every
other format is checked by reading every fragment of every state once,
streaming: a missing rank file, a truncated or unreadable one is reported with
the file, tensor and state, and nothing is held in memory::

    problems = verify_checkpoint(ckptbridge.open("run/global_step3"))   # [] when complete
"""

from __future__ import annotations

import numpy as np

from .. import _dtypes
from .._errors import CheckpointError
from .._read.checkpoint import Checkpoint
from .._read.executor import read_state
from .._read.model import Box
from .universal import verify as verify_universal

_CHUNK = 64 << 20


def verify_checkpoint(ckpt: Checkpoint) -> list[str]:
    """Every problem found in ``ckpt`` (empty: complete and, where recorded, intact)."""
    if ckpt.format == "universal":
        return verify_universal(ckpt.path, ckpt.files)
    problems: list[str] = []
    for name, t in ckpt.tensors.items():
        for sname, st in t.states.items():
            try:
                for box in _chunks(st.shape, _dtypes.itemsize(st.dtype)):
                    read_state(st, box, ckpt.files, name=f"{ckpt.path}: tensor {name!r} state {sname!r}")
            except (CheckpointError, OSError) as err:
                problems.append(f"tensor {name!r} state {sname!r}: {err}")
    return problems


def _chunks(shape: tuple[int, ...], itemsize: int) -> list[Box]:
    """Row blocks of at most ~64 MiB covering ``shape`` (the whole tensor when small or 0-d)."""
    if not shape or int(np.prod(shape)) * itemsize <= _CHUNK:
        return [Box.full(shape)]
    row = int(np.prod(shape[1:])) * itemsize or 1
    rows = max(1, _CHUNK // row)
    return [Box((lo, *(0,) * (len(shape) - 1)), (min(rows, shape[0] - lo), *shape[1:]))
            for lo in range(0, shape[0], rows)]

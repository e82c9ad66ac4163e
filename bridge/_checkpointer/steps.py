"""The checkpointer's directory of steps: naming, discovery, retention and clean-up.

``root/step_<N>`` is a universal directory; it counts only once its commit
marker exists. Staging directories (``step_<N>.partial.<job>``) of crashed
writers are removed; those of live writers (another job sharing the root) stay.
The data files of a step that retention drops may be kept in ``root/.reuse``
for the next save to overwrite (:func:`retire_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Collection, Sequence

from .._errors import CheckpointError, IncompleteCheckpointError
from .._formats.universal import MARKER
from .._storage.commit import PARTIAL

STEP_DIR = re.compile(r"^step_(\d{8,})$")

log = logging.getLogger("ckptbridge.checkpointer")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def committed_steps(root: str) -> list[int]:
    """Steps under ``root`` whose checkpoint is complete (marker present), ascending."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, MARKER)):
            out.append(int(m.group(1)))
    return sorted(out)


def steps_to_drop(steps: Sequence[int], keep_last: int | None, keep_every: int | None) -> list[int]:
    """Which committed steps retention removes (pure): all but the newest ``keep_last`` and the
    multiples of ``keep_every``; nothing when ``keep_last`` is None."""
    if keep_last is None:
        return []
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def remove_checkpoint(path: str) -> None:
    """Delete a committed checkpoint: marker first, so a crash midway never leaves a 'complete' one."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, MARKER))
    shutil.rmtree(path, ignore_errors=True)


def reuse_dir(root: str) -> str:
    """Where dropped steps' data files wait to be overwritten by the next save."""
    return os.path.join(root, ".reuse")


def retire_checkpoint(path: str, pool: str) -> None:
    """Uncommit a checkpoint (marker first, as :func:`remove_checkpoint`, which deletes
    the rest later) and move its data files into ``pool`` (by file name, replacing older
    ones) for the next save to overwrite in place. A file some process still has open or
    mapped (a reader of the old step) stays, to be deleted as ever, so that its reader
    keeps the old bytes; the same where that cannot be told (not Linux, leases refused)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, MARKER))
    data = os.path.join(path, "data")
    with contextlib.suppress(OSError):
        names = os.listdir(data)
        os.makedirs(pool, exist_ok=True)
        for name in names:
            _move_if_unopened(os.path.join(data, name), os.path.join(pool, name))


def _move_if_unopened(src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` if no other open file (of any process of this host) refers to
    it: a Linux write lease is granted only then, and it makes anyone who opens the file
    meanwhile wait until the move is done."""
    try:
        import fcntl

        lease, wrlck, unlck = fcntl.F_SETLEASE, fcntl.F_WRLCK, fcntl.F_UNLCK
    except (ImportError, AttributeError):
        return
    try:
        fd = os.open(src, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.fcntl(fd, lease, wrlck)
    except OSError:  # open elsewhere (EAGAIN), or leases not allowed here
        os.close(fd)
        return
    try:
        os.replace(src, dst)
    except OSError:  # the file stays, to be deleted with its step
        pass
    finally:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, lease, unlck)
        os.close(fd)


def reuse_paths(pool: str, rels: Sequence[str]) -> dict[str, str]:
    """Where in ``pool`` a kept file for each of the data files ``rels`` would be, by relative
    path (the writer takes it if it is there, else makes a new file)."""
    return {rel: os.path.join(pool, os.path.basename(rel)) for rel in rels}


def clean_incomplete(root: str, before: int | None, timeout: float) -> None:
    """Remove abandoned staging directories: those whose writers (recorded in
    ``owner.r*.json``) are dead processes of this host, and those of steps older than
    ``before`` untouched for longer than ``timeout``. A live writer's staging
    directory (another job sharing the root) stays."""
    for name in os.listdir(root):
        if PARTIAL not in name:
            continue
        m = STEP_DIR.match(name.split(PARTIAL, 1)[0])
        full = os.path.join(root, name)
        stale = before is not None and int(m.group(1)) < before and _age(full) > timeout if m else False
        if m and (stale or _abandoned(full)):
            shutil.rmtree(full, ignore_errors=True)
    for name in os.listdir(root):  # committed-less step dirs left by a crash mid-rename
        m = STEP_DIR.match(name)
        full = os.path.join(root, name)
        if m and not os.path.exists(os.path.join(full, MARKER)) and (before is None or int(m.group(1)) < before):
            shutil.rmtree(full, ignore_errors=True)


def record_owner(stage: str, rank: int) -> None:
    """Note which process writes ``stage`` (so a crashed writer's leftovers can be recognised)."""
    with open(os.path.join(stage, f"owner.r{rank:05d}.json"), "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, fh)


def _age(path: str) -> float:
    """Seconds since anything in a directory last changed."""
    try:
        newest = max((e.stat().st_mtime for e in os.scandir(path)), default=os.stat(path).st_mtime)
    except OSError:
        return 0.0
    return time.time() - newest


def _abandoned(stage: str) -> bool:
    """True when every writer of a staging directory was a process of this host that is gone."""
    owners = [n for n in os.listdir(stage) if n.startswith("owner.r")] if os.path.isdir(stage) else []
    if not owners:
        return False
    for name in owners:
        try:
            with open(os.path.join(stage, name)) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            return False
        if rec.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(rec["pid"]), 0)
            return False  # still running
        except ProcessLookupError:
            continue
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
    return True


def latest_step(root: str, persistent: str | None) -> int | None:
    """The newest complete step under ``root`` (or under a local ``persistent`` if root has none)."""
    steps = committed_steps(root)
    if not steps and persistent and "://" not in persistent:
        steps = committed_steps(persistent)
    return steps[-1] if steps else None


def complete_step_dir(root: str, persistent: str | None, step: int) -> str:
    """The directory of ``step``'s complete checkpoint, under ``root`` or a local ``persistent``."""
    local = step_dir(root, step)
    if os.path.exists(os.path.join(local, MARKER)):
        return local
    if persistent and "://" not in persistent:
        remote = step_dir(persistent, step)
        if os.path.exists(os.path.join(remote, MARKER)):
            return remote
    raise IncompleteCheckpointError(f"{local}: step {step} has no complete checkpoint")


def await_ranks(stage: str, world_size: int, failed: Callable[[], Collection[int]], timeout: float) -> None:
    """Wait until every rank's manifest is in ``stage`` (rank 0, before it commits); raise once a
    rank in ``failed()`` (asked again at every look: ranks are abandoned meanwhile) is found
    without its own, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    want = [os.path.join(stage, f"manifest.r{r:05d}.json") for r in range(world_size)]
    while not all(os.path.exists(w) for w in want):
        lost = sorted(r for r in failed() if r < len(want) and not os.path.exists(want[r]))
        if lost:
            raise CheckpointError(f"{stage}: not committed, ranks {lost} failed before writing their pieces")
        if time.monotonic() > deadline:
            missing = [r for r, w in enumerate(want) if not os.path.exists(w)]
            raise CheckpointError(f"{stage}: ranks {missing} did not finish within {timeout}s")
        time.sleep(0.01)


def retire_newest_dropped(root: str, keep_last: int | None, keep_every: int | None) -> list[str]:
    """Uncommit the newest step retention drops and keep its data files for the next flush
    to overwrite: in the flush thread, so that the next flush finds them (renames only; the
    rest is removed by :func:`retain`). Returns the retired step's directory."""
    try:
        drop = steps_to_drop(committed_steps(root), keep_last, keep_every)
        if drop:
            retire_checkpoint(step_dir(root, drop[-1]), reuse_dir(root))
            return [step_dir(root, drop[-1])]
    except OSError as err:  # retain deletes it instead
        log.warning("%s: keeping an old checkpoint's files failed: %s", root, err)
    return []


def retain(root: str, retired: Sequence[str], keep_last: int | None, keep_every: int | None,
           commit_timeout: float) -> None:
    """Remove ``retired`` steps, abandoned stages and the steps retention drops (off the save path)."""
    try:
        for path in retired:
            remove_checkpoint(path)
        steps = committed_steps(root)
        if not steps:
            return
        clean_incomplete(root, steps[-1], commit_timeout)
        for s in steps_to_drop(steps, keep_last, keep_every):
            remove_checkpoint(step_dir(root, s))
    except OSError as err:  # the next commit tries again
        log.warning("%s: removing old checkpoints failed: %s", root, err)

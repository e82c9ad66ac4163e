"""Helpers shared by the test modules, written once (fixtures shared the same way are in conftest.py)::

    from _common import cli, one_line_error, same_bits

    r = cli("inspect", path)                 # python -m ckptbridge, stdout and stderr captured
    one_line_error(r, path, "not a checkpoint")
    assert same_bits(a.read(), b.read())
    recs = core_loss([ckpt_dir, f"dist:{d}:tp=1,pp=1"], "--train-step")   # megatron-core on 2 gloo ranks
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

import ckptbridge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE_LOSS = os.path.join(ROOT, "tools", "megatron", "core_loss.py")

if TYPE_CHECKING:
    import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (for a launcher's rendezvous or a test server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (also for NaN payloads and signed zeros)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def same_checkpoint(a: ckptbridge.Checkpoint, b: ckptbridge.Checkpoint, *, ordered: bool = True) -> None:
    """Same names (in the same order unless ``ordered=False``), step, states, and every state of
    every tensor bitwise equal."""
    names = (list(a), list(b)) if ordered else (sorted(a), sorted(b))
    assert (names[0], a.step) == (names[1], b.step)
    assert a.states() == b.states()
    for state in a.states():
        rows = ckptbridge.diff(a, b, state=state)
        bad = [r.name for r in rows if r.in_a and r.in_b and not r.equal]
        assert not bad, (state, bad[:5])
        assert all(r.in_a == r.in_b for r in rows)


def cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python -m ckptbridge ARGS`` with stdout and stderr captured (so both are pipes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kwargs.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "ckptbridge", *args], capture_output=True, text=True,
                          env=env, **kwargs)


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one line on stderr, no traceback, naming every needle."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def small_model(seed: int = 0) -> torch.nn.Module:
    """A 3-layer torch MLP (4 tensors), seeded."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def core_loss(items: list[str], *flags: str, world: int = 2, env: dict[str, str] | None = None,
              timeout: float = 900) -> list[dict[str, Any]]:
    """``tools/megatron/core_loss.py`` on ``world`` gloo ranks (megatron-core loads each item, one
    record per item, in order); a failed run or a missing record fails with the run's output."""
    out = subprocess.run([sys.executable, CORE_LOSS, "--world", str(world), *flags, *items], capture_output=True,
                         text=True, cwd=ROOT, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})})
    recs = [json.loads(line[len("CORE_LOSS "):]) for line in out.stdout.splitlines() if line.startswith("CORE_LOSS ")]
    assert out.returncode == 0 and len(recs) == len(items), out.stdout[-3000:] + out.stderr[-5000:]
    return recs

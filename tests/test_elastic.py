"""Elastic restart after a fault (the UCP/C4 scenario), torch 4 -> 3 ranks and JAX 8 -> 6 devices."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str, timeout: int = 400) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^LOSS (\d+) (\S+)$", text, re.M)}


@pytest.mark.heavy
def test_torch_four_ranks_lose_one_and_resume_on_three(tmp_path):
    code, ref = _run("elastic_restart.py", str(tmp_path / "ref"), "--world", "4", "--steps", "7")
    assert code == 0, ref
    code, crashed = _run("elastic_restart.py", str(tmp_path / "run"), "--world", "4", "--steps", "7",
                         "--kill-rank", "3", "--kill-step", "4", "--timeout", "10")
    assert code == 3 and "lost a peer" in crashed, crashed  # survivors noticed and exited, no hang
    code, resumed = _run("elastic_restart.py", str(tmp_path / "run"), "--world", "3", "--steps", "7")
    assert code == 0 and "RESUMED from step" in resumed, resumed
    first = int(re.search(r"RESUMED from step (\d+)", resumed).group(1)) + 1
    want, got = _losses(ref), _losses(resumed)
    assert first <= 4 and sorted(got) == list(range(first, 7))
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=2e-6)
    # a negative control: the first crashed losses equal the reference too (same run up to the fault)
    assert all(abs(_losses(crashed)[s] - want[s]) <= 1e-6 * abs(want[s]) for s in _losses(crashed))


@pytest.mark.heavy
def test_jax_eight_devices_die_and_resume_on_six(tmp_path):
    code, ref = _run("elastic_restart_jax.py", str(tmp_path / "ref"), "--devices", "8", "--steps", "7")
    assert code == 0, ref
    code, crashed = _run("elastic_restart_jax.py", str(tmp_path / "run"), "--devices", "8", "--steps", "7",
                         "--kill-step", "4")
    assert code == 1 and "dies at step 4" in crashed
    code, resumed = _run("elastic_restart_jax.py", str(tmp_path / "run"), "--devices", "6", "--steps", "7")
    assert code == 0 and "on 6 devices" in resumed, resumed
    want, got = _losses(ref), _losses(resumed)
    assert got and max(got) == 6
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=2e-6)

"""Megatron-LM's own training loop loads what ckptbridge writes (heavy: runs pretrain_gpt.py on CPU).

Opt-in, NOT run by ``make test``/CI (marker ``megatron_lm``, deselected by pyproject's addopts): it
needs Megatron-LM's training code, which tools/megatron/setup.sh git-clones (CI has no network
beyond package registries, and that code is never committed). Run it with ``make test-megatron-lm``
(= ``bash tools/megatron/setup.sh && pytest -m megatron_lm tests/test_megatron_e2e.py``).
What CI runs instead is tests/test_megatron_core_e2e.py: megatron-core alone (PyPI) loads the
written checkpoints into its GPTModel and checks the forward loss; this file is the stronger proof
(Megatron-LM resumes the written checkpoint and trains on, which also pins the optimizer state).

tools/megatron/setup.sh provides the environment (git-ignored): a venv with torch 2.13.0 CPU +
megatron-core 0.16.1 from PyPI, and Megatron-LM's training code at tag core_v0.16.1 (fetched).
tools/megatron/verify_loss.py writes the checkpoint at the new layout with ckptbridge, lets
Megatron load it there (``--ckpt-format torch``) and train iterations 6 and 7, and compares the
``lm loss`` with the reference (below) within rtol 2e-6 (the printed digits).
The loss logged for iteration 6 is the forward pass with the iteration-5 weights (it pins the
weights), the one for iteration 7 follows the step-6 Adam update (it pins exp_avg/exp_avg_sq,
the step count, the lr schedule and the data position); so two iterations are trained.
The references were measured with ``verify_loss.py --ref`` (Megatron loading the reference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(HERE, "fixtures", "megatron")
TOOLS = os.path.join(ROOT, "tools", "megatron")

# lm loss of iterations 6 and 7 when Megatron-LM (core_v0.16.1, CPU/gloo) resumes the reference itself:
# A and Adistopt: A/tp1pp1/torch (resp. the Adistopt TP1/PP1/DP2 run) at TP1/PP1; B: B/tp1pp1/torch at
# TP1/PP1; Abf16: Megatron's own dist-checkpoint reshard of Abf16 TP2 iteration 5 onto TP1/PP2 (bf16
# compute differs between TP layouts, so the bf16 reference must be at the target layout).
CASES = [
    # source, tp, pp, dp, preset, {iteration: loss}
    ("A/tp2pp2/torch", 1, 2, 1, "A", {6: 5.225019, 7: 5.262239}),
    ("B/tp1pp2/torch", 2, 2, 1, "B", {6: 5.330011, 7: 5.356004}),
    ("Abf16/tp2pp1/torch", 1, 2, 1, "Abf16", {6: 5.22573, 7: 5.262768}),
    ("Adistopt/tp2pp1dp2/torch_dist", 1, 1, 2, "Adistopt", {6: 5.225019, 7: 5.262239}),
]


pytestmark = [pytest.mark.heavy, pytest.mark.megatron_lm]


@pytest.fixture(scope="module")
def megatron_env() -> None:
    subprocess.run(["bash", os.path.join(TOOLS, "setup.sh")], check=True, cwd=ROOT)


@pytest.mark.parametrize("src,tp,pp,dp,preset,expect", CASES, ids=[c[0].split("/")[0] for c in CASES])
def test_megatron_resumes_written_checkpoint_with_reference_loss(megatron_env: None, src: str, tp: int, pp: int,
                                                                  dp: int, preset: str, expect: dict) -> None:
    want = ",".join(f"{k}:{v}" for k, v in expect.items())
    out = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "verify_loss.py"), "--src", os.path.join(FIX, src), "--tp", str(tp),
         "--pp", str(pp), "--dp", str(dp), "--preset", preset, "--train-iters", "7", "--expect", want],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] and set(result["losses"]) == {"6", "7"}, result

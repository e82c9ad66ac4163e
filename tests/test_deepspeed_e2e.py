"""Real DeepSpeed resumes from ``ckptbridge reshard --to deepspeed-universal`` output.

The first test takes the ``s2_bf16_w2`` fixture (ZeRO-2 bf16 at world size 2, trained by real
DeepSpeed, with DeepSpeed's own ``ds_to_universal`` output beside it; that a live run still
reproduces the fixture is ``test_migration.py``'s proof), converts it with ckptbridge, and resumes
real engines (torchrun, CPU/gloo) from both universal checkpoints:

* world size 1, ZeRO-1: the losses of the next two steps are identical;
* world size 2, ZeRO-3 (a stage change DeepSpeed's own output cannot load): the
  state the engine loaded, gathered back from it, equals the source bitwise,
  and per-group hyper-parameters survive (see README for DeepSpeed's ZeRO-3 bugs).
* and back: a ZeRO-3 checkpoint resumed under ZeRO-2 at world size 1.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from test_deepspeed import assert_loaded_equals, run_ds_train, runs_dir  # noqa: F401  (session fixture)

from ckptbridge import reshard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import make_deepspeed_ckpt as tools  # noqa: E402


def _resume(tmp: str, label: str, ckpt_root: str, ws: int, stage: int, steps: int = 2,
            dump: bool = False, dtype: str = "bf16") -> dict:
    args = ["--stage", str(stage), "--dtype", dtype, "--steps", str(steps), "--resume_universal", ckpt_root]
    return run_ds_train(tools.launch, ws, os.path.join(tmp, label), args, dump, timeout=600)


@pytest.mark.heavy
def test_resume_other_world_size_and_stage(runs_dir: str, tmp_path: object) -> None:  # noqa: F811
    tmp = str(tmp_path)
    src = os.path.join(runs_dir, "s2_bf16_w2", "ckpt")  # latest_universal: ds_to_universal's output
    ours = os.path.join(tmp, "ours")
    reshard(src, ours, to="deepspeed-universal")

    theirs_run = _resume(tmp, "theirs_ws1_s1", src, ws=1, stage=1)
    ours_run = _resume(tmp, "ours_ws1_s1", ours, ws=1, stage=1, dump=True)
    assert len(ours_run["losses"]) == 2 and np.isfinite(ours_run["losses"]).all()
    assert ours_run["losses"] == theirs_run["losses"]  # bitwise-equal losses, two steps
    assert_loaded_equals(ours_run["loaded"], src)

    # ZeRO-2 -> ZeRO-3 at world size 2: DeepSpeed's own universal output cannot do this
    s3 = _resume(tmp, "ours_ws2_s3", ours, ws=2, stage=3, steps=1, dump=True)
    assert_loaded_equals(s3["loaded"], src)
    assert abs(s3["losses"][0] - ours_run["losses"][0]) < 1e-2  # bf16 compute at another world size


@pytest.mark.heavy
def test_zero3_checkpoint_resumes_under_zero2(runs_dir: str, tmp_path: object) -> None:  # noqa: F811
    tmp = str(tmp_path)
    src = os.path.join(runs_dir, "s3_bf16_w2", "ckpt")
    ours = os.path.join(tmp, "ours")
    reshard(src, ours, to="deepspeed-universal")
    run = _resume(tmp, "ours_ws1_s2", ours, ws=1, stage=2, steps=1, dump=True)
    assert_loaded_equals(run["loaded"], src)
    assert np.isfinite(run["losses"]).all()


@pytest.mark.heavy
def test_fp16_checkpoint_resumes_like_deepspeeds_own_universal(runs_dir: str, tmp_path: object) -> None:  # noqa: F811
    """fp16 ZeRO-2 (dynamic loss scaling) at world size 2 -> ZeRO-1 at world size 1: the same
    next-step losses as resuming from DeepSpeed's own ds_to_universal output (in the fixture)."""
    tmp = str(tmp_path)
    src = os.path.join(runs_dir, "s2_fp16_w2", "ckpt")
    ours = os.path.join(tmp, "ours")
    reshard(src, ours, to="deepspeed-universal")
    theirs_run = _resume(tmp, "theirs", src, ws=1, stage=1, dtype="fp16")
    ours_run = _resume(tmp, "ours", ours, ws=1, stage=1, dtype="fp16", dump=True)
    assert len(ours_run["losses"]) == 2 and np.isfinite(ours_run["losses"]).all()
    assert ours_run["losses"] == theirs_run["losses"]
    assert_loaded_equals(ours_run["loaded"], src)

"""ZeRO-Offload runs written by real DeepSpeed, read bitwise (issue #18).

Three runs in tests/fixtures/deepspeed/runs.tar.xz were trained on CPU/gloo by
``tools/make_deepspeed_ckpt.py`` (``tools/ds_train.py``, the tiny GPT, 2 ranks, 3 steps) with
ZeRO-Offload switched on in DeepSpeed's config:

* ``s2_bf16_w2_offopt``: ZeRO-2, ``offload_optimizer: {device: cpu}``;
* ``s3_bf16_w2_offopt``: ZeRO-3, ``offload_optimizer: {device: cpu}``;
* ``s3_fp32_w2_offparam``: ZeRO-3, ``offload_param: {device: cpu}`` (parameter offload).

The optimizer is torch's AdamW (``torch_adam: true``, as in every fixture run): DeepSpeed's
CPUAdam needs a C++ build, which this CPU-only project does not do; the offload code paths of
the ZeRO optimizers (CPU fp32 partitions, gradients copied to CPU buffers, parameter
offload in ZeRO-3) are DeepSpeed's own either way. ``runs.json`` records what the live engine
reported (``engine.zero_offload_optimizer()/zero_offload_param()``); the checkpoint's own
``ds_config`` says the same. Like the other runs, every state of every parameter equals the
live engine's (``safe_get_full_*``), ``ds_to_universal``'s and ``zero_to_fp32``'s bitwise
(``tests/test_deepspeed.py::test_matches_deepspeed_tools_and_engine`` runs over all runs,
these included; here they are checked explicitly, with the offload settings).
"""

from __future__ import annotations

import os

import pytest
from test_deepspeed import BY_NAME, runs_dir  # noqa: F401
from test_deepspeed import (
    test_matches_deepspeed_tools_and_engine as check_run,  # not collected twice
)

import ckptbridge

OFFLOAD = {
    "s2_bf16_w2_offopt": ("optimizer", 2),
    "s3_bf16_w2_offopt": ("optimizer", 3),
    "s3_fp32_w2_offparam": ("param", 3),
}


@pytest.mark.parametrize("name", sorted(OFFLOAD))
def test_offload_run_is_what_it_claims(runs_dir: str, name: str) -> None:  # noqa: F811
    what, stage = OFFLOAD[name]
    info = BY_NAME[name]
    assert info["offload"] == {"optimizer": "cpu" if what == "optimizer" else None,
                               "param": "cpu" if what == "param" else None}
    assert info["stage"] == stage and info["ds_universal"] and info["zero_to_fp32"]
    ckpt = ckptbridge.open(os.path.join(runs_dir, name, "ckpt"))
    zero = ckpt.extra["ds_config"]["zero_optimization"]
    assert zero["stage"] == stage and zero[f"offload_{what}"]["device"] == "cpu"
    assert ckpt.provenance["zero_stage"] == stage and ckpt.provenance["dp"] == 2


@pytest.mark.parametrize("name", sorted(OFFLOAD))
def test_offload_run_bitwise_like_engine_and_deepspeeds_tools(runs_dir: str, name: str) -> None:  # noqa: F811
    check_run(runs_dir, name)


def test_offload_runs_are_all_in_the_fixtures() -> None:
    assert {n for n, r in BY_NAME.items() if r.get("offload")} == set(OFFLOAD)

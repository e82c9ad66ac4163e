"""A live pipeline-parallel DeepSpeed engine (``PipelineModule``, Megatron-DeepSpeed's 3D layout
included) resumes straight from a native checkpoint of another PP x TP x DP.

The sources are real runs: ``pp2_s1_bf16_w4`` (``tools/ds_train_pp.py``: 5 layers in 2 pipeline
stages x DP 2, bf16, ``BF16_Optimizer``) and ``pp2_tp2_s1_bf16_w8`` (``tools/ds_train_3d.py``:
tensor-parallel layers in a ``PipelineModule`` over TP 2 x PP 2 x DP 2). Each case launches the same
script at a new layout under torchrun (CPU/gloo): ``load_engine`` fills every stage's engine from
the native rank files (each rank only its stage's parameters, its TP slices, its DP partition),
two pipeline steps are trained, then a second engine in the same processes resumes with
DeepSpeed's own ``load_universal`` from its ``ds_to_universal`` output and trains the same two
steps. The two loss sequences must be bitwise equal, and all ranks together must have read each
element of what they hold once.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
import pytest
from test_deepspeed import runs_dir  # noqa: F401  (session fixture)

from ckptbridge import open as cb_open

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(HERE, "..", "tools")
sys.path.insert(0, TOOLS)
import make_deepspeed_ckpt as tools  # noqa: E402
from ds_train_3d import REPLICATED as REPLICATED_3D  # noqa: E402  (the 3D model's TP-replicated patterns)

CASES = [  # label, source run, script, new layout (tp, pp), processes
    ("pp2dp2_to_pp1dp2", "pp2_s1_bf16_w4", "ds_train_pp.py", (1, 1), 2),
    ("pp2dp2_to_pp4", "pp2_s1_bf16_w4", "ds_train_pp.py", (1, 4), 4),
    ("tp2pp2dp2_to_tp4pp1", "pp2_tp2_s1_bf16_w8", "ds_train_3d.py", (4, 1), 4),
    ("tp2pp2dp2_to_tp1pp2dp1", "pp2_tp2_s1_bf16_w8", "ds_train_3d.py", (1, 2), 2),
]


@pytest.mark.heavy
@pytest.mark.parametrize("label,run,script,layout,nproc", CASES, ids=[c[0] for c in CASES])
def test_pipeline_engine_resumes_at_a_new_layout(runs_dir: str, tmp_path, label, run, script,  # noqa: F811
                                                 layout, nproc) -> None:
    tp, pp = layout
    src = os.path.join(runs_dir, run, "ckpt")
    out = os.path.join(str(tmp_path), label)
    args = ["--pp", str(pp), "--dtype", "bf16", "--steps", "2", "--out", out,
            "--resume_native", src, "--compare_universal", src]
    if script == "ds_train_3d.py":
        args += ["--tp", str(tp)]
    os.makedirs(out, exist_ok=True)
    tools.launch(nproc, args, os.path.join(out, "log.txt"), timeout=900, script=os.path.join(TOOLS, script))
    with open(os.path.join(out, "meta.json")) as fh:
        meta = json.load(fh)
    ckpt = cb_open(src)
    assert meta["resumed_at"] == ckpt.step
    assert len(meta["losses"]) == 2 and np.isfinite(meta["losses"]).all()
    assert meta["losses"] == meta["reference_losses"]  # bitwise, DeepSpeed's own universal load
    # fp32 master + 2 moments (12 bytes an element): every element once, replicated ones once per TP rank
    held = sum(math.prod(ckpt[n].shape) * (tp if any(re.fullmatch(p, n) for p in REPLICATED_3D) else 1)
               for n in ckpt)
    assert held * 12 <= sum(meta["bytes_read"]) <= held * 12 * 1.02, (meta["bytes_read"], held * 12)

"""A live DeepSpeed engine resumes straight from a native checkpoint of another world size / stage.

``ckptbridge.adapters.deepspeed.load_engine`` fills the engine's fp32 partitions,
Adam moments and step from the native rank files (each rank reading only its
new partition). Every case runs ``tools/ds_train.py`` under torchrun (CPU/gloo)
once: the engine loaded by ``load_engine`` trains two steps, then a second engine
in the same processes is resumed by DeepSpeed's own ``load_universal`` and
trains the same two steps. The two loss sequences must be *bitwise* equal, and
the state gathered from our engine right after loading must equal the
checkpoint's bitwise.

DeepSpeed's universal reference: ``ds_to_universal``'s output (in the fixtures)
where DeepSpeed can load it; across a ZeRO stage change it cannot (its output
for ZeRO-1/2 lacks what a ZeRO-3 engine reads, and vice versa, see README), so
there the reference is DeepSpeed's ``load_universal`` reading
``ckptbridge reshard --to deepspeed-universal`` output (itself tested against
``ds_to_universal`` in ``test_deepspeed_e2e.py``). DeepSpeed's ZeRO-3 universal load
shares one ``step`` tensor between all sub-groups, so each optimizer step advances it
once per sub-group and the second sub-group's Adam bias correction is wrong
(``tools/ds_train.py:unalias_steps``); the reference runs with each sub-group given
its own copy, and the test checks that the aliasing was there.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
from test_deepspeed import assert_loaded_equals, run_ds_train, runs_dir  # noqa: F401  (session fixture)

from ckptbridge import open as cb_open
from ckptbridge import reshard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import make_deepspeed_ckpt as tools  # noqa: E402


def _run(tmp: str, label: str, ws: int, stage: int, dtype: str, native: str, universal: str | None,
         extra: tuple[str, ...] = (), dump: bool = True) -> dict:
    args = ["--stage", str(stage), "--dtype", dtype, "--steps", "2", "--resume_native", native, *extra]
    if universal:
        args += ["--compare_universal", universal]
    return run_ds_train(tools.launch, ws, os.path.join(tmp, label), args, dump, timeout=900)


def _assert_partition_reads(meta: dict, src_root: str, ws: int) -> None:
    """Each rank read its partition of fp32 + both moments: 12 bytes per element / ws (plus tails)."""
    src = cb_open(src_root)
    numel = sum(math.prod(src[n].shape) for n in src)
    share = 12 * numel / ws
    got = meta["timing"]["bytes_read"]
    assert len(got) == ws
    for b in got:
        assert 0.95 * share <= b <= 1.05 * share + 12 * 4096, (got, share)


# (fixture run, target world size, target stage, dtype, reference)
CASES = [
    ("s2_bf16_w2", 4, 2, "bf16", "ds"),        # new DP degree 2 -> 4
    ("s2_fp32_w4", 2, 2, "fp32", "ds"),        # 4 -> 2, fp32
    ("s2_bf16_w2", 2, 3, "bf16", "reshard"),   # ZeRO-2 -> ZeRO-3
    ("s3_fp32_w4", 2, 1, "fp32", "reshard"),   # ZeRO-3 -> ZeRO-1, 4 -> 2
    ("s2_fp16_w2", 1, 1, "fp16", "ds"),        # fp16 with dynamic loss scaling: the scale comes along
]


@pytest.mark.heavy
@pytest.mark.parametrize(("run", "ws", "stage", "dtype", "ref"), CASES,
                         ids=[f"{c[0]}-to-s{c[2]}w{c[1]}" for c in CASES])
def test_native_resume_equals_deepspeed_universal(runs_dir: str, tmp_path, run, ws, stage, dtype, ref):  # noqa: F811
    tmp = str(tmp_path)
    src = os.path.join(runs_dir, run, "ckpt")
    if ref == "ds":
        universal = src  # latest_universal names ds_to_universal's output (the fixture)
    else:
        universal = os.path.join(tmp, "universal")
        reshard(src, universal, to="deepspeed-universal")
    meta = _run(tmp, "resume", ws, stage, dtype, src, universal)
    assert len(meta["losses"]) == 2 and np.isfinite(meta["losses"]).all()
    assert meta["losses"] == meta["reference_losses"]  # bitwise, both steps
    assert meta["global_steps"] == 5
    assert meta["timing"]["reference_step_aliases"] == (1 if stage == 3 else 0)
    assert_loaded_equals(meta["loaded"], src)
    _assert_partition_reads(meta, src, ws)


@pytest.mark.heavy
def test_dropping_the_optimizer_state_changes_the_losses(runs_dir: str, tmp_path):  # noqa: F811
    """Negative control: the same resume without the Adam state gives other losses."""
    src = os.path.join(runs_dir, "s2_bf16_w2", "ckpt")
    meta = _run(str(tmp_path), "weights_only", 2, 2, "bf16", src, src, ("--native_weights_only",), dump=False)
    assert meta["losses"][0] == meta["reference_losses"][0]  # the same weights ...
    assert meta["losses"][1] != meta["reference_losses"][1]  # ... but not the same Adam step


@pytest.mark.heavy
def test_mismatched_model_names_the_tensor(runs_dir: str, tmp_path):  # noqa: F811
    src = os.path.join(runs_dir, "s2_bf16_w2", "ckpt")
    with pytest.raises(RuntimeError) as err:
        _run(str(tmp_path), "mismatch", 1, 2, "bf16", src, None, ("--d_model", "64"))
    msg = str(err.value)
    assert "ShapeMismatchError" in msg and "tensor 'blocks.0.qkv.weight' has shape (180, 60)" in msg
    assert "the engine's parameter (192, 64)" in msg and "s2_bf16_w2/ckpt/global_step3" in msg


def test_only_what_no_read_fills_is_zeroed() -> None:
    """Moment buffers are allocated uncleared (zeroing 6 GB of fresh memory cost as long as reading it);
    the partition's padding, which no read fills, is zeroed, and nothing a read filled is touched."""
    import torch

    from ckptbridge.adapters.deepspeed._resume import _zero_gaps

    buf = torch.full((20,), float("nan"))
    filled = [(12, 4), (2, 3), (4, 2)]  # unsorted and overlapping, as fragments may come
    for start, numel in filled:
        buf[start:start + numel] = 1.0
    _zero_gaps(buf, filled)
    want = [0.0, 0.0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert buf.tolist() == want
    empty = torch.full((3,), float("nan"))
    _zero_gaps(empty, [])
    assert empty.tolist() == [0.0, 0.0, 0.0]

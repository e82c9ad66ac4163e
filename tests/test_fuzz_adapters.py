"""Fuzzing the format adapters (DeepSpeed, Megatron legacy and torch_dist, DCP, Orbax) with
mutated/truncated copies of real checkpoints: every case ends normally or in ckptbridge's own
error naming the file, within time and memory limits. CI runs FUZZ_CASES (default 1000) per
reader; `make fuzz` runs a longer campaign.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_deepspeed import runs_dir  # noqa: F401  (session fixture: unpacked DeepSpeed runs)
from test_fuzz import _fuzz

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
CASES = int(os.environ.get("FUZZ_CASES", "1000"))


def test_deepspeed_reader(tmp_path, runs_dir):  # noqa: F811
    seeds = []
    for run in ("s1_fp32_w2", "s3_bf16_w2"):
        src = os.path.join(runs_dir, run, "ckpt")
        with open(os.path.join(src, "latest")) as fh:
            tag = fh.read().strip()
        dst = tmp_path / run
        shutil.copytree(os.path.join(src, tag), dst / tag)
        shutil.copyfile(os.path.join(src, "latest"), dst / "latest")
        seeds.append(str(dst))
    _fuzz(seeds, CASES, seed=1)


def test_megatron_readers(tmp_path):
    seeds = []
    for kind in ("torch", "torch_dist"):
        dst = tmp_path / kind
        shutil.copytree(os.path.join(FIX, "megatron", "A", "tp2pp2", kind), dst)
        seeds.append(str(dst))
    _fuzz(seeds, CASES, seed=2)


def test_dcp_reader(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    dcp.save({"model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)},
              "step": torch.tensor(3)}, checkpoint_id=str(tmp_path / "dcp"))
    _fuzz([str(tmp_path / "dcp")], CASES, seed=3)


@pytest.mark.filterwarnings("ignore")
def test_orbax_reader(tmp_path):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "orbax", {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)})
    ckptr.wait_until_finished()
    _fuzz([str(tmp_path / "orbax")], CASES, seed=4)

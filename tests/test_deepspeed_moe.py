"""DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``) under ZeRO: read at any EP/DP, resume at a new one.

tools/ds_train_moe.py trains a tiny model (embedding -> MoE with 4 experts, top-2 -> norm -> head) on
CPU/gloo with DeepSpeed's ZeRO and saves DeepSpeed's checkpoint; each rank also dumps DeepSpeed's
own gathered view of its parameters (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``:
fp32 master, exp_avg, exp_avg_sq, under its local expert name) and its expert-parallel rank.

* The source run has 4 ranks, EP 2, ZeRO-2: the expert param group is partitioned over each EP
  rank's expert-data-parallel group (2 ranks), the dense groups over all 4. ckptbridge reads it as
  one logical tensor per global expert (``...deepspeed_experts.E...``, local K of EP rank r is
  ``r * 2 + K``), every state bitwise equal to DeepSpeed's gathered state, covering all of it.
* ``load_engine`` fills engines with MoE layers at new layouts without conversion: 4 ranks EP 4
  ZeRO-1 (one expert per rank, expert-DP 1, new stage) and 2 ranks EP 1 ZeRO-2 (new DP; every rank
  holds all 4 experts, expert-DP 2). Right after the load each engine's own gathered state equals the
  checkpoint's bitwise. On 4 ranks the next two losses equal DeepSpeed's own resume of the checkpoint
  (``engine.load_checkpoint`` at the source layout, the one layout where DeepSpeed can resume it)
  within fp32 reduction-order noise; on 2 ranks the losses differ by design (each rank's micro-batch,
  hence the MoE gate's load-balancing loss, changes with the world size), so the state is the proof.
* DeepSpeed's universal route fails on this checkpoint (DeepSpeed 0.19.8): ``ds_to_universal`` stops
  at ``Required universal_checkpoint_info state is missing`` and, with ``--inject_missing_state``,
  at ``RuntimeError: shape '[16]' is invalid for input of size 32`` (an expert's slice).
* ZeRO-3: DeepSpeed itself refuses its MoE layer under stage 3 (DeepSpeed 0.19.8, any device, CPU/gloo
  included): ``deepspeed.initialize`` raises ``AssertionError: Native DeepSpeed MoE is not supported with
  ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2.``, so no ZeRO-3 checkpoint with ``expp_rank_*`` /
  ``layer_*_expert_*`` files can exist to read or resume (AutoEP, DeepSpeed's replacement of Hugging Face MoE
  blocks, is a different layout that ckptbridge does not read).
* Negative control: the experts read with the wrong expert-data-parallel grouping (contiguous ranks
  instead of DeepSpeed's strided groups) or with local ids as global ids fail the check by far.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import ckptbridge
from ckptbridge.adapters.deepspeed import _moe, _reader

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(ROOT, "tools", "ds_train_moe.py")
LOCAL = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)$")
ENV = dict(os.environ, DS_ACCELERATOR="cpu", DS_SKIP_SHM_OP="1", DS_BUILD_OPS="0", DS_SKIP_CUDA_CHECK="1",
           OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
# (label, ranks, args)
RUNS = [
    ("src", 4, ["--stage", "2", "--ep", "2", "--steps", "3"]),
    ("ds_resume", 4, ["--stage", "2", "--ep", "2", "--steps", "2", "--how", "deepspeed", "--resume", "{src}"]),
    ("ep4_zero1", 4, ["--stage", "1", "--ep", "4", "--steps", "2", "--resume", "{src}"]),
    ("dp2_ep1", 2, ["--stage", "2", "--ep", "1", "--steps", "2", "--resume", "{src}"]),
]

pytestmark = pytest.mark.heavy


def _launch(out: str, ranks: int, args: list[str], port: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={port}", TRAIN, "--out", out, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    with open(os.path.join(out, "meta.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from tests._dist import free_port

    work = tmp_path_factory.mktemp("ds_moe")
    src = str(work / "src" / "ckpt")
    out = {}
    for label, ranks, args in RUNS:
        d = str(work / label)
        meta = _launch(d, ranks, [a.format(src=src) for a in args], free_port())
        meta["dir"] = d
        out[label] = meta
    return out


def _gathered(run_dir: str, world: int) -> dict[str, dict[str, np.ndarray]]:
    """DeepSpeed's own gathered state of a run, each expert under its global id."""
    import torch

    out: dict[str, dict[str, np.ndarray]] = {}
    for r in range(world):
        d = torch.load(os.path.join(run_dir, f"state_{r}.pt"), weights_only=True)
        ep, params = d["ep_rank"], d["params"]
        local = len({LOCAL.match(n).group(2) for n in params if LOCAL.match(n)})
        for n, states in params.items():
            m = LOCAL.match(n)
            g = f"{m.group(1)}{ep * local + int(m.group(2))}{m.group(3)}" if m else n
            got = {k: v.numpy() for k, v in states.items()}
            if g in out:  # dense parameters and experts held by several ranks: the same everywhere
                assert all(np.array_equal(out[g][k], got[k]) for k in got), g
            out[g] = got
    return out


def check(ckpt: Any, ref: dict[str, dict[str, np.ndarray]]) -> dict[tuple[str, str], float]:
    """Relative max error per (tensor, state) (0.0: bitwise equal); inf for a tensor missing on one side."""
    errors: dict[tuple[str, str], float] = {}
    for name in set(ref) | set(ckpt.index.tensors):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            if name not in ref or name not in ckpt.index.tensors:
                errors[(name, key)] = float("inf")
                continue
            got, want = ckpt[name].state(key)[...], ref[name][key]
            errors[(name, key)] = 0.0 if np.array_equal(got, want) else \
                float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    return errors


def test_moe_checkpoint_reads_bitwise_equal_to_deepspeeds_gathered_state(runs: dict) -> None:
    src = runs["src"]
    ckpt = ckptbridge.open(os.path.join(src["dir"], "ckpt"))
    experts = sorted(n for n in ckpt.index.tensors if ".deepspeed_experts." in n)
    assert len(experts) == 4 * 4  # global experts x (fc.weight, fc.bias, out.weight, out.bias)
    assert {int(LOCAL.match(n).group(2)) for n in experts} == {0, 1, 2, 3}
    assert all(t.scalars.get("step") == 3 for t in ckpt.index.tensors.values())
    errors = check(ckpt, _gathered(src["dir"], 4))
    assert errors and not {k: v for k, v in errors.items() if v != 0.0}


@pytest.mark.parametrize("label", ["ep4_zero1", "dp2_ep1"])
def test_load_engine_fills_moe_engine_at_new_layout(runs: dict, label: str) -> None:
    """The engine's own gathered state right after load_engine equals the checkpoint bitwise; at the same
    world size the next two losses equal DeepSpeed's own resume (at the source layout)."""
    run, ref = runs[label], runs["ds_resume"]
    ckpt = ckptbridge.open(os.path.join(runs["src"]["dir"], "ckpt"))
    errors = check(ckpt, _gathered(run["dir"], run["world"]))
    assert errors and not {k: v for k, v in errors.items() if v != 0.0}
    assert run["start"] == ref["start"] == 3
    if run["world"] == ref["world"]:
        assert np.allclose(run["losses"], ref["losses"], rtol=1e-5, atol=0), (run["losses"], ref["losses"])


def test_deepspeed_resume_at_source_layout_equals_checkpoint(runs: dict) -> None:
    ckpt = ckptbridge.open(os.path.join(runs["src"]["dir"], "ckpt"))
    errors = check(ckpt, _gathered(runs["ds_resume"]["dir"], 4))
    assert not {k: v for k, v in errors.items() if v != 0.0}


def test_ds_to_universal_fails_on_moe_checkpoint(runs: dict, tmp_path: Any) -> None:
    tag = os.path.join(runs["src"]["dir"], "ckpt", "global_step3")
    base = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag]
    p = subprocess.run([*base, "--output_folder", str(tmp_path / "u1")], capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert p.returncode != 0 and "universal_checkpoint_info state is missing" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([*base, "--output_folder", str(tmp_path / "u2"), "--inject_missing_state"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode != 0 and "is invalid for input of size" in p.stderr, p.stderr[-2000:]


def test_deepspeed_refuses_zero3_with_its_moe_layer(tmp_path: Any) -> None:
    """DeepSpeed's own engine will not build ZeRO-3 with ``deepspeed.moe.layer.MoE``: the ZeRO-3 MoE layout of
    the issue does not exist (one rank, EP 1: the refusal comes before any communication)."""
    from tests._dist import free_port

    one = dict(ENV, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, TRAIN, "--out", str(tmp_path), "--stage", "3", "--ep", "1"],
                       capture_output=True, text=True, env=one, timeout=300)
    assert p.returncode != 0, p.stdout[-2000:]
    assert "AssertionError: Native DeepSpeed MoE is not supported with ZeRO Stage 3" in p.stderr, p.stderr[-3000:]
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.parametrize("bug", ["contiguous_edp_groups", "local_as_global"])
def test_negative_control_wrong_expert_placement_fails_by_far(runs: dict, bug: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if bug == "contiguous_edp_groups":  # EP rank e held by ranks [e * EDP, (e + 1) * EDP)
        monkeypatch.setattr(_reader, "edp_members",
                            lambda dp, ep: {e: list(range(e * (dp // ep), (e + 1) * (dp // ep))) for e in range(ep)})
    else:
        monkeypatch.setattr(_reader, "global_expert", lambda name, ep_rank, num_local: _moe.global_expert(name, 0, num_local))
    ckpt = ckptbridge.open(os.path.join(runs["src"]["dir"], "ckpt"))
    errors = check(ckpt, _gathered(runs["src"]["dir"], 4))
    experts = {k: v for k, v in errors.items() if ".deepspeed_experts." in k[0]}
    assert max(experts.values()) > 0.1, experts
    dense = {k: v for k, v in errors.items() if ".deepspeed_experts." not in k[0]}
    assert not {k: v for k, v in dense.items() if v != 0.0}  # the dense groups are untouched

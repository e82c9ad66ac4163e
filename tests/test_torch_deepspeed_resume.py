"""A DeepSpeed ZeRO-1 checkpoint resumes as an FSDP2 model + torch AdamW on 2 ranks.

Fixtures (runs of tests/fixtures/deepspeed, see its README): ``s1_fp32_w2``'s
``global_step3`` is the native checkpoint DeepSpeed 0.19.8 wrote after 3 steps on 2 ranks
(read in place, no conversion step); ``resume_s1_fp32_w2_to_s1_w4`` is DeepSpeed's own
resume of it (ws 4, one more step): its logged loss and the fp32 weights it reached.

The FSDP2 run loads weights and AdamW state (exp_avg, exp_avg_sq, step) with
``ckptbridge.adapters.torch``, trains the same next step (same batch, clipping,
parameter groups), and must give DeepSpeed's loss and land on DeepSpeed's
weights, so the next loss is the same too.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from _dist import run
from test_deepspeed import runs_dir  # noqa: F401  (session fixture: the unpacked DeepSpeed runs)

import ckptbridge as cb_open
from ckptbridge.adapters import torch as cbt

# from the DeepSpeed fixture runs (tests/fixtures/deepspeed, unpacked once per session)
CKPT_RUN, RESUME_RUN = "s1_fp32_w2", "resume_s1_fp32_w2_to_s1_w4"


def _loss(model, step: int, rank: int, world: int) -> tuple[torch.Tensor, float]:
    import torch.distributed as dist

    from examples.models.torch_gpt import GLOBAL_BATCH, make_batch

    micro = GLOBAL_BATCH // world
    x, y = make_batch(step)
    loss = model(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
    total = loss.detach().clone()
    dist.all_reduce(total)
    return loss, total.item() / world


def _resume_job(rank: int, world: int, ckpt_path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from examples.models.torch_gpt import TinyGPT, param_groups

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # a different init: everything must come from the checkpoint
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    ckpt = cb_open.open(ckpt_path)  # the native DeepSpeed checkpoint, read in place
    cbt.load_module(model, ckpt)
    cbt.load_optimizer(opt, model, ckpt)
    steps = {float(opt.state[p]["step"]) for p in model.parameters()}

    loss, step3_loss = _loss(model, ckpt.step, rank, world)  # the step DeepSpeed's resume ran
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        _, step4_loss = _loss(model, ckpt.step + 1, rank, world)
    model.reshard()  # the root keeps its parameters unsharded after a forward
    weights = {n: p.detach().full_tensor().numpy() for n, p in model.named_parameters()}
    return {"steps": steps, "step3_loss": step3_loss, "step4_loss": step4_loss, "weights": weights,
            "bytes_read": ckpt.stats.bytes_read}


def _reference_next_loss(weights: dict[str, np.ndarray]) -> float:
    from examples.models.torch_gpt import TinyGPT, make_batch

    model = TinyGPT()
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()})
    with torch.no_grad():
        return model(*make_batch(4)).item()


def test_deepspeed_checkpoint_resumes_as_fsdp2_adamw_on_2_ranks(runs_dir):  # noqa: F811
    DS_CKPT = os.path.join(runs_dir, CKPT_RUN, "ckpt", "global_step3")
    DS_RESUME = os.path.join(runs_dir, RESUME_RUN)
    with open(os.path.join(DS_RESUME, "meta.json")) as fh:
        ds_meta = json.load(fh)
    ds_step3_loss = ds_meta["losses"][0]  # DeepSpeed's own resume: loss of the step after global_step3
    ds_weights = cb_open.open(os.path.join(DS_RESUME, "reference_full_fp32.pt")).state_dict()

    results = run(_resume_job, 2, DS_CKPT)
    total = sum(cb_open.open(DS_CKPT)[n].nbytes * 3 for n in cb_open.open(DS_CKPT))
    for res in results:
        assert res["steps"] == {3.0}
        assert res["step3_loss"] == pytest.approx(ds_step3_loss, rel=1e-6, abs=1e-6)
        # each rank read about half of the weights and the two Adam moments
        assert res["bytes_read"] < 0.6 * total
    ours = results[0]["weights"]
    assert set(ours) == set(ds_weights)
    for name, ref in ds_weights.items():
        np.testing.assert_allclose(ours[name], ref, rtol=0, atol=2e-5, err_msg=name)
    # the next loss equals the loss DeepSpeed's resumed weights give
    assert results[0]["step4_loss"] == pytest.approx(_reference_next_loss(ds_weights), abs=1e-5)

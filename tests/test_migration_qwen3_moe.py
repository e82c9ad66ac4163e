"""Qwen3-MoE training continues across frameworks with its Adam state, both ways, through the
``qwen3_moe`` recipe (a pure relayout: no value transform, so the continuation is exact).

1. HF + torch AdamW -> MaxText/optax: a tiny random ``Qwen3MoeForCausalLM`` (4 experts, top 2, q/k
   norms, head_dim 24 != 64 / 4) trains 2 steps with torch AdamW and is saved by
   ``ckptbridge.adapters.torch.save`` (the module's own parameters: experts fused as
   ``mlp.experts.gate_up_proj`` / ``down_proj``, hence ``hf_experts="fused"``); MaxText's own
   Qwen3-MoE decoder on a 2x2 mesh, its weights, ``mu``, ``nu`` and ``count`` loaded through the
   recipe by ``ckptbridge.adapters.flax.load``, continues with MaxText's AdamW: its next 2 losses
   are torch's next 2.
2. MaxText/optax -> HF + torch AdamW: MaxText trains 4 steps from the HF weights (the reference)
   and, separately, 2 steps saved by ``ckptbridge.adapters.flax.save``; torch loads the module and
   the optimizer through the inverse recipe and its 2 next losses are MaxText's steps 3 and 4.
3. Controls: MaxText from the same weights without the moments, and torch without them, leave the
   reference.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf
import maxtext_client as mx

from ckptbridge import recipes

pytestmark = pytest.mark.heavy

LOSS_TOL = 1e-5
BATCH, SEQ = 8, 16
SPEC = hf.HFSpec("qwen3_moe", mlp=48, experts=4, experts_per_tok=2, heads=4, kv_heads=2, head_dim=24)


def _recipe(cfg: dict, src: str = "hf", dst: str = "maxtext", **over) -> tuple:
    return recipes.rules("qwen3_moe", src=src, dst=dst, **{**recipes.config_from_hf(cfg), **over})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from ckptbridge.adapters import torch as cbtorch

    work = tmp_path_factory.mktemp("migration_qwen3_moe")
    tokens = hf.tokens(BATCH, SEQ + 1, 256, seed=2)
    np.save(work / "train.npy", tokens)
    model = hf.build(SPEC)
    hf_dir = hf.save(model, work / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    first, opt = hf.train_adamw(model, tokens, 2)
    cbtorch.save(work / "torch", model.state_dict(), optimizer=opt, module=model)
    nxt, _ = hf.train_adamw(model, tokens, 2, optimizer=opt)
    spec = mx.spec_from_hf(cfg, mesh={"fsdp": 2, "tensor": 2}, batch=BATCH, seq=SEQ)
    fused = _recipe(cfg, hf_experts="fused")
    tt = work / "train.npy"
    jobs = [
        mx.load_job(spec, work / "torch", fused, opt=True, steps=2, train_tokens=tt, report=work / "cont.json"),
        mx.load_job(spec, work / "torch", fused, opt=False, steps=2, train_tokens=tt),
        mx.load_job(spec, hf_dir, _recipe(cfg), steps=4, train_tokens=tt),
        mx.load_job(spec, hf_dir, _recipe(cfg), steps=2, train_tokens=tt, save_universal=work / "mt-2"),
    ]
    losses = [r["load"]["losses"] for r in mx.run_jobs(jobs)]
    return {"work": work, "hf_dir": hf_dir, "cfg": cfg, "torch": (first, nxt), "losses": losses, "tokens": tokens}


def test_maxtext_continues_torch_adamw_exactly(run):
    first, nxt = run["torch"]
    cont, fresh = run["losses"][0], run["losses"][1]
    report = json.loads((run["work"] / "cont.json").read_text())
    assert report["count"] == 2 and report["not_boxed"] == [] and report["not_maxtext_sharding"] == []
    assert first[1] < first[0]
    assert np.allclose(cont, nxt, rtol=0, atol=LOSS_TOL), (cont, nxt)
    assert abs(fresh[1] - nxt[1]) > 100 * LOSS_TOL, (fresh, nxt)  # without the moments: elsewhere


def _torch_from_maxtext(run, moments: bool) -> list[float]:
    import torch
    import transformers

    from ckptbridge.adapters import torch as cbtorch

    src, inverse = run["work"] / "mt-2", _recipe(run["cfg"], src="maxtext", dst="hf", hf_experts="fused")
    config = transformers.AutoConfig.from_pretrained(str(run["hf_dir"]))
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    assert cbtorch.load_module(model, src, rules=inverse) == []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if moments:
        cbtorch.load_optimizer(opt, model, src, rules=inverse)
    losses, _ = hf.train_adamw(model, run["tokens"], 2, optimizer=opt)
    return losses


def test_torch_continues_a_maxtext_run_exactly(run):
    ref, saved = run["losses"][2], run["losses"][3]
    assert saved == ref[:2]
    got = _torch_from_maxtext(run, moments=True)
    assert np.allclose(got, ref[2:], rtol=0, atol=LOSS_TOL), (got, ref)
    fresh = _torch_from_maxtext(run, moments=False)
    assert abs(fresh[0] - ref[2]) < LOSS_TOL and abs(fresh[1] - ref[3]) > 100 * LOSS_TOL, (fresh, ref)

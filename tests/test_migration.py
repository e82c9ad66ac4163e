"""Cross-framework migration end to end, optimizer state included.

* torch -> JAX: ``fixtures/migration/ds_zero2_w2`` is a real DeepSpeed 0.19.8
  ZeRO-2 checkpoint (2 CPU ranks, fp32, 4 steps of the tiny GPT) with the
  losses DeepSpeed itself got when it resumed from those files
  (``losses.json``; made by ``make_deepspeed_run.py`` in that folder). JAX/optax
  continues on a 4-device mesh straight from the DeepSpeed files.
* JAX -> torch: JAX trains on a 2x4 mesh, saves with ckptbridge and continues
  itself; an FSDP2 model with torch AdamW on 2 gloo ranks continues from the
  saved files.

Tolerance: the continued losses must equal the reference to ``TOL`` = 1e-4
(absolute; observed <= 1e-6, fp32 on CPU). Each broken migration moves the
loss of the second continued step by more than 1e-3 (measured: no optimizer
state 8.6e-3 / 1.3e-1, step reset 1.6e-3 / 1.3e-2, mu and nu swapped: NaN), so
the check catches a lost or swapped Adam moment or a wrong step count; a
missing transpose fails the shape check of the rules or changes the first
loss (tested below on the square ``proj`` matrices).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import ckptbridge  # noqa: E402
from ckptbridge import ShapeMismatchError, Transpose  # noqa: E402
from ckptbridge.plugin import apply_rules  # noqa: E402
from examples.models import gpt_rules  # noqa: E402

DS_RUN = os.path.join(HERE, "fixtures", "migration", "ds_zero2_w2")
DS_CKPT = os.path.join(DS_RUN, "ckpt")
TOL = 1e-4
CONTROL_MIN = 1e-3  # a broken migration must move some loss by more than this


def _ds_reference() -> dict:
    with open(os.path.join(DS_RUN, "losses.json")) as fh:
        return json.load(fh)


def _torch_loss(ckpt) -> tuple:
    """The torch GPT filled with the checkpoint's fp32 weights: a batch and its loss."""
    import torch

    from examples.models import torch_gpt as T

    model = T.TinyGPT()
    model.load_state_dict({n: torch.from_numpy(a) for n, a in ckpt.state_dict("fp32").items()})
    x, y = T.make_batch(4)
    with torch.no_grad():
        return x, y, model(x, y).item()


def _view(ckpt, rules):
    tensors = apply_rules(ckpt.tensors, list(rules))
    return ckptbridge.Checkpoint(ckptbridge.CheckpointIndex("mapped", ckpt.path, tensors, ckpt.step), ckpt.files)


def test_fixture_is_a_real_deepspeed_zero2_run():
    ref = _ds_reference()
    assert (ref["stage"], ref["world_size"], ref["dtype"], ref["resumed_at"]) == (2, 2, "fp32", 4)
    with ckptbridge.open(DS_CKPT) as ckpt:
        assert ckpt.format == "deepspeed" and ckpt.step == 4
        assert ckpt.extra["zero_stage"] == 2 and ckpt.extra["dp_world_size"] == 2
        t = ckpt.tensors["blocks.0.qkv.weight"]
        assert set(t.states) == {"fp32", "exp_avg", "exp_avg_sq"} and t.scalars["step"] == 4


@pytest.mark.parametrize("scan", [True, False])
def test_gpt_rules_split_transpose_stack_and_back(scan):
    with ckptbridge.open(DS_CKPT) as ckpt:
        flax = _view(ckpt, gpt_rules.torch_to_flax(60, scan=scan))
        q = "blocks/q/kernel" if scan else "blocks/1/q/kernel"
        v = "blocks/v/kernel" if scan else "blocks/1/v/kernel"
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            qkv = ckpt["blocks.1.qkv.weight"].state(state).read()
            got_q = flax[q].state(state).read()
            got_v = flax[v].state(state).read()
            np.testing.assert_array_equal(got_q[1] if scan else got_q, qkv[:60].T)
            np.testing.assert_array_equal(got_v[1] if scan else got_v, qkv[120:].T)
        assert flax["wte/embedding"].shape == (101, 60)
        assert flax["lm_head/kernel"].shape == (60, 101)
        assert flax["ln_f/scale"].shape == (60,)
        assert flax.tensors[q].scalars["step"] == 4
        if scan:
            assert flax["blocks/fc/kernel"].shape == (3, 60, 240)
        # and back: the torch names, shapes and bytes of every state
        back = _view(flax, gpt_rules.flax_to_torch(scan=scan))
        assert set(back) == set(ckpt)
        for name in ckpt:
            for state in ckpt[name].states:
                np.testing.assert_array_equal(back[name].state(state).read(), ckpt[name].state(state).read())
    text = gpt_rules.show(gpt_rules.torch_to_flax(60, scan=scan))
    assert "Split" in text and "Transpose" in text and ("Stack" in text) == scan


def test_gpt_rules_check_names_every_problem():
    with ckptbridge.open(DS_CKPT) as ckpt:
        with pytest.raises(ShapeMismatchError, match="fused dim"):
            gpt_rules.check(ckpt, gpt_rules.torch_to_flax(64), {})
        no_transpose = [r for r in gpt_rules.torch_to_flax(60) if not isinstance(r, Transpose)]
        target = {n: t.shape for n, t in apply_rules(ckpt.tensors, list(gpt_rules.torch_to_flax(60))).items()}
        with pytest.raises(ShapeMismatchError, match="blocks/fc/kernel"):
            gpt_rules.check(ckpt, no_transpose, target)


def test_flax_model_computes_the_torch_model():
    """Same weights, same batch: the Flax NNX GPT (per-layer) gives the torch GPT's loss; a
    missing transpose of the square matrices (shapes still fit) does not."""
    import flax  # noqa: F401  (a missing extra must fail, not skip)
    import jax.numpy as jnp
    from flax import nnx

    from ckptbridge.adapters import flax as cbflax
    from examples.models import flax_gpt as F

    with ckptbridge.open(DS_CKPT) as ckpt:
        x, y, want = _torch_loss(ckpt)
        graphdef, params = F.split_params(F.GPT(nnx.Rngs(0), scan=False))
        xs, ys = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
        loaded = cbflax.load(ckpt, params, rules=gpt_rules.torch_to_flax(60, scan=False))
        assert float(F.loss_fn(graphdef, loaded, xs, ys)) == pytest.approx(want, abs=1e-5)
        rules = list(gpt_rules.torch_to_flax(60, scan=False))
        rules[1] = Transpose(r"^(blocks\.\d+\.(q|k|v|fc|fc_out)|lm_head)\.weight$", (1, 0))  # proj forgotten
        broken = cbflax.load(ckpt, params, rules=rules)
        assert abs(float(F.loss_fn(graphdef, broken, xs, ys)) - want) > CONTROL_MIN


def test_linen_model_loads_the_same_rules():
    """The Linen GPT (``nn.scan`` layers) has the NNX model's names under ``params``: the same
    rule set fills it from the DeepSpeed files, and it computes the torch model's loss."""
    import flax  # noqa: F401  (a missing extra must fail, not skip)
    import jax
    import jax.numpy as jnp
    import optax

    from ckptbridge.adapters import flax as cbflax
    from examples.models import linen_gpt as L

    with ckptbridge.open(DS_CKPT) as ckpt:
        x, y, want = _torch_loss(ckpt)
        xs, ys = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
        linen = L.GPT()
        variables = jax.eval_shape(linen.init, jax.random.key(0), xs)
        variables = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), variables)
        variables = cbflax.load(ckpt, variables, rules=gpt_rules.torch_to_flax(60, scan=True))
        logits = linen.apply(variables, xs)
        got = float(optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean())
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.heavy
def test_deepspeed_zero2_run_continues_in_jax_on_4_devices():
    import optax  # noqa: F401  (a missing extra must fail, not skip)

    from examples.migrate_deepspeed_to_jax import continue_in_jax

    ref = _ds_reference()["continuation_losses"]
    k = len(ref)
    ours, params, opt_state = continue_in_jax(DS_CKPT, k, "full", n_devices=4, return_state=True)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL)
    # and JAX lands where DeepSpeed's continuation did: weights and both Adam moments, step 8
    from ckptbridge.adapters.flax import flatten_state

    with ckptbridge.open(os.path.join(DS_RUN, "ckpt_continued")) as ds8:
        want = _view(ds8, gpt_rules.torch_to_flax(60, scan=True))
        adam = opt_state[1][0]
        assert int(adam.count) == ds8.step == 4 + k
        for tree, state, atol in ((params, "fp32", 1e-5), (adam.mu, "exp_avg", 1e-6), (adam.nu, "exp_avg_sq", 1e-8)):
            for name, leaf in flatten_state(tree).items():
                np.testing.assert_allclose(np.asarray(leaf), want[name].state(state).read(), rtol=0, atol=atol,
                                           err_msg=f"{name} {state}")
    # negative controls: the same flow with a broken optimizer state misses the reference
    for mode in ("none", "reset_step", "swap_moments"):
        bad = np.asarray(continue_in_jax(DS_CKPT, k, mode, n_devices=4))
        dev = np.where(np.isfinite(bad), np.abs(bad - np.asarray(ref)), np.inf)
        assert dev.max() > CONTROL_MIN, (mode, bad, ref)


@pytest.mark.heavy
def test_jax_2x4_run_continues_as_fsdp2_with_torch_adamw(tmp_path):
    import optax  # noqa: F401  (a missing extra must fail, not skip)
    import torch  # noqa: F401  (a missing extra must fail, not skip)

    from examples.migrate_jax_to_torch import continue_in_torch, train_in_jax

    ref = train_in_jax(str(tmp_path), steps=3, more=3)
    with ckptbridge.open(ref["ckpt"]) as ckpt:  # what ckptbridge saved from the 2x4 mesh
        assert ckpt.step == 3
        assert {"fp32", "exp_avg", "exp_avg_sq"} <= set(ckpt["blocks/fc/kernel"].states)
        assert ckpt.tensors["blocks/fc/kernel"].scalars["step"] == 3
    got = continue_in_torch(ref["ckpt"], 3, world=2, optimizer=("full", "none", "reset_step"))
    np.testing.assert_allclose(got["full"], ref["continuation_losses"], rtol=0, atol=TOL)
    for mode in ("none", "reset_step"):
        dev = np.abs(np.asarray(got[mode]) - np.asarray(ref["continuation_losses"]))
        assert dev.max() > CONTROL_MIN, (mode, got[mode])


@pytest.mark.heavy
def test_live_deepspeed_zero2_run_reproduces_the_fixture_and_migrates(tmp_path):
    """Run real DeepSpeed (ZeRO-2, 2 CPU ranks via torchrun/gloo) now, exactly as the fixture
    was made: it must give the recorded losses, and JAX must continue its fresh checkpoint."""
    import subprocess

    import deepspeed  # noqa: F401  (a missing extra must fail, not skip)
    import optax  # noqa: F401  (a missing extra must fail, not skip)
    from _common import free_port

    from examples.migrate_deepspeed_to_jax import continue_in_jax

    out = tmp_path / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_SKIP_SHM_OP="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.join(DS_RUN, "..", "make_deepspeed_run.py"),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out / "losses.json") as fh:
        fresh = json.load(fh)
    ref = _ds_reference()
    np.testing.assert_allclose(fresh["losses"], ref["losses"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(fresh["continuation_losses"], ref["continuation_losses"], rtol=0, atol=1e-6)
    ours = continue_in_jax(str(out / "ckpt"), len(ref["continuation_losses"]), "full", n_devices=4)
    np.testing.assert_allclose(ours, fresh["continuation_losses"], rtol=0, atol=TOL)

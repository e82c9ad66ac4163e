"""Checkpointer.restore gives back the tree that was saved; restore_into fills a live model and
optimizer strictly (missing, unexpected and mis-shaped entries named) and the run continues exactly."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from _common import small_model

import ckptbridge
from ckptbridge import Checkpointer


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(32, 8, generator=g)).pow(2).mean().backward()
        opt.step()


# ---------------------------------------------------------------- Checkpointer.restore / restore_into

Adam = collections.namedtuple("Adam", ["count", "mu"])


@pytest.mark.parametrize("host_tier", [True, False], ids=["host-tier", "disk"])
def test_restore_returns_the_tree_that_was_saved(tmp_path, host_tier):
    state = {
        "model": {"0.weight": np.arange(6, dtype=np.float32).reshape(2, 3)},  # a key with a dot in it
        "opt": {"state": {0: {"step": np.float32(3)}, 1: Adam(np.int64(2), np.ones(2))}},  # int keys
        "sched": [1e-3, (0.9, 0.999)],
        "name": "run-1",
        "empty": {},
    }
    with Checkpointer(tmp_path / "ck", host_tier=host_tier) as ck:
        ck.save(5, state)
        ck.wait()
        got = ck.restore()
        flat = ck.restore(5, flat=True)
    assert list(got) == list(state)
    np.testing.assert_array_equal(got["model"]["0.weight"], state["model"]["0.weight"])
    assert list(got["model"]) == ["0.weight"]  # not split at the dot
    assert list(got["opt"]["state"]) == [0, 1]  # int keys stay ints
    assert got["opt"]["state"][0]["step"] == 3.0
    adam = got["opt"]["state"][1]
    assert type(adam).__name__ == "Adam" and adam._fields == ("count", "mu") and adam.count == 2
    np.testing.assert_array_equal(adam.mu, np.ones(2))
    assert got["sched"] == [1e-3, (0.9, 0.999)] and isinstance(got["sched"][1], tuple)
    assert got["name"] == "run-1" and got["empty"] == {}
    # the flat view keeps the dotted names
    assert "model.0.weight" in flat and "opt.state.1.mu" in flat and flat["sched.1.0"] == 0.9


def test_restore_into_is_strict_and_lists_missing_and_unexpected(tmp_path):
    src = small_model(0)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": src.state_dict()})
        ck.wait()
        dst = small_model(1)
        before = [p.detach().clone() for p in dst.parameters()]
        with pytest.raises(ckptbridge.TensorNotFoundError) as err:
            ck.restore_into({"net": dst.state_dict()})  # saved under another name
        text = str(err.value)
        assert "missing" in text and "'net.0.weight'" in text
        assert "unexpected" in text and "'model.0.weight'" in text and "strict=False" in text
        assert all(torch.equal(a, b) for a, b in zip(before, dst.parameters()))  # nothing copied
        # strict=False restores what both have and says what it did not
        sd = dst.state_dict()
        missing, unexpected = ck.restore_into({"model": sd, "extra": np.zeros(3)}, strict=False)
        assert missing == ["extra"] and unexpected == []
        assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
        result = ck.restore_into({"model": dst})  # an nn.Module stands for its state dict
        assert result.step == 1 and result.missing_keys == () and result.unexpected_keys == ()


def test_restore_into_checks_shapes_before_copying(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"a": np.ones(4, np.float32), "b": np.ones((2, 2), np.float32)})
        ck.wait()
        a, b = np.zeros(4, np.float32), np.zeros((4, 1), np.float32)
        with pytest.raises(ckptbridge.ShapeMismatchError, match=r"'b'.*\(2, 2\).*\(4, 1\)"):
            ck.restore_into({"a": a, "b": b})
        assert not a.any()  # checked before anything was copied


def test_restore_into_a_fresh_optimizer_continues_the_run_exactly(tmp_path):
    """A new model and a new AdamW (no state yet) restored from a step continue bitwise like the
    original run; dropping the optimizer state (the old silent behaviour) does not."""
    model = small_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    _train(model, opt, 3, seed=1)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, {"model": model, "optim": opt}, optimizer=opt)  # objects stand for their state dicts
        ck.wait()
        saved = ck.restore()
        assert set(saved["optim"]) == {"state", "param_groups"} and set(saved["optim"]["state"]) == {0, 1, 2, 3}

        fresh = small_model(7)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # other lr/betas: the saved ones win
        assert not fresh_opt.state
        result = ck.restore_into({"model": fresh, "optim": fresh_opt})
        assert result.step == 3 and not result.missing_keys and not result.unexpected_keys
        group = fresh_opt.param_groups[0]
        assert group["lr"] == 1e-2 and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(p, q)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), k

        _train(model, opt, 2, seed=2)
        _train(fresh, fresh_opt, 2, seed=2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))

        # negative control: weights only, fresh Adam state -> a different run
        control = small_model(7)
        control_opt = torch.optim.AdamW(control.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
        ck.restore_into({"model": control}, step=3, strict=False)
        _train(control, control_opt, 2, seed=2)
        model2 = small_model(0)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
        ck.restore_into({"model": model2, "optim": opt2}, step=3)
        _train(model2, opt2, 2, seed=2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), control.parameters()))


def test_restore_into_refuses_what_it_cannot_fill(tmp_path):
    """JAX arrays are immutable: restore_into says so (naming them) instead of skipping them."""
    import jax.numpy as jnp

    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": np.ones(3, np.float32)})
        ck.wait()
        with pytest.raises(ckptbridge.CheckpointError, match=r"'w'.*cannot be filled in place"):
            ck.restore_into({"w": jnp.zeros(3)})
        np.testing.assert_array_equal(ck.restore()["w"], np.ones(3))

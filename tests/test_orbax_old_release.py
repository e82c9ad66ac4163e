"""Orbax checkpoints written by an old Orbax release (0.4.2), read in place.

tests/fixtures/orbax_old was written by orbax-checkpoint 0.4.2 itself (jax 0.4.18, tensorstore
0.1.45, optax 0.1.7; ``versions.json``) in a second virtual environment, by
tools/make_old_orbax_ckpt.sh: a Flax-style train state (params + ``optax.adamw`` state + step) of
a tiny MLP after two AdamW steps, sharded on a 2x2 mesh of 4 CPU devices, saved three ways:
``PyTreeCheckpointer`` with OCDBT (that release's default) and with one Zarr directory per
array, and the old ``CheckpointManager`` API (steps 1 and 2, ``<step>/default/``). That release
wrote no ``_METADATA`` (the tree is a msgpack ``checkpoint`` file of ``PLACEHOLDER://`` leaves)
and no ``_CHECKPOINT_METADATA`` in step directories. ``expected.npz`` holds every leaf as numpy
saved it from the same arrays: ckptbridge must read each one bitwise, grouped onto the universal
states, and agree with today's Orbax restoring the same files.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from _common import same_bits

import ckptbridge

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "orbax_old")
NAMES = {"Dense_0/kernel": (16, 32), "Dense_0/bias": (32,), "Dense_1/kernel": (32, 8), "Dense_1/bias": (8,),
         "embed/embedding": (12, 16)}
STATES = {"exp_avg": "opt_state/0/mu/", "exp_avg_sq": "opt_state/0/nu/"}
# where each layout's step-2 state is: (path, open kwargs)
LAYOUTS = {
    "pytree_ocdbt": ("pytree_ocdbt", {}),
    "pytree_zarr": ("pytree_zarr", {}),
    "manager_root": ("manager", {}),
    "manager_step_dir": ("manager/2", {}),
    "manager_item_dir": ("manager/2/default", {}),
}


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    out = {}
    with np.load(os.path.join(FIX, "expected.npz")) as z:
        for k in z.files:
            a = z[k]
            if k.endswith(":bfloat16"):
                k, a = k[: -len(":bfloat16")], a.view(ml_dtypes.bfloat16)
            out[k] = a
    return out


def test_the_fixture_is_what_that_release_wrote() -> None:
    with open(os.path.join(FIX, "versions.json")) as fh:
        assert json.load(fh)["orbax-checkpoint"] == "0.4.2"
    for item in ("pytree_ocdbt", "pytree_zarr", "manager/1/default", "manager/2/default"):
        files = set(os.listdir(os.path.join(FIX, item)))
        assert "checkpoint" in files and "_METADATA" not in files, (item, files)  # the msgpack tree, no JSON tree
    assert "manifest.ocdbt" in os.listdir(os.path.join(FIX, "pytree_ocdbt"))
    assert "manifest.ocdbt" not in os.listdir(os.path.join(FIX, "pytree_zarr"))
    assert os.path.isfile(os.path.join(FIX, "pytree_zarr", "params.Dense_0.kernel", ".zarray"))
    assert not os.path.exists(os.path.join(FIX, "manager", "2", "_CHECKPOINT_METADATA"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_old_release_train_state_reads_bitwise(layout: str, expected: dict[str, np.ndarray]) -> None:
    rel, kw = LAYOUTS[layout]
    c = ckptbridge.open(os.path.join(FIX, rel), **kw)
    assert c.format == "orbax" and c.step == 2
    assert set(NAMES) <= set(c), sorted(c)
    for name, shape in NAMES.items():
        t = c[name]
        weights = "param" if name.startswith("embed") else "fp32"  # bf16 weights are 'param'
        assert t.shape == shape and set(t.states) == {weights, "exp_avg", "exp_avg_sq"}, (name, t.states)
        assert t.scalars == {"step": 2}  # optax's count
        assert same_bits(t.state(weights).read(), expected[f"params/{name}"]), name
        for state, prefix in STATES.items():
            assert same_bits(t.state(state).read(), expected[prefix + name]), (name, state)
    # the shards the 2x2 mesh wrote are the fragments: P("x", "y") -> 4 chunks of 8 x 16
    frags = c["Dense_0/kernel"].fragments
    assert sorted((f.box.offset, f.box.shape) for f in frags) == [
        ((0, 0), (8, 16)), ((0, 16), (8, 16)), ((8, 0), (8, 16)), ((8, 16), (8, 16))]
    c.stats.reset()
    np.testing.assert_array_equal(c["Dense_0/kernel"][9:11, 20:22], expected["params/Dense_0/kernel"][9:11, 20:22])


def test_old_manager_earlier_step(expected: dict[str, np.ndarray]) -> None:
    for c in (ckptbridge.open(os.path.join(FIX, "manager"), step=1), ckptbridge.open(os.path.join(FIX, "manager", "1"))):
        assert c.step == 1
        for name in NAMES:
            assert same_bits(c[name].state("exp_avg").read(), expected[f"step1:opt_state/0/mu/{name}"]), name
            assert not same_bits(c[name].state("exp_avg").read(), expected[f"opt_state/0/mu/{name}"])  # a real step apart


@pytest.mark.parametrize("item", ["pytree_ocdbt", "pytree_zarr"])
def test_todays_orbax_restores_the_same_values(item: str) -> None:
    """The peer, today's Orbax, reads the old files too; leaf by leaf it agrees with ckptbridge."""
    import jax
    import orbax.checkpoint as ocp

    restored = ocp.PyTreeCheckpointer().restore(os.path.join(FIX, item))
    leaves = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(v)
              for path, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
    raw = ckptbridge.open(os.path.join(FIX, item), layout="raw")  # Orbax's own tree names
    arrays = {k: v for k, v in leaves.items() if v.ndim}
    assert len(arrays) == 3 * len(NAMES)
    for key, want in arrays.items():
        got = raw[key].read()
        assert same_bits(got, want.astype(got.dtype)) and got.dtype == want.dtype, key


def test_old_release_converts_and_reshards_to_todays_orbax(tmp_path, expected: dict[str, np.ndarray]) -> None:
    """Old Orbax -> universal -> a current Orbax checkpoint that today's Orbax restores."""
    import orbax.checkpoint as ocp

    ckptbridge.convert(os.path.join(FIX, "pytree_ocdbt"), tmp_path / "u")
    assert ckptbridge.verify(tmp_path / "u") == []
    ckptbridge.reshard(tmp_path / "u", tmp_path / "new", to="orbax")
    restored = ocp.StandardCheckpointer().restore(str(tmp_path / "new"))
    assert same_bits(np.asarray(restored["params"]["Dense_0"]["kernel"]), expected["params/Dense_0/kernel"])
    assert same_bits(np.asarray(restored["opt_state"]["nu"]["Dense_1"]["kernel"]), expected["opt_state/0/nu/Dense_1/kernel"])

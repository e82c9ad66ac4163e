"""The checkpointer with JAX donation and with several torch ranks (gloo)."""

from __future__ import annotations

import _dist
import numpy as np

from ckptbridge import Checkpointer
from ckptbridge._checkpointer.steps import committed_steps


def test_jax_loop_with_donated_buffers(tmp_path):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    params = {"w": jax.device_put(jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32) / 100, sharding),
              "b": jnp.zeros((32,), jnp.bfloat16)}

    def train_step(p):
        return {"w": p["w"] * 0.9 + 0.01, "b": (p["b"].astype(jnp.float32) + 1).astype(jnp.bfloat16)}

    step_fn = jax.jit(train_step, donate_argnums=(0,))
    refs = {}
    with Checkpointer(tmp_path / "ck", keep_last=None) as ck:
        guarded = ck.guard(step_fn)  # waits for pending snapshots before donating
        for step in range(5):
            refs[step] = {k: np.asarray(v).copy() for k, v in params.items()}
            ck.save(step, {"params": params})  # captured lazily
            params = guarded(params)  # donates the buffers just saved
        ck.wait()
        for step, ref in refs.items():
            got = Checkpointer(tmp_path / "ck", keep_last=None, host_tier=False).restore(step, flat=True)
            for k, v in ref.items():
                assert got[f"params.{k}"].tobytes() == v.tobytes(), (step, k)
    # one logical tensor per leaf, made of the 8 device shards
    import ckptbridge

    c = ckptbridge.open(str(tmp_path / "ck" / "step_00000004"))
    assert len(c["params.w"].fragments) == 8 and c["params.w"].shape == (16, 32)


def _ranks_save(rank, world, root):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = distribute_tensor(full[:3].clone(), mesh, [Replicate()])
    with Checkpointer(root, keep_last=None) as ck:
        for step in range(3):
            ck.save(step, {"w": sharded, "r": replicated, "plain": torch.full((2,), float(rank))},
                    local={"rng": torch.full((3,), float(rank)), "position": 100 + rank})
            sharded.to_local().add_(1.0)  # changes in place right after save
        ck.wait()
    return rank


def test_multi_rank_dtensor_saves_commit_once_all_ranks_finished(tmp_path):
    import ckptbridge

    root = str(tmp_path / "ck")
    # plain tensors count as replicated (rank 0 writes); per-rank state goes in `local`
    assert _dist.run(_ranks_save, 2, root) == [0, 1]
    assert committed_steps(root) == [0, 1, 2]
    for step in range(3):
        c = ckptbridge.open(f"{root}/step_{step:08d}")
        want = np.arange(60, dtype=np.float32).reshape(10, 6) + step
        np.testing.assert_array_equal(c["w"].read(), want)
        assert len(c["w"].fragments) == 2 and len(c["r"].fragments) == 1
        np.testing.assert_array_equal(c["r"].read(), np.arange(18, dtype=np.float32).reshape(3, 6))
        np.testing.assert_array_equal(c["plain"].read(), [0.0, 0.0])
        np.testing.assert_array_equal(c["rank1.rng"].read(), [1.0, 1.0, 1.0])
        np.testing.assert_array_equal(c["rank0.rng"].read(), [0.0, 0.0, 0.0])
        assert int(c["rank1.position"].read()) == 101


def test_jax_donation_without_a_guard_is_safe(tmp_path):
    """Unguarded saves copy on the device first, so a donating step right after save is fine."""
    import jax
    import jax.numpy as jnp

    step_fn = jax.jit(lambda p: {"w": p["w"] * 2.0 + 1.0}, donate_argnums=(0,))
    params = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)}
    refs = {}
    with Checkpointer(tmp_path / "ck", keep_last=None) as ck:
        for step in range(4):
            refs[step] = np.asarray(params["w"]).copy()
            ck.save(step, {"params": params})
            params = step_fn(params)  # donates the buffers that were just saved
        ck.wait()
    for step, ref in refs.items():
        got = Checkpointer(tmp_path / "ck", keep_last=None, host_tier=False).restore(step, flat=True)
        assert got["params.w"].tobytes() == ref.tobytes()


def test_reserve_with_jax_arrays_fills_every_host_buffer_set(tmp_path):
    """``reserve`` lays out and touches every host buffer set; a JAX shard copies once, so each
    set takes fresh leaves (it raised "snapshot of the shard was already taken" on the second
    set, found by tools/gpu_check.py). The saves after it write the arrays' bytes."""
    import jax.numpy as jnp

    params = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "b": jnp.ones(7, jnp.bfloat16)}
    with Checkpointer(tmp_path / "ck", keep_last=None) as ck:
        ck.reserve({"params": params})
        assert all(b.images for b in ck._buffers) and len(ck._buffers) == 2
        for step in range(3):
            ck.save(step, {"params": params})
        ck.wait()
        for step in range(3):
            got = ck.restore(step, flat=True)
            assert got["params.w"].tobytes() == np.asarray(params["w"]).tobytes()
            assert got["params.b"].tobytes() == np.asarray(params["b"]).tobytes()

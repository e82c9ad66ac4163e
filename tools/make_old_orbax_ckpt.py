#!/usr/bin/env python
"""Write Orbax checkpoints with an *old* Orbax release (for tests/fixtures/orbax_old).

Orbax before 0.4.3 wrote PyTree checkpoints without ``_METADATA`` (its tree is a msgpack
``checkpoint`` file with ``PLACEHOLDER://`` leaves; arrays are Zarr directories or an OCDBT
database named by the ``.``-joined key path) and ``CheckpointManager`` steps without
``_CHECKPOINT_METADATA``. This script runs *inside* a second virtual environment holding that
release (``tools/make_old_orbax_ckpt.sh`` builds it: orbax-checkpoint 0.4.2, jax 0.4.18,
tensorstore 0.1.45, optax 0.1.7) and writes, for a tiny MLP trained two AdamW steps on a 2x2
mesh of 4 CPU devices::

    OUT/pytree_ocdbt/        PyTreeCheckpointer(use_ocdbt=True)  (the 0.4.x default)
    OUT/pytree_zarr/         PyTreeCheckpointer(use_ocdbt=False) (one Zarr directory per array)
    OUT/manager/{1,2}/default/   CheckpointManager (old API), steps 1 and 2
    OUT/expected.npz         every saved leaf, written by numpy from the same arrays
                             (key: the leaf's '/'-joined path, step 2; 'step1:' prefix for step 1)
    OUT/versions.json        the library versions that wrote them

The tree is a Flax-style train state: ``{"params": ..., "opt_state": optax.adamw(...) state,
"step": int}`` (fp32 kernels and biases, one bf16 embedding)::

    bash tools/make_old_orbax_ckpt.sh tests/fixtures/orbax_old
"""

from __future__ import annotations

import json
import os
import sys


def main(out: str) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from importlib.metadata import version

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if tuple(int(x) for x in version("orbax-checkpoint").split(".")[:3]) >= (0, 4, 3):
        raise SystemExit("run this with an Orbax release older than 0.4.3 (tools/make_old_orbax_ckpt.sh)")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    rng = np.random.default_rng(0)

    def put(a: np.ndarray, spec: P) -> jax.Array:
        return jax.device_put(a, NamedSharding(mesh, spec))

    params = {
        "embed": {"embedding": put(rng.standard_normal((12, 16)).astype(jnp.bfloat16), P(None, "y"))},
        "Dense_0": {"kernel": put(rng.standard_normal((16, 32)).astype(np.float32), P("x", "y")),
                    "bias": put(np.zeros(32, np.float32), P("y"))},
        "Dense_1": {"kernel": put(rng.standard_normal((32, 8)).astype(np.float32), P("x", None)),
                    "bias": put(np.zeros(8, np.float32), P())},
    }
    tx = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = tx.init(params)
    x = rng.standard_normal((4, 12)).astype(np.float32)

    def loss(p: dict) -> jax.Array:
        h = jnp.tanh(x @ p["embed"]["embedding"].astype(jnp.float32) @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
        return jnp.mean((h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]) ** 2)

    states = {}
    for step in (1, 2):
        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        states[step] = {"params": params, "opt_state": opt_state, "step": step}

    os.makedirs(out, exist_ok=False)
    final = states[2]
    # Zarr first: in this release use_ocdbt=True also switches a global of the type handlers on
    # (fixed in 0.4.6), which would turn the later saves into OCDBT ones
    for name, ocdbt in (("pytree_zarr", False), ("pytree_ocdbt", True)):
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)).save(os.path.join(out, name), final)
    mngr = ocp.CheckpointManager(os.path.join(out, "manager"), ocp.Checkpointer(ocp.PyTreeCheckpointHandler()),
                                 ocp.CheckpointManagerOptions(max_to_keep=2))
    for step, state in states.items():
        mngr.save(step, state)
    mngr.wait_until_finished()

    expected = {}
    for step, state in states.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            key = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
            arr = np.asarray(leaf)
            if arr.dtype == jnp.bfloat16:  # npz keeps raw bits; the test views them as bfloat16
                key, arr = key + ":bfloat16", arr.view(np.uint16)
            expected[key if step == 2 else f"step1:{key}"] = arr
    np.savez(os.path.join(out, "expected.npz"), **expected)
    with open(os.path.join(out, "versions.json"), "w") as fh:
        json.dump({p: version(p) for p in ("orbax-checkpoint", "jax", "jaxlib", "tensorstore", "optax", "numpy")},
                  fh, indent=1)
    print(f"wrote {out}: {len(expected)} leaves")


if __name__ == "__main__":
    main(sys.argv[1])

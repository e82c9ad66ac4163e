"""Elastic restart in JAX: a job on 8 devices dies; it resumes on 6 devices from the last complete step.

    python examples/elastic_restart_jax.py ROOT --devices 8 --steps 8 --kill-step 5
    python examples/elastic_restart_jax.py ROOT --devices 6 --steps 8         # resumes
    python examples/elastic_restart_jax.py REF  --devices 8 --steps 8         # uninterrupted

An MLP whose weights and Adam moments are sharded over a 1-D mesh is trained
with optax AdamW; the jitted step donates its inputs, and the checkpointer's
guard makes that safe while each step is captured asynchronously. The fault
kills the process mid-run; the in-flight step is never committed. The
relaunch builds shardings for its own mesh and reads, for each device, only
the box that device holds. Losses print as ``LOSS step value``.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-step", type=int, default=-1)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import ckptbridge
    from ckptbridge.adapters.jax._leaves import index_box

    mesh = Mesh(np.array(jax.devices()), ("data",))
    shard_rows = NamedSharding(mesh, PartitionSpec("data", None))  # 48 rows: 6/device on 8, 8/device on 6
    replicated = NamedSharding(mesh, PartitionSpec())
    d_in, hidden, d_out, batch = 16, 48, 8, 24
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.device_put(jax.random.normal(k1, (hidden, d_in)) * 0.3, shard_rows),
              "w2": jax.device_put(jax.random.normal(k2, (hidden, d_out)) * 0.3, shard_rows)}
    tx = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = tx.init(params)

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w1"].T)
        return jnp.mean((h @ p["w2"] - y) ** 2)

    def train_step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    step_fn = jax.jit(train_step, donate_argnums=(0, 1))
    ck = ckptbridge.Checkpointer(args.root, keep_last=3)
    step_fn = ck.guard(step_fn)

    def flat(p, s):
        adam = s[0]
        return {"params": p, "mu": adam.mu, "nu": adam.nu, "count": adam.count}

    start = 0
    latest = ck.latest()
    if latest is not None:
        ckpt = ckptbridge.open(ck.path_of(latest))

        def load(name, like):
            sharding = like.sharding
            return jax.make_array_from_callback(
                like.shape, sharding, lambda idx: ckpt[name].read(index_box(idx, like.shape)))

        params = {k: load(f"params.{k}", v) for k, v in params.items()}
        adam = opt_state[0]
        adam = adam._replace(mu={k: load(f"mu.{k}", v) for k, v in adam.mu.items()},
                             nu={k: load(f"nu.{k}", v) for k, v in adam.nu.items()},
                             count=jax.device_put(jnp.asarray(ckpt["count"].read()), replicated))
        opt_state = (adam, *opt_state[1:])
        start = latest + 1
        print(f"RESUMED from step {latest} on {len(jax.devices())} devices, "
              f"read {ckpt.stats.bytes_read} bytes", flush=True)
    for step in range(start, args.steps):
        if step == args.kill_step:
            print(f"the job dies at step {step}", flush=True)
            os._exit(1)
        rng = np.random.default_rng(1000 + step)
        x = rng.standard_normal((batch, d_in)).astype(np.float32)
        y = np.tanh(x[:, :d_out]).astype(np.float32)
        params, opt_state, loss = step_fn(params, opt_state, x, y)
        print(f"LOSS {step} {float(loss):.9g}", flush=True)
        ck.save(step, flat(params, opt_state))
    ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

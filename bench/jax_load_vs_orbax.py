#!/usr/bin/env python
"""JAX: load a sharded state onto a changed sharding; ckptbridge vs Orbax restore (8 CPU devices).

    python bench/jax_load_vs_orbax.py [--quick | --size 1g | --size 8g]

The same standard-normal fp32 state (16 tensors of ``rows x 1024``, ``gib`` in all) is saved
once per size from a 2x4 mesh with ``P("x", "y")`` three times: by Orbax at its defaults
(``StandardCheckpointer``: OCDBT, zstd compression), by Orbax without compression
(``PyTreeCheckpointHandler(use_compression=False)``) and by ``ckptbridge.adapters.jax.save``
(universal, uncompressed). Each case loads onto a 4x2 mesh with ``P(None, ("a", "b"))`` in a
fresh process; imports, meshes and the target shardings are made before the clock (JAX's
runtime warmed by one tiny transfer for every tool); the clock stops once the arrays are ready.

* Orbax ``StandardCheckpointer.restore`` of its default (zstd) checkpoint, and of the
  uncompressed one: the fair row, same bytes on disk as ckptbridge's;
* ckptbridge ``adapters.jax.load`` from its universal directory, and from each Orbax
  checkpoint in place (ckptbridge's own reader: raw chunks read directly, zstd chunks decoded
  with ``zstandard``; TensorStore only as its fallback).

After the clock every case sums the loaded arrays (``checksum``: the same values loaded).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Case, Column, Size, Suite, main, warm

N = 16
COLS = 1024


def _meshes():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devs = np.array(jax.devices())
    return Mesh(devs.reshape(2, 4), ("x", "y")), Mesh(devs.reshape(4, 2), ("a", "b"))


def _rows(gib: float) -> int:
    return max(8, int(gib * (1 << 30) / N / 4 / COLS) // 8 * 8)


def prepare(ctx) -> None:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ckptbridge.adapters import jax as cbjax

    src, _ = _meshes()
    rng = np.random.default_rng(0)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((_rows(ctx.gib), COLS), dtype=np.float32),
                                    NamedSharding(src, P("x", "y"))) for i in range(N)}
    ck = ocp.StandardCheckpointer()
    ck.save(ctx.input("orbax"), tree)
    ck.wait_until_finished()
    raw = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    raw.save(ctx.input("orbax_nozstd"), args=ocp.args.PyTreeSave(tree))
    cbjax.save(ctx.input("universal"), tree)
    os.sync()


def _setup(ctx, tool: str):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if tool == "ckptbridge":
        warm.ckptbridge()
    else:
        import orbax.checkpoint  # noqa: F401
    _, dst = _meshes()
    sh = NamedSharding(dst, P(None, ("a", "b")))
    jax.block_until_ready(jax.device_put(np.ones((8, 8), np.float32), sh))  # the runtime, warmed
    return {f"w{i}": jax.ShapeDtypeStruct((_rows(ctx.gib), COLS), np.float32, sharding=sh) for i in range(N)}


def _checksum(ctx, out) -> None:
    import jax
    import numpy as np

    ctx.metrics["checksum"] = float(sum(np.asarray(jax.device_get(v), dtype=np.float64).sum() for v in out.values()))


def _orbax(ctx, which: str) -> None:
    import jax
    import orbax.checkpoint as ocp

    target = _setup(ctx, "orbax")
    with ctx.region():
        out = ocp.StandardCheckpointer().restore(ctx.input(which), target)
        jax.block_until_ready(out)
    _checksum(ctx, out)


def orbax_default(ctx):
    _orbax(ctx, "orbax")


def orbax_nozstd(ctx):
    _orbax(ctx, "orbax_nozstd")


def _cb(ctx, which: str) -> None:
    import jax

    import ckptbridge
    from ckptbridge.adapters import jax as cbjax

    target = _setup(ctx, "ckptbridge")
    with ctx.region(), ckptbridge.open(ctx.input(which)) as ck:
        out = cbjax.load(ck, target)
        jax.block_until_ready(out)
    _checksum(ctx, out)


def cb_universal(ctx):
    _cb(ctx, "universal")


def cb_orbax(ctx):
    _cb(ctx, "orbax")


def cb_orbax_nozstd(ctx):
    _cb(ctx, "orbax_nozstd")


def startup_orbax(ctx):
    return [sys.executable, "-c", "import jax, orbax.checkpoint; jax.devices()"]


def startup_cb(ctx):
    return [sys.executable, "-c", "import jax, ckptbridge.adapters.jax; jax.devices()"]


G = "load onto a changed sharding (2x4 P(x, y) -> 4x2 P(None, (a, b)))"
SUITE = Suite(
    name="jax", module="jax_load_vs_orbax",
    title="JAX: load onto a changed sharding (ckptbridge vs Orbax restore)",
    description=__doc__.split("\n\n", 2)[2].strip(),
    prepare="prepare",
    prepare_mem_gib=lambda g: 2.5 * g + 1,
    disk_gib=lambda g: 3.2 * g,
    sizes={"quick": Size("quick", 1 / 32, reps=1), "1g": Size("1g", 1.0, reps=3), "8g": Size("8g", 8.0, reps=2)},
    cases=(
        # each Orbax case is compared with ckptbridge reading the same checkpoint (vs=); the
        # reference reads Orbax's default (zstd) checkpoint; the universal dir is a second row
        Case("orbax/default", G, "Orbax", "default (StandardCheckpointer, zstd checkpoint)", fn="orbax_default",
             startup="orbax", vs="cb/orbax", mem_gib=lambda g: 2.5 * g + 1),
        Case("orbax/nozstd", G, "Orbax", "fastest fair: checkpoint saved with use_compression=False",
             fn="orbax_nozstd", startup="orbax", vs="cb/orbax-nozstd", mem_gib=lambda g: 2.5 * g + 1),
        Case("cb/universal", G, "ckptbridge", "adapters.jax.load, universal dir (another input)", "ours",
             fn="cb_universal", startup="ckptbridge", mem_gib=lambda g: 1.2 * g + 1),
        Case("cb/orbax-nozstd", G, "ckptbridge", "adapters.jax.load, the uncompressed Orbax checkpoint in place",
             "ours", fn="cb_orbax_nozstd", startup="ckptbridge", mem_gib=lambda g: 1.5 * g + 1),
        Case("cb/orbax", G, "ckptbridge", "adapters.jax.load, the zstd Orbax checkpoint in place", "ours",
             fn="cb_orbax", startup="ckptbridge", ref=True, mem_gib=lambda g: 1.5 * g + 1),
    ),
    startups={
        "orbax": Case("startup/orbax", "start-up", "Orbax", "import jax, orbax.checkpoint", cmd="startup_orbax"),
        "ckptbridge": Case("startup/ckptbridge", "start-up", "ckptbridge", "import jax, ckptbridge.adapters.jax",
                           cmd="startup_cb"),
    },
    columns=(Column("checksum", "sum of the values loaded", "{:.6g}"),),
    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"},
)


if __name__ == "__main__":
    sys.exit(main([SUITE]))

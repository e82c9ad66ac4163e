"""One process of the two-process JAX tests (tests/test_jax_multiprocess.py); run as a script.

    python _jax_mp_worker.py PROCESS_ID PORT PATH [save|checkpointer]

Each process has 4 CPU devices; together they form one 2x4 mesh.

``save`` (default): saves a sharded array (each process writes its own shards,
process 0 commits) and loads it onto a 4x2 mesh (each process reads only its
devices' boxes).

``checkpointer``: a train loop whose jitted step donates its state saves every
step with ``ckptbridge.Checkpointer`` (rank and world size from
``jax.distributed``); each process snapshots only its addressable shards.
Process 1 holds back its part of step 1 for a while, and checks that process 0
did not commit the step without it.
"""

import os
import sys
import time

pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else "save"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptbridge as cbopen  # noqa: E402
from ckptbridge.adapters import jax as cbjax  # noqa: E402

ref = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
arr = jax.make_array_from_callback(ref.shape, NamedSharding(mesh, P("x", "y")), lambda i: ref[i])
rep = jax.make_array_from_callback((16,), NamedSharding(mesh, P()), lambda i: ref[0][i])


def save_and_load() -> None:
    cbjax.save(path, {"w": arr, "b": rep}, step=4)
    ck = cbopen.open(path)
    mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    out = cbjax.load(ck, {"w": NamedSharding(mesh2, P("b", "a"))})["w"]
    for s in out.addressable_shards:
        if not np.array_equal(np.asarray(s.data), ref[s.index]):
            raise SystemExit(f"process {pid}: shard {s.index} differs")
    print(f"OK {pid} bytes_read={ck.stats.bytes_read}", flush=True)


def checkpointer_loop() -> None:
    step_fn = jax.jit(lambda p: {"w": p["w"] * 0.5 + 1.0, "b": p["b"] + 1.0}, donate_argnums=(0,))
    params = {"w": arr, "b": rep}
    with cbopen.Checkpointer(path, keep_last=None) as ck:
        if (ck.rank, ck.world_size) != (pid, 2):
            raise SystemExit(f"process {pid}: rank/world size {ck.rank}/{ck.world_size} from jax.distributed")
        guarded = ck.guard(step_fn)  # the step donates what was just saved: it waits for the snapshot
        for step in range(3):
            if pid == 1 and step == 1:
                time.sleep(3)  # process 0 wrote its part of step 1 long ago
                if os.path.exists(os.path.join(path, "step_00000001", "COMMITTED")):
                    raise SystemExit("process 0 committed step 1 without process 1's shards")
            ck.save(step, {"params": params})
            params = guarded(params)
        ck.wait()
        sizes = [s.bytes for s in ck.stats]
    print(f"OK {pid} bytes_per_save={sizes}", flush=True)


save_and_load() if mode == "save" else checkpointer_loop()

"""One process of the two-process JAX test (tests/test_jax_multiprocess.py); run as a script.

Each process has 4 CPU devices; together they form one 2x4 mesh. Saves a sharded
array (each process writes its own shards, process 0 commits) and loads it onto a
4x2 mesh (each process reads only its devices' boxes).
"""

import os
import sys

pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
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
cbjax.save(path, {"w": arr, "b": rep}, step=4)

ck = cbopen.open(path)
mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
out = cbjax.load(ck, {"w": NamedSharding(mesh2, P("b", "a"))})["w"]
for s in out.addressable_shards:
    if not np.array_equal(np.asarray(s.data), ref[s.index]):
        raise SystemExit(f"process {pid}: shard {s.index} differs")
print(f"OK {pid} bytes_read={ck.stats.bytes_read}", flush=True)

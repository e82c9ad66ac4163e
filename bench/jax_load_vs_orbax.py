"""Load a sharded state onto a *changed* sharding: ckptbridge vs Orbax restore (8 fake CPU devices).

The same data (standard normal fp32, ``--mib`` in all, in ``--tensors`` tensors) is saved
from a 2x4 mesh with ``P("x", "y")`` twice: by Orbax ``StandardCheckpointer`` (its defaults,
zstd) and by ``ckptbridge.adapters.jax.save`` (universal). Each is then loaded onto a 4x2 mesh
with ``P(None, ("a", "b"))``, each in a fresh subprocess (peak RSS per mode):

* ``orbax``       Orbax ``StandardCheckpointer.restore`` with the new shardings;
* ``cb-universal`` ``ckptbridge.adapters.jax.load`` from the universal directory;
* ``cb-orbax``     ``ckptbridge.adapters.jax.load`` from the Orbax checkpoint (TensorStore).

Each rep of each mode is a fresh process (modes interleaved rep by rep). Reports seconds
(median of ``--reps``, warm page cache; the first rep also pays for jax's start-up),
bytes the process read (``/proc/self/io`` rchar; mmap page faults are not counted there,
see ckptbridge's own count) and peak RSS::

    OMP_NUM_THREADS=1 .venv/bin/python bench/jax_load_vs_orbax.py --mib 1024 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


MODES = ("orbax", "cb-universal", "cb-orbax")


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar")).split()[1])


def _hwm_mib() -> float:
    """Peak RSS of this process image (VmHWM; ru_maxrss would include the parent's peak before exec)."""
    with open("/proc/self/status") as fh:
        return int(next(line for line in fh if line.startswith("VmHWM")).split()[1]) / 1024


def _meshes():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devs = np.array(jax.devices())
    return Mesh(devs.reshape(2, 4), ("x", "y")), Mesh(devs.reshape(4, 2), ("a", "b"))


def make(root: str, mib: int, tensors: int) -> None:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ckptbridge.adapters import jax as cbjax

    src, _ = _meshes()
    rows = max(8, (mib << 20) // tensors // 4 // 1024 // 8 * 8)
    rng = np.random.default_rng(0)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((rows, 1024), dtype=np.float32),
                                    NamedSharding(src, P("x", "y"))) for i in range(tensors)}
    ck = ocp.StandardCheckpointer()
    ck.save(os.path.join(root, "orbax"), tree)
    ck.wait_until_finished()
    cbjax.save(os.path.join(root, "universal"), tree)
    with open(os.path.join(root, "shapes.json"), "w") as fh:
        json.dump({k: list(v.shape) for k, v in tree.items()}, fh)


def run_mode(root: str, mode: str, reps: int) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ckptbridge as cbopen
    from ckptbridge.adapters import jax as cbjax

    _, dst = _meshes()
    with open(os.path.join(root, "shapes.json")) as fh:
        shapes = json.load(fh)
    sh = NamedSharding(dst, P(None, ("a", "b")))
    target = {k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=sh) for k, s in shapes.items()}
    times, rchars, counted = [], [], []
    for _ in range(reps):
        r0, t0 = _rchar(), time.perf_counter()
        if mode == "orbax":
            out = ocp.StandardCheckpointer().restore(os.path.join(root, "orbax"), target)
            counted.append(None)
        else:
            ckpt = cbopen.open(os.path.join(root, "universal" if mode == "cb-universal" else "orbax"))
            out = cbjax.load(ckpt, target)
            counted.append(ckpt.stats.bytes_read)
            ckpt.close()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        rchars.append(_rchar() - r0)
        del out
    return {"mode": mode, "seconds": statistics.median(times), "all_seconds": times,
            "rchar": statistics.median(rchars), "bytes_read_counted": counted[-1],
            "peak_rss_mib": _hwm_mib()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode")
    ap.add_argument("--root")
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.root, args.mode, args.reps)))
        return
    root = tempfile.mkdtemp(prefix="cb-bench-jax-")
    try:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "import jax_load_vs_orbax as b; b.make(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))",
                        os.path.dirname(os.path.abspath(__file__)), root, str(args.mib), str(args.tensors)],
                       check=True)
        print(f"# made {args.mib} MiB in {args.tensors} tensors in {time.perf_counter() - t0:.1f}s", flush=True)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.reps):  # modes interleaved rep by rep: drift on a shared machine hits all alike
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--mode", mode, "--root", root, "--reps", "1"],
                                     check=True, capture_output=True, text=True).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
        results = {}
        for mode, rs in runs.items():
            results[mode] = {
                "mode": mode, "seconds": statistics.median(r["seconds"] for r in rs),
                "all_seconds": [round(r["seconds"], 3) for r in rs],
                "rchar": statistics.median(r["rchar"] for r in rs),
                "bytes_read_counted": rs[-1]["bytes_read_counted"],
                "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            }
            print(json.dumps(results[mode]), flush=True)
        base = results["orbax"]["seconds"]
        for mode in ("cb-universal", "cb-orbax"):
            print(f"# {mode}: {base / results[mode]['seconds']:.2f}x the speed of Orbax restore "
                  f"(peak rss {results[mode]['peak_rss_mib']:.0f} vs {results['orbax']['peak_rss_mib']:.0f} MiB)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

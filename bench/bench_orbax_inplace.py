#!/usr/bin/env python
"""Orbax checkpoints read in place by ckptbridge vs Orbax's own restore, onto a changed mesh.

The same data (standard normal fp32, ``--mib`` in ``--tensors`` tensors, saved from a 2x4
mesh of 8 CPU devices with ``P("x", "y")``) is written by Orbax four times, with its
OCDBT store (the default) and:

* ``zarr2-zstd``  ``StandardCheckpointer``'s defaults (zarr v2 chunks, zstd level 1);
* ``zarr3-zstd``  ``PyTreeCheckpointHandler(use_zarr3=True)`` (zarr3 shards, zstd level 3);
* ``zarr2-raw``, ``zarr3-raw``  the same with ``use_compression=False`` (the same bytes on
  disk as the data: no decoding on either side).

Each is then loaded onto a 4x2 mesh with ``P(None, ("a", "b"))`` (every device's box cuts
through two saved chunks, every saved chunk feeds two devices) by

* ``orbax``  ``ocp.StandardCheckpointer().restore(path, abstract_target)``;
* ``cb``     ``ckptbridge.adapters.jax.load(ckptbridge.open(path), abstract_target)``.

Every (layout, tool) pair runs in a fresh process per rep, pairs interleaved rep by rep
(drift on a shared machine hits all alike); warm page cache. Per run: seconds of the
load (imports and JAX start-up excluded, the same for both), bytes the process read
(``/proc/self/io`` rchar, and for ckptbridge also its own count, which includes what it
copies out of memory maps; against what the target shards need: all of the data), CPU
seconds of the process (all threads: on a shared machine a steadier measure than wall
time), and the process's peak RSS (VmHWM). Writes ``bench/results/orbax_inplace.json``::

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_orbax_inplace.py --mib 1024 --reps 5 [--ablation]

``--ablation`` adds variants of ckptbridge that undo one fix each: ``cb-ts`` reads
uncompressed chunks through TensorStore too, ``cb-ts-copy`` also reads into numpy's own
(16-byte-aligned) buffers, which JAX then copies into device buffers; ``cb-huge`` takes its
host buffers from numpy with huge pages even where the kernel reports free memory to a
hypervisor (``ckptbridge.plugin.fresh_array``; on such a VM a fresh huge page is usually
one the host took back, and its first touch costs 3x a 4 KiB page's, when it is not 6x less).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LAYOUTS = {  # name -> (use_zarr3, use_compression)
    "zarr2-zstd": (False, True),
    "zarr3-zstd": (True, True),
    "zarr2-raw": (False, False),
    "zarr3-raw": (True, False),
}
TOOLS = ("orbax", "cb")
ABLATION = ("cb-ts", "cb-ts-copy", "cb-huge")


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar")).split()[1])


def _hwm_mib() -> float:
    with open("/proc/self/status") as fh:
        return int(next(line for line in fh if line.startswith("VmHWM")).split()[1]) / 1024


def _meshes():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devs = np.array(jax.devices())
    return Mesh(devs.reshape(2, 4), ("x", "y")), Mesh(devs.reshape(4, 2), ("a", "b"))


def make(root: str, mib: int, tensors: int) -> None:
    """Write the state with Orbax in every layout, plus shapes.json."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    src, _ = _meshes()
    rows = max(8, (mib << 20) // tensors // 4 // 1024 // 8 * 8)
    rng = np.random.default_rng(0)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((rows, 1024), dtype=np.float32),
                                    NamedSharding(src, P("x", "y"))) for i in range(tensors)}
    for name, (zarr3, compress) in LAYOUTS.items():
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=zarr3, use_compression=compress)
        with ocp.Checkpointer(handler) as ck:
            ck.save(os.path.join(root, name), args=ocp.args.PyTreeSave(tree))
    with open(os.path.join(root, "shapes.json"), "w") as fh:
        json.dump({k: list(v.shape) for k, v in tree.items()}, fh)


def run_one(path: str, shapes_file: str, tool: str) -> dict:
    """Load ``path`` onto the changed mesh with ``tool``, in this process."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _, dst = _meshes()
    with open(shapes_file) as fh:
        shapes = json.load(fh)
    sh = NamedSharding(dst, P(None, ("a", "b")))
    target = {k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=sh) for k, s in shapes.items()}
    if tool == "orbax":
        import orbax.checkpoint as ocp

        ck = ocp.StandardCheckpointer()
        r0, t0, c0 = _rchar(), time.perf_counter(), time.process_time()
        out = ck.restore(path, target)
        counted = None
    else:
        import ckptbridge
        from ckptbridge.adapters import jax as cbjax

        if tool == "cb-huge":  # ablation: numpy's huge pages for the host buffers, whatever the kernel
            from ckptbridge._storage import hostmem as _hostmem

            _hostmem.huge_first_touch_is_slow = lambda: False
        if tool in ("cb-ts", "cb-ts-copy"):  # ablation: uncompressed chunks through TensorStore too
            from ckptbridge.adapters.orbax import _reader

            _reader.raw_fragments = lambda *args, **kw: None
        if tool == "cb-ts-copy":  # ablation: host buffers JAX copies (numpy's default alignment)
            from ckptbridge.plugin import dtypes

            cbjax.host_buffer = lambda shape, dtype: np.empty(shape, dtypes.to_numpy(dtype))
        r0, t0, c0 = _rchar(), time.perf_counter(), time.process_time()
        with ckptbridge.open(path) as ckpt:
            out = cbjax.load(ckpt, target)
            counted = ckpt.stats.bytes_read
    jax.block_until_ready(out)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rchar = _rchar() - r0
    need = sum(int(np.prod(s)) * 4 for s in shapes.values())
    ok = all(tuple(out[k].shape) == tuple(s) for k, s in shapes.items())
    # bytes read: rchar counts read()/pread() (TensorStore, preadv); ckptbridge's own count adds
    # what it copied out of memory maps (strided boxes of uncompressed chunks), which rchar misses
    read = rchar if counted is None else max(rchar, counted)
    return {"tool": tool, "seconds": seconds, "cpu_s": cpu, "rchar": rchar, "counted": counted, "read": read,
            "need_bytes": need, "peak_rss_mib": _hwm_mib(), "shapes_ok": ok}


def check_equal(root: str, layout: str) -> bool:
    """Both tools give the same arrays (once, outside the timed runs)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ckptbridge
    from ckptbridge.adapters import jax as cbjax

    _, dst = _meshes()
    with open(os.path.join(root, "shapes.json")) as fh:
        shapes = json.load(fh)
    sh = NamedSharding(dst, P(None, ("a", "b")))
    target = {k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=sh) for k, s in shapes.items()}
    path = os.path.join(root, layout)
    a = ocp.StandardCheckpointer().restore(path, target)
    with ckptbridge.open(path) as ckpt:
        b = cbjax.load(ckpt, target)
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) and b[k].sharding == sh for k in shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--root", default=None, help="reuse checkpoints made here (default: a temp dir)")
    ap.add_argument("--ablation", action="store_true",
                    help="also cb-ts (uncompressed chunks read through TensorStore, not as file regions), "
                         "cb-ts-copy (that, into buffers JAX copies instead of adopting) and cb-huge (numpy's "
                         "huge pages for the host buffers under a hypervisor that takes free memory back)")
    ap.add_argument("--one", nargs=3, metavar=("PATH", "SHAPES", "TOOL"), help=argparse.SUPPRESS)
    ap.add_argument("--make", nargs=3, metavar=("ROOT", "MIB", "TENSORS"), help=argparse.SUPPRESS)
    ap.add_argument("--check", nargs=2, metavar=("ROOT", "LAYOUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(*a.one)))
        return
    if a.make:
        make(a.make[0], int(a.make[1]), int(a.make[2]))
        return
    if a.check:
        print(json.dumps({"equal": check_equal(*a.check)}))
        return
    from _proc import last_json, save_result

    layouts = [x for x in a.layouts.split(",") if x in LAYOUTS]
    tools = TOOLS + (ABLATION if a.ablation else ())
    root = a.root or tempfile.mkdtemp(prefix="cb-bench-orbax-")
    env = dict(os.environ)
    try:
        if not os.path.exists(os.path.join(root, "shapes.json")):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--make", root, str(a.mib), str(a.tensors)], check=True, env=env)
            print(f"# made {a.mib} MiB in {a.tensors} tensors, {len(LAYOUTS)} layouts, in "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
        disk = {lay: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, lay))
                         for f in fs) for lay in layouts}
        equal = {}
        for lay in layouts:
            out = subprocess.run([sys.executable, __file__, "--check", root, lay], check=True, env=env,
                                 capture_output=True, text=True).stdout
            equal[lay] = last_json(out)["equal"]
        runs: dict[str, dict[str, list[dict]]] = {lay: {t: [] for t in tools} for lay in layouts}
        for rep in range(a.reps):
            for lay in layouts:
                for tool in tools:
                    out = subprocess.run([sys.executable, __file__, "--one", os.path.join(root, lay),
                                          os.path.join(root, "shapes.json"), tool],
                                         check=True, env=env, capture_output=True, text=True).stdout
                    r = last_json(out)
                    runs[lay][tool].append(r)
                    print(f"rep {rep} {lay:10s} {tool:10s} {r['seconds']:6.2f}s  cpu {r['cpu_s']:6.2f}s  read "
                          f"{r['read'] / r['need_bytes']:.2f}x of need  peak {r['peak_rss_mib']:6.0f} MiB", flush=True)
        summary = {}
        for lay in layouts:
            med = {t: {k: statistics.median(r[k] for r in runs[lay][t])
                       for k in ("seconds", "cpu_s", "read", "peak_rss_mib")} for t in tools}
            need = runs[lay]["cb"][0]["need_bytes"]
            summary[lay] = {
                "disk_bytes": disk[lay], "need_bytes": need, "same_arrays": equal[lay],
                "orbax_s": med["orbax"]["seconds"], "cb_s": med["cb"]["seconds"],
                "speedup": med["orbax"]["seconds"] / med["cb"]["seconds"],
                "orbax_cpu_s": med["orbax"]["cpu_s"], "cb_cpu_s": med["cb"]["cpu_s"],
                "cpu_ratio": med["orbax"]["cpu_s"] / med["cb"]["cpu_s"],
                "read_vs_need": {t: med[t]["read"] / need for t in tools},
                "peak_rss_mib": {t: med[t]["peak_rss_mib"] for t in tools},
                "all_seconds": {t: [round(r["seconds"], 3) for r in runs[lay][t]] for t in tools},
                "ablation": {t: {"seconds": med[t]["seconds"], "cpu_s": med[t]["cpu_s"]} for t in ABLATION
                             if t in med},
            }
        print(f"\n{a.mib} MiB in {a.tensors} tensors, 2x4 P(x, y) -> 4x2 P(None, (a, b)), medians of {a.reps}")
        print(f"{'layout':11s} {'orbax s':>8s} {'cb s':>7s} {'speed-up':>9s} {'cpu orbax/cb':>13s} {'read/need orbax':>16s} "
              f"{'cb':>5s} {'peak MiB orbax':>15s} {'cb':>6s} same")
        for lay, s in summary.items():
            print(f"{lay:11s} {s['orbax_s']:8.2f} {s['cb_s']:7.2f} {s['speedup']:8.2f}x {s['cpu_ratio']:12.2f}x "
                  f"{s['read_vs_need']['orbax']:16.2f} {s['read_vs_need']['cb']:5.2f} "
                  f"{s['peak_rss_mib']['orbax']:15.0f} {s['peak_rss_mib']['cb']:6.0f} {s['same_arrays']}")
        for lay, s in summary.items():
            for t, v in s["ablation"].items():
                print(f"  ablation {lay:10s} {t:10s} {v['seconds']:6.2f}s  cpu {v['cpu_s']:6.2f}s")
        path = save_result("orbax_inplace", {"mib": a.mib, "tensors": a.tensors, "reps": a.reps,
                                             "summary": summary, "runs": runs})
        print(f"# wrote {path}")
    finally:
        if a.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

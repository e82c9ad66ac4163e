#!/usr/bin/env python
"""Big-state benchmarks on the output of ``bench/make_big_state.py``: convert, reshard-load, memory.

Given ``BIG`` (made by ``make_big_state.py``: ``BIG/ds2/ckpt``, ``BIG/ds3/ckpt``, ``BIG/dcp``,
``BIG/info.json``), every command a fresh process tree, measured with wall time and the peak
RSS of the whole tree (psutil, 20 ms samples). Every tool meets the same page-cache state: each
command starts with its inputs evicted (``posix_fadvise(DONTNEED)``, as the harness's cold run),
so none finds the bytes another tool's run left in the cache; a convert's time includes the
``fsync`` of everything it wrote (the same durability for every tool: ``ds_to_universal`` writes
through the page cache, ckptbridge with direct I/O); reps are interleaved, the order of the tools
reversed every other rep, and the medians reported (``--reps``, default 2):

* ``convert`` (per DeepSpeed layout): ``python -m deepspeed.checkpoint.ds_to_universal``
  (its defaults) vs ``ckptbridge convert SRC DST``; and ``ckptbridge convert`` of the DCP
  state. ckptbridge's peak must stay flat in the model size: at most
  ``max(2 x the largest tensor, 1 GiB)`` (checked, reported as ``flat_ok``).
* ``jax``: the fp32 weights onto a changed mesh of 8 CPU devices (2-D tensors
  ``P(None, ("a", "b"))`` on a 4x2 mesh, 1-D ones ``P(("a", "b"))`` where they divide, else
  replicated): ``ckptbridge.adapters.jax.load`` straight from the native ZeRO-2 files vs
  Orbax's restore of the same weights as an Orbax checkpoint (written once with
  ``ckptbridge reshard --to orbax -o layout=flat``, zstd as Orbax's default), and
  ckptbridge reading that Orbax checkpoint in place.
* ``torch``: the DCP model weights (saved ``Shard(0)`` on ``ws`` ranks) loaded as ``Shard(1)``
  DTensors on the same ranks: ``dcp.load`` vs ``ckptbridge.adapters.torch.load_into``.

Outputs go to ``--scratch`` (default ``BIG/scratch``) and are deleted after each command.
Writes ``bench/results/big_state.json``::

    python bench/make_big_state.py /tmp/big && python bench/bench_big_state.py /tmp/big
    python bench/bench_big_state.py /tmp/tiny --only convert --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _harness.child import fsync_tree  # noqa: E402
from _harness.runner import evict  # noqa: E402
from _proc import last_json, measure, save_result  # noqa: E402

PARTS = ("convert", "jax", "torch")


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({"DS_ACCELERATOR": "cpu", "DS_SKIP_SHM_OP": "1", "OMP_NUM_THREADS": e.get("OMP_NUM_THREADS", "1"),
              "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"})
    return e


def _cli() -> list[str]:
    return [sys.executable, "-c", "import sys; from ckptbridge._cli import main; sys.exit(main(sys.argv[1:]))"]


def _tag_dir(root: str) -> str:
    with open(os.path.join(root, "latest")) as fh:
        return os.path.join(root, fh.read().strip())


def _run(label: str, cmd: list[str], scratch: str, results: dict, inputs: str) -> dict:
    """``cmd`` in a fresh process tree with ``inputs`` evicted from the page cache first; its wall
    time includes the fsync of what it wrote under ``scratch`` (``fsync_s`` of it)."""
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    evicted = evict(inputs)
    r = measure(cmd, env=_env(), timeout=6 * 3600)
    t0 = time.perf_counter()
    fsync_tree(scratch)
    fsync_s = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    row = {"wall_s": r["wall_s"] + fsync_s, "fsync_s": fsync_s, "peak_tree_rss_mb": r["peak_tree_rss_mb"],
           "evicted_mib": evicted / 2**20}
    try:
        row.update(last_json(r["stdout"]))
    except ValueError:
        pass
    results.setdefault(label, []).append(row)
    print(f"{label:28s} {r['wall_s']:8.2f}s  peak tree {r['peak_tree_rss_mb']:8.0f} MB", flush=True)
    return row


# ------------------------------------------------------------------ JAX


def _jax_target(shapes: dict[str, list[int]]):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    m = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    out = {}
    for name, s in shapes.items():
        if len(s) == 2 and s[1] % 8 == 0:
            spec = P(None, ("a", "b"))
        elif len(s) == 1 and s[0] % 8 == 0:
            spec = P(("a", "b"))
        else:
            spec = P()
        out[name] = jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=NamedSharding(m, spec))
    return out


def jax_child(tool: str, path: str, shapes_file: str) -> None:
    """One JAX load in this process; prints seconds, bytes counted and VmHWM."""
    import jax

    with open(shapes_file) as fh:
        shapes = json.load(fh)
    target = _jax_target(shapes)
    t0 = time.perf_counter()
    counted = None
    if tool == "orbax":
        import orbax.checkpoint as ocp

        out = ocp.StandardCheckpointer().restore(path, target)  # the flat tree reshard -o layout=flat wrote
    else:
        import ckptbridge
        from ckptbridge.adapters import jax as cbjax

        with ckptbridge.open(path) as ckpt:
            arrays = cbjax.load_arrays(ckpt, [(n, t.sharding, "float32", t.shape, "fp32") for n, t in target.items()])
            out = dict(zip(target, arrays, strict=True))
            counted = ckpt.stats.bytes_read
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    with open("/proc/self/status") as fh:
        hwm = int(next(x for x in fh if x.startswith("VmHWM")).split()[1]) / 1024
    print(json.dumps({"load_s": seconds, "bytes_counted": counted, "peak_rss_mib": hwm}))


# ------------------------------------------------------------------ torch (under torchrun)


def torch_child(tool: str, path: str, shapes_file: str) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    with open(shapes_file) as fh:
        shapes = json.load(fh)
    target = {}
    for name, s in shapes.items():  # Shard(1) of 2-D weights (saved as Shard(0)), Shard(0) of 1-D ones
        dim = 1 if len(s) == 2 else 0
        n = -(-s[dim] // ws)
        lo, hi = min(s[dim], rank * n), min(s[dim], (rank + 1) * n)
        local_shape = list(s)
        local_shape[dim] = hi - lo
        stride = (s[1], 1) if len(s) == 2 else (1,)
        target[name] = DTensor.from_local(torch.zeros(local_shape), mesh, [Shard(dim)], run_check=False,
                                          shape=torch.Size(s), stride=stride)
    dist.barrier()
    t0 = time.perf_counter()
    counted = None
    if tool == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load({"model": target}, checkpoint_id=path)
    else:
        import ckptbridge
        from ckptbridge.adapters import torch as cbt

        with ckptbridge.open(path) as ckpt:
            cbt.load_into(target, ckpt)
            counted = ckpt.stats.bytes_read
    dist.barrier()
    seconds = time.perf_counter() - t0
    checksum = torch.tensor([sum(float(t.to_local().double().sum()) for t in target.values())], dtype=torch.float64)
    dist.all_reduce(checksum)
    if rank == 0:
        print(json.dumps({"load_s": seconds, "bytes_counted_rank0": counted, "checksum": float(checksum[0]),
                          "peak_rss_mib_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("big", nargs="?")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--jax-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--torch-child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.jax_child:
        return jax_child(*a.jax_child)
    if a.torch_child:
        return torch_child(*a.torch_child)

    with open(os.path.join(a.big, "info.json")) as fh:
        info = json.load(fh)
    scratch = a.scratch or os.path.join(a.big, "scratch")
    parts = [p for p in a.only.split(",") if p in PARTS]
    bound = max(2 * info["largest_tensor_fp32_bytes"], 1 << 30) / 2**20
    results: dict[str, list[dict]] = {}
    py = sys.executable
    fmts = info["formats"]

    import ckptbridge

    if "jax" in parts or "torch" in parts:
        ck = ckptbridge.open(fmts["ds2"]["path"] if "ds2" in fmts else fmts["dcp"]["path"])
        shapes = {n: list(ck[n].shape) for n in ck if len(ck[n].shape) in (1, 2)}
        ck.close()
        shapes_file = os.path.join(a.big, "weights_shapes.json")
        with open(shapes_file, "w") as fh:
            json.dump(shapes, fh)
    orbax_dir = os.path.join(a.big, "orbax_weights")
    if "jax" in parts and "ds2" in fmts and not os.path.exists(orbax_dir):
        t0 = time.time()
        subprocess.run([*_cli(), "reshard", fmts["ds2"]["path"], orbax_dir, "--to", "orbax", "-o", "layout=flat"],
                       check=True, env=_env())
        print(f"# wrote the Orbax copy of the weights in {time.time() - t0:.0f}s", flush=True)

    def in_order(cases: list, rep: int) -> list:  # the tools' order reversed every other rep
        return cases[::-1] if rep % 2 else cases

    for rep in range(a.reps):
        print(f"# rep {rep}", flush=True)
        if "convert" in parts:
            for fmt in ("ds2", "ds3"):
                if fmt not in fmts:
                    continue
                src, u = fmts[fmt]["path"], os.path.join(scratch, "u")
                cases = [(f"convert/{fmt}/ds_to_universal", [py, "-m", "deepspeed.checkpoint.ds_to_universal",
                          "--input_folder", _tag_dir(src), "--output_folder", u, "--inject_missing_state"]),
                         (f"convert/{fmt}/ckptbridge", [*_cli(), "convert", src, u])]
                for label, cmd in in_order(cases, rep):
                    _run(label, cmd, scratch, results, src)
            if "dcp" in fmts:
                _run("convert/dcp/ckptbridge", [*_cli(), "convert", fmts["dcp"]["path"], os.path.join(scratch, "u")],
                     scratch, results, fmts["dcp"]["path"])
        if "jax" in parts and "ds2" in fmts:
            cases = [("orbax", orbax_dir), ("cb-native", fmts["ds2"]["path"]), ("cb-orbax", orbax_dir)]
            for tool, path in in_order(cases, rep):
                _run(f"jax/{tool}", [py, __file__, "--jax-child", tool, path, shapes_file], scratch, results, path)
        if "torch" in parts and "dcp" in fmts:
            for tool in in_order(["dcp", "ckptbridge"], rep):
                cmd = [py, "-m", "torch.distributed.run", f"--nproc_per_node={info['ws']}", "--master_addr=127.0.0.1",
                       f"--master_port={29700 + rep}", __file__, "--torch-child", tool, fmts["dcp"]["path"], shapes_file]
                _run(f"torch/{tool}", cmd, scratch, results, fmts["dcp"]["path"])

    med = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0] if isinstance(rs[0][m], (int, float))}
           for k, rs in results.items()}
    summary: dict = {"bound_mb": bound}
    for fmt in ("ds2", "ds3"):
        ds, cb = med.get(f"convert/{fmt}/ds_to_universal"), med.get(f"convert/{fmt}/ckptbridge")
        if ds and cb:
            summary[f"convert/{fmt}"] = {"speedup": ds["wall_s"] / cb["wall_s"],
                                         "rss_ratio": cb["peak_tree_rss_mb"] / ds["peak_tree_rss_mb"],
                                         "cb_peak_mb": cb["peak_tree_rss_mb"], "flat_ok": cb["peak_tree_rss_mb"] <= bound}
    if "convert/dcp/ckptbridge" in med:
        p = med["convert/dcp/ckptbridge"]["peak_tree_rss_mb"]
        summary["convert/dcp"] = {"cb_peak_mb": p, "flat_ok": p <= bound}
    if "jax/orbax" in med:
        for tool in ("cb-native", "cb-orbax"):
            if f"jax/{tool}" in med:
                summary[f"jax/{tool}"] = {"speedup_vs_orbax": med["jax/orbax"]["load_s"] / med[f"jax/{tool}"]["load_s"],
                                          "rss_ratio": med[f"jax/{tool}"]["peak_rss_mib"] / med["jax/orbax"]["peak_rss_mib"]}
    if "torch/dcp" in med and "torch/ckptbridge" in med:
        summary["torch"] = {"speedup_vs_dcp": med["torch/dcp"]["load_s"] / med["torch/ckptbridge"]["load_s"],
                            "rss_ratio_tree": med["torch/ckptbridge"]["peak_tree_rss_mb"] / med["torch/dcp"]["peak_tree_rss_mb"],
                            "same_checksum": results["torch/dcp"][0]["checksum"] == results["torch/ckptbridge"][0]["checksum"]}
    print(f"\n{info['params'] / 1e6:.0f} M parameters, {info['tensors']} tensors; largest {info['largest_tensor']} "
          f"({info['largest_tensor_fp32_bytes'] / 2**20:.0f} MiB fp32); flat-memory bound {bound:.0f} MB")
    for k, m in med.items():
        print(f"{k:28s} " + "  ".join(f"{x}={v:.2f}" for x, v in m.items()))
    print(json.dumps(summary, indent=1))
    path = save_result("big_state", {"info": info, "reps": a.reps, "median": med, "summary": summary,
                                     "runs": results})
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()

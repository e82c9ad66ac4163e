#!/usr/bin/env python
"""ckptbridge vs DeepSpeed's ``ds_to_universal`` on the same real ZeRO checkpoint.

Makes (once) a ZeRO-2 bf16 checkpoint with real DeepSpeed on CPU (``tools/ds_train.py``,
``--d_model 1024 --n_layer 4``: ~50 M parameters, ~0.7 GiB of state: fp32 master +
exp_avg + exp_avg_sq + bf16 weights), then times, in one run, alternating reps of:

* ``ds``       ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``
               (DeepSpeed's defaults: 4 extract / 2 merge worker processes)
* ``ds_w1``    the same with 1 worker each (no process pool; often faster on 2 cores)
* ``convert``  ``ckptbridge convert SRC DST`` (our pickle-free universal directory)
* ``convert3`` ``ckptbridge convert SRC DST --states fp32,exp_avg,exp_avg_sq``: the same
               content ds_to_universal writes (``convert`` also keeps the bf16 module weights)
* ``reshard``  ``ckptbridge reshard SRC DST --to deepspeed-universal`` (the very layout
               ds_to_universal writes, which DeepSpeed resumes from)
* ``floor``    what no converter can beat here: a Python process that imports numpy and writes
               as many bytes as ``convert`` wrote with O_DIRECT (16 MiB blocks, 3 in flight) from
               one warm buffer, fsync'd; ``floor_buf`` the same through the page cache. ``ds`` over
               the faster of the two is the largest speed-up possible on this disk.

Each command runs as a child process; we record wall time (including a final ``sync``),
peak RSS of the whole process tree (psutil, sampled every 20 ms: DeepSpeed's worker pool
counts in full) and the largest single process's peak (``getrusage(RUSAGE_CHILDREN)``
``ru_maxrss`` of a fresh wrapper process). Outputs are deleted between reps. "warm": reps
back to back with the checkpoint in the page cache; ``--cold`` also drops the page cache
before each rep (needs root) and waits a few seconds.

    python bench/bench_deepspeed_convert.py                       # makes /tmp/ckptbridge_bench_ds
    python bench/bench_deepspeed_convert.py --ckpt RUN/ckpt --reps 3 --json out.json
    python bench/bench_deepspeed_convert.py --out /dev/shm/cb   # outputs in memory: no disk floor
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

from _common import drop_caches

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": e.get("OMP_NUM_THREADS", "1")})
    return e


def make_checkpoint(out: str) -> str:
    import make_deepspeed_ckpt as tools

    os.makedirs(out, exist_ok=True)
    tools.launch(2, ["--stage", "2", "--dtype", "bf16", "--steps", "2", "--out", out,
                     "--d_model", "1024", "--n_layer", "4"], os.path.join(out, "train.log"), timeout=3600)
    return os.path.join(out, "ckpt")


FLOOR = r"""
import mmap, os, sys, threading
import numpy  # noqa: F401  (every converter here imports it)
path, nbytes, mode, block = sys.argv[1], int(sys.argv[2]), sys.argv[3], 16 << 20
buf = mmap.mmap(-1, block); buf.write(os.urandom(block))
try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if mode == "direct" else 0), 0o644)
except OSError:  # tmpfs: no O_DIRECT
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
offs = list(range(0, nbytes, block))
def run(k):
    for o in offs[k::3]:
        os.pwrite(fd, buf, o)
ths = [threading.Thread(target=run, args=(k,)) for k in range(3)]
[t.start() for t in ths]; [t.join() for t in ths]
os.ftruncate(fd, nbytes); os.fsync(fd); os.close(fd)
"""


def _universal_bytes(tag_dir: str) -> int:
    """Bytes of tensor data ``ckptbridge convert`` writes for this checkpoint (all states)."""
    import ckptbridge

    ck = ckptbridge.open(os.path.dirname(tag_dir))
    return sum(st.nbytes for t in ck.tensors.values() for st in t.states.values())


def state_bytes(tag_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(tag_dir, f)) for f in os.listdir(tag_dir) if f.endswith(".pt"))


def measure(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd`` in a fresh wrapper; wall seconds, peak tree RSS, peak single-process RSS."""
    import psutil

    wrapper = [sys.executable, __file__, "--child", "--", *cmd]
    t0 = time.perf_counter()
    proc = subprocess.Popen(wrapper, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            peak = max(peak, total)
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{err[-3000:]}")
    child = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": wall, "peak_tree_rss_mb": peak / 2**20, "peak_proc_rss_mb": child["maxrss_kb"] / 1024}


def child_main(cmd: list[str]) -> None:
    """Wrapper process: run cmd, sync, print the largest descendant's ru_maxrss."""
    res = subprocess.run(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    os.sync()
    if res.returncode:
        sys.stderr.write(res.stderr)
        raise SystemExit(res.returncode)
    print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="DeepSpeed checkpoint root (default: make one)")
    ap.add_argument("--workdir", default="/tmp/ckptbridge_bench_ds")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="where outputs go (default WORKDIR/out); e.g. /dev/shm/x "
                    "to take the disk out of the comparison")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--only", default="ds,ds_w1,convert,convert3,reshard,floor,floor_buf")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("cmd", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_main(a.cmd)

    ckpt = a.ckpt or os.path.join(a.workdir, "run", "ckpt")
    if not os.path.isdir(ckpt):
        t0 = time.time()
        make_checkpoint(os.path.join(a.workdir, "run"))
        print(f"made {ckpt} with DeepSpeed in {time.time() - t0:.0f}s")
    with open(os.path.join(ckpt, "latest")) as fh:
        tag = fh.read().strip()
    tag_dir = os.path.join(ckpt, tag)
    nbytes = state_bytes(tag_dir)
    out = a.out or os.path.join(a.workdir, "out")
    py = sys.executable
    cli = [py, "-c", "import sys; from ckptbridge._cli import main; sys.exit(main(sys.argv[1:]))"]
    cmds = {
        "ds": [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
               "--output_folder", os.path.join(out, tag + "_universal"), "--inject_missing_state"],
        "ds_w1": [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
                  "--output_folder", os.path.join(out, tag + "_universal"), "--inject_missing_state",
                  "--num_extract_workers", "1", "--num_merge_workers", "1"],
        "convert": [*cli, "convert", ckpt, os.path.join(out, "universal")],
        "convert3": [*cli, "convert", ckpt, os.path.join(out, "universal"), "--states", "fp32,exp_avg,exp_avg_sq"],
        "reshard": [*cli, "reshard", ckpt, os.path.join(out, "ds_universal"), "--to", "deepspeed-universal"],
        "floor": [py, "-c", FLOOR, os.path.join(out, "floor.bin"), str(_universal_bytes(tag_dir)), "direct"],
        "floor_buf": [py, "-c", FLOOR, os.path.join(out, "floor.bin"), str(_universal_bytes(tag_dir)), "buffered"],
    }
    names = [n for n in a.only.split(",") if n in cmds]
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    cold_ok = None
    for rep in range(a.reps):
        for n in names:
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            if a.cold:
                cold_ok = drop_caches()
            r = measure(cmds[n])
            results[n].append(r)
            print(f"rep {rep} {n:8s} {r['wall_s']:7.2f}s  tree peak {r['peak_tree_rss_mb']:8.0f} MB  "
                  f"largest proc {r['peak_proc_rss_mb']:8.0f} MB", flush=True)
    shutil.rmtree(out, ignore_errors=True)

    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    print(f"\ncheckpoint: {tag_dir}, {nbytes / 2**30:.2f} GiB of rank files, "
          f"{'cold' if a.cold else 'warm'} page cache{'' if cold_ok in (None, True) else ' (drop_caches refused)'}, "
          f"medians of {a.reps}")
    print(f"{'tool':10s} {'wall s':>8s} {'tree peak MB':>13s} {'largest proc MB':>16s}")
    for n, m in med.items():
        print(f"{n:10s} {m['wall_s']:8.2f} {m['peak_tree_rss_mb']:13.0f} {m['peak_proc_rss_mb']:16.0f}")
    floors = [med[f]["wall_s"] for f in ("floor", "floor_buf") if f in med]
    if floors:
        floor = min(floors)
        for theirs in ("ds", "ds_w1"):
            if theirs in med:
                print(f"largest speed-up possible over {theirs} on this disk: "
                      f"{med[theirs]['wall_s'] / floor:.1f}x (the faster floor row)")
        for ours in ("convert", "convert3", "reshard"):
            if ours in med:
                print(f"{ours}: {med[ours]['wall_s'] / floor:.2f}x the floor's time")
    for ours in ("convert", "convert3", "reshard"):
        for theirs in ("ds", "ds_w1"):
            if ours in med and theirs in med:
                o, t = med[ours], med[theirs]
                print(f"{ours} vs {theirs}: {t['wall_s'] / o['wall_s']:.1f}x faster, "
                      f"peak RSS (tree) {o['peak_tree_rss_mb'] / t['peak_tree_rss_mb']:.2f}x, "
                      f"(largest proc) {o['peak_proc_rss_mb'] / t['peak_proc_rss_mb']:.2f}x of DeepSpeed's")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"checkpoint": tag_dir, "state_bytes": nbytes, "cold": a.cold, "reps": results,
                       "median": med}, fh, indent=1)


if __name__ == "__main__":
    main()

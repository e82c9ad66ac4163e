"""Multi-process convert: ``ckptbridge convert`` on 1 process vs N processes, and the disk floor.

The source is a real ``torch.save`` file of ``--tensors`` fp32 matrices (``--size-mib`` in all);
each run converts it to the universal layout in a fresh destination, in one run, alternating
over ``--reps``:

* ``n1``: ``python -m ckptbridge convert SRC DST`` (one process);
* ``torchrun-nN``: ``torchrun --standalone --nproc-per-node N -m ckptbridge convert SRC DST``
  (its run id lets the ranks agree through files beside the stage; launcher start-up inside the
  clock);
* ``env-nN``: N processes with ``RANK``/``WORLD_SIZE``/``CKPTBRIDGE_JOB_ID`` as ``srun`` would
  start them (ranks agree through files in the staging directory);
* ``launch-n1`` / ``launch-torchrun-nN``: ``ckptbridge --help`` alone, directly and under torchrun
  (interpreter and launcher start-up, subtracted for the "net" numbers);
* ``floor``: copying the source file once (``shutil.copyfile``: read + write of the same bytes,
  fsync'd), the least any conversion has to do.

Reported: median wall time per method, speed-up over ``n1`` and time over the floor (also net of
start-up); every
result is checked to hold the same tensors as the source. Ratios of one run only: the machine
is shared and has few cores (``--procs`` beyond the core count measures contention).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_convert_mp.py --size-mib 256 --procs 2 --reps 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _run(cmds: list[list[str]], envs: list[dict[str, str]]) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for c, e in zip(cmds, envs)]
    errs = [p.communicate()[1] for p in procs]
    dt = time.perf_counter() - t0
    for p, err in zip(procs, errs):
        if p.returncode:
            raise SystemExit(f"{cmds[0]} failed ({p.returncode}): {err[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--procs", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "convert_mp.json"))
    args = ap.parse_args()

    import numpy as np
    import torch

    import ckptbridge

    env = dict(os.environ, OMP_NUM_THREADS="1")
    py = sys.executable
    cols = 1024
    rows = max(1, (args.size_mib << 20) // (args.tensors * cols * 4))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = os.path.join(tmp, "model.pt")
        g = torch.Generator().manual_seed(0)
        torch.save({f"layer{i}.w": torch.randn(rows, cols, generator=g) for i in range(args.tensors)}, src)
        size = os.path.getsize(src)
        methods: dict[str, object] = {"n1": None, "floor": None, "launch-n1": None}
        for n in args.procs:
            methods[f"torchrun-n{n}"] = n
            methods[f"env-n{n}"] = n
            methods[f"launch-torchrun-n{n}"] = n
        times: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(args.reps):
            for m in methods:
                dst = os.path.join(tmp, f"{m}-{rep}")
                if m == "floor":
                    t0 = time.perf_counter()
                    shutil.copyfile(src, dst)
                    with open(dst, "rb+") as fh:
                        os.fsync(fh.fileno())
                    times[m].append(time.perf_counter() - t0)
                    os.remove(dst)
                    continue
                if m.startswith("launch-"):  # the launcher and interpreter start-up alone (no conversion)
                    cmd = [py, "-m", "ckptbridge", "--help"]
                    if "torchrun" in m:
                        cmd = [py, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={methods[m]}", *cmd[1:]]
                    times[m].append(_run([cmd], [env]))
                    continue
                if m == "n1":
                    dt = _run([[py, "-m", "ckptbridge", "convert", src, dst]], [env])
                elif m.startswith("torchrun"):
                    dt = _run([[py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={methods[m]}",
                                "-m", "ckptbridge", "convert", src, dst]], [env])
                else:
                    n = int(methods[m])  # type: ignore[call-overload]
                    base = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
                    dt = _run([[py, "-m", "ckptbridge", "convert", src, dst]] * n,
                              [{**base, "RANK": str(r), "WORLD_SIZE": str(n), "CKPTBRIDGE_JOB_ID": f"{m}-{rep}"}
                               for r in range(n)])
                times[m].append(dt)
                if rep == 0:  # the result holds the source's tensors, bitwise
                    a, b = ckptbridge.open(src), ckptbridge.open(dst)
                    for name in a:
                        if not np.array_equal(a[name].read(), b[name].read()):
                            raise SystemExit(f"{m}: {name} differs from the source")
                shutil.rmtree(dst)

    med = {m: statistics.median(v) for m, v in times.items()}
    conv = [m for m in med if m == "n1" or m.startswith(("torchrun-", "env-"))]
    net = {m: max(1e-3, med[m] - med[f"launch-{m}" if m.startswith("torchrun") else "launch-n1"]) for m in conv}
    result = {
        "benchmark": "convert_mp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": "torch.save file", "size_bytes": size, "tensors": args.tensors, "reps": args.reps,
        "cpu_count": os.cpu_count(), "seconds": times, "median_s": med,
        "speedup_over_n1": {m: round(med["n1"] / t, 3) for m, t in med.items() if m in conv},
        "over_floor": {m: round(t / med["floor"], 3) for m, t in med.items() if m in conv},
        # the same with the start-up of the launcher and interpreter (measured alone) taken out
        "net_of_launch_s": net,
        "net_speedup_over_n1": {m: round(net["n1"] / t, 3) for m, t in net.items()},
    }
    from _proc import save_result_at

    save_result_at(args.out, result)
    print(f"{size / 2**20:.0f} MiB, {args.tensors} tensors, {os.cpu_count()} cores")
    for m, t in med.items():
        extra = "" if m not in conv else \
            (f"  speed-up {result['speedup_over_n1'][m]:.2f}x  {result['over_floor'][m]:.2f}x the floor;"
             f" net of start-up {net[m]:.3f} s, speed-up {result['net_speedup_over_n1'][m]:.2f}x")
        print(f"{m:20s} {t:7.3f} s{extra}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

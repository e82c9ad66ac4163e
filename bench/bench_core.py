"""Core benchmark: write and read a ~1 GiB fp32 state dict, ckptbridge vs torch and safetensors.

    python bench/bench_core.py [--gib 1.0] [--reps 3] [--out bench/out]

Every case runs in a fresh subprocess (clean peak RSS), several reps, medians;
the report gives seconds, ratios to the peer measured in the same run, and
peak RSS above the process baseline. Writes include fsync. Reads touch every
byte before the clock stops (safetensors and torch mmap loads are lazy).
"Cold" reps drop the page cache first when the machine allows it (root).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import drop_caches

CASE = r"""
import json, os, resource, sys, time
import numpy as np
import psutil
case, src, work, gib = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
n_tensors = 16
rows = int(gib * (1 << 30) / 4 / n_tensors / 4096)

def make_sd():
    import torch
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(n_tensors)}

def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd); os.close(fd)

def touch(arrays):
    return float(sum(float(np.asarray(a).reshape(-1)[:: 1024].sum()) for a in arrays))

sd = make_sd() if case.startswith("write") else None
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
if case == "write_torch":
    import torch
    torch.save(sd, os.path.join(work, "w.pt")); fsync(os.path.join(work, "w.pt"))
elif case == "write_safetensors":
    from safetensors.torch import save_file
    save_file(sd, os.path.join(work, "w.safetensors")); fsync(os.path.join(work, "w.safetensors"))
elif case == "write_ckptbridge":
    from ckptbridge.plugin import Box
    from ckptbridge.plugin import Piece
    from ckptbridge.plugin import write_universal as save
    pieces = [Piece(k, "fp32", "float32", tuple(v.shape), Box.full(tuple(v.shape)), v.numpy()) for k, v in sd.items()]
    save(os.path.join(work, "w.universal"), pieces)
elif case == "convert_ckptbridge":   # file -> file: torch.save output to the universal layout
    import ckptbridge
    ckptbridge.convert(src, os.path.join(work, "c.universal"))
elif case == "read_torch":
    import torch
    sd = torch.load(src, weights_only=True); touch([v.numpy() for v in sd.values()])
elif case == "read_torch_mmap":
    import torch
    sd = torch.load(src, weights_only=True, mmap=True)
    out = [v.clone().numpy() for v in sd.values()]; touch(out)
elif case == "read_safetensors":
    from safetensors.numpy import load_file
    sd = load_file(src.replace(".pt", ".safetensors")); out = [v.copy() for v in sd.values()]; touch(out)
elif case == "read_ckptbridge":
    import ckptbridge
    c = ckptbridge.open(src.replace(".pt", ".universal")); out = [c[k].read() for k in c]; touch(out)
elif case == "slice_torch_mmap":      # 1/8 of the columns of every tensor
    import torch
    sd = torch.load(src, weights_only=True, mmap=True)
    out = [v[:, :512].clone().numpy() for v in sd.values()]; touch(out)
elif case == "slice_safetensors":
    from safetensors import safe_open
    with safe_open(src.replace(".pt", ".safetensors"), "np") as f:
        out = [f.get_slice(k)[:, :512] for k in f.keys()]; touch(out)
elif case == "slice_ckptbridge":
    import ckptbridge
    c = ckptbridge.open(src.replace(".pt", ".universal")); out = [c[k][:, :512] for k in c]; touch(out)
else:
    raise SystemExit(f"unknown case {case}")
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": dt, "peak_extra_bytes": max(0, peak - base)}))
"""

GROUPS = {
    "write (fsync'd)": ["write_torch", "write_safetensors", "write_ckptbridge"],
    "convert .pt -> universal": ["convert_ckptbridge", "write_torch"],
    "read everything": ["read_torch", "read_torch_mmap", "read_safetensors", "read_ckptbridge"],
    "read 1/8 columns of every tensor": ["slice_torch_mmap", "slice_safetensors", "slice_ckptbridge"],
}


def run_case(case: str, src: str, work: str, gib: float) -> dict:
    for leftover in ("w.pt", "w.safetensors", "w.universal", "c.universal"):
        p = os.path.join(work, leftover)
        if case.startswith(("write", "convert")) and os.path.exists(p):
            subprocess.run(["rm", "-rf", p], check=True)
    out = subprocess.run([sys.executable, "-c", CASE, case, src, work, str(gib)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--cold", action="store_true", help="also time cold reps (drops the page cache)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    src = os.path.abspath(os.path.join(args.out, "src.pt"))
    work = os.path.abspath(args.out)
    # the shared inputs for the read cases, written once by each tool
    prep = CASE.replace('os.path.join(work, "w.pt")', "src").replace(
        'os.path.join(work, "w.safetensors")', 'src.replace(".pt", ".safetensors")').replace(
        'os.path.join(work, "w.universal")', 'src.replace(".pt", ".universal")')
    for case in ("write_torch", "write_safetensors", "write_ckptbridge"):
        subprocess.run(["rm", "-rf", src.replace(".pt", ".universal")], check=True)
        subprocess.run([sys.executable, "-c", prep, case, src, work, str(args.gib)], check=True,
                       capture_output=True)
    regimes = ["warm"] + (["cold"] if args.cold and drop_caches() else [])
    report = {"gib": args.gib, "reps": args.reps, "results": {}}
    lines = [f"# bench_core: {args.gib} GiB fp32 state dict, {args.reps} reps, medians", ""]
    for regime in regimes:
        for title, cases in GROUPS.items():
            res = {}
            for case in cases:
                secs, peaks = [], []
                for _ in range(args.reps):
                    if regime == "cold":
                        drop_caches()
                    r = run_case(case, src, work, args.gib)
                    secs.append(r["seconds"])
                    peaks.append(r["peak_extra_bytes"])
                res[case] = {"seconds": statistics.median(secs), "peak_extra_mib": max(peaks) / 2**20,
                             "all_seconds": secs}
            ours = next(c for c in cases if c.endswith("ckptbridge"))
            lines.append(f"## {title} ({regime})")
            lines.append("| case | median s | ckptbridge speed-up | peak RSS above baseline (MiB) |")
            lines.append("|---|---|---|---|")
            for case, r in res.items():
                ratio = r["seconds"] / res[ours]["seconds"]
                lines.append(f"| {case} | {r['seconds']:.2f} | {ratio:.2f}x | {r['peak_extra_mib']:.0f} |")
            lines.append("")
            report["results"][f"{title} ({regime})"] = res
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "bench_core.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    with open(os.path.join(args.out, "bench_core.md"), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()

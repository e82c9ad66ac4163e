"""Training-loop checkpoint stall: ckptbridge.Checkpointer vs torch.save, DCP async_save, Orbax async.

    python bench/bench_async.py [--gib 1.0] [--steps 8] [--every 2] [--out bench/out]

A torch loop (AdamW; parameters + both moments = ``gib`` GiB) and a JAX/optax
loop with the same state size save every ``every`` steps. Each case runs in its own
subprocess. Reported per case: median stall per save (time the training
thread was blocked by checkpointing), end-to-end loop time, and for
ckptbridge the flush throughput; plus, measured in the same run, one host
memcpy of the state (into a preallocated buffer) and the disk's raw write
speed (one fsync'd write of the same bytes), so the targets read as ratios:
stall <= 1.5x memcpy, >= 20x less stall than sync torch.save, flush >= 0.8x raw disk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASE = r"""
import json, os, shutil, statistics, sys, time
import numpy as np
case, root, gib, steps, every = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
compute = int(sys.argv[6])
n = 8
rows = max(1, int(gib * (1 << 30) / 3 / 4 / n / 4096))  # params + exp_avg + exp_avg_sq = gib
shutil.rmtree(root, ignore_errors=True); os.makedirs(root)
result = {"case": case}

def fsync_file(p):
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)

if case == "ckptbridge_flush":  # the flush level alone, nothing competing for the CPU
    from ckptbridge import Checkpointer
    state = {f"w{i}": np.random.default_rng(i).standard_normal((rows * 3, 4096), dtype=np.float32) for i in range(n)}
    ck = Checkpointer(root, keep_last=1)
    ck.reserve(state)
    for s in range(3):
        ck.save(s, state); ck.wait()
    result["flush_gbps"] = statistics.median(x.flush_gbps for x in ck.stats)
    result["stall_median"] = statistics.median(x.stall_seconds for x in ck.stats)
    result["loop_seconds"] = 0.0
    ck.close()
    print(json.dumps(result)); sys.exit(0)

if case in ("memcpy", "disk"):
    src = np.random.default_rng(0).standard_normal(int(gib * (1 << 30) / 4), dtype=np.float32)
    dst = np.empty_like(src); np.copyto(dst, src)  # fault the pages in once
    if case == "memcpy":
        times = []
        for _ in range(3):
            t = time.perf_counter(); np.copyto(dst, src); times.append(time.perf_counter() - t)
        result["seconds"] = min(times)
    else:  # the disk's raw write speed: the best of buffered+fsync and O_DIRECT (1 or 3 streams)
        import mmap, threading
        raw = memoryview(src).cast("B")
        aligned = mmap.mmap(-1, 8 << 20); aligned.write(raw[: 8 << 20])
        def direct(p, streams):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            offs = list(range(0, src.nbytes - src.nbytes % (8 << 20), 8 << 20))
            def run(k):
                for o in offs[k::streams]:
                    os.pwrite(fd, aligned, o)
            ths = [threading.Thread(target=run, args=(k,)) for k in range(streams)]
            [t.start() for t in ths]; [t.join() for t in ths]
            os.fsync(fd); os.close(fd)
            return len(offs) * (8 << 20)
        best = {}
        for i in range(3):
            for mode in ("buffered", "direct1", "direct3"):
                p = os.path.join(root, f"raw{i}{mode}")
                t = time.perf_counter()
                if mode == "buffered":
                    with open(p, "wb") as fh:
                        fh.write(raw); fh.flush(); os.fsync(fh.fileno())
                    nbytes = src.nbytes
                else:
                    nbytes = direct(p, 1 if mode == "direct1" else 3)
                gbps = nbytes / (time.perf_counter() - t) / 1e9
                best[mode] = max(best.get(mode, 0.0), gbps); os.remove(p)
        result["modes_gbps"] = best; result["gbps"] = max(best.values())
        result["seconds"] = src.nbytes / result["gbps"] / 1e9
    print(json.dumps(result)); sys.exit(0)

if case.startswith("torch") or case == "ckptbridge_torch":
    import torch
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows, 4096)) for _ in range(n)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randn(1024, 1024)
    def train_step():
        y = x
        for _ in range(compute):  # stands in for forward/backward
            y = torch.tanh(y @ x)
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
    train_step()  # materialise the moments
    def state():
        return {"model": {f"w{i}": p for i, p in enumerate(params)},
                "optim": {str(i): s for i, s in enumerate(opt.state_dict()["state"].values())}}
    stalls = []
    ck = fut = None
    if case == "torch_dcp_async":
        import torch.distributed as dist, torch.distributed.checkpoint as dcp
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if case == "ckptbridge_torch":
        from ckptbridge import Checkpointer
        ck = Checkpointer(root, keep_last=2)
        ck.reserve(state())
    t_loop = time.perf_counter()
    for step in range(steps):
        if step % every == 0:
            t = time.perf_counter()
            if case == "torch_save":
                p = os.path.join(root, f"step{step}.pt"); torch.save(state(), p); fsync_file(p)
            elif case == "torch_dcp_async":
                if fut is not None:
                    fut.result()
                fut = dcp.async_save(state(), checkpoint_id=os.path.join(root, f"step{step}"))
            elif case == "ckptbridge_torch":
                ck.save(step, state(), optimizer=opt)
            stalls.append(time.perf_counter() - t)
        train_step()  # with ckptbridge, opt.step() first waits for a pending snapshot (counted in stats)
    if fut is not None:
        fut.result()
    if ck is not None:
        ck.wait()
        stalls = [s.stall_seconds for s in ck.stats]
        result["flush_gbps"] = statistics.median(s.flush_gbps for s in ck.stats)
        ck.close()
    result["loop_seconds"] = time.perf_counter() - t_loop
else:
    import jax, jax.numpy as jnp
    import optax
    params = {f"w{i}": jax.random.normal(jax.random.key(i), (rows, 4096)) for i in range(n)}
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    x = jax.random.normal(jax.random.key(99), (1024, 1024))
    @jax.jit
    def train_step(p, s):
        y = x
        for _ in range(compute):  # stands in for forward/backward
            y = jnp.tanh(y @ x)
        g = jax.tree.map(lambda w: jnp.full_like(w, 1e-3) + 0 * y[0, 0], p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    params, opt_state = train_step(params, opt_state); jax.block_until_ready(params)
    stalls = []
    if case == "orbax_async":
        import orbax.checkpoint as ocp
        mgr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True))
    elif case == "ckptbridge_jax":
        from ckptbridge import Checkpointer
        ck = Checkpointer(root, keep_last=2)
        ck.reserve({"params": params, "opt": opt_state})
        train_step = ck.guard(train_step)
    t_loop = time.perf_counter()
    for step in range(steps):
        if step % every == 0:
            t = time.perf_counter()
            if case == "orbax_async":
                mgr.save(step, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
            elif case == "ckptbridge_jax":
                ck.save(step, {"params": params, "opt": opt_state})
            stalls.append(time.perf_counter() - t)
        params, opt_state = train_step(params, opt_state)
        jax.block_until_ready(params)
    if case == "orbax_async":
        mgr.wait_until_finished()
    elif case == "ckptbridge_jax":
        ck.wait(); stalls = [s.stall_seconds for s in ck.stats]
        result["flush_gbps"] = statistics.median(s.flush_gbps for s in ck.stats); ck.close()
    result["loop_seconds"] = time.perf_counter() - t_loop
result["stall_median"] = statistics.median(stalls) if stalls else 0.0
result["stalls"] = stalls
print(json.dumps(result))
"""

CASES = ["memcpy", "disk", "ckptbridge_flush", "torch_none", "torch_save", "torch_dcp_async", "ckptbridge_torch",
         "jax_none", "orbax_async", "ckptbridge_jax"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--compute", type=int, default=40, help="1024^3 matmuls per step standing in for fwd/bwd")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset (memcpy and disk always run)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", ""), JAX_PLATFORMS="cpu")
    res = {}
    chosen = ["memcpy", "disk", *(c for c in CASES[2:] if c in args.cases.split(","))]
    for case in chosen:
        root = os.path.abspath(os.path.join(args.out, f"async_{case}"))
        real_case = case.replace("torch_none", "torch_nockpt").replace("jax_none", "jax_nockpt")
        out = subprocess.run([sys.executable, "-c", CASE, real_case, root, str(args.gib), str(args.steps),
                              str(args.every), str(args.compute)], capture_output=True, text=True, env=env)
        subprocess.run(["rm", "-rf", root])
        if out.returncode != 0:
            res[case] = {"error": out.stderr.strip().splitlines()[-1:]}
            continue
        res[case] = json.loads(out.stdout.strip().splitlines()[-1])
    memcpy, disk = res["memcpy"]["seconds"], res["disk"]
    ours_t = res.get("ckptbridge_torch", {}).get("stall_median", 0.0)
    ours_j = res.get("ckptbridge_jax", {}).get("stall_median", 0.0)
    lines = [f"# bench_async: {args.gib} GiB state, {args.steps} steps, save every {args.every}", "",
             f"one host memcpy of the state: {memcpy:.3f} s; raw disk write: {disk['gbps']:.2f} GB/s (best of "
             + ", ".join(f"{k} {v:.2f}" for k, v in disk.get("modes_gbps", {}).items()) + ")", "",
             "| loop | case | median stall per save (s) | stall / memcpy | stall vs ckptbridge | loop time (s) |",
             "|---|---|---|---|---|---|"]
    for case in [c for c in CASES[3:] if c in res]:
        r = res[case]
        if "error" in r:
            lines.append(f"| | {case} | error: {r['error']} | | | |")
            continue
        ours = ours_j if case in ("jax_none", "orbax_async", "ckptbridge_jax") else ours_t
        st = r.get("stall_median", 0.0)
        lines.append(f"| {'jax' if ours is ours_j else 'torch'} | {case} | {st:.4f} | {st / memcpy:.2f}x | "
                     f"{(st / ours) if ours else float('nan'):.1f}x | {r['loop_seconds']:.2f} |")
    for case in ("ckptbridge_flush", "ckptbridge_torch", "ckptbridge_jax"):
        if "flush_gbps" in res.get(case, {}):
            where = "alone" if case == "ckptbridge_flush" else "while the loop trains on the same cores"
            lines.append(f"\n{case}: flush {res[case]['flush_gbps']:.2f} GB/s = "
                         f"{res[case]['flush_gbps'] / disk['gbps']:.2f}x raw disk ({where})")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "bench_async.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    with open(os.path.join(args.out, "bench_async.md"), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()

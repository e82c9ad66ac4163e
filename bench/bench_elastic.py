"""Fault to first step after restart, and the detector's cost on a healthy run.

    python bench/bench_elastic.py [--trials 1] [--steps 14] [--overhead-rounds 6] [--out bench/out/elastic]
                                  [--results bench/results]

1. **Recovery** (the example's ``demo``: four ``torchrun`` agents on this machine, c10d
   rendezvous on 127.0.0.1, ``--nnodes=3:4 --max-restarts=3``; one rank gets SIGKILL or
   SIGSTOP at step 5). ckptbridge (``Watchdog`` + ``Checkpointer``) side by side with the
   stock behaviour (the same training script, ``Checkpointer`` only): a lost peer surfaces
   as a failed collective, or for a stopped one as a gloo timeout (30 s here; torch's default
   is 30 min), and torchrun restarts every node, the faulty one included. Split into
   detection (fault -> verdict; stock: -> the first agent reacting), restart (-> the new
   workers are up), restore (reading the checkpoint), first step (-> its loss), and the
   world size the job continues on.
2. **Detector overhead** on a healthy four-rank FSDP2 job (the tests' tiny model, whose steps
   are gloo latency, and a compute-bound one): rotating phases of steps with a ``Watchdog``,
   with a control thread that only wakes as often as the watchdog's (on these VMs a
   periodically waking thread by itself changes how fast ranks blocked in gloo wake up,
   by up to 2x), and with neither; medians of per-phase median step times; plus process
   CPU time per step, the watchdog thread's own CPU time and the cost of ``wd.step()``.
   Goal: < 1% of the step time.

Timings on these shared 2-core VMs are noisy; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "elastic_restart.py")
_TORCH_LOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) .*(Closing process|failed \(exitcode)", re.M)


def _log_times(text: str) -> list[float]:
    """Epoch times of the torch agents' first reactions (their log lines carry no year)."""
    year = datetime.date.today().year
    out = []
    for month, day, clock, _ in _TORCH_LOG.findall(text):
        stamp = datetime.datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
        out.append(stamp.timestamp())
    return out


def recovery(workdir: str, signal: str, watchdog: bool, steps: int) -> dict:
    root = os.path.join(workdir, f"{signal}-{'ckptbridge' if watchdog else 'stock'}")
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, EXAMPLE, "demo", root, "--fault", signal, "--fault-rank", "2", "--fault-step", "5",
           "--steps", str(steps), "--timeout", "30"] + ([] if watchdog else ["--no-watchdog"])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**env, "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    with open(os.path.join(root, "demo.log"), "w") as fh:
        fh.write(text)
    if not os.path.exists(os.path.join(root, "events.jsonl")):
        raise RuntimeError(f"the demo produced no events (see {root}/demo.log):\n{text[-3000:]}")
    with open(os.path.join(root, "events.jsonl")) as fh:
        ev = [json.loads(line) for line in fh]
    fault = next(e for e in ev if e["ev"] == "fault")
    t0 = fault["time"]
    if watchdog:
        with open(os.path.join(root, "faults.jsonl")) as fh:
            verdict = json.loads(fh.readline())
        detected = verdict["time"]
    else:
        detected = min((t for t in _log_times(text) if t > t0), default=float("nan"))
    starts = [e for e in ev if e["ev"] == "start" and e["time"] > t0]
    resumed = [e for e in ev if e["ev"] == "resumed"]
    up = min(e["time"] for e in starts)
    first = min(e["time"] for e in ev if e["ev"] == "loss" and e["time"] > up)
    restored = max(e["time"] for e in resumed)
    return {"signal": signal, "tool": "ckptbridge" if watchdog else "stock torchrun",
            "detection": detected - t0, "restart": up - detected, "restore": max(e["seconds"] for e in resumed),
            "first_step": first - restored, "total": first - t0, "world_after": starts[0]["world"],
            "named": f"rank {verdict['rank']} {verdict['kind']}" if watchdog else "-", "ok": out.returncode == 0}


OVERHEAD = r"""
import datetime, json, os, statistics, sys, time
rank, world, port, rounds, per, hidden = (int(a) for a in sys.argv[1:7])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import ckptbridge
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10))
mesh = init_device_mesh("cpu", (world,))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(6 if hidden < 1000 else 256, 16), torch.randn(6 if hidden < 1000 else 256, 10)
phases = {"off": [], "on": [], "control": []}
cpus = {"off": [], "on": [], "control": []}  # process CPU seconds per step, per phase
import random, select, threading

class Control:
    # a thread that wakes like the watchdog's (every ~20 ms, jittered) and does nothing: on a VM,
    # a periodically waking thread changes how fast blocked ranks wake up, whatever it does
    def __init__(self):
        self.halt = threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True); self.t.start()
    def loop(self):
        while not self.halt.is_set():
            select.select([], [], [], 0.02 * random.uniform(0.5, 1.5))
    def step(self, i=None):
        pass
    def stop(self):
        self.halt.set(); self.t.join()
cpu = steps_on = 0.0

def run(wd, mode):
    times = []
    c0 = time.process_time()
    for _ in range(per):
        t = time.perf_counter()
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if wd is not None:
            wd.step()
        times.append(time.perf_counter() - t)
    cpus[mode].append((time.process_time() - c0) / per)
    return statistics.median(times[per // 5:])

run(None, "off")  # warm up
cpus["off"].clear()
orders = [("off", "control", "on"), ("on", "control", "off"), ("control", "on", "off")]
for r in range(rounds):
    for mode in orders[r % 3]:
        dist.barrier()
        if mode == "on":
            wd = ckptbridge.Watchdog(exit_on_fault=False).start()
            phases["on"].append(run(wd, mode))
            cpu += wd.cpu_seconds; steps_on += per
            wd.stop()
            if wd.verdicts or wd.stragglers:
                phases.setdefault("alarms", []).append([v.encode() for v in wd.verdicts + wd.stragglers])
        elif mode == "control":
            c = Control()
            phases["control"].append(run(c, mode))
            c.stop()
        else:
            phases["off"].append(run(None, mode))
wd = ckptbridge.Watchdog()  # not started: the cost of step() alone
t = time.perf_counter()
for i in range(100000):
    wd.step(i)
phases["step_call"] = (time.perf_counter() - t) / 100000
phases["cpu_per_step"] = cpu / steps_on
phases["process_cpu"] = {k: statistics.median(v) for k, v in cpus.items()}
dist.barrier()
if rank == 0:
    print("RESULT " + json.dumps(phases), flush=True)
dist.destroy_process_group()
"""


def overhead(rounds: int, per: int, hidden: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, "-c", OVERHEAD, str(r), "4", str(port), str(rounds), str(per), str(hidden)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(4)]
    outs = [p.communicate(timeout=1800) for p in procs]
    line = next(line for line in outs[0][0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1, help="recoveries per signal and tool")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--overhead-rounds", type=int, default=6)
    ap.add_argument("--overhead-steps", type=int, default=100, help="steps per phase")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden width of the compute-bound overhead model")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "elastic"))
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results"),
                    help="where bench_elastic.json and .md go")
    ap.add_argument("--render", action="store_true", help="only write the .md again from the JSON there")
    args = ap.parse_args()
    if args.render:
        with open(os.path.join(args.results, "bench_elastic.json")) as fh:
            doc = json.load(fh)
        with open(os.path.join(args.results, "bench_elastic.md"), "w") as fh:
            fh.write(markdown(doc))
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    if not args.skip_recovery:
        for _ in range(args.trials):
            for signal in ("kill", "stop"):
                for watchdog in (True, False):
                    rows.append(recovery(args.out, signal, watchdog, args.steps))
                    r = rows[-1]
                    print(f"{r['signal']:4} {r['tool']:15} detection {r['detection']:6.2f}s  restart {r['restart']:6.2f}s  "
                          f"restore {r['restore']:.3f}s  first step {r['first_step']:.3f}s  total {r['total']:6.2f}s  "
                          f"world after {r['world_after']}  named {r['named']}  ok={r['ok']}", flush=True)
    results = {}
    for label, hidden in (("tiny (the tests' model, gloo-latency bound)", 30), ("compute-bound", args.hidden)):
        o = results[label] = overhead(args.overhead_rounds, args.overhead_steps, hidden)
        report(label, o)
    from _proc import save_result_at

    doc = save_result_at(os.path.join(args.results, "bench_elastic.json"),
                         {"recovery": rows, "overhead": results, "time": time.time()})
    with open(os.path.join(args.results, "bench_elastic.md"), "w") as fh:
        fh.write(markdown(doc))


def markdown(doc: dict) -> str:
    """The results as the README shows them (bench/readme.py copies this file verbatim)."""
    out = ["| signal | tool | detection s | restart s | restore s | first step s | total s | world after | named |",
           "|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['signal']} | {r['tool']} | {r['detection']:.2f} | {r['restart']:.2f} | {r['restore']:.3f} | "
            f"{r['first_step']:.3f} | {r['total']:.2f} | {r['world_after']} | {r['named']} |" for r in doc["recovery"]]
    out += ["", "| healthy job | step, watchdog on (ms) | control thread (ms) | neither (ms) | on / control | "
            "watchdog thread CPU per step | `wd.step()` |", "|---|---|---|---|---|---|---|"]
    for label, o in doc["overhead"].items():
        on, ctl, off = (statistics.median(o[k]) for k in ("on", "control", "off"))
        out.append(f"| {label} | {on * 1e3:.2f} | {ctl * 1e3:.2f} | {off * 1e3:.2f} | {on / ctl:.3f}x | "
                   f"{o['cpu_per_step'] / on:.2%} of a step | {o['step_call'] * 1e9:.0f} ns |")
    out += ["", "Goal: detector overhead < 1% of the step time. What it cost here, as step time (medians of "
            "the phases; a shared 2-core VM moves phases by several percent):"]
    for label, o in doc["overhead"].items():
        on, ctl, off = (statistics.median(o[k]) for k in ("on", "control", "off"))
        cpu = o.get("process_cpu") or {}
        line = f"- {label}: a step with the watchdog took {on / ctl:.3f}x the control's and {on / off:.3f}x the plain loop's"
        if cpu.get("on") and cpu.get("control"):
            line += f"; process CPU per step {cpu['on'] / cpu['control']:.2f}x the control's"
        out.append(line + ".")
    if "machine" not in doc:
        out.append("- One run, with no machine facts recorded: not a figure to quote until measured again on a "
                   "quiet machine.")
    return "\n".join(out) + "\n"


def report(label: str, o: dict) -> None:
    off, on, ctl = (statistics.median(o[k]) for k in ("off", "on", "control"))
    ms = {k: [round(t * 1e3, 1) for t in o[k]] for k in ("off", "control", "on")}
    print(f"{label}: healthy step {on * 1e3:.2f} ms with the watchdog, {ctl * 1e3:.2f} ms with an idle thread "
          f"waking as often (control), {off * 1e3:.2f} ms with neither; with/control {on / ctl:.4f}, "
          f"with/neither {on / off:.4f}; per-phase medians {ms}")
    pc = o["process_cpu"]
    print(f"  process CPU per step (rank 0): {pc['on'] * 1e3:.2f} ms with, {pc['control'] * 1e3:.2f} ms control, "
          f"{pc['off'] * 1e3:.2f} ms neither (+{(pc['on'] - pc['control']) * 1e3:.2f} ms = "
          f"{(pc['on'] - pc['control']) / ctl:.2%} of a step over the control)")
    print(f"  watchdog thread CPU per step: {o['cpu_per_step'] * 1e3:.3f} ms = {o['cpu_per_step'] / on:.2%} of a step; "
          f"wd.step(): {o['step_call'] * 1e9:.0f} ns; false alarms: {o.get('alarms', [])}", flush=True)


if __name__ == "__main__":
    main()

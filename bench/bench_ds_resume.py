#!/usr/bin/env python
"""Time to the first training step after resuming DeepSpeed at a new DP degree.

One real ZeRO checkpoint (made once with ``tools/ds_train.py``; default ZeRO-2 bf16 on 2
ranks, ``--d_model 1024 --n_layer 4``: ~50 M parameters, ~0.7 GiB of rank files) is
resumed at another world size / stage two ways, alternating rep by rep:

* ``universal``  DeepSpeed's own path: ``python -m deepspeed.checkpoint.ds_to_universal``
                 (its defaults), then ``torchrun tools/ds_train.py --resume_universal``
                 (``"checkpoint": {"load_universal": true}``, ``engine.load_checkpoint``);
* ``native``     ``torchrun tools/ds_train.py --resume_native``: the engine is filled by
                 ``ckptbridge.adapters.deepspeed.load_engine`` straight from the native
                 checkpoint, each rank reading only its new partition; nothing is converted.

Time to first step = from launching the first command to the end of the first optimizer
step (``tools/ds_train.py`` records the epoch time; the conversion's wall time included for
``universal``). Also the time to the resumed state (launch to the end of the load, the first
step's compute excluded: it is the same work on both paths and dominates on a CPU). Also
reported: the load alone (``engine.load_checkpoint`` vs ``load_engine``),
peak RSS of each command's whole process tree (psutil), and whether the first losses are
equal. Writes ``bench/results/ds_resume.json``::

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_ds_resume.py --reps 3
    .venv/bin/python bench/bench_ds_resume.py --ckpt RUN/ckpt --src-ws 2 --dst-ws 4 --dst-stage 3
    .venv/bin/python bench/bench_ds_resume.py --big /tmp/big --dst-ws 1   # make_big_state.py's ZeRO-2 state
    .venv/bin/python bench/bench_ds_resume.py --d-model 2048 --n-layer 6 --reps 2 --name ds_resume_4g

With ``--big`` the resumed model is ``make_big_state.py``'s (its ``--worker resume``: the same
engine config, one step on random tokens), so the state can be as large as the generator's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from _proc import measure, save_result  # noqa: E402


def _env() -> dict[str, str]:
    import make_deepspeed_ckpt as tools

    e = tools.env()
    e["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return e


def make_checkpoint(out: str, ws: int, stage: int, dtype: str, d_model: int, n_layer: int) -> str:
    import make_deepspeed_ckpt as tools

    os.makedirs(out, exist_ok=True)
    tools.launch(ws, ["--stage", str(stage), "--dtype", dtype, "--steps", "1", "--out", out,
                      "--d_model", str(d_model), "--n_layer", str(n_layer)], os.path.join(out, "train.log"),
                 timeout=7200)
    return os.path.join(out, "ckpt")


def _torchrun(ws: int, args: list[str], script: str | None = None) -> list[str]:
    import make_deepspeed_ckpt as tools

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ws}", "--master_addr=127.0.0.1",
            f"--master_port={tools.free_port()}", script or os.path.join(ROOT, "tools", "ds_train.py"), *args]


def _resume_cmd(a: argparse.Namespace, out: str, how: str, path: str) -> list[str]:
    """The resume command: tools/ds_train.py (TinyGPT), or make_big_state.py's resume worker (--big)."""
    if a.big:
        info = a.big_info
        args = ["--worker", "resume", out, "--layers", str(info["layers"]), "--d-model", str(info["d_model"]),
                "--vocab", str(info["vocab"]), "--ctx", str(info["ctx"]), "--stage", str(a.dst_stage),
                f"--{how}", path]
        return _torchrun(a.dst_ws, args, os.path.join(HERE, "make_big_state.py"))
    return _torchrun(a.dst_ws, [*_train_args(a, out), f"--resume_{how}", path])


def _meta(out: str) -> dict:
    with open(os.path.join(out, "meta.json")) as fh:
        return json.load(fh)


def run_universal(ckpt: str, tag: str, scratch: str, a: argparse.Namespace) -> dict:
    root = os.path.join(scratch, "uroot")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    t0 = time.time()
    conv = measure([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(ckpt, tag), "--output_folder", os.path.join(root, tag + "_universal"),
                    "--inject_missing_state"], env=_env(), timeout=7200)
    with open(os.path.join(root, "latest_universal"), "w") as fh:
        fh.write(tag + "_universal")
    out = os.path.join(scratch, "u_out")
    shutil.rmtree(out, ignore_errors=True)
    t1 = time.time()
    res = measure(_resume_cmd(a, out, "universal", root), env=_env(), timeout=7200)
    meta = _meta(out)
    shutil.rmtree(root, ignore_errors=True)
    return {"ttfs_s": meta["timing"]["first_step_done_at"] - t0, "ready_s": meta["timing"]["load_done_at"] - t0,
            "convert_s": conv["wall_s"],
            "resume_ttfs_s": meta["timing"]["first_step_done_at"] - t1, "load_s": meta["timing"]["load_s"],
            "peak_tree_rss_mb": max(conv["peak_tree_rss_mb"], res["peak_tree_rss_mb"]),
            "convert_peak_tree_rss_mb": conv["peak_tree_rss_mb"], "resume_peak_tree_rss_mb": res["peak_tree_rss_mb"],
            "loss": meta["losses"][0]}


def run_native(ckpt: str, scratch: str, a: argparse.Namespace) -> dict:
    out = os.path.join(scratch, "n_out")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    res = measure(_resume_cmd(a, out, "native", ckpt), env=_env(), timeout=7200)
    meta = _meta(out)
    return {"ttfs_s": meta["timing"]["first_step_done_at"] - t0, "ready_s": meta["timing"]["load_done_at"] - t0,
            "load_s": meta["timing"]["load_s"], "bytes_read_per_rank": meta["timing"].get("bytes_read"), "peak_tree_rss_mb": res["peak_tree_rss_mb"],
            "loss": meta["losses"][0]}


def _train_args(a: argparse.Namespace, out: str) -> list[str]:
    return ["--stage", str(a.dst_stage), "--dtype", a.dtype, "--steps", "1", "--no_save", "--out", out,
            "--d_model", str(a.d_model), "--n_layer", str(a.n_layer)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="a DeepSpeed checkpoint root made with tools/ds_train.py "
                    "(--d_model/--n_layer must match); default: make one in --workdir")
    ap.add_argument("--workdir", default="/tmp/ckptbridge_bench_ds_resume")
    ap.add_argument("--src-ws", type=int, default=2)
    ap.add_argument("--src-stage", type=int, default=2)
    ap.add_argument("--dst-ws", type=int, default=1)
    ap.add_argument("--dst-stage", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--d-model", dest="d_model", type=int, default=1024)
    ap.add_argument("--n-layer", dest="n_layer", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--big", default=None, help="use the DeepSpeed state of bench/make_big_state.py in this "
                    "directory (its model; --big-fmt ds2 or ds3) instead of tools/ds_train.py's")
    ap.add_argument("--big-fmt", dest="big_fmt", default="ds2")
    ap.add_argument("--name", default=None, help="result file stem (default: ds_resume, or ds_resume_big "
                    "with --big), e.g. ds_resume_4g for a bigger --d-model/--n-layer")
    a = ap.parse_args()

    a.big_info = None
    if a.big:
        with open(os.path.join(a.big, "info.json")) as fh:
            a.big_info = json.load(fh)
        a.ckpt = a.big_info["formats"][a.big_fmt]["path"]
        a.src_ws, a.src_stage = a.big_info["ws"], 2 if a.big_fmt == "ds2" else 3
    ckpt = a.ckpt or os.path.join(a.workdir, "run", "ckpt")
    if not os.path.isdir(ckpt):
        t0 = time.time()
        make_checkpoint(os.path.join(a.workdir, "run"), a.src_ws, a.src_stage, a.dtype, a.d_model, a.n_layer)
        print(f"# made {ckpt} with DeepSpeed in {time.time() - t0:.0f}s", flush=True)
    with open(os.path.join(ckpt, "latest")) as fh:
        tag = fh.read().strip()
    nbytes = sum(os.path.getsize(os.path.join(ckpt, tag, f)) for f in os.listdir(os.path.join(ckpt, tag)))
    scratch = os.path.join(a.workdir, "scratch")
    os.makedirs(scratch, exist_ok=True)
    runs: dict[str, list[dict]] = {"universal": [], "native": []}
    for rep in range(a.reps):
        for mode in ("universal", "native"):
            r = run_universal(ckpt, tag, scratch, a) if mode == "universal" else run_native(ckpt, scratch, a)
            runs[mode].append(r)
            print(f"rep {rep} {mode:9s} time to first step {r['ttfs_s']:7.2f}s  load {r['load_s']:6.2f}s  "
                  f"peak tree {r['peak_tree_rss_mb']:7.0f} MB  loss {r['loss']:.6f}", flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("ttfs_s", "ready_s", "load_s", "peak_tree_rss_mb")}
           for m, rs in runs.items()}
    med["universal"]["convert_s"] = statistics.median(r["convert_s"] for r in runs["universal"])
    same = all(u["loss"] == n["loss"] for u, n in zip(runs["universal"], runs["native"]))
    u, n = med["universal"], med["native"]
    print(f"\n{ckpt}/{tag}: {nbytes / 2**30:.2f} GiB of rank files; ZeRO-{a.src_stage} x{a.src_ws} -> "
          f"ZeRO-{a.dst_stage} x{a.dst_ws}, {a.dtype}; medians of {a.reps}")
    print(f"universal: ds_to_universal {u['convert_s']:.2f}s + resume, time to first step {u['ttfs_s']:.2f}s "
          f"(load_checkpoint {u['load_s']:.2f}s), peak tree {u['peak_tree_rss_mb']:.0f} MB")
    print(f"native:    time to first step {n['ttfs_s']:.2f}s (load_engine {n['load_s']:.2f}s), "
          f"peak tree {n['peak_tree_rss_mb']:.0f} MB")
    print(f"time to resumed state (launch to end of load, first step excluded): universal {u['ready_s']:.2f}s, "
          f"native {n['ready_s']:.2f}s: {u['ready_s'] / n['ready_s']:.2f}x")
    print(f"speed-up, time to first step: {u['ttfs_s'] / n['ttfs_s']:.2f}x; "
          f"conversion + load vs load: {(u['convert_s'] + u['load_s']) / n['load_s']:.1f}x; "
          f"first losses equal: {same}")
    path = save_result(a.name or ("ds_resume_big" if a.big else "ds_resume"), {
                                     "checkpoint": os.path.join(ckpt, tag), "rank_file_bytes": nbytes,
                                     "big": a.big_info,
                                     "src": {"ws": a.src_ws, "stage": a.src_stage}, "dst": {"ws": a.dst_ws,
                                     "stage": a.dst_stage}, "dtype": a.dtype, "d_model": a.d_model,
                                     "n_layer": a.n_layer, "reps": a.reps, "median": med, "runs": runs,
                                     "speedup_ttfs": u["ttfs_s"] / n["ttfs_s"],
                                     "speedup_ready": u["ready_s"] / n["ready_s"],
                                     "first_step_s": n["ttfs_s"] - n["ready_s"],
                                     "speedup_convert_plus_load": (u["convert_s"] + u["load_s"]) / n["load_s"],
                                     "first_losses_equal": same})
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()

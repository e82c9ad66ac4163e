#!/usr/bin/env python
"""DeepSpeed: ckptbridge vs DeepSpeed's own ``ds_to_universal`` on the same real ZeRO-2 bf16 checkpoint.

    python bench/bench_deepspeed_convert.py [--quick | --size 1g | --size 8g]

The checkpoint is made once per size by real DeepSpeed on CPU (``tools/ds_train.py``, 2 gloo
ranks, ZeRO-2, bf16, one training step; fp32 master + exp_avg + exp_avg_sq + bf16 weights).
Every case is a command line in a fresh process, timed whole (start-up included) until its
outputs are fsync'd; each tool's start-up (``--help``) is measured the same way and reported
and subtracted ("net"), so that the ratio at small sizes is not mostly imports.

* ``ds_to_universal`` at its defaults (4 extract / 2 merge workers) and swept over worker
  counts: its fastest setting here is the fair comparison;
* ``ckptbridge convert`` (all four states), ``--states fp32,exp_avg,exp_avg_sq`` (the
  content ``ds_to_universal`` writes: the reference) and ``reshard --to deepspeed-universal``
  (DeepSpeed's own universal layout, which DeepSpeed resumes from);
* floors: a process that imports numpy and writes as many bytes as ``convert`` does into one
  file (3 threads of 16 MiB ``pwrite``), with ``O_DIRECT`` and through the page cache: the rate of
  one writer of one file, a reference rather than a bound. The converters write many files, and
  the disk's rate varies between runs (the same O_DIRECT floor at 8 GiB: 5.6 s median of two runs
  and 7.5 s in the third, on a quiet machine), so a converter can come out slightly under it.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Case, Size, Suite, main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLI = "import sys; from ckptbridge._cli import main; sys.exit(main(sys.argv[1:]))"  # = the `ckptbridge` script
STATES3 = "fp32,exp_avg,exp_avg_sq"


def prepare(ctx) -> None:
    import json

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_deepspeed_ckpt as tools

    import ckptbridge

    run = ctx.input("run")
    os.makedirs(run)
    tools.launch(2, ["--stage", "2", "--dtype", "bf16", "--steps", "1", "--out", run,
                     "--d_model", str(ctx.param("d_model")), "--n_layer", str(ctx.param("n_layer"))],
                 ctx.input("train.log"), timeout=4 * 3600)
    ck = ckptbridge.open(os.path.join(run, "ckpt"))
    nbytes = sum(st.nbytes for t in ck.tensors.values() for st in t.states.values())
    with open(os.path.join(run, "ckpt", "latest")) as fh:
        tag = fh.read().strip()
    tag_dir = os.path.join(run, "ckpt", tag)
    files = sum(os.path.getsize(os.path.join(tag_dir, f)) for f in os.listdir(tag_dir))
    with open(ctx.input("facts.json"), "w") as fh:
        json.dump({"tag": tag, "universal_bytes": nbytes, "rank_file_bytes": files,
                   "params": sum(t.states["fp32"].nbytes // 4 for t in ck.tensors.values() if "fp32" in t.states)},
                  fh)
    os.sync()


def _facts(ctx) -> dict:
    import json

    with open(ctx.input("facts.json")) as fh:
        return json.load(fh)


def _ckpt(ctx) -> str:
    return ctx.input("run", "ckpt")


def _tag_dir(ctx) -> str:
    return os.path.join(_ckpt(ctx), _facts(ctx)["tag"])


def _ds(ctx, extract: int, merge: int) -> list[str]:
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", _tag_dir(ctx),
            "--output_folder", ctx.out("ds_universal"), "--inject_missing_state"]
    if (extract, merge) != (4, 2):  # its defaults
        argv += ["--num_extract_workers", str(extract), "--num_merge_workers", str(merge)]
    return argv


def ds_default(ctx):
    return _ds(ctx, 4, 2)


def ds_w1(ctx):
    return _ds(ctx, 1, 1)


def ds_w2_1(ctx):
    return _ds(ctx, 2, 1)


def ds_w2_2(ctx):
    return _ds(ctx, 2, 2)


def ds_w8_4(ctx):
    return _ds(ctx, 8, 4)


def cb_convert(ctx):
    return [sys.executable, "-c", CLI, "convert", _ckpt(ctx), ctx.out("universal")]


def cb_convert3(ctx):
    return [*cb_convert(ctx), "--states", STATES3]


def cb_reshard(ctx):
    return [sys.executable, "-c", CLI, "reshard", _ckpt(ctx), ctx.out("ds_universal"), "--to", "deepspeed-universal"]


FLOOR = r"""
import mmap, os, sys, threading
import numpy  # noqa: F401  (every converter here imports it)
path, nbytes, mode, block = sys.argv[1], int(sys.argv[2]), sys.argv[3], 16 << 20
buf = mmap.mmap(-1, block); buf.write(os.urandom(block))
flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
try:
    fd = os.open(path, flags | (os.O_DIRECT if mode == "direct" else 0), 0o644)
except OSError:  # tmpfs: no O_DIRECT
    fd = os.open(path, flags, 0o644)
offs = list(range(0, nbytes, block))
def run(k):
    for o in offs[k::3]:
        os.pwrite(fd, buf, o)
ths = [threading.Thread(target=run, args=(k,)) for k in range(3)]
[t.start() for t in ths]; [t.join() for t in ths]
os.ftruncate(fd, nbytes); os.fsync(fd); os.close(fd)
"""


def floor_direct(ctx):
    return [sys.executable, "-c", FLOOR, ctx.out("floor.bin"), str(_facts(ctx)["universal_bytes"]), "direct"]


def floor_buffered(ctx):
    return [sys.executable, "-c", FLOOR, ctx.out("floor.bin"), str(_facts(ctx)["universal_bytes"]), "buffered"]


def startup_ds(ctx):
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--help"]


def startup_cb(ctx):
    return [sys.executable, "-c", CLI, "--help"]


def startup_numpy(ctx):
    return [sys.executable, "-c", "import numpy"]


G = "convert a ZeRO-2 bf16 checkpoint (2 ranks) to a universal checkpoint"
DS = "deepspeed ds_to_universal"


def _ds_mem(extract: int):
    # measured (tree PSS above base): 0.83 / 1.2 GiB at 1 GiB and 4.6 / 7.4 GiB at 8 GiB with 1 /
    # 2-8 extract workers; the checkpoint has two rank files, so no more than two workers hold one
    return lambda g: 0.5 + g * 0.55 * min(extract, 2)


SUITE = Suite(
    name="deepspeed", module="bench_deepspeed_convert",
    title="DeepSpeed: convert a real ZeRO-2 bf16 checkpoint (ckptbridge vs ds_to_universal)",
    description=__doc__.split("\n\n", 2)[2].strip(),
    prepare="prepare",
    # DeepSpeed itself makes the checkpoint: each rank holds the fp32 model, its bf16 copy and its
    # half of the fp32 master + Adam moments (measured at 8 GiB: ~18 GiB in use at peak)
    prepare_mem_gib=lambda g: 2.3 * g + 1,
    disk_gib=lambda g: 2.5 * g,
    sizes={
        "quick": Size("quick", 0.01, reps=1, params={"d_model": 128, "n_layer": 2}),
        "1g": Size("1g", 1.0, reps=3, params={"d_model": 1024, "n_layer": 6}),      # ~76M params, ~1.0 GiB
        "8g": Size("8g", 8.0, reps=2, params={"d_model": 2048, "n_layer": 12}),     # ~604M params, ~7.9 GiB
    },
    cases=(
        Case("ds/default", G, DS, "default (4 extract / 2 merge workers)", cmd="ds_default", startup="deepspeed",
             mem_gib=_ds_mem(4)),
        Case("ds/w1-1", G, DS, "workers 1 / 1", cmd="ds_w1", startup="deepspeed", mem_gib=_ds_mem(1)),
        Case("ds/w2-1", G, DS, "workers 2 / 1", cmd="ds_w2_1", startup="deepspeed", mem_gib=_ds_mem(2)),
        Case("ds/w2-2", G, DS, "workers 2 / 2", cmd="ds_w2_2", startup="deepspeed", mem_gib=_ds_mem(2)),
        Case("ds/w8-4", G, DS, "workers 8 / 4", cmd="ds_w8_4", startup="deepspeed", mem_gib=_ds_mem(8)),
        # the reference writes what ds_to_universal writes (DeepSpeed's universal layout); the
        # converts write ckptbridge's own layout, a second row, never the headline
        Case("cb/reshard", G, "ckptbridge", "reshard --to deepspeed-universal (DeepSpeed's layout)", "ours",
             cmd="cb_reshard", startup="ckptbridge", ref=True, mem_gib=0.6),
        Case("cb/convert3", G, "ckptbridge",
             f"convert --states {STATES3} (ckptbridge's own layout, the states ds_to_universal writes)", "ours",
             cmd="cb_convert3", startup="ckptbridge", mem_gib=0.6),
        Case("cb/convert", G, "ckptbridge", "convert (all four states, ckptbridge's own layout)", "ours",
             cmd="cb_convert", startup="ckptbridge", mem_gib=0.6),
        Case("floor/direct", G, "floor", "numpy process writing the same bytes, O_DIRECT", "floor",
             cmd="floor_direct", startup="numpy", mem_gib=0.2),
        Case("floor/buffered", G, "floor", "the same through the page cache", "floor", cmd="floor_buffered",
             startup="numpy", mem_gib=0.2),
    ),
    startups={
        "deepspeed": Case("startup/deepspeed", "start-up", DS, "ds_to_universal --help", cmd="startup_ds"),
        "ckptbridge": Case("startup/ckptbridge", "start-up", "ckptbridge", "ckptbridge --help", cmd="startup_cb"),
        "numpy": Case("startup/numpy", "start-up", "numpy", "python -c 'import numpy'", cmd="startup_numpy"),
    },
    env={"DS_ACCELERATOR": "cpu", "DS_SKIP_SHM_OP": "1", "DS_BUILD_OPS": "0", "DS_SKIP_CUDA_CHECK": "1"},
)


if __name__ == "__main__":
    sys.exit(main([SUITE]))

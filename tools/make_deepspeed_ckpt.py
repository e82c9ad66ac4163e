#!/usr/bin/env python
"""Make a real DeepSpeed checkpoint (+ DeepSpeed's own converters' output) for tests and benchmarks.

Runs ``tools/ds_train.py`` under torchrun on CPU/gloo, then (unless ``--no_convert``)
DeepSpeed's ``ds_to_universal`` and ``zero_to_fp32`` on the result::

    python tools/make_deepspeed_ckpt.py OUT --ws 2 --stage 2 --dtype bf16 [-- extra ds_train.py args]
    python tools/make_deepspeed_ckpt.py /tmp/frozen --ws 2 --stage 2 -- --freeze 'ln_f' --tie

    OUT/ckpt/global_step3/                  the checkpoint      OUT/ckpt/global_step3_universal/
    OUT/fp32/pytorch_model.bin              zero_to_fp32        OUT/reference.pt (live engine state)

Environment: ``DS_ACCELERATOR=cpu``, ``DS_SKIP_SHM_OP=1`` and ``OMP_NUM_THREADS=1`` are set here.
The functions are importable (``launch``, ``ds_to_universal``, ``zero_to_fp32``) for tests/benchmarks.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "ds_train.py")
TRAIN_TP = os.path.join(HERE, "ds_train_tp.py")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({"DS_ACCELERATOR": "cpu", "DS_SKIP_SHM_OP": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return e


def init_gloo() -> None:
    """In a training script under torchrun: ``deepspeed.init_distributed`` on gloo. With
    ``DS_SKIP_SHM_OP=1`` (set by :func:`env`) DeepSpeed's JIT g++ build of its CPU shared-memory
    all-reduce op is skipped (inference only; training is unaffected)."""
    if os.environ.get("DS_SKIP_SHM_OP") == "1":
        import deepspeed.comm.torch

        # not `import deepspeed.comm.torch as dct`: deepspeed.comm's own `torch` attribute (the torch
        # package) shadows the submodule there, so the patch would land on torch and the build run
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def leave() -> None:
    """End a training script (every rank, after its last barrier, all files written) without the
    interpreter's teardown: a native destructor of the torch/DeepSpeed stack there aborts a rank in
    about one run in 30 (SIGABRT "terminate called without an active exception", or SIGSEGV, with no
    Python frame), which fails the launch after its work is done; destroy_process_group() first
    does not prevent it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(nproc: int, args: list[str], log: str | None = None, timeout: float = 900, script: str = TRAIN) -> None:
    """Run ``script args`` (``ds_train.py`` unless given) on ``nproc`` CPU ranks; raise with the log tail on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", script, *args]
    _run(cmd, log, timeout)


def ds_to_universal(tag_dir: str, out: str, log: str | None = None, workers: int = 1) -> None:
    """DeepSpeed's own converter (``--inject_missing_state``, as needed for plain ZeRO-1/2 checkpoints)."""
    _run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
          "--output_folder", out, "--inject_missing_state", "--num_extract_workers", str(workers),
          "--num_merge_workers", str(workers)], log, 1800)


def zero_to_fp32(ckpt_dir: str, out: str, tag: str, log: str | None = None) -> None:
    """DeepSpeed's zero_to_fp32 consolidation, saved as ``out/pytorch_model.bin``.

    Calls ``get_fp32_state_dict_from_zero_checkpoint`` directly: the module's CLI also
    imports ``huggingface_hub`` (for sharded safetensors output), which is not needed here.
    """
    code = ("import os, sys, torch; from deepspeed.utils.zero_to_fp32 import "
            "get_fp32_state_dict_from_zero_checkpoint as g; sd = g(sys.argv[1], tag=sys.argv[3]); "
            "os.makedirs(sys.argv[2], exist_ok=True); "
            "torch.save({k: v.contiguous() for k, v in sd.items()}, os.path.join(sys.argv[2], 'pytorch_model.bin'))")
    _run([sys.executable, "-c", code, ckpt_dir, out, tag], log, 1800)


def _run(cmd: list[str], log: str | None, timeout: float) -> None:
    res = subprocess.run(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout)
    if log:
        with open(log, "w") as fh:
            fh.write(res.stdout)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (rc {res.returncode}):\n{res.stdout[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--ws", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no_convert", action="store_true")
    ap.add_argument("--no_reference", action="store_true")
    a, rest = ap.parse_known_args()  # the rest goes to ds_train.py
    rest = [x for x in rest if x != "--"]
    os.makedirs(a.out, exist_ok=True)
    args = ["--stage", str(a.stage), "--dtype", a.dtype, "--steps", str(a.steps), "--out", a.out, *rest]
    if not a.no_reference:
        args += ["--dump_final", os.path.join(a.out, "reference.pt")]
    launch(a.ws, args, os.path.join(a.out, "train.log"))
    tag = f"global_step{a.steps}"
    if not a.no_convert:
        ckpt = os.path.join(a.out, "ckpt")
        ds_to_universal(os.path.join(ckpt, tag), os.path.join(ckpt, tag + "_universal"),
                        os.path.join(a.out, "ds_to_universal.log"))
        zero_to_fp32(ckpt, os.path.join(a.out, "fp32"), tag, os.path.join(a.out, "zero_to_fp32.log"))
    print(f"made {a.out}/ckpt/{tag}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Megatron: reshard a real Megatron checkpoint; ckptbridge vs Megatron's own tools.

    python bench/bench_megatron.py [--quick | --size 1g | --size 8g]

The source is a TP2/PP2 checkpoint written by Megatron-LM itself, in both of its formats:
``torch_dist`` (megatron-core's distributed checkpoint) and the legacy per-rank ``torch``
files. ``quick`` uses the test fixture ``tests/fixtures/megatron/A/tp2pp2`` (a 4-layer
llama-like model); the larger sizes train a llama-like GPT (GQA, SwiGLU, RMSNorm, RoPE,
untied embeddings, vocab 32000) for 2 iterations with Megatron-LM's ``pretrain_gpt.py`` on
4 CPU ranks (``--ckpt-format torch_dist``) and convert it with Megatron-LM's own
``--ckpt-convert-format torch``. Megatron-LM's source (tag core_v0.16.1) must be in
``third_party/mlm`` (see bench/README.md); without it those rows are skipped, with why.

Two operations, each with the real peer:

* **reshard the legacy files to TP1/PP2** (command lines, timed whole until the outputs are
  fsync'd; start-up probes reported and subtracted): Megatron-LM's
  ``tools/checkpoint/convert.py --loader core --saver core`` (its TP/PP reshard; model
  weights only; run through ``bench/_megatron_launch.py``, which installs the CPU shim and
  works around the converter's bugs at this tag) vs ``ckptbridge reshard --to megatron
  -o optimizer=false`` (the same content; the reference) and with the optimizer state
  (what ``ckptbridge reshard`` writes by default: 3x the bytes);
* **load the torch_dist checkpoint into a TP1/PP1 model** (one process; megatron-core's
  ``GPTModel`` built before the clock): megatron-core's ``dist_checkpointing.load`` with the
  model's new sharded state dict (+ ``load_state_dict``) vs ckptbridge ``open`` +
  ``adapters.torch.load_into`` the same parameters (the vocabulary's padding rows are not
  part of ckptbridge's view: it fills the tokenizer's rows). After the clock both sum what
  they loaded over the same rows (``checksum``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Case, Column, Size, Skip, Suite, main, warm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MLM = os.environ.get("MEGATRON_LM_DIR") or os.path.join(ROOT, "third_party", "mlm")
TOOLS = os.path.join(ROOT, "tools", "megatron")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "megatron", "A", "tp2pp2")
CLI = "import sys; from ckptbridge._cli import main; sys.exit(main(sys.argv[1:]))"  # = the `ckptbridge` script
# kernel choices only (the CPU has no fused kernels); the converter builds its own argument list
UNFUSED = "--no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion --no-bias-swiglu-fusion"
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model_args(hidden: int, layers: int, ffn: int, heads: int, groups: int) -> list[str]:
    return (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} --group-query-attention "
            f"--num-query-groups {groups} --ffn-hidden-size {ffn} --swiglu --normalization RMSNorm "
            "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
            "--max-position-embeddings 32 --vocab-size 32000 --make-vocab-size-divisible-by 128").split()


def _have_mlm() -> bool:
    return os.path.isfile(os.path.join(MLM, "pretrain_gpt.py")) and \
        os.path.isfile(os.path.join(MLM, "tools", "checkpoint", "convert.py"))


def _mlm_env() -> dict[str, str]:
    return {**os.environ, "MEGATRON_CPU_SHIM": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore", "MEGATRON_LM_DIR": MLM,
            "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "_megatron_site"), os.environ.get("PYTHONPATH", "")])}


def _pretrain(ctx, log: str, *args: str) -> None:
    sys.path.insert(0, TOOLS)
    import verify_loss

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_deepspeed_ckpt import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(TOOLS, "run_pretrain.py"),
           *_model_args(**ctx.param("model")), *verify_loss.COMMON, "--tensor-model-parallel-size", "2",
           "--pipeline-model-parallel-size", "2", "--data-cache-path", ctx.input("cache"), *args]
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, env=_mlm_env(), stdout=fh, stderr=subprocess.STDOUT, timeout=6 * 3600).returncode
    if rc:
        raise RuntimeError(f"Megatron-LM pretrain_gpt.py failed (exit {rc}); see {log}")


def prepare(ctx) -> None:
    if ctx.param("model") is None:  # quick: the test fixture, written by Megatron-LM
        shutil.copytree(os.path.join(FIXTURE, "torch"), ctx.input("legacy"))
        shutil.copytree(os.path.join(FIXTURE, "torch_dist"), ctx.input("torch_dist"))
        return
    if not _have_mlm():
        raise RuntimeError(f"Megatron-LM's source is needed to make this checkpoint: {MLM} (see bench/README.md)")
    _pretrain(ctx, ctx.input("train.log"), "--train-iters", "2", "--save-interval", "2", "--ckpt-format", "torch_dist",
              "--save", ctx.input("torch_dist"))
    _pretrain(ctx, ctx.input("convert.log"), "--train-iters", "2", "--save-interval", "2", "--load",
              ctx.input("torch_dist"), "--ckpt-format", "torch_dist", "--ckpt-convert-format", "torch",
              "--ckpt-convert-save", ctx.input("conv"), "--save", ctx.input("unused"))
    os.rename(ctx.input("conv", "torch"), ctx.input("legacy"))
    for d in ("conv", "unused", "cache"):
        shutil.rmtree(ctx.input(d), ignore_errors=True)
    os.sync()


# ------------------------------------------------------------------------------------ reshard (command lines)

def megatron_convert(ctx) -> list[str]:
    if not _have_mlm():
        raise Skip(f"needs Megatron-LM's source (tag core_v0.16.1) in {MLM}; see bench/README.md")
    return ["env", "MEGATRON_CPU_SHIM=1", "CUDA_DEVICE_MAX_CONNECTIONS=1", f"MEGATRON_EXTRA_ARGS={UNFUSED}",
            f"MEGATRON_LM_DIR={MLM}", sys.executable, os.path.join(HERE, "_megatron_launch.py"),
            os.path.join(MLM, "tools", "checkpoint", "convert.py"), "--model-type", "GPT", "--loader", "core",
            "--saver", "core", "--load-dir", ctx.input("legacy"), "--save-dir", ctx.out("tp1pp2"),
            "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2", "--megatron-path", MLM,
            "--loader-transformer-impl", "local", "--saver-transformer-impl", "local"]


def cb_reshard_weights(ctx) -> list[str]:
    return [sys.executable, "-c", CLI, "reshard", ctx.input("legacy"), ctx.out("tp1pp2"), "--to", "megatron",
            "--tp", "1", "--pp", "2", "-o", "optimizer=false"]


def cb_reshard_all(ctx) -> list[str]:
    return [sys.executable, "-c", CLI, "reshard", ctx.input("legacy"), ctx.out("tp1pp2"), "--to", "megatron",
            "--tp", "1", "--pp", "2"]


def check_reshard(ctx) -> None:
    """Megatron's converter exits 0 even when its saver process failed: look at what was written."""
    out = ctx.out("tp1pp2")
    files = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs if f == "model_optim_rng.pt"]
    if len(files) != 2 or not os.path.exists(os.path.join(out, "latest_checkpointed_iteration.txt")):
        raise RuntimeError(f"{out}: expected 2 rank files (TP1/PP2) and the tracker, found {files}")
    ctx.metrics["written_mib"] = sum(os.path.getsize(f) for f in files) / 2**20


def startup_megatron(ctx) -> list[str]:
    if not _have_mlm():
        raise Skip(f"needs Megatron-LM's source in {MLM}")
    return ["env", "MEGATRON_CPU_SHIM=1", f"MEGATRON_EXTRA_ARGS={UNFUSED}", f"MEGATRON_LM_DIR={MLM}", sys.executable,
            os.path.join(HERE, "_megatron_launch.py"), os.path.join(MLM, "tools", "checkpoint", "convert.py"), "--help"]


def startup_cb(ctx) -> list[str]:
    return [sys.executable, "-c", CLI, "--help"]


# ------------------------------------------------------------------------------------ load into a TP1/PP1 model

def _model(ctx):
    """megatron-core's GPTModel at TP1/PP1 from the checkpoint's saved args (one gloo process)."""
    import argparse
    import datetime

    sys.path.insert(0, TOOLS)
    import cpu_shim  # patches torch.cuda for CPU before megatron is imported

    cpu_shim.patch_megatron_rng()
    import core_loss
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=3600))
    plain, vocab = core_loss.saved_args(ctx.input("torch_dist"))
    args = argparse.Namespace(**{k: core_loss._revive(v) for k, v in plain.items()})
    mult = int(args.make_vocab_size_divisible_by)
    args.padded_vocab_size = -(-vocab // mult) * mult  # Megatron-LM pads the tokenizer's vocab for TP1
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    model = core_loss.build_model(args, 1, 1)
    for p in model.parameters():  # resident before the clock
        p.data.zero_()
    return model, vocab, core_loss


def _checksum(ctx, model, vocab: int) -> None:
    total = 0.0
    for name, p in model.named_parameters():
        t = p.detach()
        total += float((t[:vocab] if name in VOCAB_TENSORS else t).double().sum())
    ctx.metrics["checksum"] = total


def load_dist(ctx) -> None:
    from megatron.core import dist_checkpointing  # noqa: F401

    model, vocab, core_loss = _model(ctx)
    with ctx.region():
        core_loss.load_dist(model, ctx.input("torch_dist"))  # dist_checkpointing.load + load_state_dict
    _checksum(ctx, model, vocab)


def load_cb(ctx) -> None:
    import ckptbridge
    from ckptbridge.adapters import torch as cbt

    warm.ckptbridge(torch=True)
    model, vocab, _ = _model(ctx)
    params = dict(model.named_parameters())
    with ctx.region(), ckptbridge.open(ctx.input("torch_dist")) as ck:
        targets = {n: (p.data[: ck[n].shape[0]] if n in VOCAB_TENSORS else p.data) for n, p in params.items()}
        cbt.load_into(targets, ck)  # strict: every parameter must be in the checkpoint
    _checksum(ctx, model, vocab)


R = "reshard the legacy files TP2/PP2 -> TP1/PP2 (command line)"
L = "load the torch_dist checkpoint into a TP1/PP1 GPTModel (one process)"
SUITE = Suite(
    name="megatron", module="bench_megatron",
    title="Megatron: reshard a real Megatron-LM checkpoint (ckptbridge vs convert.py, dist_checkpointing.load)",
    description=__doc__.split("\n\n", 2)[2].strip(),
    prepare="prepare",
    # Megatron-LM training the model on 4 CPU ranks: fp32 weights, grads, Adam, DDP buffers
    prepare_mem_gib=lambda g: 2.2 * g + 3,
    disk_gib=lambda g: 3.5 * g,
    sizes={
        "quick": Size("quick", 0.001, reps=1, params={"model": None}),
        # ~100M params: fp32 weights + Adam = ~1.1 GiB of legacy files
        "1g": Size("1g", 1.0, reps=3, params={"model": {"hidden": 768, "layers": 8, "ffn": 2048, "heads": 12,
                                                         "groups": 4}}),
        # ~670M params: ~7.5 GiB of legacy files
        "8g": Size("8g", 8.0, reps=2, params={"model": {"hidden": 2048, "layers": 12, "ffn": 5632, "heads": 16,
                                                         "groups": 4}}),
    },
    cases=(
        Case("reshard/megatron", R, "Megatron-LM convert.py", "default (--loader core --saver core; weights)",
             cmd="megatron_convert", startup="megatron", check="check_reshard", mem_gib=lambda g: 0.7 * g + 1.5),
        Case("reshard/cb-weights", R, "ckptbridge", "reshard --to megatron -o optimizer=false (weights)", "ours",
             cmd="cb_reshard_weights", startup="ckptbridge", check="check_reshard", ref=True,
             mem_gib=lambda g: 0.2 * g + 0.5),
        Case("reshard/cb-all", R, "ckptbridge", "reshard --to megatron (weights + Adam state)", "ours",
             cmd="cb_reshard_all", startup="ckptbridge", check="check_reshard", mem_gib=lambda g: 0.5 * g + 0.5),
        Case("load/dist_checkpointing", L, "megatron-core", "default (dist_checkpointing.load, new sharding)",
             fn="load_dist", mem_gib=lambda g: 0.8 * g + 1.5),
        Case("load/cb", L, "ckptbridge", "open + adapters.torch.load_into", "ours", fn="load_cb", ref=True,
             mem_gib=lambda g: 0.5 * g + 1.5),
    ),
    startups={
        "megatron": Case("startup/megatron", "start-up", "Megatron-LM convert.py", "convert.py --help (with the shim)",
                         cmd="startup_megatron"),
        "ckptbridge": Case("startup/ckptbridge", "start-up", "ckptbridge", "ckptbridge --help", cmd="startup_cb"),
    },
    columns=(Column("checksum", "sum of the values loaded", "{:.6g}"),
             Column("written_mib", "rank files written MiB", "{:.0f}")),
    timeout_s=7200.0,
)


if __name__ == "__main__":
    sys.exit(main([SUITE]))

"""Prove a checkpoint written by ckptbridge loads in Megatron-LM's own training loop.

1. ckptbridge (this repo's venv) reshards SRC into the legacy layout at --tp/--pp;
2. Megatron-LM's pretrain_gpt.py (the Megatron venv, CPU/gloo, tools/megatron/cpu_shim.py)
   loads it at that layout and trains up to --train-iters;
3. the same is done for --ref (a TP1/PP1 checkpoint loaded by Megatron directly), and the
   per-iteration ``lm loss`` values are compared (within --rtol).

    python tools/megatron/verify_loss.py --src tests/fixtures/megatron/A/tp2pp2/torch \\
        --ref tests/fixtures/megatron/A/tp1pp1/torch --tp 1 --pp 2 --preset A --train-iters 6

Exit status 0 when every iteration's loss matches; prints a JSON summary line.
Needs tools/megatron/setup.sh (Megatron venv + Megatron-LM training code).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

# The model and training arguments of the fixtures (tests/fixtures/megatron/tools/make_ckpts.sh).
MODEL_A = shlex.split(
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
    "--position-embedding-type rope --untie-embeddings-and-output-weights "
    "--max-position-embeddings 32 --vocab-size 250 --make-vocab-size-divisible-by 64")
# "B": GPT-2-like, tied embeddings (tools/megatron/make_tied.sh).
MODEL_B = shlex.split(
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --normalization LayerNorm "
    "--position-embedding-type learned_absolute --max-position-embeddings 32 --vocab-size 250 "
    "--make-vocab-size-divisible-by 64")
# "BENCH": a larger llama-like model for bench/bench_megatron.py (22M params, vocab 32000).
MODEL_BENCH = shlex.split(
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
    "--ffn-hidden-size 704 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --max-position-embeddings 32 --vocab-size 32000 "
    "--make-vocab-size-divisible-by 128")
COMMON = shlex.split(
    "--seq-length 32 --micro-batch-size 2 --global-batch-size 4 --tokenizer-type NullTokenizer --mock-data "
    "--seed 1234 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 10 "
    "--weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --transformer-impl local "
    "--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-gelu-fusion --no-rope-fusion "
    "--no-persist-layer-norm --no-bias-dropout-fusion --attention-dropout 0 --hidden-dropout 0 "
    "--log-interval 1 --eval-iters 0 --eval-interval 100000 --exit-on-missing-checkpoint")
PRESETS = {
    "A": MODEL_A,
    "B": MODEL_B,
    "BENCH": MODEL_BENCH,
    "Abf16": [*MODEL_A, "--bf16"],
    "Adistopt": [*MODEL_A, "--use-distributed-optimizer"],
}
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def reshard(src: str, dst: str, tp: int, pp: int, extra: list[str]) -> None:
    code = ("import sys; import ckptbridge as O; from ckptbridge.adapters import megatron; "
            "kw = dict(a.split('=', 1) for a in sys.argv[5:]); "
            "megatron.write(O.open(sys.argv[1]), sys.argv[2], tp=int(sys.argv[3]), pp=int(sys.argv[4]), **kw)")
    subprocess.run([sys.executable, "-c", code, src, dst, str(tp), str(pp), *extra], check=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_losses(load: str, tp: int, pp: int, dp: int, preset: str, iters: int, workdir: str,
                    ckpt_format: str, port: int) -> tuple[dict[int, float], str]:
    py = os.environ.get("MEGATRON_PYTHON") or os.path.join(ROOT, ".megatron", "venv", "bin", "python")
    env = dict(os.environ, MEGATRON_CPU_SHIM="1", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp * dp), "--master_addr", "127.0.0.1",
           "--master_port", str(port), os.path.join(HERE, "run_pretrain.py"), *PRESETS[preset], *COMMON,
           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
           "--load", load, "--ckpt-format", ckpt_format, "--train-iters", str(iters), "--no-load-rng",
           "--use-checkpoint-opt_param-scheduler",
           "--save-interval", "100000", "--data-cache-path", os.path.join(workdir, "cache")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    losses = {int(m.group(1)): float(m.group(2)) for m in LOSS_RE.finditer(log)}
    if proc.returncode != 0 or not losses:
        raise RuntimeError(f"Megatron run failed (rc={proc.returncode}) for {load}:\n{log[-6000:]}")
    return losses, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--src", required=True)
    ap.add_argument("--ref", help="TP1/PP1 checkpoint Megatron loads directly as the reference")
    ap.add_argument("--ref-format", default="torch")
    ap.add_argument("--ref-tp", type=int, default=1)
    ap.add_argument("--ref-pp", type=int, default=1)
    ap.add_argument("--expect", help="comma list iter:loss instead of --ref (e.g. from a Megatron log)")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--preset", default="A", choices=sorted(PRESETS))
    ap.add_argument("--train-iters", type=int, required=True)
    ap.add_argument("--rtol", type=float, default=2e-6)
    ap.add_argument("--keep", help="keep the written checkpoint here")
    ap.add_argument("-o", action="append", default=[], help="writer option key=value")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        dst = a.keep or os.path.join(work, "written")
        reshard(a.src, dst, a.tp, a.pp, a.o)
        got, _ = megatron_losses(dst, a.tp, a.pp, a.dp, a.preset, a.train_iters, work, "torch", free_port())
        if a.ref:
            want, _ = megatron_losses(a.ref, a.ref_tp, a.ref_pp, a.dp, a.preset, a.train_iters, work, a.ref_format, free_port())
        else:
            want = {int(k): float(v) for k, v in (x.split(":") for x in (a.expect or "").split(",") if x)}
    common = sorted(set(got) & set(want))
    ok = bool(common) and all(abs(got[i] - want[i]) <= a.rtol * abs(want[i]) for i in common)
    print(json.dumps({"ok": ok, "tp": a.tp, "pp": a.pp, "src": a.src, "losses": {i: got[i] for i in sorted(got)},
                      "reference": {i: want[i] for i in sorted(want)}, "rtol": a.rtol}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

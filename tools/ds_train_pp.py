#!/usr/bin/env python
"""A pipeline-parallel model (DeepSpeed ``PipelineModule``) trained with ZeRO-1 on CPU/gloo, then saved.

Shows DeepSpeed's pipeline checkpoint naming: per-layer weights in
``layer_{idx:02d}-model_{mp:02d}-model_states.pt``, one ``mp_rank_{mp:02d}_model_states.pt``
per pipeline stage and ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` per (dp, stage)::

    python -m torch.distributed.run --nproc_per_node=2 tools/ds_train_pp.py --pp 2 --out /tmp/pp

``--resume_native CKPT [--compare_universal CKPT]`` resumes at this layout with ckptbridge's
``load_engine`` (and DeepSpeed's ``load_universal`` beside it) instead (``tests/test_deepspeed_resume_pp.py``).
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, CTX, BATCH, D = 101, 16, 8, 24


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)

    def forward(self, idx):
        return self.wte(idx)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.fc_out = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc_out(F.gelu(self.fc(self.ln(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build_engine(pp: int, dtype: str, load_universal: bool = False):
    """The 5-layer model as a ``PipelineModule`` of ``pp`` stages in a ZeRO-1 engine."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(1234)
    layers = [LayerSpec(Embed), LayerSpec(MLP), LayerSpec(MLP), LayerSpec(MLP), LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=pp, loss_fn=loss_fn, partition_method="uniform")
    dp = torch.distributed.get_world_size() // pp
    cfg = {**ds_config(dp, dtype), "checkpoint": {"load_universal": load_universal}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def add_run_args(ap: argparse.ArgumentParser, dtype: str) -> None:
    """The arguments every ``ds_train_*`` launch shares: dtype, steps, output, resuming, torchrun's rank."""
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=dtype)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", required=True)
    add_resume_args(ap)
    ap.add_argument("--local_rank", type=int, default=-1)


def add_resume_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--resume_native", default=None,
                    help="fill the engine (any layout) with ckptbridge's load_engine from this checkpoint, "
                         "then train --steps without saving")
    ap.add_argument("--compare_universal", default=None,
                    help="then resume a second engine from this universal checkpoint with DeepSpeed's "
                         "load_universal and train the same steps (meta: reference_losses)")


def resume(build, run, args: argparse.Namespace, meta: dict, after_load=None) -> None:
    """``--resume_native``: ``build(load_universal)`` an engine, fill it with ``load_engine``
    (then ``after_load(engine)``), ``run(engine, start)`` its steps; ``--compare_universal``: the
    same from DeepSpeed's ``load_universal``; (rank 0) ``meta.json``; exit."""
    from make_deepspeed_ckpt import leave

    from ckptbridge.adapters.deepspeed import load_engine

    engine = build(False)
    loaded = load_engine(engine, args.resume_native)
    bytes_read = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(bytes_read, loaded.bytes_read)
    if after_load is not None:
        after_load(engine)
    start = engine.global_steps
    losses = run(engine, start)
    reference = None
    if args.compare_universal:
        other = build(True)
        path, _ = other.load_checkpoint(args.compare_universal, load_optimizer_states=True)
        if path is None:
            raise SystemExit(f"load_checkpoint({args.compare_universal}) found nothing")
        reference = run(other, other.global_steps)
    if torch.distributed.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "meta.json"), "w") as fh:
            json.dump({**meta, "world_size": torch.distributed.get_world_size(), "resumed_at": start,
                       "losses": losses, "reference_losses": reference, "bytes_read": bytes_read}, fh)
    torch.distributed.barrier()
    leave()


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--pp", type=int, default=2)
    add_run_args(ap, "fp32")
    args = ap.parse_args()
    from make_deepspeed_ckpt import init_gloo

    init_gloo()
    dp = torch.distributed.get_world_size() // args.pp
    meta = {"pp": args.pp, "dtype": args.dtype}
    if args.resume_native:
        resume(lambda universal: build_engine(args.pp, args.dtype, universal),
               lambda engine, start: train(engine, dp, start, args.steps), args, meta)
    train_and_save(build_engine(args.pp, args.dtype), args.out, dp, args.steps, meta)


def ds_config(dp: int, dtype: str) -> dict:
    """ZeRO-1 AdamW, two micro-batches per step (what a pipeline needs to overlap stages)."""
    return {
        "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // dp // 2,
        "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": dtype == "bf16"},
    }


def train(engine, dp: int, start: int, steps: int) -> list[float]:
    """Pipeline steps ``start .. start + steps`` on seeded micro-batches (two per step)."""

    def batches():
        micro = 2 * start
        while True:
            g = torch.Generator().manual_seed(1000 + micro)
            data = torch.randint(0, VOCAB, (BATCH // dp // 2, CTX + 1), generator=g)
            micro += 1
            yield data[:, :-1], data[:, 1:]

    it = batches()
    return [float(engine.train_batch(data_iter=it)) for _ in range(steps)]


def train_and_save(engine, out: str, dp: int, steps: int, meta: dict) -> None:
    """``steps`` pipeline steps on seeded batches, then the checkpoint and (rank 0) ``meta.json``."""
    losses = train(engine, dp, 0, steps)
    engine.save_checkpoint(os.path.join(out, "ckpt"), tag=f"global_step{engine.global_steps}")
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "meta.json"), "w") as fh:
            json.dump({"stage": 1, "world_size": torch.distributed.get_world_size(), **meta, "losses": losses,
                       "global_steps": engine.global_steps}, fh)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()

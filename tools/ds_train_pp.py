#!/usr/bin/env python
"""A pipeline-parallel model (DeepSpeed ``PipelineModule``) trained with ZeRO-1 on CPU/gloo, then saved.

Shows DeepSpeed's pipeline checkpoint naming: per-layer weights in
``layer_{idx:02d}-model_{mp:02d}-model_states.pt``, one ``mp_rank_{mp:02d}_model_states.pt``
per pipeline stage and ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` per (dp, stage)::

    python -m torch.distributed.run --nproc_per_node=2 tools/ds_train_pp.py --pp 2 --out /tmp/pp
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


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from make_deepspeed_ckpt import init_gloo

    init_gloo()
    torch.manual_seed(1234)
    layers = [LayerSpec(Embed), LayerSpec(MLP), LayerSpec(MLP), LayerSpec(MLP), LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=args.pp, loss_fn=loss_fn, partition_method="uniform")
    dp = torch.distributed.get_world_size() // args.pp
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(dp, args.dtype))
    train_and_save(engine, args.out, dp, args.steps, {"pp": args.pp, "dtype": args.dtype})


def ds_config(dp: int, dtype: str) -> dict:
    """ZeRO-1 AdamW, two micro-batches per step (what a pipeline needs to overlap stages)."""
    return {
        "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // dp // 2,
        "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": dtype == "bf16"},
    }


def train_and_save(engine, out: str, dp: int, steps: int, meta: dict) -> None:
    """``steps`` pipeline steps on seeded batches, then the checkpoint and (rank 0) ``meta.json``."""

    def batches():
        step = 0
        while True:
            g = torch.Generator().manual_seed(1000 + step)
            data = torch.randint(0, VOCAB, (BATCH // dp // 2, CTX + 1), generator=g)
            step += 1
            yield data[:, :-1], data[:, 1:]

    it = batches()
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(steps)]
    engine.save_checkpoint(os.path.join(out, "ckpt"), tag=f"global_step{engine.global_steps}")
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "meta.json"), "w") as fh:
            json.dump({"stage": 1, "world_size": torch.distributed.get_world_size(), **meta, "losses": losses,
                       "global_steps": engine.global_steps}, fh)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()

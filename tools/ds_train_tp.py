#!/usr/bin/env python
"""A Megatron-style tensor-parallel model trained with real DeepSpeed ZeRO (CPU/gloo), then saved.

Shows the Megatron-DeepSpeed checkpoint naming with TP > 1: ``mp_rank_{tp:02d}_model_states.pt``
per tensor-parallel rank and ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt`` per
(dp, tp) rank, with the ``universal_checkpoint_info`` patterns Megatron-DeepSpeed records
(replicated / row-parallel / vocabulary parameters) so that ``ds_to_universal`` can merge it::

    python -m torch.distributed.run --nproc_per_node=4 tools/ds_train_tp.py --tp 2 --stage 1 --out /tmp/tp

With ``--resume_native CKPT`` the engine (any TP x DP) is filled by ckptbridge's ``load_engine``
from a checkpoint of another layout, each TP rank dumps what it holds (``loaded.tp<r>.pt``), and
``--compare_universal CKPT`` trains the same steps from DeepSpeed's own ``load_universal``
(``tests/test_deepspeed_resume_tp.py``)::

    python -m torch.distributed.run --nproc_per_node=4 tools/ds_train_tp.py --tp 4 --stage 2 --dtype bf16 \
        --out /tmp/tp4 --no_save --resume_native /tmp/tp/ckpt --compare_universal /tmp/tp/ckpt

Model (per block): replicated LayerNorm, column-parallel ``fc`` ([4D/tp, D] + bias),
row-parallel ``fc_out`` ([D, 4D/tp], replicated bias); replicated word embedding;
column-parallel ``lm_head`` over a vocabulary padded from V to a multiple of tp.
The forward is the usual Megatron math (all-reduce after row-parallel layers,
all-gather of the logits), so replicated parameters stay identical across TP ranks.
"""

import argparse
import json
import os
import re

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from ds_train_pp import add_run_args, resume

VOCAB, CTX, BATCH = 101, 16, 8


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        tdist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        tdist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, world):
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(world)]
        tdist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None, None, None


class Mpu:
    """The subset of Megatron's mpu interface DeepSpeed uses."""

    def __init__(self, tp: int) -> None:
        ws, rank = tdist.get_world_size(), tdist.get_rank()
        self.tp, self.dp = tp, ws // tp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.tp_group = self.dp_group = None
        for d in range(self.dp):
            g = tdist.new_group([d * tp + t for t in range(tp)])
            if d == self.dp_rank:
                self.tp_group = g
        for t in range(tp):
            g = tdist.new_group([d * tp + t for d in range(self.dp)])
            if t == self.tp_rank:
                self.dp_group = g

    def get_model_parallel_rank(self): return self.tp_rank
    def get_model_parallel_world_size(self): return self.tp
    def get_model_parallel_group(self): return self.tp_group
    def get_tensor_model_parallel_rank(self): return self.tp_rank
    def get_tensor_model_parallel_world_size(self): return self.tp
    def get_tensor_model_parallel_group(self): return self.tp_group
    def get_slice_parallel_rank(self): return self.tp_rank
    def get_slice_parallel_world_size(self): return self.tp
    def get_slice_parallel_group(self): return self.tp_group
    def get_data_parallel_rank(self): return self.dp_rank
    def get_data_parallel_world_size(self): return self.dp
    def get_data_parallel_group(self): return self.dp_group
    def get_pipeline_model_parallel_world_size(self): return 1


class Block(nn.Module):
    def __init__(self, d: int, tp: int, mpu: Mpu) -> None:
        super().__init__()
        self.mpu = [mpu]
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d // tp)                 # column parallel
        self.fc_out = nn.Linear(4 * d // tp, d, bias=False)  # row parallel
        self.fc_out_bias = nn.Parameter(torch.zeros(d))     # replicated, added after the reduce

    def forward(self, x):
        g = self.mpu[0].tp_group
        h = F.gelu(self.fc(_CopyToTP.apply(self.ln(x), g)))
        return x + _ReduceFromTP.apply(self.fc_out(h), g) + self.fc_out_bias


class TPModel(nn.Module):
    def __init__(self, d: int, n_layer: int, mpu: Mpu) -> None:
        super().__init__()
        tp = mpu.tp
        self.mpu = [mpu]
        self.padded = -(-VOCAB // tp) * tp
        self.wte = nn.Embedding(VOCAB, d)                   # replicated
        self.blocks = nn.ModuleList([Block(d, tp, mpu) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, self.padded // tp, bias=False)  # vocab parallel
        self.universal_checkpoint_info = {
            "universal_checkpoint_version": 0.2,
            "tp_replicated_parameter_patterns": [r"wte\.weight", r".*\.ln\.(weight|bias)", r"ln_f\.(weight|bias)",
                                                 r".*\.fc_out_bias"],
            "parameter_with_row_parallelism_patterns": [r".*\.fc_out\.weight"],
            "vocabulary_parameter_patterns": [r"lm_head\.weight"],
            "original_vocab_size": VOCAB,
        }

    def forward(self, idx, targets):
        m = self.mpu[0]
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(_CopyToTP.apply(self.ln_f(x), m.tp_group))
        logits = _GatherLast.apply(logits, m.tp_group, m.tp_rank, m.tp)[..., :VOCAB]
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build_engine(args, mpu: Mpu, load_universal: bool = False):
    """The TP model (replicated parameters seeded alike, sharded ones per TP rank) in a DeepSpeed engine."""
    import deepspeed

    torch.manual_seed(1234)  # replicated parameters: same init on every rank
    model = TPModel(args.d_model, args.n_layer, mpu)
    torch.manual_seed(5678 + mpu.tp_rank)  # sharded parameters: each TP rank its own slice
    for n, p in model.named_parameters():
        if not any(re.fullmatch(pat, n) for pat in model.universal_checkpoint_info["tp_replicated_parameter_patterns"]):
            with torch.no_grad():
                p.normal_(0, 0.05)
    cfg = {
        "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // mpu.dp,
        "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "checkpoint": {"load_universal": load_universal},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
    return engine


def train(engine, mpu: Mpu, start: int, steps: int) -> list[float]:
    """Steps ``start .. start + steps`` (the batch of step i is the same at any TP x DP layout)."""
    micro = BATCH // mpu.dp
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + step)
        data = torch.randint(0, VOCAB, (BATCH, CTX + 1), generator=g)
        x, y = data[:, :-1], data[:, 1:]
        sl = slice(mpu.dp_rank * micro, (mpu.dp_rank + 1) * micro)
        loss = engine(x[sl], y[sl])
        engine.backward(loss)
        engine.step()
        v = loss.detach().float().clone()
        tdist.all_reduce(v, group=mpu.dp_group)
        losses.append(v.item() / mpu.dp)
    return losses


def dump_local(engine, path: str, write: bool) -> None:
    """{name: {fp32, exp_avg, exp_avg_sq, lp}} of this TP rank's parameters, gathered over DP (a
    collective: every rank calls it; those with ``write`` save it to ``path``)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {"fp32": safe_get_full_fp32_param(p).detach().clone(),
                     **{k: safe_get_full_optimizer_state(p, k).detach().clone() for k in ("exp_avg", "exp_avg_sq")}}
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out[name]["lp"] = p.detach().clone()  # the weights the forward uses
    if write:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(out, path)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--d_model", type=int, default=24)
    ap.add_argument("--n_layer", type=int, default=2)
    ap.add_argument("--no_save", action="store_true")
    add_run_args(ap, "fp32")  # with --resume_native, each TP rank's loaded state goes to OUT/loaded.tp<r>.pt
    args = ap.parse_args()
    from make_deepspeed_ckpt import init_gloo, leave

    init_gloo()
    mpu = Mpu(args.tp)
    meta = {"stage": args.stage, "tp": args.tp, "dtype": args.dtype}
    if args.resume_native:
        resume(lambda universal: build_engine(args, mpu, universal),
               lambda engine, start: train(engine, mpu, start, args.steps), args, meta,
               after_load=lambda engine: dump_local(engine, os.path.join(args.out, f"loaded.tp{mpu.tp_rank}.pt"),
                                                    mpu.dp_rank == 0))
    engine = build_engine(args, mpu)
    losses = train(engine, mpu, 0, args.steps)
    if not args.no_save:
        engine.save_checkpoint(os.path.join(args.out, "ckpt"), tag=f"global_step{engine.global_steps}")
    if tdist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "meta.json"), "w") as fh:
            json.dump({**meta, "world_size": tdist.get_world_size(), "losses": losses,
                       "global_steps": engine.global_steps}, fh)
    tdist.barrier()
    leave()


if __name__ == "__main__":
    main()

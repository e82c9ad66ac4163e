#!/usr/bin/env python
"""Megatron-DeepSpeed's 3D layout: a ``PipelineModule`` with tensor-parallel layers, trained with
ZeRO-1 on CPU/gloo (TP x PP x DP ranks), then saved.

Per-layer weights go to ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (one file per layer
and tensor-parallel rank), ``mp_rank_{mp:02d}_model_states.pt`` per model-parallel rank and
``zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` per (dp, mp) rank, with the
``universal_checkpoint_info`` patterns Megatron-DeepSpeed records (names carry the layer index,
as ``PipelineModule`` names its layers)::

    python -m torch.distributed.run --nproc_per_node=8 tools/ds_train_3d.py --tp 2 --pp 2 --out /tmp/3d

The tensor-parallel math is ``tools/ds_train_tp.py``'s: column-parallel ``fc``, row-parallel
``fc_out`` (replicated bias after the all-reduce), vocabulary-parallel ``lm_head`` over a
vocabulary padded to a multiple of tp, replicated embedding and LayerNorms.
"""

import argparse
import re

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from ds_train_pp import (
    VOCAB,
    D,
    Embed,
    add_run_args,
    ds_config,
    loss_fn,
    resume,
    train,
    train_and_save,
)
from ds_train_tp import _CopyToTP, _GatherLast, _ReduceFromTP

TP: dict = {}  # the tensor-parallel group, rank and size, filled once the pipeline grid exists


class MLP(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D // tp)  # column parallel
        self.fc_out = nn.Linear(4 * D // tp, D, bias=False)  # row parallel
        self.fc_out_bias = nn.Parameter(torch.zeros(D))

    def forward(self, x):
        h = F.gelu(self.fc(_CopyToTP.apply(self.ln(x), TP["group"])))
        return x + _ReduceFromTP.apply(self.fc_out(h), TP["group"]) + self.fc_out_bias


class Head(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, -(-VOCAB // tp), bias=False)  # vocabulary parallel

    def forward(self, x):
        logits = self.lm_head(_CopyToTP.apply(self.ln_f(x), TP["group"]))
        return _GatherLast.apply(logits, TP["group"], TP["rank"], TP["size"])[..., :VOCAB]


REPLICATED = [r"\d+\.wte\.weight", r"\d+\.ln\.(weight|bias)", r"\d+\.ln_f\.(weight|bias)", r"\d+\.fc_out_bias"]


def build_engine(args: argparse.Namespace, load_universal: bool = False):
    """The 3D model (TP layers in a ``PipelineModule`` over a TP x PP x DP topology) in a ZeRO-1 engine."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = tdist.get_world_size() // (args.tp * args.pp)
    topo = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=dp)
    torch.manual_seed(1234)  # replicated parameters: the same init on every rank
    layers = [LayerSpec(Embed), *(LayerSpec(MLP, args.tp) for _ in range(3)), LayerSpec(Head, args.tp)]
    model = PipelineModule(layers=layers, topology=topo, loss_fn=loss_fn, partition_method="uniform")
    grid = model._grid
    TP.update(group=grid.get_slice_parallel_group(), rank=grid.get_slice_parallel_rank(), size=args.tp)
    torch.manual_seed(5678 + TP["rank"])  # sharded parameters: each TP rank its own slice
    for n, p in model.named_parameters():
        if not any(re.fullmatch(pat, n) for pat in REPLICATED):
            with torch.no_grad():
                p.normal_(0, 0.05)
    model.universal_checkpoint_info = {
        "universal_checkpoint_version": 0.2,
        "tp_replicated_parameter_patterns": REPLICATED,
        "parameter_with_row_parallelism_patterns": [r"\d+\.fc_out\.weight"],
        "vocabulary_parameter_patterns": [r"\d+\.lm_head\.weight"],
        "original_vocab_size": VOCAB,
    }
    cfg = {**ds_config(dp, args.dtype), "checkpoint": {"load_universal": load_universal}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    add_run_args(ap, "bf16")
    args = ap.parse_args()
    from make_deepspeed_ckpt import init_gloo

    init_gloo()
    dp = tdist.get_world_size() // (args.tp * args.pp)
    meta = {"tp": args.tp, "pp": args.pp, "dtype": args.dtype}
    if args.resume_native:
        resume(lambda universal: build_engine(args, universal),
               lambda engine, start: train(engine, dp, start, args.steps), args, meta)
    train_and_save(build_engine(args), args.out, dp, args.steps, meta)


if __name__ == "__main__":
    main()

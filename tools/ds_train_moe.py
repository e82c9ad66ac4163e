#!/usr/bin/env python
"""Train a tiny model with DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``) under ZeRO 1/2 on CPU/gloo.

One process per rank under torchrun; ``--ep`` experts-parallel ranks (``ep_size``), the rest
expert-data-parallel. Writes DeepSpeed's checkpoint (``<out>/ckpt/<tag>/``: ``mp_rank_00_model_states.pt``,
``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` per global expert, ``[bf16_]zero_pp_rank_<dp>_mp_rank_00
_optim_states.pt`` per rank), ``<out>/meta.json`` (losses, world, stage, ep) and ``<out>/state_<rank>.pt``:
DeepSpeed's own gathered view of every parameter this rank holds (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``: fp32 master, exp_avg, exp_avg_sq), with its local name and the rank's
expert-parallel rank (``groups._get_expert_parallel_rank``), the reference for tests/test_deepspeed_moe.py::

    DS_ACCELERATOR=cpu DS_SKIP_SHM_OP=1 OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 \\
        --master_addr=127.0.0.1 --master_port=29533 tools/ds_train_moe.py --stage 2 --ep 2 --out /tmp/moe
    # resume at another EP / DP / stage with ckptbridge's load_engine (no conversion); state_<rank>.pt
    # is then the engine's state right after the load:
    ... --nproc_per_node=4 tools/ds_train_moe.py --stage 1 --ep 4 --steps 2 --resume /tmp/moe/ckpt --out /tmp/r

``--stage 3`` stops in ``deepspeed.initialize`` (DeepSpeed 0.19.8): ``AssertionError: Native DeepSpeed MoE is not
supported with ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2.`` (tests/test_deepspeed_moe.py keeps that proof).
"""

import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_train import GLOBAL_BATCH, make_batch
from make_deepspeed_ckpt import init_gloo, leave

VOCAB, D, EXPERTS = 64, 16, 4


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)
        self.out = nn.Linear(2 * D, D)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class TinyMoE(nn.Module):
    """Embedding -> DeepSpeed MoE (4 experts, top-2) -> norm -> head."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.wte = nn.Embedding(VOCAB, D)
        self.moe = MoE(hidden_size=D, expert=Expert(), num_experts=EXPERTS, ep_size=ep, k=2, min_capacity=16,
                       capacity_factor=4.0, drop_tokens=False)
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, idx, targets):
        x = self.wte(idx)
        y, aux, _ = self.moe(x)
        logits = self.lm_head(self.ln_f(x + y))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)) + 0.01 * aux


def build_engine(stage: int, ep: int, ws: int, dtype: str):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(1234)
    model = TinyMoE(ep)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "name": "all"}]
    cfg = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // ws,
        "gradient_accumulation_steps": 1, "steps_per_print": 10**9, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=split_params_into_different_moe_groups_for_optimizer(groups), config=cfg)
    return engine


def dump_state(engine, path: str) -> None:
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    zopt = engine.optimizer
    if hasattr(zopt, "_hp_optimizer_states_linked"):
        zopt._hp_optimizer_states_linked = False  # DeepSpeed links states lazily (see ds_train.dump_state)
        zopt._lazy_init_hp_params_optimizer_state()
    out = {}
    for n, p in engine.module.named_parameters():
        st = {"fp32": safe_get_full_fp32_param(p)}
        st.update({k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")})
        out[n] = {k: v.detach().float().clone() for k, v in st.items() if v is not None}
    name = engine.module.moe.expert_group_name
    torch.save({"params": out, "ep_rank": groups._get_expert_parallel_rank(name),
                "steps": sorted({float(s["step"]) for s in zopt.optimizer.state.values() if "step" in s})}, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", help="a checkpoint to resume from (then --steps more steps, no save)")
    ap.add_argument("--how", default="ckptbridge", choices=["ckptbridge", "deepspeed"],
                    help="resume with ckptbridge's load_engine or DeepSpeed's own engine.load_checkpoint")
    args = ap.parse_args()
    init_gloo()
    from deepspeed import comm as dist

    rank, ws = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)
    engine = build_engine(args.stage, args.ep, ws, args.dtype)
    start = 0
    if args.resume:
        if args.how == "ckptbridge":
            from ckptbridge.adapters.deepspeed import load_engine

            load_engine(engine, args.resume)
        else:
            engine.load_checkpoint(args.resume)
        start = engine.global_steps
        dump_state(engine, os.path.join(args.out, f"state_{rank}.pt"))
    micro = GLOBAL_BATCH // ws
    losses = []
    for step in range(start, start + args.steps):
        x, y = make_batch(step, VOCAB)
        loss = engine(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        v = loss.detach().float().clone()
        dist.all_reduce(v)
        losses.append(v.item() / ws)
    if not args.resume:
        engine.save_checkpoint(os.path.join(args.out, "ckpt"), tag=f"global_step{args.steps}")
        dump_state(engine, os.path.join(args.out, f"state_{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "meta.json"), "w") as fh:
            json.dump({"losses": losses, "world": ws, "stage": args.stage, "ep": args.ep, "dtype": args.dtype,
                       "start": start}, fh)
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Train a tiny GPT with real DeepSpeed ZeRO on CPU (gloo) and save a checkpoint; or resume one.

Adapted from the shared fixtures' ``train_ds.py`` (same model, data, optimizer,
so its checkpoints match the fixtures'); used by ``tests/test_deepspeed_e2e.py``,
``tools/make_deepspeed_ckpt.py`` and ``bench/bench_deepspeed_convert.py``.
Run one process per rank under torchrun::

    DS_ACCELERATOR=cpu DS_SKIP_SHM_OP=1 OMP_NUM_THREADS=1 \\
    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=29511 \\
        tools/ds_train.py --stage 2 --dtype bf16 --out /tmp/run

    # resume from a universal checkpoint (load_universal=true) at another world size / stage:
    ... --nproc_per_node=1 tools/ds_train.py --stage 1 --steps 2 --resume_universal /tmp/univ --out /tmp/r

Writes ``<out>/ckpt/<tag>/`` (DeepSpeed's checkpoint, unless ``--no_save``) and
``<out>/meta.json`` (losses, world size, stage, ...). ``--n_layer/--d_model/--vocab`` scale the model
(``--d_model 1024 --n_layer 4`` gives ~50M parameters, ~0.6 GiB of optimizer state).
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CTX = 16
GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        nh = 4
        q = q.view(B, T, nh, C // nh).transpose(1, 2)
        k = k.view(B, T, nh, C // nh).transpose(1, 2)
        v = v.view(B, T, nh, C // nh).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 101, d: int = 60, n_layer: int = 3) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(CTX, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=True)

    def forward(self, idx, targets):
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)[None]
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


def make_batch(step: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (GLOBAL_BATCH, CTX + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def param_groups(model):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "wte" not in n and "wpe" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def dump_state(engine, path: str, rank: int) -> None:
    """Full fp32 master weights + Adam moments + step of every parameter, gathered from the engine."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zopt = engine.optimizer
    if hasattr(zopt, "_hp_optimizer_states_linked") and hasattr(zopt, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed links ZeRO-1/2 optimizer-state fragments lazily after group 0's step only
        # (groups >= 1 then miss exp_avg); re-link, as the fixtures' train_ds.py does.
        zopt._hp_optimizer_states_linked = False
        zopt._lazy_init_hp_params_optimizer_state()
    out = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        fp32 = safe_get_full_fp32_param(p)
        states = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
        if rank == 0:
            out[n] = {"fp32": fp32.detach().float().clone()}
            out[n].update({k: v.detach().float().clone() for k, v in states.items() if v is not None})
    if rank == 0:
        opt = engine.optimizer.optimizer
        steps = sorted({float(s["step"]) for s in opt.state.values() if "step" in s})
        torch.save({"params": out, "steps": steps,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]},
                   path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume_universal", default=None)
    ap.add_argument("--bf16_optimizer", action="store_true")
    ap.add_argument("--zero_extra", default="{}")
    ap.add_argument("--vocab", type=int, default=101)
    ap.add_argument("--d_model", type=int, default=60)
    ap.add_argument("--n_layer", type=int, default=3)
    ap.add_argument("--no_save", action="store_true")
    ap.add_argument("--freeze", default=None, help="regex: parameters whose names match get requires_grad=False")
    ap.add_argument("--dump_final", default=None, help="like --dump_loaded, after training")
    ap.add_argument("--tie", action="store_true", help="tie lm_head.weight to wte.weight (shared parameter)")
    ap.add_argument("--dump_loaded", default=None,
                    help="after resuming, save {name: {fp32, exp_avg, exp_avg_sq}} gathered from the live engine")
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    import deepspeed
    from deepspeed import comm as dist
    from make_deepspeed_ckpt import init_gloo

    init_gloo()
    rank, ws = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // ws

    torch.manual_seed(1234)
    model = TinyGPT(args.vocab, args.d_model, args.n_layer)
    if args.tie:
        model.lm_head.weight = model.wte.weight
    if args.freeze:
        import re

        for n, p in model.named_parameters():
            if re.search(args.freeze, n):
                p.requires_grad_(False)
    zero = {"stage": args.stage}
    if args.stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True})
    zero.update(json.loads(args.zero_extra))
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": zero,
        "bf16": {"enabled": args.dtype == "bf16"},
        "wall_clock_breakdown": False,
    }
    if args.dtype == "fp16":
        # DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; torch's CPU
        # fp16 ops are slow but correct, which is all a tiny fixture needs. Everything else (the
        # ZeRO optimizer, dynamic loss scaling, the checkpoint files) is DeepSpeed's own code.
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100}
    if args.bf16_optimizer:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if args.resume_universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)

    start = 0
    if args.resume_universal:
        path, _ = engine.load_checkpoint(args.resume_universal, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        if path is None:
            raise SystemExit(f"load_checkpoint({args.resume_universal}) found nothing")
        start = engine.global_steps
        if args.dump_loaded:
            dump_state(engine, args.dump_loaded, rank)
    losses = []
    for step in range(start, start + args.steps):
        x, y = make_batch(step, args.vocab)
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        v = loss.detach().float().clone()
        dist.all_reduce(v)
        losses.append(v.item() / ws)
    if args.dump_final:
        dump_state(engine, args.dump_final, rank)
    save_s = None
    if not args.no_save:
        t0 = time.time()
        engine.save_checkpoint(os.path.join(args.out, "ckpt"), tag=f"global_step{engine.global_steps}")
        save_s = time.time() - t0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        meta = {"stage": args.stage, "world_size": ws, "dtype": args.dtype, "losses": losses,
                "global_steps": engine.global_steps, "resumed_from": args.resume_universal,
                "optimizer_wrapper": type(engine.optimizer).__name__, "save_checkpoint_s": save_s,
                "offload": {k: (str(getattr(c.device, "value", c.device)) if c is not None else None) for k, c in
                            (("optimizer", engine.zero_offload_optimizer()), ("param", engine.zero_offload_param()))},
                "n_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                for p in engine.module.parameters())}
        with open(os.path.join(args.out, "meta.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()

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
    # or straight from the native checkpoint (ckptbridge.adapters.deepspeed.load_engine, no conversion),
    # and (--compare_universal) a second engine resumed by DeepSpeed's load_universal for reference:
    ... --nproc_per_node=4 tools/ds_train.py --stage 3 --steps 2 --resume_native /tmp/run/ckpt --out /tmp/r

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


def build_engine(args, ws: int, load_universal: bool = False):
    """A fresh TinyGPT (seed 1234) in a DeepSpeed engine configured from ``args``."""
    import deepspeed

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
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def unalias_steps(engine) -> int:
    """Work around a DeepSpeed 0.19.8 ZeRO-3 universal-load bug; return how many aliases it undid.

    ``stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`` stores one and the same step
    tensor as ``state['step']`` of every sub-group, so each optimizer step increments it once per
    sub-group (3 -> 5 after one step with two sub-groups) and every sub-group after the first uses a
    wrong Adam bias correction. Giving each sub-group its own copy restores what DeepSpeed means.
    """
    opt = engine.optimizer
    flats = getattr(opt, "fp32_partitioned_groups_flat", None)
    if not flats:
        return 0
    seen, undone = set(), 0
    for fp32 in flats:
        st = opt.optimizer.state.get(fp32, {})
        step = st.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                st["step"] = step.clone()
                undone += 1
            seen.add(id(step))
    return undone


def train(engine, args, start: int, rank: int, ws: int, timing: dict | None = None) -> list[float]:
    """``args.steps`` steps from ``start``; the mean loss of each over the ranks."""
    from deepspeed import comm as dist

    micro = GLOBAL_BATCH // ws
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
        if timing is not None:
            timing.setdefault("first_step_done_at", time.time())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume_universal", default=None)
    ap.add_argument("--resume_native", default=None,
                    help="fill the engine with ckptbridge.adapters.deepspeed.load_engine from this checkpoint")
    ap.add_argument("--native_weights_only", action="store_true",
                    help="with --resume_native: load_optimizer_states=False (a negative control)")
    ap.add_argument("--compare_universal", default=None,
                    help="after a --resume_native run, resume a second engine from this universal checkpoint "
                         "with DeepSpeed's load_universal and train the same steps (meta: reference_losses; "
                         "its ZeRO-3 step aliasing is undone, see unalias_steps)")
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

    from deepspeed import comm as dist
    from make_deepspeed_ckpt import init_gloo, leave

    timing: dict = {"started_at": time.time()}
    init_gloo()
    rank, ws = dist.get_rank(), dist.get_world_size()
    engine = build_engine(args, ws, load_universal=bool(args.resume_universal))

    start = 0
    t_load = time.time()
    if args.resume_universal:
        path, _ = engine.load_checkpoint(args.resume_universal, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        if path is None:
            raise SystemExit(f"load_checkpoint({args.resume_universal}) found nothing")
    elif args.resume_native:
        from ckptbridge.adapters.deepspeed import load_engine

        loaded = load_engine(engine, args.resume_native, load_optimizer_states=not args.native_weights_only)
        got = [None] * ws
        dist.all_gather_object(got, loaded.bytes_read)
        timing["bytes_read"] = got
    timing["load_done_at"] = time.time()
    timing["load_s"] = timing["load_done_at"] - t_load
    if args.resume_universal or args.resume_native:
        start = engine.global_steps
        if args.dump_loaded:
            dump_state(engine, args.dump_loaded, rank)
    losses = train(engine, args, start, rank, ws, timing)
    reference = None
    if args.compare_universal:
        other = build_engine(args, ws, load_universal=True)
        path, _ = other.load_checkpoint(args.compare_universal, load_optimizer_states=True,
                                        load_lr_scheduler_states=True)
        if path is None:
            raise SystemExit(f"load_checkpoint({args.compare_universal}) found nothing")
        timing["reference_step_aliases"] = unalias_steps(other)
        reference = train(other, args, other.global_steps, rank, ws)
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
                "resumed_native": args.resume_native, "timing": timing, "reference_losses": reference,
                "n_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                for p in engine.module.parameters())}
        with open(os.path.join(args.out, "meta.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()

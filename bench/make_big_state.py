#!/usr/bin/env python
"""Make a big training state in DeepSpeed ZeRO-2, ZeRO-3 and torch DCP layouts, with the real libraries.

The model is a GPT-shaped stack of ``--layers`` blocks of width ``--d-model`` (12 tensors a
block: two LayerNorms, fused QKV, projection, MLP in and out, with biases; plus token and
position embeddings, a final LayerNorm and an untied LM head). The defaults, 32 layers of
1280 with a 50,304-token vocabulary, are ~760 M parameters in 389 tensors: a ~10.6 GB
(~9.9 GiB) DeepSpeed bf16 state (bf16 weights + fp32 master + Adam ``exp_avg`` /
``exp_avg_sq``) and a ~9.1 GB DCP state (fp32 weights + Adam moments).

* ``ds2`` / ``ds3``: ``deepspeed.initialize`` (ZeRO-2 / ZeRO-3 under ``zero.Init``, bf16,
  AdamW, ``--ws`` CPU ranks over gloo), the Adam moments of every partition filled with
  random values (``exp_avg ~ N(0, 1e-3)``, ``exp_avg_sq ~ U(0, 1e-6)``: what a trained state's
  bytes look like to a compressor), then ``engine.save_checkpoint``: DeepSpeed's own files.
  No training step (DeepSpeed saves an initialised engine).
* ``dcp``: an FSDP2 model (``fully_shard`` per block, built on the meta device, each rank
  materialising only its shards) and ``torch.optim.AdamW``; one optimizer step with random
  gradients gives real Adam state; ``dcp.save({"model": ..., "optim": ...})`` of
  ``get_state_dict`` (``Shard(0)`` DTensors on ``--ws`` ranks).

Writes ``OUT/ds2/ckpt``, ``OUT/ds3/ckpt``, ``OUT/dcp`` and ``OUT/info.json`` (parameter and
tensor counts, the largest tensor, bytes on disk per layout, seconds per layout)::

    python bench/make_big_state.py /tmp/big                       # ~30 GB on disk in all
    python bench/make_big_state.py /tmp/tiny --layers 2 --d-model 64 --vocab 128 --ctx 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FORMATS = ("ds2", "ds3", "dcp")


def shapes(layers: int, d: int, vocab: int, ctx: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in module order."""
    out: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"blocks.{i}."
        out.update({p + "ln1.weight": (d,), p + "ln1.bias": (d,), p + "qkv.weight": (3 * d, d),
                    p + "qkv.bias": (3 * d,), p + "proj.weight": (d, d), p + "proj.bias": (d,),
                    p + "ln2.weight": (d,), p + "ln2.bias": (d,), p + "fc.weight": (4 * d, d),
                    p + "fc.bias": (4 * d,), p + "fc_out.weight": (d, 4 * d), p + "fc_out.bias": (d,)})
    out.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head.weight": (vocab, d)})
    return out


def build_model(layers: int, d: int, vocab: int, ctx: int):
    """The module (parameters only matter; ``forward`` is a plain GPT for completeness)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class BigGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))[None]
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    return BigGPT()


def _groups(model) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


# ------------------------------------------------------------------ workers (one per rank, under torchrun)


def _fill_moments(state: dict, gen) -> None:
    import torch

    for key, fill in (("exp_avg", lambda t: t.normal_(0.0, 1e-3, generator=gen)),
                      ("exp_avg_sq", lambda t: t.uniform_(0.0, 1e-6, generator=gen))):
        t = state.get(key)
        if isinstance(t, torch.Tensor):
            fill(t.data)


def ds_config(ws: int, stage: int, load_universal: bool = False) -> dict:
    cfg = {"train_batch_size": ws, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "gradient_clipping": 1.0, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def ds_engine(a: argparse.Namespace, ws: int, stage: int, load_universal: bool = False):
    """A DeepSpeed engine of the model (ZeRO-3 built partitioned under ``zero.Init``)."""
    import deepspeed
    import torch

    cfg = ds_config(ws, stage, load_universal)
    torch.manual_seed(1234)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = build_model(a.layers, a.d_model, a.vocab, a.ctx)
    else:
        model = build_model(a.layers, a.d_model, a.vocab, a.ctx)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_groups(model), config=cfg)
    return engine


def worker_deepspeed(out: str, stage: int, a: argparse.Namespace) -> None:
    import torch
    from deepspeed import comm as dist

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_deepspeed_ckpt import init_gloo

    init_gloo()
    rank, ws = dist.get_rank(), dist.get_world_size()
    engine = ds_engine(a, ws, stage)
    opt = engine.optimizer
    inner = opt.optimizer
    gen = torch.Generator().manual_seed(100 + rank)
    flats = getattr(opt, "fp32_partitioned_groups_flat", None) or [g["params"][0] for g in inner.param_groups]
    for hp in flats:
        st = inner.state[hp]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                st[key] = torch.zeros_like(hp.data)
        if "step" not in st:
            st["step"] = torch.tensor(1.0)
        _fill_moments(st, gen)
    engine.save_checkpoint(out, tag="global_step1")
    dist.barrier()


def worker_resume(out: str, a: argparse.Namespace) -> None:
    """Resume an engine at this world size / ``--stage`` from ``--native`` (ckptbridge's load_engine)
    or ``--universal`` (DeepSpeed's load_universal), take one training step; OUT/meta.json has the
    timings (for bench/bench_ds_resume.py --big)."""
    timing: dict = {"started_at": time.time()}
    import torch
    import torch.nn.functional as F
    from deepspeed import comm as dist

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_deepspeed_ckpt import init_gloo

    init_gloo()
    rank, ws = dist.get_rank(), dist.get_world_size()
    engine = ds_engine(a, ws, a.stage, load_universal=bool(a.universal))
    t0 = time.time()
    if a.universal:
        path, _ = engine.load_checkpoint(a.universal, load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise SystemExit(f"load_checkpoint({a.universal}) found nothing")
    else:
        from ckptbridge.adapters.deepspeed import load_engine

        timing["bytes_read"] = load_engine(engine, a.native).bytes_read
    timing["load_done_at"] = time.time()
    timing["load_s"] = timing["load_done_at"] - t0
    g = torch.Generator().manual_seed(7 + rank)
    tokens = torch.randint(0, a.vocab, (1, min(16, a.ctx) + 1), generator=g)
    logits = engine(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    timing["first_step_done_at"] = time.time()
    v = loss.detach().float().clone()
    dist.all_reduce(v)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "meta.json"), "w") as fh:
            json.dump({"timing": timing, "losses": [v.item() / ws], "global_steps": engine.global_steps}, fh)
    dist.barrier()


def worker_dcp(out: str, a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    with torch.device("meta"):
        model = build_model(a.layers, a.d_model, a.vocab, a.ctx)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.normal_(0.0, 0.02, generator=gen)
            p.grad = p.detach().clone()
            p.grad.to_local().normal_(0.0, 1e-2, generator=gen)
    opt = torch.optim.AdamW(_groups(model), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    opt.step()  # real AdamW state from one step with random gradients
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def _launch(ws: int, args: list[str], log: str, timeout: float) -> float:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_deepspeed_ckpt as tools

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ws}", "--master_addr=127.0.0.1",
           f"--master_port={tools.free_port()}", os.path.abspath(__file__), *args]
    t0 = time.time()
    with open(log, "w") as fh:
        res = subprocess.run(cmd, env=tools.env(), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    if res.returncode:
        with open(log) as fh:
            tail = fh.read()[-3000:]
        raise RuntimeError(f"{' '.join(args[:3])} failed (rc {res.returncode}):\n{tail}")
    return time.time() - t0


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _args(a: argparse.Namespace) -> list[str]:
    return ["--layers", str(a.layers), "--d-model", str(a.d_model), "--vocab", str(a.vocab), "--ctx", str(a.ctx)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d-model", dest="d_model", type=int, default=1280)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--ws", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--worker", choices=(*FORMATS, "resume"), help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--native", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--universal", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "dcp":
        return worker_dcp(a.out, a)
    if a.worker == "resume":
        return worker_resume(a.out, a)
    if a.worker:
        return worker_deepspeed(a.out, 2 if a.worker == "ds2" else 3, a)

    sh = shapes(a.layers, a.d_model, a.vocab, a.ctx)
    numel = sum(math.prod(s) for s in sh.values())
    largest = max(sh, key=lambda n: math.prod(sh[n]))
    info = {"layers": a.layers, "d_model": a.d_model, "vocab": a.vocab, "ctx": a.ctx, "ws": a.ws,
            "params": numel, "tensors": len(sh), "largest_tensor": largest,
            "largest_tensor_fp32_bytes": math.prod(sh[largest]) * 4, "formats": {}}
    os.makedirs(a.out, exist_ok=True)
    info_path = os.path.join(a.out, "info.json")
    if os.path.exists(info_path):
        with open(info_path) as fh:
            info["formats"] = json.load(fh).get("formats", {})
    print(f"# {numel / 1e6:.0f} M parameters in {len(sh)} tensors (largest {largest} {sh[largest]})", flush=True)
    for fmt in [f for f in a.formats.split(",") if f in FORMATS]:
        dst = os.path.join(a.out, fmt, "ckpt") if fmt != "dcp" else os.path.join(a.out, fmt)
        if os.path.exists(dst):
            print(f"# {fmt}: {dst} exists, kept", flush=True)
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        seconds = _launch(a.ws, ["--worker", fmt, dst, *_args(a)], os.path.join(a.out, f"{fmt}.log"), 4 * 3600)
        info["formats"][fmt] = {"path": dst, "bytes": _du(dst), "seconds": seconds}
        print(f"# {fmt}: {info['formats'][fmt]['bytes'] / 2**30:.2f} GiB in {seconds:.0f}s -> {dst}", flush=True)
        with open(info_path, "w") as fh:
            json.dump(info, fh, indent=1)
    with open(info_path, "w") as fh:
        json.dump(info, fh, indent=1)


if __name__ == "__main__":
    main()

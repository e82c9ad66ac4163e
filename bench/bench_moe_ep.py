#!/usr/bin/env python
"""MoE: load a megatron-core EP 8 checkpoint onto EP 4 / EP 2 ranks; ckptbridge vs megatron-core.

    python bench/bench_moe_ep.py [--quick | --size qwen3]

The input is a ``torch_dist`` checkpoint written by megatron-core's own ``dist_checkpointing.save``
from the sharded state dicts of 8 expert-parallel ranks: each EP rank's experts are megatron-core's
``SequentialMLP`` (SwiGLU experts, no bias, bf16), its ``sharded_state_dict`` made with that rank's
expert-parallel group (megatron-core maps local expert ``K`` of EP rank ``r`` to global expert
``r * 16 + K`` itself) and the layer axis prepended as ``TransformerBlock`` does; one process writes
the shards of all 8 ranks (megatron-core allows it: a rank may hold several shards of one key), with
the Megatron-LM args a training run records in ``common.pt`` (ckptbridge reads the layout from them).
``qwen3`` has Qwen3-30B-A3B's expert shapes (128 experts, hidden 2048, expert FFN 768) in 2 layers:
2.4 GB of experts. ``quick`` (CI) is the same at tiny shapes.

One operation per target layout (EP 4, EP 2): every rank of the new layout fills its experts
(``num_experts / EP`` local experts per layer), as the resumed job does: ``EP`` processes in a gloo
world of that size, megatron-core's ``SequentialMLP`` of each rank built before the clock; rank 0
times from a barrier before the loads to a barrier after the last one:

* megatron-core: ``dist_checkpointing.load`` of each rank's sharded state dict at the new EP, then
  a copy into the parameters (what Megatron-LM's resume at a new EP runs);
* ckptbridge: ``open`` + ``adapters.torch.load_into`` the same parameters, each under its global
  expert id (``decoder.layers.L.mlp.experts.local_experts.E...``; local ``K`` of EP rank ``r`` is
  ``r * num_local + K``).

Time, peak memory and bytes read of all ranks together (the harness's columns), and per rank: its
own expert bytes (``rank_expert_mib``: what it must read at least) and the most that one rank read
(``rank_read_mib``: read calls + file pages mapped in). After the clock each rank sums what it
loaded, weighted by the parameter's position (``checksum``: the same for both tools, so a swapped
expert would show).

Two more operations per target layout write the checkpoint at the new EP to disk as Megatron-LM's
legacy per-rank files (``iter_0000001/mp_rank_00_EEE/model_optim_rng.pt``, what a job at the new EP
loads with ``--ckpt-format torch``), all files fsync'd inside the clock:

* ckptbridge: ``ckptbridge reshard --to megatron -o ep=N`` (the CLI's code, in one process, imports
  warm before the clock): every rank's file, each expert read from the EP 8 shards by its global id;
* megatron-core: ``dist_checkpointing.load`` at the new EP in each of the ``N`` rank processes, then
  ``torch.save`` of that rank's legacy file (what Megatron-LM's ``--ckpt-convert-format torch`` does:
  load at the new layout, save the legacy files);
* Megatron-LM's ``tools/checkpoint/convert.py`` (core_v0.16.1, ``--loader core --saver core
  --target-expert-parallel-size N``, local layers: the CPU has no Transformer Engine), run for real on
  Megatron-LM's own legacy MoE checkpoint ``tests/fixtures/megatron_moe/M/tp1ep2`` (the converter
  needs a whole GPT run, which this suite's expert-only input is not). It fails: after loading only EP
  rank 0's file (its loader loops over TP ranks, the EP rank stays 0), ``schema_core.get_model_schema``
  asserts ``transformer_impl == "transformer_engine"`` (MoE has only a Transformer Engine schema);
  with ``--loader-transformer-impl transformer_engine`` it cannot build the model without Transformer
  Engine (``NameError: name 'TENorm' is not defined`` in ``get_gpt_decoder_layer_specs``), and the
  ``legacy`` loader/saver build ``megatron.legacy`` models (``AttributeError: 'Namespace' object has no
  attribute 'apply_layernorm_1p'``) and take no ``--target-expert-parallel-size``. The row records the
  error of each run.

After the clock the written files are read back (``checksum``: the load rows' sum over each rank's
local experts by their local names, equal only if every file holds its own EP rank's experts) and
their size summed (``written_mib``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Case, Column, Size, Skip, Suite, main, warm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC_EP = 8
CONVERT_SRC = os.path.join(ROOT, "tests", "fixtures", "megatron_moe", "M", "tp1ep2", "torch")
TARGETS = (4, 2)


class _Group:
    """A stand-in expert-parallel group: ``SequentialMLP.sharded_state_dict`` asks it only its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _init(rank: int = 0, world: int = 1, port: int | None = None) -> Any:
    """A gloo world with megatron-core's parallel state (TP = PP = 1), on the CPU shim; this rank's own
    one-rank group (its expert-tensor-parallel and expert-data-parallel group: ETP = EDP = 1)."""
    import datetime

    sys.path.insert(0, os.path.join(ROOT, "tools", "megatron"))
    import cpu_shim  # noqa: F401  (patches torch.cuda before megatron is imported)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or 20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=3600))
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return [dist.new_group([r]) for r in range(world)][rank]


def _experts(m: dict[str, int], ep: int, ep_rank: int, own: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """EP rank ``ep_rank`` of ``ep``: its parameters by state-dict name and megatron-core's sharded state
    dict of them (every layer), as ``TransformerBlock`` / ``MoELayer`` / ``SequentialMLP`` make it."""
    import torch
    import torch.nn.functional as F
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=16,
                            ffn_hidden_size=4 * m["hidden"], moe_ffn_hidden_size=m["ffn"],
                            num_moe_experts=m["experts"], gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, params_dtype=torch.bfloat16, bf16=True,
                            use_cpu_initialization=True, perform_initialization=False)
    pg = ProcessGroupCollection(ep=_Group(ep_rank, ep), expt_tp=own, expt_dp=own)
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    params: dict[str, Any] = {}
    sharded: dict[str, Any] = {}
    for layer in range(m["layers"]):
        mlp = SequentialMLP(m["experts"] // ep, cfg, sub, pg_collection=pg)
        prefix = f"decoder.layers.{layer}.mlp.experts."
        params.update({prefix + n: p for n, p in mlp.named_parameters()})
        sd = mlp.sharded_state_dict(prefix, ((0, layer, m["layers"]),), {"dp_cp_group": own})
        replace_prefix_for_sharding(sd, f"decoder.layers.{layer}.", "decoder.layers.")
        sharded.update(sd)
    return params, sharded


def _args(m: dict[str, int], ep: int = SRC_EP) -> Any:
    """The Megatron-LM arguments a training run at EP ``ep`` records (those that lay out the experts)."""
    import argparse

    return argparse.Namespace(
        num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=16, ffn_hidden_size=4 * m["hidden"],
        swiglu=True, disable_bias_linear=True, bf16=True, params_dtype="torch.bfloat16", transformer_impl="local",
        padded_vocab_size=128, tokenizer_type="NullTokenizer", vocab_size=127, untie_embeddings_and_output_weights=True, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, num_experts=m["experts"], moe_ffn_hidden_size=m["ffn"],
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1, data_parallel_size=ep,
        world_size=ep, ckpt_format="torch_dist" if ep == SRC_EP else "torch")


def prepare(ctx) -> None:
    """megatron-core writes the EP 8 checkpoint: the shards of all 8 EP ranks from one process."""
    import torch
    from megatron.core import dist_checkpointing

    own = _init()
    m = ctx.param("model")
    torch.manual_seed(1234)
    sharded: dict[str, Any] = {}
    for r in range(SRC_EP):
        params, sd = _experts(m, SRC_EP, r, own)
        for p in params.values():
            p.data.copy_(torch.randn(p.shape).mul_(0.02))
        sharded.update({f"ep{r}/{k}": v for k, v in sd.items()})
    sharded.update(checkpoint_version=3.0, iteration=1, args=_args(m))
    os.makedirs(ctx.input("ep8"))
    dist_checkpointing.save(sharded, ctx.input("ep8"))
    os.sync()


def _read_so_far() -> int:
    """Bytes this process has read: read calls (``rchar``) + file pages mapped in (``RssFile``)."""
    with open("/proc/self/io") as fh:
        rchar = next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))
    with open("/proc/self/status") as fh:
        mapped = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("RssFile:"))
    return rchar + mapped


def _global(name: str, ep_rank: int, num_local: int) -> str:
    """``...local_experts.K...`` of EP rank ``ep_rank`` -> ``...local_experts.<ep_rank * num_local + K>...``."""
    return re.sub(r"(\.local_experts\.)(\d+)\.", lambda x: f"{x[1]}{ep_rank * num_local + int(x[2])}.", name)


def _rank(rank: int, tool: str, ep: int, port: int, inputs: str, model: dict[str, int], out: str,
          out_dir: str = "") -> None:
    """One rank of the new EP layout: fill its experts from the EP 8 checkpoint with ``tool``
    (``megatron-core-write``: load them and save this rank's legacy file under ``out_dir``)."""
    import json

    import torch.distributed as dist
    from _harness import region
    from _harness.child import fsync_tree

    own = _init(rank, ep, port)
    params, sharded = _experts(model, ep, rank, own)
    for p in params.values():  # resident before the clock
        p.data.zero_()
    if tool == "ckptbridge":
        import ckptbridge
        from ckptbridge.adapters import torch as cbt

        warm.ckptbridge(torch=True)
    else:
        import torch
        from megatron.core import dist_checkpointing
    dist.barrier()
    before = _read_so_far()
    with region() if rank == 0 else contextlib.nullcontext():
        if tool == "ckptbridge":
            with ckptbridge.open(inputs) as ck:  # each expert under its global id: local K of rank r is r * E_l + K
                cbt.load_into({_global(n, rank, model["experts"] // ep): p.data for n, p in params.items()}, ck)
        elif tool == "megatron-core":
            loaded = dist_checkpointing.load(sharded, inputs)
            for name, p in params.items():
                p.data.copy_(loaded[name])
        else:  # "megatron-core-write": Megatron-LM's legacy save of this rank's file (--ckpt-convert-format torch)
            loaded = dist_checkpointing.load(sharded, inputs)
            f = _rank_file(out_dir, rank)
            os.makedirs(os.path.dirname(f))
            torch.save({"args": _args(model, ep), "checkpoint_version": 3.0, "iteration": 1,
                        "model": {n: loaded[n] for n in params}}, f)
            fsync_tree(os.path.dirname(f))
            if rank == 0:
                with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as fh:
                    fh.write("1")
        dist.barrier()
    mine = {"read": _read_so_far() - before, "bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "sum": sum((i + 1) * float(p.detach().double().sum()) for i, p in enumerate(params.values()))}
    every: list[Any] = [None] * ep
    dist.all_gather_object(every, mine)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(every, fh)
    dist.destroy_process_group()


def _load(ctx, tool: str, ep: int) -> None:
    """``ep`` processes, the ranks of the new layout, each filling its own experts; rank 0 times them."""
    import json

    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_deepspeed_ckpt import free_port

    out, out_dir = ctx.out("ranks.json"), ctx.out(f"ep{ep}")
    mp.start_processes(_rank, (tool, ep, free_port(), ctx.input("ep8"), ctx.param("model"), out, out_dir),
                       nprocs=ep, start_method="spawn")
    with open(out) as fh:
        every = json.load(fh)
    ctx.metrics.update(_region_elsewhere=True, checksum=sum(r["sum"] for r in every),
                       rank_expert_mib=max(r["bytes"] for r in every) / 2**20,
                       rank_read_mib=max(r["read"] for r in every) / 2**20)
    if tool == "megatron-core-write":
        ctx.metrics.update(checksum=_written_sum(out_dir, ctx.param("model"), ep), written_mib=_written_mib(out_dir))


def _rank_file(out_dir: str, ep_rank: int) -> str:
    """Megatron-LM's legacy file of EP rank ``ep_rank`` (TP 1, PP 1) at iteration 1."""
    return os.path.join(out_dir, "iter_0000001", f"mp_rank_00_{ep_rank:03d}", "model_optim_rng.pt")


def _written_mib(out_dir: str) -> float:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out_dir) for f in fs) / 2**20


def _written_sum(out_dir: str, m: dict[str, int], ep: int) -> float:
    """The load rows' ``checksum`` over the legacy files written at EP ``ep`` (each rank's local experts
    in ``SequentialMLP``'s parameter order, by their local names): equal to the load rows' sums only
    if every file holds its own EP rank's experts."""
    import torch

    total = 0.0
    for r in range(ep):
        model = torch.load(_rank_file(out_dir, r), map_location="cpu", weights_only=False, mmap=True)["model"]
        names = [f"decoder.layers.{layer}.mlp.experts.local_experts.{k}.linear_fc{j}.weight"
                 for layer in range(m["layers"]) for k in range(m["experts"] // ep) for j in (1, 2)]
        total += sum((i + 1) * float(model[n].double().sum()) for i, n in enumerate(names))  # files the case wrote
    return total


def _cb_write(ctx, ep: int) -> None:
    """``ckptbridge reshard --to megatron -o ep=N``: the legacy files of every rank of the new layout, from
    one process (the CLI's own code path, in-process so that imports are warm before the clock)."""
    from _harness.child import fsync_tree

    from ckptbridge._cli import main as cli

    warm.ckptbridge(torch=True)
    out = ctx.out(f"ep{ep}")
    before = _read_so_far()
    with ctx.region():
        if cli(["reshard", ctx.input("ep8"), out, "--to", "megatron", "-o", f"ep={ep}"]) != 0:
            raise RuntimeError(f"ckptbridge reshard --to megatron -o ep={ep} failed")
        fsync_tree(out)
    m = ctx.param("model")
    ctx.metrics.update(checksum=_written_sum(out, m, ep), written_mib=_written_mib(out),
                       rank_expert_mib=_written_mib(out) / ep, rank_read_mib=(_read_so_far() - before) / 2**20)


def _convert(ctx, ep: int) -> None:
    """Megatron-LM's ``tools/checkpoint/convert.py`` (``--loader core --saver core``, the local layers: the
    CPU has no Transformer Engine) to ``--target-expert-parallel-size N``, run for real on Megatron-LM's own
    legacy MoE checkpoint (tests/fixtures/megatron_moe/M/tp1ep2: a whole GPT run, which the converter
    needs and this suite's expert-only input is not); its error, if any, is the case's."""
    import subprocess

    mlm = os.environ.get("MEGATRON_LM_DIR") or os.path.join(ROOT, "third_party", "mlm")
    conv = os.path.join(mlm, "tools", "checkpoint", "convert.py")
    if not os.path.isfile(conv):
        raise Skip(f"needs Megatron-LM's source (tag core_v0.16.1) in {mlm}; see bench/README.md")
    out = ctx.out(f"ep{ep}")
    argv = [sys.executable, os.path.join(HERE, "_megatron_launch.py"), conv, "--model-type", "GPT", "--loader", "core",
            "--saver", "core", "--load-dir", CONVERT_SRC, "--save-dir", out, "--target-tensor-parallel-size", "1",
            "--target-expert-parallel-size", str(ep), "--megatron-path", mlm, "--loader-transformer-impl", "local",
            "--saver-transformer-impl", "local"]
    env = {**os.environ, "MEGATRON_CPU_SHIM": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "MEGATRON_LM_DIR": mlm,
           "MEGATRON_EXTRA_ARGS": "--no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion "
                                  "--no-bias-swiglu-fusion"}
    with ctx.region():
        r = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    files = [f for _, _, fs in os.walk(out) for f in fs if f == "model_optim_rng.pt"]
    if r.returncode or len(files) != ep:  # (the converter can exit 0 when its saver process failed)
        raise RuntimeError(f"fails (exit {r.returncode}, {len(files)} rank files): {_last_error(r.stdout + r.stderr)}")
    ctx.metrics["written_mib"] = _written_mib(out)


def _last_error(log: str) -> str:
    """The converter's exceptions (its loader's and its saver's process each raise), one line each
    ``Error: message at file:line function: `failing line```, distinct ones joined in order."""
    lines = [ln.removeprefix("[rank0]: ").strip() for ln in log.splitlines()]
    found: list[str] = []
    for i, ln in enumerate(lines):
        if not re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln):
            continue
        where = next((lines[j] for j in range(i, -1, -1) if lines[j].startswith("File ")), "")
        code = next((lines[j] for j in range(i - 1, -1, -1) if lines[j] and not lines[j].startswith("^")), "")
        m = re.match(r'File "(.*)", line (\d+), in (\S+)', where)
        place = f"{os.path.basename(m[1])}:{m[2]} {m[3]}" if m else where
        found.append(f"{ln[:160]} at {place}: `{code[:120]}`")
    return " / ".join(dict.fromkeys(found)) or (lines[-1] if lines else "no output")


def core_ep4(ctx) -> None:
    _load(ctx, "megatron-core", 4)


def core_ep2(ctx) -> None:
    _load(ctx, "megatron-core", 2)


def cb_ep4(ctx) -> None:
    _load(ctx, "ckptbridge", 4)


def cb_ep2(ctx) -> None:
    _load(ctx, "ckptbridge", 2)


def core_write_ep4(ctx) -> None:
    _load(ctx, "megatron-core-write", 4)


def core_write_ep2(ctx) -> None:
    _load(ctx, "megatron-core-write", 2)


def cb_write_ep4(ctx) -> None:
    _cb_write(ctx, 4)


def cb_write_ep2(ctx) -> None:
    _cb_write(ctx, 2)


def convert_ep4(ctx) -> None:
    _convert(ctx, 4)


def convert_ep2(ctx) -> None:
    _convert(ctx, 2)


def _group(ep: int) -> str:
    return f"EP {SRC_EP} -> EP {ep}: every rank of the new layout fills its experts ({ep} processes)"


def _write_group(ep: int) -> str:
    return f"EP {SRC_EP} -> EP {ep} written as Megatron-LM's legacy per-rank files (a checkpoint on disk at EP {ep})"


QWEN3_30B_A3B = {"experts": 128, "hidden": 2048, "ffn": 768, "layers": 2}
SUITE = Suite(
    name="moe_ep", module="bench_moe_ep",
    title="MoE: a megatron-core EP 8 checkpoint onto EP 4 / EP 2 ranks (ckptbridge vs dist_checkpointing.load)",
    description=__doc__.split("\n\n", 2)[2].strip(),
    prepare="prepare",
    prepare_mem_gib=lambda g: 2.5 * g + 1,  # every EP rank's experts, then the save's copies
    disk_gib=lambda g: 1.2 * g,
    sizes={
        "quick": Size("quick", 0.001, reps=1, params={"model": {"experts": 16, "hidden": 64, "ffn": 32,
                                                                   "layers": 2}}),
        # 2 layers x 128 experts x 3 x 2048 x 768 bf16 = 2.25 GiB
        "qwen3": Size("qwen3", 2.25, reps=3, params={"model": QWEN3_30B_A3B}),
    },
    cases=tuple(
        c for ep in TARGETS for c in (
            Case(f"ep{ep}/dist_checkpointing", _group(ep), "megatron-core",
                 "dist_checkpointing.load of the new sharded state dict + copy", fn=f"core_ep{ep}",
                 mem_gib=lambda g, ep=ep: 2.2 * g + 0.5 * ep),
            Case(f"ep{ep}/ckptbridge", _group(ep), "ckptbridge", "open + adapters.torch.load_into", "ours",
                 fn=f"cb_ep{ep}", ref=True, mem_gib=lambda g, ep=ep: 1.2 * g + 0.5 * ep),
            Case(f"ep{ep}/write-megatron-core", _write_group(ep), "megatron-core",
                 f"dist_checkpointing.load at EP {ep} + torch.save of each rank's file ({ep} processes)",
                 fn=f"core_write_ep{ep}", mem_gib=lambda g, ep=ep: 2.5 * g + 0.5 * ep),
            Case(f"ep{ep}/write-convert.py", _write_group(ep), "Megatron-LM convert.py",
                 f"--loader core --saver core --target-expert-parallel-size {ep} (on Megatron-LM's own MoE "
                 "checkpoint tests/fixtures/megatron_moe/M/tp1ep2)", fn=f"convert_ep{ep}", mem_gib=2.0),
            Case(f"ep{ep}/write-ckptbridge", _write_group(ep), "ckptbridge",
                 f"reshard --to megatron -o ep={ep} (one process)", "ours", fn=f"cb_write_ep{ep}", ref=True,
                 mem_gib=lambda g: 0.6 * g + 0.5),
        )
    ),
    columns=(Column("checksum", "sum of the values loaded", "{:.6g}"),
             Column("rank_expert_mib", "one rank's expert MiB", "{:.0f}"),
             Column("rank_read_mib", "most read by one rank MiB", "{:.0f}"),
             Column("written_mib", "rank files written MiB", "{:.0f}")),
    timeout_s=3600.0,
)


if __name__ == "__main__":
    sys.exit(main([SUITE]))

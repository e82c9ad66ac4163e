#!/usr/bin/env python
"""Core: write, convert and read a standard-normal fp32 state dict; ckptbridge vs torch, safetensors, DCP.

    python bench/bench_core.py [--quick | --size 1g | --size 8g] [--only 'read all/*'] [--reps N]

The inputs (16 tensors of ``rows x 4096`` fp32, ``gib`` in all) are written once per size by
each real library: ``torch.save`` (``src.pt``), ``safetensors`` (``src.safetensors``), torch DCP
(``src.dcp``, one process) and ckptbridge (``src.universal``, ``ckptbridge.convert`` of ``src.pt``).
Every case runs in a fresh process; the harness times the region (``ctx.region()``) with the
same clock for every tool, and measures peak RSS of the process tree and bytes read
(``rchar`` + memory-mapped pages) the same way for all. Writes include ``fsync``; reads touch
every page of what they return before the clock stops (lazy loaders map files). The convert
group runs command lines (start-up included; each tool's start-up probe is reported and
subtracted as "net").
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Case, Size, Suite, main, warm

N_TENSORS = 16
COLS = 4096


def _rows(gib: float) -> int:
    return max(8, int(gib * (1 << 30) / 4 / N_TENSORS / COLS))


def _arrays(gib: float):
    """The state, one tensor at a time (standard normal, seeded; never zeros)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(N_TENSORS):
        yield f"layers.{i}.weight", rng.standard_normal((_rows(gib), COLS), dtype=np.float32)


def _state(gib: float) -> dict:
    import torch

    return {k: torch.from_numpy(v) for k, v in _arrays(gib)}


def _fsync_tree(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _touch(arrays) -> float:
    """Read one value per 4 KiB page of every array (pages of lazy maps get faulted in)."""
    import numpy as np

    total = 0.0
    for a in arrays:
        flat = np.asarray(a).reshape(-1)
        total += float(flat[:: 1024].sum(dtype=np.float64))
    return total


def _np(t):
    return t.numpy() if hasattr(t, "numpy") else t


def prepare(ctx) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import ckptbridge

    sd = _state(ctx.gib)
    torch.save(sd, ctx.input("src.pt"))
    del sd
    mapped = torch.load(ctx.input("src.pt"), weights_only=True, mmap=True)
    save_file(mapped, ctx.input("src.safetensors"))
    dcp.save(mapped, checkpoint_id=ctx.input("src.dcp"), no_dist=True)
    del mapped
    ckptbridge.convert(ctx.input("src.pt"), ctx.input("src.universal"))
    os.sync()


# ------------------------------------------------------------------------------------ write

def _write_setup(ctx):
    sd = _state(ctx.gib)
    for v in sd.values():  # resident before the clock
        v.add_(0)
    return sd


def write_ckptbridge(ctx) -> None:
    import ckptbridge

    warm.ckptbridge(torch=True)
    sd = _write_setup(ctx)
    with ctx.region():
        ck = ckptbridge.Checkpointer(ctx.out("ck"), keep_last=1)
        ck.save(0, sd)
        ck.wait()
        ck.close()


def write_torch(ctx, crc: bool = True) -> None:
    import torch

    sd = _write_setup(ctx)
    if not crc:
        import torch.utils.serialization.config as cfg

        cfg.save.compute_crc32 = False
    with ctx.region():
        torch.save(sd, ctx.out("w.pt"))
        _fsync_tree(ctx.out("w.pt"))


def write_torch_nocrc(ctx) -> None:
    write_torch(ctx, crc=False)


def write_safetensors(ctx) -> None:
    from safetensors.torch import save_file

    sd = _write_setup(ctx)
    with ctx.region():
        save_file(sd, ctx.out("w.safetensors"))
        _fsync_tree(ctx.out("w.safetensors"))


def write_dcp(ctx, threads: int = 1) -> None:
    import torch.distributed.checkpoint as dcp

    sd = _write_setup(ctx)
    with ctx.region():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(ctx.out("w.dcp"), thread_count=threads), no_dist=True)
        _fsync_tree(ctx.out("w.dcp"))  # sync_files=True already fsyncs the data files; metadata too


def write_dcp_threads(ctx) -> None:
    write_dcp(ctx, threads=2)


# ------------------------------------------------------------------------------------ convert (command lines)

CLI = "import sys; from ckptbridge._cli import main; sys.exit(main(sys.argv[1:]))"  # = the `ckptbridge` script


def convert_ckptbridge(ctx) -> list[str]:
    return [sys.executable, "-c", CLI, "convert", ctx.input("src.pt"), ctx.out("u")]


def convert_dcp(ctx) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "torch_to_dcp", ctx.input("src.pt"),
            ctx.out("d")]


SAFETENSORS_CONVERT = (
    "import os, sys, torch; from safetensors.torch import save_file; "
    "sd = torch.load(sys.argv[1], weights_only=True); save_file(sd, sys.argv[2]); "
    "fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd)")


def convert_safetensors(ctx) -> list[str]:
    return [sys.executable, "-c", SAFETENSORS_CONVERT, ctx.input("src.pt"), ctx.out("s.safetensors")]


def startup_ckptbridge(ctx) -> list[str]:
    return [sys.executable, "-c", CLI, "--help"]


def startup_torch(ctx) -> list[str]:
    return [sys.executable, "-c", "import torch, torch.distributed.checkpoint"]


# ------------------------------------------------------------------------------------ read everything

def read_ckptbridge(ctx, src: str = "src.universal") -> None:
    import ckptbridge

    warm.ckptbridge()
    with ctx.region():
        c = ckptbridge.open(ctx.input(src))
        out = [c[k].read() for k in c]
        ctx.metrics["checksum"] = _touch(out)


def read_ckptbridge_pt(ctx) -> None:
    read_ckptbridge(ctx, "src.pt")


def read_torch(ctx, mmap: bool = False) -> None:
    import torch

    with ctx.region():
        sd = torch.load(ctx.input("src.pt"), weights_only=True, mmap=mmap)
        ctx.metrics["checksum"] = _touch(v.numpy() for v in sd.values())


def read_torch_mmap(ctx) -> None:
    read_torch(ctx, mmap=True)


def read_safetensors(ctx) -> None:
    from safetensors.numpy import load_file

    with ctx.region():
        sd = load_file(ctx.input("src.safetensors"))
        ctx.metrics["checksum"] = _touch(sd.values())


def read_dcp(ctx) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    with ctx.region():
        md = dcp.FileSystemReader(ctx.input("src.dcp")).read_metadata()
        sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
        dcp.load(sd, checkpoint_id=ctx.input("src.dcp"), no_dist=True)
        ctx.metrics["checksum"] = _touch(v.numpy() for v in sd.values())


# ------------------------------------------------------------------------------------ read 1/8 of the columns

def slice_ckptbridge(ctx, src: str = "src.universal") -> None:
    import ckptbridge

    warm.ckptbridge()
    with ctx.region():
        c = ckptbridge.open(ctx.input(src))
        out = [c[k][:, : COLS // 8] for k in c]
        ctx.metrics["checksum"] = _touch(out)


def slice_ckptbridge_pt(ctx) -> None:
    slice_ckptbridge(ctx, "src.pt")


def slice_torch_mmap(ctx) -> None:
    import torch

    with ctx.region():
        sd = torch.load(ctx.input("src.pt"), weights_only=True, mmap=True)
        out = [v[:, : COLS // 8].clone().numpy() for v in sd.values()]
        ctx.metrics["checksum"] = _touch(out)


def slice_safetensors(ctx) -> None:
    from safetensors import safe_open

    with ctx.region():
        with safe_open(ctx.input("src.safetensors"), "np") as f:
            out = [f.get_slice(k)[:, : COLS // 8] for k in f.keys()]  # noqa: SIM118
        ctx.metrics["checksum"] = _touch(out)


W, C, R, S = "write (fsync'd)", "convert a torch.save file (command line)", "read everything", \
    "read 1/8 of the columns of every tensor"

SUITE = Suite(
    name="core", module="bench_core",
    title="Core: write, convert and read a fp32 state dict (16 tensors)",
    description=__doc__.split("\n\n", 2)[2].strip(),
    prepare="prepare",
    disk_gib=lambda g: 5.5 * g,  # inputs in four formats + one run's output
    sizes={"quick": Size("quick", 1 / 32, reps=1), "1g": Size("1g", 1.0, reps=3), "8g": Size("8g", 8.0, reps=2)},
    cases=(
        Case("write/ckptbridge", W, "ckptbridge", "Checkpointer.save + wait", "ours", fn="write_ckptbridge",
             mem_gib=lambda g: 2 * g + 0.5),
        Case("write/torch.save", W, "torch.save", "default (CRC32 on)", fn="write_torch", mem_gib=lambda g: g + 0.5),
        Case("write/torch.save-nocrc", W, "torch.save", "fastest: compute_crc32=False", fn="write_torch_nocrc",
             mem_gib=lambda g: g + 0.5),
        Case("write/safetensors", W, "safetensors", "default (save_file)", fn="write_safetensors",
             mem_gib=lambda g: 2 * g + 0.5),
        Case("write/dcp", W, "torch DCP", "default (dcp.save, 1 thread)", fn="write_dcp", mem_gib=lambda g: g + 0.5),
        Case("write/dcp-2threads", W, "torch DCP", "thread_count=2", fn="write_dcp_threads",
             mem_gib=lambda g: g + 0.5),
        Case("convert/ckptbridge", C, "ckptbridge", "ckptbridge convert SRC.pt DST", "ours", cmd="convert_ckptbridge",
             reads=("src.pt",),
             startup="ckptbridge", mem_gib=0.5),
        Case("convert/dcp", C, "torch DCP", "default (format_utils torch_to_dcp)", cmd="convert_dcp", reads=("src.pt",),
             startup="torch", mem_gib=lambda g: g + 0.5),
        Case("convert/safetensors", C, "safetensors", "default (torch.load + save_file)", cmd="convert_safetensors",
             reads=("src.pt",),
             startup="torch", mem_gib=lambda g: 2 * g + 0.5),
        Case("read all/ckptbridge", R, "ckptbridge", "default, universal dir (checksums verified)", "ours",
             fn="read_ckptbridge", reads=("src.universal",), ref=True, mem_gib=lambda g: g + 0.5),
        Case("read all/ckptbridge-pt", R, "ckptbridge", "default, the .pt in place", "ours",
             fn="read_ckptbridge_pt", reads=("src.pt",), mem_gib=lambda g: g + 0.5),
        Case("read all/torch.load", R, "torch.load", "default", fn="read_torch",
             reads=("src.pt",), mem_gib=lambda g: g + 0.5),
        Case("read all/torch.load-mmap", R, "torch.load", "mmap=True (pages touched)", fn="read_torch_mmap",
             reads=("src.pt",),
             mem_gib=lambda g: g + 0.5),
        Case("read all/safetensors", R, "safetensors", "default (load_file maps; pages touched)",
             fn="read_safetensors", reads=("src.safetensors",), mem_gib=lambda g: g + 0.5),
        Case("read all/dcp", R, "torch DCP", "default (dcp.load into new tensors)", fn="read_dcp", reads=("src.dcp",),
             mem_gib=lambda g: g + 0.5),
        Case("slice/ckptbridge", S, "ckptbridge", "default, universal dir", "ours", fn="slice_ckptbridge",
             reads=("src.universal",), ref=True,
             mem_gib=0.5),
        Case("slice/ckptbridge-pt", S, "ckptbridge", "default, the .pt in place", "ours", fn="slice_ckptbridge_pt",
             reads=("src.pt",),
             mem_gib=0.5),
        Case("slice/torch.load-mmap", S, "torch.load", "mmap=True, slice + clone", fn="slice_torch_mmap",
             reads=("src.pt",),
             mem_gib=lambda g: g / 2 + 0.5),
        Case("slice/safetensors", S, "safetensors", "default (safe_open get_slice)", fn="slice_safetensors",
             reads=("src.safetensors",),
             mem_gib=0.5),
    ),
    startups={
        "ckptbridge": Case("startup/ckptbridge", "start-up", "ckptbridge", "ckptbridge --help", cmd="startup_ckptbridge"),
        "torch": Case("startup/torch", "start-up", "torch", "python -c 'import torch'", cmd="startup_torch"),
    },
)


if __name__ == "__main__":
    sys.exit(main([SUITE]))

"""Every GPU path of ckptbridge in one run: one table (check, pass/fail, figure) and a JSON record.

On a machine with one CUDA GPU (torch and jax with CUDA), in under five minutes::

    python tools/gpu_check.py --out bench/results/gpu_check.json     # and gpu_check.md beside it

The same checks with the device replaced by the CPU (what CI runs, tests/test_gpu_check.py,
so that the script cannot rot)::

    python tools/gpu_check.py --device cpu --mib 4 --reps 2 --out /tmp/gpu_check.json

Checks (each row passes only if every byte read back equals its reference):

* ``torch pinned staging``: a Checkpointer saving CUDA tensors has page-locked every host
  image (``cudaHostRegister``; ``Tensor.is_pinned()`` asks CUDA itself) after its saves; on
  the CPU none may be locked. (Unlocking is tested with the CUDA calls recorded:
  tests/test_checkpointer.py.)
* ``torch stall vs D2H`` / ``jax stall vs D2H``: median stall of ``Checkpointer.save`` (what
  training waits) and median time until the snapshot is in host memory, each divided by the
  median of one device-to-host copy of the same state: for torch a copy into page-locked
  buffers (the floor; ``Tensor.cpu()`` into fresh memory is in the detail), for JAX
  ``jax.device_get`` of a fresh device copy (an array caches its host value), and JAX's
  ``pinned_host`` memory kind where the device has it (detail).
* ``torch restore_into``: the saved step restored in place into device tensors.
* ``DeepSpeed -> DeviceMesh``: a real DeepSpeed ZeRO-2 bf16 run (tests/fixtures/deepspeed)
  loaded by ckptbridge's own reader as DTensors on a ``DeviceMesh`` of this device, fp32 master
  equal to DeepSpeed's ``zero_to_fp32``, Adam ``exp_avg`` to ``ds_to_universal``'s.
* ``DeepSpeed -> tensors``: the same run read into plain device tensors (``load_into``).
* ``DCP -> DeviceMesh``: a checkpoint written by torch's own ``dcp.save`` read back as DTensors
  and into device tensors.
* ``DeepSpeed -> jax Mesh``: the DeepSpeed run loaded onto a ``jax`` ``Mesh`` of this device.

The JSON holds the rows and the machine: GPU, driver, torch / CUDA / jax versions, commit.
Exit status 0 iff every row passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DS_ARCHIVE = ROOT / "tests" / "fixtures" / "deepspeed" / "runs.tar.xz"
DS_RUN = "s2_bf16_w2"  # ZeRO-2, bf16 module, fp32 master, 2 ranks


@dataclass(frozen=True)
class Row:
    """One line of the table: ``ok`` is the pass/fail, ``figure`` the measured value."""

    check: str
    ok: bool
    figure: str
    detail: str = ""
    values: dict[str, float] = field(default_factory=dict)  # the measured numbers (seconds), for the JSON


@dataclass(frozen=True)
class Config:
    device: str  # "cuda" or "cpu"
    mib: int  # size of the state saved by the stall checks
    reps: int  # timed repetitions (medians)
    work: str  # scratch folder
    ds_run: str  # an unpacked DeepSpeed fixture run


# ---------------------------------------------------------------- helpers


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bytes_of(x: Any) -> bytes:
    """The raw bytes of a torch tensor (any device) or numpy/jax array."""
    import numpy as np

    if hasattr(x, "untyped_storage"):  # torch
        import torch

        return x.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Names whose bytes differ (or that are missing on either side)."""
    names = sorted(set(got) | set(want))
    return [n for n in names if n not in got or n not in want or _bytes_of(got[n]) != _bytes_of(want[n])]


def _ratios(device: str, stall: float, snap: float, d2h: float, label: str) -> str:
    """The figure of a stall row; on the CPU there is no device-to-host copy to compare with."""
    if device == "cpu":
        return "n/a on cpu (no device-to-host copy)"
    return f"stall/{label} {stall / d2h:.2f}x, snapshot/{label} {snap / d2h:.2f}x"


def _row(check: str, bad: list[str], figure: str, detail: str = "", values: dict[str, float] | None = None) -> Row:
    extra = f"differ: {bad[:3]}" if bad else ""
    return Row(check, not bad, figure, "; ".join(s for s in (detail, extra) if s), values or {})


def _torch_state(cfg: Config) -> dict[str, Any]:
    """~cfg.mib MiB of fp32 tensors and one bf16 tensor on the device."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    rows = max(1, cfg.mib * 2**20 // (8 * 1024 * 4))
    state = {f"w{i}": torch.randn(rows, 1024, generator=g) for i in range(7)}
    state["w7"] = torch.randn(rows, 1024, generator=g).to(torch.bfloat16)
    return {k: v.to(cfg.device) for k, v in state.items()}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _read_step(path: str) -> dict[str, Any]:
    import ckptbridge

    ckpt = ckptbridge.open(path)
    return {name.removeprefix("model."): ckpt[name].read() for name in ckpt.tensors}


# ---------------------------------------------------------------- Checkpointer (torch)


def _pinned_images(ck: Any) -> tuple[int, int]:
    """(page-locked images, all images) of the checkpointer's host buffer sets, as CUDA reports
    them (``is_pinned`` asks ``cudaPointerGetAttributes``; False without CUDA)."""
    import numpy as np
    import torch

    images = [img for b in ck._buffers for img in b.images.values()]  # the staging buffers
    locked = 0
    for img in images:
        view = np.frombuffer(img, np.uint8)
        locked += bool(torch.from_numpy(view).is_pinned())
        del view  # no export of the mmap may outlive this (close() unmaps it)
    return locked, len(images)


def _time_saves(ck: Any, state: Any, reps: int) -> tuple[list[float], list[float]]:
    """Steps 1..reps saved by ``ck``: each save's stall (the call's return) and its snapshot time
    (until the state is copied out), every save waited for before the next."""
    stalls, snaps = [], []
    for step in range(1, reps + 1):
        t0 = time.perf_counter()
        ck.save(step, {"model": state})
        stalls.append(time.perf_counter() - t0)
        ck.wait_snapshots()
        snaps.append(time.perf_counter() - t0)
        ck.wait()
    return stalls, snaps


def check_torch_checkpointer(cfg: Config) -> list[Row]:
    """Pinned staging, stall vs one D2H copy, and restore_into device tensors."""
    import torch

    import ckptbridge

    state = _torch_state(cfg)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ck = ckptbridge.Checkpointer(os.path.join(cfg.work, "torch_ck"), keep_last=2)
    try:
        ck.reserve({"model": state})  # both host buffer sets laid out (and pinned) before timing
        ck.save(0, {"model": state})
        ck.wait()
        locked, n_images = _pinned_images(ck)
        stalls, snaps = _time_saves(ck, state, cfg.reps)
        last = cfg.reps
        saved = _read_step(ck.path_of(last))
        d2h = _median_time(lambda: [t.to("cpu", copy=True) for t in state.values()], cfg.reps)
        pinned = {k: torch.empty_like(v, device="cpu", pin_memory=cfg.device == "cuda") for k, v in state.items()}
        d2h_pinned = _median_time(lambda: [pinned[k].copy_(v) for k, v in state.items()], cfg.reps)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ck.restore_into({"model": target})
        _sync(cfg.device)
    finally:
        ck.close()
    want_locked = n_images if cfg.device == "cuda" else 0
    pin_ok = n_images > 0 and locked == want_locked
    stall, snap = statistics.median(stalls), statistics.median(snaps)
    return [
        Row("torch pinned staging", pin_ok, f"{locked}/{n_images} images locked",
            f"{nbytes / 2**20:.0f} MiB state; expected {want_locked} locked on {cfg.device}"),
        _row("torch stall vs D2H", _mismatches(saved, state),
             _ratios(cfg.device, stall, snap, d2h_pinned, "pinned D2H"),
             f"median of {cfg.reps}: stall {stall * 1e3:.1f} ms, snapshot {snap * 1e3:.1f} ms, "
             f"Tensor.cpu() {d2h * 1e3:.1f} ms ({nbytes / d2h / 1e9:.1f} GB/s), "
             f"into pinned buffers {d2h_pinned * 1e3:.1f} ms ({nbytes / d2h_pinned / 1e9:.1f} GB/s)",
             {"bytes": nbytes, "stall_s": stall, "snapshot_s": snap, "d2h_s": d2h, "d2h_pinned_s": d2h_pinned}),
        _row("torch restore_into", _mismatches(target, state),
             f"{len(target)} tensors on {next(iter(target.values())).device}"),
    ]


# ---------------------------------------------------------------- Checkpointer (JAX)


def _jax_device(cfg: Config) -> Any:
    import jax

    return jax.devices("cpu" if cfg.device == "cpu" else "gpu")[0]


def check_jax_checkpointer(cfg: Config) -> list[Row]:
    """Stall of an (unguarded) save of device arrays vs one ``jax.device_get``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ckptbridge

    dev = _jax_device(cfg)
    host = {k: v.float().cpu().numpy() for k, v in _torch_state(Config("cpu", cfg.mib, 1, "", "")).items()}
    state = {k: jax.device_put(jnp.asarray(v, jnp.bfloat16 if k == "w7" else jnp.float32), dev)
             for k, v in host.items()}
    jax.block_until_ready(state)
    nbytes = sum(v.nbytes for v in state.values())
    ck = ckptbridge.Checkpointer(os.path.join(cfg.work, "jax_ck"), keep_last=2)
    try:
        ck.reserve({"model": state})
        ck.save(0, {"model": state})
        ck.wait()
        stalls, snaps = _time_saves(ck, state, cfg.reps)
        saved = _read_step(ck.path_of(cfg.reps))
    finally:
        ck.close()
    d2h = _fresh_d2h(state, cfg.reps, jax.device_get)
    pinned = _fresh_d2h(state, cfg.reps, _via_pinned_host) if _has_pinned_host(dev) else None
    stall, snap = statistics.median(stalls), statistics.median(snaps)
    want = {k: np.asarray(v) for k, v in state.items()}
    probe = (f", via pinned_host memory {pinned * 1e3:.1f} ms ({nbytes / pinned / 1e9:.1f} GB/s)"
             if pinned else ", no pinned_host memory kind")
    return [_row("jax stall vs D2H", _mismatches(saved, want), _ratios(cfg.device, stall, snap, d2h, "device_get"),
                 f"median of {cfg.reps}: stall {stall * 1e3:.1f} ms, snapshot {snap * 1e3:.1f} ms, "
                 f"jax.device_get {d2h * 1e3:.1f} ms ({nbytes / d2h / 1e9:.1f} GB/s) on {dev.platform}{probe}",
                 {"bytes": nbytes, "stall_s": stall, "snapshot_s": snap, "d2h_s": d2h,
                  **({"d2h_pinned_host_s": pinned} if pinned else {})})]


def _fresh_d2h(state: dict[str, Any], reps: int, get: Callable[[dict[str, Any]], Any]) -> float:
    """Median time of ``get`` (a device-to-host copy) of a fresh device copy of ``state``: an
    array caches its host value, so a second ``device_get`` of it would time the cache."""
    import jax
    import jax.numpy as jnp

    times = []
    for _ in range(reps):
        fresh = jax.block_until_ready({k: jnp.array(v, copy=True) for k, v in state.items()})
        t0 = time.perf_counter()
        get(fresh)
        times.append(time.perf_counter() - t0)
        del fresh
    return statistics.median(times)


def _has_pinned_host(dev: Any) -> bool:
    return dev.platform != "cpu" and "pinned_host" in {m.kind for m in dev.addressable_memories()}


def _via_pinned_host(state: dict[str, Any]) -> list[Any]:
    """The other device-to-host path JAX offers: into its page-locked host memory, then numpy."""
    import jax
    import numpy as np

    on_host = {k: jax.device_put(v, v.sharding.with_memory_kind("pinned_host")) for k, v in state.items()}
    return [np.asarray(v) for v in jax.block_until_ready(on_host).values()]


# ---------------------------------------------------------------- loads onto devices


def _torch_ref(path: str) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _ds_refs(run: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed's own outputs for the run: ``zero_to_fp32``'s fp32 weights and
    ``ds_to_universal``'s ``exp_avg`` per parameter."""
    fp32 = _torch_ref(os.path.join(run, "fp32", "pytorch_model.bin"))
    zero = Path(run, "ckpt", "global_step3_universal", "zero")
    exp_avg = {p.name: _torch_ref(str(p / "exp_avg.pt"))["param"] for p in zero.iterdir() if p.is_dir()}
    return fp32, exp_avg


def _ds_ckpt(run: str) -> str:
    return os.path.join(run, "ckpt", "global_step3")


def check_deepspeed_to_tensors(cfg: Config) -> list[Row]:
    """The DeepSpeed run read into plain device tensors with ``load_into`` (fp32 master)."""
    import torch

    from ckptbridge.adapters import torch as cbt

    fp32, _ = _ds_refs(cfg.ds_run)
    target = {k: torch.empty(v.shape, dtype=torch.float32, device=cfg.device) for k, v in fp32.items()}
    cbt.load_into(target, _ds_ckpt(cfg.ds_run), state="fp32")
    _sync(cfg.device)
    return [_row("DeepSpeed -> tensors", _mismatches(target, fp32),
                 f"{len(target)} tensors on {next(iter(target.values())).device}",
                 "fp32 master vs DeepSpeed's zero_to_fp32")]


def _mesh(cfg: Config) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(cfg.device, (1,), mesh_dim_names=("dp",))


def _dtensor_rows(check: str, loaded: dict[str, Any], want: dict[str, Any], detail: str) -> Row:
    from torch.distributed.tensor import DTensor

    not_dt = [k for k, v in loaded.items() if not isinstance(v, DTensor)]
    full = {k: v.full_tensor() for k, v in loaded.items() if isinstance(v, DTensor)}
    devices = sorted({str(v.to_local().device) for v in loaded.values() if isinstance(v, DTensor)})
    return _row(check, not_dt + _mismatches(full, want), f"{len(loaded)} DTensors on {','.join(devices)}", detail)


def check_deepspeed_to_mesh(cfg: Config) -> list[Row]:
    """The DeepSpeed run as DTensors (``Shard(0)``) on a DeviceMesh: fp32 master and exp_avg."""
    from torch.distributed.tensor import Shard

    from ckptbridge.adapters import torch as cbt

    fp32, exp_avg = _ds_refs(cfg.ds_run)
    mesh = _mesh(cfg)
    ckpt = _ds_ckpt(cfg.ds_run)
    w = cbt.load(ckpt, mesh, {k: [Shard(0)] for k in fp32}, state="fp32")
    m = cbt.load(ckpt, mesh, {k: [Shard(0)] for k in exp_avg}, state="exp_avg")
    return [_dtensor_rows("DeepSpeed -> DeviceMesh", {**w, **{f"{k}:exp_avg": v for k, v in m.items()}},
                          {**fp32, **{f"{k}:exp_avg": v for k, v in exp_avg.items()}},
                          "fp32 vs zero_to_fp32, exp_avg vs ds_to_universal")]


def check_dcp(cfg: Config) -> list[Row]:
    """A checkpoint written by torch's ``dcp.save`` read back as DTensors and into device tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard

    from ckptbridge.adapters import torch as cbt

    g = torch.Generator().manual_seed(1)
    sd = {"emb": torch.randn(101, 60, generator=g), "fc.weight": torch.randn(240, 60, generator=g),
          "fc.bias": torch.randn(240, generator=g).to(torch.bfloat16)}
    path = os.path.join(cfg.work, "dcp")
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    mesh = _mesh(cfg)
    loaded = cbt.load(path, mesh, {"emb": [Shard(1)], "fc.weight": [Shard(0)], "fc.bias": [Replicate()]})
    target = {k: torch.empty_like(v, device=cfg.device) for k, v in sd.items()}
    cbt.load_into(target, path)
    _sync(cfg.device)
    return [_dtensor_rows("DCP -> DeviceMesh", loaded, sd, "torch dcp.save -> cbt.load"),
            _row("DCP -> tensors", _mismatches(target, sd), f"{len(target)} tensors on {target['emb'].device}",
                 "torch dcp.save -> cbt.load_into")]


def check_jax_mesh(cfg: Config) -> list[Row]:
    """The DeepSpeed run loaded onto a jax Mesh of this device (fp32 master)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ckptbridge.adapters import jax as cbjax

    fp32, _ = _ds_refs(cfg.ds_run)
    mesh = Mesh(np.array([_jax_device(cfg)]), ("data",))
    spec = {k: NamedSharding(mesh, PartitionSpec("data", *[None] * (v.dim() - 1))) for k, v in fp32.items()}
    arrays = cbjax.load(_ds_ckpt(cfg.ds_run), spec, state="fp32")
    jax.block_until_ready(arrays)
    platforms = sorted({d.platform for a in arrays.values() for d in a.devices()})
    return [_row("DeepSpeed -> jax Mesh", _mismatches(arrays, {k: v.detach().numpy() for k, v in fp32.items()}),
                 f"{len(arrays)} arrays on {','.join(platforms)}", "fp32 vs zero_to_fp32")]


# ---------------------------------------------------------------- machine, table, JSON


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=cwd).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_facts(device: str, commit: str | None) -> dict[str, Any]:
    """GPU, driver, library versions, CPU count, host and the ckptbridge commit measured."""
    import jax
    import torch

    import ckptbridge

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if gpu else ""
    return {
        "device": device, "gpu": gpu, "driver": smi or None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
        "ckptbridge": ckptbridge.__version__,
        "commit": commit or _run(["git", "rev-parse", "HEAD"], cwd=ROOT) or None,
        "cpus": os.cpu_count(), "host": socket.gethostname(), "kernel": platform.release(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def table(rows: list[Row]) -> str:
    """The rows as a markdown table (check, pass/fail, figure, detail)."""
    lines = ["| check | result | figure | detail |", "|---|---|---|---|"]
    lines += [f"| {r.check} | {'pass' if r.ok else 'FAIL'} | {r.figure} | {r.detail} |" for r in rows]
    return "\n".join(lines)


def record_markdown(record: dict[str, Any]) -> str:
    """The ``.md`` written beside the JSON: the machine, then the table (README: bench/readme.py)."""
    m = record["machine"]
    head = (f"{m['gpu'] or 'no GPU (device replaced by the CPU)'}, driver {m['driver']}, torch {m['torch']} "
            f"(CUDA {m['cuda']}), jax {m['jax']}, Python {m['python']}, {m['cpus']} CPUs; commit "
            f"{str(m['commit'])[:10]}, {m['time']}; {record['seconds']} s; "
            f"{'every check passed' if record['ok'] else 'SOME CHECKS FAILED'}")
    return head + "\n\n" + table([Row(**r) for r in record["checks"]]) + "\n"


def report(rows: list[Row], machine: dict[str, Any], seconds: float) -> dict[str, Any]:
    return {"ok": all(r.ok for r in rows), "seconds": round(seconds, 1), "machine": machine,
            "checks": [asdict(r) for r in rows]}


CHECKS: tuple[Callable[[Config], list[Row]], ...] = (
    check_torch_checkpointer, check_jax_checkpointer, check_deepspeed_to_tensors,
    check_deepspeed_to_mesh, check_dcp, check_jax_mesh,
)


def run_checks(cfg: Config, checks: tuple[Callable[[Config], list[Row]], ...] = CHECKS) -> list[Row]:
    """Every check; one that raises is a failed row naming the error (the others still run)."""
    rows: list[Row] = []
    for check in checks:
        try:
            rows += check(cfg)
        except Exception as e:  # a broken path is a FAIL row, not a lost report
            rows.append(Row(check.__name__.removeprefix("check_"), False, "error", f"{type(e).__name__}: {e}"))
    return rows


def unpack_ds_run(dst: str, run: str = DS_RUN) -> str:
    """Unpack one run of the DeepSpeed fixture archive into ``dst``; returns its folder."""
    import lzma
    import tarfile

    with lzma.open(DS_ARCHIVE) as fh, tarfile.open(fileobj=fh) as tar:
        members = [m for m in tar if m.name.startswith(run + "/")]
        tar.extractall(dst, members=members, filter="data")
    return os.path.join(dst, run)


def _init_process_group(device: str) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--mib", type=int, default=512, help="size of the state the stall checks save")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="write the JSON record here")
    p.add_argument("--commit", help="the ckptbridge commit measured (default: git rev-parse HEAD)")
    p.add_argument("--deepspeed-run", help=f"an unpacked fixture run (default: {DS_RUN} from {DS_ARCHIVE.name})")
    p.add_argument("--render", metavar="JSON", help="only write the .md beside a record this script wrote")
    args = p.parse_args(argv)
    if args.render:
        Path(args.render).with_suffix(".md").write_text(record_markdown(json.loads(Path(args.render).read_text())))
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch
    if args.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: run with --device cpu for the CPU-only parts")
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="gpu_check-")
    try:
        run = args.deepspeed_run or unpack_ds_run(work)
        _init_process_group(args.device)
        rows = run_checks(Config(args.device, args.mib, args.reps, work, run))
        dist.destroy_process_group()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = report(rows, machine_facts(args.device, args.commit), time.perf_counter() - t0)
    print(table(rows))
    print(json.dumps(record["machine"]))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(record_markdown(record))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""``reshard --to deepspeed-universal``: the files DeepSpeed's universal loader reads.

The light tests here compare our output file by file with DeepSpeed's own
``ds_to_universal`` output (loaded with ``torch.load(weights_only=True)``);
``test_deepspeed_e2e.py`` resumes real DeepSpeed engines from it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _common import same_bits
from test_deepspeed import _load, _np, runs_dir  # noqa: F401  (session fixture)

import ckptbridge
from ckptbridge import formats, reshard
from ckptbridge import open as cb_open
from ckptbridge._cli import main as cli_main

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _theirs(runs: str, name: str) -> str:
    ck = os.path.join(runs, name, "ckpt")
    with open(os.path.join(ck, "latest")) as fh:
        return os.path.join(ck, fh.read().strip() + "_universal")


def test_registered() -> None:
    fmt = next(f for f in formats() if f.name == "deepspeed-universal")
    assert fmt.writable and not fmt.readable  # its output opens as format "deepspeed"


@pytest.mark.parametrize("name", ["s2_bf16_w2", "s3_fp32_w4", "s1_bf16opt_w2", "tp2_s2_bf16_w4", "s2_fp16_w2",
                                  "tp2_s3_bf16_w4", "pp2_tp2_s1_bf16_w8"])
def test_files_equal_ds_to_universal(runs_dir: str, tmp_path: object, name: str) -> None:  # noqa: F811
    dst = os.path.join(str(tmp_path), "out")
    src = cb_open(os.path.join(runs_dir, name, "ckpt"))
    tag = f"global_step{src.step}"
    reshard(src, dst, to="deepspeed-universal")
    with pytest.raises(ckptbridge.OptionError, match="has no option .dp"):  # the layout is the same for any DP
        reshard(src, dst + "x", to="deepspeed-universal", dp=4)
    with open(os.path.join(dst, "latest_universal")) as fh:
        assert fh.read() == tag
    ours_zero = os.path.join(dst, tag, "zero")
    theirs_zero = os.path.join(_theirs(runs_dir, name), "zero")
    params = sorted(d for d in os.listdir(theirs_zero) if os.path.isdir(os.path.join(theirs_zero, d)))
    shapes = {n: t.shape for n, t in cb_open(dst).tensors.items()}
    assert sorted(d for d in os.listdir(ours_zero) if os.path.isdir(os.path.join(ours_zero, d))) == params
    for p in params:
        for k in STATES:
            want = _load(os.path.join(theirs_zero, p, f"{k}.pt"))
            want = want["param"] if isinstance(want, dict) else want  # ZeRO-3's converter writes flat tensors
            got = _load(os.path.join(ours_zero, p, f"{k}.pt"))
            assert got["cat_dim"] in (0, 1) and got["param"].dtype == torch.float32
            assert tuple(got["param"].shape) == shapes[p]
            assert same_bits(_np(got["param"]).reshape(-1), _np(want).reshape(-1)), f"{name}: {p}/{k}"
            if isinstance(_load(os.path.join(theirs_zero, p, f"{k}.pt")), dict):  # tensor-parallel re-split keys
                theirs_meta = {m: v for m, v in _load(os.path.join(theirs_zero, p, f"{k}.pt")).items()
                               if m in ("cat_dim", "vocab_tensor")}
                assert {m: v for m, v in got.items() if m in theirs_meta} == theirs_meta
        step = _load(os.path.join(ours_zero, p, "step.pt"))
        assert step.dim() == 0 and float(step) == src[p].scalars["step"]
        if os.path.exists(os.path.join(theirs_zero, p, "step.pt")):
            assert _load(os.path.join(theirs_zero, p, "step.pt")).dtype == step.dtype
    opt = _load(os.path.join(ours_zero, "optimizer_state.pt"))  # plain data: loads with weights_only
    assert opt["ds_version"] == "0.19.8"
    want_wd = [g["weight_decay"] for g in src.extra["param_groups"]]
    assert [g["weight_decay"] for g in opt["param_groups"]] == want_wd
    assert float(opt["optimizer_state_dict"]["state"][0]["step"]) == src.step
    if len(set(want_wd)) > 1:  # hyper-parameters that differ between groups: left to the script (ZeRO-3)
        assert "weight_decay" not in opt["optimizer_state_dict"]["param_groups"][0]
    assert opt["optimizer_state_dict"]["param_groups"][0]["lr"] == 0.01
    a = os.path.join(dst, tag, "mp_rank_00_model_states.pt")
    b = os.path.join(dst, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert os.path.samefile(a, b)  # one file, two names (a hard link)
    ms = torch.load(a, map_location="cpu", weights_only=True)
    assert ms["global_steps"] == src.step and ms["mp_world_size"] == 1
    for n, t in ms["module"].items():  # the module weights, in the model's own dtype
        state = "param" if "param" in src[n].states else "fp32"
        assert same_bits(_np(t), src[n].state(state).read())


def test_round_trip_and_refusals(runs_dir: str, tmp_path: object) -> None:  # noqa: F811
    src = os.path.join(runs_dir, "s2_bf16_w2_palign", "ckpt")
    dst = os.path.join(str(tmp_path), "u")
    assert cli_main(["reshard", src, dst, "--to", "deepspeed-universal", "-o", "tag=global_step3"]) == 0
    a, b = cb_open(src), cb_open(dst)
    assert b.provenance["layout"] == "universal" and set(a) == set(b)
    for n in a:
        for k in STATES:
            assert same_bits(b[n].state(k).read(), a[n].state(k).read())
        assert b[n].scalars == a[n].scalars
    before = sorted(os.listdir(dst))
    with pytest.raises(FileExistsError):
        reshard(src, dst, to="deepspeed-universal")
    assert sorted(os.listdir(dst)) == before
    assert not os.path.exists(dst + ".partial")


def test_from_our_universal_directory(runs_dir: str, tmp_path: object) -> None:  # noqa: F811
    """Any source with fp32/exp_avg/exp_avg_sq: here ckptbridge's own universal directory."""
    src = os.path.join(runs_dir, "s3_bf16_w2_subgrp", "ckpt")
    mid = os.path.join(str(tmp_path), "mid")
    ckptbridge.convert(src, mid)
    dst = os.path.join(str(tmp_path), "ds")
    reshard(mid, dst, to="deepspeed-universal")
    native, out = cb_open(src), cb_open(dst)
    for n in native:
        for k in STATES:
            assert same_bits(out[n].state(k).read(), native[n].state(k).read())
        assert out[n].scalars.get("step") == 3


def test_frozen_and_tied_parameters(runs_dir: str, tmp_path: object) -> None:  # noqa: F811
    src = os.path.join(runs_dir, "s2_bf16_w2_frozen_tied", "ckpt")
    dst = os.path.join(str(tmp_path), "ds")
    reshard(src, dst, to="deepspeed-universal")
    zero = os.path.join(dst, "global_step3", "zero")
    assert sorted(os.listdir(os.path.join(zero, "wpe.weight"))) == ["fp32.pt"]  # frozen: weights only
    frozen = _load(os.path.join(zero, "wpe.weight", "fp32.pt"))["param"]
    want = cb_open(src)["wpe.weight"].read(dtype="float32")
    assert np.array_equal(frozen.numpy(), want)
    ms = _load(os.path.join(dst, "global_step3", "mp_rank_00_model_states.pt"))
    assert ms["shared_params"] == {"lm_head.weight": "wte.weight"}


def test_direct_io_files_bitwise_and_a_failed_write_keeps_the_old_output(runs_dir: str, tmp_path: object,  # noqa: F811
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor files go through the core's direct-I/O pipeline (``O_DIRECT`` asked for on each,
    tensors in many unaligned row blocks here): ``torch.load(weights_only=True)``, plain and
    mmap'd, reads each bitwise equal to DeepSpeed's own ``ds_to_universal`` file, and Python's
    zipfile finds every CRC right. A write that fails midway (the disk full, or the source
    unreadable) names the file, leaves the previous output byte for byte, and no stage behind."""
    import errno
    import re
    import zipfile

    import ckptbridge._formats.safetensors_write as sw

    name = "s2_bf16_w2"
    src, dst = os.path.join(runs_dir, name, "ckpt"), os.path.join(str(tmp_path), "out")
    opened: dict[str, int] = {}
    synced: set[str] = set()
    real_open, real_fsync = os.open, os.fsync

    def spy(path: str, flags: int, *args: object) -> int:
        key = os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path)
        opened[key] = opened.get(key, 0) | flags  # every open of the file
        return real_open(path, flags, *args)

    def fsync(fd: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))  # the file or folder behind the descriptor
        real_fsync(fd)

    monkeypatch.setattr(sw, "_CHUNK_BYTES", 5000)  # row blocks, each ending mid disk block
    monkeypatch.setattr(os, "open", spy)
    monkeypatch.setattr(os, "fsync", fsync)
    reshard(src, dst, to="deepspeed-universal")
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "fsync", real_fsync)
    staged = {re.sub(r"/out\.partial[^/]*", "/out", p) for p in synced}  # the stage was published as dst
    everything = {os.path.realpath(os.path.join(d, f)) for d, dirs, fs in os.walk(dst) for f in [*fs, *dirs]}
    second = os.path.realpath(os.path.join(dst, "global_step3", "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    assert everything - {second} <= staged  # durable as before: every file and folder fsynced (the link: its folder)
    tag = f"global_step{cb_open(src).step}"
    theirs_zero, ours_zero = os.path.join(_theirs(runs_dir, name), "zero"), os.path.join(dst, tag, "zero")
    params = sorted(d for d in os.listdir(ours_zero) if os.path.isdir(os.path.join(ours_zero, d)))
    files = [os.path.join(p, f"{k}.pt") for p in params for k in STATES]
    direct = getattr(os, "O_DIRECT", 0)
    others = [f"{tag}/mp_rank_00_model_states.pt", "zero/optimizer_state.pt"]
    assert direct and all(opened[f] & direct for f in [*files, *others])
    for f in files:
        want = _load(os.path.join(theirs_zero, f))["param"]
        for got in (_load(os.path.join(ours_zero, f)),
                    torch.load(os.path.join(ours_zero, f), weights_only=True, mmap=True)):
            assert same_bits(_np(got["param"]), _np(want)), f
        with zipfile.ZipFile(os.path.join(ours_zero, f)) as zf:
            assert zf.testzip() is None, f
    ms = _load(os.path.join(dst, tag, "mp_rank_00_model_states.pt"))
    ref = cb_open(src)
    assert all(same_bits(_np(t), ref[n].state("param").read()) for n, t in ms["module"].items())

    def tree(root: str) -> dict[str, bytes]:
        return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                for d, _, fs in os.walk(root) for f in fs}

    before = tree(dst)
    real_pwrite, calls = os.pwrite, [0]

    def full(fd: int, data: object, at: int) -> int:
        calls[0] += 1
        if calls[0] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match=r"\.pt: writing bytes .*No space left"):
        reshard(src, dst, to="deepspeed-universal", overwrite=True)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    view_read, reads = ckptbridge.TensorView.read, [0]

    def unreadable(self: object, *args: object, **kw: object) -> object:
        reads[0] += 1
        if reads[0] > 7:
            raise OSError(errno.EIO, f"Input/output error reading {self.name}")  # type: ignore[attr-defined]
        return view_read(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ckptbridge.TensorView, "read", unreadable)
    with pytest.raises(OSError, match="Input/output error reading"):
        reshard(src, dst, to="deepspeed-universal", overwrite=True)
    monkeypatch.setattr(ckptbridge.TensorView, "read", view_read)
    assert tree(dst) == before
    assert [p for p in os.listdir(str(tmp_path)) if p != "out"] == []  # no stage left behind

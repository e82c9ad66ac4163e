"""A pickle payload (os.system) hidden in any pickle of any supported format never runs.

The payload is appended to the real pickle stream of a real checkpoint file
(``GLOBAL os.system; arg; REDUCE; POP`` before ``STOP``), so the file is
otherwise intact and an unrestricted loader *would* run it (shown as a
positive control where the format's classes are importable).
"""

from __future__ import annotations

import glob
import io
import os
import pickle
import shutil
import zipfile

import pytest
import torch
from test_deepspeed import runs_dir  # noqa: F401  (session fixture: unpacked DeepSpeed runs)

import ckptbridge

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


def _payload(marker: str) -> bytes:
    cmd = f"touch {marker}".encode()
    return b"cos\nsystem\n" + b"X" + len(cmd).to_bytes(4, "little") + cmd + b"\x85R0"


def _inject_pickle(data: bytes, marker: str) -> bytes:
    if not data.endswith(b"."):
        raise ValueError("not a pickle stream")
    return data[:-1] + _payload(marker) + b"."


def inject(path: str, marker: str) -> None:
    """Insert the payload into a plain pickle file or into data.pkl of a torch zip archive."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:4] != b"PK\x03\x04":
        with open(path, "wb") as fh:
            fh.write(_inject_pickle(raw, marker))
        return
    with zipfile.ZipFile(path) as zf:
        members = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for name, data in members:
            out.writestr(name, _inject_pickle(data, marker) if name.endswith("data.pkl") else data)
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())


def _refuses(ckpt_path: str, marker: str) -> None:
    with pytest.raises(ckptbridge.UnsafePickleError, match="os.system"):
        c = ckptbridge.open(ckpt_path)
        for name in c:  # lazily opened files are read here
            for s in c[name].states:
                c[name].state(s).read()
    assert not os.path.exists(marker), "the payload ran"


def test_positive_control_an_unrestricted_loader_would_run_it(tmp_path):
    marker = str(tmp_path / "ran")
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    inject(str(tmp_path / "a.pt"), marker)
    torch.load(tmp_path / "a.pt", weights_only=False)
    assert os.path.exists(marker)
    os.remove(marker)
    _refuses(str(tmp_path / "a.pt"), marker)


@pytest.mark.parametrize("which", ["model_states", "optim_states"])
def test_deepspeed_model_and_optimizer_states(tmp_path, runs_dir, which):  # noqa: F811
    run = os.path.join(tmp_path, "run")
    shutil.copytree(os.path.join(runs_dir, "s2_fp32_w4", "ckpt"), run)
    with open(os.path.join(run, "latest")) as fh:
        tag = fh.read().strip()
    files = sorted(glob.glob(os.path.join(run, tag, f"*{which}.pt")))
    marker = str(tmp_path / "ran")
    inject(files[-1], marker)
    _refuses(run, marker)


def _megatron(tmp_path, kind: str) -> str:
    src = os.path.join(FIX, "megatron", "A", "tp2pp2", kind)
    dst = str(tmp_path / kind)
    shutil.copytree(src, dst)
    return dst


def test_megatron_legacy_args_and_optimizer_file(tmp_path):
    root = _megatron(tmp_path, "torch")
    marker = str(tmp_path / "ran")
    inject(sorted(glob.glob(os.path.join(root, "iter_*", "mp_rank_*", "model_optim_rng.pt")))[-1], marker)
    _refuses(root, marker)


def test_megatron_dist_checkpoint_common_and_metadata(tmp_path):
    for target in ("common.pt", ".metadata"):
        root = _megatron(tmp_path / target.strip("."), "torch_dist")
        marker = str(tmp_path / f"ran-{target}")
        inject(glob.glob(os.path.join(root, "iter_*", target))[0], marker)
        _refuses(root, marker)


def test_dcp_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.randn(4, 3), "b": torch.zeros(3)}, checkpoint_id=str(tmp_path / "dcp"))
    meta = str(tmp_path / "dcp" / ".metadata")
    marker = str(tmp_path / "ran")
    inject(meta, marker)
    with open(meta, "rb") as fh:  # positive control: plain pickle runs it
        pickle.load(fh)
    assert os.path.exists(marker)
    os.remove(marker)
    _refuses(str(tmp_path / "dcp"), marker)

"""The CLI contract other issues rely on (spellings, JSON shapes, exit codes)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import ckptbridge
from ckptbridge._cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptbridge", *args], capture_output=True, text=True)


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    sd = {"embed.weight": torch.randn(9, 4), "head.weight": torch.randn(3, 4).bfloat16(), "iteration": 5}
    torch.save(sd, tmp_path / "m.pt")
    return tmp_path / "m.pt", sd


def test_inspect_json_contract(ckpt, capsys):
    path, _ = ckpt
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "torch-save" and info["step"] == 5
    assert [t["name"] for t in info["tensors"]] == ["embed.weight", "head.weight"]
    t = info["tensors"][1]
    assert t["shape"] == [3, 4] and t["dtype"] == "bfloat16" and t["states"] == ["param"]


def test_inspect_plain_when_piped(ckpt):
    out = run("inspect", str(ckpt[0]))
    assert out.returncode == 0 and "embed.weight\t9x4\tfloat32" in out.stdout


def test_convert_verify_export_diff_reshard(ckpt, tmp_path):
    path, sd = ckpt
    u = tmp_path / "u"
    assert run("convert", str(path), str(u)).returncode == 0
    assert run("verify", str(u)).returncode == 0
    out = tmp_path / "w.safetensors"
    assert run("export", str(u), str(out), "--state", "param").returncode == 0
    np.testing.assert_array_equal(load_file(str(out))["embed.weight"], sd["embed.weight"].numpy())
    d = run("diff", str(path), str(u), "--json")
    assert d.returncode == 0
    rows = json.loads(d.stdout)
    assert all(r["equal"] and r["max_abs_diff"] == 0.0 for r in rows)
    for fmt, dst in (("universal", tmp_path / "r"), ("safetensors", tmp_path / "r.safetensors")):
        r = run("reshard", str(u), str(dst), "--to", fmt)
        assert r.returncode == 0, r.stderr
        assert all(x.equal for x in ckptbridge.diff(path, dst))


def test_diff_reports_differences_and_missing(tmp_path):
    torch.save({"a": torch.zeros(3), "b": torch.ones(2)}, tmp_path / "x.pt")
    torch.save({"a": torch.tensor([0.0, 0.5, 0.0]), "c": torch.ones(2)}, tmp_path / "y.pt")
    d = run("diff", str(tmp_path / "x.pt"), str(tmp_path / "y.pt"), "--json")
    assert d.returncode == 1
    rows = {r["name"]: r for r in json.loads(d.stdout)}
    assert rows["a"]["max_abs_diff"] == 0.5 and not rows["b"]["in_b"] and not rows["c"]["in_a"]


def test_verify_fails_and_names_the_tensor(ckpt, tmp_path):
    u = tmp_path / "u"
    ckptbridge.convert(ckpt[0], u)
    f = next((u / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(raw)
    r = run("verify", str(u))
    assert r.returncode == 1 and "checksum" in r.stderr and "'head.weight'" in r.stderr


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"hello")
    r = run("inspect", str(tmp_path / "junk.bin"))
    assert r.returncode == 2 and "junk.bin" in r.stderr and "Traceback" not in r.stderr
    r = run("reshard", str(tmp_path / "junk.bin"), str(tmp_path / "o"), "--to", "nonsense")
    assert r.returncode == 2 and "Traceback" not in r.stderr

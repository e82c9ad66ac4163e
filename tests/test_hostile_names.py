"""Tensor and state names are data, never paths: nothing escapes the output directory."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import ckptbridge
from ckptbridge.plugin import Box, Piece
from ckptbridge.plugin import write_universal as save

HOSTILE = ["../../escaped", "/etc/passwd", "a/../../b", "..", "normal", "x" * 3000, "with\\backslash", "ü/ñ"]


def _listing(root):
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def test_hostile_tensor_names_stay_inside_universal_and_safetensors_outputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    sd = {name: torch.full((2,), float(i)) for i, name in enumerate(HOSTILE)}
    torch.save(sd, src / "h.pt")
    before = _listing(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    ckptbridge.convert(src / "h.pt", out / "u")
    ckptbridge.export(out / "u", out / "w.safetensors")
    created = _listing(tmp_path) - before
    assert created and all(p.startswith(str(out) + os.sep) for p in created), created
    u = ckptbridge.open(out / "u")
    for i, name in enumerate(HOSTILE):
        np.testing.assert_array_equal(u[name].read(), [float(i)] * 2)


@pytest.mark.parametrize("name", ["", "a\x00b", "y" * 5000])
def test_unstorable_names_are_refused_with_a_clear_error(tmp_path, name):
    with pytest.raises(ckptbridge.FormatError, match="invalid tensor name"):
        save(str(tmp_path / "u"), [Piece(name, "fp32", "float32", (1,), Box.full((1,)), np.ones(1, np.float32))])
    assert not os.path.exists(tmp_path / "u")


def test_hostile_state_names_cannot_collide_or_escape(tmp_path):
    pieces = [Piece("w", state, "float32", (1,), Box.full((1,)), np.full(1, i, np.float32))
              for i, state in enumerate(["a/b", "a_b", "../up", "fp32"])]
    save(str(tmp_path / "u"), pieces)
    files = os.listdir(tmp_path / "u" / "data")
    assert len(files) == 4 and all("/" not in f and not f.startswith("..") for f in files)
    c = ckptbridge.open(tmp_path / "u")
    assert [float(c["w"].state(s).read()[0]) for s in ["a/b", "a_b", "../up", "fp32"]] == [0, 1, 2, 3]
    assert set(os.listdir(tmp_path)) == {"u"}

"""safetensors files and HF sharded indexes, read in place; lying headers refused."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ckptbridge


def test_hf_sharded_index(tmp_path):
    a = {"model.embed.weight": torch.randn(10, 4), "model.norm.weight": torch.randn(4)}
    b = {"lm_head.weight": torch.randn(10, 4).bfloat16()}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in b})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    c = ckptbridge.open(tmp_path)
    assert c.format == "safetensors" and set(c) == set(weight_map)
    np.testing.assert_array_equal(c["model.embed.weight"][3:5], a["model.embed.weight"][3:5].numpy())
    assert c["lm_head.weight"].dtype == "bfloat16"
    assert c["lm_head.weight"].read(dtype="float32").tolist() == b["lm_head.weight"].float().tolist()
    c.stats.reset()
    c["model.embed.weight"][3:5]
    assert c.stats.bytes_read == 2 * 4 * 4


def _write_raw(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "header,data,match",
    [
        ({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 20], "data_offsets": [0, 16]}}, b"\0" * 16, "does not match"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "ends at byte"),
        ({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "dtype"),
        ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16, "negative"),
    ],
)
def test_lying_headers_are_refused_before_allocating(tmp_path, header, data, match):
    p = tmp_path / "bad.safetensors"
    _write_raw(p, header, data)
    with pytest.raises(ckptbridge.FormatError, match=match):
        ckptbridge.open(p)


def test_header_size_larger_than_file(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 50) + b"{}")
    with pytest.raises(ckptbridge.TruncatedError, match="bad.safetensors"):
        ckptbridge.open(p)

"""safetensors files read in place; lying headers refused (HF sharded indexes: test_hf_index.py)."""

from __future__ import annotations

import json
import struct

import pytest

import ckptbridge


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

"""The Universal Checkpoint Language: transforms move boxes and strides, never data."""

from __future__ import annotations

import json

import numpy as np
import torch

import ckptbridge
import ckptbridge.plugin
from ckptbridge.plugin import (
    Box,
    Fuse,
    Rename,
    Shard,
    Split,
    Stack,
    Transpose,
    Unstack,
    apply_rules,
    concat,
    crop,
    fuse,
    rule_from_json,
    rules_to_json,
    split,
)


def _ckpt(tmp_path, sd):
    torch.save(sd, tmp_path / "m.pt")
    return ckptbridge.open(tmp_path / "m.pt")


def test_torch_linear_to_flax_scan_layout(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"blocks.{i}.fc.weight": torch.randn(5, 3, generator=g) for i in range(4)}
    sd["embed.weight"] = torch.randn(7, 3, generator=g)
    c = _ckpt(tmp_path, sd)
    rules = (
        Rename(r"^blocks\.(\d+)\.fc\.weight$", r"layers_\1/fc/kernel"),
        Rename(r"^embed\.weight$", "embed/embedding"),
        Transpose(r"/kernel$", (1, 0)),
        Stack(r"^layers_(\d+)/(.*)$", r"layers/\2", dim=0),
    )
    out = apply_rules(c.tensors, rules)
    assert set(out) == {"layers/fc/kernel", "embed/embedding"}
    view = ckptbridge.Checkpoint(ckptbridge.CheckpointIndex("x", c.path, out), c.files)
    want = np.stack([sd[f"blocks.{i}.fc.weight"].numpy().T for i in range(4)])
    np.testing.assert_array_equal(view["layers/fc/kernel"].read(), want)
    np.testing.assert_array_equal(view["layers/fc/kernel"][2, 1:3], want[2, 1:3])
    # and back
    back = apply_rules(out, (Unstack(r"^layers/fc/kernel$", "blocks.{i}.fc.weight"), Transpose(r"^blocks", (1, 0))))
    view2 = ckptbridge.Checkpoint(ckptbridge.CheckpointIndex("x", c.path, back), c.files)
    for i in range(4):
        np.testing.assert_array_equal(view2[f"blocks.{i}.fc.weight"].read(), sd[f"blocks.{i}.fc.weight"].numpy())


def test_split_and_fuse_grouped_query_qkv(tmp_path):
    groups, q_per_group, hd, hidden = 2, 3, 4, 5
    rows = groups * (q_per_group + 2) * hd
    qkv = torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden)
    c = _ckpt(tmp_path, {"qkv": qkv})
    st = c.tensors["qkv"].state()
    q, k, v = split(st, 0, (q_per_group * hd, hd, hd), groups)
    arr = qkv.numpy().reshape(groups, q_per_group + 2, hd, hidden)
    view = lambda s: ckptbridge.plugin.read_state(s, None, c.files)  # noqa: E731
    np.testing.assert_array_equal(view(q), arr[:, :q_per_group].reshape(-1, hidden))
    np.testing.assert_array_equal(view(k), arr[:, q_per_group].reshape(-1, hidden))
    np.testing.assert_array_equal(view(v), arr[:, q_per_group + 1].reshape(-1, hidden))
    np.testing.assert_array_equal(view(fuse([q, k, v], 0, groups)), qkv.numpy())
    # tensor-parallel shards are crops; concatenating them gives the tensor back
    shards = [crop(st, Box((r * rows // 2, 0), (rows // 2, hidden))) for r in range(2)]
    np.testing.assert_array_equal(view(concat(shards, 0)), qkv.numpy())


def test_split_rule_by_name(tmp_path):
    fc1 = torch.randn(8, 3)
    c = _ckpt(tmp_path, {"mlp.fc1.weight": fc1})
    out = apply_rules(c.tensors, (Split(r"fc1\.weight$", "fc1_{part}.weight", 0, ("gate", "up"), (4, 4)),))
    view = ckptbridge.Checkpoint(ckptbridge.CheckpointIndex("x", c.path, out), c.files)
    np.testing.assert_array_equal(view["mlp.fc1_up.weight"].read(), fc1[4:].numpy())


def test_rules_are_json_data():
    rules = (Shard(r"linear_qkv", "tp", 0), Fuse(r"linear_qkv", 0, ("q", "k", "v"), (96, 32, 32), 2),
             Rename("a", "b"), Transpose("k", (1, 0)))
    js = rules_to_json(rules)
    assert json.loads(json.dumps(js)) == js
    assert tuple(rule_from_json(r) for r in js) == rules

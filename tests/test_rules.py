"""The Universal Checkpoint Language: transforms move boxes and strides, never data."""

from __future__ import annotations

import json

import numpy as np
import torch

import ckptbridge
import ckptbridge.plugin
from ckptbridge.plugin import Box
from ckptbridge.rules import (
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


# ------------------------------------------------------------------ rule language 2


def _all_rules():
    from ckptbridge import (
        Cast,
        Crop,
        Deinterleave,
        Drop,
        Expect,
        Interleave,
        Join,
        MergeDims,
        Offset,
        Pad,
        Reshape,
        Scale,
        SplitDim,
        State,
    )
    from ckptbridge.plugin import FlatPartition, Renumber, Replicate

    return (Replicate("ln", "tp"), Renumber("layers", "pp", 4), FlatPartition(".*", "dp", 2),
            Shard(r"qkv", "tp", 0), Fuse(r"qkv", 0, ("q", "k", "v"), (96, 32, 32), 2), State("mu/(.*)", r"\1", "exp_avg"),
            Rename(r"^a\.(\d+)$", r"b/\1"), Transpose("k", (1, 0)), Reshape("k", (4, -1), (8, 6)),
            SplitDim("k", 0, (2, 4)), MergeDims("k", 0, 2), Interleave("q", 0, 16), Deinterleave("q", 0, 16),
            Pad("emb", 0, 251, 256), Crop("emb", 0, 251, 0, 256), Stack(r"^l\.(?P<l>\d+)\.w$", "w", 0, "l"),
            Unstack("^w$", "l.{i}.w", 0), Split("qkv", "{part}", 0, ("q", "k"), (2, 2)),
            Join("{part}$", "qkv", 0, ("q", "k")), Scale("q", 0.125), Offset("norm", 1.0),
            Cast("w", "bfloat16", ("param",), "float32"),
            Expect("q", (128, None), "n_heads x head_dim"), Drop(r"^mtp\.", "no MTP in the target"))


def test_every_rule_round_trips_through_json():
    rules = _all_rules()
    again = [rule_from_json(json.loads(json.dumps(r))) for r in rules_to_json(rules)]
    assert tuple(again) == rules
    # the language's rules; an adapter's own Rule subclass (adapters.lora.Copy, imported by an
    # earlier test in the same process) is applied by that adapter and never stored
    every = {c.__name__ for c in ckptbridge.plugin.Rule.__subclasses__() if c.__module__.startswith("ckptbridge.rules")}
    assert {type(r).__name__ for r in rules} == every  # every rule of the language is covered


def test_unknown_rule_fields_are_errors():
    import pytest

    with pytest.raises(ckptbridge.FormatError, match="unknown fields"):
        rule_from_json({"rule": "Scale", "pattern": "q", "factr": 2.0})


def _view(c, tensors):
    return ckptbridge.Checkpoint(ckptbridge.CheckpointIndex("x", c.path, tensors), c.files)


def test_scale_moves_each_state_with_its_meaning(tmp_path):
    """w' = c w  =>  Adam's m' = m / c and v' = v / c**2 (the gradient scales by 1/c)."""
    import pytest

    from ckptbridge import Scale

    u = tmp_path / "u"
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    ckptbridge.plugin.write_universal(str(u), [
        ckptbridge.plugin.Piece("w", s, "float32", (3, 4), Box.full((3, 4)), w * k)
        for s, k in (("fp32", 1), ("exp_avg", 2), ("exp_avg_sq", 3))])
    c = ckptbridge.open(u)
    c2 = c.with_rules([Scale("^w$", 0.125)])
    np.testing.assert_array_equal(c2["w"].read(), w * np.float32(0.125))
    np.testing.assert_array_equal(c2["w"].state("exp_avg").read(), (w * 2) * np.float32(8.0))
    np.testing.assert_array_equal(c2["w"].state("exp_avg_sq").read(), (w * 3) * np.float32(64.0))
    back = c2.with_rules(ckptbridge.invert([Scale("^w$", 0.125)]))
    np.testing.assert_array_equal(back["w"].state("exp_avg_sq").read(), w * 3)
    # bf16 targets: computed in float32, rounded once
    np.testing.assert_array_equal(c2["w"].read(dtype="bfloat16").astype(np.float32),
                                  (w * np.float32(0.125)).astype("bfloat16").astype(np.float32))
    ckptbridge.plugin.write_universal(str(tmp_path / "v"), [
        ckptbridge.plugin.Piece("w", "ema", "float32", (3, 4), Box.full((3, 4)), w)])
    with pytest.raises(ckptbridge.FormatError, match="state 'ema'"):
        ckptbridge.open(tmp_path / "v").with_rules([Scale("w", 2.0)])


def test_offset_shifts_the_weights_and_keeps_the_moments(tmp_path):
    """w' = w + b  =>  d(w')= dw: Adam's moments stay; the inverse rounds again (numpy's (w + 1) - 1)."""
    import pytest

    from ckptbridge import Offset, Scale

    u = tmp_path / "u"
    w = np.random.default_rng(0).normal(0.0, 0.1, (3, 8)).astype(np.float32)
    ckptbridge.plugin.write_universal(str(u), [
        ckptbridge.plugin.Piece("ln", s, "float32", (3, 8), Box.full((3, 8)), w * k)
        for s, k in (("fp32", 1), ("exp_avg", 2), ("exp_avg_sq", 3))])
    c = ckptbridge.open(u)
    rules = [Offset("^ln$", 1.0), Transpose("^ln$", (1, 0)), Scale("^ln$", 0.5)]
    c2 = c.with_rules(rules)
    np.testing.assert_array_equal(c2["ln"].read(), ((w + np.float32(1.0)).T * np.float32(0.5)))
    np.testing.assert_array_equal(c2["ln"].state("exp_avg").read(), (w * 2).T * np.float32(2.0))
    np.testing.assert_array_equal(c2["ln"].state("exp_avg_sq").read(), (w * 3).T * np.float32(4.0))
    # the inverse: what numpy gives for (w + 1) - 1, which is not always w in float32
    back = c2.with_rules(ckptbridge.invert(rules))
    want = (((w + np.float32(1.0)).T * np.float32(0.5)) * np.float32(2.0)).T - np.float32(1.0)
    np.testing.assert_array_equal(back["ln"].read(), want)
    assert not np.array_equal(want, w)  # the offset's rounding shows in these values
    np.testing.assert_array_equal(back["ln"].state("exp_avg").read(), w * 2)
    # bf16 targets: computed in float32, rounded once; a scale after an offset applies to w + b
    np.testing.assert_array_equal(c.with_rules(rules[:1])["ln"].read(dtype="bfloat16").astype(np.float32),
                                  (w + np.float32(1.0)).astype("bfloat16").astype(np.float32))
    assert Offset("x", 1.0).inverse() == Offset("x", -1.0)
    ckptbridge.plugin.write_universal(str(tmp_path / "v"), [
        ckptbridge.plugin.Piece("w", "ema", "float32", (3, 4), Box.full((3, 4)), w[:, :4])])
    with pytest.raises(ckptbridge.FormatError, match="state 'ema'"):
        ckptbridge.open(tmp_path / "v").with_rules([Offset("w", 1.0)])


def test_named_groups_stack_layers_and_experts(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {f"layers.{la}.experts.{e}.w1": torch.randn(3, 2, generator=g) for la in range(2) for e in range(4)}
    c = _ckpt(tmp_path, sd)
    rules = (Stack(r"^layers\.(?P<l>\d+)\.experts\.(?P<e>\d+)\.w1$", r"layers.\g<l>.w1", dim=0, index="e"),
             Stack(r"^layers\.(?P<l>\d+)\.w1$", "moe/wi", dim=1, index="l"))
    out = apply_rules(c.tensors, rules)
    want = np.stack([np.stack([sd[f"layers.{la}.experts.{e}.w1"].numpy() for e in range(4)]) for la in range(2)], 1)
    np.testing.assert_array_equal(_view(c, out)["moe/wi"].read(), want)
    back = apply_rules(out, ckptbridge.invert(rules))
    assert set(back) == set(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(_view(c, back)[k].read(), v.numpy())


def test_pad_repads_a_vocabulary_and_crop_strips_it(tmp_path):
    from ckptbridge import Crop, Pad

    emb = torch.randn(251, 4)
    c = _ckpt(tmp_path, {"emb": emb})
    padded = _view(c, apply_rules(c.tensors, [Pad("emb", 0, 251, 256)]))["emb"].read()
    assert padded.shape == (256, 4) and not padded[251:].any()
    np.testing.assert_array_equal(padded[:251], emb.numpy())
    stripped = apply_rules(apply_rules(c.tensors, [Pad("emb", 0, 251, 256)]), [Crop("emb", 0, 251, 0, 256)])
    assert stripped["emb"].states["param"].fragments == c.tensors["emb"].states["param"].fragments
    import pytest

    with pytest.raises(ckptbridge.ShapeMismatchError, match="expected 250 entries along dim 0, found 251"):
        apply_rules(c.tensors, [Pad("emb", 0, 250, 256)])


def test_rename_inverse_for_literal_patterns():
    r = Rename(r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight$", r"layers/\1/\2/kernel")
    inv = r.inverse()
    import re

    name = "model.layers.12.self_attn.k_proj.weight"
    assert re.sub(inv.pattern, inv.to, re.sub(r.pattern, r.to, name)) == name


def test_drop_leaves_tensors_out_with_one_line_naming_them(tmp_path):
    import warnings

    import pytest

    from ckptbridge import Drop, DroppedTensorsWarning, invert

    c = _ckpt(tmp_path, {"mtp.0.w": torch.ones(2, 3), "mtp.1.w": torch.ones(2), "layers.0.w": torch.ones(4)})
    rule = Drop(r"^mtp\.", "MTP layers: none in the target")
    with pytest.warns(DroppedTensorsWarning) as caught:
        out = apply_rules(c.tensors, [rule])
    assert sorted(out) == ["layers.0.w"]
    (line,) = [str(w.message) for w in caught]
    assert line == "dropped 2 tensors (MTP layers: none in the target): mtp.0.w, mtp.1.w"
    assert invert([rule]) == [rule]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing matched: nothing to report
        assert sorted(apply_rules(out, [rule])) == ["layers.0.w"]

"""Notebook views: ``Checkpoint`` / ``TensorView`` ``_repr_html_`` and ``ReshardPlan``."""

from __future__ import annotations

import os

import pytest

import ckptbridge
from ckptbridge import Box, ReshardPlan, ShapeMismatchError

HERE = os.path.dirname(os.path.abspath(__file__))
DS_CKPT = os.path.join(HERE, "fixtures", "migration", "ds_zero2_w2", "ckpt")
NAME = "blocks.1.fc.weight"  # [240, 60]: its ZeRO-2 partition boundary is at row 170, column 30


def test_checkpoint_html_is_a_tree_with_shapes_states_and_shard_maps():
    with ckptbridge.open(DS_CKPT) as ckpt:
        page = ckpt._repr_html_()
        assert "deepspeed" in page and "step</span> 4" in page
        assert "blocks." in page and "<details" in page and "<svg" in page
        assert "lm_head.bias" in page and "[101]" in page and "exp_avg_sq" in page
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in page  # the files legend
        one = ckpt[NAME]._repr_html_()
        assert one.count("<svg") == 3 and "4 fragments" in one and "step=4" in one
        assert ckpt.stats.bytes_read == 0  # metadata only


def test_reshard_plan_says_which_file_each_target_reads():
    with ckptbridge.open(DS_CKPT) as ckpt:
        view = ckpt[NAME]
        targets = {"top": Box((0, 0), (120, 60)), "bottom": Box((120, 0), (120, 60))}
        plan = ReshardPlan.build(view, targets)
        rows = plan.rows()
        assert {os.path.basename(r["file"]) for r in rows if r["target"] == "top"} == {
            "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
        bottom = [r for r in rows if r["target"] == "bottom"]
        assert {os.path.basename(r["file"]) for r in bottom} == {
            "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
        assert plan.bytes_read == view.nbytes  # a partition of the tensor reads every byte once
        assert sum(r["bytes"] for r in bottom) == 120 * 60 * 4
        page = plan._repr_html_()
        assert "top" in page and "bottom" in page and page.count("<svg") == 2
        assert "ReshardPlan" in str(plan)
        with pytest.raises(ShapeMismatchError):
            ReshardPlan.build(view, [Box((200, 0), (80, 60))])  # outside the tensor


def test_stacked_tensor_is_drawn_per_layer():
    from ckptbridge.plugin import apply_rules
    from examples.models import gpt_rules

    with ckptbridge.open(DS_CKPT) as ckpt:
        tensors = apply_rules(ckpt.tensors, list(gpt_rules.torch_to_flax(60)))
        view = ckptbridge.Checkpoint(ckptbridge.CheckpointIndex("flax", ckpt.path, tensors, 4), ckpt.files)
        page = view["blocks/fc/kernel"]._repr_html_()
        assert "[3, 60, 240]" in page and page.count("<rect") >= 3
        assert "blocks/" in view._repr_html_()

"""The ``qwen3`` / ``qwen3_moe`` recipes as data (no MaxText, no Megatron run): what they read from
an HF config, the two HF expert layouts giving the same MaxText tensors, and the shape checks that
fail before any byte is read. The model proofs are in test_recipes_qwen3.py (MaxText) and
test_recipes_qwen3_megatron.py (megatron-core)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf

import ckptbridge
from ckptbridge import OptionError, ShapeMismatchError, recipes

SPEC = hf.HFSpec("qwen3_moe", mlp=48, experts=4, experts_per_tok=2, heads=4, kv_heads=2, head_dim=24)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """save_pretrained's directory (per-expert names) and the module's own state_dict (fused experts)."""
    from safetensors.torch import save_file

    work = tmp_path_factory.mktemp("qwen3_moe")
    model = hf.build(SPEC)
    d = hf.save(model, work / "hf")
    fused = work / "state"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    return d, fused


def test_config_from_hf():
    cfg = {"model_type": "qwen3_moe", "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
           "norm_topk_prob": True, "num_hidden_layers": 48, "intermediate_size": 6144, "vocab_size": 151936}
    assert recipes.family_from_hf(cfg) == "qwen3_moe"
    assert recipes.family_from_hf({**cfg, "model_type": "qwen3"}) == "qwen3"
    assert recipes.config_from_hf(cfg) == {"n_heads": 32, "n_kv_heads": 4, "head_dim": 128, "tie_embeddings": False,
                                           "qkv_bias": False, "rope": "default", "n_experts": 128, "moe_mlp": 768}
    del cfg["num_experts"]  # what transformers 5 writes
    assert recipes.config_from_hf({**cfg, "num_local_experts": 64})["n_experts"] == 64
    args = recipes.megatron_args({**cfg, "num_local_experts": 64, "mlp_only_layers": [1], "rms_norm_eps": 1e-6})
    assert args["qk_layernorm"] and args["num_experts"] == 64 and args["moe_ffn_hidden_size"] == 768
    assert args["moe_router_topk"] == 8 and args["moe_router_pre_softmax"] is False  # softmax over the top k
    assert args["moe_layer_freq"][:3] == [1, 0, 1] and args["kv_channels"] == 128
    assert recipes.megatron_args({**cfg, "model_type": "qwen3", "norm_topk_prob": False})["qk_layernorm"]
    back = recipes.hf_config(args, family="qwen3_moe")  # Megatron args -> HF config, and back
    assert back["model_type"] == "qwen3_moe" and back["mlp_only_layers"] == [1] and back["norm_topk_prob"]
    assert recipes.config_from_hf(back) == recipes.config_from_hf({**cfg, "num_local_experts": 64})
    assert recipes.megatron_args(back) == args
    with pytest.raises(OptionError, match="no qk_layernorm"):
        recipes.hf_config({**args, "qk_layernorm": False}, family="qwen3")
    with pytest.raises(OptionError, match="no num_experts"):
        recipes.hf_config({**args, "num_experts": None}, family="qwen3_moe")


def test_both_hf_expert_layouts_give_the_same_maxtext_tensors(moe):
    split, fused = moe
    cfg = recipes.config_from_hf(split / "config.json")
    for scan in (True, False):
        a = ckptbridge.open(split, rules=recipes.rules("qwen3_moe", src="hf", dst="maxtext", **cfg, scan=scan))
        b = ckptbridge.open(fused, rules=recipes.rules("qwen3_moe", src="hf", dst="maxtext", **cfg, scan=scan,
                                                      hf_experts="fused"))
        assert sorted(a) == sorted(b) and a.stats.bytes_read == b.stats.bytes_read == 0
        assert a["decoder/layers/moe_block/wi_0" if scan else "decoder/layers_1/moe_block/wo"].shape == \
            ((4, 2, 64, 48) if scan else (4, 48, 64))
        for name in a:
            assert a[name].read().tobytes() == b[name].read().tobytes(), name
        back = b.with_rules(recipes.rules("qwen3_moe", src="maxtext", dst="hf", **cfg, scan=scan, hf_experts="fused"))
        raw = ckptbridge.open(fused)
        assert sorted(back) == sorted(raw)
        assert back["model.layers.0.mlp.experts.gate_up_proj"].read().tobytes() == \
            raw["model.layers.0.mlp.experts.gate_up_proj"].read().tobytes()


def test_both_hf_expert_layouts_give_the_same_megatron_tensors(moe):
    """transformers' fused experts (``gate_up_proj [X, 2F, E]``: ``[gate; up]`` per expert, as its forward
    chunks it) unstack into megatron-core's ``local_experts.N.linear_fc1`` exactly as save_pretrained's
    per-expert gate and up join into it; and stack back bitwise."""
    split, fused = moe
    cfg = recipes.config_from_hf(split / "config.json")
    a = ckptbridge.open(split, rules=recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg))
    b = ckptbridge.open(fused, rules=recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg, hf_experts="fused"))
    assert sorted(a) == sorted(b) and "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in a
    for name in a:
        assert a[name].read().tobytes() == b[name].read().tobytes(), name
    back, raw = b.with_rules(recipes.rules("qwen3_moe", src="megatron", dst="hf", **cfg, hf_experts="fused")), \
        ckptbridge.open(fused)
    assert sorted(back) == sorted(raw)
    for name in raw:
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name


def test_expert_count_that_does_not_fit_fails_before_any_read(moe):
    split, fused = moe
    cfg = {**recipes.config_from_hf(split / "config.json"), "n_experts": 8}
    with pytest.raises(ShapeMismatchError, match=r"'model\.layers\.0\.mlp\.gate\.weight': expected shape \(8, \*\) "
                                                 r"\(n_experts = 8 router rows\), found \(4, 64\)"):
        ckptbridge.open(split, rules=recipes.rules("qwen3_moe", src="hf", dst="maxtext", **cfg))
    with pytest.raises(ShapeMismatchError, match=r"'model\.layers\.0\.mlp\.gate\.weight': expected shape \(8, \*\)"):
        ckptbridge.open(split, rules=recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg))
    with pytest.raises(ShapeMismatchError, match=r"'model\.layers\.\d\.mlp\.(gate|experts\.(gate_up|down)_proj)"):
        ckptbridge.open(fused, rules=recipes.rules("qwen3_moe", src="hf", dst="maxtext", **cfg, hf_experts="fused"))
    with pytest.raises(OptionError, match="n_experts must be a positive integer"):
        recipes.rules("qwen3_moe", src="hf", dst="maxtext", **{**cfg, "n_experts": 0})
    with pytest.raises(OptionError, match="hf_experts must be 'split' or 'fused'"):
        recipes.rules("qwen3_moe", src="hf", dst="maxtext", **cfg, hf_experts="stacked")
    cfg = {**recipes.config_from_hf(split / "config.json"), "moe_mlp": 40}  # the experts are 48 wide
    for layout, path in (("split", split), ("fused", fused)):
        with pytest.raises(ShapeMismatchError, match=r"'model\.layers\.\d\.mlp\.experts\..*expected shape .*moe_mlp"):
            ckptbridge.open(path, rules=recipes.rules("qwen3_moe", src="hf", dst="maxtext", **cfg, hf_experts=layout))
    with pytest.raises(ShapeMismatchError, match=r"expected shape (\(40, \*\) \(moe_mlp = 40 rows\), found \(48, 64\)|"
                                                 r"\(\*, 40\) \(moe_mlp = 40 columns\), found \(64, 48\))"):
        ckptbridge.open(split, rules=recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg, megatron_experts="grouped"))
    with pytest.raises(OptionError, match="megatron_experts='grouped' needs n_experts and moe_mlp"):
        recipes.rules("qwen3_moe", src="hf", dst="megatron", **{**cfg, "moe_mlp": None}, megatron_experts="grouped")
    with pytest.raises(OptionError, match="megatron_experts must be 'sequential' or 'grouped'"):
        recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg, megatron_experts="te")


def test_megatron_layout_of_moe_checkpoints():
    from ckptbridge.adapters.megatron._layout import MegatronConfig, tp_layout

    args = {"num_attention_heads": 4, "hidden_size": 64, "num_layers": 2, "padded_vocab_size": 256,
            "swiglu": True, "num_experts": 4}
    cfg = MegatronConfig.from_args(args)
    assert tp_layout("decoder.layers.0.mlp.router.weight", cfg, 2).kind == "replicated"
    assert tp_layout("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", cfg, 2).kind == "glu"
    assert tp_layout("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", cfg, 2).kind == "row"
    assert tp_layout("decoder.layers.0.self_attention.q_layernorm.weight", cfg, 1).kind == "replicated"
    # expert-parallel and grouped-GEMM layouts are read (tests/test_megatron_moe.py) and written
    # (tests/test_megatron_moe_write.py)
    assert MegatronConfig.from_args({**args, "expert_model_parallel_size": 2}).ep == 2
    assert MegatronConfig.from_args({**args, "moe_grouped_gemm": True, "transformer_impl": "local"}).grouped_gemm

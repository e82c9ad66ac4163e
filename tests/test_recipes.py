"""Recipes as data, their inverses, and bad input (no MaxText or Megatron process needed: fast).

The checkpoints are real: tiny HF models written by ``save_pretrained`` and the Megatron family A
fixture (a Megatron-LM run). Every bad input fails in one message naming the tensor and the
expected and found shapes, before a byte of tensor data is read (``ckpt.stats.bytes_read == 0``).
The model-code proofs are tests/test_recipes_maxtext.py and tests/test_recipes_megatron.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf

import ckptbridge
from ckptbridge import OptionError, ShapeMismatchError, TensorNotFoundError, recipes

A = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron", "A", "tp2pp2", "torch")
A_CFG = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny HF Llama (llama3 rope scaling, GQA 4/2, head_dim 32) saved in several shards."""
    return hf.save(hf.build(hf.HFSpec("llama", rope="llama3", head_dim=32)), tmp_path_factory.mktemp("hf") / "llama")


def _cfg(d):
    return recipes.config_from_hf(d / "config.json")


# ------------------------------------------------------------------ the recipes as data


def test_available_recipes_and_families():
    got = recipes.available()
    for fam in ("llama", "qwen2", "mixtral"):
        assert (fam, "hf", "maxtext") in got and (fam, "maxtext", "hf") in got
    for pair in (("megatron", "hf"), ("hf", "megatron"), ("megatron", "maxtext"), ("maxtext", "megatron")):
        assert ("llama", *pair) in got and ("qwen2", *pair) in got and ("mixtral", *pair) in got
    assert {"llama", "qwen2", "mixtral"} <= set(recipes.families())


def test_config_from_hf_reads_heads_rope_and_family(llama):
    cfg = _cfg(llama)
    assert cfg == {"n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "tie_embeddings": False, "qkv_bias": False,
                   "rope": "llama3.1"}
    assert recipes.family_from_hf(llama / "config.json") == "llama"
    assert recipes.family_from_hf({"model_type": "mistral"}) == "llama"
    with pytest.raises(OptionError, match="gpt2"):
        recipes.family_from_hf({"model_type": "gpt2"})


FAMILY_CFG = {  # each family's config (default: the Llama-like A_CFG with llama3.1 rope)
    "gemma3": {**A_CFG, "rope": "llama3.1", "n_layers": 8, "hidden": 64},
    "gpt_oss": {**A_CFG, "rope": "llama3.1", "n_layers": 4, "moe_mlp": 48},
    "deepseek_v3": {"n_heads": 4, "n_layers": 3, "first_dense": 1, "q_lora_rank": 24, "kv_lora_rank": 20,
                    "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "mtp_layers": 1},
}


@pytest.mark.parametrize("family,src,dst", recipes.available())
def test_every_recipe_is_json_data_and_inverts_to_its_reverse(family, src, dst):
    cfg = FAMILY_CFG.get(family, {**A_CFG, "rope": "llama3.1"})
    rules = recipes.rules(family, src=src, dst=dst, **cfg)
    data = ckptbridge.rules_to_json(rules)
    assert tuple(ckptbridge.rule_from_json(r) for r in json.loads(json.dumps(data))) == rules
    assert [json.loads(line) for line in recipes.show(rules).splitlines()] == data
    back = recipes.rules(family, src=dst, dst=src, **cfg)
    assert tuple(ckptbridge.invert(rules)) == back
    assert tuple(ckptbridge.invert(back)) == rules


def test_hf_maxtext_hf_is_the_identity_without_reading(llama):
    """Through the recipe and back: the same names, fragments and bytes, without a read (a few
    fragments, none per row; the query's scale and its inverse compose into 1 before any value is
    computed, so unlike a stored conversion's round trip not even the query moves by an ulp)."""
    raw = ckptbridge.open(llama)
    mapped = raw.with_rules(recipes.rules("llama", src="hf", dst="maxtext", **_cfg(llama)))
    q = mapped["decoder/layers/self_attention/query/kernel"]
    assert q.shape == (64, 2, 4, 32) and len(q.fragments) == 2
    back = mapped.with_rules(recipes.rules("llama", src="maxtext", dst="hf", **_cfg(llama)))
    assert raw.stats.bytes_read == 0
    assert sorted(back) == sorted(raw)
    for name in raw:
        assert back[name].shape == raw[name].shape and len(back[name].fragments) == len(raw[name].fragments)
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name


def test_megatron_maxtext_megatron_is_the_identity_for_weights_and_moments():
    raw = ckptbridge.open(A)
    there = recipes.rules("llama", src="megatron", dst="maxtext", **A_CFG)
    mapped = raw.with_rules(there)
    assert mapped["decoder/layers/self_attention/query/kernel"].shape == (64, 4, 4, 16)
    assert mapped["decoder/layers/mlp/wi_0/kernel"].states == ("fp32", "exp_avg", "exp_avg_sq")
    back = mapped.with_rules(recipes.rules("llama", src="maxtext", dst="megatron", **A_CFG))
    assert sorted(back) == sorted(raw) and raw.stats.bytes_read == 0
    for name in raw:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert back[name].state(state).read().tobytes() == raw[name].state(state).read().tobytes(), (name, state)


def test_the_cli_prints_a_recipe_that_reshard_takes(llama, tmp_path, capsys):
    from ckptbridge._cli import main

    assert main(["recipe"]) == 0
    assert "maxtext" in capsys.readouterr().out
    rules_file = tmp_path / "r.json"
    assert main(["recipe", "llama", "hf", "maxtext", "--hf-config", str(llama / "config.json"), "-c", "scan=false",
                 "--out", str(rules_file)]) == 0
    want = recipes.rules("llama", src="hf", dst="maxtext", **{**_cfg(llama), "scan": False})
    assert json.loads(rules_file.read_text()) == ckptbridge.rules_to_json(want)
    out = tmp_path / "mt.safetensors"
    assert main(["reshard", str(llama), str(out), "--to", "safetensors", "--rules", str(rules_file)]) == 0
    got = ckptbridge.open(out)
    ref = ckptbridge.open(llama, rules=want)
    assert sorted(got) == sorted(ref) and "decoder/layers_1/self_attention/query/kernel" in got
    for name in ref:
        assert got[name].read().tobytes() == ref[name].read().tobytes(), name
    assert main(["recipe", "llama", "hf", "maxtext", "-c", "n_heads=four"]) == 2
    assert "expected an integer" in capsys.readouterr().err


def test_megatron_args_and_hf_config_round_trip(llama):
    template = ckptbridge.open(A).extra["megatron"]["args"]
    args = recipes.megatron_args(llama / "config.json", template=template)
    hf_cfg = json.loads((llama / "config.json").read_text())
    assert args["num_query_groups"] == 2 and args["kv_channels"] == 32 and args["group_query_attention"]
    assert args["vocab_size"] == 255 and args["padded_vocab_size"] == 256  # NullTokenizer adds its EOD token
    assert args["seq_length"] == template["seq_length"]  # the rest comes from the template
    back = recipes.hf_config(args, vocab_size=256)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert back[key] == hf_cfg[key], key


# ------------------------------------------------------------------ bad input


def test_unknown_family_pair_or_config_key():
    with pytest.raises(OptionError, match="no recipe family 'gpt'; families: " + ", ".join(recipes.families())):
        recipes.rules("gpt", src="hf", dst="maxtext", **A_CFG)
    with pytest.raises(OptionError, match="no 'hf' -> 'deepspeed' mapping; it maps hf->maxtext"):
        recipes.rules("llama", src="hf", dst="deepspeed", **A_CFG)
    with pytest.raises(OptionError, match="no 'megatron' -> 'hf' mapping"):
        recipes.rules("gemma3", src="megatron", dst="hf", **A_CFG)
    with pytest.raises(OptionError, match=r"unknown config \['n_layers'\]"):
        recipes.rules("llama", src="hf", dst="maxtext", n_layers=2, **A_CFG)
    with pytest.raises(OptionError, match=r"needs \['head_dim'\]"):
        recipes.rules("llama", src="hf", dst="maxtext", n_heads=4, n_kv_heads=2)
    with pytest.raises(OptionError, match="rope must be 'default' or 'llama3.1'"):
        recipes.rules("llama", src="hf", dst="maxtext", rope="yarn", **A_CFG)


def test_head_counts_that_do_not_divide():
    with pytest.raises(OptionError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        recipes.rules("llama", src="hf", dst="maxtext", n_heads=4, n_kv_heads=3, head_dim=16)


@pytest.mark.parametrize("over,expected", [
    ({"n_heads": 8}, "(256, *) (n_heads x head_dim = 8 x 32 rows), found (128, 64)"),
    ({"head_dim": 16}, "(64, *) (n_heads x head_dim = 4 x 16 rows), found (128, 64)"),
])
def test_config_that_does_not_fit_the_checkpoint(llama, over, expected):
    ckpt = ckptbridge.open(llama)
    with pytest.raises(ShapeMismatchError) as err:
        ckpt.with_rules(recipes.rules("llama", src="hf", dst="maxtext", **{**_cfg(llama), **over}))
    msg = str(err.value)
    assert msg.startswith(f"{llama}: tensor 'model.layers.0.self_attn.q_proj.weight': expected shape {expected}"), msg
    assert ckpt.stats.bytes_read == 0


def test_megatron_qkv_that_does_not_fit_the_config():
    ckpt = ckptbridge.open(A)
    with pytest.raises(ShapeMismatchError) as err:
        ckpt.with_rules(recipes.rules("llama", src="megatron", dst="hf", n_heads=4, n_kv_heads=4, head_dim=16))
    assert ("tensor 'decoder.layers.0.self_attention.linear_qkv.weight': expected shape (192, *) (n_kv_heads x "
            "(n_heads / n_kv_heads + 2) x head_dim = 4 x 3 x 16 rows: q, k, v per group), found (128, 64)") in str(err.value)
    assert ckpt.stats.bytes_read == 0


def _drop(src, dst, name):
    """A copy of the HF directory ``src`` without tensor ``name`` (its shard rewritten, the index updated)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_a_missing_tensor_is_named(llama, tmp_path):
    d = _drop(llama, tmp_path / "missing", "model.layers.1.self_attn.k_proj.weight")
    ckpt = ckptbridge.open(d)
    with pytest.raises(TensorNotFoundError) as err:
        ckpt.with_rules(recipes.rules("llama", src="hf", dst="maxtext", **_cfg(d)))
    msg = str(err.value)
    assert "no tensor 'decoder/layers_1/self_attention/key/kernel' (expected shape (64, 2, 32)" in msg, msg
    assert ckpt.stats.bytes_read == 0


def test_a_shape_mismatch_with_the_target_model(llama):
    """Loading onto a model of another shape (here: an embedding width of 32, not 64) names the
    tensor, the target's and the found shape, and reads nothing; so does a tensor the target
    wants and the checkpoint lacks."""
    import jax

    from ckptbridge.adapters import flax as cbflax

    ckpt = ckptbridge.open(llama, rules=recipes.rules("llama", src="hf", dst="maxtext", scan=False, **_cfg(llama)))
    target = {n: jax.ShapeDtypeStruct(t.shape, np.float32) for n, t in ckpt.items()}
    wrong = dict(target, **{"token_embedder/embedding": jax.ShapeDtypeStruct((256, 32), np.float32)})
    with pytest.raises(ShapeMismatchError) as err:
        cbflax.load(ckpt, _nest(wrong))
    assert "tensor 'token_embedder/embedding' has shape (256, 64), the target 'token_embedder/embedding' " \
           "expects (256, 32)" in str(err.value)
    extra = dict(target, **{"decoder/layers_2/mlp/wo/kernel": jax.ShapeDtypeStruct((128, 64), np.float32)})
    with pytest.raises(ckptbridge.FormatError, match="no tensor 'decoder/layers_2/mlp/wo/kernel'"):
        cbflax.load(ckpt, _nest(extra))
    assert ckpt.stats.bytes_read == 0
    got = cbflax.load(ckpt, _nest(target))  # and the right target loads
    assert got["decoder"]["layers_0"]["self_attention"]["query"]["kernel"].shape == (64, 4, 32)


def _nest(flat):
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *head, last = name.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def test_hf_config_refuses_megatron_args_its_family_cannot_say():
    """A Llama config for MLA or MoE args would drop the experts and the latent attention silently."""
    args = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "num_attention_heads": 4,
            "hidden_size": 64, "num_layers": 2, "padded_vocab_size": 256}
    assert recipes.hf_config(args)["model_type"] == "llama"
    for extra in ({"multi_latent_attention": True}, {"num_experts": 4}):
        with pytest.raises(OptionError, match="family 'llama' writes no HF config for multi-latent attention"):
            recipes.hf_config({**args, **extra})

"""The ``gemma3`` recipe proven with transformers' ``Gemma3ForCausalLM`` and MaxText 0.2.5's own Gemma 3.

A tiny random ``Gemma3ForCausalLM`` (GQA 4/2 heads, head_dim 32 != hidden/heads = 16, 8 layers: one
scanned block of Gemma 3's 6-layer pattern and 2 left over, sliding window 4 in 16 tokens, q/k
norms, pre/post attention and feed-forward norms, tied embeddings) opened through
``recipes.rules("gemma3", ...)`` and loaded by ``ckptbridge.adapters.flax.load`` onto MaxText's own
boxed tree on a 2x2 mesh (fsdp x tensor) with its logical-axis shardings:

1. every leaf is bitwise what MaxText's own converter hooks make (``GEMMA3`` in its
   ``param_mapping.py``: norms ``1 + w``, the embedding times bf16(sqrt(hidden))), scanned and not;
2. MaxText's fp32 logits equal HF's (<= 1e-4; MaxText's tied logits use a bfloat16 table, as in
   ``test_recipes_maxtext.py``);
3. back through the inverse recipe: bitwise what MaxText's own export makes (``(w + 1) - 1`` in
   float32, not always ``w``), loading in ``from_pretrained`` with HF's logits;
4. negative controls: without the norm offset, or without the embedding scale, the logits leave
   the tolerance by far; the sliding window matters in these 16 tokens;
5. torch AdamW's moments through the recipe: unchanged by the norm offset, scaled for the embedding.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf
from maxtext_family import SEQ, back, leaves_bitwise, prepare, recipe
from test_recipes_maxtext import _err, _from_pretrained

import ckptbridge
from ckptbridge import Offset, Scale, recipes

pytestmark = pytest.mark.heavy

TOL = 1e-4


def _without(rules: tuple, kind: type) -> tuple:
    return tuple(r for r in rules if not isinstance(r, kind))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = hf.gemma3()
    run = prepare(tmp_path_factory.mktemp("gemma3"), model, lambda cfg: {
        "no_offset": _without(recipe(cfg, True), Offset), "no_embed_scale": _without(recipe(cfg, True), Scale)})
    return {**run, "ref": hf.logits_bf16_table(model, run["tokens"]), "ref_fp32": hf.logits(model, run["tokens"])}


@pytest.mark.parametrize("scan", [True, False], ids=["scan1", "scan0"])
def test_hf_to_maxtext_every_leaf_bitwise_and_logits(run, scan):
    theirs = leaves_bitwise(run["work"], scan)
    if scan:  # one block of 6 stacked on axis 1, the 2 layers left over unstacked
        assert theirs["decoder/layers/layers_5/self_attention/query/kernel"].shape == (64, 1, 4, 32)
        assert theirs["decoder/layers_remainder/layers_1/self_attention/query/kernel"].shape == (64, 4, 32)
    assert _err(np.load(run["work"] / f"scan{int(scan)}.logits.npy"), run["ref"]) < TOL


@pytest.mark.parametrize("scan", [True, False], ids=["scan1", "scan0"])
def test_maxtext_to_hf_through_the_inverse_recipe_is_maxtexts_export(run, scan):
    mine, d = back(run["work"], run["cfg"], scan)  # bitwise MaxText's own export
    orig = ckptbridge.open(run["hf_dir"])
    norm = "model.layers.0.input_layernorm.weight"  # (w + 1) - 1 in float32: not w, within an ulp of 1
    assert mine[norm].tobytes() != orig[norm].read().tobytes()
    assert np.abs(mine[norm] - orig[norm].read()).max() <= np.spacing(np.float32(2.0))
    assert _err(hf.logits(_from_pretrained(d), run["tokens"]), run["ref_fp32"]) < TOL


def test_the_recipe_maps_values_without_reading(run):
    cfg = run["cfg"]
    ckpt = ckptbridge.open(run["hf_dir"], rules=recipe(cfg, True))
    norm = ckpt["decoder/layers/layers_0/pre_self_attention_norm/scale"]
    assert norm.shape == (64, 1) and ckpt.stats.bytes_read == 0
    raw = ckptbridge.open(run["hf_dir"])
    want = raw["model.layers.0.input_layernorm.weight"].read() + np.float32(1.0)
    assert norm.read()[:, 0].tobytes() == want.tobytes()
    emb = ckpt["token_embedder/embedding"].read()
    assert emb.tobytes() == (raw["model.embed_tokens.weight"].read() * np.float32(8.0)).tobytes()


@pytest.mark.parametrize("label", ["no_offset", "no_embed_scale"])
def test_negative_controls_move_the_logits(run, label):
    """Measured: 1.14 (norm offset dropped), 1.12 (embedding scale dropped), against 7.3e-6."""
    err = _err(np.load(run["work"] / f"{label}.logits.npy"), run["ref"])
    assert err > 50 * TOL, (label, err)


def test_the_sliding_window_matters_in_these_tokens(run):
    wide = hf.gemma3(window=SEQ)
    assert _err(hf.logits(wide, run["tokens"]), run["ref_fp32"]) > 50 * TOL


def test_config_and_shape_errors_name_the_tensor(run):
    cfg = run["cfg"]
    assert recipes.family_from_hf(cfg) == "gemma3"
    assert recipes.config_from_hf(cfg) == {"n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "tie_embeddings": True,
                                           "qkv_bias": False, "rope": "default", "n_layers": 8, "hidden": 64}
    with pytest.raises(ckptbridge.OptionError, match="n_layers"):
        recipes.rules("gemma3", src="hf", dst="maxtext", n_heads=4, n_kv_heads=2, head_dim=32, hidden=64)
    bad = {**recipes.config_from_hf(cfg), "head_dim": 16}
    with pytest.raises(ckptbridge.ShapeMismatchError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        ckptbridge.open(run["hf_dir"], rules=recipes.rules("gemma3", src="hf", dst="maxtext", **bad))
    assert dataclasses.is_dataclass(recipes.config_type("gemma3"))


def test_adam_moments_move_with_their_meaning(tmp_path):
    """torch AdamW's state through the recipe: a norm's moments stay (``d(w + 1) = dw``) while its
    weight shifts; the embedding's moments scale by ``1/c`` and ``1/c**2`` (``c = 8``)."""
    from ckptbridge.adapters import torch as cbtorch

    model = hf.gemma3(layers=2)
    _, opt = hf.train_adamw(model, hf.tokens(2, SEQ + 1, 256, seed=2), 1)
    cbtorch.save(tmp_path / "u", model.state_dict(), optimizer=opt, module=model)
    rules = recipes.rules("gemma3", src="hf", dst="maxtext", **{**recipes.config_from_hf(model.config), "scan": False})
    raw, mapped = ckptbridge.open(tmp_path / "u"), ckptbridge.open(tmp_path / "u", rules=rules)
    norm, hf_norm = mapped["decoder/layers_1/post_ffw_norm/scale"], raw["model.layers.1.post_feedforward_layernorm.weight"]
    assert {"exp_avg", "exp_avg_sq"} <= set(norm.states)
    weight = next(s for s in norm.states if s not in ("exp_avg", "exp_avg_sq"))
    assert norm.state(weight).read().tobytes() == (hf_norm.state(weight).read() + np.float32(1.0)).tobytes()
    for state in ("exp_avg", "exp_avg_sq"):
        assert norm.state(state).read().tobytes() == hf_norm.state(state).read().tobytes(), state
        assert np.abs(norm.state(state).read()).max() > 0, state
    emb, hf_emb = mapped["token_embedder/embedding"], raw["model.embed_tokens.weight"]
    for state, factor in (("exp_avg", 0.125), ("exp_avg_sq", 0.125 ** 2)):
        assert emb.state(state).read().tobytes() == (hf_emb.state(state).read() * np.float32(factor)).tobytes()
